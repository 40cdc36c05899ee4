//! The billing leader's data disk fills up (each node's data directory is a small tmpfs of
//! its own) while clients debit through every node: the leader's group stops, the node is
//! unready and exits non-zero (crash-only) rather than living on with a dead group; the
//! test's supervisor restarts it until the disk is freed, after which it serves again
//! without any manual step, and no acknowledged debit is lost or applied twice.
//!
//! Runs as root (it mounts tmpfs).

use std::io::Write;
use std::path::{Path, PathBuf};
use std::process::Command;
use std::sync::Arc;
use std::sync::atomic::{AtomicBool, Ordering};
use std::time::{Duration, Instant};

use anyhow::Context;
use common::billing::{
    ADMIN_TOKEN, BillingCluster, Rng, account, balance, completion, connect, full_trail,
    open_account, with_token,
};
use common::billing_checker::{Attempt, Completion, check_bank, check_exactly_once};
use quotamesh::api::proto::quotamesh::billing::v1 as pb;
use quotamesh::core::billing::{AccountId, AuditEntry};
use tokio::sync::Mutex;

const CLIENTS: u64 = 4;
const INITIAL: u64 = 10_000_000;
/// Each node's data directory: room for the test's state, small enough to fill in a blink.
const TMPFS_SIZE: &str = "48m";

/// The tmpfs mounts of the test; unmounted on drop.
struct Mounts(Vec<PathBuf>);

impl Drop for Mounts {
    fn drop(&mut self) {
        for path in &self.0 {
            let _ = Command::new("umount").arg("-l").arg(path).status();
        }
    }
}

fn mount_tmpfs(path: &Path) -> anyhow::Result<()> {
    std::fs::create_dir_all(path)?;
    let status = Command::new("mount")
        .args(["-t", "tmpfs", "-o", &format!("size={TMPFS_SIZE}"), "tmpfs"])
        .arg(path)
        .status()
        .context("run mount")?;
    anyhow::ensure!(status.success(), "mount tmpfs on {} (run as root)", path.display());
    Ok(())
}

/// Fills the file system of `directory` to the last byte; returns the filler's path.
fn fill(directory: &Path) -> anyhow::Result<PathBuf> {
    let path = directory.join("filler");
    let mut file = std::fs::File::create(&path)?;
    let chunk = vec![0u8; 1 << 20];
    loop {
        if file.write_all(&chunk).is_err() {
            break;
        }
    }
    // The last partial chunk, byte by byte down to nothing.
    let mut small = vec![0u8; 4096];
    while !small.is_empty() {
        if file.write_all(&small).is_err() {
            small.truncate(small.len() / 2);
        }
    }
    let _ = file.sync_all();
    Ok(path)
}

/// Clients debiting through random nodes until `stop`, each key retried while its outcome
/// is unknown (up to 40 times, so a key outlives a restart).
fn debit_load(
    addresses: Vec<String>,
    stop: Arc<AtomicBool>,
) -> tokio::task::JoinHandle<Vec<Attempt>> {
    tokio::spawn(async move {
        let history = Arc::new(Mutex::new(Vec::new()));
        let mut tasks = Vec::new();
        for client_id in 0..CLIENTS {
            let (addresses, history, stop) =
                (addresses.clone(), Arc::clone(&history), Arc::clone(&stop));
            tasks.push(tokio::spawn(async move {
                let mut rng = Rng::new(9_100 + client_id);
                let mut clients = Vec::new();
                for address in &addresses {
                    clients.push(connect(address).await.expect("lazy channel"));
                }
                let mut op = 0;
                while !stop.load(Ordering::Relaxed) {
                    op += 1;
                    let key = format!("c{client_id}-d{op}");
                    let amount = rng.between(1, 50);
                    for _ in 0..40 {
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
                        if !unknown {
                            break;
                        }
                        tokio::time::sleep(Duration::from_millis(100)).await;
                    }
                    tokio::time::sleep(Duration::from_millis(10)).await;
                }
            }));
        }
        for task in tasks {
            task.await.expect("client task");
        }
        Arc::try_unwrap(history).map(Mutex::into_inner).unwrap_or_default()
    })
}

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

/// The scenario of the file's first sentence.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_full_disk_stops_the_node_and_freeing_it_brings_it_back() -> anyhow::Result<()> {
    let mounts = Arc::new(std::sync::Mutex::new(Mounts(Vec::new())));
    let prepare = {
        let mounts = Arc::clone(&mounts);
        move |node: &common::billing::BillingNode| {
            mount_tmpfs(&node.data_dir)?;
            mounts.lock().map_err(|_| anyhow::anyhow!("poisoned"))?.0.push(node.data_dir.clone());
            Ok(())
        }
    };
    let mut cluster = BillingCluster::start_prepared(3, &prepare)?;
    let leader = cluster.wait_for_leader(0).await?;
    let mut client = cluster.client(0).await?;
    open_account(&mut client, "t1", "api", 0, INITIAL).await?;
    let addresses: Vec<String> = cluster.nodes.iter().map(|n| n.billing_addr.clone()).collect();
    let stop = Arc::new(AtomicBool::new(false));
    let load = debit_load(addresses, Arc::clone(&stop));
    tokio::time::sleep(Duration::from_secs(1)).await;

    // Fill the leader's disk: its group stops on the first write that cannot be stored.
    let full = cluster.index_of(leader);
    let filler = fill(&cluster.nodes[full].data_dir)?;
    let filled_at = Instant::now();
    let (mut unready_seen, mut exits) = (false, 0u32);
    while filled_at.elapsed() < Duration::from_secs(4) {
        let node = &mut cluster.nodes[full];
        let Some(process) = node.process.as_mut() else { break };
        if let Some(status) = process.exited()? {
            anyhow::ensure!(!status.success(), "the node exited cleanly on a full disk");
            exits += 1;
            node.process = None;
            break;
        }
        if let Ok((code, _)) = process.readiness()
            && code != 200
        {
            unready_seen = true;
        }
        tokio::time::sleep(Duration::from_millis(20)).await;
    }
    anyhow::ensure!(exits == 1, "the node with a full disk did not exit within 4 s");
    eprintln!(
        "leader {leader} exited {} ms after its disk filled (unready seen: {unready_seen})",
        filled_at.elapsed().as_millis()
    );

    // The supervisor: restart it while the disk is still full (it may start and stop again,
    // or refuse to start), then free the disk and restart until it serves.
    let supervise_until = Instant::now() + Duration::from_secs(2);
    while Instant::now() < supervise_until {
        let node = &mut cluster.nodes[full];
        match node.process.as_mut() {
            None => {
                if node.start().is_err() {
                    exits += 1;
                }
            }
            Some(process) => {
                if process.exited()?.is_some() {
                    exits += 1;
                    node.process = None;
                }
            }
        }
        tokio::time::sleep(Duration::from_millis(200)).await;
    }
    std::fs::remove_file(&filler)?;
    let freed_at = Instant::now();
    loop {
        anyhow::ensure!(freed_at.elapsed() < Duration::from_secs(30), "the node never came back");
        let node = &mut cluster.nodes[full];
        match node.process.as_mut() {
            None => {
                let _ = node.start();
            }
            Some(process) => {
                if process.exited()?.is_some() {
                    node.process = None;
                } else if let Ok((200, _)) = process.readiness() {
                    break;
                }
            }
        }
        tokio::time::sleep(Duration::from_millis(100)).await;
    }
    eprintln!(
        "node {leader} ready again {} ms after the disk was freed ({exits} exits in all)",
        freed_at.elapsed().as_millis()
    );
    tokio::time::sleep(Duration::from_secs(1)).await;
    stop.store(true, Ordering::Relaxed);
    let history = load.await?;
    let approved = history
        .iter()
        .filter(|a| matches!(a.completion, Completion::Ok { duplicate: false, .. }))
        .count();
    eprintln!("{} attempts, {approved} approved", history.len());
    anyhow::ensure!(approved > 20, "the load did too little");

    let trail = agreed_trail(&cluster).await?;
    let final_balance = balance(&mut client, "t1", "api").await?.balance;
    check_exactly_once(&history, &trail).map_err(anyhow::Error::msg)?;
    check_bank(&AccountId::new("t1", "api"), INITIAL, 0, &history, &trail, final_balance)
        .map_err(anyhow::Error::msg)?;
    for node in &mut cluster.nodes {
        node.stop()?;
    }
    drop(prepare);
    drop(mounts);
    Ok(())
}
