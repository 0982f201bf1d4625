//! The discrete-event loop: engines, the modelled telemetry and KV-event paths, faults, and one
//! routing policy, in logical time.

use std::sync::Arc;
use std::time::Duration;

use kvgate_core::kv_stream::{BatchMark, LiveAction, StreamTracker};
use kvgate_core::policy::projected::{self, WorkerLoad};
use kvgate_core::telemetry::{snapshot_from_report, CountAssumptions};
use kvgate_core::{BlockHasher, BlockKey, KvState, Namespace, PolicyConfig, RequestId, Timestamp};
use kvgate_engine_model::{Engine, EngineProfile, EngineRequest, EventBatch, Flavor, HostDelay, StepOutcome};
use kvgate_protocol::KvEvent;
use rand::{Rng, SeedableRng};
use rand_chacha::ChaCha8Rng;
use rand_distr::StandardNormal;
use rustc_hash::FxHashMap;

use crate::bus::{BusMessage, BusModel};
use crate::faults::Fault;
use crate::policy::{self, FleetInfo, PolicyRequest, PolicySpec, SimPolicy, WorkerView};
use crate::report::{Outcome, Recorder, Report};
use crate::workload::{After, SimRequest, Workload};
use crate::SimError;

/// Everything a run needs besides the workload.
#[derive(Debug, Clone)]
pub struct SimConfig {
    /// Engine profile of every engine.
    pub profile: EngineProfile,
    /// The routing policy.
    pub policy: PolicySpec,
    /// Knobs of the projected policy (its name and mode are taken from `policy`).
    pub knobs: PolicyConfig,
    /// Seed of every random choice in the run.
    pub seed: u64,
    /// How often the router polls each engine's load.
    pub poll_interval: Duration,
    /// Normal delivery delay of a KV batch from engine to router.
    pub kv_delay: Duration,
    /// Time for a replay request to be answered.
    pub replay_delay: Duration,
    /// Batches each engine keeps for replay (`buffer_steps`; engines default to 10,000, the simulator
    /// keeps fewer because a replay is answered within milliseconds and batches carry token ids).
    pub replay_buffer: usize,
    /// Time for health checks to notice an engine going away or coming back.
    pub health_detect: Duration,
    /// Router admission: reject when the chosen engine's projected wait (its reported queue plus what
    /// was sent since, over its prefill rate, plus its decode backlog) exceeds this; 0 disables.
    pub admission_wait_s: f64,
    /// Injected faults.
    pub faults: Vec<Fault>,
    /// The load report every engine serves and the router polls: vLLM's counts or SGLang's
    /// `/v1/loads` (default: the profile's engine), converted by the gateway's own function. Only
    /// the `oracle` policy reads the engines' exact state.
    pub telemetry: Flavor,
    /// What the router takes a count-only report (vLLM's) to mean in tokens, as `kvgate serve`'s
    /// `[telemetry]` `assumed_prompt_tokens` and `assumed_decode_tokens`.
    pub count_assumptions: CountAssumptions,
    /// Engine 0's throughputs as configured in the router over its real ones (1: configured right;
    /// 3: the router is told it is 3× faster than it is), for calibration experiments.
    pub misconfigured_rate_scale: f64,
    /// Router replicas behind one Service, each with its own reservations and view (requests are
    /// spread over them at random).
    pub replicas: usize,
    /// How replicas share reservations: `None`, not at all (each sees only its own); `Some`, over a
    /// modelled NATS bus as `kvgate serve` does with `[replicas]`.
    pub replica_sync: Option<BusModel>,
    /// Extra time after the last arrival before the run stops and counts what is left as unfinished.
    pub drain: Duration,
    /// Sample per-engine queue depth at this interval for plots (`None`: don't).
    pub timeline: Option<Duration>,
    /// List every measured request in the report ([`crate::Report::per_request`]).
    pub per_request: bool,
}

impl SimConfig {
    /// Defaults for `policy` on engines of `profile`.
    pub fn new(profile: EngineProfile, policy: PolicySpec, seed: u64) -> Self {
        SimConfig {
            telemetry: profile.flavor,
            count_assumptions: CountAssumptions::default(),
            profile,
            policy,
            knobs: PolicyConfig::default(),
            seed,
            poll_interval: Duration::from_millis(200),
            kv_delay: Duration::from_millis(5),
            replay_delay: Duration::from_millis(20),
            replay_buffer: 256,
            health_detect: Duration::from_secs(1),
            admission_wait_s: 30.0,
            misconfigured_rate_scale: 1.0,
            replicas: 1,
            replica_sync: None,
            faults: Vec::new(),
            drain: Duration::from_secs(900),
            timeline: None,
            per_request: false,
        }
    }
}

#[derive(Debug)]
enum Ev {
    Arrival(usize),
    /// A request staggered by its replica is decided (see [`BusModel::stagger`]).
    Decide {
        request: usize,
        replica: usize,
    },
    StepEnd(usize, u64),
    /// An engine's host has spent its gap after a step and plans the next one.
    StepStart(usize, u64),
    /// A request reaches engine `w`'s scheduler after the host's intake (process generation given).
    Intake(usize, u64, EngineRequest),
    Poll(usize),
    /// A batch reaches the router, with the time the engine published it.
    Deliver(usize, EventBatch, Timestamp),
    ReplayReply(usize, u64),
    Disconnect(usize, Duration),
    Reconnect(usize),
    Health(usize, bool),
    Restart(usize),
    Sample,
    /// Replica `r` publishes its queued reservation changes.
    BusFlush(usize),
    /// Every sharing replica publishes its whole state.
    BusState,
    /// Replica `to` applies a message from replica `from`.
    BusDeliver {
        to: usize,
        from: usize,
        message: BusMessage,
    },
}

struct Host {
    engine: Engine,
    /// Process generation: step-end events of an earlier process are ignored.
    epoch: u64,
    stepping: bool,
    connected: bool,
    tracker: StreamTracker<Vec<KvEvent>>,
    polls_fail_from: Option<Timestamp>,
    polls_fail_until: Option<Timestamp>,
    max_waiting: u64,
    /// Restarted, and no batch of the new process applied yet.
    awaiting_new_events: bool,
    /// When the last live batch was scheduled to reach the router.
    last_delivery: Timestamp,
    /// Requests sent to the engine that its scheduler has not taken yet ([`EngineProfile::intake`]),
    /// with their prompt tokens.
    in_intake: Vec<(RequestId, u64)>,
    /// When the host's intake is done with the last request sent to it: it takes one at a time.
    intake_free_at: Timestamp,
}

struct InFlight {
    worker: usize,
    request: usize,
    replica: usize,
}

/// One router replica: its own policy state (reservations, trees) and its own view of the engines.
/// Every replica polls every engine and subscribes to every event stream (ZMQ PUB fans out).
struct Replica {
    policy: Box<dyn SimPolicy>,
    view: Vec<WorkerView>,
    /// Its name on the bus.
    id: kvgate_core::ReplicaId,
    /// Whether it shares its reservations (a bus is modelled and its policy keeps reservations).
    shares: bool,
    /// When the flush of its changes is scheduled (an earlier deadline supersedes it).
    flush_at: Option<Timestamp>,
}

/// Mixed into the seed for the staggers' randomness.
const STAGGER_STREAM: u64 = 0x5374_6167_6765_7221;
/// Mixed into the seed for the engines' gaps between steps.
const STEP_GAP_STREAM: u64 = 0x4761_7073_4265_7477;
/// Mixed into the seed for the engines' intake delays.
const INTAKE_STREAM: u64 = 0x496e_7461_6b65_4465;
/// Mixed into the seed for the ways to and from the engines (dispatch and delivery).
const TRAVEL_STREAM: u64 = 0x5472_6176_656c_5761;

/// One simulation run.
pub struct Simulation<'w> {
    workload: &'w Workload,
    cfg: SimConfig,
    replicas: Vec<Replica>,
    hosts: Vec<Host>,
    queue: crate::queue::EventQueue<Ev>,
    rng: ChaCha8Rng,
    /// The staggers' own randomness, so that a run whose replicas never stagger draws exactly what
    /// it drew before staggering existed.
    stagger_rng: ChaCha8Rng,
    /// The step gaps' own randomness, for the same reason.
    step_gap_rng: ChaCha8Rng,
    /// The intake delays' own randomness, for the same reason.
    intake_rng: ChaCha8Rng,
    /// The dispatch and delivery delays' own randomness, for the same reason.
    travel_rng: ChaCha8Rng,
    hasher: BlockHasher,
    in_flight: FxHashMap<RequestId, InFlight>,
    rec: Recorder,
    kv_extra: Duration,
    kv_jitter: Duration,
    kv_loss: f64,
    replay: bool,
    fleet_block: usize,
    next_background: u64,
    /// The closed loop: who waits for what ([`crate::workload::After`]).
    closed: ClosedLoop,
}

/// Requests sent when earlier ones end ([`crate::workload::After`]), and the latest arrival so far.
#[derive(Debug, Default)]
struct ClosedLoop {
    /// Requests to send when the request of the key ends: (request, gap).
    followers: FxHashMap<usize, Vec<(usize, Duration)>>,
    /// Requests to send once every request listed before `.0` ended: (index, request, gap).
    barriers: Vec<(usize, usize, Duration)>,
    /// Which requests ended (completed, failed or rejected; background ones at once).
    ended: Vec<bool>,
    /// Requests `0..ended_prefix` all ended.
    ended_prefix: usize,
    /// The latest arrival scheduled so far.
    last_arrival: Timestamp,
}

const BACKGROUND_IDS: u64 = 1 << 62;

impl<'w> Simulation<'w> {
    /// Prepares a run of `workload` under `cfg`.
    pub fn new(workload: &'w Workload, cfg: SimConfig) -> Result<Self, SimError> {
        if workload.workers == 0 {
            return Err(SimError::Config("the fleet needs at least one engine".into()));
        }
        let p = &cfg.profile;
        let fleet = FleetInfo {
            workers: workload.workers,
            block_size: p.block_size,
            prefill_tokens_per_s: p.prefill_tokens_per_s,
            decode_tokens_per_s: p.decode_tokens_per_s(p.max_running as u64, 4096),
            first_worker_rate_scale: cfg.misconfigured_rate_scale,
            kv_capacity_tokens: p.kv_capacity_tokens,
            max_running_requests: u64::from(p.max_running),
            chunk_tokens: u64::from(p.chunk_budget),
        };
        let view = vec![WorkerView { healthy: true, ..WorkerView::default() }; workload.workers];
        if cfg.replicas == 0 || cfg.replicas > 64 {
            return Err(SimError::Config(format!("replicas must be between 1 and 64, got {}", cfg.replicas)));
        }
        if !(cfg.misconfigured_rate_scale.is_finite() && cfg.misconfigured_rate_scale > 0.0) {
            return Err(SimError::Config(format!(
                "misconfigured_rate_scale must be a positive number, got {}",
                cfg.misconfigured_rate_scale
            )));
        }
        if let Some(bus) = &cfg.replica_sync {
            bus.validate().map_err(SimError::Config)?;
        }
        p.check_scheduling().map_err(|e| SimError::Config(format!("the engine profile: {e}")))?;
        let replicas = (0..cfg.replicas)
            .map(|r| {
                let mut policy = policy::build(&cfg.policy, &fleet, &cfg.knobs)?;
                let shares =
                    cfg.replicas > 1 && cfg.replica_sync.is_some_and(|bus| policy.share_reservations(bus.windows()));
                let id = kvgate_core::ReplicaId::new(format!("replica{r}"));
                Ok(Replica { policy, view: view.clone(), id, shares, flush_at: None })
            })
            .collect::<Result<Vec<_>, SimError>>()?;
        let mut rng = ChaCha8Rng::seed_from_u64(cfg.seed);
        let hosts = (0..workload.workers)
            .map(|_| Host {
                engine: Engine::new(cfg.profile.clone(), rng.random()).with_replay_buffer(cfg.replay_buffer),
                epoch: 0,
                stepping: false,
                connected: true,
                tracker: StreamTracker::new(),
                polls_fail_from: None,
                polls_fail_until: None,
                max_waiting: 0,
                awaiting_new_events: false,
                last_delivery: Timestamp::ZERO,
                in_intake: Vec::new(),
                intake_free_at: Timestamp::ZERO,
            })
            .collect();
        let (mut kv_extra, mut kv_jitter, mut kv_loss, mut replay) = (Duration::ZERO, Duration::ZERO, 0.0, true);
        for f in &cfg.faults {
            match *f {
                Fault::KvDelay { extra, jitter } => {
                    kv_extra = extra;
                    kv_jitter = jitter;
                }
                Fault::KvLoss { probability, replay: r } => {
                    if !(0.0..=1.0).contains(&probability) {
                        return Err(SimError::Config(format!("kv loss probability {probability} is not in 0..1")));
                    }
                    kv_loss = probability;
                    replay = r;
                }
                Fault::Disconnect { worker, .. }
                | Fault::Restart { worker, .. }
                | Fault::StaleTelemetry { worker, .. }
                    if worker >= workload.workers =>
                {
                    return Err(SimError::Config(format!(
                        "fault targets engine {worker}, the fleet has {}",
                        workload.workers
                    )));
                }
                _ => {}
            }
        }
        let rec = Recorder::new(workload, &cfg.policy, cfg.seed).keeping_requests(cfg.per_request);
        Ok(Simulation {
            fleet_block: p.block_size as usize,
            workload,
            replicas,
            hosts,
            queue: crate::queue::EventQueue::default(),
            rng,
            stagger_rng: ChaCha8Rng::seed_from_u64(cfg.seed ^ STAGGER_STREAM),
            step_gap_rng: ChaCha8Rng::seed_from_u64(cfg.seed ^ STEP_GAP_STREAM),
            intake_rng: ChaCha8Rng::seed_from_u64(cfg.seed ^ INTAKE_STREAM),
            travel_rng: ChaCha8Rng::seed_from_u64(cfg.seed ^ TRAVEL_STREAM),
            hasher: BlockHasher::new(),
            in_flight: FxHashMap::default(),
            rec,
            kv_extra,
            kv_jitter,
            kv_loss,
            replay,
            next_background: BACKGROUND_IDS,
            closed: ClosedLoop { ended: vec![false; workload.requests.len()], ..ClosedLoop::default() },
            cfg,
        })
    }

    /// Runs to completion (or to the drain limit) and reports.
    pub fn run(mut self) -> Report {
        for (i, r) in self.workload.requests.iter().enumerate() {
            match r.after {
                None => {
                    self.queue.push(r.arrival, Ev::Arrival(i));
                    self.closed.last_arrival = self.closed.last_arrival.max(r.arrival);
                }
                Some(After::Request { index, gap }) => self.closed.followers.entry(index).or_default().push((i, gap)),
                Some(After::AllBefore { index, gap }) => self.closed.barriers.push((index, i, gap)),
            }
        }
        // A burst waiting for nothing before it goes at once.
        self.release_barriers(Timestamp::ZERO);
        for w in 0..self.hosts.len() {
            self.queue.push(Timestamp::ZERO, Ev::Poll(w));
            if let Some(batch) = self.hosts[w].engine.flush_idle() {
                self.send_batch(w, batch, Timestamp::ZERO);
            }
        }
        for f in self.cfg.faults.clone() {
            match f {
                Fault::Disconnect { worker, at, duration } => self.queue.push(at, Ev::Disconnect(worker, duration)),
                Fault::Restart { worker, at } => self.queue.push(at, Ev::Restart(worker)),
                Fault::StaleTelemetry { worker, from, until } => {
                    self.hosts[worker].polls_fail_from = Some(from);
                    self.hosts[worker].polls_fail_until = Some(until);
                }
                _ => {}
            }
        }
        if self.cfg.timeline.is_some() {
            self.queue.push(Timestamp::ZERO, Ev::Sample);
        }
        if let Some(bus) = self.cfg.replica_sync.filter(|_| self.replicas.iter().any(|r| r.shares)) {
            self.queue.push(Timestamp::ZERO.saturating_add(bus.state_interval), Ev::BusState);
        }
        let mut now = Timestamp::ZERO;
        while let Some((at, ev)) = self.queue.pop() {
            // Closed-loop arrivals move the last arrival, and the drain limit with it.
            if at > self.closed.last_arrival.saturating_add(self.cfg.drain) {
                break;
            }
            now = at;
            self.handle(now, ev);
            if self.rec.all_done() && now >= self.closed.last_arrival {
                break;
            }
        }
        let unfinished: Vec<RequestId> = self.in_flight.keys().copied().collect();
        for id in unfinished {
            if let Some(f) = self.in_flight.remove(&id) {
                self.rec.outcome(f.request, Outcome::Unfinished, now);
            }
        }
        for (w, h) in self.hosts.iter().enumerate() {
            self.rec.worker_max_waiting(w, h.max_waiting);
        }
        let mut report = self.rec.finish(now);
        // The first replica's rates at the end: what calibration made of the configured ones.
        for (w, r) in report.workers.iter_mut().enumerate() {
            let rates = self.replicas[0].policy.rates(w);
            r.planned_rates = rates.map(|r| r.planned);
            r.measured_rates = rates.map(|r| r.measured);
            let engine = &self.hosts[w].engine;
            r.preemptions = Some(engine.preemptions_total);
            r.true_decode_rate = engine.mean_decode_context().map(|context| {
                let profile = engine.profile();
                profile.decode_tokens_per_s(u64::from(profile.max_running), context.round() as u64)
            });
        }
        report
    }

    fn handle(&mut self, now: Timestamp, ev: Ev) {
        match ev {
            Ev::Arrival(i) => self.arrive(i, now),
            Ev::Decide { request, replica } => self.route(request, replica, now),
            Ev::StepEnd(w, epoch) if epoch == self.hosts[w].epoch => self.step_end(w, now),
            Ev::StepEnd(..) => {}
            Ev::StepStart(w, epoch) if epoch == self.hosts[w].epoch => self.start_step(w, now),
            Ev::StepStart(..) => {}
            Ev::Intake(w, epoch, req) if epoch == self.hosts[w].epoch => {
                self.hosts[w].in_intake.retain(|&(id, _)| id != req.id);
                self.take(w, req, now);
            }
            // Sent to a process that has since restarted: failed with its requests then.
            Ev::Intake(..) => {}
            Ev::Poll(w) => self.poll(w, now),
            Ev::Deliver(w, batch, published) => self.deliver(w, batch, published, now),
            Ev::ReplayReply(w, from) => self.replay_reply(w, from, now),
            Ev::Disconnect(w, duration) => self.disconnect(w, duration, now),
            Ev::Reconnect(w) => {
                self.hosts[w].connected = true;
                self.queue.push(now.saturating_add(self.cfg.health_detect), Ev::Health(w, true));
            }
            Ev::Health(w, healthy) => {
                if self.hosts[w].connected == healthy {
                    for r in &mut self.replicas {
                        if r.view[w].healthy != healthy {
                            r.view[w].healthy = healthy;
                            r.policy.on_health(w, healthy);
                        }
                    }
                }
            }
            Ev::Restart(w) => self.restart(w, now),
            Ev::BusFlush(r) => self.bus_flush(r, now),
            Ev::BusState => {
                for r in 0..self.replicas.len() {
                    // Changes first, so the state a peer applies last is the newest.
                    self.replicas[r].flush_at = None;
                    let changes = self.replicas[r].policy.take_reservation_changes();
                    if !changes.is_empty() {
                        self.bus_publish(r, BusMessage::Changes(Arc::new(changes)), now);
                    }
                    if self.replicas[r].shares {
                        let held = Arc::new(self.replicas[r].policy.held_reservations());
                        self.bus_publish(r, BusMessage::State(held), now);
                    }
                }
                if let Some(bus) = self.cfg.replica_sync {
                    if !self.rec.all_done() {
                        self.queue.push(now.saturating_add(bus.state_interval), Ev::BusState);
                    }
                }
            }
            Ev::BusDeliver { to, from, message } => {
                let peer = self.replicas[from].id.clone();
                let p = &mut self.replicas[to].policy;
                match message {
                    BusMessage::Changes(changes) => p.apply_peer_changes(&peer, &changes, now),
                    BusMessage::State(held) => p.apply_peer_state(&peer, &held, now),
                }
            }
            Ev::Sample => {
                let depths = self.hosts.iter().map(|h| h.engine.waiting_len() as u32).collect();
                self.rec.sample(now, depths);
                if let Some(every) = self.cfg.timeline {
                    if !self.rec.all_done() {
                        self.queue.push(now.saturating_add(every), Ev::Sample);
                    }
                }
            }
        }
    }

    fn arrive(&mut self, i: usize, now: Timestamp) {
        let req = &self.workload.requests[i];
        let tokens = req.prompt.tokens();
        if let Some(w) = req.direct_to {
            let id = RequestId(self.next_background);
            self.next_background += 1;
            self.submit(w, EngineRequest { id, tokens, output_tokens: req.output_tokens }, now);
            self.ended(i, now);
            return;
        }
        // Replicas sit behind one Service that spreads requests over them at random.
        let replica = if self.replicas.len() > 1 { self.rng.random_range(0..self.replicas.len()) } else { 0 };
        // A replica whose peers decide in step with it waits a little first, as the gateway does.
        if let Some(bus) = self.cfg.replica_sync.filter(|_| self.replicas[replica].shares) {
            let draw = self.stagger_rng.random::<u64>();
            let wait = self.replicas[replica].policy.arrived(now, bus.stagger, draw);
            if !wait.is_zero() {
                self.queue.push(now.saturating_add(wait), Ev::Decide { request: i, replica });
                return;
            }
        }
        self.route(i, replica, now);
    }

    /// Decides where request `i` goes at replica `replica`, and sends it there.
    fn route(&mut self, i: usize, replica: usize, now: Timestamp) {
        let req = &self.workload.requests[i];
        let tokens = req.prompt.tokens();
        let id = RequestId(i as u64);
        let keys = self.hasher.prompt_keys(Namespace::DEFAULT, &tokens, self.fleet_block);
        let page_keys: Vec<BlockKey> = if self.fleet_block == policy::approx::PAGE_TOKENS {
            keys.clone()
        } else {
            self.hasher.prompt_keys(Namespace::DEFAULT, &tokens, policy::approx::PAGE_TOKENS)
        };
        let preq = PolicyRequest {
            id,
            keys: &keys,
            page_keys: &page_keys,
            prompt_tokens: tokens.len() as u64,
            max_tokens: req.output_tokens as u64,
        };
        // A connect failure marks the engine down at once and the request is decided again, as the
        // gateway retries before any byte was streamed.
        if self.replicas[replica].policy.reads_true_state() {
            // Measured a microsecond after now, so the requests already placed at this instant
            // count as seen by it and are not counted twice.
            let observed = Timestamp(now.0 + 1);
            for (w, host) in self.hosts.iter().enumerate().filter(|(_, h)| h.connected) {
                // A request in the engine's intake is the engine's, waiting, with all its prompt.
                let mut load = host.engine.load(observed);
                load.waiting_requests += host.in_intake.len() as u64;
                load.waiting_tokens += host.in_intake.iter().map(|&(_, tokens)| tokens).sum::<u64>();
                self.replicas[replica].policy.on_load(w, &load);
            }
        }
        let pick = loop {
            let r = &mut self.replicas[replica];
            let Some(pick) = r.policy.decide(&preq, &r.view, now, &mut self.rng) else {
                break None;
            };
            if self.hosts[pick.worker].connected {
                break Some(pick);
            }
            r.policy.on_finish(id, now, None);
            self.changed(replica, now);
            let r = &mut self.replicas[replica];
            r.view[pick.worker].healthy = false;
            r.policy.on_health(pick.worker, false);
        };
        let Some(pick) = pick else {
            self.rec.outcome(i, Outcome::Failed, now);
            self.ended(i, now);
            return;
        };
        self.changed(replica, now);
        self.rec.decision(i, &pick);
        if pick.cached_tokens.unwrap_or(0) > 0 && self.untrusted(pick.worker, now) {
            self.rec.credit_while_untrusted();
        }
        let wait = pick.admission_wait_s.unwrap_or_else(|| self.admission_wait_s(replica, pick.worker, &tokens, req));
        if self.cfg.admission_wait_s > 0.0 && wait > self.cfg.admission_wait_s {
            self.replicas[replica].policy.on_finish(id, now, None);
            self.changed(replica, now);
            self.rec.outcome(i, Outcome::Rejected, now);
            self.ended(i, now);
            return;
        }
        let v = &mut self.replicas[replica].view[pick.worker];
        v.in_flight += 1;
        v.routed += 1;
        v.sent_requests_since_poll += 1;
        v.sent_tokens_since_poll += tokens.len() as u64;
        self.in_flight.insert(id, InFlight { worker: pick.worker, request: i, replica });
        let held =
            self.hosts.iter_mut().filter(|h| h.connected).map(|h| h.engine.reusable_prompt_tokens(&tokens)).max();
        self.rec.dispatched(i, pick.worker, held.unwrap_or(0));
        self.submit(pick.worker, EngineRequest { id, tokens, output_tokens: req.output_tokens }, now);
    }

    /// The admission measure for a policy without kvgate's router: the core's projected queue
    /// (`wait_s + decode_s`, as [`kvgate_core::Decision::admission_wait_s`] gives kvgate's) of the
    /// engine's last report plus what was sent to it since, at the profile's rates.
    fn admission_wait_s(&self, replica: usize, w: usize, tokens: &[u32], req: &SimRequest) -> f64 {
        let v = &self.replicas[replica].view[w];
        let p = &self.cfg.profile;
        let s = v.snapshot.unwrap_or_default();
        let load = WorkerLoad {
            waiting_requests: s.waiting_requests + v.sent_requests_since_poll,
            waiting_tokens: s.waiting_tokens + v.sent_tokens_since_poll,
            running_requests: s.running_requests,
            decode_tokens: s.active_decode_tokens,
            kv_tokens: (s.kv_usage * p.kv_capacity_tokens as f64) as u64,
            kv_capacity_tokens: p.kv_capacity_tokens,
            max_running_requests: u64::from(p.max_running),
            chunk_tokens: u64::from(p.chunk_budget),
            prefill_tps: p.prefill_tokens_per_s,
            decode_tps: p.decode_tokens_per_s(p.max_running as u64, 4096),
        };
        let ask = projected::Ask::new(tokens.len() as u64, 0, u64::from(req.output_tokens));
        projected::score(&load, ask, &self.cfg.knobs).queue_s()
    }

    /// A request is sent to engine `w`: its scheduler takes it now, or once it has reached the
    /// engine ([`EngineProfile::dispatch`]) and the host's intake is done with it. The intake takes
    /// one request at a time, in the order they were sent (vLLM's API server renders and tokenizes
    /// on a single worker thread by default), so requests sent together reach the scheduler one
    /// intake apart. On its way and in the intake a request is the engine's, waiting.
    fn submit(&mut self, w: usize, req: EngineRequest, now: Timestamp) {
        let (dispatch, intake) = (self.cfg.profile.dispatch, self.cfg.profile.intake);
        if dispatch.is_none() && intake.is_none() {
            return self.take(w, req, now);
        }
        let reaches = now.saturating_add(Duration::from_micros(draw(&dispatch, &mut self.travel_rng)));
        let host = &mut self.hosts[w];
        let ready = if intake.is_none() {
            reaches
        } else {
            let micros = draw(&intake, &mut self.intake_rng);
            host.intake_free_at = host.intake_free_at.max(reaches).saturating_add(Duration::from_micros(micros));
            host.intake_free_at
        };
        host.in_intake.push((req.id, req.tokens.len() as u64));
        self.queue.push(ready, Ev::Intake(w, host.epoch, req));
    }

    /// When a token an engine releases `now` reaches its client ([`EngineProfile::delivery`]).
    fn delivered(&mut self, now: Timestamp) -> Timestamp {
        let delivery = self.cfg.profile.delivery;
        now.saturating_add(Duration::from_micros(draw(&delivery, &mut self.travel_rng)))
    }

    /// Engine `w`'s scheduler takes a request; an idle engine starts a step at once.
    fn take(&mut self, w: usize, req: EngineRequest, now: Timestamp) {
        let host = &mut self.hosts[w];
        host.engine.submit(req);
        host.max_waiting = host.max_waiting.max(host.engine.waiting_len() as u64);
        if !host.stepping {
            self.start_step(w, now);
        }
    }

    fn start_step(&mut self, w: usize, now: Timestamp) {
        let host = &mut self.hosts[w];
        match host.engine.begin_step() {
            Some(micros) => {
                host.stepping = true;
                self.queue.push(Timestamp(now.0 + micros), Ev::StepEnd(w, host.epoch));
                if self.rec.keeps_requests() {
                    for id in self.hosts[w].engine.planned() {
                        if let Some(f) = self.in_flight.get(&id) {
                            self.rec.first_step(f.request, now);
                        }
                    }
                }
            }
            None => host.stepping = false,
        }
    }

    fn step_end(&mut self, w: usize, now: Timestamp) {
        let StepOutcome { first_tokens, finished, batch, .. } = self.hosts[w].engine.end_step();
        let host = &mut self.hosts[w];
        host.max_waiting = host.max_waiting.max(host.engine.waiting_len() as u64);
        for id in first_tokens {
            if let Some(f) = self.in_flight.get(&id) {
                let (request, replica) = (f.request, f.replica);
                let at = self.delivered(now);
                self.rec.first_token(request, at);
                self.replicas[replica].policy.on_first_token(id, now);
                self.changed(replica, now);
            }
        }
        for done in finished {
            if let Some(f) = self.in_flight.remove(&done.id) {
                let r = &mut self.replicas[f.replica];
                r.view[f.worker].in_flight -= 1;
                r.policy.on_finish(done.id, now, Some(done.output_tokens));
                self.changed(f.replica, now);
                // The client has the last token, and a closed-loop client sends its next, later.
                let at = self.delivered(now);
                self.rec.completed(f.request, &done, at);
                self.ended(f.request, at);
            }
        }
        if let Some(batch) = batch {
            self.send_batch(w, batch, now);
        }
        // A busy engine's host spends its gap before it plans the next step; what arrives meanwhile
        // joins that plan. An idle engine starts at once when work comes (`submit`).
        let gap = &self.cfg.profile.step_gap;
        if gap.is_none() || !self.hosts[w].engine.has_work() {
            self.start_step(w, now);
        } else {
            let micros = gap.micros(self.step_gap_rng.sample(StandardNormal));
            self.queue.push(Timestamp(now.0 + micros), Ev::StepStart(w, self.hosts[w].epoch));
        }
    }

    fn send_batch(&mut self, w: usize, batch: EventBatch, now: Timestamp) {
        if !self.hosts[w].connected || (self.kv_loss > 0.0 && self.rng.random::<f64>() < self.kv_loss) {
            return;
        }
        let jitter = if self.kv_jitter.is_zero() { Duration::ZERO } else { self.kv_jitter.mul_f64(self.rng.random()) };
        // One publisher's messages travel one TCP stream: jitter delays them but never reorders them.
        // (Live and replayed batches still interleave, which the tracker sorts out.)
        let at = now.saturating_add(self.cfg.kv_delay + self.kv_extra + jitter).max(self.hosts[w].last_delivery);
        self.hosts[w].last_delivery = at;
        self.queue.push(at, Ev::Deliver(w, batch, now));
    }

    fn deliver(&mut self, w: usize, batch: EventBatch, published: Timestamp, now: Timestamp) {
        self.each_policy(|p| p.on_engine_step(w, &batch.events, published, now));
        // The tracker is given no timestamp (the modelled engine's clock never goes back); a batch
        // that clears everything still marks a restart that repeats a sequence number, as in the
        // gateway.
        let clears_all = batch.events.iter().any(|e| matches!(e, KvEvent::AllBlocksCleared));
        let mark = BatchMark { clears_all, timestamp: None };
        match self.hosts[w].tracker.on_live_marked(batch.seq, mark, batch.events) {
            LiveAction::Apply(batches) => self.apply_batches(w, batches, now),
            LiveAction::Duplicate | LiveAction::Buffered => {}
            LiveAction::Replay { from } => {
                self.rec.kv_gap();
                self.kv_state_all(w, KvState::Incomplete(format!("sequence gap from {from}, replaying")), false);
                self.request_replay(w, from, now);
            }
            LiveAction::Restart => {
                self.rec.kv_gap();
                self.kv_state_all(w, KvState::Incomplete("engine restarted, replaying from 0".into()), true);
                self.request_replay(w, 0, now);
            }
        }
    }

    /// Whether the router must not trust `w`'s telemetry now: restarted with no new events yet, or
    /// its load reports older than the stale bound because its poller is failing.
    fn untrusted(&self, w: usize, now: Timestamp) -> bool {
        let h = &self.hosts[w];
        let stale_bound = self.cfg.knobs.stale_after() + self.cfg.poll_interval;
        let polls_stale = h.polls_fail_from.is_some_and(|f| now.saturating_since(f) > stale_bound)
            && h.polls_fail_until.is_none_or(|u| now < u);
        h.awaiting_new_events || polls_stale
    }

    /// Replica `r`'s reservations changed: schedule the flush of its batch when the core's outbox
    /// says it is due, if it shares them and no earlier flush is scheduled.
    fn changed(&mut self, r: usize, _now: Timestamp) {
        let replica = &mut self.replicas[r];
        if !replica.shares {
            return;
        }
        if let Some(due) = replica.policy.reservation_changes_due_at() {
            if replica.flush_at.is_none_or(|at| due < at) {
                replica.flush_at = Some(due);
                self.queue.push(due, Ev::BusFlush(r));
            }
        }
    }

    /// Publishes replica `r`'s batch, unless this flush was superseded by an earlier one.
    fn bus_flush(&mut self, r: usize, now: Timestamp) {
        if self.replicas[r].flush_at != Some(now) {
            return;
        }
        self.replicas[r].flush_at = None;
        let changes = self.replicas[r].policy.take_due_reservation_changes(now);
        if !changes.is_empty() {
            self.bus_publish(r, BusMessage::Changes(Arc::new(changes)), now);
        }
        self.changed(r, now);
    }

    /// Delivers `message` from replica `from` to every other replica, each copy lost on its own.
    fn bus_publish(&mut self, from: usize, message: BusMessage, now: Timestamp) {
        let Some(bus) = self.cfg.replica_sync else { return };
        for to in 0..self.replicas.len() {
            if to == from || (bus.loss > 0.0 && self.rng.random::<f64>() < bus.loss) {
                continue;
            }
            self.queue.push(now.saturating_add(bus.delay), Ev::BusDeliver { to, from, message: message.clone() });
        }
    }

    /// Runs `f` on every replica's policy.
    fn each_policy(&mut self, mut f: impl FnMut(&mut dyn SimPolicy)) {
        for r in &mut self.replicas {
            f(r.policy.as_mut());
        }
    }

    /// Tells every replica the event consumer's verdict on `w`.
    fn kv_state_all(&mut self, w: usize, state: KvState, clear: bool) {
        self.each_policy(|p| p.on_kv_state(w, state.clone(), clear));
    }

    fn apply_batches(&mut self, w: usize, batches: Vec<Vec<KvEvent>>, now: Timestamp) {
        if !batches.is_empty() && self.hosts[w].tracker.awaiting_replay().is_none() {
            self.hosts[w].awaiting_new_events = false;
        }
        for events in batches {
            self.each_policy(|p| p.on_kv_events(w, &events, now));
        }
    }

    fn request_replay(&mut self, w: usize, from: u64, now: Timestamp) {
        self.queue.push(now.saturating_add(self.cfg.replay_delay), Ev::ReplayReply(w, from));
    }

    fn replay_reply(&mut self, w: usize, from: u64, now: Timestamp) {
        let host = &mut self.hosts[w];
        let replayed = if self.replay && host.connected {
            host.engine.replay(from).into_iter().map(|b| (b.seq, b.events)).collect()
        } else {
            Vec::new()
        };
        let outcome = host.tracker.on_replay(replayed);
        if outcome.history_lost {
            // Missed removals would make the index claim blocks the engine evicted: forget the
            // worker's blocks and continue with a partial view, which can only under-report.
            self.rec.kv_history_lost();
            self.kv_state_all(w, KvState::Synced, true);
        }
        self.apply_batches(w, outcome.apply, now);
        if self.hosts[w].tracker.awaiting_replay().is_none() {
            self.kv_state_all(w, KvState::Synced, false);
        }
    }

    fn poll(&mut self, w: usize, now: Timestamp) {
        let host = &self.hosts[w];
        let failing = host.polls_fail_from.is_some_and(|f| now >= f) && host.polls_fail_until.is_none_or(|u| now < u);
        if host.connected && !failing {
            let report = host.engine.report(self.cfg.telemetry);
            let snapshot = snapshot_from_report(&report, self.cfg.count_assumptions, now);
            for r in &mut self.replicas {
                let v = &mut r.view[w];
                v.snapshot = Some(snapshot);
                v.sent_requests_since_poll = 0;
                v.sent_tokens_since_poll = 0;
                r.policy.on_load(w, &snapshot);
            }
        }
        if !self.rec.all_done() {
            self.queue.push(now.saturating_add(self.cfg.poll_interval), Ev::Poll(w));
        }
    }

    fn fail_requests(&mut self, w: usize, ids: Vec<RequestId>, now: Timestamp) {
        for id in ids {
            if let Some(f) = self.in_flight.remove(&id) {
                let r = &mut self.replicas[f.replica];
                r.view[w].in_flight -= 1;
                r.policy.on_finish(id, now, None);
                self.changed(f.replica, now);
                self.rec.outcome(f.request, Outcome::Failed, now);
                self.ended(f.request, now);
            }
        }
    }

    /// Request `i` ended: the requests that waited for it are sent.
    fn ended(&mut self, i: usize, now: Timestamp) {
        let c = &mut self.closed;
        c.ended[i] = true;
        while c.ended.get(c.ended_prefix) == Some(&true) {
            c.ended_prefix += 1;
        }
        for (j, gap) in c.followers.remove(&i).unwrap_or_default() {
            self.send_later(j, now.saturating_add(gap));
        }
        self.release_barriers(now);
    }

    /// Sends the requests whose earlier requests all ended.
    fn release_barriers(&mut self, now: Timestamp) {
        let prefix = self.closed.ended_prefix;
        let (ready, waiting): (Vec<_>, Vec<_>) = self.closed.barriers.drain(..).partition(|b| b.0 <= prefix);
        self.closed.barriers = waiting;
        for (_, j, gap) in ready {
            self.send_later(j, now.saturating_add(gap));
        }
    }

    /// Schedules closed-loop request `j` to arrive `at`.
    fn send_later(&mut self, j: usize, at: Timestamp) {
        self.rec.arrived(j, at);
        self.closed.last_arrival = self.closed.last_arrival.max(at);
        self.queue.push(at, Ev::Arrival(j));
    }

    fn disconnect(&mut self, w: usize, duration: Duration, now: Timestamp) {
        let aborted = self.hosts[w].engine.abort_all();
        let host = &mut self.hosts[w];
        host.connected = false;
        host.epoch += 1;
        host.stepping = false;
        self.fail_requests(w, aborted, now);
        self.queue.push(now.saturating_add(self.cfg.health_detect), Ev::Health(w, false));
        self.queue.push(now.saturating_add(duration), Ev::Reconnect(w));
    }

    fn restart(&mut self, w: usize, now: Timestamp) {
        let mut failed = self.hosts[w].engine.restart();
        let host = &mut self.hosts[w];
        failed.extend(host.in_intake.drain(..).map(|(id, _)| id));
        host.intake_free_at = now;
        host.epoch += 1;
        host.stepping = false;
        // The connections reset at once: the router learns of the restart from the failures, and the
        // worker earns no credit until the new process's events arrive.
        self.fail_requests(w, failed, now);
        self.rec.restart();
        self.hosts[w].awaiting_new_events = true;
        self.kv_state_all(w, KvState::Incomplete("engine restarted: in-flight requests failed".into()), true);
        if let Some(batch) = self.hosts[w].engine.flush_idle() {
            self.send_batch(w, batch, now);
        }
    }
}

/// A host delay drawn from `rng`: nothing is drawn for none, so a run without the delay draws what
/// it drew before the delay existed.
fn draw(delay: &HostDelay, rng: &mut ChaCha8Rng) -> u64 {
    if delay.is_none() {
        0
    } else {
        delay.micros(rng.sample(StandardNormal))
    }
}
