//! Every Prometheus metric of a node, by name, in one place. Other modules hold a
//! [`Metrics`] handle and record into it; `crate::api::http` serves [`Metrics::encode`].
//!
//! Label sets are bounded: domains appear as labels only when the policy defines them
//! (anything else is `unknown`), rules by their configured path, shards by index. The one
//! family keyed by runtime values, upstream's statistics under `detailed_metric`,
//! `value_to_metric` or a request's own `limit`, is capped at [`STATS_KEYS_MAX`] keys; past
//! it a new key is counted under its rule's path ([`Metrics::stats_key_label`]).

use std::borrow::Cow;
use std::collections::HashSet;
use std::sync::Arc;

use crate::api::grpc_metrics::{CODES, UNKNOWN, known_methods};
use parking_lot::Mutex;
use prometheus::{
    Counter, Encoder, GaugeVec, Histogram, HistogramOpts, HistogramVec, IntCounter, IntCounterVec,
    IntGauge, IntGaugeVec, Opts, Registry, TextEncoder,
};

/// Label value used for a domain the policy does not define.
pub const DOMAIN_UNKNOWN: &str = "unknown";

/// The version of this binary (`quotamesh --version`).
pub const VERSION: &str = env!("CARGO_PKG_VERSION");
/// The git commit this binary was built from, set by build.rs (`unknown` without git).
pub const COMMIT: &str = env!("QUOTAMESH_GIT_COMMIT");

/// The `outcome` labels of `quotamesh_billing_operations_total`.
pub const BILLING_OUTCOMES: [&str; 6] =
    ["approved", "insufficient_funds", "duplicate", "refused", "unavailable", "overloaded"];

/// The `result` labels of `quotamesh_region_transfers_total`: a donor's debit committed, a
/// recipient's credit confirmed, a cancelled transfer's tokens returned to the donor, a step
/// the peer or the ledger refused, a call that failed (it is retried with the same id).
pub const REGION_TRANSFER_RESULTS: [&str; 5] =
    ["debited", "credited", "returned", "refused", "failed"];

/// The `reason` labels of `quotamesh_rate_limit_bypassed_total`.
pub const BYPASS_REASONS: [&str; 3] = ["circuit_open", "ledger_timeout", "overloaded"];

/// Most statistics keys named by runtime values (`detailed_metric`, `value_to_metric`, a
/// request's `limit` override) exported at once; one key costs five series.
pub const STATS_KEYS_MAX: usize = 10_000;

/// The statistics key of requests' own `limit` overrides once [`STATS_KEYS_MAX`] is reached.
pub const STATS_KEY_OVERRIDE: &str = "override";

/// A statistics key named by runtime values, with its domain: `(domain, key)`.
type StatsKey = (Box<str>, Box<str>);

/// envoyproxy/ratelimit's per-descriptor statistics, one counter per upstream name, labelled
/// `{domain, key}` where `key` is upstream's statistics key without the domain: upstream's
/// `ratelimit.service.rate_limit.<domain>.<key>.<name>`.
#[derive(Clone)]
pub struct RateLimitStats {
    /// `quotamesh_ratelimit_total_hits_total`: every hit.
    pub total_hits: IntCounterVec,
    /// `quotamesh_ratelimit_over_limit_total`: hits past the limit.
    pub over_limit: IntCounterVec,
    /// `quotamesh_ratelimit_near_limit_total`: hits past `near_limit_ratio` of the limit,
    /// within it.
    pub near_limit: IntCounterVec,
    /// `quotamesh_ratelimit_within_limit_total`: hits of admitted descriptors.
    pub within_limit: IntCounterVec,
    /// `quotamesh_ratelimit_shadow_mode_total`: hits a shadow-mode rule let through past
    /// its limit.
    pub shadow_mode: IntCounterVec,
    /// `quotamesh_ratelimit_stats_keys_capped_total`: hits counted under their rule's path
    /// because [`STATS_KEYS_MAX`] runtime-valued keys were already exported.
    pub keys_capped: IntCounter,
    /// The runtime-valued keys exported so far.
    runtime_keys: Arc<Mutex<HashSet<StatsKey>>>,
}

/// The node's metrics and the registry that exports them.
#[derive(Clone)]
pub struct Metrics {
    registry: Registry,
    /// `quotamesh_rls_decisions_total{domain, code}`: ShouldRateLimit answers by overall code.
    pub rls_decisions: IntCounterVec,
    /// `quotamesh_rls_descriptor_decisions_total{domain, rule, code}`: per matched descriptor.
    pub rls_descriptor_decisions: IntCounterVec,
    /// `quotamesh_rls_shadow_blocks_total{domain, rule}`: hits a shadow-mode rule would have blocked.
    pub rls_shadow_blocks: IntCounterVec,
    /// `quotamesh_rls_warnings_total{domain, rule}`: descriptors a warn-stage rule admitted
    /// over its limit, with `RateLimit-Warning`.
    pub rls_warnings: IntCounterVec,
    /// `quotamesh_rls_shadow_events_dropped_total`: shadow events not written to
    /// `[policy] shadow_events_file` (its queue full, or the disk failing).
    pub rls_shadow_events_dropped: IntCounter,
    /// `quotamesh_rls_unmatched_total{reason}`: descriptors with no rule (`domain_not_found`, `no_rule`).
    pub rls_unmatched: IntCounterVec,
    /// `quotamesh_rls_rejected_requests_total{reason}`: requests refused before any state was touched.
    pub rls_rejected_requests: IntCounterVec,
    /// `quotamesh_rls_request_duration_seconds`: time spent deciding one ShouldRateLimit call.
    pub rls_request_duration: Histogram,
    /// `quotamesh_shard_keys{shard}`: keys tracked by each shard.
    pub shard_keys: IntGaugeVec,
    /// `quotamesh_shard_evictions_total{shard, reason}`: keys dropped (`pristine` or `capacity`).
    pub shard_evictions: IntCounterVec,
    /// `quotamesh_shard_cold_admissions_total{shard}`: keys created through the shard actor.
    pub shard_cold_admissions: IntCounterVec,
    /// `quotamesh_policy_reloads_total{result}`: policy loads by result (`ok`, `error`, `unchanged`).
    pub policy_reloads: IntCounterVec,
    /// `quotamesh_policy_rules`: rules in the active policy set.
    pub policy_rules: IntGauge,
    /// `quotamesh_policy_version`: the replicated policy version the node serves; 0 when it
    /// serves local files (`--policy`) or the embedded default.
    pub policy_version: IntGauge,
    /// `quotamesh_policy_info{digest}`: 1, labelled with the active policy set's digest as
    /// `quotamesh policy validate` prints it (equal on nodes serving the same policy).
    policy_info: IntGaugeVec,
    /// `quotamesh_policy_reload_failures_total`: loads refused since start (alert on increase).
    pub policy_reload_failures: IntCounter,
    /// `quotamesh_grpc_server_handled_total{service, method, code}`: gRPC calls served, by
    /// status code (`crate::api::grpc_metrics` measures every tonic server of the node).
    pub grpc_server_handled: IntCounterVec,
    /// `quotamesh_grpc_server_handling_seconds{service, method}`: whole-call latency.
    pub grpc_server_handling: HistogramVec,
    /// `quotamesh_grpc_server_in_flight_requests{service, method}`: calls being served.
    pub grpc_server_in_flight: IntGaugeVec,
    /// `quotamesh_rate_limit_bypassed_total{reason}`: admitted decisions that some limit paid
    /// from the fallback bucket instead of a ledger lease (`circuit_open`, `ledger_timeout`,
    /// `overloaded`).
    pub rate_limit_bypassed: IntCounterVec,
    /// `quotamesh_rate_limit_failed_closed_total`: decisions a fail-closed rule denied because
    /// no lease could be had.
    pub rate_limit_failed_closed: IntCounter,
    /// `quotamesh_lease_asks_total{result}`: per-key lease requests handed to the broker
    /// (`queued`) or refused at once (`refused`: broker full or circuit open).
    pub lease_asks: IntCounterVec,
    /// `quotamesh_lease_size_tokens`: tokens per grant.
    pub lease_size: Histogram,
    /// `quotamesh_lease_credited_tokens_total`: tokens the ledger credited back from this
    /// node's settlements (returned and expired unspent balances, grants whose answer was
    /// lost).
    pub lease_credited_tokens: IntCounter,
    /// `quotamesh_lease_charged_tokens_total`: tokens this node admitted beyond its leases
    /// (credit, fallback) that its settlements charged to the ledger.
    pub lease_charged_tokens: IntCounter,
    /// `quotamesh_lease_credit_admissions_total`: decisions admitted on credit (a cold key's
    /// first hits, a refill on the way), charged by the key's next report.
    pub lease_credit_admissions: IntCounter,
    /// `quotamesh_lease_waits_total`: decisions that waited for a key's lease from the ledger
    /// (its balance fell short, credit could not pay); a warm key should not make any.
    pub lease_waits: IntCounter,
    /// `quotamesh_lease_held_tokens{domain, rule}`: leased tokens this node holds per rule,
    /// at the last sweep; summed over the region's nodes it is the live drift.
    pub lease_held_tokens: IntGaugeVec,
    /// `quotamesh_lease_drift_bound_tokens{domain, rule}`: the bound on tokens outside the
    /// ledger per key of the rule: every node's lease and credit, plus the fallback allowance
    /// while the circuit is not closed (`LeaseTuning::drift_bound_tokens`).
    pub lease_drift_bound_tokens: IntGaugeVec,
    /// `quotamesh_ledger_calls_total{result}`: batched ledger calls (`ok`; `slow`: past the
    /// deadline measured from the ledger's own latency, still awaited; `timeout`: no answer
    /// at all; `error`).
    pub ledger_calls: IntCounterVec,
    /// `quotamesh_ledger_call_duration_seconds`: latency of batched ledger calls.
    pub ledger_call_duration: Histogram,
    /// `quotamesh_ledger_circuit_state`: 0 closed, 1 half-open (leasing again), 2 open.
    pub ledger_circuit_state: IntGauge,
    /// `quotamesh_ledger_circuit_opened_total`: times the circuit opened. A circuit that
    /// opens for a moment now and then never shows in the state a scrape samples.
    pub ledger_circuit_opened: IntCounter,
    /// `quotamesh_ledger_circuit_open_seconds_total`: time the circuit spent open, added
    /// when it leaves open (fail-open rules were paid from the fallback meanwhile).
    pub ledger_circuit_open_seconds: Counter,
    /// `quotamesh_ledger_stalled_seconds_total`: time during which a ledger call judged slow
    /// was outstanding, from the oldest one's start, added when the last of them ends. Keys
    /// whose reports it carried waited for their refills meanwhile, whether or not the
    /// circuit opened.
    pub ledger_stalled_seconds: Counter,
    /// `quotamesh_region_slice_tokens{region, rule}`: a region's slice of a global limit
    /// (tokens per window), this region's from its ledger, a peer's as it last reported.
    pub region_slice_tokens: IntGaugeVec,
    /// `quotamesh_region_in_flight_tokens{rule}`: tokens this region debited and has not
    /// settled (in flight to another region, or credited there and not yet settled here).
    pub region_in_flight_tokens: IntGaugeVec,
    /// `quotamesh_region_demand_tokens{rule}`: this region's demand over the observation
    /// window, in tokens per window of the limit.
    pub region_demand_tokens: IntGaugeVec,
    /// `quotamesh_region_transfers_total{result}`: transfer steps by result (see
    /// [`REGION_TRANSFER_RESULTS`]).
    pub region_transfers: IntCounterVec,
    /// `quotamesh_region_link_up{region}`: 1 while a QUIC connection to the peer is open.
    pub region_link_up: IntGaugeVec,
    /// `quotamesh_region_link_rtt_seconds{region}`: the QUIC round-trip time to the peer.
    pub region_link_rtt: GaugeVec,
    /// `quotamesh_region_calls_total{region}`: calls to a peer region that got a reply
    /// (each one request and one reply message).
    pub region_calls: IntCounterVec,
    /// `quotamesh_region_sent_bytes_total{region}`: request bytes of those calls (messages
    /// only: no QUIC, TLS or UDP overhead, no keepalives).
    pub region_sent_bytes: IntCounterVec,
    /// `quotamesh_region_received_bytes_total{region}`: reply bytes of those calls.
    pub region_received_bytes: IntCounterVec,
    /// `quotamesh_region_connections_refused_total`: QUIC connections this node's region
    /// endpoint refused (a certificate of another CA, a gateway's, or one naming a region
    /// that is not a peer).
    pub region_connections_refused: IntCounter,
    /// `quotamesh_region_leading`: 1 while this node's rebalancer runs (it leads the quota
    /// group of a region with `[[regions]]`).
    pub region_leading: IntGauge,
    /// `quotamesh_clock_offset_seconds{node}`: how far a node's wall clock was ahead of this
    /// leader's (negative: behind) at its last forwarded write.
    pub clock_offset: GaugeVec,
    /// `quotamesh_clock_offset_exceeded_total{node}`: forwarded writes whose proposer's clock
    /// differed from this leader's by more than `max_clock_offset_ms`.
    pub clock_offset_exceeded: IntCounterVec,
    /// `quotamesh_raft_term{group}`: the group's current term on this node.
    pub raft_term: IntGaugeVec,
    /// `quotamesh_raft_leader_id{group}`: the leader this node knows of, -1 for none.
    pub raft_leader_id: IntGaugeVec,
    /// `quotamesh_raft_role{group, role}`: 1 for this node's role in the group
    /// (`leader`, `follower`, `candidate`, `learner`, `shutdown`), 0 for the others.
    pub raft_role: IntGaugeVec,
    /// `quotamesh_raft_last_log_index{group}`: the last entry in this node's log (-1: none).
    pub raft_last_log_index: IntGaugeVec,
    /// `quotamesh_raft_committed_index{group}`: the last entry this node knows committed.
    pub raft_committed_index: IntGaugeVec,
    /// `quotamesh_raft_applied_index{group}`: the last entry applied on this node.
    pub raft_applied_index: IntGaugeVec,
    /// `quotamesh_raft_snapshot_index{group}`: the last entry in this node's snapshot.
    pub raft_snapshot_index: IntGaugeVec,
    /// `quotamesh_raft_replication_lag_entries{group, follower}`: on the leader, entries a
    /// follower still lacks.
    pub raft_replication_lag: IntGaugeVec,
    /// `quotamesh_raft_storage_errors_total{group}`: times the group stopped on a storage
    /// (or other fatal) error on this node.
    pub raft_storage_errors: IntCounterVec,
    /// `quotamesh_raft_log_fsync_duration_seconds{group}`: how long each write of appended
    /// entries to this node's Raft log took, fsync included. No entry counts towards a
    /// commit before it, so its tail is the first thing to read when ledger calls stall.
    pub raft_log_fsync_duration: HistogramVec,
    /// `quotamesh_billing_operations_total{outcome}`: billing operations answered, by
    /// outcome (`approved`, `insufficient_funds`, `duplicate`, `refused`, `unavailable`,
    /// `overloaded`).
    pub billing_operations: IntCounterVec,
    /// `quotamesh_build_info{version, commit}`: 1, labelled with the binary's version and
    /// the git commit it was built from (`unknown` outside a git checkout).
    build_info: IntGaugeVec,
    /// `quotamesh_insecure_cluster`: 1 when the node runs a multi-node region without TLS
    /// between nodes (`insecure_cluster = true`); alert on it.
    pub insecure_cluster: IntGauge,
    /// envoyproxy/ratelimit's statistics under Prometheus names.
    pub ratelimit_stats: RateLimitStats,
}

impl Default for Metrics {
    fn default() -> Self {
        Self::new()
    }
}

impl Metrics {
    /// Creates and registers every metric in a fresh registry.
    ///
    /// # Panics
    /// Never in practice: registration fails only on duplicate or malformed names, which are
    /// constants here and covered by a test.
    pub fn new() -> Self {
        let registry = Registry::new();
        let counter_vec = |name: &str, help: &str, labels: &[&str]| {
            let metric = IntCounterVec::new(Opts::new(name, help), labels).expect("valid metric");
            registry.register(Box::new(metric.clone())).expect("unique metric");
            metric
        };
        let gauge_vec = |name: &str, help: &str, labels: &[&str]| {
            let metric = IntGaugeVec::new(Opts::new(name, help), labels).expect("valid metric");
            registry.register(Box::new(metric.clone())).expect("unique metric");
            metric
        };
        let gauge = |name: &str, help: &str| {
            let metric = IntGauge::new(name, help).expect("valid metric");
            registry.register(Box::new(metric.clone())).expect("unique metric");
            metric
        };
        // Decisions take microseconds; calls up to the Envoy filter's 20 ms default timeout.
        let latency_buckets = vec![
            0.000_005, 0.000_01, 0.000_025, 0.000_05, 0.000_1, 0.000_25, 0.000_5, 0.001, 0.002_5,
            0.005, 0.01, 0.02, 0.05, 0.1,
        ];
        let rls_request_duration = Histogram::with_opts(
            HistogramOpts::new(
                "quotamesh_rls_request_duration_seconds",
                "Time spent deciding one ShouldRateLimit call, from decode to encode.",
            )
            .buckets(latency_buckets.clone()),
        )
        .expect("valid metric");
        registry.register(Box::new(rls_request_duration.clone())).expect("unique metric");
        // From an RLS decision (microseconds) to an admin call that waits for a node to
        // catch up (seconds).
        let mut grpc_buckets = latency_buckets;
        grpc_buckets.extend([0.25, 0.5, 1.0, 2.5, 5.0, 10.0, 30.0]);
        let grpc_server_handling = HistogramVec::new(
            HistogramOpts::new(
                "quotamesh_grpc_server_handling_seconds",
                "Whole-call latency of the gRPC calls this node served, by service and method.",
            )
            .buckets(grpc_buckets),
            &["service", "method"],
        )
        .expect("valid metric");
        registry.register(Box::new(grpc_server_handling.clone())).expect("unique metric");
        // From a fast disk's fsync (well under a millisecond) to a stalled one (seconds).
        let raft_log_fsync_duration = HistogramVec::new(
            HistogramOpts::new(
                "quotamesh_raft_log_fsync_duration_seconds",
                "Time to write and fsync a batch of appended entries to the group's Raft log.",
            )
            .buckets(prometheus::exponential_buckets(0.000_25, 2.0, 15).expect("valid buckets")),
            &["group"],
        )
        .expect("valid metric");
        registry.register(Box::new(raft_log_fsync_duration.clone())).expect("unique metric");
        // CPU, memory, open files and start time of this process (`process_*`, Linux only).
        #[cfg(target_os = "linux")]
        registry
            .register(Box::new(prometheus::process_collector::ProcessCollector::for_self()))
            .expect("unique metric");
        let histogram = |name: &str, help: &str, buckets: Vec<f64>| {
            let metric = Histogram::with_opts(HistogramOpts::new(name, help).buckets(buckets))
                .expect("valid metric");
            registry.register(Box::new(metric.clone())).expect("unique metric");
            metric
        };
        let counter = |name: &str, help: &str| {
            let metric = IntCounter::new(name, help).expect("valid metric");
            registry.register(Box::new(metric.clone())).expect("unique metric");
            metric
        };
        let seconds_counter = |name: &str, help: &str| {
            let metric = Counter::new(name, help).expect("valid metric");
            registry.register(Box::new(metric.clone())).expect("unique metric");
            metric
        };
        let policy_reload_failures = IntCounter::new(
            "quotamesh_policy_reload_failures_total",
            "Policy loads refused since start; the previous policy stays active.",
        )
        .expect("valid metric");
        registry.register(Box::new(policy_reload_failures.clone())).expect("unique metric");
        let clock_offset = GaugeVec::new(
            Opts::new(
                "quotamesh_clock_offset_seconds",
                "How far a node's wall clock was ahead of this leader's at its last forwarded \
                 write (negative: behind).",
            ),
            &["node"],
        )
        .expect("valid metric");
        registry.register(Box::new(clock_offset.clone())).expect("unique metric");

        let region_link_rtt = GaugeVec::new(
            Opts::new(
                "quotamesh_region_link_rtt_seconds",
                "Round-trip time of the QUIC connection to a peer region, as quinn estimates it.",
            ),
            &["region"],
        )
        .expect("valid metric");
        registry.register(Box::new(region_link_rtt.clone())).expect("unique metric");

        let stats_labels = ["domain", "key"];
        let ratelimit_stats = RateLimitStats {
            total_hits: counter_vec(
                "quotamesh_ratelimit_total_hits_total",
                "envoyproxy/ratelimit's total_hits: every hit, per domain and statistics key.",
                &stats_labels,
            ),
            over_limit: counter_vec(
                "quotamesh_ratelimit_over_limit_total",
                "envoyproxy/ratelimit's over_limit: hits past the limit.",
                &stats_labels,
            ),
            near_limit: counter_vec(
                "quotamesh_ratelimit_near_limit_total",
                "envoyproxy/ratelimit's near_limit: hits past near_limit_ratio of the limit.",
                &stats_labels,
            ),
            within_limit: counter_vec(
                "quotamesh_ratelimit_within_limit_total",
                "envoyproxy/ratelimit's within_limit: hits of admitted descriptors.",
                &stats_labels,
            ),
            shadow_mode: counter_vec(
                "quotamesh_ratelimit_shadow_mode_total",
                "envoyproxy/ratelimit's shadow_mode: hits a shadow-mode rule let through past \
                 its limit.",
                &stats_labels,
            ),
            keys_capped: counter(
                "quotamesh_ratelimit_stats_keys_capped_total",
                "Hits counted under their rule's path because the runtime-valued statistics \
                 keys reached their cap.",
            ),
            runtime_keys: Arc::new(Mutex::new(HashSet::new())),
        };

        let metrics = Self {
            ratelimit_stats,
            rls_decisions: counter_vec(
                "quotamesh_rls_decisions_total",
                "ShouldRateLimit answers by domain and overall code.",
                &["domain", "code"],
            ),
            rls_descriptor_decisions: counter_vec(
                "quotamesh_rls_descriptor_decisions_total",
                "Decisions per matched rule and code (ok, over_limit, shadow_over_limit).",
                &["domain", "rule", "code"],
            ),
            rls_shadow_blocks: counter_vec(
                "quotamesh_rls_shadow_blocks_total",
                "Hits a shadow-mode rule would have blocked (RateLimitShadowBlock events).",
                &["domain", "rule"],
            ),
            rls_warnings: counter_vec(
                "quotamesh_rls_warnings_total",
                "Descriptors a warn-stage rule (or a canary rule off its canary nodes) admitted \
                 over its limit, answered with RateLimit-Warning.",
                &["domain", "rule"],
            ),
            rls_unmatched: counter_vec(
                "quotamesh_rls_unmatched_total",
                "Descriptors answered OK because no rule applies.",
                &["reason"],
            ),
            rls_rejected_requests: counter_vec(
                "quotamesh_rls_rejected_requests_total",
                "ShouldRateLimit calls refused as invalid or because the node was overloaded.",
                &["reason"],
            ),
            rls_request_duration,
            shard_keys: gauge_vec(
                "quotamesh_shard_keys",
                "Keys tracked by each shard.",
                &["shard"],
            ),
            shard_evictions: counter_vec(
                "quotamesh_shard_evictions_total",
                "Keys dropped by a shard: pristine (no information lost) or capacity.",
                &["shard", "reason"],
            ),
            shard_cold_admissions: counter_vec(
                "quotamesh_shard_cold_admissions_total",
                "Keys created by a shard actor on their first hit.",
                &["shard"],
            ),
            policy_reloads: counter_vec(
                "quotamesh_policy_reloads_total",
                "Policy loads by result: ok, unchanged or error.",
                &["result"],
            ),
            policy_rules: gauge("quotamesh_policy_rules", "Rules in the active policy set."),
            policy_version: gauge(
                "quotamesh_policy_version",
                "The replicated policy version this node serves (quotamesh policy apply); 0 \
                 when it serves local files (--policy) or the embedded default.",
            ),
            policy_info: gauge_vec(
                "quotamesh_policy_info",
                "1, labelled with the active policy set's digest (as `quotamesh policy validate` \
                 prints it); equal on nodes serving the same policy.",
                &["digest"],
            ),
            policy_reload_failures,
            grpc_server_handled: counter_vec(
                "quotamesh_grpc_server_handled_total",
                "gRPC calls this node served, by service, method and status code.",
                &["service", "method", "code"],
            ),
            grpc_server_handling,
            grpc_server_in_flight: gauge_vec(
                "quotamesh_grpc_server_in_flight_requests",
                "gRPC calls this node is serving, by service and method.",
                &["service", "method"],
            ),
            rate_limit_bypassed: counter_vec(
                "quotamesh_rate_limit_bypassed_total",
                "Admitted decisions paid from the local fallback instead of a ledger lease.",
                &["reason"],
            ),
            rate_limit_failed_closed: counter(
                "quotamesh_rate_limit_failed_closed_total",
                "Decisions a fail-closed rule denied because no lease could be had.",
            ),
            lease_asks: counter_vec(
                "quotamesh_lease_asks_total",
                "Per-key lease requests: queued for the broker, or refused at once.",
                &["result"],
            ),
            lease_size: histogram(
                "quotamesh_lease_size_tokens",
                "Tokens per lease grant.",
                vec![0.0, 1.0, 5.0, 10.0, 25.0, 50.0, 100.0, 250.0, 500.0, 1_000.0, 10_000.0],
            ),
            lease_credited_tokens: counter(
                "quotamesh_lease_credited_tokens_total",
                "Tokens the ledger credited back from this node's settlements.",
            ),
            lease_charged_tokens: counter(
                "quotamesh_lease_charged_tokens_total",
                "Tokens admitted beyond leases (credit, fallback) charged to the ledger.",
            ),
            rls_shadow_events_dropped: counter(
                "quotamesh_rls_shadow_events_dropped_total",
                "RateLimitShadowBlock events not written to the shadow events file (its queue \
                 full, or the disk failing).",
            ),
            lease_credit_admissions: counter(
                "quotamesh_lease_credit_admissions_total",
                "Decisions admitted on credit, charged by the key's next report.",
            ),
            lease_waits: counter(
                "quotamesh_lease_waits_total",
                "Decisions that waited for a key's lease from the ledger.",
            ),
            lease_held_tokens: gauge_vec(
                "quotamesh_lease_held_tokens",
                "Leased tokens this node holds per rule at the last sweep.",
                &["domain", "rule"],
            ),
            lease_drift_bound_tokens: gauge_vec(
                "quotamesh_lease_drift_bound_tokens",
                "Bound on tokens outside the ledger per key: every node's lease and credit, plus \
                 the fallback allowance while the circuit is not closed.",
                &["domain", "rule"],
            ),
            ledger_calls: counter_vec(
                "quotamesh_ledger_calls_total",
                "Batched lease calls to the quota ledger by result: ok, slow, timeout, error.",
                &["result"],
            ),
            ledger_call_duration: histogram(
                "quotamesh_ledger_call_duration_seconds",
                "Latency of batched lease calls to the quota ledger.",
                vec![
                    0.000_25, 0.000_5, 0.001, 0.002, 0.003, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25,
                    0.5, 1.0, 2.5,
                ],
            ),
            ledger_circuit_state: gauge(
                "quotamesh_ledger_circuit_state",
                "Circuit breaker around ledger calls: 0 closed, 1 half-open, 2 open.",
            ),
            ledger_circuit_opened: counter(
                "quotamesh_ledger_circuit_opened_total",
                "Times the circuit breaker around ledger calls opened.",
            ),
            ledger_circuit_open_seconds: seconds_counter(
                "quotamesh_ledger_circuit_open_seconds_total",
                "Time the circuit breaker around ledger calls spent open, added as it leaves \
                 open.",
            ),
            ledger_stalled_seconds: seconds_counter(
                "quotamesh_ledger_stalled_seconds_total",
                "Time during which a ledger call judged slow was outstanding, from the oldest \
                 one's start, added when the last of them ends.",
            ),
            region_slice_tokens: gauge_vec(
                "quotamesh_region_slice_tokens",
                "A region's slice of a global limit (tokens per window): this region's from its \
                 ledger, a peer region's as it last reported.",
                &["region", "rule"],
            ),
            region_in_flight_tokens: gauge_vec(
                "quotamesh_region_in_flight_tokens",
                "Tokens this region debited from its slice and has not settled with the \
                 recipient region.",
                &["rule"],
            ),
            region_demand_tokens: gauge_vec(
                "quotamesh_region_demand_tokens",
                "This region's demand on a global limit over the observation window, in tokens \
                 per window of the limit.",
                &["rule"],
            ),
            region_transfers: counter_vec(
                "quotamesh_region_transfers_total",
                "Transfer steps of the rebalancer by result: debited, credited, returned, \
                 refused, failed.",
                &["result"],
            ),
            region_link_up: gauge_vec(
                "quotamesh_region_link_up",
                "1 while a QUIC connection to the peer region is open.",
                &["region"],
            ),
            region_link_rtt,
            region_calls: counter_vec(
                "quotamesh_region_calls_total",
                "Calls to a peer region that got a reply (one request and one reply message                  each).",
                &["region"],
            ),
            region_sent_bytes: counter_vec(
                "quotamesh_region_sent_bytes_total",
                "Request bytes of calls to a peer region (messages only, without QUIC, TLS                  and UDP overhead).",
                &["region"],
            ),
            region_received_bytes: counter_vec(
                "quotamesh_region_received_bytes_total",
                "Reply bytes of calls to a peer region (messages only).",
                &["region"],
            ),
            region_connections_refused: counter(
                "quotamesh_region_connections_refused_total",
                "QUIC connections the region endpoint refused: a certificate of another CA, a                  gateway's, or one naming a region that is not a peer.",
            ),
            region_leading: gauge(
                "quotamesh_region_leading",
                "1 while this node's rebalancer runs: it leads a quota group with [[regions]].",
            ),
            clock_offset,
            clock_offset_exceeded: counter_vec(
                "quotamesh_clock_offset_exceeded_total",
                "Forwarded writes whose proposer's clock differed from this leader's by more \
                 than max_clock_offset_ms; they were stamped with the leader's time.",
                &["node"],
            ),
            raft_term: gauge_vec(
                "quotamesh_raft_term",
                "The Raft group's current term.",
                &["group"],
            ),
            raft_leader_id: gauge_vec(
                "quotamesh_raft_leader_id",
                "The group's leader as this node knows it; -1 for none.",
                &["group"],
            ),
            raft_role: gauge_vec(
                "quotamesh_raft_role",
                "1 for this node's role in the group, 0 for the other roles.",
                &["group", "role"],
            ),
            raft_last_log_index: gauge_vec(
                "quotamesh_raft_last_log_index",
                "The last entry in this node's log of the group; -1 for none.",
                &["group"],
            ),
            raft_committed_index: gauge_vec(
                "quotamesh_raft_committed_index",
                "The last entry of the group this node knows committed; -1 for none.",
                &["group"],
            ),
            raft_applied_index: gauge_vec(
                "quotamesh_raft_applied_index",
                "The last entry of the group applied on this node; -1 for none.",
                &["group"],
            ),
            raft_snapshot_index: gauge_vec(
                "quotamesh_raft_snapshot_index",
                "The last entry in this node's snapshot of the group; -1 for none.",
                &["group"],
            ),
            raft_replication_lag: gauge_vec(
                "quotamesh_raft_replication_lag_entries",
                "On the leader: entries of the group a follower still lacks.",
                &["group", "follower"],
            ),
            raft_storage_errors: counter_vec(
                "quotamesh_raft_storage_errors_total",
                "Times the group stopped on this node on a storage (or other fatal) error.",
                &["group"],
            ),
            raft_log_fsync_duration,
            billing_operations: counter_vec(
                "quotamesh_billing_operations_total",
                "Billing operations answered, by outcome.",
                &["outcome"],
            ),
            build_info: gauge_vec(
                "quotamesh_build_info",
                "1, labelled with the version and git commit of the running binary.",
                &["version", "commit"],
            ),
            insecure_cluster: gauge(
                "quotamesh_insecure_cluster",
                "1 when this node serves a multi-node region's Raft port without TLS.",
            ),
            registry,
        };
        // Every label known in advance is exported at 0 from the start, so dashboards and
        // alerts see the series before the first event.
        for reason in BYPASS_REASONS {
            metrics.rate_limit_bypassed.with_label_values(&[reason]);
        }
        for result in ["queued", "refused"] {
            metrics.lease_asks.with_label_values(&[result]);
        }
        for result in ["ok", "slow", "timeout", "error"] {
            metrics.ledger_calls.with_label_values(&[result]);
        }
        for result in REGION_TRANSFER_RESULTS {
            metrics.region_transfers.with_label_values(&[result]);
        }
        for outcome in BILLING_OUTCOMES {
            metrics.billing_operations.with_label_values(&[outcome]);
        }
        for result in ["ok", "unchanged", "error"] {
            metrics.policy_reloads.with_label_values(&[result]);
        }
        metrics.build_info.with_label_values(&[VERSION, COMMIT]).set(1);
        let unknown = (UNKNOWN.to_owned(), UNKNOWN.to_owned());
        for (service, method) in known_methods().iter().chain([&unknown]) {
            metrics.grpc_server_in_flight.with_label_values(&[service, method]);
            metrics.grpc_server_handling.with_label_values(&[service, method]);
            for (_, code) in CODES {
                metrics.grpc_server_handled.with_label_values(&[service, method, code]);
            }
        }
        metrics
    }

    /// The `key` label of upstream's statistics for `key` in `domain`: `key` itself when it
    /// is the rule's own `path` (bounded by the policy) or one of the first
    /// [`STATS_KEYS_MAX`] runtime-valued keys, else `path` (counted as capped).
    pub fn stats_key_label<'k>(&self, domain: &str, key: &'k str, path: &'k str) -> Cow<'k, str> {
        if key == path {
            return Cow::Borrowed(key);
        }
        let stats = &self.ratelimit_stats;
        let mut known = stats.runtime_keys.lock();
        let pair = (Box::from(domain), Box::from(key));
        if known.contains(&pair) {
            return Cow::Borrowed(key);
        }
        if known.len() < STATS_KEYS_MAX {
            known.insert(pair);
            return Cow::Borrowed(key);
        }
        drop(known);
        stats.keys_capped.inc();
        Cow::Borrowed(path)
    }

    /// Shows `digest` as the active policy's in `quotamesh_policy_info`, replacing the last.
    pub fn set_policy_digest(&self, digest: u64) {
        self.policy_info.reset();
        self.policy_info.with_label_values(&[&format!("{digest:016x}")]).set(1);
    }

    /// The Prometheus text exposition of every metric.
    pub fn encode(&self) -> String {
        let mut buffer = Vec::new();
        // Encoding into a Vec cannot fail: the only errors are IO errors of the writer.
        if TextEncoder::new().encode(&self.registry.gather(), &mut buffer).is_err() {
            return String::new();
        }
        String::from_utf8(buffer).unwrap_or_default()
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    /// Every metric registers under a unique, well-formed name and appears in the output.
    #[test]
    fn metrics_register_and_encode() {
        let metrics = Metrics::new();
        metrics.rls_decisions.with_label_values(&["d", "ok"]).inc();
        metrics.policy_rules.set(3);
        let text = metrics.encode();
        assert!(
            text.contains("quotamesh_rls_decisions_total{code=\"ok\",domain=\"d\"} 1"),
            "{text}"
        );
        assert!(text.contains("quotamesh_policy_rules 3"), "{text}");
    }

    /// The series operators expect exist before the first event: process metrics, build
    /// info, every served gRPC method's codes at 0, the policy digest as a label.
    #[test]
    fn known_series_are_exported_from_the_start() {
        let metrics = Metrics::new();
        metrics.set_policy_digest(0x00ab_cdef_0123_4567);
        metrics.set_policy_digest(0x0123_4567_89ab_cdef);
        let text = metrics.encode();
        assert!(text.contains("process_resident_memory_bytes"), "{text}");
        assert!(text.contains("process_cpu_seconds_total"), "{text}");
        assert!(
            text.contains(&format!(
                "quotamesh_build_info{{commit=\"{COMMIT}\",version=\"{VERSION}\"}} 1"
            )),
            "{text}"
        );
        assert!(text.contains("quotamesh_policy_info{digest=\"0123456789abcdef\"} 1"), "{text}");
        assert!(!text.contains("00abcdef01234567"), "only the active digest: {text}");
        assert!(
            text.contains(
                "quotamesh_grpc_server_handled_total{code=\"UNAVAILABLE\",\
                 method=\"ShouldRateLimit\",service=\"envoy.service.ratelimit.v3.\
                 RateLimitService\"} 0"
            ),
            "{text}"
        );
        assert!(text.contains("quotamesh_ledger_calls_total{result=\"timeout\"} 0"), "{text}");
    }
}
