//! The accept loop: connections capped by the descriptors the process has, shed when idle under
//! pressure, header timeouts, graceful drain.
//!
//! `axum::serve` has no header timeout and no connection cap: idle or dribbling sockets could hold
//! every file descriptor and a half-sent request could hold shutdown for its whole grace period. So
//! each connection is served by hyper directly, with a header timeout (which also closes kept-alive
//! connections left idle), and tracked in a [`connections::ConnectionTable`] that knows whether it
//! is in a request. At the cap, the oldest connection not in a request is closed to make room for
//! a new one, and the timeout shrinks as the table fills; connections in a request are never
//! closed.

mod connections;

use std::future::Future;
use std::pin::Pin;
use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::Arc;
use std::task::{Context, Poll};
use std::time::Duration;

use axum::body::Body;
use hyper::body::{Frame, SizeHint};
use hyper_util::rt::{TokioIo, TokioTimer};
use hyper_util::service::TowerToHyperService;
use parking_lot::Mutex;
use tokio::net::TcpListener;
use tokio::sync::{watch, Notify};

use crate::clock::Clock;
use crate::metrics::connections::{ConnectionMetrics, SHED_BY_DRAIN, SHED_BY_PRESSURE_TIMEOUT, SHED_FOR_ROOM};
use crate::state::AppState;
use crate::GatewayError;
use connections::{ConnectionId, ConnectionTable, Shed};

pub use connections::{connection_cap, fd_limit_for, fd_reserve};

/// Connections the kernel completes and queues for the gateway to accept. Tokio's default (1024) is
/// soon full when a flood arrives faster than the gateway closes idle sockets to make room, and a
/// client whose handshake finds it full waits a whole SYN retransmission (1 s). The kernel caps it
/// at `net.core.somaxconn` (4096 by default since Linux 5.4).
const LISTEN_BACKLOG: u32 = 4096;

/// Listens on `addr` (`host:port`, the first of its addresses that binds) with a backlog of
/// [`LISTEN_BACKLOG`].
pub async fn listen(addr: &str) -> std::io::Result<TcpListener> {
    let mut last = None;
    for resolved in tokio::net::lookup_host(addr).await? {
        let socket =
            if resolved.is_ipv4() { tokio::net::TcpSocket::new_v4()? } else { tokio::net::TcpSocket::new_v6()? };
        // As std and Tokio do on Unix: a restarted gateway can bind while old connections linger.
        #[cfg(unix)]
        socket.set_reuseaddr(true)?;
        match socket.bind(resolved).and_then(|()| socket.listen(LISTEN_BACKLOG)) {
            Ok(listener) => return Ok(listener),
            Err(e) => last = Some(e),
        }
    }
    Err(last.unwrap_or_else(|| {
        std::io::Error::new(std::io::ErrorKind::InvalidInput, format!("{addr} resolves to no address"))
    }))
}

/// Pause after an accept error (out of descriptors): the error would repeat at once.
const ACCEPT_BACKOFF: Duration = Duration::from_millis(50);

/// How often the shortened timeout is enforced while under pressure.
const PRESSURE_TICK: Duration = Duration::from_millis(50);

/// What the accept loop and a connection's task share about it.
#[derive(Debug, Default)]
struct Slot {
    /// Woken when the connection is chosen to be closed.
    shed: Notify,
    /// Set before `shed` is woken: whether the connection has answered a request, so it has
    /// something to flush and is closed gracefully rather than dropped.
    shed_served: AtomicBool,
    /// Whether a read that found the socket dry was reported since the connection last finished a
    /// request: one report per wait is enough.
    starved_reported: AtomicBool,
}

/// The connection table and what the tasks around it wait on.
struct Connections {
    table: Mutex<ConnectionTable<Arc<Slot>>>,
    /// Woken when a connection closes or leaves a request: room may have been made.
    changed: Notify,
    metrics: Arc<crate::metrics::Metrics>,
    clock: Clock,
}

impl Connections {
    fn metrics(&self) -> &ConnectionMetrics {
        &self.metrics.connections
    }

    /// Tells the chosen connections' tasks to close them.
    fn shed(&self, shed: Vec<Shed<Arc<Slot>>>, reason: &str) {
        for s in shed {
            self.metrics().count_shed(reason);
            s.signal.shed_served.store(s.served, Ordering::Relaxed);
            s.signal.shed.notify_one();
        }
    }

    /// Publishes the gauges that follow the table.
    fn observe(&self, table: &ConnectionTable<Arc<Slot>>) {
        self.metrics().open.set(table.len() as i64);
        self.metrics().header_timeout_seconds.set(table.header_timeout().as_secs_f64());
    }

    /// Waits until a connection may be accepted: room under the cap, or a starved one to shed.
    async fn until_acceptable(&self) {
        loop {
            let notified = self.changed.notified();
            let mut notified = std::pin::pin!(notified);
            notified.as_mut().enable();
            let room_at = {
                let table = self.table.lock();
                if table.may_accept(self.clock.instant()) {
                    return;
                }
                table.room_at()
            };
            match room_at {
                Some(at) => {
                    tokio::select! {
                        () = notified => {}
                        () = tokio::time::sleep_until(at.into()) => {}
                    }
                }
                None => notified.await,
            }
        }
    }

    /// Waits until no connection is open.
    async fn until_empty(&self) {
        loop {
            let notified = self.changed.notified();
            let mut notified = std::pin::pin!(notified);
            notified.as_mut().enable();
            if self.table.lock().is_empty() {
                return;
            }
            notified.await;
        }
    }

    fn close(&self, id: ConnectionId) {
        let mut table = self.table.lock();
        table.close(id);
        self.observe(&table);
        drop(table);
        self.changed.notify_waiters();
    }

    /// The request on `id` ended: it waits for its next one, not yet starved.
    fn end_request(&self, id: ConnectionId, slot: &Slot) {
        let now = self.clock.instant();
        let mut table = self.table.lock();
        table.end_request(id, now);
        // Under the lock: a dry read from now on is reported, and lands after the change above.
        slot.starved_reported.store(false, Ordering::Relaxed);
        drop(table);
        self.changed.notify_waiters();
    }

    /// A read of `id`'s socket found it dry while the connection waits for a request.
    fn starved(&self, id: ConnectionId) {
        self.table.lock().mark_starved(id);
        self.changed.notify_waiters();
    }

    /// Closes, oldest first, the connections that waited longer than the timeout shortened by
    /// pressure; runs until the server stops. Without pressure hyper's own header timeout is the
    /// configured one, and the task sleeps until the table changes.
    async fn enforce_pressure_timeouts(self: Arc<Self>) {
        let mut tick = tokio::time::interval(PRESSURE_TICK);
        tick.set_missed_tick_behavior(tokio::time::MissedTickBehavior::Delay);
        loop {
            let notified = self.changed.notified();
            let mut notified = std::pin::pin!(notified);
            notified.as_mut().enable();
            if !self.table.lock().under_pressure() {
                notified.await;
                continue;
            }
            tick.tick().await;
            let now = self.clock.instant();
            let shed = {
                let mut table = self.table.lock();
                let shed = table.shed_expired(now);
                self.observe(&table);
                shed
            };
            self.shed(shed, SHED_BY_PRESSURE_TIMEOUT);
        }
    }
}

/// A response body that tells the connection table when the response has ended (all of it was
/// handed to hyper, or the response was dropped).
struct TrackedBody {
    inner: Body,
    end: Option<RequestEnd>,
}

/// Marks the request on a connection as ended when dropped.
struct RequestEnd {
    connections: Arc<Connections>,
    id: ConnectionId,
    slot: Arc<Slot>,
}

impl Drop for RequestEnd {
    fn drop(&mut self) {
        self.connections.end_request(self.id, &self.slot);
    }
}

/// A client socket that reports when a read finds it dry: the client has sent nothing more, so
/// the connection, if it waits for a request, is starved (see [`connections`]).
struct TrackedIo {
    inner: TokioIo<tokio::net::TcpStream>,
    connections: Arc<Connections>,
    id: ConnectionId,
    slot: Arc<Slot>,
}

impl hyper::rt::Read for TrackedIo {
    fn poll_read(
        mut self: Pin<&mut Self>,
        cx: &mut Context<'_>,
        buf: hyper::rt::ReadBufCursor<'_>,
    ) -> Poll<std::io::Result<()>> {
        let polled = Pin::new(&mut self.inner).poll_read(cx, buf);
        if polled.is_pending() && !self.slot.starved_reported.swap(true, Ordering::Relaxed) {
            self.connections.starved(self.id);
        }
        polled
    }
}

impl hyper::rt::Write for TrackedIo {
    fn poll_write(mut self: Pin<&mut Self>, cx: &mut Context<'_>, buf: &[u8]) -> Poll<std::io::Result<usize>> {
        Pin::new(&mut self.inner).poll_write(cx, buf)
    }

    fn poll_flush(mut self: Pin<&mut Self>, cx: &mut Context<'_>) -> Poll<std::io::Result<()>> {
        Pin::new(&mut self.inner).poll_flush(cx)
    }

    fn poll_shutdown(mut self: Pin<&mut Self>, cx: &mut Context<'_>) -> Poll<std::io::Result<()>> {
        Pin::new(&mut self.inner).poll_shutdown(cx)
    }

    fn is_write_vectored(&self) -> bool {
        self.inner.is_write_vectored()
    }

    fn poll_write_vectored(
        mut self: Pin<&mut Self>,
        cx: &mut Context<'_>,
        bufs: &[std::io::IoSlice<'_>],
    ) -> Poll<std::io::Result<usize>> {
        Pin::new(&mut self.inner).poll_write_vectored(cx, bufs)
    }
}

impl hyper::body::Body for TrackedBody {
    type Data = axum::body::Bytes;
    type Error = axum::Error;

    fn poll_frame(
        mut self: Pin<&mut Self>,
        cx: &mut Context<'_>,
    ) -> Poll<Option<Result<Frame<Self::Data>, Self::Error>>> {
        let polled = Pin::new(&mut self.inner).poll_frame(cx);
        if matches!(polled, Poll::Ready(None) | Poll::Ready(Some(Err(_)))) {
            self.end = None;
        }
        polled
    }

    fn is_end_stream(&self) -> bool {
        self.inner.is_end_stream()
    }

    fn size_hint(&self) -> SizeHint {
        self.inner.size_hint()
    }
}

/// The answer to a request that arrives on a connection already chosen to be closed: it was never
/// started, so the client may send it again.
fn refused_on_shed_connection() -> hyper::Response<TrackedBody> {
    let body = r#"{"error":{"message":"the gateway is closing this connection to stay within its file descriptors; send the request again","type":"server_error","code":"connection_shed"}}"#;
    let mut response = hyper::Response::new(TrackedBody { inner: Body::from(body), end: None });
    *response.status_mut() = hyper::StatusCode::SERVICE_UNAVAILABLE;
    let headers = response.headers_mut();
    headers.insert(hyper::header::CONTENT_TYPE, hyper::header::HeaderValue::from_static("application/json"));
    headers.insert(hyper::header::CONNECTION, hyper::header::HeaderValue::from_static("close"));
    response
}

/// The soft file descriptor limit, where the platform has one.
fn fd_limit() -> Option<u64> {
    #[cfg(unix)]
    {
        rlimit::getrlimit(rlimit::Resource::NOFILE).ok().map(|(soft, _)| soft)
    }
    #[cfg(not(unix))]
    {
        None
    }
}

/// Serves `app` on `listener` until `shutdown` resolves, then stops accepting, closes connections
/// not in a request, lets the others finish for up to the grace period, and returns.
pub(crate) async fn run(
    listener: TcpListener,
    state: &Arc<AppState>,
    app: axum::Router,
    shutdown: impl Future<Output = ()> + Send + 'static,
) -> Result<(), GatewayError> {
    let limits = state.config.limits;
    let fd_limit = fd_limit();
    let cap = connection_cap(limits.max_connections, fd_limit);
    if cap < limits.max_connections {
        tracing::info!(
            cap,
            max_connections = limits.max_connections,
            fd_limit,
            "client connections capped below max_connections by the file descriptor limit: each may need two descriptors, and some are kept for engines and the bus"
        );
    } else {
        tracing::debug!(cap, fd_limit, "client connection cap");
    }
    let connections = Arc::new(Connections {
        table: Mutex::new(ConnectionTable::new(cap, limits.header_timeout, limits.header_timeout_min)),
        changed: Notify::new(),
        metrics: state.metrics.clone(),
        clock: state.clock,
    });
    connections.metrics().cap.set(cap as i64);
    connections.observe(&connections.table.lock());
    let pressure = tokio::spawn(connections.clone().enforce_pressure_timeouts());
    let (drain_tx, drain_rx) = watch::channel(false);
    let mut http = hyper::server::conn::http1::Builder::new();
    http.timer(TokioTimer::new()).header_read_timeout(limits.header_timeout).keep_alive(true);
    let mut shutdown = std::pin::pin!(shutdown);
    let mut accept_errors = 0u64;
    loop {
        tokio::select! {
            () = connections.until_acceptable() => {}
            () = &mut shutdown => break,
        }
        let (tcp, _peer) = tokio::select! {
            accepted = listener.accept() => match accepted {
                Ok(a) => a,
                Err(e) => {
                    accept_errors += 1;
                    if accept_errors.is_power_of_two() {
                        tracing::error!(error = %e, errors = accept_errors, "cannot accept a connection (out of file descriptors?)");
                    }
                    tokio::time::sleep(ACCEPT_BACKOFF).await;
                    continue;
                }
            },
            () = &mut shutdown => break,
        };
        // Streams are many small writes: without TCP_NODELAY, Nagle's algorithm and delayed ACKs add
        // tens of milliseconds to the first token.
        if let Err(e) = tcp.set_nodelay(true) {
            tracing::debug!(error = %e, "cannot set TCP_NODELAY");
        }
        let slot = Arc::new(Slot::default());
        let (id, made_room) = {
            let mut table = connections.table.lock();
            let opened = table.open(connections.clock.instant(), slot.clone());
            connections.observe(&table);
            if table.under_pressure() {
                // Wakes the task that enforces the shortened timeout.
                connections.changed.notify_waiters();
            }
            opened
        };
        connections.metrics().accepted.inc();
        connections.shed(made_room.into_iter().collect(), SHED_FOR_ROOM);
        let io = TrackedIo { inner: TokioIo::new(tcp), connections: connections.clone(), id, slot: slot.clone() };
        tokio::spawn(serve_connection(http.clone(), io, app.clone(), connections.clone(), id, slot, drain_rx.clone()));
    }
    drop(listener);
    tracing::info!("shutting down: no new connections; draining in-flight requests");
    let _ = drain_tx.send(true);
    let idle = connections.table.lock().shed_all_waiting();
    connections.shed(idle, SHED_BY_DRAIN);
    let grace = state.config.shutdown_grace;
    tokio::select! {
        () = connections.until_empty() => {}
        () = tokio::time::sleep(grace) => {
            tracing::warn!(grace_s = grace.as_secs_f64(), "shutdown grace period over; dropping remaining streams");
        }
    }
    pressure.abort();
    Ok(())
}

/// Serves one client connection until it ends, is shed, or is drained.
async fn serve_connection(
    http: hyper::server::conn::http1::Builder,
    io: TrackedIo,
    app: axum::Router,
    connections: Arc<Connections>,
    id: ConnectionId,
    slot: Arc<Slot>,
    mut drain: watch::Receiver<bool>,
) {
    let tracked = connections.clone();
    let app = TowerToHyperService::new(app);
    let request_slot = slot.clone();
    let service = hyper::service::service_fn(move |request: hyper::Request<hyper::body::Incoming>| {
        let started = tracked.table.lock().begin_request(id);
        let app = app.clone();
        let tracked = tracked.clone();
        let slot = request_slot.clone();
        async move {
            if !started {
                return Ok::<_, std::convert::Infallible>(refused_on_shed_connection());
            }
            let end = RequestEnd { connections: tracked, id, slot };
            let response = hyper::service::Service::call(&app, request).await?;
            Ok(response.map(|inner| TrackedBody { inner, end: Some(end) }))
        }
    });
    let conn = http.serve_connection(io, service);
    let mut conn = std::pin::pin!(conn);
    let mut shedding = false;
    let mut draining = *drain.borrow();
    if draining {
        conn.as_mut().graceful_shutdown();
    }
    loop {
        tokio::select! {
            ended = conn.as_mut() => {
                if let Err(e) = ended {
                    tracing::debug!(error = %e, "client connection ended with an error");
                }
                break;
            }
            () = slot.shed.notified(), if !shedding => {
                shedding = true;
                // A connection that never answered has nothing to flush: drop it. One kept alive
                // after a response is closed by hyper, after whatever it still writes.
                if !slot.shed_served.load(Ordering::Relaxed) {
                    break;
                }
                conn.as_mut().graceful_shutdown();
            }
            changed = drain.changed(), if !draining => {
                draining = true;
                if changed.is_ok() {
                    conn.as_mut().graceful_shutdown();
                }
            }
        }
    }
    connections.close(id);
}
