//! The region's replicated policy sets: numbered versions, each with its files, digest,
//! ledger time, operator and message, as the quota ledger keeps them (DESIGN section 7).
//!
//! `quotamesh policy apply` proposes a set of files with the digest the proposing node
//! computed when it validated them (`crate::core::policy`); `policy rollback --to N`
//! proposes "version N again". Applying either here is pure bookkeeping:
//!
//! ```text
//!  apply(files, digest)      digest == current's ──▶ Unchanged(current)   (idempotent)
//!                            otherwise           ──▶ version current + 1 with the files
//!  rollback(to N)            N unknown or its files no longer kept ──▶ refused
//!                            N's digest == current's ──▶ Unchanged(current)
//!                            otherwise           ──▶ version current + 1 with N's files
//! ```
//!
//! History is bounded twice: the files of at most [`POLICY_CONTENTS_KEPT_MAX`] versions (and
//! [`POLICY_CONTENTS_BYTES_MAX`] bytes) are kept, oldest dropped first, the current version's
//! always; the metadata of at most [`POLICY_VERSIONS_MAX`] versions. The versions are
//! numbered by this machine, never by the proposer, so two operators applying at once get
//! two versions in log order, never the same number.
//!
//! No IO, no clock: the time is the command's ledger time. Parsing the files is the caller's
//! (a YAML parse has no place in the Raft apply path); the ledger's state machine
//! (`crate::core::ledger`) carries this as part of its state, and `src/ledger/quota.rs` stores
//! one record per version.

use std::collections::{BTreeMap, BTreeSet};

use serde::{Deserialize, Serialize};

/// Most files in a policy set.
pub const POLICY_FILES_MAX: usize = 256;
/// Longest policy file name, in bytes.
pub const POLICY_FILE_NAME_BYTES_MAX: usize = 256;
/// Largest policy set: names and contents of all its files, in bytes.
pub const POLICY_SET_BYTES_MAX: usize = 2 * 1024 * 1024;
/// Versions whose files are kept (a rollback can go back this far at least).
pub const POLICY_CONTENTS_KEPT_MAX: usize = 100;
/// Most bytes of files kept over all versions; older versions' files go first.
pub const POLICY_CONTENTS_BYTES_MAX: usize = 32 * 1024 * 1024;
/// Versions whose metadata (number, digest, time, operator, message) is kept.
pub const POLICY_VERSIONS_MAX: usize = 10_000;
/// Longest message of a version, in bytes.
pub const POLICY_MESSAGE_BYTES_MAX: usize = 1024;
/// Longest operator name recorded with a version, in bytes.
pub const POLICY_OPERATOR_BYTES_MAX: usize = 256;

// The current version's files are always kept, so the byte bound must hold one full set.
const _: () = assert!(POLICY_SET_BYTES_MAX <= POLICY_CONTENTS_BYTES_MAX);
const _: () = assert!(POLICY_CONTENTS_KEPT_MAX >= 1);
const _: () = assert!(POLICY_CONTENTS_KEPT_MAX <= POLICY_VERSIONS_MAX);

/// `(file name, YAML text)` pairs, in the order the files were read.
pub type PolicyFiles = Vec<(String, String)>;

/// What is recorded of every version, kept longer than its files.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
pub struct PolicyVersionInfo {
    /// 1, 2, ...: assigned in log order.
    pub version: u64,
    /// The policy digest of the files (`quotamesh policy validate` prints it).
    pub digest: u64,
    /// Ledger time the version was committed.
    pub applied_at_ms: u64,
    /// The operator who applied it, as the admin API authenticated them.
    pub applied_by: String,
    /// The operator's message; may be empty.
    pub message: String,
    /// The version whose files this one repeats, for a rollback.
    pub rollback_of: Option<u64>,
    /// Files in the set.
    pub files: u32,
    /// Names and contents of the files, in bytes.
    pub size_bytes: u64,
}

/// One version: its metadata and, while kept, its files.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
pub struct StoredPolicyVersion {
    /// The metadata.
    pub info: PolicyVersionInfo,
    /// The files; `None` once dropped from the retained history.
    pub files: Option<PolicyFiles>,
}

/// What an apply or a rollback did.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize, Deserialize)]
pub struct PolicyApplied {
    /// The current version afterwards.
    pub version: u64,
    /// Its digest.
    pub digest: u64,
    /// False when the set was the current one already, so no version was made.
    pub created: bool,
}

/// Why a policy set or a rollback was refused; it changed nothing.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize, thiserror::Error)]
pub enum PolicySetError {
    /// No file at all.
    #[error("a policy set needs at least one file")]
    NoFiles,
    /// More than [`POLICY_FILES_MAX`] files.
    #[error("{0} policy files, over the maximum of {POLICY_FILES_MAX}")]
    TooManyFiles(usize),
    /// A file name is empty, too long, or appears twice.
    #[error("invalid or duplicate policy file name {0:?}")]
    FileName(String),
    /// Names and contents together exceed [`POLICY_SET_BYTES_MAX`].
    #[error("policy set of {0} bytes, over the maximum of {POLICY_SET_BYTES_MAX}")]
    TooLarge(usize),
    /// The message exceeds [`POLICY_MESSAGE_BYTES_MAX`].
    #[error("message of {0} bytes, over the maximum of {POLICY_MESSAGE_BYTES_MAX}")]
    MessageTooLong(usize),
    /// The operator name exceeds [`POLICY_OPERATOR_BYTES_MAX`].
    #[error("operator name of {0} bytes, over the maximum of {POLICY_OPERATOR_BYTES_MAX}")]
    OperatorTooLong(usize),
    /// A rollback named a version never applied (or whose record was dropped).
    #[error("there is no policy version {0}")]
    UnknownVersion(u64),
    /// A rollback named a version whose files are no longer kept.
    #[error(
        "the files of policy version {0} are no longer kept (the last \
         {POLICY_CONTENTS_KEPT_MAX} versions' are)"
    )]
    ContentDropped(u64),
}

/// Who applies a version and why: the same for an apply and a rollback.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
pub struct PolicyAuthor {
    /// The operator, as the admin API authenticated them.
    pub applied_by: String,
    /// The operator's message; may be empty.
    pub message: String,
}

/// The versions of a region's policy set.
#[derive(Debug, Clone, Default, PartialEq, Eq)]
pub struct PolicyVersions {
    versions: BTreeMap<u64, StoredPolicyVersion>,
    // Derived from `versions`, rebuilt on load:
    /// Bytes of files kept over all versions.
    kept_bytes: usize,
    /// Versions whose files are kept, oldest first.
    kept: BTreeSet<u64>,
    // Not state: what the store has not persisted yet.
    changed: BTreeSet<u64>,
}

/// Checks a set's shape and returns its size in bytes.
///
/// # Errors
/// [`PolicySetError`] naming the first problem.
pub fn check_files(files: &[(String, String)]) -> Result<usize, PolicySetError> {
    if files.is_empty() {
        return Err(PolicySetError::NoFiles);
    }
    if files.len() > POLICY_FILES_MAX {
        return Err(PolicySetError::TooManyFiles(files.len()));
    }
    let mut names = BTreeSet::new();
    let mut total_bytes = 0usize;
    for (name, text) in files {
        if name.is_empty()
            || name.len() > POLICY_FILE_NAME_BYTES_MAX
            || !names.insert(name.as_str())
        {
            return Err(PolicySetError::FileName(name.clone()));
        }
        total_bytes = total_bytes.saturating_add(name.len()).saturating_add(text.len());
    }
    if total_bytes > POLICY_SET_BYTES_MAX {
        return Err(PolicySetError::TooLarge(total_bytes));
    }
    Ok(total_bytes)
}

fn check_author(author: &PolicyAuthor) -> Result<(), PolicySetError> {
    if author.message.len() > POLICY_MESSAGE_BYTES_MAX {
        return Err(PolicySetError::MessageTooLong(author.message.len()));
    }
    if author.applied_by.len() > POLICY_OPERATOR_BYTES_MAX {
        return Err(PolicySetError::OperatorTooLong(author.applied_by.len()));
    }
    Ok(())
}

impl PolicyVersions {
    /// No version yet.
    pub fn new() -> Self {
        Self::default()
    }

    /// Rebuilds the versions from their stored records.
    pub fn from_stored(stored: impl IntoIterator<Item = StoredPolicyVersion>) -> Self {
        let mut versions = Self::default();
        for version in stored {
            versions.insert(version);
        }
        versions
    }

    fn insert(&mut self, stored: StoredPolicyVersion) {
        let version = stored.info.version;
        if let Some(files) = &stored.files {
            self.kept_bytes = self.kept_bytes.saturating_add(files_bytes(files));
            self.kept.insert(version);
        }
        self.versions.insert(version, stored);
    }

    /// The current version, if any was applied.
    pub fn current(&self) -> Option<&StoredPolicyVersion> {
        self.versions.last_key_value().map(|(_, stored)| stored)
    }

    /// The current version's number; 0 before the first.
    pub fn current_version(&self) -> u64 {
        self.versions.last_key_value().map_or(0, |(version, _)| *version)
    }

    /// One version, if its record is kept.
    pub fn get(&self, version: u64) -> Option<&StoredPolicyVersion> {
        self.versions.get(&version)
    }

    /// Every version's metadata, oldest first.
    pub fn history(&self) -> impl DoubleEndedIterator<Item = &PolicyVersionInfo> {
        self.versions.values().map(|stored| &stored.info)
    }

    /// Makes `files` the current set, unless its digest is the current one's.
    ///
    /// # Errors
    /// [`PolicySetError`] for a set or author out of bounds; nothing changed.
    pub fn apply(
        &mut self,
        files: &[(String, String)],
        digest: u64,
        author: &PolicyAuthor,
        now_ms: u64,
    ) -> Result<PolicyApplied, PolicySetError> {
        let size_bytes = check_files(files)?;
        check_author(author)?;
        Ok(self.push(files.to_vec(), size_bytes, digest, author, None, now_ms))
    }

    /// Makes version `to_version`'s files the current set again, as a new version.
    ///
    /// # Errors
    /// [`PolicySetError::UnknownVersion`] or [`PolicySetError::ContentDropped`], or an author
    /// out of bounds; nothing changed.
    pub fn rollback(
        &mut self,
        to_version: u64,
        author: &PolicyAuthor,
        now_ms: u64,
    ) -> Result<PolicyApplied, PolicySetError> {
        check_author(author)?;
        let stored =
            self.versions.get(&to_version).ok_or(PolicySetError::UnknownVersion(to_version))?;
        let files = stored.files.clone().ok_or(PolicySetError::ContentDropped(to_version))?;
        let (digest, size_bytes) = (stored.info.digest, files_bytes(&files));
        Ok(self.push(files, size_bytes, digest, author, Some(to_version), now_ms))
    }

    fn push(
        &mut self,
        files: PolicyFiles,
        size_bytes: usize,
        digest: u64,
        author: &PolicyAuthor,
        rollback_of: Option<u64>,
        now_ms: u64,
    ) -> PolicyApplied {
        if let Some(current) = self.current()
            && current.info.digest == digest
        {
            return PolicyApplied { version: current.info.version, digest, created: false };
        }
        let version = self.current_version().saturating_add(1);
        let info = PolicyVersionInfo {
            version,
            digest,
            applied_at_ms: now_ms,
            applied_by: author.applied_by.clone(),
            message: author.message.clone(),
            rollback_of,
            files: u32::try_from(files.len()).expect("at most POLICY_FILES_MAX files"),
            size_bytes: size_bytes as u64,
        };
        self.insert(StoredPolicyVersion { info, files: Some(files) });
        self.changed.insert(version);
        self.trim();
        PolicyApplied { version, digest, created: true }
    }

    /// Drops the oldest versions' files past the bounds (never the current version's), then
    /// the oldest records past [`POLICY_VERSIONS_MAX`].
    fn trim(&mut self) {
        let current = self.current_version();
        while self.kept.len() > POLICY_CONTENTS_KEPT_MAX
            || self.kept_bytes > POLICY_CONTENTS_BYTES_MAX
        {
            let Some(oldest) = self.kept.first().copied().filter(|oldest| *oldest != current)
            else {
                break;
            };
            self.kept.remove(&oldest);
            let stored = self.versions.get_mut(&oldest).expect("kept versions are in the map");
            let files = stored.files.take().expect("kept versions have their files");
            self.kept_bytes = self.kept_bytes.saturating_sub(files_bytes(&files));
            self.changed.insert(oldest);
        }
        while self.versions.len() > POLICY_VERSIONS_MAX {
            let (oldest, stored) = self.versions.pop_first().expect("more than the maximum");
            if stored.files.is_some() {
                // Only when the content bounds keep more versions than the metadata bound.
                self.kept.remove(&oldest);
                self.kept_bytes =
                    self.kept_bytes.saturating_sub(stored.files.as_deref().map_or(0, files_bytes));
            }
            self.changed.insert(oldest);
        }
    }

    /// Returns and forgets the versions changed since the last call: `None` for a version
    /// whose record was dropped.
    pub fn take_changes(&mut self) -> Vec<(u64, Option<StoredPolicyVersion>)> {
        std::mem::take(&mut self.changed)
            .into_iter()
            .map(|version| (version, self.versions.get(&version).cloned()))
            .collect()
    }

    /// Every stored version, oldest first, for the ledger's digest.
    pub fn stored(&self) -> impl Iterator<Item = &StoredPolicyVersion> {
        self.versions.values()
    }

    /// Whether no version was ever applied.
    pub fn is_empty(&self) -> bool {
        self.versions.is_empty()
    }
}

/// Bytes of a set: names and contents.
fn files_bytes(files: &[(String, String)]) -> usize {
    files.iter().fold(0usize, |total, (name, text)| {
        total.saturating_add(name.len()).saturating_add(text.len())
    })
}

#[cfg(test)]
mod tests {
    use super::*;
    use proptest::prelude::*;

    fn author(message: &str) -> PolicyAuthor {
        PolicyAuthor { applied_by: "ops".to_owned(), message: message.to_owned() }
    }

    fn files(text: &str) -> PolicyFiles {
        vec![("p.yaml".to_owned(), text.to_owned())]
    }

    /// Versions count from 1; the same digest again is no new version; a rollback is a new
    /// version with the old files and records what it rolled back to.
    #[test]
    fn apply_is_idempotent_and_rollback_makes_a_version() {
        let mut versions = PolicyVersions::new();
        assert_eq!(versions.current_version(), 0);
        let first = versions.apply(&files("a"), 0xa, &author("first"), 1_000).expect("valid");
        assert_eq!(first, PolicyApplied { version: 1, digest: 0xa, created: true });
        let again = versions.apply(&files("a # comment"), 0xa, &author("again"), 2_000);
        assert_eq!(again, Ok(PolicyApplied { version: 1, digest: 0xa, created: false }));
        let second = versions.apply(&files("b"), 0xb, &author(""), 3_000).expect("valid");
        assert_eq!(second.version, 2);
        let back = versions.rollback(1, &author("undo"), 4_000).expect("kept");
        assert_eq!(back, PolicyApplied { version: 3, digest: 0xa, created: true });
        let current = versions.current().expect("applied");
        assert_eq!(current.files, Some(files("a")));
        assert_eq!(current.info.rollback_of, Some(1));
        assert_eq!(current.info.applied_at_ms, 4_000);
        assert_eq!(current.info.applied_by, "ops");
        // Rolling back to what is current already changes nothing.
        assert_eq!(
            versions.rollback(3, &author(""), 5_000),
            Ok(PolicyApplied { version: 3, digest: 0xa, created: false })
        );
        assert_eq!(
            versions.rollback(9, &author(""), 5_000),
            Err(PolicySetError::UnknownVersion(9))
        );
        let history: Vec<u64> = versions.history().map(|info| info.version).collect();
        assert_eq!(history, [1, 2, 3]);
    }

    /// Bad sets and authors are refused and change nothing.
    #[test]
    fn bad_input_changes_nothing() {
        let mut versions = PolicyVersions::new();
        versions.apply(&files("a"), 1, &author(""), 0).expect("valid");
        let _ = versions.take_changes();
        let before = versions.clone();
        assert_eq!(versions.apply(&[], 2, &author(""), 0), Err(PolicySetError::NoFiles));
        let twice = vec![("a".to_owned(), String::new()), ("a".to_owned(), String::new())];
        assert_eq!(
            versions.apply(&twice, 2, &author(""), 0),
            Err(PolicySetError::FileName("a".to_owned()))
        );
        let large = files(&"x".repeat(POLICY_SET_BYTES_MAX));
        assert!(matches!(
            versions.apply(&large, 2, &author(""), 0),
            Err(PolicySetError::TooLarge(_))
        ));
        let long = author(&"m".repeat(POLICY_MESSAGE_BYTES_MAX + 1));
        assert!(matches!(
            versions.apply(&files("b"), 2, &long, 0),
            Err(PolicySetError::MessageTooLong(_))
        ));
        assert_eq!(versions, before);
        assert!(versions.take_changes().is_empty());
    }

    /// Files are kept for the last POLICY_CONTENTS_KEPT_MAX versions only; older versions keep
    /// their metadata, and a rollback to them is refused.
    #[test]
    fn history_keeps_the_last_versions_files() {
        let mut versions = PolicyVersions::new();
        let total = POLICY_CONTENTS_KEPT_MAX as u64 + 5;
        for version in 1..=total {
            versions
                .apply(&files(&version.to_string()), version, &author(""), version)
                .expect("ok");
        }
        assert_eq!(versions.history().count() as u64, total);
        assert!(versions.get(5).expect("record").files.is_none());
        assert!(versions.get(6).expect("record").files.is_some());
        assert_eq!(versions.rollback(5, &author(""), 0), Err(PolicySetError::ContentDropped(5)));
        assert_eq!(
            versions.rollback(6, &author(""), 0).map(|applied| applied.version),
            Ok(total + 1)
        );
    }

    /// A model of the versions: the list of (digest, files) of every version made.
    #[derive(Debug, Clone)]
    enum Step {
        Apply(u8),
        Rollback(u64),
    }

    proptest! {
        /// Against a naive model (every version's digest in a list): versions are dense from 1,
        /// a new one is made exactly when the digest differs from the current one, rollbacks
        /// repeat a kept version's files, the retained files stay within their bounds, and a
        /// rebuild from the changed records equals the machine.
        #[test]
        fn versions_follow_the_model(steps in prop::collection::vec(
            prop_oneof![
                3 => (0u8..4).prop_map(Step::Apply),
                1 => (0u64..12).prop_map(Step::Rollback),
            ],
            0..90,
        )) {
            let mut versions = PolicyVersions::new();
            let mut model: Vec<u64> = Vec::new();
            let mut records: BTreeMap<u64, StoredPolicyVersion> = BTreeMap::new();
            for (now_ms, step) in steps.into_iter().enumerate() {
                let now_ms = now_ms as u64;
                let result = match step {
                    Step::Apply(which) => versions.apply(
                        &files(&format!("set {which}")),
                        u64::from(which),
                        &author(""),
                        now_ms,
                    ),
                    Step::Rollback(to) => versions.rollback(to, &author(""), now_ms),
                };
                let wanted = match step {
                    Step::Apply(which) => Some(u64::from(which)),
                    Step::Rollback(to) => model.get((to as usize).wrapping_sub(1)).copied(),
                };
                match (result, wanted) {
                    (Ok(applied), Some(digest)) => {
                        let created = model.last() != Some(&digest);
                        if created {
                            model.push(digest);
                        }
                        prop_assert_eq!(applied.created, created);
                        prop_assert_eq!(applied.version, model.len() as u64);
                        prop_assert_eq!(applied.digest, digest);
                    }
                    (Err(PolicySetError::UnknownVersion(_)), None) => {}
                    (result, wanted) => prop_assert!(false, "{:?} for {:?}", result, wanted),
                }
                for (version, record) in versions.take_changes() {
                    match record {
                        Some(record) => records.insert(version, record),
                        None => records.remove(&version),
                    };
                }
                prop_assert!(versions.kept.len() <= POLICY_CONTENTS_KEPT_MAX);
                let current = versions.current_version();
                prop_assert!(current == 0 || versions.get(current).is_some_and(|s| s.files.is_some()));
                prop_assert_eq!(&PolicyVersions::from_stored(records.values().cloned()), &versions);
            }
        }
    }
}
