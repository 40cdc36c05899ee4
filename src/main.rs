//! The `quotamesh` binary: parses the command line, sets up logging, dispatches.

use std::process::ExitCode;

use clap::Parser;
use quotamesh::cli::bench::BenchCommand;
use quotamesh::cli::{Cli, Command};

/// Runs the command; a failure is printed as one `error: ...` chain of causes (no
/// backtrace: it is for the operator, not a developer) and exits 1 (see the README's exit
/// codes).
fn main() -> ExitCode {
    match run() {
        Ok(code) => code,
        Err(error) => {
            eprintln!("error: {error:#}");
            ExitCode::from(quotamesh::cli::EXIT_FAILED)
        }
    }
}

fn run() -> anyhow::Result<ExitCode> {
    let cli = Cli::parse();
    quotamesh::logging::init(cli.log_format, cli.log_filter.as_deref());
    // Before any TLS object exists: ring is the only rustls provider compiled in.
    quotamesh::api::billing::tls::install_crypto_provider();
    match cli.command {
        Command::Policy(arguments) => runtime()?.block_on(quotamesh::cli::policy::run(arguments)),
        Command::Serve(arguments) => {
            runtime()?.block_on(quotamesh::cli::serve::run(arguments))?;
            Ok(ExitCode::SUCCESS)
        }
        Command::Rls(arguments) => {
            runtime()?.block_on(quotamesh::cli::rls::run(arguments))?;
            Ok(ExitCode::SUCCESS)
        }
        Command::Cluster(arguments) => {
            runtime()?.block_on(quotamesh::cli::cluster::run(arguments))?;
            Ok(ExitCode::SUCCESS)
        }
        Command::Billing(arguments) => runtime()?.block_on(quotamesh::cli::billing::run(arguments)),
        Command::Health(arguments) => Ok(quotamesh::cli::health::run(&arguments)),
        Command::Audit(arguments) => runtime()?.block_on(quotamesh::cli::audit::run(arguments)),
        Command::Bench(command) => {
            // The ceiling the RLS benchmarks compare with is a stock tonic server.
            let runtime = match command {
                BenchCommand::ConstantOk { .. } => stock_runtime()?,
                _ => runtime()?,
            };
            runtime.block_on(quotamesh::cli::bench::run(command))?;
            Ok(ExitCode::SUCCESS)
        }
    }
}

/// The multi-threaded runtime, without tokio's LIFO slot when built with
/// `--cfg tokio_unstable` (as `.cargo/config.toml` sets); `TOKIO_WORKER_THREADS` sets its
/// size (benchmarks pin it).
///
/// With the slot, a task woken by the running task runs next: each RLS stream that finishes
/// wakes its HTTP/2 connection, which then writes that one answer, a write per request.
/// Without it the connection runs after the other ready streams and writes their answers
/// together. Measured on one worker (README, Benchmarks): about a tenth of the kernel time
/// per request and 1.5 times the requests per core, with fewer stalled ledger calls in the
/// region's leasing tests on a busy machine.
fn runtime() -> std::io::Result<tokio::runtime::Runtime> {
    let mut builder = tokio::runtime::Builder::new_multi_thread();
    builder.enable_all();
    #[cfg(tokio_unstable)]
    builder.disable_lifo_slot();
    builder.build()
}

/// tokio's multi-threaded runtime as it ships.
fn stock_runtime() -> std::io::Result<tokio::runtime::Runtime> {
    tokio::runtime::Builder::new_multi_thread().enable_all().build()
}
