//! Compiles `proto/` with protox (a pure-Rust protobuf compiler), so a fresh machine builds
//! with cargo alone: no system `protoc`. The encoded descriptor set is written next to the
//! generated code for tonic-reflection, because `compile_fds` does not write it itself.
//! Also sets `QUOTAMESH_GIT_COMMIT` (the `commit` of `quotamesh_build_info`): from the
//! variable of that name when set (an image built without `.git`), else `git rev-parse`,
//! else `unknown`.

fn main() -> Result<(), Box<dyn std::error::Error>> {
    println!("cargo:rerun-if-changed=proto");
    println!("cargo:rustc-env=QUOTAMESH_GIT_COMMIT={}", git_commit());
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

/// The commit being built, and the files whose change means another commit.
fn git_commit() -> String {
    println!("cargo:rerun-if-env-changed=QUOTAMESH_GIT_COMMIT");
    if let Ok(commit) = std::env::var("QUOTAMESH_GIT_COMMIT") {
        return commit;
    }
    let git = |arguments: &[&str]| {
        std::process::Command::new("git")
            .args(arguments)
            .output()
            .ok()
            .filter(|output| output.status.success())
            .and_then(|output| String::from_utf8(output.stdout).ok())
            .map(|text| text.trim().to_owned())
            .filter(|text| !text.is_empty())
    };
    let Some(commit) = git(&["rev-parse", "--short=12", "HEAD"]) else {
        return "unknown".to_owned();
    };
    // HEAD names the branch; the branch's ref (or packed-refs) names the commit.
    let mut watched = vec![git(&["rev-parse", "--git-path", "HEAD"])];
    if let Some(branch) = git(&["symbolic-ref", "-q", "HEAD"]) {
        watched.push(git(&["rev-parse", "--git-path", &branch]));
        watched.push(git(&["rev-parse", "--git-path", "packed-refs"]));
    }
    for path in watched.into_iter().flatten() {
        if std::path::Path::new(&path).exists() {
            println!("cargo:rerun-if-changed={path}");
        }
    }
    commit
}
