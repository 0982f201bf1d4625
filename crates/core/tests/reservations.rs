//! Atomic decision-time reservations: spreading under simultaneity, balance, eligibility.

mod support;

use std::collections::HashMap;
use std::sync::{Arc, Barrier};

use kvgate_core::router::Router;
use kvgate_core::{
    KvState, LoadSnapshot, Mode, PolicyConfig, PolicyName, RequestId, Timestamp, WorkerConfig, WorkerId,
};
use proptest::prelude::*;
use rand::SeedableRng;
use rand_chacha::ChaCha8Rng;
use support::*;

#[test]
fn simultaneous_identical_requests_spread_over_idle_workers() {
    let router = fleet(8, PolicyConfig::projected(Mode::Enforce));
    let prompt = tokens("identical", 4000);
    let mut per_worker: HashMap<WorkerId, usize> = HashMap::new();
    for i in 0..8 {
        let d = decide(&router, &Req::new(&router, i, &prompt, 100), T0);
        *per_worker.entry(d.worker).or_default() += 1;
    }
    assert_eq!(per_worker.len(), 8, "{per_worker:?}");
    assert!(per_worker.values().all(|&n| n == 1));
}

#[test]
fn simultaneous_identical_requests_from_many_threads_spread() {
    const THREADS: usize = 16;
    let router = Arc::new(fleet(THREADS, PolicyConfig::projected(Mode::Enforce)));
    let prompt = Arc::new(tokens("identical", 4000));
    let barrier = Arc::new(Barrier::new(THREADS));
    let handles: Vec<_> = (0..THREADS)
        .map(|t| {
            let (router, prompt, barrier) = (router.clone(), prompt.clone(), barrier.clone());
            std::thread::spawn(move || {
                let req = Req::new(&router, t as u64, &prompt, 100);
                let mut rng = ChaCha8Rng::seed_from_u64(t as u64);
                barrier.wait();
                router.decide(&req.route(), T0, &mut rng).unwrap().worker
            })
        })
        .collect();
    let mut per_worker: HashMap<WorkerId, usize> = HashMap::new();
    for h in handles {
        *per_worker.entry(h.join().unwrap()).or_default() += 1;
    }
    assert_eq!(per_worker.len(), THREADS, "every thread got its own idle worker: {per_worker:?}");
}

#[test]
fn identical_requests_for_a_cached_prefix_fill_the_owner_then_spill() {
    let router = fleet(4, PolicyConfig::projected(Mode::Enforce));
    let prefix = tokens("cached", 8000);
    store(&router, &wid(3), &prefix);
    let mut on_owner = 0;
    for i in 0..8 {
        let d = decide(&router, &Req::new(&router, i, &hot_prompt(&prefix, i, 16), 100), T0);
        on_owner += usize::from(d.worker == wid(3));
    }
    // Each reservation adds only the 16-token suffix to the owner's queue, so cache keeps winning:
    // saving 8,000 tokens (0.4 s) outweighs seven queued suffixes.
    assert_eq!(on_owner, 8);
    // A large uncached request queued ahead changes that.
    let big = Req::new(&router, 100, &tokens("big", 20_000), 1);
    let d = router.decide(&big.route(), T0, &mut rng()).unwrap();
    assert_ne!(d.worker, wid(3));
}

#[derive(Debug, Clone)]
enum Step {
    Decide { prompt: u8, len: u16, max_tokens: u16 },
    FirstToken { nth: u8 },
    Release { nth: u8 },
    Snapshot { worker: u8, waiting: u8 },
    Eligible { worker: u8, on: bool },
    Advance { ms: u16 },
}

fn step() -> impl Strategy<Value = Step> {
    prop_oneof![
        5 => (0..3u8, 1..600u16, 0..200u16).prop_map(|(prompt, len, max_tokens)| Step::Decide { prompt, len, max_tokens }),
        3 => any::<u8>().prop_map(|nth| Step::FirstToken { nth }),
        3 => any::<u8>().prop_map(|nth| Step::Release { nth }),
        2 => (0..4u8, 0..20u8).prop_map(|(worker, waiting)| Step::Snapshot { worker, waiting }),
        1 => (0..4u8, any::<bool>()).prop_map(|(worker, on)| Step::Eligible { worker, on }),
        2 => (0..3000u16).prop_map(|ms| Step::Advance { ms }),
    ]
}

proptest! {
    #![proptest_config(ProptestConfig { cases: 128, ..ProptestConfig::default() })]

    #[test]
    fn reservations_return_to_zero_and_no_decision_picks_an_ineligible_worker(
        steps in proptest::collection::vec(step(), 1..120),
        policy in prop_oneof![Just(PolicyName::Projected), Just(PolicyName::LeastLoad), Just(PolicyName::CacheAware)],
        seed in any::<u64>(),
    ) {
        let router = fleet(4, PolicyConfig::new(policy));
        let prefixes: Vec<Vec<u32>> = (0..3).map(|i| tokens(&format!("prefix-{i}"), 1024)).collect();
        store(&router, &wid(0), &prefixes[0]);
        store(&router, &wid(1), &prefixes[1]);
        let mut rng = ChaCha8Rng::seed_from_u64(seed);
        let mut now = Timestamp::ZERO;
        let mut open: Vec<RequestId> = Vec::new();
        let mut eligible = [true; 4];
        let mut next_id = 0;
        for s in &steps {
            match *s {
                Step::Decide { prompt, len, max_tokens } => {
                    let mut p = prefixes[prompt as usize][..len.min(1024) as usize].to_vec();
                    p.extend(tokens(&format!("s{next_id}"), 10));
                    let req = Req::new(&router, next_id, &p, max_tokens as u64);
                    next_id += 1;
                    match router.decide(&req.route(), now, &mut rng) {
                        Ok(d) => {
                            let i: usize = d.worker.as_str()[1..].parse().unwrap();
                            prop_assert!(eligible[i], "picked ineligible {}", d.worker);
                            prop_assert!(d.scores.iter().all(|s| eligible[s.worker.as_str()[1..].parse::<usize>().unwrap()]));
                            open.push(d.request);
                        }
                        Err(kvgate_core::DecideError::NoEligibleWorker) => prop_assert!(eligible.iter().all(|e| !e)),
                        Err(e) => prop_assert!(false, "{}", e),
                    }
                }
                Step::FirstToken { nth } if !open.is_empty() => {
                    let id = open[nth as usize % open.len()];
                    router.first_token(id, now).unwrap();
                }
                Step::Release { nth } if !open.is_empty() => {
                    let id = open.swap_remove(nth as usize % open.len());
                    router.release(id, now).unwrap();
                }
                Step::Snapshot { worker, waiting } => {
                    let snap = LoadSnapshot { waiting_requests: waiting as u64, waiting_tokens: waiting as u64 * 500, observed_at: now, ..LoadSnapshot::default() };
                    router.update_load(&wid(worker as usize), snap).unwrap();
                }
                Step::Eligible { worker, on } => {
                    eligible[worker as usize] = on;
                    router.set_eligible(&wid(worker as usize), on).unwrap();
                }
                Step::Advance { ms } => now = now.saturating_add(std::time::Duration::from_millis(ms as u64)),
                _ => {}
            }
        }
        for id in open.drain(..) {
            router.release(id, now).unwrap();
        }
        prop_assert_eq!(router.in_flight(), 0);
        // A fresh report from every worker absorbs what the old ones still showed for finished work.
        now = now.saturating_add(std::time::Duration::from_millis(1));
        for w in 0..4 {
            router.update_load(&wid(w), LoadSnapshot { observed_at: now, ..LoadSnapshot::default() }).unwrap();
        }
        for status in router.workers(now) {
            prop_assert!(status.reserved.is_zero(), "{:?}", status);
            prop_assert_eq!(status.in_flight, 0);
            prop_assert_eq!((status.waiting_requests, status.running_requests, status.decode_tokens), (0, 0, 0));
        }
    }
}

#[test]
fn fresher_telemetry_absorbs_reservations_without_double_counting() {
    let router = fleet(1, PolicyConfig::projected(Mode::Enforce));
    let req = Req::new(&router, 1, &tokens("p", 3000), 100);
    decide(&router, &req, Timestamp::from_millis(10));
    let status = router.worker_status(&wid(0), Timestamp::from_millis(10)).unwrap();
    assert_eq!((status.waiting_requests, status.waiting_tokens), (1, 3000));
    // The engine's next report (measured after the dispatch) already counts the request.
    let seen = LoadSnapshot {
        waiting_requests: 1,
        waiting_tokens: 3000,
        observed_at: Timestamp::from_millis(20),
        ..LoadSnapshot::default()
    };
    router.update_load(&wid(0), seen).unwrap();
    let status = router.worker_status(&wid(0), Timestamp::from_millis(20)).unwrap();
    assert_eq!((status.waiting_requests, status.waiting_tokens), (1, 3000), "counted once, not twice");
    // First token: the report still says waiting, the ledger moves the request to decode.
    router.first_token(req.id, Timestamp::from_millis(30)).unwrap();
    let status = router.worker_status(&wid(0), Timestamp::from_millis(30)).unwrap();
    assert_eq!((status.waiting_requests, status.running_requests, status.decode_tokens), (0, 1, 100));
    // Finished: gone at once, though the last report still shows it waiting.
    router.release(req.id, Timestamp::from_millis(40)).unwrap();
    let status = router.worker_status(&wid(0), Timestamp::from_millis(40)).unwrap();
    assert_eq!((status.waiting_requests, status.running_requests), (0, 0));
    // An older report arriving late changes nothing.
    router
        .update_load(
            &wid(0),
            LoadSnapshot { waiting_requests: 50, observed_at: Timestamp::from_millis(5), ..LoadSnapshot::default() },
        )
        .unwrap();
    assert_eq!(router.worker_status(&wid(0), Timestamp::from_millis(40)).unwrap().waiting_requests, 0);
}

#[test]
fn a_count_only_report_keeps_the_prefill_of_requests_it_shows_as_running() {
    let router = fleet(1, PolicyConfig::projected(Mode::Enforce));
    let req = Req::new(&router, 1, &tokens("p", 3000), 100);
    decide(&router, &req, Timestamp::from_millis(10));
    // vLLM admits it at once and reports one running request; the gateway can only estimate its
    // work from the count (here 32 decode tokens a running request).
    let estimate = kvgate_core::CountEstimate { prompt_tokens_per_waiting: Some(1024), decode_tokens_per_running: 32 };
    let running = LoadSnapshot {
        running_requests: 1,
        active_decode_tokens: 32,
        observed_at: Timestamp::from_millis(20),
        estimated: Some(estimate),
        max_running_requests: None,
        ..LoadSnapshot::default()
    };
    router.update_load(&wid(0), running).unwrap();
    let status = router.worker_status(&wid(0), Timestamp::from_millis(20)).unwrap();
    assert_eq!(status.waiting_tokens, 3000, "its prefill still lies ahead, whatever the count says");
    assert_eq!(status.decode_tokens, 0, "and it is not decoding yet");
    // Queued instead: the per-waiting estimate is replaced by its real prefill.
    let queued = LoadSnapshot { waiting_requests: 1, waiting_tokens: 1024, ..running };
    let queued = LoadSnapshot { running_requests: 0, active_decode_tokens: 0, ..queued };
    router.update_load(&wid(0), LoadSnapshot { observed_at: Timestamp::from_millis(25), ..queued }).unwrap();
    let status = router.worker_status(&wid(0), Timestamp::from_millis(25)).unwrap();
    assert_eq!((status.waiting_requests, status.waiting_tokens), (1, 3000));
    // After its first token the report's own estimate takes over again.
    router.first_token(req.id, Timestamp::from_millis(30)).unwrap();
    router.update_load(&wid(0), LoadSnapshot { observed_at: Timestamp::from_millis(40), ..running }).unwrap();
    let status = router.worker_status(&wid(0), Timestamp::from_millis(40)).unwrap();
    assert_eq!((status.waiting_tokens, status.decode_tokens), (0, 32));
    // An exact report (the simulator's) is trusted as it is.
    let req2 = Req::new(&router, 2, &tokens("q", 3000), 100);
    decide(&router, &req2, Timestamp::from_millis(50));
    let exact = LoadSnapshot { estimated: None, observed_at: Timestamp::from_millis(60), ..running };
    router.update_load(&wid(0), exact).unwrap();
    let status = router.worker_status(&wid(0), Timestamp::from_millis(60)).unwrap();
    assert_eq!(status.waiting_tokens, 0, "an exact report that shows no prefill is believed");
}

#[test]
fn preview_decides_without_reserving() {
    let router = fleet(2, PolicyConfig::projected(Mode::Enforce));
    let req = Req::new(&router, 1, &tokens("p", 3000), 100);
    let a = router.preview(&req.route(), T0, &mut rng()).unwrap();
    let b = router.preview(&req.route(), T0, &mut rng()).unwrap();
    assert_eq!(a, b, "nothing changed between the two previews");
    assert_eq!(router.in_flight(), 0);
    assert!(router.workers(T0).iter().all(|w| w.reserved.is_zero()));
    let d = decide(&router, &req, T0);
    assert_eq!(d.worker, a.worker);
    assert_eq!(router.in_flight(), 1);
}

#[test]
fn requests_of_one_prefix_in_flight_on_a_worker_count_its_blocks_once_in_its_kv() {
    // A prefix nobody holds yet, sent to a worker whose KV has room for it about twice over. The
    // engine shares the prefix's blocks between the requests carrying it, so the second request
    // adds only its own tail to the projected KV: no pressure, where counting the prefix twice
    // would put the worker past the barrier's threshold. It is no saved prefill: nothing is credited
    // as cached until the events show it.
    let router = Router::new(BLOCK, PolicyConfig::projected(Mode::Enforce)).unwrap();
    for i in 0..2 {
        let config = WorkerConfig { kv_capacity_tokens: 10_000, ..WorkerConfig::new(wid(i)) };
        router.add_worker(config, KvState::Synced).unwrap();
        router.update_load(&wid(i), idle()).unwrap();
    }
    let prefix = tokens("not yet cached", 4000);
    let first = decide(&router, &Req::new(&router, 0, &hot_prompt(&prefix, 0, 500), 100), T0);
    let second = decide(&router, &Req::new(&router, 1, &hot_prompt(&prefix, 1, 500), 100), T0);
    let on_first = second.scores.iter().find(|s| s.worker == first.worker).unwrap();
    assert_eq!(on_first.barrier_s, 0.0, "4,600 + 600 of 10,000 tokens: {on_first:?}");
    assert!(second.scores.iter().all(|s| s.cached_tokens == 0), "{:?}", second.scores);
    // Another worker's requests, or a request that has ended, share nothing.
    router.release(first.request, T0).unwrap();
    router.release(second.request, T0).unwrap();
    let busy = decide(&router, &Req::new(&router, 2, &tokens("another prompt", 4500), 100), T0);
    let third = decide(&router, &Req::new(&router, 3, &hot_prompt(&prefix, 3, 500), 100), T0);
    let on_busy = third.scores.iter().find(|s| s.worker == busy.worker).unwrap();
    assert!(on_busy.barrier_s > 0.0, "4,600 + 4,600 of 10,000 tokens: {on_busy:?}");
}
