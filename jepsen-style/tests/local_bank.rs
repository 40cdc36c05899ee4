//! End to end against the real release binary: a short seeded bank run of three local
//! nodes under kill -9, SIGSTOP, wall-clock offsets (libfaketime) and a voter removed and
//! added back, with both cores busy, ends valid; and `check` on the
//! same run, with one acknowledged debit removed from every node's trail, ends invalid, and
//! so does it with one read's answer changed (so the run's verdict is one that can fail).

mod common;

/// The bank run under kill, pause, clock offsets and a membership change is valid, and is
/// judged invalid once an acknowledged debit disappears from the trails.
#[test]
fn bank_under_kill_pause_clock_and_membership_is_valid() {
    let out = tempfile::tempdir().expect("a temporary directory");
    // Seed 14 plans, in 20 s: the leader paused, the leader removed from the voters and
    // added back, a kill, the leader's clock 25 h ahead (past the idempotency-key retention).
    let nemeses = ["kill", "pause", "clock", "membership"];
    let directory = common::valid_run("bank", "local", &nemeses, 14, out.path());
    common::assert_installed(&directory, &nemeses);
    let history = common::lines(&directory.join("history.jsonl"));
    let acknowledged = history.iter().filter(|event| event["type"] == "ok").count();
    assert!(acknowledged > 500, "only {acknowledged} operations were acknowledged");

    // Remove one acknowledged, approved debit from every node's trail: a lost write.
    let lost = common::lines(&directory.join("trail-node-1.jsonl"))
        .iter()
        .filter(|entry| entry["kind"] == "debit" && entry["decision"] == "approved")
        .map(|entry| entry["key"].clone())
        .find(|key| {
            history.iter().any(|event| event["type"] == "ok" && event["value"]["key"] == *key)
        })
        .expect("an acknowledged debit");
    for node in 1..=3 {
        common::rewrite_lines(&directory.join(format!("trail-node-{node}.jsonl")), |entry| {
            (entry["key"] != lost).then_some(entry)
        });
    }
    let (code, printed) = common::check(&directory);
    assert_eq!(code, Some(1), "the lost debit {lost} went unnoticed:\n{printed}");
    assert!(printed.contains("exactly-once   Invalid"), "{printed}");
    assert!(printed.contains("linearizable   Valid"), "{printed}");

    // One acknowledged read answering a balance no order of the writes gives: the
    // linearizability search, which reads the history alone, flags it.
    let mut changed = false;
    common::rewrite_lines(&directory.join("history.jsonl"), |mut event| {
        if !changed && event["type"] == "ok" && event["f"] == "read" {
            event["value"]["balance"] = serde_json::json!(999_999);
            changed = true;
        }
        Some(event)
    });
    let (code, printed) = common::check(&directory);
    assert_eq!(code, Some(1), "{printed}");
    assert!(printed.contains("linearizable   Invalid"), "{printed}");
}
