//! Billing test harness: real `quotamesh` processes forming a billing group (one node, or
//! three voters with node 1 bootstrapping; newcomers that wait to be added), clients with
//! tokens, reading the leader from reply metadata, and collecting the whole audit trail.

use std::path::{Path, PathBuf};
use std::time::{Duration, Instant};

use anyhow::{Context, bail};
use quotamesh::api::billing::auth::token_sha256_hex;
use quotamesh::api::billing::{METADATA_LEADER, entry_from_pb};
use quotamesh::api::proto::quotamesh::billing::v1 as pb;
use quotamesh::core::billing::{AuditEntry, Decision};
use tonic::transport::Channel;

use super::billing_checker::Completion;
use super::tls::TestCa;
use super::{NodeProcess, free_port};

pub use pb::billing_client::BillingClient;

/// A token for every tenant.
pub const ADMIN_TOKEN: &str = "admin-token-for-tests";
/// A token for tenant `t1` only.
pub const T1_TOKEN: &str = "t1-token-for-tests";
/// How long a billing call may wait for its commit on the test nodes.
pub const DEADLINE_MS: u64 = 1000;
/// Client-side timeout of one call: the deadline plus room for a slow debug build.
pub const CALL_TIMEOUT: Duration = Duration::from_millis(DEADLINE_MS + 2000);

/// The example policy shipped in the repository (the RLS side needs one).
pub fn policy() -> PathBuf {
    Path::new(env!("CARGO_MANIFEST_DIR")).join("../../cluster/policies/example.yaml")
}

/// One node of a billing cluster, running or stopped.
pub struct BillingNode {
    pub id: u64,
    pub billing_addr: String,
    pub raft_addr: String,
    pub admin_addr: String,
    pub data_dir: PathBuf,
    pub config: PathBuf,
    /// The policy the node serves ([`policy`] unless the cluster was given another).
    pub policy: PathBuf,
    /// More environment variables of the process (e.g. libfaketime's).
    pub environment: Vec<(&'static str, String)>,
    pub process: Option<NodeProcess>,
}

impl BillingNode {
    /// Node `id` with fresh ports, its files under `root`, serving `policy` (else [`policy`]).
    fn new(
        root: &Path,
        id: u64,
        policy_path: Option<&Path>,
        environment: Vec<(&'static str, String)>,
    ) -> Self {
        Self {
            id,
            billing_addr: format!("127.0.0.1:{}", free_port()),
            raft_addr: format!("127.0.0.1:{}", free_port()),
            admin_addr: format!("127.0.0.1:{}", free_port()),
            data_dir: root.join(format!("node{id}")),
            config: root.join(format!("node{id}.toml")),
            policy: policy_path.map_or_else(policy, Path::to_owned),
            environment,
            process: None,
        }
    }

    /// Writes the node's TOML: addresses, `peers` (TOML `[[peers]]` tables), its certificate
    /// when the group has a CA, `[billing]` (forming the group with `bootstrap`), `trailer`.
    fn write_config(
        &self,
        peers: &str,
        bootstrap: bool,
        ca: Option<&TestCa>,
        trailer: &str,
    ) -> anyhow::Result<()> {
        let tls = match ca {
            Some(ca) => ca.node_section(self.id, "127.0.0.1", false)?,
            None => String::new(),
        };
        let text = format!(
            "billing_addr = \"{}\"\nraft_addr = \"{}\"\nraft_node_id = {}\n\n{peers}\n{tls}\n\
             [billing]\nbootstrap = {bootstrap}\ndeadline_ms = {DEADLINE_MS}\n{trailer}",
            self.billing_addr, self.raft_addr, self.id,
        );
        std::fs::write(&self.config, text)?;
        Ok(())
    }

    /// Starts (or restarts) the process on its data directory and ports.
    pub fn start(&mut self) -> anyhow::Result<()> {
        let config = self.config.to_string_lossy().into_owned();
        let arguments = [
            "--config",
            &config,
            "--billing-addr",
            &self.billing_addr,
            "--raft-addr",
            &self.raft_addr,
            "--admin-addr",
            &self.admin_addr,
        ];
        self.process = Some(NodeProcess::start_with_environment(
            &self.policy,
            &self.data_dir,
            &arguments,
            &self.environment,
        )?);
        Ok(())
    }

    /// `kill -9`: no shutdown, no flush.
    pub fn kill(&mut self) -> anyhow::Result<()> {
        let process = self.process.take().context("node not running")?;
        process.signal("KILL")?;
        drop(process); // reaps it
        Ok(())
    }

    /// SIGTERM and wait.
    pub fn stop(&mut self) -> anyhow::Result<()> {
        let mut process = self.process.take().context("node not running")?;
        process.terminate()?;
        Ok(())
    }

    /// Whether the process runs.
    pub fn running(&self) -> bool {
        self.process.is_some()
    }
}

/// A billing group of real processes.
pub struct BillingCluster {
    pub nodes: Vec<BillingNode>,
    /// What every node's config ends with, after its `[billing]` table and tokens.
    trailer: String,
    /// The group's CA when it has several nodes (mTLS between them).
    ca: Option<TestCa>,
    scratch: tempfile::TempDir,
}

fn tokens_toml() -> String {
    format!(
        "[[billing.tokens]]\nname = \"admin\"\nsha256 = \"{}\"\ntenants = [\"*\"]\n\n\
         [[billing.tokens]]\nname = \"t1-service\"\nsha256 = \"{}\"\ntenants = [\"t1\"]\n",
        token_sha256_hex(ADMIN_TOKEN),
        token_sha256_hex(T1_TOKEN)
    )
}

impl BillingCluster {
    /// Starts `count` nodes (1 or 3): one forms a single-node group; three list each other
    /// as peers and node 1 bootstraps the billing group. `extra_toml` is appended to every node's `[billing]`.
    pub fn start(count: usize, extra_toml: &str) -> anyhow::Result<Self> {
        Self::start_inner(count, extra_toml, "", None, &|_| Vec::new(), &|_| Ok(()))
    }

    /// Like [`Self::start`], with `trailer` (e.g. a `[billing.tls]` table) at the end of
    /// every node's file, after the tokens.
    pub fn start_with_trailer(count: usize, trailer: &str) -> anyhow::Result<Self> {
        Self::start_inner(count, "", trailer, None, &|_| Vec::new(), &|_| Ok(()))
    }

    /// Like [`Self::start`], every node serving `policy` and accepting the test operator
    /// token on its admin API (`super::tls::ADMIN_TOKEN`), node `id` with the environment
    /// variables `environment(id)` added.
    pub fn start_with_environment(
        count: usize,
        policy: &Path,
        environment: &dyn Fn(u64) -> Vec<(&'static str, String)>,
    ) -> anyhow::Result<Self> {
        let admin = super::tls::admin_section();
        Self::start_inner(count, "", &admin, Some(policy), environment, &|_| Ok(()))
    }

    /// Like [`Self::start`], calling `prepare` on each node (e.g. to mount its data
    /// directory) before any starts.
    pub fn start_prepared(
        count: usize,
        prepare: &dyn Fn(&BillingNode) -> anyhow::Result<()>,
    ) -> anyhow::Result<Self> {
        Self::start_inner(count, "", "", None, &|_| Vec::new(), prepare)
    }

    fn start_inner(
        count: usize,
        extra_toml: &str,
        trailer: &str,
        policy_path: Option<&Path>,
        environment: &dyn Fn(u64) -> Vec<(&'static str, String)>,
        prepare: &dyn Fn(&BillingNode) -> anyhow::Result<()>,
    ) -> anyhow::Result<Self> {
        let scratch = tempfile::tempdir()?;
        let nodes: Vec<BillingNode> = (1..=count as u64)
            .map(|id| BillingNode::new(scratch.path(), id, policy_path, environment(id)))
            .collect();
        // The billing group has the quota group's members: `raft_node_id` and `[[peers]]`.
        let peers: String = if count > 1 {
            nodes
                .iter()
                .map(|node| {
                    format!("[[peers]]\nid = {}\nraft_addr = \"{}\"\n", node.id, node.raft_addr)
                })
                .collect()
        } else {
            String::new()
        };
        // Several nodes run as shipped: mTLS between them, with a CA of the group's own.
        let ca = if count > 1 { Some(TestCa::new(scratch.path(), "local")?) } else { None };
        let trailer = format!("{extra_toml}\n{}\n{trailer}", tokens_toml());
        for node in &nodes {
            node.write_config(&peers, node.id == 1, ca.as_ref(), &trailer)?;
            prepare(node)?;
        }
        let mut cluster = Self { nodes, trailer, ca, scratch };
        for node in &mut cluster.nodes {
            node.start()?;
        }
        Ok(cluster)
    }

    /// Creates node `id` as a newcomer, with only itself in `[[peers]]` so it waits to be
    /// added (`quotamesh cluster add-node`) rather than forming a region of its own, and
    /// starts it. Needs a cluster of several nodes (their CA).
    pub fn start_newcomer(&mut self, id: u64) -> anyhow::Result<&BillingNode> {
        let ca = self.ca.as_ref().context("a newcomer joins a cluster of several nodes")?;
        let policy = self.nodes[0].policy.clone();
        let environment = self.nodes[0].environment.clone();
        let mut node = BillingNode::new(self.scratch.path(), id, Some(&policy), environment);
        let peers = format!("[[peers]]\nid = {id}\nraft_addr = \"{}\"\n", node.raft_addr);
        node.write_config(&peers, false, Some(ca), &self.trailer)?;
        node.start()?;
        self.nodes.push(node);
        Ok(&self.nodes[self.nodes.len() - 1])
    }

    /// A client of node `index` (0-based).
    pub async fn client(&self, index: usize) -> anyhow::Result<BillingClient<Channel>> {
        connect(&self.nodes[index].billing_addr).await
    }

    /// Waits until node `index` answers a linearizable read (the group has a leader that
    /// a quorum follows); returns the leader's id from the reply metadata.
    pub async fn wait_for_leader(&self, index: usize) -> anyhow::Result<u64> {
        let deadline = Instant::now() + Duration::from_secs(30);
        let mut client = self.client(index).await?;
        loop {
            let request = with_token(
                pb::GetBalanceRequest { account: Some(account("probe", "none")) },
                ADMIN_TOKEN,
            );
            let result = client.get_balance(request).await;
            let metadata = match &result {
                Ok(reply) => Some(reply.metadata().clone()),
                Err(status) if status.code() == tonic::Code::NotFound => {
                    Some(status.metadata().clone())
                }
                Err(_) => None,
            };
            if let Some(leader) = metadata
                .as_ref()
                .and_then(|m| m.get(METADATA_LEADER))
                .and_then(|v| v.to_str().ok())
                .and_then(|v| v.parse().ok())
            {
                return Ok(leader);
            }
            if Instant::now() > deadline {
                bail!("node {} found no leader within 30 s: {result:?}", index + 1);
            }
            tokio::time::sleep(Duration::from_millis(100)).await;
        }
    }

    /// The index (0-based) of the node with id `id`.
    pub fn index_of(&self, id: u64) -> usize {
        self.nodes.iter().position(|node| node.id == id).expect("known node id")
    }
}

/// A client of a billing address.
pub async fn connect(address: &str) -> anyhow::Result<BillingClient<Channel>> {
    let channel = tonic::transport::Endpoint::from_shared(format!("http://{address}"))?
        .connect_timeout(Duration::from_secs(2))
        .timeout(CALL_TIMEOUT)
        .connect_lazy();
    Ok(BillingClient::new(channel))
}

/// A request with a bearer token and the client timeout.
pub fn with_token<T>(body: T, token: &str) -> tonic::Request<T> {
    let mut request = tonic::Request::new(body);
    request.set_timeout(CALL_TIMEOUT);
    request
        .metadata_mut()
        .insert("authorization", format!("Bearer {token}").parse().expect("ascii token"));
    request
}

/// An account message.
pub fn account(tenant: &str, meter: &str) -> pb::Account {
    pb::Account { tenant: tenant.to_owned(), meter: meter.to_owned() }
}

/// Creates an account and credits it, with fixed keys.
pub async fn open_account(
    client: &mut BillingClient<Channel>,
    tenant: &str,
    meter: &str,
    floor: u64,
    credit: u64,
) -> anyhow::Result<()> {
    let create = pb::CreateAccountRequest {
        account: Some(account(tenant, meter)),
        floor,
        idempotency_key: format!("create-{tenant}-{meter}"),
    };
    client.create_account(with_token(create, ADMIN_TOKEN)).await?;
    if credit > 0 {
        let fund = pb::CreditRequest {
            account: Some(account(tenant, meter)),
            amount: credit,
            idempotency_key: format!("fund-{tenant}-{meter}"),
        };
        client.credit(with_token(fund, ADMIN_TOKEN)).await?;
    }
    Ok(())
}

/// The whole audit trail as seen through one node (all pages).
pub async fn full_trail(client: &mut BillingClient<Channel>) -> anyhow::Result<Vec<AuditEntry>> {
    let mut entries = Vec::new();
    let mut page_token = 0;
    loop {
        let request = pb::ListEntriesRequest {
            account: None,
            since_ledger_index: 0,
            page_token,
            page_size: 1000,
        };
        let reply = client.list_entries(with_token(request, ADMIN_TOKEN)).await?.into_inner();
        for entry in &reply.entries {
            entries.push(entry_from_pb(entry).map_err(anyhow::Error::msg)?);
        }
        if !reply.more {
            return Ok(entries);
        }
        page_token = reply.next_page_token;
    }
}

/// An account's balance through one node.
pub async fn balance(
    client: &mut BillingClient<Channel>,
    tenant: &str,
    meter: &str,
) -> anyhow::Result<pb::BalanceReply> {
    let request = pb::GetBalanceRequest { account: Some(account(tenant, meter)) };
    Ok(client.get_balance(with_token(request, ADMIN_TOKEN)).await?.into_inner())
}

/// A tiny deterministic PRNG (xorshift64*), so workloads are reproducible from a seed.
pub struct Rng(u64);

impl Rng {
    pub fn new(seed: u64) -> Self {
        Self(seed.wrapping_mul(0x9E37_79B9_7F4A_7C15) | 1)
    }

    fn next_word(&mut self) -> u64 {
        self.0 ^= self.0 >> 12;
        self.0 ^= self.0 << 25;
        self.0 ^= self.0 >> 27;
        self.0.wrapping_mul(0x2545_F491_4F6C_DD1D)
    }

    /// Uniform in `low..=high`.
    pub fn between(&mut self, low: u64, high: u64) -> u64 {
        low + self.next_word() % (high - low + 1)
    }
}

/// How a billing operation's reply reads in the fault-testing vocabulary: `Ok` with what it
/// decided, `Fail` for a definite refusal (not applied), `Info` when it may have applied.
pub fn completion(
    result: &Result<tonic::Response<pb::OperationReply>, tonic::Status>,
) -> Completion {
    match result {
        Ok(reply) => {
            let reply = reply.get_ref();
            let decision = match reply.original_decision() {
                pb::Decision::InsufficientFunds => Decision::InsufficientFunds,
                _ => Decision::Approved,
            };
            Completion::Ok {
                decision,
                duplicate: reply.decision() == pb::Decision::Duplicate,
                ledger_index: reply.ledger_index,
                balance_after: reply.balance,
            }
        }
        Err(status) => match status.code() {
            tonic::Code::InvalidArgument
            | tonic::Code::NotFound
            | tonic::Code::AlreadyExists
            | tonic::Code::FailedPrecondition
            | tonic::Code::PermissionDenied
            | tonic::Code::Unauthenticated
            | tonic::Code::ResourceExhausted => Completion::Fail(status.code()),
            // UNAVAILABLE, DEADLINE_EXCEEDED, transport errors: may have applied.
            _ => Completion::Info(format!("{:?}: {}", status.code(), status.message())),
        },
    }
}
