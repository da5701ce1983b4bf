//! NodeActor: the daemon. Supervises one [`WorkerActor`] per device slot, speaks the control protocol
//! over QUIC, runs the node's side of membership ([`MemberState`]) and — on the controller (the node
//! started without `join`) — the authoritative [`Membership`] and one [`JobController`] per job.
//!
//! Fencing: every control message carries its sender's epoch. The controller refuses job messages from
//! a node that is not in its view, or that acts on an older epoch, and answers a non-member with
//! `Fenced`; the fenced node drops all job state and rejoins as a new member.

use std::collections::{BTreeMap, VecDeque};
use std::net::SocketAddr;
use std::sync::Arc;
use std::time::{Duration, Instant};

use ractor::{Actor, ActorProcessingErr, ActorRef, RpcReplyPort, SupervisionEvent};
use troupe_cluster::control::{ControlEndpoint, ControlEvent, PeerRole};
use troupe_cluster::membership::{
    Epoch, MemberAction, MemberState, Membership, MembershipAction, MembershipEvent, NodeId,
};
use troupe_cluster::NodeIdentity;

use super::controller::{JobArgs, JobController, JobMsg};
use super::event_log::EventLog;
use super::outbox::Outboxes;
use super::worker::{WorkerActor, WorkerArgs, WorkerMsg};
use crate::catalog::{Catalog, StoredJob, StoredView};
use crate::node_config::restart::{Decision, RestartTracker};
use crate::node_config::NodeConfig;
use crate::protocol::{AttemptOutcome, ClusterStatus, DataPlane, JobEvent, JobId, JobInfo, JobSpec, MemberInfo, Wire};
use crate::telemetry::NodeMetrics;

/// How often the node drives its timers (heartbeats, failure detection, reconnection).
const TICK_MS: u64 = 50;
/// Membership changes kept for `troupe status`.
const CHANGES_KEPT: usize = 64;

pub enum NodeMsg {
    Control(ControlEvent),
    Tick,
    /// A local worker's message for the controller.
    FromWorker(Wire),
    /// A job controller's message for a node.
    Outgoing {
        node: NodeId,
        msg: Wire,
    },
    JobEvent {
        job: JobId,
        event: JobEvent,
        info: JobInfo,
    },
    JobInfo(JobInfo),
    StepBoundary,
    Connected(Result<String, String>),
    Status(RpcReplyPort<ClusterStatus>),
    /// SIGTERM: leave the cluster cleanly, then stop.
    Drain(RpcReplyPort<()>),
    Worker(u32, RpcReplyPort<Option<ActorRef<WorkerMsg>>>),
}

pub struct NodeArgs {
    pub config: NodeConfig,
    pub identity: Arc<NodeIdentity>,
    pub endpoint: ControlEndpoint,
    pub events: tokio::sync::mpsc::UnboundedReceiver<ControlEvent>,
    /// Set to the reason when the node stops because a child kept failing (escalation).
    pub stop_reason: Arc<std::sync::Mutex<Option<String>>>,
    /// What `/metrics` reports; updated as events pass.
    pub metrics: Arc<NodeMetrics>,
    /// The daemon's catalog: the controller records its views and jobs there, and restarts from it.
    pub catalog: Catalog,
}

struct WorkerSlot {
    actor: ActorRef<WorkerMsg>,
    restarts: RestartTracker,
    /// Attempts this worker was asked to prepare, per job (reported failed if it restarts).
    attempts: BTreeMap<JobId, u64>,
}

struct JobEntry {
    actor: Option<ActorRef<JobMsg>>,
    info: JobInfo,
    watchers: Vec<String>,
    log: EventLog,
}

/// What only the controller holds.
struct Leader {
    membership: Membership,
    members: BTreeMap<NodeId, MemberInfo>,
    jobs: BTreeMap<JobId, JobEntry>,
    next_job: JobId,
}

pub struct NodeState {
    config: NodeConfig,
    id: NodeId,
    identity: Arc<NodeIdentity>,
    endpoint: ControlEndpoint,
    /// Control messages to peers, queued per peer and written by a task each: sends never wait here.
    outboxes: std::sync::Mutex<Outboxes>,
    started: Instant,
    member: MemberState,
    leader: Option<Leader>,
    /// The controller's name once connected (non-controllers).
    leader_peer: Option<String>,
    connecting: bool,
    members: Vec<MemberInfo>,
    workers: Vec<WorkerSlot>,
    refused_stale: u64,
    changes: VecDeque<String>,
    draining: bool,
    stop_reason: Arc<std::sync::Mutex<Option<String>>>,
    metrics: Arc<NodeMetrics>,
    catalog: Catalog,
    /// The jobs whose state a `Fenced` just received says to keep.
    keep_on_fence: Vec<JobId>,
}

pub struct NodeActor;

/// Actor names are process-global in ractor: scope them by node name and listen address, so several
/// nodes (even of different clusters, as in tests) can share a process.
pub fn actor_scope(node: &str, addr: SocketAddr) -> String {
    format!("troupe/{node}@{addr}")
}

/// The membership incarnation this process starts with (`MemberState::joining`): random, so a restarted
/// daemon never repeats one its earlier process used (each fence adds one to it), and the controller
/// takes its join for a restart, not for a duplicate of the old process's.
fn new_incarnation() -> Result<u64, ActorProcessingErr> {
    let bytes: [u8; 8] = ring::rand::generate(&ring::rand::SystemRandom::new())
        .map_err(|_| "no randomness from the operating system for this node's membership incarnation")?
        .expose();
    Ok(u64::from_le_bytes(bytes))
}

impl NodeState {
    fn now(&self) -> Duration {
        self.started.elapsed()
    }

    fn scope(&self) -> String {
        actor_scope(&self.id.0, self.endpoint.local_addr())
    }

    /// The epoch this node acts on: the authoritative one on the controller, else its adopted view's.
    fn epoch(&self) -> u64 {
        match &self.leader {
            Some(l) => l.membership.epoch().0,
            None => self.member.epoch().map_or(0, |e| e.0),
        }
    }

    fn leader_addr(&self) -> SocketAddr {
        self.config.join.unwrap_or_else(|| self.endpoint.local_addr())
    }

    /// Sends `msg` to `peer` (to this node's own handler if `peer` is itself). Never waits: the message
    /// joins the peer's outbox, written in order by its own task.
    fn send(&self, me: &ActorRef<NodeMsg>, peer: &str, msg: Wire) {
        if peer == self.id.0 {
            let event = ControlEvent::Message {
                from: peer.to_owned(),
                role: PeerRole::Node,
                epoch: self.epoch(),
                body: msg.encode(),
            };
            let _ = me.cast(NodeMsg::Control(event));
            return;
        }
        let mut outboxes = self.outboxes.lock().expect("the outboxes' lock is never poisoned");
        outboxes.send(peer, self.epoch(), msg.encode());
    }

    fn send_to_leader(&self, me: &ActorRef<NodeMsg>, msg: Wire) {
        if self.leader.is_some() {
            self.send(me, &self.id.0, msg);
        } else if let Some(peer) = &self.leader_peer {
            self.send(me, peer, msg);
        }
    }

    fn record_change(&mut self, change: String) {
        tracing::info!(node = %self.id, "{change}");
        if self.changes.len() == CHANGES_KEPT {
            self.changes.pop_front();
        }
        self.changes.push_back(change);
    }

    fn status(&self) -> ClusterStatus {
        let (members, joining, jobs) = match &self.leader {
            Some(l) => (
                l.membership.view().members().iter().filter_map(|m| l.members.get(m).cloned()).collect(),
                l.membership.joining().map(|n| n.0.clone()).collect(),
                l.jobs.values().map(|j| j.info.clone()).collect(),
            ),
            None => (self.members.clone(), Vec::new(), Vec::new()),
        };
        ClusterStatus {
            node: self.id.0.clone(),
            leader: self.leader.is_some(),
            leader_addr: Some(self.leader_addr()),
            epoch: self.leader.as_ref().map_or(self.epoch(), |l| l.membership.epoch().0),
            members,
            joining,
            jobs,
            refused_stale: self.refused_stale,
            changes: self.changes.iter().cloned().collect(),
        }
    }

    async fn spawn_worker(&self, me: &ActorRef<NodeMsg>, slot: u32) -> Result<ActorRef<WorkerMsg>, ActorProcessingErr> {
        let args = WorkerArgs {
            slot,
            node: me.clone(),
            identity: self.identity.clone(),
            host: self.config.listen.ip(),
            transport: self.config.transport.clone(),
            metrics: self.metrics.clone(),
        };
        let (actor, _) =
            Actor::spawn_linked(Some(format!("{}/worker/{slot}", self.scope())), WorkerActor, args, me.get_cell())
                .await?;
        Ok(actor)
    }

    /// The controller's jobs that have not ended.
    fn live_jobs(&self) -> Vec<JobId> {
        let Some(leader) = &self.leader else { return Vec::new() };
        leader.jobs.iter().filter(|(_, j)| !j.info.state.is_terminal()).map(|(id, _)| *id).collect()
    }

    fn any_job_running(&self) -> bool {
        self.leader
            .as_ref()
            .is_some_and(|l| l.jobs.values().any(|j| j.info.state == crate::protocol::JobState::Running))
    }

    // ---- the node's side of membership ----

    async fn drive_member(&mut self, me: &ActorRef<NodeMsg>) {
        while let Some(action) = self.member.poll_action() {
            match action {
                MemberAction::SendHeartbeat { .. } => self.send_to_leader(me, Wire::Heartbeat),
                MemberAction::SendJoinRequest { incarnation } => {
                    let (slots, addr) = (self.config.slots, self.endpoint.local_addr());
                    let join = Wire::Join { slots, addr, incarnation: Some(incarnation) };
                    self.send_to_leader(me, join);
                }
                MemberAction::AdoptView(view) => {
                    tracing::info!(node = %self.id, epoch = view.epoch.0, members = view.len(), "adopted view");
                }
                MemberAction::Fenced { current } => {
                    self.record_change(format!(
                        "{} was fenced at epoch {current}; aborting its attempts and rejoining",
                        self.id
                    ));
                    // Removed from a view without a `Fenced` (a view that left it out): nothing is kept.
                    let keep = std::mem::take(&mut self.keep_on_fence);
                    for w in &mut self.workers {
                        let _ = w.actor.cast(WorkerMsg::AbortAll { keep: keep.clone() });
                        w.attempts.clear();
                    }
                }
                MemberAction::ControllerLost { silent_ms } => {
                    // The controller answers every heartbeat, so this is a slow or dead controller or link.
                    // The connection itself is kept: QUIC's idle timeout says whether it is dead, and a
                    // new connection would silently lose what is in flight on this one.
                    tracing::warn!(node = %self.id, silent_ms, "nothing heard from the controller");
                }
            }
        }
    }

    // ---- the controller ----

    async fn drive_membership(&mut self, me: &ActorRef<NodeMsg>) {
        let Some(leader) = self.leader.as_mut() else { return };
        let mut actions = Vec::new();
        while let Some(a) = leader.membership.poll_action() {
            actions.push(a);
        }
        for action in actions {
            match action {
                MembershipAction::ViewChanged { view, changes } => {
                    // Recorded before anyone hears of it: a restarted controller starts past this epoch.
                    let stored = StoredView {
                        epoch: view.epoch.0,
                        members: view.members().iter().map(|m| m.0.clone()).collect(),
                    };
                    let catalog = self.catalog.clone();
                    match tokio::task::spawn_blocking(move || catalog.save_view(&stored)).await {
                        Ok(Ok(())) => {}
                        Ok(Err(e)) => {
                            tracing::error!(node = %self.id, "{e:#}; a controller restart would reuse epochs")
                        }
                        Err(e) => tracing::error!(node = %self.id, "recording the view: {e}"),
                    }
                    self.metrics.on_view_change(view.epoch.0, &changes);
                    let changes: Vec<String> = changes.iter().map(|c| format!("{c:?}")).collect();
                    for c in &changes {
                        self.record_change(format!("epoch {}: {c}", view.epoch));
                    }
                    let jobs = self.live_jobs();
                    let leader = self.leader.as_ref().expect("controller");
                    let members: Vec<MemberInfo> =
                        view.members().iter().filter_map(|m| leader.members.get(m).cloned()).collect();
                    for job in leader.jobs.values() {
                        if let Some(actor) = &job.actor {
                            let msg =
                                JobMsg::View { view: view.clone(), members: members.clone(), changes: changes.clone() };
                            let _ = actor.cast(msg);
                        }
                    }
                    let msg = Wire::View { view: view.clone(), members: members.clone(), jobs };
                    for node in view.members() {
                        self.send(me, &node.0, msg.clone());
                    }
                }
                MembershipAction::Fence { node, stale_epoch, current } => {
                    self.refused_stale += 1;
                    tracing::warn!(%node, %stale_epoch, %current, "refused a message from a non-member; fencing it");
                    let jobs = self.live_jobs();
                    self.send(me, &node.0, Wire::Fenced { current, jobs });
                }
                MembershipAction::SendView { node, view } => {
                    let jobs = self.live_jobs();
                    let leader = self.leader.as_ref().expect("controller");
                    let members = view.members().iter().filter_map(|m| leader.members.get(m).cloned()).collect();
                    self.send(me, &node.0, Wire::View { view, members, jobs });
                }
            }
        }
    }

    fn membership_event(&mut self, event: MembershipEvent) {
        let now = self.now();
        if let Some(l) = self.leader.as_mut() {
            l.membership.handle(now, event);
        }
    }

    /// A job message from `from` at `epoch`: accepted only from a member of the current view. A
    /// non-member's message counts as refused-stale (it is fenced). A member that lags behind the view is
    /// accepted: the driver matches messages to attempts, and an attempt may outlive a view change that
    /// did not touch its ranks. One stamped before the view that admitted the member is refused: an
    /// earlier membership of the node sent it, and it came late, on a connection since replaced (each
    /// connection's reader feeds the endpoint's events on its own).
    fn admit_job_message(&mut self, from: &NodeId, epoch: u64) -> Result<(), Epoch> {
        let membership = &self.leader.as_ref().expect("controller").membership;
        let (view, admitted) = (membership.view(), membership.admitted_at(from));
        let current = view.epoch;
        if !view.contains(from) {
            self.refused_stale += 1;
            tracing::warn!(%from, epoch, %current, "refused a job message from a non-member; fencing it");
            return Err(current);
        }
        if let Some(admitted) = admitted.filter(|a| epoch < a.0) {
            self.refused_stale += 1;
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

    async fn leader_message(&mut self, me: &ActorRef<NodeMsg>, from: NodeId, epoch: u64, msg: Wire) {
        let job_msg = match msg {
            Wire::Join { slots, addr, incarnation } => {
                let info = MemberInfo { name: from.0.clone(), addr, slots };
                self.leader.as_mut().expect("controller").members.insert(from.clone(), info);
                self.membership_event(MembershipEvent::JoinRequest { from, incarnation });
                return;
            }
            Wire::Heartbeat => {
                let member = self.leader.as_ref().expect("controller").membership.view().contains(&from);
                if member && from != self.id {
                    self.send(me, &from.0, Wire::Alive);
                }
                return self.membership_event(MembershipEvent::Heartbeat { from, epoch: Epoch(epoch) });
            }
            Wire::Leave => return self.membership_event(MembershipEvent::Leave { from }),
            Wire::Ready { job, attempt, slot, data_addr, committed } => {
                (job, JobMsg::Ready { node: from.clone(), attempt, slot, addr: data_addr, committed })
            }
            Wire::Vote { job, attempt, slot, step, figures, seconds } => {
                (job, JobMsg::Vote { node: from.clone(), attempt, slot, step, figures, seconds })
            }
            Wire::Ended { job, attempt, slot, outcome } => {
                (job, JobMsg::Ended { node: from.clone(), attempt, slot, outcome })
            }
            Wire::Checkpointed { job, attempt, step, path, seconds, bytes } => {
                (job, JobMsg::Checkpointed { attempt, step, path, seconds, bytes })
            }
            Wire::Evaluated { job, attempt, step, figures } => (job, JobMsg::Evaluated { attempt, step, figures }),
            Wire::Phases { job, attempt, rank, step, spans, stage, .. } => {
                (job, JobMsg::Phases { node: from.clone(), attempt, rank, step, spans, stage })
            }
            other => return tracing::warn!(%from, "unexpected message for the controller: {other:?}"),
        };
        if let Err(current) = self.admit_job_message(&from, epoch) {
            if !self.leader.as_ref().expect("controller").membership.view().contains(&from) {
                let jobs = self.live_jobs();
                self.send(me, &from.0, Wire::Fenced { current, jobs });
            }
            return;
        }
        let (job, msg) = job_msg;
        if let Some(actor) = self.leader.as_ref().and_then(|l| l.jobs.get(&job)).and_then(|j| j.actor.as_ref()) {
            let _ = actor.cast(msg);
        }
    }

    async fn submit(&mut self, me: &ActorRef<NodeMsg>, client: &str, mut spec: JobSpec) -> Wire {
        if let Err(e) = spec.config.validate() {
            return Wire::Error { message: format!("job config: {e}") };
        }
        if spec.data_plane == DataPlane::PlaintextTcp && !self.config.allow_plaintext_tcp {
            return Wire::Error {
                message: "data_plane = plaintext_tcp: this cluster does not allow tensors between hosts unencrypted; \
                          set `allow_plaintext_tcp = true` in the controller's node config (trusted fabrics only), \
                          or submit with data_plane = auto"
                    .into(),
            };
        }
        let leader = self.leader.as_mut().expect("controller");
        let id = leader.next_job;
        leader.next_job += 1;
        if spec.trace_seed == 0 {
            spec.trace_seed = crate::telemetry::otel::new_trace_seed(id);
        }
        let view = leader.membership.view().clone();
        let members = view.members().iter().filter_map(|m| leader.members.get(m).cloned()).collect();
        let info = super::job::JobDriver::new(id, spec.clone()).info();
        self.metrics.on_submit(id, &spec);
        let catalog = self.catalog.clone();
        let args = JobArgs { id, spec, node: me.clone(), view, members, catalog, restored: None };
        let name = format!("{}/job/{id}", self.scope());
        match Actor::spawn_linked(Some(name), JobController, args, me.get_cell()).await {
            Ok((actor, _)) => {
                let entry =
                    JobEntry { actor: Some(actor), info, watchers: vec![client.to_owned()], log: EventLog::default() };
                self.leader.as_mut().expect("controller").jobs.insert(id, entry);
                tracing::info!(node = %self.id, job = id, "job submitted");
                Wire::Submitted { job: id }
            }
            Err(e) => Wire::Error { message: format!("starting the job controller: {e}") },
        }
    }

    async fn client_message(&mut self, me: &ActorRef<NodeMsg>, from: &str, msg: Wire) {
        let not_leader = || Wire::Redirect { leader: self.leader_addr() };
        let reply = match msg {
            Wire::StatusRequest => Wire::Status(Box::new(self.status())),
            Wire::Submit { spec } if self.leader.is_some() => self.submit(me, from, *spec).await,
            Wire::JobStatusRequest { job } | Wire::Watch { job, .. } | Wire::Cancel { job }
                if self.leader.is_none() =>
            {
                let _ = job;
                not_leader()
            }
            Wire::Submit { .. } => not_leader(),
            Wire::JobStatusRequest { job } => self.job_reply(job, |_| {}),
            Wire::Watch { job, since } => {
                // The missed events go out before the reply, on the same ordered stream, so the watcher
                // sees them first and in order; a watcher that reconnects replaces its old entry.
                let missed: Vec<(u64, JobEvent)> = match (since, self.leader.as_ref().and_then(|l| l.jobs.get(&job))) {
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
                    self.send(me, from, Wire::Event { job, seq, event });
                }
                let watcher = from.to_owned();
                self.job_reply(job, move |entry| {
                    entry.watchers.retain(|w| *w != watcher);
                    entry.watchers.push(watcher);
                })
            }
            Wire::Cancel { job } => self.job_reply(job, |entry| {
                if let Some(actor) = &entry.actor {
                    let _ = actor.cast(JobMsg::Cancel);
                }
            }),
            other => Wire::Error { message: format!("not a client request: {other:?}") },
        };
        self.send(me, from, reply);
    }

    /// A job of the catalog, after a restart: its events are replayed to watchers that reconnect, and
    /// unless it had ended a job controller resumes it once the nodes of the last view (`expect`) rejoined.
    async fn restore_job(&mut self, me: &ActorRef<NodeMsg>, job: StoredJob, expect: &[NodeId]) {
        let StoredJob { spec, info, first_event, events } = job;
        let log = EventLog::restore(first_event, events);
        let id = info.id;
        let actor = if info.state.is_terminal() {
            None
        } else {
            let leader = self.leader.as_ref().expect("controller");
            let view = leader.membership.view().clone();
            let members = view.members().iter().filter_map(|m| leader.members.get(m).cloned()).collect();
            self.metrics.on_submit(id, &spec);
            let restored = Some((info.clone(), log.end(), expect.to_vec()));
            let args = JobArgs { id, spec, node: me.clone(), view, members, catalog: self.catalog.clone(), restored };
            match Actor::spawn_linked(Some(format!("{}/job/{id}", self.scope())), JobController, args, me.get_cell())
                .await
            {
                Ok((actor, _)) => Some(actor),
                Err(e) => {
                    tracing::error!(job = id, "restarting the job controller: {e}");
                    None
                }
            }
        };
        tracing::info!(node = %self.id, job = id, state = ?info.state, step = info.step, "job restored from the catalog");
        let entry = JobEntry { actor, info, watchers: Vec::new(), log };
        self.leader.as_mut().expect("controller").jobs.insert(id, entry);
    }

    fn job_reply(&mut self, job: JobId, f: impl FnOnce(&mut JobEntry)) -> Wire {
        match self.leader.as_mut().and_then(|l| l.jobs.get_mut(&job)) {
            Some(entry) => {
                f(entry);
                Wire::JobStatus(Box::new(JobInfo { events: entry.log.end(), ..entry.info.clone() }))
            }
            None => Wire::Error { message: format!("no job {job} on this cluster (see `troupe status`)") },
        }
    }

    // ---- messages from the controller to this node ----

    async fn node_message(&mut self, me: &ActorRef<NodeMsg>, epoch: u64, msg: Wire) {
        let now = self.now();
        self.member.heard_from_controller(now);
        match msg {
            Wire::View { view, members, jobs } => {
                self.members = members;
                self.member.handle_view(now, view);
                self.drive_member(me).await;
                // A job that ended while its `Release` could not reach this node (paused, cut off, or
                // fenced with a list that still named it) leaves no state behind.
                self.each_worker(|| WorkerMsg::Retain { jobs: jobs.clone() });
                self.workers.iter_mut().for_each(|w| w.attempts.retain(|job, _| jobs.contains(job)));
            }
            Wire::Fenced { current, jobs } => {
                self.keep_on_fence = jobs;
                self.member.handle_fence(now, current);
                self.drive_member(me).await;
                // Used by the fence just driven, if any; a node already rejoining keeps no stale list.
                self.keep_on_fence.clear();
            }
            Wire::Prepare { job, attempt, spec, ranks, discard_from } => {
                for (rank, r) in ranks.iter().enumerate().filter(|(_, r)| r.node == self.id) {
                    if let Some(w) = self.workers.get_mut(r.slot as usize) {
                        w.attempts.insert(job, attempt);
                        let msg = WorkerMsg::Prepare { job, attempt, spec: spec.clone(), rank, epoch, discard_from };
                        let _ = w.actor.cast(msg);
                    }
                }
            }
            Wire::Start { job, attempt, roster, source } => {
                self.each_worker(|| WorkerMsg::Start { job, attempt, roster: roster.clone(), source })
            }
            Wire::Commit { job, attempt, step, .. } => self.each_worker(|| WorkerMsg::Commit { job, attempt, step }),
            Wire::Abort { job, attempt, .. } => self.each_worker(|| WorkerMsg::Abort { job, attempt }),
            Wire::Release { job } => {
                self.each_worker(|| WorkerMsg::Release { job });
                self.workers.iter_mut().for_each(|w| {
                    w.attempts.remove(&job);
                });
            }
            Wire::Alive => {}
            other => tracing::warn!(node = %self.id, "unexpected message from the controller: {other:?}"),
        }
    }

    fn each_worker(&self, msg: impl Fn() -> WorkerMsg) {
        for w in &self.workers {
            let _ = w.actor.cast(msg());
        }
    }

    async fn on_control(&mut self, me: &ActorRef<NodeMsg>, event: ControlEvent) {
        match event {
            ControlEvent::Message { from, role, epoch, body } => {
                let msg = match Wire::decode(&body) {
                    Ok(m) => m,
                    Err(e) => return tracing::warn!(node = %self.id, %from, "{e}"),
                };
                if msg.is_client_request() {
                    return self.client_message(me, &from, msg).await;
                }
                if role != PeerRole::Node {
                    return;
                }
                if msg.is_for_controller() {
                    if self.leader.is_some() {
                        self.leader_message(me, NodeId(from), epoch, msg).await;
                        self.drive_membership(me).await;
                    } else {
                        self.send(me, &from, Wire::Redirect { leader: self.leader_addr() });
                    }
                } else if self.leader.is_some() && from == self.id.0 || self.leader_peer.as_deref() == Some(&from) {
                    if from != self.id.0 && epoch < self.epoch() {
                        self.refused_stale += 1;
                        return tracing::warn!(node = %self.id, epoch, "refused a controller message of a stale epoch");
                    }
                    self.node_message(me, epoch, msg).await;
                }
            }
            ControlEvent::Connected { peer, role, addr } => {
                tracing::debug!(node = %self.id, %peer, ?role, %addr, "connected");
                // A member that connects again lost its previous connection (it crashed and restarted, or
                // its link broke) and with it whatever was in flight: it leaves the view and rejoins,
                // rather than carry on with messages silently missing.
                let id = NodeId(peer.clone());
                let is_member = self.leader.as_ref().is_some_and(|l| l.membership.view().contains(&id));
                if is_member && role == PeerRole::Node && id != self.id {
                    self.membership_event(MembershipEvent::ConnectionLost { peer: id });
                    self.drive_membership(me).await;
                }
            }
            ControlEvent::Lost { peer, reason } => {
                tracing::info!(node = %self.id, %peer, %reason, "connection lost");
                if self.leader_peer.as_deref() == Some(&peer) {
                    self.leader_peer = None;
                }
                let is_member =
                    self.leader.as_ref().is_some_and(|l| l.membership.view().contains(&NodeId(peer.clone())));
                if is_member {
                    self.membership_event(MembershipEvent::ConnectionLost { peer: NodeId(peer) });
                    self.drive_membership(me).await;
                }
            }
            ControlEvent::Departed { peer } => {
                if self.leader_peer.as_deref() == Some(&peer) {
                    self.leader_peer = None;
                }
            }
        }
    }

    async fn on_tick(&mut self, me: &ActorRef<NodeMsg>) {
        let now = self.now();
        if self.leader.is_none() && self.leader_peer.is_none() && !self.connecting && !self.draining {
            self.connecting = true;
            let (endpoint, addr, me2) = (self.endpoint.clone(), self.leader_addr(), me.clone());
            tokio::spawn(async move {
                let result = endpoint.connect(addr).await.map_err(|e| e.to_string());
                let _ = me2.cast(NodeMsg::Connected(result));
            });
        }
        if self.leader.is_some() {
            // This node is the controller: it cannot lose itself, however late a tick runs.
            self.member.heard_from_controller(now);
        }
        self.member.handle_timeout(now);
        self.drive_member(me).await;
        if self.leader.is_some() {
            let idle = !self.any_job_running();
            let l = self.leader.as_mut().expect("controller");
            // The controller is alive by definition while it ticks: it never times itself out, however
            // late a tick runs on a loaded machine.
            let epoch = l.membership.epoch();
            l.membership.handle(now, MembershipEvent::Heartbeat { from: self.id.clone(), epoch });
            l.membership.handle_timeout(now);
            if idle && l.membership.joining().next().is_some() {
                l.membership.handle(now, MembershipEvent::StepBoundary);
            }
            self.drive_membership(me).await;
        }
    }

    async fn on_worker_failed(
        &mut self,
        me: &ActorRef<NodeMsg>,
        slot: usize,
        error: String,
    ) -> Result<(), ActorProcessingErr> {
        let now = self.now();
        let decision = self.workers[slot].restarts.on_failure(now);
        self.metrics.on_worker_failure();
        let attempts = std::mem::take(&mut self.workers[slot].attempts);
        for (job, attempt) in attempts {
            let outcome =
                AttemptOutcome::Failed { step: 0, reason: format!("worker {slot} of {} failed: {error}", self.id) };
            self.send_to_leader(me, Wire::Ended { job, attempt, slot: slot as u32, outcome });
        }
        match decision {
            Decision::Restart { attempt } => {
                self.record_change(format!("{}: worker {slot} failed ({error}); restart {attempt}", self.id));
                self.workers[slot].actor = self.spawn_worker(me, slot as u32).await?;
                Ok(())
            }
            Decision::Escalate { failures } => {
                let why = format!(
                    "worker {slot} failed {failures} times within {} ms (restart.max_restarts = {}); last: {error}",
                    self.config.restart.window_ms, self.config.restart.max_restarts
                );
                tracing::error!(node = %self.id, "{why}; stopping this node");
                *self.stop_reason.lock().unwrap_or_else(|p| p.into_inner()) = Some(why.clone());
                Err(why.into())
            }
        }
    }
}

impl Actor for NodeActor {
    type Msg = NodeMsg;
    type State = NodeState;
    type Arguments = NodeArgs;

    async fn pre_start(&self, me: ActorRef<NodeMsg>, args: NodeArgs) -> Result<NodeState, ActorProcessingErr> {
        let NodeArgs { config, identity, endpoint, mut events, stop_reason, metrics, catalog } = args;
        let id = NodeId(config.name.clone());
        let started = Instant::now();
        let incarnation = new_incarnation()?;
        // A controller that ran before on this data dir starts past its last epoch and resumes its jobs.
        let (stored_view, stored_jobs) =
            if config.join.is_none() { (catalog.view()?, catalog.jobs()?) } else { (None, Vec::new()) };
        let (member, leader) = if config.join.is_none() {
            let epoch = Epoch(stored_view.as_ref().map_or(1, |v| v.epoch + 1));
            let membership =
                Membership::starting_at(config.membership.clone(), Duration::ZERO, vec![id.clone()], epoch);
            let view = membership.view().clone();
            // Recorded before it is announced (a `Fenced` names it): a second restart starts past it too.
            catalog.save_view(&StoredView { epoch: epoch.0, members: vec![id.0.clone()] })?;
            let info = MemberInfo { name: id.0.clone(), addr: endpoint.local_addr(), slots: config.slots };
            let leader = Leader {
                membership,
                members: BTreeMap::from([(id.clone(), info)]),
                jobs: BTreeMap::new(),
                next_job: stored_jobs.iter().map(|j| j.info.id + 1).max().unwrap_or(1),
            };
            let member = MemberState::member(id.clone(), config.membership.clone(), Duration::ZERO, view, incarnation);
            (member, Some(leader))
        } else {
            (MemberState::joining(id.clone(), config.membership.clone(), Duration::ZERO, incarnation), None)
        };
        let pump = me.clone();
        tokio::spawn(async move {
            while let Some(event) = events.recv().await {
                if pump.cast(NodeMsg::Control(event)).is_err() {
                    return;
                }
            }
        });
        let mut state = NodeState {
            members: leader.as_ref().map(|l| l.members.values().cloned().collect()).unwrap_or_default(),
            config,
            outboxes: std::sync::Mutex::new(Outboxes::new(endpoint.clone(), id.0.clone())),
            id,
            identity,
            endpoint,
            started,
            member,
            leader,
            leader_peer: None,
            connecting: false,
            workers: Vec::new(),
            refused_stale: 0,
            changes: VecDeque::new(),
            draining: false,
            stop_reason,
            metrics,
            catalog,
            keep_on_fence: Vec::new(),
        };
        if let Some(view) = stored_view {
            let expect: Vec<NodeId> = view.members.into_iter().map(NodeId).collect();
            let open = stored_jobs.iter().filter(|j| !j.info.state.is_terminal()).count();
            state.record_change(format!(
                "{} restarted as the controller at epoch {} (last view: epoch {}, {} members); resuming {open} job(s)",
                state.id,
                state.epoch(),
                view.epoch,
                expect.len()
            ));
            for job in stored_jobs {
                state.restore_job(&me, job, &expect).await;
            }
        }
        for slot in 0..state.config.slots {
            let actor = state.spawn_worker(&me, slot).await?;
            state.workers.push(WorkerSlot {
                actor,
                restarts: RestartTracker::new(state.config.restart),
                attempts: BTreeMap::new(),
            });
        }
        me.send_interval(Duration::from_millis(TICK_MS), || NodeMsg::Tick);
        Ok(state)
    }

    async fn handle(
        &self,
        me: ActorRef<NodeMsg>,
        msg: NodeMsg,
        state: &mut NodeState,
    ) -> Result<(), ActorProcessingErr> {
        match msg {
            NodeMsg::Control(event) => state.on_control(&me, event).await,
            NodeMsg::Tick => state.on_tick(&me).await,
            NodeMsg::FromWorker(wire) => state.send_to_leader(&me, wire),
            NodeMsg::Outgoing { node, msg } => state.send(&me, &node.0, msg),
            NodeMsg::JobEvent { job, event, info } => {
                let (seq, watchers) = match state.leader.as_mut().and_then(|l| l.jobs.get_mut(&job)) {
                    Some(entry) => {
                        entry.info = info;
                        entry.log.push(event.clone());
                        (entry.log.end() - 1, entry.watchers.clone())
                    }
                    None => return Ok(()),
                };
                state.metrics.on_job_event(job, &event, Instant::now());
                if let JobEvent::Membership { changes, .. } = &event {
                    tracing::info!(node = %state.id, job, ?changes, "job re-planned after a membership change");
                }
                for w in watchers {
                    state.send(&me, &w, Wire::Event { job, seq, event: event.clone() });
                }
            }
            NodeMsg::JobInfo(info) => {
                if let Some(entry) = state.leader.as_mut().and_then(|l| l.jobs.get_mut(&info.id)) {
                    entry.info = info;
                }
            }
            NodeMsg::StepBoundary => {
                state.membership_event(MembershipEvent::StepBoundary);
                state.drive_membership(&me).await;
            }
            NodeMsg::Connected(result) => {
                state.connecting = false;
                match result {
                    // The dialing task says so, not the endpoint's event channel: the connection's `Lost`
                    // may have come and gone already. Taken anyway, it would leave this node on a dead
                    // connection for good (it dials only while it has none); the next tick dials again.
                    Ok(peer) if !state.endpoint.is_connected(&peer) => {
                        tracing::info!(node = %state.id, %peer, "the new connection to the controller is gone already");
                    }
                    Ok(peer) => {
                        tracing::info!(node = %state.id, %peer, "connected to the controller");
                        state.leader_peer = Some(peer);
                        state.member.handle_timeout(state.now());
                        state.drive_member(&me).await;
                    }
                    Err(e) => tracing::debug!(node = %state.id, error = %e, "controller not reachable yet"),
                }
            }
            NodeMsg::Status(reply) => {
                let _ = reply.send(state.status());
            }
            NodeMsg::Drain(reply) => {
                state.draining = true;
                state.each_worker(|| WorkerMsg::DropAll);
                if state.leader.is_none() {
                    state.send_to_leader(&me, Wire::Leave);
                }
                // Everything queued (the `Leave` above, answers, events) is written before the goodbye.
                let writers = state.outboxes.lock().expect("the outboxes' lock is never poisoned").close();
                super::outbox::written(writers, super::outbox::SEND_TIMEOUT).await;
                state.endpoint.close().await;
                let _ = reply.send(());
                me.stop(Some("drained".into()));
            }
            NodeMsg::Worker(slot, reply) => {
                let _ = reply.send(state.workers.get(slot as usize).map(|w| w.actor.clone()));
            }
        }
        Ok(())
    }

    async fn handle_supervisor_evt(
        &self,
        me: ActorRef<NodeMsg>,
        event: SupervisionEvent,
        state: &mut NodeState,
    ) -> Result<(), ActorProcessingErr> {
        let SupervisionEvent::ActorFailed(cell, error) = event else { return Ok(()) };
        if let Some(slot) = state.workers.iter().position(|w| w.actor.get_id() == cell.get_id()) {
            return state.on_worker_failed(&me, slot, error.to_string()).await;
        }
        if let Some(leader) = state.leader.as_mut() {
            for (id, job) in leader.jobs.iter_mut() {
                if job.actor.as_ref().is_some_and(|a| a.get_id() == cell.get_id()) {
                    tracing::error!(job = id, %error, "job controller failed");
                    job.actor = None;
                    job.info.state = crate::protocol::JobState::Failed;
                    job.info.reason = Some(format!("the job controller failed: {error}"));
                }
            }
        }
        Ok(())
    }
}
