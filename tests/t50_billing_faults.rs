//! Billing under concurrency and faults, on three real node processes: 16 clients debiting
//! one account with random amounts and retries; the leader killed with SIGKILL mid-stream;
//! a leader cut off from both followers. Every client operation is recorded as ok, fail or
//! info (unknown), and the bank and exactly-once checkers run over the whole trail of every
//! node.

use std::sync::Arc;
use std::time::{Duration, Instant};

use common::billing::{
    ADMIN_TOKEN, BillingCluster, DEADLINE_MS, Rng, account, balance, completion, connect,
    full_trail, open_account, with_token,
};
use common::billing_checker::{Attempt, Completion, check_bank, check_exactly_once};
use quotamesh::api::proto::quotamesh::billing::v1 as pb;
use quotamesh::core::billing::{AccountId, AuditEntry, Decision};
use tokio::sync::Mutex;

const CLIENTS: u64 = 16;
const INITIAL: u64 = 12_000;
const FLOOR: u64 = 500;

/// 16 clients, each sending `debits_per_client` debits of 1..=50 to random nodes. A debit
/// with an unknown outcome is retried with the same key (up to 20 times); one in five
/// answered debits is sent once more with the same key, to exercise replays.
async fn workload(addresses: Vec<String>, debits_per_client: u64, seed: u64) -> Vec<Attempt> {
    let history = Arc::new(Mutex::new(Vec::new()));
    let mut tasks = Vec::new();
    for client_id in 0..CLIENTS {
        let (addresses, history) = (addresses.clone(), Arc::clone(&history));
        tasks.push(tokio::spawn(async move {
            let mut rng = Rng::new(seed * 1000 + client_id);
            let mut clients = Vec::new();
            for address in &addresses {
                clients.push(connect(address).await.expect("lazy channel"));
            }
            for op in 0..debits_per_client {
                let key = format!("c{client_id}-d{op}");
                let amount = rng.between(1, 50);
                let mut extra_retry = rng.between(0, 4) == 0;
                for _ in 0..20 {
                    let node = rng.between(0, addresses.len() as u64 - 1) as usize;
                    let request = pb::DebitRequest {
                        account: Some(account("t1", "api")),
                        amount,
                        idempotency_key: key.clone(),
                    };
                    let result = clients[node].debit(with_token(request, ADMIN_TOKEN)).await;
                    let completion = completion(&result);
                    let unknown = matches!(completion, Completion::Info(_));
                    history.lock().await.push(Attempt {
                        key: key.clone(),
                        account: AccountId::new("t1", "api"),
                        amount,
                        completion,
                    });
                    if unknown {
                        tokio::time::sleep(Duration::from_millis(50)).await;
                        continue;
                    }
                    if std::mem::take(&mut extra_retry) {
                        continue;
                    }
                    break;
                }
            }
        }));
    }
    for task in tasks {
        task.await.expect("client task");
    }
    Arc::try_unwrap(history).map(Mutex::into_inner).unwrap_or_default()
}

/// Reads every node's trail (each through a linearizable read on that node) until they are
/// equal; each read must be a prefix of the longest, since commits that were pending when
/// the nodes came back may land between two reads.
async fn agreed_trail(cluster: &BillingCluster) -> anyhow::Result<Vec<AuditEntry>> {
    let deadline = Instant::now() + Duration::from_secs(30);
    loop {
        let mut trails = Vec::new();
        for index in 0..cluster.nodes.len() {
            cluster.wait_for_leader(index).await?;
            let mut client = cluster.client(index).await?;
            trails.push(full_trail(&mut client).await?);
        }
        let longest = trails.iter().map(Vec::len).max().unwrap_or(0);
        let reference = trails.iter().find(|t| t.len() == longest).cloned().unwrap_or_default();
        for (index, trail) in trails.iter().enumerate() {
            anyhow::ensure!(
                reference.starts_with(trail),
                "node {} holds a trail that is not a prefix of the longest",
                index + 1
            );
        }
        if trails.iter().all(|trail| trail.len() == longest) {
            return Ok(reference);
        }
        anyhow::ensure!(Instant::now() < deadline, "trails did not converge within 30 s");
        tokio::time::sleep(Duration::from_millis(200)).await;
    }
}

fn summary(history: &[Attempt]) -> (usize, usize, usize, usize) {
    let approved = history
        .iter()
        .filter(|a| {
            matches!(
                a.completion,
                Completion::Ok { decision: Decision::Approved, duplicate: false, .. }
            )
        })
        .count();
    let duplicates = history
        .iter()
        .filter(|a| matches!(a.completion, Completion::Ok { duplicate: true, .. }))
        .count();
    let insufficient = history
        .iter()
        .filter(|a| {
            matches!(a.completion, Completion::Ok { decision: Decision::InsufficientFunds, .. })
        })
        .count();
    let unknown = history.iter().filter(|a| matches!(a.completion, Completion::Info(_))).count();
    (approved, duplicates, insufficient, unknown)
}

async fn check_all(cluster: &BillingCluster, history: &[Attempt]) -> anyhow::Result<()> {
    let trail = agreed_trail(cluster).await?;
    let mut client = cluster.client(0).await?;
    let final_balance = balance(&mut client, "t1", "api").await?.balance;
    let account = AccountId::new("t1", "api");
    check_bank(&account, INITIAL, FLOOR, history, &trail, final_balance)
        .map_err(anyhow::Error::msg)?;
    check_exactly_once(history, &trail).map_err(anyhow::Error::msg)?;
    Ok(())
}

/// 16 concurrent clients with random amounts and retries: the final balance is the initial
/// minus the approved debits, each approved debit is in the trail exactly once, the balance
/// never went below the floor, and every node holds the same trail.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn concurrent_debits_are_exact() -> anyhow::Result<()> {
    let cluster = BillingCluster::start(3, "")?;
    cluster.wait_for_leader(0).await?;
    let mut client = cluster.client(0).await?;
    open_account(&mut client, "t1", "api", FLOOR, INITIAL).await?;
    let addresses = cluster.nodes.iter().map(|n| n.billing_addr.clone()).collect();
    let history = workload(addresses, 40, 1).await;
    let (approved, duplicates, insufficient, unknown) = summary(&history);
    eprintln!(
        "approved {approved}, duplicates {duplicates}, insufficient {insufficient}, unknown {unknown}"
    );
    assert!(approved > 100 && duplicates > 10 && insufficient > 0, "the workload did too little");
    check_all(&cluster, &history).await
}

/// The leader is killed with SIGKILL mid-stream and restarted after: no acknowledged debit
/// is lost, no retried debit is applied twice (by key, over the whole trail).
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn leader_killed_mid_stream_loses_and_duplicates_nothing() -> anyhow::Result<()> {
    let mut cluster = BillingCluster::start(3, "")?;
    let leader = cluster.wait_for_leader(0).await?;
    let mut client = cluster.client(0).await?;
    open_account(&mut client, "t1", "api", FLOOR, INITIAL).await?;
    let addresses = cluster.nodes.iter().map(|n| n.billing_addr.clone()).collect();
    let stream = tokio::spawn(workload(addresses, 40, 2));
    tokio::time::sleep(Duration::from_millis(1500)).await;
    let killed = cluster.index_of(leader);
    cluster.nodes[killed].kill()?;
    eprintln!("killed the leader, node {leader}");
    let history = stream.await?;
    cluster.nodes[killed].start()?;
    let (approved, duplicates, insufficient, unknown) = summary(&history);
    eprintln!(
        "approved {approved}, duplicates {duplicates}, insufficient {insufficient}, unknown {unknown}"
    );
    assert!(approved > 100, "the workload did too little");
    check_all(&cluster, &history).await
}

/// A leader whose two followers are stopped approves nothing: every debit answers
/// UNAVAILABLE within the deadline (plus scheduling slack), and so does a balance read.
/// After the followers return, those debits may or may not have applied (they were
/// unknown), and the checkers hold.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn minority_refuses_within_the_deadline() -> anyhow::Result<()> {
    let mut cluster = BillingCluster::start(3, "")?;
    let leader = cluster.wait_for_leader(0).await?;
    let mut client = cluster.client(0).await?;
    open_account(&mut client, "t1", "api", FLOOR, INITIAL).await?;
    let alone = cluster.index_of(leader);
    for index in 0..3 {
        if index != alone {
            cluster.nodes[index].stop()?;
        }
    }
    let mut minority = cluster.client(alone).await?;
    let slack = Duration::from_millis(750);
    let mut history = Vec::new();
    for op in 0..5 {
        let key = format!("minority-{op}");
        let request = pb::DebitRequest {
            account: Some(account("t1", "api")),
            amount: 10,
            idempotency_key: key.clone(),
        };
        let started = Instant::now();
        let result = minority.debit(with_token(request, ADMIN_TOKEN)).await;
        let elapsed = started.elapsed();
        let code = result.as_ref().map(|_| tonic::Code::Ok).map_err(tonic::Status::code);
        assert_eq!(code, Err(tonic::Code::Unavailable), "debit {op} on a minority");
        assert!(elapsed <= Duration::from_millis(DEADLINE_MS) + slack, "refused after {elapsed:?}");
        history.push(Attempt {
            key,
            account: AccountId::new("t1", "api"),
            amount: 10,
            completion: completion(&result),
        });
    }
    let started = Instant::now();
    let read = minority
        .get_balance(with_token(
            pb::GetBalanceRequest { account: Some(account("t1", "api")) },
            ADMIN_TOKEN,
        ))
        .await;
    assert_eq!(read.map(|_| ()).map_err(|s| s.code()), Err(tonic::Code::Unavailable));
    assert!(started.elapsed() <= Duration::from_millis(DEADLINE_MS) + slack);

    for index in 0..3 {
        if index != alone {
            cluster.nodes[index].start()?;
        }
    }
    check_all(&cluster, &history).await
}

/// Coordinated crashes with reads right after: each of ten trials commits a debit, kills all three
/// nodes with SIGKILL the moment it is acknowledged, restarts them and reads the balance
/// through the node that led, then through each other node; every read shows every
/// acknowledged debit. A leader may keep its leadership across the restart while the
/// committed index it restarts from (a hint, not fsynced) misses the last entries: its read
/// index would then serve the state before them (openraft issue 1511; found by
/// quotamesh-jepsen's bank workload, seed 1000, as a stale read after a crash of all nodes).
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn reads_after_a_crash_of_every_node_show_every_acknowledged_debit() -> anyhow::Result<()> {
    const TRIALS: u64 = 10;
    let _hog = common::CpuHog::start(2);
    let mut cluster = BillingCluster::start(3, "")?;
    cluster.wait_for_leader(0).await?;
    let mut client = cluster.client(0).await?;
    open_account(&mut client, "t1", "api", FLOOR, INITIAL).await?;
    let mut expected = INITIAL;
    for trial in 0..TRIALS {
        let leader = cluster.wait_for_leader(0).await?;
        let leader_index = cluster.index_of(leader);
        let mut client = cluster.client(leader_index).await?;
        let amount = trial + 1;
        let request = pb::DebitRequest {
            account: Some(account("t1", "api")),
            amount,
            idempotency_key: format!("crash-{trial}"),
        };
        let reply = client.debit(with_token(request, ADMIN_TOKEN)).await?.into_inner();
        anyhow::ensure!(reply.decision() == pb::Decision::Approved, "trial {trial}: {reply:?}");
        expected -= amount;
        for node in &mut cluster.nodes {
            node.kill()?;
        }
        for node in &mut cluster.nodes {
            node.start()?;
        }
        let order =
            std::iter::once(leader_index).chain((0..3).filter(|index| *index != leader_index));
        for index in order {
            let seen = balance_when_served(&cluster, index).await?;
            assert_eq!(
                seen.balance,
                expected,
                "trial {trial}: node {} read {seen:?} after the crash of every node (led by \
                 node {leader}), acknowledged balance {expected}",
                index + 1
            );
        }
    }
    Ok(())
}

/// The first balance node `index` serves (it answers `UNAVAILABLE` while the group has no
/// leader after a restart), within 30 s, asked every 2 ms.
async fn balance_when_served(
    cluster: &BillingCluster,
    index: usize,
) -> anyhow::Result<pb::BalanceReply> {
    let deadline = Instant::now() + Duration::from_secs(30);
    loop {
        if let Ok(mut client) = cluster.client(index).await
            && let Ok(reply) = balance(&mut client, "t1", "api").await
        {
            return Ok(reply);
        }
        anyhow::ensure!(Instant::now() < deadline, "node {} served no read in 30 s", index + 1);
        // Often: the stale read could only come before the first replication round.
        tokio::time::sleep(Duration::from_millis(2)).await;
    }
}
