//! KV-event ingestion through the real socket path: a ZMQ PUB in this process, the gateway's SUB
//! subscriber, decoding, sequence tracking and the core index. Reports events per second and the
//! lag from publish to index update.
//!
//! Run: `cargo bench -p kvgate-gateway --bench kv_ingest`

#![allow(missing_docs, clippy::disallowed_methods)] // a benchmark harness measures wall time

#[path = "../tests/support/mod.rs"]
mod support;

use std::time::{Duration, Instant};

use bytes::Bytes;
use rmpv::Value;
use support::*;
use zeromq::{Socket, SocketSend, ZmqMessage};

const BLOCK: usize = 16;
const BLOCKS_PER_EVENT: usize = 32;

fn stored_batch(seq: u64) -> Vec<u8> {
    let tokens: Vec<Value> =
        (0..BLOCK * BLOCKS_PER_EVENT).map(|i| Value::from((seq as usize * 7919 + i) as u64 % 100_000)).collect();
    let hashes: Vec<Value> = (0..BLOCKS_PER_EVENT as u64).map(|i| Value::from(seq << 8 | i)).collect();
    let ev = Value::Map(vec![
        (Value::from("type"), Value::from("BlockStored")),
        (Value::from("block_hashes"), Value::Array(hashes)),
        (Value::from("parent_block_hash"), Value::Nil),
        (Value::from("token_ids"), Value::Array(tokens)),
        (Value::from("block_size"), Value::from(BLOCK as u64)),
        (Value::from("medium"), Value::from("GPU")),
    ]);
    let removed = Value::Map(vec![
        (Value::from("type"), Value::from("BlockRemoved")),
        (
            Value::from("block_hashes"),
            Value::Array(
                (0..BLOCKS_PER_EVENT as u64).map(|i| Value::from((seq.saturating_sub(64)) << 8 | i)).collect(),
            ),
        ),
    ]);
    let mut out = Vec::new();
    rmpv::encode::write_value(
        &mut out,
        &Value::Array(vec![Value::F64(0.0), Value::Array(vec![ev, removed]), Value::from(0u8)]),
    )
    .unwrap();
    out
}

fn main() {
    let rt = tokio::runtime::Builder::new_multi_thread().worker_threads(2).enable_all().build().unwrap();
    rt.block_on(async {
        let engine = fake_engine().await;
        let mut publisher = zeromq::PubSocket::new();
        let endpoint = publisher.bind("tcp://127.0.0.1:0").await.unwrap().to_string();
        let toml = base_toml(&[], &format!("[[workers]]\nid = \"a\"\nurl = \"{}\"\nkv_events = \"{endpoint}\"\nblock_size = 16\n", engine.url()));
        let gw = gateway(&toml).await;
        tokio::time::sleep(Duration::from_millis(500)).await;
        let stats = gw.state.engines.read().values().next().unwrap().stream.clone();
        let send = |seq: u64, payload: Vec<u8>| {
            ZmqMessage::try_from(vec![Bytes::new(), Bytes::from(seq.to_be_bytes().to_vec()), Bytes::from(payload)]).unwrap()
        };
        let wait_for = |seq: u64| {
            let stats = stats.clone();
            async move {
                while stats.view().last_seq != Some(seq) {
                    tokio::task::yield_now().await;
                }
            }
        };

        // Lag: one batch at a time, from send to the index update.
        let mut lags = Vec::new();
        let mut seq = 0u64;
        for _ in 0..500 {
            let payload = stored_batch(seq);
            let start = Instant::now();
            publisher.send(send(seq, payload)).await.unwrap();
            tokio::time::timeout(Duration::from_secs(5), wait_for(seq)).await.expect("applied");
            lags.push(start.elapsed().as_secs_f64() * 1e6);
            seq += 1;
        }
        lags.sort_by(f64::total_cmp);

        // Throughput: a burst of pre-encoded batches, until the last is applied.
        let n = 20_000u64;
        let payloads: Vec<Vec<u8>> = (seq..seq + n).map(stored_batch).collect();
        let start = Instant::now();
        for (i, p) in payloads.into_iter().enumerate() {
            publisher.send(send(seq + i as u64, p)).await.unwrap();
        }
        tokio::time::timeout(Duration::from_secs(120), wait_for(seq + n - 1)).await.expect("burst applied");
        let secs = start.elapsed().as_secs_f64();
        let v = stats.view();
        println!("| measurement | value |");
        println!("|---|---|");
        println!("| publish → index lag, one batch at a time, p50 | {:.0} µs |", lags[lags.len() / 2]);
        println!("| publish → index lag, p99 | {:.0} µs |", lags[lags.len() * 99 / 100]);
        println!("| burst of {n} batches (1 store of {BLOCKS_PER_EVENT} blocks + 1 removal of {BLOCKS_PER_EVENT} each) | {secs:.2} s |");
        println!("| batches per second | {:.0} |", n as f64 / secs);
        println!("| block events per second (stored + removed blocks) | {:.0} |", (n as usize * 2 * BLOCKS_PER_EVENT) as f64 / secs);
        println!("| gaps during the burst (PUB drops above its high-water mark) | {} |", v.gaps);
    });
}
