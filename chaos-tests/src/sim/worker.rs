//! The worker actor (actors/src/runtime/worker.rs) and its attempt task, modelled: a rank's "trainer" is
//! the list of steps applied to it. The data plane is an attempt's mesh: a collective (connect, state
//! copy, each step's all-reduce) completes when every rank entered it, and fails for everyone once a rank
//! left the mesh or stayed unreachable for the idle timeout.

use troupe_actors::protocol::{AttemptOutcome, StepFigures, ToController};

use super::world::{addr, trace, Ev, JobSlot, Mesh, MeshRank, Op, Phase, Prepared, RankAt, Task, World, JOB};

impl World<'_> {
    fn rank_name(&self, n: usize, slot: usize) -> String {
        format!("{}/{slot}", self.nodes[n].id)
    }

    fn rank_at(&self, n: usize, slot: usize, attempt: u64) -> RankAt {
        RankAt { node: n, inc: self.nodes[n].inc, slot: slot as u32, winc: self.nodes[n].workers[slot].winc, attempt }
    }

    fn task_mut(&mut self, at: RankAt) -> Option<&mut Task> {
        let node = &mut self.nodes[at.node];
        if !node.up || node.inc != at.inc {
            return None;
        }
        let w = node.workers.get_mut(at.slot as usize)?;
        if w.winc != at.winc {
            return None;
        }
        w.job.as_mut()?.running.as_mut().filter(|t| t.attempt == at.attempt)
    }

    fn job_slot(&mut self, n: usize, slot: usize) -> Option<&mut JobSlot> {
        self.nodes[n].workers[slot].job.as_mut()
    }

    /// What a worker sends the controller goes through its node.
    fn report(&mut self, n: usize, msg: ToController) {
        self.send_to_controller(n, msg);
    }

    /// worker.rs `Prepare`: deferred while an attempt still runs.
    pub(super) fn worker_prepare(&mut self, n: usize, slot: usize, attempt: u64, rank: usize) {
        let job = self.nodes[n].workers[slot].job.get_or_insert_with(JobSlot::default);
        if job.running.is_some() {
            job.deferred = Some(Prepared { attempt, rank });
            return;
        }
        self.prepare(n, slot, attempt, rank);
    }

    /// worker.rs `prepare`: a worker without state builds a fresh model (step 0); it answers `Ready`.
    fn prepare(&mut self, n: usize, slot: usize, attempt: u64, rank: usize) {
        let fresh = match self.sc.checkpoint_every {
            Some(_) => self.checkpoints.last().cloned().unwrap_or_default(),
            None => Vec::new(),
        };
        let job = self.nodes[n].workers[slot].job.get_or_insert_with(JobSlot::default);
        let committed = job.trainer.get_or_insert(fresh).len() as u64;
        job.prepared = Some(Prepared { attempt, rank });
        let ready = ToController::Ready {
            job: JOB,
            attempt,
            slot: slot as u32,
            data_addr: addr(n, slot as u32),
            committed: Some(committed),
        };
        self.report(n, ready);
    }

    /// worker.rs `start`: only for the attempt it prepared, with its state at hand.
    pub(super) fn worker_start(&mut self, n: usize, slot: usize, attempt: u64, world: usize, source: Option<usize>) {
        let now = self.now;
        let Some(job) = self.job_slot(n, slot) else { return };
        let Some(prepared) = job.prepared.take_if(|p| p.attempt == attempt) else { return };
        let Some(trainer) = job.trainer.take() else { return };
        job.running = Some(Task { attempt, rank: prepared.rank, state: trainer, phase: Phase::Connecting, since: now });
        let at = self.rank_at(n, slot, attempt);
        let mesh = self.meshes.entry(attempt).or_insert_with(|| Mesh {
            ranks: vec![None; world],
            source,
            broken_at: None,
            synced: None,
        });
        if let Some(r) = mesh.ranks.get_mut(prepared.rank) {
            *r = Some(MeshRank { at, entered: None, gone: false });
        }
        trace!(self, "{} starts attempt {attempt} as rank {}", self.rank_name(n, slot), prepared.rank);
        self.enter(at, Op::Connect);
    }

    /// The task enters a collective; the last rank in completes it for everyone.
    fn enter(&mut self, at: RankAt, op: Op) {
        let now = self.now;
        let timeout = match op {
            Op::Connect => self.cfg.connect_timeout_ms,
            Op::Sync | Op::Step(_) => self.cfg.collective_timeout_ms,
        };
        let Some(task) = self.task_mut(at) else { return };
        task.phase = match op {
            Op::Connect => Phase::Connecting,
            Op::Sync => Phase::Syncing,
            Op::Step(s) => Phase::Reducing(s),
        };
        task.since = now;
        let rank = task.rank;
        self.push(now + timeout, Ev::OpTimeout { at, op, since: now });
        let Some(mesh) = self.meshes.get_mut(&at.attempt) else { return };
        if mesh.broken_at.is_some() {
            return self.task_failed(at, "a peer of the data plane is gone");
        }
        if let Some(Some(r)) = mesh.ranks.get_mut(rank) {
            r.entered = Some(op);
        }
        let all_in = mesh.ranks.iter().all(|r| r.is_some_and(|r| !r.gone && r.entered == Some(op)));
        if !all_in {
            return;
        }
        let ranks: Vec<RankAt> = mesh.ranks.iter().flatten().map(|r| r.at).collect();
        for r in mesh.ranks.iter_mut().flatten() {
            r.entered = None;
        }
        let states: Vec<(String, Vec<u64>)> = ranks
            .iter()
            .map(|&r| {
                let state = self.task_mut(r).map(|t| t.state.clone()).unwrap_or_default();
                (self.rank_name(r.node, r.slot as usize), state)
            })
            .collect();
        match op {
            Op::Sync => {
                self.stats.state_copies += 1;
                let mesh = self.meshes.get_mut(&at.attempt).expect("mesh");
                let source = mesh.source.unwrap_or(0);
                mesh.synced = states.get(source).map(|s| s.1.clone());
            }
            Op::Step(step) => self.check.reduced(now, at.attempt, step, &states),
            Op::Connect => {}
        }
        // Each rank receives its last piece on its own connections: the ranks finish in any order, and
        // nothing orders that with the control plane.
        let nodes: Vec<usize> = ranks.iter().map(|r| r.node).collect();
        for r in ranks {
            let done = self.data_latency(&nodes);
            self.push(done, Ev::OpDone { at: r, op });
        }
    }

    pub(super) fn op_done(&mut self, at: RankAt, op: Op) {
        let total = self.sc.steps;
        let Some(task) = self.task_mut(at) else { return };
        let expected = match op {
            Op::Connect => Phase::Connecting,
            Op::Sync => Phase::Syncing,
            Op::Step(s) => Phase::Reducing(s),
        };
        if task.phase != expected {
            return;
        }
        let broken = self.meshes.get(&at.attempt).is_none_or(|m| m.broken_at.is_some());
        if broken {
            return self.task_failed(at, "a peer of the data plane is gone");
        }
        match op {
            Op::Connect if self.meshes[&at.attempt].source.is_some() => self.enter(at, Op::Sync),
            Op::Connect => self.begin_steps(at, total),
            Op::Sync => {
                let synced = self.meshes[&at.attempt].synced.clone().unwrap_or_default();
                if let Some(task) = self.task_mut(at) {
                    task.state = synced;
                }
                self.begin_steps(at, total);
            }
            Op::Step(step) => {
                if let Some(task) = self.task_mut(at) {
                    task.phase = Phase::AwaitCommit(step);
                }
                let vote = ToController::Vote {
                    job: JOB,
                    attempt: at.attempt,
                    slot: at.slot,
                    step,
                    figures: StepFigures::new(4.0 / (step as f64 + 1.0), 1.0),
                    seconds: 0.0,
                };
                trace!(
                    self,
                    "{} votes for step {step} of attempt {}",
                    self.rank_name(at.node, at.slot as usize),
                    at.attempt
                );
                self.report(at.node, vote);
            }
        }
    }

    pub(super) fn op_timeout(&mut self, at: RankAt, op: Op, since: u64) {
        let Some(task) = self.task_mut(at) else { return };
        let waiting = match (op, task.phase) {
            (Op::Connect, Phase::Connecting) | (Op::Sync, Phase::Syncing) => true,
            (Op::Step(s), Phase::Reducing(r)) => s == r,
            _ => false,
        };
        if waiting && task.since == since {
            self.task_failed(at, "a collective timed out");
        }
    }

    fn begin_steps(&mut self, at: RankAt, total: u64) {
        let Some(task) = self.task_mut(at) else { return };
        let step = task.state.len() as u64;
        if step >= total {
            return self.task_end(at, AttemptOutcome::Completed { step, saved: None });
        }
        self.compute(at, step);
    }

    fn compute(&mut self, at: RankAt, step: u64) {
        let ms = self.rng.range(self.sc.step_ms_min, self.sc.step_ms_max) + self.sc.straggle_ms(at.node, self.now);
        let Some(task) = self.task_mut(at) else { return };
        task.phase = Phase::Computing(step);
        self.push(self.now + ms, Ev::Computed { at, step });
    }

    pub(super) fn computed(&mut self, at: RankAt, step: u64) {
        if self.task_mut(at).is_some_and(|t| t.phase == Phase::Computing(step)) {
            self.enter(at, Op::Step(step));
        }
    }

    /// worker.rs `Commit`: reaches the task only if it runs that attempt; the task applies it only while
    /// waiting for it (a commit arriving during compute or a collective is consumed by `wait_abort`).
    pub(super) fn worker_commit(&mut self, n: usize, slot: usize, attempt: u64, step: u64) {
        let at = self.rank_at(n, slot, attempt);
        let total = self.sc.steps;
        let Some(task) = self.task_mut(at) else { return };
        match task.phase {
            Phase::AwaitCommit(s) if s == step => {}
            phase => {
                return trace!(self, "{} discards Commit(step {step}) while {phase:?}", self.rank_name(n, slot));
            }
        }
        let before = task.state.clone();
        self.check.applying(self.now, &self.rank_name(n, slot), attempt, step, &before);
        let Some(task) = self.task_mut(at) else { return };
        task.state.push(step);
        let held = task.state.len() as u64;
        let rank = task.rank;
        self.stats.applied += 1;
        if let (0, Some(every)) = (rank, self.sc.checkpoint_every) {
            if held == total || held.checked_rem(every) == Some(0) {
                let state = self.task_mut(at).map(|t| t.state.clone()).unwrap_or_default();
                self.checkpoints.push(state);
                self.stats.checkpoints += 1;
                let path = format!("/shared/checkpoints/step-{held:08}").into();
                let msg = ToController::Checkpointed { job: JOB, attempt, step: held, path, seconds: 0.0, bytes: 0 };
                self.report(n, msg);
            }
        }
        if held >= total {
            self.task_end(at, AttemptOutcome::Completed { step: held, saved: None });
        } else {
            self.compute(at, step + 1);
        }
    }

    /// worker.rs `Abort`: the task stops (keeping the committed state); a prepared attempt is forgotten.
    pub(super) fn worker_abort(&mut self, n: usize, slot: usize, attempt: u64) {
        let at = self.rank_at(n, slot, attempt);
        if let Some(task) = self.task_mut(at) {
            let step = task.state.len() as u64;
            self.task_end(at, AttemptOutcome::Aborted { step });
        }
        if let Some(job) = self.job_slot(n, slot) {
            job.prepared.take_if(|p| p.attempt == attempt);
        }
    }

    /// worker.rs `AbortAll` (the node was fenced): every attempt stops, keeping the committed state if the
    /// controller still runs the job (`keep`) and dropping it otherwise; nothing prepared or deferred is kept.
    pub(super) fn worker_abort_all(&mut self, n: usize, slot: usize, keep: bool) {
        if !keep {
            return self.worker_drop(n, slot);
        }
        let Some(job) = self.job_slot(n, slot) else { return };
        job.prepared = None;
        job.deferred = None;
        let Some(attempt) = job.running.as_ref().map(|t| t.attempt) else { return };
        self.worker_abort(n, slot, attempt);
    }

    fn task_failed(&mut self, at: RankAt, reason: &str) {
        self.stats.failed_attempts_seen += 1;
        let Some(task) = self.task_mut(at) else { return };
        let step = task.state.len() as u64;
        self.task_end(at, AttemptOutcome::Failed { step, reason: reason.into() });
    }

    /// worker.rs `Returned`: the task gives its committed state back and the worker reports the outcome,
    /// then runs a deferred `Prepare`.
    fn task_end(&mut self, at: RankAt, outcome: AttemptOutcome) {
        let (n, slot) = (at.node, at.slot as usize);
        let Some(job) = self.job_slot(n, slot) else { return };
        let Some(task) = job.running.take() else { return };
        if let AttemptOutcome::Completed { step, .. } = outcome {
            self.check.completed(self.now, at.attempt, n, at.slot, step, task.state.clone());
        }
        let job = self.job_slot(n, slot).expect("slot");
        job.trainer = Some(task.state);
        let deferred = job.deferred.take();
        trace!(self, "{} ends attempt {}: {outcome:?}", self.rank_name(n, slot), at.attempt);
        // worker.rs `train_over`: a completed rank shuts its transport down gracefully — it says goodbye
        // and closes only once every peer finished too — so it breaks no peer's collective (a peer may
        // still be connecting when the attempt has no step left to run).
        let graceful = matches!(outcome, AttemptOutcome::Completed { .. });
        let delay = self.rng.range(self.cfg.net_delay_ms_min, self.cfg.net_delay_ms_max);
        self.leave_mesh(at.attempt, task.rank, (!graceful).then_some(delay));
        self.report(n, ToController::Ended { job: JOB, attempt: at.attempt, slot: at.slot, outcome });
        if let Some(p) = deferred {
            self.prepare(n, slot, p.attempt, p.rank);
        }
    }

    /// worker.rs `Release`: the job's state is dropped; a running task is stopped silently.
    pub(super) fn worker_drop(&mut self, n: usize, slot: usize) {
        let delay = self.rng.range(self.cfg.net_delay_ms_min, self.cfg.net_delay_ms_max);
        self.worker_vanish(n, slot, delay);
    }

    /// The worker's job state is gone (dropped, or with its process); peers of a running task notice
    /// after `notice_ms`.
    pub(super) fn worker_vanish(&mut self, n: usize, slot: usize, notice_ms: u64) {
        let Some(job) = self.nodes[n].workers[slot].job.take() else { return };
        if let Some(task) = job.running {
            trace!(self, "{} drops attempt {}", self.rank_name(n, slot), task.attempt);
            self.leave_mesh(task.attempt, task.rank, Some(notice_ms));
        }
    }

    /// A rank leaves the attempt's mesh; unless it left gracefully (`notice_ms` None), the others notice
    /// after `notice_ms` and the mesh breaks.
    fn leave_mesh(&mut self, attempt: u64, rank: usize, notice_ms: Option<u64>) {
        let Some(mesh) = self.meshes.get_mut(&attempt) else { return };
        if let Some(Some(r)) = mesh.ranks.get_mut(rank) {
            r.gone = true;
        }
        if let (None, Some(notice_ms)) = (mesh.broken_at, notice_ms) {
            self.push(self.now + notice_ms, Ev::MeshBreak { attempt });
        }
    }

    /// Every mesh with a rank on node `n` breaks (the node was unreachable for the idle timeout).
    pub(super) fn break_meshes_of(&mut self, n: usize) {
        let attempts: Vec<u64> = self
            .meshes
            .iter()
            .filter(|(_, m)| m.broken_at.is_none() && m.ranks.iter().flatten().any(|r| r.at.node == n && !r.gone))
            .map(|(&a, _)| a)
            .collect();
        for attempt in attempts {
            self.mesh_break(attempt);
        }
    }

    /// The mesh is broken: every rank waiting in a collective fails (later ones fail on entering).
    pub(super) fn mesh_break(&mut self, attempt: u64) {
        let Some(mesh) = self.meshes.get_mut(&attempt) else { return };
        if mesh.broken_at.is_some() {
            return;
        }
        mesh.broken_at = Some(self.now);
        let ranks: Vec<RankAt> = mesh.ranks.iter().flatten().filter(|r| !r.gone).map(|r| r.at).collect();
        for at in ranks {
            // Through the rank's own queue: a paused rank finds out when it resumes.
            let op = self.task_mut(at).and_then(|t| match t.phase {
                Phase::Connecting => Some(Op::Connect),
                Phase::Syncing => Some(Op::Sync),
                Phase::Reducing(s) => Some(Op::Step(s)),
                Phase::Computing(_) | Phase::AwaitCommit(_) => None,
            });
            if let Some(op) = op {
                self.push(self.now, Ev::OpDone { at, op });
            }
        }
    }
}
