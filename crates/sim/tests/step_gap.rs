//! The engines' gap between steps: the host's time after a step before it plans the next.

use kvgate_core::Timestamp;
use kvgate_engine_model::{EngineProfile, StepGap};
use kvgate_sim::policy::PolicySpec;
use kvgate_sim::workload::{PromptSpec, Segment, SimRequest, Workload};
use kvgate_sim::{Report, SimConfig, SimError};

/// One request of `prompt` tokens asking for `output` tokens, alone on one engine.
fn lone_request(prompt: u32, output: u32) -> Workload {
    let request = SimRequest {
        arrival: Timestamp(1_000_000),
        prompt: PromptSpec { segments: vec![Segment { seed: 7, len: prompt }] },
        output_tokens: output,
        hot: false,
        direct_to: None,
        after: None,
        warm_up: false,
    };
    Workload { name: "lone".into(), workers: 1, requests: vec![request], hot_owner: None }
}

fn run(w: &Workload, gap: StepGap, seed: u64) -> Result<Report, SimError> {
    let profile = EngineProfile { step_gap: gap, ..EngineProfile::llama3_8b_h100() };
    let mut cfg = SimConfig::new(profile, PolicySpec::parse("round_robin").unwrap(), seed);
    cfg.per_request = true;
    kvgate_sim::run(w, cfg)
}

/// The lone request's TTFT and end to end, µs.
fn times(r: &Report) -> (i64, i64) {
    let row = &r.per_request[0];
    let micros = |s: Option<f64>| (s.unwrap() * 1e6).round() as i64;
    (micros(row.ttft_s), micros(row.e2e_s))
}

#[test]
fn a_fixed_gap_comes_between_every_two_steps_and_not_before_the_first() {
    let w = lone_request(1000, 21);
    let (ttft, e2e) = times(&run(&w, StepGap::NONE, 1).unwrap());
    let (gapped_ttft, gapped_e2e) = times(&run(&w, StepGap { median_ms: 5.0, p90_ms: 5.0 }, 1).unwrap());
    assert_eq!(gapped_ttft, ttft, "an idle engine starts the request at once");
    // The prefill step, then 20 decode steps: 20 gaps, none after the last step.
    assert!((gapped_e2e - e2e - 100_000).abs() <= 100, "{gapped_e2e} - {e2e}");
}

#[test]
fn drawn_gaps_average_the_lognormals_mean_and_repeat_with_the_seed() {
    let w = lone_request(100, 2001);
    let (_, e2e) = times(&run(&w, StepGap::NONE, 1).unwrap());
    let gap = StepGap { median_ms: 1.0, p90_ms: 3.0 };
    let (_, gapped) = times(&run(&w, gap, 1).unwrap());
    // sigma = ln 3 / 1.2816 = 0.857; the mean is exp(sigma² / 2) = 1.444 ms.
    let per_step_ms = (gapped - e2e) as f64 / 2000.0 / 1000.0;
    assert!((per_step_ms - 1.444).abs() < 0.1, "{per_step_ms} ms a step");
    assert_eq!(times(&run(&w, gap, 1).unwrap()), times(&run(&w, gap, 1).unwrap()));
    assert_ne!(times(&run(&w, gap, 1).unwrap()), times(&run(&w, gap, 2).unwrap()), "another seed, other gaps");
}

#[test]
fn a_profile_with_a_bad_gap_or_schedule_is_refused_with_the_reason() {
    let w = lone_request(100, 2);
    let Err(SimError::Config(why)) = run(&w, StepGap { median_ms: 2.0, p90_ms: 1.0 }, 1) else {
        panic!("a p90 under the median is refused");
    };
    assert!(why.contains("step_gap.p90_ms must be at least the median"), "{why}");
    let profile = EngineProfile { mixed_chunk: Some(false), ..EngineProfile::llama3_8b_h100() };
    let cfg = SimConfig::new(profile, PolicySpec::parse("round_robin").unwrap(), 1);
    let Err(SimError::Config(why)) = kvgate_sim::run(&w, cfg) else {
        panic!("vLLM without mixed chunks is refused");
    };
    assert!(why.contains("vLLM's scheduler always mixes"), "{why}");
}
