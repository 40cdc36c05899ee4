//! End to end against the real release binary: a short seeded lease run of three local
//! voters and a gateway under kill -9, SIGSTOP and wall-clock jumps, with both cores busy,
//! grants no more than each bucket holds and refills; and `check` on the same run, with
//! one grant's tokens raised in the history, ends invalid.

mod common;

/// The lease run under kill, pause and clock jumps is valid, the gateway's grants among its
/// answers, and it is judged invalid once one grant appears to have taken a whole burst.
#[test]
fn leases_under_kill_pause_and_clock_jumps_stay_within_the_bucket() {
    let out = tempfile::tempdir().expect("a temporary directory");
    let nemeses = ["kill", "pause", "clock"];
    let directory =
        common::valid_run_with("leases", "local", &nemeses, SEED, out.path(), &["--gateways", "1"]);
    common::assert_installed(&directory, &nemeses);
    let history = common::lines(&directory.join("history.jsonl"));
    let granted = |node: Option<u64>| {
        history
            .iter()
            .filter(|event| event["type"] == "ok" && event["f"] == "acquire")
            .filter(|event| node.is_none_or(|node| event["node"] == node))
            .filter(|event| event["value"]["granted"].as_u64().is_some_and(|tokens| tokens > 0))
            .count()
    };
    assert!(granted(Some(4)) > 10, "the gateway (node 4) granted {} times", granted(Some(4)));
    let refused = history
        .iter()
        .filter(|event| event["type"] == "ok" && event["value"]["granted"] == 0)
        .count();
    assert!(refused > 500, "only {refused} grants got nothing: the load is not above the rate");

    // The first grant that got less than a burst gets a whole burst more.
    let mut raised = false;
    common::rewrite_lines(&directory.join("history.jsonl"), |mut event| {
        let tokens = event["value"]["granted"].as_u64().unwrap_or(0);
        if !raised && event["type"] == "ok" && tokens > 0 {
            event["value"]["granted"] = serde_json::Value::from(tokens + 20);
            event["value"]["remaining"] = serde_json::Value::from(0);
            raised = true;
        }
        Some(event)
    });
    let (code, printed) = common::check(&directory);
    assert_eq!(code, Some(1), "an over-grant went unnoticed:\n{printed}");
    assert!(printed.contains("lease-conservation Invalid"), "{printed}");
}

/// Plans, in 20 s, the leader's clock an hour ahead, the leader paused and the leader
/// killed (checked above, as carried out).
const SEED: u64 = 18;
