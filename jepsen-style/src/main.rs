//! The `quotamesh-jepsen` command line: `run` (a seeded run against fresh nodes), `check`
//! (the checkers again on a saved run) and `report` (a saved run's summary). Exit code 0 for
//! a valid verdict, 1 for an invalid one, 2 when the run cannot be judged.

use std::path::PathBuf;
use std::process::ExitCode;
use std::time::Duration;

use anyhow::Context;
use clap::{Parser, Subcommand};
use quotamesh_jepsen::nemesis::FaultKind;
use quotamesh_jepsen::run::{self, RunOptions, WorkloadKind};
use quotamesh_jepsen::topology::Topology;

#[derive(Parser)]
#[command(
    name = "quotamesh-jepsen",
    version,
    about = "Fault injection against quotamesh nodes: histories, nemeses, checkers"
)]
struct Cli {
    #[command(subcommand)]
    command: Command,
}

#[derive(Subcommand)]
enum Command {
    /// Starts a region, runs a seeded workload under seeded faults, checks the history.
    Run {
        /// Where the nodes run: `local` (processes on loopback) or `netns` (a network
        /// namespace each, on a bridge; needs root; allows partitions).
        #[arg(long, default_value = "local", value_parser = ["local", "netns"])]
        topology: String,
        #[arg(long, default_value_t = 3, value_parser = clap::value_parser!(u64).range(1..=9))]
        nodes: u64,
        /// The workload: `bank` (transfers and reads on the billing API) or `rls` (hits on an
        /// open and a closed rule through the Rate Limit Service).
        #[arg(long, default_value = "bank", value_parser = ["bank", "rls"])]
        workload: String,
        /// Faults, comma-separated: `kill`, `pause`, `partition` (netns only), `clock`
        /// (libfaketime); `none` for a fault-free baseline.
        #[arg(long, default_value = "kill,pause")]
        nemesis: String,
        /// How long the workload runs, e.g. `60s`, `2m`, `1500ms`.
        #[arg(long, default_value = "60s", value_parser = parse_duration)]
        time_limit: Duration,
        /// Operations per second, over all clients.
        #[arg(long, default_value_t = 200)]
        rate: u64,
        /// Fixes every planned operation and fault.
        #[arg(long, default_value_t = 42)]
        seed: u64,
        /// Runs are written to a new directory under this one.
        #[arg(long, default_value = "runs")]
        out: PathBuf,
        /// The quotamesh binary to run.
        #[arg(long, env = "QUOTAMESH_BIN", default_value = "target/release/quotamesh")]
        binary: PathBuf,
    },
    /// Runs the checkers again on a saved run; rewrites its verdict and report.
    Check { directory: PathBuf },
    /// Prints a saved run's report (Markdown).
    Report { directory: PathBuf },
}

fn parse_duration(text: &str) -> Result<Duration, String> {
    let text = text.trim();
    let (number, unit_ms) = if let Some(number) = text.strip_suffix("ms") {
        (number, 1)
    } else if let Some(number) = text.strip_suffix('s') {
        (number, 1_000)
    } else if let Some(number) = text.strip_suffix('m') {
        (number, 60_000)
    } else if let Some(number) = text.strip_suffix('h') {
        (number, 3_600_000)
    } else {
        return Err(format!("{text:?}: give a unit (ms, s, m, h)"));
    };
    let count: u64 = number.trim().parse().map_err(|error| format!("{text:?}: {error}"))?;
    count
        .checked_mul(unit_ms)
        .map(Duration::from_millis)
        .ok_or_else(|| format!("{text:?} is too long"))
}

fn main() -> ExitCode {
    match run_command(Cli::parse().command) {
        Ok(code) => ExitCode::from(code),
        Err(error) => {
            eprintln!("quotamesh-jepsen: {error:#}");
            ExitCode::from(2)
        }
    }
}

fn run_command(command: Command) -> anyhow::Result<u8> {
    match command {
        Command::Run {
            topology,
            nodes,
            workload,
            nemesis,
            time_limit,
            rate,
            seed,
            out,
            binary,
        } => {
            let nemeses = if nemesis.trim() == "none" {
                Vec::new()
            } else {
                nemesis
                    .split(',')
                    .map(FaultKind::parse)
                    .collect::<Result<Vec<_>, _>>()
                    .map_err(anyhow::Error::msg)?
            };
            let topology = Topology::parse(&topology).map_err(anyhow::Error::msg)?;
            anyhow::ensure!(
                topology == Topology::Netns || !nemeses.contains(&FaultKind::Partition),
                "partitions need --topology netns"
            );
            let options = RunOptions {
                topology,
                nodes: usize::try_from(nodes)?,
                workload: WorkloadKind::parse(&workload).map_err(anyhow::Error::msg)?,
                nemeses,
                time_limit_ms: u64::try_from(time_limit.as_millis())?,
                rate_per_second: rate,
                seed,
                binary,
            };
            let runtime = tokio::runtime::Runtime::new().context("start the async runtime")?;
            let (directory, verdict) = runtime.block_on(run::run(options, &out))?;
            print!("{}", std::fs::read_to_string(directory.join("report.md")).unwrap_or_default());
            println!("\nrun directory: {}", directory.display());
            Ok(verdict.exit_code())
        }
        Command::Check { directory } => {
            let verdict = run::check_directory(&directory)?;
            run::write_verdict(&directory, &verdict)?;
            for check in &verdict.checks {
                println!(
                    "{:<14} {:?} ({} checked, {} problems)",
                    check.name, check.validity, check.checked, check.problem_count
                );
            }
            println!("verdict: {:?}", verdict.validity);
            Ok(verdict.exit_code())
        }
        Command::Report { directory } => {
            print!("{}", quotamesh_jepsen::report::render(&directory)?);
            Ok(0)
        }
    }
}
