//! `quotamesh cluster init|add-node|remove-node|status|regions|acquire-leases`: the command-line
//! client of the admin gRPC service (`crate::api::admin`); `cluster certs` is
//! `crate::cli::certs`'s.
//!
//! Every call carries the operator token (`authorization: Bearer`), read from
//! `QUOTAMESH_ADMIN_TOKEN` or the file `--admin-token-file` names; against an admin port
//! served with `admin.tls`, `--ca-cert` (and an operator's `--client-cert`, `--client-key`
//! instead of a token) makes the connection TLS.
//!
//! Membership changes run on the changed group's leader. A voter is a member of both of the
//! region's groups, so `add-node` and `remove-node` change both (`--group all`, the default):
//! the quota group first, then the billing group, each at its own leader; `--group quota` or
//! `--group billing` changes one, e.g. to finish a change that stopped half way. Give
//! `--admin-addr` every node of the region (comma-separated or repeated) and the command
//! finds each group's leader by asking each node for its status; with one address, that node
//! must lead. Running a change again after a lost answer finishes it or changes nothing.
//! Output is readable text, or one JSON document with `--json`. The connection and output
//! options ([`Target`]) may come before or after the subcommand.

use std::collections::BTreeMap;
use std::time::Duration;

use anyhow::{Context, bail};
use clap::{Args, Subcommand, ValueEnum};
use tonic::transport::Channel;

use crate::api::proto::quotamesh::admin::v1 as proto;
use crate::api::proto::quotamesh::admin::v1::admin_client::AdminClient;

/// How long connecting to a node may take.
const CONNECT_TIMEOUT: Duration = Duration::from_secs(3);
/// How often `init` looks for an elected leader.
const LEADER_POLL: Duration = Duration::from_millis(100);

/// `--timeout-ms` when none is given, in milliseconds.
const TIMEOUT_MS_DEFAULT: &str = "30000";

/// `quotamesh cluster`: the options every subcommand shares, then the subcommand.
#[derive(Debug, Args)]
pub struct ClusterArgs {
    /// Where to reach the region, how long to wait, how to print.
    #[command(flatten)]
    pub target: Target,
    /// What to do.
    #[command(subcommand)]
    pub command: ClusterCommand,
}

/// Where to reach the region and how long to wait: accepted before or after the subcommand
/// (`global`).
#[derive(Debug, Args)]
pub struct Target {
    /// Admin gRPC address of a node, `host:port` or `http://host:port`; comma-separated or
    /// repeated to give every node of the region.
    #[arg(
        long = "admin-addr",
        global = true,
        value_delimiter = ',',
        default_value = "127.0.0.1:8083"
    )]
    pub admin_addrs: Vec<String>,
    /// Deadline of each call, in milliseconds (each command's help says what it covers).
    #[arg(long, global = true, default_value = TIMEOUT_MS_DEFAULT)]
    pub timeout_ms: u64,
    /// Print JSON instead of text.
    #[arg(long, global = true)]
    pub json: bool,
    /// A file holding the operator token (else `QUOTAMESH_ADMIN_TOKEN`).
    #[arg(long, global = true)]
    pub admin_token_file: Option<std::path::PathBuf>,
    /// The cluster's CA certificate: talk TLS to an admin port served with `admin.tls`.
    #[arg(long, global = true)]
    pub ca_cert: Option<std::path::PathBuf>,
    /// An operator certificate (`quotamesh cluster certs issue-operator`), instead of a token.
    #[arg(long, global = true, requires = "client_key")]
    pub client_cert: Option<std::path::PathBuf>,
    /// The operator certificate's key.
    #[arg(long, global = true, requires = "client_cert")]
    pub client_key: Option<std::path::PathBuf>,
    /// The token, once read.
    #[arg(skip)]
    token: Option<tonic::metadata::MetadataValue<tonic::metadata::Ascii>>,
}

/// The variable the operator token is read from.
pub const ADMIN_TOKEN_VARIABLE: &str = "QUOTAMESH_ADMIN_TOKEN";

impl Target {
    /// The target of another command that calls the admin API of one node (`quotamesh
    /// policy apply|history|rollback|get --version`), with the operator token read.
    ///
    /// # Errors
    /// A token file that cannot be read, or a token that is not printable ASCII.
    pub fn single(
        admin_addr: String,
        timeout_ms: u64,
        admin_token_file: Option<std::path::PathBuf>,
        tls: &crate::cli::policy::AdminTls,
    ) -> anyhow::Result<Self> {
        let mut target = Self {
            admin_addrs: vec![admin_addr],
            timeout_ms,
            json: false,
            admin_token_file,
            ca_cert: tls.ca_cert.clone(),
            client_cert: tls.client_cert.clone(),
            client_key: tls.client_key.clone(),
            token: None,
        };
        target.read_token()?;
        Ok(target)
    }

    /// Reads the operator token from `--admin-token-file` or `QUOTAMESH_ADMIN_TOKEN`.
    fn read_token(&mut self) -> anyhow::Result<()> {
        self.token = match operator_token(self.admin_token_file.as_deref())? {
            None => None,
            Some(token) => {
                let mut value: tonic::metadata::MetadataValue<tonic::metadata::Ascii> =
                    format!("Bearer {token}")
                        .parse()
                        .context("the admin token must be printable ASCII")?;
                value.set_sensitive(true);
                Some(value)
            }
        };
        Ok(())
    }
}

/// The operator token of the file given (`--admin-token-file`), else of
/// `QUOTAMESH_ADMIN_TOKEN`, trimmed; `None` when neither holds one.
///
/// # Errors
/// A token file that cannot be read.
pub fn operator_token(file: Option<&std::path::Path>) -> anyhow::Result<Option<String>> {
    let token = match file {
        Some(path) => Some(
            std::fs::read_to_string(path)
                .with_context(|| format!("read the admin token from {}", path.display()))?,
        ),
        None => std::env::var(ADMIN_TOKEN_VARIABLE).ok(),
    };
    Ok(token.as_deref().map(str::trim).filter(|token| !token.is_empty()).map(str::to_owned))
}

/// `--timeout-ms` as one subcommand shows it: [`Target::timeout_ms`] with that command's own
/// help. A subcommand's argument of a global option's id hides the group's copy, and clap
/// hands the value given on either side of the subcommand to both, so `Target` reads it
/// wherever it was written.
fn timeout_arg(help: &'static str) -> clap::Arg {
    clap::Arg::new("timeout_ms")
        .long("timeout-ms")
        .value_name("TIMEOUT_MS")
        .help(help)
        .value_parser(clap::value_parser!(u64))
        .default_value(TIMEOUT_MS_DEFAULT)
}

/// The groups a membership command changes.
#[derive(Debug, Clone, Copy, PartialEq, Eq, ValueEnum)]
pub enum GroupChoice {
    /// Both of the region's groups (a voter is a member of both): quota, then billing.
    All,
    /// The quota group only (leases, policies).
    Quota,
    /// The billing group only (accounts, debits).
    Billing,
}

impl GroupChoice {
    fn groups(self) -> &'static [proto::Group] {
        match self {
            Self::All => &[proto::Group::Quota, proto::Group::Billing],
            Self::Quota => &[proto::Group::Quota],
            Self::Billing => &[proto::Group::Billing],
        }
    }
}

/// A group's name as the nodes log it.
fn group_name(group: proto::Group) -> &'static str {
    match group {
        proto::Group::Quota => crate::ledger::QUOTA_GROUP_NAME,
        proto::Group::Billing => crate::ledger::BILLING_GROUP_NAME,
    }
}

/// Cluster subcommands.
#[derive(Debug, Subcommand)]
pub enum ClusterCommand {
    /// Form the quota group from the node's configured `[[peers]]` (once, on one of them),
    /// then wait until a leader is elected.
    #[command(arg(timeout_arg(
        "How long forming the group and electing its leader may take, in milliseconds"
    )))]
    Init,
    /// Add a node to the region's groups: as a learner, wait until it caught up, then make it
    /// a voter; the quota group, then the billing group. Returns once the node has applied
    /// every quota entry the leader had when it became a voter (watched on the node itself
    /// when its admin address is among `--admin-addr`, else it holds them, as the leader sees).
    #[command(arg(timeout_arg(
        "How long adding the node may take, in milliseconds, including the waits until it has \
         caught up with the leader's log"
    )))]
    AddNode {
        /// The new node's `raft_node_id`.
        #[arg(long)]
        node_id: u64,
        /// Its Raft address as the other nodes reach it, `host:port`.
        #[arg(long)]
        raft_addr: String,
        /// Keep it a learner (a non-voting replica). A gateway (`role = "gateway"`) needs no
        /// add-node: it is no member.
        #[arg(long)]
        learner_only: bool,
        /// Which groups to add it to.
        #[arg(long, value_enum, default_value = "all")]
        group: GroupChoice,
    },
    /// Remove a node from the voters and the members of the region's groups. A group's last
    /// voter is refused.
    #[command(arg(timeout_arg("How long the membership change may take, in milliseconds")))]
    RemoveNode {
        /// The node's `raft_node_id`.
        #[arg(long)]
        node_id: u64,
        /// Which groups to remove it from; with `all`, a group the node is no member of is
        /// left as it is (a change finished by an earlier run).
        #[arg(long, value_enum, default_value = "all")]
        group: GroupChoice,
    },
    /// Show each node's view: role, leader, term, commit and applied index, members, lag per
    /// follower, ledger digest (a gateway: the leader it last reached and its voters).
    #[command(arg(timeout_arg("How long each node may take to answer, in milliseconds")))]
    Status,
    /// Show each node's region: every global limit's slice here, its policy share, the
    /// demand measured, the peers' slices, and the transfers in flight (the rebalancer's
    /// measures show on the quota group's leader).
    #[command(arg(timeout_arg("How long each node may take to answer, in milliseconds")))]
    Regions,
    /// List the quota ledger's keys as the first node has applied them: each key's limit,
    /// live leases, debt, and its bucket's totals (granted, charged for debt, returned on
    /// settlement) since it took its limit.
    #[command(arg(timeout_arg("How long each page may take, in milliseconds")))]
    Keys {
        /// Start after this key (the listing is in key order).
        #[arg(long, default_value = "")]
        after: String,
        /// At most this many keys.
        #[arg(long, default_value_t = 100)]
        limit: usize,
    },
    /// Make the cluster's CA and node certificates (mTLS between nodes).
    #[command(subcommand)]
    Certs(crate::cli::certs::CertsCommand),
    /// Ask for leases on one descriptor (held by the node asked), e.g. to check a rule.
    #[command(arg(timeout_arg("How long the lease request may take, in milliseconds")))]
    AcquireLeases {
        /// The descriptor's domain.
        #[arg(long)]
        domain: String,
        /// A descriptor entry `key=value`; repeat for a nested descriptor.
        #[arg(long = "entry", required = true)]
        entries: Vec<String>,
        /// Tokens wanted.
        #[arg(long, default_value_t = 1)]
        tokens: u64,
        /// Lease TTL in milliseconds (0: the node's default).
        #[arg(long, default_value_t = 0)]
        lease_ttl_ms: u64,
    },
}

/// Runs a cluster subcommand.
///
/// # Errors
/// When no node can be reached in time, or the node refuses the call (the message says why).
pub async fn run(arguments: ClusterArgs) -> anyhow::Result<()> {
    let ClusterArgs { mut target, command } = arguments;
    if !matches!(command, ClusterCommand::Certs(_)) {
        target.read_token()?;
    }
    match command {
        ClusterCommand::Certs(command) => crate::cli::certs::run(command),
        ClusterCommand::Init => init(&target).await,
        ClusterCommand::AddNode { node_id, raft_addr, learner_only, group } => {
            let started = tokio::time::Instant::now();
            let mut changed = Vec::new();
            for &group in group.groups() {
                let mut client = leader(&target, group).await?;
                if !target.json {
                    eprintln!(
                        "adding node {node_id} ({raft_addr}) to the {} group as a learner; \
                         waiting until it has caught up...",
                        group_name(group)
                    );
                }
                let request = proto::AddNodeRequest {
                    node_id,
                    raft_addr: raft_addr.clone(),
                    learner_only,
                    group: group as i32,
                };
                let reply = client
                    .add_node(with_deadline(request, &target))
                    .await
                    .map_err(|status| group_error(group, status))?
                    .into_inner();
                let caught_up = if group == proto::Group::Quota {
                    wait_caught_up(&mut client, &target, node_id, started).await?
                } else {
                    None
                };
                changed.push((group, Some(reply), caught_up));
            }
            print_members(&target, "node added", &changed)
        }
        ClusterCommand::RemoveNode { node_id, group: choice } => {
            let mut changed = Vec::new();
            for &group in choice.groups() {
                let mut client = leader(&target, group).await?;
                let request = proto::RemoveNodeRequest { node_id, group: group as i32 };
                match client.remove_node(with_deadline(request, &target)).await {
                    Ok(reply) => changed.push((group, Some(reply.into_inner()), None)),
                    // An earlier run removed it from this group already.
                    Err(status)
                        if choice == GroupChoice::All && status.code() == tonic::Code::NotFound =>
                    {
                        changed.push((group, None, None));
                    }
                    Err(status) => return Err(group_error(group, status)),
                }
            }
            if changed.iter().all(|(_, reply, _)| reply.is_none()) {
                bail!("NotFound: node {node_id} is a member of neither group");
            }
            print_members(&target, "node removed", &changed)
        }
        ClusterCommand::Status => status(&target).await,
        ClusterCommand::Regions => regions(&target).await,
        ClusterCommand::Keys { after, limit } => keys(&target, after, limit).await,
        ClusterCommand::AcquireLeases { domain, entries, tokens, lease_ttl_ms } => {
            let entries = entries
                .iter()
                .map(|entry| {
                    let (key, value) = entry
                        .split_once('=')
                        .with_context(|| format!("{entry:?} is not key=value"))?;
                    Ok(proto::DescriptorEntry { key: key.to_owned(), value: value.to_owned() })
                })
                .collect::<anyhow::Result<Vec<_>>>()?;
            let address = first_address(&target)?;
            let mut client = connect(address, &target).await?;
            let request = proto::AcquireLeasesRequest {
                leases: vec![proto::LeaseWanted { domain, entries, tokens_wanted: tokens }],
                lease_ttl_ms,
            };
            let reply = client
                .acquire_leases(with_deadline(request, &target))
                .await
                .map_err(rpc_error)?
                .into_inner();
            let results: Vec<serde_json::Value> = reply
                .results
                .iter()
                .map(|result| {
                    serde_json::json!({
                        "key": result.key,
                        "granted_tokens": result.granted_tokens,
                        "retry_after_ms": result.retry_after_ms,
                        "remaining_tokens": result.remaining_tokens,
                        "lease_expires_at_ms": result.lease_expires_at_ms,
                        "error": (!result.error.is_empty()).then_some(&result.error),
                    })
                })
                .collect();
            if target.json {
                let answer = serde_json::json!({
                    "leaseholder_node_id": reply.leaseholder_node_id,
                    "results": results,
                });
                println!("{}", serde_json::to_string_pretty(&answer)?);
                return Ok(());
            }
            println!("held by node {}", reply.leaseholder_node_id);
            for result in &reply.results {
                println!("  {}", describe_lease(result));
            }
            Ok(())
        }
    }
}

/// `cluster keys`: pages of `ReadKeys` listings until `limit` keys or the last page.
async fn keys(target: &Target, mut after: String, limit: usize) -> anyhow::Result<()> {
    let mut client = connect(first_address(target)?, target).await?;
    let mut entries = Vec::new();
    let mut state = (None, 0);
    while entries.len() < limit {
        let wanted = u32::try_from(limit - entries.len()).unwrap_or(u32::MAX);
        let request = proto::ReadKeysRequest { keys: Vec::new(), after, max_keys: wanted };
        let page =
            client.read_keys(with_deadline(request, target)).await.map_err(rpc_error)?.into_inner();
        state = (page.applied_index, page.ledger_time_ms);
        entries.extend(page.entries);
        if page.next_after.is_empty() {
            break;
        }
        after = page.next_after;
    }
    entries.truncate(limit);
    let (applied_index, ledger_time_ms) = state;
    if target.json {
        let keys: Vec<serde_json::Value> = entries.iter().map(key_json).collect();
        let answer = serde_json::json!({
            "applied_index": applied_index,
            "ledger_time_ms": ledger_time_ms,
            "keys": keys,
        });
        println!("{}", serde_json::to_string_pretty(&answer)?);
        return Ok(());
    }
    println!(
        "{} key(s) at applied index {}, ledger time {}",
        entries.len(),
        applied_index.map_or_else(|| "-".to_owned(), |index| index.to_string()),
        crate::core::rfc3339::format_epoch_ms(ledger_time_ms)
    );
    for entry in &entries {
        let leases: Vec<String> = entry
            .leases
            .iter()
            .map(|lease| format!("node {} holds {}", lease.node_id, lease.tokens))
            .collect();
        println!(
            "  {}: {} {} per {} ms, holds {}; since {}: granted {}, charged {}, returned {}; \
             debt {}; {}",
            entry.key,
            entry.algorithm,
            entry.requests_per_window,
            entry.window_ms,
            entry.capacity_tokens,
            crate::core::rfc3339::format_epoch_ms(entry.totals_since_ms),
            entry.granted_tokens,
            entry.charged_tokens,
            entry.returned_tokens,
            entry.debt_tokens,
            if leases.is_empty() { "no lease".to_owned() } else { leases.join(", ") },
        );
    }
    Ok(())
}

fn key_json(entry: &proto::KeyEntry) -> serde_json::Value {
    let leases: Vec<serde_json::Value> = entry
        .leases
        .iter()
        .map(|lease| {
            serde_json::json!({
                "node_id": lease.node_id,
                "tokens": lease.tokens,
                "expires_at_ms": lease.expires_at_ms,
            })
        })
        .collect();
    serde_json::json!({
        "key": entry.key,
        "algorithm": entry.algorithm,
        "requests_per_window": entry.requests_per_window,
        "window_ms": entry.window_ms,
        "capacity_tokens": entry.capacity_tokens,
        "totals_since_ms": entry.totals_since_ms,
        "granted_tokens": entry.granted_tokens,
        "charged_tokens": entry.charged_tokens,
        "returned_tokens": entry.returned_tokens,
        "debt_tokens": entry.debt_tokens,
        "last_used_ms": entry.last_used_ms,
        "leases": leases,
    })
}

/// One lease result as a line: what was granted and until when, or why not.
fn describe_lease(result: &proto::LeaseResult) -> String {
    if !result.error.is_empty() {
        return format!("{}: refused: {}", result.key, result.error);
    }
    if result.granted_tokens == 0 {
        return format!(
            "{}: no tokens; {} left, retry after {} ms",
            result.key, result.remaining_tokens, result.retry_after_ms
        );
    }
    let expires = result
        .lease_expires_at_ms
        .map_or_else(|| "-".to_owned(), crate::core::rfc3339::format_epoch_ms);
    format!(
        "{}: granted {} token(s), {} left in the ledger, lease expires at {expires}",
        result.key, result.granted_tokens, result.remaining_tokens
    )
}

/// After `add-node`: waits until the new node has applied every entry the leader's log had
/// when the change returned, within what is left of `--timeout-ms`. The change itself waits
/// for the learner to catch up before promoting it, but writes go on meanwhile. Only the
/// node knows what it has applied, so when its admin address is among `--admin-addr` its own
/// status is watched; otherwise the leader's view, the entries it holds, has to do (it
/// applies them once the next heartbeat tells it they are committed). Returns the index
/// waited for.
async fn wait_caught_up(
    client: &mut AdminClient<Channel>,
    target: &Target,
    node_id: u64,
    started: tokio::time::Instant,
) -> anyhow::Result<Option<u64>> {
    let deadline = started + Duration::from_millis(target.timeout_ms);
    let wanted = node_status(client, target).await?.last_log_index;
    let mut newcomer = node_client(target, node_id).await;
    loop {
        let (reached, what) = match &mut newcomer {
            Some(newcomer) => (node_status(newcomer, target).await?.applied_index, "applied"),
            None => {
                let status = node_status(client, target).await?;
                let follower = status.followers.iter().find(|lag| lag.node_id == node_id);
                (follower.and_then(|lag| lag.matched_index), "holds")
            }
        };
        if reached >= wanted {
            return Ok(wanted);
        }
        if tokio::time::Instant::now() >= deadline {
            bail!(
                "node {node_id} was added but has not caught up within {} ms: it {what} entries \
                 up to {}, the leader had {}; see `quotamesh cluster status`",
                target.timeout_ms,
                index(reached),
                index(wanted),
            );
        }
        tokio::time::sleep(LEADER_POLL).await;
    }
}

/// The client of the node `node_id` among `--admin-addr`, if one of them answers as it.
async fn node_client(target: &Target, node_id: u64) -> Option<AdminClient<Channel>> {
    for address in &target.admin_addrs {
        let Ok(mut client) = connect(address, target).await else { continue };
        if node_status(&mut client, target).await.is_ok_and(|status| status.node_id == node_id) {
            return Some(client);
        }
    }
    None
}

/// One node's status through `client`.
async fn node_status(
    client: &mut AdminClient<Channel>,
    target: &Target,
) -> anyhow::Result<proto::StatusReply> {
    Ok(client
        .status(with_deadline(proto::StatusRequest {}, target))
        .await
        .map_err(rpc_error)?
        .into_inner())
}

/// A refused call as its gRPC code and the node's message, which says why.
pub(crate) fn rpc_error(status: tonic::Status) -> anyhow::Error {
    anyhow::anyhow!("{:?}: {}", status.code(), status.message())
}

/// A refused membership change, naming the group it was for.
fn group_error(group: proto::Group, status: tonic::Status) -> anyhow::Error {
    anyhow::anyhow!("{} group: {:?}: {}", group_name(group), status.code(), status.message())
}

pub(crate) fn with_deadline<T>(message: T, target: &Target) -> tonic::Request<T> {
    let mut request = tonic::Request::new(message);
    request.set_timeout(Duration::from_millis(target.timeout_ms));
    if let Some(token) = &target.token {
        request.metadata_mut().insert("authorization", token.clone());
    }
    request
}

pub(crate) fn first_address(target: &Target) -> anyhow::Result<&str> {
    target.admin_addrs.first().map(String::as_str).context("no --admin-addr given")
}

pub(crate) async fn connect(
    address: &str,
    target: &Target,
) -> anyhow::Result<AdminClient<Channel>> {
    let scheme = if target.ca_cert.is_some() { "https" } else { "http" };
    let url =
        if address.contains("://") { address.to_owned() } else { format!("{scheme}://{address}") };
    let mut endpoint = tonic::transport::Endpoint::from_shared(url)
        .with_context(|| format!("invalid admin address {address:?}"))?
        .connect_timeout(CONNECT_TIMEOUT)
        .timeout(Duration::from_millis(target.timeout_ms));
    if let Some(ca) = &target.ca_cert {
        let identity = target.client_cert.as_deref().zip(target.client_key.as_deref());
        endpoint =
            endpoint.tls_config(crate::cli::billing::client_tls(Some(ca), identity, None)?)?;
    }
    let channel = endpoint
        .connect()
        .await
        .with_context(|| format!("cannot connect to the admin API at {address}"))?;
    Ok(AdminClient::new(channel)
        .max_decoding_message_size(crate::api::admin::ADMIN_MESSAGE_BYTES_MAX)
        .max_encoding_message_size(crate::api::admin::ADMIN_MESSAGE_BYTES_MAX))
}

/// The client of the node that leads `group` among the given ones.
async fn leader(target: &Target, group: proto::Group) -> anyhow::Result<AdminClient<Channel>> {
    if let [only] = target.admin_addrs.as_slice() {
        // One address: send it there; a follower answers with the leader's name.
        return connect(only, target).await;
    }
    let mut seen = Vec::new();
    for address in &target.admin_addrs {
        let reply = async {
            let mut client = connect(address, target).await?;
            let status = client
                .status(with_deadline(proto::StatusRequest {}, target))
                .await
                .map_err(rpc_error)?
                .into_inner();
            anyhow::Ok((client, status))
        }
        .await;
        let view = reply.map(|(client, status)| {
            let (state, leader) = match group {
                proto::Group::Quota => (status.state.clone(), status.leader_id),
                proto::Group::Billing => status.billing.as_ref().map_or_else(
                    || ("no billing group".to_owned(), None),
                    |billing| (billing.state.clone(), billing.leader_id),
                ),
            };
            (client, status, state, leader)
        });
        match view {
            Ok((client, _, state, _)) if state == "Leader" => return Ok(client),
            Ok((_, status, _, _)) if status.role == "gateway" => seen.push(format!(
                "{address}: node {} is a gateway, no member of the group (last leader it \
                 reached: {})",
                status.node_id,
                index(status.cached_leader_id)
            )),
            Ok((_, status, state, leader)) => seen.push(format!(
                "{address}: node {} is {state} (leader: {})",
                status.node_id,
                leader.map_or_else(|| "none".to_owned(), |id| id.to_string())
            )),
            Err(error) => seen.push(format!("{address}: {error:#}")),
        }
    }
    bail!(
        "no node among the given admin addresses leads the {} group:\n  {}",
        group_name(group),
        seen.join("\n  ")
    )
}

async fn init(target: &Target) -> anyhow::Result<()> {
    let address = first_address(target)?;
    let mut client = connect(address, target).await?;
    let reply = client
        .init(with_deadline(proto::InitRequest {}, target))
        .await
        .map_err(rpc_error)?
        .into_inner();
    if !target.json {
        eprintln!("quota group formed; waiting for a leader...");
    }
    let deadline = tokio::time::Instant::now() + Duration::from_millis(target.timeout_ms);
    loop {
        let status = node_status(&mut client, target).await?;
        if let Some(leader) = status.leader_id {
            if target.json {
                let answer = serde_json::json!({
                    "leader_id": leader,
                    "term": status.term,
                    "members": members_json(&reply.members),
                });
                println!("{}", serde_json::to_string_pretty(&answer)?);
            } else {
                println!("leader: node {leader}, term {}", status.term);
                print_member_lines(&reply.members);
            }
            return Ok(());
        }
        if tokio::time::Instant::now() >= deadline {
            bail!("the group was formed but no leader was elected within {} ms", target.timeout_ms);
        }
        tokio::time::sleep(LEADER_POLL).await;
    }
}

/// `cluster regions`: each node's `Regions` answer, as JSON or one line per slice and per
/// transfer. Fails when no node answered.
async fn regions(target: &Target) -> anyhow::Result<()> {
    let mut answers = Vec::new();
    for address in &target.admin_addrs {
        let reply = async {
            let mut client = connect(address, target).await?;
            let request = with_deadline(proto::RegionsRequest {}, target);
            anyhow::Ok(client.regions(request).await.map_err(rpc_error)?.into_inner())
        }
        .await;
        answers.push((address.clone(), reply.map_err(|error| format!("{error:#}"))));
    }
    if target.json {
        let nodes: Vec<serde_json::Value> = answers
            .iter()
            .map(|(address, answer)| match answer {
                Ok(reply) => regions_json(address, reply),
                Err(error) => serde_json::json!({"admin_addr": address, "error": error}),
            })
            .collect();
        println!("{}", serde_json::to_string_pretty(&serde_json::json!({ "nodes": nodes }))?);
    } else {
        for (address, answer) in &answers {
            match answer {
                Ok(reply) => print_regions(address, reply),
                Err(error) => println!("{address}: {error}"),
            }
        }
    }
    if answers.iter().all(|(_, answer)| answer.is_err()) {
        bail!("no node answered");
    }
    Ok(())
}

fn regions_json(address: &str, reply: &proto::RegionsReply) -> serde_json::Value {
    let slices: Vec<serde_json::Value> = reply
        .slices
        .iter()
        .map(|slice| {
            serde_json::json!({
                "rule": slice.rule,
                "global_tokens": slice.global_tokens,
                "slice_tokens": slice.slice_tokens,
                "policy_tokens": slice.policy_tokens,
                "demand_tokens": slice.demand_tokens,
                "in_flight_tokens": slice.in_flight_tokens,
                "peer_slice_tokens": slice.peer_slice_tokens.iter().collect::<BTreeMap<_, _>>(),
            })
        })
        .collect();
    let transfers: Vec<serde_json::Value> = reply
        .transfers
        .iter()
        .map(|transfer| {
            serde_json::json!({
                "serial": transfer.serial,
                "rule": transfer.rule,
                "recipient": transfer.recipient,
                "tokens": transfer.tokens,
                "debited_at_ms": transfer.debited_at_ms,
            })
        })
        .collect();
    let credited: Vec<serde_json::Value> = reply
        .credited
        .iter()
        .map(|credited| serde_json::json!({"donor": credited.donor, "serial": credited.serial}))
        .collect();
    serde_json::json!({
        "admin_addr": address,
        "region": reply.region,
        "applied_index": reply.applied_index,
        "slices": slices,
        "transfers": transfers,
        "credited": credited,
        "truncated": reply.truncated,
    })
}

fn print_regions(address: &str, reply: &proto::RegionsReply) {
    println!("region {} (node at {address}): {} sliced limit(s)", reply.region, reply.slices.len());
    let known = |tokens: Option<u64>| tokens.map_or_else(|| "-".to_owned(), |t| t.to_string());
    for slice in &reply.slices {
        let peers: Vec<String> = slice
            .peer_slice_tokens
            .iter()
            .collect::<BTreeMap<_, _>>()
            .into_iter()
            .map(|(peer, tokens)| format!("{peer} {tokens}"))
            .collect();
        println!(
            "  {}: slice {} of {} (policy {}), demand {}, in flight {}, peers: {}",
            slice.rule,
            slice.slice_tokens,
            slice.global_tokens,
            known(slice.policy_tokens),
            known(slice.demand_tokens),
            slice.in_flight_tokens,
            if peers.is_empty() { "-".to_owned() } else { peers.join(", ") },
        );
    }
    if reply.truncated {
        println!("  (more slices not listed)");
    }
    for transfer in &reply.transfers {
        println!(
            "  transfer {}/{}: {} token(s) of {} to {}, debited at {}",
            reply.region,
            transfer.serial,
            transfer.tokens,
            transfer.rule,
            transfer.recipient,
            crate::core::rfc3339::format_epoch_ms(transfer.debited_at_ms)
        );
    }
}

async fn status(target: &Target) -> anyhow::Result<()> {
    let mut views = Vec::new();
    let mut failures = 0usize;
    for address in &target.admin_addrs {
        let reply = async {
            let mut client = connect(address, target).await?;
            let status = client
                .status(with_deadline(proto::StatusRequest {}, target))
                .await
                .map_err(rpc_error)?
                .into_inner();
            anyhow::Ok(status)
        }
        .await;
        match reply {
            Ok(status) => views.push((address.clone(), Ok(status))),
            Err(error) => {
                failures += 1;
                views.push((address.clone(), Err(format!("{error:#}"))));
            }
        }
    }
    if target.json {
        let nodes: Vec<serde_json::Value> = views
            .iter()
            .map(|(address, view)| match view {
                Ok(status) => status_json(address, status),
                Err(error) => serde_json::json!({"admin_addr": address, "error": error}),
            })
            .collect();
        println!("{}", serde_json::to_string_pretty(&serde_json::json!({ "nodes": nodes }))?);
    } else {
        for (address, view) in &views {
            match view {
                Ok(status) => print_status(address, status),
                Err(error) => println!("{address}: unreachable: {error}\n"),
            }
        }
    }
    if failures == views.len() {
        bail!("no node answered");
    }
    Ok(())
}

fn members_json(members: &[proto::Member]) -> serde_json::Value {
    members
        .iter()
        .map(|member| {
            serde_json::json!({
                "node_id": member.node_id,
                "raft_addr": member.raft_addr,
                "voter": member.voter,
            })
        })
        .collect()
}

fn status_json(address: &str, status: &proto::StatusReply) -> serde_json::Value {
    let followers: Vec<serde_json::Value> = status
        .followers
        .iter()
        .map(|lag| {
            serde_json::json!({
                "node_id": lag.node_id,
                "matched_index": lag.matched_index,
                "lag_entries": lag.lag_entries,
            })
        })
        .collect();
    let outstanding: serde_json::Map<String, serde_json::Value> = status
        .outstanding_tokens
        .iter()
        .map(|tokens| (tokens.node_id.to_string(), tokens.tokens.into()))
        .collect();
    serde_json::json!({
        "admin_addr": address,
        "node_id": status.node_id,
        "node_name": status.node_name,
        "policy_version": status.policy_version,
        "policy_source": status.policy_source,
        "policy_digest": format!("{:016x}", status.policy_digest),
        "region_policy_version": status.region_policy_version,
        "cluster_id": status.cluster_id,
        "raft_addr": status.raft_addr,
        "state": status.state,
        "leader_id": status.leader_id,
        "term": status.term,
        "last_log_index": status.last_log_index,
        "commit_index": status.commit_index,
        "applied_index": status.applied_index,
        "snapshot_index": status.snapshot_index,
        "purged_index": status.purged_index,
        "members": members_json(&status.members),
        "followers": followers,
        "state_digest": format!("{:016x}", status.state_digest),
        "ledger_keys": status.ledger_keys,
        "outstanding_tokens": outstanding,
        "ledger_time_ms": status.ledger_time_ms,
        "millis_since_quorum_ack": status.millis_since_quorum_ack,
        "role": status.role,
        "cached_leader_id": status.cached_leader_id,
        "seeds": members_json(&status.seeds),
        "clock_offsets": clock_offsets_json(status),
        "max_clock_offset_ms": status.max_clock_offset_ms,
        "billing": status.billing.as_ref().map(|billing| serde_json::json!({
            "state": billing.state,
            "leader_id": billing.leader_id,
            "term": billing.term,
            "last_log_index": billing.last_log_index,
            "commit_index": billing.commit_index,
            "applied_index": billing.applied_index,
            "members": members_json(&billing.members),
            "state_digest": format!("{:016x}", billing.state_digest),
        })),
    })
}

fn clock_offsets_json(status: &proto::StatusReply) -> serde_json::Value {
    status
        .clock_offsets
        .iter()
        .map(|seen| {
            serde_json::json!({
                "node_id": seen.node_id,
                "offset_ms": seen.offset_ms,
                "exceeded_total": seen.exceeded_total,
                "exceeded": seen.offset_ms.unsigned_abs() > status.max_clock_offset_ms,
            })
        })
        .collect()
}

fn index(value: Option<u64>) -> String {
    value.map_or_else(|| "-".to_owned(), |index| index.to_string())
}

/// What policy the node serves: its version and source, and the region's latest version
/// when the node serves its own files (drift).
fn policy_line(status: &proto::StatusReply) -> String {
    let digest = format!("{:016x}", status.policy_digest);
    if status.policy_source == "replicated" {
        format!("policy version {} (replicated), digest {digest}", status.policy_version)
    } else {
        format!(
            "policy {} (local files or the embedded default), digest {digest}; the region's \
             latest version: {}",
            if status.policy_source.is_empty() { "local" } else { status.policy_source.as_str() },
            status.region_policy_version
        )
    }
}

fn print_status(address: &str, status: &proto::StatusReply) {
    // A node older than the role field answers without it: it can only be a voter.
    let role = if status.role.is_empty() { "voter" } else { status.role.as_str() };
    if role == "gateway" {
        println!(
            "node {} ({}) at {address}, cluster {}: gateway (leases only, no replica), last \
             leader reached {}",
            status.node_id,
            status.node_name,
            status.cluster_id,
            index(status.cached_leader_id)
        );
        let seeds: Vec<String> = status
            .seeds
            .iter()
            .map(|seed| format!("{} at {}", seed.node_id, seed.raft_addr))
            .collect();
        println!("  writes through the voters {}", seeds.join(", "));
        println!("  {}", policy_line(status));
        println!();
        return;
    }
    println!(
        "node {} ({}) at {address}, cluster {}, {role}: {}, leader {}, term {}",
        status.node_id,
        status.node_name,
        status.cluster_id,
        status.state,
        index(status.leader_id),
        status.term
    );
    println!(
        "  log {}  committed {}  applied {}  snapshot {}  purged {}",
        index(status.last_log_index),
        index(status.commit_index),
        index(status.applied_index),
        index(status.snapshot_index),
        index(status.purged_index)
    );
    println!(
        "  ledger: {} keys, digest {:016x}, time {}",
        status.ledger_keys,
        status.state_digest,
        crate::core::rfc3339::format_epoch_ms(status.ledger_time_ms)
    );
    println!("  {}", policy_line(status));
    print_member_lines(&status.members);
    if let Some(billing) = &status.billing {
        println!(
            "  billing group: {}, leader {}, term {}, committed {}, applied {}, digest {:016x}",
            billing.state,
            index(billing.leader_id),
            billing.term,
            index(billing.commit_index),
            index(billing.applied_index),
            billing.state_digest
        );
        for member in &billing.members {
            let role = if member.voter { "voter" } else { "learner" };
            println!("    member {} {role} at {}", member.node_id, member.raft_addr);
        }
    }
    for lag in &status.followers {
        println!(
            "  follower {}: matched {}, {} entries behind",
            lag.node_id,
            index(lag.matched_index),
            lag.lag_entries
        );
    }
    for seen in &status.clock_offsets {
        let verdict = if seen.offset_ms.unsigned_abs() > status.max_clock_offset_ms {
            "CLOCK OFF: its writes are stamped with the leader's time; check its NTP"
        } else {
            "within bounds"
        };
        println!(
            "  clock of node {}: {:+} ms from this node's, {} writes past {} ms ({verdict})",
            seen.node_id, seen.offset_ms, seen.exceeded_total, status.max_clock_offset_ms
        );
    }
    println!();
}

fn print_member_lines(members: &[proto::Member]) {
    for member in members {
        let role = if member.voter { "voter" } else { "learner" };
        println!("  member {} {role} at {}", member.node_id, member.raft_addr);
    }
}

/// A membership change's result in one group: the members after it (`None`: the node had
/// left the group before), and for an added node the log index it caught up to.
type Changed = (proto::Group, Option<proto::MembershipReply>, Option<u64>);

fn print_members(target: &Target, what: &str, changed: &[Changed]) -> anyhow::Result<()> {
    if target.json {
        let groups: serde_json::Map<String, serde_json::Value> = changed
            .iter()
            .map(|(group, reply, caught_up)| {
                let members = reply.as_ref().map(|reply| members_json(&reply.members));
                let mut view = serde_json::json!({ "members": members });
                if let Some(index) = caught_up {
                    view["caught_up_index"] = (*index).into();
                }
                (group_name(*group).to_owned(), view)
            })
            .collect();
        println!("{}", serde_json::to_string_pretty(&serde_json::json!({ "groups": groups }))?);
    } else {
        for (group, reply, caught_up) in changed {
            match reply {
                Some(reply) => {
                    println!("{} group: {what}; members now:", group_name(*group));
                    print_member_lines(&reply.members);
                    if let Some(index) = caught_up {
                        println!("  caught up to log index {index}");
                    }
                }
                None => println!("{} group: not a member (removed before)", group_name(*group)),
            }
        }
    }
    Ok(())
}
