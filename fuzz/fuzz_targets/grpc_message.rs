//! A gRPC worker's messages (SMG's worker protocol), decoded and read as the gRPC backend and
//! subscriber read them: vLLM and SGLang Generate answers, KV event batches, pushed loads.
#![no_main]

use kvgate_worker_proto::{common, sglang, vllm};
use libfuzzer_sys::fuzz_target;
use prost::Message;

fuzz_target!(|data: &[u8]| {
    let Some((&mode, rest)) = data.split_first() else { return };
    match mode % 4 {
        0 => {
            if let Ok(m) = vllm::GenerateResponse::decode(rest) {
                kvgate_gateway::fuzzing::vllm_generate_response(m);
            }
        }
        1 => {
            if let Ok(m) = sglang::GenerateResponse::decode(rest) {
                kvgate_gateway::fuzzing::sglang_generate_response(m);
            }
        }
        2 => {
            if let Ok(batch) = common::KvEventBatch::decode(rest) {
                kvgate_gateway::fuzzing::kv_event_batch(&batch);
            }
        }
        _ => {
            if let Ok(load) = common::EngineLoad::decode(rest) {
                let rank = rest.first().map(|&b| i32::from(b % 4));
                kvgate_gateway::fuzzing::pushed_load(rank, &load, 4);
            }
        }
    }
});
