//! Replicated policy sets through real `quotamesh` processes (DESIGN section 7): three
//! voters and a gateway with no `--policy` of their own follow what `quotamesh policy apply`
//! commits through the quota group; every node serves a new version soon after the command
//! returns (measured with both cores busy and printed as a `figure |` line); re-applying the
//! same rules makes no version; history, get --version, diff and rollback work against the
//! region; a bad set is refused with file:line and changes nothing; an apply without an
//! operator credential is refused; restarted nodes serve the latest version. On an admin
//! port served over TLS an operator certificate authors a version and a node's certificate
//! applies nothing; a node whose own `[policy]` options refuse a version keeps serving the
//! last one it accepted, says so once, and takes the next one it accepts.

use std::path::Path;
use std::time::{Duration, Instant};

use anyhow::{Context, Result};
use common::cluster::{CLUSTER_WAIT, Cluster, ClusterOptions, admin_client, call};
use common::tls::ADMIN_TOKEN;
use common::{CpuHog, http_get, metric_value, run_cli as quotamesh, write_file};
use quotamesh::api::proto::quotamesh::admin::v1 as admin;
use quotamesh::policy_follow::GATEWAY_POLL_INTERVAL;

/// One test at a time in this binary: the propagation figure is measured against a target,
/// and another test's region on the same two cores would skew it.
static SERIAL: tokio::sync::Mutex<()> = tokio::sync::Mutex::const_new(());

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

/// Waits until the nodes `ids` serve `version`; returns how long that took from `since`.
fn wait_served(cluster: &Cluster, ids: &[u64], version: u64, since: Instant) -> Result<Duration> {
    let deadline = since + CLUSTER_WAIT;
    let mut pending: Vec<u64> = ids.to_vec();
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

/// `policy history` of the region through voter `via`: (version, operator, message), newest
/// first. `credentials` are the CLI's TLS flags; the test token is sent too.
fn history(
    cluster: &Cluster,
    via: u64,
    credentials: &[&str],
) -> Result<Vec<(u64, String, String)>> {
    let admin_addr = cluster.nodes[&via].admin_addr.to_string();
    let mut arguments = vec!["policy", "history", "--admin-addr", &admin_addr, "--json"];
    arguments.extend(credentials);
    let run = quotamesh(&arguments, Some(ADMIN_TOKEN))?;
    let history: serde_json::Value = serde_json::from_str(&run.stdout)
        .with_context(|| format!("history: {}{}", run.stdout, run.stderr))?;
    Ok(history["versions"]
        .as_array()
        .context("versions")?
        .iter()
        .map(|v| {
            (
                v["version"].as_u64().unwrap_or(0),
                v["applied_by"].as_str().unwrap_or("").to_owned(),
                v["message"].as_str().unwrap_or("").to_owned(),
            )
        })
        .collect())
}

// Proves the whole life of a replicated policy set on a region of 3 voters and a gateway,
// with both cores kept busy while versions propagate.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn applied_versions_reach_every_node_and_roll_back() -> Result<()> {
    let _serial = SERIAL.lock().await;
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
    let first_figure = wait_served(&cluster, &NODES, 1, returned)?;
    let applied = apply(&cluster, 1, &second, "halve the tenant limit")?;
    let returned = Instant::now();
    assert_eq!(applied["version"].as_u64(), Some(2), "{applied}");
    let second_figure = wait_served(&cluster, &NODES, 2, returned)?;
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
    let operator = "test-operator".to_owned();
    assert_eq!(
        history(&cluster, 1, &[])?,
        [
            (2, operator.clone(), "halve the tenant limit".to_owned()),
            (1, operator, "first rules".to_owned())
        ]
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
    let rollback_figure = wait_served(&cluster, &NODES, 3, returned)?;
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
        wait_served(&cluster, &NODES, 3, restarted)?;
        assert_eq!(config_of(&cluster, id)?.2, digest_one, "node {id} after a restart");
    }
    Ok(())
}

/// Rules over two files that both declare the domain: only a node with `[policy]
/// merge_domains = true` loads them.
const MERGED: [(&str, &str); 2] = [
    (
        "tenants.yaml",
        "domain: governed\ndescriptors:\n  - key: tenant\n    rate_limit: {unit: minute, requests_per_unit: 75}\n",
    ),
    (
        "paths.yaml",
        "domain: governed\ndescriptors:\n  - key: path\n    rate_limit: {unit: second, requests_per_unit: 20}\n",
    ),
];
/// The nodes of the refusal test that merge a domain spread over several files.
const ACCEPTING: [u64; 2] = [1, 2];
/// The nodes of the refusal test that do not, so refuse such a set.
const REFUSING: [u64; 2] = [3, GATEWAY];
/// What a following node logs when its own options refuse a replicated version.
const REFUSAL_LOG: &str = "replicated policy version refused";
/// Counts every policy load a node refused, replicated versions included.
const REFUSALS_METRIC: &str = "quotamesh_policy_reload_failures_total";

// Proves that on an admin port served over TLS an operator certificate of the cluster's CA,
// with no token, applies a version authored by that operator, and that a node's certificate
// of the same CA is refused and commits nothing.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn an_operator_certificate_authors_an_applied_version() -> Result<()> {
    let _serial = SERIAL.lock().await;
    let options =
        ClusterOptions { follow_region_policy: true, admin_tls: true, ..ClusterOptions::default() };
    let cluster = Cluster::start(3, options).await?;
    let root = cluster.root.path().to_owned();
    let first = policy_directory(&root, "first", "governed.yaml", FIRST)?;
    let second = policy_directory(&root, "second", "governed.yaml", SECOND)?;
    let operator = cluster.ca.authority.issue_operator("alice", quotamesh::clock::now_ms(), 1)?;
    let (alice_cert, alice_key) = cluster.ca.write("operator-alice", &operator)?;
    // Node 3's own certificate: the cluster's CA signed it, but it names a node.
    let node_cert = cluster.ca.directory.join("node-3.pem");
    let node_key = cluster.ca.directory.join("node-3.key");
    let bundle = cluster.ca.bundle().display().to_string();
    let admin_addr = cluster.nodes[&2].admin_addr.to_string();
    let apply_as = |directory: &Path, cert: &Path, key: &Path, message: &str| {
        quotamesh(
            &[
                "policy",
                "apply",
                &directory.display().to_string(),
                "--message",
                message,
                "--admin-addr",
                &admin_addr,
                "--ca-cert",
                &bundle,
                "--client-cert",
                &cert.display().to_string(),
                "--client-key",
                &key.display().to_string(),
                "--json",
            ],
            None,
        )
    };

    let applied = apply_as(&first, &alice_cert, &alice_key, "by certificate")?;
    assert_eq!(applied.code, Some(0), "{}{}", applied.stdout, applied.stderr);
    let applied: serde_json::Value = serde_json::from_str(&applied.stdout)?;
    assert_eq!((applied["version"].as_u64(), applied["created"].as_bool()), (Some(1), Some(true)));
    wait_served(&cluster, &[1, 2, 3], 1, Instant::now())?;

    let refused = apply_as(&second, &node_cert, &node_key, "by a node")?;
    assert_ne!(refused.code, Some(0), "a node certificate applied: {}", refused.stdout);
    assert!(refused.stderr.contains("Unauthenticated"), "{}", refused.stderr);

    let tls = ["--ca-cert", bundle.as_str()];
    assert_eq!(
        history(&cluster, 1, &tls)?,
        [(1, "alice".to_owned(), "by certificate".to_owned())],
        "one version, authored by the certificate's operator"
    );
    for id in [1, 2, 3] {
        assert_eq!(served_version(&cluster, id)?, 1.0, "node {id} after the refused apply");
    }
    Ok(())
}

// Proves that a voter and a gateway whose own `[policy]` options refuse a replicated
// version keep serving the version they last accepted, log and count the refusal once while
// the other voters serve the new version, and install the next version they accept.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_node_refusing_a_version_keeps_the_last_it_accepted() -> Result<()> {
    let _serial = SERIAL.lock().await;
    // Every node merges a domain spread over several files, except voter 3 and the gateway,
    // whose variable overrides the shared config.
    let no_merging = vec![("QUOTAMESH_MERGE_DOMAINS", "false".to_owned())];
    let options = ClusterOptions {
        follow_region_policy: true,
        config_extra: "[policy]\nmerge_domains = true\n".to_owned(),
        node_environment: [(3, no_merging.clone()), (GATEWAY, no_merging)].into(),
        ..ClusterOptions::default()
    };
    let mut cluster = Cluster::start(3, options).await?;
    cluster.start_gateway(GATEWAY)?;
    let root = cluster.root.path().to_owned();
    let first = policy_directory(&root, "first", "governed.yaml", FIRST)?;
    let merged = root.join("merged");
    std::fs::create_dir_all(&merged)?;
    for (name, text) in MERGED {
        write_file(&merged, name, text);
    }
    let second = policy_directory(&root, "second", "governed.yaml", SECOND)?;
    let metrics_of = |id: u64| -> Result<String> {
        cluster.nodes[&id].process.as_ref().context("running")?.metrics()
    };
    let refusals_logged = |id: u64| -> Result<usize> {
        Ok(std::fs::read_to_string(&cluster.nodes[&id].log_path)?.matches(REFUSAL_LOG).count())
    };

    // Version 1 loads everywhere.
    let applied = apply(&cluster, 1, &first, "one file")?;
    let digest_one = applied["digest"].as_str().context("digest")?.to_owned();
    wait_served(&cluster, &NODES, 1, Instant::now())?;

    // Version 2 merges the domain over two files: committed through voter 1, which merges,
    // and served by the voters that merge; voter 3 and the gateway refuse it.
    let hog = CpuHog::start(2);
    let admin_addr = cluster.nodes[&1].admin_addr.to_string();
    let run = quotamesh(
        &[
            "policy",
            "apply",
            &merged.display().to_string(),
            "--merge-domains",
            "--message",
            "merged",
            "--admin-addr",
            &admin_addr,
            "--json",
        ],
        Some(ADMIN_TOKEN),
    )?;
    anyhow::ensure!(run.code == Some(0), "apply failed: {}{}", run.stdout, run.stderr);
    let applied: serde_json::Value = serde_json::from_str(&run.stdout)?;
    assert_eq!((applied["version"].as_u64(), applied["created"].as_bool()), (Some(2), Some(true)));
    let digest_two = applied["digest"].as_str().context("digest")?.to_owned();
    wait_served(&cluster, &ACCEPTING, 2, Instant::now())?;
    let deadline = Instant::now() + CLUSTER_WAIT;
    for id in REFUSING {
        while metric_value(&metrics_of(id)?, REFUSALS_METRIC) < 1.0 {
            anyhow::ensure!(Instant::now() < deadline, "node {id} never refused version 2");
            std::thread::sleep(Duration::from_millis(5));
        }
    }
    // A few of the gateway's polls while version 2 is current: a refusal it did not
    // remember would be fetched, logged and counted again.
    std::thread::sleep(GATEWAY_POLL_INTERVAL * 5);
    for id in ACCEPTING {
        assert_eq!(config_of(&cluster, id)?, (2, "replicated".to_owned(), digest_two.clone()));
    }
    for id in REFUSING {
        assert_eq!(
            config_of(&cluster, id)?,
            (1, "replicated".to_owned(), digest_one.clone()),
            "node {id} keeps the version it accepted"
        );
        assert_eq!(served_version(&cluster, id)?, 1.0, "node {id}");
        assert_eq!(metric_value(&metrics_of(id)?, REFUSALS_METRIC), 1.0, "node {id}");
        assert_eq!(refusals_logged(id)?, 1, "node {id} logs the refusal once");
    }

    // Version 3 is one file again: every node serves it, the refusal is not repeated.
    let applied = apply(&cluster, 2, &second, "one file again")?;
    assert_eq!(applied["version"].as_u64(), Some(3), "{applied}");
    let digest_three = applied["digest"].as_str().context("digest")?.to_owned();
    wait_served(&cluster, &NODES, 3, Instant::now())?;
    drop(hog);
    for id in NODES {
        assert_eq!(config_of(&cluster, id)?, (3, "replicated".to_owned(), digest_three.clone()));
        let expected_refusals = if REFUSING.contains(&id) { 1 } else { 0 };
        assert_eq!(refusals_logged(id)?, expected_refusals, "node {id}'s log");
        assert_eq!(
            metric_value(&metrics_of(id)?, REFUSALS_METRIC),
            expected_refusals as f64,
            "node {id}'s count"
        );
    }
    Ok(())
}
