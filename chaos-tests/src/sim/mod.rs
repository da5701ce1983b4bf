//! Deterministic simulation of a cluster running one job (issue 8), in one thread on virtual time.
//!
//! What is real and what is modelled: every node runs the runtime's own
//! [`NodeCore`](troupe_actors::runtime::node_core::NodeCore) — its side of membership
//! ([`MemberState`](troupe_cluster::membership::MemberState)), and on the controller the authoritative
//! [`Membership`](troupe_cluster::membership::Membership), fencing, the admission of job messages,
//! routing, and restoring the job from the catalog — and the controller's job controller runs the
//! runtime's own [`JobDriver`](troupe_actors::runtime::job::JobDriver). The simulation is the shell
//! around them, as `NodeActor` and `JobController` are in the daemon: it models only IO — the control
//! connections (the epoch in every frame header, what a closed connection loses, readers and
//! mailboxes), the catalog, the job controller's mailbox and flush, and each worker: its committed
//! state (the list of steps it applied), its attempt task (connect, copy state, then per step compute →
//! all-reduce → vote → wait for `Commit` → apply), and the attempt's data-plane mesh. Architecture
//! Invariant: no decision of the node or the job is written here; a change to node.rs's logic is a
//! change to `NodeCore`, which this simulation then checks.
//!
//! A run starts as a cluster does: the controller alone in epoch 1, the other daemons dialing and
//! joining; the job is submitted through the controller's core once every node joined (or at
//! 3 s), as `troupe train --nodes` waits for its members.
//!
//! The adversary delays control messages (slow links), cuts nodes off (a partition shorter than the idle
//! timeout only delays; a longer one loses the connection on both sides with what was in flight), resets
//! connections (both ends at once, or — the close frame lost — only the node's, the controller's end
//! lingering until it next sends there, its idle timeout, or the node's newer connection replacing it),
//! and crashes, pauses (SIGSTOP), drains and restarts nodes, panics workers and slows their steps. The
//! controller's node is paused too (its side of every connection waits with it, and the members'
//! connections time out), and killed: its daemon restarts from its catalog — the last view and the job as
//! last recorded, both written before anyone heard of them — past the last epoch, restores the job
//! (`JobDriver::restore`) and waits for the members to rejoin. It is cut off too: every control
//! connection has it at one end, so all of them stall, and its ranks' data plane with them.
//!
//! # Replicated controllers (issue 32)
//!
//! A scenario with `controllers = 3` runs nodes 0–2 as controller-eligible (node.toml `controllers`,
//! no `join`) and the others with `join` = node 0, as a cluster of three controllers does. The Raft
//! group is **a model of the guarantees openraft gives, not openraft itself** ([`raft`], whose header
//! lists them: one leader per term, the leader lease, a new leader holding every committed entry, a
//! write answered only once a majority holds it, a deposed leader's writes refused or overwritten, an
//! election once the leader is silent past the timeout). Why not the real thing: openraft 0.9's `Raft`
//! is several tasks — its core loop, a tick task that sleeps in a loop, the state-machine worker, one
//! replication stream per follower, vote requests — spawned through its `AsyncRuntime` and talking over
//! tokio channels (`tokio::select!` in `core/raft_core.rs`), with its election timeouts drawn from a
//! thread-local RNG (`AsyncRuntime::thread_rng`) and async storage and network traits. The trait would
//! let a custom runtime supply virtual time and a seeded RNG, but driving it from this simulation's
//! synchronous event queue needs a deterministic single-threaded executor whose timers are the queue's —
//! more than this change could build and trust. So the runtime is tested against the guarantees it
//! relies on, and openraft itself by actors/tests/raft_group.rs and the chaos scenarios on real
//! processes. What the model leaves out: Raft's messages are not reordered or lost one by one (a round
//! sees the network as it is at that instant: who runs, who is cut off); the heartbeat round is
//! `RaftTiming::heartbeat_ms`; there is no pre-vote (openraft 0.9 has none either: a controller cut off
//! stands in rising terms and, back, deposes the leader — the simulation shows the cost, one more
//! take-over).
//!
//! What is real: every node's `NodeCore` with its `controllers` list, leadership included — the
//! group's watch goes to `NodeCore::on_leadership` and, each tick, `NodeCore::leadership_tick`, which
//! decide to take over (`become_controller` from the state the model's committed log rebuilds), to
//! `step_down` when the group names another or a write is not committed, which leader to `follow`;
//! `Redirect`s, the next controller tried — the same calls node.rs makes ([`replicated`] is that
//! shell: node.rs `on_leadership`, `take_over`, `record_view`; controller.rs `flush`). A view waits for its commit with the node actor blocked (node.rs
//! awaits `propose` in `act`), a job controller's batch with that actor blocked; neither goes out
//! unless committed. Controllers' connections are the same modelled QUIC connections, now with any
//! node at the accepting end (a member dials the leader, or a controller that redirects it).
//!
//! The checker adds, across take-overs: a controller elected starts past every epoch announced (checked
//! when its first view commits), at most one controller commits a step of an attempt, and every `Commit`
//! sent has its record in a majority of the controllers' logs (`PlantedBug::DeposedLeaderAnnounces`
//! breaks that rule to show it is caught). The simulation found, in the runtime: a deposed leader's
//! view change, never committed, was still reported (`NodeCore::step_down` now drops its note); a member
//! trying the list of controllers waited the whole connect timeout (10 s) on one gone for good (now a
//! second, `CANDIDATE_DIAL`); and that a leader paused right after its record of a step committed
//! announces that step after resuming, once a new leader has redone it — harmless (members fence it by
//! epoch; its own workers apply the same bits), counted as `Stats::late_commits`. Not handled by the
//! runtime, so left out of the schedules: a node that is not a controller restarted after node 0 (its
//! only `join`) is gone for good before it was ever admitted into a view knows no controller to
//! dial (one that was keeps the last view's daemons across the restart: `NodeCore::remember`, as
//! node.rs keeps them in the data dir; one never admitted remembers the daemons named in the status it
//! asks with each `Join`, which the simulation keeps too — found by loaded seed 242, a node whose join
//! reached node 0 just before node 0 was cut off and then killed, and which dialed it forever). A
//! job's record committed although its leader heard `NotLeader` (Raft commits it with the next
//! leader's first entry) is announced by no one: the watcher re-watches the new
//! leader, as `JobHandle` does, and gets the job's end from the replicated log
//! (`World::rewatch_end`; tests/simulation.rs, the replicated property, says which seeds found both).
//!
//! # Order and duplicates
//!
//! The network is what QUIC and the control plane (cluster/src/control) give troupe, and the seed
//! reorders whatever they leave unordered:
//! - **One connection** carries each direction on one stream: in order, at most once. QUIC retransmits
//!   within a connection and delivers once; a new connection never carries the old one's data, so
//!   nothing in the transport delivers a message twice.
//! - **Across connections** nothing is ordered. A node dials only once its own end of the old connection
//!   is gone, so a node never has two; the controller may (the node's end was reset, its own lingers).
//!   Each connection has its own reader task, and all of them feed the node actor's one channel: what the
//!   replaced connection's reader had read still reaches the node actor — now and then after the newer
//!   connection's `Connected` (which removes the node from the view), even after its first messages
//!   (`Stats::late_after_replacement`, `Stats::overtaken`). A reader hands over what it read after a
//!   stall drawn from the seed ([`SimConfig::reader_stall_ms_max`]; [`SimConfig::loaded`] for a loaded
//!   machine); a connection's `Lost` comes after what its reader read. Each side's node actor learns of
//!   a new connection a mailbox hop after it is up: until then the controller sends on it what it meant
//!   for the node's old membership, and the node — told by the dialing task, not the event channel —
//!   may hear of the connection's loss first (the core takes only a connection still up since the
//!   simulation showed this: `NodeCore::dialed`).
//! - **Control plane and data plane**, and different peers, have no order between them: each rank
//!   finishes a collective on its own, and votes race commits and the other ranks' traffic. An attempt's
//!   mesh is its own (fresh endpoints, messages matched by tag), so nothing crosses attempts.
//! - **Resends** are the runtime's own: a joiner sends `Join` every heartbeat interval until admitted,
//!   and members heartbeat — so one `Join` may arrive twice, once on each side of a reconnection
//!   (`Stats::join_repeats_across_connections`), and a restarted daemon's old process may still be heard
//!   after its new one dialed. Nothing else is ever resent: `Ready`, votes and commits go once; a
//!   reconnection removes the member and aborts its attempt, and the next attempt has a new number.
//!
//! [`Network::Datagrams`] breaks QUIC's guarantees on purpose (each message delayed on its own, some
//! delivered twice) to show which invariants rest on them; tests/simulation.rs names them.
//!
//! A run is a [`Scenario`] (cluster, job, fault schedule) plus a seed for every timing
//! choice; [`run`] is a pure function of both, and the [`check`] module's invariants are checked as it
//! goes.

pub mod check;
pub mod config;
mod controller;
mod node;
pub mod raft;
mod replicated;
pub mod rng;
pub mod scenario;
pub mod trace;
mod worker;
mod world;

use std::fmt::Write;

use troupe_actors::api::Job;
use troupe_actors::protocol::JobSpec;

pub use config::{Network, PlantedBug, SimConfig};
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
    /// When the job had to have ended ([`SimConfig::finish_bound_ms`]).
    pub bound_ms: u64,
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
        let _ = writeln!(s, "bound: {} ms; run stopped at {} ms", self.bound_ms, self.end_ms);
        if !self.trace_tail.is_empty() {
            let _ = writeln!(s, "last {} trace lines (of {}):", self.trace_tail.len(), self.trace_lines);
            for line in &self.trace_tail {
                let _ = writeln!(s, "  {line}");
            }
        }
        let _ = writeln!(s, "replay: make sim-replay SIM_SEED={} (and the SIM_* settings of this run)", self.seed);
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
    let bound = config.finish_bound_ms(scenario);
    match world.end {
        JobEnd::Unfinished => {
            let what = format!(
                "the job did not end by {bound} ms (faults over at {} ms); {} of {} steps committed",
                scenario.heal_ms(),
                world.check.committed_steps(),
                scenario.steps
            );
            world.check.fail(world.now, what);
        }
        JobEnd::Finished { .. } | JobEnd::Failed { .. } => {
            world.check_released();
            world.check_rejoined();
        }
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
        bound_ms: bound,
        trace_tail: world.trace.into_tail(),
    }
}

/// The run of `seed`: its random scenario, its timing.
pub fn run_seed(seed: u64, config: &SimConfig, keep_lines: usize) -> Outcome {
    run(seed, &Scenario::random(seed), config, keep_lines)
}
