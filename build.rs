//! Compiles `proto/` with protox (a pure-Rust protobuf compiler), so a fresh machine builds
//! with cargo alone: no system `protoc`. The encoded descriptor set is written next to the
//! generated code for tonic-reflection, because `compile_fds` does not write it itself.

fn main() -> Result<(), Box<dyn std::error::Error>> {
    println!("cargo:rerun-if-changed=proto");
    let out_dir = std::path::PathBuf::from(std::env::var("OUT_DIR")?);
    let mut compiler = protox::Compiler::new(["proto"])?;
    compiler.include_imports(true).include_source_info(true);
    compiler.open_files([
        "envoy/service/ratelimit/v3/rls.proto",
        "quotamesh/raft/v1/raft.proto",
        "quotamesh/admin/v1/admin.proto",
        "quotamesh/billing/v1/billing.proto",
    ])?;
    std::fs::write(
        out_dir.join("quotamesh_descriptor.bin"),
        compiler.encode_file_descriptor_set(),
    )?;
    tonic_prost_build::configure()
        .build_client(true)
        .build_server(true)
        .compile_fds(compiler.file_descriptor_set())?;
    Ok(())
}
