//! The `quotamesh` binary: parses the command line, sets up logging, dispatches.

use std::process::ExitCode;

use clap::Parser;
use quotamesh::cli::{Cli, Command, LogFormat};

fn main() -> anyhow::Result<ExitCode> {
    let cli = Cli::parse();
    init_tracing(cli.log_format);
    // Before any TLS object exists: ring is the only rustls provider compiled in.
    quotamesh::api::billing::tls::install_crypto_provider();
    match cli.command {
        Command::Policy(command) => Ok(quotamesh::cli::policy::run(command)),
        Command::Serve(arguments) => {
            runtime()?.block_on(quotamesh::cli::serve::run(arguments))?;
            Ok(ExitCode::SUCCESS)
        }
        Command::Rls(command) => {
            runtime()?.block_on(quotamesh::cli::rls::run(command))?;
            Ok(ExitCode::SUCCESS)
        }
        Command::Cluster(command) => {
            runtime()?.block_on(quotamesh::cli::cluster::run(command))?;
            Ok(ExitCode::SUCCESS)
        }
        Command::Billing(arguments) => runtime()?.block_on(quotamesh::cli::billing::run(arguments)),
        Command::Bench(command) => {
            runtime()?.block_on(quotamesh::cli::bench::run(command))?;
            Ok(ExitCode::SUCCESS)
        }
    }
}

/// The multi-threaded runtime; `TOKIO_WORKER_THREADS` sets its size (benchmarks pin it).
fn runtime() -> std::io::Result<tokio::runtime::Runtime> {
    tokio::runtime::Builder::new_multi_thread().enable_all().build()
}

fn init_tracing(format: LogFormat) {
    let filter = tracing_subscriber::EnvFilter::try_from_default_env()
        .unwrap_or_else(|_| tracing_subscriber::EnvFilter::new("info"));
    let builder = tracing_subscriber::fmt().with_env_filter(filter).with_writer(std::io::stderr);
    match format {
        LogFormat::Text => builder.init(),
        LogFormat::Json => builder.json().init(),
    }
}
