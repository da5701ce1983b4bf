//! The replicated controller in the simulation: the shell around the Raft model ([`super::raft`]) as
//! node.rs and controller.rs are around openraft's `ControllerGroup` — proposals that the node actor
//! (a view) or its job controller (a batch) wait for, the leadership watch handed to
//! `NodeCore::on_leadership` and, each tick, to `NodeCore::leadership_tick` (the core decides: take
//! over, step down, which leader to follow; the shell reads the replicated catalog for
//! `NodeCore::become_controller` when the core asks with `NodeAction::TakeOver`), and a job
//! controller's `NotCommitted`. What each node decides is `NodeCore`'s, the same code node.rs runs;
//! what the group guarantees is the model's.

use troupe_actors::catalog::{StoredJob, StoredView};
use troupe_actors::protocol::{JobEvent, JobInfo, JobState};

use super::node::dur;
use super::raft::{Net, Proposer, RaftOut, Watch, Write};
use super::world::{trace, Ev, JobEnd, World};

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

    /// node.rs `on_leadership`: what the watch means is `NodeCore::on_leadership`'s (elected: a
    /// [`NodeAction::TakeOver`](troupe_actors::runtime::node_core::NodeAction::TakeOver); otherwise step
    /// down and follow the leader named); the replicated catalog this node applied names the leader's
    /// address if the leader recorded the last view.
    pub(super) fn on_leadership(&mut self, n: usize, watch: Watch) {
        let leader = watch.leader.map(|l| self.nodes[l].id.0.clone());
        let raft = self.ctl.raft.as_ref().expect("replicated controllers");
        self.nodes[n].core.on_leadership(dur(self.now), watch.term, leader.as_deref(), || raft.state(n).0);
        self.act(n);
    }

    /// node.rs `Tick` with replicated controllers: `NodeCore::leadership_tick` with what the watch says
    /// now (the leader looked up again, an election won but not acted on).
    pub(super) fn leadership_tick(&mut self, n: usize) {
        if self.ctl.raft.is_none() || n >= self.sc.controllers || self.nodes[n].busy {
            return;
        }
        let raft = self.ctl.raft.as_ref().expect("replicated controllers");
        let leader = raft.leader_of(n).map(|l| self.nodes[l].id.0.clone());
        let term = raft.peers[n].term;
        self.nodes[n].core.leadership_tick(term, leader.as_deref(), || raft.state(n).0);
    }

    /// node.rs `take_over` ([`NodeAction::TakeOver`](troupe_actors::runtime::node_core::NodeAction::TakeOver)):
    /// `NodeCore::become_controller` with the state this node applied (everything committed, its blank
    /// entry included). Its actions follow in the caller's loop.
    pub(super) fn take_over(&mut self, n: usize, term: u64) {
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
        let ended = jobs.first().map(|j| j.info.clone()).filter(|info| info.state.is_terminal());
        self.nodes[n].core.become_controller(dur(self.now), view, jobs);
        if self.nodes[n].core.is_controller() {
            self.stats.takeovers += 1;
            self.nodes[n].generation += 1;
            self.nodes[n].took_over_at = Some(epoch);
            if let Some(info) = ended.filter(|_| self.end == JobEnd::Unfinished) {
                self.rewatch_end(n, &info);
            }
        }
    }

    /// The job ended in a record that was committed but never announced: its proposer heard `NotLeader`
    /// (deposed while the record was on a majority's logs, which the next leader's first entry then
    /// committed — Raft's rule, seeds 130 and 340 of the random schedules). The new controller restores
    /// the job as it ended, and the watcher, following the controller across the take-over, re-watches
    /// from the next event number (`JobHandle`, `Watch { since }`): the end is replayed from the
    /// replicated event log. Modelled for the end only: the checker follows steps by their commits.
    fn rewatch_end(&mut self, n: usize, info: &JobInfo) {
        let event = match info.state {
            JobState::Finished => JobEvent::Finished { steps: info.step, final_loss: info.last_loss },
            JobState::Cancelled => JobEvent::Cancelled,
            _ => JobEvent::Failed { reason: info.reason.clone().unwrap_or_default() },
        };
        trace!(self, "the watcher re-watches at {}: the job ended in a record it was never told of", self.nodes[n].id);
        self.job_event(n, event);
    }
}
