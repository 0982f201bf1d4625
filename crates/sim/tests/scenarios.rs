//! The simulator's claims, asserted on runs of the real core and engine model.

use std::path::PathBuf;

use kvgate_engine_model::EngineProfile;
use kvgate_sim::faults;
use kvgate_sim::policy::PolicySpec;
use kvgate_sim::workload::{self, Workload, WorkloadParams};
use kvgate_sim::{Report, SimConfig};

fn run_with(w: &Workload, policy: &str, seed: u64, tweak: impl Fn(&mut SimConfig)) -> Report {
    let mut cfg = SimConfig::new(EngineProfile::large_moe_h200(), PolicySpec::parse(policy).unwrap(), seed);
    tweak(&mut cfg);
    kvgate_sim::run(w, cfg).unwrap()
}

fn run(w: &Workload, policy: &str) -> Report {
    run_with(w, policy, 1, |_| {})
}

fn hot51(duration: f64) -> Workload {
    workload::hot_prefix_51(WorkloadParams { workers: None, rate: None, duration_s: Some(duration), seed: 1 })
}

fn multi(rate: f64, duration: f64) -> Workload {
    workload::multi_prefix(WorkloadParams { workers: None, rate: Some(rate), duration_s: Some(duration), seed: 1 })
}

fn with_fault(w: &Workload, policy: &str, fault: &str) -> Report {
    let start = w.requests.iter().find(|r| r.direct_to.is_none()).unwrap().arrival;
    let span = w.requests.last().unwrap().arrival.saturating_since(start);
    let f = faults::named(fault, w.hot_owner.unwrap_or(0), start, span).unwrap();
    run_with(w, policy, 1, |c| c.faults = vec![f.clone()])
}

fn spread(r: &Report) -> (f64, f64) {
    let counts: Vec<f64> = r.workers.iter().map(|w| w.requests as f64).collect();
    let mean = counts.iter().sum::<f64>() / counts.len() as f64;
    let min = counts.iter().cloned().fold(f64::MAX, f64::min);
    let max = counts.iter().cloned().fold(0.0, f64::max);
    (min / mean, max / mean)
}

#[test]
fn hot_prefix_51_projected_admits_everything_and_sends_hot_work_to_idle_peers() {
    let w = hot51(10.0);
    let projected = run(&w, "projected:enforce");
    assert_eq!(projected.requests.rejected, 0, "{:?}", projected.requests);
    assert_eq!(projected.requests.failed, 0);
    assert_eq!(projected.requests.completed, projected.requests.total);
    assert!(projected.hot_prefix.owner_share < 0.02, "{:?}", projected.hot_prefix);
    // The incident: cap-one seeding pins the hot prefix to its owner, whose queue makes admission
    // refuse the burst.
    let seeded = run(&w, "cache_aware_seeded");
    assert!(seeded.hot_prefix.owner_share > 0.99, "{:?}", seeded.hot_prefix);
    assert!(seeded.requests.rejected > seeded.requests.total / 2, "{:?}", seeded.requests);
    // Without admission control every request waits behind the owner's queue.
    let no_admission = |c: &mut SimConfig| c.admission_wait_s = 0.0;
    let seeded_all = run_with(&w, "cache_aware_seeded", 1, no_admission);
    let projected_all = run_with(&w, "projected:enforce", 1, no_admission);
    assert!(
        projected_all.ttft_s.p99 * 20.0 < seeded_all.ttft_s.p99,
        "{:?} vs {:?}",
        projected_all.ttft_s,
        seeded_all.ttft_s
    );
}

#[test]
fn projected_computes_fewer_prefill_tokens_than_least_load_at_equal_throughput() {
    let w = multi(50.0, 30.0);
    let ll = run(&w, "smg_least_load");
    let off = run(&w, "projected:off");
    let enforce = run(&w, "projected:enforce");
    for r in [&ll, &off, &enforce] {
        assert_eq!(r.requests.completed, r.requests.total, "{}: {:?}", r.label(), r.requests);
    }
    assert!(
        (enforce.cache.prefill_tokens_computed as f64) < 0.8 * ll.cache.prefill_tokens_computed as f64,
        "enforce {} vs least_load {}",
        enforce.cache.prefill_tokens_computed,
        ll.cache.prefill_tokens_computed
    );
    assert!(enforce.cache.prefill_tokens_computed < off.cache.prefill_tokens_computed);
    assert!(enforce.throughput.output_tokens_per_s >= 0.98 * ll.throughput.output_tokens_per_s);
    assert!(enforce.cache.hit_rate > ll.cache.hit_rate);
    // The fleets held about as much of each prompt at dispatch; least_load sent requests past it.
    let held = |r: &Report| r.cache.held_rate.expect("the simulator reads the engines' caches");
    assert!(held(&ll) - ll.cache.hit_rate > 0.03, "least_load: held {} hit {}", held(&ll), ll.cache.hit_rate);
    assert!(
        held(&enforce) - enforce.cache.hit_rate < 0.01,
        "enforce: held {} hit {}",
        held(&enforce),
        enforce.cache.hit_rate
    );
    assert!((held(&enforce) - held(&ll)).abs() < 0.02);
}

#[test]
fn shadow_dispatches_like_off_and_counts_disagreements() {
    let w = multi(40.0, 10.0);
    let off = run(&w, "projected:off");
    let shadow = run(&w, "projected:shadow");
    assert_eq!(off.workers, shadow.workers, "identical dispatch");
    assert_eq!(shadow.shadow.decisions, shadow.requests.total);
    assert!(shadow.shadow.disagreements > 0 && shadow.shadow.disagreements < shadow.shadow.decisions);
    assert_eq!(off.shadow.decisions, 0);
}

#[test]
fn lost_kv_events_fall_back_without_starving_or_flooding_any_worker() {
    let w = multi(50.0, 30.0);
    let lost = with_fault(&w, "projected:enforce", "kv-loss-no-replay");
    assert!(lost.kv.history_lost > 0);
    assert_eq!(lost.requests.completed, lost.requests.total);
    let load_only = lost.decisions_by_reason.get("load_only").copied().unwrap_or(0)
        + lost.decisions_by_reason.iter().filter(|(k, _)| k.starts_with("fallback:")).map(|(_, v)| v).sum::<u64>();
    assert!(load_only > lost.requests.total / 2, "{:?}", lost.decisions_by_reason);
    let (min, max) = spread(&lost);
    assert!(min > 0.7 && max < 1.3, "per-worker share {min:.2}..{max:.2}");
    // With the replay socket, gaps are filled and the cache keeps working.
    let replayed = with_fault(&w, "projected:enforce", "kv-loss");
    let clean = run(&w, "projected:enforce");
    assert!(replayed.kv.gaps > 0 && replayed.kv.history_lost == 0, "{:?}", replayed.kv);
    assert!(replayed.cache.hit_rate > lost.cache.hit_rate);
    assert!(replayed.cache.hit_rate > clean.cache.hit_rate - 0.02);
}

#[test]
fn delayed_kv_events_keep_their_order_and_everything_completes() {
    let w = multi(50.0, 20.0);
    let r = with_fault(&w, "projected:enforce", "kv-delay");
    assert_eq!(r.kv.gaps, 0);
    assert_eq!(r.requests.completed, r.requests.total);
    let (min, max) = spread(&r);
    assert!(min > 0.7 && max < 1.3, "per-worker share {min:.2}..{max:.2}");
}

#[test]
fn a_disconnected_engine_fails_its_in_flight_requests_and_gets_no_more() {
    let w = multi(50.0, 30.0);
    let r = with_fault(&w, "projected:enforce", "disconnect");
    assert!(r.requests.failed > 0, "in-flight requests fail");
    assert!(r.requests.failed < r.requests.total / 50, "then the router stops sending: {:?}", r.requests);
    assert_eq!(r.requests.completed + r.requests.failed, r.requests.total);
    // Against the same run without the fault (an engine that comes back idle draws more than its
    // share for a while, so the fleet's mean is not the yardstick).
    let target = r.workers[0].requests as f64;
    let undisturbed = run(&w, "projected:enforce").workers[0].requests as f64;
    assert!(target < 0.85 * undisturbed, "out for a third of the run: {target} requests against {undisturbed}");
}

#[test]
fn a_restarted_engine_gets_no_cache_credit_until_its_new_events_arrive() {
    let w = multi(50.0, 30.0);
    let r = with_fault(&w, "projected:enforce", "restart");
    assert_eq!(r.kv.restarts, 1);
    assert_eq!(r.kv.credit_while_untrusted, 0, "{:?}", r.kv);
    assert!(r.requests.failed > 0);
    let (min, _) = spread(&r);
    assert!(min > 0.5, "the restarted engine is used again");
}

#[test]
fn stale_telemetry_withholds_credit_from_that_engine_only() {
    let w = multi(50.0, 30.0);
    let r = with_fault(&w, "projected:enforce", "stale-telemetry");
    assert_eq!(r.kv.credit_while_untrusted, 0);
    assert_eq!(r.requests.completed, r.requests.total);
    let clean = run(&w, "projected:enforce");
    assert!(r.cache.hit_rate > clean.cache.hit_rate - 0.03, "one stale engine does not switch caching off");
}

#[test]
fn every_baseline_serves_the_multi_prefix_workload() {
    let w = multi(40.0, 10.0);
    for name in kvgate_sim::policy::POLICY_NAMES {
        let r = run(&w, name);
        assert_eq!(r.requests.failed, 0, "{name}");
        assert!(r.requests.completed + r.requests.rejected == r.requests.total, "{name}: {:?}", r.requests);
        assert!(r.requests.completed > 0, "{name}");
    }
}

#[test]
fn same_seed_gives_identical_reports_and_another_seed_does_not() {
    let w = multi(50.0, 10.0);
    let a = serde_json::to_string(&run_with(&w, "projected:enforce", 7, |c| {
        c.faults = vec![faults::Fault::KvLoss { probability: 0.1, replay: true }]
    }))
    .unwrap();
    let b = serde_json::to_string(&run_with(&w, "projected:enforce", 7, |c| {
        c.faults = vec![faults::Fault::KvLoss { probability: 0.1, replay: true }]
    }))
    .unwrap();
    assert_eq!(a, b);
    let c = serde_json::to_string(&run_with(&w, "projected:enforce", 8, |c| {
        c.faults = vec![faults::Fault::KvLoss { probability: 0.1, replay: true }]
    }))
    .unwrap();
    assert_ne!(a, c);
}

fn shared(path: &str) -> PathBuf {
    let p = PathBuf::from(env!("CARGO_MANIFEST_DIR")).join("../../../shared/data/traces").join(path);
    // CI always has ../shared: a missing trace fails the test instead of skipping it.
    assert!(p.exists(), "{} not found; the tests need ../shared/data beside the checkout", p.display());
    p
}

#[test]
fn mooncake_replay_shares_block_zero_and_projected_reuses_it() {
    let path = shared("mooncake_conversation_trace.jsonl");
    let w = workload::mooncake(&path, 16, 4.0, Some(400)).unwrap();
    assert_eq!(w.requests.len(), 400);
    assert!(w.requests.iter().all(|r| r.hot), "every request starts with hash id 0");
    let rr = run(&w, "round_robin");
    let projected = run(&w, "projected:enforce");
    assert_eq!(projected.requests.completed, 400);
    assert!(projected.cache.hit_rate > rr.cache.hit_rate, "{} vs {}", projected.cache.hit_rate, rr.cache.hit_rate);
    let (_, max) = spread(&projected);
    assert!(max < 2.5, "no single owner for the shared block: max/mean {max:.2}");
}

#[test]
fn azure_replay_is_load_only() {
    let path = shared("AzureLLMInferenceTrace_code.csv");
    let w = workload::azure(&path, 8, 1.0, Some(300)).unwrap();
    let r = run(&w, "projected:enforce");
    assert_eq!(r.requests.completed, 300);
    assert!(r.cache.hit_rate < 0.01);
}

#[test]
fn several_router_replicas_each_reserve_on_their_own_and_still_spread() {
    let w = hot51(10.0);
    let four = run_with(&w, "projected:enforce", 1, |c| c.replicas = 4);
    assert_eq!(four.requests.rejected, 0);
    assert!(four.hot_prefix.owner_share < 0.02, "{:?}", four.hot_prefix);
    let m = multi(50.0, 20.0);
    let one = run(&m, "projected:enforce");
    let eight = run_with(&m, "projected:enforce", 1, |c| c.replicas = 8);
    assert_eq!(eight.requests.completed, eight.requests.total);
    let (min, max) = spread(&eight);
    // The engines report what SGLang's /v1/loads does (counts and queued tokens, not the running
    // batch's work), so replicas that share nothing agree a little less than on exact state (which
    // gave 0.6..1.4).
    assert!(min > 0.45 && max < 1.5, "per-worker share {min:.2}..{max:.2}");
    // Replicas converge through telemetry; their private reservations cost a little reuse at most.
    assert!(eight.cache.hit_rate > one.cache.hit_rate - 0.03);
    let bad = kvgate_sim::run(&m, {
        let mut c = SimConfig::new(EngineProfile::large_moe_h200(), PolicySpec::parse("projected").unwrap(), 1);
        c.replicas = 0;
        c
    });
    assert!(bad.is_err());
}

#[test]
fn replicas_sharing_reservations_over_the_bus_decide_like_one() {
    let m = multi(50.0, 20.0);
    let sync = |c: &mut SimConfig| {
        c.replicas = 8;
        c.replica_sync = Some(kvgate_sim::bus::BusModel::default());
    };
    let one = run(&m, "projected:enforce");
    let blind = run_with(&m, "projected:enforce", 1, |c| c.replicas = 8);
    let shared = run_with(&m, "projected:enforce", 1, sync);
    assert_eq!(shared.requests.completed, shared.requests.total);
    eprintln!(
        "multi-prefix TTFT p90/p99: one {:.3}/{:.3}, 8 blind {:.3}/{:.3}, 8 sharing {:.3}/{:.3}",
        one.ttft_s.p90, one.ttft_s.p99, blind.ttft_s.p90, blind.ttft_s.p99, shared.ttft_s.p90, shared.ttft_s.p99
    );
    assert!(
        shared.ttft_s.p90 <= blind.ttft_s.p90,
        "sharing made p90 worse: {:?} against {:?}",
        shared.ttft_s,
        blind.ttft_s
    );
    assert!(shared.ttft_s.p90 <= one.ttft_s.p90 * 1.05, "8 sharing replicas {:?}, one {:?}", shared.ttft_s, one.ttft_s);
    // A lossy bus still converges: the periodic full state repairs what was lost.
    let lossy = run_with(&m, "projected:enforce", 1, |c| {
        sync(c);
        c.replica_sync = Some(kvgate_sim::bus::BusModel { loss: 0.2, ..Default::default() });
    });
    assert_eq!(lossy.requests.completed, lossy.requests.total);
    assert!(lossy.ttft_s.p90 <= blind.ttft_s.p90 * 1.05, "{:?} against {:?}", lossy.ttft_s, blind.ttft_s);
    let bad = kvgate_sim::run(&m, {
        let mut c = SimConfig::new(EngineProfile::large_moe_h200(), PolicySpec::parse("projected").unwrap(), 1);
        sync(&mut c);
        c.replica_sync = Some(kvgate_sim::bus::BusModel { loss: 1.5, ..Default::default() });
        c
    });
    assert!(bad.is_err());
}

#[test]
fn the_oracle_decides_on_true_load_even_when_no_report_is_fresh() {
    let m = multi(50.0, 20.0);
    // One load report a minute: the projected policy's reports go stale and it withholds credit;
    // the oracle is handed every engine's true load at each decision.
    // (The simulator's admission reads the polled reports alone, so it is off here.)
    let rare_polls = |c: &mut SimConfig| {
        c.poll_interval = std::time::Duration::from_secs(60);
        c.admission_wait_s = 0.0;
    };
    let projected = run_with(&m, "projected:enforce", 1, rare_polls);
    let oracle = run_with(&m, "oracle", 1, rare_polls);
    let fallbacks = |r: &Report| {
        r.decisions_by_reason.iter().filter(|(k, _)| k.starts_with("fallback")).map(|(_, v)| v).sum::<u64>()
    };
    assert!(fallbacks(&projected) > 0, "{:?}", projected.decisions_by_reason);
    assert_eq!(fallbacks(&oracle), 0, "{:?}", oracle.decisions_by_reason);
    assert_eq!(oracle.requests.completed, oracle.requests.total);
    // Exact load at every decision is worth something: the oracle bounds what better telemetry
    // could buy the projected policy (seen: p90 0.09 against 0.12 s on the default multi-prefix run).
    let plain = run(&m, "oracle");
    assert!(plain.ttft_s.p90 <= run(&m, "projected:enforce").ttft_s.p90, "{:?}", plain.ttft_s);
}

fn bursts(workers: usize, clients: usize, per_burst: usize, n: usize) -> Workload {
    workload::incident_bursts(workload::IncidentBursts {
        workers,
        prefix_tokens: 2048,
        question_tokens: 512,
        output_tokens: 64,
        clients,
        per_burst,
        bursts: n,
        settle: std::time::Duration::from_secs(1),
        seed: 1,
    })
}

#[test]
fn closed_loop_clients_wait_for_their_answers_and_every_burst_is_sent() {
    // One client: never two requests at once (one may wait out the step under way when it comes),
    // and the run lasts at least the sum of the answers and the settles between bursts.
    let one = run(&bursts(1, 1, 4, 2), "round_robin");
    assert_eq!((one.requests.total, one.requests.completed), (8, 8), "the warm-up is not reported: {:?}", one.requests);
    assert!(one.workers[0].max_waiting <= 1, "{:?}", one.workers);
    let span = one.throughput.requests_per_s.recip() * 8.0;
    assert!(span >= 8.0 * one.e2e_s.p50 * 0.9 + 1.0, "span {span} s, e2e p50 {} s", one.e2e_s.p50);
    // Sixteen clients on one engine: the engine never holds more than sixteen.
    let many = run(&bursts(1, 16, 48, 3), "round_robin");
    assert_eq!(many.requests.completed, 144, "{:?}", many.requests);
    assert!(many.workers[0].max_waiting <= 16, "{:?}", many.workers);
    // The incident: SMG's cache_aware (no spill at 16 clients on 4 engines) keeps every burst on
    // the owner; kvgate spreads it.
    let w = bursts(4, 16, 48, 3);
    let pinned = run(&w, "cache_aware");
    let spread = run(&w, "projected:enforce");
    assert!(pinned.hot_prefix.owner_share > 0.99, "{:?}", pinned.hot_prefix);
    assert!(spread.hot_prefix.owner_share < 0.5, "{:?}", spread.hot_prefix);
    assert!(spread.ttft_s.p90 < pinned.ttft_s.p90, "{:?} against {:?}", spread.ttft_s, pinned.ttft_s);
    // SMG 1.13 as shipped: its guards move part of each burst off the owner (overload protection
    // at 8 waiting, a spill margin of 4 at a mean of 4 in flight), so less stays there than without
    // them, and the owner's queue stays shorter.
    let guarded = run(&w, "smg_cache_aware");
    assert!(guarded.hot_prefix.owner_share < 0.9, "{:?}", guarded.hot_prefix);
    assert!(guarded.ttft_s.p90 < pinned.ttft_s.p90, "{:?} against {:?}", guarded.ttft_s, pinned.ttft_s);
    let peak = |r: &kvgate_sim::report::Report| r.workers.iter().map(|w| w.max_waiting).max().unwrap_or(0);
    assert!(peak(&guarded) < peak(&pinned), "{} against {}", peak(&guarded), peak(&pinned));
}

#[test]
fn a_run_asked_for_its_requests_lists_each_measured_one_consistently_with_its_percentiles() {
    let w = bursts(2, 4, 8, 2);
    let plain = run(&w, "projected:enforce");
    assert!(plain.per_request.is_empty(), "listed only when asked");
    let listed = run_with(&w, "projected:enforce", 1, |c| c.per_request = true);
    assert_eq!(listed.ttft_s, plain.ttft_s, "listing changes nothing of the run");
    let rows = &listed.per_request;
    // The warm-up (index 0) is not measured, so not listed; every burst request is, in order.
    assert_eq!(rows.iter().map(|r| r.index).collect::<Vec<_>>(), (1..=16).collect::<Vec<_>>());
    for r in rows {
        let (ttft, e2e) = (r.ttft_s.unwrap(), r.e2e_s.unwrap());
        assert!(ttft > 0.0 && ttft <= e2e, "{r:?}");
        assert!(r.worker.is_some_and(|w| w < 2) && r.cached_tokens <= r.prompt_tokens, "{r:?}");
    }
    // A burst's first client requests leave together; each later one after its client's answer.
    assert!(rows[..4].iter().all(|r| r.arrival_s == rows[0].arrival_s), "{:?}", &rows[..4]);
    // (Both figures are rounded to 0.1 ms.)
    assert!(rows[4].arrival_s >= rows[0].arrival_s + rows[0].e2e_s.unwrap() - 2e-4, "{:?}", &rows[..5]);
    let mut ttfts: Vec<f64> = rows.iter().filter_map(|r| r.ttft_s).collect();
    ttfts.sort_by(f64::total_cmp);
    assert_eq!(ttfts[ttfts.len() - 1], listed.ttft_s.p99, "the slowest of 16 is the p99");
}
