//! The node (actors/src/runtime/node.rs) in the simulation. Every node runs the runtime's own
//! [`NodeCore`] — its side of membership and, on the controller, the authoritative membership, fencing,
//! the admission of job messages, routing to workers and job controllers, restoring jobs from the
//! catalog — and this module is its shell, as `NodeActor` is in the daemon: it feeds the core what the
//! endpoint, the timer and the workers would, in the order the modelled network and mailboxes give
//! them, and carries out the core's [`NodeAction`]s on the modelled network, workers, job controller
//! and catalog. Nothing the node decides is modelled here. What the adversary does to a node (crash,
//! pause, partition, connection reset, drain, restart) is.

use std::time::Duration;

use troupe_actors::catalog::{StoredJob, StoredView};
use troupe_actors::node_config::restart::RestartPolicy;
use troupe_actors::protocol::{Request, ToController, ToNode, Wire};
use troupe_actors::runtime::messages::{JobMsg, WorkerMsg};
use troupe_actors::runtime::node_core::{NodeAction, NodeCore, NodeNote, NodeSettings};
use troupe_cluster::control::PeerRole;
use troupe_cluster::membership::{Change, NodeId};

use super::scenario::Fault;
use super::world::{addr, trace, Envelope, Ev, JobInput, Local, Stall, Worker, World, JOB};

pub(super) fn dur(ms: u64) -> Duration {
    Duration::from_millis(ms)
}

/// The membership incarnation a process of the node starts with (node.rs draws a random one): each
/// process its own range, which its fences count up in.
pub(super) fn first_incarnation(process: u32) -> u64 {
    u64::from(process) << 32
}

/// The peer name of the client that submits the job: what the core says to it (the answer, the job's
/// events) is not modelled.
pub(super) const CLIENT: &str = "client";

/// The core of process `inc` of node `n` starting at `now_ms`, as node.rs builds it from node.toml.
/// Workers restart however often they panic: the simulation leaves escalation (the node stopping) to
/// the supervision tests.
pub(super) fn new_core(
    w: &World<'_>,
    n: usize,
    inc: u32,
    stored_view: Option<StoredView>,
    stored_jobs: Vec<StoredJob>,
) -> NodeCore {
    let spec = &w.sc.nodes[n];
    let settings = NodeSettings {
        id: spec.name.clone(),
        addr: addr(n, 0),
        join: (n != 0).then(|| addr(0, 0)),
        slots: spec.slots,
        allow_plaintext_tcp: false,
        membership: w.cfg.membership.clone(),
        restart: RestartPolicy { max_restarts: u32::MAX, window_ms: 1 },
        controllers: Vec::new(),
        dashboard: None,
    };
    NodeCore::new(settings, dur(w.now), first_incarnation(inc), stored_view, stored_jobs)
}

impl World<'_> {
    fn controller_name(&self) -> String {
        self.nodes[0].id.0.clone()
    }

    /// node.rs `Tick`; on the controller also the job controller's own tick (a restored job's grace,
    /// the wait below min_nodes).
    pub(super) fn tick(&mut self, n: usize) {
        let inc = self.nodes[n].inc;
        self.push(self.now + self.cfg.tick_ms, Ev::Tick { node: n, inc });
        self.nodes[n].core.tick(dur(self.now));
        self.act(n);
        if n == 0 && self.ctl.started {
            self.ctl.driver.on_tick(dur(self.now));
            self.job_flush();
        }
    }

    /// node.rs `act`: carries out node `n`'s actions in order, each before the next.
    pub(super) fn act(&mut self, n: usize) {
        while let Some(action) = self.nodes[n].core.poll_action() {
            match action {
                NodeAction::Send { peer, epoch, msg } => self.send(n, &peer, epoch, msg),
                NodeAction::RecordView(view) => {
                    // Recorded before anyone hears of it: a restarted controller starts past this epoch.
                    self.ctl.catalog.view_epoch = view.epoch;
                    self.ctl.catalog.view_members = view.members.into_iter().map(NodeId).collect();
                }
                NodeAction::Worker { slot, msg } => self.to_worker(n, slot, msg),
                NodeAction::Job { msg, .. } => self.to_job(msg),
                NodeAction::StartJob { spec, view, members, restored, .. } => {
                    // controller.rs `pre_start`: the driver, its first view and flush, before the answer.
                    self.ctl.driver = match restored {
                        Some((info, _, expect)) => {
                            troupe_actors::runtime::job::JobDriver::restore(JOB, *spec, &info, expect)
                        }
                        None => troupe_actors::runtime::job::JobDriver::new(JOB, *spec),
                    };
                    self.ctl.started = true;
                    self.ctl.catalog.recorded = None;
                    self.ctl.driver.on_view(&view, &members, Vec::new());
                    self.job_flush();
                    self.nodes[0].core.job_started(JOB, Ok(()));
                }
                NodeAction::Dial { .. } => self.dial(n),
                // Only a replicated controller steps down, which this simulation does not model yet.
                NodeAction::AnswerControllers { .. } => {}
                NodeAction::AnswerDashboard { .. } | NodeAction::ControllerDashboard { .. } => {}
                NodeAction::StopJobs => self.check.fail(self.now, format!("{} stepped down", self.nodes[n].id)),
                NodeAction::RestartWorker { slot } => {
                    let winc = self.nodes[n].workers[slot].winc + 1;
                    self.nodes[n].workers[slot] = Worker { winc, ..Worker::default() };
                }
                NodeAction::Stop { reason } => {
                    self.check.fail(self.now, format!("{} stopped: {reason}", self.nodes[n].id))
                }
                NodeAction::Note(note) => self.note(n, note),
            }
        }
    }

    /// What the core reports, for the checker and the statistics.
    fn note(&mut self, n: usize, note: NodeNote) {
        match note {
            NodeNote::AdoptedView(view) => {
                trace!(self, "{} adopts epoch {} {:?}", self.nodes[n].id, view.epoch, view.members());
                let inc = self.nodes[n].inc;
                self.check.adopted(self.now, n, inc, view.epoch.0);
            }
            NodeNote::Fenced { current } => {
                trace!(self, "{} fenced at epoch {current}: aborts its attempts", self.nodes[n].id);
                self.stats.fences += 1;
                self.nodes[n].generation += 1;
            }
            NodeNote::ViewChanged { epoch, changes } => {
                self.stats.view_changes += u64::from(self.ctl.submitted);
                self.check.view_changed(self.now, epoch);
                for change in &changes {
                    if let Change::Joined(node) = change {
                        let m = self.index[node];
                        self.check.admitted(m, self.nodes[m].generation);
                    }
                }
                let members = self.nodes[0].core.membership().map(|m| m.view().members().to_vec()).unwrap_or_default();
                trace!(self, "VIEW epoch {epoch} {members:?} after {changes:?}");
                if !self.ctl.submitted && members.len() == self.nodes.len() {
                    self.push(self.now, Ev::Submit);
                }
            }
            NodeNote::RefusedStale if n == 0 => self.stats.refused_stale += 1,
            NodeNote::RefusedStale => self.stats.node_refused_stale += 1,
            NodeNote::JobEvent { .. } | NodeNote::WorkerFailed { .. } => {}
        }
    }

    /// A client submits the job once every node joined (as `troupe train --nodes` waits for its
    /// members), or at the latest when [`super::world::SUBMIT_BY_MS`] passed.
    pub(super) fn submit(&mut self) {
        if self.ctl.submitted {
            return;
        }
        if !self.nodes[0].up || self.nodes[0].paused_until.is_some() {
            return self.push(self.now + 100, Ev::Submit);
        }
        self.ctl.submitted = true;
        let members = self.nodes[0].core.membership().map(|m| m.view().members().to_vec()).unwrap_or_default();
        trace!(self, "job submitted on {members:?}");
        let spec = Box::new(super::job_spec(self.sc));
        self.nodes[0].core.message(dur(self.now), CLIENT, PeerRole::Client, 0, Request::Submit { spec }.into());
        self.act(0);
    }

    /// node.rs `send`: the controller to itself through its mailbox, to a node on that node's current
    /// connection; a node to the controller on its connection. Without one the message is lost.
    fn send(&mut self, n: usize, peer: &str, epoch: u64, msg: Wire) {
        let env = Envelope::new(epoch, self.nodes[n].generation, msg);
        if peer == self.nodes[n].id.0 {
            return self.local(Local::ToSelf, Ev::SelfMsg(env));
        }
        let Some(&m) = self.index.get(&NodeId(peer.to_owned())) else {
            return; // the client
        };
        let conn = if n == 0 { self.ctl.conns[m].filter(|&c| self.conns[c].open_ctrl) } else { self.nodes[n].conn };
        match conn {
            Some(conn) => self.net_send(conn, n != 0, env),
            None => {
                self.stats.lost_messages += 1;
                trace!(self, "{} drops {} for {peer} (not connected)", self.nodes[n].id, kind(&env.msg));
            }
        }
    }

    /// What a worker reports goes through its node (`NodeMsg::FromWorker`).
    pub(super) fn send_to_controller(&mut self, n: usize, msg: ToController) {
        self.nodes[n].core.send_to_controller(msg);
        self.act(n);
    }

    /// The node's orders to a worker (worker.rs `WorkerMsg`).
    fn to_worker(&mut self, n: usize, slot: usize, msg: WorkerMsg) {
        match msg {
            WorkerMsg::Prepare { attempt, rank, .. } => self.worker_prepare(n, slot, attempt, rank),
            WorkerMsg::Start { attempt, roster, source, .. } => {
                self.worker_start(n, slot, attempt, roster.len(), source)
            }
            WorkerMsg::Commit { attempt, step, .. } => self.worker_commit(n, slot, attempt, step),
            WorkerMsg::Abort { attempt, .. } => self.worker_abort(n, slot, attempt),
            WorkerMsg::Release { .. } | WorkerMsg::DropAll => self.worker_drop(n, slot),
            WorkerMsg::Retain { jobs } if !jobs.contains(&JOB) => self.worker_drop(n, slot),
            WorkerMsg::AbortAll { keep } => self.worker_abort_all(n, slot, keep.contains(&JOB)),
            WorkerMsg::Retain { .. } | WorkerMsg::Returned { .. } | WorkerMsg::Panic(_) => {}
        }
    }

    /// The controller's node hands its job controller a message (`JobMsg`); a job message accepted
    /// from a node is checked against the membership that sent it.
    fn to_job(&mut self, msg: JobMsg) {
        let input = match msg {
            JobMsg::View { view, members, changes } => JobInput::View { view, members, changes },
            JobMsg::Ready { node, attempt, slot, committed, .. } => {
                JobInput::Ready { node: self.index[&node], attempt, slot, committed }
            }
            JobMsg::Vote { node, attempt, slot, step, .. } => {
                JobInput::Vote { node: self.index[&node], attempt, slot, step }
            }
            JobMsg::Ended { node, attempt, slot, outcome } => {
                JobInput::Ended { node: self.index[&node], attempt, slot, outcome }
            }
            JobMsg::Checkpointed { attempt, step, .. } => JobInput::Checkpointed { attempt, step },
            JobMsg::Evaluated { .. } | JobMsg::Phases { .. } | JobMsg::Cancel | JobMsg::Tick => return,
        };
        if !matches!(input, JobInput::View { .. }) {
            if let Some((from, generation)) = self.delivering {
                self.check.accepted_job_message(self.now, from, generation, input_kind(&input));
            }
        }
        self.local(Local::NodeToJob, Ev::ToJob(input));
    }

    fn dial(&mut self, n: usize) {
        self.stats.dials += 1;
        let inc = self.nodes[n].inc;
        let handshake = self.rng.range(self.cfg.dial_ms_min, self.cfg.dial_ms_max);
        // The handshake needs both ends running and connected: a cut-off node, a stopped controller, or a
        // crashed one (QUIC retransmits the handshake: it completes once the controller is back).
        let down = match self.nodes[0].up {
            true => None,
            false => Some(self.sc.controller_back_at(self.now).unwrap_or(u64::MAX)),
        };
        let blocked =
            [self.sc.control_cut_until(n, self.now), self.nodes[0].paused_until, down].into_iter().flatten().max();
        let (at, ok) = match blocked {
            Some(until) if until > self.now + self.cfg.connect_timeout_ms => {
                (self.now + self.cfg.connect_timeout_ms, false)
            }
            Some(until) => (until + handshake, true),
            None => (self.now + handshake, true),
        };
        trace!(self, "{} dials the controller", self.nodes[n].id);
        self.push(at, Ev::DialDone { node: n, inc, ok });
    }

    /// A dial ended. A new connection replaces the older one on both sides, and what was in flight on
    /// the older one is lost — but what the controller's reader of the older one had read is still
    /// handed to the node actor (`reads_until`), possibly after the newer one's `Connected` and first
    /// messages; the controller's endpoint reports nothing for the older one (control/shared.rs). Each
    /// side's node actor learns of the newer connection a mailbox hop later (`Ev::Connected`): until
    /// then the controller still counts the node as connected the old way and may send it messages
    /// meant for that membership, which go out on the newer connection.
    pub(super) fn dial_done(&mut self, n: usize, ok: bool) {
        if !ok || !self.nodes[0].up {
            trace!(self, "{} could not reach the controller", self.nodes[n].id);
            self.nodes[n].core.dialed(dur(self.now), addr(0, 0), Err("unreachable".into()), false);
            return self.act(n);
        }
        if let Some(old) = self.nodes[n].conn.take() {
            self.conns[old].open_node = false;
        }
        let replaced = self.ctl.conns[n].filter(|&c| self.conns[c].open_ctrl);
        if let Some(old) = replaced {
            let c = &mut self.conns[old];
            c.open_ctrl = false;
            c.reads_until = Some(c.reads_until.map_or(self.now, |t| t.min(self.now)));
        }
        let conn = self.open_conn(n);
        self.nodes[n].conn = Some(conn);
        trace!(self, "{} connected to the controller (conn {conn}, replacing {replaced:?})", self.nodes[n].id);
        let at_ctrl = self.now + self.rng.range(0, self.cfg.local_delay_ms_max);
        // One reader, one channel: the newer connection's messages reach the node actor after its
        // `Connected`.
        self.conns[conn].last_up = at_ctrl;
        self.push(at_ctrl, Ev::Connected { conn, at_ctrl: true, inc: self.nodes[0].inc });
        let at_node = self.now + self.rng.range(0, self.cfg.local_delay_ms_max);
        self.push(at_node, Ev::Connected { conn, at_ctrl: false, inc: self.nodes[n].inc });
    }

    /// A node actor handles `Connected`: the controller's from its endpoint (`ControlEvent::Connected`),
    /// the dialing node's from its dialing task (`NodeMsg::Connected`, not through the endpoint's event
    /// channel, so the connection's `Lost` may come first: the core is told whether it is still up).
    pub(super) fn connected(&mut self, conn: usize, at_ctrl: bool) {
        let n = self.conns[conn].node;
        let now = dur(self.now);
        if at_ctrl {
            trace!(self, "controller sees {} connect (conn {conn})", self.nodes[n].id);
            let peer = self.nodes[n].id.0.clone();
            self.nodes[0].core.connected(now, &peer, PeerRole::Node);
            return self.act(0);
        }
        let live = self.conns[conn].open_node && self.nodes[n].conn == Some(conn);
        if !live {
            trace!(self, "{} learns of conn {conn}, already lost", self.nodes[n].id);
        }
        let controller = self.controller_name();
        self.nodes[n].core.dialed(now, addr(0, 0), Ok(controller), live);
        self.act(n);
    }

    /// One side of a connection ended without a goodbye (`ControlEvent::Lost`). The controller's reader
    /// reports it after handing over what it read before; the endpoint reports only the loss of a peer's
    /// current connection.
    pub(super) fn conn_lost(&mut self, conn: usize, at_ctrl: bool) {
        let n = self.conns[conn].node;
        if at_ctrl {
            if !self.conns[conn].open_ctrl {
                return;
            }
            let c = &mut self.conns[conn];
            if c.reads_until.is_none() && c.last_up > self.now {
                c.reads_until = Some(self.now);
                let at = c.last_up;
                return self.push(at, Ev::ConnLost { conn, at_ctrl });
            }
            c.open_ctrl = false;
            c.reads_until = None;
            if self.ctl.conns[n] != Some(conn) {
                return;
            }
            self.ctl.conns[n] = None;
            let peer = self.nodes[n].id.0.clone();
            trace!(self, "controller lost its connection {conn} to {peer}");
            self.nodes[0].core.lost(dur(self.now), &peer);
            self.act(0);
        } else {
            if !self.conns[conn].open_node {
                return;
            }
            self.conns[conn].open_node = false;
            if self.nodes[n].conn == Some(conn) {
                self.nodes[n].conn = None;
                trace!(self, "{} lost its connection {conn} to the controller", self.nodes[n].id);
                let controller = self.controller_name();
                self.nodes[n].core.lost(dur(self.now), &controller);
                self.act(n);
            }
        }
    }

    /// A controller message reaching node `n` over the network.
    pub(super) fn deliver_down(&mut self, conn: usize, env: Envelope) {
        let n = self.conns[conn].node;
        if !self.conns[conn].open_node {
            self.stats.lost_messages += 1;
            if self.conns[conn].reset_by_node {
                let back = self.now + self.rng.range(self.cfg.net_delay_ms_min, self.cfg.net_delay_ms_max);
                self.push(back, Ev::ConnLost { conn, at_ctrl: true });
            }
            return;
        }
        self.count_delivery(n, false, &env);
        trace!(self, "{} <- {} (epoch {})", self.nodes[n].id, kind(&env.msg), env.epoch);
        let controller = self.controller_name();
        self.nodes[n].core.message(dur(self.now), &controller, PeerRole::Node, env.epoch, env.msg);
        self.act(n);
    }

    /// The controller node's message to itself (through its own mailbox).
    pub(super) fn deliver_self(&mut self, env: Envelope) {
        let me = self.controller_name();
        self.delivering = Some((0, env.generation));
        self.nodes[0].core.message(dur(self.now), &me, PeerRole::Node, env.epoch, env.msg);
        self.act(0);
        self.delivering = None;
    }

    // ---- the adversary ----

    pub(super) fn fault(&mut self, i: usize) {
        let fault = self.sc.faults[i];
        trace!(self, "FAULT {fault:?}");
        let idle = self.cfg.idle_timeout_ms;
        match fault {
            Fault::Crash { node, restart_after_ms, .. } => {
                if !self.nodes[node].up {
                    return;
                }
                if node == 0 {
                    self.crash_controller();
                }
                self.crash(node);
                if let Some(after) = restart_after_ms {
                    self.push(self.now + after, Ev::Restart { node });
                }
            }
            Fault::Pause { node, for_ms, .. } => {
                if !self.nodes[node].up {
                    return;
                }
                let inc = self.nodes[node].inc;
                self.nodes[node].paused_until = Some(self.now + for_ms);
                self.nodes[node].pause_broke = false;
                self.push(self.now + for_ms, Ev::Resume { node, inc });
                self.push(self.now + idle, Ev::StallCheck { node, inc, stall: Stall::Pause, since: self.now });
            }
            Fault::Isolate { node, .. } => {
                let inc = self.nodes[node].inc;
                self.push(self.now + idle, Ev::StallCheck { node, inc, stall: Stall::Isolate, since: self.now });
            }
            Fault::DropConnection { node, .. } => {
                if let Some(conn) = self.nodes[node].conn {
                    let a = self.rng.range(0, 20);
                    self.push(self.now + a, Ev::ConnLost { conn, at_ctrl: false });
                    if self.rng.chance(500) {
                        let b = self.rng.range(0, 20);
                        self.push(self.now + b, Ev::ConnLost { conn, at_ctrl: true });
                    } else {
                        // Only the node's end closed (its close frame was lost): the controller's end
                        // learns of it when it next sends there (the node's endpoint answers with a
                        // stateless reset), at its idle timeout, or when a newer connection replaces it.
                        self.conns[conn].reset_by_node = true;
                        self.push(self.now + a + idle, Ev::ConnLost { conn, at_ctrl: true });
                    }
                }
            }
            Fault::WorkerPanic { node, slot, .. } => {
                if self.nodes[node].up && self.nodes[node].paused_until.is_none() {
                    self.worker_panicked(node, slot as usize);
                }
            }
            Fault::Leave { node, rejoin_after_ms, .. } => {
                // A stopped process handles SIGTERM only when resumed: a drain that falls in a pause
                // is left out of the run.
                if !self.nodes[node].up || self.nodes[node].paused_until.is_some() {
                    return;
                }
                self.drain(node);
                if let Some(after) = rejoin_after_ms {
                    self.push(self.now + after, Ev::Restart { node });
                }
            }
            Fault::Straggle { .. } | Fault::SlowLink { .. } => {}
        }
    }

    /// SIGKILL: everything of this incarnation is gone; the controller's side of the connection times out.
    fn crash(&mut self, n: usize) {
        let node = &mut self.nodes[n];
        node.up = false;
        node.paused_until = None;
        node.held.clear();
        if let Some(conn) = node.conn.take() {
            self.conns[conn].open_node = false;
            self.push(self.now + self.cfg.idle_timeout_ms, Ev::ConnLost { conn, at_ctrl: true });
        }
        for slot in 0..self.nodes[n].workers.len() {
            self.worker_vanish(n, slot, self.cfg.idle_timeout_ms);
        }
    }

    /// SIGTERM (node.rs `Drain`): drop job state, say `Leave`, close the connection with a goodbye.
    fn drain(&mut self, n: usize) {
        self.nodes[n].core.drain();
        self.act(n);
        if let Some(conn) = self.nodes[n].conn.take() {
            self.conns[conn].open_node = false;
            let after = self.conns[conn].last_up.max(self.now) + 1;
            self.push(after, Ev::ConnDeparted { conn });
        }
        let node = &mut self.nodes[n];
        node.up = false;
        node.paused_until = None;
        node.held.clear();
    }

    /// SIGKILL of the controller's daemon: besides what any node loses, the controller's membership, its
    /// job controller and its side of every connection are gone; the members notice when their
    /// connections time out. Only the catalog survives.
    fn crash_controller(&mut self) {
        self.ctl.conns.iter_mut().for_each(|c| *c = None);
        for conn in 0..self.conns.len() {
            self.conns[conn].reads_until = None;
            if std::mem::take(&mut self.conns[conn].open_ctrl) && self.conns[conn].open_node {
                self.push(self.now + self.cfg.idle_timeout_ms, Ev::ConnLost { conn, at_ctrl: false });
            }
        }
    }

    /// A new incarnation of the node: empty, asking to join. The controller's daemon (node.rs
    /// `pre_start`) finds its catalog — the last view, the job as last recorded — and its core starts
    /// past that epoch and resumes the job, expecting the nodes of the last view to rejoin.
    pub(super) fn restart(&mut self, n: usize) {
        let node = &mut self.nodes[n];
        node.up = true;
        node.inc += 1;
        node.generation += 1;
        node.conn = None;
        node.paused_until = None;
        node.pause_broke = false;
        node.workers = (0..node.slots).map(|_| Worker::default()).collect();
        let inc = node.inc;
        trace!(self, "{} starts again (incarnation {inc})", self.nodes[n].id);
        let (view, jobs) = match n {
            0 => {
                let catalog = &self.ctl.catalog;
                let members = catalog.view_members.iter().map(|m| m.0.clone()).collect();
                let view = StoredView { epoch: catalog.view_epoch, members, recorded_by: None };
                let job = catalog.job.clone().map(|info| StoredJob {
                    spec: super::job_spec(self.sc),
                    info,
                    first_event: 0,
                    events: Vec::new(),
                });
                (Some(view), job.into_iter().collect())
            }
            _ => (None, Vec::new()),
        };
        if n == 0 {
            let epoch = self.ctl.catalog.view_epoch + 1;
            self.ctl.started = false;
            self.check.controller_restarted(self.now, epoch, self.nodes[0].generation);
            self.stats.controller_restarts += 1;
            trace!(self, "controller restarted at epoch {epoch} from its catalog; expects {:?}", view);
        }
        self.nodes[n].core = new_core(self, n, inc, view, jobs);
        self.act(n);
        let phase = self.rng.below(self.cfg.tick_ms);
        self.push(self.now + phase, Ev::Tick { node: n, inc });
    }

    /// SIGCONT: what waited runs, in order, before anything else due now. A pause past the idle timeout
    /// cost the node its connections.
    pub(super) fn resume(&mut self, n: usize, inc: u32) {
        if !self.nodes[n].up || self.nodes[n].inc != inc || self.nodes[n].paused_until.is_none() {
            return;
        }
        trace!(self, "{} resumes", self.nodes[n].id);
        self.nodes[n].paused_until = None;
        if std::mem::take(&mut self.nodes[n].pause_broke) {
            if let Some(conn) = self.nodes[n].conn.take() {
                self.conns[conn].open_node = false;
                let controller = self.controller_name();
                self.nodes[n].core.lost(dur(self.now), &controller);
                self.act(n);
            }
        }
        let held = std::mem::take(&mut self.nodes[n].held).into_iter().map(|item| item.ev).collect();
        self.push_ahead(held);
    }

    /// A pause or partition reached the idle timeout: connections to the node are lost, and every
    /// data-plane mesh it is in breaks.
    pub(super) fn stall_check(&mut self, n: usize, inc: u32, stall: Stall, since: u64) {
        if !self.nodes[n].up || self.nodes[n].inc != inc {
            return;
        }
        let still = match stall {
            Stall::Pause => self.nodes[n].paused_until.is_some() && self.paused_since(n) == Some(since),
            Stall::Isolate => self.sc.isolated_until(n, since).is_some_and(|until| until > self.now),
        };
        if !still {
            return;
        }
        trace!(self, "{} silent for the idle timeout ({stall:?}): its connections time out", self.nodes[n].id);
        if n == 0 {
            // The controller stopped: every member's connection times out on the member's side now, and
            // on the controller's when it runs again (that event waits for it); meshes with its ranks break.
            for m in 1..self.nodes.len() {
                if let Some(conn) = self.nodes[m].conn {
                    let (a, b) = (self.rng.range(0, 30), self.rng.range(0, 30));
                    self.push(self.now + a, Ev::ConnLost { conn, at_ctrl: false });
                    self.push(self.now + b, Ev::ConnLost { conn, at_ctrl: true });
                }
            }
        }
        if let Some(conn) = self.nodes[n].conn {
            let b = self.rng.range(0, 30);
            self.push(self.now + b, Ev::ConnLost { conn, at_ctrl: true });
            match stall {
                Stall::Pause => self.nodes[n].pause_broke = true,
                Stall::Isolate => {
                    let a = self.rng.range(0, 30);
                    self.push(self.now + a, Ev::ConnLost { conn, at_ctrl: false });
                }
            }
        }
        self.break_meshes_of(n);
    }

    fn paused_since(&self, n: usize) -> Option<u64> {
        let until = self.nodes[n].paused_until?;
        self.sc.faults.iter().find_map(|f| match *f {
            Fault::Pause { node, at_ms, for_ms } if node == n && at_ms + for_ms == until => Some(at_ms),
            _ => None,
        })
    }

    /// The worker's process side of a panic: its attempt task is gone at once; its node is told
    /// (supervision) and reports the attempt failed and restarts the worker (node.rs `worker_failed`).
    fn worker_panicked(&mut self, n: usize, slot: usize) {
        if slot >= self.nodes[n].workers.len() {
            return;
        }
        self.worker_vanish(n, slot, 0);
        self.nodes[n].core.worker_failed(dur(self.now), slot, "injected panic");
        self.act(n);
    }
}

/// A short name of a message for the trace.
pub(super) fn kind(msg: &Wire) -> String {
    match msg {
        Wire::ToController(msg) => to_controller_kind(msg),
        Wire::ToNode(msg) => to_node_kind(msg),
        other => format!("{other:?}"),
    }
}

fn to_controller_kind(msg: &ToController) -> String {
    match msg {
        ToController::Join { .. } => "Join".into(),
        ToController::Heartbeat => "Heartbeat".into(),
        ToController::Leave => "Leave".into(),
        ToController::Ready { attempt, slot, committed, .. } => format!("Ready(a{attempt} s{slot} c{committed:?})"),
        ToController::Vote { attempt, slot, step, .. } => format!("Vote(a{attempt} s{slot} step {step})"),
        ToController::Ended { attempt, slot, outcome, .. } => format!("Ended(a{attempt} s{slot} {outcome:?})"),
        other => format!("{other:?}"),
    }
}

/// A short name of a controller's message for the trace.
pub(super) fn to_node_kind(msg: &ToNode) -> String {
    match msg {
        ToNode::View { view, .. } => format!("View(e{} {:?})", view.epoch, view.members()),
        ToNode::Fenced { current, .. } => format!("Fenced(e{current})"),
        ToNode::Prepare { attempt, ranks, .. } => {
            let ranks: Vec<String> = ranks.iter().map(|r| format!("{}/{}", r.node, r.slot)).collect();
            format!("Prepare(a{attempt} {ranks:?})")
        }
        ToNode::Start { attempt, source, .. } => format!("Start(a{attempt} source {source:?})"),
        ToNode::Commit { attempt, step, .. } => format!("Commit(a{attempt} step {step})"),
        ToNode::Abort { attempt, .. } => format!("Abort(a{attempt})"),
        ToNode::Release { .. } => "Release".into(),
        ToNode::Alive => "Alive".into(),
        ToNode::Refused { .. } => "Refused".into(),
    }
}

/// What the checker calls a job message.
fn input_kind(input: &JobInput) -> &'static str {
    match input {
        JobInput::View { .. } => "a view",
        JobInput::Ready { .. } => "Ready",
        JobInput::Vote { .. } => "Vote",
        JobInput::Ended { .. } => "Ended",
        JobInput::Checkpointed { .. } => "Checkpointed",
    }
}
