//! Deterministic simulation of a cluster running one job (issue 8), in one thread on virtual time.
//!
//! What is real and what is modelled: the controller's [`Membership`](troupe_cluster::membership::Membership),
//! every node's [`MemberState`](troupe_cluster::membership::MemberState) and the job's
//! [`JobDriver`](troupe_actors::runtime::job::JobDriver) are the runtime's own sans-IO machines. Around
//! them the simulation models, faithfully to actors/src/runtime/{node,worker}.rs, the node actor (its
//! control connection, the epoch in every frame header, fencing, routing to workers), the job controller
//! actor's mailbox, and each worker: its committed state (the list of steps it applied), its attempt task
//! (connect, copy state, then per step compute → all-reduce → vote → wait for `Commit` → apply), and the
//! attempt's data-plane mesh.
//!
//! The network is what QUIC really gives: per connection, messages arrive in order and at most once;
//! the adversary delays them (slow links), cuts nodes off (a partition shorter than the idle timeout only
//! delays; a longer one loses the connection on both sides with what was in flight), resets
//! connections, and crashes, pauses (SIGSTOP), drains and restarts nodes, panics workers and slows
//! their steps. The controller's node is paused too (its side of every connection waits with it, and the
//! members' connections time out), and killed: its daemon restarts from its catalog — the last view and
//! the job as last recorded, both written before anyone heard of them — past the last epoch, restores the
//! job (`JobDriver::restore`) and waits for the members to rejoin. It is cut off too: every control
//! connection has it at one end, so all of them stall, and its ranks' data plane with them. A run is a [`Scenario`] (cluster, job, fault schedule) plus a seed for every timing
//! choice; [`run`] is a pure function of both, and the [`check`] module's invariants are checked as it
//! goes.

pub mod check;
pub mod config;
mod controller;
mod node;
pub mod rng;
pub mod scenario;
pub mod trace;
mod worker;
mod world;

use std::fmt::Write;

use troupe_actors::api::Job;
use troupe_actors::runtime::protocol::JobSpec;

pub use config::{NodeModel, PlantedBug, SimConfig};
pub use scenario::{Fault, NodeSpec, Scenario};
pub use world::{JobEnd, Stats};

/// What a run did and which invariants it broke.
#[derive(Clone, Debug)]
pub struct Outcome {
    pub seed: u64,
    pub scenario: Scenario,
    /// The first [`check::VIOLATIONS_KEPT`] violations, in the order they happened.
    pub violations: Vec<String>,
    pub more_violations: u64,
    pub end: JobEnd,
    pub stats: Stats,
    /// FNV-1a of the whole trace: two runs of one seed must agree.
    pub trace_hash: u64,
    pub trace_lines: u64,
    /// The last lines of the trace (as many as asked for).
    pub trace_tail: Vec<String>,
    /// Virtual time when the run stopped.
    pub end_ms: u64,
}

impl Outcome {
    pub fn ok(&self) -> bool {
        self.violations.is_empty()
    }

    /// Everything needed to understand and replay a failing run.
    pub fn report(&self) -> String {
        let mut s = String::new();
        let _ = writeln!(
            s,
            "seed {} broke {} invariant(s):",
            self.seed,
            self.violations.len() as u64 + self.more_violations
        );
        for v in &self.violations {
            let _ = writeln!(s, "  - {v}");
        }
        if self.more_violations > 0 {
            let _ = writeln!(s, "  - ... and {} more", self.more_violations);
        }
        let _ = writeln!(s, "job end: {:?}; stats: {:?}", self.end, self.stats);
        let _ = writeln!(s, "scenario: {:?}", self.scenario);
        let _ = writeln!(s, "bound: {} ms; run stopped at {} ms", self.scenario.finish_bound_ms(), self.end_ms);
        if !self.trace_tail.is_empty() {
            let _ = writeln!(s, "last {} trace lines (of {}):", self.trace_tail.len(), self.trace_lines);
            for line in &self.trace_tail {
                let _ = writeln!(s, "  {line}");
            }
        }
        let _ = writeln!(
            s,
            "replay: SIM_SEED={} cargo test --release -p troupe-chaos --test simulation replay_one_seed -- --nocapture",
            self.seed
        );
        s
    }
}

/// The job every run trains: gpt-tiny with the scenario's steps, rank cap and checkpoints.
pub fn job_spec(sc: &Scenario) -> JobSpec {
    let mut job = Job::gpt_tiny().name("sim").steps(sc.steps).data_parallel(sc.max_ranks, "none");
    if let Some(every) = sc.checkpoint_every {
        job = job.checkpoints("/shared/checkpoints", every, 0);
    }
    job.into_spec()
}

/// Runs `scenario` with timing drawn from `seed`; keeps the last `keep_lines` trace lines.
pub fn run(seed: u64, scenario: &Scenario, config: &SimConfig, keep_lines: usize) -> Outcome {
    let mut world = world::World::new(seed, scenario, config, keep_lines);
    world.start();
    world.run();
    match world.end {
        JobEnd::Unfinished => {
            let bound = scenario.finish_bound_ms();
            let what = format!(
                "the job did not end by {bound} ms (faults over at {} ms); {} of {} steps committed",
                scenario.heal_ms(),
                world.check.committed_steps(),
                scenario.steps
            );
            world.check.fail(world.now, what);
        }
        JobEnd::Finished { .. } | JobEnd::Failed { .. } => world.check_released(),
    }
    Outcome {
        seed,
        scenario: scenario.clone(),
        more_violations: world.check.more_violations(),
        violations: std::mem::take(&mut world.check.violations),
        end: world.end.clone(),
        stats: world.stats.clone(),
        trace_hash: world.trace.hash(),
        trace_lines: world.trace.lines(),
        end_ms: world.now,
        trace_tail: world.trace.into_tail(),
    }
}

/// The run of `seed`: its random scenario, its timing.
pub fn run_seed(seed: u64, config: &SimConfig, keep_lines: usize) -> Outcome {
    run(seed, &Scenario::random(seed), config, keep_lines)
}
