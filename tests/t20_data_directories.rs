//! A voter whose data directory lost one of its Raft groups' directories refuses to start
//! and names the group, rather than forming a fresh, empty group in its place.

use std::ffi::OsString;
use std::net::SocketAddr;
use std::path::Path;

use common::{NodeProcess, free_port, write_file};

const POLICY: &str = "domain: t20\ndescriptors:\n  - key: k\n    rate_limit: {unit: second, requests_per_unit: 10}\n";

/// Starts a single-node voter on `data_dir`, its output to `log`.
fn start(policy: &Path, data_dir: &Path, log: &Path) -> anyhow::Result<NodeProcess> {
    let address =
        |port: u16| -> anyhow::Result<SocketAddr> { Ok(format!("127.0.0.1:{port}").parse()?) };
    let mut arguments: Vec<OsString> =
        vec!["--data-dir".into(), data_dir.into(), "--policy".into(), policy.into()];
    for flag in ["--admin-addr", "--billing-addr", "--raft-addr"] {
        arguments.push(flag.into());
        arguments.push(address(free_port())?.to_string().into());
    }
    NodeProcess::spawn(
        address(free_port())?,
        address(free_port())?,
        data_dir,
        &arguments,
        &[],
        Some(log),
    )
}

/// Each group's directory in turn: removed after a clean stop, the node refuses to start
/// and its error names the directory and says the Raft state was lost.
#[test]
fn a_voter_missing_a_group_directory_refuses_to_start() -> anyhow::Result<()> {
    for group in ["billing", "quota"] {
        let directory = tempfile::tempdir()?;
        let policy = write_file(directory.path(), "policy.yaml", POLICY);
        let data_dir = directory.path().join("data");
        let log = directory.path().join("node.log");
        let mut node = start(&policy, &data_dir, &log)?;
        // Ready (both groups have their leader) before the signal: the node installs its
        // SIGTERM handler only once it has started.
        let deadline = std::time::Instant::now() + std::time::Duration::from_secs(30);
        while !matches!(node.readiness(), Ok((200, _))) {
            anyhow::ensure!(std::time::Instant::now() < deadline, "the node never became ready");
            std::thread::sleep(std::time::Duration::from_millis(50));
        }
        let status = node.terminate()?;
        assert!(status.success(), "first run exited with {status}");
        std::fs::remove_dir_all(data_dir.join(group))?;
        let refused = start(&policy, &data_dir, &log);
        let error = format!("{:#}", refused.err().expect("the node must refuse to start"));
        assert!(error.contains("exited before becoming ready"), "{error}");
        let text = std::fs::read_to_string(&log)?;
        let expected = data_dir.join(group).display().to_string();
        assert!(
            text.lines().any(|line| line.contains(&expected) && line.contains("missing or empty")),
            "the log does not say that {group} is missing:\n{}",
            text.lines().rev().take(5).collect::<Vec<_>>().join("\n")
        );
    }
    Ok(())
}
