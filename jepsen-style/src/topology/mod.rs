//! Topologies: where the nodes under test run and how faults reach them. Every node is a
//! child process of the runner (`processes`: spawn, SIGKILL, SIGSTOP/SIGCONT); `local` puts
//! them all on 127.0.0.1, `netns` gives each a network namespace of its own on a bridge, so
//! nft rules can cut links between them (`netns`), and `docker` runs each in a container of
//! a docker-compose project, the child being `docker start --attach` (`docker`: docker
//! kill, pause and network disconnect).

pub mod docker;
pub mod netns;
pub mod processes;

use std::process::Stdio;
use std::time::Duration;

use anyhow::{Context, bail};
use serde::{Deserialize, Serialize};
use tokio::process::Command;

/// Where the nodes run.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize, Deserialize)]
#[serde(rename_all = "kebab-case")]
pub enum Topology {
    /// Processes on loopback: kill and pause.
    Local,
    /// Processes in network namespaces joined by veth pairs and a bridge (needs root):
    /// kill, pause and partitions.
    Netns,
    /// Containers of the quotamesh image on a docker network: kill, pause and partitions
    /// that take whole nodes off the network.
    Docker,
}

impl Topology {
    /// Parses a `--topology` name.
    ///
    /// # Errors
    /// An unknown name.
    pub fn parse(name: &str) -> Result<Self, String> {
        match name {
            "local" => Ok(Self::Local),
            "netns" => Ok(Self::Netns),
            "docker" => Ok(Self::Docker),
            other => Err(format!("unknown topology {other:?}; known: local, netns, docker")),
        }
    }

    pub fn name(self) -> &'static str {
        match self {
            Self::Local => "local",
            Self::Netns => "netns",
            Self::Docker => "docker",
        }
    }
}

/// Runs `command` (with `input` on stdin when given) within `timeout`, its output discarded.
///
/// # Errors
/// It cannot start, takes longer, or fails (with what it printed on stderr).
async fn run_command(
    command: &[&str],
    input: Option<&str>,
    timeout: Duration,
) -> anyhow::Result<()> {
    use tokio::io::AsyncWriteExt;
    let mut child = Command::new(command[0])
        .args(&command[1..])
        .stdin(if input.is_some() { Stdio::piped() } else { Stdio::null() })
        .stdout(Stdio::null())
        .stderr(Stdio::piped())
        .kill_on_drop(true)
        .spawn()
        .with_context(|| format!("run {}", command.join(" ")))?;
    if let (Some(text), Some(mut stdin)) = (input, child.stdin.take()) {
        stdin.write_all(text.as_bytes()).await?;
    }
    let output = tokio::time::timeout(timeout, child.wait_with_output())
        .await
        .with_context(|| format!("{} took over {timeout:?}", command.join(" ")))??;
    if !output.status.success() {
        bail!("{} failed: {}", command.join(" "), String::from_utf8_lossy(&output.stderr).trim());
    }
    Ok(())
}
