//! A SUB socket: one connection to a publisher, or a listener that publishers connect to.

use std::net::SocketAddr;
use std::sync::atomic::{AtomicUsize, Ordering};
use std::sync::Arc;

use tokio::net::{TcpListener, TcpStream};
use tokio::sync::mpsc;
use tokio::task::JoinHandle;

use crate::wire::{Connection, Message};
use crate::{Endpoint, Limits, SocketType, ZmtpError};

/// Messages buffered between the socket's readers and [`SubSocket::recv`]. When it is full the
/// readers stop reading and TCP pushes back on the publisher, which drops at its high-water mark,
/// as a ZeroMQ SUB does.
const QUEUE: usize = 1024;

/// Where a subscriber's messages come from.
#[derive(Debug)]
enum Source {
    /// A connecting socket reads its one connection itself (no task, no channel hop); `None` once
    /// it failed.
    Direct(Option<Connection>),
    /// A binding socket's peers each have a reader task feeding this channel.
    Fanned(mpsc::Receiver<Result<Message, ZmtpError>>),
}

/// A subscriber. Dropping it closes its connections (and its listener).
#[derive(Debug)]
pub struct SubSocket {
    source: Source,
    tasks: Vec<JoinHandle<()>>,
    local: Option<SocketAddr>,
    peers: Arc<AtomicUsize>,
}

impl Drop for SubSocket {
    fn drop(&mut self) {
        for t in &self.tasks {
            t.abort();
        }
    }
}

async fn subscribe(stream: TcpStream, topic: &[u8], limits: Limits) -> Result<Connection, ZmtpError> {
    let mut conn = Connection::handshake(stream, SocketType::Sub, limits).await?;
    let mut subscription = Vec::with_capacity(topic.len() + 1);
    subscription.push(1);
    subscription.extend_from_slice(topic);
    conn.send(&[&subscription]).await?;
    Ok(conn)
}

/// Counts a connected peer for as long as it lives.
struct PeerCount(Arc<AtomicUsize>);

impl PeerCount {
    fn new(peers: &Arc<AtomicUsize>) -> PeerCount {
        peers.fetch_add(1, Ordering::Relaxed);
        PeerCount(peers.clone())
    }
}

impl Drop for PeerCount {
    fn drop(&mut self) {
        self.0.fetch_sub(1, Ordering::Relaxed);
    }
}

/// Forwards a connection's messages until it fails or the socket is dropped; the error is the last
/// item it sends, wrapped by `wrap`.
async fn forward(
    mut conn: Connection,
    tx: mpsc::Sender<Result<Message, ZmtpError>>,
    _counted: PeerCount,
    wrap: impl Fn(ZmtpError) -> ZmtpError,
) {
    loop {
        match conn.recv().await {
            Ok(m) => {
                if tx.send(Ok(m)).await.is_err() {
                    return;
                }
            }
            Err(e) => {
                let _ = tx.send(Err(wrap(e))).await;
                return;
            }
        }
    }
}

impl SubSocket {
    /// Connects to a publisher at `endpoint` and subscribes to messages whose first frame starts
    /// with `topic` (empty: all). Returns once the subscription is sent, so an unreachable or
    /// misbehaving peer is an error here.
    pub async fn connect(endpoint: &str, topic: &[u8], limits: Limits) -> Result<SubSocket, ZmtpError> {
        let addr = Endpoint::parse(endpoint)?.resolve().await?;
        let stream = TcpStream::connect(addr).await?;
        let conn = subscribe(stream, topic, limits).await?;
        Ok(SubSocket {
            source: Source::Direct(Some(conn)),
            tasks: Vec::new(),
            local: None,
            peers: Arc::new(AtomicUsize::new(1)),
        })
    }

    /// Listens on `endpoint` for publishers that connect (vLLM with a `tcp://HOST:PORT` endpoint
    /// connects its PUB socket), subscribing each to `topic`. A peer that fails its handshake or
    /// breaks the framing rules is reported by [`SubSocket::recv`] as [`ZmtpError::Peer`] and
    /// disconnected; the socket goes on listening.
    pub async fn bind(endpoint: &str, topic: &[u8], limits: Limits) -> Result<SubSocket, ZmtpError> {
        let addr = Endpoint::parse(endpoint)?.resolve().await?;
        let listener = TcpListener::bind(addr).await?;
        let local = listener.local_addr()?;
        let (tx, rx) = mpsc::channel(QUEUE);
        let topic = topic.to_vec();
        let peers = Arc::new(AtomicUsize::new(0));
        let connected = peers.clone();
        let refused = tx.clone();
        let task = tokio::spawn(crate::listen::accept_peers(
            listener,
            limits.max_peers,
            move |stream, peer| {
                let (tx, topic, connected) = (tx.clone(), topic.clone(), connected.clone());
                async move {
                    let wrap = move |e| ZmtpError::Peer { peer, source: Box::new(e) };
                    match subscribe(stream, &topic, limits).await {
                        Ok(conn) => forward(conn, tx, PeerCount::new(&connected), wrap).await,
                        Err(e) => {
                            let _ = tx.send(Err(wrap(e))).await;
                        }
                    }
                }
            },
            move |_stream, peer| {
                let refused = refused.clone();
                async move {
                    let why = format!("refused: already {} peers connected", limits.max_peers);
                    let err = ZmtpError::Handshake(why);
                    refused.send(Err(ZmtpError::Peer { peer, source: Box::new(err) })).await.is_ok()
                }
            },
        ));
        Ok(SubSocket { source: Source::Fanned(rx), tasks: vec![task], local: Some(local), peers })
    }

    /// The address a binding socket listens on (useful with port 0).
    pub fn local_addr(&self) -> Option<SocketAddr> {
        self.local
    }

    /// Publishers connected now, past their handshake and subscribed (a connecting socket: 1 until
    /// its connection fails).
    pub fn connected_peers(&self) -> usize {
        self.peers.load(Ordering::Relaxed)
    }

    /// The next message. A connecting socket's error ends it (connect again); a binding socket's
    /// [`ZmtpError::Peer`] errors concern one peer and the socket continues.
    /// Cancel-safe: a message half received when the future is dropped is completed by the next
    /// call.
    pub async fn recv(&mut self) -> Result<Message, ZmtpError> {
        match &mut self.source {
            Source::Fanned(rx) => rx.recv().await.unwrap_or(Err(ZmtpError::Closed)),
            Source::Direct(slot) => {
                let Some(conn) = slot else { return Err(ZmtpError::Closed) };
                let received = conn.recv().await;
                if received.is_err() {
                    *slot = None;
                    self.peers.store(0, Ordering::Relaxed);
                }
                received
            }
        }
    }
}
