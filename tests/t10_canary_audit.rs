//! `quotamesh audit canary` against a real node: it passes while the node serves the
//! intended policy, leaving callers' quota untouched, and fails (exit 1, the node and rule
//! named) when a fail-closed rule is made fail-open, shadowed or raised on the node; with
//! `--every` it exports the failure counter and the last clean round for the alert.

use std::net::SocketAddr;
use std::process::{Child, Command, Stdio};
use std::time::{Duration, Instant};

use anyhow::{Context, Result};
use common::tls::{ADMIN_TOKEN, admin_section};
use common::{NodeProcess, descriptor, free_port, http_get, request, write_file};
use quotamesh::api::proto::envoy::service::ratelimit::v3::rate_limit_response::Code;

/// The intended policy: fail-closed rules of each kind the audit covers, one it cannot
/// audit without spending callers' quota, and a fail-open rule it leaves alone.
const INTENDED: &str = "\
domain: pay
descriptors:
  - key: tenant
    failure_mode: closed
    rate_limit: {unit: second, requests_per_unit: 50}
  - key: cluster
    value: payments
    failure_mode: closed
    rate_limit: {unit: minute, requests_per_unit: 200}
  - key: route
    value: /charge*
    failure_mode: closed
    rate_limit: {unit: minute, requests_per_unit: 10, algorithm: fixed_window}
  - key: cluster
    value: ledger
    failure_mode: closed
    rate_limit: {unit: minute, requests_per_unit: 20, algorithm: fixed_window}
  - key: catalog
    rate_limit: {unit: second, requests_per_unit: 500}
";

/// What one run of the audit left.
struct Run {
    code: Option<i32>,
    stdout: String,
}

fn audit(intended: &std::path::Path, node: &NodeProcess) -> Result<Run> {
    let output = Command::new(env!("CARGO_BIN_EXE_quotamesh"))
        .args(["audit", "canary", "--policy"])
        .arg(intended)
        .args(["--node", &format!("http://{}", node.rls_addr)])
        .args(["--config-url", &format!("http://{}", node.metrics_addr)])
        .env("QUOTAMESH_ADMIN_TOKEN", ADMIN_TOKEN)
        .env("RUST_BACKTRACE", "0")
        .output()
        .context("run quotamesh audit")?;
    Ok(Run { code: output.status.code(), stdout: String::from_utf8(output.stdout)? })
}

/// The node serving `policy.yaml` of `directory`, with the test operator token.
fn start_node(directory: &std::path::Path) -> Result<NodeProcess> {
    let policy = write_file(directory, "policy.yaml", INTENDED);
    let config = write_file(directory, "node.toml", &admin_section());
    NodeProcess::start_with(
        &policy,
        &directory.join("data"),
        &["--config", config.to_str().context("a UTF-8 path")?],
    )
}

/// Rewrites the node's policy and waits until it serves it (its `/config` shows the text).
fn serve(node: &NodeProcess, directory: &std::path::Path, text: &str) -> Result<()> {
    write_file(directory, "policy.yaml", text);
    let deadline = Instant::now() + Duration::from_secs(10);
    loop {
        let bearer = format!("Bearer {ADMIN_TOKEN}");
        let body =
            common::http_request(node.metrics_addr, "/config", &[("authorization", &bearer)])?.body;
        if body.contains(text) {
            return Ok(());
        }
        anyhow::ensure!(Instant::now() < deadline, "the node did not reload:\n{body}");
        std::thread::sleep(Duration::from_millis(100));
    }
}

/// On the intended policy every audited rule is refused, the rule that would spend callers'
/// window is named as not audited, and callers' counters keep their whole quota; then each
/// way of letting more through fails the audit with the node and rule named.
#[tokio::test]
async fn the_audit_passes_as_intended_and_fails_on_every_fail_open_creep() -> Result<()> {
    let directory = tempfile::tempdir()?;
    let intended = write_file(directory.path(), "intended.yaml", INTENDED);
    let served_dir = directory.path().join("served");
    std::fs::create_dir_all(&served_dir)?;
    let node = start_node(&served_dir)?;

    let clean = audit(&intended, &node)?;
    assert_eq!(clean.code, Some(0), "{}", clean.stdout);
    for rule in ["pay/tenant", "pay/cluster_payments", "pay/route_/charge*"] {
        assert!(clean.stdout.contains(&format!("{rule}: refused")), "{rule}:\n{}", clean.stdout);
    }
    assert!(
        clean.stdout.contains("pay/cluster_ledger: not audited: a fixed window"),
        "{}",
        clean.stdout
    );
    assert!(!clean.stdout.contains("pay/catalog"), "fail-open rules are not audited");
    assert!(clean.stdout.contains("3 passed, 0 failed, 1 fail-closed rule(s) not audited"));
    // The audit's requests touched no caller's counter: each still has its whole limit.
    let mut client = node.client().await?;
    for (entries, limit) in [
        (&[("cluster", "payments")][..], 200),
        (&[("route", "/charge/card")][..], 10),
        (&[("cluster", "ledger")][..], 20),
    ] {
        let response =
            client.should_rate_limit(request("pay", vec![descriptor(entries)])).await?.into_inner();
        assert_eq!(response.overall_code(), Code::Ok, "{entries:?}");
        assert_eq!(response.statuses[0].limit_remaining, limit - 1, "{entries:?}");
    }

    let creeps = [
        (
            "  - key: tenant\n    failure_mode: closed\n",
            "  - key: tenant\n    failure_mode: open\n",
            "pay/tenant: FAILED: served with failure_mode: open (intended: closed)",
        ),
        (
            "  - key: tenant\n    failure_mode: closed\n",
            "  - key: tenant\n    failure_mode: closed\n    shadow_mode: true\n",
            "pay/tenant: FAILED: admitted a synthetic request of 51 hits",
        ),
        (
            "requests_per_unit: 200}",
            "requests_per_unit: 20000}",
            "pay/cluster_payments: FAILED: admitted a synthetic request of 201 hits",
        ),
        (
            "  - key: route\n    value: /charge*\n",
            "  - key: route\n    value: /checkout*\n",
            "pay/route_/charge*: FAILED: the node serves no such rule",
        ),
    ];
    for (from, to, reported) in creeps {
        serve(&node, &served_dir, &INTENDED.replacen(from, to, 1))?;
        let run = audit(&intended, &node)?;
        assert_eq!(run.code, Some(1), "{to}:\n{}", run.stdout);
        assert!(run.stdout.contains(reported), "{to}: expected {reported:?} in:\n{}", run.stdout);
    }
    Ok(())
}

/// The long-running mode exports its metrics: a clean round sets the last-success time, a
/// failing one adds to the failure counter while the time stays put.
#[test]
fn the_audit_every_interval_exports_its_metrics() -> Result<()> {
    let directory = tempfile::tempdir()?;
    let intended = write_file(directory.path(), "intended.yaml", INTENDED);
    let served_dir = directory.path().join("served");
    std::fs::create_dir_all(&served_dir)?;
    let node = start_node(&served_dir)?;
    let metrics_addr: SocketAddr = format!("127.0.0.1:{}", free_port()).parse()?;
    let daemon = Daemon(
        Command::new(env!("CARGO_BIN_EXE_quotamesh"))
            .args(["audit", "canary", "--every", "1s", "--policy"])
            .arg(&intended)
            .args(["--node", &format!("http://{}", node.rls_addr)])
            .args(["--config-url", &format!("http://{}", node.metrics_addr)])
            .args(["--metrics-addr", &metrics_addr.to_string()])
            .env("QUOTAMESH_ADMIN_TOKEN", ADMIN_TOKEN)
            .stdout(Stdio::null())
            .spawn()?,
    );
    let value = |name: &str| -> Result<f64> {
        let (_, body) = http_get(metrics_addr, "/metrics")?;
        Ok(common::metric_value(&body, name))
    };
    let wait_for = |what: &str, done: &dyn Fn() -> Result<bool>| -> Result<()> {
        let deadline = Instant::now() + Duration::from_secs(20);
        while !done().unwrap_or(false) {
            anyhow::ensure!(Instant::now() < deadline, "{what} within 20 s");
            std::thread::sleep(Duration::from_millis(100));
        }
        Ok(())
    };
    const SUCCESS: &str = "quotamesh_canary_audit_last_success_timestamp_seconds";
    const FAILURES: &str = "quotamesh_canary_audit_failures_total";
    wait_for("a clean round", &|| Ok(value(SUCCESS)? > 0.0))?;
    assert_eq!(value(FAILURES)?, 0.0);
    serve(&node, &served_dir, &INTENDED.replacen("failure_mode: closed", "failure_mode: open", 1))?;
    wait_for("a failed round", &|| Ok(value(FAILURES)? >= 1.0))?;
    let last_success = value(SUCCESS)?;
    std::thread::sleep(Duration::from_millis(2_500));
    assert!(value(FAILURES)? >= 2.0, "every round fails");
    assert_eq!(value(SUCCESS)?, last_success, "no clean round since");
    drop(daemon);
    Ok(())
}

/// Stops the audit process when the test ends.
struct Daemon(Child);

impl Drop for Daemon {
    fn drop(&mut self) {
        let _ = self.0.kill();
        let _ = self.0.wait();
    }
}

/// `quotamesh policy diff` against the node's served policy: the same rules (here written
/// as a Kubernetes resource) are no change and exit 0; a raised limit and a new rule are
/// shown rule by rule and exit 1; files that do not load exit 2.
#[test]
fn policy_diff_shows_rule_changes_and_exits_for_pipelines() -> Result<()> {
    let directory = tempfile::tempdir()?;
    let served_dir = directory.path().join("served");
    std::fs::create_dir_all(&served_dir)?;
    let node = start_node(&served_dir)?;
    let diff = |file: &std::path::Path| -> Result<Run> {
        let output = Command::new(env!("CARGO_BIN_EXE_quotamesh"))
            .args(["policy", "diff"])
            .arg(file)
            .args(["--url", &format!("http://{}", node.metrics_addr)])
            .env("QUOTAMESH_ADMIN_TOKEN", ADMIN_TOKEN)
            .output()?;
        Ok(Run { code: output.status.code(), stdout: String::from_utf8(output.stdout)? })
    };
    let indented: String = INTENDED.lines().map(|line| format!("  {line}\n")).collect();
    let resource = write_file(
        directory.path(),
        "resource.yaml",
        &format!(
            "apiVersion: quotamesh.io/v1\nkind: RateLimitPolicy\nmetadata:\n  name: pay\nspec:\n{indented}"
        ),
    );
    let same = diff(&resource)?;
    assert_eq!(same.code, Some(0), "{}", same.stdout);
    assert!(same.stdout.contains("no changes"), "{}", same.stdout);
    let changed = write_file(
        directory.path(),
        "changed.yaml",
        &format!(
            "{}  - key: refunds\n    rate_limit: {{unit: hour, requests_per_unit: 3}}\n",
            INTENDED.replace("requests_per_unit: 50}", "requests_per_unit: 80}")
        ),
    );
    let run = diff(&changed)?;
    assert_eq!(run.code, Some(1), "{}", run.stdout);
    assert!(
        run.stdout.contains(
            "~ pay/tenant\n    was: 50 per second token_bucket; failure_mode closed\n    now: 80 \
             per second token_bucket; failure_mode closed"
        ),
        "{}",
        run.stdout
    );
    assert!(run.stdout.contains("+ pay/refunds: 3 per hour token_bucket"), "{}", run.stdout);
    assert!(run.stdout.contains("2 rule(s) would change"), "{}", run.stdout);
    let broken = write_file(directory.path(), "broken.yaml", "domain: pay\ndescriptors: 5\n");
    assert_eq!(diff(&broken)?.code, Some(2));
    Ok(())
}
