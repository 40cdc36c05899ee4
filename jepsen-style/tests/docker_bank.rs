//! End to end in docker containers: the node image built by `cluster/build-image.sh` from
//! the binary under test, a short seeded bank run of three containers under `docker kill`,
//! `docker pause` and `docker network disconnect`, with both cores busy, ends valid, and
//! leaves no container or network of its project behind. Without a usable docker (and
//! docker-compose) it says so and checks nothing.

mod common;

use std::path::Path;
use std::process::Command;

/// The image the test builds and runs (not the compose demo's `quotamesh:dev`).
const IMAGE: &str = "quotamesh-jepsen:test";

/// Why docker cannot be used here, if it cannot (each probe bounded by `timeout`).
fn docker_unusable() -> Option<String> {
    for probe in [["docker", "info"], ["docker-compose", "version"]] {
        let output = Command::new("timeout").arg("30").args(probe).output();
        match output {
            Ok(output) if output.status.success() => {}
            Ok(output) => {
                let said = String::from_utf8_lossy(&output.stderr);
                return Some(format!("`{}` failed: {}", probe.join(" "), said.trim()));
            }
            Err(error) => return Some(format!("cannot run `{}`: {error}", probe.join(" "))),
        }
    }
    None
}

/// The names (`format`: `{{.Names}}` for containers, `{{.Name}}` for networks) of `what`
/// (`ps -a` or `network ls`) in docker's list whose name holds `name`.
fn docker_names(what: &[&str], format: &str, name: &str) -> String {
    let output = Command::new("timeout")
        .arg("30")
        .arg("docker")
        .args(what)
        .args(["--filter", &format!("name={name}"), "--format", format])
        .output()
        .expect("run docker");
    assert!(output.status.success(), "docker {what:?} failed");
    String::from_utf8_lossy(&output.stdout).trim().to_owned()
}

/// The bank run in containers under kills, pauses and partitions is valid, and everything
/// the run made in docker is gone after it.
#[test]
fn bank_in_containers_under_kill_pause_and_partition_is_valid() {
    if let Some(reason) = docker_unusable() {
        eprintln!("skipped: docker is not usable here: {reason}");
        return;
    }
    let binary = common::quotamesh_binary();
    assert!(binary.is_file(), "{} is missing: build it first", binary.display());
    let script = Path::new(env!("CARGO_MANIFEST_DIR")).join("../cluster/build-image.sh");
    let built = Command::new("timeout")
        .arg("300")
        .arg(&script)
        .arg(IMAGE)
        .env("QUOTAMESH_BIN", &binary)
        .env("NODE_ONLY", "1")
        .status()
        .expect("run cluster/build-image.sh");
    assert!(built.success(), "cluster/build-image.sh {IMAGE} failed");

    let out = tempfile::tempdir().expect("a temporary directory");
    // Seed 7 plans, in 20 s: one node paused, the leader taken off the network, a kill,
    // the whole region paused.
    let nemeses = ["kill", "pause", "partition"];
    let directory =
        common::valid_run_with("bank", "docker", &nemeses, 7, out.path(), &["--image", IMAGE]);
    common::assert_installed(&directory, &nemeses);
    let history = common::lines(&directory.join("history.jsonl"));
    let acknowledged = history.iter().filter(|event| event["type"] == "ok").count();
    assert!(acknowledged > 500, "only {acknowledged} operations were acknowledged");

    // The compose file's first line names the project; nothing of it may remain.
    let compose = std::fs::read_to_string(directory.join("docker-compose.yml"))
        .expect("the run's compose file");
    let project = compose
        .lines()
        .next()
        .and_then(|line| line.split("(project ").nth(1))
        .and_then(|rest| rest.split(')').next())
        .expect("the project named in the compose file")
        .to_owned();
    assert_eq!(docker_names(&["ps", "-a"], "{{.Names}}", &project), "", "containers left behind");
    assert_eq!(
        docker_names(&["network", "ls"], "{{.Name}}", &project),
        "",
        "a network left behind"
    );
}
