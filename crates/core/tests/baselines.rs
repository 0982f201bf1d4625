//! The baseline policies users A/B against: round_robin, random and power_of_two, through the
//! router's public API.

mod support;

use std::collections::BTreeMap;

use kvgate_core::{PolicyConfig, PolicyName, Reason, WorkerId};
use rand::SeedableRng;
use support::*;

fn chosen(router: &kvgate_core::Router, id: u64, rng: &mut rand_chacha::ChaCha8Rng) -> WorkerId {
    let req = Req::new(router, id, &tokens(&format!("prompt {id}"), 64), 16);
    router.decide(&req.route(), T0, rng).unwrap().worker
}

#[test]
fn round_robin_takes_each_eligible_worker_in_turn_and_a_preview_does_not_use_a_turn() {
    let router = fleet(3, PolicyConfig::new(PolicyName::RoundRobin));
    // Load and cache mean nothing to it.
    router.update_load(&wid(0), busy(50, 100_000, 10, 5_000)).unwrap();
    let mut rng = rand_chacha::ChaCha8Rng::seed_from_u64(7);
    let probe = Req::new(&router, 999, &tokens("probe", 64), 16);
    let mut order = Vec::new();
    for i in 0..6 {
        let preview = router.preview(&probe.route(), T0, &mut rng).unwrap();
        let d = router.decide(&Req::new(&router, i, &tokens(&format!("p{i}"), 64), 16).route(), T0, &mut rng).unwrap();
        assert_eq!(preview.worker, d.worker, "the preview shows what the next request gets");
        assert_eq!(d.reason, Reason::Baseline(PolicyName::RoundRobin));
        assert_eq!(d.reason.as_str(), "round_robin");
        order.push(d.worker);
    }
    assert_eq!(order, [wid(0), wid(1), wid(2), wid(0), wid(1), wid(2)]);
    // An ineligible worker is skipped; the others keep taking turns.
    router.set_eligible(&wid(1), false).unwrap();
    let next: Vec<WorkerId> = (10..14).map(|i| chosen(&router, i, &mut rng)).collect();
    assert!(next.iter().all(|w| *w != wid(1)), "{next:?}");
    assert_ne!(next[0], next[1]);
    assert_ne!(next[1], next[2]);
}

#[test]
fn random_spreads_uniformly_whatever_the_load() {
    let router = fleet(4, PolicyConfig::new(PolicyName::Random));
    router.update_load(&wid(3), busy(80, 200_000, 20, 9_000)).unwrap();
    let mut rng = rand_chacha::ChaCha8Rng::seed_from_u64(11);
    let mut counts = BTreeMap::<WorkerId, u32>::new();
    for i in 0..4000 {
        *counts.entry(chosen(&router, i, &mut rng)).or_default() += 1;
    }
    assert_eq!(counts.len(), 4, "{counts:?}");
    // 1,000 expected each; 4 standard deviations is about 110.
    assert!(counts.values().all(|&n| (880..=1120).contains(&n)), "{counts:?}");
}

#[test]
fn power_of_two_never_picks_the_most_loaded_and_spreads_over_the_rest() {
    let router = fleet(4, PolicyConfig::new(PolicyName::PowerOfTwo));
    router.update_load(&wid(2), busy(40, 120_000, 12, 6_000)).unwrap();
    let mut rng = rand_chacha::ChaCha8Rng::seed_from_u64(3);
    let mut counts = BTreeMap::<WorkerId, u32>::new();
    for i in 0..600 {
        let w = chosen(&router, i, &mut rng);
        *counts.entry(w.clone()).or_default() += 1;
        // Release at once so that reservations do not change the picture.
        router.release(kvgate_core::RequestId(i), T0).unwrap();
    }
    assert!(!counts.contains_key(&wid(2)), "the loaded worker wins no pair: {counts:?}");
    assert_eq!(counts.len(), 3, "every idle worker wins some pairs: {counts:?}");
}

#[test]
fn a_baseline_runs_in_mode_off_only_and_is_named_in_errors() {
    for name in [PolicyName::RoundRobin, PolicyName::Random, PolicyName::PowerOfTwo] {
        assert_eq!(name.as_str().parse::<PolicyName>().unwrap(), name);
        let enforce = PolicyConfig { mode: kvgate_core::Mode::Enforce, ..PolicyConfig::new(name) };
        let err = enforce.validate().unwrap_err().to_string();
        assert!(err.contains("always runs in mode off"), "{err}");
    }
    let err = "round-robin".parse::<PolicyName>().unwrap_err().to_string();
    assert!(err.contains("round_robin, random, power_of_two"), "{err}");
}
