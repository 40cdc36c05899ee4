//! `quotamesh health`: asks a node's HTTP endpoint (by default `/readyz` on the metrics
//! port) and exits 0 when it answers 200, 1 otherwise, printing the answer. The container
//! image runs it as its HEALTHCHECK: an image FROM scratch has no shell or curl.

use std::process::ExitCode;
use std::time::Duration;

use clap::Args;

/// Options of `quotamesh health`.
#[derive(Debug, Args)]
pub struct HealthArgs {
    /// The URL to ask (`/healthz` for liveness only).
    #[arg(long, default_value = "http://127.0.0.1:6070/readyz")]
    pub url: String,
    /// How long connecting and reading the answer may take, in milliseconds.
    #[arg(long, default_value_t = 2000)]
    pub timeout_ms: u64,
}

/// Runs the probe: 0 when the URL answers 200, 1 otherwise (the reason on stderr).
pub fn run(arguments: &HealthArgs) -> ExitCode {
    super::http_get::print_answer(&arguments.url, Duration::from_millis(arguments.timeout_ms))
}
