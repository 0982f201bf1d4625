//! A PUB socket that binds: subscribers connect and are sent the messages whose first frame starts
//! with one of their subscriptions. kvgate never publishes to engines; the mock engine and the tests
//! that impersonate one do, and they need to know when a subscriber is really listening.

use std::net::SocketAddr;
use std::sync::atomic::{AtomicUsize, Ordering};
use std::sync::{Arc, Mutex, PoisonError};

use bytes::Bytes;
use tokio::net::TcpListener;
use tokio::sync::mpsc;
use tokio::task::JoinHandle;

use crate::wire::{Connection, Message};
use crate::{Endpoint, Limits, SocketType, ZmtpError};

/// Messages queued for one subscriber. Past it the subscriber misses new messages (ZeroMQ's
/// high-water mark) instead of the publisher waiting for it.
const HIGH_WATER_MARK: usize = 1024;

/// One subscriber as the publisher sees it.
struct Peer {
    queue: mpsc::Sender<Message>,
    topics: Arc<Mutex<Vec<Vec<u8>>>>,
}

impl Peer {
    fn wants(&self, topic: &[u8]) -> bool {
        self.topics.lock().unwrap_or_else(PoisonError::into_inner).iter().any(|t| topic.starts_with(t))
    }
}

type Peers = Arc<Mutex<Vec<Peer>>>;

/// A publisher. Dropping it closes its listener and every subscriber's connection.
#[derive(Debug)]
pub struct PubSocket {
    peers: Peers,
    subscribed: Arc<AtomicUsize>,
    local: SocketAddr,
    listener: JoinHandle<()>,
}

impl std::fmt::Debug for Peer {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("Peer").finish_non_exhaustive()
    }
}

impl Drop for PubSocket {
    fn drop(&mut self) {
        self.listener.abort();
    }
}

impl PubSocket {
    /// Listens on `endpoint` (port 0 picks a free one) for subscribers.
    pub async fn bind(endpoint: &str, limits: Limits) -> Result<PubSocket, ZmtpError> {
        let addr = Endpoint::parse(endpoint)?.resolve().await?;
        let listener = TcpListener::bind(addr).await?;
        let local = listener.local_addr()?;
        let peers: Peers = Arc::default();
        let subscribed = Arc::new(AtomicUsize::new(0));
        let (p, s) = (peers.clone(), subscribed.clone());
        let listener = tokio::spawn(crate::listen::accept_peers(
            listener,
            limits.max_peers,
            move |stream, _| {
                let (peers, subscribed) = (p.clone(), s.clone());
                async move {
                    if let Ok(conn) = Connection::handshake(stream, SocketType::Pub, limits).await {
                        serve(conn, &peers, &subscribed).await;
                    }
                }
            },
            |_stream, _| async { true }, // refused: the connection is dropped
        ));
        Ok(PubSocket { peers, subscribed, local, listener })
    }

    /// The address the socket listens on.
    pub fn local_addr(&self) -> SocketAddr {
        self.local
    }

    /// The `tcp://` endpoint subscribers connect to.
    pub fn endpoint(&self) -> String {
        format!("tcp://{}", self.local)
    }

    /// Subscribers connected now that have sent at least one subscription. Once it counts a
    /// subscriber, every message sent after matching its subscriptions reaches it (unless it falls
    /// a whole high-water mark behind): a readiness probe, which ZeroMQ's own PUB lacks.
    pub fn subscribers(&self) -> usize {
        self.subscribed.load(Ordering::Acquire)
    }

    /// Queues `frames` for every subscriber whose subscription its first frame starts with, without
    /// waiting for any of them; returns how many it was queued for.
    pub fn send(&self, frames: Message) -> usize {
        let topic = frames.first().cloned().unwrap_or_default();
        let mut peers = self.peers.lock().unwrap_or_else(PoisonError::into_inner);
        peers.retain(|p| !p.queue.is_closed());
        let mut queued = 0;
        for peer in peers.iter().filter(|p| p.wants(&topic)) {
            if peer.queue.try_send(frames.clone()).is_ok() {
                queued += 1;
            }
        }
        queued
    }
}

/// Counts a subscriber from its first subscription until it has none or goes away.
struct Subscribed<'a> {
    count: &'a AtomicUsize,
    counted: bool,
}

impl Subscribed<'_> {
    fn update(&mut self, has_topics: bool) {
        if has_topics != self.counted {
            self.counted = has_topics;
            if has_topics {
                self.count.fetch_add(1, Ordering::Release);
            } else {
                self.count.fetch_sub(1, Ordering::Release);
            }
        }
    }
}

impl Drop for Subscribed<'_> {
    fn drop(&mut self) {
        self.update(false);
    }
}

/// Applies a ZMTP 3.0 subscription message (`0x01` + topic subscribes, `0x00` + topic cancels);
/// anything else a subscriber sends is ignored, as ZeroMQ's PUB ignores it.
fn apply_subscription(topics: &Mutex<Vec<Vec<u8>>>, message: &[Bytes]) -> bool {
    let mut topics = topics.lock().unwrap_or_else(PoisonError::into_inner);
    if let [frame] = message {
        match frame.split_first() {
            Some((1, topic)) => topics.push(topic.to_vec()),
            Some((0, topic)) => {
                if let Some(i) = topics.iter().position(|t| t == topic) {
                    topics.remove(i);
                }
            }
            _ => {}
        }
    }
    !topics.is_empty()
}

/// Serves one subscriber: reads its subscriptions and writes what is queued for it, until either
/// side fails or the socket is dropped.
async fn serve(mut conn: Connection, peers: &Peers, subscribed: &AtomicUsize) {
    let topics = Arc::new(Mutex::new(Vec::new()));
    let (queue, mut outgoing) = mpsc::channel(HIGH_WATER_MARK);
    peers.lock().unwrap_or_else(PoisonError::into_inner).push(Peer { queue, topics: topics.clone() });
    let mut counted = Subscribed { count: subscribed, counted: false };
    loop {
        tokio::select! {
            received = conn.recv() => match received {
                Ok(message) => counted.update(apply_subscription(&topics, &message)),
                Err(_) => return,
            },
            Some(frames) = outgoing.recv() => {
                let parts: Vec<&[u8]> = frames.iter().map(|f| f.as_ref()).collect();
                if conn.send(&parts).await.is_err() {
                    return;
                }
            }
        }
    }
}
