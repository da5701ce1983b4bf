//! NodeActor: the daemon. Supervises one [`WorkerActor`] per device slot, speaks the control protocol
//! over QUIC and — on the controller (the node started without `join`, or, with several `controllers`,
//! the one whose Raft group leads) — runs one [`JobController`] per job. It is the shell of [`NodeCore`]: what the node decides (membership, fencing, admission of job
//! messages, routing) is the core's; the actor feeds it the endpoint's events, its timer and its
//! children's messages, and carries out its [`NodeAction`]s — sockets, the catalog, spawning actors,
//! metrics — in order.
//!
//! Fencing: every control message carries its sender's epoch. The controller refuses job messages from
//! a node that is not in its view, or that acts on an older epoch, and answers a non-member with
//! `Fenced`; the fenced node drops all job state and rejoins as a new member.

use std::collections::{BTreeMap, HashMap};
use std::net::SocketAddr;
use std::sync::Arc;
use std::time::{Duration, Instant};

use ractor::{Actor, ActorProcessingErr, ActorRef, RpcReplyPort, SupervisionEvent};
use troupe_cluster::control::{ControlEndpoint, ControlEvent, PeerRole};
use troupe_cluster::membership::NodeId;
use troupe_cluster::NodeIdentity;

use super::controller::{JobArgs, JobController};
pub use super::messages::NodeMsg;
use super::messages::{JobMsg, WorkerMsg};
use super::node_core::{NodeAction, NodeCore, NodeNote, NodeSettings};
use super::outbox::Outboxes;
use super::raft::{CatalogWrite, ControllerGroup, Leadership};
use super::worker::{AttemptThreads, WorkerActor, WorkerArgs};
use crate::catalog::{Catalog, StoredView};
use crate::node_config::NodeConfig;
use crate::protocol::{JobId, Reply, SlotDevice, Wire};
use crate::telemetry::NodeMetrics;

/// How often the node drives its timers (heartbeats, failure detection, reconnection).
const TICK_MS: u64 = 50;

pub struct NodeArgs {
    pub config: NodeConfig,
    pub identity: Arc<NodeIdentity>,
    pub endpoint: ControlEndpoint,
    pub events: tokio::sync::mpsc::UnboundedReceiver<ControlEvent>,
    /// Set to the reason when the node stops because a child kept failing (escalation).
    pub stop_reason: Arc<std::sync::Mutex<Option<String>>>,
    /// What `/metrics` reports; updated as events pass.
    pub metrics: Arc<NodeMetrics>,
    /// The daemon's catalog: the controller restarts from it (one controller); with several, it is
    /// this node's copy of the replicated catalog.
    pub catalog: Catalog,
    /// Where the controller's writes go: the catalog itself (one controller), or the Raft group whose
    /// leader is the controller (several).
    pub group: Arc<ControllerGroup>,
    /// The URL of this daemon's dashboard, if it serves one: announced to the controller in its `Join`.
    pub dashboard: Option<String>,
    /// What each slot computes on (node.toml `devices` resolved on this machine): one worker each.
    pub devices: Vec<SlotDevice>,
}

pub struct NodeState {
    core: NodeCore,
    config: NodeConfig,
    identity: Arc<NodeIdentity>,
    endpoint: ControlEndpoint,
    /// Control messages to peers, queued per peer and written by a task each: sends never wait here.
    outboxes: std::sync::Mutex<Outboxes>,
    started: Instant,
    /// What each slot computes on, by slot.
    devices: Vec<SlotDevice>,
    /// What the machine is using, sampled on the tick for the heartbeats (`troupe status`).
    load: crate::telemetry::load::LoadSampler,
    workers: Vec<ActorRef<WorkerMsg>>,
    /// The running job controllers (on the controller).
    jobs: BTreeMap<JobId, ActorRef<JobMsg>>,
    stop_reason: Arc<std::sync::Mutex<Option<String>>>,
    metrics: Arc<NodeMetrics>,
    catalog: Catalog,
    group: Arc<ControllerGroup>,
    /// The workers' attempt threads, which a drain waits for.
    attempts: AttemptThreads,
    /// The member's dashboard pages waiting for the controller's fragment, and when it was last asked.
    dashboard_waiters: Vec<RpcReplyPort<Result<String, String>>>,
    dashboard_asked: Option<Instant>,
    /// The controller's last rendering of its page fragment for members, and when.
    dashboard_rendered: Option<(Instant, String)>,
    /// The dials in flight ([`NodeAction::Dial`]), to be aborted by [`NodeAction::CancelDial`].
    dials: HashMap<SocketAddr, tokio::task::AbortHandle>,
}

/// Dashboard pages of a member that may wait on the controller's fragment at once; more are refused.
const DASHBOARD_WAITERS_MAX: usize = 64;
/// After this long without an answer the controller is asked again.
const DASHBOARD_ASK_AGAIN_MS: u64 = 2_000;
/// Members' pages asking the controller within this long of each other share one rendering.
const DASHBOARD_FRESH_MS: u64 = 500;

/// How long a drain waits for aborted attempts to leave the step they compute.
const DRAIN_ATTEMPTS_MS: u64 = 10_000;

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
        actor_scope(&self.core.id().0, self.endpoint.local_addr())
    }

    /// Sends `msg` to `peer` (to this node's own handler if `peer` is itself). Never waits: the message
    /// joins the peer's outbox, written in order by its own task.
    fn send(&self, me: &ActorRef<NodeMsg>, peer: &str, epoch: u64, msg: Wire) {
        if peer == self.core.id().0 {
            let event =
                ControlEvent::Message { from: peer.to_owned(), role: PeerRole::Node, epoch, body: msg.encode() };
            let _ = me.cast(NodeMsg::Control(event));
            return;
        }
        let mut outboxes = self.outboxes.lock().expect("the outboxes' lock is never poisoned");
        outboxes.send(peer, epoch, msg.encode());
    }

    async fn spawn_worker(
        &mut self,
        me: &ActorRef<NodeMsg>,
        slot: u32,
    ) -> Result<ActorRef<WorkerMsg>, ActorProcessingErr> {
        let args = WorkerArgs {
            slot,
            device: self.devices.get(slot as usize).cloned().unwrap_or(SlotDevice::Cpu),
            peak_tflops: self.config.telemetry.peak_tflops_per_slot,
            node: me.clone(),
            identity: self.identity.clone(),
            host: self.config.listen.ip(),
            transport: self.config.transport.clone(),
            metrics: self.metrics.clone(),
            attempts: self.attempts.clone(),
        };
        let (actor, _) =
            Actor::spawn_linked(Some(format!("{}/worker/{slot}", self.scope())), WorkerActor, args, me.get_cell())
                .await?;
        Ok(actor)
    }

    /// Carries out the core's actions, in order, each to completion. At start (`starting`) a view that
    /// cannot be recorded stops the node; later it is logged (a controller restart would reuse epochs).
    async fn act(&mut self, me: &ActorRef<NodeMsg>, starting: bool) -> Result<(), ActorProcessingErr> {
        while let Some(action) = self.core.poll_action() {
            match action {
                NodeAction::Send { peer, epoch, msg } => self.send(me, &peer, epoch, msg),
                NodeAction::RecordView(view) => self.record_view(view, starting).await?,
                NodeAction::Worker { slot, msg } => {
                    if let Some(worker) = self.workers.get(slot) {
                        let _ = worker.cast(msg);
                    }
                }
                NodeAction::Job { job, msg } => {
                    if let Some(actor) = self.jobs.get(&job) {
                        let _ = actor.cast(msg);
                    }
                }
                NodeAction::StartJob { id, mut spec, view, members, restored } => {
                    if spec.trace_seed == 0 {
                        spec.trace_seed = crate::telemetry::otel::new_trace_seed(id);
                    }
                    self.metrics.on_submit(id, &spec);
                    let group = self.group.clone();
                    let args = JobArgs { id, spec: *spec, node: me.clone(), view, members, group, restored };
                    let name = format!("{}/job/{id}", self.scope());
                    let started = match Actor::spawn_linked(Some(name), JobController, args, me.get_cell()).await {
                        Ok((actor, _)) => {
                            self.jobs.insert(id, actor);
                            Ok(())
                        }
                        // pre_start's own error (the job's first record not committed) as it is.
                        Err(ractor::SpawnErr::StartupFailed(e)) => Err(e.to_string()),
                        Err(e) => Err(e.to_string()),
                    };
                    self.core.job_started(id, started);
                }
                NodeAction::Dial { addr } => {
                    let (endpoint, me) = (self.endpoint.clone(), me.clone());
                    let dial = tokio::spawn(async move {
                        let result = endpoint.connect(addr).await.map_err(|e| e.to_string());
                        let _ = me.cast(NodeMsg::Connected(addr, result));
                    });
                    if let Some(earlier) = self.dials.insert(addr, dial.abort_handle()) {
                        earlier.abort();
                    }
                }
                NodeAction::CancelDial { addr } => {
                    if let Some(dial) = self.dials.remove(&addr) {
                        dial.abort();
                    }
                }
                NodeAction::RestartWorker { slot } => {
                    let worker = self.spawn_worker(me, slot as u32).await?;
                    self.workers[slot] = worker;
                }
                NodeAction::AnswerControllers { client, change: None } => {
                    let reply = Reply::Controllers(Box::new(self.group.status()));
                    self.send(me, &client, self.core.epoch(), Wire::Reply(reply));
                }
                NodeAction::AnswerControllers { client, change: Some(change) } => {
                    // Answered once committed (or refused): the node goes on meanwhile.
                    let members: Vec<String> = self.core.status().members.into_iter().map(|m| m.name).collect();
                    let (group, endpoint, epoch) = (self.group.clone(), self.endpoint.clone(), self.core.epoch());
                    tokio::spawn(async move {
                        let reply = match group.change(change, &members).await {
                            Ok(()) => Reply::Controllers(Box::new(group.status())),
                            Err(e) => Reply::Error { message: e.to_string() },
                        };
                        let _ = endpoint.send(&client, epoch, Wire::Reply(reply).encode()).await;
                    });
                }
                NodeAction::AnswerDashboard { client } => {
                    let fragment = self.members_dashboard();
                    self.send(me, &client, self.core.epoch(), Wire::Reply(Reply::Dashboard { fragment }));
                }
                NodeAction::ControllerDashboard { fragment } => {
                    self.dashboard_asked = None;
                    for waiter in self.dashboard_waiters.drain(..) {
                        let _ = waiter.send(Ok(fragment.clone()));
                    }
                }
                NodeAction::TakeOver { term } => self.take_over(term).await,
                NodeAction::StopJobs => {
                    for (_, job) in std::mem::take(&mut self.jobs) {
                        job.stop(Some("this node is no longer the controller".into()));
                    }
                }
                NodeAction::Stop { reason } => {
                    *self.stop_reason.lock().unwrap_or_else(|p| p.into_inner()) = Some(reason.clone());
                    return Err(reason.into());
                }
                NodeAction::Note(NodeNote::HeardOfDaemons { daemons }) => {
                    // Remembered by the core already; kept for a restart before a view admits this node.
                    super::raft::known::save(&self.config.data_dir, &daemons);
                }
                NodeAction::Note(note) => {
                    if matches!(note, NodeNote::AdoptedView(_) | NodeNote::ViewChanged { .. }) {
                        self.keep_known();
                    }
                    self.observe(note)
                }
            }
        }
        Ok(())
    }

    /// Recorded before anyone hears of it: a restarted controller starts past this epoch. With
    /// replicated controllers, committed by a majority first; a view that is not (this node is no
    /// longer the leader, or cut off) is never announced: the node steps down.
    async fn record_view(&mut self, view: StoredView, starting: bool) -> Result<(), ActorProcessingErr> {
        match self.group.propose(CatalogWrite::View(view)).await {
            Ok(()) => {}
            Err(e) if self.group.is_replicated() => {
                let now = self.now();
                self.step_down(now, &format!("its view was not committed: {e}"));
            }
            Err(e) if starting => return Err(format!("{e:#}").into()),
            Err(e) => tracing::error!(node = %self.core.id(), "{e:#}; a controller restart would reuse epochs"),
        }
        Ok(())
    }

    /// Elected in `term`: the node becomes the controller from the replicated catalog, read once this
    /// node applied everything committed before (`ControllerGroup::state`). A read that fails is tried
    /// again at the next tick, while the group still names this node.
    async fn take_over(&mut self, term: u64) {
        match self.group.state().await {
            Ok((view, jobs)) => {
                tracing::info!(node = %self.core.id(), term, "elected: taking over as the controller");
                let now = self.now();
                self.core.become_controller(now, view, jobs);
            }
            Err(e) => tracing::warn!(node = %self.core.id(), "elected, but reading the replicated catalog failed: {e}"),
        }
    }

    /// The Raft group's leadership changed (what it means is [`NodeCore::on_leadership`]'s); a node
    /// that stepped down disconnects its jobs' watchers (see [`Self::step_down`]).
    fn on_leadership(&mut self, leadership: Leadership) {
        let watchers = self.core.watchers();
        let (was_controller, now, catalog) = (self.core.is_controller(), self.now(), &self.catalog);
        self.core.on_leadership(now, leadership.term, leadership.leader.as_deref(), || catalog.view().ok().flatten());
        if was_controller && !self.core.is_controller() {
            self.disconnect(watchers);
        }
    }

    /// This node stops being the controller ([`NodeCore::step_down`]); the clients following its jobs
    /// are disconnected, so that they look for the new one at once — a controller removed from the
    /// voters, or cut off, stays up, and its watchers would otherwise wait on it.
    fn step_down(&mut self, now: Duration, why: &str) {
        let watchers = self.core.watchers();
        self.core.step_down(now, why);
        self.disconnect(watchers);
    }

    /// Disconnects the clients among `watchers` (a controller's jobs' watchers, after it stepped down).
    fn disconnect(&self, watchers: Vec<String>) {
        let endpoint = self.endpoint.clone();
        let clients =
            endpoint.peers().into_iter().filter(|(name, role)| *role == PeerRole::Client && watchers.contains(name));
        let clients: Vec<String> = clients.map(|(name, _)| name).collect();
        tokio::spawn(async move {
            for client in clients {
                endpoint.disconnect(&client).await;
            }
        });
    }

    /// The controller's page fragment for a member's page: rendered at most once per
    /// [`DASHBOARD_FRESH_MS`], however many members ask.
    fn members_dashboard(&mut self) -> String {
        let fresh = Duration::from_millis(DASHBOARD_FRESH_MS);
        if let Some((_, fragment)) = self.dashboard_rendered.as_ref().filter(|(at, _)| at.elapsed() < fresh) {
            return fragment.clone();
        }
        let fragment = crate::telemetry::endpoint::fragment(&self.core.status(), &self.metrics);
        self.dashboard_rendered = Some((Instant::now(), fragment.clone()));
        fragment
    }

    /// A member's page asks for the controller's fragment: asked of the controller once for every page
    /// waiting (again if no answer came within [`DASHBOARD_ASK_AGAIN_MS`]), answered when it arrives.
    fn ask_controller_dashboard(&mut self, reply: RpcReplyPort<Result<String, String>>) {
        self.dashboard_waiters.retain(|w| !w.is_closed());
        if self.dashboard_waiters.len() >= DASHBOARD_WAITERS_MAX {
            let _ = reply.send(Err(format!("{DASHBOARD_WAITERS_MAX} pages already wait for the controller")));
            return;
        }
        self.dashboard_waiters.push(reply);
        let waiting =
            self.dashboard_asked.is_some_and(|at| at.elapsed() < Duration::from_millis(DASHBOARD_ASK_AGAIN_MS));
        if waiting {
            return;
        }
        if self.core.ask_controller_dashboard() {
            self.dashboard_asked = Some(Instant::now());
            return;
        }
        let why = if self.core.is_controller() {
            "this node is the controller".to_owned()
        } else {
            "this node is not connected to the controller (yet)".to_owned()
        };
        for waiter in self.dashboard_waiters.drain(..) {
            let _ = waiter.send(Err(why.clone()));
        }
    }

    /// Replicated controllers: the daemons of the view, kept in the data dir for a restart that finds
    /// its `join` gone, and tried when no leader is named (raft::known).
    fn keep_known(&mut self) {
        if self.config.controller_names().len() < 2 {
            return;
        }
        let members = self.core.status().members;
        super::raft::known::save(&self.config.data_dir, &members);
        self.core.remember(members);
    }

    fn observe(&self, note: NodeNote) {
        match note {
            NodeNote::ViewChanged { epoch, changes } => self.metrics.on_view_change(epoch, &changes),
            NodeNote::JobEvent { job, event } => self.metrics.on_job_event(job, &event, Instant::now()),
            NodeNote::WorkerFailed { .. } => self.metrics.on_worker_failure(),
            NodeNote::AdoptedView(_)
            | NodeNote::Fenced { .. }
            | NodeNote::RefusedStale
            | NodeNote::HeardOfDaemons { .. } => {}
        }
    }

    async fn on_control(&mut self, event: ControlEvent) {
        let now = self.now();
        match event {
            ControlEvent::Message { from, role, epoch, body } => match Wire::decode(&body) {
                Ok(msg) => self.core.message(now, &from, role, epoch, msg),
                Err(e) => tracing::warn!(node = %self.core.id(), %from, "{e}"),
            },
            ControlEvent::Connected { peer, role, addr } => {
                tracing::debug!(node = %self.core.id(), %peer, ?role, %addr, "connected");
                self.core.connected(now, &peer, role);
            }
            ControlEvent::Lost { peer, reason } => {
                tracing::info!(node = %self.core.id(), %peer, %reason, "connection lost");
                self.core.lost(now, &peer);
            }
            ControlEvent::Departed { peer } => self.core.departed(&peer),
        }
    }
}

impl Actor for NodeActor {
    type Msg = NodeMsg;
    type State = NodeState;
    type Arguments = NodeArgs;

    async fn pre_start(&self, me: ActorRef<NodeMsg>, args: NodeArgs) -> Result<NodeState, ActorProcessingErr> {
        let NodeArgs {
            config,
            identity,
            endpoint,
            mut events,
            stop_reason,
            metrics,
            catalog,
            group,
            dashboard,
            devices,
        } = args;
        let started = Instant::now();
        // A controller that ran before on this data dir starts past its last epoch and resumes its jobs
        // (with replicated controllers, a node does so when its Raft group elects it).
        let single = config.join.is_none() && !group.is_replicated();
        let (stored_view, stored_jobs) = if single { (catalog.view()?, catalog.jobs()?) } else { (None, Vec::new()) };
        let settings = NodeSettings {
            id: NodeId(config.name.clone()),
            addr: endpoint.local_addr(),
            join: config.join,
            slots: devices.len() as u32,
            devices: devices.clone(),
            allow_plaintext_tcp: config.allow_plaintext_tcp,
            membership: config.membership.clone(),
            restart: config.restart,
            controllers: config.controller_names(),
            dashboard,
            raft_listen: config.raft_listen,
        };
        let mut core = NodeCore::new(settings, Duration::ZERO, new_incarnation()?, stored_view, stored_jobs);
        core.remember(super::raft::known::load(&config.data_dir));
        let pump = me.clone();
        tokio::spawn(async move {
            while let Some(event) = events.recv().await {
                if pump.cast(NodeMsg::Control(event)).is_err() {
                    return;
                }
            }
        });
        let mut state = NodeState {
            core,
            outboxes: std::sync::Mutex::new(Outboxes::new(endpoint.clone(), config.name.clone())),
            config,
            identity,
            endpoint,
            started,
            devices,
            load: crate::telemetry::load::LoadSampler::default(),
            workers: Vec::new(),
            jobs: BTreeMap::new(),
            stop_reason,
            metrics,
            catalog,
            group,
            attempts: AttemptThreads::default(),
            dashboard_waiters: Vec::new(),
            dashboard_asked: None,
            dashboard_rendered: None,
            dials: HashMap::new(),
        };
        if state.group.is_replicated() {
            let (mut leadership, pump) = (state.group.leadership(), me.clone());
            tokio::spawn(async move {
                loop {
                    let now = leadership.borrow_and_update().clone();
                    if pump.cast(NodeMsg::Leadership(now)).is_err() || leadership.changed().await.is_err() {
                        return;
                    }
                }
            });
        }
        state.act(&me, true).await?;
        for slot in 0..state.devices.len() as u32 {
            let actor = state.spawn_worker(&me, slot).await?;
            state.workers.push(actor);
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
        let now = state.now();
        match msg {
            NodeMsg::Control(event) => state.on_control(event).await,
            NodeMsg::Tick => {
                if state.group.is_replicated() {
                    state.core.set_voters(state.group.controllers());
                    // The leader looked up again, an election won but not acted on: NodeCore decides.
                    let Leadership { term, leader } = state.group.leadership().borrow().clone();
                    let lost = !state.core.is_controller() && !state.core.has_controller_peer();
                    if lost && leader.is_none() && !state.group.controllers().contains(&state.core.id().0) {
                        // Removed from the voters: no leader will be named to it; the others redirect it.
                        state.core.look_for_controller();
                    }
                    let catalog = &state.catalog;
                    state.core.leadership_tick(term, leader.as_deref(), || catalog.view().ok().flatten());
                }
                if let Some(load) = state.load.sample(Instant::now(), &state.devices) {
                    state.core.set_load(load);
                }
                state.core.tick(now);
            }
            NodeMsg::Leadership(leadership) => state.on_leadership(leadership),
            NodeMsg::NotCommitted(why) => state.step_down(now, &why),
            NodeMsg::FromWorker(wire) => state.core.send_to_controller(wire),
            NodeMsg::Outgoing { node, msg } => state.core.job_outgoing(&node, msg),
            NodeMsg::JobEvent { job, event, info } => state.core.job_event(job, event, info),
            NodeMsg::JobInfo(info) => state.core.job_info(info),
            NodeMsg::StepBoundary => state.core.step_boundary(now),
            NodeMsg::Connected(addr, result) => {
                // This dial's handle (a later dial to the same address keeps its own).
                if state.dials.get(&addr).is_some_and(|d| d.is_finished()) {
                    state.dials.remove(&addr);
                }
                let still_up = result.as_ref().is_ok_and(|peer| state.endpoint.is_connected(peer));
                state.core.dialed(now, addr, result, still_up);
            }
            NodeMsg::Status(reply) => {
                let _ = reply.send(state.core.status());
            }
            NodeMsg::ControllerDashboard(reply) => state.ask_controller_dashboard(reply),
            NodeMsg::Drain(reply) => {
                state.core.drain();
                state.act(&me, false).await?;
                // Everything queued (the `Leave` above, answers, events) is written before the goodbye.
                let writers = state.outboxes.lock().expect("the outboxes' lock is never poisoned").close();
                super::outbox::written(writers, super::outbox::SEND_TIMEOUT).await;
                state.endpoint.close().await;
                // The workers abort their attempts (`DropAll` above); a step in libtorch finishes first.
                if !state.attempts.ended(Duration::from_millis(DRAIN_ATTEMPTS_MS)).await {
                    let running = state.attempts.running();
                    tracing::warn!(
                        running,
                        "drained with attempts still computing a step after {DRAIN_ATTEMPTS_MS} ms"
                    );
                }
                let _ = reply.send(());
                me.stop(Some("drained".into()));
            }
            NodeMsg::Worker(slot, reply) => {
                let _ = reply.send(state.workers.get(slot as usize).cloned());
            }
        }
        state.act(&me, false).await
    }

    async fn handle_supervisor_evt(
        &self,
        me: ActorRef<NodeMsg>,
        event: SupervisionEvent,
        state: &mut NodeState,
    ) -> Result<(), ActorProcessingErr> {
        let SupervisionEvent::ActorFailed(cell, error) = event else { return Ok(()) };
        if let Some(slot) = state.workers.iter().position(|w| w.get_id() == cell.get_id()) {
            let now = state.now();
            state.core.worker_failed(now, slot, &error.to_string());
        }
        let failed: Vec<JobId> =
            state.jobs.iter().filter(|(_, a)| a.get_id() == cell.get_id()).map(|(id, _)| *id).collect();
        for job in failed {
            state.jobs.remove(&job);
            state.core.job_controller_failed(job, &error.to_string());
        }
        state.act(&me, false).await
    }
}
