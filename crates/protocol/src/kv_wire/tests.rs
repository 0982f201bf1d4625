//! The decoder against every wire vector in `shared/data/kv-events/`, produced by the engines' own
//! encoders, plus hand-made malformed input.

use std::path::PathBuf;

use serde_json::Value as Json;

use super::*;

fn hex(s: &str) -> Vec<u8> {
    (0..s.len()).step_by(2).map(|i| u8::from_str_radix(&s[i..i + 2], 16).expect("hex")).collect()
}

fn frames(v: &Json) -> Vec<Vec<u8>> {
    v.as_array().unwrap().iter().map(|f| hex(f.as_str().unwrap())).collect()
}

fn vectors() -> Vec<(String, Json)> {
    let dir = PathBuf::from(env!("CARGO_MANIFEST_DIR")).join("../../../shared/data/kv-events");
    let entries = std::fs::read_dir(&dir)
        .unwrap_or_else(|e| panic!("{}: {e}; the tests need ../shared/data beside the checkout", dir.display()));
    let mut out: Vec<(String, Json)> = entries
        .filter_map(Result::ok)
        .map(|e| e.path())
        .filter(|p| p.extension().is_some_and(|x| x == "json"))
        .map(|p| {
            (
                p.file_name().unwrap().to_string_lossy().into_owned(),
                serde_json::from_str(&std::fs::read_to_string(&p).unwrap()).unwrap(),
            )
        })
        .collect();
    out.sort_by(|a, b| a.0.cmp(&b.0));
    out
}

fn u64s(v: &Json) -> Vec<u64> {
    v.as_array().unwrap().iter().map(|x| x.as_u64().unwrap()).collect()
}

fn opt_str(v: &Json) -> Option<String> {
    v.as_str().map(str::to_owned)
}

fn opt_u32(v: &Json) -> Option<u32> {
    v.as_u64().map(|x| x as u32)
}

fn check_events(name: &str, got: &[KvEvent], expected: &Json) {
    let expected = expected.as_array().unwrap();
    assert_eq!(got.len(), expected.len(), "{name}: event count");
    for (g, e) in got.iter().zip(expected) {
        assert_eq!(g.tag(), e["type"], "{name}");
        match g {
            KvEvent::BlockStored(s) => {
                assert_eq!(
                    s.block_hashes.iter().map(|h| h.0).collect::<Vec<_>>(),
                    u64s(&e["block_hashes_u64"]),
                    "{name}: hashes"
                );
                assert_eq!(s.parent_block_hash.map(|h| h.0), e["parent_block_hash_u64"].as_u64(), "{name}: parent");
                let tokens: Vec<u32> = e["token_ids"]
                    .as_array()
                    .unwrap()
                    .iter()
                    .map(|t| t.as_u64().or_else(|| t[0].as_u64()).unwrap() as u32)
                    .collect();
                assert_eq!(s.token_ids, tokens, "{name}: tokens");
                assert_eq!(Some(s.block_size), opt_u32(&e["block_size"]), "{name}: block size");
                assert_eq!(s.medium, opt_str(&e["medium"]), "{name}: medium");
                assert_eq!(s.lora_name, opt_str(&e["lora_name"]), "{name}: lora");
                assert_eq!(s.group_idx, opt_u32(&e["group_idx"]), "{name}: group");
                assert_eq!(s.kv_cache_spec_kind, opt_str(&e["kv_cache_spec_kind"]), "{name}: kind");
                assert_eq!(s.cache_salt, opt_str(&e["cache_salt"]), "{name}: salt");
            }
            KvEvent::BlockRemoved(r) => {
                assert_eq!(
                    r.block_hashes.iter().map(|h| h.0).collect::<Vec<_>>(),
                    u64s(&e["block_hashes_u64"]),
                    "{name}: hashes"
                );
                assert_eq!(r.medium, opt_str(&e["medium"]), "{name}: medium");
                assert_eq!(r.group_idx, opt_u32(&e["group_idx"]), "{name}: group");
            }
            KvEvent::AllBlocksCleared => {}
        }
    }
}

fn check_batch(name: &str, got: &DecodedBatch, e: &Json) {
    assert!(got.skipped.is_empty(), "{name}: skipped {:?}", got.skipped);
    assert_eq!(got.batch.ts, e["batch"]["ts"].as_f64().unwrap(), "{name}: ts");
    assert_eq!(got.batch.dp_rank, opt_u32(&e["batch"]["dp_rank"]), "{name}: dp rank");
    check_events(name, &got.batch.events, &e["events"]);
}

#[test]
fn every_wire_vector_decodes_to_its_expect_block() {
    let mut checked = 0;
    for (name, v) in vectors() {
        let expect = &v["expect"];
        match v["kind"].as_str().unwrap() {
            "live" => {
                let msg = decode_live(&frames(&v["frames_hex"])).unwrap_or_else(|e| panic!("{name}: {e}"));
                assert_eq!(msg.topic, expect["topic"].as_str().unwrap(), "{name}: topic");
                assert_eq!(msg.seq, expect["seq"].as_u64().unwrap(), "{name}: seq");
                check_batch(&name, &msg.batch, expect);
                if let Some(flags) = expect.get("apply_to_prefix_index").and_then(Json::as_array) {
                    let ours: Vec<bool> = msg
                        .batch
                        .batch
                        .events
                        .iter()
                        .map(|ev| match ev {
                            KvEvent::BlockStored(s) => is_prefix_group(s.group_idx, s.kv_cache_spec_kind.as_deref()),
                            KvEvent::BlockRemoved(r) => is_prefix_group(r.group_idx, None),
                            KvEvent::AllBlocksCleared => true,
                        })
                        .collect();
                    assert_eq!(
                        ours,
                        flags.iter().map(|f| f.as_bool().unwrap()).collect::<Vec<_>>(),
                        "{name}: index flags"
                    );
                }
            }
            "live-stream" => {
                for (i, (f, e)) in
                    v["frames_hex"].as_array().unwrap().iter().zip(expect["messages"].as_array().unwrap()).enumerate()
                {
                    let msg = decode_live(&frames(f)).unwrap_or_else(|err| panic!("{name}[{i}]: {err}"));
                    assert_eq!(msg.seq, e["seq"].as_u64().unwrap(), "{name}[{i}]");
                    check_batch(&format!("{name}[{i}]"), &msg.batch, e);
                }
            }
            "replay" => {
                let per_message = expect["frames_per_message"].as_u64().unwrap() as usize;
                let msgs = v["frames_hex"].as_array().unwrap();
                for (i, (f, e)) in msgs.iter().zip(expect["messages"].as_array().unwrap()).enumerate() {
                    let fr = frames(f);
                    let decoded = decode_replay(&fr).unwrap_or_else(|err| panic!("{name}[{i}]: {err}"));
                    match decoded {
                        ReplayMessage::End => {
                            assert!(e["end"].as_bool().unwrap(), "{name}[{i}]: unexpected end");
                            assert_eq!(fr.len(), expect["end_marker_frames_hex"].as_array().unwrap().len());
                        }
                        ReplayMessage::Batch { topic, seq, batch } => {
                            assert_eq!(fr.len(), per_message, "{name}[{i}]: layout");
                            assert_eq!(seq, e["seq"].as_u64().unwrap(), "{name}[{i}]");
                            assert_eq!(topic.is_some(), expect["layout"] == "topic", "{name}[{i}]");
                            check_batch(&format!("{name}[{i}]"), &batch, e);
                        }
                    }
                }
                let first = msgs.first().map(|f| match decode_replay(&frames(f)).unwrap() {
                    ReplayMessage::Batch { seq, .. } => seq,
                    ReplayMessage::End => u64::MAX,
                });
                let lost = first.is_some_and(|s| s > expect["start_seq"].as_u64().unwrap());
                assert_eq!(lost, expect["history_lost"].as_bool().unwrap(), "{name}: history lost");
            }
            "block-hash" => continue,
            other => panic!("{name}: unknown kind {other}"),
        }
        checked += 1;
    }
    assert!(checked >= 20, "only {checked} vectors checked");
}

#[test]
fn hashes_normalise_from_every_width_and_from_bytes() {
    assert_eq!(normalise_hash(&Value::from(-2644529662644789639i64)), Some(EngineHash(15802214411064761977)));
    assert_eq!(normalise_hash(&Value::from(u64::MAX)), Some(EngineHash(u64::MAX)));
    assert_eq!(normalise_hash(&Value::from(7u8)), Some(EngineHash(7)));
    assert_eq!(normalise_hash(&Value::Binary(vec![0xAA; 32])), Some(EngineHash(0xAAAA_AAAA_AAAA_AAAA)));
    assert_eq!(normalise_hash(&Value::Binary(vec![1, 2])), Some(EngineHash(0x0102)));
    assert_eq!(normalise_hash(&Value::from("x")), None);
}

fn encode(v: &Value) -> Vec<u8> {
    let mut out = Vec::new();
    rmpv::encode::write_value(&mut out, v).unwrap();
    out
}

#[test]
fn lenient_on_extras_and_strict_on_broken_events() {
    let stored = |tokens: usize| {
        Value::Map(vec![
            (Value::from("type"), Value::from("BlockStored")),
            (Value::from("block_hashes"), Value::Array(vec![Value::from(1u64)])),
            (Value::from("token_ids"), Value::Array((0..tokens as u64).map(Value::from).collect())),
            (Value::from("block_size"), Value::from(4u64)),
            (Value::from("future_field"), Value::from(true)),
        ])
    };
    let batch = Value::Array(vec![
        Value::F64(1.5),
        Value::Array(vec![
            stored(4),
            stored(3),
            Value::Array(vec![Value::from("BlockTeleported")]),
            Value::Array(vec![Value::from("BlockRemoved"), Value::from("not a list")]),
            Value::from(5u64),
            Value::Array(vec![Value::from("AllBlocksCleared"), Value::Nil, Value::from("extra")]),
        ]),
        Value::Nil,
        Value::from("trailing"),
    ]);
    let d = decode_payload(&encode(&batch)).unwrap();
    assert_eq!(d.batch.events.len(), 2);
    assert_eq!(d.batch.dp_rank, None);
    assert_eq!(d.skipped.len(), 4, "{:?}", d.skipped);
    assert!(matches!(&d.skipped[1], Skipped::UnknownTag(t) if t == "BlockTeleported"));
    // A two-element batch is accepted.
    assert!(decode_payload(&encode(&Value::Array(vec![Value::F64(0.0), Value::Array(vec![])]))).is_ok());
}

#[test]
fn undecodable_messages_are_errors_not_panics() {
    assert!(matches!(decode_live(&[b"t".to_vec(), vec![0; 8]]), Err(DecodeError::FrameCount { .. })));
    assert!(matches!(decode_live(&[b"t".to_vec(), vec![0; 7], vec![0x90]]), Err(DecodeError::SeqFrame(7))));
    assert!(matches!(decode_live(&[vec![0xff], vec![0; 8], vec![0x90]]), Err(DecodeError::Topic)));
    assert!(matches!(decode_payload(&[0xc1]), Err(DecodeError::Payload(_))));
    assert!(matches!(decode_payload(&encode(&Value::from(3u8))), Err(DecodeError::Payload(_))));
    assert!(matches!(decode_payload(&[0x93, 0xcb]), Err(DecodeError::Payload(_))));
    assert!(matches!(decode_replay(&vec![Vec::<u8>::new(); 5]), Err(DecodeError::FrameCount { .. })));
    assert_eq!(decode_replay(&[vec![], vec![], vec![0xff; 8], vec![]]).unwrap(), ReplayMessage::End);
    assert_eq!(replay_request(3), [vec![], vec![0, 0, 0, 0, 0, 0, 0, 3]]);
}
