//! A vLLM or SGLang `/metrics` page, as the load poller reads it.
#![no_main]

use libfuzzer_sys::fuzz_target;

fuzz_target!(|data: &[u8]| {
    let Ok(text) = std::str::from_utf8(data) else { return };
    let _ = kvgate_protocol::telemetry::parse_prometheus(text);
    for line in text.lines() {
        let _ = kvgate_protocol::prometheus::parse_line(line);
    }
});
