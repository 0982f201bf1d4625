//! The real-engine suite: kvgate in front of three real engines on the CPU, all vLLM or all SGLang
//! (`KVGATE_REAL_RUNTIME=vllm|sglang`, vLLM when unset; `scripts/real-engines/test.sh` runs both,
//! one fleet after the other).
//!
//! Every engine is paced like a GPU (`Pacing::cpu_default`: Llama 3 8B on one H100, four times
//! slower): its steps take the modeled time, so engines that share the machine's cores do not slow
//! each other down, and kvgate is told each engine's paced rates.
//!
//! One fleet serves every trial (engines take tens of seconds to start), so trials run one at a time
//! and each uses prompts of its own. The same trials run on either runtime, reading each engine's own
//! counters by that runtime's names. The fleet:
//! - `a`: binds its KV-event socket (`tcp://*:P`); 8 MiB of KV (16,384 tokens).
//! - `b`: connects its KV-event socket to kvgate (`tcp://127.0.0.1:P`); 8 MiB of KV.
//! - `c`: binds; 1 MiB of KV (2,048 tokens, 64 blocks), small enough to queue and evict.
//! - `g`: the same runtime served as a gRPC worker (SMG's worker protocol, `smg-grpc-servicer`); 8 MiB
//!   of KV. Only the gRPC trials route to it (one of them beside `c`).
//! - on the SGLang fleet also `v`, a vLLM engine (8 MiB) for the mixed-fleet trial.
//! - for the embeddings trial only, `eh` and `eg`: the model served as an embedding model by the
//!   engine's own server and as a gRPC worker, started and stopped by that trial.
//!
//! Needs `scripts/real-engines/setup.sh` (vLLM and SGLang in venvs, and the tiny model); fails saying
//! so otherwise. `scripts/real-engines/test.sh` does the set-up and runs this.

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
    pub mod embed;
    pub mod grpc;
    pub mod grpc_fleet;
    pub mod mixed;
    pub mod occupancy;
    pub mod pacing;
    pub mod parity;
    pub mod responses;
    pub mod restart;
    pub mod routing;
    pub mod smg;
    pub mod stand_in;
    pub mod streaming;
}

use kvgate_real_engines::fleet::{EngineSpec, Fleet, Runtime};
use kvgate_real_engines::pacing::Pacing;

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

/// The trials every runtime runs, in order.
fn common_trials() -> Vec<(&'static str, TrialFn)> {
    trials![
        real::parity::chat_and_completion_token_ids_match_the_engines_own,
        real::cache::the_block_size_is_read_from_the_engine_and_a_mismatch_is_invalid,
        real::cache::kv_events_arrive_in_both_socket_roles,
        real::cache::cache_credit_equals_the_engines_own_prefix_cache_hits,
        real::streaming::streaming_through_kvgate_is_byte_for_byte_what_the_engine_sent,
        real::pacing::a_paced_engine_steps_at_its_profiles_time_and_a_busy_neighbour_does_not_slow_it,
        real::routing::a_prefix_follows_its_idle_owner_and_a_burst_spreads_to_peers_that_become_owners,
        real::routing::a_prefix_asked_for_steadily_is_copied_to_an_idle_peer_that_then_holds_it,
        real::cache::eviction_shrinks_credit_with_the_engines_block_removed_events,
        real::cache::a_prefix_cache_reset_clears_credit_through_all_blocks_cleared,
        real::demo::the_demo_runs_on_real_engines_and_reuses_their_caches,
        real::occupancy::a_running_batch_delays_a_new_prompt_by_its_steps_not_by_its_drain,
        real::responses::the_responses_api_prompt_is_the_one_the_engine_runs,
    ]
}

/// The trials of one runtime's suite. Calibration runs on vLLM only: kvgate times prefill by the
/// cadence of an engine's per-step KV event batches and decode by its decode-filled blocks, and
/// SGLang publishes neither (it stores a request's blocks when a chunk or the request ends), so on
/// SGLang kvgate times decode by its streams' inter-token times and plans prefill at the configured
/// rate (docs/real-engines.md). The restart trial comes last: it kills an engine.
fn trials_of(runtime: Runtime) -> Vec<(&'static str, TrialFn)> {
    let mut list = common_trials();
    match runtime {
        Runtime::Vllm => list.extend(trials![
            real::calibration::the_prefill_rate_is_measured_from_the_engines_own_step_cadence,
            real::calibration::the_decode_rate_is_measured_from_the_engines_decode_filled_blocks,
        ]),
        Runtime::Sglang => list.extend(trials![
            real::cache::a_late_subscriber_without_a_replay_socket_joins_without_a_gap,
            real::mixed::a_mixed_fleet_gets_credit_and_load_from_each_engines_own_telemetry,
        ]),
    }
    list.extend(trials![
        real::grpc::a_grpc_worker_answers_as_the_engines_own_server_does,
        real::grpc::a_grpc_workers_events_earn_credit_and_a_gone_client_aborts_its_request,
        real::embed::a_grpc_embedding_worker_answers_as_the_engines_own_server_does,
        real::smg::smg_in_grpc_mode_answers_as_kvgate_does_but_where_it_departs_from_the_engine,
        real::grpc_fleet::a_burst_spreads_from_an_http_owner_to_a_grpc_peer_that_becomes_an_owner,
        // Kills and restarts g: after every other trial of it.
        real::grpc_fleet::a_grpc_worker_evicts_and_killed_mid_stream_is_rebuilt_from_a_new_subscription,
    ]);
    list.extend(trials![real::restart::an_engine_killed_mid_stream_is_marked_down_and_its_credit_rebuilt_from_zero]);
    if runtime == Runtime::Sglang {
        // After every other trial: no request of any of them reached the stand-in.
        list.extend(trials![real::stand_in::no_sgl_kernel_stand_in_function_was_called]);
    }
    list
}

/// The fleet of one runtime's suite (see the module docs).
fn fleet_of(runtime: Runtime) -> Vec<EngineSpec> {
    let mut specs: Vec<EngineSpec> = vec![
        EngineSpec::new("a", 16_384).on(runtime),
        EngineSpec::new("b", 16_384).on(runtime).connecting(),
        EngineSpec::new("c", 2_048).on(runtime),
        // The same runtime as a gRPC worker (SMG's protocol), which only the gRPC trials route to.
        EngineSpec::new("g", 16_384).on(runtime).grpc(),
    ];
    if runtime == Runtime::Sglang {
        specs.push(EngineSpec::new("v", 16_384).on(Runtime::Vllm));
    }
    specs.into_iter().map(|s| s.paced(Pacing::cpu_default())).collect()
}

fn main() -> ExitCode {
    let mut args = Arguments::from_args();
    // One fleet, shared: trials take turns.
    args.test_threads = Some(1);
    let wanted = std::env::var("KVGATE_REAL_RUNTIME").unwrap_or_else(|_| "vllm".into());
    let Some(runtime) = Runtime::from_name(&wanted) else {
        let message = format!("KVGATE_REAL_RUNTIME={wanted}: expected vllm or sglang");
        eprintln!("{message}");
        let trial = Trial::test("the_runtime_is_known", move || Err(Failed::from(message)));
        return libtest_mimic::run(&args, vec![trial]).exit_code();
    };
    let list = trials_of(runtime);
    if args.list {
        let trials = list.iter().map(|(name, _)| Trial::test(format!("{runtime}::{name}"), || Ok(()))).collect();
        return libtest_mimic::run(&args, trials).exit_code();
    }
    let runtime_threads = tokio::runtime::Builder::new_multi_thread().worker_threads(2).enable_all().build();
    let tokio_runtime = Arc::new(runtime_threads.expect("a tokio runtime"));
    let specs = fleet_of(runtime);
    eprintln!("starting {} real engines, {runtime} (about a minute on 2 cores)...", specs.len());
    let started = std::time::Instant::now();
    let fleet = match Fleet::start(specs, FLEET_START) {
        Ok(f) => Arc::new(f),
        Err(e) => {
            let message = format!("{e:#}");
            // Said here too: a name filter would hide the failing trial.
            eprintln!("the real {runtime} fleet did not start: {message}");
            let trial = Trial::test("the_real_fleet_starts", move || Err(Failed::from(message)));
            return libtest_mimic::run(&args, vec![trial]).exit_code();
        }
    };
    eprintln!("fleet up in {:.0} s; logs in {}", started.elapsed().as_secs_f64(), fleet.run_dir().display());
    let trials = list
        .into_iter()
        .map(|(name, f)| {
            let (fleet, tokio_runtime) = (fleet.clone(), tokio_runtime.clone());
            Trial::test(format!("{runtime}::{name}"), move || {
                let outcome = tokio_runtime.block_on(async { tokio::time::timeout(TRIAL_TIMEOUT, f(fleet)).await });
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
