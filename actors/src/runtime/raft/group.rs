//! [`ControllerGroup`]: what the node uses of the replicated controller. With one controller it is the
//! catalog itself (no Raft, no traffic: today's behaviour); with several, a Raft group whose leader is
//! the controller: [`ControllerGroup::propose`] returns once a majority committed the write (and this
//! node applied it), [`ControllerGroup::leadership`] reports (term, leader) changes,
//! [`ControllerGroup::state`] reads the replicated catalog after catching up with the leader.

use std::collections::{BTreeMap, BTreeSet};
use std::sync::Arc;
use std::time::Duration;

use openraft::error::{ClientWriteError, RaftError};
use openraft::{ChangeMembers, Config, SnapshotPolicy};
use tokio::sync::watch;
use tokio::task::JoinHandle;
use troupe_cluster::control::ControlEndpoint;

use super::machine::StateMachine;
use super::network::{serve, Network, RaftEndpoint, Rpcs};
use super::store::LogStore;
use super::{node_id, Controller, NodeId, Raft, StorageError};
use crate::catalog::{Catalog, CatalogWrite, StoredJob, StoredView};
use crate::protocol::{ControllerInfo, ControllersChange, ControllersStatus};

/// The group's timing (docs/runtime-semantics.md, "Replicated controller (Raft)").
#[derive(Clone, Debug)]
pub struct RaftTimeouts {
    /// The leader's heartbeat to each follower.
    pub heartbeat_ms: u64,
    /// A follower that heard no leader for a random time in `election_min_ms..election_max_ms` stands.
    pub election_min_ms: u64,
    pub election_max_ms: u64,
    /// How long [`ControllerGroup::propose`] waits for a majority before giving up.
    pub propose_ms: u64,
    /// A snapshot is built every this many applied entries (and the log before it purged).
    pub snapshot_every: u64,
}

impl Default for RaftTimeouts {
    fn default() -> Self {
        RaftTimeouts {
            heartbeat_ms: 100,
            election_min_ms: 400,
            election_max_ms: 800,
            propose_ms: 5_000,
            snapshot_every: 1_000,
        }
    }
}

/// The group a node starts with.
#[derive(Clone, Debug)]
pub struct GroupConfig {
    /// This node's name (node.toml `name`, the name in its certificate).
    pub name: String,
    /// Every controller of the initial group with its Raft address (node.toml `controllers`). The
    /// lowest-named initialises the membership, once.
    pub controllers: Vec<Controller>,
    pub timeouts: RaftTimeouts,
}

/// Who leads, as this node last learnt it. `term` is Raft's: every election raises it.
#[derive(Clone, Debug, Default, PartialEq, Eq)]
pub struct Leadership {
    pub term: u64,
    pub leader: Option<String>,
}

#[derive(Debug, thiserror::Error)]
pub enum ProposeError {
    /// Only the leader commits: send the write to `leader` (none known yet during an election).
    #[error("this node is not the controller; the controller is {}", leader.as_deref().unwrap_or("not known yet (an election is under way)"))]
    NotLeader { leader: Option<String> },
    /// No majority answered in time (this node may be cut off with a minority).
    #[error("not committed within {0:?}: no majority of the controllers answered")]
    NotCommitted(Duration),
    #[error("the change of controllers was refused: {0}")]
    Membership(String),
    #[error("the Raft group stopped: {0}")]
    Stopped(String),
    #[error(transparent)]
    Catalog(#[from] anyhow::Error),
}

pub struct ControllerGroup {
    name: String,
    catalog: Catalog,
    leadership: watch::Receiver<Leadership>,
    /// Keeps the single controller's leadership channel open.
    _single: Option<watch::Sender<Leadership>>,
    replicated: Option<Replicated>,
}

struct Replicated {
    raft: Raft,
    endpoint: ControlEndpoint,
    tasks: Vec<JoinHandle<()>>,
    propose: Duration,
}

impl ControllerGroup {
    /// One controller: writes go straight to the catalog; this node leads, for ever, in term 0.
    pub fn single(name: &str, catalog: Catalog) -> Self {
        let (tx, leadership) = watch::channel(Leadership { term: 0, leader: Some(name.into()) });
        ControllerGroup { name: name.into(), catalog, leadership, _single: Some(tx), replicated: None }
    }

    /// Several controllers: starts this node's Raft over `endpoint` and, on the lowest-named
    /// controller, initialises the membership unless it was (an error for anything but "already").
    pub async fn replicated(endpoint: RaftEndpoint, catalog: Catalog, config: GroupConfig) -> anyhow::Result<Self> {
        anyhow::ensure!(
            config.controllers.len() >= 2,
            "controllers: a Raft group needs 2 or more (1 is the single controller: ControllerGroup::single)"
        );
        let ids: BTreeSet<NodeId> = config.controllers.iter().map(|c| node_id(&c.name)).collect();
        anyhow::ensure!(
            ids.len() == config.controllers.len(),
            "controllers: two names listed twice or with colliding Raft ids: {:?}",
            config.controllers
        );
        let t = &config.timeouts;
        let raft_config = Config {
            cluster_name: "troupe-controllers".into(),
            heartbeat_interval: t.heartbeat_ms,
            election_timeout_min: t.election_min_ms,
            election_timeout_max: t.election_max_ms,
            snapshot_policy: SnapshotPolicy::LogsSinceLast(t.snapshot_every),
            max_in_snapshot_log_to_keep: t.snapshot_every,
            ..Default::default()
        };
        let raft_config = Arc::new(raft_config.validate()?);
        warn_if_configured_differs(&catalog, &config);
        let me = node_id(&config.name);
        let RaftEndpoint { endpoint, events } = endpoint;
        let rpcs = Rpcs::new(me, endpoint.clone());
        let network = Network { rpcs: rpcs.clone() };
        let raft =
            Raft::new(me, raft_config, network, LogStore::new(&catalog), StateMachine::new(catalog.clone())).await?;
        let (tx, leadership) = watch::channel(Leadership::default());
        let tasks = vec![
            tokio::spawn(serve(rpcs.clone(), events, raft.clone())),
            tokio::spawn(report_leadership(raft.clone(), tx)),
            tokio::spawn(keep_connected(raft.clone(), rpcs, config.controllers.clone())),
        ];
        let lowest = config.controllers.iter().map(|c| c.name.as_str()).min();
        if lowest == Some(config.name.as_str()) && !raft.is_initialized().await? {
            let members: BTreeMap<NodeId, Controller> =
                config.controllers.iter().map(|c| (node_id(&c.name), c.clone())).collect();
            match raft.initialize(members).await {
                Ok(()) | Err(RaftError::APIError(openraft::error::InitializeError::NotAllowed(_))) => {}
                Err(e) => anyhow::bail!("initialising the controllers' Raft group: {e}"),
            }
        }
        let propose = Duration::from_millis(t.propose_ms);
        let replicated = Some(Replicated { raft, endpoint, tasks, propose });
        Ok(ControllerGroup { name: config.name, catalog, leadership, _single: None, replicated })
    }

    pub fn name(&self) -> &str {
        &self.name
    }

    /// Whether this is a Raft group (several controllers), not the single controller's catalog.
    pub fn is_replicated(&self) -> bool {
        self.replicated.is_some()
    }

    /// (term, leader) as it changes; the first value is the current one.
    pub fn leadership(&self) -> watch::Receiver<Leadership> {
        self.leadership.clone()
    }

    /// Whether this node is the controller now.
    pub fn is_leader(&self) -> bool {
        self.leadership.borrow().leader.as_deref() == Some(self.name.as_str())
    }

    /// This node's catalog: what it applied so far (on a follower, possibly behind the leader).
    pub fn catalog(&self) -> &Catalog {
        &self.catalog
    }

    /// Writes `write` to the catalog once a majority of the controllers committed it, and returns once
    /// this node (the leader) applied it. A follower answers `NotLeader` naming the leader.
    pub async fn propose(&self, write: CatalogWrite) -> Result<(), ProposeError> {
        let Some(r) = &self.replicated else {
            let catalog = self.catalog.clone();
            return tokio::task::spawn_blocking(move || catalog.apply(&write))
                .await
                .map_err(|e| ProposeError::Stopped(e.to_string()))?
                .map_err(ProposeError::Catalog);
        };
        match tokio::time::timeout(r.propose, r.raft.client_write(write)).await {
            Ok(Ok(_)) => Ok(()),
            Ok(Err(e)) => Err(write_error(e)),
            Err(_) => Err(ProposeError::NotCommitted(r.propose)),
        }
    }

    /// The replicated state on the leader: waits until this node applied everything committed before
    /// the call (openraft's `ensure_linearizable`), then reads the catalog. A follower answers
    /// `NotLeader`. For the take-over: a new leader restores its jobs from this.
    pub async fn state(&self) -> Result<(Option<StoredView>, Vec<StoredJob>), ProposeError> {
        if let Some(r) = &self.replicated {
            let read = r.raft.ensure_linearizable();
            match tokio::time::timeout(r.propose, read).await {
                Ok(Ok(_)) => {}
                Ok(Err(RaftError::APIError(openraft::error::CheckIsLeaderError::ForwardToLeader(f)))) => {
                    return Err(ProposeError::NotLeader { leader: f.leader_node.map(|n| n.name) })
                }
                Ok(Err(e)) => return Err(ProposeError::Stopped(e.to_string())),
                Err(_) => return Err(ProposeError::NotCommitted(r.propose)),
            }
        }
        Ok((self.catalog.view()?, self.catalog.jobs()?))
    }

    /// The voting controllers as this node knows them (the membership last appended to its log), by name.
    pub fn controllers(&self) -> Vec<String> {
        match &self.replicated {
            Some(r) => self.membership(r).0,
            None => vec![self.name.clone()],
        }
    }

    /// The group as this node sees it (`troupe cluster controllers`): term, leader, its log's last
    /// index, each voter and learner with the index the leader knows it holds (on the leader only).
    pub fn status(&self) -> ControllersStatus {
        let Some(r) = &self.replicated else {
            let me = ControllerInfo { name: self.name.clone(), raft_addr: None, matched: None };
            let leader = Some(self.name.clone());
            return ControllersStatus {
                node: self.name.clone(),
                replicated: false,
                term: 0,
                leader,
                last_log_index: None,
                controllers: vec![me],
                learners: Vec::new(),
            };
        };
        let metrics = r.raft.metrics();
        let m = metrics.borrow();
        let membership = m.membership_config.membership();
        let name_of = |id: &NodeId| membership.get_node(id).map(|n| n.name.clone());
        let info = |id: NodeId| {
            let node = membership.get_node(&id)?;
            let matched = m.replication.as_ref().and_then(|r| r.get(&id).cloned().flatten()).map(|l| l.index);
            Some(ControllerInfo { name: node.name.clone(), raft_addr: Some(node.addr.clone()), matched })
        };
        let mut controllers: Vec<ControllerInfo> = membership.voter_ids().filter_map(info).collect();
        let mut learners: Vec<ControllerInfo> = membership.learner_ids().filter_map(info).collect();
        controllers.sort_by(|a, b| a.name.cmp(&b.name));
        learners.sort_by(|a, b| a.name.cmp(&b.name));
        ControllersStatus {
            node: self.name.clone(),
            replicated: true,
            term: m.current_term,
            leader: leader_id(&m).as_ref().and_then(name_of),
            last_log_index: m.last_log_index,
            controllers,
            learners,
        }
    }

    /// `troupe cluster controllers add|remove` on the leader. `members`: the nodes of the cluster's
    /// current view; only one of them can be added (it holds a certificate and runs a daemon).
    pub async fn change(&self, change: ControllersChange, members: &[String]) -> Result<(), ProposeError> {
        match change {
            ControllersChange::Add { node, raft_addr } => {
                if !members.contains(&node) {
                    let shown = raft_addr.map_or("HOST:PORT".to_owned(), |a| a.to_string());
                    return Err(ProposeError::Membership(format!(
                        "{node} is not a member of the cluster (members: {}): issue it a certificate \
                         (`troupe cluster add-node {node}`), start its daemon with `join` and `raft_listen = \
                         \"{shown}\"` in its node.toml, then add it",
                        members.join(", ")
                    )));
                }
                let Some(raft_addr) = raft_addr else {
                    self.not_voting(&node)?;
                    return Err(ProposeError::Membership(format!(
                        "{node}'s daemon announced no Raft address: start it with `raft_listen = \"HOST:PORT\"` \
                         (a port of its own) in its node.toml, or give the address as `--address HOST:PORT`. \
                         Nothing changed"
                    )));
                };
                self.add_controller(Controller { name: node, addr: raft_addr.to_string() }).await
            }
            ControllersChange::Remove { node } => self.remove_controller(&node).await,
        }
    }

    /// Refuses a node that votes already, naming the voters.
    fn not_voting(&self, name: &str) -> Result<(), ProposeError> {
        let (voters, _) = self.membership(self.raft_group()?);
        if !voters.iter().any(|v| v == name) {
            return Ok(());
        }
        Err(ProposeError::Membership(format!(
            "{name} is already a controller (the controllers are {})",
            voters.join(", ")
        )))
    }

    /// Adds `controller` as a voter by joint consensus: it catches up as a learner first, then votes.
    /// On the leader. Refused, with nothing changed: a node that already votes, an address another
    /// controller has; a learner that did not catch up within `propose_ms` is removed again.
    pub async fn add_controller(&self, controller: Controller) -> Result<(), ProposeError> {
        let r = self.raft_group()?;
        let id = node_id(&controller.name);
        self.not_voting(&controller.name)?;
        let (_, nodes) = self.membership(r);
        if let Some(other) = nodes.iter().find(|n| n.addr == controller.addr && n.name != controller.name) {
            return Err(ProposeError::Membership(format!(
                "{} is the Raft address of {}; give {} its own (its node.toml `raft_listen`)",
                controller.addr, other.name, controller.name
            )));
        }
        let addr = controller.addr.clone();
        let learner = tokio::time::timeout(r.propose, r.raft.add_learner(id, controller.clone(), true)).await;
        let why = match learner {
            Ok(Ok(_)) => None,
            Ok(Err(e)) => match write_error(e) {
                e @ (ProposeError::NotLeader { .. } | ProposeError::Stopped(_)) => return Err(e),
                e => Some(e.to_string()),
            },
            Err(_) => Some(format!("it did not catch up within {:?}", r.propose)),
        };
        if let Some(why) = why {
            // Nothing changed: the learner that cannot be reached leaves the membership again.
            let undo = ChangeMembers::RemoveNodes(BTreeSet::from([id]));
            let _ = tokio::time::timeout(r.propose, r.raft.change_membership(undo, false)).await;
            return Err(ProposeError::Membership(format!(
                "{}'s Raft endpoint at {addr} did not join as a learner ({why}); is {addr} its node.toml \
                 `raft_listen`, and its daemon running? Nothing changed",
                controller.name
            )));
        }
        let change = ChangeMembers::AddVoterIds(BTreeSet::from([id]));
        let voted = tokio::time::timeout(r.propose, r.raft.change_membership(change, false)).await;
        voted.map_err(|_| ProposeError::NotCommitted(r.propose))?.map_err(write_error)?;
        Ok(())
    }

    /// Removes the controller called `name` from the voters (joint consensus). On the leader; removing
    /// the leader itself makes it step down once the change is committed, and the others elect one.
    /// Refused, with nothing changed: a node that is not a controller, the last controller.
    pub async fn remove_controller(&self, name: &str) -> Result<(), ProposeError> {
        let r = self.raft_group()?;
        let (voters, _) = self.membership(r);
        if !voters.iter().any(|v| v == name) {
            return Err(ProposeError::Membership(format!(
                "{name} is not a controller (the controllers are {})",
                voters.join(", ")
            )));
        }
        if voters.len() <= 1 {
            return Err(ProposeError::Membership(format!(
                "{name} is the last controller: a cluster needs one; add another first"
            )));
        }
        let change = ChangeMembers::RemoveVoters(BTreeSet::from([node_id(name)]));
        let removed = r.raft.change_membership(change, false);
        tokio::time::timeout(r.propose, removed)
            .await
            .map_err(|_| ProposeError::NotCommitted(r.propose))?
            .map_err(write_error)?;
        Ok(())
    }

    /// The voters' names (sorted) and every node of the membership, voters and learners.
    fn membership(&self, r: &Replicated) -> (Vec<String>, Vec<Controller>) {
        let metrics = r.raft.metrics();
        let m = metrics.borrow();
        let membership = m.membership_config.membership();
        let mut voters: Vec<String> =
            membership.voter_ids().filter_map(|id| membership.get_node(&id).map(|n| n.name.clone())).collect();
        voters.sort();
        (voters, membership.nodes().map(|(_, n)| n.clone()).collect())
    }

    fn raft_group(&self) -> Result<&Replicated, ProposeError> {
        self.replicated.as_ref().ok_or_else(|| {
            ProposeError::Membership(
                "a single controller has no Raft group: list 3 or 5 in node.toml `controllers`".into(),
            )
        })
    }

    /// Stops Raft and closes the group's endpoint (peers see this node depart).
    pub async fn shutdown(&self) {
        let Some(r) = &self.replicated else { return };
        if let Err(e) = r.raft.shutdown().await {
            tracing::warn!(error = %e, "raft: shutdown");
        }
        for task in &r.tasks {
            task.abort();
        }
        r.endpoint.close().await;
    }
}

/// The voting controllers of the membership this node's catalog holds as applied (so committed), with
/// their Raft addresses; empty before the group was initialised (or on a node never in it).
pub fn committed_controllers(catalog: &Catalog) -> Result<Vec<Controller>, StorageError> {
    let (_, stored) = StateMachine::new(catalog.clone()).applied()?;
    let membership = stored.membership();
    let mut voters: Vec<Controller> =
        membership.voter_ids().filter_map(|id| membership.get_node(&id).cloned()).collect();
    voters.sort_by(|a, b| a.name.cmp(&b.name));
    Ok(voters)
}

/// The committed membership wins over node.toml's `controllers` (the initial set): a restarted node
/// whose node.toml lists others says so, naming both lists.
fn warn_if_configured_differs(catalog: &Catalog, config: &GroupConfig) {
    let committed = match committed_controllers(catalog) {
        Ok(voters) => voters.into_iter().map(|c| c.name).collect::<Vec<_>>(),
        Err(e) => return tracing::warn!(node = %config.name, "reading the committed controllers: {e}"),
    };
    let mut configured: Vec<String> = config.controllers.iter().map(|c| c.name.clone()).collect();
    configured.sort();
    if let Some(warning) = crate::node_config::controllers::committed_differs(&configured, &committed) {
        tracing::warn!(node = %config.name, "{warning}");
    }
}

fn write_error(e: RaftError<NodeId, ClientWriteError<NodeId, Controller>>) -> ProposeError {
    match e {
        RaftError::APIError(ClientWriteError::ForwardToLeader(f)) => {
            ProposeError::NotLeader { leader: f.leader_node.map(|n| n.name) }
        }
        RaftError::APIError(ClientWriteError::ChangeMembershipError(e)) => ProposeError::Membership(e.to_string()),
        RaftError::Fatal(e) => ProposeError::Stopped(e.to_string()),
    }
}

/// The leader as openraft's metrics name it — but a leader removed from the voters steps down keeping
/// its own committed vote, which the metrics still name: this node leads only in the Leader state.
fn leader_id(m: &openraft::RaftMetrics<NodeId, Controller>) -> Option<NodeId> {
    m.current_leader.filter(|id| *id != m.id || m.state == openraft::ServerState::Leader)
}

/// Publishes (term, leader name) whenever Raft's metrics change them.
async fn report_leadership(raft: Raft, tx: watch::Sender<Leadership>) {
    let mut metrics = raft.metrics();
    loop {
        let now = {
            let m = metrics.borrow_and_update();
            let leader =
                leader_id(&m).and_then(|id| m.membership_config.membership().get_node(&id).map(|n| n.name.clone()));
            Leadership { term: m.current_term, leader }
        };
        tx.send_if_modified(|old| {
            let changed = *old != now;
            *old = now;
            changed
        });
        if metrics.changed().await.is_err() {
            return;
        }
    }
}

/// Pause between checks that every higher-named member is connected.
const CONNECT_EVERY: Duration = Duration::from_millis(100);
/// How long one dial of the connector may take before it is tried again.
const DIAL_MS: u64 = 1_000;

/// Dials every member (voter or learner) named higher than this node that is not connected (see
/// `network`), and the controllers of node.toml (`seeds`) not in the membership: a node being added
/// knows no membership until the leader reaches it, and the leader dials it only if named lower.
async fn keep_connected(raft: Raft, rpcs: Arc<Rpcs>, seeds: Vec<Controller>) {
    let metrics = raft.metrics();
    loop {
        let mut members: Vec<Controller> =
            metrics.borrow().membership_config.membership().nodes().map(|(_, n)| n.clone()).collect();
        for seed in &seeds {
            if !members.iter().any(|m| m.name == seed.name) {
                members.push(seed.clone());
            }
        }
        let dials = members.iter().map(|peer| {
            let rpcs = rpcs.clone();
            async move {
                let _ = tokio::time::timeout(Duration::from_millis(DIAL_MS), rpcs.ensure_connected(peer)).await;
            }
        });
        futures::future::join_all(dials).await;
        tokio::time::sleep(CONNECT_EVERY).await;
    }
}
