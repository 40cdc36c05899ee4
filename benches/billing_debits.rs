//! Approved debits per second on a 3-node billing group of real `quotamesh` processes on
//! loopback, fsync on (redb commits every log batch durably), with 1, 16 and 256 concurrent
//! clients, and the p50 and p99 latency of one debit as the client sees it.
//!
//! Every client sends debits of 1 to one account with a fresh idempotency key each, one at a
//! time, for `BILLING_BENCH_SECONDS` (default 10) per client count. Clients are spread over
//! the three nodes (a follower forwards its batch to the leader in one hop), or sent to the
//! leader only with `BILLING_BENCH_TARGET=leader`. Counts come from `BILLING_BENCH_CLIENTS`
//! (default `1,16,256`). Run with `cargo bench --bench billing_debits`; the figures are
//! printed, never asserted.

// The integration tests' node harness; this bench uses only a part of it.
#[allow(dead_code)]
#[path = "../tests/common/mod.rs"]
mod common;

use std::time::{Duration, Instant};

use common::billing::{ADMIN_TOKEN, BillingCluster, account, open_account, with_token};
use quotamesh::api::proto::quotamesh::billing::v1 as pb;

/// Clients sharing one HTTP/2 connection.
const CLIENTS_PER_CHANNEL: usize = 32;

struct Figures {
    approved: u64,
    failed: u64,
    latencies_us: Vec<u64>,
}

async fn run_round(addresses: &[String], clients: usize, seconds: u64, round: usize) -> Figures {
    let mut channels = Vec::new();
    for index in 0..clients.div_ceil(CLIENTS_PER_CHANNEL) * addresses.len() {
        let address = &addresses[index % addresses.len()];
        channels.push(common::billing::connect(address).await.expect("channel"));
    }
    let stop_at = Instant::now() + Duration::from_secs(seconds);
    let mut tasks = Vec::new();
    for client_id in 0..clients {
        let mut client = channels[client_id % channels.len()].clone();
        tasks.push(tokio::spawn(async move {
            let mut figures = Figures { approved: 0, failed: 0, latencies_us: Vec::new() };
            let mut sequence = 0u64;
            while Instant::now() < stop_at {
                sequence += 1;
                let request = pb::DebitRequest {
                    account: Some(account("bench", "api")),
                    amount: 1,
                    idempotency_key: format!("r{round}-c{client_id}-{sequence}"),
                };
                let started = Instant::now();
                let result = client.debit(with_token(request, ADMIN_TOKEN)).await;
                let elapsed = started.elapsed();
                match result {
                    Ok(reply) if reply.get_ref().decision() == pb::Decision::Approved => {
                        figures.approved += 1;
                        figures.latencies_us.push(elapsed.as_micros() as u64);
                    }
                    _ => figures.failed += 1,
                }
            }
            figures
        }));
    }
    let mut total = Figures { approved: 0, failed: 0, latencies_us: Vec::new() };
    for task in tasks {
        let figures = task.await.expect("client task");
        total.approved += figures.approved;
        total.failed += figures.failed;
        total.latencies_us.extend(figures.latencies_us);
    }
    total.latencies_us.sort_unstable();
    total
}

fn percentile(sorted: &[u64], fraction: f64) -> f64 {
    if sorted.is_empty() {
        return 0.0;
    }
    let position = ((sorted.len() as f64 - 1.0) * fraction).round() as usize;
    sorted[position] as f64 / 1000.0
}

fn main() -> anyhow::Result<()> {
    let seconds: u64 =
        std::env::var("BILLING_BENCH_SECONDS").ok().and_then(|s| s.parse().ok()).unwrap_or(10);
    let counts: Vec<usize> = std::env::var("BILLING_BENCH_CLIENTS")
        .unwrap_or_else(|_| "1,16,256".to_owned())
        .split(',')
        .filter_map(|count| count.trim().parse().ok())
        .collect();
    let leader_only = std::env::var("BILLING_BENCH_TARGET").is_ok_and(|target| target == "leader");
    let runtime = tokio::runtime::Builder::new_multi_thread().enable_all().build()?;
    runtime.block_on(async {
        let cluster = BillingCluster::start(3, "")?;
        let leader = cluster.wait_for_leader(0).await?;
        let mut client = cluster.client(0).await?;
        open_account(&mut client, "bench", "api", 0, i64::MAX as u64).await?;
        let addresses: Vec<String> = if leader_only {
            vec![cluster.nodes[cluster.index_of(leader)].billing_addr.clone()]
        } else {
            cluster.nodes.iter().map(|node| node.billing_addr.clone()).collect()
        };
        println!(
            "billing debits, 3 nodes on loopback, fsync on, {seconds} s per row, clients sent to {}",
            if leader_only { "the leader" } else { "all three nodes" }
        );
        println!("{:>8} {:>14} {:>10} {:>10} {:>8}", "clients", "approved/s", "p50 ms", "p99 ms", "errors");
        for (round, clients) in counts.iter().enumerate() {
            let figures = run_round(&addresses, *clients, seconds, round).await;
            println!(
                "{:>8} {:>14.0} {:>10.2} {:>10.2} {:>8}",
                clients,
                figures.approved as f64 / seconds as f64,
                percentile(&figures.latencies_us, 0.50),
                percentile(&figures.latencies_us, 0.99),
                figures.failed
            );
        }
        anyhow::Ok(())
    })
}
