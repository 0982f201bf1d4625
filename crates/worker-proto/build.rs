//! Compiles kvgate's own `.proto` files with `protox` (a protobuf compiler in Rust, so a machine with
//! only the Rust toolchain builds: no system `protoc`), then generates the messages with prost and the
//! client and server stubs with tonic. The compiled descriptors are kept for the drift test against
//! SMG's published ones.

use std::path::PathBuf;

fn main() -> Result<(), Box<dyn std::error::Error>> {
    let files = ["proto/smg/common.proto", "proto/sglang/scheduler.proto", "proto/vllm/engine.proto"];
    for f in files {
        println!("cargo:rerun-if-changed={f}");
    }
    let descriptors = protox::compile(files, ["proto"])?;
    let out = PathBuf::from(std::env::var("OUT_DIR")?);
    std::fs::write(out.join("descriptors.bin"), prost::Message::encode_to_vec(&descriptors))?;
    tonic_prost_build::configure().build_client(true).build_server(true).compile_fds(descriptors)?;
    Ok(())
}
