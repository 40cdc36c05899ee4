//! The node's configuration: a TOML file, overridden by `QUOTAMESH_*` environment variables,
//! overridden by flags (the flag/variable layer is parsed by `crate::cli::serve`). This module
//! owns the file format, the defaults and validation; it opens no sockets.
//!
//! ```toml
//! node_id = "node-1"
//! region = "local"
//! data_dir = "./quotamesh-data"
//! policy = "cluster/policies"      # a YAML file or a directory of them; absent = embedded example
//!                                  # (or `path` in a [policy] table, with the settings below)
//! rls_addr = "0.0.0.0:8081"
//! rls_threads = 0                  # 0: rls_addr served on the node's runtime; N: by N threads,
//!                                  # each its own connections on a runtime of its own;
//!                                  # "auto": one per core the process may use but one
//! metrics_addr = "0.0.0.0:6070"
//! raft_node_id = 1                 # this node in its region's Raft groups; never changes
//! cluster_id = "local"             # the region's cluster; stored in data_dir on first start
//! raft_addr = "127.0.0.1:8084"     # Raft peer gRPC (listen); loopback unless configured
//! admin_addr = "127.0.0.1:8083"    # admin gRPC: `quotamesh cluster ...`; loopback likewise
//! billing_addr = "0.0.0.0:8082"    # the billing-debit gRPC API
//! role = "voter"                   # or "gateway": leases only, not a member of the groups
//! max_clock_offset_ms = 500        # a node whose clock differs more from the leader's is reported
//! quic_addr = "127.0.0.1:8443"     # QUIC (UDP) for the other regions' rebalancers
//!
//! [[regions]]                      # the other regions (DESIGN section 5); needs [tls]
//! name = "eu-central"              # as its nodes' certificates name it
//! quic_addr = "10.1.0.1:8443"      # where its quota group's leader answers QUIC
//!
//! [rebalance]                      # the rebalancer, on the leader of the quota group
//! trigger_percent = 80             # a region asks when its demand reaches this % of its slice
//! target_percent = 50              # ... for enough tokens to bring its demand to this %
//! observe_ms = 20000               # demand is measured over this window
//! interval_ms = 1000               # how often the rebalancer looks
//! transfer_timeout_ms = 30000      # an uncredited transfer is cancelled (returned) after it
//!
//! [[peers]]                        # the region's voters (for `cluster init`; a gateway's
//! id = 1                           # way to the leader); none = single node
//! raft_addr = "10.0.0.1:8084"      # as the other nodes reach it
//!
//! insecure_cluster = false         # with [[peers]] and no [tls]: refuse to start, unless true
//!
//! [tls]                            # mTLS between nodes: `quotamesh cluster certs ...`
//! cert = "certs/node-1.pem"        # this node's certificate (names cluster, region, Raft id)
//! key = "certs/node-1.key"
//! ca = "certs/ca.pem"              # trusted CAs; old and new during a CA rotation
//! reload_interval_ms = 5000        # the three files are re-read this often; changes apply
//!                                  # to new connections
//!
//! [admin]                          # who may call the admin API
//! read_open = false                # true: Status, ReadKeys and HTTP /config need no token
//! tls = false                      # true: TLS with [tls]'s certificate; operator certificates
//!                                  # authenticate as tokens do
//! [[admin.tokens]]                 # none: every admin call is UNAUTHENTICATED
//! name = "ops"                     # the operator named in the log
//! sha256 = "<64 hex digits>"       # `quotamesh billing hash-token` prints it
//! read_only = false                # true: Status and ReadKeys only
//!
//! [quota_group]                    # Raft timings and log compaction of the quota group
//! heartbeat_interval_ms = 50
//! election_timeout_min_ms = 300
//! election_timeout_max_ms = 600
//! snapshot_every_logs = 10000
//! logs_kept_after_snapshot = 1000
//!
//! [policy]                         # instead of `policy = "..."` above, when settings are needed
//! path = "cluster/policies"
//! merge_domains = false            # true: several files may declare one domain (upstream's
//!                                  # MERGE_DOMAIN_CONFIG)
//! default_algorithm = "token_bucket" # or "fixed_window" (counts as envoyproxy/ratelimit) or
//!                                  # "sliding_window": limits that name no algorithm
//! near_limit_ratio = 0.8           # upstream's NEAR_LIMIT_RATIO, for the near_limit statistic
//! shadow_events_file = "shadow.jsonl" # a JSON line per shadow rule's would-be rejection
//! shadow_events_file_max_bytes = 268435456 # then renamed to FILE.1 and started anew
//!
//! [shards]
//! count = 0                        # 0 = one per core
//! keys_per_shard_max = 1000000
//! sweep_interval_ms = 250         # returns idle and surplus leases, drops idle keys
//!
//! [headers]
//! ietf_draft10 = true              # RateLimit-Policy and RateLimit
//! legacy = false                   # RateLimit-Limit, RateLimit-Remaining, RateLimit-Reset
//! retry_after = true               # Retry-After when over the limit
//!
//! [leasing]                        # the lease broker, its circuit breaker, the fallback
//! # ledger_timeout_ms = 5          # a fixed deadline per ledger call; unset: 4 x measured p90
//! wait_budget_ms = 15              # longest a request waits for a lease (Envoy allows 20)
//! batch_window_ms = 1              # lease requests gathered into one ledger command
//! fallback_multiplier = 1.0        # fallback bucket: multiplier x limit / nodes_in_region
//! nodes_in_region = 0              # 0 = the number of [[peers]] (1 without)
//! circuit_failures_to_open = 3
//! circuit_probe_interval_ms = 1000
//! circuit_close_after_calls = 5    # healthy calls, half-open, that close the circuit
//!
//! [billing]                        # its Raft group has the quota group's members (peers)
//! bootstrap = false                # with peers: this node forms the group on its first start
//! deadline_ms = 1000               # no commit within it: UNAVAILABLE
//! key_retention_ms = 86400000      # idempotency keys are kept this long
//!
//! [[billing.tokens]]               # none: every billing call is UNAUTHENTICATED
//! name = "checkout"                # the caller named in the audit trail
//! sha256 = "<64 hex digits>"       # `quotamesh billing hash-token` prints it
//! tenants = ["acme"]               # or ["*"] for every tenant
//!
//! [billing.tls]                    # optional: TLS on the billing port
//! cert = "billing.pem"
//! key = "billing.key"
//! client_ca = "clients-ca.pem"     # optional: require client certificates (mTLS)
//! ```

use std::net::SocketAddr;
use std::path::{Path, PathBuf};
use std::str::FromStr;

use serde::Deserialize;

use crate::core::ledger::NodeId;
use crate::core::policy::LoadOptions;
use crate::core::rate::Algorithm;

/// Default RLS gRPC address: envoyproxy/ratelimit's port, so Envoy configs carry over.
pub const RLS_ADDR_DEFAULT: &str = "0.0.0.0:8081";
/// Default Prometheus and health HTTP address.
pub const METRICS_ADDR_DEFAULT: &str = "0.0.0.0:6070";
/// Default Raft peer gRPC address (DESIGN.md section 8): loopback, so the embedded
/// single-node default is reachable from this host only; a region configures its own.
pub const RAFT_ADDR_DEFAULT: &str = "127.0.0.1:8084";
/// Default admin gRPC address (DESIGN.md section 8): loopback, as the Raft port.
pub const ADMIN_ADDR_DEFAULT: &str = "127.0.0.1:8083";
/// Default interval between two reads of the TLS files.
pub const TLS_RELOAD_INTERVAL_MS_DEFAULT: u64 = 5_000;
/// Most admin tokens in the configuration.
pub const ADMIN_TOKENS_MAX: usize = 1024;
/// Default cluster id: the embedded single-node region.
pub const CLUSTER_ID_DEFAULT: &str = "local";
/// Longest cluster id, in bytes.
pub const CLUSTER_ID_BYTES_MAX: usize = 128;
/// Most peers a node's configuration lists (3 or 5 voters, a few gateways); equal to the
/// transport's cached channels so every configured peer keeps its connection.
pub const PEERS_MAX: usize = crate::ledger::network::PEER_CHANNELS_MAX;
/// Longest peer address (`host:port`), in bytes.
pub const PEER_ADDR_BYTES_MAX: usize = 256;
/// Default billing-debit gRPC address.
pub const BILLING_ADDR_DEFAULT: &str = "0.0.0.0:8082";
/// Most billing tokens in the configuration.
pub const BILLING_TOKENS_MAX: usize = 1024;
/// Longest billing token name, in bytes (it is the caller in the audit trail).
pub const BILLING_TOKEN_NAME_BYTES_MAX: usize = crate::core::billing::CALLER_BYTES_MAX;
/// The tenant entry that grants a token every tenant.
pub const BILLING_ALL_TENANTS: &str = "*";
/// Default data directory of the embedded single-node setup.
pub const DATA_DIR_DEFAULT: &str = "./quotamesh-data";
/// Most shard actors a node may run.
pub const SHARD_COUNT_MAX: usize = 1024;
/// Most threads serving the RLS port.
pub const RLS_THREADS_MAX: usize = 256;
/// Most keys one shard may track; with about 100 bytes a key this bounds a shard near 10 GiB.
pub const KEYS_PER_SHARD_MAX_LIMIT: usize = 100_000_000;
/// Largest configuration file read.
pub const CONFIG_FILE_BYTES_MAX: u64 = 1024 * 1024;

/// Everything a node needs to start.
#[derive(Debug, Clone, PartialEq, Deserialize)]
#[serde(deny_unknown_fields, default)]
pub struct NodeConfig {
    /// This node's name, unique in its region.
    pub node_id: String,
    /// The region this node belongs to.
    pub region: String,
    /// Directory for the node's durable state.
    pub data_dir: PathBuf,
    /// Where the policy comes from and how it is read: `policy = "path"`, or a `[policy]`
    /// table.
    #[serde(deserialize_with = "policy_field")]
    pub policy: PolicyConfig,
    /// Envoy RLS v3 gRPC listen address.
    pub rls_addr: SocketAddr,
    /// Threads serving `rls_addr`, each on a single-threaded runtime of its own with the
    /// connections handed to it: a number (0, the default, serves it on the node's runtime),
    /// or `"auto"`, one per core but one.
    pub rls_threads: RlsThreads,
    /// Prometheus `/metrics`, `/healthz` and `/readyz` listen address.
    pub metrics_addr: SocketAddr,
    /// Billing-debit gRPC listen address.
    pub billing_addr: SocketAddr,
    /// The billing group and API.
    pub billing: BillingConfig,
    /// Tenant-shard actors.
    pub shards: ShardConfig,
    /// Rate-limit headers added to Envoy's responses.
    pub headers: HeaderConfig,
    /// This node's id in its region's Raft groups (at least 1), stored in the data directory
    /// on first start and checked on every later one.
    ///
    /// A separate number rather than a numeric `node_id`: Raft (openraft) needs a `u64` that
    /// never changes for the life of the data directory, while `node_id` is the name operators
    /// already use in logs and configs since the first slice; renaming a node must not change
    /// its Raft identity, and existing configurations keep working unchanged.
    pub raft_node_id: NodeId,
    /// The region's cluster, stored in the data directory on first start: a node refuses a
    /// data directory of another cluster. `[A-Za-z0-9._-]`, at most
    /// [`CLUSTER_ID_BYTES_MAX`] bytes.
    pub cluster_id: String,
    /// Raft peer gRPC listen address (the transport of the quota group).
    pub raft_addr: SocketAddr,
    /// Admin gRPC listen address (`quotamesh cluster ...`).
    pub admin_addr: SocketAddr,
    /// QUIC (UDP) listen address for the other regions (DESIGN section 5).
    pub quic_addr: SocketAddr,
    /// The other regions this region exchanges slices of global limits with; QUIC between
    /// regions always uses `[tls]`'s credentials.
    pub regions: Vec<RegionPeerConfig>,
    /// How the rebalancer moves tokens of global limits between regions.
    pub rebalance: RebalanceConfig,
    /// A voter of the region's Raft groups, or a gateway that only leases.
    pub role: Role,
    /// The region's voters with the Raft address the other nodes reach each at. For a voter,
    /// the members `cluster init` forms the group from, this node included; empty: a
    /// single-node region that forms its own quota group on first start (the embedded
    /// default). For a gateway, the voters its writes go to (never itself; at least one).
    pub peers: Vec<PeerConfig>,
    /// Raft timings and log compaction of the quota group.
    pub quota_group: RaftGroupConfig,
    /// mTLS between nodes (the Raft port and every call a node makes to a peer); `None`:
    /// plaintext, which a node with `peers` accepts only with `insecure_cluster`.
    pub tls: Option<ClusterTlsConfig>,
    /// Set in so many words to run a multi-node region without TLS between its nodes:
    /// anyone who reaches the Raft port can then write to the ledgers. Logged at every start
    /// and exported as `quotamesh_insecure_cluster`.
    pub insecure_cluster: bool,
    /// Who may call the admin API.
    pub admin: AdminConfig,
    /// How the node leases tokens from the quota ledger, and what it does without it.
    pub leasing: LeasingConfig,
    /// A node whose wall clock differs from the leader's by more is reported (metric, WARN,
    /// `cluster status`); ledger time follows the leader's stamps either way
    /// (`crate::core::ledger_time`).
    pub max_clock_offset_ms: u64,
}

/// The rebalancer (DESIGN section 5): when a region asks for tokens and how long a transfer
/// may stay uncredited.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Deserialize)]
#[serde(deny_unknown_fields, default)]
pub struct RebalanceConfig {
    /// A region asks when its demand reaches this share of its slice, in percent.
    pub trigger_percent: u64,
    /// What it asks for: a slice its demand fills to this percent.
    pub target_percent: u64,
    /// The window demand is measured over.
    pub observe_ms: u64,
    /// How often the rebalancer measures, exchanges views and moves tokens.
    pub interval_ms: u64,
    /// A transfer its recipient has not credited after this long is cancelled, so its tokens
    /// return to the donor once the recipient confirms.
    pub transfer_timeout_ms: u64,
}

impl Default for RebalanceConfig {
    /// DESIGN section 5: 80 % within 20 s; a look each second; 30 s for a credit.
    fn default() -> Self {
        let plan = crate::core::region::plan::PlanSettings::default();
        Self {
            trigger_percent: plan.trigger_percent,
            target_percent: plan.target_percent,
            observe_ms: plan.observe_ms,
            interval_ms: 1_000,
            transfer_timeout_ms: 30_000,
        }
    }
}

impl RebalanceConfig {
    /// The planner's settings.
    #[must_use]
    pub fn plan(&self) -> crate::core::region::plan::PlanSettings {
        crate::core::region::plan::PlanSettings {
            trigger_percent: self.trigger_percent,
            target_percent: self.target_percent,
            observe_ms: self.observe_ms,
        }
    }

    fn validate(&self) -> Result<(), ConfigError> {
        let invalid = |message: String| Err(ConfigError::Invalid(message));
        if let Err(error) = self.plan().check() {
            return invalid(format!("rebalance: {error}"));
        }
        if !(10..=3_600_000).contains(&self.interval_ms) {
            return invalid("rebalance.interval_ms must be between 10 and 3600000".to_owned());
        }
        if self.transfer_timeout_ms <= self.interval_ms {
            return invalid(
                "rebalance.transfer_timeout_ms must be longer than rebalance.interval_ms"
                    .to_owned(),
            );
        }
        Ok(())
    }
}

/// The lease broker, its circuit breaker, and the fallback (DESIGN sections 2 and 3).
#[derive(Debug, Clone, PartialEq, Deserialize)]
#[serde(deny_unknown_fields, default)]
pub struct LeasingConfig {
    /// A fixed deadline by which a ledger call is judged slow; unset (the default), calls
    /// are judged against the ledger's measured latency (4 x its recent p90, between 100 ms
    /// and 5 s). A slow call is still awaited and its answer applied.
    pub ledger_timeout_ms: Option<u64>,
    /// Longest a request waits for a key's lease before deciding from the fallback (fail-open
    /// rules, charged as debt) or denying (fail-closed rules): within Envoy's own RLS timeout.
    pub wait_budget_ms: u64,
    /// Longest the broker gathers lease requests into one ledger command.
    pub batch_window_ms: u64,
    /// Fallback bucket per node and key: `fallback_multiplier * limit / nodes_in_region`.
    pub fallback_multiplier: f64,
    /// Nodes leasing from the region (voters and gateways); 0: the number of `[[peers]]`
    /// (1 for a single-node region).
    pub nodes_in_region: u64,
    /// Consecutive failed ledger calls that open the circuit.
    pub circuit_failures_to_open: u32,
    /// While open, one probe per this interval.
    pub circuit_probe_interval_ms: u64,
    /// Healthy calls in a row, once a probe succeeded (half-open), that close the circuit.
    pub circuit_close_after_calls: u32,
}

impl Default for LeasingConfig {
    /// DESIGN sections 2 and 3: measured deadlines, a 15 ms wait, 1 ms batches, multiplier
    /// 1.0, 3 failures, 1 probe/s, 5 healthy calls to close.
    fn default() -> Self {
        Self {
            ledger_timeout_ms: None,
            wait_budget_ms: 15,
            batch_window_ms: 1,
            fallback_multiplier: 1.0,
            nodes_in_region: 0,
            circuit_failures_to_open: 3,
            circuit_probe_interval_ms: 1_000,
            circuit_close_after_calls: 5,
        }
    }
}

impl LeasingConfig {
    fn validate(&self) -> Result<(), ConfigError> {
        let invalid = |message: &str| Err(ConfigError::Invalid(format!("leasing.{message}")));
        if self.ledger_timeout_ms.is_some_and(|timeout_ms| !(1..=10_000).contains(&timeout_ms)) {
            return invalid("ledger_timeout_ms must be between 1 and 10000");
        }
        if !(1..=10_000).contains(&self.wait_budget_ms) {
            return invalid("wait_budget_ms must be between 1 and 10000");
        }
        if !(1..=100).contains(&self.batch_window_ms) {
            return invalid("batch_window_ms must be between 1 and 100");
        }
        if !(self.fallback_multiplier.is_finite()
            && (0.001..=100.0).contains(&self.fallback_multiplier))
        {
            return invalid("fallback_multiplier must be between 0.001 and 100");
        }
        if self.nodes_in_region > 10_000 {
            return invalid("nodes_in_region must be at most 10000");
        }
        if !(1..=1_000).contains(&self.circuit_failures_to_open) {
            return invalid("circuit_failures_to_open must be between 1 and 1000");
        }
        if !(10..=60_000).contains(&self.circuit_probe_interval_ms) {
            return invalid("circuit_probe_interval_ms must be between 10 and 60000");
        }
        if !(1..=10_000).contains(&self.circuit_close_after_calls) {
            return invalid("circuit_close_after_calls must be between 1 and 10000");
        }
        Ok(())
    }

    /// `fallback_multiplier` in per mille (validated to a range where this is exact enough).
    pub fn fallback_multiplier_permille(&self) -> u64 {
        // In 1..=100_000 after validation, so the cast neither truncates nor wraps.
        (self.fallback_multiplier * 1000.0).round() as u64
    }
}

/// What a node is in its region's Raft groups (`role` in the file).
///
/// A gateway is not a member of any group: it keeps no replica of the ledger, never votes
/// and never forms a group; it serves RLS from its leases, which it asks the quota group's
/// leader for through the configured voters (`peers`). The billing group has voters only.
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq, Deserialize)]
#[serde(rename_all = "lowercase")]
pub enum Role {
    /// A member of the region's quota and billing groups (the default).
    #[default]
    Voter,
    /// A lease-only node outside the groups, writing through the voters.
    Gateway,
}

impl Role {
    /// The name used in the file, flags and the admin status.
    pub fn as_str(self) -> &'static str {
        match self {
            Self::Voter => "voter",
            Self::Gateway => "gateway",
        }
    }
}

impl std::fmt::Display for Role {
    fn fmt(&self, formatter: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        formatter.write_str(self.as_str())
    }
}

impl FromStr for Role {
    type Err = String;

    /// Parses the flag and variable form: `voter` or `gateway`.
    fn from_str(text: &str) -> Result<Self, Self::Err> {
        match text.trim() {
            "voter" => Ok(Self::Voter),
            "gateway" => Ok(Self::Gateway),
            other => Err(format!("unknown role {other:?}: expected \"voter\" or \"gateway\"")),
        }
    }
}

/// Another region, as `[[regions]]` lists it.
#[derive(Debug, Clone, PartialEq, Eq, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct RegionPeerConfig {
    /// The region's name, as its nodes' certificates name it.
    pub name: String,
    /// Where its quota group's leader answers QUIC.
    pub quic_addr: SocketAddr,
}

impl From<&RegionPeerConfig> for crate::region::RegionPeer {
    fn from(peer: &RegionPeerConfig) -> Self {
        Self { name: peer.name.clone(), quic_addr: peer.quic_addr }
    }
}

/// One voter of the region, as `[[peers]]` lists it.
#[derive(Debug, Clone, PartialEq, Eq, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct PeerConfig {
    /// Its `raft_node_id`.
    pub id: NodeId,
    /// `host:port` of its Raft listener, as the other nodes reach it.
    pub raft_addr: String,
}

/// The TLS files of the links between nodes (PEM; `quotamesh cluster certs ...` makes them).
#[derive(Debug, Clone, PartialEq, Eq, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct ClusterTlsConfig {
    /// This node's certificate chain; its certificate names the cluster, region and Raft id.
    pub cert: PathBuf,
    /// Its private key.
    pub key: PathBuf,
    /// The CA bundle every peer's certificate must chain to.
    pub ca: PathBuf,
    /// How often the three files are read again; a change applies to new connections.
    #[serde(default = "tls_reload_interval_ms_default")]
    pub reload_interval_ms: u64,
}

fn tls_reload_interval_ms_default() -> u64 {
    TLS_RELOAD_INTERVAL_MS_DEFAULT
}

impl ClusterTlsConfig {
    /// The files, as `crate::tls` takes them.
    pub fn files(&self) -> crate::tls::credentials::TlsFiles {
        crate::tls::credentials::TlsFiles {
            cert: self.cert.clone(),
            key: self.key.clone(),
            ca: self.ca.clone(),
        }
    }
}

/// Who may call the admin API: operator tokens, stored as SHA-256 digests.
#[derive(Debug, Clone, Default, PartialEq, Eq, Deserialize)]
#[serde(deny_unknown_fields, default)]
pub struct AdminConfig {
    /// `Status` and `ReadKeys` without a token (the calls that change nothing), and the
    /// policy files on the metrics port's `/config` (`crate::api::http`).
    pub read_open: bool,
    /// Serve the admin API over TLS with the node's `[tls]` certificate; an operator
    /// certificate of the cluster's CA (`quotamesh cluster certs issue-operator`) then
    /// authenticates a caller as a token does.
    pub tls: bool,
    /// The operators.
    pub tokens: Vec<AdminToken>,
}

/// One operator token.
#[derive(Debug, Clone, PartialEq, Eq, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct AdminToken {
    /// The operator's name, written in the log of every change it makes.
    pub name: String,
    /// SHA-256 of the token, 64 hex digits; the token itself is never stored.
    pub sha256: String,
    /// Only the calls that change nothing (`Status`, `ReadKeys`); others are
    /// `PERMISSION_DENIED`.
    #[serde(default)]
    pub read_only: bool,
}

/// Raft timings and log compaction of one group (see `crate::ledger::GroupSettings`).
#[derive(Debug, Clone, PartialEq, Eq, Deserialize)]
#[serde(deny_unknown_fields, default)]
pub struct RaftGroupConfig {
    /// Leader heartbeat period.
    pub heartbeat_interval_ms: u64,
    /// A follower that hears no leader for a random time between this and
    /// `election_timeout_max_ms` starts an election.
    pub election_timeout_min_ms: u64,
    /// Upper end of the election timeout range.
    pub election_timeout_max_ms: u64,
    /// A snapshot is built, and the log before it purged, every this many applied entries.
    pub snapshot_every_logs: u64,
    /// Entries kept behind a snapshot, so a briefly lagging follower catches up from the log.
    pub logs_kept_after_snapshot: u64,
}

/// Tenant-shard actor settings.
#[derive(Debug, Clone, PartialEq, Deserialize)]
#[serde(deny_unknown_fields, default)]
pub struct ShardConfig {
    /// Number of shard actors; 0 means one per available core.
    pub count: usize,
    /// Keys one shard tracks before it evicts the least recently useful one.
    pub keys_per_shard_max: usize,
    /// How often a shard returns surplus and idle balances to the ledger and drops keys that
    /// hold nothing; at most a lookahead (250 ms by default), or idle balances expire
    /// unspent before they are returned.
    pub sweep_interval_ms: u64,
}

/// The policy files and the node-wide settings for reading them.
#[derive(Debug, Clone, PartialEq, Deserialize)]
#[serde(deny_unknown_fields, default)]
pub struct PolicyConfig {
    /// Policy file or directory; `None` serves the embedded example policy.
    pub path: Option<PathBuf>,
    /// Several files may declare one domain (upstream's `MERGE_DOMAIN_CONFIG=true`).
    pub merge_domains: bool,
    /// The algorithm of limits that name none (`fixed_window` counts as upstream does).
    pub default_algorithm: Algorithm,
    /// Past this share of a limit hits count as `near_limit` (upstream's `NEAR_LIMIT_RATIO`).
    pub near_limit_ratio: f64,
    /// Where each request a shadow rule would have refused is appended as a JSON line
    /// (`quotamesh policy shadow-report` reads it); `None`: counted and logged at debug only.
    pub shadow_events_file: Option<PathBuf>,
    /// Past this size the events file is renamed to `FILE.1` and started anew.
    pub shadow_events_file_max_bytes: u64,
}

impl Default for PolicyConfig {
    fn default() -> Self {
        Self {
            path: None,
            merge_domains: false,
            default_algorithm: Algorithm::default(),
            near_limit_ratio: 0.8,
            shadow_events_file: None,
            shadow_events_file_max_bytes: SHADOW_EVENTS_FILE_MAX_BYTES_DEFAULT,
        }
    }
}

/// Default size past which the shadow events file is rotated: 256 MiB.
pub const SHADOW_EVENTS_FILE_MAX_BYTES_DEFAULT: u64 = 256 * 1024 * 1024;

impl PolicyConfig {
    /// The loader's view of these settings.
    #[must_use]
    pub fn load_options(&self) -> LoadOptions {
        LoadOptions { merge_domains: self.merge_domains, default_algorithm: self.default_algorithm }
    }

    /// `near_limit_ratio` in thousandths, as the RLS service counts it.
    #[must_use]
    pub fn near_limit_ratio_permille(&self) -> u64 {
        // Validated to lie in 0..=1, so the product fits.
        #[allow(clippy::cast_possible_truncation, clippy::cast_sign_loss)]
        let permille = (self.near_limit_ratio * 1_000.0).round() as u64;
        permille
    }
}

/// `policy` is either a path (the older form) or a `[policy]` table.
fn policy_field<'de, D: serde::Deserializer<'de>>(
    deserializer: D,
) -> Result<PolicyConfig, D::Error> {
    struct Field;
    impl<'de> serde::de::Visitor<'de> for Field {
        type Value = PolicyConfig;
        fn expecting(&self, formatter: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
            formatter.write_str("a policy path or a [policy] table")
        }
        fn visit_str<E: serde::de::Error>(self, path: &str) -> Result<PolicyConfig, E> {
            Ok(PolicyConfig { path: Some(PathBuf::from(path)), ..PolicyConfig::default() })
        }
        fn visit_map<M: serde::de::MapAccess<'de>>(self, map: M) -> Result<PolicyConfig, M::Error> {
            PolicyConfig::deserialize(serde::de::value::MapAccessDeserializer::new(map))
        }
    }
    deserializer.deserialize_any(Field)
}

/// How many threads serve the RLS port: a number (0, the default: none of its own) or
/// `rls_threads = "auto"`.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum RlsThreads {
    /// One per core the process may use (`available_parallelism`, which honours CPU
    /// affinity and cgroup quotas) but one, at least one: [`auto_rls_threads`].
    Auto,
    /// That many serving threads; 0 serves the port on the node's multi-threaded runtime.
    Count(usize),
}

impl<'de> Deserialize<'de> for RlsThreads {
    fn deserialize<D: serde::Deserializer<'de>>(deserializer: D) -> Result<Self, D::Error> {
        struct Field;
        impl serde::de::Visitor<'_> for Field {
            type Value = RlsThreads;
            fn expecting(&self, formatter: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
                formatter.write_str(
                    "\"auto\" (one thread per core but one) or a number of threads (0: the \
                     node's runtime)",
                )
            }
            fn visit_str<E: serde::de::Error>(self, text: &str) -> Result<RlsThreads, E> {
                match text {
                    "auto" => Ok(RlsThreads::Auto),
                    _ => Err(E::invalid_value(serde::de::Unexpected::Str(text), &self)),
                }
            }
            fn visit_i64<E: serde::de::Error>(self, count: i64) -> Result<RlsThreads, E> {
                usize::try_from(count)
                    .map(RlsThreads::Count)
                    .map_err(|_| E::invalid_value(serde::de::Unexpected::Signed(count), &self))
            }
            fn visit_u64<E: serde::de::Error>(self, count: u64) -> Result<RlsThreads, E> {
                usize::try_from(count)
                    .map(RlsThreads::Count)
                    .map_err(|_| E::invalid_value(serde::de::Unexpected::Unsigned(count), &self))
            }
        }
        deserializer.deserialize_any(Field)
    }
}

/// Which rate-limit header generations the RLS answer carries.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Deserialize)]
#[serde(deny_unknown_fields, default)]
pub struct HeaderConfig {
    /// IETF draft-ietf-httpapi-ratelimit-headers-10: `RateLimit-Policy` and `RateLimit`.
    pub ietf_draft10: bool,
    /// The older `RateLimit-Limit`, `RateLimit-Remaining`, `RateLimit-Reset` (seconds).
    /// Off by default, as envoyproxy/ratelimit's `LIMIT_RESPONSE_HEADERS_ENABLED`: Envoy's
    /// own `X-RateLimit-*` headers carry the same numbers, and every header costs encoding.
    pub legacy: bool,
    /// `Retry-After` (seconds) on over-limit answers.
    pub retry_after: bool,
}

/// The billing group and its API.
#[derive(Debug, Clone, PartialEq, Deserialize)]
#[serde(deny_unknown_fields, default)]
pub struct BillingConfig {
    /// With `peers`: this node forms the billing group (of every peer) on its first start;
    /// set it on one node. Without peers the node forms a single-node group of itself.
    pub bootstrap: bool,
    /// How long a billing call waits for its commit before answering `UNAVAILABLE`.
    pub deadline_ms: u64,
    /// How long idempotency keys are kept after their first commit.
    pub key_retention_ms: u64,
    /// Callers: bearer tokens (hashed) and the tenants each may touch.
    pub tokens: Vec<BillingToken>,
    /// TLS on the billing port; `None` serves plaintext.
    pub tls: Option<BillingTls>,
}

/// One billing caller.
#[derive(Debug, Clone, PartialEq, Eq, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct BillingToken {
    /// The caller's name, written in the audit trail.
    pub name: String,
    /// SHA-256 of the token, 64 hex digits; the token itself is never stored.
    pub sha256: String,
    /// Tenants the token may touch; `"*"` for all.
    pub tenants: Vec<String>,
}

/// TLS files of the billing port (PEM).
#[derive(Debug, Clone, PartialEq, Eq, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct BillingTls {
    /// The server's certificate chain.
    pub cert: PathBuf,
    /// The server's private key.
    pub key: PathBuf,
    /// When set, clients must present a certificate signed by this CA (mTLS).
    pub client_ca: Option<PathBuf>,
}

impl Default for BillingConfig {
    fn default() -> Self {
        Self {
            bootstrap: false,
            deadline_ms: 1000,
            key_retention_ms: crate::core::billing::KEY_RETENTION_MS_DEFAULT,
            tokens: Vec::new(),
            tls: None,
        }
    }
}

impl BillingConfig {
    fn validate(&self) -> Result<(), ConfigError> {
        use crate::core::billing::{KEY_RETENTION_MS_MAX, KEY_RETENTION_MS_MIN};
        let invalid = |message: String| Err(ConfigError::Invalid(message));
        if !(10..=60_000).contains(&self.deadline_ms) {
            return invalid("billing.deadline_ms must be between 10 and 60000".to_owned());
        }
        if !(KEY_RETENTION_MS_MIN..=KEY_RETENTION_MS_MAX).contains(&self.key_retention_ms) {
            return invalid(format!(
                "billing.key_retention_ms must be between {KEY_RETENTION_MS_MIN} and {KEY_RETENTION_MS_MAX}"
            ));
        }
        if self.tokens.len() > BILLING_TOKENS_MAX {
            return invalid(format!("billing.tokens: at most {BILLING_TOKENS_MAX}"));
        }
        for token in &self.tokens {
            if let Err(reason) = check_token(&token.name, &token.sha256) {
                return invalid(format!("billing.tokens {:?}: {reason}", token.name));
            }
            if token.tenants.is_empty() {
                return invalid(format!("billing.tokens {:?}: no tenants", token.name));
            }
            for tenant in &token.tenants {
                let account = crate::core::billing::AccountId::new(tenant.as_str(), "m");
                if tenant != BILLING_ALL_TENANTS && account.check().is_err() {
                    return invalid(format!(
                        "billing.tokens {:?}: bad tenant {tenant:?}",
                        token.name
                    ));
                }
            }
        }
        Ok(())
    }
}

impl Default for NodeConfig {
    fn default() -> Self {
        Self {
            node_id: "node-1".to_owned(),
            region: "local".to_owned(),
            data_dir: PathBuf::from(DATA_DIR_DEFAULT),
            policy: PolicyConfig::default(),
            rls_addr: RLS_ADDR_DEFAULT.parse().expect("constant address parses"),
            rls_threads: RlsThreads::Count(0),
            metrics_addr: METRICS_ADDR_DEFAULT.parse().expect("constant address parses"),
            billing_addr: BILLING_ADDR_DEFAULT.parse().expect("constant address parses"),
            billing: BillingConfig::default(),
            shards: ShardConfig::default(),
            headers: HeaderConfig::default(),
            raft_node_id: NodeId(1),
            cluster_id: CLUSTER_ID_DEFAULT.to_owned(),
            raft_addr: RAFT_ADDR_DEFAULT.parse().expect("constant address parses"),
            admin_addr: ADMIN_ADDR_DEFAULT.parse().expect("constant address parses"),
            quic_addr: crate::region::QUIC_ADDR_DEFAULT.parse().expect("constant address parses"),
            regions: Vec::new(),
            rebalance: RebalanceConfig::default(),
            role: Role::Voter,
            peers: Vec::new(),
            quota_group: RaftGroupConfig::default(),
            tls: None,
            insecure_cluster: false,
            admin: AdminConfig::default(),
            leasing: LeasingConfig::default(),
            max_clock_offset_ms: crate::core::ledger_time::MAX_CLOCK_OFFSET_MS_DEFAULT,
        }
    }
}

impl Default for RaftGroupConfig {
    /// `crate::ledger::GroupSettings::new`'s defaults, spelled out for the config file.
    fn default() -> Self {
        Self {
            heartbeat_interval_ms: 50,
            election_timeout_min_ms: 300,
            election_timeout_max_ms: 600,
            snapshot_every_logs: 10_000,
            logs_kept_after_snapshot: 1_000,
        }
    }
}

impl Default for ShardConfig {
    fn default() -> Self {
        Self { count: 0, keys_per_shard_max: 1_000_000, sweep_interval_ms: 250 }
    }
}

impl Default for HeaderConfig {
    fn default() -> Self {
        Self { ietf_draft10: true, legacy: false, retry_after: true }
    }
}

/// Why a configuration was refused.
#[derive(Debug, thiserror::Error)]
pub enum ConfigError {
    /// The file could not be read.
    #[error("cannot read config {path}: {source}")]
    Read {
        /// The file.
        path: PathBuf,
        /// The IO error.
        source: std::io::Error,
    },
    /// The file is larger than [`CONFIG_FILE_BYTES_MAX`].
    #[error("config {path} is {size_bytes} bytes, more than the {CONFIG_FILE_BYTES_MAX} allowed")]
    TooLarge {
        /// The file.
        path: PathBuf,
        /// Its size.
        size_bytes: u64,
    },
    /// The TOML did not parse or had unknown keys.
    #[error("invalid config {path}: {message}")]
    Parse {
        /// The file.
        path: PathBuf,
        /// The parser's message, with line and column.
        message: String,
    },
    /// A value is out of range.
    #[error("invalid config: {0}")]
    Invalid(String),
}

impl NodeConfig {
    /// Reads a TOML file; missing keys take their defaults.
    ///
    /// # Errors
    /// [`ConfigError`] when the file cannot be read, is too large, or does not parse.
    pub fn from_file(path: &Path) -> Result<Self, ConfigError> {
        let read_error = |source| ConfigError::Read { path: path.to_owned(), source };
        let size_bytes = std::fs::metadata(path).map_err(read_error)?.len();
        if size_bytes > CONFIG_FILE_BYTES_MAX {
            return Err(ConfigError::TooLarge { path: path.to_owned(), size_bytes });
        }
        let text = std::fs::read_to_string(path).map_err(read_error)?;
        Self::from_toml(&text)
            .map_err(|message| ConfigError::Parse { path: path.to_owned(), message })
    }

    /// Parses TOML text.
    ///
    /// # Errors
    /// The parser's message when the text is not a valid configuration.
    pub fn from_toml(text: &str) -> Result<Self, String> {
        toml::from_str(text).map_err(|error| error.to_string())
    }

    /// Checks ranges that serde cannot express.
    ///
    /// # Errors
    /// [`ConfigError::Invalid`] naming the first bad value.
    pub fn validate(&self) -> Result<(), ConfigError> {
        let invalid = |message: String| Err(ConfigError::Invalid(message));
        if self.node_id.is_empty() || self.node_id.len() > 128 {
            return invalid(format!("node_id must be 1 to 128 bytes, got {:?}", self.node_id));
        }
        if self.region.is_empty() || self.region.len() > 128 {
            return invalid(format!("region must be 1 to 128 bytes, got {:?}", self.region));
        }
        if !(1..=86_400_000).contains(&self.max_clock_offset_ms) {
            return invalid(format!(
                "max_clock_offset_ms must be between 1 and 86400000, got {}",
                self.max_clock_offset_ms
            ));
        }
        if self.shards.count > SHARD_COUNT_MAX {
            return invalid(format!("shards.count must be at most {SHARD_COUNT_MAX}"));
        }
        if matches!(self.rls_threads, RlsThreads::Count(count) if count > RLS_THREADS_MAX) {
            return invalid(format!("rls_threads must be at most {RLS_THREADS_MAX}"));
        }
        if self.shards.keys_per_shard_max == 0
            || self.shards.keys_per_shard_max > KEYS_PER_SHARD_MAX_LIMIT
        {
            return invalid(format!(
                "shards.keys_per_shard_max must be between 1 and {KEYS_PER_SHARD_MAX_LIMIT}"
            ));
        }
        if !(10..=3_600_000).contains(&self.shards.sweep_interval_ms) {
            return invalid("shards.sweep_interval_ms must be between 10 and 3600000".to_owned());
        }
        if !(self.policy.near_limit_ratio.is_finite()
            && (0.0..=1.0).contains(&self.policy.near_limit_ratio))
        {
            return invalid("policy.near_limit_ratio must be between 0 and 1".to_owned());
        }
        if self.policy.shadow_events_file_max_bytes < 4096 {
            return invalid("policy.shadow_events_file_max_bytes must be at least 4096".to_owned());
        }
        self.validate_cluster()?;
        self.leasing.validate()?;
        self.billing.validate()
    }

    /// Checks `[[regions]]`: valid names, none twice, not this node's own, and TLS to
    /// authenticate them with.
    fn validate_regions(&self) -> Result<(), ConfigError> {
        let invalid = |message: String| Err(ConfigError::Invalid(message));
        if self.regions.len() > crate::core::region::REGIONS_PER_RULE_MAX {
            return invalid(format!(
                "at most {} [[regions]], got {}",
                crate::core::region::REGIONS_PER_RULE_MAX,
                self.regions.len()
            ));
        }
        let mut names = std::collections::BTreeSet::new();
        for peer in &self.regions {
            if let Err(error) = crate::core::region::check_region_name(&peer.name) {
                return invalid(format!("regions: {:?}: {error}", peer.name));
            }
            if peer.name == self.region {
                return invalid(format!("regions: {} is this node's own region", peer.name));
            }
            if !names.insert(peer.name.as_str()) {
                return invalid(format!("regions: {} is listed twice", peer.name));
            }
        }
        self.rebalance.validate()?;
        if !self.regions.is_empty() && self.tls.is_none() {
            return invalid(
                "[[regions]] needs [tls]: regions authenticate each other by certificate \
                 (quotamesh cluster certs)"
                    .to_owned(),
            );
        }
        Ok(())
    }

    /// Checks the Raft and cluster settings.
    fn validate_cluster(&self) -> Result<(), ConfigError> {
        let invalid = |message: String| Err(ConfigError::Invalid(message));
        if self.raft_node_id.0 == 0 {
            return invalid("raft_node_id must be at least 1".to_owned());
        }
        if !valid_cluster_id(&self.cluster_id) {
            return invalid(format!(
                "cluster_id must be 1 to {CLUSTER_ID_BYTES_MAX} characters of [A-Za-z0-9._-], \
                 got {:?}",
                self.cluster_id
            ));
        }
        if self.peers.len() > PEERS_MAX {
            return invalid(format!("at most {PEERS_MAX} peers, got {}", self.peers.len()));
        }
        let mut ids = std::collections::BTreeSet::new();
        for peer in &self.peers {
            if peer.id.0 == 0 {
                return invalid("peers: id must be at least 1".to_owned());
            }
            if !ids.insert(peer.id) {
                return invalid(format!("peers: id {} is listed twice", peer.id));
            }
            if let Err(reason) = check_peer_addr(&peer.raft_addr) {
                return invalid(format!("peers: node {}: raft_addr {reason}", peer.id));
            }
        }
        self.validate_regions()?;
        self.validate_role(&ids)?;
        self.validate_security()?;
        let group = &self.quota_group;
        if !(10..=10_000).contains(&group.heartbeat_interval_ms) {
            return invalid(
                "quota_group.heartbeat_interval_ms must be between 10 and 10000".into(),
            );
        }
        if group.election_timeout_min_ms <= group.heartbeat_interval_ms
            || group.election_timeout_max_ms <= group.election_timeout_min_ms
            || group.election_timeout_max_ms > 60_000
        {
            return invalid(
                "quota_group: need heartbeat_interval_ms < election_timeout_min_ms < \
                 election_timeout_max_ms <= 60000"
                    .to_owned(),
            );
        }
        if !(1..=100_000_000).contains(&group.snapshot_every_logs) {
            return invalid(
                "quota_group.snapshot_every_logs must be between 1 and 100000000".into(),
            );
        }
        if group.logs_kept_after_snapshot > 100_000_000 {
            return invalid(
                "quota_group.logs_kept_after_snapshot must be at most 100000000".into(),
            );
        }
        Ok(())
    }

    /// Checks TLS and the admin tokens: a node with peers needs TLS between nodes unless
    /// `insecure_cluster` says otherwise.
    fn validate_security(&self) -> Result<(), ConfigError> {
        let invalid = |message: String| Err(ConfigError::Invalid(message));
        if !self.peers.is_empty() && self.tls.is_none() && !self.insecure_cluster {
            return invalid(
                "this node has peers but no [tls]: its Raft port would let anyone who reaches \
                 it write to the ledgers; configure [tls] (cert, key, ca; `quotamesh cluster \
                 certs init` and `issue` make them), or set insecure_cluster = true to run \
                 without it"
                    .to_owned(),
            );
        }
        if let Some(tls) = &self.tls
            && !(100..=3_600_000).contains(&tls.reload_interval_ms)
        {
            return invalid("tls.reload_interval_ms must be between 100 and 3600000".to_owned());
        }
        if self.admin.tls && self.tls.is_none() {
            return invalid(
                "admin.tls uses the node's certificate: configure [tls] too".to_owned(),
            );
        }
        if self.admin.tokens.len() > ADMIN_TOKENS_MAX {
            return invalid(format!("admin.tokens: at most {ADMIN_TOKENS_MAX}"));
        }
        for token in &self.admin.tokens {
            check_token(&token.name, &token.sha256).map_err(|reason| {
                ConfigError::Invalid(format!("admin.tokens {:?}: {reason}", token.name))
            })?;
        }
        Ok(())
    }

    /// Checks `role` against `peers` (whose ids are `ids`): a voter lists itself (or no
    /// peers at all), a gateway lists the voters and never itself.
    fn validate_role(&self, ids: &std::collections::BTreeSet<NodeId>) -> Result<(), ConfigError> {
        let invalid = |message: String| Err(ConfigError::Invalid(message));
        let this = self.raft_node_id;
        match self.role {
            Role::Voter if !ids.is_empty() && !ids.contains(&this) => invalid(format!(
                "peers must list this node (raft_node_id {this}) with the address the others \
                 reach it at; leave peers empty for a single-node region, or set \
                 role = \"gateway\" for a node that only leases"
            )),
            Role::Voter => Ok(()),
            Role::Gateway if ids.is_empty() => invalid(
                "role = \"gateway\" needs peers: list the region's voters ([[peers]], \
                 QUOTAMESH_PEERS or --peers), through which the gateway reaches the quota \
                 group's leader"
                    .to_owned(),
            ),
            Role::Gateway if ids.contains(&this) => invalid(format!(
                "a gateway is not a voter: peers must list only the region's voters, not this \
                 node (raft_node_id {this}); give the gateway a raft_node_id of its own, or set \
                 role = \"voter\""
            )),
            Role::Gateway if self.billing.bootstrap => invalid(
                "billing.bootstrap is set on a gateway: the billing group has voters only; set \
                 it on one voter"
                    .to_owned(),
            ),
            Role::Gateway => Ok(()),
        }
    }

    /// Whether this node is a gateway: it only leases, through the voters in `peers`.
    pub fn is_gateway(&self) -> bool {
        self.role == Role::Gateway
    }

    /// How many voters the configuration names: `peers`, or this node alone in a
    /// single-node region. The group's membership may have changed since (`cluster
    /// add-node`, `remove-node`); `RaftGroup::voter_count` gives the live figure.
    pub fn voter_count(&self) -> usize {
        self.peers.len().max(1)
    }

    /// The Raft address the other nodes reach this one at: its own `[[peers]]` entry, or for
    /// a single-node region (and a gateway, which is not among its peers) `raft_addr` with an
    /// unspecified IP (`0.0.0.0`, `::`) read as loopback, which is where a single node is
    /// reached from.
    pub fn raft_advertise_addr(&self) -> String {
        if let Some(peer) = self.peers.iter().find(|peer| peer.id == self.raft_node_id) {
            return peer.raft_addr.clone();
        }
        let mut address = self.raft_addr;
        if address.ip().is_unspecified() {
            address.set_ip(if address.is_ipv4() {
                std::net::Ipv4Addr::LOCALHOST.into()
            } else {
                std::net::Ipv6Addr::LOCALHOST.into()
            });
        }
        address.to_string()
    }

    /// Nodes leasing from the region: `leasing.nodes_in_region`, or the configured peers.
    pub fn nodes_in_region(&self) -> u64 {
        match self.leasing.nodes_in_region {
            0 => (self.peers.len() as u64).max(1),
            nodes => nodes,
        }
    }

    /// The number of threads serving the RLS port (0: none of its own, the node's runtime
    /// serves it): the configured count, or [`auto_rls_threads`] of the cores.
    pub fn rls_thread_count(&self) -> usize {
        match self.rls_threads {
            RlsThreads::Count(count) => count,
            RlsThreads::Auto => auto_rls_threads(
                std::thread::available_parallelism().map_or(1, std::num::NonZeroUsize::get),
            ),
        }
    }

    /// The number of shard actors to run: the configured count, or one per core.
    pub fn shard_count(&self) -> usize {
        if self.shards.count > 0 {
            return self.shards.count;
        }
        std::thread::available_parallelism().map_or(1, std::num::NonZeroUsize::get)
    }
}

/// The serving threads of `rls_threads = "auto"` on `cores` cores: one per core but one,
/// leaving the node's runtime (the Raft groups, the lease broker, the shard actors) a core's
/// room beside serving threads that keep theirs busy; at least one, at most
/// [`RLS_THREADS_MAX`]. (With every core serving, ledger calls stalled longest on a busy
/// machine; with one left over they still stalled longer than on the node's runtime.)
#[must_use]
pub fn auto_rls_threads(cores: usize) -> usize {
    cores.saturating_sub(1).clamp(1, RLS_THREADS_MAX)
}

/// Checks a token's name and digest (billing and admin tokens alike).
fn check_token(name: &str, sha256: &str) -> Result<(), String> {
    if name.is_empty() || name.len() > BILLING_TOKEN_NAME_BYTES_MAX {
        return Err(format!("name must be 1 to {BILLING_TOKEN_NAME_BYTES_MAX} bytes"));
    }
    if sha256.len() != 64 || !sha256.bytes().all(|b| b.is_ascii_hexdigit()) {
        return Err("sha256 must be 64 hex digits".to_owned());
    }
    Ok(())
}

fn valid_cluster_id(id: &str) -> bool {
    !id.is_empty()
        && id.len() <= CLUSTER_ID_BYTES_MAX
        && id.bytes().all(|b| b.is_ascii_alphanumeric() || matches!(b, b'.' | b'_' | b'-'))
}

/// Checks a `host:port` peer address.
///
/// # Errors
/// The reason, completing "raft_addr ...".
pub fn check_peer_addr(address: &str) -> Result<(), String> {
    if address.len() > PEER_ADDR_BYTES_MAX {
        return Err(format!("is longer than {PEER_ADDR_BYTES_MAX} bytes"));
    }
    let valid = address.rsplit_once(':').is_some_and(|(host, port)| {
        !host.is_empty()
            && !host.contains(['/', ' ', '@'])
            && port.parse::<u16>().is_ok_and(|port| port > 0)
    });
    if valid { Ok(()) } else { Err(format!("{address:?} is not host:port")) }
}

/// Parses `voter` or `gateway`, the form of the role in flags and `QUOTAMESH_ROLE`.
///
/// # Errors
/// A message naming the accepted values.
pub fn parse_role(text: &str) -> Result<Role, String> {
    text.parse()
}

/// Parses `ID=HOST:PORT`, the form of one peer in flags and `QUOTAMESH_PEERS`.
///
/// # Errors
/// A message naming what is wrong.
pub fn parse_peer(text: &str) -> Result<PeerConfig, String> {
    let (id, raft_addr) =
        text.split_once('=').ok_or_else(|| format!("{text:?} is not ID=HOST:PORT"))?;
    let id = id.trim().parse::<u64>().map_err(|e| format!("{text:?}: bad node id: {e}"))?;
    let raft_addr = raft_addr.trim().to_owned();
    check_peer_addr(&raft_addr).map_err(|reason| format!("{text:?}: address {reason}"))?;
    Ok(PeerConfig { id: NodeId(id), raft_addr })
}

#[cfg(test)]
mod tests {
    use super::*;

    /// An empty file is the embedded default.
    #[test]
    fn empty_toml_is_default() {
        assert_eq!(NodeConfig::from_toml("").expect("parses"), NodeConfig::default());
    }

    /// Unknown keys are refused with their name, so a typo never silently takes a default.
    #[test]
    fn unknown_key_is_refused() {
        let message = NodeConfig::from_toml("rls_adr = \"1.2.3.4:1\"").expect_err("typo");
        assert!(message.contains("rls_adr"), "{message}");
    }

    /// Nested tables override only what they name.
    #[test]
    fn nested_tables_override_fields() {
        let config =
            NodeConfig::from_toml("[shards]\ncount = 3\n[headers]\nlegacy = true").expect("parses");
        assert_eq!(config.shards.count, 3);
        assert_eq!(config.shards.keys_per_shard_max, ShardConfig::default().keys_per_shard_max);
        assert!(config.headers.legacy);
        assert!(config.headers.ietf_draft10);
        assert!(config.validate().is_ok());
    }

    /// The example configuration shipped in `cluster/node.toml` parses, validates, and
    /// states exactly the defaults.
    #[test]
    fn shipped_example_is_the_default() {
        let config = NodeConfig::from_toml(include_str!("../cluster/node.toml")).expect("parses");
        assert!(config.validate().is_ok());
        assert_eq!(config, NodeConfig::default());
    }

    /// `policy` is a path or a `[policy]` table with the loader's settings; a bad algorithm,
    /// an unknown key or a ratio outside 0..=1 is refused.
    #[test]
    fn policy_is_a_path_or_a_table() {
        let path = NodeConfig::from_toml("policy = \"p.yaml\"").expect("parses");
        assert_eq!(path.policy.path, Some(PathBuf::from("p.yaml")));
        assert_eq!(path.policy.load_options(), LoadOptions::default());
        let table = NodeConfig::from_toml(
            "[policy]\npath = \"dir\"\nmerge_domains = true\ndefault_algorithm = \"fixed_window\"\n\
             near_limit_ratio = 0.5\n",
        )
        .expect("parses");
        assert_eq!(table.policy.path, Some(PathBuf::from("dir")));
        assert_eq!(
            table.policy.load_options(),
            LoadOptions { merge_domains: true, default_algorithm: Algorithm::FixedWindow }
        );
        assert_eq!(table.policy.near_limit_ratio_permille(), 500);
        assert!(NodeConfig::from_toml("[policy]\ndefault_algorithm = \"leaky\"").is_err());
        assert!(NodeConfig::from_toml("[policy]\nmerge_domain = true").is_err());
        let ratio = NodeConfig::from_toml("[policy]\nnear_limit_ratio = 1.5").expect("parses");
        assert!(ratio.validate().is_err());
    }

    /// A billing section with a token parses and validates; a malformed token digest or an
    /// unknown key is refused.
    #[test]
    fn billing_section_parses_and_validates() {
        let text = r#"
            [billing]
            bootstrap = true
            [[billing.tokens]]
            name = "svc"
            sha256 = "9f86d081884c7d659a2feaa0c55ad015a3bf4f1b2b0b822cd15d6c15b0f00a08"
            tenants = ["t1", "*"]
        "#;
        let config = NodeConfig::from_toml(text).expect("parses");
        assert!(config.validate().is_ok(), "{:?}", config.validate());
        let mut bad_digest = config;
        bad_digest.billing.tokens[0].sha256 = "abc".to_owned();
        assert!(bad_digest.validate().is_err());
        assert!(NodeConfig::from_toml("[billing]\nvoters = []").is_err());
    }

    /// The RLS port's threads: none of its own unless set, `"auto"` one per core but one,
    /// at most [`RLS_THREADS_MAX`]; any other word or a negative count is refused.
    #[test]
    fn rls_threads_are_none_unless_set() {
        let cores = std::thread::available_parallelism().map_or(1, std::num::NonZeroUsize::get);
        assert_eq!(NodeConfig::default().rls_threads, RlsThreads::Count(0));
        assert_eq!(NodeConfig::default().rls_thread_count(), 0);
        for (cores, threads) in [(1, 1), (2, 1), (3, 2), (16, 15), (1_000, RLS_THREADS_MAX)] {
            assert_eq!(auto_rls_threads(cores), threads, "{cores} cores");
        }
        let auto = NodeConfig::from_toml("rls_threads = \"auto\"").expect("parses");
        assert_eq!(auto.rls_threads, RlsThreads::Auto);
        assert_eq!(auto.rls_thread_count(), auto_rls_threads(cores));
        let node_runtime = NodeConfig::from_toml("rls_threads = 0").expect("parses");
        assert!(node_runtime.validate().is_ok());
        assert_eq!(node_runtime.rls_thread_count(), 0);
        let three = NodeConfig::from_toml("rls_threads = 3").expect("parses");
        assert!(three.validate().is_ok());
        assert_eq!(three.rls_thread_count(), 3);
        for bad in ["rls_threads = \"all\"", "rls_threads = -1", "rls_threads = 1.5"] {
            let message = NodeConfig::from_toml(bad).expect_err(bad);
            assert!(message.contains("auto"), "{bad}: {message}");
        }
        let too_many = NodeConfig::from_toml(&format!("rls_threads = {}", RLS_THREADS_MAX + 1))
            .expect("parses");
        let message = format!("{}", too_many.validate().expect_err("too many"));
        assert!(message.contains("rls_threads"), "{message}");
    }

    /// Out-of-range values are refused by validate.
    #[test]
    fn zero_capacity_is_invalid() {
        let config = NodeConfig::from_toml("[shards]\nkeys_per_shard_max = 0").expect("parses");
        assert!(config.validate().is_err());
    }

    /// A 3-node region's configuration parses, and the advertised address is the node's own
    /// peer entry.
    #[test]
    fn peers_and_raft_settings_parse() {
        let config = NodeConfig::from_toml(
            "raft_node_id = 2\ncluster_id = \"region-a\"\nraft_addr = \"127.0.0.2:8084\"\n\
             insecure_cluster = true\n[[peers]]\nid = 1\nraft_addr = \"127.0.0.1:8084\"\n\
             [[peers]]\nid = 2\nraft_addr = \"node-2.example:8084\"\n\
             [quota_group]\nsnapshot_every_logs = 5",
        )
        .expect("parses");
        assert!(config.validate().is_ok(), "{:?}", config.validate());
        assert_eq!(config.raft_node_id, NodeId(2));
        assert_eq!(config.raft_advertise_addr(), "node-2.example:8084");
        assert_eq!(config.quota_group.snapshot_every_logs, 5);
        assert_eq!(config.quota_group.heartbeat_interval_ms, 50);
    }

    /// `[[regions]]` parse with their QUIC addresses; a bad or repeated name, the node's
    /// own region, regions without `[tls]`, or bad `[rebalance]` settings are refused.
    #[test]
    fn regions_parse_and_bad_ones_are_refused() {
        let tls = "[tls]\ncert = \"n.pem\"\nkey = \"n.key\"\nca = \"ca.pem\"\n";
        let config = NodeConfig::from_toml(&format!(
            "region = \"us-east\"\nquic_addr = \"0.0.0.0:9443\"\n{tls}\
             [[regions]]\nname = \"eu-central\"\nquic_addr = \"10.1.0.1:8443\"\n"
        ))
        .expect("parses");
        assert!(config.validate().is_ok(), "{:?}", config.validate());
        assert_eq!(config.quic_addr.to_string(), "0.0.0.0:9443");
        assert_eq!(config.rebalance.plan(), crate::core::region::plan::PlanSettings::default());
        assert_eq!(NodeConfig::default().quic_addr.port(), 8443);
        let peer = crate::region::RegionPeer::from(&config.regions[0]);
        assert_eq!(
            (peer.name.as_str(), peer.quic_addr.to_string()),
            ("eu-central", "10.1.0.1:8443".into())
        );
        let entry =
            |name: &str| format!("[[regions]]\nname = \"{name}\"\nquic_addr = \"10.1.0.1:8443\"\n");
        for (text, expected) in [
            (format!("region = \"a\"\n{tls}{}", entry("a b")), "may only use"),
            (format!("region = \"a\"\n{tls}{}", entry("a")), "own region"),
            (format!("region = \"a\"\n{tls}{}{}", entry("b"), entry("b")), "listed twice"),
            (format!("region = \"a\"\n{}", entry("b")), "needs [tls]"),
            ("[rebalance]\ntarget_percent = 90\n".to_owned(), "target_percent"),
            ("[rebalance]\nobserve_ms = 0\n".to_owned(), "observe_ms"),
            ("[rebalance]\ntransfer_timeout_ms = 500\n".to_owned(), "transfer_timeout_ms"),
        ] {
            let error = NodeConfig::from_toml(&text).expect("parses").validate().expect_err(&text);
            assert!(error.to_string().contains(expected), "{error} for {text}");
        }
    }

    /// With no peers the node advertises loopback for an unspecified listen address.
    #[test]
    fn single_node_advertises_loopback() {
        assert_eq!(NodeConfig::default().raft_advertise_addr(), "127.0.0.1:8084");
    }

    /// Peers must include this node, once each, with valid addresses; ids start at 1.
    #[test]
    fn bad_peers_are_refused() {
        for (text, expected) in [
            ("[[peers]]\nid = 2\nraft_addr = \"a:1\"", "must list this node"),
            (
                "[[peers]]\nid = 1\nraft_addr = \"a:1\"\n[[peers]]\nid = 1\nraft_addr = \"b:1\"",
                "listed twice",
            ),
            ("[[peers]]\nid = 1\nraft_addr = \"nohost\"", "not host:port"),
            ("raft_node_id = 0", "at least 1"),
            ("cluster_id = \"a b\"", "cluster_id"),
            ("[quota_group]\nelection_timeout_min_ms = 40", "heartbeat_interval_ms <"),
        ] {
            let config = NodeConfig::from_toml(text).expect("parses");
            let error = config.validate().expect_err(text).to_string();
            assert!(error.contains(expected), "{text}: {error}");
        }
    }

    /// A gateway lists the region's voters, not itself; it parses, validates, and counts
    /// the voters it was given.
    #[test]
    fn gateway_lists_the_voters() {
        let config = NodeConfig::from_toml(
            "role = \"gateway\"\nraft_node_id = 4\ninsecure_cluster = true\n\
             [[peers]]\nid = 1\nraft_addr = \"127.0.0.1:8084\"\n\
             [[peers]]\nid = 2\nraft_addr = \"127.0.0.2:8084\"\n\
             [[peers]]\nid = 3\nraft_addr = \"127.0.0.3:8084\"",
        )
        .expect("parses");
        assert!(config.validate().is_ok(), "{:?}", config.validate());
        assert_eq!(config.role, Role::Gateway);
        assert!(config.is_gateway());
        assert_eq!(config.voter_count(), 3);
        assert_eq!(config.raft_advertise_addr(), "127.0.0.1:8084", "raft_addr, loopback");
        assert!(!NodeConfig::default().is_gateway(), "a voter by default");
        assert_eq!(NodeConfig::default().voter_count(), 1, "a single-node region");
    }

    /// A gateway listing itself, a gateway without peers, and a gateway asked to bootstrap
    /// the billing group are refused, each with a message that says what to change.
    #[test]
    fn bad_gateways_are_refused() {
        let voters =
            "[[peers]]\nid = 1\nraft_addr = \"a:1\"\n[[peers]]\nid = 2\nraft_addr = \"b:1\"\n";
        for (text, expected) in [
            (
                format!("role = \"gateway\"\nraft_node_id = 2\n{voters}"),
                "a gateway is not a voter: peers must list only the region's voters, not this \
                 node (raft_node_id 2)",
            ),
            ("role = \"gateway\"\nraft_node_id = 4".to_owned(), "role = \"gateway\" needs peers"),
            (
                format!(
                    "role = \"gateway\"\nraft_node_id = 4\n{voters}[billing]\nbootstrap = true"
                ),
                "the billing group has voters only",
            ),
        ] {
            let config = NodeConfig::from_toml(&text).expect("parses");
            let error = config.validate().expect_err(&text).to_string();
            assert!(error.contains(expected), "{text}: {error}");
        }
        let voter_without_itself = format!("raft_node_id = 4\n{voters}");
        let error = NodeConfig::from_toml(&voter_without_itself)
            .expect("parses")
            .validate()
            .expect_err("a voter must list itself")
            .to_string();
        assert!(error.contains("role = \"gateway\""), "points at the gateway role: {error}");
    }

    /// An unknown role is refused when parsed, naming the value and the accepted ones, in the
    /// file and in the flag and variable form alike.
    #[test]
    fn unknown_role_is_refused() {
        let message = NodeConfig::from_toml("role = \"observer\"").expect_err("unknown role");
        assert!(message.contains("observer"), "{message}");
        assert!(message.contains("voter") && message.contains("gateway"), "{message}");
        assert!(NodeConfig::from_toml("role = \"Gateway\"").is_err(), "names are lowercase");
        assert_eq!(parse_role("gateway"), Ok(Role::Gateway));
        assert_eq!(parse_role("voter"), Ok(Role::Voter));
        let message = parse_role("learner").expect_err("unknown role");
        assert!(message.contains("\"learner\"") && message.contains("\"gateway\""), "{message}");
    }

    /// A node with peers refuses to start without TLS unless `insecure_cluster` says so;
    /// a `[tls]` table and operator tokens parse and validate, bad digests are refused.
    #[test]
    fn peers_need_tls_or_insecure_cluster() {
        let peers = "[[peers]]\nid = 1\nraft_addr = \"a:1\"\n";
        let error = NodeConfig::from_toml(peers).expect("parses").validate().expect_err("no TLS");
        assert!(error.to_string().contains("insecure_cluster = true"), "{error}");
        let insecure = format!("insecure_cluster = true\n{peers}");
        assert!(NodeConfig::from_toml(&insecure).expect("parses").validate().is_ok());
        let secure = format!(
            "{peers}[tls]\ncert = \"n.pem\"\nkey = \"n.key\"\nca = \"ca.pem\"\n\
             [[admin.tokens]]\nname = \"ops\"\nsha256 = \"{}\"\nread_only = true\n",
            "ab".repeat(32)
        );
        let config = NodeConfig::from_toml(&secure).expect("parses");
        assert!(config.validate().is_ok(), "{:?}", config.validate());
        assert_eq!(config.tls.as_ref().map(|tls| tls.reload_interval_ms), Some(5000));
        assert!(config.admin.tokens[0].read_only);
        let mut bad = config;
        bad.admin.tokens[0].sha256 = "xyz".to_owned();
        assert!(bad.validate().is_err());
        assert_eq!(
            NodeConfig::default().admin_addr.ip(),
            std::net::Ipv4Addr::LOCALHOST,
            "the default admin port is on loopback"
        );
    }

    /// The flag and variable form of a peer.
    #[test]
    fn peer_flag_form_parses() {
        let peer = parse_peer("3=127.0.0.3:8084").expect("parses");
        assert_eq!(peer, PeerConfig { id: NodeId(3), raft_addr: "127.0.0.3:8084".to_owned() });
        assert!(parse_peer("3").is_err());
        assert!(parse_peer("x=a:1").is_err());
        assert!(parse_peer("3=a").is_err());
    }

    /// The shipped 3-node region examples parse, validate and agree on their peers.
    #[test]
    fn shipped_region_examples_are_valid() {
        let nodes = [
            include_str!("../cluster/region-a/node-1.toml"),
            include_str!("../cluster/region-a/node-2.toml"),
            include_str!("../cluster/region-a/node-3.toml"),
        ];
        for (index, text) in nodes.iter().enumerate() {
            let config = NodeConfig::from_toml(text).expect("parses");
            assert!(config.validate().is_ok(), "node {}: {:?}", index + 1, config.validate());
            assert_eq!(config.raft_node_id, NodeId(index as u64 + 1));
            assert_eq!(config.peers.len(), 3);
            assert_eq!(config.raft_advertise_addr(), config.raft_addr.to_string());
        }
    }

    /// The shipped gateway example is a valid gateway of the shipped 3-node region: the
    /// same cluster, the same voters, an id and loopback address of its own.
    #[test]
    fn shipped_gateway_example_is_valid() {
        let gateway = NodeConfig::from_toml(include_str!("../cluster/region-a/gateway-4.toml"))
            .expect("parses");
        assert!(gateway.validate().is_ok(), "{:?}", gateway.validate());
        assert!(gateway.is_gateway());
        let voter =
            NodeConfig::from_toml(include_str!("../cluster/region-a/node-1.toml")).expect("parses");
        assert_eq!(gateway.cluster_id, voter.cluster_id);
        assert_eq!(gateway.peers, voter.peers);
        assert_eq!(gateway.raft_node_id, NodeId(4));
        assert_eq!(gateway.raft_advertise_addr(), "127.0.0.4:8084");
        for address in
            [gateway.rls_addr, gateway.metrics_addr, gateway.admin_addr, gateway.raft_addr]
        {
            assert_eq!(address.ip().to_string(), "127.0.0.4");
        }
        assert_ne!(gateway.data_dir, voter.data_dir);
    }
}
