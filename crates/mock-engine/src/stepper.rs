//! The engine model in real time: one task owns the [`Engine`], runs its steps with their modelled
//! durations (divided by the speed-up), and tells each request's handler about its tokens.

use std::collections::HashMap;
use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::Arc;
use std::time::Duration;

use kvgate_core::RequestId;
use kvgate_engine_model::{Engine, EngineRequest, EventBatch, Flavor};
use kvgate_protocol::telemetry::EngineLoad;
use parking_lot::Mutex;
use tokio::sync::mpsc;

/// What a request's handler hears from the engine.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum TokenEvent {
    /// The first token.
    First,
    /// Another token.
    Token,
    /// Finished: prompt tokens, of which cached, and tokens generated.
    Done {
        /// Prompt tokens.
        prompt_tokens: u64,
        /// Prompt tokens served from the prefix cache.
        cached_tokens: u64,
        /// Tokens generated.
        output_tokens: u64,
    },
    /// The engine dropped the request (restart).
    Failed,
}

/// Commands to the stepper.
#[derive(Debug)]
pub enum Command {
    /// Queue a request.
    Submit(EngineRequest, mpsc::UnboundedSender<TokenEvent>),
    /// Restart the engine process.
    Restart,
    /// Freeze for a while (no steps).
    Stall(Duration),
    /// The client went away: drop the request and free its KV blocks, as vLLM aborts a request
    /// whose connection closed.
    Cancel(RequestId),
}

/// State the HTTP side reads.
#[derive(Debug, Default)]
pub struct Shared {
    /// The latest load report, as SGLang's `/v1/loads` carries it (a superset of vLLM's counts);
    /// the same report the simulator's engines serve.
    pub load: Mutex<EngineLoad>,
    /// Prompt tokens admitted since start.
    pub prompt_tokens: AtomicU64,
    /// Of those, served from the prefix cache.
    pub cached_tokens: AtomicU64,
    /// Deepest waiting queue seen.
    pub max_waiting: AtomicU64,
    /// Requests aborted because their client went away.
    pub cancelled: AtomicU64,
    /// `SubscribeKvEvents` streams open now (gRPC mode).
    pub event_streams: AtomicU64,
    /// Requests finished.
    pub finished: AtomicU64,
    /// When the current engine "process" started, in Unix seconds (`f64` bits): what vLLM reports as
    /// `process_start_time_seconds`; a restart changes it.
    pub started_at_s: AtomicU64,
}

impl Shared {
    /// Fresh state for a process starting now.
    pub fn new() -> Self {
        let s = Shared::default();
        s.mark_started();
        s
    }

    /// Records that the engine "process" (re)started now.
    #[allow(clippy::disallowed_methods)] // the process start time an engine reports is wall-clock time
    pub fn mark_started(&self) {
        let now = std::time::SystemTime::now().duration_since(std::time::UNIX_EPOCH).map_or(0.0, |d| d.as_secs_f64());
        // A restart within the same second still gets a distinct start time.
        let previous = f64::from_bits(self.started_at_s.load(Ordering::Relaxed));
        let now = if now <= previous { previous + 1.0 } else { now };
        self.started_at_s.store(now.to_bits(), Ordering::Relaxed);
    }

    /// The current process start time, Unix seconds.
    pub fn started_at(&self) -> f64 {
        f64::from_bits(self.started_at_s.load(Ordering::Relaxed))
    }
}

/// Runs the engine until the command channel closes.
pub async fn run(
    mut engine: Engine,
    speedup: f64,
    mut commands: mpsc::UnboundedReceiver<Command>,
    batches: mpsc::UnboundedSender<EventBatch>,
    shared: Arc<Shared>,
    clock: kvgate_clock::Clock,
) {
    let mut listeners: HashMap<RequestId, mpsc::UnboundedSender<TokenEvent>> = HashMap::new();
    let mut stalled_until: Option<std::time::Instant> = None;
    // SGLang publishes its start-up clear as the process starts, before anyone subscribes.
    if let Some(b) = engine.flush_idle() {
        let _ = batches.send(b);
    }
    loop {
        // Take every pending command; block for one only when there is nothing to run.
        loop {
            let cmd = if engine.has_work() {
                match commands.try_recv() {
                    Ok(c) => c,
                    Err(mpsc::error::TryRecvError::Empty) => break,
                    Err(mpsc::error::TryRecvError::Disconnected) => return,
                }
            } else {
                // Idle until told otherwise: what it reports must say so (a cancel may have just
                // emptied it).
                publish_load(&engine, &shared);
                match commands.recv().await {
                    Some(c) => c,
                    None => return,
                }
            };
            match cmd {
                Command::Submit(req, tx) => {
                    listeners.insert(req.id, tx);
                    engine.submit(req);
                }
                Command::Restart => {
                    // vLLM's block hashes are deterministic (sha256 from a fixed root since 0.29): a
                    // restarted process reports the same hashes for the same prompts.
                    shared.mark_started();
                    for id in engine.restart() {
                        if let Some(tx) = listeners.remove(&id) {
                            let _ = tx.send(TokenEvent::Failed);
                        }
                    }
                    if let Some(b) = engine.flush_idle() {
                        let _ = batches.send(b);
                    }
                }
                Command::Stall(d) => stalled_until = Some(clock.instant() + d),
                Command::Cancel(id) => cancel(&mut engine, &mut listeners, &shared, id),
            }
        }
        // A stalled engine still queues what arrives (and reports it), but runs no step.
        if let Some(until) = stalled_until {
            if clock.instant() < until {
                publish_load(&engine, &shared);
                let left = until.saturating_duration_since(clock.instant());
                tokio::select! {
                    _ = tokio::time::sleep(left.min(Duration::from_millis(20))) => {}
                    cmd = commands.recv() => match cmd {
                        Some(Command::Submit(req, tx)) => {
                            listeners.insert(req.id, tx);
                            engine.submit(req);
                        }
                        Some(Command::Stall(d)) => stalled_until = Some(clock.instant() + d),
                        Some(Command::Restart) => stalled_until = None,
                        Some(Command::Cancel(id)) => cancel(&mut engine, &mut listeners, &shared, id),
                        None => return,
                    },
                }
                continue;
            }
            stalled_until = None;
        }
        if let Some(b) = engine.flush_idle() {
            let _ = batches.send(b);
        }
        let Some(micros) = engine.begin_step() else {
            publish_load(&engine, &shared);
            continue;
        };
        tokio::time::sleep(Duration::from_secs_f64(micros as f64 / 1e6 / speedup)).await;
        let out = engine.end_step();
        for id in out.first_tokens {
            if let Some(tx) = listeners.get(&id) {
                let _ = tx.send(TokenEvent::First);
            }
        }
        for id in out.decoded {
            if let Some(tx) = listeners.get(&id) {
                let _ = tx.send(TokenEvent::Token);
            }
        }
        for f in out.finished {
            shared.finished.fetch_add(1, Ordering::Relaxed);
            if let Some(tx) = listeners.remove(&f.id) {
                let _ = tx.send(TokenEvent::Done {
                    prompt_tokens: f.prompt_tokens,
                    cached_tokens: f.cached_tokens,
                    output_tokens: f.output_tokens,
                });
            }
        }
        if let Some(b) = out.batch {
            let _ = batches.send(b);
        }
        shared.prompt_tokens.store(engine.prompt_tokens_total, Ordering::Relaxed);
        shared.cached_tokens.store(engine.cached_tokens_total, Ordering::Relaxed);
        publish_load(&engine, &shared);
    }
}

fn cancel(
    engine: &mut Engine,
    listeners: &mut HashMap<RequestId, mpsc::UnboundedSender<TokenEvent>>,
    shared: &Shared,
    id: RequestId,
) {
    listeners.remove(&id);
    if engine.abort(id) {
        shared.cancelled.fetch_add(1, Ordering::Relaxed);
    }
}

fn publish_load(engine: &Engine, shared: &Shared) {
    let load = engine.report(Flavor::Sglang);
    shared.max_waiting.fetch_max(load.waiting_requests, Ordering::Relaxed);
    *shared.load.lock() = load;
}
