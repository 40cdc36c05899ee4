//! Whose data directory this is: the cluster id and Raft node id a node stored there on its
//! first start, checked on every later start.
//!
//! A Raft node that starts on another node's log, or on a log of another cluster, can vote
//! twice in one term or replicate foreign entries; one that finds its log gone and starts
//! afresh forgets votes and acknowledged entries. So a node never guesses:
//!
//! ```text
//!  identity file   group directories     outcome
//!  absent          absent or empty       first start: write the identity (fsync'd, renamed)
//!  absent          hold data             refuse: data of unknown origin
//!  present, ours   present               start
//!  present, ours   missing or empty      refuse: the Raft state was lost
//!  present, other  any                   refuse: another cluster's or node's directory
//!  unreadable      any                   refuse: corrupt
//! ```
//!
//! The file is small JSON, so an operator can read it. Opening the groups themselves (and
//! refusing a corrupt log or state) is `crate::ledger`'s; wiring this in is `crate::node`'s.

use std::io::Write;
use std::path::{Path, PathBuf};

use serde::{Deserialize, Serialize};

use crate::core::ledger::NodeId;

/// The identity file's name inside the data directory.
pub const IDENTITY_FILE_NAME: &str = "identity.json";
/// Format version written into the file; a node refuses versions it does not know.
pub const IDENTITY_FORMAT: u32 = 1;
/// Largest identity file read; a real one is under 200 bytes.
const IDENTITY_FILE_BYTES_MAX: u64 = 4096;

/// Who owns a data directory.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct NodeIdentity {
    /// The file format, [`IDENTITY_FORMAT`].
    pub format: u32,
    /// The cluster (region) the node belongs to.
    pub cluster_id: String,
    /// The node's Raft id.
    pub raft_node_id: NodeId,
}

impl NodeIdentity {
    /// The identity of node `raft_node_id` of cluster `cluster_id`.
    pub fn new(cluster_id: impl Into<String>, raft_node_id: NodeId) -> Self {
        Self { format: IDENTITY_FORMAT, cluster_id: cluster_id.into(), raft_node_id }
    }
}

/// How the data directory was found.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Claim {
    /// A new directory: the identity was just written.
    FirstStart,
    /// The directory was this node's already.
    Returning,
}

/// Why a node refuses its data directory. None of these goes away by retrying: the
/// configuration or the directory needs an operator.
#[derive(Debug, thiserror::Error)]
pub enum IdentityError {
    /// The identity file or the directory could not be read or written.
    #[error("cannot access {path}: {source}")]
    Io {
        /// The file or directory.
        path: PathBuf,
        /// The OS error.
        #[source]
        source: std::io::Error,
    },
    /// The identity file does not parse or has an unknown format.
    #[error(
        "the data directory is corrupt: {path} cannot be read ({reason}); restore the directory \
         from a backup, or move it away to start this node afresh and re-add it to its cluster"
    )]
    Corrupt {
        /// The identity file.
        path: PathBuf,
        /// What is wrong with it.
        reason: String,
    },
    /// The directory belongs to another cluster.
    #[error(
        "the data directory belongs to cluster {stored:?}, but this node is configured for \
         cluster {configured:?} ({path}); refusing to start rather than mix two clusters' state"
    )]
    OtherCluster {
        /// The identity file.
        path: PathBuf,
        /// The cluster id stored there.
        stored: String,
        /// The configured cluster id.
        configured: String,
    },
    /// The directory belongs to another node of the cluster.
    #[error(
        "the data directory belongs to Raft node {stored}, but this node is configured as Raft \
         node {configured} ({path}); refusing to start rather than take over another node's log"
    )]
    OtherNode {
        /// The identity file.
        path: PathBuf,
        /// The node id stored there.
        stored: NodeId,
        /// The configured node id.
        configured: NodeId,
    },
    /// A group directory holds data but no identity file says whose it is.
    #[error(
        "the data directory holds Raft state in {group_dir} but no {IDENTITY_FILE_NAME}; it was \
         not created by this version of quotamesh or is damaged; refusing to start"
    )]
    UnknownOrigin {
        /// The group directory with data.
        group_dir: PathBuf,
    },
    /// The identity file exists but a group's Raft state is gone.
    #[error(
        "the data directory says it belongs to Raft node {raft_node_id} of cluster \
         {cluster_id:?}, but its Raft state {group_dir} is missing or empty; refusing to start \
         afresh, which would forget its votes and log (remove the node from its cluster, then \
         start it on an empty directory)"
    )]
    GroupMissing {
        /// The missing group directory.
        group_dir: PathBuf,
        /// The stored cluster id.
        cluster_id: String,
        /// The stored node id.
        raft_node_id: NodeId,
    },
}

/// Checks that `data_dir` belongs to `expected`, writing the identity on a first start.
/// `group_dirs` are the directories (inside `data_dir`) of the Raft groups whose state must
/// exist once the identity does.
///
/// # Errors
/// [`IdentityError`] when the directory belongs to another cluster or node, is corrupt, or
/// lost its Raft state.
pub fn claim(
    data_dir: &Path,
    expected: &NodeIdentity,
    group_dirs: &[&str],
) -> Result<Claim, IdentityError> {
    let path = data_dir.join(IDENTITY_FILE_NAME);
    let io = |path: &Path| {
        let path = path.to_owned();
        move |source| IdentityError::Io { path, source }
    };
    let stored = match std::fs::metadata(&path) {
        Err(error) if error.kind() == std::io::ErrorKind::NotFound => None,
        Err(error) => return Err(io(&path)(error)),
        Ok(metadata) if metadata.len() > IDENTITY_FILE_BYTES_MAX => {
            return Err(IdentityError::Corrupt {
                path,
                reason: format!("{} bytes, more than {IDENTITY_FILE_BYTES_MAX}", metadata.len()),
            });
        }
        Ok(_) => Some(std::fs::read(&path).map_err(io(&path))?),
    };
    let Some(bytes) = stored else {
        for group in group_dirs {
            let group_dir = data_dir.join(group);
            if holds_data(&group_dir).map_err(io(&group_dir))? {
                return Err(IdentityError::UnknownOrigin { group_dir });
            }
        }
        write_identity(data_dir, &path, expected)?;
        return Ok(Claim::FirstStart);
    };
    let stored: NodeIdentity = serde_json::from_slice(&bytes).map_err(|error| {
        IdentityError::Corrupt { path: path.clone(), reason: error.to_string() }
    })?;
    if stored.format != IDENTITY_FORMAT {
        return Err(IdentityError::Corrupt {
            path,
            reason: format!(
                "unknown format {} (this version knows {IDENTITY_FORMAT})",
                stored.format
            ),
        });
    }
    if stored.cluster_id != expected.cluster_id {
        return Err(IdentityError::OtherCluster {
            path,
            stored: stored.cluster_id,
            configured: expected.cluster_id.clone(),
        });
    }
    if stored.raft_node_id != expected.raft_node_id {
        return Err(IdentityError::OtherNode {
            path,
            stored: stored.raft_node_id,
            configured: expected.raft_node_id,
        });
    }
    for group in group_dirs {
        let group_dir = data_dir.join(group);
        if !holds_data(&group_dir).map_err(io(&group_dir))? {
            return Err(IdentityError::GroupMissing {
                group_dir,
                cluster_id: stored.cluster_id,
                raft_node_id: stored.raft_node_id,
            });
        }
    }
    Ok(Claim::Returning)
}

/// Whether `directory` exists and has at least one entry.
fn holds_data(directory: &Path) -> std::io::Result<bool> {
    match std::fs::read_dir(directory) {
        Ok(mut entries) => Ok(entries.next().transpose()?.is_some()),
        Err(error) if error.kind() == std::io::ErrorKind::NotFound => Ok(false),
        Err(error) => Err(error),
    }
}

/// Writes the identity durably: a temporary file, fsync'd, renamed into place, and the
/// directory fsync'd, so a crash leaves either no identity or a whole one.
fn write_identity(
    data_dir: &Path,
    path: &Path,
    identity: &NodeIdentity,
) -> Result<(), IdentityError> {
    let temporary = data_dir.join(format!("{IDENTITY_FILE_NAME}.tmp"));
    let io = |path: &Path| {
        let path = path.to_owned();
        move |source| IdentityError::Io { path, source }
    };
    let mut text = serde_json::to_vec_pretty(identity)
        .map_err(|error| io(path)(std::io::Error::other(error)))?;
    text.push(b'\n');
    {
        let mut file = std::fs::File::create(&temporary).map_err(io(&temporary))?;
        file.write_all(&text).map_err(io(&temporary))?;
        file.sync_all().map_err(io(&temporary))?;
    }
    std::fs::rename(&temporary, path).map_err(io(path))?;
    std::fs::File::open(data_dir).and_then(|directory| directory.sync_all()).map_err(io(data_dir))
}

#[cfg(test)]
mod tests {
    use super::*;

    fn identity(cluster: &str, node: u64) -> NodeIdentity {
        NodeIdentity::new(cluster, NodeId(node))
    }

    /// A first start writes the identity; the same node then returns; another cluster or
    /// node id is refused, naming both.
    #[test]
    fn first_start_then_checks() -> Result<(), IdentityError> {
        let directory = tempfile::tempdir()
            .map_err(|source| IdentityError::Io { path: PathBuf::from("tempdir"), source })?;
        let data = directory.path();
        assert_eq!(claim(data, &identity("a", 1), &["quota"])?, Claim::FirstStart);
        std::fs::create_dir_all(data.join("quota")).expect("mkdir");
        std::fs::write(data.join("quota/log"), b"x").expect("write");
        assert_eq!(claim(data, &identity("a", 1), &["quota"])?, Claim::Returning);
        let other = claim(data, &identity("b", 1), &["quota"]).expect_err("other cluster");
        assert!(other.to_string().contains("\"a\"") && other.to_string().contains("\"b\""));
        let other = claim(data, &identity("a", 2), &["quota"]).expect_err("other node");
        assert!(matches!(other, IdentityError::OtherNode { .. }), "{other}");
        Ok(())
    }

    /// A corrupt file, a lost group and group data without an identity are all refused.
    #[test]
    fn damage_is_refused() {
        let directory = tempfile::tempdir().expect("tempdir");
        let data = directory.path();
        std::fs::create_dir_all(data.join("quota")).expect("mkdir");
        std::fs::write(data.join("quota/log"), b"x").expect("write");
        let error = claim(data, &identity("a", 1), &["quota"]).expect_err("unknown origin");
        assert!(matches!(error, IdentityError::UnknownOrigin { .. }), "{error}");

        std::fs::remove_dir_all(data.join("quota")).expect("rm");
        assert!(claim(data, &identity("a", 1), &["quota"]).is_ok());
        let error = claim(data, &identity("a", 1), &["quota"]).expect_err("group missing");
        assert!(matches!(error, IdentityError::GroupMissing { .. }), "{error}");

        std::fs::write(data.join(IDENTITY_FILE_NAME), b"{not json").expect("write");
        let error = claim(data, &identity("a", 1), &["quota"]).expect_err("corrupt");
        assert!(error.to_string().contains("corrupt"), "{error}");
    }
}
