//! How a node learns the region's replicated policy versions and hands them to its policy
//! store (`crate::policy_store`), voters and gateways alike.
//!
//! ```text
//!  voter:    quota apply ──change signal (watch: latest value, never a queue)──▶ follower
//!            ──read the current version from the applied machine──▶ parse (blocking pool)
//!            ──▶ PolicyStore::install_replicated (one Arc swapped)
//!  gateway:  every GATEWAY_POLL_INTERVAL: FetchPolicy(known version) to the leader it last
//!            reached, else the next voter ──version only, or the new version's files──▶
//!            parse ──▶ install
//! ```
//!
//! The Raft apply path only publishes a number on a watch channel; parsing, which may take
//! milliseconds for a large set, happens here, on the blocking pool. A node started after
//! versions were applied installs the latest before it reports ready ([`PolicyFollower::start`]
//! runs one step first): a voter from its own state, a gateway by one fetch (if the voters
//! do not answer it in time, the next poll does).

use std::sync::Arc;
use std::time::Duration;

use tokio::task::JoinHandle;

use crate::config::Role;
use crate::core::policy_versions::StoredPolicyVersion;
use crate::ledger::{QuotaGroup, RaftGroup};
use crate::policy_store::PolicyStore;

/// How often a gateway asks the voters for the current policy version; a poll is a few
/// bytes each way, and a new version reaches the gateway within about this much.
pub const GATEWAY_POLL_INTERVAL: Duration = Duration::from_millis(200);
/// How long one `FetchPolicy` call may take (it carries up to a full policy set).
pub const FETCH_TIMEOUT: Duration = Duration::from_secs(2);

/// Follows the region's policy versions for one node's policy store.
pub struct PolicyFollower {
    store: Arc<PolicyStore>,
    quota: RaftGroup<QuotaGroup>,
    role: Role,
}

impl PolicyFollower {
    /// Installs the region's current version if there is one (before the node is ready),
    /// then follows new versions until `shutdown` resolves.
    pub async fn start(
        store: Arc<PolicyStore>,
        quota: RaftGroup<QuotaGroup>,
        role: Role,
        shutdown: impl Future<Output = ()> + Send + 'static,
    ) -> JoinHandle<()> {
        let follower = Self { store, quota, role };
        follower.step().await;
        tokio::spawn(follower.run(shutdown))
    }

    async fn run(self, shutdown: impl Future<Output = ()> + Send + 'static) {
        tokio::pin!(shutdown);
        let mut changes = self.quota.subscribe_changes();
        loop {
            match self.role {
                Role::Voter => tokio::select! {
                    () = &mut shutdown => return,
                    changed = changes.changed() => if changed.is_err() {
                        // The group stopped; the node is shutting down.
                        return;
                    },
                },
                Role::Gateway => tokio::select! {
                    () = &mut shutdown => return,
                    () = tokio::time::sleep(GATEWAY_POLL_INTERVAL) => {}
                },
            }
            self.step().await;
        }
    }

    /// One look at the region's current version; installs it when it is new here.
    async fn step(&self) {
        let known_version = self.store.region_version();
        let newer = match self.role {
            Role::Voter => self.quota.read(|ledger| {
                let policies = ledger.policies();
                (policies.current_version() > known_version)
                    .then(|| policies.current().cloned())
                    .flatten()
            }),
            Role::Gateway => match self.quota.fetch_policy(known_version, FETCH_TIMEOUT).await {
                Ok(fetched) => fetched.version.filter(|stored| stored.info.version > known_version),
                Err(error) => {
                    tracing::debug!(%error, "policy version poll failed; polling again");
                    None
                }
            },
        };
        if let Some(stored) = newer {
            self.install(stored).await;
        }
    }

    async fn install(&self, stored: StoredPolicyVersion) {
        let store = Arc::clone(&self.store);
        // Parsing is CPU work; keep it off the async workers.
        let installed = tokio::task::spawn_blocking(move || store.install_replicated(&stored));
        if let Err(error) = installed.await {
            tracing::error!(%error, "installing a replicated policy version failed");
        }
    }
}
