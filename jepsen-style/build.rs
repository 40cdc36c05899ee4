//! Generates the gRPC clients of the node's billing and admin APIs and Envoy Rate Limit Service from
//! the project's `proto/` with protox (no system `protoc`). Clients only: the suite serves
//! nothing.

fn main() -> Result<(), Box<dyn std::error::Error>> {
    println!("cargo:rerun-if-changed=../proto");
    let mut compiler = protox::Compiler::new(["../proto"])?;
    compiler.include_imports(true);
    compiler.open_files([
        "quotamesh/billing/v1/billing.proto",
        "quotamesh/admin/v1/admin.proto",
        "envoy/service/ratelimit/v3/rls.proto",
    ])?;
    tonic_prost_build::configure()
        .build_client(true)
        .build_server(false)
        .compile_fds(compiler.file_descriptor_set())?;
    Ok(())
}
