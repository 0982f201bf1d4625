//! SMG's gRPC worker protocol, the one SMG's gRPC mode speaks to vLLM and SGLang engines, as far as
//! kvgate uses it: the messages (prost) and the client and server stubs (tonic) of
//! `vllm.grpc.engine.VllmEngine` and `sglang.grpc.scheduler.SglangScheduler`, and the types they share
//! in `smg.grpc.common` (KV events and the load pushed with them, the tokenizer download).
//!
//! The definitions are kvgate's own (`proto/`), a subset of what the `smg-grpc-proto` package on PyPI
//! publishes: a field kvgate does not use is left out, and protobuf's wire format skips what a
//! message carries beyond its definition. `tests/smg_descriptors.rs` checks every message, field
//! number, type and label, and every method, against the package's own descriptors, so a change on
//! either side is caught.
//!
//! ```
//! use kvgate_worker_proto::sglang;
//! use prost::Message;
//!
//! let request = sglang::GenerateRequest {
//!     request_id: "r1".into(),
//!     tokenized: Some(sglang::TokenizedInput { original_text: String::new(), input_ids: vec![1, 2, 3] }),
//!     stream: true,
//!     ..Default::default()
//! };
//! let bytes = request.encode_to_vec();
//! assert_eq!(sglang::GenerateRequest::decode(bytes.as_slice()).unwrap(), request);
//! ```

#![forbid(unsafe_code)]

/// Generated code: prost's and tonic's output carries no doc comments of its own.
#[allow(missing_docs, clippy::all, clippy::pedantic)]
mod generated {
    pub mod smg {
        pub mod grpc {
            pub mod common {
                include!(concat!(env!("OUT_DIR"), "/smg.grpc.common.rs"));
            }
        }
    }
    pub mod sglang {
        pub mod grpc {
            pub mod scheduler {
                include!(concat!(env!("OUT_DIR"), "/sglang.grpc.scheduler.rs"));
            }
        }
    }
    pub mod vllm {
        pub mod grpc {
            pub mod engine {
                include!(concat!(env!("OUT_DIR"), "/vllm.grpc.engine.rs"));
            }
        }
    }
}

/// `sglang.grpc.scheduler`: SGLang's `SglangScheduler` service and its messages.
pub use generated::sglang::grpc::scheduler as sglang;
/// `smg.grpc.common`: KV event batches, pushed load, tokenizer chunks, cache flushes.
pub use generated::smg::grpc::common;
/// `vllm.grpc.engine`: vLLM's `VllmEngine` service and its messages.
pub use generated::vllm::grpc::engine as vllm;

/// The compiled descriptors of kvgate's definitions (an encoded `FileDescriptorSet`), for checking
/// them against the engines' own.
pub const FILE_DESCRIPTOR_SET: &[u8] = include_bytes!(concat!(env!("OUT_DIR"), "/descriptors.bin"));
