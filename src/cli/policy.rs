//! `quotamesh policy`: offline work on policy files.

use std::path::PathBuf;
use std::process::ExitCode;

use clap::Subcommand;

use crate::core::policy::{LoadOptions, PolicyError, PolicyErrors, PolicySet};
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
    },
}

/// Runs a policy subcommand; the exit code is non-zero when a policy is invalid.
pub fn run(command: PolicyCommand) -> ExitCode {
    match command {
        PolicyCommand::Validate { paths, merge_domains, default_algorithm } => {
            let options = LoadOptions {
                merge_domains,
                default_algorithm: default_algorithm.unwrap_or_default(),
            };
            validate(&paths, options)
        }
    }
}

fn validate(paths: &[PathBuf], options: LoadOptions) -> ExitCode {
    let mut sources = Vec::new();
    let mut errors = Vec::new();
    for path in paths {
        match PolicyOrigin::Path(path.clone()).read_sources() {
            Ok(read) => sources.extend(read),
            Err(error) => errors.push(read_error(path, &error)),
        }
    }
    match PolicySet::parse_with(&sources, options) {
        Ok(policy) if errors.is_empty() => {
            let rules = policy.rules().count();
            println!(
                "ok: {} file(s), {rules} rule(s), digest {:016x}",
                sources.len(),
                policy.digest()
            );
            return ExitCode::SUCCESS;
        }
        Ok(_) => {}
        Err(PolicyErrors(parse_errors)) => errors.extend(parse_errors),
    }
    for error in &errors {
        eprintln!("{error}");
    }
    eprintln!("{} error(s)", errors.len());
    ExitCode::FAILURE
}

/// A file that could not be read is reported like a parse error, at line 0.
fn read_error(path: &std::path::Path, error: &PolicyLoadError) -> PolicyError {
    PolicyError { file: path.display().to_string(), line: 0, column: 0, reason: error.to_string() }
}
