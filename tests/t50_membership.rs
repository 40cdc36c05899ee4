//! Fault: membership changes under load. Grants (and, in the billing test, debits) stream in
//! while the region grows from three voters to five and shrinks back to three, removing two
//! of the original nodes (the leader among them when it is one of the two), all through
//! `quotamesh cluster add-node` and `remove-node`, which change both of the region's groups.
//! And `add-node` itself: it returns only once the newcomer has applied the leader's log.

use std::sync::Arc;
use std::time::{Duration, Instant};

use anyhow::{Context, Result, bail};
use common::CpuHog;
use common::billing::{
    ADMIN_TOKEN as BILLING_TOKEN, BillingCluster, Rng, balance, completion, connect, full_trail,
    open_account, with_token,
};
use common::billing_checker::{Attempt, Completion, check_bank, check_exactly_once};
use common::cluster::{
    Cluster, ClusterOptions, Outcome, admin_client, call, check_grants, cli, stream_grants, wanted,
};
use quotamesh::api::proto::quotamesh::admin::v1 as admin;
use quotamesh::api::proto::quotamesh::billing::v1 as pb;
use quotamesh::core::billing::AccountId;

/// Runs a `quotamesh cluster` membership command until it succeeds: right after a leader is
/// removed no node leads for a moment. `done` recognises a refusal meaning that an earlier
/// attempt, whose answer was lost, already made the change.
async fn until_done(arguments: &[&str], done: &str) -> Result<()> {
    let deadline = Instant::now() + Duration::from_secs(60);
    loop {
        match cli(arguments) {
            Ok(_) => return Ok(()),
            Err(error) if error.to_string().contains(done) => return Ok(()),
            Err(error) if Instant::now() > deadline => return Err(error),
            Err(_) => tokio::time::sleep(Duration::from_millis(100)).await,
        }
    }
}

/// `quotamesh cluster add-node` of node `id` at `raft_addr` to `group` (`all`, `quota` or
/// `billing`), through the admin addresses `voters`, until done.
async fn add_node(voters: &str, id: u64, raft_addr: &str, group: &str) -> Result<()> {
    let id = id.to_string();
    let arguments = [
        "cluster",
        "add-node",
        "--admin-addr",
        voters,
        "--node-id",
        &id,
        "--raft-addr",
        raft_addr,
        "--group",
        group,
    ];
    until_done(&arguments, "a voter of the").await
}

/// `quotamesh cluster remove-node` of node `id` from `group`, until done.
async fn remove_node(voters: &str, id: u64, group: &str) -> Result<()> {
    let id = id.to_string();
    let arguments =
        ["cluster", "remove-node", "--admin-addr", voters, "--node-id", &id, "--group", group];
    // "is not a member" of one group; "a member of neither group" with `all`.
    until_done(&arguments, "a member").await
}

/// Waits until node `id` sees exactly `voters` as voters.
async fn voters_are(cluster: &Cluster, id: u64, voters: &[u64]) -> Result<()> {
    let deadline = Instant::now() + Duration::from_secs(30);
    loop {
        let seen = cluster.voters(id).await.unwrap_or_default();
        if seen == voters {
            return Ok(());
        }
        if Instant::now() > deadline {
            bail!("node {id} sees voters {seen:?}, expected {voters:?}");
        }
        tokio::time::sleep(Duration::from_millis(20)).await;
    }
}

// Proves that `quotamesh cluster add-node` returns only once the newcomer has applied every
// entry the leader's log held when the change was made, though it had to install a snapshot
// first, grants kept streaming in and both cores were busy: right after the command returns, the newcomer's own status shows at
// least the index the command reports it waited for, which is past every grant acknowledged
// before the command started.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn add_node_returns_once_the_newcomer_has_applied_the_log() -> Result<()> {
    // Snapshots every 100 entries: the newcomer catches up from a snapshot, then the log.
    let options = ClusterOptions {
        snapshot_every_logs: Some(100),
        logs_kept_after_snapshot: Some(10),
        ..ClusterOptions::default()
    };
    let mut cluster = Cluster::start(3, options).await?;
    let leader = cluster.leader().await?;
    let mut client = cluster.admin(leader).await?;
    for n in 0..300 {
        let request = admin::AcquireLeasesRequest {
            leases: vec![wanted("api_key", &format!("t50-catch-up-{n}"), 1)],
            lease_ttl_ms: 0,
        };
        client.acquire_leases(call(request)).await?;
    }
    let _hog = CpuHog::start(2);
    let (stop, stopped) = tokio::sync::watch::channel(false);
    let stream = tokio::spawn(stream_grants(
        3,
        cluster.nodes[&3].admin_addr,
        "t50-add-node".to_owned(),
        1,
        stopped,
    ));
    let raft_addr = cluster.start_newcomer(4)?.raft_addr.to_string();
    let before = cluster.status(leader).await?.commit_index.context("a committed index")?;
    let started = Instant::now();
    let output = cli(&[
        "cluster",
        "add-node",
        "--json",
        "--admin-addr",
        &cluster.admin_addrs(&[1, 2, 3, 4]),
        "--node-id",
        "4",
        "--raft-addr",
        &raft_addr,
        "--group",
        "quota",
    ])?;
    let took = started.elapsed();
    let newcomer = cluster.status(4).await?;
    let _ = stop.send(true);
    stream.await?;
    let reply: serde_json::Value = serde_json::from_str(&output)?;
    let waited_for = reply["groups"]["quota"]["caught_up_index"]
        .as_u64()
        .with_context(|| format!("add-node reported no index: {reply}"))?;
    eprintln!(
        "add-node took {took:?}; committed before it {before}, waited for {waited_for}, \
         newcomer applied {:?}",
        newcomer.applied_index
    );
    assert!(waited_for > before, "the change itself is in the log after {before}");
    assert!(
        newcomer.applied_index.is_some_and(|applied| applied >= waited_for),
        "add-node returned with the newcomer at {:?}, short of {waited_for}",
        newcomer.applied_index
    );
    assert!(newcomer.snapshot_index.is_some(), "it caught up from a snapshot: {newcomer:?}");
    assert!(newcomer.members.iter().any(|member| member.node_id == 4 && member.voter));
    Ok(())
}

// Proves that the quota group's membership can go 3 -> 5 -> 3 while grants flow (this
// region's billing group is never formed, so the commands name the quota group): the new
// nodes catch up and vote, the removed ones (the leader possibly among them) leave, grants
// keep committing, and the final three nodes hold every acknowledged grant exactly once and
// agree on the ledger.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn membership_goes_three_five_three_while_grants_flow() -> Result<()> {
    let mut cluster = Cluster::start(3, ClusterOptions::default()).await?;
    let (stop, stopped) = tokio::sync::watch::channel(false);
    // Node 3 stays a voter throughout; grants go through it.
    let stream = tokio::spawn(stream_grants(
        3,
        cluster.nodes[&3].admin_addr,
        "t50-members".to_owned(),
        2,
        stopped,
    ));

    let changes_started = Instant::now();
    for id in [4, 5] {
        let raft_addr = cluster.start_newcomer(id)?.raft_addr.to_string();
        add_node(&cluster.admin_addrs(&[1, 2, 3]), id, &raft_addr, "quota").await?;
        eprintln!("added {id} at {:?}", changes_started.elapsed());
    }
    for id in [1, 2, 3, 4, 5] {
        voters_are(&cluster, id, &[1, 2, 3, 4, 5]).await?;
    }
    // Grants keep committing, so the five seldom stand on one applied index at the moment
    // they are asked: each must catch up to where node 3 was once all five were voters (they
    // converge exactly once the grants stop, below).
    let grown = cluster.status(3).await?;
    assert!(grown.ledger_keys > 0, "grants flowed while the region grew");
    let deadline = Instant::now() + Duration::from_secs(30);
    for id in [1, 2, 3, 4, 5] {
        while cluster.status(id).await?.applied_index < grown.applied_index {
            anyhow::ensure!(Instant::now() < deadline, "node {id} did not catch up");
            tokio::time::sleep(Duration::from_millis(20)).await;
        }
    }

    for id in [1, 2] {
        remove_node(&cluster.admin_addrs(&[1, 2, 3, 4, 5]), id, "quota").await?;
        eprintln!("removed {id} at {:?}", changes_started.elapsed());
    }
    for id in [3, 4, 5] {
        voters_are(&cluster, id, &[3, 4, 5]).await?;
    }
    let changes_done = Instant::now();
    let leader = cluster.leader_among(&[3, 4, 5]).await?;
    // Grants keep committing on the shrunk region.
    let keys_then = cluster.status(leader).await?.ledger_keys;
    let deadline = Instant::now() + Duration::from_secs(30);
    while cluster.status(leader).await?.ledger_keys < keys_then + 20 {
        anyhow::ensure!(Instant::now() < deadline, "no grant committed after the shrink");
        tokio::time::sleep(Duration::from_millis(20)).await;
    }

    let _ = stop.send(true);
    let ops = stream.await?;
    cluster.converged(&[3, 4, 5]).await?;
    for id in [3, 4, 5] {
        let (ok, fail, unknown, applied) = check_grants(&cluster, id, &ops).await?;
        eprintln!("node {id}: {ok} ok, {fail} fail, {unknown} unknown ({applied} applied)");
    }
    let during_changes = ops
        .iter()
        .filter(|op| {
            op.outcome == Outcome::Ok
                && op.completed_at > changes_started
                && op.completed_at < changes_done
        })
        .count();
    let slowest = ops
        .windows(2)
        .map(|pair| {
            (pair[1].completed_at - pair[0].completed_at, pair[1].completed_at - changes_started)
        })
        .max()
        .unwrap_or_default();
    eprintln!("slowest grant: {slowest:?}");
    eprintln!(
        "{during_changes} grants acknowledged during {:?} of membership changes",
        changes_done - changes_started
    );
    assert!(during_changes >= 5, "grants were acknowledged while the membership changed");
    Ok(())
}

/// Each billing client's account and its opening balance (high enough that no debit of the
/// test is refused for funds: every acknowledged debit must be in the trail).
const BILLING_CLIENTS: u64 = 4;
const OPENING_BALANCE: u64 = 1_000_000;

fn meter(client: u64) -> String {
    format!("m{client}")
}

/// Debits `t1/m<client>` through `address` with keys `c<client>-d<n>`, one at a time, until
/// `stop` is set; a debit of unknown outcome is retried with its key until it is answered.
/// Every attempt is recorded.
async fn stream_debits(
    client: u64,
    address: String,
    stop: tokio::sync::watch::Receiver<bool>,
    history: Arc<tokio::sync::Mutex<Vec<Attempt>>>,
) {
    let mut rng = Rng::new(client + 1);
    let mut billing = connect(&address).await.expect("a lazy channel");
    for op in 0.. {
        if *stop.borrow() {
            return;
        }
        let (key, amount) = (format!("c{client}-d{op}"), rng.between(1, 20));
        for _ in 0..200 {
            let request = pb::DebitRequest {
                account: Some(common::billing::account("t1", &meter(client))),
                amount,
                idempotency_key: key.clone(),
            };
            let result = billing.debit(with_token(request, BILLING_TOKEN)).await;
            let completion = completion(&result);
            let unknown = matches!(completion, Completion::Info(_));
            history.lock().await.push(Attempt {
                key: key.clone(),
                account: AccountId::new("t1", meter(client)),
                amount,
                completion,
            });
            if !unknown {
                break;
            }
            tokio::time::sleep(Duration::from_millis(50)).await;
        }
    }
}

/// The billing voters as the node at `admin_addr` sees them.
async fn billing_voters(admin_addr: &str) -> Result<Vec<u64>> {
    let mut client = admin_client(admin_addr.parse()?).await?;
    let status = client.status(call(admin::StatusRequest {})).await?.into_inner();
    let billing = status.billing.context("a voter reports its billing group")?;
    Ok(billing.members.iter().filter(|member| member.voter).map(|member| member.node_id).collect())
}

async fn billing_voters_are(cluster: &BillingCluster, id: u64, voters: &[u64]) -> Result<()> {
    let address = &cluster.nodes[cluster.index_of(id)].admin_addr;
    let deadline = Instant::now() + Duration::from_secs(30);
    loop {
        let seen = billing_voters(address).await.unwrap_or_default();
        if seen == voters {
            return Ok(());
        }
        if Instant::now() > deadline {
            bail!("node {id} sees billing voters {seen:?}, expected {voters:?}");
        }
        tokio::time::sleep(Duration::from_millis(20)).await;
    }
}

/// Runs `call` until it succeeds, for 30 s at most: on a loaded machine a billing call may
/// miss its 1 s commit deadline (UNAVAILABLE, outcome unknown). Only for calls that are safe
/// to repeat: reads, and writes with fixed idempotency keys.
async fn patiently<T, F: AsyncFnMut() -> Result<T>>(mut call: F) -> Result<T> {
    let deadline = Instant::now() + Duration::from_secs(30);
    loop {
        match call().await {
            Ok(value) => return Ok(value),
            Err(error) if Instant::now() > deadline => return Err(error),
            Err(_) => tokio::time::sleep(Duration::from_millis(100)).await,
        }
    }
}

/// The trail as the nodes `ids` read it, once they all hold the same one.
async fn agreed_trail(
    cluster: &BillingCluster,
    ids: &[u64],
) -> Result<Vec<quotamesh::core::billing::AuditEntry>> {
    let deadline = Instant::now() + Duration::from_secs(30);
    loop {
        let mut trails = Vec::new();
        for id in ids {
            let mut client = cluster.client(cluster.index_of(*id)).await?;
            trails.push(patiently(async || full_trail(&mut client).await).await?);
        }
        if trails.iter().all(|trail| *trail == trails[0]) {
            return Ok(trails.swap_remove(0));
        }
        anyhow::ensure!(Instant::now() < deadline, "the trails of {ids:?} did not converge");
        tokio::time::sleep(Duration::from_millis(200)).await;
    }
}

// Proves that the billing group's voters can go 3 -> 5 -> 3 through `quotamesh cluster
// add-node` and `remove-node` (both groups, each at its own leader) while clients debit: the
// new nodes catch up and vote, the removed ones leave (the billing leader among them when it
// is one of the two), debits keep committing, and every acknowledged debit is in the final
// trail exactly once with every balance exact.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn billing_voters_go_three_five_three_while_debits_flow() -> Result<()> {
    let policy = common::billing::policy();
    let mut cluster = BillingCluster::start_with_environment(3, &policy, &|_| Vec::new())?;
    // Node 1 formed the billing group (billing.bootstrap); the quota group is formed by hand.
    cli(&["cluster", "init", "--admin-addr", &cluster.nodes[0].admin_addr])?;
    cluster.wait_for_leader(2).await?;
    let mut opener = cluster.client(2).await?;
    for client in 0..BILLING_CLIENTS {
        let meter = meter(client);
        patiently(async || open_account(&mut opener, "t1", &meter, 0, OPENING_BALANCE).await)
            .await?;
    }
    let (stop, stopped) = tokio::sync::watch::channel(false);
    let history = Arc::new(tokio::sync::Mutex::new(Vec::new()));
    // Node 3 stays a voter throughout; the debits go through it (forwarded to the leader).
    let streams: Vec<_> = (0..BILLING_CLIENTS)
        .map(|client| {
            tokio::spawn(stream_debits(
                client,
                cluster.nodes[2].billing_addr.clone(),
                stopped.clone(),
                Arc::clone(&history),
            ))
        })
        .collect();
    let admin_addrs = |cluster: &BillingCluster, ids: &[u64]| {
        ids.iter()
            .map(|id| cluster.nodes[cluster.index_of(*id)].admin_addr.clone())
            .collect::<Vec<_>>()
            .join(",")
    };

    let acknowledged = |history: &[Attempt]| {
        history.iter().filter(|attempt| matches!(attempt.completion, Completion::Ok { .. })).count()
    };
    let changes_started = Instant::now();
    let before_changes = acknowledged(&history.lock().await);
    for id in [4, 5] {
        let raft_addr = cluster.start_newcomer(id)?.raft_addr.clone();
        add_node(&admin_addrs(&cluster, &[1, 2, 3]), id, &raft_addr, "all").await?;
        eprintln!("added {id} at {:?}", changes_started.elapsed());
    }
    for id in [1, 2, 3, 4, 5] {
        billing_voters_are(&cluster, id, &[1, 2, 3, 4, 5]).await?;
    }
    let mut status = admin_client(cluster.nodes[2].admin_addr.parse()?).await?;
    let billing_leader = status
        .status(call(admin::StatusRequest {}))
        .await?
        .into_inner()
        .billing
        .and_then(|billing| billing.leader_id);
    eprintln!("billing leader before the removals: {billing_leader:?}");
    for id in [1, 2] {
        remove_node(&admin_addrs(&cluster, &[1, 2, 3, 4, 5]), id, "all").await?;
        eprintln!("removed {id} at {:?}", changes_started.elapsed());
    }
    for id in [3, 4, 5] {
        billing_voters_are(&cluster, id, &[3, 4, 5]).await?;
    }
    let changes_done = Instant::now();
    let after_changes = acknowledged(&history.lock().await);
    let during_changes = after_changes - before_changes;
    // Debits keep committing on the shrunk group.
    let deadline = Instant::now() + Duration::from_secs(30);
    while acknowledged(&history.lock().await) < after_changes + 20 {
        anyhow::ensure!(Instant::now() < deadline, "no debit committed after the shrink");
        tokio::time::sleep(Duration::from_millis(20)).await;
    }

    let _ = stop.send(true);
    for stream in streams {
        stream.await?;
    }
    let history = std::mem::take(&mut *history.lock().await);
    let trail = agreed_trail(&cluster, &[3, 4, 5]).await?;
    let mut client = cluster.client(cluster.index_of(4)).await?;
    for client_id in 0..BILLING_CLIENTS {
        let account = AccountId::new("t1", meter(client_id));
        let of_account: Vec<Attempt> =
            history.iter().filter(|attempt| attempt.account == account).cloned().collect();
        let meter = meter(client_id);
        let final_balance =
            patiently(async || balance(&mut client, "t1", &meter).await).await?.balance;
        check_bank(&account, OPENING_BALANCE, 0, &of_account, &trail, final_balance)
            .map_err(anyhow::Error::msg)?;
    }
    check_exactly_once(&history, &trail).map_err(anyhow::Error::msg)?;
    let unknown =
        history.iter().filter(|attempt| matches!(attempt.completion, Completion::Info(_))).count();
    eprintln!(
        "{} debits acknowledged ({during_changes} during {:?} of membership changes), {unknown} \
         attempts of unknown outcome retried",
        acknowledged(&history),
        changes_done - changes_started
    );
    assert!(during_changes >= 20, "debits were acknowledged while the membership changed");
    Ok(())
}
