//! The invariant checker: the simulation reports what happens (god's view: it sees every node at once)
//! and the checker records every broken invariant with the time it broke.
//!
//! Invariants:
//! - **Commits.** The controller commits steps contiguously from 0, each once (one attempt per step),
//!   and reports them in order. With replicated controllers: at most one controller commits a given
//!   step (of an attempt), and a step's `Commit` goes out only once its record is in a majority of the
//!   controllers' stores (checked in `controller.rs`, `commit_announced`; with one controller, in its
//!   catalog).
//! - **No partial update.** A rank applies a step only after the controller committed it (in that
//!   attempt), to a state holding exactly the steps before it — so every rank applies exactly the
//!   committed steps, in order, each once. Every all-reduce sees the same state on every rank.
//! - **Completion.** A finished job's ranks all hold every step; the job ends within the scenario's
//!   bound, and fails only with a reason the scenario allows.
//! - **Epochs.** Each view change bumps the epoch by exactly one, and a restarted controller — or a
//!   controller elected in a take-over — starts past every epoch any controller announced; a node only
//!   ever adopts newer views.
//! - **Fencing.** The controller never accepts a job message sent by an incarnation of a node that has
//!   since been fenced or replaced (only the incarnation admitted into its current view counts).
//! - **Rejoin.** Once the job ended and every fault healed, every node that runs is back in the
//!   controller's view and holds it (checked at the end of the run, `World::check_rejoined`).

use std::collections::{BTreeMap, BTreeSet};

#[derive(Debug, Default)]
pub struct Checker {
    pub violations: Vec<String>,
    view_epoch: u64,
    /// step → the attempt that committed it, on the job's current trajectory (a rollback cuts it).
    committed: BTreeMap<u64, u64>,
    /// Every (step, attempt) ever committed, rolled back or not: a rank cut off before it applied a
    /// commit may still apply it later (the step was committed; the rank's membership is over).
    ever_committed: BTreeSet<(u64, u64)>,
    /// (step, attempt) → the node whose controller committed it.
    committed_by: BTreeMap<(u64, u64), usize>,
    reported_steps: u64,
    /// (node, incarnation) → newest epoch adopted.
    adopted: BTreeMap<(usize, u32), u64>,
    /// The generation each node asked to join with, and the one its current membership was admitted as.
    join_gen: BTreeMap<usize, u32>,
    view_gen: BTreeMap<usize, u32>,
    /// (attempt, node, slot) → the state a rank completed the job with.
    pub completed: BTreeMap<(u64, usize, u32), Vec<u64>>,
    pub applied: u64,
    pub reductions: u64,
    pub accepted: u64,
    more_violations: u64,
    /// (node, generation) already reported as never admitted.
    unadmitted: BTreeSet<(usize, u32)>,
}

/// Violations kept per run (the first ones explain the rest).
pub const VIOLATIONS_KEPT: usize = 20;

/// The state of a rank that applied exactly steps `0..n`.
fn is_prefix(state: &[u64], n: u64) -> bool {
    state.len() as u64 == n && state.iter().enumerate().all(|(i, &s)| s == i as u64)
}

impl Checker {
    pub fn new(first_epoch: u64, nodes: usize) -> Self {
        Checker { view_epoch: first_epoch, view_gen: (0..nodes).map(|n| (n, 0)).collect(), ..Checker::default() }
    }

    pub fn fail(&mut self, now_ms: u64, what: String) {
        if self.violations.len() < VIOLATIONS_KEPT {
            self.violations.push(format!("t={now_ms}ms: {what}"));
        } else {
            self.more_violations += 1;
        }
    }

    /// Violations beyond the first [`VIOLATIONS_KEPT`].
    pub fn more_violations(&self) -> u64 {
        self.more_violations
    }

    pub fn committed_steps(&self) -> u64 {
        self.committed.len() as u64
    }

    pub fn view_changed(&mut self, now_ms: u64, epoch: u64) {
        if epoch != self.view_epoch + 1 {
            self.fail(now_ms, format!("the view went from epoch {} to {epoch}, not by one", self.view_epoch));
        }
        self.view_epoch = epoch;
    }

    /// A controller started at `epoch` on `node`, a member of its own view as `generation`: the
    /// controller's daemon restarted from its catalog, or (replicated controllers) an elected node took
    /// over, its first view committed. Past every epoch any controller announced before.
    pub fn controller_restarted(&mut self, now_ms: u64, node: usize, epoch: u64, generation: u32) {
        if epoch <= self.view_epoch {
            self.fail(
                now_ms,
                format!(
                    "the controller on node {node} started at epoch {epoch}, which was announced already (epochs reached {})",
                    self.view_epoch
                ),
            );
        }
        self.view_epoch = epoch;
        self.view_gen.insert(node, generation);
    }

    pub fn adopted(&mut self, now_ms: u64, node: usize, incarnation: u32, epoch: u64) {
        let last = self.adopted.insert((node, incarnation), epoch);
        if last.is_some_and(|last| last >= epoch) {
            self.fail(now_ms, format!("node {node} adopted epoch {epoch} after epoch {}", last.unwrap_or(0)));
        }
    }

    pub fn join_requested(&mut self, node: usize, generation: u32) {
        self.join_gen.insert(node, generation);
    }

    /// `node` was admitted as a joiner; `current` is the generation it runs now. A joiner is admitted
    /// with no state, so whichever incarnation asked, the one running now is the one admitted (unless it
    /// never asked at all, which the checker cannot tell from a crash between asking and admission).
    pub fn admitted(&mut self, node: usize, current: u32) {
        let asked = self.join_gen.get(&node).copied().unwrap_or(0);
        self.view_gen.insert(node, current.max(asked));
    }

    /// The controller handed a job message of `node` to the job driver.
    pub fn accepted_job_message(&mut self, now_ms: u64, node: usize, generation: u32, what: &str) {
        self.accepted += 1;
        let admitted = self.view_gen.get(&node).copied();
        if admitted != Some(generation) && self.unadmitted.insert((node, generation)) {
            self.fail(
                now_ms,
                format!(
                    "the controller accepted {what} from node {node} generation {generation}, but its view holds generation {admitted:?}: an incarnation it never admitted"
                ),
            );
        }
    }

    /// The driver of the controller on node `by` sent `Commit` for `step` in `attempt`: once per step on
    /// the job's trajectory, and by one controller.
    pub fn commit_sent(&mut self, now_ms: u64, attempt: u64, step: u64, by: usize) {
        if let Some(&other) = self.committed_by.get(&(step, attempt)).filter(|&&o| o != by) {
            self.fail(
                now_ms,
                format!("step {step} of attempt {attempt} committed by two controllers (nodes {other} and {by})"),
            );
        }
        self.committed_by.insert((step, attempt), by);
        match self.committed.get(&step) {
            Some(&a) if a == attempt => {}
            Some(&a) => self.fail(now_ms, format!("step {step} committed twice (attempts {a} and {attempt})")),
            None => {
                if step != self.committed.len() as u64 {
                    self.fail(now_ms, format!("step {step} committed after {} steps", self.committed.len()));
                }
                self.committed.insert(step, attempt);
                self.ever_committed.insert((step, attempt));
            }
        }
    }

    /// A deposed leader announced `step` of `attempt`, committed in its own term (see
    /// `World::commit_announced`): ranks may apply it.
    pub fn late_commit(&mut self, attempt: u64, step: u64) {
        self.ever_committed.insert((step, attempt));
    }

    /// The driver reported `step` committed steps (a `Step` event).
    pub fn step_reported(&mut self, now_ms: u64, step: u64) {
        if step != self.reported_steps + 1 {
            self.fail(now_ms, format!("step event {step} after {}", self.reported_steps));
        }
        self.reported_steps = step;
    }

    pub fn applying(&mut self, now_ms: u64, rank: &str, attempt: u64, step: u64, before: &[u64]) {
        self.applied += 1;
        if !self.ever_committed.contains(&(step, attempt)) {
            self.fail(
                now_ms,
                format!(
                    "{rank} applied step {step} of attempt {attempt}, which the controller had not committed (committed: {:?})",
                    self.committed.get(&step)
                ),
            );
        }
        if !is_prefix(before, step) {
            self.fail(now_ms, format!("{rank} applied step {step} to a state holding steps {before:?}"));
        }
    }

    /// An all-reduce of `step` completed over these ranks' states.
    pub fn reduced(&mut self, now_ms: u64, attempt: u64, step: u64, states: &[(String, Vec<u64>)]) {
        self.reductions += 1;
        for (rank, state) in states {
            if !is_prefix(state, step) {
                self.fail(
                    now_ms,
                    format!("attempt {attempt} all-reduced step {step} with {rank} holding steps {state:?}"),
                );
            }
        }
    }

    pub fn completed(&mut self, now_ms: u64, attempt: u64, node: usize, slot: u32, steps: u64, state: Vec<u64>) {
        if !is_prefix(&state, steps) {
            self.fail(now_ms, format!("node {node} slot {slot} completed attempt {attempt} holding {state:?}"));
        }
        self.completed.insert((attempt, node, slot), state);
    }

    /// Every copy of the state after `to_step` was lost: the job redoes the steps from there.
    pub fn rolled_back(&mut self, to_step: u64) {
        self.committed.retain(|&step, _| step < to_step);
        self.reported_steps = to_step;
    }

    /// The driver resumed the job at `step` (a `Recovered` event). Past the current trajectory — after a
    /// rollback, a node that held a more advanced committed state came back and is the source — every
    /// step before it must have been committed once, and the trajectory continues from those commits.
    pub fn recovered(&mut self, now_ms: u64, step: u64) {
        let current = self.committed.len() as u64;
        if step <= current {
            return;
        }
        for s in current..step {
            match self.ever_committed.iter().rev().find(|(c, _)| *c == s) {
                Some(&(_, attempt)) => {
                    self.committed.insert(s, attempt);
                }
                None => {
                    return self.fail(now_ms, format!("recovered at step {step}, but step {s} was never committed"));
                }
            }
        }
        self.reported_steps = step;
    }

    pub fn is_prefix(state: &[u64], n: u64) -> bool {
        is_prefix(state, n)
    }
}
