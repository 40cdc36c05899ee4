//! The admin gRPC service (`quotamesh.admin.v1.Admin`, default port 8083): forms the region's
//! quota group, changes the membership of its quota and billing groups, reports their
//! status, and takes lease grants by hand.
//!
//! ```text
//!  quotamesh cluster ... ──gRPC──▶ AdminService ──▶ RaftGroup<QuotaGroup> (crate::ledger)
//!                                       │    └─────▶ RaftGroup<BillingGroup>: AddNode,
//!                                       │            RemoveNode with group = BILLING, Status
//!                                       │ AcquireLeases: validate every item, resolve its
//!                                       │ rule in the node's policy, then ONE AcquireLeases
//!                                       ▼ command, forwarded to the leader by the group
//!                                  policy (ArcSwap)
//! ```
//!
//! A membership change names one group and runs on that group's leader: adding a node makes
//! it a learner, waits until it has caught up with the log (a snapshot transfer if need be),
//! then makes it a voter through joint consensus; removing one refuses the group's last
//! voter. The two groups elect their leaders apart, so `quotamesh cluster` sends each group's
//! change to its own leader (`crate::cli::cluster`).
//!
//! On a gateway (`role = "gateway"`, no member of the group) the membership calls and
//! `ReadKeys` are refused (it has no membership to change and no replica to read), `Status`
//! reports the role, the leader its writes last reached and the voters it writes through,
//! and `AcquireLeases` works as anywhere: the group sends the command to the leader.
//!
//! The region's policy set (`ApplyPolicy`, `GetPolicy`, `PolicyHistory`, `RollbackPolicy`):
//! an apply is validated here exactly as `quotamesh policy validate` validates (errors with
//! file:line:column; a bad set proposes nothing), then committed through the quota group with
//! the digest computed here and the operator's name; the ledger numbers the versions
//! (`crate::core::policy_versions`). Every node then swaps it in (`crate::policy_follow`).
//!
//! `Regions` shows the region's slices of global limits and unsettled transfers from the
//! ledger as applied here, with what the rebalancer (`crate::actors::rebalancer`) measured.
//!
//! Every call needs an operator token (`crate::api::operators`): the ones that change the
//! group or the ledger (`Init`, `AddNode`, `RemoveNode`, `AcquireLeases`, `ApplyPolicy`,
//! `RollbackPolicy`) a full one, the reads (`Status`, `ReadKeys`, `GetPolicy`,
//! `PolicyHistory`, `Regions`) any, or none with `admin.read_open`. With `admin.tls` the
//! port is TLS and an operator certificate counts as a full token. Changes are logged with
//! the operator's name.
//!
//! Every call is bounded by the caller's gRPC deadline, capped at [`ADMIN_DEADLINE_MAX`]
//! (default [`ADMIN_DEADLINE_DEFAULT`]). Bad input is refused before anything is proposed, so
//! it changes nothing, not even ledger time. Errors become statuses in `crate::api::status`.

use std::collections::BTreeMap;
use std::sync::Arc;
use std::time::Duration;

use arc_swap::ArcSwap;
use tonic::{Request, Response, Status};

use crate::actors::rebalancer::RegionBoard;
use crate::api::grpc_limits::{self, Bounded};
use crate::api::operators::{Access, Operator, Operators};
use crate::api::proto::quotamesh::admin::v1 as proto;
use crate::api::proto::quotamesh::admin::v1::admin_server::{Admin, AdminServer};
use crate::config::Role;
use crate::core::lease_key::LeaseKey;
use crate::core::ledger::{
    KEY_BYTES_MAX, LEASE_REQUESTS_PER_COMMAND_MAX, LEASE_TOKENS_MAX, LEASE_TTL_MS_MAX,
    LeaseRequest, QuotaCommand, QuotaLedger, QuotaResponse, check_lease_request,
};
use crate::core::policy::{DESCRIPTOR_DEPTH_MAX, Entry, Match, PolicySet, PolicySource};
use crate::core::policy_versions::{
    POLICY_FILE_NAME_BYTES_MAX, POLICY_FILES_MAX, POLICY_SET_BYTES_MAX, PolicyApplied,
    PolicyAuthor, PolicySetError, PolicyVersionInfo, check_files,
};
use crate::core::region::transfer::SliceKey;
use crate::ledger::{
    BasicNode, BillingGroup, GroupConfig, GroupMachine, MembershipError, NodeId, QuotaGroup,
    RaftGroup,
};
use crate::policy_store::PolicyStore;

/// Deadline of a call that sent none.
pub const ADMIN_DEADLINE_DEFAULT: Duration = Duration::from_secs(10);
/// Longest any call may run, whatever deadline it sent: adding a node waits until it has
/// caught up, which may take a snapshot transfer.
pub const ADMIN_DEADLINE_MAX: Duration = Duration::from_secs(120);
/// Largest admin message either way: a full batch of lease requests with the longest keys.
pub const ADMIN_MESSAGE_BYTES_MAX: usize = 4 * 1024 * 1024;
/// Most calls served at once on one connection (a benchmark keeps a few dozen in flight).
pub const ADMIN_CONCURRENT_REQUESTS_PER_CONNECTION_MAX: usize = 256;
/// Lease TTL of a request that names none (the design's default: at most 1 s).
pub const LEASE_TTL_MS_DEFAULT: u64 = 1_000;
/// Most keys one `ReadKeys` call may ask for.
pub const READ_KEYS_MAX: usize = LEASE_REQUESTS_PER_COMMAND_MAX;
/// Most slices one `Regions` reply lists (a reply stays well under a MiB).
pub const REGION_SLICES_LISTED_MAX: usize = 512;
/// Longest domain, entry key or entry value in a lease request: the RLS path's bound, so
/// every descriptor the RLS path leases for can be granted by hand too (the ledger key is a
/// fixed-length digest whatever the descriptor's length).
const FIELD_BYTES_MAX: usize = crate::api::rls::FIELD_BYTES_MAX;

/// Versions `PolicyHistory` returns when the caller names no limit.
pub const POLICY_HISTORY_LIMIT_DEFAULT: u32 = 100;
/// Most versions one `PolicyHistory` answer holds (each up to about 1.5 KiB of metadata).
pub const POLICY_HISTORY_LIMIT_MAX: u32 = 1_000;

const _: () = assert!(LEASE_TTL_MS_DEFAULT <= LEASE_TTL_MS_MAX);
// A full policy set, with its framing, fits one admin message both ways.
const _: () = assert!(
    POLICY_SET_BYTES_MAX + POLICY_FILES_MAX * (POLICY_FILE_NAME_BYTES_MAX + 16) + 64 * 1024
        <= ADMIN_MESSAGE_BYTES_MAX
);
const _: () = assert!(POLICY_HISTORY_LIMIT_DEFAULT <= POLICY_HISTORY_LIMIT_MAX);
const _: () = assert!((POLICY_HISTORY_LIMIT_MAX as usize) * 2048 <= ADMIN_MESSAGE_BYTES_MAX);
const _: () =
    assert!(LEASE_REQUESTS_PER_COMMAND_MAX * (KEY_BYTES_MAX + 64) < ADMIN_MESSAGE_BYTES_MAX);

/// What the admin service knows of its node.
#[derive(Debug, Clone)]
pub struct AdminNode {
    /// The node's name (`node_id` in its configuration).
    pub name: String,
    /// Its Raft id; leases granted through it are held by it.
    pub raft_node_id: NodeId,
    /// A voter of the group, or a gateway outside it.
    pub role: Role,
    /// Its cluster.
    pub cluster_id: String,
    /// The Raft address the other nodes reach it at.
    pub advertise_addr: String,
    /// The configured voters: the members `Init` forms the group from, or a gateway's seeds.
    pub peers: BTreeMap<NodeId, BasicNode>,
}

/// The admin service of one node; cheap to clone.
#[derive(Clone)]
pub struct AdminService {
    node: Arc<AdminNode>,
    quota: RaftGroup<QuotaGroup>,
    billing: Option<RaftGroup<BillingGroup>>,
    policy: Arc<ArcSwap<PolicySet>>,
    /// The node's policy store: the options an applied set is validated with, and what the
    /// node serves (`Status`).
    policy_store: Arc<PolicyStore>,
    operators: Arc<Operators>,
    /// This node's region, and what its rebalancer measured (`Regions`).
    regions: (String, Arc<RegionBoard>),
}

impl AdminService {
    /// The service over this node's quota group and billing group (`None` on a gateway),
    /// resolving rules in the policy `policy_store` serves, serving the callers `operators`
    /// lets in.
    pub fn new(
        node: AdminNode,
        quota: RaftGroup<QuotaGroup>,
        billing: Option<RaftGroup<BillingGroup>>,
        policy_store: Arc<PolicyStore>,
        operators: Operators,
    ) -> Self {
        Self {
            node: Arc::new(node),
            quota,
            billing,
            policy: policy_store.active(),
            policy_store,
            operators: Arc::new(operators),
            regions: (String::new(), Arc::new(RegionBoard::default())),
        }
    }

    /// Answers `Regions` for `region`, with what the rebalancer shows on `board`.
    #[must_use]
    pub fn with_regions(mut self, region: &str, board: Arc<RegionBoard>) -> Self {
        self.regions = (region.to_owned(), board);
        self
    }

    /// Checks the caller's token for `access`; logs who asks for a change. Returns the
    /// operator (`None` for an open read without a token).
    fn authorize<T>(
        &self,
        request: &Request<T>,
        access: Access,
        call: &str,
    ) -> Result<Option<Arc<Operator>>, Status> {
        let certificate = request
            .extensions()
            .get::<crate::tls::transport::PeerInfo>()
            .and_then(|info| info.identity.as_deref());
        let authorized = self.operators.authorize(request.metadata(), certificate, access);
        let operator = authorized.map_err(|error| {
            tracing::warn!(call, remote = ?request.remote_addr(), %error, "admin call refused");
            Status::from(error)
        })?;
        if access == Access::Change
            && let Some(operator) = &operator
        {
            tracing::info!(call, operator = %operator.name, "admin change requested");
        }
        Ok(operator)
    }

    /// Commits a policy command and answers with what it did.
    async fn write_policy(
        &self,
        command: QuotaCommand,
        budget: Duration,
    ) -> Result<Response<proto::PolicyReply>, Status> {
        let response = self.quota.write(command, budget).await.map_err(Status::from)?;
        match response {
            QuotaResponse::PolicySet(Ok(PolicyApplied { version, digest, created })) => {
                tracing::info!(version, created, "policy set committed");
                Ok(Response::new(proto::PolicyReply { version, digest, created }))
            }
            QuotaResponse::PolicySet(Err(error)) => Err(policy_set_status(&error)),
            other => Err(Status::internal(format!(
                "the ledger answered a policy command with {other:?}"
            ))),
        }
    }

    /// The tonic service with the message size limits set both ways.
    pub fn into_server(self) -> AdminServer<Self> {
        AdminServer::new(self)
            .max_decoding_message_size(ADMIN_MESSAGE_BYTES_MAX)
            .max_encoding_message_size(ADMIN_MESSAGE_BYTES_MAX)
    }

    /// Serves the admin API on `listener` until `shutdown` completes: over TLS with `tls`
    /// (client certificates optional; an operator's counts as a token), else plaintext.
    ///
    /// # Errors
    /// The transport error that stopped the server.
    pub async fn serve(
        self,
        listener: tokio::net::TcpListener,
        tls: Option<Arc<rustls::ServerConfig>>,
        grpc_metrics: crate::api::grpc_metrics::GrpcMetricsLayer,
        shutdown: impl Future<Output = ()> + Send,
    ) -> Result<(), tonic::transport::Error> {
        let router = tonic::transport::Server::builder()
            .layer(grpc_metrics)
            // A backstop: each handler bounds its own work by the caller's deadline.
            .timeout(ADMIN_DEADLINE_MAX + Duration::from_secs(5))
            .concurrency_limit_per_connection(ADMIN_CONCURRENT_REQUESTS_PER_CONNECTION_MAX)
            .http2_max_header_list_size(grpc_limits::HEADER_LIST_BYTES_MAX)
            .add_service(Bounded::new(self.into_server()));
        match tls {
            Some(tls) => {
                let incoming = crate::tls::transport::incoming(listener, tls);
                router.serve_with_incoming_shutdown(incoming, shutdown).await
            }
            None => {
                let incoming =
                    tonic::transport::server::TcpIncoming::from(listener).with_nodelay(Some(true));
                router.serve_with_incoming_shutdown(incoming, shutdown).await
            }
        }
    }

    fn members(&self) -> Vec<proto::Member> {
        members_of(&self.quota)
    }

    /// The billing group, or why this node has none (a gateway).
    fn billing(&self) -> Result<&RaftGroup<BillingGroup>, Status> {
        self.refuse_on_gateway("change the billing group")?;
        self.billing.as_ref().ok_or_else(|| {
            Status::failed_precondition(format!(
                "node {} runs no billing group",
                self.node.raft_node_id
            ))
        })
    }

    /// Refuses a call that needs a member of the group (a replica, a membership) on a gateway.
    fn refuse_on_gateway(&self, what: &str) -> Result<(), Status> {
        if self.node.role != Role::Gateway {
            return Ok(());
        }
        Err(Status::failed_precondition(format!(
            "node {} is a gateway: it is no member of the quota group and holds no replica of \
             its ledger, so it cannot {what}; send it to a voter's admin address",
            self.node.raft_node_id
        )))
    }

    /// A membership error as a status (`crate::api::status`).
    fn membership_status(&self, error: MembershipError) -> Status {
        membership_status_of(&self.quota, error)
    }

    /// Checks every item, resolves its rule, and builds the ledger's lease requests.
    fn lease_requests(
        &self,
        request: &proto::AcquireLeasesRequest,
    ) -> Result<(Vec<u32>, Vec<LeaseRequest>), Status> {
        if request.leases.is_empty() {
            return Err(Status::invalid_argument("no leases requested"));
        }
        if request.leases.len() > LEASE_REQUESTS_PER_COMMAND_MAX {
            return Err(Status::invalid_argument(format!(
                "{} leases requested in one call; at most {LEASE_REQUESTS_PER_COMMAND_MAX}",
                request.leases.len()
            )));
        }
        let lease_ttl_ms = match request.lease_ttl_ms {
            0 => LEASE_TTL_MS_DEFAULT,
            ttl if ttl > LEASE_TTL_MS_MAX => {
                return Err(Status::invalid_argument(format!(
                    "lease_ttl_ms must be at most {LEASE_TTL_MS_MAX}, got {ttl}"
                )));
            }
            ttl => ttl,
        };
        let policy = self.policy.load();
        let mut items = Vec::with_capacity(request.leases.len());
        let mut requests = Vec::with_capacity(request.leases.len());
        for (index, wanted) in request.leases.iter().enumerate() {
            let item = u32::try_from(index).expect("bounded by LEASE_REQUESTS_PER_COMMAND_MAX");
            let refuse =
                |reason: String| Status::invalid_argument(format!("item {index}: {reason}"));
            check_wanted(wanted).map_err(refuse)?;
            let entries: Vec<Entry<'_>> = wanted
                .entries
                .iter()
                .map(|entry| Entry { key: &entry.key, value: &entry.value })
                .collect();
            let rule = match policy.match_descriptor(&wanted.domain, &entries) {
                Match::DomainNotFound => {
                    return Err(Status::not_found(format!(
                        "item {index}: no policy for domain {:?}",
                        wanted.domain
                    )));
                }
                Match::NoRule => {
                    return Err(Status::not_found(format!(
                        "item {index}: no rule of domain {:?} matches the descriptor {}",
                        wanted.domain,
                        descriptor_path(&wanted.entries)
                    )));
                }
                Match::Rule(rule) if rule.limits.is_empty() => {
                    return Err(Status::not_found(format!(
                        "item {index}: rule {:?} of domain {:?} has no limit: nothing to lease",
                        rule.path, wanted.domain
                    )));
                }
                Match::Rule(rule) => rule,
            };
            for (limit_index, limit) in rule.limits.iter().enumerate() {
                // The key the RLS path leases under, so a grant by hand lands on the same bucket.
                let pairs =
                    wanted.entries.iter().map(|entry| (entry.key.as_str(), entry.value.as_str()));
                let key = LeaseKey::of(&wanted.domain, pairs, limit_index, &limit.policy_spec)
                    .ledger_key();
                let lease = LeaseRequest {
                    key,
                    limit: limit.spec,
                    tokens_wanted: wanted.tokens_wanted,
                    lease_ttl_ms,
                };
                check_lease_request(&lease).map_err(|error| refuse(error.to_string()))?;
                items.push(item);
                requests.push(lease);
            }
        }
        if requests.len() > LEASE_REQUESTS_PER_COMMAND_MAX {
            return Err(Status::invalid_argument(format!(
                "the items' rules need {} lease requests; at most {LEASE_REQUESTS_PER_COMMAND_MAX} \
                 fit in one command",
                requests.len()
            )));
        }
        Ok((items, requests))
    }
}

/// The group a membership call names.
fn group_of(group: i32) -> Result<proto::Group, Status> {
    proto::Group::try_from(group).map_err(|_| {
        Status::invalid_argument(format!(
            "unknown group {group}: {} (quota) or {} (billing)",
            proto::Group::Quota as i32,
            proto::Group::Billing as i32
        ))
    })
}

/// A group's members as this node sees them.
fn members_of<C: GroupConfig>(group: &RaftGroup<C>) -> Vec<proto::Member> {
    let metrics = group.metrics();
    let membership = metrics.membership_config.membership();
    let voters: std::collections::BTreeSet<NodeId> = membership.voter_ids().collect();
    membership
        .nodes()
        .map(|(id, node)| proto::Member {
            node_id: id.0,
            raft_addr: node.addr.clone(),
            voter: voters.contains(id),
        })
        .collect()
}

/// A membership error as a status, naming the group's leader and its address when this node
/// is not it.
fn membership_status_of<C: GroupConfig>(group: &RaftGroup<C>, error: MembershipError) -> Status {
    if let MembershipError::NotLeader { leader: Some(leader) } = &error {
        let metrics = group.metrics();
        let address = metrics
            .membership_config
            .membership()
            .get_node(leader)
            .map_or_else(|| "unknown address".to_owned(), |node| node.addr.clone());
        return Status::failed_precondition(format!(
            "node {} is not the leader of the {} group; node {leader} is (Raft address \
             {address}): send membership changes to its admin address",
            group.node_id(),
            group.name()
        ));
    }
    crate::api::status::membership_status(error)
}

/// Adds `request`'s node to `group` as a learner, waits until it has caught up, then (unless
/// learner-only) makes it a voter; returns the members after. A voter already at that
/// address is left as it is, so a retry after a lost answer finishes or changes nothing.
async fn add_member<C: GroupConfig>(
    group: &RaftGroup<C>,
    request: &proto::AddNodeRequest,
    budget: Duration,
) -> Result<Vec<proto::Member>, Status> {
    let started = tokio::time::Instant::now();
    let name = group.name();
    let node_id = NodeId(request.node_id);
    let (known, is_voter) = {
        let metrics = group.metrics();
        let membership = metrics.membership_config.membership();
        let known = membership.get_node(&node_id).map(|node| node.addr.clone());
        (known, membership.voter_ids().any(|voter| voter == node_id))
    };
    if let Some(address) = &known
        && *address != request.raft_addr
    {
        return Err(Status::failed_precondition(format!(
            "node {node_id} is a member of the {name} group already, at {address}; remove it \
             first to move it"
        )));
    }
    if is_voter {
        if request.learner_only {
            return Err(Status::failed_precondition(format!(
                "node {node_id} is a voter of the {name} group already; remove it first to make \
                 it a learner"
            )));
        }
        return Ok(members_of(group));
    }
    let learner = group.add_learner(node_id, BasicNode::new(request.raft_addr.clone()));
    tokio::time::timeout(budget, learner)
        .await
        .map_err(|_| {
            Status::deadline_exceeded(format!(
                "node {node_id} may have been added to the {name} group as a learner but has \
                 not caught up in time; run add-node again to finish"
            ))
        })?
        .map_err(|error| membership_status_of(group, error))?;
    tracing::info!(group = name, %node_id, raft_addr = %request.raft_addr, "learner added and caught up");
    if !request.learner_only {
        let remaining = budget.saturating_sub(started.elapsed());
        tokio::time::timeout(remaining, group.promote_voter(node_id))
            .await
            .map_err(|_| {
                Status::deadline_exceeded(format!(
                    "node {node_id} is a learner of the {name} group; making it a voter did not \
                     finish in time (it may still); run add-node again to finish"
                ))
            })?
            .map_err(|error| membership_status_of(group, error))?;
        tracing::info!(group = name, %node_id, "learner promoted to voter");
    }
    Ok(members_of(group))
}

/// Removes `node_id` from `group`'s voters and members; returns the members after. The
/// group's last voter is refused: a group without voters can never commit again.
async fn remove_member<C: GroupConfig>(
    group: &RaftGroup<C>,
    node_id: NodeId,
    budget: Duration,
) -> Result<Vec<proto::Member>, Status> {
    let name = group.name();
    let (member, voters) = {
        let metrics = group.metrics();
        let membership = metrics.membership_config.membership();
        let voters: Vec<NodeId> = membership.voter_ids().collect();
        (membership.get_node(&node_id).is_some(), voters)
    };
    if !member {
        return Err(Status::not_found(format!(
            "node {node_id} is not a member of the {name} group"
        )));
    }
    if voters == [node_id] {
        return Err(Status::failed_precondition(format!(
            "node {node_id} is the only voter of the {name} group; the group cannot lose it"
        )));
    }
    tokio::time::timeout(budget, group.remove_member(node_id))
        .await
        .map_err(|_| {
            Status::deadline_exceeded(format!(
                "removing node {node_id} from the {name} group did not finish in time (it may \
                 still)"
            ))
        })?
        .map_err(|error| membership_status_of(group, error))?;
    tracing::info!(group = name, %node_id, "node removed");
    Ok(members_of(group))
}

/// A group's state as this node sees it, for `Status`.
async fn group_status<C: GroupConfig>(group: &RaftGroup<C>) -> Result<proto::GroupStatus, Status> {
    let commit_index =
        group.committed_index().await.map_err(crate::api::status::membership_status)?;
    let metrics = group.metrics();
    let (state_digest, applied_index) = group.read_at_applied(GroupMachine::digest);
    Ok(proto::GroupStatus {
        state: format!("{:?}", metrics.state),
        leader_id: metrics.current_leader.map(|id| id.0),
        term: metrics.current_term,
        last_log_index: metrics.last_log_index,
        commit_index,
        applied_index,
        members: members_of(group),
        state_digest,
    })
}

/// Checks the fields of one item that need no policy.
fn check_wanted(wanted: &proto::LeaseWanted) -> Result<(), String> {
    if wanted.tokens_wanted == 0 || wanted.tokens_wanted > LEASE_TOKENS_MAX {
        return Err(format!(
            "tokens_wanted must be between 1 and {LEASE_TOKENS_MAX}, got {}",
            wanted.tokens_wanted
        ));
    }
    if wanted.domain.is_empty() || wanted.domain.len() > FIELD_BYTES_MAX {
        return Err(format!("domain must be 1 to {FIELD_BYTES_MAX} bytes"));
    }
    if wanted.entries.is_empty() || wanted.entries.len() > DESCRIPTOR_DEPTH_MAX {
        return Err(format!(
            "a descriptor has 1 to {DESCRIPTOR_DEPTH_MAX} entries, got {}",
            wanted.entries.len()
        ));
    }
    for (position, entry) in wanted.entries.iter().enumerate() {
        if entry.key.is_empty() {
            return Err(format!("entry {position}: key must not be empty"));
        }
        if entry.key.len() > FIELD_BYTES_MAX || entry.value.len() > FIELD_BYTES_MAX {
            return Err(format!(
                "entry {position}: key and value are at most {FIELD_BYTES_MAX} bytes"
            ));
        }
    }
    Ok(())
}

/// `key=value/key=value` for messages.
fn descriptor_path(entries: &[proto::DescriptorEntry]) -> String {
    entries
        .iter()
        .map(|entry| format!("{}={}", entry.key, entry.value))
        .collect::<Vec<_>>()
        .join("/")
}

/// The caller's deadline from its `grpc-timeout` header, capped; the default when absent.
fn deadline<T>(request: &Request<T>) -> Duration {
    let sent = request
        .metadata()
        .get("grpc-timeout")
        .and_then(|value| value.to_str().ok())
        .and_then(parse_grpc_timeout);
    sent.unwrap_or(ADMIN_DEADLINE_DEFAULT).min(ADMIN_DEADLINE_MAX)
}

/// Parses gRPC's `TimeoutValue TimeoutUnit`: up to 8 digits and one of `HMSmun`.
fn parse_grpc_timeout(text: &str) -> Option<Duration> {
    let (digits, unit) = text.split_at_checked(text.len().checked_sub(1)?)?;
    if digits.is_empty() || digits.len() > 8 {
        return None;
    }
    let value: u64 = digits.parse().ok()?;
    Some(match unit {
        "H" => Duration::from_secs(value.saturating_mul(3600)),
        "M" => Duration::from_secs(value.saturating_mul(60)),
        "S" => Duration::from_secs(value),
        "m" => Duration::from_millis(value),
        "u" => Duration::from_micros(value),
        "n" => Duration::from_nanos(value),
        _ => return None,
    })
}

/// The part of a deadline spent on work, leaving room to send the answer before the caller
/// gives up.
fn work_budget(deadline: Duration) -> Duration {
    deadline.mul_f64(0.9)
}

/// The status of a policy command the ledger refused.
fn policy_set_status(error: &PolicySetError) -> Status {
    match error {
        PolicySetError::UnknownVersion(_) => Status::not_found(error.to_string()),
        PolicySetError::ContentDropped(_) => Status::failed_precondition(error.to_string()),
        _ => Status::invalid_argument(error.to_string()),
    }
}

fn version_info(info: &PolicyVersionInfo, files_kept: bool) -> proto::PolicyVersionInfo {
    proto::PolicyVersionInfo {
        version: info.version,
        digest: info.digest,
        applied_at_ms: info.applied_at_ms,
        applied_by: info.applied_by.clone(),
        message: info.message.clone(),
        rollback_of: info.rollback_of,
        files: info.files,
        size_bytes: info.size_bytes,
        files_kept,
    }
}

/// The author of a policy change: the authenticated operator's name.
fn author(operator: Option<&Operator>, message: String) -> PolicyAuthor {
    // A change always needs a credential, so an operator is always named here.
    let applied_by =
        operator.map_or_else(|| "unknown".to_owned(), |operator| operator.name.clone());
    PolicyAuthor { applied_by, message }
}

fn outstanding_by_node(ledger: &QuotaLedger) -> Vec<proto::NodeTokens> {
    let mut totals: BTreeMap<NodeId, u64> = BTreeMap::new();
    let now_ms = ledger.last_seen_ms();
    for (_, entry) in ledger.keys() {
        // Live leases only: an expired one is written off, whether or not the sweep has
        // reached its key yet.
        for (node_id, lease) in
            entry.leases.iter().filter(|(_, lease)| lease.expires_at_ms > now_ms)
        {
            let total = totals.entry(*node_id).or_default();
            *total = total.saturating_add(lease.tokens);
        }
    }
    totals
        .into_iter()
        .map(|(node_id, tokens)| proto::NodeTokens { node_id: node_id.0, tokens })
        .collect()
}

#[tonic::async_trait]
impl Admin for AdminService {
    async fn init(
        &self,
        request: Request<proto::InitRequest>,
    ) -> Result<Response<proto::MembershipReply>, Status> {
        self.authorize(&request, Access::Change, "init")?;
        let budget = work_budget(deadline(&request));
        self.refuse_on_gateway("form the group")?;
        if self.node.peers.is_empty() {
            return Err(Status::failed_precondition(
                "this node has no [[peers]] configured: it is a single-node region and formed \
                 its quota group on first start",
            ));
        }
        tokio::time::timeout(budget, self.quota.initialize(self.node.peers.clone()))
            .await
            .map_err(|_| Status::deadline_exceeded("initialize did not finish in time"))?
            .map_err(|error| self.membership_status(error))?;
        tracing::info!(voters = ?self.node.peers.keys().collect::<Vec<_>>(), "quota group formed");
        Ok(Response::new(proto::MembershipReply { members: self.members() }))
    }

    async fn add_node(
        &self,
        request: Request<proto::AddNodeRequest>,
    ) -> Result<Response<proto::MembershipReply>, Status> {
        self.authorize(&request, Access::Change, "add_node")?;
        let budget = work_budget(deadline(&request));
        self.refuse_on_gateway("change the membership")?;
        let request = request.into_inner();
        if request.node_id == 0 {
            return Err(Status::invalid_argument("node_id must be at least 1"));
        }
        crate::config::check_peer_addr(&request.raft_addr)
            .map_err(|reason| Status::invalid_argument(format!("raft_addr {reason}")))?;
        let members = match group_of(request.group)? {
            proto::Group::Quota => add_member(&self.quota, &request, budget).await?,
            proto::Group::Billing => add_member(self.billing()?, &request, budget).await?,
        };
        Ok(Response::new(proto::MembershipReply { members }))
    }

    async fn remove_node(
        &self,
        request: Request<proto::RemoveNodeRequest>,
    ) -> Result<Response<proto::MembershipReply>, Status> {
        self.authorize(&request, Access::Change, "remove_node")?;
        let budget = work_budget(deadline(&request));
        self.refuse_on_gateway("change the membership")?;
        let request = request.into_inner();
        let node_id = NodeId(request.node_id);
        let members = match group_of(request.group)? {
            proto::Group::Quota => remove_member(&self.quota, node_id, budget).await?,
            proto::Group::Billing => remove_member(self.billing()?, node_id, budget).await?,
        };
        Ok(Response::new(proto::MembershipReply { members }))
    }

    async fn status(
        &self,
        request: Request<proto::StatusRequest>,
    ) -> Result<Response<proto::StatusReply>, Status> {
        self.authorize(&request, Access::Read, "status")?;
        let served = self.policy_store.served().load_full();
        let commit_index =
            self.quota.committed_index().await.map_err(crate::api::status::membership_status)?;
        let metrics = self.quota.metrics();
        let followers = metrics
            .replication
            .as_ref()
            .map(|replication| {
                replication
                    .iter()
                    .filter(|(id, _)| **id != metrics.id)
                    .map(|(id, matched)| {
                        let matched_index = matched.map(|log_id| log_id.index);
                        let last = metrics.last_log_index.unwrap_or(0);
                        proto::FollowerLag {
                            node_id: id.0,
                            matched_index,
                            lag_entries: last.saturating_sub(matched_index.unwrap_or(0)),
                        }
                    })
                    .collect()
            })
            .unwrap_or_default();
        let ((state_digest, ledger_keys, outstanding_tokens, ledger_time_ms), applied_index) =
            self.quota.read_at_applied(|ledger| {
                (
                    ledger.digest(),
                    ledger.key_count() as u64,
                    outstanding_by_node(ledger),
                    ledger.last_seen_ms(),
                )
            });
        Ok(Response::new(proto::StatusReply {
            node_id: self.node.raft_node_id.0,
            cluster_id: self.node.cluster_id.clone(),
            node_name: self.node.name.clone(),
            raft_addr: self.node.advertise_addr.clone(),
            state: format!("{:?}", metrics.state),
            leader_id: metrics.current_leader.map(|id| id.0),
            term: metrics.current_term,
            last_log_index: metrics.last_log_index,
            commit_index,
            applied_index,
            snapshot_index: metrics.snapshot.map(|id| id.index),
            purged_index: metrics.purged.map(|id| id.index),
            members: self.members(),
            followers,
            state_digest,
            ledger_keys,
            outstanding_tokens,
            ledger_time_ms,
            millis_since_quorum_ack: metrics.millis_since_quorum_ack,
            role: self.node.role.to_string(),
            cached_leader_id: self.quota.cached_leader().map(|id| id.0),
            seeds: match self.node.role {
                Role::Voter => Vec::new(),
                Role::Gateway => self
                    .quota
                    .seeds()
                    .map(|(id, node)| proto::Member {
                        node_id: id.0,
                        raft_addr: node.addr.clone(),
                        voter: true,
                    })
                    .collect(),
            },
            clock_offsets: self
                .quota
                .clock_offsets()
                .snapshot()
                .into_iter()
                .map(|seen| proto::ClockOffset {
                    node_id: seen.node_id.0,
                    offset_ms: seen.offset_ms,
                    exceeded_total: seen.exceeded_total,
                })
                .collect(),
            max_clock_offset_ms: self.quota.clock_offsets().max_clock_offset_ms(),
            billing: match &self.billing {
                Some(billing) => Some(group_status(billing).await?),
                None => None,
            },
            policy_version: served.version,
            policy_source: served.source.to_string(),
            policy_digest: served.digest,
            region_policy_version: self.policy_store.region_version(),
        }))
    }

    async fn acquire_leases(
        &self,
        request: Request<proto::AcquireLeasesRequest>,
    ) -> Result<Response<proto::AcquireLeasesReply>, Status> {
        self.authorize(&request, Access::Change, "acquire_leases")?;
        let budget = work_budget(deadline(&request));
        let (items, requests) = self.lease_requests(request.get_ref())?;
        let keys: Vec<String> = requests.iter().map(|lease| lease.key.clone()).collect();
        let command = QuotaCommand::AcquireLeases {
            now_ms: crate::clock::now_ms(),
            node_id: self.node.raft_node_id,
            requests,
        };
        let response = self.quota.write(command, budget).await.map_err(Status::from)?;
        let grants = match response {
            QuotaResponse::Leases(grants) => grants,
            QuotaResponse::Rejected(refused) => {
                return Err(Status::invalid_argument(refused.to_string()));
            }
            other => {
                return Err(Status::internal(format!(
                    "the ledger answered an AcquireLeases command with {other:?}"
                )));
            }
        };
        let results = grants
            .into_iter()
            .zip(items)
            .zip(keys)
            .map(|((grant, item), key)| match grant {
                Ok(grant) => proto::LeaseResult {
                    item,
                    key,
                    granted_tokens: grant.granted_tokens,
                    retry_after_ms: grant.retry_after_ms,
                    remaining_tokens: grant.remaining_tokens,
                    lease_expires_at_ms: grant.lease_expires_at_ms,
                    error: String::new(),
                },
                Err(error) => {
                    proto::LeaseResult { item, key, error: error.to_string(), ..Default::default() }
                }
            })
            .collect();
        Ok(Response::new(proto::AcquireLeasesReply {
            results,
            leaseholder_node_id: self.node.raft_node_id.0,
        }))
    }

    async fn read_keys(
        &self,
        request: Request<proto::ReadKeysRequest>,
    ) -> Result<Response<proto::ReadKeysReply>, Status> {
        self.authorize(&request, Access::Read, "read_keys")?;
        self.refuse_on_gateway("read ledger keys")?;
        let request = request.into_inner();
        if request.keys.len() > READ_KEYS_MAX {
            return Err(Status::invalid_argument(format!(
                "{} keys asked for; at most {READ_KEYS_MAX}",
                request.keys.len()
            )));
        }
        let listed_max = match usize::try_from(request.max_keys) {
            Ok(0) | Err(_) => READ_KEYS_MAX,
            Ok(max_keys) => max_keys.min(READ_KEYS_MAX),
        };
        let (reply, applied_index) = self.quota.read_at_applied(|ledger| {
            let mut reply = proto::ReadKeysReply {
                ledger_time_ms: ledger.last_seen_ms(),
                ..Default::default()
            };
            if request.keys.is_empty() {
                // One more than the page, to know whether another page follows.
                let mut listed = ledger.keys_after(&request.after).take(listed_max + 1);
                for (key, entry) in listed.by_ref().take(listed_max) {
                    reply.entries.push(key_entry(key.clone(), Some(entry)));
                }
                if listed.next().is_some() {
                    reply.next_after =
                        reply.entries.last().map(|entry| entry.key.clone()).unwrap_or_default();
                }
            } else {
                reply.entries = request
                    .keys
                    .into_iter()
                    .map(|key| {
                        let entry = ledger.key(&key);
                        key_entry(key, entry)
                    })
                    .collect();
            }
            reply
        });
        Ok(Response::new(proto::ReadKeysReply { applied_index, ..reply }))
    }

    async fn regions(
        &self,
        request: Request<proto::RegionsRequest>,
    ) -> Result<Response<proto::RegionsReply>, Status> {
        self.authorize(&request, Access::Read, "regions")?;
        self.refuse_on_gateway("read region slices")?;
        let (region, board) = &self.regions;
        let ((slices, truncated, transfers, credited), applied_index) =
            self.quota.read_at_applied(|ledger| {
                let regions = ledger.regions();
                let mut in_flight: BTreeMap<&SliceKey, u64> = BTreeMap::new();
                let transfers = regions
                    .outgoing()
                    .map(|(serial, transfer)| {
                        let tokens = in_flight.entry(&transfer.key).or_default();
                        *tokens = tokens.saturating_add(transfer.tokens);
                        proto::RegionTransfer {
                            serial,
                            rule: transfer.key.0.clone(),
                            recipient: transfer.recipient.clone(),
                            tokens: transfer.tokens,
                            debited_at_ms: transfer.debited_at_ms,
                        }
                    })
                    .collect::<Vec<_>>();
                let slices = regions
                    .slices()
                    .take(REGION_SLICES_LISTED_MAX)
                    .map(|(key, slice)| {
                        let measured = board.measured(key);
                        proto::RegionSlice {
                            rule: key.0.clone(),
                            global_tokens: slice.global_tokens,
                            slice_tokens: slice.tokens,
                            policy_tokens: measured.map(|measured| measured.policy_tokens),
                            demand_tokens: measured.map(|measured| measured.demand_tokens),
                            in_flight_tokens: in_flight.get(key).copied().unwrap_or(0),
                            peer_slice_tokens: board.peer_slices(key).into_iter().collect(),
                        }
                    })
                    .collect::<Vec<_>>();
                let truncated = regions.slices().count() > REGION_SLICES_LISTED_MAX;
                // Bounded by the donors' transfers in flight (`RECEIVED_PER_DONOR_MAX` each).
                let credited = regions
                    .credited()
                    .map(|(donor, serial)| proto::RegionCredited {
                        donor: donor.to_owned(),
                        serial,
                    })
                    .collect::<Vec<_>>();
                (slices, truncated, transfers, credited)
            });
        Ok(Response::new(proto::RegionsReply {
            region: region.clone(),
            slices,
            transfers,
            applied_index,
            truncated,
            credited,
        }))
    }

    async fn apply_policy(
        &self,
        request: Request<proto::ApplyPolicyRequest>,
    ) -> Result<Response<proto::PolicyReply>, Status> {
        let operator = self.authorize(&request, Access::Change, "apply_policy")?;
        let budget = work_budget(deadline(&request));
        self.refuse_on_gateway("apply a policy set (only voters propose policies)")?;
        let request = request.into_inner();
        let files: Vec<(String, String)> =
            request.files.into_iter().map(|file| (file.name, file.text)).collect();
        check_files(&files).map_err(|error| policy_set_status(&error))?;
        let sources: Vec<PolicySource> = files
            .iter()
            .map(|(name, text)| PolicySource { name: name.clone(), text: text.clone() })
            .collect();
        let options = self.policy_store.options();
        // Parsing up to a full set is CPU work; keep it off the async workers.
        let parsed = tokio::task::spawn_blocking(move || PolicySet::parse_with(&sources, options))
            .await
            .map_err(|error| Status::internal(format!("validating the policy set: {error}")))?;
        let digest = parsed
            .map_err(|errors| Status::invalid_argument(format!("invalid policy:\n{errors}")))?
            .digest();
        let command = QuotaCommand::ApplyPolicySet {
            now_ms: crate::clock::now_ms(),
            files,
            digest,
            author: author(operator.as_deref(), request.message),
        };
        self.write_policy(command, budget).await
    }

    async fn rollback_policy(
        &self,
        request: Request<proto::RollbackPolicyRequest>,
    ) -> Result<Response<proto::PolicyReply>, Status> {
        let operator = self.authorize(&request, Access::Change, "rollback_policy")?;
        let budget = work_budget(deadline(&request));
        self.refuse_on_gateway("roll the policy back (only voters propose policies)")?;
        let request = request.into_inner();
        let command = QuotaCommand::RollbackPolicySet {
            now_ms: crate::clock::now_ms(),
            to_version: request.to_version,
            author: author(operator.as_deref(), request.message),
        };
        self.write_policy(command, budget).await
    }

    async fn get_policy(
        &self,
        request: Request<proto::GetPolicyRequest>,
    ) -> Result<Response<proto::GetPolicyReply>, Status> {
        self.authorize(&request, Access::Read, "get_policy")?;
        self.refuse_on_gateway("read the policy versions")?;
        let wanted = request.into_inner().version;
        let stored = self.quota.read(|ledger| {
            let policies = ledger.policies();
            match wanted {
                None => policies.current().cloned(),
                Some(version) => policies.get(version).cloned(),
            }
        });
        let stored = stored.ok_or_else(|| match wanted {
            None => Status::not_found("no policy version was applied in this region yet"),
            Some(version) => Status::not_found(format!("there is no policy version {version}")),
        })?;
        let files = stored
            .files
            .as_deref()
            .unwrap_or_default()
            .iter()
            .map(|(name, text)| proto::PolicyFile { name: name.clone(), text: text.clone() })
            .collect();
        Ok(Response::new(proto::GetPolicyReply {
            info: Some(version_info(&stored.info, stored.files.is_some())),
            files,
        }))
    }

    async fn policy_history(
        &self,
        request: Request<proto::PolicyHistoryRequest>,
    ) -> Result<Response<proto::PolicyHistoryReply>, Status> {
        self.authorize(&request, Access::Read, "policy_history")?;
        self.refuse_on_gateway("read the policy versions")?;
        let limit = match request.into_inner().limit {
            0 => POLICY_HISTORY_LIMIT_DEFAULT,
            limit => limit.min(POLICY_HISTORY_LIMIT_MAX),
        };
        let versions = self.quota.read(|ledger| {
            let policies = ledger.policies();
            policies
                .history()
                .rev()
                .take(limit as usize)
                .map(|info| {
                    let kept = policies.get(info.version).is_some_and(|s| s.files.is_some());
                    version_info(info, kept)
                })
                .collect()
        });
        Ok(Response::new(proto::PolicyHistoryReply { versions }))
    }
}

/// One ledger key as `ReadKeys` shows it.
fn key_entry(key: String, entry: Option<&crate::core::ledger::KeyEntry>) -> proto::KeyEntry {
    let Some(entry) = entry else {
        return proto::KeyEntry { key, ..Default::default() };
    };
    proto::KeyEntry {
        key,
        found: true,
        leases: entry
            .leases
            .iter()
            .map(|(node_id, lease)| proto::KeyLease {
                node_id: node_id.0,
                tokens: lease.tokens,
                expires_at_ms: lease.expires_at_ms,
            })
            .collect(),
        last_used_ms: entry.last_used_ms,
        algorithm: entry.limit.algorithm.name().to_owned(),
        requests_per_window: entry.limit.requests_per_window,
        window_ms: entry.limit.window_ms,
        capacity_tokens: entry.limit.capacity_tokens(),
        totals_since_ms: entry.totals.since_ms,
        granted_tokens: entry.totals.granted_tokens,
        charged_tokens: entry.totals.charged_tokens,
        returned_tokens: entry.totals.returned_tokens,
        debt_tokens: entry.debt_tokens,
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    /// gRPC timeouts parse in every unit; junk is ignored.
    #[test]
    fn grpc_timeouts_parse() {
        assert_eq!(parse_grpc_timeout("250m"), Some(Duration::from_millis(250)));
        assert_eq!(parse_grpc_timeout("3S"), Some(Duration::from_secs(3)));
        assert_eq!(parse_grpc_timeout("2M"), Some(Duration::from_secs(120)));
        assert_eq!(parse_grpc_timeout("m"), None);
        assert_eq!(parse_grpc_timeout("123456789m"), None);
        assert_eq!(parse_grpc_timeout("5x"), None);
    }
}
