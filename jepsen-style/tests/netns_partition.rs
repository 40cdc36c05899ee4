//! End to end in network namespaces (root only): a short seeded bank run of three nodes,
//! each in a namespace of its own, under partitions (both ways, one way, flapping), kill -9
//! and SIGSTOP, with both cores busy, ends valid. Without root it says so and checks
//! nothing.

mod common;

/// The bank run under partitions of every shape, kills and pauses is valid.
#[test]
fn bank_under_partitions_is_valid() {
    let root = std::process::Command::new("id")
        .arg("-u")
        .output()
        .is_ok_and(|output| String::from_utf8_lossy(&output.stdout).trim() == "0");
    if !root {
        eprintln!("skipped: network namespaces need root");
        return;
    }
    let out = tempfile::tempdir().expect("a temporary directory");
    // Seed 32 plans, in 20 s: a flapping partition of one node, a kill, a partition of
    // another, the leader hearing nobody (one way).
    let nemeses = ["partition", "partition-one-way", "partition-flap", "kill", "pause"];
    let directory = common::valid_run("bank", "netns", &nemeses, 32, out.path());
    common::assert_installed(
        &directory,
        &["partition", "partition-one-way", "partition-flap", "kill"],
    );
}
