//! A workers file (JSON when the first byte is odd, else the line form), and each line as a
//! `--worker` flag's compact form.
#![no_main]

use libfuzzer_sys::fuzz_target;

fuzz_target!(|data: &[u8]| {
    let Some((&mode, rest)) = data.split_first() else { return };
    let Ok(text) = std::str::from_utf8(rest) else { return };
    let _ = kvgate_gateway::discovery::parse(text, mode % 2 == 1);
    for line in text.lines() {
        let _ = kvgate_gateway::WorkerSpec::parse_compact(line);
    }
});
