//! Topologies: where the nodes under test run and how faults reach them. Either way every
//! node is a child process of the runner (`processes`: spawn, SIGKILL, SIGSTOP/SIGCONT);
//! `local` puts them all on 127.0.0.1, `netns` gives each a network namespace of its own
//! on a bridge, so nft rules can cut links between them (`netns`).

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
            other => Err(format!("unknown topology {other:?}; known: local, netns")),
        }
    }

    pub fn name(self) -> &'static str {
        match self {
            Self::Local => "local",
            Self::Netns => "netns",
        }
    }
}
