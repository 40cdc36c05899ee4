//! Envoy Rate Limit Service v3: `ShouldRateLimit`.
//!
//! ```text
//! request ─▶ validate ─▶ match each descriptor (policy) ─▶ probes ─▶ ShardSet::decide
//!                                                                        │
//! response ◀─ statuses + RateLimit headers ◀──────────────────────────────┘
//! ```
//!
//! Semantics follow envoyproxy/ratelimit so Envoy configs and policies carry over: an
//! unknown domain or a descriptor without a rule answers OK; the request's `hits_addend` 0
//! means 1, and a descriptor's own `hits_addend` beats the request's, where 0 checks without
//! consuming (OVER_LIMIT when nothing is left); the request is OVER_LIMIT when any enforced
//! descriptor is, except that quota-mode descriptors make it OVER_LIMIT only when all of them
//! are; a rule's rollout stage decides what its refusal does (shadow: counted and reported,
//! answer OK; warn, and a canary rule off its canary nodes: answer OK with
//! `RateLimit-Warning`; enforce: OVER_LIMIT); a limit named in another
//! matched limit's `replaces` is skipped; a `share_threshold` level counts under its
//! wildcard pattern; the `metadata` of rules that admitted their descriptor comes back in
//! `dynamic_metadata`, shaped as upstream's; upstream's per-descriptor statistics are
//! counted (`crate::core::hit_stats`). Unlike a Redis counter, a rejected request consumes
//! nothing on any descriptor.

use std::borrow::Cow;
use std::sync::Arc;

use arc_swap::ArcSwap;
use smallvec::{SmallVec, smallvec};
use tonic::Status;

use crate::actors::shard::{Decision, Deferred, LedgerName, Probe, ProbeCounter, ShardSet};
use crate::api::proto::envoy::extensions::common::ratelimit::v3::RateLimitDescriptor;
use crate::api::proto::envoy::extensions::common::ratelimit::v3::rate_limit_descriptor::RateLimitOverride;
use crate::api::proto::envoy::service::ratelimit::v3::RateLimitRequest;
use crate::api::proto::envoy::service::ratelimit::v3::rate_limit_response::Code;
use crate::api::proto::envoy::service::ratelimit::v3::rate_limit_response::rate_limit::Unit as ProtoUnit;
use crate::api::proto::envoy::r#type::v3::RateLimitUnit;
use crate::api::rls_wire::{CurrentLimit, RlsAnswer, StatusAnswer};
use crate::api::rule_metrics::{
    DescriptorCode, DomainCounters, ResolvedRules, RuleCounters, RuleMetrics,
};
use crate::api::shadow_events::ShadowSink;
use crate::api::status::InvalidRequest;
use crate::core::admission::Verdict;
use crate::core::headers::{HeaderOptions, LimitReport, Warning, emit_headers, push_warning};
use crate::core::hit_stats::{HitCounts, NEAR_LIMIT_RATIO_PERMILLE_DEFAULT, classify};
use crate::core::lease::LeaseTuning;
use crate::core::policy::FailureMode;
use crate::core::policy::{Entry, Match, PolicySet, Rule, RuleLimit, Stage, Unit};
use crate::core::rate::LimitSpec;
use crate::core::shadow_report::{DescriptorEntry, SHADOW_BLOCK_EVENT, ShadowEvent};
use crate::metrics::{Metrics, STATS_KEY_OVERRIDE};

/// Most descriptors in one request.
pub const DESCRIPTORS_MAX: usize = 64;
/// Most entries in one descriptor.
pub const ENTRIES_MAX: usize = 64;
/// Longest domain, entry key or entry value.
pub const FIELD_BYTES_MAX: usize = 1024;
/// Largest request accepted: tonic refuses a larger one before decoding it, and the client
/// gets `RESOURCE_EXHAUSTED` (`crate::api::grpc_limits`).
pub const REQUEST_BYTES_MAX: usize = 1024 * 1024;

/// Lease settings of a request's own `limit` override, which names no rule.
static DEFAULT_LEASE: LeaseTuning = LeaseTuning::DESIGN;

/// The `ShouldRateLimit` service.
#[derive(Clone)]
pub struct RlsService {
    shards: Arc<ShardSet>,
    policy: Arc<ArcSwap<PolicySet>>,
    metrics: Metrics,
    /// The active policy's rule counters, resolved once per policy.
    rule_metrics: Arc<RuleMetrics>,
    headers: HeaderOptions,
    near_limit_ratio_permille: u64,
    /// Where shadow rules' would-be rejections go as events, with this node's id.
    shadow_events: Option<(ShadowSink, Arc<str>)>,
}

/// Each descriptor's own `limit` (`None` without one), or nothing when no descriptor has
/// one: almost no request does.
#[derive(Default)]
struct Overrides(SmallVec<[Option<RuleLimit>; 1]>);

impl Overrides {
    fn new() -> Self {
        Self::default()
    }

    /// The override of each descriptor in order, then `None` forever.
    fn each(&self) -> impl Iterator<Item = Option<&RuleLimit>> {
        self.0.iter().map(Option::as_ref).chain(std::iter::repeat(None))
    }
}

impl FromIterator<Option<RuleLimit>> for Overrides {
    fn from_iter<I: IntoIterator<Item = Option<RuleLimit>>>(items: I) -> Self {
        Self(items.into_iter().collect())
    }
}
/// What each descriptor of a request asks for.
type Plans<'p> = SmallVec<[Plan<'p>; 4]>;
/// The probes of a request's descriptors with limits: most requests have one or two.
type Probes<'p> = SmallVec<[Probe<'p>; 2]>;

/// What a request's descriptors are matched against.
#[derive(Clone, Copy)]
struct Matched<'p> {
    policy: &'p PolicySet,
    rule_counters: &'p ResolvedRules,
    overrides: &'p Overrides,
}

/// Whether matching a request counts its misses and rejections: once per request.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
enum Counting {
    On,
    Off,
}

/// What one descriptor of a request asks for.
enum Plan<'p> {
    /// No rule applies (unknown domain, no match, or every limit replaced): OK.
    Unmatched,
    /// The matched rule is `unlimited`: OK with the maximum remaining.
    Unlimited,
    /// Limits to check; `probe` indexes the probes handed to the shards.
    Limited { rule: RuleView<'p>, limits: SmallVec<[&'p RuleLimit; 2]>, probe: usize },
}

/// The parts of a rule the response needs; an override has no configured rule.
struct RuleView<'p> {
    path: &'p str,
    /// What a refusal by this rule does on this node.
    stage: Stage,
    /// The rule's `enforce_after` day, told to warned callers.
    enforce_after: Option<&'p str>,
    /// Upstream's statistics key (without the domain), the rule's path unless runtime
    /// values name it (`detailed_metric`, `value_to_metric`, an override).
    stats_key: Cow<'p, str>,
    metadata: Option<&'p serde_json::Map<String, serde_json::Value>>,
    /// The rule's resolved counters; `None` for an override, which names no rule.
    counters: Option<&'p RuleCounters>,
}

impl RlsService {
    /// A service deciding from `shards` under the policy currently in `policy`.
    pub fn new(
        shards: Arc<ShardSet>,
        policy: Arc<ArcSwap<PolicySet>>,
        metrics: Metrics,
        headers: HeaderOptions,
    ) -> Self {
        Self {
            shards,
            policy,
            rule_metrics: Arc::new(RuleMetrics::new(metrics.clone())),
            metrics,
            headers,
            near_limit_ratio_permille: NEAR_LIMIT_RATIO_PERMILLE_DEFAULT,
            shadow_events: None,
        }
    }

    /// Writes each request a shadow rule would have refused to `sink`, as the node
    /// `node_id` decided it.
    #[must_use]
    pub fn with_shadow_events(mut self, sink: ShadowSink, node_id: &str) -> Self {
        self.shadow_events = Some((sink, Arc::from(node_id)));
        self
    }

    /// The share of a limit past which hits count as `near_limit` in the statistics, in
    /// thousandths (upstream's `NEAR_LIMIT_RATIO`, 0.8 by default).
    #[must_use]
    pub fn with_near_limit_ratio_permille(mut self, permille: u64) -> Self {
        self.near_limit_ratio_permille = permille.min(1_000);
        self
    }

    /// Decides one request at `now_ms`.
    ///
    /// # Errors
    /// `INVALID_ARGUMENT` for malformed requests, `UNAVAILABLE` when the shards cannot
    /// decide (overload).
    pub async fn decide(
        &self,
        request: &RateLimitRequest,
        now_ms: u64,
    ) -> Result<Box<RlsAnswer>, Status> {
        match self.decide_from_memory(request, now_ms) {
            Ok(answer) => answer,
            // Keys to create or a lease to wait for: the waiting path, its future boxed, so
            // every other request's stays small (it is moved whole, and async_trait boxes it).
            Err(deferred) => Box::pin(self.decide_waiting(request, now_ms, deferred)).await,
        }
    }

    /// Decides a request in one pass over the shards' memory, as almost every request is;
    /// hands back the ones that must wait, with what the pass found.
    fn decide_from_memory(
        &self,
        request: &RateLimitRequest,
        now_ms: u64,
    ) -> Result<Result<Box<RlsAnswer>, Status>, Deferred> {
        if let Err(invalid) = validate(request) {
            self.metrics.rls_rejected_requests.with_label_values(&[invalid.reason_label()]).inc();
            return Ok(Err(invalid.into()));
        }
        let policy = self.policy.load();
        let rule_counters = self.rule_metrics.of(&policy);
        let overrides = match self.overrides(&policy, request, Counting::On) {
            Ok(overrides) => overrides,
            Err(status) => return Ok(Err(status)),
        };
        let (mut plans, mut probes) = (Plans::new(), Probes::new());
        let matched =
            Matched { policy: &policy, rule_counters: &rule_counters, overrides: &overrides };
        self.prepare(request, matched, Counting::On, &mut plans, &mut probes);
        let decision = if probes.is_empty() {
            Decision::without_limits()
        } else {
            self.shards.decide_now(&probes, now_ms)?
        };
        let domain_counters = rule_counters.domain(&request.domain);
        Ok(Ok(self.respond(request, domain_counters, &plans, &decision, &probes, now_ms)))
    }

    /// Finishes a request [`RlsService::decide_from_memory`] deferred: the same probes
    /// again (its counts already taken), then the shards' waiting path.
    async fn decide_waiting(
        &self,
        request: &RateLimitRequest,
        now_ms: u64,
        deferred: Deferred,
    ) -> Result<Box<RlsAnswer>, Status> {
        let policy = self.policy.load();
        let rule_counters = self.rule_metrics.of(&policy);
        let overrides = self.overrides(&policy, request, Counting::Off)?;
        let (mut plans, mut probes) = (Plans::new(), Probes::new());
        let matched =
            Matched { policy: &policy, rule_counters: &rule_counters, overrides: &overrides };
        self.prepare(request, matched, Counting::Off, &mut plans, &mut probes);
        let decision = if probes.is_empty() {
            Decision::without_limits()
        } else {
            self.shards.decide_deferred(&probes, now_ms, deferred).await?
        };
        let domain_counters = rule_counters.domain(&request.domain);
        Ok(self.respond(request, domain_counters, &plans, &decision, &probes, now_ms))
    }

    /// Each descriptor's own `limit`, validated. `Counting::Off` leaves the rejection
    /// counters alone, for a request matched a second time.
    fn overrides(
        &self,
        policy: &PolicySet,
        request: &RateLimitRequest,
        counting: Counting,
    ) -> Result<Overrides, Status> {
        // Almost no request carries its own limit: nothing to build or move then.
        if request.descriptors.iter().all(|descriptor| descriptor.limit.is_none()) {
            return Ok(Overrides::new());
        }
        let domain = request.domain.as_str();
        let overrides = request
            .descriptors
            .iter()
            .enumerate()
            .map(|(index, descriptor)| override_limit(policy, domain, index, descriptor))
            .collect::<Result<Overrides, _>>()
            .inspect_err(|invalid| {
                if counting == Counting::On {
                    self.metrics
                        .rls_rejected_requests
                        .with_label_values(&[invalid.reason_label()])
                        .inc();
                }
            })?;
        Ok(overrides)
    }

    /// Matches a valid request's descriptors into `plans` (what each asks for) and `probes`
    /// (those with limits), filled in place: they are large, and moving them would copy
    /// them. `Counting::Off` leaves the miss counters alone, for a request matched a second
    /// time.
    fn prepare<'p>(
        &self,
        request: &'p RateLimitRequest,
        Matched { policy, rule_counters, overrides }: Matched<'p>,
        counting: Counting,
        plans: &mut Plans<'p>,
        probes: &mut Probes<'p>,
    ) {
        let domain = request.domain.as_str();

        // Requests carry a few descriptors: keep the per-request bookkeeping on the stack.
        let matched: SmallVec<[Option<&Rule>; 4]> = request
            .descriptors
            .iter()
            .zip(overrides.each())
            .map(|(descriptor, overridden)| match overridden {
                Some(_) => None,
                None => self.matched_rule(policy, domain, descriptor, counting),
            })
            .collect();
        // Almost no rule replaces another's limits: nothing to gather then.
        let replaced: SmallVec<[&str; 4]> =
            if matched.iter().flatten().all(|rule| rule.replaces.is_empty()) {
                SmallVec::new()
            } else {
                matched
                    .iter()
                    .flatten()
                    .flat_map(|rule| rule.replaces.iter().map(String::as_str))
                    .collect()
            };

        for ((descriptor, overridden), rule) in
            request.descriptors.iter().zip(overrides.each()).zip(&matched)
        {
            let (view, limits): (RuleView<'_>, SmallVec<[&RuleLimit; 2]>) = match (overridden, rule)
            {
                (Some(limit), _) => {
                    let view = RuleView {
                        path: "override",
                        stage: Stage::Enforce,
                        enforce_after: None,
                        stats_key: Cow::Owned(descriptor_key(descriptor)),
                        metadata: None,
                        counters: None,
                    };
                    (view, smallvec![limit])
                }
                (None, Some(rule)) if rule.unlimited => {
                    plans.push(Plan::Unlimited);
                    continue;
                }
                (None, Some(rule)) => {
                    let kept = rule
                        .limits
                        .iter()
                        .filter(|limit| {
                            limit.name.as_deref().is_none_or(|name| !replaced.contains(&name))
                        })
                        .collect();
                    let view = RuleView {
                        path: &rule.path,
                        stage: rule.stage,
                        enforce_after: rule.enforce_after.as_deref(),
                        stats_key: rule.stats_key(|level| {
                            descriptor.entries.get(level).map(|entry| entry.value.as_str())
                        }),
                        metadata: rule.metadata.as_ref(),
                        counters: rule_counters.rule(rule.id),
                    };
                    (view, kept)
                }
                (None, None) => {
                    plans.push(Plan::Unmatched);
                    continue;
                }
            };
            if limits.is_empty() {
                plans.push(Plan::Unmatched);
                continue;
            }
            let (hits, check_only) = hits_of(request, descriptor);
            // A `share_threshold` level counts under its pattern, whatever value matched it.
            let entries: SmallVec<[(&str, &str); 4]> = descriptor
                .entries
                .iter()
                .enumerate()
                .map(|(level, entry)| {
                    let value = match rule {
                        Some(rule) if overridden.is_none() => {
                            rule.counter_value(level, entry.value.as_str())
                        }
                        _ => entry.value.as_str(),
                    };
                    (entry.key.as_str(), value)
                })
                .collect();
            let hash = self.shards.hash_descriptor(domain, entries.iter().copied());
            let counters = limits
                .iter()
                .copied()
                .enumerate()
                .map(|(index, limit)| ProbeCounter {
                    key: self.shards.counter_of(&hash, index, &limit.spec),
                    spec: &limit.spec,
                    ledger_spec: &limit.policy_spec,
                })
                .collect();
            let (lease, failure_mode, rule_id, quota_mode) = match (overridden, rule) {
                (None, Some(rule)) => {
                    (&rule.lease, rule.failure_mode, Some(rule.id), rule.quota_mode)
                }
                _ => (&DEFAULT_LEASE, FailureMode::default(), None, false),
            };
            probes.push(Probe {
                stripe: self.shards.stripe_of(&hash),
                counters,
                hits,
                check_only,
                enforced: view.stage == Stage::Enforce,
                quota_mode,
                lease,
                failure_mode,
                rule: rule_id,
                name: LedgerName { domain, entries },
            });
            plans.push(Plan::Limited { rule: view, limits, probe: probes.len() - 1 });
        }
    }

    /// The rule a descriptor matches, counting the misses.
    fn matched_rule<'p>(
        &self,
        policy: &'p PolicySet,
        domain: &str,
        descriptor: &RateLimitDescriptor,
        counting: Counting,
    ) -> Option<&'p Rule> {
        let entries: SmallVec<[Entry<'_>; 4]> = descriptor
            .entries
            .iter()
            .map(|entry| Entry { key: &entry.key, value: &entry.value })
            .collect();
        match policy.match_descriptor(domain, &entries) {
            Match::Rule(rule) => Some(rule),
            Match::DomainNotFound => {
                if counting == Counting::On {
                    self.rule_metrics.unmatched_domain.inc();
                }
                None
            }
            Match::NoRule => {
                if counting == Counting::On {
                    self.rule_metrics.unmatched_rule.inc();
                }
                None
            }
        }
    }

    fn respond(
        &self,
        request: &RateLimitRequest,
        domain_counters: &DomainCounters,
        plans: &[Plan<'_>],
        decision: &Decision,
        probes: &[Probe<'_>],
        now_ms: u64,
    ) -> Box<RlsAnswer> {
        let domain = request.domain.as_str();
        let domain_label = &*domain_counters.label;
        let mut metadata: Option<serde_json::Map<String, serde_json::Value>> = None;
        // Boxed from the start and filled in place: the answer passes through several
        // futures on its way to the wire, where a pointer moves cheaper than its statuses and
        // header fields, and nothing built beside it is moved into it.
        let mut answer =
            Box::new(RlsAnswer::new(if decision.admitted { Code::Ok } else { Code::OverLimit }));
        let statuses = &mut answer.statuses;
        statuses.reserve(plans.len());
        let mut reports: SmallVec<[LimitReport<'_>; 4]> = SmallVec::new();
        let mut retry_after_ms: Option<u64> = None;
        let mut warning: Option<Warning<'_>> = None;
        for (plan, descriptor) in plans.iter().zip(&request.descriptors) {
            let (rule, limits, probe) = match plan {
                Plan::Unmatched => {
                    statuses.push(StatusAnswer::ok(0));
                    continue;
                }
                Plan::Unlimited => {
                    statuses.push(StatusAnswer::ok(u32::MAX));
                    continue;
                }
                Plan::Limited { rule, limits, probe } => (rule, limits, *probe),
            };
            let outcome = &decision.outcomes[probe];
            let counted_hits = if probes[probe].check_only { 0 } else { probes[probe].hits };
            let evaluations = remaining_as_answered(
                &outcome.verdicts,
                limits,
                // A check's verdicts already include its untaken hit.
                probes[probe].check_only || (decision.admitted && outcome.admitted),
                probes[probe].hits,
            );
            let shown = shown_limit(&evaluations, outcome.admitted);
            self.count_hits(domain_label, rule, limits[shown], &evaluations[shown], counted_hits);
            if outcome.admitted
                && let Some(rule_metadata) = rule.metadata
            {
                merge_json(metadata.get_or_insert_with(serde_json::Map::new), rule_metadata);
            }
            let code = if outcome.admitted || rule.stage != Stage::Enforce {
                Code::Ok
            } else {
                Code::OverLimit
            };
            let descriptor_code = match (outcome.admitted, rule.stage) {
                (true, _) => DescriptorCode::Ok,
                (false, Stage::Shadow) => DescriptorCode::ShadowOverLimit,
                (false, Stage::Warn) => DescriptorCode::WarnOverLimit,
                (false, Stage::Enforce) => DescriptorCode::OverLimit,
            };
            match rule.counters {
                Some(counters) => counters.count_decision(descriptor_code),
                None => self
                    .metrics
                    .rls_descriptor_decisions
                    .with_label_values(&[domain_label, rule.path, descriptor_code.label()])
                    .inc(),
            }
            if rule.stage == Stage::Warn && !outcome.admitted {
                match rule.counters {
                    Some(counters) => counters.warnings.inc(),
                    None => self
                        .metrics
                        .rls_warnings
                        .with_label_values(&[domain_label, rule.path])
                        .inc(),
                }
                let over_permille = Some(outcome.over_permille).filter(|over| *over != u64::MAX);
                let this = Warning { over_permille, enforce_after: rule.enforce_after };
                warning = Some(warning.map_or(this, |earlier| earlier.merge(this)));
            }
            if rule.stage == Stage::Shadow {
                if !outcome.admitted {
                    match rule.counters {
                        Some(counters) => counters.shadow_blocks.inc(),
                        None => self
                            .metrics
                            .rls_shadow_blocks
                            .with_label_values(&[domain_label, rule.path])
                            .inc(),
                    }
                    tracing::debug!(
                        event = SHADOW_BLOCK_EVENT,
                        domain,
                        rule = rule.path,
                        "shadow-mode rule would have blocked"
                    );
                    if let Some((sink, node)) = &self.shadow_events {
                        sink.record(ShadowEvent {
                            event: SHADOW_BLOCK_EVENT.to_owned(),
                            time_ms: now_ms,
                            time: crate::core::rfc3339::format_epoch_ms(now_ms),
                            node: node.to_string(),
                            domain: domain.to_owned(),
                            rule: rule.path.to_owned(),
                            descriptor: descriptor
                                .entries
                                .iter()
                                .map(|entry| DescriptorEntry {
                                    key: entry.key.clone(),
                                    value: entry.value.clone(),
                                })
                                .collect(),
                            hits: probes[probe].hits,
                        });
                    }
                }
            } else {
                for (limit, evaluation) in limits.iter().zip(&evaluations) {
                    reports.push(report(limit, evaluation));
                    // A warned caller is admitted: nothing to wait for.
                    if !evaluation.admitted && rule.stage == Stage::Enforce {
                        let wait_ms = if evaluation.retry_after_ms == u64::MAX {
                            evaluation.reset_ms
                        } else {
                            evaluation.retry_after_ms
                        };
                        retry_after_ms = Some(retry_after_ms.unwrap_or(0).max(wait_ms));
                    }
                }
            }
            let (limit, evaluation) = (limits[shown], &evaluations[shown]);
            statuses.push(StatusAnswer {
                code,
                current_limit: Some(current_limit(limit)),
                limit_remaining: u32::try_from(evaluation.remaining).unwrap_or(u32::MAX),
                reset_seconds: Some(whole_seconds_of_ms(evaluation.reset_ms)),
            });
        }
        domain_counters.count_answer(decision.admitted);
        let retry_after_ms = if decision.admitted { None } else { retry_after_ms };
        emit_headers(&reports, retry_after_ms, self.headers, &mut answer.headers);
        if let Some(warning) = warning {
            answer.headers.push_with("ratelimit-warning", |out| push_warning(out, warning));
        }
        answer.dynamic_metadata = metadata.map(|metadata| dynamic_metadata(request, metadata));
        answer
    }

    /// Upstream's statistics for one descriptor: its hits classified against the limit
    /// it was answered with, under its statistics key (capped, `Metrics::stats_key_label`).
    fn count_hits(
        &self,
        domain_label: &str,
        rule: &RuleView<'_>,
        limit: &RuleLimit,
        verdict: &Verdict,
        hits: u64,
    ) {
        let counts = classify(
            limit.spec.capacity_tokens(),
            verdict.remaining,
            hits,
            verdict.admitted,
            self.near_limit_ratio_permille,
        );
        let HitCounts { total, over_limit, near_limit, within_limit } = counts;
        let shadow_mode = if rule.stage == Stage::Shadow && over_limit > 0 { hits } else { 0 };
        // A rule's own path: its resolved handles; a key named by runtime values or an
        // override: the vectors, under the capped key label.
        if let Some(counters) = rule.counters.filter(|_| rule.stats_key == rule.path) {
            let stats = &counters.stats;
            stats.total_hits.inc_by(total);
            stats.over_limit.inc_by(over_limit);
            stats.near_limit.inc_by(near_limit);
            stats.within_limit.inc_by(within_limit);
            stats.shadow_mode.inc_by(shadow_mode);
            return;
        }
        let fallback = if rule.path == "override" { STATS_KEY_OVERRIDE } else { rule.path };
        let key = self.metrics.stats_key_label(domain_label, &rule.stats_key, fallback);
        let labels = [domain_label, key.as_ref()];
        let stats = &self.metrics.ratelimit_stats;
        stats.total_hits.with_label_values(&labels).inc_by(total);
        stats.over_limit.with_label_values(&labels).inc_by(over_limit);
        stats.near_limit.with_label_values(&labels).inc_by(near_limit);
        stats.within_limit.with_label_values(&labels).inc_by(within_limit);
        if shadow_mode > 0 {
            stats.shadow_mode.with_label_values(&labels).inc_by(shadow_mode);
        }
    }
}

/// Upstream's statistics key of a request's own `limit` override: `key` or `key_value` per
/// entry, from the runtime values.
fn descriptor_key(descriptor: &RateLimitDescriptor) -> String {
    let mut key = String::new();
    for entry in &descriptor.entries {
        if !key.is_empty() {
            key.push('.');
        }
        key.push_str(&entry.key);
        if !entry.value.is_empty() {
            key.push('_');
            key.push_str(&entry.value);
        }
    }
    key
}

/// Merges a rule's `metadata` into what earlier rules gave, as upstream does: a key already
/// present keeps its value, unless both are mappings, which merge in turn.
fn merge_json(
    into: &mut serde_json::Map<String, serde_json::Value>,
    from: &serde_json::Map<String, serde_json::Value>,
) {
    for (key, value) in from {
        match into.get_mut(key) {
            None => {
                into.insert(key.clone(), value.clone());
            }
            Some(serde_json::Value::Object(existing)) => {
                if let serde_json::Value::Object(more) = value {
                    merge_json(existing, more);
                }
            }
            Some(_) => {}
        }
    }
}

/// The response's dynamic metadata, shaped as upstream's: the domain, the descriptors
/// (entries as `key=value`, a descriptor's own `hitsAddend`), the request's `hitsAddend`
/// when set, and the merged `metadata` of the rules that admitted their descriptors.
fn dynamic_metadata(
    request: &RateLimitRequest,
    metadata: serde_json::Map<String, serde_json::Value>,
) -> prost_types::Struct {
    use prost_types::value::Kind;
    let descriptors = request
        .descriptors
        .iter()
        .map(|descriptor| {
            let entries = descriptor
                .entries
                .iter()
                .map(|entry| Kind::StringValue(format!("{}={}", entry.key, entry.value)))
                .map(|kind| prost_types::Value { kind: Some(kind) })
                .collect();
            let mut fields = std::collections::BTreeMap::new();
            fields.insert(
                "entries".to_owned(),
                prost_types::Value {
                    kind: Some(Kind::ListValue(prost_types::ListValue { values: entries })),
                },
            );
            if let Some(hits) = descriptor.hits_addend {
                #[allow(clippy::cast_precision_loss)] // a JSON number, as upstream sends it
                let number = hits as f64;
                fields.insert(
                    "hitsAddend".to_owned(),
                    prost_types::Value { kind: Some(Kind::NumberValue(number)) },
                );
            }
            prost_types::Value { kind: Some(Kind::StructValue(prost_types::Struct { fields })) }
        })
        .collect();
    let mut fields = std::collections::BTreeMap::new();
    fields.insert(
        "domain".to_owned(),
        prost_types::Value { kind: Some(Kind::StringValue(request.domain.clone())) },
    );
    fields.insert(
        "descriptors".to_owned(),
        prost_types::Value {
            kind: Some(Kind::ListValue(prost_types::ListValue { values: descriptors })),
        },
    );
    if request.hits_addend != 0 {
        fields.insert(
            "hitsAddend".to_owned(),
            prost_types::Value { kind: Some(Kind::NumberValue(f64::from(request.hits_addend))) },
        );
    }
    fields.insert("metadata".to_owned(), struct_value(&serde_json::Value::Object(metadata)));
    prost_types::Struct { fields }
}

/// A JSON value as a protobuf `Value`.
fn struct_value(json: &serde_json::Value) -> prost_types::Value {
    use prost_types::value::Kind;
    let kind = match json {
        serde_json::Value::Null => Kind::NullValue(0),
        serde_json::Value::Bool(flag) => Kind::BoolValue(*flag),
        serde_json::Value::Number(number) => Kind::NumberValue(number.as_f64().unwrap_or(0.0)),
        serde_json::Value::String(text) => Kind::StringValue(text.clone()),
        serde_json::Value::Array(items) => Kind::ListValue(prost_types::ListValue {
            values: items.iter().map(struct_value).collect(),
        }),
        serde_json::Value::Object(map) => Kind::StructValue(prost_types::Struct {
            fields: map.iter().map(|(key, value)| (key.clone(), struct_value(value))).collect(),
        }),
    };
    prost_types::Value { kind: Some(kind) }
}

impl RlsService {
    /// `ShouldRateLimit`: decides `request` now, timed.
    ///
    /// # Errors
    /// As [`RlsService::decide`].
    pub async fn should_rate_limit(
        &self,
        request: &RateLimitRequest,
    ) -> Result<Box<RlsAnswer>, Status> {
        let timer = self.metrics.rls_request_duration.start_timer();
        let result = self.decide(request, crate::clock::now_ms()).await;
        timer.observe_duration();
        result
    }
}

/// Refuses malformed requests before any state is allocated.
fn validate(request: &RateLimitRequest) -> Result<(), InvalidRequest> {
    if request.domain.is_empty() {
        return Err(InvalidRequest::EmptyDomain);
    }
    if request.domain.len() > FIELD_BYTES_MAX {
        return Err(InvalidRequest::DomainTooLong(request.domain.len()));
    }
    if request.descriptors.is_empty() {
        return Err(InvalidRequest::NoDescriptors);
    }
    if request.descriptors.len() > DESCRIPTORS_MAX {
        return Err(InvalidRequest::TooManyDescriptors(request.descriptors.len()));
    }
    for (descriptor_index, descriptor) in request.descriptors.iter().enumerate() {
        if descriptor.entries.is_empty() {
            return Err(InvalidRequest::EmptyDescriptor(descriptor_index));
        }
        if descriptor.entries.len() > ENTRIES_MAX {
            return Err(InvalidRequest::TooManyEntries {
                descriptor: descriptor_index,
                entries: descriptor.entries.len(),
            });
        }
        for (entry_index, entry) in descriptor.entries.iter().enumerate() {
            if entry.key.is_empty() {
                return Err(InvalidRequest::EmptyKey {
                    descriptor: descriptor_index,
                    entry: entry_index,
                });
            }
            for (field, length) in [("key", entry.key.len()), ("value", entry.value.len())] {
                if length > FIELD_BYTES_MAX {
                    return Err(InvalidRequest::FieldTooLong {
                        descriptor: descriptor_index,
                        entry: entry_index,
                        field,
                        length,
                    });
                }
            }
        }
    }
    Ok(())
}

/// Hits a descriptor adds, and whether it only checks: its own `hits_addend` when set (a
/// `UInt64Value`: 0 there checks without consuming, decided as one hit that is never
/// committed), else the request's (a plain `uint32`: 0 there means 1).
fn hits_of(request: &RateLimitRequest, descriptor: &RateLimitDescriptor) -> (u64, bool) {
    match descriptor.hits_addend {
        Some(0) => (1, true),
        Some(hits) => (hits, false),
        None => (u64::from(request.hits_addend.max(1)), false),
    }
}

/// A descriptor's `limit` override, as envoyproxy/ratelimit applies it: only in a domain
/// the policy defines, `requests_per_unit` per `unit` counted with the node's default
/// algorithm.
fn override_limit(
    policy: &PolicySet,
    domain: &str,
    index: usize,
    descriptor: &RateLimitDescriptor,
) -> Result<Option<RuleLimit>, InvalidRequest> {
    let Some(RateLimitOverride { requests_per_unit, unit }) = descriptor.limit else {
        return Ok(None);
    };
    if !policy.has_domain(domain) {
        return Ok(None);
    }
    let bad = |reason: String| InvalidRequest::BadOverride { descriptor: index, reason };
    let unit = match RateLimitUnit::try_from(unit) {
        Ok(RateLimitUnit::Second) => Unit::Second,
        Ok(RateLimitUnit::Minute) => Unit::Minute,
        Ok(RateLimitUnit::Hour) => Unit::Hour,
        Ok(RateLimitUnit::Day) => Unit::Day,
        Ok(RateLimitUnit::Month) => Unit::Month,
        Ok(RateLimitUnit::Year) => Unit::Year,
        Ok(RateLimitUnit::Unknown) | Err(_) => return Err(bad(format!("has unknown unit {unit}"))),
    };
    let spec = LimitSpec::new(
        policy.default_algorithm(),
        u64::from(requests_per_unit),
        unit.window_ms(),
        None,
    )
    .map_err(|error| bad(error.to_string()))?;
    Ok(Some(RuleLimit::new(spec, spec, Some(unit), None, ("override", 0, 1))))
}

/// When the request as a whole was not admitted nothing was consumed, so a limit that
/// admitted its share reports what is really left.
fn remaining_as_answered(
    evaluations: &[Verdict],
    limits: &[&RuleLimit],
    consumed: bool,
    hits: u64,
) -> SmallVec<[Verdict; 2]> {
    evaluations
        .iter()
        .zip(limits)
        .map(|(evaluation, limit)| {
            let mut shown = *evaluation;
            if evaluation.admitted && !consumed {
                shown.remaining =
                    evaluation.remaining.saturating_add(hits).min(limit.spec.capacity_tokens());
            }
            shown
        })
        .collect()
}

/// The limit a descriptor status shows: the rejecting one that waits longest, else the
/// one with the fewest hits left.
fn shown_limit(evaluations: &[Verdict], admitted: bool) -> usize {
    let indexed = evaluations.iter().enumerate();
    let chosen = if admitted {
        indexed.min_by_key(|(_, evaluation)| evaluation.remaining)
    } else {
        indexed
            .filter(|(_, evaluation)| !evaluation.admitted)
            .max_by_key(|(_, evaluation)| evaluation.retry_after_ms)
    };
    chosen.map_or(0, |(index, _)| index)
}

fn report<'p>(limit: &'p RuleLimit, evaluation: &Verdict) -> LimitReport<'p> {
    LimitReport {
        policy: &limit.header,
        remaining: evaluation.remaining,
        reset_ms: evaluation.reset_ms,
    }
}

/// The limit a descriptor status shows; its `name` is the limit's own, empty without one as
/// upstream's (Envoy shows it in `x-ratelimit-limit`), never the rule path.
fn current_limit(limit: &RuleLimit) -> CurrentLimit {
    let unit = match limit.unit {
        Some(Unit::Second) => ProtoUnit::Second,
        Some(Unit::Minute) => ProtoUnit::Minute,
        Some(Unit::Hour) => ProtoUnit::Hour,
        Some(Unit::Day) => ProtoUnit::Day,
        Some(Unit::Week) => ProtoUnit::Week,
        Some(Unit::Month) => ProtoUnit::Month,
        Some(Unit::Year) => ProtoUnit::Year,
        // An arbitrary window (`window: 30s`) has no Envoy unit.
        None => ProtoUnit::Unknown,
    };
    CurrentLimit {
        name: limit.name.clone().unwrap_or_default(),
        requests_per_unit: u32::try_from(limit.spec.requests_per_window).unwrap_or(u32::MAX),
        unit,
    }
}

/// `duration_until_reset` in whole seconds, rounded up, as envoyproxy/ratelimit answers (a
/// per-second window says 1 s, not 0 s and some nanoseconds: Envoy's `x-ratelimit-reset`
/// header shows the seconds).
fn whole_seconds_of_ms(ms: u64) -> i64 {
    i64::try_from(ms.div_ceil(1000)).unwrap_or(i64::MAX)
}
