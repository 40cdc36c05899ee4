//! End to end against the real release binary: a short seeded RLS run of three local nodes
//! under kill -9, SIGSTOP, a stepping wall clock and a policy file rewritten under the
//! nodes, with both cores busy, keeps both rules within their bounds; and `check` on the
//! same run, with refused hits of the fail-closed rule turned into admissions, or with the
//! ledger's totals showing a bucket that gave more than it holds, ends invalid.

mod common;

/// The RLS run under kill, pause, clock steps and a policy reload is valid, and is judged
/// invalid once the fail-closed rule appears to have admitted every hit.
#[test]
fn rls_under_kill_pause_clock_steps_and_reloads_is_within_bounds() {
    let out = tempfile::tempdir().expect("a temporary directory");
    // Seed 16 plans, in 20 s: the leader paused, the leader's policy file rewritten, every
    // clock stepping an hour ahead and back, the leader killed.
    let nemeses = ["kill", "pause", "policy", "clock-step"];
    let directory = common::valid_run("rls", "local", &nemeses, 16, out.path());
    common::assert_installed(&directory, &nemeses);
    // The rewritten file reached its node: right after the fault it had loaded a policy
    // again (at start it had loaded one; a later kill restarts the counts).
    let reloads = |node: &serde_json::Value, label: &str| -> u64 {
        let path = directory.join(format!("metrics/node-{node}-{label}.prom"));
        std::fs::read_to_string(&path)
            .unwrap_or_default()
            .lines()
            .filter(|line| line.starts_with("quotamesh_policy_reloads_total{"))
            .filter_map(|line| line.rsplit(' ').next()?.parse::<u64>().ok())
            .sum()
    };
    let policy = common::lines(&directory.join("nemesis.jsonl"))
        .into_iter()
        .find(|record| record["kind"] == "policy" && record["phase"] == "start")
        .expect("a policy fault");
    for node in policy["nodes"].as_array().expect("its nodes") {
        let after = format!("fault-{}", policy["fault"]);
        assert!(reloads(node, &after) > reloads(node, "start"), "node {node} did not reload");
    }
    let history = common::lines(&directory.join("history.jsonl"));
    let refused = history
        .iter()
        .filter(|event| event["type"] == "ok" && event["value"]["admitted"] == false)
        .count();
    assert!(refused > 500, "only {refused} hits were refused: the load is not above the limit");

    // The ledger was read from the voters as the run went, with the rules' keys leased and
    // settled (what the nodes reported came back or was charged), and judged.
    let reads = common::lines(&directory.join("ledger.jsonl"));
    assert!(reads.len() > 20, "only {} reads of the ledger", reads.len());
    // The latest read that holds keys (the sweep forgets a key idle for two windows).
    let with_keys =
        |read: &&serde_json::Value| read["keys"].as_array().is_some_and(|keys| !keys.is_empty());
    let last = reads
        .iter()
        .filter(with_keys)
        .max_by_key(|read| read["applied_index"].as_u64())
        .expect("a read with keys");
    let total = |field: &str| -> u64 {
        last["keys"].as_array().expect("keys").iter().filter_map(|key| key[field].as_u64()).sum()
    };
    assert!(total("granted_tokens") > 100, "granted {}", total("granted_tokens"));
    assert!(
        total("returned_tokens") + total("charged_tokens") > 0,
        "no settlement moved a token: the keys were not live"
    );
    let verdict = common::json(&directory.join("verdict.json"));
    let totals = verdict["checks"]
        .as_array()
        .and_then(|checks| checks.iter().find(|check| check["name"] == "lease-totals"))
        .expect("a lease-totals check");
    assert!(totals["checked"].as_u64() > Some(40), "{totals}");

    // That state (read from every voter that read its applied index) shows a key's bucket
    // granting far more than it holds and refills: `check` says so.
    let last_index = last["applied_index"].as_u64();
    let ledger = directory.join("ledger.jsonl");
    let saved = std::fs::read(&ledger).expect("ledger.jsonl");
    common::rewrite_lines(&ledger, |mut read| {
        if read["applied_index"].as_u64() == last_index {
            let granted = read["keys"][0]["granted_tokens"].as_u64().unwrap_or(0);
            read["keys"][0]["granted_tokens"] = serde_json::Value::from(granted + 100_000);
        }
        Some(read)
    });
    let (code, printed) = common::check(&directory);
    assert_eq!(code, Some(1), "an over-grant went unnoticed:\n{printed}");
    let judged = |line: &&str| line.starts_with("lease-totals ") && line.contains(" Invalid ");
    assert!(printed.lines().any(|line| judged(&line)), "{printed}");
    std::fs::write(&ledger, saved).expect("ledger.jsonl put back");

    common::rewrite_lines(&directory.join("history.jsonl"), |mut event| {
        if event["value"]["descriptor"] == "closed" && event["value"]["admitted"] == false {
            event["value"]["admitted"] = serde_json::Value::Bool(true);
        }
        Some(event)
    });
    let (code, printed) = common::check(&directory);
    assert_eq!(code, Some(1), "over-admission went unnoticed:\n{printed}");
    assert!(printed.contains("admissions-closed Invalid"), "{printed}");
}
