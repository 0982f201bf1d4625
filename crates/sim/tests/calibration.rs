//! Online calibration: the router's rates for an engine it was told the wrong speed of move toward
//! what the engine really does, from the first tokens and inter-token times it observes, within a
//! minute of traffic; with calibration off they stay as configured.

use kvgate_core::PolicyConfig;
use kvgate_engine_model::EngineProfile;
use kvgate_sim::policy::PolicySpec;
use kvgate_sim::workload::{self, WorkloadParams};
use kvgate_sim::SimConfig;

/// Engine 0's planned prefill rate after 60 s of multi-prefix traffic (seed `seed`), with engine 0
/// configured at `scale` × its real 20,000 tokens/s.
fn planned_prefill_of_first(scale: f64, calibrate: bool, seed: u64) -> f64 {
    let w = workload::multi_prefix(WorkloadParams { workers: None, rate: None, duration_s: Some(60.0), seed });
    let mut cfg = SimConfig::new(EngineProfile::large_moe_h200(), PolicySpec::parse("projected").unwrap(), seed);
    cfg.knobs = PolicyConfig { calibrate, ..PolicyConfig::default() };
    cfg.misconfigured_rate_scale = scale;
    let report = kvgate_sim::run(&w, cfg).unwrap();
    report.workers[0].planned_rates.expect("kvgate's policy reports its rates").0
}

/// The median over seeds 1 to 3 of engine 0's planned prefill rate: one seed's estimate is noisy
/// (docs/routing.md shows each).
fn median_planned_prefill_of_first(scale: f64) -> f64 {
    let mut rates: Vec<f64> = (1..=3).map(|seed| planned_prefill_of_first(scale, true, seed)).collect();
    rates.sort_by(f64::total_cmp);
    rates[1]
}

#[test]
fn an_engine_configured_three_times_too_slow_is_found_out_within_a_minute() {
    let real = EngineProfile::large_moe_h200().prefill_tokens_per_s;
    let planned = median_planned_prefill_of_first(1.0 / 3.0);
    assert!((planned - real).abs() < 0.25 * real, "planned {planned:.0} against the real {real:.0} tokens/s");
    assert!((planned_prefill_of_first(1.0 / 3.0, false, 1) - real / 3.0).abs() < 1.0, "calibration off");
}

#[test]
fn an_engine_configured_three_times_too_fast_moves_toward_its_real_rate() {
    let real = EngineProfile::large_moe_h200().prefill_tokens_per_s;
    let planned = median_planned_prefill_of_first(3.0);
    // While it looks fast it draws more traffic than the rest, and the queued prompts it shares with
    // each other turn out cached by the time they run, which makes it look faster than it is: after
    // a minute the median estimate has come down from 60,000, but not to 20,000 (43,789 here; the
    // three seeds in docs/routing.md). This is why calibration is not the default.
    assert!(planned < 3.0 * real, "planned {planned:.0}, configured {:.0}", 3.0 * real);
    assert_eq!(planned_prefill_of_first(3.0, false, 1), 3.0 * real, "calibration off");
}
