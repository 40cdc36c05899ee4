//! The pure quota state machine (`core::ledger`): determinism, conservation of tokens,
//! bounded returns, bad input, the sweep and persistence, by example and by proptest
//! against a naive reference model of the lease accounting.

use std::collections::BTreeMap;

use proptest::prelude::*;
use quotamesh::core::ledger::{
    CommandError, KeyError, LEASE_REQUESTS_PER_COMMAND_MAX, LEASE_TOKENS_MAX, LEASE_TTL_MS_MAX,
    LeaseGrant, LeaseRequest, LeaseRequestError, NodeId, PolicySetError, QuotaCommand, QuotaLedger,
    QuotaResponse, ReturnError,
};
use quotamesh::core::rate::{Algorithm, LimitSpec};
use quotamesh::ledger::GroupMachine;

fn bucket(requests_per_window: u64, window_ms: u64, burst_tokens: u64) -> LimitSpec {
    LimitSpec::new(Algorithm::TokenBucket, requests_per_window, window_ms, Some(burst_tokens))
        .expect("a valid limit")
}

fn request(key: &str, limit: LimitSpec, tokens_wanted: u64) -> LeaseRequest {
    LeaseRequest { key: key.to_owned(), limit, tokens_wanted, lease_ttl_ms: 1_000 }
}

fn acquire(now_ms: u64, node: u64, requests: Vec<LeaseRequest>) -> QuotaCommand {
    QuotaCommand::AcquireLeases { now_ms, node_id: NodeId(node), requests }
}

fn grants(response: QuotaResponse) -> Vec<Result<LeaseGrant, LeaseRequestError>> {
    match response {
        QuotaResponse::Leases(grants) => grants,
        other => panic!("expected lease grants, got {other:?}"),
    }
}

fn credited(response: QuotaResponse) -> u64 {
    match response {
        QuotaResponse::Returned(Ok(outcome)) => outcome.credited_tokens,
        other => panic!("expected a credited return, got {other:?}"),
    }
}

/// Whole tokens available in `key`'s bucket at `now_ms`, without changing anything.
fn available(ledger: &QuotaLedger, key: &str, now_ms: u64) -> u64 {
    ledger.key(key).map_or(0, |entry| entry.limit.evaluate(&entry.state, now_ms, 0).remaining)
}

// Proves a grant is min(want, available), and an empty bucket answers 0 with the exact
// wait until the next token.
#[test]
fn grants_what_is_available_then_the_exact_retry_time() {
    let mut ledger = QuotaLedger::new();
    let limit = bucket(10, 1_000, 10); // one token per 100 ms
    let first = grants(ledger.apply(&acquire(5_000, 1, vec![request("rl:d:k", limit, 6)])));
    assert_eq!(first[0].as_ref().map(|g| g.granted_tokens), Ok(6));
    let second = grants(ledger.apply(&acquire(5_000, 2, vec![request("rl:d:k", limit, 6)])));
    assert_eq!(second[0].as_ref().map(|g| (g.granted_tokens, g.remaining_tokens)), Ok((4, 0)));
    let empty = grants(ledger.apply(&acquire(5_000, 1, vec![request("rl:d:k", limit, 1)])));
    assert_eq!(empty[0].as_ref().map(|g| (g.granted_tokens, g.retry_after_ms)), Ok((0, 100)));
    assert_eq!(empty[0].as_ref().map(|g| g.lease_expires_at_ms), Ok(None));
    let early = grants(ledger.apply(&acquire(5_099, 1, vec![request("rl:d:k", limit, 1)])));
    assert_eq!(early[0].as_ref().map(|g| g.granted_tokens), Ok(0));
    let on_time = grants(ledger.apply(&acquire(5_100, 1, vec![request("rl:d:k", limit, 1)])));
    assert_eq!(on_time[0].as_ref().map(|g| g.granted_tokens), Ok(1));
    assert_eq!(ledger.outstanding_tokens(NodeId(1)), 7);
    assert_eq!(ledger.outstanding_tokens(NodeId(2)), 4);
    assert_eq!(ledger.outstanding_tokens_on_key("rl:d:k"), 11);
}

// Proves a clock that steps back never mints tokens: apply uses max(last_seen_ms, now_ms).
#[test]
fn a_proposer_clock_behind_ledger_time_uses_ledger_time() {
    let mut ledger = QuotaLedger::new();
    let limit = bucket(10, 1_000, 10);
    grants(ledger.apply(&acquire(10_000, 1, vec![request("rl:d:k", limit, 10)])));
    let stale = grants(ledger.apply(&acquire(1_000, 2, vec![request("rl:d:k", limit, 1)])));
    assert_eq!(stale[0].as_ref().map(|g| (g.granted_tokens, g.retry_after_ms)), Ok((0, 100)));
    assert_eq!(ledger.last_seen_ms(), 10_000);
}

// Proves returns credit at most what the node still holds on the key, so a repeated return
// cannot mint tokens, and never above capacity.
#[test]
fn returns_are_capped_by_the_lease_and_the_capacity() {
    let mut ledger = QuotaLedger::new();
    let limit = bucket(100, 1_000, 100);
    grants(ledger.apply(&acquire(1_000, 1, vec![request("rl:d:k", limit, 30)])));
    let give_back = |tokens| QuotaCommand::ReturnLease {
        now_ms: 1_000,
        node_id: NodeId(1),
        key: "rl:d:k".to_owned(),
        tokens,
    };
    assert_eq!(credited(ledger.apply(&give_back(20))), 20);
    assert_eq!(credited(ledger.apply(&give_back(20))), 10, "only 10 were still leased");
    assert_eq!(credited(ledger.apply(&give_back(20))), 0, "a repeated return credits nothing");
    assert_eq!(available(&ledger, "rl:d:k", 1_000), 100);
    assert_eq!(ledger.outstanding_tokens(NodeId(1)), 0);
    let stranger = QuotaCommand::ReturnLease {
        now_ms: 1_000,
        node_id: NodeId(9),
        key: "rl:d:k".to_owned(),
        tokens: 5,
    };
    assert_eq!(credited(ledger.apply(&stranger)), 0, "a node without a lease credits nothing");
}

// Proves an expired lease stops counting as outstanding and can no longer be returned.
#[test]
fn leases_expire_from_the_accounting() {
    let mut ledger = QuotaLedger::new();
    let limit = bucket(100, 10_000, 100);
    grants(ledger.apply(&acquire(1_000, 1, vec![request("rl:d:k", limit, 30)])));
    assert_eq!(ledger.outstanding_tokens(NodeId(1)), 30);
    let late = QuotaCommand::ReturnLease {
        now_ms: 2_000,
        node_id: NodeId(1),
        key: "rl:d:k".to_owned(),
        tokens: 30,
    };
    assert_eq!(credited(ledger.apply(&late)), 0, "the 1 s lease ended at 2 000");
    assert_eq!(ledger.outstanding_tokens(NodeId(1)), 0);
    assert_eq!(ledger.outstanding_tokens_on_key("rl:d:k"), 0);
}

// Proves the sweep forgets an idle key 2 x window after its last use, once its leases
// expired and its bucket refilled, and keeps it before then.
#[test]
fn idle_keys_are_swept_two_windows_after_last_use() {
    let mut ledger = QuotaLedger::new();
    let limit = bucket(10, 1_000, 10);
    grants(ledger.apply(&acquire(1_000, 1, vec![request("rl:d:idle", limit, 5)])));
    let tick = |now_ms| acquire(now_ms, 2, vec![request("rl:d:other", limit, 1)]);
    grants(ledger.apply(&tick(2_999)));
    assert!(ledger.key("rl:d:idle").is_some(), "kept before 2 x window");
    grants(ledger.apply(&tick(3_000)));
    assert!(ledger.key("rl:d:idle").is_none(), "swept at 2 x window after last use");
    assert_eq!(ledger.outstanding_tokens(NodeId(1)), 0);
}

// Proves bad lease requests get their own error and change nothing, while the good ones in
// the same batch proceed exactly as they would alone.
#[test]
fn bad_requests_are_refused_item_by_item() {
    let limit = bucket(10, 1_000, 10);
    let mut broken_limit = limit;
    broken_limit.window_ms = 0;
    let bad = vec![
        request("", limit, 1),
        request(&format!("rl:{}", "x".repeat(600)), limit, 1),
        request("no-prefix", limit, 1),
        request("rl:d:zero", limit, 0),
        request("rl:d:absurd", limit, LEASE_TOKENS_MAX + 1),
        LeaseRequest { lease_ttl_ms: 0, ..request("rl:d:ttl0", limit, 1) },
        LeaseRequest { lease_ttl_ms: LEASE_TTL_MS_MAX + 1, ..request("rl:d:ttl", limit, 1) },
        request("rl:d:limit", broken_limit, 1),
    ];
    let good = request("rl:d:good", limit, 3);
    let mut mixed = bad.clone();
    mixed.insert(3, good.clone());
    let mut with_bad = QuotaLedger::new();
    let mut alone = QuotaLedger::new();
    let answers = grants(with_bad.apply(&acquire(1_000, 1, mixed)));
    grants(alone.apply(&acquire(1_000, 1, vec![good])));
    assert_eq!(with_bad.digest(), alone.digest());
    assert_eq!(answers[0], Err(LeaseRequestError::Key(KeyError::Empty)));
    assert_eq!(answers[1], Err(LeaseRequestError::Key(KeyError::TooLong(603))));
    assert_eq!(answers[2], Err(LeaseRequestError::Key(KeyError::Prefix)));
    assert_eq!(answers[3].as_ref().map(|g| g.granted_tokens), Ok(3));
    assert_eq!(answers[4], Err(LeaseRequestError::TokensWanted(0)));
    assert_eq!(answers[5], Err(LeaseRequestError::TokensWanted(LEASE_TOKENS_MAX + 1)));
    assert_eq!(answers[6], Err(LeaseRequestError::LeaseTtl(0)));
    assert_eq!(answers[7], Err(LeaseRequestError::LeaseTtl(LEASE_TTL_MS_MAX + 1)));
    assert!(matches!(answers[8], Err(LeaseRequestError::Limit(_))));

    let zero_return = QuotaCommand::ReturnLease {
        now_ms: 1_000,
        node_id: NodeId(1),
        key: "rl:d:good".to_owned(),
        tokens: 0,
    };
    let before = with_bad.digest();
    assert_eq!(with_bad.apply(&zero_return), QuotaResponse::Returned(Err(ReturnError::Tokens(0))));
    assert_eq!(with_bad.digest(), before);
}

// Proves a batch of returns credits exactly what the same returns one by one would, and an
// oversized batch of returns is refused whole.
#[test]
fn batched_returns_equal_single_returns() {
    let grant = |ledger: &mut QuotaLedger| {
        ledger.apply(&acquire(
            1_000,
            1,
            vec![
                request("rl:d:a", bucket(10, 1_000, 10), 6),
                request("rl:d:b", bucket(10, 1_000, 10), 4),
            ],
        ))
    };
    let mut single = QuotaLedger::new();
    let mut batched = QuotaLedger::new();
    grant(&mut single);
    grant(&mut batched);
    let returns = [("rl:d:a", 2), ("rl:d:b", 9), ("rl:d:missing", 1), ("rl:d:a", 1)];
    let mut one_by_one = Vec::new();
    for (key, tokens) in returns {
        let reply = single.apply(&QuotaCommand::ReturnLease {
            now_ms: 1_010,
            node_id: NodeId(1),
            key: key.to_owned(),
            tokens,
        });
        let QuotaResponse::Returned(result) = reply else { panic!("{reply:?}") };
        one_by_one.push(result);
    }
    let reply = batched.apply(&QuotaCommand::ReturnLeases {
        now_ms: 1_010,
        node_id: NodeId(1),
        returns: returns.iter().map(|(key, tokens)| ((*key).to_owned(), *tokens)).collect(),
    });
    assert_eq!(reply, QuotaResponse::ReturnedMany(one_by_one));
    assert_eq!(single.digest(), batched.digest());
    let before = batched.digest();
    let oversized = QuotaCommand::ReturnLeases {
        now_ms: 2_000,
        node_id: NodeId(1),
        returns: vec![("rl:d:a".to_owned(), 1); LEASE_REQUESTS_PER_COMMAND_MAX + 1],
    };
    assert_eq!(
        batched.apply(&oversized),
        QuotaResponse::Rejected(CommandError::BatchTooLarge(LEASE_REQUESTS_PER_COMMAND_MAX + 1))
    );
    assert_eq!(batched.digest(), before);
}

// Proves a batch over the maximum is refused as a whole before anything, even time, moves.
#[test]
fn an_oversized_batch_changes_nothing() {
    let mut ledger = QuotaLedger::new();
    let before = ledger.digest();
    let requests =
        vec![request("rl:d:k", bucket(10, 1_000, 10), 1); LEASE_REQUESTS_PER_COMMAND_MAX + 1];
    assert_eq!(
        ledger.apply(&acquire(1_000, 1, requests)),
        QuotaResponse::Rejected(CommandError::BatchTooLarge(LEASE_REQUESTS_PER_COMMAND_MAX + 1))
    );
    assert_eq!(ledger.digest(), before);
    assert_eq!(ledger.last_seen_ms(), 0);
}

// Proves policy sets are versioned: newer replaces, a retry of the stored one is accepted,
// older or conflicting versions and duplicate file names are refused.
#[test]
fn policy_sets_only_move_forward() {
    let mut ledger = QuotaLedger::new();
    let put = |version, files: &[(&str, &str)]| QuotaCommand::PutPolicySet {
        now_ms: 1_000,
        version,
        policy_yaml: files.iter().map(|(n, t)| ((*n).to_owned(), (*t).to_owned())).collect(),
    };
    assert_eq!(ledger.apply(&put(2, &[("a.yaml", "domain: a")])), QuotaResponse::PolicySet(Ok(())));
    assert_eq!(ledger.apply(&put(2, &[("a.yaml", "domain: a")])), QuotaResponse::PolicySet(Ok(())));
    assert_eq!(
        ledger.apply(&put(2, &[("a.yaml", "domain: b")])),
        QuotaResponse::PolicySet(Err(PolicySetError::StaleVersion { offered: 2, stored: 2 }))
    );
    assert_eq!(
        ledger.apply(&put(1, &[("a.yaml", "domain: a")])),
        QuotaResponse::PolicySet(Err(PolicySetError::StaleVersion { offered: 1, stored: 2 }))
    );
    assert_eq!(
        ledger.apply(&put(3, &[("a.yaml", "x"), ("a.yaml", "y")])),
        QuotaResponse::PolicySet(Err(PolicySetError::FileName("a.yaml".to_owned())))
    );
    assert_eq!(ledger.policy().map(|p| p.version), Some(2));
}

/// A small world: few keys, nodes and limits, so commands collide on the same buckets.
fn arbitrary_command() -> impl Strategy<Value = (u64, QuotaCommand)> {
    let limits = prop_oneof![
        Just(bucket(10, 1_000, 20)),
        Just(bucket(3, 100, 3)),
        Just(LimitSpec::new(Algorithm::FixedWindow, 5, 500, None).expect("valid")),
        Just(LimitSpec::new(Algorithm::SlidingWindow, 8, 400, None).expect("valid")),
    ];
    let keys = prop_oneof![Just("rl:a:1"), Just("rl:a:2"), Just("rl:b:1"), Just("bad"), Just("")];
    let lease_request = (keys.clone(), limits, 0..30u64, prop_oneof![Just(0u64), 1..3_000u64])
        .prop_map(|(key, limit, tokens_wanted, lease_ttl_ms)| LeaseRequest {
            key: key.to_owned(),
            limit,
            tokens_wanted,
            lease_ttl_ms,
        });
    let step_ms = 0..400u64;
    prop_oneof![
        4 => (step_ms.clone(), 1..4u64, prop::collection::vec(lease_request, 0..6))
            .prop_map(|(step, node, requests)| (step, QuotaCommand::AcquireLeases { now_ms: 0, node_id: NodeId(node), requests })),
        2 => (step_ms.clone(), 1..4u64, keys.clone(), 0..30u64)
            .prop_map(|(step, node, key, tokens)| (step, QuotaCommand::ReturnLease { now_ms: 0, node_id: NodeId(node), key: key.to_owned(), tokens })),
        1 => (step_ms.clone(), 1..4u64, prop::collection::vec((keys, 0..30u64), 0..4))
            .prop_map(|(step, node, returns)| (step, QuotaCommand::ReturnLeases { now_ms: 0, node_id: NodeId(node), returns: returns.into_iter().map(|(key, tokens)| (key.to_owned(), tokens)).collect() })),
        1 => (step_ms, 0..4u64, "[a-c]{1,3}")
            .prop_map(|(step, version, text)| (step, QuotaCommand::PutPolicySet { now_ms: 0, version, policy_yaml: vec![("p.yaml".to_owned(), text)] })),
    ]
}

/// Stamps commands with a clock that mostly moves forward and sometimes jumps back.
fn stamped(commands: Vec<(u64, QuotaCommand)>, back_jumps: &[bool]) -> Vec<QuotaCommand> {
    let mut clock_ms = 1_000u64;
    commands
        .into_iter()
        .zip(back_jumps.iter().cycle())
        .map(|((step_ms, mut command), back)| {
            clock_ms = if *back { clock_ms.saturating_sub(step_ms) } else { clock_ms + step_ms };
            match &mut command {
                QuotaCommand::AcquireLeases { now_ms, .. }
                | QuotaCommand::ReturnLease { now_ms, .. }
                | QuotaCommand::ReturnLeases { now_ms, .. }
                | QuotaCommand::PutPolicySet { now_ms, .. } => *now_ms = clock_ms,
            }
            command
        })
        .collect()
}

/// Applies the machine's pending record changes to a map, as the sled store does.
fn persist(ledger: &mut QuotaLedger, records: &mut BTreeMap<Vec<u8>, Vec<u8>>) {
    for change in GroupMachine::take_changes(ledger) {
        match change.value {
            Some(value) => records.insert(change.key, value),
            None => records.remove(&change.key),
        };
    }
}

proptest! {
    #![proptest_config(ProptestConfig { cases: 256, ..ProptestConfig::default() })]

    // Proves replicas applying the same commands give the same answers and digests, and that
    // a replica rebuilt from its persisted records at any point continues identically.
    #[test]
    fn replicas_and_reloaded_replicas_agree(
        commands in prop::collection::vec(arbitrary_command(), 1..60),
        back_jumps in prop::collection::vec(prop::bool::weighted(0.15), 1..8),
        reload_at in 0usize..60,
    ) {
        let commands = stamped(commands, &back_jumps);
        let mut first = QuotaLedger::new();
        let mut second = QuotaLedger::new();
        let mut reloaded = QuotaLedger::new();
        let mut records = BTreeMap::new();
        for (index, command) in commands.iter().enumerate() {
            if index == reload_at {
                reloaded = <QuotaLedger as GroupMachine>::from_records(records.clone()).expect("records decode");
                prop_assert_eq!(reloaded.digest(), first.digest());
            }
            let answer = first.apply(command);
            prop_assert_eq!(&second.apply(command), &answer);
            if index >= reload_at {
                prop_assert_eq!(&reloaded.apply(command), &answer);
            }
            persist(&mut first, &mut records);
            prop_assert_eq!(first.digest(), second.digest());
        }
        let rebuilt = <QuotaLedger as GroupMachine>::from_records(records).expect("records decode");
        prop_assert_eq!(rebuilt.digest(), first.digest());
    }

    // Proves conservation on a token bucket: tokens out (granted minus credited back) never
    // exceed capacity plus the refill since the first grant, and the bucket never holds more
    // than its capacity, returns included.
    #[test]
    fn token_bucket_grants_never_exceed_capacity_plus_refill(
        steps in prop::collection::vec((0..150u64, 1..4u64, 1..15u64, prop::bool::weighted(0.3)), 1..80),
    ) {
        let limit = bucket(10, 1_000, 20);
        let capacity = limit.capacity_tokens();
        let mut ledger = QuotaLedger::new();
        let start_ms = 50_000u64;
        let mut now_ms = start_ms;
        let mut out_tokens: i128 = 0;
        for (step_ms, node, tokens, is_return) in steps {
            now_ms += step_ms;
            if is_return {
                let command = QuotaCommand::ReturnLease { now_ms, node_id: NodeId(node), key: "rl:c:k".to_owned(), tokens };
                let credited_tokens = credited(ledger.apply(&command));
                prop_assert!(credited_tokens <= tokens);
                out_tokens -= i128::from(credited_tokens);
            } else {
                let answer = grants(ledger.apply(&acquire(now_ms, node, vec![request("rl:c:k", limit, tokens)])));
                let grant = answer[0].clone().expect("a valid request");
                prop_assert!(grant.granted_tokens <= tokens);
                out_tokens += i128::from(grant.granted_tokens);
            }
            let refill = i128::from(limit.requests_per_window) * i128::from(now_ms - start_ms) / i128::from(limit.window_ms);
            prop_assert!(out_tokens <= i128::from(capacity) + refill, "out {} > capacity {} + refill {}", out_tokens, capacity, refill);
            prop_assert!(available(&ledger, "rl:c:k", now_ms) <= capacity);
        }
    }

    // Proves the lease accounting matches a naive model: per node one aggregate lease whose
    // expiry is the latest grant's, returns credited up to what is held, expired leases gone.
    #[test]
    fn lease_accounting_matches_a_naive_model(
        steps in prop::collection::vec((0..700u64, 1..4u64, 1..10u64, 1..1_500u64, prop::bool::weighted(0.35)), 1..60),
    ) {
        let limit = bucket(1_000, 1_000, 1_000);
        let mut ledger = QuotaLedger::new();
        let mut model: BTreeMap<u64, (u64, u64)> = BTreeMap::new(); // node -> (tokens, expires_at_ms)
        let mut now_ms = 10_000u64;
        for (step_ms, node, tokens, lease_ttl_ms, is_return) in steps {
            now_ms += step_ms;
            model.retain(|_, (_, expires_at_ms)| *expires_at_ms > now_ms);
            if is_return {
                let command = QuotaCommand::ReturnLease { now_ms, node_id: NodeId(node), key: "rl:m:k".to_owned(), tokens };
                let credited_tokens = credited(ledger.apply(&command));
                let held = model.get(&node).map_or(0, |(held, _)| *held);
                prop_assert_eq!(credited_tokens, tokens.min(held));
                if let Some((held, _)) = model.get_mut(&node) {
                    *held -= credited_tokens;
                }
                model.retain(|_, (held, _)| *held > 0);
            } else {
                let lease = LeaseRequest { lease_ttl_ms, ..request("rl:m:k", limit, tokens) };
                let answer = grants(ledger.apply(&acquire(now_ms, node, vec![lease])));
                let granted = answer[0].as_ref().map(|g| g.granted_tokens).expect("a valid request");
                if granted > 0 {
                    let (held, expires_at_ms) = model.entry(node).or_insert((0, 0));
                    *held += granted;
                    *expires_at_ms = (*expires_at_ms).max(now_ms + lease_ttl_ms);
                }
            }
            // The ledger expires lazily; compare what is live at `now_ms` on the key.
            // A key never used, or swept after its leases ended, holds no lease.
            let live: BTreeMap<u64, (u64, u64)> = ledger
                .key("rl:m:k")
                .map(|entry| {
                    entry
                        .leases
                        .iter()
                        .filter(|(_, lease)| lease.expires_at_ms > now_ms)
                        .map(|(node, lease)| (node.0, (lease.tokens, lease.expires_at_ms)))
                        .collect()
                })
                .unwrap_or_default();
            prop_assert_eq!(&live, &model);
        }
    }
}
