//! `quotamesh health`: asks a node's HTTP endpoint (by default `/readyz` on the metrics
//! port) and exits 0 when it answers 200, 1 otherwise, printing the answer (or, with
//! `--json`, one JSON object). The container image runs it as its HEALTHCHECK: an image FROM
//! scratch has no shell or curl.

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
    /// Print one JSON object on stdout (`url`, `ready`, and `status` and `body`, or `error`)
    /// instead of the answer; the exit code is the same.
    #[arg(long)]
    pub json: bool,
}

/// Runs the probe: 0 when the URL answers 200, 1 otherwise (the reason on stderr, or in the
/// JSON object).
pub fn run(arguments: &HealthArgs) -> ExitCode {
    let timeout = Duration::from_millis(arguments.timeout_ms);
    if !arguments.json {
        return super::http_get::print_answer(&arguments.url, None, timeout);
    }
    let (ready, answer) = match super::http_get::get(&arguments.url, None, timeout) {
        Ok((status, body)) => (
            status == 200,
            serde_json::json!({
                "url": arguments.url, "ready": status == 200, "status": status, "body": body,
            }),
        ),
        Err(error) => (
            false,
            serde_json::json!({"url": arguments.url, "ready": false, "error": format!("{error:#}")}),
        ),
    };
    println!("{answer}");
    if ready { ExitCode::SUCCESS } else { ExitCode::FAILURE }
}
