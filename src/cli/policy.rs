//! `quotamesh policy`: offline work on policy files (`validate`), the policy a running node
//! serves (`get`, from its HTTP `/config`, with an operator token), the region's replicated
//! policy versions through the admin gRPC API (`apply`, `history`, `rollback`, `get
//! --version`), and what its shadow rules would have refused (`shadow-report`, from the
//! nodes' events files).
//!
//! `apply` validates the files exactly as `validate` does (the same errors, file:line:column,
//! and nothing is sent when one is found); the node validates them again with its `[policy]`
//! options before it commits them (`crate::api::admin`).

use std::path::PathBuf;
use std::process::ExitCode;

use clap::{Args, Subcommand};

use anyhow::Context;

use crate::api::proto::quotamesh::admin::v1 as proto;
use crate::cli::cluster::{Target, connect, first_address, rpc_error, with_deadline};
use crate::core::policy::diff::RuleChange;
use crate::core::policy::{LoadOptions, PolicyErrors, PolicySet, PolicySource, parse_duration_ms};
use crate::core::rate::Algorithm;
use crate::core::rfc3339::format_epoch_ms;
use crate::core::shadow_report::{ShadowEvent, summarize};
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

/// The node whose served policy (its HTTP `/config`) a command reads.
#[derive(Debug, Args)]
pub struct NodeConfig {
    /// The node's metrics address (`--metrics-addr`).
    #[arg(long, default_value = "http://127.0.0.1:6070")]
    pub url: String,
    /// How long connecting and reading may take, in milliseconds.
    #[arg(long, default_value_t = 5000)]
    pub timeout_ms: u64,
    /// A file holding the operator token (else `QUOTAMESH_ADMIN_TOKEN`).
    #[arg(long)]
    pub admin_token_file: Option<PathBuf>,
}

/// The admin gRPC API of a voter, for the commands on the region's replicated versions.
#[derive(Debug, Args)]
pub struct AdminTarget {
    /// Admin gRPC address of a voter, `host:port` or `http://host:port`.
    #[arg(long, default_value = "127.0.0.1:8083")]
    pub admin_addr: String,
    /// How to reach an admin port served with `admin.tls`.
    #[command(flatten)]
    pub tls: AdminTls,
}

/// TLS to an admin port served with `admin.tls`, as `quotamesh cluster` takes it.
#[derive(Debug, Args)]
pub struct AdminTls {
    /// The cluster's CA certificate: talk TLS to the admin port.
    #[arg(long)]
    pub ca_cert: Option<PathBuf>,
    /// An operator certificate (`quotamesh cluster certs issue-operator`), instead of a token.
    #[arg(long, requires = "client_key")]
    pub client_cert: Option<PathBuf>,
    /// The operator certificate's key.
    #[arg(long, requires = "client_cert")]
    pub client_key: Option<PathBuf>,
}

/// Options of the admin calls: where, how long, with which token.
#[derive(Debug, Args)]
pub struct AdminCall {
    /// Which voter.
    #[command(flatten)]
    pub target: AdminTarget,
    /// Deadline of the call, in milliseconds.
    #[arg(long, default_value_t = 10_000)]
    pub timeout_ms: u64,
    /// A file holding the operator token (else `QUOTAMESH_ADMIN_TOKEN`).
    #[arg(long)]
    pub admin_token_file: Option<PathBuf>,
}

impl AdminCall {
    fn target(self) -> anyhow::Result<Target> {
        Target::single(
            self.target.admin_addr,
            self.timeout_ms,
            self.admin_token_file,
            &self.target.tls,
        )
    }
}

impl NodeConfig {
    /// The operator token and the timeout.
    fn access(&self) -> anyhow::Result<(Option<String>, std::time::Duration)> {
        let token = crate::cli::cluster::operator_token(self.admin_token_file.as_deref())?;
        Ok((token, std::time::Duration::from_millis(self.timeout_ms)))
    }
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
    /// Show the policy a running node serves: its digest, version, source (local or
    /// replicated) and files (its HTTP `/config`, which needs an operator token, as the admin
    /// API's reads do, unless `admin.read_open`); with `--version N`, version N of the
    /// region's replicated set instead (from the admin API at `--admin-addr`).
    Get {
        /// Which node, and how to ask it.
        #[command(flatten)]
        node: NodeConfig,
        /// A version of the region's replicated set (`policy history` lists them).
        #[arg(long)]
        version: Option<u64>,
        /// The voter whose admin API `--version` reads.
        #[command(flatten)]
        admin: AdminTarget,
    },
    /// Validate files exactly as `validate` does, then commit them as the region's next
    /// policy version through a voter's admin API; every node of the region (gateways too)
    /// then serves it, unless it runs with its own `--policy`. The same rules as the current
    /// version (same digest) make no new version.
    Apply {
        /// Files or directories, as `validate` takes them.
        #[arg(required = true)]
        paths: Vec<PathBuf>,
        /// Why, for `policy history`.
        #[arg(long, default_value = "")]
        message: String,
        /// Merge a domain declared in several files, as `[policy] merge_domains = true`.
        #[arg(long)]
        merge_domains: bool,
        /// The algorithm of limits that name none, as `[policy] default_algorithm`.
        #[arg(long, value_parser = crate::cli::serve::parse_algorithm)]
        default_algorithm: Option<Algorithm>,
        /// Which voter, and how to call it.
        #[command(flatten)]
        call: AdminCall,
    },
    /// List the region's policy versions, newest first: number, digest, time, operator,
    /// message, and whether its files are still kept for a rollback.
    History {
        /// Most versions listed.
        #[arg(long, default_value_t = 20)]
        limit: u32,
        /// Which voter, and how to call it.
        #[command(flatten)]
        call: AdminCall,
    },
    /// Make an earlier version's files the region's policy again, as a new version.
    Rollback {
        /// The version to go back to.
        #[arg(long = "to")]
        to_version: u64,
        /// Why, for `policy history`.
        #[arg(long, default_value = "")]
        message: String,
        /// Which voter, and how to call it.
        #[command(flatten)]
        call: AdminCall,
    },
    /// Show rule by rule what applying these files would change against the policy a node
    /// serves (its `/config`); exit 0 when nothing, 1 when something, 2 when the two could
    /// not be compared (for CI pipelines).
    Diff {
        /// Files or directories, as `validate` takes them.
        #[arg(required = true)]
        paths: Vec<PathBuf>,
        /// Which node, and how to ask it.
        #[command(flatten)]
        node: NodeConfig,
    },
    /// Sum the would-be rejections of shadow rules per rule, from the nodes' events files
    /// (`[policy] shadow_events_file`): the false-positive review before enforcing.
    ShadowReport {
        /// Events files (JSON lines; a rotated `FILE.1` too), of one node or several.
        #[arg(required = true)]
        events: Vec<PathBuf>,
        /// The period to sum, back from now (`7d`, `24h`, `30m`).
        #[arg(long, default_value = "7d")]
        since: String,
        /// Descriptors listed per rule, most blocked first.
        #[arg(long, default_value_t = 5)]
        top: usize,
    },
}

/// Runs a policy subcommand; the exit code is non-zero when a policy is invalid, or when the
/// node does not show its policy.
///
/// # Errors
/// An operator token file that cannot be read; an admin call refused or unanswered.
pub async fn run(arguments: PolicyArgs) -> anyhow::Result<ExitCode> {
    let json = arguments.json;
    match arguments.command {
        PolicyCommand::Validate { paths, merge_domains, default_algorithm } => {
            let options = LoadOptions {
                merge_domains,
                default_algorithm: default_algorithm.unwrap_or_default(),
            };
            Ok(report_validation(&load(&paths, options), json))
        }
        PolicyCommand::Apply { paths, message, merge_domains, default_algorithm, call } => {
            let options = LoadOptions {
                merge_domains,
                default_algorithm: default_algorithm.unwrap_or_default(),
            };
            let loaded = load(&paths, options);
            if !loaded.is_valid() {
                return Ok(report_validation(&loaded, json));
            }
            apply(loaded.sources, message, call.target()?, json).await
        }
        PolicyCommand::History { limit, call } => history(limit, &call.target()?, json).await,
        PolicyCommand::Rollback { to_version, message, call } => {
            let target = call.target()?;
            let mut client = connect(first_address(&target)?, &target).await?;
            let request = proto::RollbackPolicyRequest { to_version, message };
            let reply =
                client.rollback_policy(with_deadline(request, &target)).await.map_err(rpc_error)?;
            print_applied(&reply.into_inner(), json);
            Ok(ExitCode::SUCCESS)
        }
        PolicyCommand::Get { node, version: Some(version), admin } => {
            let target = Target::single(
                admin.admin_addr,
                node.timeout_ms,
                node.admin_token_file,
                &admin.tls,
            )?;
            get_version(version, &target, json).await
        }
        PolicyCommand::Get { node, version: None, .. } => {
            let (token, timeout) = node.access()?;
            let url = format!(
                "{}/config{}",
                node.url.trim_end_matches('/'),
                if json { "?format=json" } else { "" }
            );
            Ok(super::http_get::print_answer(&url, token.as_deref(), timeout))
        }
        PolicyCommand::Diff { paths, node } => {
            let (token, timeout) = node.access()?;
            Ok(diff(&paths, &node.url, token.as_deref(), timeout, json))
        }
        PolicyCommand::ShadowReport { events, since, top } => {
            let since_ms = parse_duration_ms(&since)
                .map_err(|error| anyhow::anyhow!("--since {since:?}: {error}"))?;
            shadow_report(&events, since_ms, top, json)
        }
    }
}

/// Exit code of `policy diff` when the two policies could not be compared, as diff(1).
const EXIT_DIFF_TROUBLE: u8 = 2;

/// `policy diff`: the local files against the node's served policy.
fn diff(
    paths: &[PathBuf],
    url: &str,
    token: Option<&str>,
    timeout: std::time::Duration,
    json: bool,
) -> ExitCode {
    let compared = served_policy(url, token, timeout).and_then(|served| {
        let options = served.1;
        let mut sources = Vec::new();
        for path in paths {
            sources.extend(PolicyOrigin::Path(path.clone()).read_sources()?);
        }
        let local = PolicySet::parse_with(&sources, options)
            .map_err(|errors| anyhow::anyhow!("the files do not load:\n{errors}"))?;
        Ok(crate::core::policy::diff::diff(&served.0, &local))
    });
    let changes = match compared {
        Ok(changes) => changes,
        Err(error) => {
            eprintln!("error: {error:#}");
            return ExitCode::from(EXIT_DIFF_TROUBLE);
        }
    };
    if json {
        let listed: Vec<serde_json::Value> = changes
            .iter()
            .map(|change| match change {
                RuleChange::Added { rule, now } => {
                    serde_json::json!({"rule": rule, "change": "added", "now": now})
                }
                RuleChange::Removed { rule, was } => {
                    serde_json::json!({"rule": rule, "change": "removed", "was": was})
                }
                RuleChange::Changed { rule, was, now } => {
                    serde_json::json!({"rule": rule, "change": "changed", "was": was, "now": now})
                }
            })
            .collect();
        println!("{}", serde_json::json!({"same": changes.is_empty(), "changes": listed}));
    } else {
        for change in &changes {
            match change {
                RuleChange::Added { rule, now } => println!("+ {rule}: {now}"),
                RuleChange::Removed { rule, was } => println!("- {rule}: {was}"),
                RuleChange::Changed { rule, was, now } => {
                    println!("~ {rule}\n    was: {was}\n    now: {now}");
                }
            }
        }
        match changes.len() {
            0 => println!("no changes: the node serves these rules"),
            count => println!("{count} rule(s) would change"),
        }
    }
    if changes.is_empty() { ExitCode::SUCCESS } else { ExitCode::FAILURE }
}

/// The policy the node at `url` (its metrics address) serves, from its
/// `/config?format=json`, parsed with the options the node read it with (also returned).
///
/// # Errors
/// The node unreachable or refusing (no operator token), an answer that is not the node's
/// policy, or files that do not load here.
pub fn served_policy(
    url: &str,
    token: Option<&str>,
    timeout: std::time::Duration,
) -> anyhow::Result<(PolicySet, LoadOptions)> {
    let url = format!("{}/config?format=json", url.trim_end_matches('/'));
    let (status, body) = super::http_get::get(&url, token, timeout)?;
    anyhow::ensure!(status == 200, "{url} answered {status}: {}", body.trim());
    let config: serde_json::Value = serde_json::from_str(&body).context("/config is not JSON")?;
    let files = config["files"].as_array().context("/config has no files")?;
    let sources = files
        .iter()
        .map(|file| {
            Some(PolicySource {
                name: file["name"].as_str()?.to_owned(),
                text: file["text"].as_str()?.to_owned(),
            })
        })
        .collect::<Option<Vec<_>>>()
        .context("/config files need a name and a text")?;
    let default_algorithm = serde_json::from_value(config["default_algorithm"].clone())
        .context("/config has no default_algorithm")?;
    let merge_domains =
        config["merge_domains"].as_bool().context("/config has no merge_domains")?;
    let options = LoadOptions { merge_domains, default_algorithm };
    let policy = PolicySet::parse_with(&sources, options)
        .map_err(|errors| anyhow::anyhow!("the served policy does not load here:\n{errors}"))?;
    Ok((policy, options))
}

/// Longest events line read; a longer one is skipped as not an event.
const EVENT_LINE_BYTES_MAX: usize = 1024 * 1024;

/// `policy shadow-report`: reads every file, sums, prints.
fn shadow_report(
    files: &[PathBuf],
    since_ms: u64,
    top: usize,
    json: bool,
) -> anyhow::Result<ExitCode> {
    use std::io::BufRead;
    let now_ms = crate::clock::now_ms();
    let mut events = Vec::new();
    let mut skipped = 0_u64;
    for path in files {
        let file = std::fs::File::open(path)
            .with_context(|| format!("cannot read the events file {}", path.display()))?;
        for line in std::io::BufReader::new(file).split(b'\n') {
            let line = line.with_context(|| format!("reading {}", path.display()))?;
            let event = (line.len() <= EVENT_LINE_BYTES_MAX)
                .then(|| serde_json::from_slice::<ShadowEvent>(&line).ok())
                .flatten();
            match event {
                Some(event) => events.push(event),
                None if line.is_empty() => {}
                None => skipped += 1,
            }
        }
    }
    let report = summarize(events, now_ms.saturating_sub(since_ms), now_ms, top);
    if json {
        let answer = serde_json::json!({"rules": report, "skipped_lines": skipped});
        println!("{}", serde_json::to_string_pretty(&answer)?);
        return Ok(ExitCode::SUCCESS);
    }
    if report.is_empty() {
        println!("no shadow rule would have refused a request in the period");
    }
    for rule in &report {
        println!(
            "{}/{}: {} request(s) would have been refused ({} hits), {:.1} per hour; first {}, \
             last {}",
            rule.domain,
            rule.rule,
            rule.blocks,
            rule.hits,
            rule.blocks_per_hour,
            format_epoch_ms(rule.first_ms),
            format_epoch_ms(rule.last_ms)
        );
        for (descriptor, count) in &rule.top {
            println!("  {count:>8}  {descriptor}");
        }
    }
    if skipped > 0 {
        println!("{skipped} line(s) skipped: not shadow events");
    }
    Ok(ExitCode::SUCCESS)
}

/// Policy files read and parsed as `validate` and `apply` see them.
struct Loaded {
    sources: Vec<PolicySource>,
    /// Files that could not be read, as messages.
    read_errors: Vec<String>,
    /// The parse: the set, or every error with file:line:column.
    parsed: Result<PolicySet, PolicyErrors>,
}

impl Loaded {
    fn is_valid(&self) -> bool {
        self.read_errors.is_empty() && self.parsed.is_ok()
    }
}

fn load(paths: &[PathBuf], options: LoadOptions) -> Loaded {
    let mut sources = Vec::new();
    let mut read_errors = Vec::new();
    for path in paths {
        match PolicyOrigin::Path(path.clone()).read_sources() {
            Ok(read) => sources.extend(read),
            Err(error) => read_errors.push(read_error(&error)),
        }
    }
    let parsed = PolicySet::parse_with(&sources, options);
    Loaded { sources, read_errors, parsed }
}

/// Prints `validate`'s verdict; the exit code says whether the files are valid.
fn report_validation(loaded: &Loaded, json: bool) -> ExitCode {
    let errors: &[crate::core::policy::PolicyError] = match &loaded.parsed {
        Ok(policy) if loaded.read_errors.is_empty() => {
            let rules = policy.rules().count();
            let digest = format!("{:016x}", policy.digest());
            let files = loaded.sources.len();
            if json {
                let answer = serde_json::json!({
                    "ok": true, "files": files, "rules": rules, "digest": digest,
                });
                println!("{answer}");
            } else {
                println!("ok: {files} file(s), {rules} rule(s), digest {digest}");
            }
            return ExitCode::SUCCESS;
        }
        Ok(_) => &[],
        Err(PolicyErrors(parse_errors)) => parse_errors,
    };
    let read_errors = &loaded.read_errors;
    if json {
        let all: Vec<String> =
            read_errors.iter().cloned().chain(errors.iter().map(ToString::to_string)).collect();
        println!("{}", serde_json::json!({ "ok": false, "errors": all }));
        return ExitCode::FAILURE;
    }
    for error in read_errors {
        eprintln!("{error}");
    }
    for error in errors {
        eprintln!("{error}");
    }
    eprintln!("{} error(s)", read_errors.len() + errors.len());
    ExitCode::FAILURE
}

/// `policy apply`: sends valid files to the admin API and says what became of them.
async fn apply(
    sources: Vec<PolicySource>,
    message: String,
    target: Target,
    json: bool,
) -> anyhow::Result<ExitCode> {
    let files = sources
        .into_iter()
        .map(|source| proto::PolicyFile { name: source.name, text: source.text })
        .collect();
    let mut client = connect(first_address(&target)?, &target).await?;
    let request = proto::ApplyPolicyRequest { files, message };
    let reply = client.apply_policy(with_deadline(request, &target)).await.map_err(rpc_error)?;
    print_applied(&reply.into_inner(), json);
    Ok(ExitCode::SUCCESS)
}

fn print_applied(reply: &proto::PolicyReply, json: bool) {
    let digest = format!("{:016x}", reply.digest);
    if json {
        let answer = serde_json::json!({
            "version": reply.version, "digest": digest, "created": reply.created,
        });
        println!("{answer}");
    } else if reply.created {
        println!("applied: policy version {} (digest {digest})", reply.version);
    } else {
        println!(
            "unchanged: version {} has these rules already (digest {digest}); no new version",
            reply.version
        );
    }
}

fn version_json(info: &proto::PolicyVersionInfo) -> serde_json::Value {
    serde_json::json!({
        "version": info.version,
        "digest": format!("{:016x}", info.digest),
        "applied_at": format_epoch_ms(info.applied_at_ms),
        "applied_at_ms": info.applied_at_ms,
        "applied_by": info.applied_by,
        "message": info.message,
        "rollback_of": info.rollback_of,
        "files": info.files,
        "size_bytes": info.size_bytes,
        "files_kept": info.files_kept,
    })
}

/// `policy history`: the versions, newest first.
async fn history(limit: u32, target: &Target, json: bool) -> anyhow::Result<ExitCode> {
    let mut client = connect(first_address(target)?, target).await?;
    let request = proto::PolicyHistoryRequest { limit };
    let reply = client
        .policy_history(with_deadline(request, target))
        .await
        .map_err(rpc_error)?
        .into_inner();
    if json {
        let versions: Vec<serde_json::Value> = reply.versions.iter().map(version_json).collect();
        println!("{}", serde_json::json!({ "versions": versions }));
        return Ok(ExitCode::SUCCESS);
    }
    if reply.versions.is_empty() {
        println!("no policy version was applied in this region yet");
    }
    for info in &reply.versions {
        let rollback =
            info.rollback_of.map(|of| format!(" (rollback to {of})")).unwrap_or_default();
        let kept = if info.files_kept { "" } else { " [files no longer kept]" };
        println!(
            "{:>5}  {:016x}  {}  {}{rollback}{kept}  {}",
            info.version,
            info.digest,
            format_epoch_ms(info.applied_at_ms),
            info.applied_by,
            info.message
        );
    }
    Ok(ExitCode::SUCCESS)
}

/// `policy get --version N`: one version of the region's set with its files.
async fn get_version(version: u64, target: &Target, json: bool) -> anyhow::Result<ExitCode> {
    let mut client = connect(first_address(target)?, target).await?;
    let request = proto::GetPolicyRequest { version: Some(version) };
    let reply =
        client.get_policy(with_deadline(request, target)).await.map_err(rpc_error)?.into_inner();
    let info = reply.info.context("the node answered no version")?;
    if json {
        let files: Vec<serde_json::Value> = reply
            .files
            .iter()
            .map(|file| serde_json::json!({"name": file.name, "text": file.text}))
            .collect();
        let mut answer = version_json(&info);
        answer["contents"] = serde_json::Value::Array(files);
        println!("{answer}");
        return Ok(ExitCode::SUCCESS);
    }
    println!(
        "# policy version {}, digest {:016x}, applied {} by {}{}",
        info.version,
        info.digest,
        format_epoch_ms(info.applied_at_ms),
        info.applied_by,
        if info.message.is_empty() { String::new() } else { format!(": {}", info.message) }
    );
    if !info.files_kept {
        println!("# its files are no longer kept");
    }
    for file in &reply.files {
        print!("# --- {}\n{}", file.name, file.text);
        if !file.text.ends_with('\n') {
            println!();
        }
    }
    Ok(ExitCode::SUCCESS)
}

/// A file that could not be read: the error names the path itself, so no `file:0:0:` prefix.
fn read_error(error: &PolicyLoadError) -> String {
    error.to_string()
}
