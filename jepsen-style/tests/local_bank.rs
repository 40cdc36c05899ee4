//! End to end against the real release binary: a short seeded bank run of three local
//! nodes under kill -9 and SIGSTOP, with both cores busy, ends valid; and `check` on the
//! same run, with one acknowledged debit removed from every node's trail, ends invalid (so
//! the run's verdict is one that can fail).

use std::path::{Path, PathBuf};
use std::process::Command;

/// The quotamesh binary under test: `QUOTAMESH_BIN`, else the workspace's release build.
fn quotamesh_binary() -> PathBuf {
    std::env::var_os("QUOTAMESH_BIN").map_or_else(
        || Path::new(env!("CARGO_MANIFEST_DIR")).join("../target/release/quotamesh"),
        PathBuf::from,
    )
}

/// Two threads that spin until dropped: both cores busy, as on a shared CI machine.
struct CpuHog {
    stop: std::sync::Arc<std::sync::atomic::AtomicBool>,
    threads: Vec<std::thread::JoinHandle<()>>,
}

impl CpuHog {
    fn start(threads: usize) -> Self {
        let stop = std::sync::Arc::new(std::sync::atomic::AtomicBool::new(false));
        let threads = (0..threads)
            .map(|_| {
                let stop = std::sync::Arc::clone(&stop);
                std::thread::spawn(move || {
                    let mut spin = 0_u64;
                    while !stop.load(std::sync::atomic::Ordering::Relaxed) {
                        spin = std::hint::black_box(spin.wrapping_mul(6_364_136_223_846_793_005));
                    }
                })
            })
            .collect();
        Self { stop, threads }
    }
}

impl Drop for CpuHog {
    fn drop(&mut self) {
        self.stop.store(true, std::sync::atomic::Ordering::Relaxed);
        for thread in self.threads.drain(..) {
            let _ = thread.join();
        }
    }
}

fn json(path: &Path) -> serde_json::Value {
    let text = std::fs::read_to_string(path).unwrap_or_else(|error| panic!("{path:?}: {error}"));
    serde_json::from_str(&text).unwrap_or_else(|error| panic!("{path:?}: {error}"))
}

fn lines(path: &Path) -> Vec<serde_json::Value> {
    std::fs::read_to_string(path)
        .unwrap_or_else(|error| panic!("{path:?}: {error}"))
        .lines()
        .map(|line| serde_json::from_str(line).expect("a JSON line"))
        .collect()
}

/// The bank run under kill and pause is valid, and is judged invalid once an acknowledged
/// debit disappears from the trails.
#[test]
fn bank_under_kill_and_pause_is_valid() {
    let binary = quotamesh_binary();
    assert!(
        binary.is_file(),
        "{} is missing: build it first (cargo build --release --bin quotamesh)",
        binary.display()
    );
    let out = tempfile::tempdir().expect("a temporary directory");
    let started = std::time::Instant::now();
    let output = {
        let _hog = CpuHog::start(2);
        Command::new(env!("CARGO_BIN_EXE_quotamesh-jepsen"))
            .args(["run", "--topology", "local", "--nodes", "3", "--workload", "bank"])
            .args(["--nemesis", "kill,pause", "--time-limit", "20s", "--rate", "200"])
            .args(["--seed", "42", "--out"])
            .arg(out.path())
            .arg("--binary")
            .arg(&binary)
            .output()
            .expect("run quotamesh-jepsen")
    };
    let stdout = String::from_utf8_lossy(&output.stdout);
    eprintln!("{stdout}\n{}", String::from_utf8_lossy(&output.stderr));
    eprintln!("the run took {:?}", started.elapsed());
    assert_eq!(output.status.code(), Some(0), "the run's verdict is not valid");

    let directory = std::fs::read_dir(out.path())
        .expect("the out directory")
        .map(|entry| entry.expect("an entry").path())
        .find(|path| path.is_dir())
        .expect("a run directory");
    assert_eq!(json(&directory.join("verdict.json"))["validity"], "valid");
    // Seed 42 plans pauses and a kill in 20 s; each was carried out.
    let faults = lines(&directory.join("nemesis.jsonl"));
    for kind in ["kill", "pause"] {
        assert!(
            faults.iter().any(|record| record["kind"] == kind
                && record["phase"] == "start"
                && record["outcome"] == "installed"),
            "no {kind} was installed: {faults:?}"
        );
    }
    let history = lines(&directory.join("history.jsonl"));
    let acknowledged = history.iter().filter(|event| event["type"] == "ok").count();
    assert!(acknowledged > 500, "only {acknowledged} operations were acknowledged");

    // Remove one acknowledged, approved debit from every node's trail: a lost write.
    let trail_one = lines(&directory.join("trail-node-1.jsonl"));
    let lost = trail_one
        .iter()
        .filter(|entry| entry["kind"] == "debit" && entry["decision"] == "approved")
        .map(|entry| entry["key"].as_str().expect("a key").to_owned())
        .find(|key| {
            history.iter().any(|event| event["type"] == "ok" && event["value"]["key"] == **key)
        })
        .expect("an acknowledged debit");
    for node in 1..=3 {
        let path = directory.join(format!("trail-node-{node}.jsonl"));
        let kept: String = std::fs::read_to_string(&path)
            .expect("a trail")
            .lines()
            .filter(|line| !line.contains(&format!("\"key\":\"{lost}\"")))
            .map(|line| format!("{line}\n"))
            .collect();
        std::fs::write(&path, kept).expect("rewrite the trail");
    }
    let check = Command::new(env!("CARGO_BIN_EXE_quotamesh-jepsen"))
        .arg("check")
        .arg(&directory)
        .output()
        .expect("run quotamesh-jepsen check");
    let printed = String::from_utf8_lossy(&check.stdout);
    assert_eq!(check.status.code(), Some(1), "the lost debit {lost} went unnoticed:\n{printed}");
    assert!(printed.contains("exactly-once   Invalid"), "{printed}");
}
