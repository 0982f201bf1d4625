//! The real-engine suite: kvgate in front of three real vLLM engines on the CPU.
//!
//! One fleet serves every trial (vLLM takes tens of seconds to start), so trials run one at a time
//! and each uses prompts of its own. The fleet:
//! - `a`: binds its KV-event socket (`tcp://*:P`); 8 MiB of KV (16,384 tokens).
//! - `b`: connects its KV-event socket to kvgate (`tcp://127.0.0.1:P`); 8 MiB of KV.
//! - `c`: binds; 1 MiB of KV (2,048 tokens, 64 blocks), small enough to queue and evict.
//!
//! Needs `scripts/real-engines/setup.sh` (vLLM in a venv and the tiny model); fails saying so
//! otherwise. `scripts/real-engines/test.sh` does the set-up and runs this.

// Real engines run in real time: the suite waits on the wall clock.
#![allow(clippy::disallowed_methods)]

use std::process::ExitCode;
use std::sync::Arc;
use std::time::Duration;

use libtest_mimic::{Arguments, Failed, Trial};

mod real {
    pub mod cache;
    pub mod calibration;
    pub mod demo;
    pub mod occupancy;
    pub mod parity;
    pub mod responses;
    pub mod restart;
    pub mod routing;
    pub mod streaming;
}

use kvgate_real_engines::fleet::{EngineSpec, Fleet, BYTES_PER_TOKEN};

/// Longest a trial may run before it fails (the engines share 2 cores).
const TRIAL_TIMEOUT: Duration = Duration::from_secs(300);
/// Longest the fleet may take to start.
const FLEET_START: Duration = Duration::from_secs(420);

type TrialFn = fn(Arc<Fleet>) -> std::pin::Pin<Box<dyn std::future::Future<Output = anyhow::Result<()>> + Send>>;

macro_rules! trials {
    ($($path:path),* $(,)?) => {
        vec![$((stringify!($path).rsplit("::").next().unwrap_or("").trim(), (|f| Box::pin($path(f))) as TrialFn)),*]
    };
}

fn main() -> ExitCode {
    let mut args = Arguments::from_args();
    // One fleet, shared: trials take turns.
    args.test_threads = Some(1);
    let list: Vec<(&str, TrialFn)> = trials![
        real::parity::chat_and_completion_token_ids_match_the_engines_own,
        real::responses::the_responses_api_prompt_is_the_one_the_engine_runs,
        real::cache::the_block_size_is_read_from_the_engine_and_a_mismatch_is_invalid,
        real::cache::kv_events_arrive_in_both_socket_roles,
        real::cache::cache_credit_equals_the_engines_own_prefix_cache_hits,
        real::streaming::streaming_through_kvgate_is_byte_for_byte_what_the_engine_sent,
        real::routing::a_prefix_follows_its_idle_owner_and_a_burst_spreads_to_peers_that_become_owners,
        real::routing::a_prefix_asked_for_steadily_is_copied_to_an_idle_peer_that_then_holds_it,
        real::cache::eviction_shrinks_credit_with_the_engines_block_removed_events,
        real::cache::a_prefix_cache_reset_clears_credit_through_all_blocks_cleared,
        real::demo::the_demo_runs_on_real_engines_and_reuses_their_caches,
        real::calibration::the_prefill_rate_is_measured_from_the_engines_own_step_cadence,
        real::calibration::the_decode_rate_is_measured_from_the_engines_decode_filled_blocks,
        real::occupancy::a_running_batch_delays_a_new_prompt_by_its_steps_not_by_its_drain,
        real::restart::an_engine_killed_mid_stream_is_marked_down_and_its_credit_rebuilt_from_zero,
    ];
    if args.list {
        let trials = list.iter().map(|(name, _)| Trial::test(*name, || Ok(()))).collect();
        return libtest_mimic::run(&args, trials).exit_code();
    }
    let runtime = Arc::new(tokio::runtime::Builder::new_multi_thread().worker_threads(2).enable_all().build().unwrap());
    let specs = vec![
        EngineSpec::new("a", 16_384 * BYTES_PER_TOKEN),
        EngineSpec::new("b", 16_384 * BYTES_PER_TOKEN).connecting(),
        EngineSpec::new("c", 2_048 * BYTES_PER_TOKEN),
    ];
    eprintln!("starting 3 real vLLM engines (about a minute on 2 cores)...");
    let started = std::time::Instant::now();
    let fleet = match Fleet::start(specs, FLEET_START) {
        Ok(f) => Arc::new(f),
        Err(e) => {
            let message = format!("{e:#}");
            // Said here too: a name filter would hide the failing trial.
            eprintln!("the real fleet did not start: {message}");
            let trial = Trial::test("the_real_fleet_starts", move || Err(Failed::from(message)));
            return libtest_mimic::run(&args, vec![trial]).exit_code();
        }
    };
    eprintln!("fleet up in {:.0} s; logs in {}", started.elapsed().as_secs_f64(), fleet.run_dir().display());
    let trials = list
        .into_iter()
        .map(|(name, f)| {
            let (fleet, runtime) = (fleet.clone(), runtime.clone());
            Trial::test(name, move || {
                let outcome = runtime.block_on(async { tokio::time::timeout(TRIAL_TIMEOUT, f(fleet)).await });
                match outcome {
                    Ok(Ok(())) => Ok(()),
                    Ok(Err(e)) => Err(Failed::from(format!("{e:#}"))),
                    Err(_) => Err(Failed::from(format!("timed out after {TRIAL_TIMEOUT:?}"))),
                }
            })
        })
        .collect();
    let conclusion = libtest_mimic::run(&args, trials);
    drop(fleet);
    conclusion.exit_code()
}
