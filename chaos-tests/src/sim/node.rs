//! The node actor (actors/src/runtime/node.rs), modelled: its side of membership, its control connection
//! to the controller, how it routes the controller's messages to its workers and theirs back — and what
//! the adversary does to it (crash, pause, partition, connection reset, drain, restart).

use std::time::Duration;

use std::collections::BTreeMap;

use troupe_actors::protocol::{AttemptOutcome, MemberInfo, Wire};
use troupe_actors::runtime::job::JobDriver;
use troupe_cluster::membership::{Epoch, MemberAction, MemberState, Membership, MembershipEvent};

use super::scenario::Fault;
use super::world::{addr, trace, Envelope, Ev, Local, Stall, Worker, World, JOB};

pub(super) fn dur(ms: u64) -> Duration {
    Duration::from_millis(ms)
}

/// The membership incarnation a process of the node starts with (node.rs draws a random one): each
/// process its own range, which its fences count up in.
pub(super) fn first_incarnation(process: u32) -> u64 {
    u64::from(process) << 32
}

impl World<'_> {
    /// node.rs `on_tick`: dial the controller if not connected, drive membership timers; on the
    /// controller also failure detection and admitting joiners while no job runs.
    pub(super) fn tick(&mut self, n: usize) {
        let inc = self.nodes[n].inc;
        self.push(self.now + self.cfg.tick_ms, Ev::Tick { node: n, inc });
        if n != 0 && !self.nodes[n].leader_peer && !self.nodes[n].connecting {
            self.dial(n);
        }
        let now = dur(self.now);
        self.nodes[n].member.handle_timeout(now);
        self.drive_member(n);
        if n == 0 {
            // The controller is alive while it ticks: it never times itself out.
            let epoch = self.ctl.membership.epoch();
            let me = self.nodes[0].id.clone();
            self.ctl.membership.handle(now, MembershipEvent::Heartbeat { from: me, epoch });
            self.ctl.membership.handle_timeout(now);
            let idle = self.ctl.driver.info().state != troupe_actors::protocol::JobState::Running;
            if idle && self.ctl.membership.joining().next().is_some() {
                self.ctl.membership.handle(now, MembershipEvent::StepBoundary);
            }
            self.drive_membership();
            // The job controller's own tick (a restored job's grace, the wait below min_nodes).
            self.ctl.driver.on_tick(now);
            self.job_flush();
        }
    }

    fn dial(&mut self, n: usize) {
        self.nodes[n].connecting = true;
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
            self.nodes[n].connecting = false;
            trace!(self, "{} could not reach the controller", self.nodes[n].id);
            return;
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

    /// A node actor handles `Connected`. On the controller, node.rs (`ControlEvent::Connected`) removes a
    /// member that connects again, whether or not the controller still held an older connection of it —
    /// a node admitted while its connection was down (the controller's side had noticed the loss while it
    /// was only a joiner) missed its view and whatever job message followed it. On the dialing node
    /// (`NodeMsg::Connected`, sent by the dialing task — not through the endpoint's event channel, so
    /// the connection's `Lost` may come first) the controller becomes its leader peer.
    pub(super) fn connected(&mut self, conn: usize, at_ctrl: bool) {
        let n = self.conns[conn].node;
        if at_ctrl {
            if self.cfg.node_model.replacement_is_loss && self.ctl.membership.view().contains(&self.nodes[n].id) {
                let peer = self.nodes[n].id.clone();
                trace!(self, "controller sees {peer} connect again (conn {conn}): it lost its previous connection");
                self.ctl.membership.handle(dur(self.now), MembershipEvent::ConnectionLost { peer });
                self.drive_membership();
            }
            return;
        }
        self.nodes[n].connecting = false;
        let live = self.conns[conn].open_node && self.nodes[n].conn == Some(conn);
        if !live && self.cfg.node_model.connected_checks_link {
            return trace!(self, "{} learns of conn {conn}, already lost: it dials again", self.nodes[n].id);
        }
        self.nodes[n].leader_peer = true;
        self.nodes[n].member.handle_timeout(dur(self.now));
        self.drive_member(n);
    }

    /// One side of a connection ended without a goodbye (`ControlEvent::Lost`). The controller's reader
    /// reports it after handing over what it read before.
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
            let peer = self.nodes[n].id.clone();
            trace!(self, "controller lost its connection {conn} to {peer}");
            if self.ctl.membership.view().contains(&peer) {
                self.ctl.membership.handle(dur(self.now), MembershipEvent::ConnectionLost { peer });
                self.drive_membership();
            }
        } else {
            if !self.conns[conn].open_node {
                return;
            }
            self.conns[conn].open_node = false;
            if self.nodes[n].conn == Some(conn) {
                self.nodes[n].conn = None;
                self.nodes[n].leader_peer = false;
                trace!(self, "{} lost its connection {conn} to the controller", self.nodes[n].id);
            }
        }
    }

    /// node.rs `send_to_leader`: the controller node sends to itself; another node sends on its
    /// connection if it has one, else the message is dropped.
    pub(super) fn send_to_leader(&mut self, n: usize, msg: Wire) {
        let generation = self.nodes[n].generation;
        let epoch = self.stamp(n);
        if n == 0 {
            self.local(Local::ToSelf, Ev::SelfMsg(Envelope::new(0, epoch, generation, msg)));
            return;
        }
        match self.nodes[n].conn {
            Some(conn) if self.nodes[n].leader_peer => {
                self.net_send(conn, true, Envelope::new(n, epoch, generation, msg))
            }
            _ => {
                self.stats.lost_messages += 1;
                trace!(self, "{} drops {} (not connected to the controller)", self.nodes[n].id, kind(&msg));
            }
        }
    }

    /// The epoch in the frame header of what node `n` sends.
    pub(super) fn stamp(&self, n: usize) -> u64 {
        if n == 0 && self.cfg.node_model.stamp_membership_epoch {
            self.ctl.membership.epoch().0
        } else {
            self.nodes[n].epoch()
        }
    }

    /// node.rs `drive_member`.
    pub(super) fn drive_member(&mut self, n: usize) {
        while let Some(action) = self.nodes[n].member.poll_action() {
            match action {
                MemberAction::SendHeartbeat { .. } => self.send_to_leader(n, Wire::Heartbeat),
                MemberAction::SendJoinRequest { incarnation } => {
                    let slots = self.nodes[n].slots;
                    let incarnation = Some(incarnation);
                    self.send_to_leader(n, Wire::Join { slots, addr: addr(n, 0), incarnation });
                }
                MemberAction::AdoptView(view) => {
                    trace!(self, "{} adopts epoch {} {:?}", self.nodes[n].id, view.epoch, view.members());
                    let inc = self.nodes[n].inc;
                    self.check.adopted(self.now, n, inc, view.epoch.0);
                }
                MemberAction::Fenced { current } => {
                    trace!(
                        self,
                        "{} fenced at epoch {current}: aborts its attempts, keeps its state",
                        self.nodes[n].id
                    );
                    self.stats.fences += 1;
                    self.nodes[n].generation += 1;
                    let keep = std::mem::take(&mut self.nodes[n].keep_on_fence);
                    for slot in 0..self.nodes[n].workers.len() {
                        self.worker_abort_all(n, slot, keep);
                        self.nodes[n].workers[slot].attempt = None;
                    }
                }
                MemberAction::ControllerLost { silent_ms } => {
                    trace!(self, "{} heard nothing from the controller for {silent_ms} ms", self.nodes[n].id);
                    if n != 0 && !self.cfg.node_model.keep_connection_on_silence {
                        self.nodes[n].leader_peer = false;
                    }
                }
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
        if !self.nodes[n].leader_peer {
            self.stats.lost_messages += 1;
            trace!(self, "{} ignores {} (no controller connection)", self.nodes[n].id, kind(&env.msg));
            return;
        }
        self.count_delivery(n, false, &env);
        if env.epoch < self.nodes[n].epoch() {
            self.stats.node_refused_stale += 1;
            trace!(
                self,
                "{} refuses {} of epoch {} (its own is {})",
                self.nodes[n].id,
                kind(&env.msg),
                env.epoch,
                self.nodes[n].epoch()
            );
            return;
        }
        self.node_message(n, env);
    }

    /// The controller node's message to itself: for its controller part, or for its node part.
    pub(super) fn deliver_self(&mut self, env: Envelope) {
        if env.msg.is_for_controller() {
            self.leader_message(env);
            self.drive_membership();
        } else {
            self.node_message(0, env);
        }
    }

    /// node.rs `node_message`: a controller message the node accepted.
    fn node_message(&mut self, n: usize, env: Envelope) {
        let now = dur(self.now);
        self.nodes[n].member.heard_from_controller(now);
        trace!(self, "{} <- {} (epoch {})", self.nodes[n].id, kind(&env.msg), env.epoch);
        let slots = self.nodes[n].workers.len();
        match env.msg {
            Wire::View { view, jobs, .. } => {
                self.nodes[n].member.handle_view(now, view);
                self.drive_member(n);
                if !jobs.contains(&JOB) {
                    // node.rs: `WorkerMsg::Retain` drops the state of a job the controller no longer runs.
                    for slot in 0..slots {
                        self.worker_drop(n, slot);
                        self.nodes[n].workers[slot].attempt = None;
                    }
                }
            }
            Wire::Fenced { current, jobs } => {
                self.nodes[n].keep_on_fence = jobs.contains(&JOB);
                self.nodes[n].member.handle_fence(now, current);
                self.drive_member(n);
                self.nodes[n].keep_on_fence = false;
            }
            Wire::Prepare { attempt, ranks, .. } => {
                let me = self.nodes[n].id.clone();
                for (rank, r) in ranks.iter().enumerate().filter(|(_, r)| r.node == me) {
                    let slot = r.slot as usize;
                    if slot < slots {
                        self.nodes[n].workers[slot].attempt = Some(attempt);
                        self.worker_prepare(n, slot, attempt, rank);
                    }
                }
            }
            Wire::Start { attempt, roster, source, .. } => {
                for slot in 0..slots {
                    self.worker_start(n, slot, attempt, roster.len(), source);
                }
            }
            Wire::Commit { attempt, step, .. } => {
                for slot in 0..slots {
                    self.worker_commit(n, slot, attempt, step);
                }
            }
            Wire::Abort { attempt, .. } => {
                for slot in 0..slots {
                    self.worker_abort(n, slot, attempt);
                }
            }
            Wire::Release { .. } => {
                for slot in 0..slots {
                    self.worker_drop(n, slot);
                    self.nodes[n].workers[slot].attempt = None;
                }
            }
            other => trace!(self, "{} got an unexpected {other:?}", self.nodes[n].id),
        }
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
        node.leader_peer = false;
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
        for slot in 0..self.nodes[n].workers.len() {
            self.worker_drop(n, slot);
        }
        self.send_to_leader(n, Wire::Leave);
        if let Some(conn) = self.nodes[n].conn.take() {
            self.conns[conn].open_node = false;
            let after = self.conns[conn].last_up.max(self.now) + 1;
            self.push(after, Ev::ConnDeparted { conn });
        }
        let node = &mut self.nodes[n];
        node.up = false;
        node.leader_peer = false;
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

    /// node.rs `pre_start` of a daemon that ran as the controller on this data dir before: it starts as
    /// the only member of a view one past the catalog's last epoch, and restores the job from the catalog
    /// (`JobDriver::restore`), expecting the nodes of the last view to rejoin.
    fn restart_controller(&mut self) {
        let now = dur(self.now);
        let me = self.nodes[0].id.clone();
        let catalog = &self.ctl.catalog;
        let epoch = Epoch(catalog.view_epoch + 1);
        let expect = catalog.view_members.clone();
        let membership = Membership::starting_at(self.cfg.membership.clone(), now, vec![me.clone()], epoch);
        let view = membership.view().clone();
        let spec = super::job_spec(self.sc);
        let driver = match &catalog.job {
            Some(info) => JobDriver::restore(JOB, spec, info, expect.clone()),
            None => JobDriver::new(JOB, spec),
        };
        let info = MemberInfo { name: me.0.clone(), addr: addr(0, 0), slots: self.nodes[0].slots };
        self.ctl.membership = membership;
        self.ctl.members = BTreeMap::from([(me.clone(), info)]);
        self.ctl.driver = driver;
        self.ctl.catalog.recorded = None;
        self.ctl.catalog.view_epoch = epoch.0;
        self.ctl.catalog.view_members = vec![me.clone()];
        let incarnation = first_incarnation(self.nodes[0].inc);
        self.nodes[0].member = MemberState::member(me, self.cfg.membership.clone(), now, view.clone(), incarnation);
        self.check.controller_restarted(self.now, epoch.0, self.nodes[0].generation);
        self.stats.controller_restarts += 1;
        trace!(self, "controller restarted at epoch {epoch} from its catalog; expects {expect:?}");
        let members = self.members_of(&view);
        self.ctl.driver.on_view(&view, &members, Vec::new());
        self.job_flush();
    }

    /// A new incarnation of the node: empty, asking to join (the controller's: see `restart_controller`).
    pub(super) fn restart(&mut self, n: usize) {
        let now = dur(self.now);
        let node = &mut self.nodes[n];
        node.up = true;
        node.inc += 1;
        node.generation += 1;
        let incarnation = first_incarnation(node.inc);
        node.member = MemberState::joining(node.id.clone(), self.cfg.membership.clone(), now, incarnation);
        node.leader_peer = false;
        node.conn = None;
        node.connecting = false;
        node.paused_until = None;
        node.pause_broke = false;
        node.workers = (0..node.slots).map(|_| Worker::default()).collect();
        let inc = node.inc;
        trace!(self, "{} starts again (incarnation {inc})", self.nodes[n].id);
        if n == 0 {
            self.restart_controller();
        }
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
            }
            self.nodes[n].leader_peer = false;
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

    /// node.rs `on_worker_failed`: report the worker's attempt failed, restart it empty.
    fn worker_panicked(&mut self, n: usize, slot: usize) {
        if slot >= self.nodes[n].workers.len() {
            return;
        }
        if let Some(attempt) = self.nodes[n].workers[slot].attempt.take() {
            let reason = format!("worker {slot} of {} failed: injected panic", self.nodes[n].id);
            let outcome = AttemptOutcome::Failed { step: 0, reason };
            self.send_to_leader(n, Wire::Ended { job: JOB, attempt, slot: slot as u32, outcome });
        }
        self.worker_vanish(n, slot, 0);
        self.nodes[n].workers[slot].winc += 1;
    }
}

/// A short name of a message for the trace.
pub(super) fn kind(msg: &Wire) -> String {
    match msg {
        Wire::Join { .. } => "Join".into(),
        Wire::Heartbeat => "Heartbeat".into(),
        Wire::Leave => "Leave".into(),
        Wire::Ready { attempt, slot, committed, .. } => format!("Ready(a{attempt} s{slot} c{committed:?})"),
        Wire::Vote { attempt, slot, step, .. } => format!("Vote(a{attempt} s{slot} step {step})"),
        Wire::Ended { attempt, slot, outcome, .. } => format!("Ended(a{attempt} s{slot} {outcome:?})"),
        Wire::View { view, .. } => format!("View(e{} {:?})", view.epoch, view.members()),
        Wire::Fenced { current, .. } => format!("Fenced(e{current})"),
        Wire::Prepare { attempt, ranks, .. } => {
            format!(
                "Prepare(a{attempt} {:?})",
                ranks.iter().map(|r| format!("{}/{}", r.node, r.slot)).collect::<Vec<_>>()
            )
        }
        Wire::Start { attempt, source, .. } => format!("Start(a{attempt} source {source:?})"),
        Wire::Commit { attempt, step, .. } => format!("Commit(a{attempt} step {step})"),
        Wire::Abort { attempt, .. } => format!("Abort(a{attempt})"),
        Wire::Release { .. } => "Release".into(),
        other => format!("{other:?}"),
    }
}
