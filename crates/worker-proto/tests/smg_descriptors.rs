//! kvgate's own definitions of SMG's gRPC worker protocol against the descriptors the engines'
//! servicers are built from (the PyPI package `smg-grpc-proto`, fetched by
//! `scripts/fetch-smg-descriptors.sh`): every message, field, enum value and method kvgate defines
//! must exist there with the same number, type, label, message type, oneof and streaming.

use std::collections::BTreeMap;
use std::path::PathBuf;

use prost::Message;
use prost_types::{DescriptorProto, EnumDescriptorProto, FileDescriptorSet, ServiceDescriptorProto};

/// The package version the servicers kvgate is tested against ship (smg-grpc-servicer 0.14.1).
const SMG_GRPC_PROTO: &str = "0.4.28";

fn smg_descriptors() -> FileDescriptorSet {
    let path = PathBuf::from(env!("CARGO_MANIFEST_DIR"))
        .join("../../target/test-data/smg-grpc-proto")
        .join(format!("descriptors-{SMG_GRPC_PROTO}.bin"));
    let bytes = std::fs::read(&path).unwrap_or_else(|e| {
        panic!(
            "{} is missing ({e}): run scripts/fetch-smg-descriptors.sh (scripts/test.sh does; it needs python3 and pip access to PyPI)",
            path.display()
        )
    });
    FileDescriptorSet::decode(bytes.as_slice()).expect("the fetched descriptors decode")
}

fn kvgate_descriptors() -> FileDescriptorSet {
    FileDescriptorSet::decode(kvgate_worker_proto::FILE_DESCRIPTOR_SET).expect("kvgate's descriptors decode")
}

/// Every definition of a descriptor set by its full name.
#[derive(Default)]
struct Index {
    messages: BTreeMap<String, DescriptorProto>,
    enums: BTreeMap<String, EnumDescriptorProto>,
    services: BTreeMap<String, ServiceDescriptorProto>,
}

impl Index {
    fn of(set: &FileDescriptorSet) -> Self {
        let mut index = Index::default();
        for file in &set.file {
            let scope = format!(".{}", file.package());
            for m in &file.message_type {
                index.add_message(&scope, m);
            }
            for e in &file.enum_type {
                index.enums.insert(format!("{scope}.{}", e.name()), e.clone());
            }
            for s in &file.service {
                index.services.insert(format!("{scope}.{}", s.name()), s.clone());
            }
        }
        index
    }

    fn add_message(&mut self, scope: &str, m: &DescriptorProto) {
        let name = format!("{scope}.{}", m.name());
        for nested in &m.nested_type {
            self.add_message(&name, nested);
        }
        for e in &m.enum_type {
            self.enums.insert(format!("{name}.{}", e.name()), e.clone());
        }
        self.messages.insert(name, m.clone());
    }
}

/// How a field looks on the wire and in the schema, for comparison.
fn field_shape(m: &DescriptorProto, f: &prost_types::FieldDescriptorProto) -> String {
    // A proto3 `optional` is a synthetic oneof: compare the flag, not the generated oneof's name.
    let oneof = match f.oneof_index {
        Some(i) if !f.proto3_optional() => m.oneof_decl.get(i as usize).map(|o| o.name().to_owned()),
        _ => None,
    };
    format!(
        "number {} type {:?} label {:?} type_name {:?} oneof {:?} optional {}",
        f.number(),
        f.r#type(),
        f.label(),
        f.type_name(),
        oneof,
        f.proto3_optional()
    )
}

/// Every difference between kvgate's definitions and SMG's, one line each; and how many fields,
/// enum values and methods were compared.
fn differences(ours: &FileDescriptorSet, theirs: &FileDescriptorSet) -> (Vec<String>, usize) {
    let (ours, theirs) = (Index::of(ours), Index::of(theirs));
    let mut diffs = Vec::new();
    let mut compared = 0;
    for (name, m) in &ours.messages {
        let Some(t) = theirs.messages.get(name) else {
            diffs.push(format!("message {name}: not in smg-grpc-proto"));
            continue;
        };
        for f in &m.field {
            compared += 1;
            match t.field.iter().find(|tf| tf.name() == f.name()) {
                None => diffs.push(format!("{name}.{}: no such field in smg-grpc-proto", f.name())),
                Some(tf) => {
                    let (a, b) = (field_shape(m, f), field_shape(t, tf));
                    if a != b {
                        diffs.push(format!("{name}.{}: kvgate has {a}; smg-grpc-proto has {b}", f.name()));
                    }
                }
            }
        }
    }
    for (name, e) in &ours.enums {
        let Some(t) = theirs.enums.get(name) else {
            diffs.push(format!("enum {name}: not in smg-grpc-proto"));
            continue;
        };
        for v in &e.value {
            compared += 1;
            match t.value.iter().find(|tv| tv.name() == v.name()) {
                Some(tv) if tv.number() == v.number() => {}
                Some(tv) => {
                    diffs.push(format!("{name}.{}: kvgate {}, smg-grpc-proto {}", v.name(), v.number(), tv.number()))
                }
                None => diffs.push(format!("{name}.{}: no such value in smg-grpc-proto", v.name())),
            }
        }
    }
    for (name, s) in &ours.services {
        let Some(t) = theirs.services.get(name) else {
            diffs.push(format!("service {name}: not in smg-grpc-proto"));
            continue;
        };
        for method in &s.method {
            compared += 1;
            let shape = |m: &prost_types::MethodDescriptorProto| {
                format!(
                    "({}{}) -> ({}{})",
                    if m.client_streaming() { "stream " } else { "" },
                    m.input_type(),
                    if m.server_streaming() { "stream " } else { "" },
                    m.output_type()
                )
            };
            match t.method.iter().find(|tm| tm.name() == method.name()) {
                None => diffs.push(format!("{name}/{}: no such method in smg-grpc-proto", method.name())),
                Some(tm) if shape(tm) != shape(method) => diffs.push(format!(
                    "{name}/{}: kvgate {}; smg-grpc-proto {}",
                    method.name(),
                    shape(method),
                    shape(tm)
                )),
                Some(_) => {}
            }
        }
    }
    (diffs, compared)
}

#[test]
fn kvgate_definitions_match_the_engines_protocol() {
    let ours = kvgate_descriptors();
    let (diffs, compared) = differences(&ours, &smg_descriptors());
    assert!(diffs.is_empty(), "kvgate's proto/ differs from smg-grpc-proto {SMG_GRPC_PROTO}:\n{}", diffs.join("\n"));
    // The services kvgate speaks are all there, and the check looked at a real number of fields.
    let index = Index::of(&ours);
    for service in [".vllm.grpc.engine.VllmEngine", ".sglang.grpc.scheduler.SglangScheduler"] {
        assert!(index.services.contains_key(service), "{service} is defined");
    }
    assert!(compared > 200, "only {compared} fields, values and methods compared");
    eprintln!("{compared} fields, enum values and methods match smg-grpc-proto {SMG_GRPC_PROTO}");
}

#[test]
fn a_changed_field_number_type_or_method_is_reported() {
    let theirs = smg_descriptors();
    let mut ours = kvgate_descriptors();
    let file = ours.file.iter_mut().find(|f| f.package() == "smg.grpc.common").expect("common");
    let batch = file.message_type.iter_mut().find(|m| m.name() == "KvEventBatch").expect("KvEventBatch");
    let seq = batch.field.iter_mut().find(|f| f.name() == "sequence_number").expect("sequence_number");
    seq.number = Some(9);
    let block = file.message_type.iter_mut().find(|m| m.name() == "KvBlock").expect("KvBlock");
    let hash = block.field.iter_mut().find(|f| f.name() == "block_hash").expect("block_hash");
    hash.set_type(prost_types::field_descriptor_proto::Type::Uint64);
    let sglang = ours.file.iter_mut().find(|f| f.package() == "sglang.grpc.scheduler").expect("sglang");
    let service = sglang.service.first_mut().expect("SglangScheduler");
    service.method.iter_mut().find(|m| m.name() == "GetLoads").expect("GetLoads").server_streaming = Some(true);
    let (diffs, _) = differences(&ours, &theirs);
    let report = diffs.join("\n");
    assert_eq!(diffs.len(), 3, "{report}");
    assert!(report.contains(".smg.grpc.common.KvEventBatch.sequence_number: kvgate has number 9"), "{report}");
    assert!(report.contains(".smg.grpc.common.KvBlock.block_hash: kvgate has number 1 type Uint64"), "{report}");
    assert!(report.contains("SglangScheduler/GetLoads"), "{report}");
}
