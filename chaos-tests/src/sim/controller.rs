//! The controller in the simulation: its node runs the runtime's own `NodeCore` (see `node.rs`); here
//! is the JobController actor around the runtime's own [`JobDriver`](troupe_actors::runtime::job::JobDriver)
//! — its mailbox, its flush (record in the catalog, then carry out) — the controller's readers of the
//! members' connections, and the checks of what the job did.

use troupe_actors::protocol::{JobEvent, JobInfo, StepFigures, ToController, ToNode, Wire};
use troupe_actors::runtime::controller::not_started;
use troupe_actors::runtime::job::{DriverAction, FAILED_ATTEMPTS_MAX};
use troupe_cluster::control::PeerRole;
use troupe_cluster::membership::NodeId;

use super::check::Checker;
use super::config::PlantedBug;
use super::node::{dur, kind, to_node_kind};
use super::raft::{Proposer, Write};
use super::world::{addr, trace, Envelope, Ev, FromJob, JobEnd, JobInput, Local, World, JOB};

impl World<'_> {
    /// The controller's reader of connection `conn` hands a node's message to the node actor: on an open
    /// connection, or what a replaced (or lost) one read before it stopped reading.
    pub(super) fn deliver_up(&mut self, conn: usize, env: Envelope, read_at: u64) {
        let c = &self.conns[conn];
        let handed = match c.reads_until {
            Some(until) => read_at < until,
            None => c.open_ctrl,
        };
        if !handed {
            self.stats.lost_messages += 1;
            return;
        }
        if !c.open_ctrl {
            self.stats.late_after_replacement += 1;
            let what = kind(&env.msg);
            trace!(self, "{what} of {} read on replaced conn {conn} reaches the controller", self.nodes[c.node].id);
        }
        let (from, server) = (c.node, c.server);
        self.count_delivery(from, true, &env);
        if let Wire::ToController(ToController::Join { incarnation, .. }) = &env.msg {
            self.count_join(from, *incarnation, env.via);
            self.check.join_requested(from, env.generation);
            trace!(self, "controller <- Join from {} (incarnation {incarnation:?})", self.nodes[from].id);
        }
        let peer = self.nodes[from].id.0.clone();
        self.delivering = Some((from, env.generation));
        self.nodes[server].core.message(dur(self.now), &peer, PeerRole::Node, env.epoch, env.msg);
        self.act(server);
        self.delivering = None;
    }

    /// A `Join` the controller had from this incarnation already is a resend (a joiner asks every
    /// heartbeat interval until a view admits it): counted, and whether it came on another connection.
    fn count_join(&mut self, from: usize, incarnation: Option<u64>, via: Option<usize>) {
        match self.joins.get(&(from, incarnation)) {
            Some(&first) => {
                self.stats.join_repeats += 1;
                if first != via {
                    self.stats.join_repeats_across_connections += 1;
                }
            }
            None => {
                self.joins.insert((from, incarnation), via);
            }
        }
    }

    /// Node `n`'s JobController actor of incarnation `jc` gets a message: handled now, or after the
    /// record it waits for was committed (replicated controllers: `flush` awaits `propose`).
    pub(super) fn job_handle(&mut self, n: usize, jc: u32, input: JobInput) {
        let job = &mut self.nodes[n].job;
        if job.jc != jc || !job.started {
            return;
        }
        if job.waiting_batch.is_some() {
            return job.waiting.push_back(input);
        }
        self.job_input(n, input);
    }

    /// The JobController actor handles one message and flushes the driver's actions to its node.
    fn job_input(&mut self, n: usize, input: JobInput) {
        let now = dur(self.now);
        trace!(self, "job@{} <- {input:?}", self.nodes[n].id);
        let id = |w: &Self, m: usize| w.nodes[m].id.clone();
        match input {
            JobInput::View { view, members, changes } => self.nodes[n].job.driver.on_view(&view, &members, changes),
            JobInput::Ready { node, attempt, slot, committed } => {
                let id = id(self, node);
                self.nodes[n].job.driver.on_ready(now, &id, attempt, slot, addr(node, slot), committed);
            }
            JobInput::Vote { node, attempt, slot, step } => {
                if self.cfg.planted == PlantedBug::CommitOnFirstVote {
                    self.commit_on_first_vote(n, attempt, step);
                }
                let id = id(self, node);
                let loss = 4.0 / (step as f64 + 1.0);
                self.nodes[n].job.driver.on_vote(now, &id, attempt, slot, step, StepFigures::new(loss, 1.0));
            }
            JobInput::Ended { node, attempt, slot, outcome } => {
                let id = id(self, node);
                self.nodes[n].job.driver.on_ended(&id, attempt, slot, outcome);
            }
            JobInput::Checkpointed { attempt, step } => self.nodes[n].job.driver.on_checkpoint(
                attempt,
                step,
                format!("/shared/checkpoints/step-{step:08}").into(),
                0.0,
                0,
            ),
        }
        self.job_flush(n);
    }

    /// The planted bug: commit a step to every rank on its first vote (the driver is not changed; this
    /// wraps its actions).
    fn commit_on_first_vote(&mut self, n: usize, attempt: u64, step: u64) {
        let info = self.nodes[n].job.driver.info();
        if attempt != info.attempts || step != info.step || !self.ctl.early.insert((attempt, step)) {
            return;
        }
        let mut nodes: Vec<NodeId> = self
            .ctl
            .attempt_ranks
            .get(&attempt)
            .map(|r| r.iter().map(|r| r.node.clone()).collect())
            .unwrap_or_default();
        nodes.dedup();
        trace!(self, "PLANTED BUG: commit step {step} of attempt {attempt} on its first vote");
        for node in nodes {
            let msg = ToNode::Commit { job: JOB, attempt, step, lr_hint: 0.0 };
            self.local(Local::JobToNode, Ev::FromJob { node: n, out: FromJob::Send { node, msg } });
        }
    }

    /// controller.rs `flush`: the batch is recorded (when it has events or the job's attempt or state
    /// changed) — in the catalog with one controller, committed by the Raft group with several — then
    /// carried out.
    pub(super) fn job_flush(&mut self, n: usize) {
        let job = &mut self.nodes[n].job;
        if job.stopped {
            return;
        }
        let mut batch = Vec::new();
        while let Some(action) = job.driver.poll_action() {
            batch.push(action);
        }
        let info = job.driver.info();
        let unrecorded = job.recorded != Some((info.attempts, info.state));
        if unrecorded || batch.iter().any(|a| matches!(a, DriverAction::Event(_))) {
            let jc = job.jc;
            if self.ctl.raft.is_none() {
                self.nodes[n].job.recorded = Some((info.attempts, info.state));
                self.ctl.catalog.job = Some(info);
            } else {
                match self.propose(n, Write::Job(Box::new(info)), Proposer::Job { jc }) {
                    Ok(()) => self.nodes[n].job.waiting_batch = Some(batch),
                    Err(e) => self.not_recorded(n, batch, e),
                }
                return;
            }
        }
        self.carry_out(n, batch);
    }

    /// The record of node `n`'s job controller was committed (or not): its batch goes out, then what
    /// reached the actor meanwhile is handled, in order.
    pub(super) fn job_decided(&mut self, n: usize, jc: u32, result: Result<(), String>) {
        let job = &mut self.nodes[n].job;
        if job.jc != jc {
            return;
        }
        let Some(batch) = job.waiting_batch.take() else { return };
        match result {
            Ok(()) => {
                let info = job.driver.info();
                job.recorded = Some((info.attempts, info.state));
                self.carry_out(n, batch);
            }
            Err(e) => self.not_recorded(n, batch, e),
        }
        if std::mem::take(&mut self.nodes[n].job.starting) {
            // pre_start returns: the node actor answers `job_started` and goes on.
            let started = self.job_start_result(n);
            self.nodes[n].core.job_started(JOB, started);
            self.nodes[n].busy = false;
            self.act(n);
            if !self.nodes[n].busy {
                self.release_actor(n);
            }
        }
        while self.nodes[n].job.waiting_batch.is_none() && !self.nodes[n].job.stopped {
            let Some(input) = self.nodes[n].job.waiting.pop_front() else { break };
            self.job_input(n, input);
        }
    }

    /// A record not committed by a majority: none of the batch goes out; the job controller stops and
    /// tells its node, which steps down (controller.rs `flush`). The planted bug carries it out anyway.
    fn not_recorded(&mut self, n: usize, batch: Vec<DriverAction>, why: String) {
        trace!(self, "{}: the job's record was not committed: {why}", self.nodes[n].id);
        if self.cfg.planted == PlantedBug::DeposedLeaderAnnounces {
            trace!(self, "PLANTED BUG: {} announces an uncommitted batch", self.nodes[n].id);
            return self.carry_out(n, batch);
        }
        let (inc, why) = (self.nodes[n].inc, format!("job {JOB}'s record was not committed: {why}"));
        let job = &mut self.nodes[n].job;
        job.stopped = true;
        job.waiting.clear();
        job.not_committed = Some(why.clone());
        self.local(Local::JobToNode, Ev::NotCommitted { node: n, inc, why });
    }

    /// What controller.rs `pre_start` returns: a job whose first record was not committed did not start
    /// (its submitter is told to submit again), whatever the planted bug carried out.
    pub(super) fn job_start_result(&self, n: usize) -> Result<(), String> {
        match &self.nodes[n].job.not_committed {
            Some(why) => Err(not_started(JOB, why)),
            None => Ok(()),
        }
    }

    /// Carries out a recorded batch: the driver's messages and events go to the node actor.
    fn carry_out(&mut self, n: usize, batch: Vec<DriverAction>) {
        // A deposed leader's late batch (see `commit_announced`) is not the job's trajectory: its events
        // reach no one the checker follows (watchers follow the new controller).
        let deposed = self.ctl.raft.as_ref().is_some_and(|r| r.deposed(n));
        for action in batch {
            match action {
                DriverAction::Send { node, msg } => {
                    match &msg {
                        ToNode::Prepare { attempt, ranks, .. } => {
                            self.stats.attempts = *attempt;
                            self.ctl.attempt_ranks.insert(*attempt, ranks.clone());
                        }
                        ToNode::Commit { attempt, step, .. } => self.commit_announced(n, *attempt, *step),
                        _ => {}
                    }
                    trace!(self, "driver@{} -> {node}: {}", self.nodes[n].id, to_node_kind(&msg));
                    self.local(Local::JobToNode, Ev::FromJob { node: n, out: FromJob::Send { node, msg } });
                }
                DriverAction::Event(event) => {
                    if !deposed {
                        self.job_event(n, event.clone());
                    }
                    let info = Box::new(self.nodes[n].job.driver.info());
                    self.local(Local::JobToNode, Ev::FromJob { node: n, out: FromJob::Event { event, info } });
                }
                DriverAction::StepBoundary => {
                    self.local(Local::JobToNode, Ev::FromJob { node: n, out: FromJob::StepBoundary })
                }
            }
        }
        // controller.rs sends its job's state after every flush; the node needs only its changes.
        let info = self.nodes[n].job.driver.info();
        let key = (info.state, info.attempts, info.step);
        if self.nodes[n].job.told != Some(key) {
            self.nodes[n].job.told = Some(key);
            self.local(Local::JobToNode, Ev::FromJob { node: n, out: FromJob::Info(Box::new(info)) });
        }
    }

    /// Node `n`'s job controller sends `Commit` for `step` of `attempt`: the step is committed once, by
    /// one controller, and its record is in a majority of the controllers' stores (the catalog, with
    /// one controller).
    ///
    /// A deposed leader (its term superseded, which it does not know yet: it was paused or cut off) may
    /// still announce a step whose record its own term committed before a new leader took over: Raft
    /// committed it, so it is not a second commit. Members refuse it (their controller is the new one,
    /// at a newer epoch); only its own workers may apply it — the step the new leader redoes from the
    /// same state, the same bits (checked: a rank applies only committed steps, to the steps before).
    fn commit_announced(&mut self, n: usize, attempt: u64, step: u64) {
        let deposed = self.ctl.raft.as_ref().is_some_and(|r| r.deposed(n));
        if deposed {
            trace!(
                self,
                "{} (deposed) announces step {step} of attempt {attempt}, committed in its term",
                self.nodes[n].id
            );
            self.stats.late_commits += 1;
            self.check.late_commit(attempt, step);
        } else {
            self.check.commit_sent(self.now, attempt, step, n);
        }
        let holds = |i: &JobInfo| i.attempts == attempt && i.step > step;
        let held = match &self.ctl.raft {
            None => self.ctl.catalog.job.as_ref().is_some_and(holds),
            Some(raft) => raft.in_majority(|w| matches!(w, Write::Job(i) if holds(i))),
        };
        if !held {
            let what = format!(
                "{} sent Commit of step {step} (attempt {attempt}), which no majority of the controllers' stores holds",
                self.nodes[n].id
            );
            self.check.fail(self.now, what);
        }
    }

    /// The job controller's actions reach its node actor (`NodeMsg::Outgoing`, `StepBoundary`,
    /// `JobEvent`, `JobInfo`).
    pub(super) fn job_output(&mut self, n: usize, out: FromJob) {
        let now = dur(self.now);
        let core = &mut self.nodes[n].core;
        match out {
            FromJob::Send { node, msg } => core.job_outgoing(&node, msg),
            FromJob::StepBoundary => core.step_boundary(now),
            FromJob::Event { event, info } => core.job_event(JOB, event, *info),
            FromJob::Info(info) => core.job_info(*info),
        }
        self.act(n);
    }

    pub(super) fn job_event(&mut self, n: usize, event: JobEvent) {
        trace!(self, "JOB {event:?}");
        match event {
            JobEvent::Step { step, .. } => {
                self.stats.committed_steps = step;
                self.check.step_reported(self.now, step);
            }
            JobEvent::Finished { steps, .. } => {
                self.end = JobEnd::Finished { at_ms: self.now };
                if steps != self.sc.steps {
                    self.check.fail(self.now, format!("the job finished after {steps} of {} steps", self.sc.steps));
                }
                self.check_final_ranks(n);
            }
            JobEvent::Failed { reason } => {
                self.check_failure_allowed(n, &reason);
                self.end = JobEnd::Failed { at_ms: self.now, reason };
            }
            JobEvent::RolledBack { from_step, to_step } => {
                if let Some(holders) = self.holders_of(n, from_step) {
                    let what =
                        format!("rolled back from step {from_step} to {to_step} although members {holders:?} hold it");
                    self.check.fail(self.now, what);
                }
                self.check.rolled_back(to_step);
                self.stats.rollbacks += 1;
            }
            JobEvent::Recovered { step, .. } => self.check.recovered(self.now, step),
            JobEvent::Cancelled => self.check.fail(self.now, "the job was cancelled; nobody cancelled it".into()),
            _ => {}
        }
    }

    /// Every rank of the attempt that finished the job completed it holding every step.
    fn check_final_ranks(&mut self, n: usize) {
        let attempt = self.nodes[n].job.driver.info().attempts;
        let ranks = self.ctl.attempt_ranks.get(&attempt).cloned().unwrap_or_default();
        for r in ranks {
            let node = self.index[&r.node];
            match self.check.completed.get(&(attempt, node, r.slot)) {
                Some(state) if Checker::is_prefix(state, self.sc.steps) => {}
                other => {
                    let what =
                        format!("rank {}/{} of the final attempt {attempt} ended holding {other:?}", r.node, r.slot);
                    self.check.fail(self.now, what);
                }
            }
        }
    }

    /// A job may fail only when the scenario made it unavoidable.
    fn check_failure_allowed(&mut self, n: usize, reason: &str) {
        if reason.contains("was lost") {
            let step = self.nodes[n].job.driver.info().step;
            if let Some(holders) = self.holders_of(n, step) {
                let what = format!("the job failed ({reason}) although members {holders:?} hold step {step}");
                self.check.fail(self.now, what);
            }
        } else if reason.contains("attempts in a row failed") {
            if self.sc.harmful_faults() < FAILED_ATTEMPTS_MAX as usize {
                let what = format!("the job failed ({reason}) with only {} faults", self.sc.harmful_faults());
                self.check.fail(self.now, what);
            }
        } else {
            self.check.fail(self.now, format!("the job failed for a reason no fault explains: {reason}"));
        }
    }

    /// The controller: of the running nodes that act as the controller (a deposed one may not know it
    /// yet), the one with the newest view.
    pub(super) fn controller_node(&self) -> Option<usize> {
        (0..self.nodes.len())
            .filter(|&n| self.nodes[n].up && self.nodes[n].core.is_controller())
            .max_by_key(|&n| self.nodes[n].core.epoch())
    }

    /// Node `n`'s view as the controller (empty if it is not one).
    fn view_of(&self, n: usize) -> troupe_cluster::membership::View {
        match self.nodes[n].core.membership() {
            Some(m) => m.view().clone(),
            None => troupe_cluster::membership::View::new(troupe_cluster::membership::Epoch(0), Vec::new()),
        }
    }

    /// The controller's current view (empty without a controller).
    pub(super) fn controller_view(&self) -> troupe_cluster::membership::View {
        self.view_of(self.controller_node().unwrap_or(0))
    }

    /// The live members' workers (of controller `n`'s view) that hold at least `step` committed steps.
    fn holders_of(&self, n: usize, step: u64) -> Option<Vec<String>> {
        let view = self.view_of(n);
        let mut holders = Vec::new();
        for node in self.nodes.iter().filter(|n| n.up && view.contains(&n.id)) {
            for (slot, w) in node.workers.iter().enumerate() {
                let held = w
                    .job
                    .as_ref()
                    .and_then(|j| j.trainer.as_ref().or(j.running.as_ref().map(|t| &t.state)).map(|s| s.len() as u64));
                if held.is_some_and(|h| h >= step) {
                    holders.push(format!("{}/{slot}", node.id));
                }
            }
        }
        (!holders.is_empty()).then_some(holders)
    }

    /// After the job ended, the faults healed and the tail passed: every node that runs is a member of the
    /// controller's view again and holds that view (a node left out for good is capacity lost).
    pub(super) fn check_rejoined(&mut self) {
        if self.controller_node().is_none() {
            return self.check.fail(self.now, "no node is the controller at the end of the run".into());
        }
        let view = self.controller_view();
        for n in 0..self.nodes.len() {
            let node = &self.nodes[n];
            let held = node.core.member().epoch();
            if node.up && (!view.contains(&node.id) || held != Some(view.epoch)) {
                let what = format!(
                    "{} runs but is not back in the controller's view (epoch {}: {:?}); it holds epoch {held:?}",
                    node.id,
                    view.epoch,
                    view.members()
                );
                self.check.fail(self.now, what);
            }
        }
    }

    /// After the job ended and the tail passed: every member released the job's state.
    pub(super) fn check_released(&mut self) {
        let view = self.controller_view();
        for n in 0..self.nodes.len() {
            let node = &self.nodes[n];
            if !node.up || !view.contains(&node.id) {
                continue;
            }
            for (slot, w) in node.workers.iter().enumerate() {
                if let Some(job) = &w.job {
                    let held = job.trainer.as_ref().map(Vec::len);
                    let what = format!(
                        "{}/{slot} still holds the job's state ({held:?} steps, running: {}) after the job ended",
                        node.id,
                        job.running.is_some()
                    );
                    self.check.fail(self.now, what);
                }
            }
        }
    }
}
