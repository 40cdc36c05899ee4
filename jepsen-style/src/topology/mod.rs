//! Topologies: where the nodes under test run and how faults reach them. Every node is a
//! child process of the runner (`processes`: spawn, SIGKILL, SIGSTOP/SIGCONT); `local` puts
//! them all on 127.0.0.1, `netns` gives each a network namespace of its own on a bridge, so
//! nft rules can cut links between them (`netns`), and `docker` runs each in a container of
//! a docker-compose project, the child being `docker start --attach` (`docker`: docker
//! kill, pause and network disconnect).

pub mod docker;
pub mod netns;
pub mod processes;

use serde::{Deserialize, Serialize};

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
