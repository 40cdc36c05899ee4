//! How a node logs: the default filter (dependencies at WARN, quotamesh at INFO), colour only
//! on a terminal, text or JSON lines on stderr, and the openraft events that are expected in
//! a healthy region and so must not read as errors. `main.rs` calls [`init`] once.
//!
//! openraft logs some expected events at ERROR itself, with no setting to change that:
//! - `RPCError` from its replication task, for every append or heartbeat to a follower that
//!   timed out or could not be reached (a busy follower misses openraft's 50 ms heartbeat
//!   deadline now and then; a follower that is down fails every call), together with
//!   `error replication to target=...`, `update progress error ...` and `heartbeat error: ...`
//!   lines at WARN for the same call;
//! - `while requesting vote` and `timeout` from a candidate whose vote request to a peer
//!   failed or timed out (an election on a loaded machine);
//! - `...: to-Raft tx send error`, when a caller of `Raft::with_raft_state` stopped waiting
//!   (quotamesh bounds its calls into openraft with deadlines; the answer is no longer wanted);
//! - `Can not initialize`, when a group that already has a membership is asked to form.
//!
//! A tracing layer cannot lower an event's level, so [`ExpectedOpenraftEvents`] drops those
//! events instead, and quotamesh logs each case itself at the level it deserves:
//! `crate::ledger::network` a WARN naming the follower, at most once per
//! [`PEER_FAILURE_LOG_INTERVAL`] per follower; the callers of `initialize` check first and
//! log an already-formed group at INFO. openraft's storage errors and everything else pass.

use std::io::IsTerminal;
use std::time::Duration;

use tracing::field::{Field, Visit};
use tracing::{Event, Level, Subscriber};
use tracing_subscriber::layer::{Context, Layer, SubscriberExt};
use tracing_subscriber::util::SubscriberInitExt;
use tracing_subscriber::{EnvFilter, fmt};

use crate::cli::LogFormat;

/// The filter when neither `--log-filter` nor `RUST_LOG` sets one: quotamesh's own events at
/// INFO, every dependency's (openraft's state dumps, tonic, hyper, sled) at WARN.
pub const DEFAULT_FILTER: &str = "warn,quotamesh=info";

/// The shortest interval between two WARN lines about failed Raft calls to one follower;
/// the calls failed meanwhile are counted in the next line.
pub const PEER_FAILURE_LOG_INTERVAL: Duration = Duration::from_secs(10);

/// Installs the process's tracing subscriber, writing to stderr. `filter` (from
/// `--log-filter`) beats `RUST_LOG`, which beats [`DEFAULT_FILTER`]; an invalid filter falls
/// back to the default with a warning.
pub fn init(format: LogFormat, filter: Option<&str>) {
    let requested = filter.map(str::to_owned).or_else(|| std::env::var("RUST_LOG").ok());
    let (filter, refused) = match requested.as_deref().map(EnvFilter::try_new) {
        None => (EnvFilter::new(DEFAULT_FILTER), None),
        Some(Ok(filter)) => (filter, None),
        Some(Err(error)) => (EnvFilter::new(DEFAULT_FILTER), Some(error)),
    };
    // Colour codes only where a person reads them: not in files, pipes or container logs.
    let ansi = std::io::stderr().is_terminal();
    let registry = tracing_subscriber::registry().with(ExpectedOpenraftEvents).with(filter);
    match format {
        LogFormat::Text => {
            registry.with(fmt::layer().with_writer(std::io::stderr).with_ansi(ansi)).init()
        }
        LogFormat::Json => {
            registry.with(fmt::layer().json().with_writer(std::io::stderr).with_ansi(false)).init()
        }
    }
    if let Some(error) = refused {
        tracing::warn!(%error, default = DEFAULT_FILTER, "invalid log filter; using the default");
    }
}

/// Drops the openraft events listed in the module documentation.
pub struct ExpectedOpenraftEvents;

impl<S: Subscriber> Layer<S> for ExpectedOpenraftEvents {
    fn event_enabled(&self, event: &Event<'_>, _context: Context<'_, S>) -> bool {
        let metadata = event.metadata();
        if !metadata.target().starts_with("openraft") {
            return true;
        }
        let mut message = MessageField(String::new());
        event.record(&mut message);
        !is_expected_openraft_event(*metadata.level(), &message.0)
    }
}

/// Whether an openraft event at `level` with `message` is one quotamesh logs itself.
pub fn is_expected_openraft_event(level: Level, message: &str) -> bool {
    if level == Level::ERROR {
        ["RPCError", "Can not initialize", "while requesting vote", "timeout"].contains(&message)
            || message.ends_with(": to-Raft tx send error")
    } else if level == Level::WARN {
        // Logged before the error is told apart: a storage error is logged again at ERROR.
        ["error replication to target=", "update progress error", "heartbeat error:"]
            .iter()
            .any(|prefix| message.starts_with(prefix))
    } else {
        false
    }
}

/// Collects an event's `message` field.
struct MessageField(String);

impl Visit for MessageField {
    fn record_str(&mut self, field: &Field, value: &str) {
        if field.name() == "message" {
            value.clone_into(&mut self.0);
        }
    }

    fn record_debug(&mut self, field: &Field, value: &dyn std::fmt::Debug) {
        if field.name() == "message" {
            self.0 = format!("{value:?}");
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    /// Only the expected replication and initialization events are dropped; a storage error
    /// from the same replication task is not.
    #[test]
    fn expected_openraft_events() {
        assert!(is_expected_openraft_event(Level::ERROR, "RPCError"));
        assert!(is_expected_openraft_event(Level::ERROR, "Can not initialize"));
        assert!(is_expected_openraft_event(Level::ERROR, "while requesting vote"));
        assert!(is_expected_openraft_event(
            Level::ERROR,
            "openraft::raft::Raft<_>::with_raft_state: to-Raft tx send error"
        ));
        assert!(!is_expected_openraft_event(Level::ERROR, "rx recv error"));
        assert!(is_expected_openraft_event(Level::WARN, "error replication to target=2"));
        assert!(is_expected_openraft_event(Level::WARN, "update progress error request_id=1"));
        assert!(is_expected_openraft_event(Level::WARN, "heartbeat error: NetworkError: x"));
        assert!(!is_expected_openraft_event(Level::WARN, "A message will be ignored"));
        assert!(!is_expected_openraft_event(Level::ERROR, "error replication to target=2"));
        assert!(!is_expected_openraft_event(Level::ERROR, "RaftCore stopped"));
        assert!(!is_expected_openraft_event(Level::INFO, "RPCError"));
    }

    /// The layer drops the openraft events it should, by target and message, and nothing
    /// logged by quotamesh.
    #[test]
    fn layer_drops_only_openraft_events() {
        use std::sync::Arc;
        use std::sync::atomic::{AtomicUsize, Ordering};

        struct Count(Arc<AtomicUsize>);
        impl<S: Subscriber> Layer<S> for Count {
            fn on_event(&self, _event: &Event<'_>, _context: Context<'_, S>) {
                self.0.fetch_add(1, Ordering::Relaxed);
            }
        }
        let seen = Arc::new(AtomicUsize::new(0));
        let subscriber = tracing_subscriber::registry()
            .with(ExpectedOpenraftEvents)
            .with(Count(Arc::clone(&seen)));
        tracing::subscriber::with_default(subscriber, || {
            tracing::error!(target: "openraft::replication", err = "timeout", "RPCError");
            tracing::error!(target: "openraft::engine::engine_impl", "Can not initialize");
            tracing::error!(target: "quotamesh::ledger", "RPCError");
            tracing::error!(target: "openraft::replication", "error replication to target=2");
        });
        assert_eq!(seen.load(Ordering::Relaxed), 2);
    }
}
