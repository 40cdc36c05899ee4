//! `quotamesh policy`: offline work on policy files.

use std::path::PathBuf;
use std::process::ExitCode;

use clap::Subcommand;

use crate::core::policy::{LoadOptions, PolicyErrors, PolicySet};
use crate::core::rate::Algorithm;
use crate::policy_store::{PolicyLoadError, PolicyOrigin};

/// Policy subcommands.
#[derive(Debug, Subcommand)]
pub enum PolicyCommand {
    /// Check policy files (or directories of them); print every error as file:line:column.
    Validate {
        /// Files or directories to check together (a domain may appear in one file only,
        /// unless `--merge-domains`).
        #[arg(required = true)]
        paths: Vec<PathBuf>,
        /// Merge a domain declared in several files, as `[policy] merge_domains = true`.
        #[arg(long)]
        merge_domains: bool,
        /// The algorithm of limits that name none, as `[policy] default_algorithm`
        /// (the digest printed depends on it).
        #[arg(long, value_parser = crate::cli::serve::parse_algorithm)]
        default_algorithm: Option<Algorithm>,
        /// Print one JSON object on stdout (`ok`, and `files`, `rules`, `digest` or `errors`).
        #[arg(long)]
        json: bool,
    },
    /// Show the policy a running node serves: its digest and files (its HTTP `/config`).
    Get {
        /// The node's metrics address (`--metrics-addr`).
        #[arg(long, default_value = "http://127.0.0.1:6070")]
        url: String,
        /// How long connecting and reading may take, in milliseconds.
        #[arg(long, default_value_t = 5000)]
        timeout_ms: u64,
        /// Print the node's JSON (digest, rules, files) instead of the files.
        #[arg(long)]
        json: bool,
    },
}

/// Runs a policy subcommand; the exit code is non-zero when a policy is invalid.
pub fn run(command: PolicyCommand) -> ExitCode {
    match command {
        PolicyCommand::Validate { paths, merge_domains, default_algorithm, json } => {
            let options = LoadOptions {
                merge_domains,
                default_algorithm: default_algorithm.unwrap_or_default(),
            };
            validate(&paths, options, json)
        }
        PolicyCommand::Get { url, timeout_ms, json } => get(&url, timeout_ms, json),
    }
}

fn get(url: &str, timeout_ms: u64, json: bool) -> ExitCode {
    let url =
        format!("{}/config{}", url.trim_end_matches('/'), if json { "?format=json" } else { "" });
    super::http_get::print_answer(&url, std::time::Duration::from_millis(timeout_ms))
}

fn validate(paths: &[PathBuf], options: LoadOptions, json: bool) -> ExitCode {
    let mut sources = Vec::new();
    let mut errors = Vec::new();
    let mut read_errors = Vec::new();
    for path in paths {
        match PolicyOrigin::Path(path.clone()).read_sources() {
            Ok(read) => sources.extend(read),
            Err(error) => read_errors.push(read_error(&error)),
        }
    }
    match PolicySet::parse_with(&sources, options) {
        Ok(policy) if read_errors.is_empty() => {
            let rules = policy.rules().count();
            let digest = format!("{:016x}", policy.digest());
            if json {
                let answer = serde_json::json!({
                    "ok": true, "files": sources.len(), "rules": rules, "digest": digest,
                });
                println!("{answer}");
            } else {
                println!("ok: {} file(s), {rules} rule(s), digest {digest}", sources.len());
            }
            return ExitCode::SUCCESS;
        }
        Ok(_) => {}
        Err(PolicyErrors(parse_errors)) => errors.extend(parse_errors),
    }
    if json {
        let all: Vec<String> =
            read_errors.iter().cloned().chain(errors.iter().map(ToString::to_string)).collect();
        println!("{}", serde_json::json!({ "ok": false, "errors": all }));
        return ExitCode::FAILURE;
    }
    for error in &read_errors {
        eprintln!("{error}");
    }
    for error in &errors {
        eprintln!("{error}");
    }
    eprintln!("{} error(s)", read_errors.len() + errors.len());
    ExitCode::FAILURE
}

/// A file that could not be read: the error names the path itself, so no `file:0:0:` prefix.
fn read_error(error: &PolicyLoadError) -> String {
    error.to_string()
}
