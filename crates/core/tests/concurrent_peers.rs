//! Replicas whose requests arrive in the same instants: how they measure it, stagger and spread.

mod support;

use std::time::Duration;

use kvgate_core::policy::projected::SPREAD_TOLERANCE;
use kvgate_core::{Decision, Mode, PolicyConfig, Reason, ReplicaId, Router, Timestamp};
use proptest::prelude::*;
use support::*;

const STAGGER: Duration = Duration::from_millis(10);

fn at_ms(ms: u64) -> Timestamp {
    Timestamp(ms * 1000)
}

/// Three replicas of a six-worker fleet, sharing reservations, with a short prefix of every prompt
/// cached on worker 0: the best worker for every request by a little, at every replica.
fn replicas() -> Vec<Router> {
    (0..3)
        .map(|_| {
            let r = fleet(6, PolicyConfig::projected(Mode::Enforce));
            r.share_reservations(true);
            store(&r, &wid(0), &prefix());
            r
        })
        .collect()
}

fn prefix() -> Vec<u32> {
    tokens("shared system prompt", 64)
}

/// One request reaches each replica at `now`; all three decide before the bus carries any of
/// their reservations (a 1 ms hop), and every request is done 50 ms later.
fn tick(replicas: &[Router], tick: u64) -> Vec<Decision> {
    let now = at_ms(tick * 100);
    let decisions: Vec<Decision> = replicas
        .iter()
        .enumerate()
        .map(|(r, router)| {
            router.arrived(now, STAGGER, tick);
            let id = tick * 10 + r as u64;
            let prompt = hot_prompt(&prefix(), id, 4000);
            // Each replica draws from its own randomness.
            let mut rng = <rand_chacha::ChaCha8Rng as rand::SeedableRng>::seed_from_u64(id);
            router.decide(&Req::new(router, id, &prompt, 100).route(), now, &mut rng).unwrap()
        })
        .collect();
    deliver(replicas, at_ms(tick * 100 + 1));
    for (router, d) in replicas.iter().zip(&decisions) {
        router.release(d.request, at_ms(tick * 100 + 50)).unwrap();
    }
    deliver(replicas, at_ms(tick * 100 + 51));
    decisions
}

/// Every replica's queued changes, applied by the others at `now`.
fn deliver(replicas: &[Router], now: Timestamp) {
    let changes: Vec<_> = replicas.iter().map(Router::take_reservation_changes).collect();
    for (from, batch) in changes.iter().enumerate() {
        for (to, router) in replicas.iter().enumerate() {
            if to != from && !batch.is_empty() {
                router.apply_peer_changes(&ReplicaId::new(format!("r{from}")), batch, now);
            }
        }
    }
}

#[test]
fn replicas_deciding_in_the_same_instants_learn_it_then_stagger_and_spread() {
    let replicas = replicas();
    let first = tick(&replicas, 0);
    assert!(
        first.iter().all(|d| d.worker == wid(0) && d.reason == Reason::CacheAndLoad),
        "blind and not yet knowing it, every replica chooses the owner: {first:?}"
    );
    for t in 1..40 {
        tick(&replicas, t);
    }
    for router in &replicas {
        let peers = router.concurrent_peers();
        assert!(peers.in_step, "two peers' requests in each instant, ten instants a second: {peers:?}");
        // An average over about the last 20 requests, nearing the two peers from below.
        let near_two = |x: f64| (1.6..=2.0).contains(&x);
        assert!(near_two(peers.unseen) && near_two(peers.coinciding), "{peers:?}");
        let (wait, _) = router.arrived(at_ms(4000), STAGGER, u64::MAX / 2);
        assert!((wait.as_secs_f64() - 0.005).abs() < 1e-6, "half the stagger for a middle draw: {wait:?}");
    }
    let later: Vec<Vec<Decision>> = (40..80).map(|t| tick(&replicas, t)).collect();
    let herded = later.iter().filter(|ds| ds.iter().all(|d| d.worker == ds[0].worker)).count();
    let spread = later.iter().flatten().filter(|d| d.reason == Reason::Spread).count();
    assert!(herded <= 8, "{herded} of 40 instants still sent all three requests to one worker");
    assert!(spread > 0, "some decisions leave the best worker for a near-tie");
}

#[test]
fn a_lone_replica_never_staggers_nor_spreads() {
    let router = fleet(6, PolicyConfig::projected(Mode::Enforce));
    router.share_reservations(true);
    store(&router, &wid(0), &prefix());
    for i in 0..200u64 {
        let now = at_ms(i);
        let (wait, peers) = router.arrived(now, STAGGER, u64::MAX / 2);
        assert_eq!((wait, peers.unseen, peers.in_step), (Duration::ZERO, 0.0, false));
        let prompt = hot_prompt(&prefix(), i, 4000);
        let d = decide(&router, &Req::new(&router, i, &prompt, 100), now);
        assert_ne!(d.reason, Reason::Spread);
        router.release(d.request, now).unwrap();
    }
}

proptest! {
    #![proptest_config(ProptestConfig::with_cases(64))]

    /// Whatever the loads and however many peers decide blind, a spread decision costs at most the
    /// tolerance above the best worker's, and without blind peers the best worker is chosen.
    #[test]
    fn a_spread_never_goes_past_the_tolerance(
        waiting_tokens in proptest::collection::vec(0u64..40_000, 6),
        peers_per_instant in 0u32..6,
        seed in any::<u64>(),
    ) {
        let router = fleet(6, PolicyConfig::projected(Mode::Enforce));
        router.share_reservations(true);
        store(&router, &wid(0), &prefix());
        for (i, &w) in waiting_tokens.iter().enumerate() {
            router.update_load(&wid(i), busy(w / 4000, w, 0, 0)).unwrap();
        }
        // Peers' reservations heard within the window after each of 60 decisions here.
        let peer = ReplicaId::new("peer");
        for i in 0..60u64 {
            let now = at_ms(i * 100);
            let d = decide(&router, &Req::new(&router, 1000 + i, &tokens(&format!("warm {i}"), 64), 1), now);
            router.release(d.request, now).unwrap();
            let _ = router.take_reservation_changes();
            if peers_per_instant > 0 {
                // Reservations that end at once: counted, and leaving no load behind.
                let reserved: Vec<_> = (0..peers_per_instant)
                    .map(|p| kvgate_core::ReservationChange::Reserved {
                        request: kvgate_core::RequestId(i * 100 + u64::from(p)),
                        worker: wid(p as usize % 6),
                        work: kvgate_core::ledger::Work { prefill_tokens: 0, decode_tokens: 0, kv_tokens: 0 },
                    })
                    .collect();
                router.apply_peer_changes(&peer, &reserved, at_ms(i * 100 + 1));
                let released: Vec<_> = (0..peers_per_instant)
                    .map(|p| kvgate_core::ReservationChange::Released { request: kvgate_core::RequestId(i * 100 + u64::from(p)) })
                    .collect();
                router.apply_peer_changes(&peer, &released, at_ms(i * 100 + 2));
            }
        }
        let k = router.concurrent_peers().unseen;
        let prompt = hot_prompt(&prefix(), 7, 4000);
        let req = Req::new(&router, 1, &prompt, 100);
        let d = router.decide(&req.route(), at_ms(6000), &mut <rand_chacha::ChaCha8Rng as rand::SeedableRng>::seed_from_u64(seed)).unwrap();
        let best = d.scores.iter().min_by(|a, b| a.cost_s.total_cmp(&b.cost_s)).unwrap();
        let chosen = d.scores.iter().find(|s| s.worker == d.worker).unwrap();
        if k < kvgate_core::concurrent_peers::CONCURRENT_MIN {
            prop_assert_ne!(d.reason, Reason::Spread);
            if d.reason == Reason::CacheAndLoad {
                prop_assert!(chosen.cost_s <= best.cost_s + 1e-9, "{k} {d:?}");
            }
        } else if d.reason == Reason::Spread {
            prop_assert!(chosen.cost_s <= best.cost_s + SPREAD_TOLERANCE * k * best.prefill_s + 1e-9, "{k} {d:?}");
        }
    }
}
