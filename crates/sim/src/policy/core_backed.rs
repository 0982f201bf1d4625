//! kvgate's own policies and the SMG cache_aware baseline, run by the real core `Router`: the same
//! decision code as the gateway, fed by the simulator's modelled telemetry and event paths.

use kvgate_core::{
    BatchWindows, HeldReservation, KvState, LoadSnapshot, PolicyConfig, ReplicaId, RequestId, ReservationChange,
    RouteRequest, Router, Timestamp, WorkerConfig, WorkerId,
};
use kvgate_protocol::KvEvent;
use rand_chacha::ChaCha8Rng;

use super::{FleetInfo, Pick, PolicyRequest, SimPolicy, WorkerRates, WorkerView};
use crate::SimError;

/// A policy decided by the core.
#[derive(Debug)]
pub struct CorePolicy {
    router: Router,
    ids: Vec<WorkerId>,
    true_state: bool,
}

impl CorePolicy {
    /// A core router over `fleet` with `policy`.
    pub fn new(fleet: &FleetInfo, policy: PolicyConfig) -> Result<Self, SimError> {
        let router = Router::new(fleet.block_size, policy).map_err(|e| SimError::Config(e.to_string()))?;
        let ids: Vec<WorkerId> = (0..fleet.workers).map(|i| WorkerId::new(format!("w{i}"))).collect();
        for (i, id) in ids.iter().enumerate() {
            let scale = if i == 0 { fleet.first_worker_rate_scale } else { 1.0 };
            let config = WorkerConfig {
                id: id.clone(),
                prefill_tokens_per_s: fleet.prefill_tokens_per_s * scale,
                decode_tokens_per_s: fleet.decode_tokens_per_s * scale,
                kv_capacity_tokens: fleet.kv_capacity_tokens,
                max_running_requests: fleet.max_running_requests,
                chunk_tokens: fleet.chunk_tokens,
            };
            router.add_worker(config, KvState::Synced).map_err(|e| SimError::Config(e.to_string()))?;
        }
        Ok(CorePolicy { router, ids, true_state: false })
    }

    /// The same policy, handed the engines' true load before every decision (the `oracle`).
    pub fn reading_true_state(mut self) -> Self {
        self.true_state = true;
        self
    }

    fn index_of(&self, id: &WorkerId) -> usize {
        id.as_str()[1..].parse().expect("ids are w<index>")
    }
}

impl SimPolicy for CorePolicy {
    fn decide(
        &mut self,
        req: &PolicyRequest<'_>,
        _view: &[WorkerView],
        now: Timestamp,
        rng: &mut ChaCha8Rng,
    ) -> Option<Pick> {
        let route = RouteRequest {
            id: req.id,
            keys: req.keys,
            prompt_tokens: req.prompt_tokens,
            max_tokens: req.max_tokens,
            exclude: &[],
            keys_cover_prompt: true,
        };
        let d = self.router.decide(&route, now, rng).ok()?;
        Some(Pick {
            worker: self.index_of(&d.worker),
            reason: Some(d.reason),
            shadow_disagrees: (d.mode == kvgate_core::Mode::Shadow).then(|| d.shadow_disagrees()),
            cached_tokens: Some(d.cached_tokens),
            admission_wait_s: Some(d.admission_wait_s()),
        })
    }

    fn on_load(&mut self, worker: usize, snapshot: &LoadSnapshot) {
        let _ = self.router.update_load(&self.ids[worker], *snapshot);
    }

    fn on_kv_events(&mut self, worker: usize, events: &[KvEvent], now: Timestamp) {
        let _ = self.router.apply_kv_events(&self.ids[worker], events, now);
    }

    fn on_engine_step(&mut self, worker: usize, events: &[KvEvent], engine_time: Timestamp, received: Timestamp) {
        let seconds = engine_time.as_micros() as f64 / 1e6;
        let _ = self.router.observe_engine_step(&self.ids[worker], events, seconds, None, received);
    }

    fn on_kv_state(&mut self, worker: usize, state: KvState, clear: bool) {
        if clear {
            let _ = self.router.clear_kv(&self.ids[worker]);
        }
        let _ = self.router.set_kv_state(&self.ids[worker], state);
    }

    fn on_first_token(&mut self, id: RequestId, now: Timestamp) {
        let _ = self.router.first_token(id, now);
    }

    fn on_finish(&mut self, id: RequestId, now: Timestamp, output_tokens: Option<u64>) {
        let _ = self.router.release_with_output(id, now, output_tokens);
    }

    fn on_health(&mut self, worker: usize, healthy: bool) {
        let _ = self.router.set_eligible(&self.ids[worker], healthy);
    }

    fn rates(&self, worker: usize) -> Option<WorkerRates> {
        let status = self.router.worker_status(self.ids.get(worker)?, Timestamp::ZERO).ok()?;
        Some(WorkerRates {
            planned: (status.prefill_tokens_per_s, status.decode_tokens_per_s),
            measured: (status.measured_prefill_tokens_per_s, status.measured_decode_tokens_per_s),
        })
    }

    fn reads_true_state(&self) -> bool {
        self.true_state
    }

    fn share_reservations(&mut self, windows: BatchWindows) -> bool {
        self.router.batch_reservation_changes(windows, None);
        true
    }

    fn arrived(&mut self, now: Timestamp, max_stagger: std::time::Duration, draw: u64) -> std::time::Duration {
        self.router.arrived(now, max_stagger, draw).0
    }

    fn reservation_changes_due_at(&self) -> Option<Timestamp> {
        self.router.reservation_changes_due_at()
    }

    fn take_due_reservation_changes(&mut self, now: Timestamp) -> Vec<ReservationChange> {
        self.router.take_due_reservation_changes(now)
    }

    fn take_reservation_changes(&mut self) -> Vec<ReservationChange> {
        self.router.take_reservation_changes()
    }

    fn held_reservations(&self) -> Vec<HeldReservation> {
        self.router.held_reservations()
    }

    fn apply_peer_changes(&mut self, peer: &ReplicaId, changes: &[ReservationChange], now: Timestamp) {
        self.router.apply_peer_changes(peer, changes, now);
    }

    fn apply_peer_state(&mut self, peer: &ReplicaId, held: &[HeldReservation], now: Timestamp) {
        self.router.apply_peer_state(peer, held, now);
    }
}
