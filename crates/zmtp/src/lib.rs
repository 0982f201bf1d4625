//! Bounded ZMTP 3.0 client sockets for reading engines' KV events.
//!
//! Engines publish KV events over ZeroMQ (a PUB socket, and a ROUTER for replays). kvgate only
//! reads: a SUB socket that connects to an engine or binds for an engine that connects, and a DEALER
//! that asks a replay socket for history. A binding PUB serves the mock engine and the tests that
//! impersonate an engine, with what ZeroMQ's lacks: a count of subscribers really listening. The peer may be anything that can listen on, or connect
//! to, that port, so every length it announces is checked against [`Limits`] before a byte is
//! buffered: a frame header announcing a terabyte is an error, not an allocation. (The `zeromq`
//! crate reserves whatever a header announces and aborts the process; libzmq's `ZMQ_MAXMSGSIZE`
//! needs a C library kvgate does not otherwise build.)
//!
//! ```text
//! TcpStream ─► greeting (64 bytes, NULL mechanism, version 3.0) ─► READY command both ways
//!          ─► SUB: one subscription message (0x01 + topic) ─► frames (flags, length, body) ─► messages
//! ```
//!
//! Version 3.0 is announced on purpose: libzmq and the `zeromq` crate then expect subscriptions as
//! messages (not 3.1's SUBSCRIBE command) and send no heartbeats. Only the `tcp://` transport and the
//! NULL mechanism are spoken; that is what vLLM and SGLang use for KV events.

#![forbid(unsafe_code)]

mod endpoint;
mod listen;
mod publish;
mod sub;
mod wire;

use std::net::SocketAddr;
use std::time::Duration;

pub use endpoint::Endpoint;
pub use publish::PubSocket;
pub use sub::SubSocket;
#[cfg(fuzzing)]
pub use wire::fuzz_peer_bytes;
pub use wire::{peer_opening, Connection, Message};

/// Bounds on what a peer may make this side hold.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct Limits {
    /// Largest frame accepted (a message's part). Larger announced lengths end the connection.
    pub max_frame_bytes: u64,
    /// Largest message accepted, all its frames together.
    pub max_message_bytes: u64,
    /// Most frames in one message.
    pub max_frames: usize,
    /// Most peers connected at once to a binding socket; more are refused.
    pub max_peers: usize,
    /// How long a peer may take to complete the greeting and handshake.
    pub handshake_timeout: Duration,
}

impl Default for Limits {
    /// 16 MiB per message (a vLLM batch for a 128k-token prompt is under 1 MiB), 16 frames, 64 peers,
    /// 5 s to shake hands.
    fn default() -> Self {
        Limits {
            max_frame_bytes: 16 << 20,
            max_message_bytes: 16 << 20,
            max_frames: 16,
            max_peers: 64,
            handshake_timeout: Duration::from_secs(5),
        }
    }
}

/// The socket types kvgate speaks, and what each may talk to.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum SocketType {
    /// Subscribes to a PUB (or XPUB).
    Sub,
    /// Talks to a ROUTER (or DEALER, REP).
    Dealer,
    /// Publishes to SUBs (or XSUBs); only the mock engine and tests publish.
    Pub,
}

impl SocketType {
    /// The name sent in the READY command.
    pub fn as_str(self) -> &'static str {
        match self {
            SocketType::Sub => "SUB",
            SocketType::Dealer => "DEALER",
            SocketType::Pub => "PUB",
        }
    }

    /// Whether a peer announcing `peer` may talk to this socket type (ZMTP's compatibility table).
    pub fn accepts(self, peer: &str) -> bool {
        let peer = peer.to_ascii_uppercase();
        match self {
            SocketType::Sub => matches!(peer.as_str(), "PUB" | "XPUB"),
            SocketType::Dealer => matches!(peer.as_str(), "ROUTER" | "DEALER" | "REP"),
            SocketType::Pub => matches!(peer.as_str(), "SUB" | "XSUB"),
        }
    }
}

/// What can go wrong talking to a peer.
#[derive(Debug, thiserror::Error)]
#[non_exhaustive]
pub enum ZmtpError {
    /// The endpoint string is not `tcp://HOST:PORT`.
    #[error("bad endpoint `{endpoint}`: {why}")]
    Endpoint {
        /// The endpoint given.
        endpoint: String,
        /// What is wrong with it.
        why: String,
    },
    /// The socket could not connect, bind or read.
    #[error("{0}")]
    Io(#[from] std::io::Error),
    /// The peer closed the connection.
    #[error("the peer closed the connection")]
    Closed,
    /// The peer's greeting is not ZMTP 3 with the NULL mechanism.
    #[error("bad greeting: {0}")]
    Greeting(String),
    /// The READY exchange failed or the peer's socket type cannot talk to ours.
    #[error("bad handshake: {0}")]
    Handshake(String),
    /// The peer did not finish the greeting and handshake in time.
    #[error("handshake timed out after {0:?}")]
    HandshakeTimeout(Duration),
    /// A frame header announced more than [`Limits::max_frame_bytes`].
    #[error("frame of {announced} bytes announced; the limit is {limit}")]
    FrameTooLarge {
        /// The length the header announced.
        announced: u64,
        /// The limit.
        limit: u64,
    },
    /// A message's frames add up to more than [`Limits::max_message_bytes`], or are too many.
    #[error("message too large: {0}")]
    MessageTooLarge(String),
    /// A frame violates the framing rules (reserved flag bits, a command inside a message).
    #[error("bad frame: {0}")]
    Framing(String),
    /// A peer of a binding socket failed; the socket keeps listening for others.
    #[error("peer {peer}: {source}")]
    Peer {
        /// The peer's address.
        peer: SocketAddr,
        /// What it did.
        source: Box<ZmtpError>,
    },
}

impl ZmtpError {
    /// Whether this reports one peer of a binding socket, which goes on listening.
    pub fn is_peer(&self) -> bool {
        matches!(self, ZmtpError::Peer { .. })
    }

    /// Whether the peer sent something a well-behaved engine never sends (as opposed to the
    /// connection failing).
    pub fn is_protocol_violation(&self) -> bool {
        match self {
            ZmtpError::Peer { source, .. } => source.is_protocol_violation(),
            ZmtpError::Greeting(_)
            | ZmtpError::Handshake(_)
            | ZmtpError::FrameTooLarge { .. }
            | ZmtpError::MessageTooLarge(_)
            | ZmtpError::Framing(_) => true,
            _ => false,
        }
    }
}

/// Connects a DEALER to `endpoint`, for request/reply with a ROUTER (a replay socket).
pub async fn connect_dealer(endpoint: &str, limits: Limits) -> Result<Connection, ZmtpError> {
    let addr = Endpoint::parse(endpoint)?.resolve().await?;
    let stream = tokio::net::TcpStream::connect(addr).await?;
    Connection::handshake(stream, SocketType::Dealer, limits).await
}
