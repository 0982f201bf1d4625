//! An engine's JSON answers: SGLang's `/v1/loads`, and `/server_info` (page size and capacity).
#![no_main]

use libfuzzer_sys::fuzz_target;

fuzz_target!(|data: &[u8]| {
    let _ = kvgate_protocol::telemetry::parse_sglang_loads(data);
    if let Ok(info) = serde_json::from_slice::<serde_json::Value>(data) {
        let _ = kvgate_gateway::engines::server_info_identity(&info);
    }
});
