//! The pure quota state machine (`core::ledger`): determinism, conservation of tokens,
//! settlement (credits, debt, stale and lost reports, epochs), fair shares, bad input, the
//! sweep and persistence, by example and by proptest against naive reference models.

use std::collections::BTreeMap;

use proptest::prelude::*;
use quotamesh::core::ledger::{
    CommandError, KeyError, LEASE_REQUESTS_PER_COMMAND_MAX, LEASE_TOKENS_MAX, LEASE_TTL_MS_MAX,
    LeaseEpoch, LeaseGrant, LeaseReport, LeaseRequest, LeaseRequestError, NodeId, PolicyApplied,
    PolicyAuthor, PolicySetError, QuotaCommand, QuotaLedger, QuotaResponse, ReportOutcome,
    Settlement,
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

const EPOCH: LeaseEpoch = LeaseEpoch { incarnation: 1, serial: 1 };

/// A node's report on `key`: totals spent and held, and a want.
fn report(key: &str, limit: LimitSpec, seq: u64, spent: u64, held: u64, want: u64) -> LeaseReport {
    LeaseReport {
        key: key.to_owned(),
        limit,
        epoch: EPOCH,
        seq,
        spent_tokens: spent,
        held_tokens: held,
        settled_tokens: 0,
        tokens_wanted: want,
        demand_milli_per_second: 0,
        lookahead_ms: 250,
        lease_ttl_ms: 1_000,
    }
}

fn settle(now_ms: u64, node: u64, reports: Vec<LeaseReport>) -> QuotaCommand {
    QuotaCommand::SettleLeases { now_ms, node_id: NodeId(node), reports }
}

/// The settlement of the one report of a `SettleLeases` answer.
fn settled(response: QuotaResponse) -> Settlement {
    match response {
        QuotaResponse::Settled(mut outcomes) if outcomes.len() == 1 => match outcomes.remove(0) {
            Ok(ReportOutcome::Settled(settlement)) => settlement,
            other => panic!("expected a settlement, got {other:?}"),
        },
        other => panic!("expected one settlement, got {other:?}"),
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

// Proves a region's moved slice carries the key's count over: a key drained under a slice of
// 50 is not full again under 100 (it refills at the new rate from the move on), and nodes
// alternating between the two numbers (one has not seen the move yet) mint nothing; a limit
// of another window starts over.
#[test]
fn changed_numbers_carry_the_count_and_another_shape_starts_over() {
    let mut ledger = QuotaLedger::new();
    let (slice, moved) = (bucket(50, 1_000, 50), bucket(100, 1_000, 100));
    let drained = grants(ledger.apply(&acquire(5_000, 1, vec![request("rl:d:k", slice, 50)])));
    assert_eq!(drained[0].as_ref().map(|g| g.granted_tokens), Ok(50));
    let after_move = grants(ledger.apply(&acquire(5_000, 2, vec![request("rl:d:k", moved, 100)])));
    assert_eq!(after_move[0].as_ref().map(|g| g.granted_tokens), Ok(0), "no fresh burst");
    // Two nodes, one on each number, every 10 ms for a second: at most the refill at the
    // larger rate (100 a second), never a burst per switch.
    let mut granted = 0;
    for step in 1..=100_u64 {
        let (node, limit) = if step % 2 == 0 { (1, slice) } else { (2, moved) };
        let answer = grants(ledger.apply(&acquire(
            5_000 + step * 10,
            node,
            vec![request("rl:d:k", limit, 100)],
        )));
        granted += answer[0].as_ref().map_or(0, |g| g.granted_tokens);
    }
    assert!((50..=100).contains(&granted), "granted {granted} over a second of switching");
    let other_window = bucket(100, 60_000, 100);
    let reshaped =
        grants(ledger.apply(&acquire(6_000, 1, vec![request("rl:d:k", other_window, 100)])));
    assert_eq!(reshaped[0].as_ref().map(|g| g.granted_tokens), Ok(100), "a new limit starts over");
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

// Proves a settlement credits exactly what the node neither spent nor holds, a repeated
// report is stale and changes nothing, and credits never fill the bucket above capacity.
#[test]
fn settlement_credits_what_was_neither_spent_nor_held() {
    let mut ledger = QuotaLedger::new();
    let limit = bucket(100, 1_000, 100);
    let first =
        settled(ledger.apply(&settle(1_000, 1, vec![report("rl:d:k", limit, 1, 0, 0, 30)])));
    assert_eq!(first.grant.granted_tokens, 30);
    assert_eq!(ledger.outstanding_tokens(NodeId(1)), 30);
    // The node spent 8 and gives back 12 of the 22 it holds.
    let back = settled(ledger.apply(&settle(1_000, 1, vec![report("rl:d:k", limit, 2, 8, 10, 0)])));
    assert_eq!((back.credited_tokens, back.charged_tokens), (12, 0));
    assert_eq!(available(&ledger, "rl:d:k", 1_000), 82);
    assert_eq!(ledger.outstanding_tokens(NodeId(1)), 10);
    let before = ledger.digest();
    let again = ledger.apply(&settle(1_000, 1, vec![report("rl:d:k", limit, 2, 8, 0, 0)]));
    assert_eq!(again, QuotaResponse::Settled(vec![Ok(ReportOutcome::Stale)]));
    assert_eq!(ledger.digest(), before, "a stale report changes nothing");
    let all_back =
        settled(ledger.apply(&settle(1_000, 1, vec![report("rl:d:k", limit, 3, 8, 0, 0)])));
    assert_eq!(all_back.credited_tokens, 10);
    assert_eq!(available(&ledger, "rl:d:k", 1_000), 92, "100 less the 8 spent");
    let decreased = ledger.apply(&settle(1_000, 1, vec![report("rl:d:k", limit, 4, 7, 0, 0)]));
    assert_eq!(
        decreased,
        QuotaResponse::Settled(vec![Err(LeaseRequestError::SpentDecreased {
            applied: 8,
            reported: 7
        })])
    );
    // A full bucket caps a credit: returns never mint tokens.
    let mut full = QuotaLedger::new();
    settled(full.apply(&settle(1_000, 1, vec![report("rl:d:k", limit, 1, 0, 0, 10)])));
    settled(full.apply(&settle(60_000, 1, vec![report("rl:d:k", limit, 2, 0, 0, 0)])));
    assert_eq!(available(&full, "rl:d:k", 60_000), 100);
}

// Proves an expired lease is written off (no longer live) and the node's next report settles
// it exactly: what it did not spend comes back.
#[test]
fn expired_leases_are_written_off_then_settled_exactly() {
    let mut ledger = QuotaLedger::new();
    let limit = bucket(10, 3_600_000, 100); // nothing refills within the test
    settled(ledger.apply(&settle(1_000, 1, vec![report("rl:d:k", limit, 1, 0, 0, 30)])));
    let tick = |now_ms| settle(now_ms, 2, vec![report("rl:d:other", limit, 1, 0, 0, 0)]);
    ledger.apply(&tick(2_001));
    assert_eq!(ledger.outstanding_tokens(NodeId(1)), 0, "the 1 s lease ended at 2 000");
    assert_eq!(ledger.outstanding_tokens_on_key("rl:d:k"), 0);
    assert_eq!(available(&ledger, "rl:d:k", 2_001), 70, "written off: counted as spent");
    let late = settled(ledger.apply(&settle(2_500, 1, vec![report("rl:d:k", limit, 2, 10, 0, 0)])));
    assert_eq!(late.credited_tokens, 20, "30 granted, 10 spent, nothing held");
    assert_eq!(available(&ledger, "rl:d:k", 2_500), 90);
}

// Proves spending beyond leases is debt: charged to the bucket at once as far as it holds
// tokens, the rest owed and paid from refill before any grant, with the exact wait.
#[test]
fn debt_is_charged_before_any_grant() {
    let mut ledger = QuotaLedger::new();
    let limit = bucket(10, 1_000, 10); // a token per 100 ms
    let charged =
        settled(ledger.apply(&settle(1_000, 1, vec![report("rl:d:k", limit, 1, 7, 0, 0)])));
    assert_eq!(charged.charged_tokens, 7);
    assert_eq!(available(&ledger, "rl:d:k", 1_000), 3);
    let over = settled(ledger.apply(&settle(1_000, 2, vec![report("rl:d:k", limit, 1, 5, 0, 4)])));
    assert_eq!(over.charged_tokens, 3, "3 of the 5 paid now, 2 owed");
    assert_eq!(ledger.key("rl:d:k").map(|entry| entry.debt_tokens), Some(2));
    assert_eq!((over.grant.granted_tokens, over.grant.retry_after_ms), (0, 300), "2 owed + 1");
    let early = settled(ledger.apply(&settle(1_250, 1, vec![report("rl:d:k", limit, 2, 7, 0, 1)])));
    assert_eq!(early.grant.granted_tokens, 0);
    let paid = settled(ledger.apply(&settle(1_300, 1, vec![report("rl:d:k", limit, 3, 7, 0, 1)])));
    assert_eq!(paid.grant.granted_tokens, 1, "the debt paid, a token granted");
    assert_eq!(ledger.key("rl:d:k").map(|entry| entry.debt_tokens), Some(0));
}

// Proves a grant whose answer never reached the node is credited back by its next report,
// and a report of a newer epoch starts the counts over while the old life stays spent.
#[test]
fn lost_grants_come_back_and_epochs_start_over() {
    let mut ledger = QuotaLedger::new();
    let limit = bucket(100, 3_600_000, 100);
    settled(ledger.apply(&settle(1_000, 1, vec![report("rl:d:k", limit, 1, 0, 0, 20)])));
    // The node never saw that answer: it still holds nothing and has spent nothing.
    let next = settled(ledger.apply(&settle(1_010, 1, vec![report("rl:d:k", limit, 2, 0, 0, 5)])));
    assert_eq!((next.credited_tokens, next.grant.granted_tokens), (20, 5));
    assert_eq!(available(&ledger, "rl:d:k", 1_010), 95);
    // The node spent 3 of the 5, then restarted: the new life reports from zero.
    let reborn = LeaseReport {
        epoch: LeaseEpoch { incarnation: 2, serial: 0 },
        ..report("rl:d:k", limit, 1, 1, 0, 0)
    };
    let fresh = settled(ledger.apply(&settle(1_020, 1, vec![reborn.clone()])));
    assert_eq!(fresh.charged_tokens, 1, "the old life's 5 stay spent; the new one spent 1");
    assert_eq!(available(&ledger, "rl:d:k", 1_020), 94);
    let old = ledger.apply(&settle(1_030, 1, vec![report("rl:d:k", limit, 9, 3, 0, 0)]));
    assert_eq!(old, QuotaResponse::Settled(vec![Ok(ReportOutcome::Superseded)]), "an older life");
}

// Proves a contended key follows fair shares: two nodes with equal demand get equal grants
// whatever how often each asks, and a node short of its want is told to wait a lookahead.
#[test]
fn contended_keys_follow_fair_shares() {
    let mut ledger = QuotaLedger::new();
    let limit = bucket(100, 1_000, 100); // 100/s
    let demand = |mut report: LeaseReport| {
        report.demand_milli_per_second = 200_000; // each node offers 200/s: 4x the limit together
        report
    };
    // Drain the burst first.
    settled(ledger.apply(&settle(1_000, 3, vec![report("rl:d:k", limit, 1, 100, 0, 0)])));
    let mut granted = [0_u64; 2];
    let mut seqs = [0_u64; 2];
    let mut spent = [0_u64; 2];
    for step in 0..200_u64 {
        let now_ms = 1_000 + step * 10;
        // Node 1 asks every 10 ms, node 2 every 50 ms.
        for (index, node) in [(0_usize, 1_u64), (1, 2)] {
            if node == 2 && step % 5 != 0 {
                continue;
            }
            seqs[index] += 1;
            let answer = settled(ledger.apply(&settle(
                now_ms,
                node,
                vec![demand(report("rl:d:k", limit, seqs[index], spent[index], 0, 50))],
            )));
            assert!(answer.contended || step == 0);
            granted[index] += answer.grant.granted_tokens;
            spent[index] += answer.grant.granted_tokens;
            if answer.contended && answer.grant.granted_tokens < 50 {
                assert!(answer.grant.retry_after_ms >= 250, "{answer:?}");
            }
        }
    }
    let total = granted[0] + granted[1];
    assert!(total <= 200 + 2, "2 s at 100/s after the drained burst: {granted:?}");
    let share = granted[0] as f64 / total as f64;
    assert!((0.4..=0.6).contains(&share), "equal demand, equal share: {granted:?}");
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

    let bad_reports = vec![
        LeaseReport { held_tokens: LEASE_TOKENS_MAX + 1, ..report("rl:d:good", limit, 1, 0, 0, 0) },
        LeaseReport { lookahead_ms: 0, ..report("rl:d:good", limit, 1, 0, 0, 0) },
        report("nope", limit, 1, 0, 0, 1),
    ];
    let before = with_bad.digest();
    let answer = with_bad.apply(&settle(1_000, 1, bad_reports));
    assert_eq!(
        answer,
        QuotaResponse::Settled(vec![
            Err(LeaseRequestError::ReportTokens),
            Err(LeaseRequestError::Lookahead(0)),
            Err(LeaseRequestError::Key(KeyError::Prefix)),
        ])
    );
    assert_eq!(with_bad.digest(), before, "time did not move either: 1 000 was applied");
}

// Proves a batch of reports settles exactly what the same reports one by one would, and an
// oversized batch is refused whole.
#[test]
fn batched_reports_equal_single_reports() {
    let limit = bucket(10, 1_000, 10);
    let grant = |ledger: &mut QuotaLedger| {
        ledger.apply(&settle(
            1_000,
            1,
            vec![report("rl:d:a", limit, 1, 0, 0, 6), report("rl:d:b", limit, 1, 0, 0, 4)],
        ))
    };
    let mut single = QuotaLedger::new();
    let mut batched = QuotaLedger::new();
    grant(&mut single);
    grant(&mut batched);
    let reports = vec![
        report("rl:d:a", limit, 2, 2, 1, 0),
        report("rl:d:b", limit, 2, 9, 0, 3),
        report("rl:d:missing", limit, 1, 1, 0, 0),
        report("rl:d:a", limit, 3, 3, 0, 2),
    ];
    let mut one_by_one = Vec::new();
    for report in &reports {
        let QuotaResponse::Settled(mut outcome) =
            single.apply(&settle(1_010, 1, vec![report.clone()]))
        else {
            panic!("a settlement")
        };
        one_by_one.push(outcome.remove(0));
    }
    assert_eq!(batched.apply(&settle(1_010, 1, reports)), QuotaResponse::Settled(one_by_one));
    assert_eq!(single.digest(), batched.digest());
    let before = batched.digest();
    let oversized = settle(
        2_000,
        1,
        vec![report("rl:d:a", limit, 9, 3, 0, 0); LEASE_REQUESTS_PER_COMMAND_MAX + 1],
    );
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

// Proves policy sets are versioned by the ledger: a new digest makes the next version, the
// current digest again makes none, a rollback repeats an earlier version's files, and a bad
// set is refused without a version.
#[test]
fn policy_sets_are_versioned_in_log_order() {
    let mut ledger = QuotaLedger::new();
    let author = PolicyAuthor { applied_by: "ops".to_owned(), message: String::new() };
    let put = |digest, files: &[(&str, &str)]| QuotaCommand::ApplyPolicySet {
        now_ms: 1_000,
        files: files.iter().map(|(n, t)| ((*n).to_owned(), (*t).to_owned())).collect(),
        digest,
        author: author.clone(),
    };
    let applied = |version, digest, created| {
        QuotaResponse::PolicySet(Ok(PolicyApplied { version, digest, created }))
    };
    assert_eq!(ledger.apply(&put(7, &[("a.yaml", "domain: a")])), applied(1, 7, true));
    assert_eq!(ledger.apply(&put(7, &[("a.yaml", "domain: a")])), applied(1, 7, false));
    assert_eq!(ledger.apply(&put(8, &[("a.yaml", "domain: b")])), applied(2, 8, true));
    assert_eq!(
        ledger.apply(&put(9, &[("a.yaml", "x"), ("a.yaml", "y")])),
        QuotaResponse::PolicySet(Err(PolicySetError::FileName("a.yaml".to_owned())))
    );
    let rollback = QuotaCommand::RollbackPolicySet { now_ms: 2_000, to_version: 1, author };
    assert_eq!(ledger.apply(&rollback), applied(3, 7, true));
    let current = ledger.policies().current().expect("applied");
    assert_eq!(current.info.rollback_of, Some(1));
    assert_eq!(current.files, Some(vec![("a.yaml".to_owned(), "domain: a".to_owned())]));
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
    let lease_request =
        (keys.clone(), limits.clone(), 0..30u64, prop_oneof![Just(0u64), 1..3_000u64]).prop_map(
            |(key, limit, tokens_wanted, lease_ttl_ms)| LeaseRequest {
                key: key.to_owned(),
                limit,
                tokens_wanted,
                lease_ttl_ms,
            },
        );
    let lease_report = (
        keys.clone(),
        limits.clone(),
        (0..3u64, 1..6u64),
        (0..40u64, 0..30u64, 0..30u64),
        0..300_000u64,
    )
        .prop_map(
            |(
                key,
                limit,
                (serial, seq),
                (spent_tokens, held_tokens, tokens_wanted),
                demand_milli_per_second,
            )| LeaseReport {
                key: key.to_owned(),
                limit,
                epoch: LeaseEpoch { incarnation: 1, serial },
                seq,
                spent_tokens,
                held_tokens,
                settled_tokens: spent_tokens / 2,
                tokens_wanted,
                demand_milli_per_second,
                lookahead_ms: 250,
                lease_ttl_ms: 500,
            },
        );
    let step_ms = 0..400u64;
    prop_oneof![
        4 => (step_ms.clone(), 1..4u64, prop::collection::vec(lease_request, 0..6))
            .prop_map(|(step, node, requests)| (step, QuotaCommand::AcquireLeases { now_ms: 0, node_id: NodeId(node), requests })),
        3 => (step_ms.clone(), 1..4u64, prop::collection::vec(lease_report, 0..5))
            .prop_map(|(step, node, reports)| (step, QuotaCommand::SettleLeases { now_ms: 0, node_id: NodeId(node), reports })),
        1 => (step_ms, 0..4u64, "[a-c]{1,3}")
            .prop_map(|(step, digest, text)| (step, QuotaCommand::ApplyPolicySet { now_ms: 0, files: vec![("p.yaml".to_owned(), text)], digest, author: PolicyAuthor { applied_by: "ops".to_owned(), message: String::new() } })),
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
                | QuotaCommand::SettleLeases { now_ms, .. }
                | QuotaCommand::ApplyPolicySet { now_ms, .. }
                | QuotaCommand::RollbackPolicySet { now_ms, .. }
                | QuotaCommand::Region { now_ms, .. } => *now_ms = clock_ms,
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

    // Proves conservation on a token bucket against honest nodes that also spend beyond
    // their leases: what the ledger attributes to nodes plus what its bucket holds, less the
    // debt it is owed, never exceeds capacity plus refill; the bucket never holds more than
    // its capacity; and the ledger attributes to each node exactly what the node reported
    // it spent and holds. The key's totals (what `ReadKeys` shows an outside checker) count
    // every grant and charge, and between any two states granted + charged - returned
    // grows by at most capacity plus the refill of the ledger time between.
    #[test]
    fn settlement_conserves_tokens(
        steps in prop::collection::vec((0..150u64, 1..4u64, 0..5u8, 1..15u64), 1..120),
    ) {
        let limit = bucket(10, 1_000, 20);
        let capacity = limit.capacity_tokens();
        let mut ledger = QuotaLedger::new();
        let start_ms = 50_000u64;
        let mut now_ms = start_ms;
        // node -> (spent, held, seq), as the node knows them.
        let mut nodes: BTreeMap<u64, (u64, u64, u64)> = BTreeMap::new();
        // (life, ledger time, net tokens drawn) after every step; the answers' sums in the
        // key's current life (the sweep may forget an idle key, and its totals start over).
        let mut samples: Vec<(u64, u64, i128)> = Vec::new();
        let (mut life_since_ms, mut granted_sum, mut charged_sum) = (0_u64, 0_u64, 0_u64);
        for (step_ms, node, action, tokens) in steps {
            let mut step_sums = (0_u64, 0_u64);
            now_ms += step_ms;
            let (spent, held, seq) = nodes.entry(node).or_insert((0, 0, 0));
            let mut send = |spent: u64, held: u64, want: u64, seq: &mut u64| {
                *seq += 1;
                let answer = settled(ledger.apply(&settle(now_ms, node, vec![report("rl:c:k", limit, *seq, spent, held, want)])));
                step_sums.0 += answer.grant.granted_tokens;
                step_sums.1 += answer.charged_tokens;
                answer
            };
            match action {
                0 => {
                    let answer = send(*spent, *held, tokens, seq);
                    prop_assert!(answer.grant.granted_tokens <= tokens);
                    *held += answer.grant.granted_tokens;
                }
                1 => {
                    let used = tokens.min(*held);
                    *held -= used;
                    *spent += used;
                }
                2 => {
                    *held -= tokens.min(*held);
                    send(*spent, *held, 0, seq);
                }
                3 => {
                    // Admitted without a lease (credit, fallback): debt.
                    *spent += tokens.min(3);
                    send(*spent, *held, 0, seq);
                }
                _ => {
                    // The node's lease expired: what it held is gone from it.
                    *held = 0;
                }
            }
            let entry = ledger.key("rl:c:k");
            let attributed: u64 = entry.map_or(0, |entry| {
                entry.leases.values().map(|lease| lease.spent_tokens + lease.written_off_tokens + lease.tokens).sum()
            });
            let debt = entry.map_or(0, |entry| entry.debt_tokens);
            let bucket_now = available(&ledger, "rl:c:k", now_ms);
            let refill = limit.requests_per_window * (now_ms - start_ms) / limit.window_ms;
            prop_assert!(bucket_now <= capacity);
            prop_assert!(
                attributed + bucket_now <= capacity + refill + debt + 1,
                "attributed {} + bucket {} > capacity {} + refill {} + debt {}",
                attributed, bucket_now, capacity, refill, debt
            );
            if let Some(entry) = entry {
                let totals = entry.totals;
                if totals.since_ms != life_since_ms {
                    (life_since_ms, granted_sum, charged_sum) = (totals.since_ms, 0, 0);
                }
                granted_sum += step_sums.0;
                charged_sum += step_sums.1;
                prop_assert_eq!((totals.granted_tokens, totals.charged_tokens), (granted_sum, charged_sum));
                let net = i128::from(totals.granted_tokens) + i128::from(totals.charged_tokens) - i128::from(totals.returned_tokens);
                samples.push((life_since_ms, ledger.last_seen_ms(), net));
                samples.push((life_since_ms, life_since_ms, 0));
            }
        }
        let rate_milli_per_ms = i128::from(limit.requests_per_window) * 1_000 / i128::from(limit.window_ms);
        samples.sort_unstable();
        for (first, (life, first_ms, first_net)) in samples.iter().enumerate() {
            for (_, last_ms, last_net) in samples[first..].iter().filter(|sample| sample.0 == *life) {
                let bound_milli = i128::from(capacity) * 1_000 + rate_milli_per_ms * i128::from(last_ms - first_ms) + 999;
                prop_assert!(
                    (last_net - first_net) * 1_000 <= bound_milli,
                    "net {} tokens drawn between {} and {} ms", last_net - first_net, first_ms, last_ms
                );
            }
        }
        // Every node settles: the ledger then attributes exactly what each reported.
        for (node, (spent, held, seq)) in &mut nodes {
            *seq += 1;
            settled(ledger.apply(&settle(now_ms, *node, vec![report("rl:c:k", limit, *seq, *spent, *held, 0)])));
            let lease = ledger.key("rl:c:k").and_then(|entry| entry.leases.get(&NodeId(*node)).copied()).expect("a record");
            prop_assert_eq!(lease.spent_tokens + lease.written_off_tokens + lease.tokens, *spent + *held);
        }
    }

    // Proves the lease accounting matches a naive model: per node one aggregate lease whose
    // expiry is the latest grant's, expired leases no longer live, a settlement that holds
    // nothing ending the live lease (and crediting at least what was live).
    #[test]
    fn lease_accounting_matches_a_naive_model(
        steps in prop::collection::vec((0..700u64, 1..4u64, 1..10u64, 1..1_500u64, prop::bool::weighted(0.35)), 1..60),
    ) {
        let limit = bucket(1_000, 1_000, 1_000);
        let mut ledger = QuotaLedger::new();
        let mut model: BTreeMap<u64, (u64, u64)> = BTreeMap::new(); // node -> (tokens, expires_at_ms)
        let mut now_ms = 10_000u64;
        let mut seqs: BTreeMap<u64, u64> = BTreeMap::new();
        for (step_ms, node, tokens, lease_ttl_ms, is_settle) in steps {
            now_ms += step_ms;
            model.retain(|_, (_, expires_at_ms)| *expires_at_ms > now_ms);
            if is_settle {
                // The node settles: it spent nothing and holds nothing, so all comes back.
                let seq = seqs.entry(node).or_insert(0);
                *seq += 1;
                let answer = settled(ledger.apply(&settle(now_ms, node, vec![LeaseReport { lease_ttl_ms, ..report("rl:m:k", limit, *seq, 0, 0, 0) }])));
                let held = model.remove(&node).map_or(0, |(held, _)| held);
                prop_assert!(answer.credited_tokens >= held, "credited {} of {} live", answer.credited_tokens, held);
            } else {
                // The node never spends: it reports what is live as held.
                let seq = seqs.entry(node).or_insert(0);
                *seq += 1;
                let live_held = model.get(&node).map_or(0, |(held, _)| *held);
                let ask = LeaseReport { lease_ttl_ms, ..report("rl:m:k", limit, *seq, 0, live_held, tokens) };
                let granted = settled(ledger.apply(&settle(now_ms, node, vec![ask]))).grant.granted_tokens;
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
                        .filter(|(_, lease)| lease.tokens > 0 && lease.expires_at_ms > now_ms)
                        .map(|(node, lease)| (node.0, (lease.tokens, lease.expires_at_ms)))
                        .collect()
                })
                .unwrap_or_default();
            prop_assert_eq!(&live, &model);
        }
    }
}
