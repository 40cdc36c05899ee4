//! `quotamesh policy`: offline work on policy files (`validate`), and the policy a running
//! node serves (`get`, from its HTTP `/config`, with an operator token).

use std::path::PathBuf;
use std::process::ExitCode;

use clap::{Args, Subcommand};

use crate::core::policy::{LoadOptions, PolicyErrors, PolicySet};
use crate::core::rate::Algorithm;
use crate::policy_store::{PolicyLoadError, PolicyOrigin};

/// Options of `quotamesh policy`, accepted before or after the subcommand (`global`).
#[derive(Debug, Args)]
pub struct PolicyArgs {
    /// Print one JSON object on stdout: `validate`'s verdict (`ok`, and `files`, `rules`,
    /// `digest` or `errors`), or the node's policy (digest, rules, files) for `get`.
    #[arg(long, global = true)]
    pub json: bool,
    /// What to do.
    #[command(subcommand)]
    pub command: PolicyCommand,
}

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
    },
    /// Show the policy a running node serves: its digest and files (its HTTP `/config`, which
    /// needs an operator token, as the admin API's reads do, unless `admin.read_open`).
    Get {
        /// The node's metrics address (`--metrics-addr`).
        #[arg(long, default_value = "http://127.0.0.1:6070")]
        url: String,
        /// How long connecting and reading may take, in milliseconds.
        #[arg(long, default_value_t = 5000)]
        timeout_ms: u64,
        /// A file holding the operator token (else `QUOTAMESH_ADMIN_TOKEN`).
        #[arg(long)]
        admin_token_file: Option<PathBuf>,
    },
}

/// Runs a policy subcommand; the exit code is non-zero when a policy is invalid, or when the
/// node does not show its policy.
///
/// # Errors
/// An operator token file that cannot be read.
pub fn run(arguments: PolicyArgs) -> anyhow::Result<ExitCode> {
    let json = arguments.json;
    match arguments.command {
        PolicyCommand::Validate { paths, merge_domains, default_algorithm } => {
            let options = LoadOptions {
                merge_domains,
                default_algorithm: default_algorithm.unwrap_or_default(),
            };
            Ok(validate(&paths, options, json))
        }
        PolicyCommand::Get { url, timeout_ms, admin_token_file } => {
            let token = crate::cli::cluster::operator_token(admin_token_file.as_deref())?;
            let url = format!(
                "{}/config{}",
                url.trim_end_matches('/'),
                if json { "?format=json" } else { "" }
            );
            let timeout = std::time::Duration::from_millis(timeout_ms);
            Ok(super::http_get::print_answer(&url, token.as_deref(), timeout))
        }
    }
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
