//! The `docker` topology's containers: one per node, from the FROM-scratch image that
//! `cluster/build-image.sh` builds, under a docker-compose project of the run's own (its
//! compose file in the run's directory), on one network of the project's. Each container
//! runs as the owner of the run's directory and mounts that directory at its own path, so
//! the configs, certificates, policy files and data directories `processes` writes serve
//! unchanged; the runner reaches each node through ports published on 127.0.0.1. Starting a
//! node, and its log, are `processes`' (`docker start --attach` is the node's child
//! process); the faults and the teardown are here:
//!
//! ```text
//!   runner ── 127.0.0.1:P ──> [container node-1: 0.0.0.0:8081..8084, 6070] ─┐
//!                             [container node-2]  ───── project network ────┤
//!                             [container node-3]  ──────────────────────────┘
//!   kill: docker kill (SIGKILL), docker start    pause: docker pause, docker unpause
//!   partition: docker network disconnect (the node off the network), docker network connect
//! ```
//!
//! `docker-compose down --volumes` removes the containers, the network and the image's
//! anonymous data volumes when the run ends, pass or fail (also from `Drop`).

use std::collections::BTreeSet;
use std::path::{Path, PathBuf};
use std::process::Stdio;
use std::time::Duration;

use anyhow::{Context, bail};

/// One `docker` or `docker-compose` command may take this long (a daemon under load).
const COMMAND_TIMEOUT: Duration = Duration::from_secs(60);
/// The teardown may take this long: each container gets docker-compose's 10 s to stop.
const DOWN_TIMEOUT_S: u64 = 120;

/// What one node's container runs and publishes.
pub struct ContainerSpec {
    /// The node's config (inside the run's directory, at the same path in the container).
    pub config_path: PathBuf,
    /// (the runner's address for it on 127.0.0.1, the port inside the container).
    pub published: Vec<(String, u16)>,
}

/// The compose project of one run.
pub struct Compose {
    /// The docker-compose project, also the network's and the containers' prefix.
    project: String,
    file: PathBuf,
    /// Taken off the network by a partition, by position.
    disconnected: BTreeSet<usize>,
    /// `up` created something that `down` must remove.
    created: bool,
}

impl Compose {
    /// Names the project of a run whose compose file goes in `directory`; nothing is
    /// created yet.
    pub fn new(directory: &Path) -> Self {
        let unique =
            std::process::id() ^ u32::try_from(crate::run::unix_ms() % (1 << 20)).unwrap_or(0);
        Self {
            project: format!("quotamesh-jepsen-{unique:x}"),
            file: directory.join("docker-compose.yml"),
            disconnected: BTreeSet::new(),
            created: false,
        }
    }

    /// Node `position`'s container name, also the name the other nodes dial (any container
    /// on a user-defined network resolves by its name, also after a reconnect).
    pub fn container(&self, position: usize) -> String {
        format!("{}-node-{}", self.project, position + 1)
    }

    /// Writes the compose file for `nodes` (by position) running `image`, and creates the
    /// network and the containers without starting them.
    ///
    /// # Errors
    /// Docker is not usable, the image is missing, or `docker-compose` fails.
    pub async fn create(
        &mut self,
        image: &str,
        directory: &Path,
        nodes: &[ContainerSpec],
    ) -> anyhow::Result<()> {
        docker(&["image", "inspect", "--format", "{{.Id}}", image]).await.with_context(|| {
            format!(
                "no image {image}: build it from the quotamesh binary with \
                 `QUOTAMESH_BIN=<binary> NODE_ONLY=1 cluster/build-image.sh {image}`"
            )
        })?;
        // The owner of the run's directory, so the nodes read its keys and write their data
        // there as the runner's own processes would.
        let owner = {
            use std::os::unix::fs::MetadataExt;
            let metadata = std::fs::metadata(directory)
                .with_context(|| format!("stat {}", directory.display()))?;
            format!("{}:{}", metadata.uid(), metadata.gid())
        };
        // JSON strings are YAML strings: paths and names need no escaping of their own.
        let quoted = |text: &str| serde_json::Value::from(text).to_string();
        let mount = quoted(&format!("{0}:{0}", directory.display()));
        let mut text = format!(
            "# Written by quotamesh-jepsen for one run (project {project}); removed with\n\
             # docker-compose -p {project} -f docker-compose.yml down --volumes\n\
             version: \"3.8\"\nservices:\n",
            project = self.project
        );
        for (position, node) in nodes.iter().enumerate() {
            let ports: Vec<String> = node
                .published
                .iter()
                .map(|(address, port)| quoted(&format!("{address}:{port}")))
                .collect();
            text.push_str(&format!(
                "  node-{number}:\n    image: {image}\n    container_name: {name}\n    \
                 user: {owner}\n    command: [\"serve\", \"--config\", {config}]\n    \
                 environment: {{RUST_BACKTRACE: \"1\"}}\n    ports: [{ports}]\n    \
                 volumes: [{mount}]\n    networks: [region]\n",
                number = position + 1,
                image = quoted(image),
                name = quoted(&self.container(position)),
                owner = quoted(&owner),
                config = quoted(&node.config_path.display().to_string()),
                ports = ports.join(", "),
            ));
        }
        text.push_str(&format!("networks:\n  region:\n    name: {}\n", quoted(&self.project)));
        std::fs::write(&self.file, text)
            .with_context(|| format!("write {}", self.file.display()))?;
        self.created = true;
        self.compose(&["up", "--no-start"]).await
    }

    /// `docker kill` (SIGKILL) of node `position`'s container.
    ///
    /// # Errors
    /// The command fails (the container is not running, say).
    pub async fn kill(&self, position: usize) -> anyhow::Result<()> {
        docker(&["kill", &self.container(position)]).await
    }

    /// `docker pause` (the cgroup freezer: every process of the container stops).
    ///
    /// # Errors
    /// The command fails.
    pub async fn pause(&self, position: usize) -> anyhow::Result<()> {
        docker(&["pause", &self.container(position)]).await
    }

    /// `docker unpause`.
    ///
    /// # Errors
    /// The command fails.
    pub async fn unpause(&self, position: usize) -> anyhow::Result<()> {
        docker(&["unpause", &self.container(position)]).await
    }

    /// Cuts the links `pairs` (of node positions, `nemesis::cut_links`) of `nodes` nodes by
    /// taking the nodes [`isolated`] names off the network.
    ///
    /// # Errors
    /// A partition `docker network disconnect` cannot make, or a docker command fails.
    pub async fn partition(
        &mut self,
        pairs: &[(usize, usize)],
        nodes: usize,
    ) -> anyhow::Result<()> {
        for position in isolated(pairs, nodes)? {
            if self.disconnected.insert(position) {
                docker(&["network", "disconnect", &self.project, &self.container(position)])
                    .await?;
            }
        }
        Ok(())
    }

    /// Puts every node a partition took off back on the network.
    ///
    /// # Errors
    /// A docker command fails (the node stays listed, so the next heal tries again).
    pub async fn heal(&mut self) -> anyhow::Result<()> {
        while let Some(&position) = self.disconnected.first() {
            docker(&["network", "connect", &self.project, &self.container(position)]).await?;
            self.disconnected.remove(&position);
        }
        Ok(())
    }

    /// `docker-compose down --volumes`: the containers (stopped first), the network and the
    /// containers' anonymous volumes. Synchronous, so it also runs from `Drop`; bounded by
    /// coreutils' `timeout`.
    pub fn destroy(&mut self) {
        if !std::mem::take(&mut self.created) {
            return;
        }
        let down = std::process::Command::new("timeout")
            .arg(DOWN_TIMEOUT_S.to_string())
            .arg("docker-compose")
            .args(["--project-name", &self.project, "--file"])
            .arg(&self.file)
            .args(["down", "--volumes", "--remove-orphans", "--timeout", "10"])
            .stdin(Stdio::null())
            .stdout(Stdio::null())
            .stderr(Stdio::piped())
            .output();
        match down {
            Ok(output) if output.status.success() => {}
            Ok(output) => eprintln!(
                "quotamesh-jepsen: docker-compose down of {} failed: {}",
                self.project,
                String::from_utf8_lossy(&output.stderr).trim()
            ),
            Err(error) => eprintln!("quotamesh-jepsen: run docker-compose down: {error}"),
        }
    }

    /// `docker-compose` on the project.
    async fn compose(&self, arguments: &[&str]) -> anyhow::Result<()> {
        let file = self.file.display().to_string();
        let mut command = vec!["docker-compose", "--project-name", &self.project, "--file", &file];
        command.extend_from_slice(arguments);
        super::run_command(&command, None, COMMAND_TIMEOUT).await
    }
}

impl Drop for Compose {
    fn drop(&mut self) {
        self.destroy();
    }
}

/// The nodes to take off the network so that exactly the links `pairs` (of positions among
/// `nodes`) are cut. `docker network disconnect` takes a node off whole (the runner loses
/// it too): the nodes cut from every other one go, and a partition with a cut link between
/// two nodes that both keep others (a bridge, a minority of two among five) is refused.
///
/// # Errors
/// Such a partition.
fn isolated(pairs: &[(usize, usize)], nodes: usize) -> anyhow::Result<BTreeSet<usize>> {
    let cut = |first: usize, second: usize| {
        pairs.contains(&(first, second)) || pairs.contains(&(second, first))
    };
    let alone: BTreeSet<usize> = (0..nodes)
        .filter(|position| (0..nodes).all(|other| other == *position || cut(*position, other)))
        .collect();
    if let Some((first, second)) =
        pairs.iter().find(|(first, second)| !alone.contains(first) && !alone.contains(second))
    {
        bail!(
            "docker network disconnect cuts whole nodes, but this partition cuts node {} from \
             node {} only (use --topology netns)",
            first + 1,
            second + 1
        );
    }
    Ok(alone)
}

async fn docker(arguments: &[&str]) -> anyhow::Result<()> {
    let mut command = vec!["docker"];
    command.extend_from_slice(arguments);
    super::run_command(&command, None, COMMAND_TIMEOUT).await
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::nemesis::{Target, cut_links};

    /// A node cut from the rest, or every node alone, is taken off whole; a bridge and a
    /// minority of two among five, which keep some of a cut node's links, are refused.
    #[test]
    fn only_whole_nodes_are_taken_off() {
        let taken = |target: &Target, positions: &[usize], nodes: usize| {
            isolated(&cut_links(target, positions, nodes), nodes).ok()
        };
        assert_eq!(taken(&Target::One(1), &[1], 3), Some(BTreeSet::from([1])));
        assert_eq!(taken(&Target::Leader, &[0], 3), Some(BTreeSet::from([0])));
        assert_eq!(taken(&Target::All, &[0, 1, 2], 3), Some(BTreeSet::from([0, 1, 2])));
        assert_eq!(taken(&Target::Minority(vec![4]), &[4], 5), Some(BTreeSet::from([4])));
        assert_eq!(taken(&Target::Bridge(0), &[0], 3), None);
        assert_eq!(taken(&Target::Minority(vec![1, 3]), &[1, 3], 5), None);
    }
}
