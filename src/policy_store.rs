//! Where the active policy comes from and how it is replaced: reads policy files from disk
//! (or the embedded example), parses them with `crate::core::policy`, publishes the result
//! in an [`ArcSwap`] that RLS handlers read without locking, and reloads on file changes and
//! on SIGHUP. A file that fails to load never replaces a good policy: the failure is logged
//! and counted once per distinct content of the files (a broken file that stays broken is
//! not reported again on every event), and the previous set stays active.
//!
//! A node also follows the region's replicated policy versions (`quotamesh policy apply`,
//! `crate::core::policy_versions`), which `crate::policy_follow` hands to
//! [`PolicyStore::install_replicated`]. Which one a node serves:
//!
//! ```text
//!  --policy FILE (or [policy] path)   local: the files, always; the region's version is
//!                                     reported beside it (`region_version`), so drift shows
//!  no path (the embedded default)     the embedded default until the region has a version,
//!                                     then the latest version, replicated
//! ```
//!
//! Every swap replaces one `Arc`: a decision reads one whole set, never a mix of two.
//!
//! A rule with `regions` is enforced at this region's slice: the policy's share until the
//! rebalancer (`crate::actors::rebalancer`) reports the slices of the region's ledger
//! ([`PolicyStore::follow_slices`]), those from then on. The unsliced set, with the global
//! limits, is [`PolicyStore::global`].

use std::collections::BTreeMap;
use std::path::{Path, PathBuf};
use std::sync::Arc;
use std::sync::atomic::{AtomicU64, Ordering};
use std::time::Duration;

use arc_swap::ArcSwap;
use notify::Watcher;
use tokio::sync::mpsc;

use crate::core::digest::Fnv1a;
use crate::core::policy::{LoadOptions, PolicyErrors, PolicySet, PolicySource};
use crate::core::policy_versions::StoredPolicyVersion;
use crate::core::region::transfer::SliceKey;
use crate::metrics::Metrics;

/// The example policy served when no policy path is configured.
pub const EMBEDDED_POLICY_YAML: &str = include_str!("../cluster/policies/example.yaml");
/// How the embedded example is named in messages.
pub const EMBEDDED_POLICY_NAME: &str = "cluster/policies/example.yaml (embedded)";
/// Largest policy file read: the largest policy set the quota ledger stores
/// (`POLICY_SET_BYTES_MAX`), so a file that could never be distributed is refused by its
/// size, up front, rather than by a parser limit it happens to reach first.
pub const POLICY_FILE_BYTES_MAX: u64 = crate::core::ledger::POLICY_SET_BYTES_MAX as u64;
/// Most policy files read from one directory.
pub const POLICY_FILES_MAX: usize = 1000;
/// File events within this interval are folded into one reload (editors write in bursts).
pub const RELOAD_DEBOUNCE: Duration = Duration::from_millis(250);

/// Where policies are read from.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum PolicyOrigin {
    /// The example policy compiled into the binary.
    Embedded,
    /// A YAML file, or a directory whose `*.yaml` and `*.yml` files are read in name order.
    Path(PathBuf),
}

/// Why a policy could not be loaded.
#[derive(Debug, thiserror::Error)]
pub enum PolicyLoadError {
    /// A file or directory could not be read.
    #[error("cannot read {path}: {source}")]
    Read {
        /// The path.
        path: PathBuf,
        /// The IO error.
        source: std::io::Error,
    },
    /// A file is larger than [`POLICY_FILE_BYTES_MAX`].
    #[error("{path} is {size_bytes} bytes; policy files may be at most {POLICY_FILE_BYTES_MAX}")]
    TooLarge {
        /// The file.
        path: PathBuf,
        /// Its size.
        size_bytes: u64,
    },
    /// A directory holds more than [`POLICY_FILES_MAX`] policy files, or none.
    #[error("{path}: {reason}")]
    Directory {
        /// The directory.
        path: PathBuf,
        /// What is wrong.
        reason: String,
    },
    /// The files were read but are not a valid policy set; every error is listed.
    #[error("invalid policy:\n{0}")]
    Invalid(PolicyErrors),
}

impl PolicyOrigin {
    /// Reads every policy source of this origin.
    ///
    /// # Errors
    /// [`PolicyLoadError`] when a file cannot be read or a limit is exceeded.
    pub fn read_sources(&self) -> Result<Vec<PolicySource>, PolicyLoadError> {
        match self {
            Self::Embedded => Ok(vec![PolicySource {
                name: EMBEDDED_POLICY_NAME.to_owned(),
                text: EMBEDDED_POLICY_YAML.to_owned(),
            }]),
            Self::Path(path) => read_path(path),
        }
    }
}

/// Reads one file, or every policy file of a directory.
fn read_path(path: &Path) -> Result<Vec<PolicySource>, PolicyLoadError> {
    let read_error = |source| PolicyLoadError::Read { path: path.to_owned(), source };
    let metadata = std::fs::metadata(path).map_err(read_error)?;
    if !metadata.is_dir() {
        return Ok(vec![read_file(path)?]);
    }
    let mut files = Vec::new();
    for entry in std::fs::read_dir(path).map_err(read_error)? {
        let entry_path = entry.map_err(read_error)?.path();
        let name = entry_path.file_name().and_then(|name| name.to_str()).unwrap_or_default();
        // Hidden entries include Kubernetes' `..data` indirection of mounted ConfigMaps.
        let is_policy =
            !name.starts_with('.') && (name.ends_with(".yaml") || name.ends_with(".yml"));
        if is_policy && entry_path.is_file() {
            files.push(entry_path);
        }
        if files.len() > POLICY_FILES_MAX {
            return Err(PolicyLoadError::Directory {
                path: path.to_owned(),
                reason: format!("more than {POLICY_FILES_MAX} policy files"),
            });
        }
    }
    if files.is_empty() {
        return Err(PolicyLoadError::Directory {
            path: path.to_owned(),
            reason: "no *.yaml or *.yml policy files".to_owned(),
        });
    }
    files.sort();
    files.iter().map(|file| read_file(file)).collect()
}

fn read_file(path: &Path) -> Result<PolicySource, PolicyLoadError> {
    let read_error = |source| PolicyLoadError::Read { path: path.to_owned(), source };
    let size_bytes = std::fs::metadata(path).map_err(read_error)?.len();
    if size_bytes > POLICY_FILE_BYTES_MAX {
        return Err(PolicyLoadError::TooLarge { path: path.to_owned(), size_bytes });
    }
    let text = std::fs::read_to_string(path).map_err(read_error)?;
    Ok(PolicySource { name: path.display().to_string(), text })
}

/// What a reload did.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum ReloadOutcome {
    /// A different policy set is now active.
    Replaced,
    /// The files hold the active policy already.
    Unchanged,
    /// The files could not be loaded; the previous policy stays active.
    Refused,
}

/// Where the policy a node serves comes from.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Default)]
pub enum ServedFrom {
    /// Files of this node (`--policy`) or the embedded default.
    #[default]
    Local,
    /// A version of the region's replicated policy set.
    Replicated,
}

impl std::fmt::Display for ServedFrom {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.write_str(match self {
            Self::Local => "local",
            Self::Replicated => "replicated",
        })
    }
}

/// What [`PolicyStore::install_replicated`] did.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum ReplicatedOutcome {
    /// The version is now served.
    Installed,
    /// The version (or a newer one) is served already.
    Unchanged,
    /// This node serves its `--policy` files: the version is only reported.
    Local,
    /// The version's files do not load here (counted and logged); the previous set stays.
    Refused,
}

/// The policy a node serves as operators see it (`/config`, `quotamesh policy get`): the
/// files it was parsed from and its digest.
#[derive(Debug, Clone, Default)]
pub struct ServedPolicy {
    /// The replicated version served; 0 for local files.
    pub version: u64,
    /// Local files or the region's replicated set.
    pub source: ServedFrom,
    /// The digest `quotamesh policy validate` prints for the same files.
    pub digest: u64,
    /// Rules in the set.
    pub rules: usize,
    /// When this policy became active, in epoch milliseconds.
    pub active_since_ms: u64,
    /// The files, as read.
    pub sources: Vec<PolicySource>,
    /// How the files were read (`[policy]`), so a reader parses them as the node did.
    pub options: LoadOptions,
}

/// The active policy and where it came from.
pub struct PolicyStore {
    origin: PolicyOrigin,
    options: LoadOptions,
    /// This node's region: the active set carries its slices of rules with `regions`.
    region: String,
    /// This node's id: the active set carries its stage of each rule's rollout (a canary
    /// enforces on some nodes only).
    node_id: String,
    active: Arc<ArcSwap<PolicySet>>,
    /// The served set before slicing: the global limits of rules with `regions`.
    global: ArcSwap<PolicySet>,
    /// The region's slices from its quota ledger, by slice key (empty until reported).
    slices: parking_lot::Mutex<Arc<BTreeMap<SliceKey, u64>>>,
    served: Arc<ArcSwap<ServedPolicy>>,
    /// The fingerprint of the files' content (or of the read error) last refused, so that
    /// the same refusal is logged and counted once, not on every file event.
    last_refused: parking_lot::Mutex<Option<u64>>,
    /// The latest replicated version this node has seen (served or not); 0: none.
    region_version: AtomicU64,
    /// Held while a new set is chosen and published, so a file reload and a replicated
    /// version never interleave.
    publishing: parking_lot::Mutex<()>,
    metrics: Metrics,
}

impl PolicyStore {
    /// Loads the initial policy; a node does not start without a valid one. The active set
    /// is the one `region` enforces ([`PolicySet::for_region`]), as the node `node_id`
    /// serves it ([`PolicySet::for_node`]).
    ///
    /// # Errors
    /// [`PolicyLoadError`] when the initial policy cannot be loaded.
    pub fn open(
        origin: PolicyOrigin,
        options: LoadOptions,
        region: &str,
        node_id: &str,
        metrics: Metrics,
    ) -> Result<Self, PolicyLoadError> {
        let sources = origin.read_sources()?;
        let policy = PolicySet::parse_with(&sources, options).map_err(PolicyLoadError::Invalid)?;
        let store = Self {
            origin,
            options,
            region: region.to_owned(),
            node_id: node_id.to_owned(),
            active: Arc::new(ArcSwap::from_pointee(PolicySet::default())),
            global: ArcSwap::from_pointee(PolicySet::default()),
            slices: parking_lot::Mutex::new(Arc::new(BTreeMap::new())),
            served: Arc::new(ArcSwap::from_pointee(ServedPolicy::default())),
            last_refused: parking_lot::Mutex::new(None),
            region_version: AtomicU64::new(0),
            publishing: parking_lot::Mutex::new(()),
            metrics,
        };
        store.publish(policy, sources, 0);
        store.metrics.policy_reloads.with_label_values(&["ok"]).inc();
        Ok(store)
    }

    /// The handle `/config` reads the served policy's files and digest through.
    pub fn served(&self) -> Arc<ArcSwap<ServedPolicy>> {
        Arc::clone(&self.served)
    }

    /// The handle RLS handlers read the policy through.
    pub fn active(&self) -> Arc<ArcSwap<PolicySet>> {
        Arc::clone(&self.active)
    }

    /// How the policy files are read (`[policy]`).
    pub fn options(&self) -> LoadOptions {
        self.options
    }

    /// Whether this node follows the region's replicated versions: it has no `--policy`.
    pub fn follows_region(&self) -> bool {
        self.origin == PolicyOrigin::Embedded
    }

    /// The latest replicated version this node has seen, served or not (0: none).
    pub fn region_version(&self) -> u64 {
        self.region_version.load(Ordering::Acquire)
    }

    /// Serves `stored`, a version of the region's policy set, when this node follows the
    /// region and serves an older one. Parses the files (CPU work: call it off the async
    /// workers).
    pub fn install_replicated(&self, stored: &StoredPolicyVersion) -> ReplicatedOutcome {
        let version = stored.info.version;
        let _publishing = self.publishing.lock();
        let seen = self.region_version.fetch_max(version, Ordering::AcqRel);
        if !self.follows_region() {
            if seen < version {
                tracing::info!(
                    version,
                    "the region applied a policy version; this node serves its --policy files \
                     (local) and does not follow it"
                );
            }
            return ReplicatedOutcome::Local;
        }
        if self.served.load().version >= version {
            return ReplicatedOutcome::Unchanged;
        }
        let Some(files) = &stored.files else {
            // The current version always keeps its files; an older one is never installed.
            return ReplicatedOutcome::Unchanged;
        };
        let sources: Vec<PolicySource> = files
            .iter()
            .map(|(name, text)| PolicySource { name: name.clone(), text: text.clone() })
            .collect();
        match PolicySet::parse_with(&sources, self.options) {
            Ok(policy) => {
                let (rules, digest) = (policy.rules().count(), policy.digest());
                self.publish(policy, sources, version);
                self.metrics.policy_reloads.with_label_values(&["ok"]).inc();
                tracing::info!(
                    version,
                    rules,
                    digest = %format_args!("{digest:016x}"),
                    applied_by = %stored.info.applied_by,
                    "replicated policy version installed"
                );
                ReplicatedOutcome::Installed
            }
            Err(errors) => {
                self.metrics.policy_reloads.with_label_values(&["error"]).inc();
                self.metrics.policy_reload_failures.inc();
                tracing::error!(
                    version,
                    %errors,
                    "replicated policy version refused (this node's [policy] options differ?); \
                     the previous policy stays active"
                );
                ReplicatedOutcome::Refused
            }
        }
    }

    /// Reloads from the origin; a failure leaves the active policy in place. A failure of
    /// the same content as the last one refused is neither logged nor counted again. A node
    /// serving a replicated version keeps it: the embedded default never replaces it.
    pub fn reload(&self) -> ReloadOutcome {
        let _publishing = self.publishing.lock();
        if self.served.load().source == ServedFrom::Replicated {
            return ReloadOutcome::Unchanged;
        }
        // A read error is its own fingerprint; a parse error that of the files' content.
        let loaded = match self.origin.read_sources() {
            Err(error) => Err((None, error)),
            Ok(sources) => match PolicySet::parse_with(&sources, self.options) {
                Ok(policy) => Ok((policy, sources)),
                Err(errors) => Err((Some(fingerprint(&sources)), PolicyLoadError::Invalid(errors))),
            },
        };
        match loaded {
            Ok((policy, sources)) => {
                *self.last_refused.lock() = None;
                if policy.digest() == self.active.load().digest() {
                    self.metrics.policy_reloads.with_label_values(&["unchanged"]).inc();
                    return ReloadOutcome::Unchanged;
                }
                let rules = policy.rules().count();
                let digest = policy.digest();
                self.publish(policy, sources, 0);
                self.metrics.policy_reloads.with_label_values(&["ok"]).inc();
                tracing::info!(rules, digest = %format_args!("{digest:016x}"), "policy reloaded");
                ReloadOutcome::Replaced
            }
            Err((content, error)) => {
                let refused = content.unwrap_or_else(|| {
                    let mut hasher = Fnv1a::default();
                    hasher.write(error.to_string().as_bytes());
                    hasher.finish()
                });
                if self.last_refused.lock().replace(refused) == Some(refused) {
                    return ReloadOutcome::Refused;
                }
                self.metrics.policy_reloads.with_label_values(&["error"]).inc();
                self.metrics.policy_reload_failures.inc();
                tracing::error!(
                    %error,
                    "policy reload refused; the previous policy stays active (logged once until \
                     the files change)"
                );
                ReloadOutcome::Refused
            }
        }
    }

    /// Serves `policy`: `version` 0 for local files, else the replicated version.
    fn publish(&self, policy: PolicySet, sources: Vec<PolicySource>, version: u64) {
        let rules = policy.rules().count();
        self.metrics.policy_rules.set(i64::try_from(rules).unwrap_or(i64::MAX));
        self.metrics.set_policy_digest(policy.digest());
        self.metrics.policy_version.set(i64::try_from(version).unwrap_or(i64::MAX));
        let source = if version == 0 { ServedFrom::Local } else { ServedFrom::Replicated };
        self.served.store(Arc::new(ServedPolicy {
            version,
            source,
            digest: policy.digest(),
            rules,
            active_since_ms: crate::clock::now_ms(),
            sources,
            options: self.options,
        }));
        let slices = Arc::clone(&self.slices.lock());
        self.global.store(Arc::new(policy.clone()));
        self.active.store(Arc::new(
            policy.for_region_slices(&self.region, &slices).for_node(&self.node_id),
        ));
    }

    /// The served set before slicing: rules with `regions` carry their global limits.
    pub fn global(&self) -> Arc<PolicySet> {
        self.global.load_full()
    }

    /// Enforces `slices` (the region's ledger slices, by slice key) from now on, in place of
    /// the policy's shares; a no-op when they are the ones enforced already.
    pub fn follow_slices(&self, slices: BTreeMap<SliceKey, u64>) {
        let _publishing = self.publishing.lock();
        {
            let mut current = self.slices.lock();
            if **current == slices {
                return;
            }
            *current = Arc::new(slices);
        }
        let slices = Arc::clone(&self.slices.lock());
        let global = PolicySet::clone(&self.global.load());
        self.active.store(Arc::new(
            global.for_region_slices(&self.region, &slices).for_node(&self.node_id),
        ));
    }

    /// Reloads whenever the policy files change or the process receives SIGHUP, until
    /// `shutdown` resolves. The embedded policy only reloads on SIGHUP (a no-op).
    ///
    /// # Errors
    /// The error of installing the SIGHUP handler or the file watcher.
    pub fn watch(
        self: Arc<Self>,
        shutdown: impl Future<Output = ()> + Send + 'static,
    ) -> std::io::Result<tokio::task::JoinHandle<()>> {
        let mut hangup = tokio::signal::unix::signal(tokio::signal::unix::SignalKind::hangup())?;
        // One pending wake-up is enough: a reload reads every file anew.
        let (changed_sender, mut changed) = mpsc::channel::<()>(1);
        let watcher = match &self.origin {
            PolicyOrigin::Embedded => None,
            PolicyOrigin::Path(path) => Some(watch_path(path, changed_sender)?),
        };
        Ok(tokio::spawn(async move {
            let _watcher = watcher;
            tokio::pin!(shutdown);
            loop {
                tokio::select! {
                    () = &mut shutdown => return,
                    Some(()) = changed.recv() => {
                        tokio::time::sleep(RELOAD_DEBOUNCE).await;
                        while changed.try_recv().is_ok() {}
                    }
                    Some(()) = hangup.recv() => tracing::info!("SIGHUP: reloading policy"),
                }
                let store = Arc::clone(&self);
                // Parsing a large policy is CPU work; keep it off the async workers.
                let _ = tokio::task::spawn_blocking(move || store.reload()).await;
            }
        }))
    }
}

/// The fingerprint of policy files' names and content: equal for the same files.
fn fingerprint(sources: &[PolicySource]) -> u64 {
    let mut hasher = Fnv1a::default();
    for source in sources {
        for part in [&source.name, &source.text] {
            hasher.write(&(part.len() as u64).to_le_bytes());
            hasher.write(part.as_bytes());
        }
    }
    hasher.finish()
}

/// Watches the policy directory (or the file's directory, so that editors' and
/// Kubernetes' rename-into-place is seen) and signals every change.
fn watch_path(
    path: &Path,
    changed: mpsc::Sender<()>,
) -> std::io::Result<notify::RecommendedWatcher> {
    let watched = if path.is_dir() {
        path.to_owned()
    } else {
        path.parent()
            .filter(|parent| !parent.as_os_str().is_empty())
            .unwrap_or(Path::new("."))
            .to_owned()
    };
    // Watching a file's directory sees every other file in it too: a log file written next
    // to the policy must not trigger a reload per line.
    let policy_file = if path.is_dir() { None } else { path.file_name().map(ToOwned::to_owned) };
    let mut watcher = notify::recommended_watcher(move |event: notify::Result<notify::Event>| {
        let Ok(event) = event else { return };
        let concerns_policy = match &policy_file {
            None => true,
            Some(file) => {
                event.paths.is_empty()
                    || event.paths.iter().any(|changed| concerns_policy_file(changed, file))
            }
        };
        if concerns_policy && !event.kind.is_access() {
            // Full means a reload is already pending.
            let _ = changed.try_send(());
        }
    })
    .map_err(std::io::Error::other)?;
    watcher.watch(&watched, notify::RecursiveMode::NonRecursive).map_err(std::io::Error::other)?;
    Ok(watcher)
}

/// Whether a change to `changed`, in the directory of the policy file named `file`, may
/// change the policy: the file itself, or a hidden entry (Kubernetes swaps a mounted
/// ConfigMap's files through its `..data` link; editors write hidden temporary files).
fn concerns_policy_file(changed: &Path, file: &std::ffi::OsStr) -> bool {
    changed.file_name().is_none_or(|name| name == file || name.as_encoded_bytes().starts_with(b"."))
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::core::policy_versions::PolicyVersionInfo;

    fn version(version: u64, text: &str) -> StoredPolicyVersion {
        StoredPolicyVersion {
            info: PolicyVersionInfo {
                version,
                digest: version,
                applied_at_ms: 0,
                applied_by: "ops".to_owned(),
                message: String::new(),
                rollback_of: None,
                files: 1,
                size_bytes: text.len() as u64,
            },
            files: Some(vec![("region.yaml".to_owned(), text.to_owned())]),
        }
    }

    const REGION_POLICY: &str = "domain: region\ndescriptors:\n  - key: k\n    rate_limit: {unit: second, requests_per_unit: 1}\n";

    /// A node on the embedded default follows the region's versions (never back to an older
    /// one, and a SIGHUP reload keeps the replicated set); a node with its own files stays
    /// local and only records the region's version.
    #[test]
    fn the_embedded_default_follows_the_region_and_files_stay_local() {
        let embedded = PolicyStore::open(
            PolicyOrigin::Embedded,
            LoadOptions::default(),
            "r",
            "n",
            Metrics::new(),
        )
        .expect("the embedded policy loads");
        assert_eq!(embedded.served().load().source, ServedFrom::Local);
        assert_eq!(
            embedded.install_replicated(&version(2, REGION_POLICY)),
            ReplicatedOutcome::Installed
        );
        assert_eq!(
            embedded.install_replicated(&version(1, REGION_POLICY)),
            ReplicatedOutcome::Unchanged
        );
        assert_eq!(embedded.reload(), ReloadOutcome::Unchanged);
        let served = embedded.served().load_full();
        assert_eq!((served.version, served.source), (2, ServedFrom::Replicated));
        assert!(embedded.active().load().has_domain("region"));
        assert_eq!(
            embedded.install_replicated(&version(3, "domain: [broken")),
            ReplicatedOutcome::Refused
        );
        assert_eq!(embedded.served().load().version, 2, "a refused version changes nothing");

        let directory = tempfile::tempdir().expect("temporary directory");
        let file = directory.path().join("local.yaml");
        std::fs::write(&file, EMBEDDED_POLICY_YAML).expect("write");
        let local = PolicyStore::open(
            PolicyOrigin::Path(file),
            LoadOptions::default(),
            "r",
            "n",
            Metrics::new(),
        )
        .expect("the file loads");
        assert_eq!(local.install_replicated(&version(4, REGION_POLICY)), ReplicatedOutcome::Local);
        assert_eq!(local.region_version(), 4);
        let served = local.served().load_full();
        assert_eq!((served.version, served.source), (0, ServedFrom::Local));
    }
}
