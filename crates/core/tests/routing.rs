//! Routing decisions of the core, driven through its public API with prefixes fed as real events.

mod support;

use kvgate_core::{KvState, LoadSnapshot, Mode, PolicyConfig, PolicyName, Reason, Timestamp};
use kvgate_protocol::{BlockStored, EngineHash, KvEvent};
use support::*;

/// The production incident: 51 engines, the owner of a hot prefix with 109 waiting and 38 running,
/// 49 idle peers and one more busy worker.
fn incident(policy: PolicyConfig) -> (kvgate_core::Router, Vec<u32>) {
    let router = fleet(51, policy);
    let prefix = make_hot_owner(&router);
    router.update_load(&wid(50), busy(12, 60_000, 30, 9_000)).unwrap();
    (router, prefix)
}

/// Makes w0 the incident's owner: 109 waiting, 38 running, holding the hot 8k-token prefix.
fn make_hot_owner(router: &kvgate_core::Router) -> Vec<u32> {
    let prefix = tokens("hot system prompt", 8192);
    let owner = LoadSnapshot { kv_usage: 0.62, ..busy(109, 915_600, 38, 11_400) };
    router.update_load(&wid(0), owner).unwrap();
    store(router, &wid(0), &prefix);
    prefix
}

#[test]
fn hot_owner_loses_to_idle_peers_when_its_queue_exceeds_recompute() {
    let (router, prefix) = incident(PolicyConfig::projected(Mode::Enforce));
    // The owner's cache is credited, and it still loses: 45.8 s of queued prefill, and its 38 running
    // requests ride each of the 112 steps to the end of this prefill (2.1 s).
    let probe = Req::new(&router, 1000, &hot_prompt(&prefix, 1000, 200), 256);
    let owner = router.worker_status(&wid(0), T0).unwrap();
    assert_eq!((owner.waiting_requests, owner.running_requests, owner.blocks_held), (109, 38, 512));
    let d = decide(&router, &probe, T0);
    assert_eq!(d.cached_tokens, 0);
    router.release(probe.id, T0).unwrap();
    let mut chosen = std::collections::HashSet::new();
    for i in 0..49 {
        let req = Req::new(&router, i, &hot_prompt(&prefix, i, 200), 256);
        let d = decide(&router, &req, T0);
        assert_ne!(d.worker, wid(0), "request {i} went to the hot owner: {d:?}");
        assert_ne!(d.worker, wid(50), "request {i} went to the busy worker");
        assert_eq!(d.reason, Reason::CacheAndLoad);
        assert!(d.scores.len() <= 17, "51 workers list the best 16 plus the load-only winner");
        assert!(d.scores.iter().all(|s| s.worker != wid(0)), "the owner is nowhere near the best 16");
        chosen.insert(d.worker.clone());
    }
    assert_eq!(chosen.len(), 49, "49 simultaneous hot requests spread over the 49 idle peers");
}

#[test]
fn cache_aware_with_cap_one_seeding_piles_the_burst_onto_the_owner() {
    // Without seeding, SMG's balance gate moves the burst off the owner.
    let (plain, prefix) = incident(PolicyConfig::new(PolicyName::CacheAware));
    let d = decide(&plain, &Req::new(&plain, 0, &hot_prompt(&prefix, 0, 200), 256), T0);
    assert_ne!(d.worker, wid(0));
    let policy = PolicyConfig { distribution_seeding: true, ..PolicyConfig::new(PolicyName::CacheAware) };
    let (router, prefix) = incident(policy);
    let mut on_owner = 0;
    for i in 0..49 {
        let req = Req::new(&router, i, &hot_prompt(&prefix, i, 200), 256);
        if decide(&router, &req, T0).worker == wid(0) {
            on_owner += 1;
        }
    }
    assert_eq!(on_owner, 49, "the hot prefix is pinned to its one owner, whatever its queue");
    // The owner scores worst of 51, yet its queue is in the decision: admission reads it there.
    let d = decide(&router, &Req::new(&router, 99, &hot_prompt(&prefix, 99, 200), 256), T0);
    assert_eq!(d.worker, wid(0));
    assert!(d.admission_wait_s() > 45.0, "the owner's queue: {}", d.admission_wait_s());
}

#[test]
fn cache_affinity_is_kept_when_saved_prefill_exceeds_the_load_penalty() {
    let router = fleet(4, PolicyConfig::projected(Mode::Enforce));
    let prefix = tokens("system", 8192);
    // 4,000 queued tokens cost the owner 0.2 s; the cached 8,192 tokens save 0.41 s.
    router.update_load(&wid(2), busy(1, 4_000, 0, 0)).unwrap();
    store(&router, &wid(2), &prefix);
    let req = Req::new(&router, 1, &hot_prompt(&prefix, 1, 100), 64);
    let d = decide(&router, &req, T0);
    assert_eq!(d.worker, wid(2));
    assert_eq!(d.reason, Reason::CacheAndLoad);
    assert_eq!(d.cached_tokens, 8192);
    assert_ne!(d.load_only_worker, wid(2));

    // With 20,000 queued tokens (1 s) the same saving no longer pays for the queue.
    router
        .update_load(&wid(2), LoadSnapshot { observed_at: Timestamp::from_millis(1), ..busy(1, 20_000, 0, 0) })
        .unwrap();
    let req = Req::new(&router, 2, &hot_prompt(&prefix, 2, 100), 64);
    let d = decide(&router, &req, Timestamp::from_millis(1));
    assert_ne!(d.worker, wid(2));
}

#[test]
fn a_reuse_slack_keeps_the_deeper_holder_while_its_cost_is_within_the_slack() {
    let router = fleet(4, PolicyConfig::projected(Mode::Enforce));
    let prefix = tokens("system", 8192);
    let owner_queue = |queued: u64, ms: u64| {
        let snapshot = LoadSnapshot { observed_at: Timestamp::from_millis(ms), ..busy(1, queued, 0, 0) };
        router.update_load(&wid(2), snapshot).unwrap();
    };
    owner_queue(20_000, 0);
    store(&router, &wid(2), &prefix);
    let req = |id| Req::new(&router, id, &hot_prompt(&prefix, id, 100), 64);
    let cost = |d: &kvgate_core::Decision, w: usize| d.scores.iter().find(|s| s.worker == wid(w)).unwrap().cost_s;
    // The owner's 1 s queue outweighs the 0.41 s its cache saves: by default an idle peer wins.
    let d = decide(&router, &req(1), T0);
    assert_ne!(d.worker, wid(2));
    assert_eq!(d.reason, Reason::CacheAndLoad);
    router.release(d.request, T0).unwrap();
    // Within a slack of 3 (up to 4× the winner's cost) the owner keeps it.
    router.set_policy(PolicyConfig { reuse_slack: 3.0, ..router.policy() }).unwrap();
    let d = decide(&router, &req(2), T0);
    assert_eq!((d.worker.clone(), d.reason, d.cached_tokens), (wid(2), Reason::Reuse, 8192), "{:?}", d.scores);
    let cheapest = d.scores.iter().map(|s| s.cost_s).fold(f64::INFINITY, f64::min);
    assert!(cost(&d, 2) > cheapest && cost(&d, 2) <= 4.0 * cheapest, "{:?}", d.scores);
    router.release(d.request, T0).unwrap();
    // A 5 s queue is beyond the slack (the escape, at 3600 s, does not decide it).
    router.set_policy(PolicyConfig { escape_seconds: 3600.0, ..router.policy() }).unwrap();
    owner_queue(100_000, 1);
    let d = decide(&router, &req(3), Timestamp::from_millis(1));
    assert_ne!(d.worker, wid(2));
    assert_eq!(d.reason, Reason::CacheAndLoad);
    router.release(d.request, Timestamp::from_millis(1)).unwrap();
    // The hard escape still applies to the holder the slack would keep.
    router.set_policy(PolicyConfig { reuse_slack: 100.0, escape_seconds: 2.0, ..router.policy() }).unwrap();
    let d = decide(&router, &req(4), Timestamp::from_millis(1));
    assert_eq!(d.reason, Reason::Escape);
    assert_eq!(d.worker, d.load_only_worker);
}

#[test]
fn a_running_batch_costs_its_share_of_each_step_and_a_full_one_a_slot() {
    let router = fleet(2, PolicyConfig::projected(Mode::Enforce));
    // w1 has 0.1 s of queued prefill; w0 none, but 40 running requests with 12,000 tokens to decode.
    router.update_load(&wid(0), busy(0, 0, 40, 12_000)).unwrap();
    router.update_load(&wid(1), busy(0, 2_000, 0, 0)).unwrap();
    let prompt = tokens("p", 1000);
    let d = decide(&router, &Req::new(&router, 1, &prompt, 16), T0);
    assert_eq!(d.worker, wid(0), "the new request joins w0's batch at the next step: {:?}", d.scores);
    let w0 = d.scores.iter().find(|s| s.worker == wid(0)).unwrap();
    assert!((w0.decode_s - 40.0 / 2_000.0).abs() < 1e-9, "one step carrying 40 sequences: {w0:?}");
    router.release(d.request, T0).unwrap();
    // A full batch (256 running, 300 tokens each left) makes it wait for one of them to finish.
    router.update_load(&wid(0), busy(0, 0, 256, 76_800)).unwrap();
    let d = decide(&router, &Req::new(&router, 2, &prompt, 16), T0);
    assert_eq!(d.worker, wid(1));
    let w0 = d.scores.iter().find(|s| s.worker == wid(0)).unwrap();
    let slot_wait = 76_800.0 / (256.0 * 2_000.0);
    assert!((w0.decode_s - (256.0 / 2_000.0 + slot_wait)).abs() < 1e-9, "{w0:?}");
    router.release(d.request, T0).unwrap();
    // The engine says it admits 2,048 (SGLang's max_running_requests): 256 running leave room, so
    // the request rides one step and waits for no slot, whatever the configured limit.
    let roomy = LoadSnapshot { max_running_requests: Some(2_048), ..busy(0, 0, 256, 76_800) };
    router.update_load(&wid(0), roomy).unwrap();
    let d = decide(&router, &Req::new(&router, 3, &prompt, 16), T0);
    let w0 = d.scores.iter().find(|s| s.worker == wid(0)).unwrap();
    assert!((w0.decode_s - 256.0 / 2_000.0).abs() < 1e-9, "no slot wait under the engine's own limit: {w0:?}");
}

/// The owner of a prefix that would win on cache, and an idle load-only winner.
fn owner_fleet() -> (kvgate_core::Router, Vec<u32>) {
    let router = fleet(3, PolicyConfig::projected(Mode::Enforce));
    let prefix = tokens("shared", 4096);
    router.update_load(&wid(1), busy(1, 1_000, 0, 0)).unwrap();
    store(&router, &wid(1), &prefix);
    (router, prefix)
}

fn assert_fallback(router: &kvgate_core::Router, prefix: &[u32], now: Timestamp, reason: &str) {
    let req = Req::new(router, 9, &hot_prompt(prefix, 9, 50), 32);
    let d = router.decide(&req.route(), now, &mut rng()).unwrap();
    assert_eq!(d.reason.as_str(), reason, "{d:?}");
    assert_eq!(d.worker, d.load_only_worker, "fallback is the load-only decision");
    assert_ne!(d.worker, wid(1));
    assert_eq!(d.cached_tokens, 0);
    let owner = d.scores.iter().find(|s| s.worker == wid(1)).unwrap();
    assert_eq!(owner.cached_tokens, 0, "no cache credit for untrusted telemetry");
}

#[test]
fn owner_wins_on_cache_when_its_telemetry_is_trusted() {
    let (router, prefix) = owner_fleet();
    let d = decide(&router, &Req::new(&router, 1, &hot_prompt(&prefix, 1, 50), 32), T0);
    assert_eq!(d.worker, wid(1));
    assert_eq!(d.reason, Reason::CacheAndLoad);
}

#[test]
fn missing_load_telemetry_falls_back_to_load_only() {
    let router = fleet(3, PolicyConfig::projected(Mode::Enforce));
    let prefix = tokens("shared", 4096);
    router.remove_worker(&wid(1), Timestamp::ZERO).unwrap();
    router.add_worker(kvgate_core::WorkerConfig::new(wid(1)), KvState::Synced).unwrap();
    store(&router, &wid(1), &prefix);
    // A router-side reservation makes w1 the load-only loser.
    let other = Req::new(&router, 100, &tokens("other", 3000), 32);
    router.decide(&other.route(), T0, &mut rng()).unwrap();
    assert_fallback(&router, &prefix, T0, "fallback:missing");
}

#[test]
fn stale_load_telemetry_falls_back_to_load_only() {
    let (router, prefix) = owner_fleet();
    for i in [0, 2] {
        router.update_load(&wid(i), LoadSnapshot { observed_at: Timestamp::from_millis(9_000), ..idle() }).unwrap();
    }
    assert_fallback(&router, &prefix, Timestamp::from_millis(10_000), "fallback:stale");
}

#[test]
fn incomplete_kv_state_falls_back_to_load_only() {
    let (router, prefix) = owner_fleet();
    router.set_kv_state(&wid(1), KvState::Incomplete("sequence gap 7..9 not replayed".into())).unwrap();
    assert_fallback(&router, &prefix, T0, "fallback:incomplete");
}

#[test]
fn invalid_kv_state_falls_back_to_load_only() {
    let (router, prefix) = owner_fleet();
    router.set_kv_state(&wid(1), KvState::Invalid("undecodable payload".into())).unwrap();
    assert_fallback(&router, &prefix, T0, "fallback:invalid");
}

#[test]
fn kv_events_going_quiet_under_traffic_make_the_worker_stale() {
    let (router, prefix) = owner_fleet();
    let policy = PolicyConfig { kv_stale_after_ms: 1_000, stale_after_ms: 3_600_000, ..router.policy() };
    router.set_policy(policy).unwrap();
    let d = decide(&router, &Req::new(&router, 1, &hot_prompt(&prefix, 1, 50), 32), Timestamp::from_millis(10));
    assert_eq!(d.worker, wid(1));
    router.release(d.request, Timestamp::from_millis(20)).unwrap();
    // Traffic flowed at t = 10 ms and no event arrived for 5 s.
    assert_fallback(&router, &prefix, Timestamp::from_millis(5_000), "fallback:stale");
}

#[test]
fn off_mode_is_exactly_least_load() {
    let (a, prefix) = owner_fleet();
    a.set_policy(PolicyConfig::projected(Mode::Off)).unwrap();
    let (b, _) = owner_fleet();
    b.set_policy(PolicyConfig::new(PolicyName::LeastLoad)).unwrap();
    for i in 0..20 {
        let prompt = hot_prompt(&prefix, i, 10 + i as usize);
        let da = decide(&a, &Req::new(&a, i, &prompt, 32), T0);
        let db = decide(&b, &Req::new(&b, i, &prompt, 32), T0);
        assert_eq!(da.worker, db.worker);
        assert_eq!(da.worker, da.load_only_worker);
        assert_eq!(da.reason, Reason::LoadOnly);
        assert_eq!(da.enforce_worker, None);
        assert_eq!(da.enforce_reason, None);
    }
}

#[test]
fn shadow_records_the_enforce_choice_without_changing_dispatch() {
    let (router, prefix) = owner_fleet();
    router.set_policy(PolicyConfig::projected(Mode::Shadow)).unwrap();
    let d = decide(&router, &Req::new(&router, 1, &hot_prompt(&prefix, 1, 50), 32), T0);
    assert_eq!(d.reason, Reason::Shadow);
    assert_eq!(d.worker, d.load_only_worker);
    assert_eq!(d.enforce_worker, Some(wid(1)));
    assert_eq!(d.enforce_reason, Some(Reason::CacheAndLoad));
    assert!(d.shadow_disagrees());
    let status = router.worker_status(&d.worker, T0).unwrap();
    assert_eq!(status.in_flight, 1, "the reservation follows the dispatched worker");
    assert_eq!(router.worker_status(&wid(1), T0).unwrap().in_flight, 0);
}

#[test]
fn enforce_escapes_to_the_load_only_winner_when_configured() {
    let (router, prefix) = owner_fleet();
    let req = |id| Req::new(&router, id, &hot_prompt(&prefix, id, 50), 32);
    // The owner's 1,000 queued tokens (0.05 s) are within any escape bound of 0.05 s or more.
    router.set_policy(PolicyConfig { escape_seconds: 0.06, ..PolicyConfig::projected(Mode::Enforce) }).unwrap();
    let d = decide(&router, &req(1), T0);
    assert_eq!((d.worker.clone(), d.reason), (wid(1), Reason::CacheAndLoad));
    router.release(d.request, T0).unwrap();
    router.set_policy(PolicyConfig { escape_seconds: 0.01, ..PolicyConfig::projected(Mode::Enforce) }).unwrap();
    let d = decide(&router, &req(2), T0);
    assert_eq!(d.reason, Reason::Escape);
    assert_eq!(d.worker, d.load_only_worker);
    router.release(d.request, T0).unwrap();
    router.set_policy(PolicyConfig { escape_waiting: 0, ..PolicyConfig::projected(Mode::Enforce) }).unwrap();
    assert_eq!(decide(&router, &req(3), T0).reason, Reason::Escape, "one waiting request beyond a bound of 0");
}

#[test]
fn distribution_seeding_is_rejected_for_projected() {
    let router = fleet(2, PolicyConfig::projected(Mode::Enforce));
    let err = router.set_policy(PolicyConfig { distribution_seeding: true, ..router.policy() }).unwrap_err();
    assert!(err.to_string().contains("distribution_seeding"), "{err}");
    assert!(!router.policy().distribution_seeding, "the old policy stays");
}

#[test]
fn smg_guards_are_cache_aware_only() {
    let router = fleet(2, PolicyConfig::projected(Mode::Enforce));
    let err = router.set_policy(PolicyConfig { smg_guards: true, ..router.policy() }).unwrap_err();
    assert!(err.to_string().contains("smg_guards belongs to the cache_aware policy"), "{err}");
    let guarded = PolicyConfig { smg_guards: true, ..PolicyConfig::new(PolicyName::CacheAware) };
    router.set_policy(guarded).unwrap();
    assert!(router.policy().smg_guards);
}

#[test]
fn reservations_move_to_decode_at_first_token_and_vanish_on_release() {
    let router = fleet(1, PolicyConfig::projected(Mode::Enforce));
    let req = Req::new(&router, 1, &tokens("p", 1000), 100);
    decide(&router, &req, T0);
    let s = router.worker_status(&wid(0), T0).unwrap();
    assert_eq!((s.waiting_requests, s.waiting_tokens, s.running_requests), (1, 1000, 0));
    router.first_token(req.id, Timestamp::from_millis(5)).unwrap();
    let s = router.worker_status(&wid(0), T0).unwrap();
    assert_eq!((s.waiting_tokens, s.running_requests, s.decode_tokens), (0, 1, 100));
    router.release(req.id, Timestamp::from_millis(9)).unwrap();
    let s = router.worker_status(&wid(0), T0).unwrap();
    assert!(s.reserved.is_zero(), "{s:?}");
    assert_eq!(router.in_flight(), 0);
    assert!(router.release(req.id, Timestamp::from_millis(9)).is_err());
}

#[test]
fn ineligible_workers_are_never_chosen_and_an_empty_fleet_says_so() {
    let router = fleet(3, PolicyConfig::projected(Mode::Enforce));
    router.set_eligible(&wid(0), false).unwrap();
    router.set_eligible(&wid(2), false).unwrap();
    for i in 0..5 {
        assert_eq!(decide(&router, &Req::new(&router, i, &tokens("x", 100), 1), T0).worker, wid(1));
    }
    router.set_eligible(&wid(1), false).unwrap();
    let req = Req::new(&router, 99, &tokens("x", 100), 1);
    assert_eq!(router.decide(&req.route(), T0, &mut rng()), Err(kvgate_core::DecideError::NoEligibleWorker));
}

#[test]
fn observed_slow_prefill_raises_a_worker_projected_wait() {
    let router = fleet(2, PolicyConfig::projected(Mode::Enforce));
    for i in 0..2 {
        router.update_load(&wid(i), busy(1, 10_000, 0, 0)).unwrap();
    }
    router.observe_rate(&wid(0), kvgate_core::RateKind::Prefill, 5_000.0, 1.0).unwrap();
    let d = decide(&router, &Req::new(&router, 1, &tokens("p", 100), 1), T0);
    assert_eq!(d.worker, wid(1));
    let w0 = d.scores.iter().find(|s| s.worker == wid(0)).unwrap();
    assert!((w0.wait_s - 2.0).abs() < 1e-9, "10,000 tokens at the observed 5,000 tok/s: {w0:?}");
}

#[test]
fn removing_a_worker_drops_its_reservations() {
    let router = fleet(2, PolicyConfig::projected(Mode::Enforce));
    let d = decide(&router, &Req::new(&router, 1, &tokens("p", 100), 1), T0);
    let dropped = router.remove_worker(&d.worker, Timestamp::ZERO).unwrap();
    assert_eq!(dropped, vec![d.request]);
    assert_eq!(router.in_flight(), 0);
    assert!(router.first_token(d.request, T0).is_err());
}

#[test]
fn hot_owner_is_credited_for_its_cache_and_still_loses() {
    let router = fleet(3, PolicyConfig::projected(Mode::Enforce));
    let prefix = make_hot_owner(&router);
    let d = decide(&router, &Req::new(&router, 1, &hot_prompt(&prefix, 1, 200), 256), T0);
    let owner = d.scores.iter().find(|s| s.worker == wid(0)).unwrap();
    assert_eq!(owner.cached_tokens, 8192);
    assert!((owner.wait_s - 45.78).abs() < 1e-9 && (owner.decode_s - 112.0 * 38.0 / 2_000.0).abs() < 1e-9, "{owner:?}");
    assert!((owner.prefill_s - 0.01).abs() < 1e-9, "only the 200-token suffix is prefilled");
    let winner = d.scores.iter().find(|s| s.worker == d.worker).unwrap();
    assert!((winner.prefill_s - 8392.0 / 20_000.0).abs() < 1e-9);
    assert!(winner.projected_s < 1.0 && owner.projected_s > 47.0);
}

#[test]
fn zero_block_size_is_rejected() {
    let err = kvgate_core::Router::new(0, PolicyConfig::default()).unwrap_err();
    assert!(err.to_string().contains("block_size"), "{err}");
}

/// Feeds a one-worker fleet a minute of its engine's KV event batches: steps of 40 ms plus their
/// prefill at `real_tps`, most storing a few blocks, every tenth a large prompt, every third pair
/// spanning a silent step; then decides one request.
fn calibrate_against(policy: PolicyConfig, real_tps: f64) -> kvgate_core::Decision {
    let router = fleet(1, policy);
    feed_steps(&router, real_tps);
    decide(&router, &Req::new(&router, 99, &tokens("last", 1000), 64), T0)
}

/// The KV event batches of [`calibrate_against`].
fn feed_steps(router: &kvgate_core::Router, real_tps: f64) {
    let block = router.block_size();
    let mut engine_s = 1_000.0;
    for i in 0..100u32 {
        let blocks = if i % 10 == 9 { 2_000 / block } else { 1 + i % 4 };
        let stored = KvEvent::BlockStored(BlockStored {
            block_hashes: (0..blocks).map(|b| EngineHash(u64::from(i) << 32 | u64::from(b))).collect(),
            block_size: block,
            ..BlockStored::default()
        });
        let silent_step = if i % 3 == 0 { 0.040 } else { 0.0 };
        engine_s += silent_step + 0.040 + f64::from(blocks * block) / real_tps;
        router.observe_engine_step(&wid(0), &[stored], engine_s, None, Timestamp::from_secs_f64(engine_s)).unwrap();
    }
}

#[test]
fn calibration_learns_a_worker_prefill_rate_and_decisions_show_the_rate_used() {
    let on = PolicyConfig { calibrate: true, ..PolicyConfig::projected(Mode::Enforce) };
    let d = calibrate_against(on, 8_000.0);
    let rate = d.scores[0].prefill_tokens_per_s;
    assert!((rate - 8_000.0).abs() < 200.0, "the 40 ms per step is not taken for a slow engine: {rate}");
    let off = calibrate_against(PolicyConfig::projected(Mode::Enforce), 8_000.0);
    assert_eq!(off.scores[0].prefill_tokens_per_s, 20_000.0, "calibration off plans with the configured rate");
}

#[test]
fn with_calibration_off_the_rate_is_measured_and_shown_but_not_planned_with() {
    let router = fleet(1, PolicyConfig::projected(Mode::Enforce));
    feed_steps(&router, 8_000.0);
    let status = router.worker_status(&wid(0), T0).unwrap();
    let measured = status.measured_prefill_tokens_per_s.expect("measured with calibration off");
    assert!((measured - 8_000.0).abs() < 200.0, "{measured}");
    assert_eq!(status.step_alignment, Some(kvgate_core::step_cadence::StepAlignment::AfterStep));
    assert_eq!(status.prefill_tokens_per_s, 20_000.0);
    let d = decide(&router, &Req::new(&router, 98, &tokens("before", 1000), 64), T0);
    assert_eq!(d.scores[0].prefill_tokens_per_s, 20_000.0);
    router.release(d.request, T0).unwrap();
    // Turned on, the next decision plans with what was measured meanwhile.
    router.set_policy(PolicyConfig { calibrate: true, ..router.policy() }).unwrap();
    let d = decide(&router, &Req::new(&router, 99, &tokens("after", 1000), 64), T0);
    assert_eq!(d.scores[0].prefill_tokens_per_s, measured);
    router.release(d.request, T0).unwrap();
    router.set_policy(PolicyConfig { calibrate: false, ..router.policy() }).unwrap();
    assert_eq!(router.worker_status(&wid(0), T0).unwrap().prefill_tokens_per_s, 20_000.0);
}

/// w0 decodes for 30 sequences and holds each prompt but its last 100 tokens just before it comes;
/// w1 is idle and holds nothing, and never shows a copy in its KV events. Requests for
/// `prompt_of(i)`, each decoding `max_tokens`, arrive every 100 ms and are released at once.
/// Returns each decision's (seconds since the first, worker, reason).
fn ten_a_second(
    policy: PolicyConfig,
    max_tokens: u64,
    prompt_of: impl Fn(u64) -> Vec<u32>,
) -> Vec<(f64, String, Reason)> {
    let router = fleet(2, policy);
    (0..200u64)
        .map(|i| {
            let now = Timestamp::from_millis(i * 100);
            router.update_load(&wid(0), LoadSnapshot { observed_at: now, ..busy(0, 0, 30, 9_000) }).unwrap();
            router.update_load(&wid(1), LoadSnapshot { observed_at: now, ..idle() }).unwrap();
            let prompt = prompt_of(i);
            store(&router, &wid(0), &prompt[..prompt.len() - 100]);
            let d = decide(&router, &Req::new(&router, i, &prompt, max_tokens), now);
            router.release(d.request, now).unwrap();
            (i as f64 / 10.0, d.worker.as_str().to_owned(), d.reason)
        })
        .collect()
}

fn first_copy(decisions: &[(f64, String, Reason)]) -> usize {
    decisions.iter().position(|d| d.2 == Reason::Replicate).expect("a copy within 20 s")
}

#[test]
fn a_prefix_asked_for_long_and_often_is_copied_to_the_idle_load_winner() {
    let prefix = tokens("shared system prompt", 8192);
    let decisions = ten_a_second(PolicyConfig::projected(Mode::Enforce), 64, |i| hot_prompt(&prefix, i, 100));
    // A copy costs this request 0.4 s of prefill. w0 runs (30 − 15) sequences more than the fleet's
    // mean, each 1 / 2,000 s of a step; a copy takes half of them off each later request's steps,
    // its first and its 64 decoding ones at weight 0.15: 7.5 ms / 2 × (1 + 0.15 × 64) = 40 ms.
    // At 10 a second, once the prefix has been hot for ~1 s.
    let copy = first_copy(&decisions);
    let (at, worker, _) = &decisions[copy];
    assert!((0.5..2.0).contains(at), "the first copy at {at} s");
    assert_eq!(worker, wid(1).as_str());
    assert!(
        decisions[..copy].iter().all(|d| d.1 == wid(0).as_str() && d.2 == Reason::CacheAndLoad),
        "before it pays, the holder serves: {decisions:?}"
    );
    // The copy is a holder while it computes the prompt (0.4 s, and a second for its KV events):
    // the next requests are not sent to make it again.
    let next_copy = copy + 1 + first_copy(&decisions[copy + 1..]);
    assert!(decisions[next_copy].0 - at > 1.3, "copied again at {} s: {decisions:?}", decisions[next_copy].0);
    // Turned off, the holder serves every request.
    let off = PolicyConfig { replication_horizon_s: 0.0, ..PolicyConfig::projected(Mode::Enforce) };
    let decisions = ten_a_second(off, 64, |i| hot_prompt(&prefix, i, 100));
    assert!(decisions.iter().all(|d| d.1 == wid(0).as_str()), "{decisions:?}");
}

#[test]
fn requests_that_decode_longer_make_a_copy_pay_sooner() {
    let prefix = tokens("shared system prompt", 8192);
    let at = |max_tokens| {
        let decisions =
            ten_a_second(PolicyConfig::projected(Mode::Enforce), max_tokens, |i| hot_prompt(&prefix, i, 100));
        decisions[first_copy(&decisions)].0
    };
    // Decoding one token, a later request rides about one crowded step: 7.5 ms / 2 × 1.15 saved
    // each, so the copy pays after ~9 s; decoding 256, after a fraction of a second.
    let (short, long) = (at(1), at(256));
    assert!((7.0..12.0).contains(&short), "one token: the first copy at {short} s");
    assert!(long < 1.0, "256 tokens: the first copy at {long} s");
}

#[test]
fn a_session_growing_its_own_prefix_is_never_taken_for_a_hot_one() {
    // Each request extends the one before it by a turn: its longest cached prefix is new every time.
    let history = tokens("one long session", 8192 + 200 * 128);
    let decisions =
        ten_a_second(PolicyConfig::projected(Mode::Enforce), 64, |i| history[..8192 + 128 * (i as usize + 1)].to_vec());
    assert!(decisions.iter().all(|d| d.1 == wid(0).as_str() && d.2 == Reason::CacheAndLoad), "{decisions:?}");
}
