//! The operator's side of a real node: the command line takes its shared options before or
//! after a subcommand, `quotamesh health --json` prints one object with the probe's exit
//! code, and the policy files (`/config`, `/rlconfig`) are shown only to an operator token
//! of the admin API, or to anyone where its reads are open, while `/metrics`, `/healthz`
//! and `/readyz` stay open to Prometheus and probes.

use std::net::SocketAddr;
use std::path::Path;
use std::time::{Duration, Instant};

use anyhow::{Context, Result};
use common::tls::{ADMIN_TOKEN, admin_section};
use common::{NodeProcess, free_port, http_request, run_cli as quotamesh, write_file};

/// The policy the node serves.
const POLICY: &str = "\
domain: cli-test
descriptors:
  - key: api_key
    rate_limit: {name: per_key, unit: second, requests_per_unit: 100}
";

/// Waits until the node's `/readyz` answers 200: a fresh single node elects itself first.
fn wait_ready(node: &NodeProcess) -> Result<()> {
    let deadline = Instant::now() + Duration::from_secs(30);
    while node.readiness()?.0 != 200 {
        anyhow::ensure!(Instant::now() < deadline, "not ready: {:?}", node.readiness()?);
        std::thread::sleep(Duration::from_millis(50));
    }
    Ok(())
}

/// A single node with the test operator token, its admin reads open or not; ready.
fn start_node(directory: &Path, read_open: bool) -> Result<(NodeProcess, SocketAddr)> {
    let policy = write_file(directory, "policy.yaml", POLICY);
    let config = write_file(
        directory,
        "node.toml",
        &format!("{}\n[admin]\nread_open = {read_open}\n", admin_section()),
    );
    let admin_addr: SocketAddr = format!("127.0.0.1:{}", free_port()).parse()?;
    let node = NodeProcess::start_with(
        &policy,
        &directory.join("data"),
        &[
            "--config",
            config.to_str().context("a UTF-8 path")?,
            "--admin-addr",
            &admin_addr.to_string(),
        ],
    )?;
    wait_ready(&node)?;
    Ok((node, admin_addr))
}

/// Proves that `cluster`, `policy` and `rls` take their shared options (`--admin-addr`,
/// `--timeout-ms`, `--json`, `--addr`) before the subcommand as after it, with the same
/// result; and that each cluster command still shows its own `--timeout-ms` help.
#[test]
fn shared_options_go_before_or_after_the_subcommand() -> Result<()> {
    let scratch = tempfile::tempdir()?;
    let (node, admin_addr) = start_node(scratch.path(), false)?;
    let admin = admin_addr.to_string();
    let token = Some(ADMIN_TOKEN);

    let before = quotamesh(
        &["cluster", "--admin-addr", &admin, "--timeout-ms", "5000", "--json", "status"],
        token,
    )?;
    let after = quotamesh(
        &["cluster", "status", "--admin-addr", &admin, "--timeout-ms", "5000", "--json"],
        token,
    )?;
    for run in [&before, &after] {
        assert_eq!(run.code, Some(0), "cluster status failed: {}", run.stderr);
        let status: serde_json::Value = serde_json::from_str(&run.stdout)
            .with_context(|| format!("not JSON: {}", run.stdout))?;
        assert_eq!(status["nodes"][0]["admin_addr"], admin.as_str(), "{status}");
        assert_eq!(status["nodes"][0]["node_id"], 1, "{status}");
    }
    // Before the subcommand, `--timeout-ms` is the same typed option: a word is refused.
    let misspelt = quotamesh(&["cluster", "--timeout-ms", "soon", "status"], token)?;
    assert_eq!(misspelt.code, Some(2), "{}", misspelt.stderr);
    assert!(misspelt.stderr.contains("--timeout-ms"), "{}", misspelt.stderr);

    let add_help = quotamesh(&["cluster", "add-node", "--help"], None)?.stdout;
    assert!(add_help.contains("caught up with the leader's log"), "{add_help}");
    let status_help = quotamesh(&["cluster", "status", "--help"], None)?.stdout;
    assert!(status_help.contains("How long each node may take to answer"), "{status_help}");

    let policy = scratch.path().join("policy.yaml");
    let policy = policy.to_str().context("a UTF-8 path")?;
    for arguments in
        [["policy", "--json", "validate", policy], ["policy", "validate", policy, "--json"]]
    {
        let run = quotamesh(&arguments, None)?;
        assert_eq!(run.code, Some(0), "{}", run.stderr);
        let verdict: serde_json::Value = serde_json::from_str(&run.stdout)?;
        assert_eq!(verdict["ok"], true, "{verdict}");
    }

    let rls = format!("http://{}", node.rls_addr);
    for arguments in [
        vec![
            "rls",
            "--addr",
            &rls,
            "--json",
            "ask",
            "--domain",
            "cli-test",
            "--entry",
            "api_key=a",
        ],
        vec![
            "rls",
            "ask",
            "--domain",
            "cli-test",
            "--entry",
            "api_key=a",
            "--addr",
            &rls,
            "--json",
        ],
    ] {
        let run = quotamesh(&arguments, None)?;
        assert_eq!(run.code, Some(0), "{}", run.stderr);
        let answer: serde_json::Value = serde_json::from_str(&run.stdout)?;
        assert_eq!(answer["overall_code"], "OK", "{answer}");
    }
    Ok(())
}

/// Proves that `quotamesh health --json` prints one JSON object and keeps the exit codes:
/// 0 and `ready` on a 200, 1 with the status on any other answer, 1 with the error when
/// nothing answers.
#[test]
fn health_json_is_one_object_with_the_same_exit_codes() -> Result<()> {
    let scratch = tempfile::tempdir()?;
    let (node, _) = start_node(scratch.path(), false)?;
    let url = |path: &str| format!("http://{}{path}", node.metrics_addr);

    let ready = quotamesh(&["health", "--json", "--url", &url("/readyz")], None)?;
    assert_eq!(ready.code, Some(0), "{}{}", ready.stdout, ready.stderr);
    assert_eq!(ready.stdout.lines().count(), 1, "one line: {}", ready.stdout);
    let answer: serde_json::Value = serde_json::from_str(&ready.stdout)?;
    assert_eq!(answer["ready"], true, "{answer}");
    assert_eq!(answer["status"], 200, "{answer}");
    assert!(answer["body"].as_str().is_some_and(|body| body.starts_with("ready\n")), "{answer}");

    // The policy is locked: a 401 is not ready.
    let refused = quotamesh(&["health", "--json", "--url", &url("/config")], None)?;
    assert_eq!(refused.code, Some(1), "{}", refused.stdout);
    let answer: serde_json::Value = serde_json::from_str(&refused.stdout)?;
    assert_eq!((answer["ready"].clone(), answer["status"].clone()), (false.into(), 401.into()));

    let nowhere = format!("http://127.0.0.1:{}/readyz", free_port());
    let down = quotamesh(&["health", "--json", "--url", &nowhere, "--timeout-ms", "500"], None)?;
    assert_eq!(down.code, Some(1), "{}", down.stdout);
    let answer: serde_json::Value = serde_json::from_str(&down.stdout)?;
    assert_eq!(answer["ready"], false, "{answer}");
    assert!(answer["error"].as_str().is_some_and(|error| error.contains("connect")), "{answer}");
    Ok(())
}

/// Proves that `/config` and `/rlconfig` refuse a caller without an operator token (401, a
/// body saying what to send) or with a wrong one, and show the policy to the test operator
/// token, through `quotamesh policy get` as through HTTP; that `/metrics`, `/healthz` and
/// `/readyz` need none; and that with `admin.read_open` the policy is open too.
#[test]
fn the_policy_is_shown_to_operators_only() -> Result<()> {
    let scratch = tempfile::tempdir()?;
    let (node, _) = start_node(scratch.path(), false)?;
    let address = node.metrics_addr;
    let bearer = |token: &str| format!("Bearer {token}");

    for path in ["/config", "/rlconfig", "/config?format=json"] {
        let anonymous = http_request(address, path, &[])?;
        assert_eq!(anonymous.status, 401, "{path}: {}", anonymous.body);
        assert!(anonymous.body.contains("Authorization: Bearer <token>"), "{}", anonymous.body);
        assert_eq!(anonymous.header("www-authenticate"), Some("Bearer"));
        let wrong = http_request(address, path, &[("Authorization", &bearer("not-the-token"))])?;
        assert_eq!(wrong.status, 401, "{path} with a wrong token: {}", wrong.body);
        assert!(wrong.body.contains("unknown bearer token"), "{}", wrong.body);
        let operator = http_request(address, path, &[("Authorization", &bearer(ADMIN_TOKEN))])?;
        assert_eq!(operator.status, 200, "{path} with the token: {}", operator.body);
        assert!(operator.body.contains("domain: cli-test"), "{path}: {}", operator.body);
    }
    for path in ["/metrics", "/healthz", "/readyz"] {
        let open = http_request(address, path, &[])?;
        assert_eq!(open.status, 200, "{path} needs no token: {}", open.body);
    }

    let url = format!("http://{address}");
    let refused = quotamesh(&["policy", "get", "--url", &url], None)?;
    assert_eq!(refused.code, Some(1), "{}", refused.stdout);
    assert!(
        refused.stderr.contains("401") && refused.stderr.contains("Bearer"),
        "{}",
        refused.stderr
    );
    let shown = quotamesh(&["policy", "get", "--url", &url, "--json"], Some(ADMIN_TOKEN))?;
    assert_eq!(shown.code, Some(0), "{}", shown.stderr);
    let policy: serde_json::Value = serde_json::from_str(&shown.stdout)?;
    assert_eq!(policy["rules"], 1, "{policy}");
    let token_file = write_file(scratch.path(), "token", &format!("{ADMIN_TOKEN}\n"));
    let from_file = quotamesh(
        &[
            "policy",
            "get",
            "--url",
            &url,
            "--admin-token-file",
            token_file.to_str().context("path")?,
        ],
        None,
    )?;
    assert_eq!(from_file.code, Some(0), "{}", from_file.stderr);
    assert!(from_file.stdout.starts_with("# policy digest "), "{}", from_file.stdout);
    drop(node);

    let open_scratch = tempfile::tempdir()?;
    let (open_node, _) = start_node(open_scratch.path(), true)?;
    let open = http_request(open_node.metrics_addr, "/rlconfig", &[])?;
    assert_eq!(open.status, 200, "read_open: {}", open.body);
    let wrong =
        http_request(open_node.metrics_addr, "/config", &[("Authorization", &bearer("nope"))])?;
    assert_eq!(wrong.status, 401, "a wrong token is refused even when reads are open");
    Ok(())
}
