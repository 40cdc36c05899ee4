//! What the end-to-end tests share: the quotamesh binary under test, a CPU hog, a run of
//! `quotamesh-jepsen` into a temporary directory, and readers of its JSON files.

#![allow(dead_code)] // Each test binary uses a different part.

use std::path::{Path, PathBuf};
use std::process::Command;

/// The quotamesh binary under test: `QUOTAMESH_BIN`, else the workspace's release build.
pub fn quotamesh_binary() -> PathBuf {
    std::env::var_os("QUOTAMESH_BIN").map_or_else(
        || Path::new(env!("CARGO_MANIFEST_DIR")).join("../target/release/quotamesh"),
        PathBuf::from,
    )
}

/// Two threads that spin until dropped: both cores busy, as on a shared CI machine.
pub struct CpuHog {
    stop: std::sync::Arc<std::sync::atomic::AtomicBool>,
    threads: Vec<std::thread::JoinHandle<()>>,
}

impl CpuHog {
    pub fn start(threads: usize) -> Self {
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

/// `quotamesh-jepsen run` of `workload` on three voters of `topology` under the faults
/// `nemeses` for 20 s at the default rate with `seed`, with both cores busy; asserts a valid
/// verdict and that every planned fault was carried out, and returns the run's directory
/// (inside `out`).
pub fn valid_run(
    workload: &str,
    topology: &str,
    nemeses: &[&str],
    seed: u64,
    out: &Path,
) -> PathBuf {
    valid_run_with(workload, topology, nemeses, seed, out, &[])
}

/// [`valid_run`] with more options for `run` (`--gateways 1`, say).
pub fn valid_run_with(
    workload: &str,
    topology: &str,
    nemeses: &[&str],
    seed: u64,
    out: &Path,
    options: &[&str],
) -> PathBuf {
    let binary = quotamesh_binary();
    assert!(
        binary.is_file(),
        "{} is missing: build it first (cargo build --release --bin quotamesh)",
        binary.display()
    );
    let started = std::time::Instant::now();
    let output = {
        let _hog = CpuHog::start(2);
        Command::new(env!("CARGO_BIN_EXE_quotamesh-jepsen"))
            .args(["run", "--topology", topology, "--nodes", "3", "--workload", workload])
            .args(["--nemesis", &nemeses.join(","), "--time-limit", "20s", "--rate", "200"])
            .args(["--seed", &seed.to_string()])
            .args(options)
            .arg("--out")
            .arg(out)
            .arg("--binary")
            .arg(&binary)
            .output()
            .expect("run quotamesh-jepsen")
    };
    eprintln!(
        "{}\n{}\nthe run took {:?}",
        String::from_utf8_lossy(&output.stdout),
        String::from_utf8_lossy(&output.stderr),
        started.elapsed()
    );
    assert_eq!(output.status.code(), Some(0), "the run's verdict is not valid");
    let directory = std::fs::read_dir(out)
        .expect("the out directory")
        .map(|entry| entry.expect("an entry").path())
        .find(|path| path.is_dir())
        .expect("a run directory");
    assert_eq!(json(&directory.join("verdict.json"))["validity"], "valid");
    // Every fault the seed planned was carried out (a leader-aimed one may find no leader).
    let planned =
        json(&directory.join("schedule.json"))["faults"].as_array().cloned().unwrap_or_default();
    assert!(!planned.is_empty(), "seed {seed} planned no fault in 20 s");
    let faults = lines(&directory.join("nemesis.jsonl"));
    for (number, fault) in planned.iter().enumerate() {
        let done = faults.iter().any(|record| {
            record["fault"] == number
                && record["phase"] == "start"
                && (record["outcome"] == "installed"
                    || (record["outcome"] == "skipped" && fault["target"] == "leader"))
        });
        assert!(done, "planned fault {number} ({fault}) was not carried out: {faults:?}");
    }
    directory
}

/// Asserts that the run's nemesis put a fault of each of `kinds` in place.
pub fn assert_installed(directory: &Path, kinds: &[&str]) {
    let installed: Vec<String> = lines(&directory.join("nemesis.jsonl"))
        .into_iter()
        .filter(|record| record["phase"] == "start" && record["outcome"] == "installed")
        .filter_map(|record| record["kind"].as_str().map(str::to_owned))
        .collect();
    for kind in kinds {
        assert!(installed.iter().any(|done| done == kind), "no {kind}: {installed:?}");
    }
}

/// `quotamesh-jepsen check` on a run directory: its exit code and what it printed.
pub fn check(directory: &Path) -> (Option<i32>, String) {
    let output = Command::new(env!("CARGO_BIN_EXE_quotamesh-jepsen"))
        .arg("check")
        .arg(directory)
        .output()
        .expect("run quotamesh-jepsen check");
    (output.status.code(), String::from_utf8_lossy(&output.stdout).into_owned())
}

pub fn json(path: &Path) -> serde_json::Value {
    let text = std::fs::read_to_string(path).unwrap_or_else(|error| panic!("{path:?}: {error}"));
    serde_json::from_str(&text).unwrap_or_else(|error| panic!("{path:?}: {error}"))
}

pub fn lines(path: &Path) -> Vec<serde_json::Value> {
    std::fs::read_to_string(path)
        .unwrap_or_else(|error| panic!("{path:?}: {error}"))
        .lines()
        .map(|line| serde_json::from_str(line).expect("a JSON line"))
        .collect()
}

/// Rewrites a JSON-lines file through `edit`.
pub fn rewrite_lines(
    path: &Path,
    edit: impl FnMut(serde_json::Value) -> Option<serde_json::Value>,
) {
    let kept: String =
        lines(path).into_iter().filter_map(edit).map(|value| format!("{value}\n")).collect();
    std::fs::write(path, kept).expect("rewrite a JSON-lines file");
}
