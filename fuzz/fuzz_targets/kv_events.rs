//! vLLM and SGLang KV-event messages, as the subscriber reads them off the socket: a payload alone
//! (first byte even), a live message's frames or a replay answer's frames (frames separated by the
//! two bytes `0xfe 0xfd` in the input, so that mutations keep a frame structure).
#![no_main]

use libfuzzer_sys::fuzz_target;

/// Splits `data` into frames at each `0xfe 0xfd`.
fn frames(data: &[u8]) -> Vec<&[u8]> {
    let mut out = Vec::new();
    let mut start = 0;
    let mut i = 0;
    while i + 1 < data.len() {
        if data[i] == 0xfe && data[i + 1] == 0xfd {
            out.push(&data[start..i]);
            start = i + 2;
            i += 2;
        } else {
            i += 1;
        }
    }
    out.push(&data[start..]);
    out
}

fuzz_target!(|data: &[u8]| {
    let Some((&mode, rest)) = data.split_first() else { return };
    match mode % 3 {
        0 => {
            let _ = kvgate_protocol::kv_wire::decode_payload(rest);
        }
        1 => {
            let _ = kvgate_protocol::kv_wire::decode_live(&frames(rest));
        }
        _ => {
            let _ = kvgate_protocol::kv_wire::decode_replay(&frames(rest));
        }
    }
});
