//! The engines' host delays: the gap after a step before the host plans the next, the intake from
//! a request reaching the engine to its scheduler taking it, and the ways there (dispatch) and back
//! (delivery).

use kvgate_core::Timestamp;
use kvgate_engine_model::{EngineProfile, HostDelay};
use kvgate_sim::faults::Fault;
use kvgate_sim::policy::PolicySpec;
use kvgate_sim::workload::{PromptSpec, Segment, SimRequest, Workload};
use kvgate_sim::{Report, SimConfig, SimError};

/// `count` requests of `prompt` tokens asking for `output` tokens, sent together to one engine.
fn together(count: u64, prompt: u32, output: u32) -> Workload {
    let requests = (0..count)
        .map(|i| SimRequest {
            arrival: Timestamp(1_000_000),
            prompt: PromptSpec { segments: vec![Segment { seed: 7 + i, len: prompt }] },
            output_tokens: output,
            hot: false,
            direct_to: None,
            after: None,
            warm_up: false,
        })
        .collect();
    Workload { name: "together".into(), workers: 1, requests, hot_owner: None }
}

/// One request of `prompt` tokens asking for `output` tokens, alone on one engine.
fn lone_request(prompt: u32, output: u32) -> Workload {
    together(1, prompt, output)
}

fn run_with(w: &Workload, profile: EngineProfile, seed: u64, faults: Vec<Fault>) -> Result<Report, SimError> {
    let mut cfg = SimConfig::new(profile, PolicySpec::parse("round_robin").unwrap(), seed);
    cfg.per_request = true;
    cfg.faults = faults;
    kvgate_sim::run(w, cfg)
}

fn run(w: &Workload, gap: HostDelay, seed: u64) -> Result<Report, SimError> {
    run_with(w, EngineProfile { step_gap: gap, ..EngineProfile::llama3_8b_h100() }, seed, Vec::new())
}

fn with_intake(intake: HostDelay) -> EngineProfile {
    EngineProfile { intake, ..EngineProfile::llama3_8b_h100() }
}

/// A request's TTFT and end to end, µs.
fn times_of(r: &Report, index: usize) -> (i64, i64) {
    let row = &r.per_request[index];
    let micros = |s: Option<f64>| (s.unwrap() * 1e6).round() as i64;
    (micros(row.ttft_s), micros(row.e2e_s))
}

/// The lone request's TTFT and end to end, µs.
fn times(r: &Report) -> (i64, i64) {
    times_of(r, 0)
}

#[test]
fn a_fixed_gap_comes_between_every_two_steps_and_not_before_the_first() {
    let w = lone_request(1000, 21);
    let (ttft, e2e) = times(&run(&w, HostDelay::NONE, 1).unwrap());
    let (gapped_ttft, gapped_e2e) = times(&run(&w, HostDelay { median_ms: 5.0, p90_ms: 5.0 }, 1).unwrap());
    assert_eq!(gapped_ttft, ttft, "an idle engine starts the request at once");
    // The prefill step, then 20 decode steps: 20 gaps, none after the last step.
    assert!((gapped_e2e - e2e - 100_000).abs() <= 100, "{gapped_e2e} - {e2e}");
}

#[test]
fn drawn_gaps_average_the_lognormals_mean_and_repeat_with_the_seed() {
    let w = lone_request(100, 2001);
    let (_, e2e) = times(&run(&w, HostDelay::NONE, 1).unwrap());
    let gap = HostDelay { median_ms: 1.0, p90_ms: 3.0 };
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
    let Err(SimError::Config(why)) = run(&w, HostDelay { median_ms: 2.0, p90_ms: 1.0 }, 1) else {
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

#[test]
fn a_fixed_intake_delays_a_lone_requests_first_token_by_exactly_it() {
    let w = lone_request(1000, 21);
    let (ttft, e2e) = times(&run_with(&w, with_intake(HostDelay::NONE), 1, Vec::new()).unwrap());
    let fixed = HostDelay { median_ms: 50.0, p90_ms: 50.0 };
    let (late_ttft, late_e2e) = times(&run_with(&w, with_intake(fixed), 1, Vec::new()).unwrap());
    assert_eq!(late_ttft - ttft, 50_000, "the scheduler takes the request 50 ms after it arrives");
    assert_eq!(late_e2e - e2e, 50_000, "and nothing after that changes");
}

#[test]
fn requests_sent_together_go_through_the_intake_one_at_a_time() {
    // Without an intake, the first request starts the idle engine's step alone and the other three
    // share the next step, so they see their first tokens together.
    let w = together(4, 500, 4);
    let ttfts = |r: &Report| (0..4).map(|i| times_of(r, i).0).collect::<Vec<_>>();
    let plain = ttfts(&run_with(&w, with_intake(HostDelay::NONE), 1, Vec::new()).unwrap());
    assert!(plain[1] == plain[2] && plain[2] == plain[3], "{plain:?}");
    // A fixed 50 ms intake, one request at a time: they reach the scheduler at 50, 100, 150 and
    // 200 ms, each after the one before has finished (a 21 ms prefill step and three decodes), so
    // each has the same step to its first token, 50 ms after the one before.
    let fixed = HostDelay { median_ms: 50.0, p90_ms: 50.0 };
    let serial = ttfts(&run_with(&w, with_intake(fixed), 1, Vec::new()).unwrap());
    for k in 0..4 {
        assert_eq!(serial[k] - plain[0], 50_000 * (k as i64 + 1), "request {k}: {serial:?} against {plain:?}");
    }
}

#[test]
fn drawn_intakes_spread_requests_sent_together_and_repeat_with_the_seed() {
    let w = together(4, 500, 4);
    let ttfts = |r: &Report| (0..4).map(|i| times_of(r, i).0).collect::<Vec<_>>();
    let drawn = HostDelay { median_ms: 20.0, p90_ms: 100.0 };
    let spread = ttfts(&run_with(&w, with_intake(drawn), 1, Vec::new()).unwrap());
    let mut distinct = spread.clone();
    distinct.sort_unstable();
    distinct.dedup();
    assert!(distinct.len() >= 3, "{spread:?}");
    assert_eq!(spread, ttfts(&run_with(&w, with_intake(drawn), 1, Vec::new()).unwrap()), "the same seed");
    assert_ne!(spread, ttfts(&run_with(&w, with_intake(drawn), 2, Vec::new()).unwrap()), "another seed");
}

#[test]
fn a_request_still_in_intake_when_its_engine_restarts_fails_and_is_not_lost() {
    let w = lone_request(1000, 21);
    let fixed = HostDelay { median_ms: 50.0, p90_ms: 50.0 };
    // The request arrives at 1 s and would reach the scheduler at 1.05 s; the engine restarts at
    // 1.02 s.
    let restart = vec![Fault::Restart { worker: 0, at: Timestamp(1_020_000) }];
    let r = run_with(&w, with_intake(fixed), 1, restart).unwrap();
    assert_eq!((r.requests.total, r.requests.failed, r.requests.completed), (1, 1, 0), "{:?}", r.requests);
    let Err(SimError::Config(why)) =
        run_with(&w, with_intake(HostDelay { median_ms: 9.0, p90_ms: 3.0 }), 1, Vec::new())
    else {
        panic!("an intake p90 under its median is refused");
    };
    assert!(why.contains("intake.p90_ms must be at least the median"), "{why}");
}

#[test]
fn the_oracle_counts_the_requests_in_an_engines_intake_as_the_engines() {
    // Engine 0 holds a 500-token prefix (a request placed on it directly); then four requests of
    // that prefix and 2,000 tokens of their own come at once, each reaching its scheduler 100 ms
    // after it is sent. Blind to the intake, the oracle would see engine 0 idle and cached for
    // every one of them; seeing the first ones waiting there, it spreads them.
    let request = |arrival: u64, seed: u64, direct_to: Option<usize>| SimRequest {
        arrival: Timestamp(arrival),
        prompt: PromptSpec { segments: vec![Segment { seed: 1, len: 500 }, Segment { seed, len: 2000 }] },
        output_tokens: 4,
        hot: false,
        direct_to,
        after: None,
        warm_up: false,
    };
    let mut requests = vec![request(0, 99, Some(0))];
    requests.extend((0..4).map(|i| request(1_000_000, 100 + i, None)));
    let w = Workload { name: "owner".into(), workers: 4, requests, hot_owner: None };
    let profile = with_intake(HostDelay { median_ms: 100.0, p90_ms: 100.0 });
    let cfg = SimConfig::new(profile, PolicySpec::parse("oracle").unwrap(), 1);
    let r = kvgate_sim::run(&w, cfg).unwrap();
    let routed: Vec<u64> = r.workers.iter().map(|w| w.requests).collect();
    assert!(routed.iter().all(|&n| n <= 2) && routed.iter().sum::<u64>() == 4, "{routed:?}");
}

fn with_travel(dispatch: HostDelay, intake: HostDelay, delivery: HostDelay) -> EngineProfile {
    EngineProfile { dispatch, intake, delivery, ..EngineProfile::llama3_8b_h100() }
}

#[test]
fn a_fixed_dispatch_and_delivery_add_exactly_themselves_to_a_lone_request() {
    let w = lone_request(1000, 21);
    let none = HostDelay::NONE;
    let (ttft, e2e) = times(&run_with(&w, with_travel(none, none, none), 1, Vec::new()).unwrap());
    let ms = |v: f64| HostDelay { median_ms: v, p90_ms: v };
    let (sent_ttft, sent_e2e) = times(&run_with(&w, with_travel(ms(7.0), none, none), 1, Vec::new()).unwrap());
    assert_eq!((sent_ttft - ttft, sent_e2e - e2e), (7_000, 7_000), "the engine takes it 7 ms after it is sent");
    let (back_ttft, back_e2e) = times(&run_with(&w, with_travel(none, none, ms(12.0)), 1, Vec::new()).unwrap());
    assert_eq!((back_ttft - ttft, back_e2e - e2e), (12_000, 12_000), "each token reaches the client 12 ms late");
    let all = with_travel(ms(7.0), ms(50.0), ms(12.0));
    let (all_ttft, all_e2e) = times(&run_with(&w, all.clone(), 1, Vec::new()).unwrap());
    assert_eq!((all_ttft - ttft, all_e2e - e2e), (69_000, 69_000), "the three add up");
    // The row cuts the TTFT where the request's first step begins: after the way there and the
    // intake, before the prefill and the way back.
    let row = &run_with(&w, all, 1, Vec::new()).unwrap().per_request[0];
    let first_step = (row.first_step_s.unwrap() * 1e6).round() as i64;
    assert_eq!(first_step, 57_000, "{row:?}");
    assert_eq!(all_ttft - first_step, ttft + 12_000, "the prefill step, then the delivery: {row:?}");
}

#[test]
fn requests_dispatched_together_reach_the_intake_together_and_leave_it_one_at_a_time() {
    let w = together(4, 500, 4);
    let ttfts = |r: &Report| (0..4).map(|i| times_of(r, i).0).collect::<Vec<_>>();
    let none = HostDelay::NONE;
    let plain = ttfts(&run_with(&w, with_travel(none, none, none), 1, Vec::new()).unwrap());
    let ms = |v: f64| HostDelay { median_ms: v, p90_ms: v };
    // All four reach the engine 10 ms after they are sent; the intake then takes 50 ms each.
    let serial = ttfts(&run_with(&w, with_travel(ms(10.0), ms(50.0), none), 1, Vec::new()).unwrap());
    for k in 0..4 {
        assert_eq!(serial[k] - plain[0], 10_000 + 50_000 * (k as i64 + 1), "request {k}: {serial:?}");
    }
}

#[test]
fn a_closed_loop_client_sends_its_next_request_once_the_last_token_has_reached_it() {
    // Two requests of one client, the second sent when the first has ended: the delivery of the
    // first's last token comes before the second leaves, so the second's arrival moves with it.
    let mut w = together(2, 500, 4);
    w.requests[1].after = Some(kvgate_sim::workload::After::Request { index: 0, gap: std::time::Duration::ZERO });
    let none = HostDelay::NONE;
    let arrivals = |r: &Report| (r.per_request[0].arrival_s, r.per_request[1].arrival_s);
    let (first, second) = arrivals(&run_with(&w, with_travel(none, none, none), 1, Vec::new()).unwrap());
    let delivery = HostDelay { median_ms: 12.0, p90_ms: 12.0 };
    let (late_first, late_second) = arrivals(&run_with(&w, with_travel(none, none, delivery), 1, Vec::new()).unwrap());
    assert_eq!(late_first, first);
    assert!(((late_second - second) - 0.012).abs() < 1e-9, "{late_second} against {second}");
}
