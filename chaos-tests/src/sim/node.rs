//! The node (actors/src/runtime/node.rs) in the simulation. Every node runs the runtime's own
//! [`NodeCore`] — its side of membership and, on the controller, the authoritative membership, fencing,
//! the admission of job messages, routing to workers and job controllers, restoring jobs from the
//! catalog — and this module is its shell, as `NodeActor` is in the daemon: it feeds the core what the
//! endpoint, the timer and the workers would, in the order the modelled network and mailboxes give
//! them, and carries out the core's [`NodeAction`]s on the modelled network, workers, job controller
//! and catalog. Nothing the node decides is modelled here. What the adversary does to a node (crash,
//! pause, partition, connection reset, drain, restart) is.

use std::net::SocketAddr;
use std::time::Duration;

use troupe_actors::catalog::{StoredJob, StoredView};
use troupe_actors::node_config::restart::RestartPolicy;
use troupe_actors::protocol::{JobSpec, Reply, Request, SlotDevice, ToController, ToNode, Wire};
use troupe_actors::runtime::job::JobDriver;
use troupe_actors::runtime::messages::{JobMsg, WorkerMsg};
use troupe_actors::runtime::node_core::{NodeAction, NodeCore, NodeNote, NodeSettings, Restored};
use troupe_cluster::control::PeerRole;
use troupe_cluster::membership::{Change, NodeId};

use super::raft::Write;
use super::scenario::Fault;
use super::world::{addr, trace, Envelope, Ev, JobCtl, JobInput, Local, Stall, Worker, World, JOB};

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

/// How long the client waits before it submits again a job the controller refused (it lost its
/// leadership before a majority recorded the job).
const CLIENT_RETRY_MS: u64 = 500;

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
    // Replicated: the controllers (nodes `0..k`) have no `join` (their Raft group names the leader);
    // the other nodes join the first controller, which redirects them to the leader.
    let k = w.sc.controllers;
    let controllers = if k > 1 { w.sc.nodes[..k].iter().map(|s| s.name.0.clone()).collect() } else { Vec::new() };
    let settings = NodeSettings {
        id: spec.name.clone(),
        addr: addr(n, 0),
        join: (n != 0 && (k <= 1 || n >= k)).then(|| addr(0, 0)),
        slots: spec.slots,
        allow_plaintext_tcp: false,
        membership: w.cfg.membership.clone(),
        restart: RestartPolicy { max_restarts: u32::MAX, window_ms: 1 },
        controllers,
        dashboard: None,
        raft_listen: None,
        devices: vec![SlotDevice::Cpu; spec.slots as usize],
    };
    NodeCore::new(settings, dur(w.now), first_incarnation(inc), stored_view, stored_jobs)
}

impl World<'_> {
    /// The name of the node connection `conn` was dialed to.
    fn server_name(&self, conn: usize) -> String {
        self.nodes[self.conns[conn].server].id.0.clone()
    }

    /// node.rs `Tick` (with replicated controllers, first the leader named but not yet resolved, and an
    /// election won but not yet acted on); on the controller also the job controller's own tick (a
    /// restored job's grace, the wait below min_nodes).
    pub(super) fn tick(&mut self, n: usize) {
        let inc = self.nodes[n].inc;
        self.push(self.now + self.cfg.tick_ms, Ev::Tick { node: n, inc });
        self.leadership_tick(n);
        if self.nodes[n].busy {
            return;
        }
        self.nodes[n].core.tick(dur(self.now));
        self.act(n);
        let job = &self.nodes[n].job;
        if job.started && job.waiting_batch.is_none() && !job.stopped {
            self.nodes[n].job.driver.on_tick(dur(self.now));
            self.job_flush(n);
        }
    }

    /// A job controller starts on node `n` (controller.rs `pre_start`): its driver, its first view and
    /// flush, before the node's answer.
    fn start_job(&mut self, n: usize, spec: JobSpec, restored: Option<Restored>) {
        let driver = match restored {
            Some((info, _, expect)) => JobDriver::restore(JOB, spec, &info, expect),
            None => JobDriver::new(JOB, spec),
        };
        let jc = self.nodes[n].job.jc + 1;
        self.nodes[n].job = JobCtl { jc, started: true, ..JobCtl::new(driver) };
    }

    /// The node's job controllers stop (it stepped down, or its process died).
    pub(super) fn stop_job(&mut self, n: usize) {
        let jc = self.nodes[n].job.jc + 1;
        let driver = JobDriver::new(JOB, super::job_spec(self.sc));
        self.nodes[n].job = JobCtl { jc, ..JobCtl::new(driver) };
    }

    /// node.rs `act`: carries out node `n`'s actions in order, each before the next. With replicated
    /// controllers a view waits for its commit: the rest (and the actor's mailbox) wait with it. An
    /// action may run `act` again within (a worker's report goes straight to the core): once that made
    /// the node wait, this loop stops too — it carried on, a take-over's restored job started (and its
    /// first record's commit could free the actor) before its view was committed (found with the
    /// submission's fix: seeds 15 and 19 of the replicated schedules).
    pub(super) fn act(&mut self, n: usize) {
        while !self.nodes[n].busy {
            // Carried on once the commit it waits for is decided.
            let Some(action) = self.nodes[n].core.poll_action() else { break };
            match action {
                NodeAction::Send { peer, epoch, msg } => self.send(n, &peer, epoch, msg),
                NodeAction::RecordView(view) if self.ctl.raft.is_none() => {
                    // Recorded before anyone hears of it: a restarted controller starts past this epoch.
                    self.ctl.catalog.view_epoch = view.epoch;
                    self.ctl.catalog.view_members = view.members.into_iter().map(NodeId).collect();
                    self.ctl.catalog.view_expecting = view.expecting;
                }
                NodeAction::RecordView(view) => {
                    if self.record_view(n, view) {
                        return;
                    }
                }
                NodeAction::Worker { slot, msg } => self.to_worker(n, slot, msg),
                NodeAction::Job { msg, .. } => self.to_job(n, msg),
                NodeAction::StartJob { spec, view, members, restored, .. } => {
                    // controller.rs `pre_start`: the first flush, awaited by the node actor (node.rs
                    // awaits the spawn) — answered by `job_decided` once the record's commit is decided.
                    self.start_job(n, *spec, restored);
                    self.nodes[n].job.driver.on_view(&view, &members, Vec::new());
                    self.job_flush(n);
                    if self.nodes[n].job.waiting_batch.is_some() {
                        self.nodes[n].job.starting = true;
                        self.nodes[n].busy = true;
                        return;
                    }
                    let started = self.job_start_result(n);
                    self.nodes[n].core.job_started(JOB, started);
                }
                NodeAction::Dial { addr } => self.dial(n, addr),
                NodeAction::CancelDial { addr: to } => {
                    if let Some(server) = (0..self.nodes.len()).find(|&s| addr(s, 0) == to) {
                        trace!(self, "{} gives up its dial to {}", self.nodes[n].id, self.nodes[server].id);
                        self.nodes[n].dials.remove(&server);
                    }
                }
                NodeAction::AnswerControllers { .. } => {}
                NodeAction::AnswerDashboard { .. } | NodeAction::ControllerDashboard { .. } => {}
                NodeAction::TakeOver { term } => self.take_over(n, term),
                NodeAction::StopJobs => {
                    trace!(self, "{} stepped down: its job controller stops", self.nodes[n].id);
                    self.stats.step_downs += 1;
                    self.nodes[n].generation += 1;
                    self.stop_job(n);
                }
                NodeAction::RestartWorker { slot } => {
                    let winc = self.nodes[n].workers[slot].winc + 1;
                    self.nodes[n].workers[slot] = Worker { winc, ..Worker::default() };
                }
                NodeAction::Stop { reason } => {
                    self.check.fail(self.now, format!("{} stopped: {reason}", self.nodes[n].id))
                }
                NodeAction::Note(NodeNote::HeardOfDaemons { daemons }) => {
                    // node.rs: written to the data dir (the core remembered them already).
                    let names: Vec<&str> = daemons.iter().map(|d| d.name.as_str()).collect();
                    trace!(self, "{} heard of {names:?}", self.nodes[n].id);
                    self.nodes[n].known = daemons;
                }
                NodeAction::Note(note) => {
                    let adopted = matches!(note, NodeNote::AdoptedView(_) | NodeNote::ViewChanged { .. });
                    if adopted && self.ctl.raft.is_some() {
                        // node.rs `keep_known`: written to the data dir, kept across a restart.
                        let members = self.nodes[n].core.status().members;
                        self.nodes[n].core.remember(members.clone());
                        self.nodes[n].known = members;
                    }
                    self.note(n, note)
                }
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
                let members = self.nodes[n].core.membership().map(|m| m.view().members().to_vec()).unwrap_or_default();
                trace!(self, "VIEW epoch {epoch} {members:?} after {changes:?}");
                if !self.ctl.submitted && members.len() == self.nodes.len() {
                    self.push(self.now, Ev::Submit);
                }
            }
            NodeNote::RefusedStale if self.nodes[n].core.is_controller() => self.stats.refused_stale += 1,
            NodeNote::RefusedStale => self.stats.node_refused_stale += 1,
            NodeNote::JobEvent { .. } | NodeNote::WorkerFailed { .. } | NodeNote::HeardOfDaemons { .. } => {}
        }
    }

    /// A client submits the job once every node joined (as `troupe train --nodes` waits for its
    /// members), or at the latest when [`super::world::SUBMIT_BY_MS`] passed.
    pub(super) fn submit(&mut self) {
        if self.ctl.submitted {
            return;
        }
        let ready = self.controller_node().filter(|&c| self.nodes[c].paused_until.is_none() && !self.nodes[c].busy);
        let Some(c) = ready else {
            return self.push(self.now + 100, Ev::Submit);
        };
        self.ctl.submitted = true;
        if self.nodes[c].core.status().jobs.iter().any(|j| j.id == JOB) {
            // The client looks before it submits again (`troupe job status`): the record of the refused
            // submission reached the new leader, which committed it and runs the job.
            trace!(self, "{} holds the job already: not submitted again", self.nodes[c].id);
            return;
        }
        let members = self.nodes[c].core.membership().map(|m| m.view().members().to_vec()).unwrap_or_default();
        trace!(self, "job submitted to {} on {members:?}", self.nodes[c].id);
        let spec = Box::new(super::job_spec(self.sc));
        self.nodes[c].core.message(dur(self.now), CLIENT, PeerRole::Client, 0, Request::Submit { spec }.into());
        self.act(c);
    }

    /// The controller's answer to the submitting client: `Submitted` only once the job's first record
    /// was committed; an error (the controller lost its leadership first) and the client submits again,
    /// to the controller then.
    fn client_reply(&mut self, n: usize, msg: Wire) {
        match msg {
            Wire::Reply(Reply::Submitted { job }) => {
                trace!(self, "client <- Submitted job {job} from {}", self.nodes[n].id);
                // "Committed by a majority before announce", for the submission too.
                let recorded = self.ctl.raft.as_ref().is_none_or(|r| r.in_majority(|w| matches!(w, Write::Job(_))));
                if !recorded {
                    let why = format!("{} answered Submitted before a majority held the job", self.nodes[n].id);
                    self.check.fail(self.now, why);
                }
            }
            Wire::Reply(Reply::Error { message }) if self.ctl.submitted => {
                trace!(self, "client <- error from {}: {message}", self.nodes[n].id);
                self.ctl.submitted = false;
                self.push(self.now + CLIENT_RETRY_MS, Ev::Submit);
            }
            _ => {}
        }
    }

    /// node.rs `send`: a node to itself through its mailbox; the controller to a node on that node's
    /// current connection to it; a node to its controller on its own connection. Without one the
    /// message is lost.
    fn send(&mut self, n: usize, peer: &str, epoch: u64, msg: Wire) {
        if peer == CLIENT {
            return self.client_reply(n, msg);
        }
        let env = Envelope::new(epoch, self.nodes[n].generation, msg);
        if peer == self.nodes[n].id.0 {
            return self.local(Local::ToSelf, Ev::SelfMsg { node: n, env });
        }
        let Some(&m) = self.index.get(&NodeId(peer.to_owned())) else {
            return; // the client
        };
        let own = self.nodes[n].conn.filter(|&c| self.conns[c].server == m).map(|c| (c, true));
        let served = self.nodes[n].served[m].filter(|&c| self.conns[c].open_ctrl).map(|c| (c, false));
        let route = if self.nodes[n].core.is_controller() { served.or(own) } else { own.or(served) };
        match route {
            Some((conn, up)) => self.net_send(conn, up, env),
            None => {
                self.stats.lost_messages += 1;
                trace!(self, "{} drops {} for {peer} (not connected)", self.nodes[n].id, kind(&env.msg));
            }
        }
    }

    /// What a worker reports goes through its node (`NodeMsg::FromWorker`), whose actor may be waiting
    /// for a commit.
    pub(super) fn send_to_controller(&mut self, n: usize, msg: ToController) {
        if self.nodes[n].busy {
            let inc = self.nodes[n].inc;
            return self.hold_for_actor(n, Ev::FromWorker { node: n, inc, msg });
        }
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
    fn to_job(&mut self, n: usize, msg: JobMsg) {
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
        // A deposed controller that does not know it yet may still take a message of a membership the
        // new controller has since replaced: fencing is the current controller's (its epochs are newer).
        let deposed = self.ctl.raft.as_ref().is_some_and(|r| r.deposed(n));
        if !matches!(input, JobInput::View { .. }) && !deposed {
            if let Some((from, generation)) = self.delivering {
                self.check.accepted_job_message(self.now, from, generation, input_kind(&input));
            }
        }
        let jc = self.nodes[n].job.jc;
        self.local(Local::NodeToJob, Ev::ToJob { node: n, jc, input });
    }

    /// node.rs `Dial`: node `n` connects to the node listening at `to` (its controller, or with
    /// replicated controllers the one it was told leads or tries next).
    fn dial(&mut self, n: usize, to: SocketAddr) {
        self.stats.dials += 1;
        let inc = self.nodes[n].inc;
        let Some(server) = (0..self.nodes.len()).find(|&s| addr(s, 0) == to) else { return };
        let handshake = self.rng.range(self.cfg.dial_ms_min, self.cfg.dial_ms_max);
        // The handshake needs both ends running and connected: a cut-off node, a stopped server, or a
        // crashed one (QUIC retransmits the handshake: it completes once the server is back).
        let down = match self.nodes[server].up {
            true => None,
            false => Some(self.sc.back_at(server, self.now).unwrap_or(u64::MAX)),
        };
        let cut = self.sc.cut_until(n, server, self.now);
        let blocked = [cut, self.nodes[server].paused_until, down].into_iter().flatten().max();
        let (at, ok) = match blocked {
            Some(until) if until > self.now + self.cfg.connect_timeout_ms => {
                (self.now + self.cfg.connect_timeout_ms, false)
            }
            Some(until) => (until + handshake, true),
            None => (self.now + handshake, true),
        };
        trace!(self, "{} dials {}", self.nodes[n].id, self.nodes[server].id);
        let node = &mut self.nodes[n];
        node.dial_seq += 1;
        let seq = node.dial_seq;
        node.dials.insert(server, seq);
        self.push(at, Ev::DialDone { node: n, inc, server, ok, seq });
    }

    /// A dial ended. A new connection replaces the older one on both sides, and what was in flight on
    /// the older one is lost — but what the server's reader of the older one had read is still handed
    /// to the node actor (`reads_until`), possibly after the newer one's `Connected` and first
    /// messages; the server's endpoint reports nothing for the older one (control/shared.rs). Each
    /// side's node actor learns of the newer connection a mailbox hop later (`Ev::Connected`): until
    /// then the server still counts the node as connected the old way and may send it messages meant
    /// for that membership, which go out on the newer connection. A node that turns to another server
    /// (replicated controllers) leaves its connection to the earlier one, which that one sees lost.
    pub(super) fn dial_done(&mut self, n: usize, server: usize, ok: bool, seq: u64) {
        if self.nodes[n].dials.get(&server) != Some(&seq) {
            // Given up (node.rs aborted its task): no connection, and the core hears nothing of it.
            return trace!(self, "{}'s given-up dial to {} ends unseen", self.nodes[n].id, self.nodes[server].id);
        }
        self.nodes[n].dials.remove(&server);
        if !ok || !self.nodes[server].up {
            trace!(self, "{} could not reach {}", self.nodes[n].id, self.nodes[server].id);
            self.nodes[n].core.dialed(dur(self.now), addr(server, 0), Err("unreachable".into()), false);
            return self.act(n);
        }
        if self.nodes[n].core.has_controller_peer() {
            // A dial the node gave up on (it connected to another controller since): the core ignores
            // its end, and its connection carries nothing; the node's own connection stays.
            trace!(self, "{}'s abandoned dial to {} ends", self.nodes[n].id, self.nodes[server].id);
            let name = self.nodes[server].id.0.clone();
            self.nodes[n].core.dialed(dur(self.now), addr(server, 0), Ok(name), false);
            return self.act(n);
        }
        // One connection per pair of nodes: the endpoint keeps the newest with a peer, so one the server
        // had dialed to this node (a controller it followed) is replaced, silently, what was in flight lost.
        if let Some(old) = self.nodes[server].conn.filter(|&c| self.conns[c].server == n) {
            trace!(
                self,
                "{}'s connection {old} to {} is replaced by the new one",
                self.nodes[server].id,
                self.nodes[n].id
            );
            self.nodes[server].conn = None;
            let c = &mut self.conns[old];
            (c.open_node, c.open_ctrl, c.reads_until) = (false, false, None);
            if self.nodes[n].served[server] == Some(old) {
                self.nodes[n].served[server] = None;
            }
        }
        if let Some(old) = self.nodes[n].conn.take() {
            self.conns[old].open_node = false;
            if self.conns[old].server != server {
                let after = self.now + self.rng.range(self.cfg.net_delay_ms_min, self.cfg.net_delay_ms_max);
                self.push(after, Ev::ConnLost { conn: old, at_ctrl: true });
            }
        }
        let replaced = self.nodes[server].served[n].filter(|&c| self.conns[c].open_ctrl);
        if let Some(old) = replaced {
            let c = &mut self.conns[old];
            c.open_ctrl = false;
            c.reads_until = Some(c.reads_until.map_or(self.now, |t| t.min(self.now)));
        }
        let conn = self.open_conn(n, server);
        self.nodes[n].conn = Some(conn);
        trace!(
            self,
            "{} connected to {} (conn {conn}, replacing {replaced:?})",
            self.nodes[n].id,
            self.nodes[server].id
        );
        let at_ctrl = self.now + self.rng.range(0, self.cfg.local_delay_ms_max);
        // One reader, one channel: the newer connection's messages reach the node actor after its
        // `Connected`.
        self.conns[conn].last_up = at_ctrl;
        self.push(at_ctrl, Ev::Connected { conn, at_ctrl: true, inc: self.nodes[server].inc });
        let at_node = self.now + self.rng.range(0, self.cfg.local_delay_ms_max);
        self.push(at_node, Ev::Connected { conn, at_ctrl: false, inc: self.nodes[n].inc });
    }

    /// A node actor handles `Connected`: the server's from its endpoint (`ControlEvent::Connected`),
    /// the dialing node's from its dialing task (`NodeMsg::Connected`, not through the endpoint's event
    /// channel, so the connection's `Lost` may come first: the core is told whether it is still up).
    pub(super) fn connected(&mut self, conn: usize, at_ctrl: bool) {
        let (n, server) = (self.conns[conn].node, self.conns[conn].server);
        let now = dur(self.now);
        if at_ctrl {
            trace!(self, "{} sees {} connect (conn {conn})", self.nodes[server].id, self.nodes[n].id);
            let peer = self.nodes[n].id.0.clone();
            self.nodes[server].core.connected(now, &peer, PeerRole::Node);
            return self.act(server);
        }
        let live = self.conns[conn].open_node && self.nodes[n].conn == Some(conn);
        if !live {
            trace!(self, "{} learns of conn {conn}, already lost", self.nodes[n].id);
        }
        let name = self.server_name(conn);
        self.nodes[n].core.dialed(now, addr(server, 0), Ok(name), live);
        self.act(n);
    }

    /// One side of a connection ended without a goodbye (`ControlEvent::Lost`). The server's reader
    /// reports it after handing over what it read before; the endpoint reports only the loss of a peer's
    /// current connection.
    pub(super) fn conn_lost(&mut self, conn: usize, at_ctrl: bool) {
        let (n, server) = (self.conns[conn].node, self.conns[conn].server);
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
            if self.nodes[server].served[n] != Some(conn) {
                return;
            }
            self.nodes[server].served[n] = None;
            let peer = self.nodes[n].id.0.clone();
            trace!(self, "{} lost its connection {conn} to {peer}", self.nodes[server].id);
            self.nodes[server].core.lost(dur(self.now), &peer);
            self.act(server);
        } else {
            if !self.conns[conn].open_node {
                return;
            }
            self.conns[conn].open_node = false;
            if self.nodes[n].conn == Some(conn) {
                self.nodes[n].conn = None;
                let name = self.server_name(conn);
                trace!(self, "{} lost its connection {conn} to {name}", self.nodes[n].id);
                self.nodes[n].core.lost(dur(self.now), &name);
                self.act(n);
            }
        }
    }

    /// A server's message reaching node `n` over the network.
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
        let name = self.server_name(conn);
        self.nodes[n].core.message(dur(self.now), &name, PeerRole::Node, env.epoch, env.msg);
        self.act(n);
    }

    /// A node's message to itself (through its own mailbox).
    pub(super) fn deliver_self(&mut self, n: usize, env: Envelope) {
        let me = self.nodes[n].id.0.clone();
        self.delivering = Some((n, env.generation));
        self.nodes[n].core.message(dur(self.now), &me, PeerRole::Node, env.epoch, env.msg);
        self.act(n);
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
                self.crash_server(node);
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

    /// SIGKILL: everything of this incarnation is gone; the server's side of the connection times out.
    fn crash(&mut self, n: usize) {
        self.stop_job(n);
        if let Some(raft) = self.ctl.raft.as_mut().filter(|_| n < self.sc.controllers) {
            raft.crashed(n);
        }
        let node = &mut self.nodes[n];
        node.up = false;
        node.paused_until = None;
        node.held.clear();
        (node.busy, node.took_over_at) = (false, None);
        node.busy_held.clear();
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

    /// SIGKILL of a node others dialed (the controller's daemon; with replicated controllers any
    /// controller): besides what any node loses, its membership, its job controller and its side of
    /// every connection to it are gone; the members notice when their connections time out. Only the
    /// catalog (the Raft log) survives.
    fn crash_server(&mut self, n: usize) {
        self.nodes[n].served.iter_mut().for_each(|c| *c = None);
        let served: Vec<usize> = (0..self.conns.len()).filter(|&c| self.conns[c].server == n).collect();
        for conn in served {
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
            0 if self.ctl.raft.is_none() => {
                let catalog = &self.ctl.catalog;
                let members = catalog.view_members.iter().map(|m| m.0.clone()).collect();
                let expecting = catalog.view_expecting.clone();
                let view = StoredView { epoch: catalog.view_epoch, members, recorded_by: None, expecting };
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
        if let Some(raft) = self.ctl.raft.as_mut().filter(|_| n < self.sc.controllers) {
            raft.restarted(n, self.now, &mut self.rng);
        } else if n == 0 {
            let epoch = self.ctl.catalog.view_epoch + 1;
            self.check.controller_restarted(self.now, 0, epoch, self.nodes[0].generation);
            self.stats.controller_restarts += 1;
            trace!(self, "controller restarted at epoch {epoch} from its catalog; expects {:?}", view);
        }
        self.nodes[n].core = new_core(self, n, inc, view, jobs);
        let known = self.nodes[n].known.clone();
        self.nodes[n].core.remember(known);
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
                let server = self.server_name(conn);
                self.nodes[n].core.lost(dur(self.now), &server);
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
        {
            // A server (the controller) stopped: every member's connection to it times out on the
            // member's side now, and on the server's when it runs again (that event waits for it);
            // meshes with its ranks break.
            for m in (0..self.nodes.len()).filter(|&m| m != n) {
                if let Some(conn) = self.nodes[m].conn.filter(|&c| self.conns[c].server == n) {
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
        Wire::Reply(Reply::Status(status)) => format!("Status({} members)", status.members.len()),
        other => format!("{other:?}"),
    }
}

fn to_controller_kind(msg: &ToController) -> String {
    match msg {
        ToController::Join { .. } => "Join".into(),
        ToController::Heartbeat { .. } => "Heartbeat".into(),
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
