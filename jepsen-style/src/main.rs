//! The `quotamesh-jepsen` command line: `run` (a seeded run against fresh nodes), `check`
//! (the checkers again on a saved run) and `report` (a saved run's summary). Exit code 0 for
//! a valid verdict, 1 for an invalid one, 2 when the run cannot be judged.

use std::path::PathBuf;
use std::process::ExitCode;
use std::time::Duration;

use anyhow::Context;
use clap::{Args, Parser, Subcommand};
use quotamesh_jepsen::checker::availability::{THRESHOLDS_DEFAULT, Thresholds};
use quotamesh_jepsen::nemesis::FaultKind;
use quotamesh_jepsen::run::{self, RunOptions, WorkloadKind};
use quotamesh_jepsen::topology::Topology;
use quotamesh_jepsen::workload::Pacing;

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

/// What a run is: the cluster, the workload, the faults and the seed.
#[derive(Args)]
struct RunArgs {
    /// Where the nodes run: `local` (processes on loopback), `netns` (a network namespace
    /// each, on a bridge; needs root; allows partitions) or `docker` (a container each of
    /// `--image`; kill, pause and partition only).
    #[arg(long, default_value = "local", value_parser = ["local", "netns", "docker"])]
    topology: String,
    /// Voters: members of both Raft groups.
    #[arg(long, default_value_t = 3, value_parser = clap::value_parser!(u64).range(1..=9))]
    nodes: u64,
    /// Gateways besides the voters (`role = "gateway"`: they serve RLS and lease through
    /// the voters, no replica, no vote); the `rls` and `leases` workloads send to them too.
    #[arg(long, default_value_t = 0, value_parser = clap::value_parser!(u64).range(0..=4))]
    gateways: u64,
    /// The workload: `bank` (transfers and reads on the billing API), `linear` (the same on
    /// two accounts, half reads: for the linearizability search), `holds` (reserves with
    /// short TTLs, captured, voided or left to expire), `rls` (hits on an open and a
    /// closed rule through the Rate Limit Service) or `leases` (lease grants through the
    /// admin API, held to the bucket's capacity and refill).
    #[arg(long, default_value = "bank", value_parser = ["bank", "linear", "holds", "rls", "leases"])]
    workload: String,
    /// Faults, comma-separated: `kill`, `pause`, `partition`, `partition-one-way`,
    /// `partition-flap`, `majorities-ring` (netns; `partition` on docker too), `clock`,
    /// `clock-step` (libfaketime), `policy`, `membership`, `disk` (root); `none` for a
    /// fault-free baseline.
    #[arg(long, default_value = "kill,pause")]
    nemesis: String,
    /// How long the workload runs, e.g. `60s`, `2m`, `1500ms`.
    #[arg(long, default_value = "60s", value_parser = parse_duration)]
    time_limit: Duration,
    /// Operations per second, over all clients.
    #[arg(long, default_value_t = 200)]
    rate: u64,
    /// Fixes every planned operation and fault (the first run's, for `soak`).
    #[arg(long, default_value_t = 42)]
    seed: u64,
    /// Runs are written to a new directory under this one.
    #[arg(long, default_value = "runs")]
    out: PathBuf,
    /// The availability check: every node answers `ok` within this long after each heal
    /// (default 15s).
    #[arg(long, value_parser = parse_duration)]
    recovery_max: Option<Duration>,
    /// The availability check: at least this percentage of the operations outside faults
    /// (and the recovery time after each) are `ok` (default 90).
    #[arg(long, value_parser = clap::value_parser!(u64).range(0..=100))]
    quiet_ok_min: Option<u64>,
    /// The quotamesh binary to run.
    #[arg(long, env = "QUOTAMESH_BIN", default_value = "target/release/quotamesh")]
    binary: PathBuf,
    /// The node image of `--topology docker`, built from the same binary by
    /// `cluster/build-image.sh`.
    #[arg(long, env = "QUOTAMESH_IMAGE", default_value = run::IMAGE_DEFAULT)]
    image: String,
}

impl RunArgs {
    fn options(&self) -> anyhow::Result<RunOptions> {
        let nemeses = if self.nemesis.trim() == "none" {
            Vec::new()
        } else {
            self.nemesis
                .split(',')
                .map(FaultKind::parse)
                .collect::<Result<Vec<_>, _>>()
                .map_err(anyhow::Error::msg)?
        };
        let topology = Topology::parse(&self.topology).map_err(anyhow::Error::msg)?;
        match topology {
            Topology::Local => anyhow::ensure!(
                !nemeses.iter().any(|kind| kind.is_partition()),
                "partitions need --topology netns or docker"
            ),
            Topology::Netns => {}
            // What the docker CLI can do to a container as a whole.
            Topology::Docker => anyhow::ensure!(
                nemeses.iter().all(|kind| {
                    matches!(kind, FaultKind::Kill | FaultKind::Pause | FaultKind::Partition)
                }),
                "--topology docker carries out kill, pause and partition only (docker kill, \
                 docker pause, docker network disconnect)"
            ),
        }
        Ok(RunOptions {
            topology,
            pacing: Pacing::new(
                usize::try_from(self.nodes)?,
                self.rate,
                u64::try_from(self.time_limit.as_millis())?,
            ),
            gateways: usize::try_from(self.gateways)?,
            workload: WorkloadKind::parse(&self.workload).map_err(anyhow::Error::msg)?,
            nemeses,
            seed: self.seed,
            binary: self.binary.clone(),
            image: self.image.clone(),
            availability: Thresholds {
                recovery_ms_max: match self.recovery_max {
                    Some(recovery_max) => u64::try_from(recovery_max.as_millis())?,
                    None => THRESHOLDS_DEFAULT.recovery_ms_max,
                },
                quiet_ok_permille_min: self
                    .quiet_ok_min
                    .map_or(THRESHOLDS_DEFAULT.quiet_ok_permille_min, |percent| percent * 10),
            },
        })
    }
}

#[derive(Subcommand)]
enum Command {
    /// Starts a region, runs a seeded workload under seeded faults, checks the history.
    Run(RunArgs),
    /// Runs again and again, one seed after the other (`--seed`, `--seed` + 1, ...), each on
    /// a fresh region; prints the summary of the out directory. Exit code: the worst verdict.
    Soak {
        #[command(flatten)]
        run: RunArgs,
        /// How many runs.
        #[arg(long, default_value_t = 10)]
        runs: u64,
    },
    /// Runs the checkers again on a saved run; rewrites its verdict and report.
    Check { directory: PathBuf },
    /// Prints a saved run's report (Markdown); given a directory of runs, a table of them.
    Report {
        directory: PathBuf,
        /// Writes the run's page with plots (`report.html` in its directory) and prints its
        /// path instead.
        #[arg(long)]
        html: bool,
    },
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
        Command::Run(arguments) => {
            let runtime = tokio::runtime::Runtime::new().context("start the async runtime")?;
            let (directory, verdict) =
                runtime.block_on(run::run(arguments.options()?, &arguments.out))?;
            print!("{}", std::fs::read_to_string(directory.join("report.md")).unwrap_or_default());
            println!("\nrun directory: {}", directory.display());
            Ok(verdict.exit_code())
        }
        Command::Soak { run: arguments, runs } => {
            let runtime = tokio::runtime::Runtime::new().context("start the async runtime")?;
            let mut worst = 0;
            for number in 0..runs {
                let mut options = arguments.options()?;
                options.seed = options.seed.saturating_add(number);
                let seed = options.seed;
                let (directory, verdict) = runtime.block_on(run::run(options, &arguments.out))?;
                println!("seed {seed}: {:?} ({})", verdict.validity, directory.display());
                // Invalid (1) outranks unknown (2): a violation is what a soak looks for.
                worst = match (worst, verdict.exit_code()) {
                    (1, _) | (_, 1) => 1,
                    (current, code) => current.max(code),
                };
            }
            print!("{}", quotamesh_jepsen::report::render_summary(&arguments.out)?);
            Ok(worst)
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
        Command::Report { directory, html: true } => {
            let path = directory.join("report.html");
            std::fs::write(&path, quotamesh_jepsen::html::render(&directory)?)
                .with_context(|| format!("write {}", path.display()))?;
            println!("{}", path.display());
            Ok(0)
        }
        Command::Report { directory, html: false } => {
            if directory.join("run.json").is_file() {
                print!("{}", quotamesh_jepsen::report::render(&directory)?);
            } else {
                print!("{}", quotamesh_jepsen::report::render_summary(&directory)?);
            }
            Ok(0)
        }
    }
}
