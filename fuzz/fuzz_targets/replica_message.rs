//! A message on the replica bus (NATS), as a peer's reservations arrive.
#![no_main]

use libfuzzer_sys::fuzz_target;

fuzz_target!(|data: &[u8]| {
    let _ = kvgate_gateway::replicas::wire::decode(data);
});
