//! The messages replicas exchange on the bus: MessagePack envelopes, one per batch.
//!
//! An envelope names its format and version (`kind`), the sending replica and its process
//! instance (so two processes that were given the same replica id can tell), a sequence number,
//! and one body: a batch of reservation changes, the sender's full state, or a goodbye.

use kvgate_core::ledger::Work;
use kvgate_core::{HeldReservation, ReplicaId, RequestId, ReservationChange, WorkerId};
use serde::{Deserialize, Serialize};

/// The format and version every envelope carries.
pub const KIND: &str = "kvgate.reservations/1";

/// One bus message.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
pub struct Envelope {
    /// [`KIND`].
    pub kind: String,
    /// The sending replica.
    pub replica: ReplicaId,
    /// A random number the sending process drew at start.
    pub instance: u64,
    /// Messages this instance sent before this one.
    pub seq: u64,
    /// What it says.
    pub body: Body,
}

/// What an envelope says.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
pub enum Body {
    /// Reservation changes since the previous batch, oldest first.
    Changes(Vec<ReservationChange>),
    /// Every reservation the sender holds; the worker names are listed once and referred to by
    /// position, which keeps a large state within the server's payload limit.
    State {
        /// Worker names.
        workers: Vec<WorkerId>,
        /// (request, position in `workers`, work, decoding).
        held: Vec<(RequestId, u32, Work, bool)>,
    },
    /// The sender is shutting down: its reservations end now.
    Goodbye,
}

/// What a payload on the subject turned out to be.
#[derive(Debug, Clone, PartialEq)]
pub enum Decoded {
    /// A message of this format and version.
    Message(Envelope),
    /// A kvgate envelope of another version.
    Foreign(String),
    /// Not a kvgate envelope at all.
    Garbage(String),
}

/// Encodes an envelope.
pub fn encode(envelope: &Envelope) -> Vec<u8> {
    rmp_serde::to_vec(envelope).expect("envelopes always serialize")
}

/// Decodes a payload, telling other versions apart from garbage.
pub fn decode(payload: &[u8]) -> Decoded {
    match rmp_serde::from_slice::<Envelope>(payload) {
        Ok(env) if env.kind == KIND => Decoded::Message(env),
        Ok(env) => Decoded::Foreign(env.kind),
        Err(e) => {
            // A newer version may change the body; its header still says what it is.
            let kind = rmpv::decode::read_value(&mut &payload[..]).ok().and_then(|v| match v {
                rmpv::Value::Array(items) => items.first().and_then(|k| k.as_str().map(str::to_owned)),
                _ => None,
            });
            match kind {
                Some(k) if k.starts_with("kvgate.reservations/") => Decoded::Foreign(k),
                _ => Decoded::Garbage(e.to_string()),
            }
        }
    }
}

/// A full state body for `held`.
pub fn state_body(held: Vec<HeldReservation>) -> Body {
    let mut workers: Vec<WorkerId> = Vec::new();
    let mut position: std::collections::HashMap<WorkerId, u32> = std::collections::HashMap::new();
    let mut rows = Vec::with_capacity(held.len());
    for h in held {
        let pos = *position.entry(h.worker.clone()).or_insert_with(|| {
            workers.push(h.worker);
            workers.len() as u32 - 1
        });
        rows.push((h.request, pos, h.work, h.decoding));
    }
    Body::State { workers, held: rows }
}

/// The reservations a state body lists; `None` if a row names a worker position the list lacks.
pub fn held_of(workers: &[WorkerId], rows: &[(RequestId, u32, Work, bool)]) -> Option<Vec<HeldReservation>> {
    rows.iter()
        .map(|&(request, pos, work, decoding)| {
            let worker = workers.get(pos as usize)?.clone();
            Some(HeldReservation { request, worker, work, decoding })
        })
        .collect()
}

#[cfg(test)]
mod tests {
    use super::*;

    fn envelope(body: Body) -> Envelope {
        Envelope { kind: KIND.into(), replica: ReplicaId::new("r1"), instance: 7, seq: 3, body }
    }

    #[test]
    fn every_body_round_trips_and_a_state_lists_each_worker_once() {
        let work = Work { prefill_tokens: 100, decode_tokens: 20, kv_tokens: 120 };
        let held: Vec<HeldReservation> = (0..4)
            .map(|i| HeldReservation {
                request: RequestId(i),
                worker: WorkerId::new(if i % 2 == 0 { "a" } else { "b" }),
                work,
                decoding: i == 3,
            })
            .collect();
        let state = state_body(held.clone());
        let Body::State { workers, held: rows } = &state else { unreachable!() };
        assert_eq!(workers.len(), 2);
        assert_eq!(held_of(workers, rows).unwrap(), held);
        for body in [
            Body::Changes(vec![
                ReservationChange::Reserved { request: RequestId(1), worker: WorkerId::new("a"), work },
                ReservationChange::FirstToken { request: RequestId(1) },
                ReservationChange::Released { request: RequestId(1) },
            ]),
            state,
            Body::Goodbye,
        ] {
            let env = envelope(body);
            assert_eq!(decode(&encode(&env)), Decoded::Message(env));
        }
    }

    #[test]
    fn other_versions_and_garbage_are_told_apart() {
        let mut env = envelope(Body::Goodbye);
        env.kind = "kvgate.reservations/2".into();
        assert_eq!(decode(&encode(&env)), Decoded::Foreign("kvgate.reservations/2".into()));
        let newer = rmp_serde::to_vec(&("kvgate.reservations/9", "r1", 1u64, 2u64, "a body from the future")).unwrap();
        assert_eq!(decode(&newer), Decoded::Foreign("kvgate.reservations/9".into()));
        for payload in [&b"hello"[..], &[], &[0xc1], &rmp_serde::to_vec(&("someone.else", 1)).unwrap()] {
            assert!(matches!(decode(payload), Decoded::Garbage(_)), "{payload:?}");
        }
        assert_eq!(held_of(&[], &[(RequestId(1), 0, Work::default(), false)]), None);
    }
}
