//! Emulated peer replicas on a replica bus, for measuring what sharing costs the replica that
//! listens (`scripts/replica-bus-cpu.sh`).
//!
//! `cargo run --release -p kvgate-gateway --example replica_peers -- NATS_URL SUBJECT PEERS
//! DECISIONS_PER_S WORKERS SECONDS`: `PEERS` replicas named `peer0..` together decide
//! `DECISIONS_PER_S` requests a second over workers `w0..w{WORKERS-1}`. Each decision is published
//! as a gateway publishes it: a reserved change, a first token 100 ms later, a release 1 s later,
//! batched by the core's outbox with the gateway's default windows, and every peer sends its full
//! state each second.

#![allow(missing_docs)]
#![allow(clippy::disallowed_methods)] // a load generator paced by the wall clock

use std::collections::VecDeque;
use std::time::{Duration, Instant};

use kvgate_core::ledger::Work;
use kvgate_core::{
    BatchWindows, HeldReservation, Outbox, ReplicaId, RequestId, ReservationChange, Timestamp, WorkerId,
};
use kvgate_gateway::replicas::wire::{self, Body, Envelope};

#[tokio::main(flavor = "current_thread")]
async fn main() {
    let args: Vec<String> = std::env::args().skip(1).collect();
    let [url, subject, peers, rate, workers, seconds] = args.as_slice() else {
        eprintln!("usage: replica_peers NATS_URL SUBJECT PEERS DECISIONS_PER_S WORKERS SECONDS");
        std::process::exit(2);
    };
    let (peers, rate, workers, seconds): (usize, f64, usize, f64) =
        (peers.parse().unwrap(), rate.parse().unwrap(), workers.parse().unwrap(), seconds.parse().unwrap());
    let client = async_nats::connect(url.as_str()).await.expect("connect to NATS");
    let names: Vec<ReplicaId> = (0..peers).map(|p| ReplicaId::new(format!("peer{p}"))).collect();
    let worker_ids: Vec<WorkerId> = (0..workers).map(|w| WorkerId::new(format!("w{w}"))).collect();
    let work = Work { prefill_tokens: 2000, decode_tokens: 256, kv_tokens: 2256 };
    // (due, peer, change), in due order per kind.
    let mut firsts: VecDeque<(Instant, usize, RequestId)> = VecDeque::new();
    let mut releases: VecDeque<(Instant, usize, RequestId)> = VecDeque::new();
    let mut held: Vec<Vec<HeldReservation>> = vec![Vec::new(); peers];
    let mut outboxes: Vec<Outbox> = (0..peers).map(|_| Outbox::new(BatchWindows::default(), None)).collect();
    let mut seq = vec![0u64; peers];
    let start = Instant::now();
    let mut next_state = start + Duration::from_secs(1);
    let mut decided = 0u64;
    let mut published = 0u64;
    let mut tick = tokio::time::interval(Duration::from_millis(1));
    while start.elapsed().as_secs_f64() < seconds {
        tick.tick().await;
        let now = Instant::now();
        let at = Timestamp::from_micros((now - start).as_micros() as u64);
        let due = (start.elapsed().as_secs_f64() * rate) as u64;
        while decided < due {
            let peer = decided as usize % peers;
            let request = RequestId(decided);
            let worker = worker_ids[decided as usize % workers].clone();
            outboxes[peer].push(ReservationChange::Reserved { request, worker: worker.clone(), work }, at);
            held[peer].push(HeldReservation { request, worker, work, decoding: false });
            firsts.push_back((now + Duration::from_millis(100), peer, request));
            releases.push_back((now + Duration::from_secs(1), peer, request));
            decided += 1;
        }
        while firsts.front().is_some_and(|f| f.0 <= now) {
            let (_, peer, request) = firsts.pop_front().unwrap();
            outboxes[peer].push(ReservationChange::FirstToken { request }, at);
            if let Some(h) = held[peer].iter_mut().find(|h| h.request == request) {
                h.decoding = true;
            }
        }
        while releases.front().is_some_and(|r| r.0 <= now) {
            let (_, peer, request) = releases.pop_front().unwrap();
            outboxes[peer].push(ReservationChange::Released { request }, at);
            held[peer].retain(|h| h.request != request);
        }
        let state_due = now >= next_state;
        let mut bodies: Vec<(usize, Body)> = outboxes
            .iter_mut()
            .enumerate()
            .map(|(p, o)| (p, if state_due { o.take_all() } else { o.take_due(at) }))
            .filter(|(_, b)| !b.is_empty())
            .map(|(p, b)| (p, Body::Changes(b)))
            .collect();
        if state_due {
            next_state += Duration::from_secs(1);
            bodies.extend((0..peers).map(|p| (p, wire::state_body(held[p].clone()))));
        }
        for (p, body) in bodies {
            let envelope =
                Envelope { kind: wire::KIND.into(), replica: names[p].clone(), instance: 1, seq: seq[p], body };
            seq[p] += 1;
            client.publish(subject.clone(), wire::encode(&envelope).into()).await.expect("publish");
            published += 1;
        }
    }
    for (p, name) in names.iter().enumerate() {
        let envelope =
            Envelope { kind: wire::KIND.into(), replica: name.clone(), instance: 1, seq: seq[p], body: Body::Goodbye };
        client.publish(subject.clone(), wire::encode(&envelope).into()).await.expect("publish");
    }
    client.flush().await.expect("flush");
    println!("{decided} decisions by {peers} peers in {seconds} s, {published} messages");
}
