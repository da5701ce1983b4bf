//! The simulated world: every node, the controller, the network and the data-plane meshes, driven by one
//! event queue on virtual time. Events at the same instant run in the order they were scheduled, and
//! every random choice comes from the run's one generator, so a run replays exactly from its seed.

use std::cmp::{Ordering, Reverse};
use std::collections::{BTreeMap, BTreeSet, BinaryHeap, VecDeque};
use std::net::SocketAddr;

use troupe_actors::protocol::{AttemptOutcome, JobEvent, JobId, JobInfo, JobState, MemberInfo, RankSlot, ToNode, Wire};
use troupe_actors::runtime::job::{DriverAction, JobDriver};
use troupe_actors::runtime::node_core::NodeCore;
use troupe_cluster::membership::{NodeId, View};

use super::check::Checker;
use super::config::{Network, SimConfig};
use super::raft::{Proposer, RaftModel, Watch};
use super::rng::Rng;
use super::scenario::Scenario;
use super::trace::Trace;

/// The one job of a run.
pub(super) const JOB: JobId = 1;

/// The job is submitted once every node joined, or at this time at the latest.
pub(super) const SUBMIT_BY_MS: u64 = 3_000;

/// Where the event tie-breakers start (see `World::seq`): room enough both ways.
const SEQ_START: u64 = 1 << 62;

/// A control-plane message with its frame header: the sender's epoch. The rest is not on the wire:
/// `generation` names the sender's incarnation and membership for the checker; `order` counts the
/// messages sent between the node and the controller in that direction (over all connections and
/// incarnations), `via` is the connection it travels on (none: the controller's node to itself), and
/// `copy` marks a second delivery (only a network that breaks QUIC's guarantees makes one).
#[derive(Clone, Debug)]
pub(super) struct Envelope {
    pub epoch: u64,
    pub generation: u32,
    pub order: u64,
    pub via: Option<usize>,
    pub copy: bool,
    pub msg: Wire,
}

impl Envelope {
    pub fn new(epoch: u64, generation: u32, msg: Wire) -> Self {
        Envelope { epoch, generation, order: 0, via: None, copy: false, msg }
    }
}

/// What the controller's node actor hands its job controller actor (`JobMsg`).
#[derive(Debug)]
pub(super) enum JobInput {
    View { view: View, members: Vec<MemberInfo>, changes: Vec<String> },
    Ready { node: usize, attempt: u64, slot: u32, committed: Option<u64> },
    Vote { node: usize, attempt: u64, slot: u32, step: u64 },
    Ended { node: usize, attempt: u64, slot: u32, outcome: AttemptOutcome },
    Checkpointed { attempt: u64, step: u64 },
}

/// What the job controller actor hands back to its node actor (`NodeMsg::Outgoing`, `StepBoundary`,
/// `JobEvent`, `JobInfo`).
#[derive(Debug)]
pub(super) enum FromJob {
    Send { node: NodeId, msg: ToNode },
    StepBoundary,
    Event { event: JobEvent, info: Box<JobInfo> },
    Info(Box<JobInfo>),
}

/// A collective of an attempt's data-plane mesh, in the order every rank runs them.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub(super) enum Op {
    Connect,
    Sync,
    Step(u64),
}

/// One rank's attempt task: which node incarnation, worker incarnation and attempt it belongs to.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub(super) struct RankAt {
    pub node: usize,
    pub inc: u32,
    pub slot: u32,
    pub winc: u32,
    pub attempt: u64,
}

#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub(super) enum Stall {
    Pause,
    Isolate,
}

#[derive(Debug)]
pub(super) enum Ev {
    Tick {
        node: usize,
        inc: u32,
    },
    /// A control message the controller's reader of connection `conn` hands to its node actor; it read
    /// it off the stream at `read_at`.
    Up {
        conn: usize,
        env: Envelope,
        read_at: u64,
    },
    /// A control message reaching the connection's node.
    Down {
        conn: usize,
        env: Envelope,
    },
    /// A node sending to itself (through its own mailbox).
    SelfMsg {
        node: usize,
        env: Envelope,
    },
    /// To node `node`'s job controller of incarnation `jc` (dropped once it stopped).
    ToJob {
        node: usize,
        jc: u32,
        input: JobInput,
    },
    FromJob {
        node: usize,
        out: FromJob,
    },
    /// A worker's report reaching its node actor while that actor waited for a commit.
    FromWorker {
        node: usize,
        inc: u32,
        msg: troupe_actors::protocol::ToController,
    },
    /// Replicated controllers: a heartbeat round of the Raft group, a leader's replication a round trip
    /// after a proposal, a proposal decided, a controller's leadership watch changed, and a job
    /// controller telling its node that a write was not committed (`NodeMsg::NotCommitted`).
    RaftTick,
    RaftReplicate {
        node: usize,
    },
    Decided {
        node: usize,
        inc: u32,
        by: Proposer,
        result: Result<(), String>,
    },
    Leadership {
        node: usize,
        inc: u32,
        watch: Watch,
    },
    NotCommitted {
        node: usize,
        inc: u32,
        why: String,
    },
    ConnLost {
        conn: usize,
        at_ctrl: bool,
    },
    /// A dialed connection was admitted at both ends; the node actor on one side now handles its
    /// `Connected` (the controller's node actor, of incarnation `inc`; or the dialing node's).
    Connected {
        conn: usize,
        at_ctrl: bool,
        inc: u32,
    },
    /// The node said goodbye: the controller's side closes without a `Lost`.
    ConnDeparted {
        conn: usize,
    },
    DialDone {
        node: usize,
        inc: u32,
        server: usize,
        ok: bool,
        seq: u64,
    },
    Computed {
        at: RankAt,
        step: u64,
    },
    OpDone {
        at: RankAt,
        op: Op,
    },
    OpTimeout {
        at: RankAt,
        op: Op,
        since: u64,
    },
    MeshBreak {
        attempt: u64,
    },
    Fault(usize),
    /// A client submits the job to the controller.
    Submit,
    Restart {
        node: usize,
    },
    Resume {
        node: usize,
        inc: u32,
    },
    StallCheck {
        node: usize,
        inc: u32,
        stall: Stall,
        since: u64,
    },
}

#[derive(Debug)]
pub(super) struct Item {
    pub at: u64,
    seq: u64,
    pub ev: Ev,
}

impl PartialEq for Item {
    fn eq(&self, other: &Self) -> bool {
        (self.at, self.seq) == (other.at, other.seq)
    }
}
impl Eq for Item {}
impl PartialOrd for Item {
    fn partial_cmp(&self, other: &Self) -> Option<Ordering> {
        Some(self.cmp(other))
    }
}
impl Ord for Item {
    fn cmp(&self, other: &Self) -> Ordering {
        (self.at, self.seq).cmp(&(other.at, other.seq))
    }
}

/// One control connection between a node (one incarnation) and the node it dialed as its controller
/// (`server`: the controller, or with replicated controllers any controller-eligible node).
#[derive(Debug)]
pub(super) struct Conn {
    pub node: usize,
    pub inc: u32,
    pub server: usize,
    pub open_node: bool,
    /// The controller's side is open: it sends on it, and it is the node's connection there.
    pub open_ctrl: bool,
    /// The controller's side stopped reading at this time: what its reader read before is still handed
    /// to the node actor (after a replacement, or before the `Lost` that ends it), the rest is lost.
    pub reads_until: Option<u64>,
    /// The node's end was reset while its process lives on: its endpoint answers what still arrives on
    /// the connection with a stateless reset.
    pub reset_by_node: bool,
    /// FIFO clocks: the latest arrival scheduled in each direction (the stream's order), and the latest
    /// hand-over by the controller's reader (after which its `Lost` or `Departed` comes).
    arrived_up: u64,
    pub last_up: u64,
    last_down: u64,
}

/// What an attempt's task holds while it runs (the worker's trainer moved into it).
#[derive(Debug)]
pub(super) struct Task {
    pub attempt: u64,
    pub rank: usize,
    pub state: Vec<u64>,
    pub phase: Phase,
    /// When the current collective was entered (to tell a stale timeout).
    pub since: u64,
}

#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub(super) enum Phase {
    Connecting,
    Syncing,
    Computing(u64),
    Reducing(u64),
    AwaitCommit(u64),
}

#[derive(Clone, Copy, Debug)]
pub(super) struct Prepared {
    pub attempt: u64,
    pub rank: usize,
}

/// A worker's slot for the job (worker.rs `JobSlot`); the model's trainer is the list of steps applied.
#[derive(Debug, Default)]
pub(super) struct JobSlot {
    pub trainer: Option<Vec<u64>>,
    pub prepared: Option<Prepared>,
    pub running: Option<Task>,
    pub deferred: Option<Prepared>,
}

#[derive(Debug, Default)]
pub(super) struct Worker {
    /// Incarnation: bumped when the node restarts the worker.
    pub winc: u32,
    pub job: Option<JobSlot>,
}

#[derive(Debug)]
pub(super) struct Node {
    pub id: NodeId,
    pub slots: u32,
    pub up: bool,
    pub inc: u32,
    /// Bumped on every fence and every new incarnation (the checker's name for "this membership").
    pub generation: u32,
    pub paused_until: Option<u64>,
    /// The pause outlasted the idle timeout: its connections are gone when it resumes.
    pub pause_broke: bool,
    pub held: Vec<Item>,
    /// The runtime's node: everything it decides (node.rs's `NodeCore`).
    pub core: NodeCore,
    pub conn: Option<usize>,
    /// This node's side of each node's current connection to it (as the controller, or a controller
    /// that answers with a redirect).
    pub served: Vec<Option<usize>>,
    pub workers: Vec<Worker>,
    /// The job controller this node runs while it is the controller.
    pub job: JobCtl,
    /// Replicated controllers: the node actor waits for a view's commit (node.rs `record_view` awaits
    /// `propose`); what reaches the actor meanwhile waits here, in order.
    pub busy: bool,
    pub busy_held: Vec<Item>,
    /// Elected: the epoch of the first view, checked once it is committed.
    pub took_over_at: Option<u64>,
    /// The epoch of the view the node actor waits to see committed.
    pub pending_view: Option<u64>,
    /// Replicated controllers: the daemons of the last view this node knew, which node.rs keeps in
    /// the data dir (raft::known) and hands to a restarted core (`NodeCore::remember`).
    pub known: Vec<MemberInfo>,
    /// The dials in flight, by server, each with its number (node.rs keeps their tasks to abort them
    /// on `CancelDial`); a dial's end that is not here was given up and reaches nothing.
    pub dials: BTreeMap<usize, u64>,
    /// Numbers the dials.
    pub dial_seq: u64,
}

/// A node's JobController actor around the runtime's own `JobDriver` (controller.rs).
#[derive(Debug)]
pub(super) struct JobCtl {
    /// Bumped each time a job controller starts or stops: messages for an earlier one are dropped.
    pub jc: u32,
    pub started: bool,
    pub driver: JobDriver,
    /// The job's state as the node last heard it (`NodeMsg::JobInfo`).
    pub told: Option<(JobState, u64, u64)>,
    /// The attempt and state last recorded (controller.rs `recorded`).
    pub recorded: Option<(u64, JobState)>,
    /// A batch waiting for its record's commit (replicated controllers), and the messages that
    /// reached the actor meanwhile.
    pub waiting_batch: Option<Vec<DriverAction>>,
    pub waiting: VecDeque<JobInput>,
    /// A write was not committed: nothing more goes out (controller.rs `stopped`).
    pub stopped: bool,
    /// Why the write was not committed (what `pre_start` fails with, for the job's first record).
    pub not_committed: Option<String>,
    /// The job controller's `pre_start` awaits its first record's commit, and its node actor with it.
    pub starting: bool,
}

/// What the controllers share: the job's submission, the attempts prepared, the single controller's
/// catalog — or, replicated, the Raft group whose state machine is the catalog.
#[derive(Debug)]
pub(super) struct Controller {
    /// The job was submitted.
    pub submitted: bool,
    /// The ranks each attempt was prepared on (read off the driver's `Prepare`s).
    pub attempt_ranks: BTreeMap<u64, Vec<RankSlot>>,
    /// Steps the planted bug committed early, per attempt.
    pub early: BTreeSet<(u64, u64)>,
    /// What the controller's daemon wrote to its catalog (redb, durable) — all a restart finds (one
    /// controller).
    pub catalog: Catalog,
    /// Replicated controllers (nodes `0..k`): the Raft group.
    pub raft: Option<RaftModel>,
}

/// The controller's catalog (actors/src/daemon/catalog.rs), modelled: the last view, recorded before
/// anyone hears of it (node.rs), and the job as last recorded — before any batch of the job controller's
/// messages and events goes out (controller.rs `flush`).
#[derive(Debug)]
pub(super) struct Catalog {
    pub view_epoch: u64,
    pub view_members: Vec<NodeId>,
    /// The nodes the controller that recorded the view still waited for (`StoredView::expecting`).
    pub view_expecting: Vec<String>,
    pub job: Option<JobInfo>,
}

/// An attempt's data plane: the ranks that started, and the collective each waits in.
#[derive(Debug)]
pub(super) struct Mesh {
    pub ranks: Vec<Option<MeshRank>>,
    pub source: Option<usize>,
    pub broken_at: Option<u64>,
    /// What the source rank held when the state copy completed.
    pub synced: Option<Vec<u64>>,
}

#[derive(Clone, Copy, Debug)]
pub(super) struct MeshRank {
    pub at: RankAt,
    pub entered: Option<Op>,
    pub gone: bool,
}

#[derive(Clone, Debug, Default, PartialEq, Eq)]
pub struct Stats {
    /// View changes after the job was submitted (the cluster forming before is not counted).
    pub view_changes: u64,
    pub attempts: u64,
    pub committed_steps: u64,
    pub applied: u64,
    /// Job messages refused: from non-members (answered with `Fenced`), or sent by an earlier membership
    /// of a member.
    pub refused_stale: u64,
    /// Controller messages a node refused for carrying an older epoch than its own.
    pub node_refused_stale: u64,
    pub fences: u64,
    /// Messages lost: sent while not connected, or in flight on a connection that closed.
    pub lost_messages: u64,
    pub dials: u64,
    pub failed_attempts_seen: u64,
    /// Attempts that copied the state of one rank to the others before training.
    pub state_copies: u64,
    pub rollbacks: u64,
    pub checkpoints: u64,
    /// The controller's daemon came back from its catalog after a kill.
    pub controller_restarts: u64,
    /// Replicated controllers: elections held, and controllers that took over (became the controller
    /// after another had been), and stepped down.
    pub elections: u64,
    pub takeovers: u64,
    pub step_downs: u64,
    /// Commits a deposed leader announced late (their record committed in its term before the new
    /// leader's).
    pub late_commits: u64,
    /// Messages of a replaced connection that its reader handed to the controller's node actor after the
    /// newer connection was admitted.
    pub late_after_replacement: u64,
    /// Messages delivered after one sent later between the same two nodes (under QUIC only across
    /// connections: a replaced connection's late ones).
    pub overtaken: u64,
    /// `Join`s the controller received again from an incarnation it had one from (a joiner resends every
    /// heartbeat interval until admitted), and of those, the ones that came on another connection.
    pub join_repeats: u64,
    pub join_repeats_across_connections: u64,
    /// Second copies delivered (only a network that breaks QUIC's guarantees makes them).
    pub duplicates: u64,
}

/// How the job ended.
#[derive(Clone, Debug, PartialEq)]
pub enum JobEnd {
    Finished { at_ms: u64 },
    Failed { at_ms: u64, reason: String },
    Unfinished,
}

pub(super) struct World<'a> {
    pub cfg: &'a SimConfig,
    pub sc: &'a Scenario,
    pub now: u64,
    queue: BinaryHeap<Reverse<Item>>,
    /// Tie-breakers among events due at one instant: `push` counts up from `SEQ_START`, `push_ahead`
    /// down from it.
    seq: u64,
    ahead: u64,
    pub rng: Rng,
    pub nodes: Vec<Node>,
    pub index: BTreeMap<NodeId, usize>,
    pub conns: Vec<Conn>,
    /// FIFO clocks of the in-process hops: node→job, job→node, controller node→itself.
    local_last: [u64; 3],
    /// Per (node, server) pair: the `order` of the next message the node sends the server and of the
    /// next the server sends it, and the highest of each delivered so far.
    pub order_next: Vec<[u64; 2]>,
    pub order_seen: Vec<[Option<u64>; 2]>,
    /// (node, incarnation) of every `Join` received, with the connection of the first.
    pub joins: BTreeMap<(usize, Option<u64>), Option<usize>>,
    pub ctl: Controller,
    /// The node and membership (generation) whose control message the controller's node handles now.
    pub delivering: Option<(usize, u32)>,
    pub meshes: BTreeMap<u64, Mesh>,
    /// Durable checkpoints on storage every node shares, oldest first (the state each holds).
    pub checkpoints: Vec<Vec<u64>>,
    pub check: Checker,
    pub trace: Trace,
    pub stats: Stats,
    pub end: JobEnd,
}

#[derive(Clone, Copy, Debug)]
pub(super) enum Local {
    NodeToJob = 0,
    JobToNode = 1,
    ToSelf = 2,
}

/// A fake address: the model has no sockets, but `MemberInfo` and `Ready` carry one.
pub(super) fn addr(node: usize, slot: u32) -> SocketAddr {
    SocketAddr::from(([10, 0, 0, node as u8 + 1], 7000 + slot as u16))
}

/// Formats a trace line only when it is kept or hashed (always: the hash covers every line).
macro_rules! trace {
    ($w:expr, $($arg:tt)*) => {
        $w.trace.log($w.now, format_args!($($arg)*))
    };
}
pub(super) use trace;

impl JobCtl {
    pub fn new(driver: JobDriver) -> Self {
        JobCtl {
            jc: 0,
            started: false,
            driver,
            told: None,
            recorded: None,
            waiting_batch: None,
            waiting: VecDeque::new(),
            stopped: false,
            not_committed: None,
            starting: false,
        }
    }
}

impl<'a> World<'a> {
    /// Every node's daemon starting at t=0: the controller alone in epoch 1, the others about to join.
    pub fn new(seed: u64, sc: &'a Scenario, cfg: &'a SimConfig, keep_lines: usize) -> Self {
        let ids: Vec<NodeId> = sc.nodes.iter().map(|n| n.name.clone()).collect();
        let index = ids.iter().cloned().enumerate().map(|(i, n)| (n, i)).collect();
        let job_spec = super::job_spec(sc);
        let mut world = World {
            cfg,
            sc,
            now: 0,
            queue: BinaryHeap::new(),
            seq: SEQ_START,
            ahead: SEQ_START,
            rng: Rng::new(seed),
            nodes: Vec::new(),
            index,
            conns: Vec::new(),
            local_last: [0; 3],
            order_next: vec![[0; 2]; sc.nodes.len() * sc.nodes.len()],
            order_seen: vec![[None; 2]; sc.nodes.len() * sc.nodes.len()],
            joins: BTreeMap::new(),
            ctl: Controller {
                submitted: false,
                attempt_ranks: BTreeMap::new(),
                early: BTreeSet::new(),
                catalog: Catalog { view_epoch: 0, view_members: Vec::new(), view_expecting: Vec::new(), job: None },
                raft: None,
            },
            delivering: None,
            meshes: BTreeMap::new(),
            checkpoints: Vec::new(),
            check: Checker::new(if sc.controllers > 1 { 0 } else { 1 }, sc.nodes.len()),
            trace: Trace::new(keep_lines),
            stats: Stats::default(),
            end: JobEnd::Unfinished,
        };
        for (n, spec) in sc.nodes.iter().enumerate() {
            let core = super::node::new_core(&world, n, 0, None, Vec::new());
            world.nodes.push(Node {
                id: spec.name.clone(),
                slots: spec.slots,
                up: true,
                inc: 0,
                generation: 0,
                paused_until: None,
                pause_broke: false,
                held: Vec::new(),
                core,
                conn: None,
                served: vec![None; sc.nodes.len()],
                workers: (0..spec.slots).map(|_| Worker::default()).collect(),
                job: JobCtl::new(JobDriver::new(JOB, job_spec.clone())),
                busy: false,
                busy_held: Vec::new(),
                took_over_at: None,
                pending_view: None,
                known: Vec::new(),
                dials: BTreeMap::new(),
                dial_seq: 0,
            });
        }
        if sc.controllers > 1 {
            world.ctl.raft = Some(RaftModel::new(sc.controllers, cfg.raft, &mut world.rng));
        }
        world
    }

    pub fn push(&mut self, at: u64, ev: Ev) {
        self.seq += 1;
        self.queue.push(Reverse(Item { at, seq: self.seq, ev }));
    }

    /// Schedules `events` now, in their order, ahead of everything else due now: what waited for a
    /// paused process was due before what is due at the instant it resumes.
    pub fn push_ahead(&mut self, events: Vec<Ev>) {
        self.ahead -= events.len() as u64;
        for (i, ev) in events.into_iter().enumerate() {
            self.queue.push(Reverse(Item { at: self.now, seq: self.ahead + i as u64, ev }));
        }
    }

    /// The cluster at t=0: the controller records its first view, every node's timer starts (the
    /// others dial and join), and the job is submitted once they joined.
    pub fn start(&mut self) {
        self.act(0);
        for n in 0..self.nodes.len() {
            let phase = self.rng.below(self.cfg.tick_ms);
            self.push(phase, Ev::Tick { node: n, inc: 0 });
        }
        for (i, f) in self.sc.faults.iter().enumerate() {
            self.push(f.at_ms(), Ev::Fault(i));
        }
        self.push(SUBMIT_BY_MS, Ev::Submit);
        if self.ctl.raft.is_some() {
            self.push(0, Ev::RaftTick);
        }
    }

    /// Runs until the job ended and the tail passed, or the scenario's bound.
    pub fn run(&mut self) {
        let bound = self.cfg.finish_bound_ms(self.sc);
        while let Some(Reverse(item)) = self.queue.pop() {
            let ended_at = match self.end {
                JobEnd::Finished { at_ms } | JobEnd::Failed { at_ms, .. } => Some(at_ms),
                JobEnd::Unfinished => None,
            };
            let stop = match ended_at {
                Some(t) => (t + self.cfg.tail_ms).max(self.sc.heal_ms() + self.cfg.tail_ms),
                None => bound,
            };
            if item.at > stop {
                self.now = stop;
                break;
            }
            self.now = item.at;
            self.dispatch(item);
        }
    }

    /// The node whose process must be running for the event to happen (paused: it waits; crashed or
    /// replaced: it is gone).
    fn target(&self, ev: &Ev) -> Option<(usize, u32)> {
        let current = |n: usize| Some((n, self.nodes[n].inc));
        match ev {
            Ev::Tick { node, inc }
            | Ev::DialDone { node, inc, .. }
            | Ev::Decided { node, inc, .. }
            | Ev::Leadership { node, inc, .. }
            | Ev::NotCommitted { node, inc, .. }
            | Ev::FromWorker { node, inc, .. } => Some((*node, *inc)),
            Ev::Down { conn, .. }
            | Ev::ConnLost { conn, at_ctrl: false }
            | Ev::Connected { conn, at_ctrl: false, .. } => Some((self.conns[*conn].node, self.conns[*conn].inc)),
            Ev::Connected { conn, at_ctrl: true, inc } => Some((self.conns[*conn].server, *inc)),
            Ev::Computed { at, .. } | Ev::OpDone { at, .. } | Ev::OpTimeout { at, .. } => Some((at.node, at.inc)),
            // The server's side of a connection runs in its process: it waits while that one is paused.
            Ev::Up { conn, .. } | Ev::ConnLost { conn, at_ctrl: true } | Ev::ConnDeparted { conn } => {
                current(self.conns[*conn].server)
            }
            Ev::SelfMsg { node, .. } | Ev::ToJob { node, .. } | Ev::FromJob { node, .. } => current(*node),
            _ => None,
        }
    }

    /// The node whose node actor handles the event: it waits while that actor awaits a commit.
    fn actor(&self, ev: &Ev) -> Option<usize> {
        match ev {
            Ev::Tick { node, .. }
            | Ev::DialDone { node, .. }
            | Ev::Leadership { node, .. }
            | Ev::NotCommitted { node, .. }
            | Ev::FromWorker { node, .. }
            | Ev::SelfMsg { node, .. }
            | Ev::FromJob { node, .. } => Some(*node),
            Ev::Down { conn, .. }
            | Ev::ConnLost { conn, at_ctrl: false }
            | Ev::Connected { conn, at_ctrl: false, .. } => Some(self.conns[*conn].node),
            Ev::Up { conn, .. } | Ev::ConnLost { conn, at_ctrl: true } | Ev::Connected { conn, at_ctrl: true, .. } => {
                Some(self.conns[*conn].server)
            }
            _ => None,
        }
    }

    fn dispatch(&mut self, item: Item) {
        if let Some((n, inc)) = self.target(&item.ev) {
            let node = &mut self.nodes[n];
            if !node.up || node.inc != inc {
                if matches!(item.ev, Ev::Down { .. }) {
                    self.stats.lost_messages += 1;
                }
                return;
            }
            if node.paused_until.is_some() {
                node.held.push(item);
                return;
            }
        }
        if let Some(n) = self.actor(&item.ev).filter(|&n| self.nodes[n].busy) {
            self.nodes[n].busy_held.push(item);
            return;
        }
        match item.ev {
            Ev::Tick { node, .. } => self.tick(node),
            Ev::Up { conn, env, read_at } => self.deliver_up(conn, env, read_at),
            Ev::Down { conn, env } => self.deliver_down(conn, env),
            Ev::SelfMsg { node, env } => self.deliver_self(node, env),
            Ev::ToJob { node, jc, input } => self.job_handle(node, jc, input),
            Ev::FromJob { node, out } => self.job_output(node, out),
            Ev::FromWorker { node, msg, .. } => self.send_to_controller(node, msg),
            Ev::ConnLost { conn, at_ctrl } => self.conn_lost(conn, at_ctrl),
            Ev::Connected { conn, at_ctrl, .. } => self.connected(conn, at_ctrl),
            Ev::ConnDeparted { conn } => {
                let c = &mut self.conns[conn];
                c.open_ctrl = false;
                c.reads_until = None;
                let (node, server) = (c.node, c.server);
                if self.nodes[server].served[node] == Some(conn) {
                    self.nodes[server].served[node] = None;
                }
            }
            Ev::DialDone { node, server, ok, seq, .. } => self.dial_done(node, server, ok, seq),
            Ev::Computed { at, step } => self.computed(at, step),
            Ev::OpDone { at, op } => self.op_done(at, op),
            Ev::OpTimeout { at, op, since } => self.op_timeout(at, op, since),
            Ev::MeshBreak { attempt } => self.mesh_break(attempt),
            Ev::Fault(i) => self.fault(i),
            Ev::Submit => self.submit(),
            Ev::Restart { node } => self.restart(node),
            Ev::Resume { node, inc } => self.resume(node, inc),
            Ev::StallCheck { node, inc, stall, since } => self.stall_check(node, inc, stall, since),
            Ev::RaftTick => self.raft_tick(),
            Ev::RaftReplicate { node } => self.raft_replicate(node),
            Ev::Decided { node, by, result, .. } => self.decided(node, by, result),
            Ev::Leadership { node, watch, .. } => self.on_leadership(node, watch),
            Ev::NotCommitted { node, why, .. } => self.not_committed(node, &why),
        }
    }

    /// Holds `ev` for node `n`'s actor, which waits for a commit (see [`Node::busy`]).
    pub fn hold_for_actor(&mut self, n: usize, ev: Ev) {
        self.seq += 1;
        let item = Item { at: self.now, seq: self.seq, ev };
        self.nodes[n].busy_held.push(item);
    }

    /// Node `n`'s actor is free again: what waited for it runs now, in order, before anything else.
    pub fn release_actor(&mut self, n: usize) {
        self.nodes[n].busy = false;
        let held = std::mem::take(&mut self.nodes[n].busy_held).into_iter().map(|item| item.ev).collect();
        self.push_ahead(held);
    }

    // ---- the network ----

    /// A new control connection of node `n`'s current incarnation to `server`, open on both sides.
    pub fn open_conn(&mut self, n: usize, server: usize) -> usize {
        let conn = self.conns.len();
        self.conns.push(Conn {
            node: n,
            inc: self.nodes[n].inc,
            server,
            open_node: true,
            open_ctrl: true,
            reads_until: None,
            reset_by_node: false,
            arrived_up: self.now,
            last_up: self.now,
            last_down: self.now,
        });
        self.nodes[server].served[n] = Some(conn);
        conn
    }

    fn net_delay(&mut self) -> u64 {
        self.rng.range(self.cfg.net_delay_ms_min, self.cfg.net_delay_ms_max)
    }

    /// Sends on a connection: in order, once, unless the connection closes first. A message sent while
    /// the node is cut off waits for the partition to heal (QUIC retransmits). The controller's reader
    /// hands what it read to the node actor in order, now and then after a stall; the node's reader
    /// never competes with another connection of the same peer (a node dials only once its connection
    /// is gone), so its stalls change nothing and are not drawn. [`Network::Datagrams`] gives up the
    /// order and sends some messages twice.
    pub fn net_send(&mut self, conn: usize, up: bool, mut env: Envelope) {
        let c = &self.conns[conn];
        let open = if up { c.open_node } else { c.open_ctrl && c.reads_until.is_none() };
        if !open {
            self.stats.lost_messages += 1;
            return;
        }
        let (node, server) = (c.node, c.server);
        let dir = usize::from(!up);
        let pair = node * self.nodes.len() + server;
        env.order = self.order_next[pair][dir];
        self.order_next[pair][dir] += 1;
        env.via = Some(conn);
        let cut = self.sc.cut_until(node, server, self.now);
        let sent = cut.unwrap_or(self.now) + self.sc.slow_link_ms(node, self.now);
        let fifo = self.cfg.network == Network::Quic;
        let copy = match self.cfg.network {
            Network::Quic => None,
            Network::Datagrams { duplicate_per_mille, .. } => {
                self.rng.chance(duplicate_per_mille).then(|| Envelope { copy: true, ..env.clone() })
            }
        };
        for env in std::iter::once(env).chain(copy) {
            let arrive = sent + self.net_delay() + self.datagram_spread();
            let stall = if up { self.reader_stall() } else { 0 };
            let c = &mut self.conns[conn];
            if up {
                let read_at = if fifo { arrive.max(c.arrived_up) } else { arrive };
                let at = if fifo { (read_at + stall).max(c.last_up) } else { read_at + stall };
                c.arrived_up = c.arrived_up.max(read_at);
                c.last_up = c.last_up.max(at);
                self.push(at, Ev::Up { conn, env, read_at });
            } else {
                let at = if fifo { arrive.max(c.last_down) } else { arrive };
                c.last_down = c.last_down.max(at);
                self.push(at, Ev::Down { conn, env });
            }
        }
    }

    /// The extra delay of one message on a network without QUIC's order.
    fn datagram_spread(&mut self) -> u64 {
        match self.cfg.network {
            Network::Quic => 0,
            Network::Datagrams { spread_ms, .. } => self.rng.range(0, spread_ms),
        }
    }

    /// How long the controller's reader of a connection waits before handing over what it just read.
    fn reader_stall(&mut self) -> u64 {
        if self.rng.chance(self.cfg.reader_stall_per_mille) {
            self.rng.range(1, self.cfg.reader_stall_ms_max)
        } else {
            0
        }
    }

    /// A control message between node `node` and the controller is delivered: counts second copies, and
    /// messages that overtook an earlier one in the same direction.
    pub fn count_delivery(&mut self, node: usize, up: bool, env: &Envelope) {
        if env.copy {
            self.stats.duplicates += 1;
            let what = super::node::kind(&env.msg);
            return trace!(self, "a second copy of {what} (node {node}, order {}) is delivered", env.order);
        }
        let server = env.via.map_or(node, |c| self.conns[c].server);
        let seen = &mut self.order_seen[node * self.nodes.len() + server][usize::from(!up)];
        if seen.is_some_and(|s| s > env.order) {
            self.stats.overtaken += 1;
            let last = seen.unwrap_or(0);
            trace!(
                self,
                "{} ({} {node}, order {}) arrives after order {last}, sent later",
                super::node::kind(&env.msg),
                if up { "from" } else { "to" },
                env.order
            );
        } else {
            *seen = Some(env.order);
        }
    }

    /// A hop between actors of one process: FIFO per hop, a small delay.
    pub fn local(&mut self, link: Local, ev: Ev) {
        let at = (self.now + self.rng.range(0, self.cfg.local_delay_ms_max)).max(self.local_last[link as usize]);
        self.local_last[link as usize] = at;
        self.push(at, ev);
    }

    /// Data-plane latency between ranks, after any partition between them heals.
    pub fn data_latency(&mut self, nodes: &[usize]) -> u64 {
        let mut start = self.now;
        for &n in nodes {
            if let Some(until) = self.sc.isolated_until(n, self.now) {
                start = start.max(until);
            }
            if let Some(until) = self.nodes[n].paused_until {
                start = start.max(until);
            }
        }
        start + self.net_delay()
    }
}
