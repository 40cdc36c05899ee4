//! One node's clock 25 h ahead (libfaketime, Debian's `faketime`) in a region of three real
//! node processes, while 16 clients debit with retries through every node: ledger time
//! follows the leader's clock only, so no idempotency key applies twice, no 1-hour hold
//! expires, no quota key grants more than its day bucket, and the skewed node is reported.

use std::sync::Arc;
use std::time::{Duration, Instant};

use anyhow::Context;
use common::billing::{
    ADMIN_TOKEN, BillingCluster, Rng, account, balance, completion, connect, full_trail,
    open_account, with_token,
};
use common::billing_checker::{Attempt, Completion, check_bank, check_exactly_once};
use common::cluster::{CLUSTER_POLICY, admin_client, call, wanted};
use quotamesh::api::proto::quotamesh::admin::v1 as admin;
use quotamesh::api::proto::quotamesh::billing::v1 as pb;
use quotamesh::core::billing::{AccountId, AuditEntry, OperationKind};
use tokio::sync::Mutex;

const CLIENTS: u64 = 16;
const DEBITS_PER_CLIENT: u64 = 8;
const INITIAL: u64 = 1_000_000;
const FLOOR: u64 = 0;
/// The skewed node.
const FAST_NODE: u64 = 3;
/// How far its clock runs ahead: past the 24 h idempotency retention.
const SKEW: &str = "+25h";
const HOLDS: u64 = 6;
const HOLD_TTL_MS: u64 = 3_600_000;
/// The `small` key of the cluster test policy: 10 tokens a day.
const SMALL_BUCKET_TOKENS: u64 = 10;

/// 16 clients debit through the nodes `through` (indexes), each a fresh key per debit,
/// retrying an unknown outcome with the same key; returns the history and the keys that
/// got an answer.
async fn workload(
    addresses: Vec<String>,
    through: Vec<usize>,
    phase: &'static str,
) -> (Vec<Attempt>, Vec<(String, u64)>) {
    let history = Arc::new(Mutex::new((Vec::new(), Vec::new())));
    let mut tasks = Vec::new();
    for client_id in 0..CLIENTS {
        let (addresses, through, history) =
            (addresses.clone(), through.clone(), Arc::clone(&history));
        tasks.push(tokio::spawn(async move {
            let mut rng = Rng::new(7_000 + client_id);
            let mut clients = Vec::new();
            for address in &addresses {
                clients.push(connect(address).await.expect("lazy channel"));
            }
            for op in 0..DEBITS_PER_CLIENT {
                let key = format!("{phase}-c{client_id}-d{op}");
                let amount = rng.between(1, 50);
                for _ in 0..20 {
                    let pick = rng.between(0, through.len() as u64 - 1) as usize;
                    let outcome = debit(&mut clients[through[pick]], &key, amount).await;
                    let unknown = matches!(outcome.completion, Completion::Info(_));
                    let mut history = history.lock().await;
                    history.0.push(outcome);
                    if !unknown {
                        history.1.push((key.clone(), amount));
                        break;
                    }
                    drop(history);
                    tokio::time::sleep(Duration::from_millis(50)).await;
                }
            }
        }));
    }
    for task in tasks {
        task.await.expect("client task");
    }
    Arc::try_unwrap(history).map(Mutex::into_inner).unwrap_or_default()
}

/// Sends every `(key, amount)` again through the node at `address`.
async fn replay(address: &str, keys: &[(String, u64)]) -> anyhow::Result<Vec<Attempt>> {
    let mut client = connect(address).await?;
    let mut history = Vec::new();
    for (key, amount) in keys {
        history.push(debit(&mut client, key, *amount).await);
    }
    Ok(history)
}

async fn debit(
    client: &mut common::billing::BillingClient<tonic::transport::Channel>,
    key: &str,
    amount: u64,
) -> Attempt {
    let request = pb::DebitRequest {
        account: Some(account("t1", "api")),
        amount,
        idempotency_key: key.to_owned(),
    };
    let result = client.debit(with_token(request, ADMIN_TOKEN)).await;
    Attempt {
        key: key.to_owned(),
        account: AccountId::new("t1", "api"),
        amount,
        completion: completion(&result),
    }
}

/// Every node's trail, once they agree (each read is linearizable on its node).
async fn agreed_trail(cluster: &BillingCluster) -> anyhow::Result<Vec<AuditEntry>> {
    let deadline = Instant::now() + Duration::from_secs(30);
    loop {
        let mut trails = Vec::new();
        for index in 0..cluster.nodes.len() {
            cluster.wait_for_leader(index).await?;
            let mut client = cluster.client(index).await?;
            trails.push(full_trail(&mut client).await?);
        }
        if trails.windows(2).all(|pair| pair[0] == pair[1]) {
            return Ok(trails.swap_remove(0));
        }
        anyhow::ensure!(Instant::now() < deadline, "trails did not converge within 30 s");
        tokio::time::sleep(Duration::from_millis(200)).await;
    }
}

/// Asks for quota-key leases through every node in turn (the fast one included) until the
/// bucket answers empty a few times; returns the tokens granted in all.
async fn drain_small_bucket(admin_addrs: &[String]) -> anyhow::Result<u64> {
    let mut granted = 0;
    for round in 0..12 {
        let address = &admin_addrs[round % admin_addrs.len()];
        let mut client = admin_client(address.parse()?).await?;
        let request = admin::AcquireLeasesRequest {
            leases: vec![wanted("small", "clock-skew", 3)],
            lease_ttl_ms: 1_000,
        };
        let reply = client.acquire_leases(call(request)).await?.into_inner();
        granted += reply.results.iter().map(|result| result.granted_tokens).sum::<u64>();
    }
    Ok(granted)
}

/// The scenario of the file's first sentence.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_clock_25_hours_ahead_moves_no_ledger_time() -> anyhow::Result<()> {
    let preload = common::libfaketime()?;
    let scratch = tempfile::tempdir()?;
    let policy = common::write_file(scratch.path(), "policy.yaml", CLUSTER_POLICY);
    let environment = |id: u64| {
        if id == FAST_NODE {
            vec![
                ("LD_PRELOAD", preload.display().to_string()),
                ("FAKETIME", SKEW.to_owned()),
                // Only the wall clock is off; timers keep their pace.
                ("FAKETIME_DONT_FAKE_MONOTONIC", "1".to_owned()),
            ]
        } else {
            Vec::new()
        }
    };
    let started = Instant::now();
    let cluster = BillingCluster::start_with_environment(3, &policy, &environment)?;
    let admin_addrs: Vec<String> = cluster.nodes.iter().map(|n| n.admin_addr.clone()).collect();
    // The quota group forms from node 1 (the billing group forms itself: node 1 bootstraps).
    let init = std::process::Command::new(env!("CARGO_BIN_EXE_quotamesh"))
        .args(["cluster", "init", "--json", "--admin-addr", &admin_addrs[0]])
        .env("QUOTAMESH_ADMIN_TOKEN", common::tls::ADMIN_TOKEN)
        .output()?;
    anyhow::ensure!(
        init.status.success(),
        "cluster init: {}",
        String::from_utf8_lossy(&init.stderr)
    );
    cluster.wait_for_leader(0).await?;
    let mut client = cluster.client(0).await?;
    open_account(&mut client, "t1", "api", FLOOR, INITIAL).await?;

    // Holds of an hour, reserved through the sane nodes before the fast one proposes
    // anything: none may expire while the test runs.
    let mut holds = Vec::new();
    for hold in 0..HOLDS {
        let mut through = cluster.client(usize::try_from(hold % 2)?).await?;
        let request = pb::ReserveRequest {
            account: Some(account("t1", "api")),
            amount: 100,
            ttl_ms: HOLD_TTL_MS,
            idempotency_key: format!("hold-{hold}"),
        };
        let reply = through.reserve(with_token(request, ADMIN_TOKEN)).await?.into_inner();
        holds.push(reply.hold_id.context("an approved reserve names its hold")?);
    }

    // Debits through the two nodes with sane clocks, then through every node (the fast one
    // proposes from here on), then every key answered before is sent again through the
    // fast node and through node 1: each must answer DUPLICATE, 25 h of its clock later.
    let addresses: Vec<String> = cluster.nodes.iter().map(|n| n.billing_addr.clone()).collect();
    let (mut history, answered_before) = workload(addresses.clone(), vec![0, 1], "before").await;
    let granted_before = drain_small_bucket(&admin_addrs).await?;
    let (during, answered_during) = workload(addresses.clone(), vec![0, 1, 2], "during").await;
    history.extend(during);
    let fast = usize::try_from(FAST_NODE - 1)?;
    history.extend(replay(&addresses[fast], &answered_before).await?);
    history.extend(replay(&addresses[0], &answered_before).await?);
    history.extend(replay(&addresses[fast], &answered_during).await?);
    let granted = granted_before + drain_small_bucket(&admin_addrs).await?;
    let approved = history
        .iter()
        .filter(|a| matches!(a.completion, Completion::Ok { duplicate: false, .. }))
        .count();
    let duplicates = history
        .iter()
        .filter(|a| matches!(a.completion, Completion::Ok { duplicate: true, .. }))
        .count();
    eprintln!("approved {approved}, duplicates {duplicates}, quota tokens granted {granted}");
    let debits = usize::try_from(CLIENTS * DEBITS_PER_CLIENT)?;
    assert!(answered_before.len() == debits && answered_during.len() == debits, "unanswered");

    // No key applied twice, and the money adds up.
    let trail = agreed_trail(&cluster).await?;
    let final_balance = balance(&mut client, "t1", "api").await?.balance;
    check_exactly_once(&history, &trail).map_err(anyhow::Error::msg)?;
    assert!(duplicates >= 3 * debits, "replays not answered as duplicates: {duplicates}");
    // The holds are not debits: the bank checker sees them as held, not spent.
    let account_id = AccountId::new("t1", "api");
    check_bank(&account_id, INITIAL, FLOOR, &history, &trail, final_balance)
        .map_err(anyhow::Error::msg)?;

    // No hold expired, and ledger time moved no faster than this test's own clock.
    let expired: Vec<&AuditEntry> =
        trail.iter().filter(|entry| entry.kind == OperationKind::Expire).collect();
    assert!(expired.is_empty(), "holds expired early: {expired:?}");
    let first_ms = trail.first().map_or(0, |entry| entry.time_ms);
    let last_ms = trail.last().map_or(0, |entry| entry.time_ms);
    let elapsed_ms = u64::try_from(started.elapsed().as_millis())?;
    assert!(
        last_ms - first_ms <= elapsed_ms,
        "ledger time advanced {} ms in {elapsed_ms} ms",
        last_ms - first_ms
    );
    for hold in holds {
        let request = pb::CaptureRequest {
            account: Some(account("t1", "api")),
            hold_id: hold,
            amount: 100,
            idempotency_key: format!("capture-{hold}"),
        };
        let reply = client.capture(with_token(request, ADMIN_TOKEN)).await;
        let reply = reply.with_context(|| format!("capture of hold {hold}"))?.into_inner();
        assert_eq!(reply.decision(), pb::Decision::Approved, "hold {hold}");
    }

    // The day bucket gave out at most its 10 tokens (plus what a day's rate refilled meanwhile).
    assert!(granted <= SMALL_BUCKET_TOKENS, "the 10-a-day key granted {granted} tokens");
    assert!(granted > 0, "the quota key granted nothing: the check would prove nothing");

    // The leaders reported the fast node: metric and `cluster status`.
    let mut reported = false;
    for node in &cluster.nodes {
        let process = node.process.as_ref().context("running")?;
        let metrics = process.metrics()?;
        let series = format!("quotamesh_clock_offset_exceeded_total{{node=\"{FAST_NODE}\"}}");
        if common::metric_value(&metrics, &series) > 0.0 {
            reported = true;
            let output = std::process::Command::new(env!("CARGO_BIN_EXE_quotamesh"))
                .args(["cluster", "status", "--json", "--admin-addr", &node.admin_addr])
                .env("QUOTAMESH_ADMIN_TOKEN", common::tls::ADMIN_TOKEN)
                .output()?;
            let status: serde_json::Value = serde_json::from_slice(&output.stdout)
                .with_context(|| String::from_utf8_lossy(&output.stderr).into_owned())?;
            let offsets = &status["nodes"][0]["clock_offsets"];
            let fast = offsets
                .as_array()
                .and_then(|all| all.iter().find(|seen| seen["node_id"] == FAST_NODE))
                .with_context(|| {
                    format!("node {} reports no clock of node 3: {status}", node.id)
                })?;
            assert_eq!(fast["exceeded"], true, "{fast}");
            let offset_ms = fast["offset_ms"].as_i64().context("offset")?;
            assert!(offset_ms > 24 * 3_600_000, "node 3's offset seen as {offset_ms} ms");
        }
    }
    assert!(reported, "no node reported node {FAST_NODE}'s clock");
    Ok(())
}
