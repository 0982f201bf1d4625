//! Entry points for the fuzz targets under `fuzz/` (built with `--cfg fuzzing` by
//! scripts/fuzz.sh): what the gateway does with a gRPC worker's messages once decoded, which is
//! otherwise reached only through a live stream.

use kvgate_worker_proto::{common, sglang, vllm};

/// Reads a vLLM worker's Generate message as the gRPC backend does.
pub fn vllm_generate_response(m: vllm::GenerateResponse) {
    let _ = crate::grpc_worker::from_vllm(m);
}

/// Reads an SGLang worker's Generate message as the gRPC backend does.
pub fn sglang_generate_response(m: sglang::GenerateResponse) {
    let _ = crate::grpc_worker::from_sglang(m);
}

/// Reads a worker's KV event batch as the gRPC event subscriber does.
pub fn kv_event_batch(batch: &common::KvEventBatch) {
    let _ = crate::engines::grpc_events::events_of(batch);
}

/// Records a worker's pushed load of `rank` (of `ranks`) as the load subscriber does.
pub fn pushed_load(rank: Option<i32>, load: &common::EngineLoad, ranks: usize) {
    let _ = crate::grpc_worker::PushedLoads::default().record(rank, load, ranks);
}
