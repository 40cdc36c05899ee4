//! End to end in network namespaces (root only): a short seeded bank run of three nodes,
//! each in a namespace of its own, under partitions, kill -9 and SIGSTOP, with both cores
//! busy, ends valid. Without root it says so and checks nothing.

mod common;

/// The bank run under partitions, kills and pauses is valid.
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
    let directory = common::valid_run("bank", "netns", &["partition", "kill", "pause"], out.path());
    let faults = common::lines(&directory.join("nemesis.jsonl"));
    assert!(
        faults
            .iter()
            .any(|record| record["kind"] == "partition" && record["outcome"] == "installed"),
        "no partition: {faults:?}"
    );
}
