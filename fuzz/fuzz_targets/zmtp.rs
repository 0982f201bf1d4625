//! What a KV-event publisher or replay socket sends a subscriber: the ZMTP greeting, the READY
//! handshake and framed messages, read by the same code as a live connection.
#![no_main]

use kvgate_zmtp::{Limits, SocketType};
use libfuzzer_sys::fuzz_target;

fuzz_target!(|data: &[u8]| {
    let Some((&mode, rest)) = data.split_first() else { return };
    let socket = if mode % 2 == 0 { SocketType::Sub } else { SocketType::Dealer };
    // Small limits, so the limit checks are reached by inputs of fuzzing size.
    let limits = Limits { max_frame_bytes: 4096, max_message_bytes: 8192, max_frames: 4, ..Limits::default() };
    let _ = kvgate_zmtp::fuzz_peer_bytes(rest, socket, &limits);
});
