//! Envoy Rate Limit Service v3: `ShouldRateLimit`.
//!
//! ```text
//! request ─▶ validate ─▶ match each descriptor (policy) ─▶ probes ─▶ ShardSet::decide
//!                                                                        │
//! response ◀─ statuses + RateLimit headers ◀──────────────────────────────┘
//! ```
//!
//! Semantics follow envoyproxy/ratelimit so Envoy configs and policies carry over: an
//! unknown domain or a descriptor without a rule answers OK; `hits_addend` 0 means 1 and a
//! descriptor's own `hits_addend` beats the request's; the request is OVER_LIMIT when any
//! enforced descriptor is; shadow-mode rules are evaluated and counted but answer OK; a
//! limit named in another matched limit's `replaces` is skipped. Unlike a Redis counter,
//! a rejected request consumes nothing on any descriptor.

use std::borrow::Cow;
use std::sync::Arc;

use arc_swap::ArcSwap;
use smallvec::{SmallVec, smallvec};
use tonic::{Request, Response, Status};

use crate::actors::shard::{Decision, LedgerName, Probe, ShardSet};
use crate::api::proto::envoy::config::core::v3::HeaderValue;
use crate::api::proto::envoy::extensions::common::ratelimit::v3::RateLimitDescriptor;
use crate::api::proto::envoy::extensions::common::ratelimit::v3::rate_limit_descriptor::RateLimitOverride;
use crate::api::proto::envoy::service::ratelimit::v3::rate_limit_response::rate_limit::Unit as ProtoUnit;
use crate::api::proto::envoy::service::ratelimit::v3::rate_limit_response::{
    Code, DescriptorStatus, RateLimit,
};
use crate::api::proto::envoy::service::ratelimit::v3::rate_limit_service_server::RateLimitService;
use crate::api::proto::envoy::service::ratelimit::v3::{RateLimitRequest, RateLimitResponse};
use crate::api::proto::envoy::r#type::v3::RateLimitUnit;
use crate::api::status::InvalidRequest;
use crate::core::admission::Verdict;
use crate::core::headers::{HeaderOptions, LimitReport, format_headers};
use crate::core::lease::LeaseTuning;
use crate::core::policy::FailureMode;
use crate::core::policy::{Entry, Match, PolicySet, Rule, RuleLimit, Unit};
use crate::core::rate::{Algorithm, LimitSpec};
use crate::metrics::{DOMAIN_UNKNOWN, Metrics};

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
    headers: HeaderOptions,
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
#[derive(Clone, Copy)]
struct RuleView<'p> {
    path: &'p str,
    shadow_mode: bool,
}

impl RlsService {
    /// A service deciding from `shards` under the policy currently in `policy`.
    pub fn new(
        shards: Arc<ShardSet>,
        policy: Arc<ArcSwap<PolicySet>>,
        metrics: Metrics,
        headers: HeaderOptions,
    ) -> Self {
        Self { shards, policy, metrics, headers }
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
    ) -> Result<RateLimitResponse, Status> {
        if let Err(invalid) = validate(request) {
            self.metrics.rls_rejected_requests.with_label_values(&[invalid.reason_label()]).inc();
            return Err(invalid.into());
        }
        let policy = self.policy.load();
        let domain = request.domain.as_str();
        let overrides = request
            .descriptors
            .iter()
            .enumerate()
            .map(|(index, descriptor)| override_limit(&policy, domain, index, descriptor))
            .collect::<Result<SmallVec<[_; 4]>, _>>()
            .inspect_err(|invalid| {
                self.metrics
                    .rls_rejected_requests
                    .with_label_values(&[invalid.reason_label()])
                    .inc();
            })?;

        // Requests carry a few descriptors: keep the per-request bookkeeping on the stack.
        let mut plans: SmallVec<[Plan<'_>; 4]> = SmallVec::with_capacity(request.descriptors.len());
        let mut probes: SmallVec<[Probe<'_>; 4]> = SmallVec::new();
        let matched: SmallVec<[Option<&Rule>; 4]> = request
            .descriptors
            .iter()
            .zip(&overrides)
            .map(|(descriptor, overridden)| match overridden {
                Some(_) => None,
                None => self.matched_rule(&policy, domain, descriptor),
            })
            .collect();
        let replaced: SmallVec<[&str; 4]> = matched
            .iter()
            .flatten()
            .flat_map(|rule| rule.replaces.iter().map(String::as_str))
            .collect();

        for ((descriptor, overridden), rule) in
            request.descriptors.iter().zip(&overrides).zip(&matched)
        {
            let (view, limits): (RuleView<'_>, SmallVec<[&RuleLimit; 2]>) = match (overridden, rule)
            {
                (Some(limit), _) => {
                    (RuleView { path: "override", shadow_mode: false }, smallvec![limit])
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
                    (RuleView { path: &rule.path, shadow_mode: rule.shadow_mode }, kept)
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
            let hits = hits_of(request, descriptor);
            let hash = self.shards.hash_descriptor(
                domain,
                descriptor.entries.iter().map(|entry| (entry.key.as_str(), entry.value.as_str())),
            );
            let counters = limits
                .iter()
                .copied()
                .enumerate()
                .map(|(index, limit)| {
                    (self.shards.counter_of(&hash, index, &limit.spec), &limit.spec)
                })
                .collect();
            let (lease, failure_mode, rule_id) = match rule {
                Some(rule) => (&rule.lease, rule.failure_mode, Some(rule.id)),
                None => (&DEFAULT_LEASE, FailureMode::default(), None),
            };
            probes.push(Probe {
                stripe: self.shards.stripe_of(&hash),
                counters,
                hits,
                enforced: !view.shadow_mode,
                lease,
                failure_mode,
                rule: rule_id,
                name: LedgerName {
                    domain,
                    entries: descriptor
                        .entries
                        .iter()
                        .map(|entry| (entry.key.as_str(), entry.value.as_str()))
                        .collect(),
                },
            });
            plans.push(Plan::Limited { rule: view, limits, probe: probes.len() - 1 });
        }

        let decision = if probes.is_empty() {
            Decision { outcomes: Vec::new(), admitted: true, bypass: None, failed_closed: false }
        } else {
            self.shards.decide(&probes, now_ms).await?
        };
        let response = self.respond(domain, &policy, &plans, &decision, &probes);
        Ok(response)
    }

    /// The rule a descriptor matches, counting the misses.
    fn matched_rule<'p>(
        &self,
        policy: &'p PolicySet,
        domain: &str,
        descriptor: &RateLimitDescriptor,
    ) -> Option<&'p Rule> {
        let entries: SmallVec<[Entry<'_>; 4]> = descriptor
            .entries
            .iter()
            .map(|entry| Entry { key: &entry.key, value: &entry.value })
            .collect();
        match policy.match_descriptor(domain, &entries) {
            Match::Rule(rule) => Some(rule),
            Match::DomainNotFound => {
                self.metrics.rls_unmatched.with_label_values(&["domain_not_found"]).inc();
                None
            }
            Match::NoRule => {
                self.metrics.rls_unmatched.with_label_values(&["no_rule"]).inc();
                None
            }
        }
    }

    fn respond(
        &self,
        domain: &str,
        policy: &PolicySet,
        plans: &[Plan<'_>],
        decision: &Decision,
        probes: &[Probe<'_>],
    ) -> RateLimitResponse {
        let domain_label = if policy.has_domain(domain) { domain } else { DOMAIN_UNKNOWN };
        let mut statuses = Vec::with_capacity(plans.len());
        let mut reports: SmallVec<[LimitReport<'_>; 4]> = SmallVec::new();
        let mut retry_after_ms: Option<u64> = None;
        for plan in plans {
            let (rule, limits, probe) = match plan {
                Plan::Unmatched => {
                    statuses.push(DescriptorStatus { code: Code::Ok.into(), ..Default::default() });
                    continue;
                }
                Plan::Unlimited => {
                    statuses.push(DescriptorStatus {
                        code: Code::Ok.into(),
                        limit_remaining: u32::MAX,
                        ..Default::default()
                    });
                    continue;
                }
                Plan::Limited { rule, limits, probe } => (rule, limits, *probe),
            };
            let outcome = &decision.outcomes[probe];
            let evaluations = remaining_as_answered(
                &outcome.verdicts,
                limits,
                decision.admitted && outcome.admitted,
                probes[probe].hits,
            );
            let shown = shown_limit(&evaluations, outcome.admitted);
            let code =
                if outcome.admitted || rule.shadow_mode { Code::Ok } else { Code::OverLimit };
            let label = match (outcome.admitted, rule.shadow_mode) {
                (true, _) => "ok",
                (false, true) => "shadow_over_limit",
                (false, false) => "over_limit",
            };
            self.metrics
                .rls_descriptor_decisions
                .with_label_values(&[domain_label, rule.path, label])
                .inc();
            if rule.shadow_mode {
                if !outcome.admitted {
                    self.metrics
                        .rls_shadow_blocks
                        .with_label_values(&[domain_label, rule.path])
                        .inc();
                    tracing::debug!(
                        event = "RateLimitShadowBlock",
                        domain,
                        rule = rule.path,
                        "shadow-mode rule would have blocked"
                    );
                }
            } else {
                for (index, (limit, evaluation)) in limits.iter().zip(&evaluations).enumerate() {
                    reports.push(report(rule.path, index, limits.len(), limit, evaluation));
                    if !evaluation.admitted {
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
            statuses.push(DescriptorStatus {
                code: code.into(),
                current_limit: Some(current_limit(rule.path, limit)),
                limit_remaining: u32::try_from(evaluation.remaining).unwrap_or(u32::MAX),
                duration_until_reset: Some(duration_of_ms(evaluation.reset_ms)),
                quota: None,
            });
        }
        let overall = if decision.admitted { Code::Ok } else { Code::OverLimit };
        self.metrics
            .rls_decisions
            .with_label_values(&[domain_label, if decision.admitted { "ok" } else { "over_limit" }])
            .inc();
        let retry_after_ms = if decision.admitted { None } else { retry_after_ms };
        let response_headers_to_add = format_headers(&reports, retry_after_ms, self.headers)
            .into_iter()
            .map(|(key, value)| HeaderValue { key: key.to_owned(), value, raw_value: Vec::new() })
            .collect();
        RateLimitResponse {
            overall_code: overall.into(),
            statuses,
            response_headers_to_add,
            ..Default::default()
        }
    }
}

#[tonic::async_trait]
impl RateLimitService for RlsService {
    async fn should_rate_limit(
        &self,
        request: Request<RateLimitRequest>,
    ) -> Result<Response<RateLimitResponse>, Status> {
        let timer = self.metrics.rls_request_duration.start_timer();
        let result = self.decide(request.get_ref(), crate::clock::now_ms()).await;
        timer.observe_duration();
        result.map(Response::new)
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

/// Hits a descriptor adds: its own `hits_addend`, else the request's; 0 means 1.
fn hits_of(request: &RateLimitRequest, descriptor: &RateLimitDescriptor) -> u64 {
    match descriptor.hits_addend {
        Some(hits) if hits > 0 => hits,
        _ => u64::from(request.hits_addend.max(1)),
    }
}

/// A descriptor's `limit` override, as envoyproxy/ratelimit applies it: only in a domain
/// the policy defines, as a token bucket of `requests_per_unit` per `unit`.
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
        Algorithm::TokenBucket,
        u64::from(requests_per_unit),
        unit.window_ms(),
        None,
    )
    .map_err(|error| bad(error.to_string()))?;
    Ok(Some(RuleLimit { spec, unit: Some(unit), name: None }))
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

/// The name a limit goes by in the headers: its own name, else the rule's path (numbered
/// when the rule has several unnamed limits).
fn policy_name<'p>(
    path: &'p str,
    index: usize,
    count: usize,
    limit: &'p RuleLimit,
) -> Cow<'p, str> {
    match (&limit.name, count) {
        (Some(name), _) => Cow::Borrowed(name),
        (None, 1) => Cow::Borrowed(path),
        (None, _) => Cow::Owned(format!("{path}#{index}")),
    }
}

fn report<'p>(
    path: &'p str,
    index: usize,
    count: usize,
    limit: &'p RuleLimit,
    evaluation: &Verdict,
) -> LimitReport<'p> {
    LimitReport {
        policy_name: policy_name(path, index, count, limit),
        quota: limit.spec.requests_per_window,
        window_ms: limit.spec.window_ms,
        remaining: evaluation.remaining,
        reset_ms: evaluation.reset_ms,
    }
}

fn current_limit(path: &str, limit: &RuleLimit) -> RateLimit {
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
    RateLimit {
        name: limit.name.clone().unwrap_or_else(|| path.to_owned()),
        requests_per_unit: u32::try_from(limit.spec.requests_per_window).unwrap_or(u32::MAX),
        unit: unit.into(),
    }
}

fn duration_of_ms(ms: u64) -> prost_types::Duration {
    prost_types::Duration {
        seconds: i64::try_from(ms / 1000).unwrap_or(i64::MAX),
        nanos: i32::try_from((ms % 1000) * 1_000_000).expect("below one second fits i32"),
    }
}
