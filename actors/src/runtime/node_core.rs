//! The node's decisions, sans-IO: [`NodeCore`] takes what happened (a control message, a connection
//! made or lost, a tick, a worker's failure, a job controller's event) with the time, and queues what
//! to do about it as [`NodeAction`]s. [`super::node::NodeActor`] is the shell that carries them out
//! (sockets, the catalog, spawning actors, metrics); the deterministic simulation (chaos-tests/src/sim)
//! drives the same core on virtual time. Architecture Invariant: everything the node *decides* —
//! admission of job messages, fencing, adopting a view or a connection, routing to workers and job
//! controllers, what a restarted controller resumes — is here, so the simulation checks the code
//! that ships; the shell decides nothing.
//!
//! Order: the shell carries out actions in the order they are queued, each to completion before the
//! next. [`NodeAction::RecordView`] therefore lands in the catalog before the messages that announce the
//! view ("record before announce"), and a [`NodeAction::StartJob`] is answered ([`NodeCore::job_started`])
//! before anything else reaches the core.

use std::collections::{BTreeMap, VecDeque};
use std::net::SocketAddr;
use std::time::Duration;

use troupe_cluster::control::PeerRole;
use troupe_cluster::membership::{
    Change, Epoch, MemberAction, MemberState, Membership, MembershipAction, MembershipConfig, MembershipEvent, NodeId,
    View,
};

use super::event_log::EventLog;
use super::job::{JobDriver, RESUME_GRACE};
use super::messages::{JobMsg, WorkerMsg};
use crate::catalog::{StoredJob, StoredView};
use crate::node_config::restart::{Decision, RestartPolicy, RestartTracker};
use crate::protocol::{
    AttemptOutcome, ClusterStatus, ControllersChange, DataPlane, JobEvent, JobId, JobInfo, JobSpec, JobState,
    MemberInfo, NodeLoad, Reply, Request, SlotDevice, ToController, ToNode, Wire,
};

/// Membership changes kept for `troupe status`.
const CHANGES_KEPT: usize = 64;

/// Replicated controllers: how often a node not yet admitted asks the daemon it joins for its status
/// again ([`NodeCore::ask_for_daemons`]); its `Join` goes every heartbeat interval.
const ASK_DAEMONS_EVERY: Duration = Duration::from_secs(5);

/// Replicated controllers: how long a member waits for a controller of the list it tries (no leader
/// named) to answer its dial before it tries the next. A live one answers in milliseconds; one gone for
/// good would hold the member for the whole connect timeout (found by the simulation).
const CANDIDATE_DIAL: Duration = Duration::from_secs(1);

/// What the core needs to know of its node (from `node.toml` and the endpoint).
#[derive(Clone, Debug)]
pub struct NodeSettings {
    pub id: NodeId,
    /// This node's control address: what its `Join` announces, and the controller's address on the
    /// controller.
    pub addr: SocketAddr,
    /// The controller to join; `None` on the controller (or, with replicated controllers, on a
    /// controller-eligible node: it learns the leader from its Raft group).
    pub join: Option<SocketAddr>,
    pub slots: u32,
    /// What each slot computes on (announced in the `Join`: `MemberInfo::devices`).
    pub devices: Vec<SlotDevice>,
    pub allow_plaintext_tcp: bool,
    pub membership: MembershipConfig,
    pub restart: RestartPolicy,
    /// The controller-eligible nodes (node.toml `controllers`) by name. Two or more: the controller is
    /// replicated — a listed node is the controller only while its Raft group leads
    /// ([`NodeCore::become_controller`], [`NodeCore::step_down`]), and every node that loses its
    /// controller tries the others.
    pub controllers: Vec<String>,
    /// The URL of this node's dashboard, if it serves one: announced in its `Join`
    /// (`MemberInfo::dashboard`).
    pub dashboard: Option<String>,
    /// node.toml's `raft_listen` (a node that may be made a controller at run time): announced in its
    /// `Join` (`MemberInfo::raft_listen`), so `troupe cluster controllers add NODE` needs no address.
    pub raft_listen: Option<SocketAddr>,
}

/// What the node does, in order (see the module docs).
pub enum NodeAction {
    /// Send `msg` to `peer` stamped with `epoch` (the sender's epoch when it decided). `peer` may be this
    /// node: the message comes back to [`NodeCore::message`] through its own mailbox.
    Send {
        peer: String,
        epoch: u64,
        msg: Wire,
    },
    /// Record the view in the catalog, before anything queued after it.
    RecordView(StoredView),
    Worker {
        slot: usize,
        msg: WorkerMsg,
    },
    /// To the job's controller (only queued while it runs).
    Job {
        job: JobId,
        msg: JobMsg,
    },
    /// Start the job's controller (a job submitted, or restored from the catalog), then answer with
    /// [`NodeCore::job_started`]. `restored`: a job of the
    /// catalog — its last recorded info, the number of its next event, the nodes of the last view.
    StartJob {
        id: JobId,
        spec: Box<JobSpec>,
        view: View,
        members: Vec<MemberInfo>,
        restored: Option<Restored>,
    },
    /// Connect to the controller, then answer with [`NodeCore::dialed`].
    Dial {
        addr: SocketAddr,
    },
    /// Give up the dial to `addr` before it ends ([`NodeCore::dialed`] is not called for it): the node
    /// turned to another controller, or became the controller. Left running, a dial to a daemon that is
    /// down retries up to `connect_timeout_ms`; when that daemon comes back it lands, and its connection
    /// replaces the live one between the two nodes (the endpoint keeps one per peer) — a member's
    /// connection to this node, once it is the controller, found by rolling-restart-three-controllers.
    CancelDial {
        addr: SocketAddr,
    },
    /// Start a new worker in `slot` (its predecessor failed).
    RestartWorker {
        slot: usize,
    },
    /// Stop every job controller at once: this node is no longer the controller.
    StopJobs,
    /// Replicated controllers: this node's Raft group elected it in `term`. Read the replicated
    /// catalog once this node applied everything committed (openraft's `ensure_linearizable`) and hand
    /// it to [`NodeCore::become_controller`]; a read that fails is tried again at the next
    /// [`NodeCore::leadership_tick`].
    TakeOver {
        term: u64,
    },
    /// Answer `client`'s `ControllersRequest` with the Raft group's status (which the shell holds),
    /// after making `change` (`ChangeControllers`, on the controller) if one is asked for.
    AnswerControllers {
        client: String,
        change: Option<ControllersChange>,
    },
    /// Answer `client`'s `DashboardRequest` (a member's daemon) with this controller's page fragment,
    /// which the shell draws from its metrics.
    AnswerDashboard {
        client: String,
    },
    /// The controller answered this node's `DashboardRequest` ([`NodeCore::ask_controller_dashboard`]).
    ControllerDashboard {
        fragment: String,
    },
    /// A worker kept failing: the node stops, for this reason.
    Stop {
        reason: String,
    },
    /// What happened, for whoever watches (metrics, the simulation's checker); nothing to carry out.
    Note(NodeNote),
}

/// A job the controller resumes from its catalog (see [`JobDriver::restore`]).
pub type Restored = (JobInfo, u64, Vec<NodeId>);

/// See [`NodeAction::Note`].
#[derive(Debug)]
pub enum NodeNote {
    /// This node adopted a view (as a member).
    AdoptedView(View),
    /// This node was fenced: it aborted its attempts and rejoins.
    Fenced {
        current: Epoch,
    },
    /// The controller's view changed (recorded and announced in the actions around this).
    ViewChanged {
        epoch: u64,
        changes: Vec<Change>,
    },
    /// A job controller's event, passed to the job's watchers.
    JobEvent {
        job: JobId,
        event: JobEvent,
    },
    WorkerFailed {
        slot: usize,
    },
    /// A message was refused: its sender is not a member, or it is of an earlier membership or epoch.
    RefusedStale,
    /// Replicated controllers: the daemons a controller (or the daemon this node took for one) named
    /// in its status, remembered ([`NodeCore::remember`]) for the shell to keep in the data dir as it
    /// keeps a view's.
    HeardOfDaemons {
        daemons: Vec<MemberInfo>,
    },
}

struct WorkerSlot {
    restarts: RestartTracker,
    /// Attempts this worker was asked to prepare, per job (reported failed if it restarts).
    attempts: BTreeMap<JobId, u64>,
}

struct JobEntry {
    /// Whether the job has a controller (it has not ended, and its controller neither failed nor is
    /// still starting).
    running: bool,
    info: JobInfo,
    watchers: Vec<String>,
    log: EventLog,
    /// The client whose `Submit` waits for the controller to start.
    submitted_by: Option<String>,
}

/// What only the controller holds.
struct Controller {
    membership: Membership,
    members: BTreeMap<NodeId, MemberInfo>,
    jobs: BTreeMap<JobId, JobEntry>,
    next_job: JobId,
    /// After a take-over or restart: the nodes of the last recorded view (and those its recorder still
    /// waited for) that the restored jobs wait for, recorded with every view until `expecting_until`
    /// (the jobs' [`RESUME_GRACE`]), so that a controller replacing this one before they rejoined
    /// waits for them too ([`StoredView::expecting`]).
    expecting: Vec<NodeId>,
    expecting_until: Duration,
}

/// The node's state and decisions (see the module docs).
pub struct NodeCore {
    settings: NodeSettings,
    member: MemberState,
    controller: Option<Controller>,
    /// The controller's name once connected (non-controllers).
    controller_peer: Option<String>,
    /// Where this node dials its controller: `join`, then (replicated controllers) the leader its Raft
    /// group names, a `Redirect`'s address, or the next controller of the list.
    target: Option<SocketAddr>,
    /// The leader's control address as this node's Raft group named it ([`NodeCore::follow`]).
    leader_addr: Option<SocketAddr>,
    /// Which controller of the list a member tries next (replicated controllers).
    next_candidate: usize,
    /// The leader the Raft group named whose control address is not known yet, with the term it was
    /// named in (looked up again each tick: [`NodeCore::leadership_tick`]).
    unresolved_leader: Option<(u64, String)>,
    /// The newest Raft term this node's group reported: a leadership report of an older term (one that
    /// waited in the shell's mailbox while the group moved on) is stale and ignored.
    newest_term: u64,
    /// The address of the dial under way, if any. A new target (a new leader named meanwhile) is
    /// dialed at once, without waiting for a dial to a dead one to time out; a dial that ends for an
    /// address other than this one is not taken for the controller's connection.
    dialing: Option<SocketAddr>,
    /// When that dial started.
    dialing_since: Duration,
    /// The daemon last asked for its status while joining, and when ([`Self::ask_for_daemons`]).
    daemons_asked: Option<(String, Duration)>,
    /// The members of the last view this node heard of (non-controllers).
    members: Vec<MemberInfo>,
    workers: Vec<WorkerSlot>,
    refused_stale: u64,
    changes: VecDeque<String>,
    draining: bool,
    /// What this node's machine is using, as the shell last sampled it ([`NodeCore::set_load`]): sent
    /// with each heartbeat.
    load: Option<NodeLoad>,
    /// The jobs whose state a `Fenced` just received says to keep.
    keep_on_fence: Vec<JobId>,
    /// The voting controllers of the Raft group's committed membership, which may differ from node.toml's
    /// `controllers` after `troupe cluster controllers add|remove` ([`NodeCore::set_voters`]).
    voters: Vec<String>,
    /// The daemons of the last view this node knew, or an earlier run's ([`NodeCore::remember`]), tried last.
    remembered: Vec<MemberInfo>,
    actions: VecDeque<NodeAction>,
}

impl std::fmt::Debug for NodeCore {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("NodeCore")
            .field("id", &self.settings.id)
            .field("controller", &self.controller.is_some())
            .field("epoch", &self.epoch())
            .field("controller_peer", &self.controller_peer)
            .finish_non_exhaustive()
    }
}

impl NodeCore {
    /// A node starting at `now` with membership incarnation `incarnation` (random per process). A
    /// controller (no `join`) that ran before on its data dir passes its catalog's last view and jobs:
    /// it starts past that epoch and resumes the jobs that had not ended; the view it starts with is
    /// the first action ([`NodeAction::RecordView`]).
    pub fn new(
        settings: NodeSettings,
        now: Duration,
        incarnation: u64,
        stored_view: Option<StoredView>,
        stored_jobs: Vec<StoredJob>,
    ) -> NodeCore {
        let id = settings.id.clone();
        let config = settings.membership.clone();
        let workers = (0..settings.slots)
            .map(|_| WorkerSlot { restarts: RestartTracker::new(settings.restart), attempts: BTreeMap::new() })
            .collect();
        let mut core = NodeCore {
            member: MemberState::joining(id.clone(), config.clone(), now, incarnation),
            controller: None,
            controller_peer: None,
            target: settings.join,
            leader_addr: None,
            next_candidate: 0,
            unresolved_leader: None,
            newest_term: 0,
            dialing: None,
            dialing_since: Duration::ZERO,
            daemons_asked: None,
            members: Vec::new(),
            workers,
            refused_stale: 0,
            changes: VecDeque::new(),
            draining: false,
            load: None,
            keep_on_fence: Vec::new(),
            voters: Vec::new(),
            remembered: Vec::new(),
            actions: VecDeque::new(),
            settings,
        };
        if core.settings.join.is_some() || core.eligible() {
            return core;
        }
        core.take_control(now, incarnation, stored_view, stored_jobs);
        core
    }

    /// Becomes the controller at `now`: its view starts past `stored_view`'s epoch with only itself in
    /// it (recorded first), and every job of `stored_jobs` is restored (see [`Self::restore_job`]),
    /// waiting for the nodes [`expected_after`] the last view names.
    fn take_control(
        &mut self,
        now: Duration,
        incarnation: u64,
        stored_view: Option<StoredView>,
        stored_jobs: Vec<StoredJob>,
    ) {
        let (id, config) = (self.settings.id.clone(), self.settings.membership.clone());
        let epoch = Epoch(stored_view.as_ref().map_or(1, |v| v.epoch + 1));
        let membership = Membership::starting_at(config.clone(), now, vec![id.clone()], epoch);
        let view = membership.view().clone();
        let (addr, slots, dashboard) = (self.settings.addr, self.settings.slots, self.settings.dashboard.clone());
        let raft_listen = self.settings.raft_listen;
        let devices = self.settings.devices.clone();
        let info = MemberInfo { name: id.0.clone(), addr, slots, dashboard, raft_listen, devices, load: None };
        let (previous, expect) = stored_view.as_ref().map_or((None, Vec::new()), |last| expected_after(last, &id));
        self.members = vec![info.clone()];
        self.controller = Some(Controller {
            membership,
            members: BTreeMap::from([(id.clone(), info)]),
            jobs: BTreeMap::new(),
            next_job: stored_jobs.iter().map(|j| j.info.id + 1).max().unwrap_or(1),
            expecting: expect.iter().filter(|n| **n != id).cloned().collect(),
            expecting_until: now + RESUME_GRACE,
        });
        // Recorded before it is announced (a `Fenced` names it): a second restart starts past it too,
        // and a controller replacing this one before the nodes it expects rejoined still expects them.
        let record = self.stored_view(epoch.0, vec![id.0.clone()]);
        self.actions.push_back(NodeAction::RecordView(record));
        self.member = MemberState::member(id.clone(), config, now, view, incarnation);
        let Some(last) = stored_view else { return };
        let open = stored_jobs.iter().filter(|j| !j.info.state.is_terminal()).count();
        let how = match &previous {
            Some(old) => format!("took over from {old} as the controller"),
            None => "restarted as the controller".to_owned(),
        };
        self.record_change(format!(
            "{id} {how} at epoch {epoch} (last view: epoch {}, {} members; waiting for {} node(s)); resuming {open} job(s)",
            last.epoch,
            last.members.len(),
            expect.len()
        ));
        for job in stored_jobs {
            self.restore_job(job, &expect);
        }
    }

    /// A view as recorded: with who recorded it, where it listens, and (within the grace after a
    /// take-over) the nodes this controller still waits for that are not in it.
    fn stored_view(&self, epoch: u64, members: Vec<String>) -> StoredView {
        let expecting = self.controller.as_ref().map_or(Vec::new(), |c| {
            c.expecting.iter().filter(|n| !members.contains(&n.0)).map(|n| n.0.clone()).collect()
        });
        StoredView { epoch, members, recorded_by: Some((self.settings.id.0.clone(), self.settings.addr)), expecting }
    }

    /// Whether the controller is replicated (two or more controller-eligible nodes).
    fn replicated(&self) -> bool {
        self.settings.controllers.len() >= 2
    }

    /// Whether this node is one of several controller-eligible nodes: the controller while its Raft
    /// group leads, a member otherwise.
    pub fn eligible(&self) -> bool {
        let me = &self.settings.id.0;
        self.replicated() && (self.settings.controllers.contains(me) || self.voters.contains(me))
    }

    /// The Raft group's voters changed (replicated controllers): this node may be elected if it is one
    /// (added at run time), and tries them when it looks for the controller.
    pub fn set_voters(&mut self, voters: Vec<String>) {
        self.voters = voters;
    }

    /// Replicated controllers: this node knows no controller and its Raft group will name none to it
    /// (it was removed from the voters): it tries the controllers and the daemons it knows, which
    /// redirect it to the leader.
    pub fn look_for_controller(&mut self) {
        if self.controller.is_none() && self.controller_peer.is_none() && self.dialing.is_none() {
            self.try_next_controller(None);
        }
    }

    /// The clients following this controller's jobs (none on a node that is not the controller).
    pub fn watchers(&self) -> Vec<String> {
        let jobs = self.controller.iter().flat_map(|c| c.jobs.values());
        let mut watchers: Vec<String> = jobs.flat_map(|j| j.watchers.iter().cloned()).collect();
        watchers.sort();
        watchers.dedup();
        watchers
    }

    /// Replicated controllers: with its `Join`, this node asks the daemon it took for the controller
    /// for its status, whose members it remembers ([`Self::heard_of_daemons`]). Until a view admits
    /// it, its `join` is the only address it knows; were that controller gone for good before the
    /// view came (killed, or cut off while its successor is elected), it would know no other to dial
    /// and never find the cluster (found by the simulation: loaded replicated seed 242, a worker whose
    /// `Join` reached node-a 10 ms before node-a was cut off, then killed). The status answered
    /// names the view's daemons, the controllers among them, each of which redirects to the leader.
    /// Asked with the first `Join` to a daemon, then every [`ASK_DAEMONS_EVERY`] while not admitted
    /// (not with every `Join`, sent each heartbeat interval: a status names every member).
    fn ask_for_daemons(&mut self, now: Duration) {
        let Some(peer) = self.controller_peer.clone() else { return };
        if !self.replicated() || self.controller.is_some() {
            return;
        }
        let fresh = |(asked, at): &(String, Duration)| *asked == peer && now.saturating_sub(*at) < ASK_DAEMONS_EVERY;
        if !self.daemons_asked.as_ref().is_some_and(fresh) {
            self.send(&peer, Request::StatusRequest);
            self.daemons_asked = Some((peer, now));
        }
    }

    /// A daemon's status named `daemons` (see [`Self::ask_for_daemons`]): remembered, and noted for
    /// the shell to keep across a restart, unless they are what this node remembers already.
    fn heard_of_daemons(&mut self, daemons: Vec<MemberInfo>) {
        if daemons.is_empty() || daemons == self.remembered {
            return;
        }
        self.remembered = daemons.clone();
        self.actions.push_back(NodeAction::Note(NodeNote::HeardOfDaemons { daemons }));
    }

    /// The daemons of the last view this node knew, or an earlier run's (the shell keeps them in the
    /// data dir): with replicated controllers, tried after the controllers when none answers — any
    /// daemon redirects to the controller — so a member restarted after its `join` is gone finds the
    /// cluster.
    pub fn remember(&mut self, daemons: Vec<MemberInfo>) {
        self.remembered = daemons;
    }

    /// This node's Raft group elected it (replicated controllers): it becomes the controller, restoring
    /// the replicated catalog's view and jobs (read after catching up with everything committed) as a
    /// restarted controller does. Its own workers abort the attempts of the controller it replaces,
    /// keeping the committed state of the jobs it resumes (as a fenced member does).
    pub fn become_controller(&mut self, now: Duration, stored_view: Option<StoredView>, stored_jobs: Vec<StoredJob>) {
        if self.controller.is_some() || self.draining || !self.eligible() {
            return;
        }
        let keep: Vec<JobId> = stored_jobs.iter().filter(|j| !j.info.state.is_terminal()).map(|j| j.info.id).collect();
        self.each_worker(|| WorkerMsg::AbortAll { keep: keep.clone() });
        self.workers.iter_mut().for_each(|w| w.attempts.clear());
        self.cancel_dial();
        (self.controller_peer, self.leader_addr) = (None, None);
        let incarnation = self.member.incarnation() + 1;
        self.take_control(now, incarnation, stored_view, stored_jobs);
    }

    /// This node is no longer the controller (its Raft group elected another, or a write was not
    /// committed: it may be cut off from the majority). Nothing it decided as the controller and has not
    /// carried out yet goes out (none of it can be committed); its job controllers stop; its workers
    /// abort their attempts, keeping the committed state of its jobs (the next controller resumes them);
    /// it rejoins as a member of whoever leads.
    pub fn step_down(&mut self, now: Duration, why: &str) {
        let Some(c) = self.controller.take() else { return };
        // A view change not yet recorded was never committed: it did not happen (found by the simulation).
        self.actions.retain(|a| {
            !matches!(
                a,
                NodeAction::Send { .. }
                    | NodeAction::Job { .. }
                    | NodeAction::StartJob { .. }
                    | NodeAction::RecordView(_)
                    | NodeAction::Note(NodeNote::ViewChanged { .. })
            )
        });
        self.actions.push_back(NodeAction::StopJobs);
        let keep: Vec<JobId> = c.jobs.iter().filter(|(_, j)| !j.info.state.is_terminal()).map(|(id, _)| *id).collect();
        self.each_worker(|| WorkerMsg::AbortAll { keep: keep.clone() });
        self.workers.iter_mut().for_each(|w| w.attempts.clear());
        let (id, config) = (self.settings.id.clone(), self.settings.membership.clone());
        self.record_change(format!("{id} is no longer the controller ({why}); it rejoins as a member"));
        self.member = MemberState::joining(id, config, now, self.member.incarnation() + 1);
        (self.controller_peer, self.target, self.leader_addr) = (None, None, None);
    }

    /// This node's Raft group names `leader` (another node, listening at `addr`) the controller: this
    /// node dials it from now on, leaving the connection to any earlier controller.
    pub fn follow(&mut self, leader: &str, addr: SocketAddr) {
        if self.controller.is_some() || leader == self.settings.id.0 {
            return;
        }
        self.leader_addr = Some(addr);
        if self.controller_peer.as_deref() == Some(leader) {
            return;
        }
        if self.controller_peer.is_some() || self.target != Some(addr) {
            tracing::info!(node = %self.settings.id, %leader, %addr, "following the new controller");
        }
        self.controller_peer = None;
        self.target = Some(addr);
    }

    /// The Raft group's leadership watch changed (replicated controllers): `term`, and the leader it
    /// names (none during an election). Named itself, this node takes over ([`NodeAction::TakeOver`]);
    /// otherwise it steps down if it was the controller, and follows the leader named once it knows
    /// its address. A report of a term older than one already seen is stale (it waited in the shell's
    /// mailbox while the group moved on) and changes nothing: a deposed node follows the newest
    /// leader, not the one it heard of first. `recorded`: the replicated catalog's last view, read
    /// only to look the leader's address up.
    pub fn on_leadership(
        &mut self,
        now: Duration,
        term: u64,
        leader: Option<&str>,
        recorded: impl FnOnce() -> Option<StoredView>,
    ) {
        if term < self.newest_term {
            return tracing::debug!(node = %self.settings.id, term, newest = self.newest_term, "a stale leadership report");
        }
        self.newest_term = term;
        match leader {
            Some(leader) if leader == self.settings.id.0 => {
                self.unresolved_leader = None;
                self.take_over(term);
            }
            leader => {
                let why = format!("Raft term {term}: {} leads", leader.unwrap_or("no one yet"));
                self.step_down(now, &why);
                self.unresolved_leader = leader.map(|l| (term, l.to_owned()));
                self.resolve_leader(recorded);
            }
        }
    }

    /// The node's timer with replicated controllers, given what the group's watch says now: a node
    /// without its controller looks the leader up again (one that kept leading across a restart on
    /// another address raises no leadership change), prefers it to a leader named in an older term
    /// that it could not resolve yet, follows it once its address is known; and an election won but
    /// not acted on (the catalog's read failed) is acted on.
    pub fn leadership_tick(&mut self, term: u64, leader: Option<&str>, recorded: impl FnOnce() -> Option<StoredView>) {
        let me = leader == Some(self.settings.id.0.as_str());
        self.newest_term = self.newest_term.max(term);
        let lost = self.controller.is_none() && self.controller_peer.is_none();
        if let Some(leader) = leader.filter(|_| lost && !me) {
            let older = self.unresolved_leader.as_ref().is_none_or(|(named_in, _)| *named_in <= term);
            if older {
                self.unresolved_leader = Some((term, leader.to_owned()));
            }
        }
        self.resolve_leader(recorded);
        if me {
            self.take_over(term);
        }
    }

    /// Elected in `term`: the shell reads the replicated catalog for [`Self::become_controller`] (once:
    /// not while a read is queued, nor once this node is the controller).
    fn take_over(&mut self, term: u64) {
        let queued = self.actions.iter().any(|a| matches!(a, NodeAction::TakeOver { .. }));
        if self.controller.is_none() && !queued && !self.draining && self.eligible() {
            self.actions.push_back(NodeAction::TakeOver { term });
        }
    }

    /// Follows the leader the Raft group named once its control address is known: from the replicated
    /// catalog's last view if the leader recorded it (its address now: a leader restarted on another
    /// address records a view before anything else), else from a view this node holds.
    fn resolve_leader(&mut self, recorded: impl FnOnce() -> Option<StoredView>) {
        let Some((_, leader)) = self.unresolved_leader.clone() else { return };
        let by_leader = recorded().and_then(|v| v.recorded_by).filter(|(name, _)| *name == leader);
        if let Some(addr) = by_leader.map(|(_, addr)| addr).or_else(|| self.known_addr(&leader)) {
            self.follow(&leader, addr);
            self.unresolved_leader = None;
        }
    }

    /// The control address of the node called `name`, if a view this node knows lists it.
    pub fn known_addr(&self, name: &str) -> Option<SocketAddr> {
        let member = self.members.iter().find(|m| m.name == name).map(|m| m.addr);
        member.or_else(|| self.controller.as_ref()?.members.get(&NodeId(name.to_owned())).map(|m| m.addr))
    }

    /// Replicated controllers: the controller was lost or refused this node, and no leader is known
    /// to it: it tries the next controller of its list whose address it knows (from the last view), or
    /// its `join`, which answers with a redirect to the leader if it is not the leader itself. `gone`:
    /// a controller whose connection was just lost, not tried (its address may not answer at all).
    fn try_next_controller(&mut self, gone: Option<&str>) {
        if !self.replicated() {
            return;
        }
        let mut candidates: Vec<SocketAddr> = self.settings.join.into_iter().collect();
        let skip = |n: &String| *n == self.settings.id.0 || Some(n.as_str()) == gone;
        for name in self.settings.controllers.iter().chain(&self.voters).filter(|n| !skip(n)) {
            if let Some(addr) = self.known_addr(name).filter(|a| !candidates.contains(a)) {
                candidates.push(addr);
            }
        }
        for m in self.remembered.iter().filter(|m| !skip(&m.name)) {
            if !candidates.contains(&m.addr) {
                candidates.push(m.addr);
            }
        }
        if candidates.is_empty() {
            self.target = self.leader_addr;
            return;
        }
        self.next_candidate = (self.next_candidate + 1) % candidates.len();
        self.target = Some(candidates[self.next_candidate]);
    }

    /// The next thing to do, if any.
    pub fn poll_action(&mut self) -> Option<NodeAction> {
        self.actions.pop_front()
    }

    pub fn id(&self) -> &NodeId {
        &self.settings.id
    }

    pub fn is_controller(&self) -> bool {
        self.controller.is_some()
    }

    /// The controller's authoritative membership (on the controller).
    pub fn membership(&self) -> Option<&Membership> {
        self.controller.as_ref().map(|c| &c.membership)
    }

    /// This node's side of membership.
    pub fn member(&self) -> &MemberState {
        &self.member
    }

    /// Whether this node holds a connection it takes for the controller's.
    pub fn has_controller_peer(&self) -> bool {
        self.controller_peer.is_some()
    }

    /// The epoch this node acts on, stamped on what it sends: the authoritative one on the controller,
    /// else its adopted view's.
    pub fn epoch(&self) -> u64 {
        match &self.controller {
            Some(c) => c.membership.epoch().0,
            None => self.member.epoch().map_or(0, |e| e.0),
        }
    }

    /// Messages refused as stale so far (`troupe status`).
    pub fn refused_stale(&self) -> u64 {
        self.refused_stale
    }

    /// The controller's address as this node knows it: its own on the controller; the connected
    /// controller's; with replicated controllers the leader its Raft group named, if any.
    fn controller_addr(&self) -> Option<SocketAddr> {
        if self.controller.is_some() {
            return Some(self.settings.addr);
        }
        if !self.replicated() {
            return self.settings.join;
        }
        if self.controller_peer.is_some() {
            return self.target;
        }
        self.leader_addr
    }

    /// What a node that is not the controller answers a request for it: where the controller is, or
    /// (replicated controllers, during an election) that none is known yet.
    fn redirect(&self) -> Reply {
        match self.controller_addr() {
            Some(controller) => Reply::Redirect { controller },
            None => Reply::Error {
                message: format!(
                    "{} is not the controller and knows of none yet (an election is under way?); retry in a second",
                    self.settings.id
                ),
            },
        }
    }

    /// What this node's machine is using now (the shell samples it): the next heartbeats carry it to
    /// the controller, whose `troupe status` shows it.
    pub fn set_load(&mut self, load: NodeLoad) {
        self.load = Some(load);
    }

    /// `troupe status` as this node sees it.
    pub fn status(&self) -> ClusterStatus {
        let (members, joining, jobs) = match &self.controller {
            Some(c) => (
                c.membership.view().members().iter().filter_map(|m| c.members.get(m).cloned()).collect(),
                c.membership.joining().map(|n| n.0.clone()).collect(),
                c.jobs.values().map(|j| j.info.clone()).collect(),
            ),
            None => (self.members.clone(), Vec::new(), Vec::new()),
        };
        ClusterStatus {
            node: self.settings.id.0.clone(),
            controller: self.controller.is_some(),
            controller_addr: self.controller_addr(),
            epoch: self.epoch(),
            members,
            joining,
            jobs,
            refused_stale: self.refused_stale,
            changes: self.changes.iter().cloned().collect(),
        }
    }

    fn send(&mut self, peer: &str, msg: impl Into<Wire>) {
        let epoch = self.epoch();
        self.actions.push_back(NodeAction::Send { peer: peer.to_owned(), epoch, msg: msg.into() });
    }

    /// To the controller: this node's own controller part, or the connected controller; dropped while
    /// not connected (what it says is resent or superseded: joins, heartbeats; an attempt's messages
    /// are lost with the connection, which ends the attempt).
    pub fn send_to_controller(&mut self, msg: ToController) {
        if self.controller.is_some() {
            let me = self.settings.id.0.clone();
            self.send(&me, msg);
        } else if let Some(peer) = self.controller_peer.clone() {
            self.send(&peer, msg);
        }
    }

    /// Asks the connected controller for its dashboard's fragment, answered by
    /// [`NodeAction::ControllerDashboard`]; false when this node is not connected to a controller (or is
    /// the controller).
    pub fn ask_controller_dashboard(&mut self) -> bool {
        let Some(peer) = self.controller_peer.clone().filter(|_| self.controller.is_none()) else { return false };
        self.send(&peer, Request::DashboardRequest);
        true
    }

    /// A job controller's message for a node (dropped once this node is no longer the controller).
    pub fn job_outgoing(&mut self, node: &NodeId, msg: ToNode) {
        if self.controller.is_some() {
            self.send(&node.0, msg);
        }
    }

    fn record_change(&mut self, change: String) {
        tracing::info!(node = %self.settings.id, "{change}");
        if self.changes.len() == CHANGES_KEPT {
            self.changes.pop_front();
        }
        self.changes.push_back(change);
    }

    fn each_worker(&mut self, msg: impl Fn() -> WorkerMsg) {
        for slot in 0..self.workers.len() {
            self.actions.push_back(NodeAction::Worker { slot, msg: msg() });
        }
    }

    fn refuse(&mut self) {
        self.refused_stale += 1;
        self.actions.push_back(NodeAction::Note(NodeNote::RefusedStale));
    }

    /// The controller's jobs that have not ended.
    fn live_jobs(&self) -> Vec<JobId> {
        let Some(c) = &self.controller else { return Vec::new() };
        c.jobs.iter().filter(|(_, j)| !j.info.state.is_terminal()).map(|(id, _)| *id).collect()
    }

    fn any_job_running(&self) -> bool {
        self.controller.as_ref().is_some_and(|c| c.jobs.values().any(|j| j.info.state == JobState::Running))
    }

    fn members_of(&self, view: &View) -> Vec<MemberInfo> {
        let c = self.controller.as_ref().expect("controller");
        view.members().iter().filter_map(|m| c.members.get(m).cloned()).collect()
    }

    // ---- the node's side of membership ----

    fn drive_member(&mut self, now: Duration) {
        while let Some(action) = self.member.poll_action() {
            match action {
                MemberAction::SendHeartbeat { .. } => {
                    self.send_to_controller(ToController::Heartbeat { load: self.load.clone() })
                }
                MemberAction::SendJoinRequest { incarnation } => {
                    let (slots, addr) = (self.settings.slots, self.settings.addr);
                    let dashboard = self.settings.dashboard.clone();
                    let incarnation = Some(incarnation);
                    let (controllers, raft_listen) =
                        (Some(self.settings.controllers.clone()), self.settings.raft_listen);
                    let devices = self.settings.devices.clone();
                    let join =
                        ToController::Join { slots, addr, incarnation, dashboard, controllers, raft_listen, devices };
                    self.send_to_controller(join);
                    self.ask_for_daemons(now);
                }
                MemberAction::AdoptView(view) => {
                    tracing::info!(node = %self.settings.id, epoch = view.epoch.0, members = view.len(), "adopted view");
                    self.actions.push_back(NodeAction::Note(NodeNote::AdoptedView(view)));
                }
                MemberAction::Fenced { current } => {
                    let id = self.settings.id.clone();
                    self.record_change(format!(
                        "{id} was fenced at epoch {current}; aborting its attempts and rejoining"
                    ));
                    self.actions.push_back(NodeAction::Note(NodeNote::Fenced { current }));
                    // Removed from a view without a `Fenced` (a view that left it out): nothing is kept.
                    let keep = std::mem::take(&mut self.keep_on_fence);
                    self.each_worker(|| WorkerMsg::AbortAll { keep: keep.clone() });
                    self.workers.iter_mut().for_each(|w| w.attempts.clear());
                }
                MemberAction::ControllerLost { silent_ms } => {
                    // The controller answers every heartbeat, so this is a slow or dead controller or link.
                    // The connection itself is kept: QUIC's idle timeout says whether it is dead, and a
                    // new connection would silently lose what is in flight on this one.
                    tracing::warn!(node = %self.settings.id, silent_ms, "nothing heard from the controller");
                }
            }
        }
    }

    // ---- the controller ----

    fn drive_membership(&mut self) {
        let Some(c) = self.controller.as_mut() else { return };
        let mut actions = Vec::new();
        while let Some(a) = c.membership.poll_action() {
            actions.push(a);
        }
        for action in actions {
            match action {
                MembershipAction::ViewChanged { view, changes } => {
                    // Recorded before anyone hears of it: a restarted controller starts past this epoch.
                    let members = view.members().iter().map(|m| m.0.clone()).collect();
                    let record = self.stored_view(view.epoch.0, members);
                    self.actions.push_back(NodeAction::RecordView(record));
                    let said: Vec<String> = changes.iter().map(|c| format!("{c:?}")).collect();
                    for c in &said {
                        self.record_change(format!("epoch {}: {c}", view.epoch));
                    }
                    let note = NodeNote::ViewChanged { epoch: view.epoch.0, changes };
                    self.actions.push_back(NodeAction::Note(note));
                    let jobs = self.live_jobs();
                    let members = self.members_of(&view);
                    let running: Vec<JobId> = self.running_jobs();
                    for job in running {
                        let msg = JobMsg::View { view: view.clone(), members: members.clone(), changes: said.clone() };
                        self.actions.push_back(NodeAction::Job { job, msg });
                    }
                    let msg = ToNode::View { view: view.clone(), members, jobs };
                    for node in view.members() {
                        self.send(&node.0, msg.clone());
                    }
                }
                MembershipAction::Fence { node, stale_epoch, current } => {
                    self.refuse();
                    tracing::warn!(%node, %stale_epoch, %current, "refused a message from a non-member; fencing it");
                    let jobs = self.live_jobs();
                    self.send(&node.0, ToNode::Fenced { current, jobs });
                }
                MembershipAction::SendView { node, view } => {
                    let jobs = self.live_jobs();
                    let members = self.members_of(&view);
                    self.send(&node.0, ToNode::View { view, members, jobs });
                }
            }
        }
    }

    fn running_jobs(&self) -> Vec<JobId> {
        let Some(c) = &self.controller else { return Vec::new() };
        c.jobs.iter().filter(|(_, j)| j.running).map(|(id, _)| *id).collect()
    }

    fn membership_event(&mut self, now: Duration, event: MembershipEvent) {
        if let Some(c) = self.controller.as_mut() {
            c.membership.handle(now, event);
        }
    }

    /// A job message from `from` at `epoch`: accepted only from a member of the current view. A
    /// non-member's message counts as refused-stale (it is fenced). A member that lags behind the view is
    /// accepted: the driver matches messages to attempts, and an attempt may outlive a view change that
    /// did not touch its ranks. One stamped before the view that admitted the member is refused: an
    /// earlier membership of the node sent it, and it came late, on a connection since replaced (each
    /// connection's reader feeds the endpoint's events on its own).
    fn admit_job_message(&mut self, from: &NodeId, epoch: u64) -> Result<(), Epoch> {
        let membership = &self.controller.as_ref().expect("controller").membership;
        let (view, admitted) = (membership.view(), membership.admitted_at(from));
        let current = view.epoch;
        if !view.contains(from) {
            self.refuse();
            tracing::warn!(%from, epoch, %current, "refused a job message from a non-member; fencing it");
            return Err(current);
        }
        if let Some(admitted) = admitted.filter(|a| epoch < a.0) {
            self.refuse();
            tracing::warn!(%from, epoch, %admitted, "refused a job message of an earlier membership of a member");
            return Err(current);
        }
        if epoch < current.0 {
            // A member whose view lags: its message still belongs to an attempt the driver knows (or
            // is ignored by attempt number), so it is accepted.
            tracing::debug!(%from, epoch, %current, "job message from a member behind the current epoch");
        }
        Ok(())
    }

    fn controller_message(&mut self, now: Duration, from: NodeId, epoch: u64, msg: ToController) {
        let job_msg = match msg {
            ToController::Join { slots, addr, incarnation, dashboard, controllers, raft_listen, devices } => {
                let ours = &self.settings.controllers;
                let (me, theirs) = (&self.settings.id.0, controllers.unwrap_or_else(|| ours.clone()));
                let mismatch = |ours| crate::node_config::controllers::join_mismatch(&from.0, &theirs, me, ours);
                // node.toml's list, or the committed one after `troupe cluster controllers add|remove`.
                let committed = (self.voters.len() >= 2).then(|| mismatch(&self.voters)).flatten();
                if let Some(reason) = mismatch(ours).filter(|_| self.voters.len() < 2 || committed.is_some()) {
                    tracing::error!(node = %me, joiner = %from, "refused a join: {reason}");
                    return self.send(&from.0, ToNode::Refused { reason });
                }
                let info =
                    MemberInfo { name: from.0.clone(), addr, slots, dashboard, raft_listen, devices, load: None };
                self.controller.as_mut().expect("controller").members.insert(from.clone(), info);
                return self.membership_event(now, MembershipEvent::JoinRequest { from, incarnation });
            }
            ToController::Heartbeat { load } => {
                let member = self.membership().expect("controller").view().contains(&from);
                if let (Some(load), Some(info)) =
                    (load, self.controller.as_mut().and_then(|c| c.members.get_mut(&from)))
                {
                    info.load = Some(load);
                }
                if member && from != self.settings.id {
                    self.send(&from.0, ToNode::Alive);
                }
                return self.membership_event(now, MembershipEvent::Heartbeat { from, epoch: Epoch(epoch) });
            }
            ToController::Leave => return self.membership_event(now, MembershipEvent::Leave { from }),
            ToController::Ready { job, attempt, slot, data_addr, committed } => {
                (job, JobMsg::Ready { node: from.clone(), attempt, slot, addr: data_addr, committed })
            }
            ToController::Vote { job, attempt, slot, step, figures, seconds } => {
                (job, JobMsg::Vote { node: from.clone(), attempt, slot, step, figures, seconds })
            }
            ToController::Ended { job, attempt, slot, outcome } => {
                (job, JobMsg::Ended { node: from.clone(), attempt, slot, outcome })
            }
            ToController::Checkpointed { job, attempt, step, path, seconds, bytes } => {
                (job, JobMsg::Checkpointed { attempt, step, path, seconds, bytes })
            }
            ToController::Evaluated { job, attempt, step, figures } => {
                (job, JobMsg::Evaluated { attempt, step, figures })
            }
            ToController::Phases { job, attempt, rank, step, spans, stage, .. } => {
                (job, JobMsg::Phases { node: from.clone(), attempt, rank, step, spans, stage })
            }
        };
        if let Err(current) = self.admit_job_message(&from, epoch) {
            if !self.membership().expect("controller").view().contains(&from) {
                let jobs = self.live_jobs();
                self.send(&from.0, ToNode::Fenced { current, jobs });
            }
            return;
        }
        let (job, msg) = job_msg;
        if self.controller.as_ref().and_then(|c| c.jobs.get(&job)).is_some_and(|j| j.running) {
            self.actions.push_back(NodeAction::Job { job, msg });
        }
    }

    fn submit(&mut self, client: &str, spec: JobSpec) -> Option<Reply> {
        if let Err(e) = spec.config.validate() {
            return Some(Reply::Error { message: format!("job config: {e}") });
        }
        if spec.data_plane == DataPlane::PlaintextTcp && !self.settings.allow_plaintext_tcp {
            return Some(Reply::Error {
                message: "data_plane = plaintext_tcp: this cluster does not allow tensors between hosts unencrypted; \
                          set `allow_plaintext_tcp = true` in the controller's node config (trusted fabrics only), \
                          or submit with data_plane = auto"
                    .into(),
            });
        }
        let c = self.controller.as_mut().expect("controller");
        let id = c.next_job;
        c.next_job += 1;
        let view = c.membership.view().clone();
        let members = self.members_of(&view);
        let info = JobDriver::new(id, spec.clone()).info();
        let entry = JobEntry {
            running: false,
            info,
            watchers: vec![client.to_owned()],
            log: EventLog::default(),
            submitted_by: Some(client.to_owned()),
        };
        self.controller.as_mut().expect("controller").jobs.insert(id, entry);
        self.actions.push_back(NodeAction::StartJob { id, spec: Box::new(spec), view, members, restored: None });
        // Answered once the job controller started (`job_started`).
        None
    }

    /// The shell started (or failed to start) the controller of job `id` ([`NodeAction::StartJob`]).
    pub fn job_started(&mut self, id: JobId, result: Result<(), String>) {
        let Some(c) = self.controller.as_mut() else { return };
        let Some(entry) = c.jobs.get_mut(&id) else { return };
        let client = entry.submitted_by.take();
        match (result, client) {
            (Ok(()), client) => {
                entry.running = !entry.info.state.is_terminal();
                if let Some(client) = client {
                    tracing::info!(node = %self.settings.id, job = id, "job submitted");
                    self.send(&client, Reply::Submitted { job: id });
                }
            }
            (Err(e), Some(client)) => {
                c.jobs.remove(&id);
                self.send(&client, Reply::Error { message: format!("starting the job controller: {e}") });
            }
            (Err(e), None) => tracing::error!(job = id, "restarting the job controller: {e}"),
        }
    }

    /// A message from a client (any peer role): answered by any node for status, by the controller
    /// for jobs (others redirect).
    fn client_message(&mut self, from: &str, msg: Request) {
        let not_controller = self.redirect();
        let reply = match msg {
            Request::StatusRequest => Some(Reply::Status(Box::new(self.status()))),
            Request::ControllersRequest if self.eligible() || self.controller.is_some() => {
                self.actions.push_back(NodeAction::AnswerControllers { client: from.to_owned(), change: None });
                None
            }
            Request::ControllersRequest => Some(not_controller),
            Request::ChangeControllers { .. } if self.controller.is_none() => Some(not_controller),
            Request::ChangeControllers { change } => {
                let change = Some(self.raft_address_of(change));
                self.actions.push_back(NodeAction::AnswerControllers { client: from.to_owned(), change });
                None
            }
            _ if self.controller.is_none() => Some(not_controller),
            Request::DashboardRequest => {
                self.actions.push_back(NodeAction::AnswerDashboard { client: from.to_owned() });
                None
            }
            Request::Submit { spec } => self.submit(from, *spec),
            Request::JobStatusRequest { job } => Some(self.job_reply(job, |_| {})),
            Request::Watch { job, since } => Some(self.watch(from, job, since)),
            Request::Cancel { job } => {
                let running = self.controller.as_ref().and_then(|c| c.jobs.get(&job)).is_some_and(|j| j.running);
                if running {
                    self.actions.push_back(NodeAction::Job { job, msg: JobMsg::Cancel });
                }
                Some(self.job_reply(job, |_| {}))
            }
        };
        if let Some(reply) = reply {
            self.send(from, reply);
        }
    }

    /// A watcher (re)attaches: the events it missed go out before the reply, on the same ordered stream,
    /// so it sees them first and in order.
    fn watch(&mut self, from: &str, job: JobId, since: Option<u64>) -> Reply {
        let missed: Vec<(u64, JobEvent)> = match (since, self.controller.as_ref().and_then(|c| c.jobs.get(&job))) {
            (Some(since), Some(entry)) => {
                let (events, lost) = entry.log.since(since);
                if lost > 0 {
                    tracing::warn!(
                        job,
                        watcher = from,
                        lost,
                        "a reconnecting watcher missed more events than are kept"
                    );
                }
                let events: Vec<JobEvent> = events.cloned().collect();
                let first = entry.log.end() - events.len() as u64;
                (first..).zip(events).collect()
            }
            _ => Vec::new(),
        };
        for (seq, event) in missed {
            self.send(from, Reply::Event { job, seq, event });
        }
        let watcher = from.to_owned();
        self.job_reply(job, move |entry| {
            entry.watchers.retain(|w| *w != watcher);
            entry.watchers.push(watcher);
        })
    }

    /// A job of the catalog, after a restart: its events are replayed to watchers that reconnect, and
    /// unless it had ended a job controller resumes it once the nodes of the last view (`expect`) rejoined.
    fn restore_job(&mut self, job: StoredJob, expect: &[NodeId]) {
        let StoredJob { spec, info, first_event, events } = job;
        let log = EventLog::restore(first_event, events);
        let id = info.id;
        if !info.state.is_terminal() {
            let view = self.membership().expect("controller").view().clone();
            let members = self.members_of(&view);
            let restored = Some((info.clone(), log.end(), expect.to_vec()));
            self.actions.push_back(NodeAction::StartJob { id, spec: Box::new(spec), view, members, restored });
        }
        tracing::info!(node = %self.settings.id, job = id, state = ?info.state, step = info.step, "job restored from the catalog");
        let entry = JobEntry { running: false, info, watchers: Vec::new(), log, submitted_by: None };
        self.controller.as_mut().expect("controller").jobs.insert(id, entry);
    }

    fn job_reply(&mut self, job: JobId, f: impl FnOnce(&mut JobEntry)) -> Reply {
        match self.controller.as_mut().and_then(|c| c.jobs.get_mut(&job)) {
            Some(entry) => {
                f(entry);
                Reply::JobStatus(Box::new(JobInfo { events: entry.log.end(), ..entry.info.clone() }))
            }
            None => Reply::Error { message: format!("no job {job} on this cluster (see `troupe status`)") },
        }
    }

    /// A job controller's event: logged for reconnecting watchers and passed to the watchers.
    pub fn job_event(&mut self, job: JobId, event: JobEvent, info: JobInfo) {
        let Some(entry) = self.controller.as_mut().and_then(|c| c.jobs.get_mut(&job)) else { return };
        entry.info = info;
        entry.log.push(event.clone());
        let (seq, watchers) = (entry.log.end() - 1, entry.watchers.clone());
        if let JobEvent::Membership { changes, .. } = &event {
            tracing::info!(node = %self.settings.id, job, ?changes, "job re-planned after a membership change");
        }
        self.actions.push_back(NodeAction::Note(NodeNote::JobEvent { job, event: event.clone() }));
        for w in watchers {
            self.send(&w, Reply::Event { job, seq, event: event.clone() });
        }
    }

    /// A job controller's latest state of its job.
    pub fn job_info(&mut self, info: JobInfo) {
        if let Some(entry) = self.controller.as_mut().and_then(|c| c.jobs.get_mut(&info.id)) {
            entry.info = info;
        }
    }

    /// A job controller died: its job failed.
    pub fn job_controller_failed(&mut self, job: JobId, error: &str) {
        if let Some(entry) = self.controller.as_mut().and_then(|c| c.jobs.get_mut(&job)) {
            tracing::error!(job, %error, "job controller failed");
            entry.running = false;
            entry.info.state = JobState::Failed;
            entry.info.reason = Some(format!("the job controller failed: {error}"));
        }
    }

    /// A job finished a step: the controller admits joiners at step boundaries.
    pub fn step_boundary(&mut self, now: Duration) {
        self.membership_event(now, MembershipEvent::StepBoundary);
        self.drive_membership();
    }

    // ---- messages from the controller to this node ----

    fn node_message(&mut self, now: Duration, epoch: u64, msg: ToNode) {
        self.member.heard_from_controller(now);
        match msg {
            ToNode::View { view, members, jobs } => {
                self.members = members;
                self.member.handle_view(now, view);
                self.drive_member(now);
                // A job that ended while its `Release` could not reach this node (paused, cut off, or
                // fenced with a list that still named it) leaves no state behind.
                self.each_worker(|| WorkerMsg::Retain { jobs: jobs.clone() });
                self.workers.iter_mut().for_each(|w| w.attempts.retain(|job, _| jobs.contains(job)));
            }
            ToNode::Refused { reason } => {
                tracing::error!(node = %self.settings.id, "the controller refused this node: {reason}");
                self.actions.push_back(NodeAction::Stop { reason: format!("the controller refused it: {reason}") });
            }
            ToNode::Fenced { current, jobs } => {
                self.keep_on_fence = jobs;
                self.member.handle_fence(now, current);
                self.drive_member(now);
                // Used by the fence just driven, if any; a node already rejoining keeps no stale list.
                self.keep_on_fence.clear();
            }
            ToNode::Prepare { job, attempt, spec, ranks, discard_from } => {
                let me = self.settings.id.clone();
                for (rank, r) in ranks.iter().enumerate().filter(|(_, r)| r.node == me) {
                    let slot = r.slot as usize;
                    if let Some(w) = self.workers.get_mut(slot) {
                        w.attempts.insert(job, attempt);
                        let msg = WorkerMsg::Prepare { job, attempt, spec: spec.clone(), rank, epoch, discard_from };
                        self.actions.push_back(NodeAction::Worker { slot, msg });
                    }
                }
            }
            ToNode::Start { job, attempt, roster, source, plane } => {
                self.each_worker(|| WorkerMsg::Start { job, attempt, roster: roster.clone(), source, plane })
            }
            ToNode::Commit { job, attempt, step, .. } => self.each_worker(|| WorkerMsg::Commit { job, attempt, step }),
            ToNode::Abort { job, attempt, .. } => self.each_worker(|| WorkerMsg::Abort { job, attempt }),
            ToNode::Release { job } => {
                self.each_worker(|| WorkerMsg::Release { job });
                self.workers.iter_mut().for_each(|w| {
                    w.attempts.remove(&job);
                });
            }
            ToNode::Alive => {}
        }
    }

    // ---- what the endpoint reports ----

    /// A control message from `from` (`role`), stamped with the sender's `epoch`: a client's request
    /// from anyone; a node's message for the controller, or the controller's for this node, only from a
    /// daemon (a reply to a daemon is dropped: daemons ask nothing).
    pub fn message(&mut self, now: Duration, from: &str, role: PeerRole, epoch: u64, msg: Wire) {
        let is_me = from == self.settings.id.0;
        match msg {
            Wire::Request(request) => self.client_message(from, request),
            Wire::Reply(Reply::Dashboard { fragment }) if self.controller_peer.as_deref() == Some(from) => {
                self.actions.push_back(NodeAction::ControllerDashboard { fragment });
            }
            // The answer to [`Self::ask_for_daemons`], from whichever daemon was asked (one that
            // redirected this node since answers too): no refusal.
            Wire::Reply(Reply::Status(status)) if role == PeerRole::Node && self.controller.is_none() => {
                self.heard_of_daemons(status.members)
            }
            Wire::Reply(reply) if self.controller_peer.as_deref() == Some(from) && self.replicated() => {
                self.refused_by_controller(from, reply)
            }
            Wire::Reply(reply) => tracing::debug!(node = %self.settings.id, %from, "ignored a reply: {reply:?}"),
            _ if role != PeerRole::Node => {}
            Wire::ToController(msg) if self.controller.is_some() => {
                self.controller_message(now, NodeId(from.to_owned()), epoch, msg);
                self.drive_membership();
            }
            Wire::ToController(_) => {
                let reply = self.redirect();
                self.send(from, reply);
            }
            Wire::ToNode(msg)
                if self.controller.is_some() && is_me || self.controller_peer.as_deref() == Some(from) =>
            {
                if !is_me && epoch < self.epoch() {
                    self.refuse();
                    return tracing::warn!(node = %self.settings.id, epoch, "refused a controller message of a stale epoch");
                }
                self.node_message(now, epoch, msg);
            }
            Wire::ToNode(_) => {}
        }
    }

    /// Replicated controllers: the node this one took for the controller answered as a non-leader —
    /// with the leader's address (followed), or knowing none (the next controller is tried).
    fn refused_by_controller(&mut self, from: &str, reply: Reply) {
        self.controller_peer = None;
        match reply {
            // Not to itself: a controller just removed from the voters may be named by one that has not
            // heard of the next leader yet.
            Reply::Redirect { controller } if controller != self.settings.addr => {
                tracing::info!(node = %self.settings.id, %from, %controller, "redirected to the controller");
                self.target = Some(controller);
            }
            other => {
                tracing::info!(node = %self.settings.id, %from, "not the controller: {other:?}");
                self.try_next_controller(None);
            }
        }
    }

    /// The endpoint has a new connection with `peer`. A member that connects again lost its previous
    /// connection (it crashed and restarted, or its link broke) and with it whatever was in flight: it
    /// leaves the view and rejoins, rather than carry on with messages silently missing.
    pub fn connected(&mut self, now: Duration, peer: &str, role: PeerRole) {
        let id = NodeId(peer.to_owned());
        let is_member = self.membership().is_some_and(|m| m.view().contains(&id));
        if is_member && role == PeerRole::Node && id != self.settings.id {
            self.membership_event(now, MembershipEvent::ConnectionLost { peer: id });
            self.drive_membership();
        }
    }

    /// The connection with `peer` ended without a goodbye.
    pub fn lost(&mut self, now: Duration, peer: &str) {
        self.forget_watcher(peer);
        if self.controller_peer.as_deref() == Some(peer) {
            // Replicated controllers: until its Raft group names the next leader, this node redirects
            // no one to the one it lost, and tries the others.
            (self.controller_peer, self.leader_addr) = (None, None);
            self.try_next_controller(Some(peer));
        }
        let id = NodeId(peer.to_owned());
        if self.membership().is_some_and(|m| m.view().contains(&id)) {
            self.membership_event(now, MembershipEvent::ConnectionLost { peer: id });
            self.drive_membership();
        }
    }

    /// `peer` closed its connection with a goodbye (its `Leave` came before).
    pub fn departed(&mut self, peer: &str) {
        self.forget_watcher(peer);
        if self.controller_peer.as_deref() == Some(peer) {
            self.controller_peer = None;
        }
    }

    /// A connection ended: whatever it watched, it watches no more. Each client connection has a name of
    /// its own (`<certificate name>#<n>`); a watcher that reconnects attaches again under its new one.
    fn forget_watcher(&mut self, peer: &str) {
        if let Some(c) = self.controller.as_mut() {
            for entry in c.jobs.values_mut() {
                entry.watchers.retain(|w| w != peer);
            }
        }
    }

    /// A dial ([`NodeAction::Dial`]) ended: connected to `peer`, and whether that connection is still up
    /// now. The dialing task says so, not the endpoint's event channel: the connection's loss may have
    /// come and gone already. Taken anyway, it would leave this node on a dead connection for good (it
    /// dials only while it has none); the next tick dials again.
    pub fn dialed(&mut self, now: Duration, addr: SocketAddr, result: Result<String, String>, still_up: bool) {
        if self.dialing != Some(addr) {
            return tracing::debug!(node = %self.settings.id, %addr, "a dial to an earlier controller's address ended");
        }
        self.dialing = None;
        if self.controller.is_some() {
            return;
        }
        match result {
            Ok(peer) if !still_up => {
                tracing::info!(node = %self.settings.id, %peer, "the new connection to the controller is gone already");
            }
            Ok(peer) => {
                tracing::info!(node = %self.settings.id, %peer, "connected to the controller");
                self.controller_peer = Some(peer);
                self.member.handle_timeout(now);
                self.drive_member(now);
            }
            Err(e) => {
                tracing::debug!(node = %self.settings.id, error = %e, "controller not reachable yet");
                if self.leader_addr.is_none() {
                    self.try_next_controller(None);
                }
            }
        }
    }

    /// `controllers add NODE` without an address: the Raft address NODE's `Join` announced (its node.toml
    /// `raft_listen`). Without one the group refuses the change, naming the fix.
    fn raft_address_of(&self, change: ControllersChange) -> ControllersChange {
        let ControllersChange::Add { node, raft_addr: None } = change else { return change };
        let members = &self.controller.as_ref().expect("controller").members;
        let raft_addr = members.get(&NodeId(node.clone())).and_then(|m| m.raft_listen);
        ControllersChange::Add { node, raft_addr }
    }

    /// Gives up the dial in flight, if any ([`NodeAction::CancelDial`]).
    fn cancel_dial(&mut self) {
        if let Some(addr) = self.dialing.take() {
            tracing::debug!(node = %self.settings.id, %addr, "giving up the dial");
            self.actions.push_back(NodeAction::CancelDial { addr });
        }
    }

    /// The node's timer: dial the controller when not connected, drive membership's timers; on the
    /// controller, failure detection and admitting joiners while no job runs.
    pub fn tick(&mut self, now: Duration) {
        if self.controller.is_none() && self.controller_peer.is_none() && !self.draining {
            let slow = self.dialing.is_some() && now.saturating_sub(self.dialing_since) >= CANDIDATE_DIAL;
            if slow && self.leader_addr.is_none() {
                self.try_next_controller(None);
            }
            if let Some(addr) = self.target.filter(|t| self.dialing != Some(*t)) {
                self.cancel_dial();
                (self.dialing, self.dialing_since) = (Some(addr), now);
                self.actions.push_back(NodeAction::Dial { addr });
            }
        }
        if self.controller.is_some() {
            // This node is the controller: it cannot lose itself, however late a tick runs.
            self.member.heard_from_controller(now);
        }
        self.member.handle_timeout(now);
        self.drive_member(now);
        if self.controller.is_some() {
            let idle = !self.any_job_running();
            let me = self.settings.id.clone();
            let c = self.controller.as_mut().expect("controller");
            if now >= c.expecting_until {
                // The restored jobs resumed without whoever did not rejoin: nobody waits for them now.
                c.expecting.clear();
            }
            // The controller is alive by definition while it ticks: it never times itself out, however
            // late a tick runs on a loaded machine.
            let epoch = c.membership.epoch();
            c.membership.handle(now, MembershipEvent::Heartbeat { from: me, epoch });
            c.membership.handle_timeout(now);
            if idle && c.membership.joining().next().is_some() {
                c.membership.handle(now, MembershipEvent::StepBoundary);
            }
            self.drive_membership();
        }
    }

    /// Worker `slot` failed: its attempts are reported failed, and it is restarted — or the node stops,
    /// when it failed too often ([`RestartPolicy`]).
    pub fn worker_failed(&mut self, now: Duration, slot: usize, error: &str) {
        let Some(worker) = self.workers.get_mut(slot) else { return };
        let decision = worker.restarts.on_failure(now);
        let attempts = std::mem::take(&mut worker.attempts);
        self.actions.push_back(NodeAction::Note(NodeNote::WorkerFailed { slot }));
        let id = self.settings.id.clone();
        for (job, attempt) in attempts {
            let outcome = AttemptOutcome::Failed { step: 0, reason: format!("worker {slot} of {id} failed: {error}") };
            self.send_to_controller(ToController::Ended { job, attempt, slot: slot as u32, outcome });
        }
        match decision {
            Decision::Restart { attempt } => {
                self.record_change(format!("{id}: worker {slot} failed ({error}); restart {attempt}"));
                self.actions.push_back(NodeAction::RestartWorker { slot });
            }
            Decision::Escalate { failures } => {
                let policy = self.settings.restart;
                let reason = format!(
                    "worker {slot} failed {failures} times within {} ms (restart.max_restarts = {}); last: {error}",
                    policy.window_ms, policy.max_restarts
                );
                tracing::error!(node = %id, "{reason}; stopping this node");
                self.actions.push_back(NodeAction::Stop { reason });
            }
        }
    }

    /// SIGTERM: drop all job state and say `Leave`; the shell then closes its connections.
    pub fn drain(&mut self) {
        self.draining = true;
        self.each_worker(|| WorkerMsg::DropAll);
        if self.controller.is_none() {
            self.send_to_controller(ToController::Leave);
        }
    }
}

/// What a controller taking over after `last` (recorded by another, or by itself before a restart)
/// waits for: the controller that recorded it if that was another one (it lost its majority: presumed
/// gone; if it was only cut off it rejoins later as a member), and the nodes the restored jobs wait for
/// — `last`'s members and those its recorder still expected (a controller deposed before the nodes it
/// waited for rejoined recorded a view without them, yet they may hold the jobs' state in memory).
fn expected_after(last: &StoredView, me: &NodeId) -> (Option<String>, Vec<NodeId>) {
    let previous = last.recorded_by.as_ref().map(|(name, _)| name.clone()).filter(|name| *name != me.0);
    let mut expect: Vec<NodeId> = Vec::new();
    for name in last.members.iter().chain(&last.expecting) {
        if Some(name) != previous.as_ref() && !expect.iter().any(|n| n.0 == *name) {
            expect.push(NodeId(name.clone()));
        }
    }
    (previous, expect)
}
