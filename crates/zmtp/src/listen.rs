//! The accept loop that binding sockets share.

use std::future::Future;
use std::net::SocketAddr;
use std::time::Duration;

use tokio::net::{TcpListener, TcpStream};

/// Accepts connections on `listener` for ever, serving each with `serve` on its own task. The tasks
/// belong to this loop: aborting it aborts them all. Past `max_peers` at once a connection goes to
/// `refuse` instead, and the loop ends when `refuse` says so (`false`).
pub(crate) async fn accept_peers<S, SF, R, RF>(listener: TcpListener, max_peers: usize, mut serve: S, mut refuse: R)
where
    S: FnMut(TcpStream, SocketAddr) -> SF,
    SF: Future<Output = ()> + Send + 'static,
    R: FnMut(TcpStream, SocketAddr) -> RF,
    RF: Future<Output = bool>,
{
    let mut peers = tokio::task::JoinSet::new();
    loop {
        let accepted = tokio::select! {
            accepted = listener.accept() => accepted,
            Some(_) = peers.join_next(), if !peers.is_empty() => continue,
        };
        let Ok((stream, peer)) = accepted else {
            // Out of descriptors or similar: wait a moment instead of spinning.
            tokio::time::sleep(Duration::from_millis(100)).await;
            continue;
        };
        if peers.len() >= max_peers {
            if !refuse(stream, peer).await {
                return;
            }
            continue;
        }
        peers.spawn(serve(stream, peer));
    }
}
