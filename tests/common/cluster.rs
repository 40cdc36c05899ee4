//! Cluster harness: a region of real `quotamesh serve` processes, node N on 127.0.0.N with
//! its own ports, TOML config and data directory (real redb and sled files), formed with the
//! real `quotamesh cluster init`; kill -9, SIGTERM and restarts; admin gRPC clients; and a
//! recorder for lease-grant operations whose outcome is ok, fail or unknown.
//!
//! A gateway (`role = "gateway"`: leases only, no member of the group) can join the region
//! as node N too, listing the voters as its peers.
//!
//! Every cluster runs as shipped for several nodes: mTLS between nodes with a CA of its own
//! (`super::tls`), and admin calls carrying the test operator token (over TLS, trusting the
//! cluster's CA, when the nodes serve `admin.tls`).
//!
//! Waits poll a condition with a deadline; nothing sleeps for a fixed time.

use std::collections::BTreeMap;
use std::ffi::OsString;
use std::net::SocketAddr;
use std::path::{Path, PathBuf};
use std::process::Command;
use std::time::{Duration, Instant};

use anyhow::{Context, bail};
use quotamesh::api::proto::quotamesh::admin::v1 as admin;
use quotamesh::api::proto::quotamesh::admin::v1::admin_client::AdminClient;
use quotamesh::core::lease_key::LeaseKey;
use quotamesh::core::rate::{Algorithm, LimitSpec};
use tonic::transport::Channel;

use super::tls::{ADMIN_TOKEN, TestCa, admin_section};
use super::{NodeProcess, free_port_on, write_file};

/// How long a cluster may take to agree on a leader or converge (debug builds, shared box).
pub const CLUSTER_WAIT: Duration = Duration::from_secs(30);
/// Deadline of one admin call from a test.
pub const CALL_TIMEOUT: Duration = Duration::from_secs(5);
/// Between two looks at a condition.
const POLL: Duration = Duration::from_millis(25);

/// The policy every cluster test serves: day-long buckets, so grants of a test never run
/// dry and keys are not reclaimed while it runs.
pub const CLUSTER_POLICY: &str = "\
domain: cluster-test
descriptors:
  - key: api_key
    rate_limit: {unit: day, requests_per_unit: 1000000}
  - key: small
    rate_limit: {unit: day, requests_per_unit: 10}
  - key: two_limits
    rate_limits:
      - {unit: hour, requests_per_unit: 1000}
      - {unit: day, requests_per_unit: 100000}
  - key: free
    rate_limit: {unlimited: true}
";
/// The domain of [`CLUSTER_POLICY`].
pub const DOMAIN: &str = "cluster-test";

/// How a cluster's nodes are configured.
#[derive(Debug, Clone)]
pub struct ClusterOptions {
    /// `cluster_id` of every node.
    pub cluster_id: String,
    /// `[quota_group] snapshot_every_logs`, when not the default.
    pub snapshot_every_logs: Option<u64>,
    /// `[quota_group] logs_kept_after_snapshot`, when not the default.
    pub logs_kept_after_snapshot: Option<u64>,
    /// The policy every node serves, when not [`CLUSTER_POLICY`].
    pub policy: Option<String>,
    /// No `policy` path in the nodes' configs: they serve the embedded default until the
    /// region has a replicated version (`quotamesh policy apply`), then follow it.
    pub follow_region_policy: bool,
    /// More TOML sections for every node's config (e.g. a `[leasing]` table).
    pub config_extra: String,
    /// More environment variables for some nodes' processes, by node id: a `QUOTAMESH_*`
    /// variable overrides the shared config for that node alone.
    pub node_environment: BTreeMap<u64, Vec<(&'static str, String)>>,
    /// `[admin] tls = true` on every node: the admin port speaks TLS only, with the node's
    /// certificate, and accepts operator certificates of the cluster's CA.
    pub admin_tls: bool,
    /// Run node N as user id `base + N` (the test runs as root), so firewall rules can
    /// match one node's packets (`meta skuid`); the nodes' directories are made writable.
    pub uid_base: Option<u32>,
    /// `region` of every node, and the region its certificate names, when not the
    /// default (`super::tls::REGION` in certificates, the node's default in its config).
    pub region: Option<String>,
}

impl Default for ClusterOptions {
    fn default() -> Self {
        Self {
            cluster_id: "test-region".to_owned(),
            snapshot_every_logs: None,
            logs_kept_after_snapshot: None,
            policy: None,
            follow_region_policy: false,
            config_extra: String::new(),
            node_environment: BTreeMap::new(),
            admin_tls: false,
            uid_base: None,
            region: None,
        }
    }
}

/// One node's addresses and files; its process when running.
pub struct ClusterNode {
    pub id: u64,
    pub rls_addr: SocketAddr,
    pub metrics_addr: SocketAddr,
    pub admin_addr: SocketAddr,
    pub raft_addr: SocketAddr,
    pub data_dir: PathBuf,
    pub config_path: PathBuf,
    pub log_path: PathBuf,
    /// `[[peers]]` in its config, as `(id, raft address)`.
    pub peers: Vec<(u64, SocketAddr)>,
    /// `role = "gateway"` in its config: the peers are the voters, without it.
    pub gateway: bool,
    /// The user id its process runs as, when not the test's.
    pub uid: Option<u32>,
    /// More environment variables for its process (e.g. libfaketime's), set before a start.
    pub environment: Vec<(&'static str, String)>,
    pub process: Option<NodeProcess>,
}

impl ClusterNode {
    fn new(root: &Path, id: u64, options: &ClusterOptions) -> anyhow::Result<Self> {
        let ip = format!("127.0.0.{id}");
        let address =
            |port: u16| -> anyhow::Result<SocketAddr> { Ok(format!("{ip}:{port}").parse()?) };
        Ok(Self {
            id,
            rls_addr: address(free_port_on(&ip)?)?,
            metrics_addr: address(free_port_on(&ip)?)?,
            admin_addr: address(free_port_on(&ip)?)?,
            raft_addr: address(free_port_on(&ip)?)?,
            data_dir: root.join(format!("node-{id}")),
            config_path: root.join(format!("node-{id}.toml")),
            log_path: root.join(format!("node-{id}.log")),
            peers: Vec::new(),
            gateway: false,
            uid: None,
            environment: options.node_environment.get(&id).cloned().unwrap_or_default(),
            process: None,
        })
    }

    /// Writes the node's TOML config. The Raft address comes from the config file, the
    /// admin address from a `QUOTAMESH_*` variable and the RLS address from a flag, so the
    /// three layers are all exercised.
    fn write_config(
        &self,
        options: &ClusterOptions,
        policy: &Path,
        ca: &TestCa,
    ) -> anyhow::Result<()> {
        let mut text = format!(
            "node_id = \"test-node-{id}\"\nraft_node_id = {id}\ncluster_id = \"{cluster}\"\n\
             data_dir = \"{data}\"\nraft_addr = \"{raft}\"\n",
            id = self.id,
            cluster = options.cluster_id,
            data = self.data_dir.display(),
            raft = self.raft_addr,
        );
        if let Some(region) = &options.region {
            text.push_str(&format!("region = \"{region}\"\n"));
        }
        if !options.follow_region_policy {
            text.push_str(&format!("policy = \"{}\"\n", policy.display()));
        }
        if self.gateway {
            text.push_str("role = \"gateway\"\n");
        }
        for (id, address) in &self.peers {
            text.push_str(&format!("\n[[peers]]\nid = {id}\nraft_addr = \"{address}\"\n"));
        }
        text.push('\n');
        text.push_str(&ca.node_section(self.id, &self.raft_addr.ip().to_string(), self.gateway)?);
        text.push('\n');
        if options.admin_tls {
            text.push_str("[admin]\ntls = true\n");
        }
        text.push_str(&admin_section());
        text.push_str("\n[quota_group]\n");
        if let Some(every) = options.snapshot_every_logs {
            text.push_str(&format!("snapshot_every_logs = {every}\n"));
        }
        if let Some(kept) = options.logs_kept_after_snapshot {
            text.push_str(&format!("logs_kept_after_snapshot = {kept}\n"));
        }
        text.push('\n');
        text.push_str(&options.config_extra);
        std::fs::write(&self.config_path, text)?;
        Ok(())
    }

    /// Starts the process (again) with the node's config; waits until it is ready.
    pub fn start(&mut self) -> anyhow::Result<()> {
        anyhow::ensure!(self.process.is_none(), "node {} is running already", self.id);
        let process = self.spawn(&[])?;
        self.process = Some(process);
        Ok(())
    }

    /// Starts the process with extra flags; the caller keeps the result (a start that must
    /// fail gives its error with the log's tail).
    pub fn spawn(&self, extra: &[&str]) -> anyhow::Result<NodeProcess> {
        let mut arguments: Vec<OsString> = vec!["--config".into(), self.config_path.clone().into()];
        arguments.extend(extra.iter().map(OsString::from));
        let mut environment = vec![
            ("QUOTAMESH_ADMIN_ADDR", self.admin_addr.to_string()),
            // The billing API is not under test here; keep it off the shared default port.
            ("QUOTAMESH_BILLING_ADDR", format!("{}:0", self.admin_addr.ip())),
        ];
        environment.extend(self.environment.iter().cloned());
        NodeProcess::spawn_as(
            self.rls_addr,
            self.metrics_addr,
            &self.data_dir,
            &arguments,
            &environment,
            Some(&self.log_path),
            self.uid,
        )
        .with_context(|| format!("node {}", self.id))
    }

    /// kill -9.
    pub fn kill(&mut self) -> anyhow::Result<()> {
        self.process.take().with_context(|| format!("node {} is not running", self.id))?.kill()
    }

    /// SIGTERM, and a clean exit expected.
    pub fn stop(&mut self) -> anyhow::Result<()> {
        let mut process =
            self.process.take().with_context(|| format!("node {} is not running", self.id))?;
        let status = process.terminate()?;
        anyhow::ensure!(status.success(), "node {} exited with {status}", self.id);
        Ok(())
    }

    /// Bytes the process has written to storage so far (`/proc/<pid>/io`), when running.
    pub fn write_bytes(&self) -> Option<u64> {
        let pid = self.process.as_ref()?.pid()?;
        proc_write_bytes(pid)
    }
}

/// `write_bytes` of `/proc/<pid>/io`: bytes the process caused to be sent to storage.
pub fn proc_write_bytes(pid: u32) -> Option<u64> {
    let text = std::fs::read_to_string(format!("/proc/{pid}/io")).ok()?;
    text.lines().find_map(|line| line.strip_prefix("write_bytes: ")?.trim().parse().ok())
}

/// A region of node processes.
pub struct Cluster {
    pub root: tempfile::TempDir,
    /// The cluster's CA (node certificates are in its directory).
    pub ca: TestCa,
    pub options: ClusterOptions,
    pub policy: PathBuf,
    pub nodes: BTreeMap<u64, ClusterNode>,
}

impl Cluster {
    /// Starts nodes `1..=voters` with each other as peers, forms the group with
    /// `quotamesh cluster init`, and waits until every node names the same leader.
    pub async fn start(voters: u64, options: ClusterOptions) -> anyhow::Result<Self> {
        Self::start_with_ca(voters, options, None).await
    }

    /// As [`Cluster::start`], for another region of the cluster of `other`: its nodes'
    /// certificates come from `other`'s CA and name `options.region`.
    pub async fn start_sharing_ca(
        voters: u64,
        options: ClusterOptions,
        other: &Cluster,
    ) -> anyhow::Result<Self> {
        Self::start_with_ca(voters, options, Some(&other.ca)).await
    }

    async fn start_with_ca(
        voters: u64,
        options: ClusterOptions,
        shared: Option<&TestCa>,
    ) -> anyhow::Result<Self> {
        let root = tempfile::tempdir()?;
        let policy = write_file(
            root.path(),
            "policy.yaml",
            options.policy.as_deref().unwrap_or(CLUSTER_POLICY),
        );
        let mut ca = match shared {
            Some(other) => TestCa::sharing(root.path(), other, super::tls::REGION)?,
            None => TestCa::new(root.path(), &options.cluster_id)?,
        };
        if let Some(region) = &options.region {
            ca.region.clone_from(region);
        }
        let mut nodes = BTreeMap::new();
        if options.uid_base.is_some() {
            // Nodes of other users create their data directories here.
            std::fs::set_permissions(
                root.path(),
                std::os::unix::fs::PermissionsExt::from_mode(0o777),
            )?;
        }
        for id in 1..=voters {
            let mut node = ClusterNode::new(root.path(), id, &options)?;
            node.uid = match options.uid_base {
                Some(base) => Some(base + u32::try_from(id)?),
                None => None,
            };
            nodes.insert(id, node);
        }
        let peers: Vec<(u64, SocketAddr)> =
            nodes.values().map(|node| (node.id, node.raft_addr)).collect();
        for node in nodes.values_mut() {
            node.peers.clone_from(&peers);
            node.write_config(&options, &policy, &ca)?;
            node.start()?;
        }
        let cluster = Self { root, ca, options, policy, nodes };
        let output = cluster.cli(&[
            "cluster",
            "init",
            "--json",
            "--admin-addr",
            &cluster.nodes[&1].admin_addr.to_string(),
        ])?;
        let init: serde_json::Value = serde_json::from_str(&output)
            .with_context(|| format!("cluster init printed {output:?}"))?;
        anyhow::ensure!(init["leader_id"].as_u64().is_some(), "init named no leader: {init}");
        cluster.leader().await?;
        Ok(cluster)
    }

    /// Creates node `id` as a newcomer (its config lists only itself as peer, so it waits to
    /// be added) and starts it.
    pub fn start_newcomer(&mut self, id: u64) -> anyhow::Result<&ClusterNode> {
        let mut node = ClusterNode::new(self.root.path(), id, &self.options)?;
        node.peers = vec![(id, node.raft_addr)];
        node.write_config(&self.options, &self.policy, &self.ca)?;
        node.start()?;
        self.nodes.insert(id, node);
        Ok(&self.nodes[&id])
    }

    /// Creates node `id` as a gateway whose peers are the cluster's voters (every node that
    /// is not a gateway) and starts it; nothing needs to add it to the group.
    pub fn start_gateway(&mut self, id: u64) -> anyhow::Result<&ClusterNode> {
        let mut node = ClusterNode::new(self.root.path(), id, &self.options)?;
        node.peers = self
            .nodes
            .values()
            .filter(|voter| !voter.gateway)
            .map(|voter| (voter.id, voter.raft_addr))
            .collect();
        node.gateway = true;
        node.write_config(&self.options, &self.policy, &self.ca)?;
        node.start()?;
        self.nodes.insert(id, node);
        Ok(&self.nodes[&id])
    }

    /// Runs the `quotamesh` binary with the test operator token ([`cli`]), and with
    /// `--ca-cert` when the admin ports speak TLS.
    pub fn cli(&self, arguments: &[&str]) -> anyhow::Result<String> {
        if !self.options.admin_tls {
            return cli(arguments);
        }
        let bundle = self.ca.bundle().display().to_string();
        let mut arguments = arguments.to_vec();
        arguments.extend(["--ca-cert", &bundle]);
        cli(&arguments)
    }

    /// Comma-separated admin addresses of the given nodes, for the CLI.
    pub fn admin_addrs(&self, ids: &[u64]) -> String {
        ids.iter().map(|id| self.nodes[id].admin_addr.to_string()).collect::<Vec<_>>().join(",")
    }

    /// Ids of the nodes whose process runs.
    pub fn running(&self) -> Vec<u64> {
        self.nodes.values().filter(|node| node.process.is_some()).map(|node| node.id).collect()
    }

    pub fn node(&mut self, id: u64) -> &mut ClusterNode {
        self.nodes.get_mut(&id).expect("a node of this cluster")
    }

    /// An admin client of node `id` (over TLS when the admin ports speak it).
    pub async fn admin(&self, id: u64) -> anyhow::Result<AdminClient<Channel>> {
        let address = self.nodes[&id].admin_addr;
        if self.options.admin_tls {
            admin_client_tls(address, &self.ca.bundle()).await
        } else {
            admin_client(address).await
        }
    }

    /// Node `id`'s status.
    pub async fn status(&self, id: u64) -> anyhow::Result<admin::StatusReply> {
        let mut client = self.admin(id).await?;
        Ok(client.status(call(admin::StatusRequest {})).await?.into_inner())
    }

    /// Waits until every running voter names the same leader, which is one of them; returns
    /// it. Gateways are left out: they name no leader.
    pub async fn leader(&self) -> anyhow::Result<u64> {
        let running: Vec<u64> =
            self.running().into_iter().filter(|id| !self.nodes[id].gateway).collect();
        self.leader_among(&running).await
    }

    /// Waits until the nodes `ids` name the same leader, which is one of them.
    pub async fn leader_among(&self, ids: &[u64]) -> anyhow::Result<u64> {
        let deadline = Instant::now() + CLUSTER_WAIT;
        loop {
            let mut leaders = Vec::new();
            for id in ids {
                leaders.push(self.status(*id).await.ok().and_then(|status| status.leader_id));
            }
            if let Some(Some(leader)) = leaders.first()
                && ids.contains(leader)
                && leaders.iter().all(|seen| seen == &Some(*leader))
            {
                return Ok(*leader);
            }
            if Instant::now() > deadline {
                bail!("nodes {ids:?} agreed on no leader within {CLUSTER_WAIT:?}: {leaders:?}");
            }
            tokio::time::sleep(POLL).await;
        }
    }

    /// Waits until the nodes `ids` have applied the same index with the same ledger digest;
    /// returns their statuses.
    pub async fn converged(&self, ids: &[u64]) -> anyhow::Result<Vec<admin::StatusReply>> {
        let deadline = Instant::now() + CLUSTER_WAIT;
        loop {
            let mut statuses = Vec::new();
            for id in ids {
                if let Ok(status) = self.status(*id).await {
                    statuses.push(status);
                }
            }
            if statuses.len() == ids.len()
                && statuses.iter().all(|status| {
                    status.applied_index.is_some()
                        && status.applied_index == statuses[0].applied_index
                        && status.state_digest == statuses[0].state_digest
                })
            {
                return Ok(statuses);
            }
            if Instant::now() > deadline {
                let seen: Vec<_> = statuses
                    .iter()
                    .map(|status| (status.node_id, status.applied_index, status.state_digest))
                    .collect();
                bail!("nodes {ids:?} did not converge within {CLUSTER_WAIT:?}: {seen:?}");
            }
            tokio::time::sleep(POLL).await;
        }
    }

    /// Waits until the nodes `ids` have converged at or past log index `index`: after a
    /// restart of every node, the entries before it are applied only once a new leader has
    /// committed an entry of its own term, so equal digests alone may still be a step behind.
    pub async fn converged_past(
        &self,
        ids: &[u64],
        index: Option<u64>,
    ) -> anyhow::Result<Vec<admin::StatusReply>> {
        let deadline = Instant::now() + CLUSTER_WAIT;
        loop {
            let statuses = self.converged(ids).await?;
            if statuses[0].applied_index >= index {
                return Ok(statuses);
            }
            if Instant::now() > deadline {
                bail!("nodes {ids:?} did not apply index {index:?} within {CLUSTER_WAIT:?}");
            }
            tokio::time::sleep(POLL).await;
        }
    }

    /// The voters as node `id` sees them.
    pub async fn voters(&self, id: u64) -> anyhow::Result<Vec<u64>> {
        let status = self.status(id).await?;
        Ok(status
            .members
            .iter()
            .filter(|member| member.voter)
            .map(|member| member.node_id)
            .collect())
    }
}

/// Runs the `quotamesh` binary (e.g. `cluster status`) with the test operator token and
/// returns its stdout; fails with its stderr when it exits non-zero.
pub fn cli(arguments: &[&str]) -> anyhow::Result<String> {
    let output = Command::new(super::quotamesh_bin())
        .args(arguments)
        .env("RUST_BACKTRACE", "0")
        .env("QUOTAMESH_ADMIN_TOKEN", ADMIN_TOKEN)
        .output()
        .context("run quotamesh")?;
    if !output.status.success() {
        bail!(
            "quotamesh {} failed ({}): {}",
            arguments.join(" "),
            output.status,
            String::from_utf8_lossy(&output.stderr)
        );
    }
    Ok(String::from_utf8(output.stdout)?)
}

/// An admin client with a connect timeout; each call carries [`CALL_TIMEOUT`] via [`call`].
pub async fn admin_client(address: SocketAddr) -> anyhow::Result<AdminClient<Channel>> {
    let channel = tonic::transport::Endpoint::from_shared(format!("http://{address}"))?
        .connect_timeout(Duration::from_secs(2))
        .timeout(CALL_TIMEOUT)
        .connect()
        .await
        .with_context(|| format!("connect to the admin API at {address}"))?;
    Ok(AdminClient::new(channel))
}

/// [`admin_client`] to an admin port served with `admin.tls`, trusting the CA `bundle`; no
/// client certificate, so calls authenticate with the token [`call`] adds.
pub async fn admin_client_tls(
    address: SocketAddr,
    bundle: &Path,
) -> anyhow::Result<AdminClient<Channel>> {
    let tls = quotamesh::cli::billing::client_tls(Some(bundle), None, None)?;
    let channel = tonic::transport::Endpoint::from_shared(format!("https://{address}"))?
        .tls_config(tls)?
        .connect_timeout(Duration::from_secs(2))
        .timeout(CALL_TIMEOUT)
        .connect()
        .await
        .with_context(|| format!("connect over TLS to the admin API at {address}"))?;
    Ok(AdminClient::new(channel))
}

/// A request with the test deadline and the test operator token.
pub fn call<T>(message: T) -> tonic::Request<T> {
    let mut request = tonic::Request::new(message);
    request.set_timeout(CALL_TIMEOUT);
    request
        .metadata_mut()
        .insert("authorization", format!("Bearer {ADMIN_TOKEN}").parse().expect("ascii token"));
    request
}

/// One lease request of the test policy: `tokens` on `api_key=<value>`.
pub fn wanted(key: &str, value: &str, tokens: u64) -> admin::LeaseWanted {
    admin::LeaseWanted {
        domain: DOMAIN.to_owned(),
        entries: vec![admin::DescriptorEntry { key: key.to_owned(), value: value.to_owned() }],
        tokens_wanted: tokens,
    }
}

/// The ledger key the node builds for `key=value` of the test domain (single-limit rules),
/// the same the RLS path leases under.
pub fn ledger_key(key: &str, value: &str) -> String {
    ledger_key_at(key, value, 0)
}

/// The ledger key of the `limit_index`-th limit of `key=value`'s rule in [`CLUSTER_POLICY`].
pub fn ledger_key_at(key: &str, value: &str, limit_index: usize) -> String {
    const DAY_MS: u64 = 86_400_000;
    let (requests, window_ms) = match (key, limit_index) {
        ("api_key", 0) => (1_000_000, DAY_MS),
        ("small", 0) => (10, DAY_MS),
        ("two_limits", 0) => (1_000, 3_600_000),
        ("two_limits", 1) => (100_000, DAY_MS),
        other => panic!("no limit {other:?} in the cluster policy"),
    };
    let spec = LimitSpec::new(Algorithm::TokenBucket, requests, window_ms, None)
        .expect("the policy's limits are valid");
    LeaseKey::of(DOMAIN, [(key, value)].into_iter(), limit_index, &spec).ledger_key()
}

/// How a client operation ended, in the fault-testing vocabulary.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum Outcome {
    /// Acknowledged: it was applied.
    Ok,
    /// Refused definitely: it was not applied.
    Fail(String),
    /// Timeout, UNAVAILABLE or a broken connection: it may or may not have been applied.
    Unknown(String),
}

impl Outcome {
    /// Classifies a call's result: only codes that promise "nothing happened" are `Fail`.
    pub fn of<T>(result: &Result<T, tonic::Status>) -> Self {
        let Err(status) = result else {
            return Self::Ok;
        };
        let message = format!("{:?}: {}", status.code(), status.message());
        match status.code() {
            tonic::Code::InvalidArgument
            | tonic::Code::NotFound
            | tonic::Code::FailedPrecondition
            | tonic::Code::AlreadyExists
            | tonic::Code::OutOfRange
            | tonic::Code::PermissionDenied
            | tonic::Code::Unauthenticated => Self::Fail(message),
            // A connection that was refused never carried the request.
            tonic::Code::Unavailable if connection_refused(status) => Self::Fail(message),
            _ => Self::Unknown(message),
        }
    }
}

/// Whether the call failed because the connection was refused (so it was never sent).
fn connection_refused(status: &tonic::Status) -> bool {
    let mut source: Option<&(dyn std::error::Error + 'static)> = std::error::Error::source(status);
    while let Some(error) = source {
        if let Some(io) = error.downcast_ref::<std::io::Error>()
            && io.kind() == std::io::ErrorKind::ConnectionRefused
        {
            return true;
        }
        source = error.source();
    }
    false
}

/// One recorded grant: a unique key asked for `tokens` once, through node `via`.
#[derive(Debug, Clone)]
pub struct GrantOp {
    pub key: String,
    pub tokens: u64,
    pub via: u64,
    pub outcome: Outcome,
    /// When the answer (or the failure) came back.
    pub completed_at: Instant,
}

/// Sends single-item grants on fresh keys `<prefix>-<n>` through `via`'s admin API until
/// `stop` is set, one at a time, and records each outcome. Each key is asked for once, so a
/// key holding more than `tokens` was applied twice.
pub async fn stream_grants(
    via: u64,
    address: SocketAddr,
    prefix: String,
    tokens: u64,
    stop: tokio::sync::watch::Receiver<bool>,
) -> Vec<GrantOp> {
    let mut ops = Vec::new();
    let mut client: Option<AdminClient<Channel>> = None;
    for sequence in 0.. {
        if *stop.borrow() {
            break;
        }
        let value = format!("{prefix}-{sequence}");
        let key = ledger_key("api_key", &value);
        if client.is_none() {
            client = admin_client(address).await.ok();
        }
        let Some(connected) = client.as_mut() else {
            // Not even connected: nothing was sent.
            let outcome = Outcome::Fail("no connection".into());
            ops.push(GrantOp { key, tokens, via, outcome, completed_at: Instant::now() });
            tokio::time::sleep(POLL).await;
            continue;
        };
        let request = admin::AcquireLeasesRequest {
            leases: vec![wanted("api_key", &value, tokens)],
            lease_ttl_ms: 60_000,
        };
        let result = connected.acquire_leases(call(request)).await;
        let outcome = Outcome::of(&result);
        if let Ok(reply) = &result {
            let granted = reply.get_ref().results.first().map_or(0, |result| result.granted_tokens);
            assert_eq!(granted, tokens, "a fresh day-long bucket grants everything asked");
        }
        if outcome != Outcome::Ok {
            // Leadership is moving or the node is down: give it a moment, reconnect.
            client = None;
            tokio::time::sleep(POLL).await;
        }
        ops.push(GrantOp { key, tokens, via, outcome, completed_at: Instant::now() });
    }
    ops
}

/// Checks recorded grants against the ledger of node `id`: every acknowledged grant is held
/// exactly once, a refused one not at all, an unknown one once or not at all. Returns the
/// counts of (ok, fail, unknown, unknown-found-applied).
pub async fn check_grants(
    cluster: &Cluster,
    id: u64,
    ops: &[GrantOp],
) -> anyhow::Result<(usize, usize, usize, usize)> {
    let mut client = cluster.admin(id).await?;
    let mut held = BTreeMap::new();
    for chunk in ops.chunks(1024) {
        let keys = chunk.iter().map(|op| op.key.clone()).collect();
        let reply = client
            .read_keys(call(admin::ReadKeysRequest { keys, ..Default::default() }))
            .await?
            .into_inner();
        for entry in reply.entries {
            let tokens: u64 = entry.leases.iter().map(|lease| lease.tokens).sum();
            held.insert(entry.key, tokens);
        }
    }
    let (mut ok, mut fail, mut unknown, mut unknown_applied) = (0, 0, 0, 0);
    for op in ops {
        let tokens = held.get(&op.key).copied().unwrap_or(0);
        match &op.outcome {
            Outcome::Ok => {
                ok += 1;
                anyhow::ensure!(
                    tokens == op.tokens,
                    "node {id}: acknowledged grant {} holds {tokens} tokens, expected {}",
                    op.key,
                    op.tokens
                );
            }
            Outcome::Fail(reason) => {
                fail += 1;
                anyhow::ensure!(
                    tokens == 0,
                    "node {id}: refused grant {} ({reason}) holds {tokens}",
                    op.key
                );
            }
            Outcome::Unknown(_) => {
                unknown += 1;
                anyhow::ensure!(
                    tokens == 0 || tokens == op.tokens,
                    "node {id}: grant {} of unknown outcome holds {tokens}, neither 0 nor {}",
                    op.key,
                    op.tokens
                );
                if tokens > 0 {
                    unknown_applied += 1;
                }
            }
        }
    }
    Ok((ok, fail, unknown, unknown_applied))
}
