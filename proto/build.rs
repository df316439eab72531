//! Compiles `schema/agent.proto` with protox (a pure-Rust protobuf compiler), so building needs
//! no `protoc` binary.

fn main() -> Result<(), Box<dyn std::error::Error>> {
    let schema = concat!(env!("CARGO_MANIFEST_DIR"), "/../schema");
    println!("cargo:rerun-if-changed={schema}/agent.proto");
    let descriptors = protox::compile(["agent.proto"], [schema])?;
    // The encoded descriptor set, for the gateway's server reflection (`FILE_DESCRIPTOR_SET`).
    let out_dir = std::path::PathBuf::from(std::env::var("OUT_DIR")?);
    std::fs::write(out_dir.join("agent_descriptor.bin"), protox::prost::Message::encode_to_vec(&descriptors))?;
    // A tunnel's frames are `bytes::Bytes`: decoded as a slice of the call's buffer and relayed
    // on without a copy (a `Vec<u8>` would be one more copy of every byte each way).
    tonic_prost_build::configure()
        .build_client(true)
        .build_server(true)
        .bytes(".bettercompute.agent.v1.TunnelFrame.frame")
        .compile_fds(descriptors)?;
    Ok(())
}
