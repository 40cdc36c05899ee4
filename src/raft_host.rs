//! The Raft side of one node: the data directory's identity, the Raft groups the node runs
//! (quota, and billing on a voter), and the Raft peer listener they share.
//!
//! ```text
//! start:    claim data_dir (identity.json; a voter claims <data_dir>/quota and
//!           <data_dir>/billing, a gateway quota only) ─▶ load the TLS files ([tls], crate::tls)
//!           ─▶ open <data_dir>/quota (seeds: the voters) ─▶ a voter: open <data_dir>/billing
//!           ─▶ register both with the RaftPeer service ─▶ listen on raft_addr (mTLS with [tls])
//!           ─▶ form what this node forms: a single-node region (a voter without peers) both
//!              groups; with peers, the billing group on the node with billing.bootstrap
//! shutdown: stop every group (storage released) ─▶ stop the RaftPeer listener and the
//!           TLS file poll
//! ```
//!
//! The billing group has the quota group's voters when formed (`raft_node_id`, `[[peers]]`);
//! after that each group's membership changes on its own, through the admin API
//! (`crate::api::admin`), so the two can differ while a change is half done. A group whose
//! storage already holds a membership is never formed again.
//!
//! With `[tls]` every link to and from this node is mutual TLS: the listener accepts only
//! nodes of this cluster and tells the service who each caller is; the channels to peers
//! present this node's certificate. The files are polled and reloaded on change.
//!
//! A gateway (`role = "gateway"`) runs the same quota group handle, opened on its own
//! storage and never initialized: it is no member, so it holds no replica, never votes, and
//! its metrics never name a leader; the handle is its write path only, reaching the leader
//! through its seeds, the configured voters (`crate::ledger::group`). A storage-less client
//! handle would need a second type behind every user of the group (admin, lease broker) for
//! the sake of a few empty files; with the same handle a gateway also stays one membership
//! change (`cluster add-node --learner-only`) away from being a learner with a local
//! replica, which its write path then uses unchanged.
//!
//! The groups themselves (storage, transport, writes) are `crate::ledger`'s; the admin API
//! over them is `crate::api::admin`'s; `crate::node` starts and stops this with the rest.

use std::collections::BTreeMap;
use std::net::SocketAddr;
use std::path::Path;

use tokio::sync::watch;
use tokio::task::JoinHandle;

use crate::config::{NodeConfig, Role};
use crate::identity::{Claim, IdentityError, NodeIdentity};
use crate::ledger::ledger_time::ClockOffsets;
use crate::ledger::service::RegisterError;
use crate::ledger::{
    BILLING_GROUP_NAME, BasicNode, BillingGroup, GroupSettings, MembershipError, NodeId, OpenError,
    PeerChannels, QUOTA_GROUP_NAME, QuotaGroup, RaftGroup, RaftPeerService,
};
use crate::metrics::Metrics;
use crate::tls::credentials::{Accept, Credentials, CredentialsError};

/// Why the Raft side of a node could not start. None of these goes away by retrying as is.
#[derive(Debug, thiserror::Error)]
pub enum RaftHostError {
    /// The data directory belongs to another cluster or node, or is damaged.
    #[error(transparent)]
    Identity(#[from] IdentityError),
    /// The TLS files cannot be used.
    #[error(transparent)]
    Tls(#[from] CredentialsError),
    /// A group's storage could not be opened (corrupt, locked, bad settings).
    #[error("cannot open the {group} Raft group: {source}")]
    Open {
        /// The group.
        group: &'static str,
        /// Why (boxed: openraft's configuration errors are large).
        #[source]
        source: Box<OpenError>,
    },
    /// The Raft peer listener could not be bound.
    #[error("cannot listen for Raft peers on {address}: {source}")]
    Bind {
        /// The address.
        address: SocketAddr,
        /// The IO error.
        #[source]
        source: std::io::Error,
    },
    /// A group could not be registered with the peer service.
    #[error(transparent)]
    Register(#[from] RegisterError),
    /// A group this node forms could not be formed.
    #[error("cannot form the {group} group: {source}")]
    Initialize {
        /// The group.
        group: &'static str,
        /// Why.
        #[source]
        source: MembershipError,
    },
}

/// The Raft groups of a running node and their shared transport.
pub struct RaftHost {
    node_id: NodeId,
    role: Role,
    cluster_id: String,
    raft_addr: SocketAddr,
    advertise_addr: String,
    peers: BTreeMap<NodeId, BasicNode>,
    service: RaftPeerService,
    quota: RaftGroup<QuotaGroup>,
    /// `None` on a gateway: the billing group has voters only.
    billing: Option<RaftGroup<BillingGroup>>,
    stop: watch::Sender<bool>,
    server: JoinHandle<()>,
    credentials: Option<std::sync::Arc<Credentials>>,
    tls_reload: Option<JoinHandle<()>>,
}

impl RaftHost {
    /// Claims the data directory, opens the quota group in `<data_dir>/quota` with the
    /// configured voters as its seeds and, on a voter, the billing group in
    /// `<data_dir>/billing`, serves the Raft peer service on `raft_addr`, and forms the groups
    /// this node forms (see the module's documentation) unless they were formed before. A
    /// gateway never forms a group.
    ///
    /// # Errors
    /// [`RaftHostError`] naming the step that failed; nothing is left running.
    pub async fn start(config: &NodeConfig, metrics: &Metrics) -> Result<Self, RaftHostError> {
        let identity = NodeIdentity::new(config.cluster_id.clone(), config.raft_node_id);
        // A voter runs both groups and claims both directories: one that lost either must
        // not start afresh (it would forget votes and acknowledged entries). A gateway holds
        // no billing replica.
        let groups: &[&str] = match config.role {
            Role::Voter => &[QUOTA_GROUP_NAME, BILLING_GROUP_NAME],
            Role::Gateway => &[QUOTA_GROUP_NAME],
        };
        let claim = crate::identity::claim(&config.data_dir, &identity, groups)?;
        let credentials = match &config.tls {
            Some(tls) => Some(Credentials::load(
                tls.files(),
                &config.cluster_id,
                config.raft_node_id,
                config.is_gateway(),
            )?),
            None => None,
        };
        let channels =
            PeerChannels::new(credentials.as_ref().map(crate::tls::transport::client_config));
        // The handshakes happen now rather than in a gateway's first lease calls.
        channels.connect_early(
            config
                .peers
                .iter()
                .filter(|peer| peer.id != config.raft_node_id)
                .map(|peer| peer.raft_addr.clone()),
        );
        let clock_offsets = ClockOffsets::new(config.max_clock_offset_ms, Some(metrics.clone()));
        let mut settings = quota_settings(config, &config.data_dir);
        settings.clock_offsets = clock_offsets;
        settings.log_fsync_seconds =
            Some(metrics.raft_log_fsync_duration.with_label_values(&[QUOTA_GROUP_NAME]));
        let quota =
            RaftGroup::<QuotaGroup>::open(&settings, channels.clone()).await.map_err(|source| {
                RaftHostError::Open { group: QUOTA_GROUP_NAME, source: Box::new(source) }
            })?;
        let billing = match config.role {
            Role::Gateway => Ok(None),
            Role::Voter => {
                let mut settings = GroupSettings::new(
                    BILLING_GROUP_NAME,
                    config.raft_node_id,
                    config.data_dir.join(BILLING_GROUP_NAME),
                );
                settings.clock_offsets = quota.clock_offsets().clone();
                settings.log_fsync_seconds =
                    Some(metrics.raft_log_fsync_duration.with_label_values(&[BILLING_GROUP_NAME]));
                RaftGroup::<BillingGroup>::open(&settings, channels.clone())
                    .await
                    .map(Some)
                    .map_err(|source| RaftHostError::Open {
                        group: BILLING_GROUP_NAME,
                        source: Box::new(source),
                    })
            }
        };
        let served = match billing {
            Ok(billing) => {
                Self::serve(config, credentials, quota.clone(), billing.clone(), claim, metrics)
                    .await
                    .map_err(|error| (error, billing))
            }
            Err(error) => Err((error, None)),
        };
        match served {
            Ok(host) => Ok(host),
            Err((error, billing)) => {
                // Release the storage so a retry in this process can open it again.
                if let Some(billing) = billing
                    && let Err(shutdown) = billing.shutdown().await
                {
                    tracing::warn!(%shutdown, "billing group did not stop cleanly");
                }
                if let Err(shutdown) = quota.shutdown().await {
                    tracing::warn!(%shutdown, "quota group did not stop cleanly");
                }
                Err(error)
            }
        }
    }

    async fn serve(
        config: &NodeConfig,
        credentials: Option<std::sync::Arc<Credentials>>,
        quota: RaftGroup<QuotaGroup>,
        billing: Option<RaftGroup<BillingGroup>>,
        claim: Claim,
        metrics: &Metrics,
    ) -> Result<Self, RaftHostError> {
        let service = RaftPeerService::new(credentials.is_some()).with_grpc_metrics(metrics);
        if config.is_gateway() {
            // No replica here: its policy answer would be "none" whatever the region holds.
            service.register_group(&quota)?;
        } else {
            service.register_quota_group(&quota)?;
        }
        if let Some(billing) = &billing {
            service.register_group(billing)?;
        }
        let listener = tokio::net::TcpListener::bind(config.raft_addr)
            .await
            .map_err(|source| RaftHostError::Bind { address: config.raft_addr, source })?;
        let raft_addr = listener
            .local_addr()
            .map_err(|source| RaftHostError::Bind { address: config.raft_addr, source })?;
        let advertise_addr = config.raft_advertise_addr();
        if config.role == Role::Voter && config.peers.is_empty() {
            // A single-node region: the group must exist for the node to serve, and with no
            // peers nobody else can form it. Only a group that never had a membership is
            // formed, so this never re-initializes (crate::identity refuses a lost one).
            let initialized = quota
                .is_initialized()
                .await
                .map_err(|source| RaftHostError::Initialize { group: QUOTA_GROUP_NAME, source })?;
            if !initialized {
                let members =
                    BTreeMap::from([(config.raft_node_id, BasicNode::new(advertise_addr.clone()))]);
                quota.initialize(members).await.map_err(|source| RaftHostError::Initialize {
                    group: QUOTA_GROUP_NAME,
                    source,
                })?;
                tracing::info!(node = %config.raft_node_id, ?claim, "formed a single-node quota group");
            }
        }
        if let Some(billing) = &billing {
            form_billing(config, &advertise_addr, billing).await?;
        }
        let (stop, mut stopped) = watch::channel(false);
        let tls = credentials
            .as_ref()
            .map(|credentials| crate::tls::transport::server_config(credentials, Accept::Nodes));
        let tls_reload =
            credentials.clone().zip(config.tls.as_ref()).map(|(credentials, files)| {
                let mut stopped = stopped.clone();
                credentials.watch(
                    std::time::Duration::from_millis(files.reload_interval_ms),
                    async move {
                        let _ = stopped.wait_for(|stop| *stop).await;
                    },
                )
            });
        let server = {
            let service = service.clone();
            tokio::spawn(async move {
                let shutdown = async move {
                    let _ = stopped.wait_for(|stop| *stop).await;
                };
                let served = match tls {
                    Some(tls) => service.serve_tls(listener, tls, shutdown).await,
                    None => service.serve(listener, shutdown).await,
                };
                if let Err(error) = served {
                    tracing::error!(%error, "Raft peer server stopped");
                }
            })
        };
        let peers = config
            .peers
            .iter()
            .map(|peer| (peer.id, BasicNode::new(peer.raft_addr.clone())))
            .collect();
        tracing::info!(%raft_addr, advertise = %advertise_addr, node = %config.raft_node_id, cluster = %config.cluster_id, role = %config.role, tls = config.tls.is_some(), "Raft peer service listening");
        Ok(Self {
            node_id: config.raft_node_id,
            role: config.role,
            cluster_id: config.cluster_id.clone(),
            raft_addr,
            advertise_addr,
            peers,
            service,
            quota,
            billing,
            stop,
            server,
            credentials,
            tls_reload,
        })
    }

    /// This node's Raft id.
    pub fn node_id(&self) -> NodeId {
        self.node_id
    }

    /// Whether this node is a voter of the region's groups or a gateway outside them.
    pub fn role(&self) -> Role {
        self.role
    }

    /// The cluster this node belongs to.
    pub fn cluster_id(&self) -> &str {
        &self.cluster_id
    }

    /// The bound Raft peer address (useful when configured with port 0).
    pub fn raft_addr(&self) -> SocketAddr {
        self.raft_addr
    }

    /// The Raft address the other nodes reach this one at.
    pub fn advertise_addr(&self) -> &str {
        &self.advertise_addr
    }

    /// The configured voters: on a voter, the members `cluster init` forms the group from;
    /// on a gateway, the seeds its writes go through.
    pub fn peers(&self) -> &BTreeMap<NodeId, BasicNode> {
        &self.peers
    }

    /// The quota group.
    pub fn quota(&self) -> &RaftGroup<QuotaGroup> {
        &self.quota
    }

    /// The billing group; `None` on a gateway, which holds no billing replica.
    pub fn billing(&self) -> Option<&RaftGroup<BillingGroup>> {
        self.billing.as_ref()
    }

    /// The node's TLS credentials (`[tls]`), for the other ports that use them.
    pub fn credentials(&self) -> Option<&std::sync::Arc<Credentials>> {
        self.credentials.as_ref()
    }

    /// Stops every group (releasing their storage), then the peer listener: peers keep
    /// reaching this node until its groups have stopped, so a leader's last heartbeats and a
    /// follower's last acknowledgements still flow.
    pub async fn shutdown(self) {
        if let Some(billing) = &self.billing {
            if let Err(error) = billing.shutdown().await {
                tracing::error!(%error, "the billing group did not stop cleanly");
            }
            self.service.unregister(BILLING_GROUP_NAME);
        }
        if let Err(error) = self.quota.shutdown().await {
            tracing::error!(%error, "the quota group did not stop cleanly");
        }
        self.service.unregister(QUOTA_GROUP_NAME);
        let _ = self.stop.send(true);
        let mut server = self.server;
        if tokio::time::timeout(crate::node::SHUTDOWN_DRAIN_TIMEOUT, &mut server).await.is_err() {
            tracing::warn!("the Raft peer server did not drain; closing it");
            server.abort();
            let _ = server.await;
        }
        if let Some(reload) = self.tls_reload {
            let _ = reload.await;
        }
    }
}

/// Forms the billing group when this node is the one to: alone in a single-node region, with
/// every configured voter when it has `billing.bootstrap`. Others wait to be contacted by the
/// leader (formed by the bootstrapping node, or added with `cluster add-node`).
async fn form_billing(
    config: &NodeConfig,
    advertise_addr: &str,
    billing: &RaftGroup<BillingGroup>,
) -> Result<(), RaftHostError> {
    let node_id = config.raft_node_id;
    let members: BTreeMap<NodeId, BasicNode> = if config.peers.is_empty() {
        BTreeMap::from([(node_id, BasicNode::new(advertise_addr))])
    } else if config.billing.bootstrap {
        config.peers.iter().map(|peer| (peer.id, BasicNode::new(peer.raft_addr.clone()))).collect()
    } else {
        return Ok(());
    };
    // Checked first: openraft logs an ERROR when asked to form a group that has formed.
    let initialized = billing
        .is_initialized()
        .await
        .map_err(|source| RaftHostError::Initialize { group: BILLING_GROUP_NAME, source })?;
    if initialized {
        tracing::info!(%node_id, "billing group already formed; not forming it again");
        return Ok(());
    }
    match billing.initialize(members).await {
        Ok(()) => {
            tracing::info!(%node_id, "billing group formed");
            Ok(())
        }
        Err(MembershipError::AlreadyInitialized) => Ok(()),
        Err(source) => Err(RaftHostError::Initialize { group: BILLING_GROUP_NAME, source }),
    }
}

/// The quota group's settings from the node's configuration.
fn quota_settings(config: &NodeConfig, data_dir: &Path) -> GroupSettings {
    let mut settings =
        GroupSettings::new(QUOTA_GROUP_NAME, config.raft_node_id, data_dir.join(QUOTA_GROUP_NAME));
    let group = &config.quota_group;
    settings.heartbeat_interval_ms = group.heartbeat_interval_ms;
    settings.election_timeout_min_ms = group.election_timeout_min_ms;
    settings.election_timeout_max_ms = group.election_timeout_max_ms;
    settings.snapshot_every_logs = group.snapshot_every_logs;
    settings.logs_kept_after_snapshot = group.logs_kept_after_snapshot;
    // A gateway reaches the leader through the voters; a voter uses them only while it is
    // not a member yet (the group drops this node's own entry).
    settings.seeds =
        config.peers.iter().map(|peer| (peer.id, BasicNode::new(peer.raft_addr.clone()))).collect();
    settings
}
