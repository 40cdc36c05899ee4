//! Checkers: pure functions from a recorded history (and the final state read after the
//! run) to a verdict. No IO, no clock. Every checker has tests on hand-made bad histories it
//! must flag.

pub mod availability;
pub mod bank;
pub mod fail_closed;
pub mod holds;
pub mod leases;
pub mod linearizable;
pub mod replicas;
pub mod rls;
pub mod well_formed;
pub mod wgl;

use serde::{Deserialize, Serialize};

/// A checker's conclusion, Jepsen's three-valued one.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize, Deserialize)]
#[serde(rename_all = "lowercase")]
pub enum Validity {
    Valid,
    /// A violation of what quotamesh promises.
    Invalid,
    /// The run cannot be judged (a harness fault, missing final state).
    Unknown,
}

/// Problems kept per check; the rest are only counted.
pub const PROBLEMS_KEPT_MAX: usize = 20;

/// One checker's result.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
pub struct CheckResult {
    pub name: String,
    pub validity: Validity,
    /// What the check looked at (operations, entries, reads), for the report.
    pub checked: u64,
    /// How many problems were found; the first [`PROBLEMS_KEPT_MAX`] are in `problems`.
    pub problem_count: u64,
    pub problems: Vec<String>,
}

impl CheckResult {
    /// A result that starts valid; [`Self::problem`] makes it invalid.
    pub fn new(name: &str) -> Self {
        Self {
            name: name.to_owned(),
            validity: Validity::Valid,
            checked: 0,
            problem_count: 0,
            problems: Vec::new(),
        }
    }

    /// Records a violation.
    pub fn problem(&mut self, text: String) {
        self.validity = Validity::Invalid;
        self.note(text);
    }

    /// Records why the check cannot judge, unless it found a violation already.
    pub fn unknown(&mut self, text: String) {
        if self.validity == Validity::Valid {
            self.validity = Validity::Unknown;
        }
        self.note(text);
    }

    fn note(&mut self, text: String) {
        self.problem_count += 1;
        if self.problems.len() < PROBLEMS_KEPT_MAX {
            self.problems.push(text);
        }
    }
}

/// The run's verdict: invalid if any check is, else unknown if any is, else valid.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
pub struct Verdict {
    pub validity: Validity,
    pub checks: Vec<CheckResult>,
}

impl Verdict {
    pub fn of(checks: Vec<CheckResult>) -> Self {
        let worst = |validity| checks.iter().any(|check| check.validity == validity);
        let validity = if worst(Validity::Invalid) {
            Validity::Invalid
        } else if worst(Validity::Unknown) || checks.is_empty() {
            Validity::Unknown
        } else {
            Validity::Valid
        };
        Self { validity, checks }
    }

    /// The process exit code for it: 0 valid, 1 invalid, 2 unknown.
    pub fn exit_code(&self) -> u8 {
        match self.validity {
            Validity::Valid => 0,
            Validity::Invalid => 1,
            Validity::Unknown => 2,
        }
    }
}
