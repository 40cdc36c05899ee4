//! A region of N `quotamesh serve` child processes, each with its own addresses, TOML
//! config, data directory and log under the run's directory, formed as an operator would:
//! certificates from `quotamesh cluster certs`, token digests from `quotamesh billing
//! hash-token`, node 1 bootstrapping the billing group and `quotamesh cluster init` forming
//! the quota group. On `local` the nodes share 127.0.0.1 with ports of their own; on `netns`
//! each has its own namespace and address with the default ports (`super::netns`); on
//! `docker` each is a container listening on the default ports, which the runner reaches
//! through ports published on 127.0.0.1, and its child process is `docker start --attach`
//! (`super::docker`: SIGKILL, SIGSTOP and SIGCONT become `docker kill`, `pause`, `unpause`).
//! Faults: SIGKILL (then a restart on the same data directory), SIGSTOP and SIGCONT, wall
//! clock offsets (each node then runs under libfaketime, reading its offset from a file of
//! its own), policy files rewritten (each node has its own), a voter removed and added back
//! through the CLI, full data disks (each data directory then a small tmpfs), and on `netns`
//! partitions (both ways or one way), on `docker` nodes taken off the network.
//! Gateways (`role = "gateway"`: RLS and leases through the voters, no replica, no vote)
//! follow the voters in `Cluster::nodes`, with the next ids; no fault aims at them.

use std::path::{Path, PathBuf};
use std::process::Stdio;
use std::time::{Duration, Instant};

use anyhow::{Context, bail};
use tokio::io::{AsyncReadExt, AsyncWriteExt};
use tokio::process::{Child, Command};

use super::Topology;
use super::docker::{Compose, ContainerSpec};
use super::netns::Namespaces;
use crate::history::NodeId;
use crate::nemesis::{FaultKind, PolicyEdit};

/// How long a node may take to answer `/healthz` after it is spawned.
const READY_TIMEOUT: Duration = Duration::from_secs(30);
/// How long one CLI command (certificates, token digests, `cluster init`) may take.
const COMMAND_TIMEOUT: Duration = Duration::from_secs(60);
/// One HTTP request to a node's metrics port.
const HTTP_TIMEOUT: Duration = Duration::from_secs(2);
/// Between two looks at a starting node.
const POLL: Duration = Duration::from_millis(50);
/// Ports handed to nodes: below Linux's ephemeral range, so no outgoing connection takes one
/// between the check here and the node's bind.
const PORTS: std::ops::Range<u16> = 20_000..32_000;
/// With disk faults, each node's data directory is a tmpfs of this size: room for a short
/// run's logs and snapshots, little to fill.
const DATA_DISK_BYTES: u64 = 128 << 20;
/// How long the heal keeps trying to add a removed voter back (the region may be electing
/// a leader after the removal of its last one).
const ADD_BACK_WAIT: Duration = Duration::from_secs(15);
/// Between two tries.
const ADD_BACK_PAUSE: Duration = Duration::from_millis(250);
/// The file a disk fault fills a data directory with.
const FILLER: &str = "jepsen-filler";
/// The shipped default ports, which nodes in namespaces and containers listen on.
const RAFT_PORT: u16 = 8084;
const BILLING_PORT: u16 = 8082;
const RLS_PORT: u16 = 8081;
const METRICS_PORT: u16 = 6070;
const ADMIN_PORT: u16 = 8083;
/// In the order `Cluster::start` hands a node's ports out.
const DEFAULT_PORTS: [u16; 5] = [RAFT_PORT, BILLING_PORT, RLS_PORT, METRICS_PORT, ADMIN_PORT];
/// The cluster and region the nodes' configs and certificates name.
const CLUSTER_ID: &str = "jepsen";

/// The operator and billing tokens the nodes accept (made fresh for each run).
#[derive(Debug, Clone)]
pub struct Tokens {
    pub admin: String,
    pub billing: String,
}

/// One node's addresses and files; its process while it runs.
pub struct LocalNode {
    pub id: NodeId,
    pub billing_addr: String,
    pub rls_addr: String,
    pub metrics_addr: String,
    pub admin_addr: String,
    pub config_path: PathBuf,
    pub log_path: PathBuf,
    /// Its Raft address, as the others reach it.
    raft_addr: String,
    /// Its own policy file, when the region serves one.
    policy_path: Option<PathBuf>,
    /// The policy file holds a nemesis's edit.
    policy_edited: bool,
    /// Removed from the voters by the nemesis, not yet added back.
    removed: bool,
    data_dir: PathBuf,
    /// Its data directory is a tmpfs the runner mounted.
    data_mounted: bool,
    /// A disk fault filled its data directory.
    disk_full: bool,
    /// On `netns`: the namespace it runs in.
    namespace: Option<String>,
    /// With clock faults: the file libfaketime reads the node's wall-clock offset from.
    clock_file: Option<PathBuf>,
    clock_offset_s: i64,
    child: Option<Child>,
    paused: bool,
}

impl LocalNode {
    /// The process id while it runs.
    pub fn pid(&self) -> Option<u32> {
        self.child.as_ref().and_then(Child::id)
    }

    pub fn running(&self) -> bool {
        self.child.is_some()
    }

    /// Stopped by SIGSTOP and not resumed yet.
    pub fn paused(&self) -> bool {
        self.paused
    }
}

/// How many nodes of each role a region has.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct Shape {
    /// Members of both Raft groups.
    pub voters: usize,
    /// Nodes that serve RLS and lease through the voters.
    pub gateways: usize,
}

impl Shape {
    pub fn nodes(self) -> usize {
        self.voters + self.gateways
    }
}

/// A region of node processes.
pub struct Cluster {
    binary: PathBuf,
    /// The voters, then the gateways.
    pub nodes: Vec<LocalNode>,
    /// How many of `nodes` are voters (the first ones).
    pub voters: usize,
    pub tokens: Tokens,
    /// On `netns`: the nodes' namespaces.
    namespaces: Option<Namespaces>,
    /// On `docker`: the nodes' containers.
    compose: Option<Compose>,
    /// A partition is installed.
    partitioned: bool,
    /// With clock faults: libfaketime's preload library.
    faketime: Option<PathBuf>,
    /// The policy every node serves (YAML), when the region serves one.
    policy: Option<String>,
}

impl Cluster {
    /// Writes the region's certificates and configs under `directory`, starts the nodes of
    /// `shape` with `binary` (on `docker`, containers of `image`, which holds the same
    /// binary) on `topology` serving `policy` (a YAML policy; `None`: the node's embedded
    /// example), ready for the faults `nemeses`, and forms the region.
    ///
    /// # Errors
    /// A CLI command fails, a node does not become ready, or the region forms no leader.
    pub async fn start(
        binary: &Path,
        directory: &Path,
        shape: Shape,
        topology: Topology,
        policy: Option<&str>,
        nemeses: &[FaultKind],
        image: &str,
    ) -> anyhow::Result<Self> {
        let clock_faults = nemeses.iter().any(|kind| kind.is_clock());
        let faketime = if clock_faults { Some(libfaketime()?) } else { None };
        // Absolute: a container mounts the run's directory at the same path.
        let directory = &directory
            .canonicalize()
            .with_context(|| format!("resolve {}", directory.display()))?;
        let count = shape.nodes();
        anyhow::ensure!(shape.voters >= 1, "a region needs a voter");
        anyhow::ensure!(
            binary.is_file(),
            "no quotamesh binary at {} (build it with `cargo build --release --bin quotamesh`, \
             or give --binary / QUOTAMESH_BIN)",
            binary.display()
        );
        let certs = directory.join("certs");
        let nodes_directory = directory.join("nodes");
        let logs = directory.join("logs");
        for path in [&nodes_directory, &logs] {
            std::fs::create_dir_all(path).with_context(|| format!("create {}", path.display()))?;
        }
        let nonce = format!("{:x}-{}", std::process::id(), crate::run::unix_ms());
        let tokens = Tokens {
            admin: format!("jepsen-operator-{nonce}"),
            billing: format!("jepsen-billing-{nonce}"),
        };
        let admin_sha256 = hash_token(binary, &tokens.admin).await?;
        let billing_sha256 = hash_token(binary, &tokens.billing).await?;
        let certs_arg = certs.display().to_string();
        run_cli(
            binary,
            &["cluster", "certs", "init", "--cluster-id", CLUSTER_ID, "--out", &certs_arg],
            None,
        )
        .await?;
        let namespaces = match topology {
            Topology::Netns => Some(Namespaces::create(count).await?),
            Topology::Local | Topology::Docker => None,
        };
        let mut compose = (topology == Topology::Docker).then(|| Compose::new(directory));
        let mut ports = PortPicker::new();
        let mut nodes = Vec::new();
        let mut raft_addrs = Vec::new();
        for position in 0..count {
            let id = position as u64 + 1;
            let id_arg = id.to_string();
            // On netns a node has an address of its own and the shipped default ports; in a
            // container, a name the other containers dial.
            let container = compose.as_ref().map(|compose| compose.container(position));
            let (host, mut port) = match &namespaces {
                Some(namespaces) => {
                    let host = namespaces.address(position);
                    let mut defaults = DEFAULT_PORTS.into_iter();
                    (host, Box::new(move || Ok(defaults.next().unwrap_or(0))) as PortSource)
                }
                None => ("127.0.0.1".to_owned(), Box::new(|| ports.next()) as PortSource),
            };
            let san = container.clone().unwrap_or_else(|| host.clone());
            let mut issue = vec![
                "cluster",
                "certs",
                "issue",
                "--ca",
                &certs_arg,
                "--node-id",
                &id_arg,
                "--region",
                CLUSTER_ID,
                "--san",
                &san,
            ];
            // A gateway's certificate names its role, so no voter takes it for a member.
            if position >= shape.voters {
                issue.push("--gateway");
            }
            run_cli(binary, &issue, None).await?;
            raft_addrs.push(match &container {
                Some(name) => format!("{name}:{RAFT_PORT}"),
                None => format!("{host}:{}", port()?),
            });
            nodes.push(LocalNode {
                id: NodeId(id),
                billing_addr: format!("{host}:{}", port()?),
                rls_addr: format!("{host}:{}", port()?),
                metrics_addr: format!("{host}:{}", port()?),
                admin_addr: format!("{host}:{}", port()?),
                namespace: namespaces.as_ref().map(|namespaces| namespaces.namespace(position)),
                clock_file: faketime
                    .as_ref()
                    .map(|_| nodes_directory.join(format!("node-{id}.faketime"))),
                clock_offset_s: 0,
                raft_addr: raft_addrs[position].clone(),
                policy_path: policy.map(|_| nodes_directory.join(format!("node-{id}.policy.yaml"))),
                policy_edited: false,
                removed: false,
                data_dir: nodes_directory.join(format!("node-{id}")),
                data_mounted: false,
                disk_full: false,
                config_path: nodes_directory.join(format!("node-{id}.toml")),
                log_path: logs.join(format!("node-{id}.log")),
                child: None,
                paused: false,
            });
        }
        for node in &nodes {
            if let (Some(path), Some(text)) = (&node.policy_path, policy) {
                std::fs::write(path, text).with_context(|| format!("write {}", path.display()))?;
            }
        }
        // The voters; a gateway reaches the groups through them.
        let peers: String = raft_addrs[..shape.voters]
            .iter()
            .enumerate()
            .map(|(position, address)| {
                format!("[[peers]]\nid = {}\nraft_addr = \"{address}\"\n\n", position + 1)
            })
            .collect();
        // Every node that leases counts in each one's share of the fallback allowance.
        let leasing = if shape.gateways > 0 {
            format!("[leasing]\nnodes_in_region = {count}\n\n")
        } else {
            String::new()
        };
        // Where a node listens: in a container, the default ports on every interface (the
        // runner's addresses are the published ports); elsewhere where the runner reaches it.
        let listen = |address: &str, port: u16| match &compose {
            Some(_) => format!("0.0.0.0:{port}"),
            None => address.to_owned(),
        };
        for (position, node) in nodes.iter().enumerate() {
            let id = node.id.0;
            let gateway = position >= shape.voters;
            let policy_line = node
                .policy_path
                .as_ref()
                .map_or(String::new(), |path| format!("policy = \"{}\"\n", path.display()));
            let config = format!(
                "# Written by quotamesh-jepsen for one run.\n\
                 node_id = \"jepsen-{id}\"\nregion = \"{CLUSTER_ID}\"\ncluster_id = \"{CLUSTER_ID}\"\n\
                 {role}raft_node_id = {id}\ndata_dir = \"{data}\"\n{policy_line}\
                 rls_addr = \"{rls}\"\nmetrics_addr = \"{metrics}\"\n\
                 admin_addr = \"{admin}\"\n{billing_line}raft_addr = \"{raft}\"\n\n\
                 {peers}\
                 [tls]\ncert = \"{certs}/node-{id}.pem\"\nkey = \"{certs}/node-{id}.key\"\n\
                 ca = \"{certs}/ca.pem\"\n\n\
                 [[admin.tokens]]\nname = \"jepsen-operator\"\nsha256 = \"{admin_sha256}\"\n\n\
                 {leasing}{billing}",
                data = node.data_dir.display(),
                rls = listen(&node.rls_addr, RLS_PORT),
                metrics = listen(&node.metrics_addr, METRICS_PORT),
                admin = listen(&node.admin_addr, ADMIN_PORT),
                raft = listen(&raft_addrs[position], RAFT_PORT),
                certs = certs.display(),
                role = if gateway { "role = \"gateway\"\n" } else { "" },
                billing_line = if gateway {
                    String::new()
                } else {
                    format!("billing_addr = \"{}\"\n", listen(&node.billing_addr, BILLING_PORT))
                },
                billing = if gateway {
                    String::new()
                } else {
                    format!(
                        "[billing]\nbootstrap = {}\n\n[[billing.tokens]]\nname = \"jepsen\"\n\
                         sha256 = \"{billing_sha256}\"\ntenants = [\"*\"]\n",
                        position == 0
                    )
                },
            );
            std::fs::write(&node.config_path, config)
                .with_context(|| format!("write {}", node.config_path.display()))?;
        }
        for node in &nodes {
            if let Some(file) = &node.clock_file {
                std::fs::write(file, "+0\n")
                    .with_context(|| format!("write {}", file.display()))?;
            }
        }
        if let Some(compose) = compose.as_mut() {
            let specs: Vec<ContainerSpec> = nodes
                .iter()
                .map(|node| ContainerSpec {
                    config_path: node.config_path.clone(),
                    published: vec![
                        (node.billing_addr.clone(), BILLING_PORT),
                        (node.rls_addr.clone(), RLS_PORT),
                        (node.metrics_addr.clone(), METRICS_PORT),
                        (node.admin_addr.clone(), ADMIN_PORT),
                    ],
                })
                .collect();
            compose.create(image, directory, &specs).await?;
        }
        let mut cluster = Self {
            binary: binary.to_owned(),
            nodes,
            tokens,
            voters: shape.voters,
            namespaces,
            compose,
            partitioned: false,
            faketime,
            policy: policy.map(str::to_owned),
        };
        if nemeses.contains(&FaultKind::Disk) {
            for position in 0..count {
                cluster.mount_data_disk(position).await?;
            }
        }
        for position in 0..count {
            cluster.spawn(position).await?;
        }
        let admin_addrs = cluster.admin_addrs();
        run_cli(
            &cluster.binary,
            &["cluster", "init", "--admin-addr", &admin_addrs],
            Some(&cluster.tokens.admin),
        )
        .await?;
        Ok(cluster)
    }

    /// Starts node `position`'s process on its config and waits until `/healthz` answers.
    async fn spawn(&mut self, position: usize) -> anyhow::Result<()> {
        let node = &mut self.nodes[position];
        anyhow::ensure!(node.child.is_none(), "node {} runs already", node.id.0);
        let log = std::fs::OpenOptions::new()
            .create(true)
            .append(true)
            .open(&node.log_path)
            .with_context(|| format!("open {}", node.log_path.display()))?;
        let mut command = match (&node.namespace, &self.compose) {
            (Some(namespace), _) => {
                let mut command = Command::new("ip");
                // `ip netns exec` execs the binary: the child's pid is the node's.
                command.args(["netns", "exec", namespace]).arg(&self.binary);
                command
            }
            (None, Some(compose)) => {
                // Attached, it lasts as long as the container and copies its output to the
                // log; the container runs the command its compose file names.
                let mut command = Command::new("docker");
                command.args(["start", "--attach", &compose.container(position)]);
                command
            }
            (None, None) => Command::new(&self.binary),
        };
        if let (Some(library), Some(file)) = (&self.faketime, &node.clock_file) {
            command
                .env("LD_PRELOAD", library)
                .env("FAKETIME_TIMESTAMP_FILE", file)
                // The file is re-read at most once a second; timers keep their pace.
                .env("FAKETIME_CACHE_DURATION", "1")
                .env("FAKETIME_DONT_FAKE_MONOTONIC", "1");
        }
        if self.compose.is_none() {
            command.arg("serve").arg("--config").arg(&node.config_path);
        }
        let child = command
            // The log an operator gets by default.
            .env_remove("RUST_LOG")
            .env("RUST_BACKTRACE", "1")
            .stdin(Stdio::null())
            .stdout(log.try_clone()?)
            .stderr(log)
            // A runner that dies must not leave nodes behind.
            .kill_on_drop(true)
            .spawn()
            .with_context(|| format!("spawn node {}", node.id.0))?;
        node.child = Some(child);
        node.paused = false;
        let deadline = Instant::now() + READY_TIMEOUT;
        loop {
            if let Some(child) = node.child.as_mut()
                && let Some(status) = child.try_wait()?
            {
                node.child = None;
                bail!(
                    "node {} exited while starting ({status}); see {}",
                    node.id.0,
                    node.log_path.display()
                );
            }
            if let Ok((200, _)) = http_get(&node.metrics_addr, "/healthz").await {
                return Ok(());
            }
            if Instant::now() > deadline {
                bail!("node {} was not healthy within {READY_TIMEOUT:?}", node.id.0);
            }
            tokio::time::sleep(POLL).await;
        }
    }

    /// SIGKILL (kill -9): no shutdown, no flush; waits until the process is gone.
    ///
    /// # Errors
    /// The node is not running or cannot be signalled.
    pub async fn kill(&mut self, position: usize) -> anyhow::Result<()> {
        let node = &mut self.nodes[position];
        let mut child = node.child.take().with_context(|| format!("node {} is down", node.id.0))?;
        node.paused = false;
        match &self.compose {
            Some(compose) => {
                compose.kill(position).await?;
                // The attached `docker start` ends with the container; should it linger,
                // it is only a client.
                if tokio::time::timeout(READY_TIMEOUT, child.wait()).await.is_err() {
                    let _ = child.kill().await;
                }
            }
            None => child.kill().await.with_context(|| format!("kill node {}", node.id.0))?,
        }
        Ok(())
    }

    /// Restarts a killed node on its data directory.
    ///
    /// # Errors
    /// It runs already, or does not become healthy.
    pub async fn restart(&mut self, position: usize) -> anyhow::Result<()> {
        self.spawn(position).await
    }

    /// SIGSTOP (on `docker`, `docker pause`): the process freezes; its sockets stay open.
    ///
    /// # Errors
    /// The node is not running or the signal fails.
    pub async fn pause(&mut self, position: usize) -> anyhow::Result<()> {
        match &self.compose {
            Some(compose) => compose.pause(position).await?,
            None => self.signal(position, "STOP").await?,
        }
        self.nodes[position].paused = true;
        Ok(())
    }

    /// SIGCONT (on `docker`, `docker unpause`).
    ///
    /// # Errors
    /// The node is not running or the signal fails.
    pub async fn resume(&mut self, position: usize) -> anyhow::Result<()> {
        match &self.compose {
            Some(compose) => compose.unpause(position).await?,
            None => self.signal(position, "CONT").await?,
        }
        self.nodes[position].paused = false;
        Ok(())
    }

    async fn signal(&self, position: usize, signal: &str) -> anyhow::Result<()> {
        let node = &self.nodes[position];
        let pid = node.pid().with_context(|| format!("node {} is down", node.id.0))?;
        let status = Command::new("kill")
            .arg(format!("-{signal}"))
            .arg(pid.to_string())
            .status()
            .await
            .context("run kill")?;
        anyhow::ensure!(status.success(), "kill -{signal} {pid} (node {}) failed", node.id.0);
        Ok(())
    }

    /// Cuts the links `links` (pairs of node positions; `nemesis::cut_links`).
    ///
    /// # Errors
    /// The topology has no network to cut (`local`), the partition keeps some of a cut
    /// node's links on `docker`, or an nft or docker command fails.
    pub async fn partition(&mut self, links: &[(usize, usize)]) -> anyhow::Result<()> {
        if let Some(compose) = self.compose.as_mut() {
            self.partitioned = true;
            return compose.partition(links, self.voters).await;
        }
        let namespaces =
            self.namespaces.as_ref().context("partitions need the netns or docker topology")?;
        self.partitioned = true;
        namespaces.partition(links).await
    }

    /// Cuts the directed links `links` ((sender, receiver) positions;
    /// `nemesis::one_way_links`).
    ///
    /// # Errors
    /// The topology has no network to cut (`local`), or an nft command fails.
    pub async fn partition_one_way(&mut self, links: &[(usize, usize)]) -> anyhow::Result<()> {
        let namespaces = self.namespaces.as_ref().context("partitions need the netns topology")?;
        self.partitioned = true;
        namespaces.partition_one_way(links).await
    }

    /// Removes every partition.
    ///
    /// # Errors
    /// An nft command fails.
    pub async fn heal_partitions(&mut self) -> anyhow::Result<()> {
        if !self.partitioned {
            return Ok(());
        }
        if let Some(namespaces) = &self.namespaces {
            namespaces.heal().await?;
        }
        if let Some(compose) = self.compose.as_mut() {
            compose.heal().await?;
        }
        self.partitioned = false;
        Ok(())
    }

    /// Rewrites node `position`'s policy file as `edit` says (replacing it whole, as an
    /// editor's save does); the node's file watch picks it up.
    ///
    /// # Errors
    /// The region serves no policy file, or it cannot be written.
    pub fn edit_policy(&mut self, position: usize, edit: PolicyEdit) -> anyhow::Result<()> {
        let policy = self.policy.as_deref().context("the nodes serve no policy file")?;
        let text = match edit {
            PolicyEdit::ExtraRule => format!(
                "{policy}  - key: jepsen-reloaded\n    rate_limit:\n      unit: minute\n      \
                 requests_per_unit: 7\n"
            ),
            PolicyEdit::Broken => "domain: [this is not a policy\n".to_owned(),
        };
        self.write_policy(position, &text)?;
        self.nodes[position].policy_edited = true;
        Ok(())
    }

    fn write_policy(&self, position: usize, text: &str) -> anyhow::Result<()> {
        let path =
            self.nodes[position].policy_path.as_ref().context("the node has no policy file")?;
        let temporary = path.with_extension("yaml.new");
        std::fs::write(&temporary, text)
            .and_then(|()| std::fs::rename(&temporary, path))
            .with_context(|| format!("write {}", path.display()))
    }

    /// `quotamesh cluster remove-node` of node `position`, through every node's admin port;
    /// the node keeps running.
    ///
    /// # Errors
    /// The command fails (the message says why).
    pub async fn remove_voter(&mut self, position: usize) -> anyhow::Result<()> {
        let id = self.nodes[position].id.0.to_string();
        let admin_addrs = self.admin_addrs();
        // Marked first: a removal that fails half way is finished by adding the node back.
        self.nodes[position].removed = true;
        run_cli(
            &self.binary,
            &["cluster", "remove-node", "--admin-addr", &admin_addrs, "--node-id", &id],
            Some(&self.tokens.admin),
        )
        .await
        .map(drop)
    }

    /// `quotamesh cluster add-node` of node `position` (a learner until it has caught up,
    /// then a voter of both groups).
    ///
    /// # Errors
    /// The command fails (the message says why).
    pub async fn add_voter(&mut self, position: usize) -> anyhow::Result<()> {
        let node = &self.nodes[position];
        let id = node.id.0.to_string();
        let raft_addr = node.raft_addr.clone();
        let admin_addrs = self.admin_addrs();
        run_cli(
            &self.binary,
            &[
                "cluster",
                "add-node",
                "--admin-addr",
                &admin_addrs,
                "--node-id",
                &id,
                "--raft-addr",
                &raft_addr,
            ],
            Some(&self.tokens.admin),
        )
        .await?;
        self.nodes[position].removed = false;
        Ok(())
    }

    /// Mounts a tmpfs of [`DATA_DISK_BYTES`] on node `position`'s data directory.
    async fn mount_data_disk(&mut self, position: usize) -> anyhow::Result<()> {
        let node = &mut self.nodes[position];
        std::fs::create_dir_all(&node.data_dir)
            .with_context(|| format!("create {}", node.data_dir.display()))?;
        let status = Command::new("mount")
            .args(["-t", "tmpfs", "-o", &format!("size={DATA_DISK_BYTES}"), "quotamesh-jepsen"])
            .arg(&node.data_dir)
            .status()
            .await
            .context("run mount")?;
        anyhow::ensure!(
            status.success(),
            "mount a tmpfs on {} failed (disk faults need root)",
            node.data_dir.display()
        );
        node.data_mounted = true;
        Ok(())
    }

    /// Fills node `position`'s data directory until the file system has no space left.
    ///
    /// # Errors
    /// The directory is no tmpfs of the runner's, or the filler cannot be written for
    /// another reason than a full disk.
    pub fn fill_disk(&mut self, position: usize) -> anyhow::Result<()> {
        use std::io::Write;
        let node = &mut self.nodes[position];
        anyhow::ensure!(node.data_mounted, "node {}'s data directory is no tmpfs", node.id.0);
        node.disk_full = true;
        let path = node.data_dir.join(FILLER);
        let mut file =
            std::fs::File::create(&path).with_context(|| format!("create {}", path.display()))?;
        let chunk = vec![0_u8; 1 << 20];
        loop {
            match file.write(&chunk) {
                Ok(0) => return Ok(()),
                Ok(_) => {}
                Err(error) if error.kind() == std::io::ErrorKind::StorageFull => return Ok(()),
                Err(error) => {
                    return Err(error).with_context(|| format!("fill {}", path.display()));
                }
            }
        }
    }

    /// Every voter's admin address, comma-separated (as the CLI takes them).
    fn admin_addrs(&self) -> String {
        let voters = self.nodes[..self.voters].iter();
        voters.map(|node| node.admin_addr.as_str()).collect::<Vec<_>>().join(",")
    }

    /// Sets node `position`'s wall clock `offset_s` seconds off (0: true time again); it
    /// takes effect within libfaketime's one-second cache.
    ///
    /// # Errors
    /// The cluster was started without clock faults, or the file cannot be written.
    pub fn set_clock(&mut self, position: usize, offset_s: i64) -> anyhow::Result<()> {
        let node = &mut self.nodes[position];
        let file = node.clock_file.as_ref().context("the nodes run without libfaketime")?;
        std::fs::write(file, format!("{offset_s:+}\n"))
            .with_context(|| format!("write {}", file.display()))?;
        node.clock_offset_s = offset_s;
        Ok(())
    }

    /// Undoes every fault: removes partitions, sets clocks right, resumes paused nodes,
    /// restarts killed ones. Returns what failed.
    pub async fn heal(&mut self) -> Vec<String> {
        let mut problems = Vec::new();
        for position in 0..self.nodes.len() {
            if self.nodes[position].clock_offset_s != 0
                && let Err(error) = self.set_clock(position, 0)
            {
                problems.push(format!("{error:#}"));
            }
        }
        if let Err(error) = self.heal_partitions().await {
            problems.push(format!("{error:#}"));
        }
        for position in 0..self.nodes.len() {
            let node = &mut self.nodes[position];
            if node.disk_full {
                match std::fs::remove_file(node.data_dir.join(FILLER)) {
                    Ok(()) => node.disk_full = false,
                    Err(error) => {
                        problems.push(format!("empty node {}'s disk: {error}", node.id.0))
                    }
                }
            }
            // A node that exited by itself (a full disk, a crash) is restarted, and said so.
            if let Some(child) = node.child.as_mut()
                && let Ok(Some(status)) = child.try_wait()
            {
                node.child = None;
                node.paused = false;
                problems.push(format!("node {} had exited ({status}); restarted", node.id.0));
            }
            if self.nodes[position].policy_edited {
                let original = self.policy.clone().unwrap_or_default();
                match self.write_policy(position, &original) {
                    Ok(()) => self.nodes[position].policy_edited = false,
                    Err(error) => problems.push(format!("{error:#}")),
                }
            }
            let result = if self.nodes[position].paused {
                self.resume(position).await
            } else if !self.nodes[position].running() {
                self.restart(position).await
            } else {
                Ok(())
            };
            if let Err(error) = result {
                problems.push(format!("{error:#}"));
            }
        }
        // Added back once every node runs again, so the change finds its leaders. A removed
        // leader leaves the rest to elect a new one, which may still be under way: retried.
        for position in 0..self.nodes.len() {
            if !self.nodes[position].removed {
                continue;
            }
            let deadline = Instant::now() + ADD_BACK_WAIT;
            loop {
                match self.add_voter(position).await {
                    Ok(()) => break,
                    Err(_) if Instant::now() < deadline => tokio::time::sleep(ADD_BACK_PAUSE).await,
                    Err(error) => {
                        problems.push(format!("{error:#}"));
                        break;
                    }
                }
            }
        }
        problems
    }

    /// Node `position`'s Prometheus text.
    ///
    /// # Errors
    /// The node does not answer in time.
    pub async fn metrics(&self, position: usize) -> anyhow::Result<String> {
        let (status, body) = http_get(&self.nodes[position].metrics_addr, "/metrics").await?;
        anyhow::ensure!(status == 200, "/metrics answered {status}");
        Ok(body)
    }

    /// Resumes and stops every node (SIGTERM, then SIGKILL after a grace period).
    pub async fn shutdown(&mut self) {
        const GRACE: Duration = Duration::from_secs(10);
        for position in 0..self.nodes.len() {
            if self.nodes[position].paused {
                let _ = self.resume(position).await;
            }
            // On `docker`, the attached `docker start` passes the signal to the container.
            if self.nodes[position].running() {
                let _ = self.signal(position, "TERM").await;
            }
        }
        for node in &mut self.nodes {
            if let Some(mut child) = node.child.take()
                && tokio::time::timeout(GRACE, child.wait()).await.is_err()
            {
                let _ = child.kill().await;
            }
        }
        for node in &mut self.nodes {
            if node.data_mounted {
                let unmounted = Command::new("umount").arg(&node.data_dir).status().await;
                node.data_mounted = !unmounted.is_ok_and(|status| status.success());
            }
        }
        if let Some(namespaces) = self.namespaces.take() {
            namespaces.destroy();
        }
        if let Some(mut compose) = self.compose.take() {
            // `docker-compose down` waits on the daemon: off the runtime's threads.
            let _ = tokio::task::spawn_blocking(move || compose.destroy()).await;
        }
    }
}

/// libfaketime's preload library where Debian's `libfaketime` installs it.
fn libfaketime() -> anyhow::Result<PathBuf> {
    let directories = std::fs::read_dir("/usr/lib").context("read /usr/lib")?;
    directories
        .filter_map(Result::ok)
        .map(|entry| entry.path().join("faketime/libfaketime.so.1"))
        .find(|path| path.is_file())
        .context("clock faults need libfaketime (Debian: apt-get install faketime)")
}

/// Where a node's next port comes from.
type PortSource<'a> = Box<dyn FnMut() -> anyhow::Result<u16> + 'a>;

/// Hands out ports that were free a moment ago, each once.
struct PortPicker {
    next: u16,
}

impl PortPicker {
    fn new() -> Self {
        // Each runner starts at its own place, so parallel runs rarely probe the same ports.
        let span = u32::from(PORTS.end - PORTS.start);
        let offset = (std::process::id().wrapping_mul(7_919)) % span;
        Self { next: PORTS.start + u16::try_from(offset).unwrap_or(0) }
    }

    fn next(&mut self) -> anyhow::Result<u16> {
        for _ in PORTS {
            let port = self.next;
            self.next = if self.next + 1 >= PORTS.end { PORTS.start } else { self.next + 1 };
            if std::net::TcpListener::bind(("127.0.0.1", port)).is_ok() {
                return Ok(port);
            }
        }
        bail!("no free port on 127.0.0.1 in {PORTS:?}")
    }
}

/// Runs a `quotamesh` CLI command (with the operator token when given); returns stdout.
async fn run_cli(
    binary: &Path,
    arguments: &[&str],
    admin_token: Option<&str>,
) -> anyhow::Result<String> {
    let mut command = Command::new(binary);
    command.args(arguments).env("RUST_BACKTRACE", "0").stdin(Stdio::null()).kill_on_drop(true);
    if let Some(token) = admin_token {
        command.env("QUOTAMESH_ADMIN_TOKEN", token);
    }
    let output = tokio::time::timeout(COMMAND_TIMEOUT, command.output())
        .await
        .with_context(|| {
            format!("quotamesh {} took over {COMMAND_TIMEOUT:?}", arguments.join(" "))
        })?
        .context("run quotamesh")?;
    if !output.status.success() {
        bail!(
            "quotamesh {} failed ({}): {}",
            arguments.join(" "),
            output.status,
            String::from_utf8_lossy(&output.stderr)
        );
    }
    Ok(String::from_utf8_lossy(&output.stdout).into_owned())
}

/// `quotamesh billing hash-token`: the digest a node's config stores for `token`.
async fn hash_token(binary: &Path, token: &str) -> anyhow::Result<String> {
    let mut child = Command::new(binary)
        .args(["billing", "hash-token"])
        .stdin(Stdio::piped())
        .stdout(Stdio::piped())
        .stderr(Stdio::piped())
        .kill_on_drop(true)
        .spawn()
        .context("run quotamesh billing hash-token")?;
    let mut stdin = child.stdin.take().context("hash-token's stdin")?;
    stdin.write_all(token.as_bytes()).await?;
    drop(stdin);
    let output = tokio::time::timeout(COMMAND_TIMEOUT, child.wait_with_output())
        .await
        .context("hash-token took too long")??;
    anyhow::ensure!(
        output.status.success(),
        "hash-token failed: {}",
        String::from_utf8_lossy(&output.stderr)
    );
    let digest = String::from_utf8_lossy(&output.stdout).trim().to_owned();
    anyhow::ensure!(digest.len() == 64, "hash-token printed {digest:?}");
    Ok(digest)
}

/// A minimal HTTP/1.1 GET (health and metrics endpoints), with a timeout.
async fn http_get(address: &str, path: &str) -> anyhow::Result<(u16, String)> {
    let exchange = async {
        let mut stream = tokio::net::TcpStream::connect(address).await?;
        let head = format!("GET {path} HTTP/1.1\r\nHost: {address}\r\nConnection: close\r\n\r\n");
        stream.write_all(head.as_bytes()).await?;
        let mut response = Vec::new();
        stream.read_to_end(&mut response).await?;
        anyhow::Ok(String::from_utf8_lossy(&response).into_owned())
    };
    let response = tokio::time::timeout(HTTP_TIMEOUT, exchange)
        .await
        .with_context(|| format!("GET {address}{path} took over {HTTP_TIMEOUT:?}"))??;
    let (head, body) = response.split_once("\r\n\r\n").context("no end of the HTTP header")?;
    let status = head
        .lines()
        .next()
        .and_then(|line| line.split_whitespace().nth(1))
        .context("no HTTP status line")?
        .parse()?;
    Ok((status, body.to_owned()))
}
