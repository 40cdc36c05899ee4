//! The node's configuration: a TOML file, overridden by `QUOTAMESH_*` environment variables,
//! overridden by flags (the flag/variable layer is parsed by `crate::cli::serve`). This module
//! owns the file format, the defaults and validation; it opens no sockets.
//!
//! ```toml
//! node_id = "node-1"
//! region = "local"
//! data_dir = "./quotamesh-data"
//! policy = "cluster/policies"      # a YAML file or a directory of them; absent = embedded example
//! rls_addr = "0.0.0.0:8081"
//! metrics_addr = "0.0.0.0:6070"
//! billing_addr = "0.0.0.0:8082"   # the billing-debit gRPC API
//! raft_addr = "0.0.0.0:8084"      # Raft between the nodes of the region
//!
//! [shards]
//! count = 0                        # 0 = one per core
//! keys_per_shard_max = 1000000
//! sweep_interval_ms = 1000
//!
//! [headers]
//! ietf_draft10 = true              # RateLimit-Policy and RateLimit
//! legacy = true                    # RateLimit-Limit, RateLimit-Remaining, RateLimit-Reset
//! retry_after = true               # Retry-After when over the limit
//!
//! [billing]
//! raft_node_id = 1                 # this node's id in the billing Raft group
//! voters = []                      # empty: a single-node group of this node
//! # voters = [{ id = 1, raft_addr = "10.0.0.1:8084" }, { id = 2, raft_addr = "10.0.0.2:8084" }, ...]
//! bootstrap = false                # with voters: this node forms the group on its first start
//! deadline_ms = 1000               # no commit within it: UNAVAILABLE
//! key_retention_ms = 86400000      # idempotency keys are kept this long
//!
//! [[billing.tokens]]               # none: every billing call is UNAUTHENTICATED
//! name = "checkout"                # the caller named in the audit trail
//! sha256 = "<64 hex digits>"       # `quotamesh billing hash-token` prints it
//! tenants = ["acme"]               # or ["*"] for every tenant
//!
//! [billing.tls]                    # optional: TLS on the billing port
//! cert = "billing.pem"
//! key = "billing.key"
//! client_ca = "clients-ca.pem"     # optional: require client certificates (mTLS)
//! ```

use std::net::SocketAddr;
use std::path::{Path, PathBuf};

use serde::Deserialize;

/// Default RLS gRPC address: envoyproxy/ratelimit's port, so Envoy configs carry over.
pub const RLS_ADDR_DEFAULT: &str = "0.0.0.0:8081";
/// Default Prometheus and health HTTP address.
pub const METRICS_ADDR_DEFAULT: &str = "0.0.0.0:6070";
/// Default billing-debit gRPC address.
pub const BILLING_ADDR_DEFAULT: &str = "0.0.0.0:8082";
/// Default Raft peer gRPC address.
pub const RAFT_ADDR_DEFAULT: &str = "0.0.0.0:8084";
/// Most voters of a billing group (Raft groups of a region have 3 or 5).
pub const BILLING_VOTERS_MAX: usize = 7;
/// Most billing tokens in the configuration.
pub const BILLING_TOKENS_MAX: usize = 1024;
/// Longest billing token name, in bytes (it is the caller in the audit trail).
pub const BILLING_TOKEN_NAME_BYTES_MAX: usize = crate::core::billing::CALLER_BYTES_MAX;
/// The tenant entry that grants a token every tenant.
pub const BILLING_ALL_TENANTS: &str = "*";
/// Default data directory of the embedded single-node setup.
pub const DATA_DIR_DEFAULT: &str = "./quotamesh-data";
/// Most shard actors a node may run.
pub const SHARD_COUNT_MAX: usize = 1024;
/// Most keys one shard may track; with about 100 bytes a key this bounds a shard near 10 GiB.
pub const KEYS_PER_SHARD_MAX_LIMIT: usize = 100_000_000;
/// Largest configuration file read.
pub const CONFIG_FILE_BYTES_MAX: u64 = 1024 * 1024;

/// Everything a node needs to start.
#[derive(Debug, Clone, PartialEq, Deserialize)]
#[serde(deny_unknown_fields, default)]
pub struct NodeConfig {
    /// This node's name, unique in its region.
    pub node_id: String,
    /// The region this node belongs to.
    pub region: String,
    /// Directory for the node's durable state.
    pub data_dir: PathBuf,
    /// Policy file or directory; `None` serves the embedded example policy.
    pub policy: Option<PathBuf>,
    /// Envoy RLS v3 gRPC listen address.
    pub rls_addr: SocketAddr,
    /// Prometheus `/metrics`, `/healthz` and `/readyz` listen address.
    pub metrics_addr: SocketAddr,
    /// Billing-debit gRPC listen address.
    pub billing_addr: SocketAddr,
    /// Raft peer gRPC listen address (every Raft group of the node shares it).
    pub raft_addr: SocketAddr,
    /// The billing group and API.
    pub billing: BillingConfig,
    /// Tenant-shard actors.
    pub shards: ShardConfig,
    /// Rate-limit headers added to Envoy's responses.
    pub headers: HeaderConfig,
}

/// Tenant-shard actor settings.
#[derive(Debug, Clone, PartialEq, Deserialize)]
#[serde(deny_unknown_fields, default)]
pub struct ShardConfig {
    /// Number of shard actors; 0 means one per available core.
    pub count: usize,
    /// Keys one shard tracks before it evicts the least recently useful one.
    pub keys_per_shard_max: usize,
    /// How often a shard drops keys whose state has returned to that of a fresh key.
    pub sweep_interval_ms: u64,
}

/// Which rate-limit header generations the RLS answer carries.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Deserialize)]
#[serde(deny_unknown_fields, default)]
pub struct HeaderConfig {
    /// IETF draft-ietf-httpapi-ratelimit-headers-10: `RateLimit-Policy` and `RateLimit`.
    pub ietf_draft10: bool,
    /// The older `RateLimit-Limit`, `RateLimit-Remaining`, `RateLimit-Reset` (seconds).
    pub legacy: bool,
    /// `Retry-After` (seconds) on over-limit answers.
    pub retry_after: bool,
}

/// The billing group and its API.
#[derive(Debug, Clone, PartialEq, Deserialize)]
#[serde(deny_unknown_fields, default)]
pub struct BillingConfig {
    /// This node's id in the billing Raft group (1 or more), stable for its data directory.
    pub raft_node_id: u64,
    /// The group's voters with their Raft addresses. Empty: a single-node group of this
    /// node, formed on its first start.
    pub voters: Vec<BillingVoter>,
    /// With `voters`: this node forms the group on its first start (set it on one node).
    pub bootstrap: bool,
    /// How long a billing call waits for its commit before answering `UNAVAILABLE`.
    pub deadline_ms: u64,
    /// How long idempotency keys are kept after their first commit.
    pub key_retention_ms: u64,
    /// Callers: bearer tokens (hashed) and the tenants each may touch.
    pub tokens: Vec<BillingToken>,
    /// TLS on the billing port; `None` serves plaintext.
    pub tls: Option<BillingTls>,
}

/// One voter of the billing group.
#[derive(Debug, Clone, PartialEq, Eq, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct BillingVoter {
    /// Its `billing.raft_node_id`.
    pub id: u64,
    /// Its Raft address as the other voters reach it (`host:port`).
    pub raft_addr: String,
}

/// One billing caller.
#[derive(Debug, Clone, PartialEq, Eq, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct BillingToken {
    /// The caller's name, written in the audit trail.
    pub name: String,
    /// SHA-256 of the token, 64 hex digits; the token itself is never stored.
    pub sha256: String,
    /// Tenants the token may touch; `"*"` for all.
    pub tenants: Vec<String>,
}

/// TLS files of the billing port (PEM).
#[derive(Debug, Clone, PartialEq, Eq, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct BillingTls {
    /// The server's certificate chain.
    pub cert: PathBuf,
    /// The server's private key.
    pub key: PathBuf,
    /// When set, clients must present a certificate signed by this CA (mTLS).
    pub client_ca: Option<PathBuf>,
}

impl Default for BillingConfig {
    fn default() -> Self {
        Self {
            raft_node_id: 1,
            voters: Vec::new(),
            bootstrap: false,
            deadline_ms: 1000,
            key_retention_ms: crate::core::billing::KEY_RETENTION_MS_DEFAULT,
            tokens: Vec::new(),
            tls: None,
        }
    }
}

impl BillingConfig {
    fn validate(&self) -> Result<(), ConfigError> {
        use crate::core::billing::{KEY_RETENTION_MS_MAX, KEY_RETENTION_MS_MIN};
        let invalid = |message: String| Err(ConfigError::Invalid(message));
        if self.raft_node_id == 0 {
            return invalid("billing.raft_node_id must be 1 or more".to_owned());
        }
        if self.voters.len() > BILLING_VOTERS_MAX {
            return invalid(format!("billing.voters: at most {BILLING_VOTERS_MAX}"));
        }
        let mut ids = std::collections::BTreeSet::new();
        for voter in &self.voters {
            if voter.id == 0 || !ids.insert(voter.id) || voter.raft_addr.is_empty() {
                return invalid(format!("billing.voters: bad or repeated voter {voter:?}"));
            }
        }
        if !self.voters.is_empty() && !ids.contains(&self.raft_node_id) {
            return invalid("billing.voters must include billing.raft_node_id".to_owned());
        }
        if !(10..=60_000).contains(&self.deadline_ms) {
            return invalid("billing.deadline_ms must be between 10 and 60000".to_owned());
        }
        if !(KEY_RETENTION_MS_MIN..=KEY_RETENTION_MS_MAX).contains(&self.key_retention_ms) {
            return invalid(format!(
                "billing.key_retention_ms must be between {KEY_RETENTION_MS_MIN} and {KEY_RETENTION_MS_MAX}"
            ));
        }
        if self.tokens.len() > BILLING_TOKENS_MAX {
            return invalid(format!("billing.tokens: at most {BILLING_TOKENS_MAX}"));
        }
        for token in &self.tokens {
            if token.name.is_empty() || token.name.len() > BILLING_TOKEN_NAME_BYTES_MAX {
                return invalid(format!(
                    "billing.tokens: name must be 1 to {BILLING_TOKEN_NAME_BYTES_MAX} bytes, got {:?}",
                    token.name
                ));
            }
            if token.sha256.len() != 64 || !token.sha256.bytes().all(|b| b.is_ascii_hexdigit()) {
                return invalid(format!(
                    "billing.tokens {:?}: sha256 must be 64 hex digits",
                    token.name
                ));
            }
            if token.tenants.is_empty() {
                return invalid(format!("billing.tokens {:?}: no tenants", token.name));
            }
            for tenant in &token.tenants {
                let account = crate::core::billing::AccountId::new(tenant.as_str(), "m");
                if tenant != BILLING_ALL_TENANTS && account.check().is_err() {
                    return invalid(format!(
                        "billing.tokens {:?}: bad tenant {tenant:?}",
                        token.name
                    ));
                }
            }
        }
        Ok(())
    }
}

impl Default for NodeConfig {
    fn default() -> Self {
        Self {
            node_id: "node-1".to_owned(),
            region: "local".to_owned(),
            data_dir: PathBuf::from(DATA_DIR_DEFAULT),
            policy: None,
            rls_addr: RLS_ADDR_DEFAULT.parse().expect("constant address parses"),
            metrics_addr: METRICS_ADDR_DEFAULT.parse().expect("constant address parses"),
            billing_addr: BILLING_ADDR_DEFAULT.parse().expect("constant address parses"),
            raft_addr: RAFT_ADDR_DEFAULT.parse().expect("constant address parses"),
            billing: BillingConfig::default(),
            shards: ShardConfig::default(),
            headers: HeaderConfig::default(),
        }
    }
}

impl Default for ShardConfig {
    fn default() -> Self {
        Self { count: 0, keys_per_shard_max: 1_000_000, sweep_interval_ms: 1000 }
    }
}

impl Default for HeaderConfig {
    fn default() -> Self {
        Self { ietf_draft10: true, legacy: true, retry_after: true }
    }
}

/// Why a configuration was refused.
#[derive(Debug, thiserror::Error)]
pub enum ConfigError {
    /// The file could not be read.
    #[error("cannot read config {path}: {source}")]
    Read {
        /// The file.
        path: PathBuf,
        /// The IO error.
        source: std::io::Error,
    },
    /// The file is larger than [`CONFIG_FILE_BYTES_MAX`].
    #[error("config {path} is {size_bytes} bytes, more than the {CONFIG_FILE_BYTES_MAX} allowed")]
    TooLarge {
        /// The file.
        path: PathBuf,
        /// Its size.
        size_bytes: u64,
    },
    /// The TOML did not parse or had unknown keys.
    #[error("invalid config {path}: {message}")]
    Parse {
        /// The file.
        path: PathBuf,
        /// The parser's message, with line and column.
        message: String,
    },
    /// A value is out of range.
    #[error("invalid config: {0}")]
    Invalid(String),
}

impl NodeConfig {
    /// Reads a TOML file; missing keys take their defaults.
    ///
    /// # Errors
    /// [`ConfigError`] when the file cannot be read, is too large, or does not parse.
    pub fn from_file(path: &Path) -> Result<Self, ConfigError> {
        let read_error = |source| ConfigError::Read { path: path.to_owned(), source };
        let size_bytes = std::fs::metadata(path).map_err(read_error)?.len();
        if size_bytes > CONFIG_FILE_BYTES_MAX {
            return Err(ConfigError::TooLarge { path: path.to_owned(), size_bytes });
        }
        let text = std::fs::read_to_string(path).map_err(read_error)?;
        Self::from_toml(&text)
            .map_err(|message| ConfigError::Parse { path: path.to_owned(), message })
    }

    /// Parses TOML text.
    ///
    /// # Errors
    /// The parser's message when the text is not a valid configuration.
    pub fn from_toml(text: &str) -> Result<Self, String> {
        toml::from_str(text).map_err(|error| error.to_string())
    }

    /// Checks ranges that serde cannot express.
    ///
    /// # Errors
    /// [`ConfigError::Invalid`] naming the first bad value.
    pub fn validate(&self) -> Result<(), ConfigError> {
        let invalid = |message: String| Err(ConfigError::Invalid(message));
        if self.node_id.is_empty() || self.node_id.len() > 128 {
            return invalid(format!("node_id must be 1 to 128 bytes, got {:?}", self.node_id));
        }
        if self.region.is_empty() || self.region.len() > 128 {
            return invalid(format!("region must be 1 to 128 bytes, got {:?}", self.region));
        }
        if self.shards.count > SHARD_COUNT_MAX {
            return invalid(format!("shards.count must be at most {SHARD_COUNT_MAX}"));
        }
        if self.shards.keys_per_shard_max == 0
            || self.shards.keys_per_shard_max > KEYS_PER_SHARD_MAX_LIMIT
        {
            return invalid(format!(
                "shards.keys_per_shard_max must be between 1 and {KEYS_PER_SHARD_MAX_LIMIT}"
            ));
        }
        if !(10..=3_600_000).contains(&self.shards.sweep_interval_ms) {
            return invalid("shards.sweep_interval_ms must be between 10 and 3600000".to_owned());
        }
        self.billing.validate()
    }

    /// The number of shard actors to run: the configured count, or one per core.
    pub fn shard_count(&self) -> usize {
        if self.shards.count > 0 {
            return self.shards.count;
        }
        std::thread::available_parallelism().map_or(1, std::num::NonZeroUsize::get)
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    /// An empty file is the embedded default.
    #[test]
    fn empty_toml_is_default() {
        assert_eq!(NodeConfig::from_toml("").expect("parses"), NodeConfig::default());
    }

    /// Unknown keys are refused with their name, so a typo never silently takes a default.
    #[test]
    fn unknown_key_is_refused() {
        let message = NodeConfig::from_toml("rls_adr = \"1.2.3.4:1\"").expect_err("typo");
        assert!(message.contains("rls_adr"), "{message}");
    }

    /// Nested tables override only what they name.
    #[test]
    fn nested_tables_override_fields() {
        let config = NodeConfig::from_toml("[shards]\ncount = 3\n[headers]\nlegacy = false")
            .expect("parses");
        assert_eq!(config.shards.count, 3);
        assert_eq!(config.shards.keys_per_shard_max, ShardConfig::default().keys_per_shard_max);
        assert!(!config.headers.legacy);
        assert!(config.headers.ietf_draft10);
        assert!(config.validate().is_ok());
    }

    /// The example configuration shipped in `cluster/node.toml` parses, validates, and
    /// states exactly the defaults.
    #[test]
    fn shipped_example_is_the_default() {
        let config = NodeConfig::from_toml(include_str!("../cluster/node.toml")).expect("parses");
        assert!(config.validate().is_ok());
        assert_eq!(config, NodeConfig::default());
    }

    /// A three-voter billing group with a token parses and validates; a voter list that
    /// leaves this node out, or a malformed token digest, is refused.
    #[test]
    fn billing_section_parses_and_validates() {
        let text = r#"
            [billing]
            raft_node_id = 2
            bootstrap = true
            voters = [{ id = 1, raft_addr = "a:1" }, { id = 2, raft_addr = "b:1" }, { id = 3, raft_addr = "c:1" }]
            [[billing.tokens]]
            name = "svc"
            sha256 = "9f86d081884c7d659a2feaa0c55ad015a3bf4f1b2b0b822cd15d6c15b0f00a08"
            tenants = ["t1", "*"]
        "#;
        let config = NodeConfig::from_toml(text).expect("parses");
        assert!(config.validate().is_ok(), "{:?}", config.validate());
        let mut outside = config.clone();
        outside.billing.raft_node_id = 4;
        assert!(outside.validate().is_err());
        let mut bad_digest = config;
        bad_digest.billing.tokens[0].sha256 = "abc".to_owned();
        assert!(bad_digest.validate().is_err());
    }

    /// Out-of-range values are refused by validate.
    #[test]
    fn zero_capacity_is_invalid() {
        let config = NodeConfig::from_toml("[shards]\nkeys_per_shard_max = 0").expect("parses");
        assert!(config.validate().is_err());
    }
}
