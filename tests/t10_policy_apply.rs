//! Replicated policy sets through real `quotamesh` processes (DESIGN section 7): three
//! voters and a gateway with no `--policy` of their own follow what `quotamesh policy apply`
//! commits through the quota group; every node serves a new version soon after the command
//! returns (measured with both cores busy and printed as a `figure |` line); re-applying the
//! same rules makes no version; history, get --version, diff and rollback work against the
//! region; a bad set is refused with file:line and changes nothing; an apply without an
//! operator credential is refused; restarted nodes serve the latest version.

mod common;

use std::path::Path;
use std::time::{Duration, Instant};

use anyhow::{Context, Result};
use common::cluster::{CLUSTER_WAIT, Cluster, ClusterOptions, admin_client, call};
use common::tls::ADMIN_TOKEN;
use common::{CpuHog, http_get, metric_value, run_cli as quotamesh, write_file};
use quotamesh::api::proto::quotamesh::admin::v1 as admin;

/// The gateway's raft_node_id.
const GATEWAY: u64 = 4;
/// Every node of the region.
const NODES: [u64; 4] = [1, 2, 3, GATEWAY];
/// The design's target: every node serves a new version this soon after `apply` returns.
const PROPAGATION_TARGET: Duration = Duration::from_secs(1);

const FIRST: &str = "\
domain: governed
descriptors:
  - key: tenant
    rate_limit: {unit: minute, requests_per_unit: 100}
";
const SECOND: &str = "\
domain: governed
descriptors:
  - key: tenant
    rate_limit: {unit: minute, requests_per_unit: 50}
  - key: path
    rollout: shadow
    rate_limit: {unit: second, requests_per_unit: 10}
";

/// `policy apply` of `directory` through voter `via`; the JSON answer.
fn apply(
    cluster: &Cluster,
    via: u64,
    directory: &Path,
    message: &str,
) -> Result<serde_json::Value> {
    let admin_addr = cluster.nodes[&via].admin_addr.to_string();
    let run = quotamesh(
        &[
            "policy",
            "apply",
            &directory.display().to_string(),
            "--message",
            message,
            "--admin-addr",
            &admin_addr,
            "--json",
        ],
        Some(ADMIN_TOKEN),
    )?;
    anyhow::ensure!(run.code == Some(0), "apply failed: {}{}", run.stdout, run.stderr);
    Ok(serde_json::from_str(&run.stdout)?)
}

/// The replicated version node `id` serves, from its metrics.
fn served_version(cluster: &Cluster, id: u64) -> Result<f64> {
    let process = cluster.nodes[&id].process.as_ref().context("running")?;
    Ok(metric_value(&process.metrics()?, "quotamesh_policy_version"))
}

/// Waits until every node serves `version`; returns how long that took from `since`.
fn wait_served(cluster: &Cluster, version: u64, since: Instant) -> Result<Duration> {
    let deadline = since + CLUSTER_WAIT;
    let mut pending: Vec<u64> = NODES.to_vec();
    while !pending.is_empty() {
        anyhow::ensure!(Instant::now() < deadline, "nodes {pending:?} never served {version}");
        let mut still = Vec::new();
        for id in pending {
            if served_version(cluster, id)? < version as f64 {
                still.push(id);
            }
        }
        pending = still;
        if !pending.is_empty() {
            std::thread::sleep(Duration::from_millis(5));
        }
    }
    Ok(since.elapsed())
}

/// A policy directory holding `text` as `name`.
fn policy_directory(
    root: &Path,
    directory: &str,
    name: &str,
    text: &str,
) -> Result<std::path::PathBuf> {
    let path = root.join(directory);
    std::fs::create_dir_all(&path)?;
    write_file(&path, name, text);
    Ok(path)
}

/// What node `id`'s `/config` says it serves: (version, source, digest).
fn config_of(cluster: &Cluster, id: u64) -> Result<(u64, String, String)> {
    let address = cluster.nodes[&id].metrics_addr;
    let response = common::http_request(
        address,
        "/config?format=json",
        &[("authorization", &format!("Bearer {ADMIN_TOKEN}"))],
    )?;
    anyhow::ensure!(response.status == 200, "/config: {}", response.body);
    let config: serde_json::Value = serde_json::from_str(&response.body)?;
    Ok((
        config["version"].as_u64().context("version")?,
        config["policy_source"].as_str().context("source")?.to_owned(),
        config["digest"].as_str().context("digest")?.to_owned(),
    ))
}

// Proves the whole life of a replicated policy set on a region of 3 voters and a gateway,
// with both cores kept busy while versions propagate.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn applied_versions_reach_every_node_and_roll_back() -> Result<()> {
    let options = ClusterOptions { follow_region_policy: true, ..ClusterOptions::default() };
    let mut cluster = Cluster::start(3, options).await?;
    cluster.start_gateway(GATEWAY)?;
    let root = cluster.root.path().to_owned();
    let first = policy_directory(&root, "first", "governed.yaml", FIRST)?;
    let second = policy_directory(&root, "second", "governed.yaml", SECOND)?;
    for id in NODES {
        let (version, source, _) = config_of(&cluster, id)?;
        assert_eq!((version, source.as_str()), (0, "local"), "node {id} starts on the default");
    }

    // Version 1, through a follower or the leader alike; measured under load.
    let hog = CpuHog::start(2);
    let applied = apply(&cluster, 2, &first, "first rules")?;
    let returned = Instant::now();
    assert_eq!((applied["version"].as_u64(), applied["created"].as_bool()), (Some(1), Some(true)));
    let first_figure = wait_served(&cluster, 1, returned)?;
    let applied = apply(&cluster, 1, &second, "halve the tenant limit")?;
    let returned = Instant::now();
    assert_eq!(applied["version"].as_u64(), Some(2), "{applied}");
    let second_figure = wait_served(&cluster, 2, returned)?;
    drop(hog);
    println!(
        "figure | policy propagation, 3 voters + 1 gateway, 2 cores busy: every node served \
         version 1 {} ms and version 2 {} ms after apply returned (target {} ms)",
        first_figure.as_millis(),
        second_figure.as_millis(),
        PROPAGATION_TARGET.as_millis()
    );
    assert!(first_figure <= PROPAGATION_TARGET, "version 1 took {first_figure:?}");
    assert!(second_figure <= PROPAGATION_TARGET, "version 2 took {second_figure:?}");

    // Every node, the gateway too, serves the same set, replicated, and says so.
    let digest_two = applied["digest"].as_str().context("digest")?.to_owned();
    for id in NODES {
        assert_eq!(config_of(&cluster, id)?, (2, "replicated".to_owned(), digest_two.clone()));
        let (status, body) = http_get(cluster.nodes[&id].metrics_addr, "/readyz")?;
        assert_eq!(status, 200, "{body}");
        assert!(body.contains("policy_version 2 policy_source replicated"), "{body}");
    }
    let status = cluster.status(GATEWAY).await?;
    assert_eq!((status.policy_version, status.policy_source.as_str()), (2, "replicated"));
    let text = cluster.cli(&[
        "cluster",
        "status",
        "--admin-addr",
        &cluster.nodes[&GATEWAY].admin_addr.to_string(),
    ])?;
    assert!(text.contains("policy version 2 (replicated)"), "{text}");

    // The same rules again: no new version, and it says so.
    let again = apply(&cluster, 3, &second, "again")?;
    assert_eq!((again["version"].as_u64(), again["created"].as_bool()), (Some(2), Some(false)));

    // A bad set: refused by the CLI with file:line, and by the API when sent directly;
    // nothing changes either way.
    let bad = policy_directory(
        &root,
        "bad",
        "broken.yaml",
        "domain: governed\ndescriptors:\n  - key: tenant\n    rate_limit: {unit: fortnight, requests_per_unit: 1}\n",
    )?;
    let admin_addr = cluster.nodes[&1].admin_addr.to_string();
    let refused = quotamesh(
        &["policy", "apply", &bad.display().to_string(), "--admin-addr", &admin_addr],
        Some(ADMIN_TOKEN),
    )?;
    assert_eq!(refused.code, Some(1), "{}{}", refused.stdout, refused.stderr);
    assert!(refused.stderr.contains("broken.yaml:4:"), "{}", refused.stderr);
    let mut client = admin_client(cluster.nodes[&1].admin_addr).await?;
    let files = vec![admin::PolicyFile {
        name: "sent.yaml".to_owned(),
        text: "domain: governed\ndescriptors:\n  - key: tenant\n    rate_limit: {unit: fortnight, requests_per_unit: 1}\n".to_owned(),
    }];
    let direct = client
        .apply_policy(call(admin::ApplyPolicyRequest {
            files: files.clone(),
            message: String::new(),
        }))
        .await
        .expect_err("a bad set is refused");
    assert_eq!(direct.code(), tonic::Code::InvalidArgument, "{direct:?}");
    assert!(direct.message().contains("sent.yaml:4:"), "{direct:?}");

    // Without an operator credential: refused, nothing proposed.
    let mut anonymous = tonic::Request::new(admin::ApplyPolicyRequest {
        files: vec![admin::PolicyFile { name: "a.yaml".to_owned(), text: FIRST.to_owned() }],
        message: String::new(),
    });
    anonymous.set_timeout(Duration::from_secs(5));
    let refused = client.apply_policy(anonymous).await.expect_err("no token");
    assert_eq!(refused.code(), tonic::Code::Unauthenticated, "{refused:?}");
    let run = quotamesh(
        &["policy", "apply", &first.display().to_string(), "--admin-addr", &admin_addr],
        None,
    )?;
    assert_ne!(run.code, Some(0), "an apply without a token is refused: {}", run.stdout);

    // History: still two versions, newest first, with operator and message.
    let history = quotamesh(
        &["policy", "history", "--admin-addr", &admin_addr, "--json"],
        Some(ADMIN_TOKEN),
    )?;
    let history: serde_json::Value = serde_json::from_str(&history.stdout)
        .with_context(|| format!("history: {}{}", history.stdout, history.stderr))?;
    let versions = history["versions"].as_array().context("versions")?;
    let listed: Vec<(u64, &str, &str)> = versions
        .iter()
        .map(|v| {
            (
                v["version"].as_u64().unwrap_or(0),
                v["applied_by"].as_str().unwrap_or(""),
                v["message"].as_str().unwrap_or(""),
            )
        })
        .collect();
    assert_eq!(
        listed,
        [(2, "test-operator", "halve the tenant limit"), (1, "test-operator", "first rules")]
    );

    // Diff against what the gateway serves (version 2): the first rules differ, the second not.
    let gateway_url = format!("http://{}", cluster.nodes[&GATEWAY].metrics_addr);
    let diff = |directory: &Path| {
        quotamesh(
            &["policy", "diff", &directory.display().to_string(), "--url", &gateway_url],
            Some(ADMIN_TOKEN),
        )
    };
    let changed = diff(&first)?;
    assert_eq!(changed.code, Some(1), "{}{}", changed.stdout, changed.stderr);
    assert!(changed.stdout.contains("tenant"), "{}", changed.stdout);
    let same = diff(&second)?;
    assert_eq!(same.code, Some(0), "{}{}", same.stdout, same.stderr);

    // get --version 1: its files as applied.
    let got = quotamesh(
        &["policy", "get", "--version", "1", "--admin-addr", &admin_addr],
        Some(ADMIN_TOKEN),
    )?;
    assert_eq!(got.code, Some(0), "{}", got.stderr);
    assert!(got.stdout.contains("requests_per_unit: 100"), "{}", got.stdout);

    // Rollback to 1: version 3 with version 1's rules, on every node.
    let rolled = quotamesh(
        &["policy", "rollback", "--to", "1", "--admin-addr", &admin_addr, "--json"],
        Some(ADMIN_TOKEN),
    )?;
    let returned = Instant::now();
    let rolled: serde_json::Value = serde_json::from_str(&rolled.stdout)
        .with_context(|| format!("rollback: {}{}", rolled.stdout, rolled.stderr))?;
    assert_eq!((rolled["version"].as_u64(), rolled["created"].as_bool()), (Some(3), Some(true)));
    let rollback_figure = wait_served(&cluster, 3, returned)?;
    println!(
        "figure | policy rollback, 3 voters + 1 gateway: every node served version 3 {} ms \
         after rollback returned",
        rollback_figure.as_millis()
    );
    let digest_one = rolled["digest"].as_str().context("digest")?.to_owned();
    for id in NODES {
        assert_eq!(config_of(&cluster, id)?, (3, "replicated".to_owned(), digest_one.clone()));
    }
    assert_eq!(diff(&first)?.code, Some(0), "the gateway serves the first rules again");

    // Restarted nodes serve the latest version: a voter from its own state, the gateway by
    // fetching it.
    for id in [3, GATEWAY] {
        cluster.node(id).stop()?;
        cluster.node(id).start()?;
        let restarted = Instant::now();
        wait_served(&cluster, 3, restarted)?;
        assert_eq!(config_of(&cluster, id)?.2, digest_one, "node {id} after a restart");
    }
    Ok(())
}
