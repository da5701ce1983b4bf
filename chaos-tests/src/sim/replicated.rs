//! The replicated controller in the simulation: the shell around the Raft model ([`super::raft`]) as
//! node.rs and controller.rs are around openraft's `ControllerGroup` — proposals that the node actor
//! (a view) or its job controller (a batch) wait for, the leadership watch (node.rs `on_leadership`:
//! the elected node becomes the controller from the replicated catalog with `NodeCore::become_controller`,
//! the others `NodeCore::step_down` and follow the leader), and a job controller's `NotCommitted`.
//! What each node decides is `NodeCore`'s; what the group guarantees is the model's.

use troupe_actors::catalog::{StoredJob, StoredView};

use super::node::dur;
use super::raft::{Net, Proposer, RaftOut, Watch, Write};
use super::world::{trace, Ev, World};

impl World<'_> {
    /// Which controllers run now, and which pairs reach each other.
    fn raft_net(&self) -> Net {
        let k = self.sc.controllers;
        let runs: Vec<bool> = (0..k).map(|c| self.nodes[c].up && self.nodes[c].paused_until.is_none()).collect();
        let reach = (0..k)
            .map(|a| (0..k).map(|b| runs[a] && runs[b] && self.sc.cut_until(a, b, self.now).is_none()).collect())
            .collect();
        Net { runs, reach }
    }

    /// A heartbeat round of the group.
    pub(super) fn raft_tick(&mut self) {
        let net = self.raft_net();
        let Some(raft) = self.ctl.raft.as_mut() else { return };
        let out = raft.tick(self.now, &net, &mut self.rng);
        self.stats.elections = raft.elections;
        self.raft_out(out);
        let next = self.now + self.cfg.raft.heartbeat_ms;
        self.push(next, Ev::RaftTick);
    }

    /// Leader `c` replicates what it was just asked to commit.
    pub(super) fn raft_replicate(&mut self, c: usize) {
        let net = self.raft_net();
        let Some(raft) = self.ctl.raft.as_mut() else { return };
        let out = raft.replicate(c, self.now, &net, &mut self.rng);
        self.raft_out(out);
    }

    /// What the group decided reaches each node a mailbox hop later.
    fn raft_out(&mut self, out: Vec<RaftOut>) {
        for o in out {
            let hop = self.rng.range(0, self.cfg.local_delay_ms_max);
            match o {
                RaftOut::Decided { node, by, result } => {
                    let inc = self.nodes[node].inc;
                    self.push(self.now + hop, Ev::Decided { node, inc, by, result });
                }
                RaftOut::Leadership { node, watch } => {
                    trace!(self, "RAFT {} sees term {} led by {:?}", self.nodes[node].id, watch.term, watch.leader);
                    let inc = self.nodes[node].inc;
                    self.push(self.now + hop, Ev::Leadership { node, inc, watch });
                }
            }
        }
    }

    /// `ControllerGroup::propose` on node `n`: in flight (answered by [`Ev::Decided`] once the leader
    /// replicated), or refused at once.
    pub(super) fn propose(&mut self, n: usize, write: Write, by: Proposer) -> Result<(), String> {
        let raft = self.ctl.raft.as_mut().expect("replicated controllers");
        raft.propose(n, write, by, self.now)?;
        let rtt = 2 * self.rng.range(self.cfg.net_delay_ms_min, self.cfg.net_delay_ms_max);
        self.push(self.now + rtt, Ev::RaftReplicate { node: n });
        Ok(())
    }

    /// node.rs `record_view`: the view is proposed and the node actor waits for the commit (true); a
    /// refusal steps the node down at once, and the actions after it go on (false).
    pub(super) fn record_view(&mut self, n: usize, view: StoredView) -> bool {
        let epoch = view.epoch;
        match self.propose(n, Write::View(view), Proposer::View) {
            Ok(()) => {
                trace!(self, "{} proposes view epoch {epoch}", self.nodes[n].id);
                self.nodes[n].busy = true;
                self.nodes[n].pending_view = Some(epoch);
                true
            }
            Err(e) => {
                let why = format!("its view was not committed: {e}");
                self.nodes[n].core.step_down(dur(self.now), &why);
                false
            }
        }
    }

    /// A proposal of node `n` was decided.
    pub(super) fn decided(&mut self, n: usize, by: Proposer, result: Result<(), String>) {
        match by {
            Proposer::Job { jc } => self.job_decided(n, jc, result),
            Proposer::View => {
                let epoch = self.nodes[n].pending_view.take();
                self.nodes[n].busy = false;
                match result {
                    Ok(()) => {
                        if let Some(epoch) = epoch.filter(|&e| self.nodes[n].took_over_at == Some(e)) {
                            self.nodes[n].took_over_at = None;
                            let generation = self.nodes[n].generation;
                            self.check.controller_restarted(self.now, n, epoch, generation);
                        }
                    }
                    Err(e) => {
                        trace!(self, "{}: view epoch {epoch:?} not committed: {e}", self.nodes[n].id);
                        let why = format!("its view was not committed: {e}");
                        self.nodes[n].core.step_down(dur(self.now), &why);
                    }
                }
                self.act(n);
                if !self.nodes[n].busy {
                    self.release_actor(n);
                }
            }
        }
    }

    /// node.rs `NodeMsg::NotCommitted`: a job controller's record was not committed.
    pub(super) fn not_committed(&mut self, n: usize, why: &str) {
        self.nodes[n].core.step_down(dur(self.now), why);
        self.act(n);
    }

    /// node.rs `on_leadership`: elected, the node becomes the controller from the replicated catalog it
    /// applied; otherwise it steps down (if it was the controller) and follows the leader named.
    pub(super) fn on_leadership(&mut self, n: usize, watch: Watch) {
        match watch.leader {
            Some(leader) if leader == n => {
                self.nodes[n].unresolved_leader = None;
                if !self.nodes[n].core.is_controller() {
                    self.take_over(n, watch.term);
                }
            }
            leader => {
                let name = leader.map(|l| self.nodes[l].id.0.clone());
                let why = format!("Raft term {}: {} leads", watch.term, name.as_deref().unwrap_or("no one yet"));
                self.nodes[n].core.step_down(dur(self.now), &why);
                self.nodes[n].unresolved_leader = name;
                self.resolve_leader(n);
                self.act(n);
            }
        }
    }

    /// node.rs `Tick` with replicated controllers: a member without its controller looks the leader up
    /// again, the leader named is followed once its address is known, and an election won but not
    /// acted on is acted on.
    pub(super) fn leadership_tick(&mut self, n: usize) {
        if self.ctl.raft.is_none() || n >= self.sc.controllers || self.nodes[n].busy {
            return;
        }
        let leader = self.ctl.raft.as_ref().expect("replicated controllers").leader_of(n);
        let core = &self.nodes[n].core;
        if !core.is_controller() && !core.has_controller_peer() && leader.is_some_and(|l| l != n) {
            let name = leader.map(|l| self.nodes[l].id.0.clone());
            self.nodes[n].unresolved_leader = self.nodes[n].unresolved_leader.take().or(name);
        }
        self.resolve_leader(n);
        let raft = self.ctl.raft.as_ref().expect("replicated controllers");
        if raft.leads(n) && !self.nodes[n].core.is_controller() {
            let term = raft.peers[n].term;
            self.take_over(n, term);
        }
    }

    /// node.rs `resolve_leader`: the leader's control address from the replicated catalog's last view if
    /// the leader recorded it, else from a view this node holds.
    fn resolve_leader(&mut self, n: usize) {
        let Some(leader) = self.nodes[n].unresolved_leader.clone() else { return };
        let recorded = || {
            let (view, _) = self.ctl.raft.as_ref()?.state(n);
            view?.recorded_by.filter(|(name, _)| *name == leader).map(|(_, addr)| addr)
        };
        if let Some(addr) = recorded().or_else(|| self.nodes[n].core.known_addr(&leader)) {
            self.nodes[n].core.follow(&leader, addr);
            self.nodes[n].unresolved_leader = None;
        }
    }

    /// Elected in `term`: `NodeCore::become_controller` with the state this node applied (everything
    /// committed, its blank entry included).
    fn take_over(&mut self, n: usize, term: u64) {
        let (view, info) = self.ctl.raft.as_ref().expect("replicated controllers").state(n);
        let epoch = view.as_ref().map_or(1, |v| v.epoch + 1);
        let jobs: Vec<StoredJob> = info
            .map(|info| StoredJob { spec: super::job_spec(self.sc), info, first_event: 0, events: Vec::new() })
            .into_iter()
            .collect();
        trace!(
            self,
            "{} elected in term {term}: the controller at epoch {epoch}, restoring {:?}",
            self.nodes[n].id,
            view
        );
        self.nodes[n].core.become_controller(dur(self.now), view, jobs);
        if self.nodes[n].core.is_controller() {
            self.stats.takeovers += 1;
            self.nodes[n].generation += 1;
            self.nodes[n].took_over_at = Some(epoch);
        }
        self.act(n);
    }
}
