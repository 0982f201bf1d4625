//! Prefill calibration from the engine's step cadence: what live KV event batches cost the router
//! with calibration on. Every 8th batch copies the 256-point window under the fleet's lock (what a
//! decision can wait behind); the envelope refit of that copy runs after the lock is let go.
//!
//! Run: `cargo bench -p kvgate-core --bench step_cadence`

#![allow(missing_docs)] // criterion_group! generates undocumented public functions

use std::hint::black_box;

use criterion::{criterion_group, criterion_main, Criterion};
use kvgate_core::step_cadence::{StepCadence, STEP_WINDOW};

/// A full window of a busy engine's steps: mostly small, one in ten large, with silent steps.
fn warm() -> (StepCadence, f64) {
    let mut cadence = StepCadence::default();
    let mut t = 1_000.0;
    for i in 0..STEP_WINDOW as u64 * 2 {
        let tokens = if i % 10 == 9 { 6_400 } else { 64 * (1 + i % 12) };
        t += 0.020 + (i % 3) as f64 * 0.020 + tokens as f64 / 20_000.0;
        if let Some(window) = cadence.observe(tokens, 8 + i % 24, t, None) {
            cadence.set_fit(window.fit());
        }
    }
    (cadence, t)
}

fn bench_step_cadence(c: &mut Criterion) {
    let mut group = c.benchmark_group("step_cadence_256_points");
    group.bench_function("eight_batches_under_the_lock", |b| {
        let (mut cadence, mut t) = warm();
        let mut i = 0u64;
        b.iter(|| {
            for _ in 0..8 {
                i += 1;
                let tokens = if i % 10 == 9 { 6_400 } else { 64 * (1 + i % 12) };
                t += 0.025 + tokens as f64 / 20_000.0;
                black_box(cadence.observe(tokens, 8 + i % 24, t, None));
            }
        })
    });
    group.bench_function("refit_outside_the_lock", |b| {
        let (mut cadence, mut t) = warm();
        let window = loop {
            t += 0.025;
            if let Some(window) = cadence.observe(64, 8, t, None) {
                break window;
            }
        };
        b.iter(|| black_box(window.fit()))
    });
    group.finish();
}

criterion_group! {
    name = benches;
    config = Criterion::default().sample_size(50);
    targets = bench_step_cadence
}
criterion_main!(benches);
