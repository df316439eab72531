//! Compiles `schema/agent.proto` with protox (a pure-Rust protobuf compiler), so building needs
//! no `protoc` binary.

fn main() -> Result<(), Box<dyn std::error::Error>> {
    let schema = concat!(env!("CARGO_MANIFEST_DIR"), "/../schema");
    println!("cargo:rerun-if-changed={schema}/agent.proto");
    let descriptors = protox::compile(["agent.proto"], [schema])?;
    tonic_prost_build::configure().build_client(true).build_server(true).compile_fds(descriptors)?;
    Ok(())
}
