//! End to end against the real release binary: a short seeded RLS run of three local nodes
//! under kill -9 and SIGSTOP, with both cores busy, keeps both rules within their bounds;
//! and `check` on the same run, with refused hits of the fail-closed rule turned into
//! admissions, ends invalid.

mod common;

/// The RLS run under kill and pause is valid, and is judged invalid once the fail-closed
/// rule appears to have admitted every hit.
#[test]
fn rls_under_kill_and_pause_is_within_bounds() {
    let out = tempfile::tempdir().expect("a temporary directory");
    let directory = common::valid_run("rls", "local", &["kill", "pause"], out.path());
    let history = common::lines(&directory.join("history.jsonl"));
    let refused = history
        .iter()
        .filter(|event| event["type"] == "ok" && event["value"]["admitted"] == false)
        .count();
    assert!(refused > 500, "only {refused} hits were refused: the load is not above the limit");

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
