//! The job controller's logic, sans-IO: the attempt and commit protocol of one job. The
//! [`super::controller::JobController`] actor feeds it and carries out its actions.
//!
//! An *attempt* is one run of the job on a fixed set of ranks at one membership epoch:
//! `Prepare` → every rank answers `Ready` (data-plane address, committed step) → `Start` (the roster,
//! and the rank whose state the others copy) → per step, every rank votes after its all-reduce → the
//! controller sends `Commit` → ranks apply the update. A membership change that touches the ranks aborts
//! the attempt and starts a new one on the new ranks from the last committed step: nothing is applied
//! half-way, so the run continues on the fault-free trajectory.

use std::collections::{BTreeMap, BTreeSet, VecDeque};
use std::net::SocketAddr;
use std::time::Duration;

use troupe_cluster::membership::{NodeId, View};
use troupe_cluster::transport::quic::PeerInfo;
use troupe_model::optim::learning_rate;
use troupe_model::periodic::PeriodicSync;

use crate::protocol::{
    rank_coords, slot_device, AttemptOutcome, EvalFigures, GradientPlane, JobEvent, JobId, JobInfo, JobSpec, JobState,
    MemberInfo, RankInfo, RankSlot, RankState, RankUsage, SlotDevice, StageTime, StepFigures, ToNode,
};

/// Attempts in a row that fail without committing a step before the job is declared failed.
pub const FAILED_ATTEMPTS_MAX: u32 = 5;

/// How long a restarted controller's job waits for the nodes of the last view to rejoin before it resumes
/// without the missing ones. Members notice the old controller's death by QUIC's idle timeout (2 s by
/// default), dial the new one and rejoin within a heartbeat or two of reaching it.
pub const RESUME_GRACE: Duration = Duration::from_secs(10);

#[derive(Clone, Debug, PartialEq)]
pub enum DriverAction {
    Send {
        node: NodeId,
        msg: ToNode,
    },
    Event(JobEvent),
    /// A step committed: pending joiners may be admitted now.
    StepBoundary,
}

#[derive(Debug)]
enum Phase {
    /// Not enough ranks (or not started).
    Idle,
    Preparing {
        ranks: Vec<RankSlot>,
        ready: Vec<Option<(SocketAddr, Option<u64>)>>,
    },
    Running {
        ranks: Vec<RankSlot>,
        /// Each rank's figures of the step in flight.
        votes: Vec<Option<StepFigures>>,
        ended: Vec<Option<AttemptOutcome>>,
    },
    Done,
}

#[derive(Debug)]
pub struct JobDriver {
    id: JobId,
    spec: JobSpec,
    state: JobState,
    committed: u64,
    attempt: u64,
    epoch: u64,
    phase: Phase,
    last_loss: Option<f64>,
    /// The newest step whose validation loss was reported (0: none): an attempt that starts at an
    /// evaluation step evaluates it again (the one that computed it may have lost a rank first), and
    /// only the first report of a step becomes an event. Lowered by a rollback, after which the steps
    /// past the checkpoint are computed, and evaluated, again.
    evaluated: u64,
    failed_attempts: u32,
    /// Set by a rank's `StateLost`: states of this step or later are incomplete; told to every rank of
    /// the next attempts until a step commits.
    discard_from: Option<u64>,
    reason: Option<String>,
    /// When the last step committed (or the attempt started): step time is wall time between commits.
    last_commit_at: Duration,
    /// The committed step the running attempt started from: until it commits past it, its ranks are
    /// still starting or recovering.
    attempt_from: u64,
    /// Below `elastic.min_nodes`: since when (first seen by [`JobDriver::on_tick`]; None until then).
    waiting: Option<Option<Duration>>,
    /// Every node ever asked to prepare an attempt: each may hold the job's state (a rank that became a
    /// spare keeps it), so each is told to release it when the job ends.
    prepared_nodes: BTreeSet<NodeId>,
    /// The newest view and its members' info.
    view: Option<(View, Vec<MemberInfo>)>,
    /// The most advanced committed step each slot may hold for this job: what it said in its last
    /// `Ready`, raised to every step committed while it is a rank (an upper bound: a commit may not reach
    /// it, and a node that restarted since holds nothing). A rank that became a spare keeps its state
    /// (a fenced node keeps the state of the jobs the controller still runs), and may be ahead of the
    /// ranks after a rollback that happened while it was away.
    held: BTreeMap<RankSlot, u64>,
    /// A restarted controller's job, until it resumes.
    resume: Option<Resume>,
    /// Restored by a restarted controller: which nodes the old one prepared is not recorded, so every
    /// member of every view seen since counts as prepared (each may hold the job's state — a spare of
    /// the old controller's last attempts, not in its last recorded view — and is released at the end).
    restored: bool,
    /// A restarted controller's job until its first attempt starts: the last recorded commit may have
    /// reached no rank that survived (the controller died between recording it and sending it).
    commit_maybe_undelivered: bool,
    /// The tensor degree of the running (or next) attempt: `parallel.tp`, or a smaller one after a loss
    /// left no whole tensor group ([`JobDriver::plan_degree`]).
    tp: usize,
    /// What each rank of the running attempt held and sent in a step, by rank, once its
    /// [`JobEvent::Usage`] was told (empty before, and for engines that do not count it).
    usage: Vec<RankUsage>,
    /// Where the running (or last) attempt sums its gradients, and why (`crate::plan::plane`).
    plane: (GradientPlane, String),
    /// A rank's NCCL could not start (`plane::nccl_unusable`): why. The job's later attempts take the
    /// host plane rather than fail the same way until the retries run out.
    nccl_unusable: Option<String>,
    actions: VecDeque<DriverAction>,
}

/// What a restarted controller's job waits for: the nodes of the last view before the restart (their
/// workers hold the committed state; resuming without one would leave its part of a sharded state behind,
/// or have it re-join a step later and abort the first attempt).
#[derive(Debug)]
struct Resume {
    expect: Vec<NodeId>,
    /// When the wait began (the first tick).
    since: Option<Duration>,
    /// The newest view.
    view: Option<(View, Vec<MemberInfo>)>,
}

/// The ranks a view offers a job: each member's slots, members in node-id order, at most `max_nodes`
/// members (0: all) and at most `max_ranks` slots (0: all), their number a multiple of `stages` (a
/// pipeline job's world is whole pipelines; none when fewer slots than stages). Under any cap, members
/// and slots that are ranks `now` keep their place and only the rest is filled in node-id order: spares
/// wait, and a joiner never displaces a running rank (which may hold the only copy of the committed
/// state); a pipeline job keeps a running rank of every stage before a second of any. Ranks are numbered
/// in node-id order either way.
pub fn plan_ranks(
    view: &View,
    members: &[MemberInfo],
    max_nodes: usize,
    max_ranks: usize,
    stages: usize,
    now: &[RankSlot],
) -> Vec<RankSlot> {
    let mut nodes: Vec<&NodeId> = view.members().iter().collect();
    if max_nodes != 0 && nodes.len() > max_nodes {
        let (kept, spare): (Vec<&NodeId>, Vec<&NodeId>) =
            nodes.into_iter().partition(|n| now.iter().any(|r| &r.node == *n));
        nodes = kept.into_iter().chain(spare).take(max_nodes).collect();
        nodes.sort();
    }
    let mut slots = Vec::new();
    for node in nodes {
        let count = members.iter().find(|m| m.name == node.0).map_or(1, |m| m.slots);
        slots.extend((0..count).map(|slot| RankSlot { node: node.clone(), slot }));
    }
    let capped = if max_ranks == 0 { slots.len() } else { max_ranks.min(slots.len()) };
    let take = capped / stages.max(1) * stages.max(1);
    if slots.len() == take {
        return slots;
    }
    let (mut kept, spare): (Vec<RankSlot>, Vec<RankSlot>) = slots.into_iter().partition(|s| now.contains(s));
    if stages > 1 {
        // Rank r of a pipeline job of D = |now| / stages replicas runs stage r div D and holds that
        // stage's state: keep one running rank of every stage first, so no stage's only surviving copy
        // becomes a spare.
        let replicas = (now.len() / stages).max(1);
        let stage_of = |s: &RankSlot| now.iter().position(|n| n == s).map(|i| (i / replicas).min(stages - 1));
        let mut covered = vec![false; stages];
        let (first, rest): (Vec<RankSlot>, Vec<RankSlot>) = kept.into_iter().partition(|s| match stage_of(s) {
            Some(stage) if !covered[stage] => {
                covered[stage] = true;
                true
            }
            _ => false,
        });
        kept = first.into_iter().chain(rest).collect();
    }
    let mut ranks: Vec<RankSlot> = kept.into_iter().chain(spare).take(take).collect();
    ranks.sort();
    ranks
}

/// A tensor-parallel job's ranks (`wanted`, from [`plan_ranks`]) re-picked so that every tensor group —
/// `tp` consecutive ranks — shares a node, its collectives on the node's shared memory as the planner
/// places them: whole groups of slots of the same nodes, in node-id order, as many ranks as before.
/// `wanted` as it was when those nodes cannot hold that many whole groups.
fn tensor_groups_within_nodes(members: &[MemberInfo], wanted: Vec<RankSlot>, tp: usize) -> Vec<RankSlot> {
    if tp <= 1 || wanted.is_empty() {
        return wanted;
    }
    let mut nodes: Vec<&NodeId> = wanted.iter().map(|r| &r.node).collect();
    nodes.dedup();
    let mut picked = Vec::with_capacity(wanted.len());
    for node in nodes {
        let slots = members.iter().find(|m| m.name == node.0).map_or(1, |m| m.slots as usize);
        let whole = (slots / tp * tp).min(wanted.len() - picked.len());
        picked.extend((0..whole / tp * tp).map(|slot| RankSlot { node: node.clone(), slot: slot as u32 }));
    }
    if picked.len() < wanted.len() {
        return wanted;
    }
    picked
}

impl JobDriver {
    pub fn new(id: JobId, spec: JobSpec) -> Self {
        let tp = spec.config.parallel.tp.max(1);
        JobDriver {
            id,
            spec,
            state: JobState::Waiting,
            committed: 0,
            attempt: 0,
            epoch: 0,
            phase: Phase::Idle,
            last_loss: None,
            evaluated: 0,
            failed_attempts: 0,
            discard_from: None,
            reason: None,
            last_commit_at: Duration::ZERO,
            attempt_from: 0,
            waiting: None,
            prepared_nodes: BTreeSet::new(),
            view: None,
            held: BTreeMap::new(),
            resume: None,
            restored: false,
            commit_maybe_undelivered: false,
            tp,
            usage: Vec::new(),
            plane: (GradientPlane::Host, String::new()),
            nccl_unusable: None,
            actions: VecDeque::new(),
        }
    }

    /// A job the controller recorded before it restarted, as last recorded (`info`; written before any
    /// step commit or attempt it announced, so no rank is ahead of it by more than a commit's delivery).
    /// It waits — at most [`RESUME_GRACE`] — for `expect`, the nodes of the last view, to rejoin, then
    /// resumes from the most advanced step its ranks hold, on attempt numbers past any the old controller
    /// used. A terminal job stays as it ended.
    pub fn restore(id: JobId, spec: JobSpec, info: &JobInfo, expect: Vec<NodeId>) -> Self {
        let mut d = Self::new(id, spec);
        d.committed = info.step;
        d.attempt = info.attempts;
        d.epoch = info.epoch;
        d.last_loss = info.last_loss;
        d.reason.clone_from(&info.reason);
        if info.state.is_terminal() {
            d.state = info.state;
            d.phase = Phase::Done;
        } else {
            d.prepared_nodes = expect.iter().cloned().collect();
            d.restored = true;
            d.resume = Some(Resume { expect, since: None, view: None });
            d.commit_maybe_undelivered = info.step > 0;
        }
        d
    }

    pub fn info(&self) -> JobInfo {
        JobInfo {
            id: self.id,
            name: self.spec.name.clone(),
            state: self.state,
            step: self.committed,
            total_steps: self.spec.config.train.steps,
            epoch: self.epoch,
            world: self.ranks().len(),
            attempts: self.attempt,
            events: 0,
            last_loss: self.last_loss,
            reason: self.reason.clone(),
            ranks: self.rank_infos(),
            data_plane: self.spec.data_plane,
            plane: self.plane.0,
            plane_reason: self.plane.1.clone(),
        }
    }

    /// What each slot does for the job: the attempt's ranks in rank order (with their stage and replica),
    /// then the view's other slots (spares, or all waiting while the job waits for nodes).
    fn rank_infos(&self) -> Vec<RankInfo> {
        if self.state.is_terminal() {
            return Vec::new();
        }
        let ranks = self.ranks();
        // The planner's order: rank = t + tp·(d + replicas·p).
        let (pp, tp) = (self.spec.config.parallel.pp.max(1), self.tp.max(1));
        let replicas = (ranks.len() / (pp * tp)).max(1);
        let state = match (&self.phase, self.committed > self.attempt_from, self.attempt) {
            (Phase::Running { .. }, true, _) => RankState::Training,
            (_, _, 1) => RankState::Starting,
            _ => RankState::Recovering,
        };
        let info = |slot: &RankSlot, rank: Option<usize>, state| RankInfo {
            node: slot.node.0.clone(),
            slot: slot.slot,
            rank,
            stage: rank.filter(|_| pp > 1).map(|r| rank_coords(r, tp, replicas).2.min(pp - 1)),
            tensor: rank.filter(|_| tp > 1).map(|r| rank_coords(r, tp, replicas).0),
            replica: rank.map(|r| rank_coords(r, tp, replicas).1),
            state,
            step: self.held.get(slot).copied(),
            memory_bytes: rank.and_then(|r| self.usage.get(r)).map(RankUsage::memory_bytes),
            sent_bytes_per_step: rank.and_then(|r| self.usage.get(r)).map(RankUsage::sent_bytes),
        };
        let mut infos: Vec<RankInfo> = ranks.iter().enumerate().map(|(r, slot)| info(slot, Some(r), state)).collect();
        if let Some((view, members)) = &self.view {
            let others = if ranks.is_empty() { RankState::Waiting } else { RankState::Spare };
            for slot in plan_ranks(view, members, 0, 0, 1, &[]).iter().filter(|s| !ranks.contains(s)) {
                infos.push(info(slot, None, others));
            }
        }
        infos
    }

    /// The cap on ranks: `parallel.dp` (0 is no cap) replicas of `parallel.pp` stages of
    /// `parallel.tp` ranks each.
    fn max_ranks(&self) -> usize {
        let parallel = &self.spec.config.parallel;
        parallel.dp * parallel.pp * parallel.tp.max(1)
    }

    /// The world is whole model replicas: a multiple of `parallel.pp` × `parallel.tp` ranks.
    fn replica_ranks(&self) -> usize {
        let parallel = &self.spec.config.parallel;
        parallel.pp.max(1) * parallel.tp.max(1)
    }

    pub fn poll_action(&mut self) -> Option<DriverAction> {
        self.actions.pop_front()
    }

    fn ranks(&self) -> &[RankSlot] {
        match &self.phase {
            Phase::Preparing { ranks, .. } | Phase::Running { ranks, .. } => ranks,
            Phase::Idle | Phase::Done => &[],
        }
    }

    fn nodes(ranks: &[RankSlot]) -> Vec<NodeId> {
        let mut nodes: Vec<NodeId> = ranks.iter().map(|r| r.node.clone()).collect();
        nodes.dedup();
        nodes
    }

    fn send_all(&mut self, ranks: &[RankSlot], msg: &ToNode) {
        for node in Self::nodes(ranks) {
            self.actions.push_back(DriverAction::Send { node, msg: msg.clone() });
        }
    }

    /// A new view. Re-plans when the ranks it offers differ from the running attempt's, or when a spare
    /// of the view may hold a later committed step than the job's (a former rank back after the job
    /// rolled back without it): the next attempt includes that spare rather than redo the steps it holds.
    pub fn on_view(&mut self, view: &View, members: &[MemberInfo], changes: Vec<String>) {
        if self.state.is_terminal() {
            return;
        }
        self.epoch = view.epoch.0;
        self.view = Some((view.clone(), members.to_vec()));
        if self.restored {
            self.prepared_nodes.extend(view.members().iter().cloned());
        }
        if let Some(resume) = &mut self.resume {
            resume.view = Some((view.clone(), members.to_vec()));
            if resume.expect.iter().all(|n| view.contains(n)) {
                self.resume_now();
            }
            return;
        }
        let (mut wanted, degree) = self.plan_degree(view, members);
        let mut changes = changes;
        if degree != self.tp {
            changes.push(crate::engine::degree_change(&self.spec.config, self.tp, degree));
        }
        let same_degree = degree == self.tp;
        self.tp = degree;
        if !matches!(self.phase, Phase::Idle) && wanted == self.ranks() && same_degree {
            match self.ranks_with_a_more_advanced_spare(self.committed, &wanted) {
                Some(better) => wanted = better,
                None => return,
            }
        }
        if !matches!(self.phase, Phase::Idle) {
            self.actions.push_back(DriverAction::Event(JobEvent::Membership {
                epoch: self.epoch,
                world: wanted.len(),
                changes,
            }));
            let survivors: Vec<RankSlot> = self.ranks().iter().filter(|r| view.contains(&r.node)).cloned().collect();
            self.abort(&survivors, "membership changed");
        }
        self.start_attempt(wanted);
    }

    /// The ranks of the next attempt on `view` and its tensor degree: at `parallel.tp` when the view
    /// holds a whole tensor group; after a loss (an attempt ran) that left none, at the largest smaller
    /// degree the model splits into that the slots hold (`tensor_parallel::degrees_to_try`). The
    /// survivors of a lost group hold the whole committed state (each rank's shard and its buddy copy of
    /// the previous rank's, put together among them) and that attempt goes on from it; when two
    /// neighbouring ranks were lost they keep nothing, and it starts from the newest checkpoint.
    fn plan_degree(&self, view: &View, members: &[MemberInfo]) -> (Vec<RankSlot>, usize) {
        let (max_nodes, parallel) = (self.spec.config.elastic.max_nodes, &self.spec.config.parallel);
        let mut planned = (Vec::new(), parallel.tp.max(1));
        for tp in crate::engine::degrees_to_try(&self.spec.config) {
            let (max_ranks, stages) = (parallel.dp * parallel.pp * tp, parallel.pp.max(1) * tp);
            let wanted = plan_ranks(view, members, max_nodes, max_ranks, stages, self.ranks());
            planned = (tensor_groups_within_nodes(members, wanted, tp), tp);
            if !planned.0.is_empty() || self.attempt == 0 {
                break;
            }
        }
        planned
    }

    /// A restored job resumes on the newest view: every expected node rejoined, or the grace is over.
    fn resume_now(&mut self) {
        let Some(Resume { expect, view: Some((view, members)), .. }) = self.resume.take() else { return };
        let mut changes = vec![format!("the controller restarted; resuming after step {}", self.committed)];
        let missing: Vec<&str> = expect.iter().filter(|n| !view.contains(n)).map(|n| n.0.as_str()).collect();
        if !missing.is_empty() {
            changes.push(format!("{} did not rejoin within {} s", missing.join(", "), RESUME_GRACE.as_secs()));
        }
        let (max_nodes, stages) = (self.spec.config.elastic.max_nodes, self.replica_ranks());
        let world = plan_ranks(&view, &members, max_nodes, self.max_ranks(), stages, &[]).len();
        self.actions.push_back(DriverAction::Event(JobEvent::Membership { epoch: view.epoch.0, world, changes }));
        self.on_view(&view, &members, Vec::new());
    }

    fn abort(&mut self, ranks: &[RankSlot], reason: &str) {
        let msg = ToNode::Abort { job: self.id, attempt: self.attempt, reason: reason.into() };
        self.send_all(ranks, &msg);
        self.phase = Phase::Idle;
    }

    fn start_attempt(&mut self, ranks: Vec<RankSlot>) {
        let (nodes, elastic) = (Self::nodes(&ranks).len(), &self.spec.config.elastic);
        if ranks.is_empty() || nodes < elastic.min_nodes {
            if self.waiting.is_none() {
                self.waiting = Some(None);
                let event = JobEvent::Waiting { nodes, min_nodes: elastic.min_nodes, wait_s: elastic.wait_s };
                self.actions.push_back(DriverAction::Event(event));
            }
            self.state = JobState::Waiting;
            self.phase = Phase::Idle;
            return;
        }
        self.waiting = None;
        self.attempt += 1;
        let mut spec = self.spec.clone();
        spec.config.parallel.tp = self.tp;
        let msg = ToNode::Prepare {
            job: self.id,
            attempt: self.attempt,
            spec: Box::new(spec),
            ranks: ranks.clone(),
            discard_from: self.discard_from,
        };
        self.send_all(&ranks, &msg);
        self.prepared_nodes.extend(Self::nodes(&ranks));
        self.phase = Phase::Preparing { ready: vec![None; ranks.len()], ranks };
    }

    /// The passage of time: a job below `elastic.min_nodes` for longer than `elastic.wait_s` fails.
    /// A restored job resumes once [`RESUME_GRACE`] has passed, whoever rejoined.
    pub fn on_tick(&mut self, now: Duration) {
        if let Some(resume) = &mut self.resume {
            let since = *resume.since.get_or_insert(now);
            if now.saturating_sub(since) >= RESUME_GRACE {
                self.resume_now();
            }
            return;
        }
        let Some(since) = &mut self.waiting else { return };
        if self.state.is_terminal() {
            return;
        }
        let since = *since.get_or_insert(now);
        let elastic = &self.spec.config.elastic;
        if elastic.wait_s > 0 && now.saturating_sub(since) >= Duration::from_secs(elastic.wait_s) {
            let (need, waited, pp) = (elastic.min_nodes, elastic.wait_s, self.spec.config.parallel.pp);
            let pipelines = if pp > 1 {
                format!(" (or fewer than the parallel.pp = {pp} slots of one pipeline)")
            } else {
                String::new()
            };
            self.fail(format!(
                "fewer than elastic.min_nodes = {need} nodes offered ranks{pipelines} for elastic.wait_s = {waited} s; \
                 add nodes, lower elastic.min_nodes, or raise elastic.wait_s (0 waits forever)"
            ));
        }
    }

    /// When the ranks of an attempt hold at most `best`, short of the committed step: the ranks of an
    /// attempt that includes the spares of the view (slots outside `ranks`) that may hold the most
    /// advanced state above `best` — not one of a step a `StateLost` made every rank drop. None when
    /// no spare may hold more, and for jobs whose ranks hold parts of the state (ZeRO shards, pipeline
    /// stages): one spare's part of a step is no use without the others', and the attempt would end in
    /// `StateLost`. A restored job knows nothing of what the old controller's spares held: a spare it
    /// has not heard from may hold the last recorded step (its `Ready` in the attempt tells).
    fn ranks_with_a_more_advanced_spare(&self, best: u64, ranks: &[RankSlot]) -> Option<Vec<RankSlot>> {
        let parallel = &self.spec.config.parallel;
        if parallel.pp > 1 || parallel.shard != "none" {
            return None;
        }
        let (view, members) = self.view.as_ref()?;
        let every_slot = plan_ranks(view, members, 0, 0, 1, &[]);
        let spares: Vec<RankSlot> = every_slot.into_iter().filter(|s| !ranks.contains(s)).collect();
        let may_hold = |s: &RankSlot| {
            let unknown = self.restored.then_some(self.committed);
            let held = self.held.get(s).copied().or(unknown);
            held.filter(|&h| h > best && self.discard_from.is_none_or(|from| h < from))
        };
        let most = spares.iter().filter_map(may_hold).max()?;
        let holders: Vec<RankSlot> = spares.into_iter().filter(|s| may_hold(s) == Some(most)).collect();
        let planned = plan_ranks(view, members, self.spec.config.elastic.max_nodes, self.max_ranks(), 1, &holders);
        planned.iter().any(|r| holders.contains(r)).then_some(planned)
    }

    fn rank_of(&self, node: &NodeId, slot: u32) -> Option<usize> {
        self.ranks().iter().position(|r| &r.node == node && r.slot == slot)
    }

    pub fn on_ready(
        &mut self,
        now: Duration,
        node: &NodeId,
        attempt: u64,
        slot: u32,
        addr: SocketAddr,
        committed: Option<u64>,
    ) {
        if attempt != self.attempt {
            return;
        }
        let Some(rank) = self.rank_of(node, slot) else { return };
        let Phase::Preparing { ranks, ready } = &mut self.phase else { return };
        ready[rank] = Some((addr, committed));
        self.held.insert(RankSlot { node: node.clone(), slot }, committed.unwrap_or(0));
        if ready.iter().any(Option::is_none) {
            return;
        }
        let ranks = std::mem::take(ranks);
        let ready: Vec<(SocketAddr, Option<u64>)> = ready.iter().map(|r| r.expect("all ready")).collect();
        let best = ready.iter().map(|r| r.1.unwrap_or(0)).max().unwrap_or(0);
        if best < self.committed {
            if let Some(better) = self.ranks_with_a_more_advanced_spare(best, &ranks) {
                // Rather than roll back (or fail for want of a checkpoint), ask the spares that may hold
                // more: the next attempt includes them, and their `Ready` says what they hold.
                self.abort(&ranks, "a spare may hold a more advanced state");
                return self.start_attempt(better);
            }
        }
        // After a controller restart, ranks one step behind its record did vote for that step but never
        // heard its `Commit`: they redo it (the same bits), which is a rollback by one step, not a loss.
        let undelivered = std::mem::take(&mut self.commit_maybe_undelivered) && best + 1 == self.committed;
        // A periodically synchronizing job's ranks keep the state of their last synchronization: rolling
        // back to it is the defined end of an interval that lost a rank, not a loss.
        let steps = self.spec.config.train.steps;
        let redo_interval = PeriodicSync::of(&self.spec.config.parallel)
            .is_some_and(|sync| best >= sync.last_sync(self.committed, steps));
        if best < self.committed {
            if self.spec.config.checkpoint.dir.is_none() && !undelivered && !redo_interval {
                return self.fail(format!(
                    "the state of step {} was lost with the nodes that held it (the ranks left have step {best}) and the job has no checkpoint.dir to fall back on",
                    self.committed
                ));
            }
            let event = JobEvent::RolledBack { from_step: self.committed, to_step: best };
            self.actions.push_back(DriverAction::Event(event));
            self.evaluated = self.evaluated.min(best);
        }
        let all_equal = ready.iter().all(|r| r.1 == Some(best));
        let source = (!all_equal).then(|| ready.iter().position(|r| r.1.unwrap_or(0) == best).unwrap_or(0));
        let roster =
            ranks.iter().zip(&ready).map(|(r, (addr, _))| PeerInfo { name: r.node.0.clone(), addr: *addr }).collect();
        let (plane, plane_reason) = self.choose_plane(&ranks, &ready);
        self.plane = (plane, plane_reason.clone());
        let msg = ToNode::Start { job: self.id, attempt: self.attempt, roster, source, plane };
        self.send_all(&ranks, &msg);
        for r in &ranks {
            self.held.insert(r.clone(), best);
        }
        self.committed = best;
        self.attempt_from = best;
        self.state = JobState::Running;
        self.last_commit_at = now;
        let (world, epoch, step) = (ranks.len(), self.epoch, self.committed);
        let event = if self.attempt == 1 {
            let (attempt, data_plane) = (self.attempt, self.spec.data_plane);
            JobEvent::Started { world, epoch, from_step: step, attempt, data_plane, plane, plane_reason }
        } else {
            JobEvent::Recovered { step, epoch, world }
        };
        self.actions.push_back(DriverAction::Event(event));
        let (tp, pp) = (self.tp.max(1), self.spec.config.parallel.pp.max(1));
        if tp > 1 || pp > 1 {
            let (attempt, dp, ranks) = (self.attempt, world / (tp * pp), ranks.clone());
            self.actions.push_back(DriverAction::Event(JobEvent::Placed { attempt, tp, pp, dp, ranks }));
        }
        self.phase = Phase::Running { votes: vec![None; world], ended: vec![None; world], ranks };
        self.usage.clear();
    }

    /// A rank's vote for `step`: its loss and gradient norm (identical on every rank after the
    /// all-reduce; rank 0's are reported).
    #[allow(clippy::too_many_arguments)]
    /// A rank's vote for `step`: (loss, gradient norm, peak RSS bytes of its process).
    pub fn on_vote(&mut self, now: Duration, node: &NodeId, attempt: u64, slot: u32, step: u64, vote: StepFigures) {
        if attempt != self.attempt || step != self.committed {
            return;
        }
        let Some(rank) = self.rank_of(node, slot) else { return };
        let Phase::Running { ranks, votes, .. } = &mut self.phase else { return };
        votes[rank] = Some(vote);
        if votes.iter().any(Option::is_none) {
            return;
        }
        let StepFigures { loss, grad_norm, skipped, loss_scale, .. } = votes[0].clone().expect("all voted");
        let stage_times: Vec<_> = votes.iter().map(|v| v.as_ref().and_then(|v| v.stage_time)).collect();
        let usage: Option<Vec<RankUsage>> = votes.iter_mut().map(|v| v.as_mut().and_then(|v| v.usage.take())).collect();
        let bubble = StageTime::bubble(&stage_times);
        let peaks: Option<Vec<f64>> = votes.iter().map(|v| v.as_ref().and_then(|v| v.peak_flops)).collect();
        let peak_rss_bytes: Vec<u64> = votes.iter_mut().map(|v| v.take().map_or(0, |v| v.peak_rss_bytes)).collect();
        let seconds = now.saturating_sub(self.last_commit_at).as_secs_f64();
        self.last_commit_at = now;
        let ranks = ranks.clone();
        let train = &self.spec.config.train;
        let lr = learning_rate(train, step);
        let tokens = (train.global_batch * self.spec.config.model.context) as f64;
        let tokens_per_s = tokens / seconds.max(1e-9);
        // DESIGN.md's MFU convention: training ≈ 3 × the forward's FLOPs per token.
        let model_flops = tokens_per_s * 3.0 * self.spec.config.model.forward_flops_per_token();
        let mfu = peaks.map(|p| p.iter().sum::<f64>()).filter(|p| *p > 0.0).map(|peak| model_flops / peak);
        self.send_all(&ranks, &ToNode::Commit { job: self.id, attempt, step, lr_hint: lr });
        self.committed = step + 1;
        for r in &ranks {
            self.held.insert(r.clone(), self.committed);
        }
        self.last_loss = Some(loss);
        self.failed_attempts = 0;
        self.discard_from = None;
        self.actions.push_back(DriverAction::Event(JobEvent::Step {
            step: step + 1,
            loss,
            lr,
            grad_norm,
            skipped,
            loss_scale,
            tokens_per_s,
            epoch: self.epoch,
            world: ranks.len(),
            peak_rss_bytes,
            bubble,
            mfu,
        }));
        // Once per attempt: its second step, the first that runs as every later one does (a first step
        // may skip a gather: ZeRO's parameters are fresh), or its first when that ends the job.
        let (nth, last) = (self.committed - self.attempt_from, self.committed >= self.spec.config.train.steps);
        if let (Some(ranks), true) = (usage, nth == 2 || (nth == 1 && last)) {
            self.usage.clone_from(&ranks);
            self.actions.push_back(DriverAction::Event(JobEvent::Usage { attempt, step: step + 1, ranks }));
        }
        if self.committed < self.spec.config.train.steps {
            self.actions.push_back(DriverAction::StepBoundary);
        }
    }

    /// The attempt's plane (`crate::plan::plane`) from what each rank's slot computes on, as its member
    /// announced it, and the host of its data-plane address.
    fn choose_plane(&self, ranks: &[RankSlot], ready: &[(SocketAddr, Option<u64>)]) -> (GradientPlane, String) {
        use crate::plan::plane::{choose, RankDevice};
        let members = self.view.as_ref().map_or(&[][..], |(_, m)| m.as_slice());
        let cpu = SlotDevice::Cpu;
        let ranks: Vec<RankDevice> = ranks
            .iter()
            .zip(ready)
            .map(|(r, (addr, _))| RankDevice {
                node: &r.node.0,
                slot: r.slot,
                host: addr.ip(),
                device: members.iter().find(|m| m.name == r.node.0).map_or(&cpu, |m| slot_device(&m.devices, r.slot)),
            })
            .collect();
        match (choose(&self.spec.config, &ranks), &self.nccl_unusable) {
            ((GradientPlane::Nccl, _), Some(why)) => {
                (GradientPlane::Host, format!("NCCL failed to start in an earlier attempt ({why})"))
            }
            (chosen, _) => chosen,
        }
    }

    /// A rank failed the attempt: abort it everywhere and start the next, up to the limit.
    fn retry(&mut self, rank: usize, reason: &str) {
        self.failed_attempts += 1;
        if self.failed_attempts >= FAILED_ATTEMPTS_MAX {
            return self.fail(format!("{FAILED_ATTEMPTS_MAX} attempts in a row failed; last: {reason}"));
        }
        let ranks = self.ranks().to_vec();
        self.abort(&ranks, &format!("rank {rank} failed: {reason}"));
        self.start_attempt(ranks);
    }

    pub fn on_ended(&mut self, node: &NodeId, attempt: u64, slot: u32, outcome: AttemptOutcome) {
        if attempt != self.attempt || self.state.is_terminal() {
            return;
        }
        let Some(rank) = self.rank_of(node, slot) else { return };
        match outcome {
            AttemptOutcome::Aborted { .. } => {}
            AttemptOutcome::Failed { reason, .. } => {
                if self.plane.0 == GradientPlane::Nccl && crate::plan::plane::nccl_unusable(&reason) {
                    self.nccl_unusable.get_or_insert_with(|| format!("rank {rank}: {reason}"));
                }
                self.retry(rank, &reason)
            }
            AttemptOutcome::StateLost { step, reason } => {
                // Every rank reaches the same verdict, but a rank aborted before it would keep its
                // partial state: the next attempts tell every rank to drop it.
                self.discard_from = Some(self.discard_from.map_or(step, |d| d.min(step)));
                self.retry(rank, &reason);
            }
            done @ AttemptOutcome::Completed { .. } => {
                let Phase::Running { ended, .. } = &mut self.phase else { return };
                ended[rank] = Some(done);
                if ended.iter().any(Option::is_none) {
                    return;
                }
                let saved: Vec<_> = ended
                    .iter()
                    .filter_map(|e| match e {
                        Some(AttemptOutcome::Completed { saved: Some(path), .. }) => Some(path.clone()),
                        _ => None,
                    })
                    .collect();
                for path in saved {
                    self.actions.push_back(DriverAction::Event(JobEvent::Saved { path }));
                }
                self.finish(
                    JobState::Finished,
                    JobEvent::Finished { steps: self.committed, final_loss: self.last_loss },
                );
            }
        }
    }

    /// Rank 0 committed a durable checkpoint.
    pub fn on_checkpoint(&mut self, attempt: u64, step: u64, path: std::path::PathBuf, seconds: f64, bytes: u64) {
        if attempt == self.attempt && !self.state.is_terminal() {
            self.actions.push_back(DriverAction::Event(JobEvent::Checkpoint { step, path, seconds, bytes }));
        }
    }

    /// Rank 0 evaluated the validation loss of the model after `step` committed steps: reported once
    /// per step (see `evaluated`).
    pub fn on_eval(&mut self, attempt: u64, step: u64, figures: EvalFigures) {
        if attempt != self.attempt || self.state.is_terminal() || step <= self.evaluated {
            return;
        }
        self.evaluated = step;
        let EvalFigures { loss, windows, tokens } = figures;
        let event = JobEvent::Eval { step, loss, perplexity: loss.exp(), windows, tokens };
        self.actions.push_back(DriverAction::Event(event));
    }

    pub fn cancel(&mut self) {
        if !self.state.is_terminal() {
            self.finish(JobState::Cancelled, JobEvent::Cancelled);
        }
    }

    fn fail(&mut self, reason: String) {
        self.reason = Some(reason.clone());
        self.finish(JobState::Failed, JobEvent::Failed { reason });
    }

    fn finish(&mut self, state: JobState, event: JobEvent) {
        for node in std::mem::take(&mut self.prepared_nodes) {
            self.actions.push_back(DriverAction::Send { node, msg: ToNode::Release { job: self.id } });
        }
        self.state = state;
        self.phase = Phase::Done;
        self.actions.push_back(DriverAction::Event(event));
    }
}

#[cfg(test)]
pub(super) mod tests {
    use troupe_cluster::membership::Epoch;

    fn figures(loss: f64, grad_norm: f64, peak_rss_bytes: u64) -> StepFigures {
        StepFigures { peak_rss_bytes, ..StepFigures::new(loss, grad_norm) }
    }

    use super::*;

    const T: Duration = Duration::from_millis(100);

    /// A job of `steps` steps of the default model, for the driver's and the node core's tests.
    pub(in crate::runtime) fn spec(steps: u64) -> JobSpec {
        let mut config = troupe_model::config::JobConfig::default();
        config.train.steps = steps;
        JobSpec {
            config,
            name: "t".into(),
            save_final: None,
            data_plane: Default::default(),
            trace: false,
            trace_seed: 0,
        }
    }

    fn view(epoch: u64, nodes: &[&str]) -> (View, Vec<MemberInfo>) {
        let members = nodes
            .iter()
            .map(|n| MemberInfo {
                name: (*n).into(),
                addr: "127.0.0.1:1".parse().unwrap(),
                slots: 1,
                dashboard: None,
                raft_listen: None,
                devices: Vec::new(),
                load: None,
            })
            .collect();
        (View::new(Epoch(epoch), nodes.iter().map(|n| NodeId::from(*n)).collect()), members)
    }

    fn drain(d: &mut JobDriver) -> Vec<DriverAction> {
        std::iter::from_fn(|| d.poll_action()).collect()
    }

    fn sent(actions: &[DriverAction]) -> Vec<(String, &ToNode)> {
        actions
            .iter()
            .filter_map(|a| match a {
                DriverAction::Send { node, msg } => Some((node.0.clone(), msg)),
                _ => None,
            })
            .collect()
    }

    fn events(actions: &[DriverAction]) -> Vec<&JobEvent> {
        actions
            .iter()
            .filter_map(|a| match a {
                DriverAction::Event(e) => Some(e),
                _ => None,
            })
            .collect()
    }

    fn addr(port: u16) -> SocketAddr {
        SocketAddr::from(([127, 0, 0, 1], port))
    }

    /// Starts a job on `nodes`, every rank ready at `committed`; returns the attempt number.
    fn started(d: &mut JobDriver, epoch: u64, nodes: &[&str], committed: &[u64]) -> u64 {
        let (v, m) = view(epoch, nodes);
        d.on_view(&v, &m, vec![]);
        drain(d);
        let attempt = d.info().attempts;
        for (i, (n, c)) in nodes.iter().zip(committed).enumerate() {
            d.on_ready(T, &NodeId::from(*n), attempt, 0, addr(1000 + i as u16), Some(*c));
        }
        attempt
    }

    /// What a controller recorded before it died, to restore from.
    fn recorded(d: &mut JobDriver) -> JobInfo {
        drain(d);
        d.info()
    }

    #[test]
    fn a_restored_job_waits_for_the_last_views_nodes_and_resumes_from_the_most_advanced_rank() {
        let mut before = JobDriver::new(1, spec(10));
        started(&mut before, 3, &["a", "b", "c"], &[0, 0, 0]);
        for step in 0..5 {
            for n in ["a", "b", "c"] {
                before.on_vote(T, &n.into(), 1, 0, step, figures(5.0, 1.0, 0));
            }
        }
        let info = recorded(&mut before);
        assert_eq!((info.step, info.attempts, info.state), (5, 1, JobState::Running));

        // The restarted controller: epoch 4, only itself ("a") at first, then b; c is still on its way.
        let expect: Vec<NodeId> = ["a", "b", "c"].map(NodeId::from).to_vec();
        let mut d = JobDriver::restore(1, spec(10), &info, expect);
        assert_eq!(d.info().state, JobState::Waiting);
        for nodes in [&["a"][..], &["a", "b"]] {
            let (v, m) = view(4 + nodes.len() as u64, nodes);
            d.on_view(&v, &m, vec![]);
            assert!(drain(&mut d).is_empty(), "an attempt on {nodes:?} would leave c's state behind");
        }
        let (v, m) = view(7, &["a", "b", "c"]);
        d.on_view(&v, &m, vec![]);
        let actions = drain(&mut d);
        let JobEvent::Membership { epoch: 7, world: 3, changes } = events(&actions)[0] else { panic!("{actions:?}") };
        assert!(changes[0].contains("controller restarted"), "{changes:?}");
        let prepares = sent(&actions);
        assert_eq!(prepares.len(), 3);
        assert!(prepares.iter().all(|(_, w)| matches!(w, ToNode::Prepare { attempt: 2, .. })), "past the old attempts");

        // b applied step 5's commit before the old controller died; a and c did not hear it.
        for (i, (n, c)) in [("a", 5), ("b", 6), ("c", 5)].into_iter().enumerate() {
            d.on_ready(T, &n.into(), 2, 0, addr(i as u16), Some(c));
        }
        let actions = drain(&mut d);
        assert!(matches!(sent(&actions)[0].1, ToNode::Start { source: Some(1), attempt: 2, .. }), "{actions:?}");
        assert_eq!(events(&actions), vec![&JobEvent::Recovered { step: 6, epoch: 7, world: 3 }], "no rollback");
        d.on_vote(T, &"a".into(), 2, 0, 6, figures(4.0, 1.0, 0));
        d.on_vote(T, &"b".into(), 2, 0, 6, figures(4.0, 1.0, 0));
        d.on_vote(T, &"c".into(), 2, 0, 6, figures(4.0, 1.0, 0));
        assert_eq!(d.info().step, 7);
    }

    #[test]
    fn a_restored_job_whose_last_commit_reached_no_surviving_rank_redoes_that_step() {
        let mut before = JobDriver::new(1, spec(10));
        started(&mut before, 2, &["a", "b"], &[0, 0]);
        for step in 0..3 {
            for n in ["a", "b"] {
                before.on_vote(T, &n.into(), 1, 0, step, figures(5.0, 1.0, 0));
            }
        }
        // Step 3 recorded as committed; the controller died before its `Commit` left.
        let info = recorded(&mut before);
        assert_eq!(info.step, 3);
        let mut d = JobDriver::restore(1, spec(10), &info, vec!["a".into(), "b".into()]);
        let (v, m) = view(5, &["a", "b"]);
        d.on_view(&v, &m, vec![]);
        drain(&mut d);
        for (i, n) in ["a", "b"].into_iter().enumerate() {
            d.on_ready(T, &n.into(), 2, 0, addr(i as u16), Some(2));
        }
        let actions = drain(&mut d);
        assert_eq!(
            events(&actions),
            vec![
                &JobEvent::RolledBack { from_step: 3, to_step: 2 },
                &JobEvent::Recovered { step: 2, epoch: 5, world: 2 }
            ],
            "redone, not failed, though the job has no checkpoint.dir"
        );
        assert_eq!(d.info().state, JobState::Running);
        // Two steps behind is a real loss: without a checkpoint the job fails, as before.
        let mut d = JobDriver::restore(1, spec(10), &info, vec!["a".into(), "b".into()]);
        d.on_view(&v, &m, vec![]);
        drain(&mut d);
        for (i, n) in ["a", "b"].into_iter().enumerate() {
            d.on_ready(T, &n.into(), 2, 0, addr(i as u16), Some(1));
        }
        drain(&mut d);
        assert_eq!(d.info().state, JobState::Failed);
    }

    #[test]
    fn a_restored_job_resumes_without_a_node_that_does_not_come_back_within_the_grace() {
        let mut before = JobDriver::new(1, spec(10));
        started(&mut before, 2, &["a", "b"], &[0, 0]);
        let info = recorded(&mut before);
        let mut one_rank = spec(10);
        one_rank.config.parallel.dp = 1;
        let mut d = JobDriver::restore(1, one_rank, &info, vec!["a".into(), "b".into()]);
        let (v, m) = view(3, &["a"]);
        d.on_view(&v, &m, vec![]);
        let t0 = Duration::from_secs(100);
        d.on_tick(t0);
        d.on_tick(t0 + RESUME_GRACE - Duration::from_millis(1));
        assert!(drain(&mut d).is_empty());
        d.on_tick(t0 + RESUME_GRACE);
        let actions = drain(&mut d);
        let JobEvent::Membership { world: 1, changes, .. } = events(&actions)[0] else { panic!("{actions:?}") };
        assert!(changes[1].contains("b did not rejoin within 10 s"), "{changes:?}");
        assert_eq!(sent(&actions).len(), 1);
        let (node, msg) = &sent(&actions)[0];
        assert!(node == "a" && matches!(msg, ToNode::Prepare { attempt: 2, .. }), "{actions:?}");
        // x joins: a spare the old controller may have prepared after its last recorded view (a joiner
        // it admitted, say) — the restored driver cannot tell, and releases it at the end too.
        let (v, m) = view(4, &["a", "x"]);
        d.on_view(&v, &m, vec![]);
        assert!(drain(&mut d).is_empty(), "x is a spare of the one-rank job: nothing sent to it");
        // Its end releases b too, should b come back holding the job's state.
        d.cancel();
        let released: Vec<String> = sent(&drain(&mut d)).into_iter().map(|(n, _)| n).collect();
        assert_eq!(released, vec!["a", "b", "x"]);
    }

    #[test]
    fn a_restored_job_that_had_ended_stays_ended() {
        let mut before = JobDriver::new(1, spec(10));
        before.cancel();
        let info = recorded(&mut before);
        let mut d = JobDriver::restore(1, spec(10), &info, vec!["a".into()]);
        let (v, m) = view(3, &["a"]);
        d.on_view(&v, &m, vec![]);
        d.on_tick(Duration::from_secs(1000));
        assert!(drain(&mut d).is_empty());
        assert_eq!(d.info().state, JobState::Cancelled);
    }

    #[test]
    fn ranks_are_slots_of_members_in_node_id_order_capped() {
        let (v, mut m) = view(1, &["b", "a"]);
        m[0].slots = 2; // "b"
        let ranks = plan_ranks(&v, &m, 0, 0, 1, &[]);
        let names: Vec<_> = ranks.iter().map(|r| (r.node.0.as_str(), r.slot)).collect();
        assert_eq!(names, vec![("a", 0), ("b", 0), ("b", 1)]);
        assert_eq!(plan_ranks(&v, &m, 0, 2, 1, &[]).len(), 2);
        // Under the cap, the ranks of now keep their place (in node-id order): "a" waits as a spare.
        let now = [RankSlot { node: "b".into(), slot: 1 }];
        let kept: Vec<_> = plan_ranks(&v, &m, 0, 2, 1, &now).into_iter().map(|r| (r.node.0, r.slot)).collect();
        assert_eq!(kept, vec![("a".to_string(), 0), ("b".to_string(), 1)]);
        let kept: Vec<_> = plan_ranks(&v, &m, 0, 1, 1, &now).into_iter().map(|r| (r.node.0, r.slot)).collect();
        assert_eq!(kept, vec![("b".to_string(), 1)]);
    }

    /// A pipeline job of 2 stages gets whole pipelines: 5 members give 4 ranks (the running ones kept,
    /// one spare), 1 member gives none, and the dp cap counts pipelines.
    #[test]
    fn a_pipeline_job_gets_whole_pipelines_and_keeps_its_running_ranks() {
        let (v, m) = view(1, &["a", "b", "c", "d", "e"]);
        let nodes = |ranks: Vec<RankSlot>| ranks.into_iter().map(|r| r.node.0).collect::<Vec<_>>();
        assert_eq!(nodes(plan_ranks(&v, &m, 0, 0, 2, &[])), ["a", "b", "c", "d"]);
        let now: Vec<RankSlot> = ["b", "c", "d", "e"].iter().map(|n| RankSlot { node: (*n).into(), slot: 0 }).collect();
        assert_eq!(nodes(plan_ranks(&v, &m, 0, 0, 2, &now)), ["b", "c", "d", "e"]);
        // Capped to one pipeline: one running rank of each stage (b, c run stage 0; d, e stage 1).
        assert_eq!(nodes(plan_ranks(&v, &m, 0, 2, 2, &now)), ["b", "d"]);
        assert_eq!(nodes(plan_ranks(&v, &m, 0, 0, 3, &[])), ["a", "b", "c"]);
        // Running as stage 0 on a, b and stage 1 on c, d; c lost: a and b hold stage 0, only d holds
        // stage 1 — d stays, b waits as a spare.
        let (lost_c, m3) = view(2, &["a", "b", "d"]);
        let now: Vec<RankSlot> = ["a", "b", "c", "d"].iter().map(|n| RankSlot { node: (*n).into(), slot: 0 }).collect();
        assert_eq!(nodes(plan_ranks(&lost_c, &m3, 0, 0, 2, &now)), ["a", "d"]);
        let (one, m1) = view(1, &["a"]);
        assert!(plan_ranks(&one, &m1, 0, 0, 2, &[]).is_empty(), "fewer slots than stages: no ranks");
        let mut s = spec(10);
        s.config.parallel.pp = 2;
        s.config.parallel.dp = 1;
        let mut d = JobDriver::new(1, s);
        d.on_view(&v, &m, vec![]);
        assert_eq!(d.info().world, 2, "dp = 1 replica of 2 stages");

        // One member cannot hold a pipeline of 2: the job waits, then fails saying what it lacked.
        let mut s = spec(10);
        s.config.parallel.pp = 2;
        s.config.elastic.wait_s = 30;
        let mut d = JobDriver::new(1, s);
        d.on_view(&one, &m1, vec![]);
        let actions = drain(&mut d);
        assert!(sent(&actions).is_empty(), "nothing prepared: {actions:?}");
        assert!(events(&actions).contains(&&JobEvent::Waiting { nodes: 0, min_nodes: 1, wait_s: 30 }), "{actions:?}");
        d.on_tick(Duration::from_secs(0));
        d.on_tick(Duration::from_secs(30));
        let actions = drain(&mut d);
        let Some(JobEvent::Failed { reason }) = events(&actions).last().copied() else { panic!("{actions:?}") };
        assert!(reason.contains("parallel.pp = 2 slots of one pipeline"), "{reason}");
    }

    /// `troupe status` per rank: a pipeline of 2 stages × 2 replicas on a..d with e spare — each rank's
    /// stage, replica, state and committed step through start, training, a loss and the recovery; all
    /// slots waiting while the job waits for nodes; nothing once it ended.
    #[test]
    fn each_slot_of_a_job_reports_its_rank_stage_replica_state_and_step() {
        /// (node, rank, stage, replica, state, step).
        type Row = (String, Option<usize>, Option<usize>, Option<usize>, &'static str, Option<u64>);
        fn row(r: &RankInfo) -> Row {
            (r.node.clone(), r.rank, r.stage, r.replica, r.state.name(), r.step)
        }
        let rows = |d: &JobDriver| d.info().ranks.iter().map(row).collect::<Vec<_>>();
        let mut s = spec(10);
        s.config.parallel.pp = 2;
        s.config.parallel.dp = 2;
        s.config.checkpoint.dir = Some("/ckpt".into());
        let mut d = JobDriver::new(1, s);
        let some =
            |n: &str, r, stage, replica, state, step| (n.to_owned(), Some(r), Some(stage), Some(replica), state, step);
        let spare = |n: &str, step| (n.to_owned(), None, None, None, "spare", step);
        started(&mut d, 1, &["a", "b", "c", "d", "e"], &[0, 0, 0, 0]);
        assert_eq!(
            rows(&d),
            [
                some("a", 0, 0, 0, "starting", Some(0)),
                some("b", 1, 0, 1, "starting", Some(0)),
                some("c", 2, 1, 0, "starting", Some(0)),
                some("d", 3, 1, 1, "starting", Some(0)),
                spare("e", None),
            ]
        );
        for n in ["a", "b", "c", "d"] {
            d.on_vote(T, &n.into(), 1, 0, 0, figures(5.0, 1.0, 0));
        }
        assert!(rows(&d)[..4].iter().all(|r| r.4 == "training" && r.5 == Some(1)), "{:?}", rows(&d));

        // b is lost: e takes its place as the second replica of stage 0 (ranks in node order).
        let (v, m) = view(2, &["a", "c", "d", "e"]);
        d.on_view(&v, &m, vec!["b failed".into()]);
        let attempt = d.info().attempts;
        assert_eq!(
            rows(&d),
            [
                some("a", 0, 0, 0, "recovering", Some(1)),
                some("c", 1, 0, 1, "recovering", Some(1)),
                some("d", 2, 1, 0, "recovering", Some(1)),
                some("e", 3, 1, 1, "recovering", None),
            ]
        );
        for (i, n) in ["a", "c", "d", "e"].into_iter().enumerate() {
            d.on_ready(T, &n.into(), attempt, 0, addr(i as u16), Some(u64::from(n != "e")));
        }
        assert!(rows(&d).iter().all(|r| r.4 == "recovering" && r.5 == Some(1)), "until the attempt commits");
        for n in ["a", "c", "d", "e"] {
            d.on_vote(T, &n.into(), attempt, 0, 1, figures(5.0, 1.0, 0));
        }
        assert!(rows(&d).iter().all(|r| r.4 == "training" && r.5 == Some(2)), "{:?}", rows(&d));

        // One node cannot hold a pipeline of 2: every slot waits.
        let (one, m1) = view(3, &["a"]);
        d.on_view(&one, &m1, vec!["c, d, e failed".into()]);
        assert_eq!(rows(&d), [("a".to_owned(), None, None, None, "waiting", Some(2))]);
        d.cancel();
        assert!(d.info().ranks.is_empty(), "an ended job has no ranks");

        // A data-parallel job: every rank its own replica, no stage.
        let mut d = JobDriver::new(2, spec(10));
        started(&mut d, 1, &["a", "b"], &[0, 0]);
        let ddp: Vec<_> = rows(&d).into_iter().map(|r| (r.1, r.2, r.3)).collect();
        assert_eq!(ddp, [(Some(0), None, Some(0)), (Some(1), None, Some(1))]);

        // Tensor × pipeline × data: tensor ranks innermost, then replicas, then stages (the planner's
        // rank = t + 2·(d + 2·p)); the attempt's `Placed` event names each rank's node and slot.
        let mut s = spec(10);
        (s.config.parallel.tp, s.config.parallel.pp, s.config.parallel.dp) = (2, 2, 2);
        let mut d = JobDriver::new(3, s);
        let nodes = ["a", "b", "c", "d", "e", "f", "g", "h"];
        started(&mut d, 1, &nodes, &[0; 8]);
        let actions = drain(&mut d);
        let coords: Vec<_> = d.info().ranks.iter().map(|r| (r.tensor, r.replica, r.stage)).collect();
        let want: Vec<_> = (0..8).map(|r| (Some(r % 2), Some(r / 2 % 2), Some(r / 4))).collect();
        assert_eq!(coords, want);
        let placed = events(&actions).into_iter().find_map(|e| match e {
            JobEvent::Placed { tp: 2, pp: 2, dp: 2, ranks, .. } => {
                Some(ranks.iter().map(|r| r.node.0.clone()).collect::<Vec<_>>())
            }
            _ => None,
        });
        assert_eq!(placed, Some(nodes.map(String::from).to_vec()), "{actions:?}");
    }

    /// tp 2 × pp 2 × dp 2 on four two-slot nodes loses d: the replica left (4 ranks) is planned as whole
    /// tensor groups of the nodes kept — a's two slots and b's — not a slot each of b and c, which would
    /// put a tensor group across two hosts.
    #[test]
    fn a_tensor_parallel_re_plan_keeps_each_tensor_group_on_one_node() {
        let two_slots = |nodes: &[&str]| {
            let (view, mut members) = view(1, nodes);
            members.iter_mut().for_each(|m| m.slots = 2);
            (view, members)
        };
        let (v, m) = two_slots(&["a", "b", "c", "d"]);
        let all = plan_ranks(&v, &m, 0, 8, 4, &[]);
        let (v, m) = two_slots(&["a", "b", "c"]);
        let wanted = plan_ranks(&v, &m, 0, 4, 4, &all);
        let at = |r: &[RankSlot]| r.iter().map(|r| format!("{}:{}", r.node.0, r.slot)).collect::<Vec<_>>();
        assert_eq!(at(&wanted), ["a:0", "a:1", "b:0", "c:0"], "plan_ranks alone keeps one rank of each old stage");
        assert_eq!(at(&tensor_groups_within_nodes(&m, wanted.clone(), 2)), ["a:0", "a:1", "b:0", "b:1"]);
        // One slot per node: no whole group fits a node, so the ranks stay as planned.
        let (v1, m1) = view(1, &["a", "b"]);
        let single = plan_ranks(&v1, &m1, 0, 2, 2, &[]);
        assert_eq!(tensor_groups_within_nodes(&m1, single.clone(), 2), single);
    }

    /// Found by the deterministic simulation (troupe-chaos): with `max_ranks` 1, a restarted
    /// node with a lower id displaced the only rank, which held every committed step, and the job failed
    /// with "state lost" though a member held it.
    #[test]
    fn under_the_cap_a_joiner_waits_as_a_spare_instead_of_displacing_a_rank() {
        let mut s = spec(10);
        s.config.parallel.dp = 1;
        let mut d = JobDriver::new(1, s);
        started(&mut d, 1, &["b"], &[0]);
        d.on_vote(T, &"b".into(), 1, 0, 0, figures(5.0, 1.0, 0));
        drain(&mut d);
        let (v, m) = view(2, &["a", "b"]);
        d.on_view(&v, &m, vec!["a joined".into()]);
        assert!(sent(&drain(&mut d)).is_empty(), "the attempt on b goes on");
        d.on_vote(T, &"b".into(), 1, 0, 1, figures(4.0, 1.0, 0));
        assert_eq!(d.info().step, 2);
        let (v, m) = view(3, &["a"]);
        d.on_view(&v, &m, vec!["b failed".into()]);
        let actions = drain(&mut d);
        assert!(sent(&actions).iter().any(|(n, w)| n == "a" && matches!(w, ToNode::Prepare { attempt: 2, .. })));
    }

    /// Each step's validation loss becomes one `eval` event, from the running attempt: an attempt that
    /// starts at an evaluation step evaluates it again (its predecessor may have lost a rank during it),
    /// and that report is dropped; after a rollback the steps past the checkpoint are evaluated anew.
    #[test]
    fn each_steps_validation_loss_is_reported_once_and_again_after_a_rollback() {
        let mut s = spec(10);
        s.config.checkpoint.dir = Some("ckpt".into());
        let mut d = JobDriver::new(1, s);
        started(&mut d, 1, &["a", "b"], &[0, 0]);
        for step in 0..4 {
            for n in ["a", "b"] {
                d.on_vote(T, &n.into(), 1, 0, step, figures(5.0, 1.0, 0));
            }
        }
        drain(&mut d);
        let eval = |loss| EvalFigures { loss, windows: 8, tokens: 1024 };
        d.on_eval(1, 2, eval(2.0));
        d.on_eval(1, 2, eval(2.0));
        d.on_eval(0, 4, eval(1.5));
        let actions = drain(&mut d);
        let evals = events(&actions);
        assert_eq!(evals, [&JobEvent::Eval { step: 2, loss: 2.0, perplexity: 2f64.exp(), windows: 8, tokens: 1024 }]);
        d.on_eval(1, 4, eval(1.5));
        assert_eq!(events(&drain(&mut d)).len(), 1, "a later step is reported");
        d.on_eval(1, 4, eval(1.5));
        assert!(events(&drain(&mut d)).is_empty(), "the retry of step 4 is not");

        // Both ranks lost; "c" restores the checkpoint of step 2 and computes steps 3 and 4 again.
        let (v, m) = view(2, &["c"]);
        d.on_view(&v, &m, vec!["a failed".into(), "b failed".into()]);
        drain(&mut d);
        d.on_ready(T, &"c".into(), 2, 0, addr(2000), Some(2));
        assert!(events(&drain(&mut d)).contains(&&JobEvent::RolledBack { from_step: 4, to_step: 2 }));
        d.on_eval(2, 2, eval(2.0));
        assert!(events(&drain(&mut d)).is_empty(), "the checkpoint's step was reported before the rollback");
        for step in 2..4 {
            d.on_vote(T, &"c".into(), 2, 0, step, figures(5.0, 1.0, 0));
        }
        drain(&mut d);
        d.on_eval(2, 4, eval(1.5));
        assert_eq!(events(&drain(&mut d)).len(), 1, "step 4, computed again, is evaluated again");
    }

    /// A job capped at one rank (dp 1, checkpoints on) that committed 5 steps on "a", "b" a spare.
    fn five_steps_on_a_with_b_spare() -> JobDriver {
        let mut s = spec(10);
        s.config.parallel.dp = 1;
        s.config.checkpoint.dir = Some("ckpt".into());
        let mut d = JobDriver::new(1, s);
        started(&mut d, 1, &["a", "b"], &[0]);
        for step in 0..5 {
            d.on_vote(T, &"a".into(), 1, 0, step, figures(5.0, 1.0, 0));
        }
        d
    }

    /// Found by the deterministic simulation (troupe-chaos, seed 76936): with `max_ranks` 1, the only
    /// rank "a" (step 5) was lost and the job rolled back on the spare "b"; "a" came back fenced,
    /// keeping its state, as a spare — and was ignored while "b" redid the steps "a" held. Now a spare
    /// that may hold a later step than the job's is taken as soon as it is back: the attempt on "b" is
    /// aborted and the job resumes from "a"'s state.
    #[test]
    fn under_the_cap_a_returning_spare_that_may_hold_a_later_step_is_taken_at_once() {
        let mut d = five_steps_on_a_with_b_spare();
        drain(&mut d);
        let (v, m) = view(2, &["b"]);
        d.on_view(&v, &m, vec!["a's connection was lost".into()]);
        drain(&mut d);
        d.on_ready(T, &"b".into(), 2, 0, addr(2), Some(0));
        let actions = drain(&mut d);
        assert!(events(&actions).contains(&&JobEvent::RolledBack { from_step: 5, to_step: 0 }), "nobody holds more");
        for step in 0..2 {
            d.on_vote(T, &"b".into(), 2, 0, step, figures(5.0, 1.0, 0));
        }
        drain(&mut d);
        let (v, m) = view(3, &["a", "b"]);
        d.on_view(&v, &m, vec!["a joined".into()]);
        let actions = drain(&mut d);
        let msgs = sent(&actions);
        assert!(
            matches!(msgs[..], [(ref n, ToNode::Abort { attempt: 2, .. }), (ref a, ToNode::Prepare { attempt: 3, ref ranks, .. })]
            if n == "b" && a == "a" && ranks == &[RankSlot { node: "a".into(), slot: 0 }]),
            "{msgs:?}"
        );
        d.on_ready(T, &"a".into(), 3, 0, addr(1), Some(5));
        let actions = drain(&mut d);
        assert!(matches!(events(&actions)[..], [JobEvent::Recovered { step: 5, .. }]), "{actions:?}");
        assert_eq!(d.info().step, 5);
        // The view changes again without a spare that may hold more: the attempt on "a" goes on.
        let (v, m) = view(4, &["a", "b", "c"]);
        d.on_view(&v, &m, vec!["c joined".into()]);
        assert!(sent(&drain(&mut d)).is_empty());
    }

    /// When the ranks come back with less than the job committed, the spares that may hold more are
    /// asked before rolling back; one that was asked and holds no more is not asked again.
    #[test]
    fn a_spare_is_asked_before_rolling_back_and_one_that_holds_no_more_does_not_stop_it() {
        let mut d = five_steps_on_a_with_b_spare();
        let (v, m) = view(2, &["b"]);
        d.on_view(&v, &m, vec![]);
        d.on_ready(T, &"b".into(), 2, 0, addr(2), Some(0));
        d.on_vote(T, &"b".into(), 2, 0, 0, figures(5.0, 1.0, 0));
        let (v, m) = view(3, &["a", "b"]);
        d.on_view(&v, &m, vec![]);
        drain(&mut d);
        // "a" restarted meanwhile: it holds nothing (a fresh model, step 0); "b" may hold step 1.
        d.on_ready(T, &"a".into(), 3, 0, addr(1), Some(0));
        let actions = drain(&mut d);
        let msgs = sent(&actions);
        assert!(
            matches!(msgs[..], [(_, ToNode::Abort { attempt: 3, .. }), (ref b, ToNode::Prepare { attempt: 4, .. })] if b == "b"),
            "{msgs:?}"
        );
        // "b" restarted too: nobody holds step 1 after all, and the job rolls back.
        d.on_ready(T, &"b".into(), 4, 0, addr(2), Some(0));
        let actions = drain(&mut d);
        assert!(events(&actions).contains(&&JobEvent::RolledBack { from_step: 1, to_step: 0 }), "{actions:?}");
        assert!(matches!(sent(&actions)[..], [(_, ToNode::Start { attempt: 4, .. })]), "{actions:?}");
    }

    /// Found by the deterministic simulation (troupe-chaos, seed 9490, the controller killed): a restored
    /// job's driver had no record of what the old controller's spares held, so when its only rank came
    /// back empty it failed the job for a lost state while a spare held every committed step. A spare it
    /// has not heard from is now asked first.
    #[test]
    fn a_restored_job_asks_the_spares_it_never_heard_from_before_giving_the_state_up() {
        let mut one_rank = spec(10);
        one_rank.config.parallel.dp = 1;
        let mut before = JobDriver::new(1, one_rank.clone());
        started(&mut before, 1, &["a", "b"], &[0]);
        for step in 0..5 {
            before.on_vote(T, &"a".into(), 1, 0, step, figures(5.0, 1.0, 0));
        }
        let info = recorded(&mut before);
        let mut d = JobDriver::restore(1, one_rank, &info, vec!["a".into(), "b".into()]);
        let (v, m) = view(3, &["a", "b"]);
        d.on_view(&v, &m, vec![]);
        drain(&mut d);
        // "a" was the controller's node: it restarted and holds nothing.
        d.on_ready(T, &"a".into(), 2, 0, addr(1), Some(0));
        let actions = drain(&mut d);
        assert!(events(&actions).is_empty(), "neither failed nor rolled back: {actions:?}");
        let sent = sent(&actions);
        assert!(
            matches!(sent[..], [(_, ToNode::Abort { attempt: 2, .. }), (ref b, ToNode::Prepare { attempt: 3, ref ranks, .. })]
            if b == "b" && ranks == &[RankSlot { node: "b".into(), slot: 0 }]),
            "{sent:?}"
        );
        d.on_ready(T, &"b".into(), 3, 0, addr(2), Some(5));
        let actions = drain(&mut d);
        assert!(matches!(events(&actions)[..], [JobEvent::Recovered { step: 5, .. }]), "{actions:?}");
    }

    /// Found by the deterministic simulation (troupe-chaos): the job's end released only the ranks of
    /// the last attempt — none at all when it failed while preparing — so former ranks kept its state.
    #[test]
    fn the_end_of_a_job_releases_every_node_it_ever_prepared() {
        let mut d = JobDriver::new(1, spec(10));
        started(&mut d, 1, &["a", "b"], &[0, 0]);
        for n in ["a", "b"] {
            d.on_vote(T, &n.into(), 1, 0, 0, figures(5.0, 1.0, 0));
        }
        let (v, m) = view(2, &["b", "c"]);
        d.on_view(&v, &m, vec![]);
        drain(&mut d);
        let (v, m) = view(3, &["c"]);
        d.on_view(&v, &m, vec![]);
        drain(&mut d);
        d.on_ready(T, &"c".into(), 3, 0, addr(1), Some(0));
        let actions = drain(&mut d);
        assert!(matches!(events(&actions)[..], [JobEvent::Failed { .. }]), "{actions:?}");
        let released: Vec<_> =
            sent(&actions).into_iter().filter(|(_, w)| matches!(w, ToNode::Release { .. })).map(|(n, _)| n).collect();
        assert_eq!(released, vec!["a", "b", "c"]);
    }

    #[test]
    fn a_step_commits_only_when_every_rank_voted_and_the_job_finishes_when_every_rank_completed() {
        let mut d = JobDriver::new(7, spec(2));
        let (v, m) = view(3, &["a", "b"]);
        d.on_view(&v, &m, vec![]);
        let prepares = drain(&mut d);
        assert_eq!(sent(&prepares).len(), 2);
        assert!(sent(&prepares).iter().all(|(_, w)| matches!(w, ToNode::Prepare { attempt: 1, .. })));
        d.on_ready(T, &"a".into(), 1, 0, addr(1), Some(0));
        assert!(drain(&mut d).is_empty(), "waits for every rank");
        d.on_ready(T, &"b".into(), 1, 0, addr(2), Some(0));
        let start = drain(&mut d);
        let starts = sent(&start);
        let ToNode::Start { roster, source, .. } = starts[0].1 else { panic!("{start:?}") };
        assert_eq!(roster.iter().map(|p| p.addr).collect::<Vec<_>>(), vec![addr(1), addr(2)]);
        assert_eq!(*source, None, "every rank holds step 0: nothing to copy");
        assert!(matches!(events(&start)[0], JobEvent::Started { world: 2, epoch: 3, from_step: 0, attempt: 1, .. }));

        d.on_vote(T * 2, &"a".into(), 1, 0, 0, figures(4.0, 1.0, 100));
        assert!(drain(&mut d).is_empty());
        d.on_vote(T * 2, &"a".into(), 1, 0, 0, figures(4.0, 1.0, 100)); // a duplicate changes nothing
        assert!(drain(&mut d).is_empty());
        d.on_vote(T * 3, &"b".into(), 1, 0, 0, figures(4.0, 1.0, 200));
        let commit = drain(&mut d);
        assert_eq!(sent(&commit).len(), 2);
        assert!(matches!(sent(&commit)[0].1, ToNode::Commit { step: 0, .. }));
        let JobEvent::Step { step: 1, loss, tokens_per_s, world: 2, peak_rss_bytes, .. } = events(&commit)[0] else {
            panic!()
        };
        assert_eq!(*loss, 4.0);
        assert_eq!(peak_rss_bytes, &vec![100, 200], "each rank's peak memory, by rank");
        // 8 samples × 128 tokens over the 200 ms since the attempt started.
        assert!((tokens_per_s - 1024.0 / 0.2).abs() < 1e-6, "{tokens_per_s}");
        assert!(commit.contains(&DriverAction::StepBoundary));

        d.on_vote(T * 4, &"a".into(), 1, 0, 1, figures(3.0, 1.0, 0));
        d.on_vote(T * 4, &"b".into(), 1, 0, 1, figures(3.0, 1.0, 0));
        assert!(!drain(&mut d).contains(&DriverAction::StepBoundary), "no boundary after the last step");
        d.on_ended(&"a".into(), 1, 0, AttemptOutcome::Completed { step: 2, saved: None });
        assert_eq!(d.info().state, JobState::Running);
        d.on_ended(&"b".into(), 1, 0, AttemptOutcome::Completed { step: 2, saved: None });
        let end = drain(&mut d);
        assert!(matches!(events(&end).last(), Some(JobEvent::Finished { steps: 2, final_loss: Some(3.0) })));
        assert!(sent(&end).iter().all(|(_, w)| matches!(w, ToNode::Release { job: 7 })));
        assert_eq!(d.info().state, JobState::Finished);
    }

    /// Members that announced a GPU per slot: the controller picks the NCCL plane, sends it with `Start`
    /// and reports it (start event, status). Every rank's known device peak gives the step its MFU, one
    /// unknown peak none. Two ranks on one host's GPU take the host plane, saying why.
    #[test]
    fn the_plane_follows_the_announced_devices_and_known_peaks_give_the_mfu() {
        let gpu = |ordinal| SlotDevice::Cuda {
            ordinal,
            name: "NVIDIA H200".into(),
            memory_bytes: 1 << 37,
            nccl_missing: None,
        };
        let mut d = JobDriver::new(7, spec(2));
        let (v, mut m) = view(3, &["a", "b"]);
        m[0].devices = vec![gpu(0)];
        m[1].devices = vec![gpu(0)];
        d.on_view(&v, &m, vec![]);
        drain(&mut d);
        d.on_ready(T, &"a".into(), 1, 0, addr(1), Some(0));
        d.on_ready(T, &"b".into(), 1, 0, "10.0.0.2:9".parse().unwrap(), Some(0));
        let start = drain(&mut d);
        assert!(sent(&start).iter().all(|(_, w)| matches!(w, ToNode::Start { plane: GradientPlane::Nccl, .. })));
        let JobEvent::Started { plane, plane_reason, .. } = events(&start)[0] else { panic!("{start:?}") };
        assert_eq!(*plane, GradientPlane::Nccl, "{plane_reason}");
        assert_eq!(d.info().plane, GradientPlane::Nccl);

        let peak = |loss| StepFigures { peak_flops: Some(989e12), ..figures(loss, 1.0, 0) };
        d.on_vote(T * 2, &"a".into(), 1, 0, 0, peak(4.0));
        d.on_vote(T * 2, &"b".into(), 1, 0, 0, peak(4.0));
        let commit = drain(&mut d);
        let JobEvent::Step { tokens_per_s, mfu: Some(mfu), .. } = events(&commit)[0] else { panic!("{commit:?}") };
        let flops = tokens_per_s * 3.0 * spec(2).config.model.forward_flops_per_token();
        assert!((mfu - flops / (2.0 * 989e12)).abs() < 1e-15, "{mfu}");
        // A rank whose peak is unknown: no MFU rather than a wrong one.
        d.on_vote(T * 3, &"a".into(), 1, 0, 1, peak(3.0));
        d.on_vote(T * 3, &"b".into(), 1, 0, 1, figures(3.0, 1.0, 0));
        assert!(matches!(events(&drain(&mut d))[0], JobEvent::Step { mfu: None, .. }));

        // Two ranks on one host's cuda:0 cannot both be NCCL ranks.
        let mut d = JobDriver::new(8, spec(2));
        d.on_view(&v, &m, vec![]);
        drain(&mut d);
        d.on_ready(T, &"a".into(), 1, 0, addr(1), Some(0));
        d.on_ready(T, &"b".into(), 1, 0, addr(2), Some(0));
        let start = drain(&mut d);
        assert!(sent(&start).iter().all(|(_, w)| matches!(w, ToNode::Start { plane: GradientPlane::Host, .. })));
        assert!(d.info().plane_reason.contains("share cuda:0 of host 127.0.0.1"), "{}", d.info().plane_reason);
    }

    /// A rank whose NCCL could not start (the library or the device failed) fails its attempt; the next
    /// attempts take the host plane, saying why, instead of failing the same way until the retries run
    /// out. A rank that failed for another reason (a peer lost while the communicator was being built)
    /// leaves NCCL chosen.
    #[test]
    fn a_rank_whose_nccl_cannot_start_sends_the_job_to_the_host_plane() {
        let gpu =
            SlotDevice::Cuda { ordinal: 0, name: "NVIDIA H200".into(), memory_bytes: 1 << 37, nccl_missing: None };
        let mut d = JobDriver::new(7, spec(4));
        let (v, mut m) = view(3, &["a", "b"]);
        m[0].devices = vec![gpu.clone()];
        m[1].devices = vec![gpu];
        d.on_view(&v, &m, vec![]);
        drain(&mut d);
        let start = |d: &mut JobDriver| {
            let attempt = d.info().attempts;
            d.on_ready(T, &"a".into(), attempt, 0, addr(1), Some(0));
            d.on_ready(T, &"b".into(), attempt, 0, "10.0.0.2:9".parse().unwrap(), Some(0));
            let actions = drain(d);
            let planes: Vec<GradientPlane> = sent(&actions)
                .iter()
                .filter_map(|(_, w)| match w {
                    ToNode::Start { plane, .. } => Some(*plane),
                    _ => None,
                })
                .collect();
            assert_eq!(planes.len(), 2, "{actions:?}");
            (attempt, planes[0])
        };
        let (attempt, plane) = start(&mut d);
        assert_eq!(plane, GradientPlane::Nccl);
        let lost = "building the NCCL communicator on cuda:0: peer 1 lost".to_string();
        d.on_ended(&"b".into(), attempt, 0, AttemptOutcome::Failed { step: 0, reason: lost });
        drain(&mut d);
        let (attempt, plane) = start(&mut d);
        assert_eq!(plane, GradientPlane::Nccl, "a lost peer is no reason to leave NCCL");

        let reason = format!("{} (cuda:0): NCCL error: ncclSystemError", crate::plan::plane::NCCL_UNUSABLE);
        d.on_ended(&"b".into(), attempt, 0, AttemptOutcome::Failed { step: 0, reason });
        drain(&mut d);
        let (_, plane) = start(&mut d);
        assert_eq!(plane, GradientPlane::Host);
        let why = d.info().plane_reason;
        assert!(why.starts_with("NCCL failed to start in an earlier attempt (rank 1: "), "{why}");
        assert!(why.contains("ncclSystemError"), "{why}");
    }

    /// Ranks that count what they hold and send: the attempt says it once, at its second step (its first
    /// may skip a gather), by rank, and `troupe status` shows each rank's figures from then on.
    #[test]
    fn an_attempt_that_counts_its_usage_says_it_once_at_its_second_step_and_each_rank_shows_it() {
        use crate::protocol::{CollectiveKind, GroupKind, SentBytes};
        let mut d = JobDriver::new(1, spec(10));
        started(&mut d, 1, &["a", "b"], &[0, 0]);
        drain(&mut d);
        let counted = |param_bytes: u64| {
            let line = SentBytes {
                group: GroupKind::Tensor,
                collective: CollectiveKind::AllReduce,
                calls: 4,
                bytes: 1000,
                seconds: 0.1,
            };
            let usage = RankUsage { param_bytes, step_seconds: 1.0, sent: vec![line], ..RankUsage::default() };
            StepFigures { usage: Some(usage), ..figures(5.0, 1.0, 0) }
        };
        for step in 0..3 {
            assert!(d.info().ranks.iter().all(|r| r.memory_bytes.is_none() == (step < 2)), "step {step}");
            for (n, bytes) in [("a", 100), ("b", 200)] {
                d.on_vote(T, &n.into(), 1, 0, step, counted(bytes));
            }
            let actions = drain(&mut d);
            let told: Vec<&JobEvent> =
                events(&actions).into_iter().filter(|e| matches!(e, JobEvent::Usage { .. })).collect();
            match (step, told.as_slice()) {
                (1, [JobEvent::Usage { attempt: 1, step: 2, ranks }]) => {
                    assert_eq!(ranks.iter().map(|r| r.param_bytes).collect::<Vec<_>>(), [100, 200]);
                }
                (1, _) => panic!("one usage event at the attempt's second step: {told:?}"),
                _ => assert!(told.is_empty(), "step {step}: {told:?}"),
            }
        }
        let shown: Vec<_> = d.info().ranks.iter().map(|r| (r.memory_bytes, r.sent_bytes_per_step)).collect();
        assert_eq!(shown, [(Some(100), Some(1000)), (Some(200), Some(1000))]);
    }

    #[test]
    fn a_membership_change_aborts_the_attempt_and_the_next_copies_state_from_the_most_advanced_rank() {
        let mut d = JobDriver::new(1, spec(10));
        started(&mut d, 1, &["a", "b", "c"], &[0, 0, 0]);
        drain(&mut d);
        for n in ["a", "b", "c"] {
            d.on_vote(T, &n.into(), 1, 0, 0, figures(5.0, 1.0, 0));
        }
        drain(&mut d);
        d.on_vote(T, &"a".into(), 1, 0, 1, figures(4.0, 1.0, 0)); // step 1 in flight when c dies
        let (v, m) = view(2, &["a", "b"]);
        d.on_view(&v, &m, vec!["c failed".into()]);
        let actions = drain(&mut d);
        let aborts: Vec<_> = sent(&actions).into_iter().filter(|(_, w)| matches!(w, ToNode::Abort { .. })).collect();
        assert_eq!(aborts.iter().map(|(n, _)| n.as_str()).collect::<Vec<_>>(), vec!["a", "b"], "survivors only");
        assert!(matches!(events(&actions)[0], JobEvent::Membership { epoch: 2, world: 2, .. }));
        assert!(sent(&actions).iter().any(|(_, w)| matches!(w, ToNode::Prepare { attempt: 2, .. })));
        // A late vote of the aborted attempt is ignored.
        d.on_vote(T, &"b".into(), 1, 0, 1, figures(4.0, 1.0, 0));
        assert!(drain(&mut d).is_empty());

        // A joiner "d" arrives with no progress; "a" and "b" committed step 1.
        let (v, m) = view(3, &["a", "b", "d"]);
        d.on_view(&v, &m, vec!["d joined".into()]);
        drain(&mut d);
        for (i, (n, c)) in [("a", 1), ("b", 1), ("d", 0)].into_iter().enumerate() {
            d.on_ready(T, &n.into(), 3, 0, addr(i as u16), Some(c));
        }
        let start = drain(&mut d);
        assert!(matches!(sent(&start)[0].1, ToNode::Start { source: Some(0), attempt: 3, .. }));
        assert!(matches!(events(&start)[0], JobEvent::Recovered { step: 1, epoch: 3, world: 3 }));
    }

    #[test]
    fn state_lost_with_every_node_that_held_it_fails_the_job_with_the_reason() {
        let mut d = JobDriver::new(1, spec(10));
        started(&mut d, 1, &["a", "b"], &[0, 0]);
        for n in ["a", "b"] {
            d.on_vote(T, &n.into(), 1, 0, 0, figures(5.0, 1.0, 0));
        }
        drain(&mut d);
        let (v, m) = view(2, &["c"]);
        d.on_view(&v, &m, vec![]);
        drain(&mut d);
        d.on_ready(T, &"c".into(), 2, 0, addr(1), Some(0));
        let actions = drain(&mut d);
        let JobEvent::Failed { reason } = events(&actions)[0] else { panic!("{actions:?}") };
        assert!(reason.contains("state of step 1 was lost"), "{reason}");
        assert_eq!(d.info().state, JobState::Failed);
    }

    #[test]
    fn a_lost_state_is_dropped_by_every_rank_of_the_next_attempts_until_a_step_commits() {
        let mut spec = spec(10);
        spec.config.checkpoint.dir = Some("ckpt".into());
        let mut d = JobDriver::new(1, spec);
        let attempt = started(&mut d, 1, &["a", "b"], &[7, 7]);
        drain(&mut d);
        let reason = "the state of step 7 is incomplete".to_string();
        d.on_ended(&"a".into(), attempt, 0, AttemptOutcome::StateLost { step: 7, reason });
        let actions = drain(&mut d);
        let prepares: Vec<_> =
            sent(&actions).into_iter().filter(|(_, w)| matches!(w, ToNode::Prepare { .. })).collect();
        assert_eq!(prepares.len(), 2, "{actions:?}");
        assert!(
            prepares.iter().all(|(_, w)| matches!(w, ToNode::Prepare { discard_from: Some(7), .. })),
            "{prepares:?}"
        );
        // "b" was aborted before it saw the verdict and still offers step 7; the next attempt fails too and
        // the order stands, then the ranks come back with the checkpoint's step 5.
        let attempt = d.info().attempts;
        d.on_ready(T, &"a".into(), attempt, 0, addr(1), Some(5));
        d.on_ready(T, &"b".into(), attempt, 0, addr(2), Some(7));
        d.on_ended(&"b".into(), attempt, 0, AttemptOutcome::Failed { step: 7, reason: "boom".into() });
        let actions = drain(&mut d);
        assert!(sent(&actions).iter().any(|(_, w)| matches!(w, ToNode::Prepare { discard_from: Some(7), .. })));
        let attempt = d.info().attempts;
        for (i, n) in ["a", "b"].into_iter().enumerate() {
            d.on_ready(T, &n.into(), attempt, 0, addr(i as u16), Some(5));
        }
        let actions = drain(&mut d);
        assert!(events(&actions).contains(&&JobEvent::RolledBack { from_step: 7, to_step: 5 }), "{actions:?}");
        for n in ["a", "b"] {
            d.on_vote(T, &n.into(), attempt, 0, 5, figures(5.0, 1.0, 0));
        }
        drain(&mut d);
        d.on_ended(&"a".into(), attempt, 0, AttemptOutcome::Failed { step: 6, reason: "boom".into() });
        let actions = drain(&mut d);
        assert!(
            sent(&actions).iter().any(|(_, w)| matches!(w, ToNode::Prepare { discard_from: None, .. })),
            "{actions:?}"
        );
    }

    #[test]
    fn a_failing_rank_retries_the_attempt_until_the_limit() {
        let mut d = JobDriver::new(1, spec(10));
        for i in 0..FAILED_ATTEMPTS_MAX {
            let attempt = started(&mut d, 1 + u64::from(i), &["a", "b"], &[0, 0]);
            drain(&mut d);
            d.on_ended(&"b".into(), attempt, 0, AttemptOutcome::Failed { step: 0, reason: "boom".into() });
            let actions = drain(&mut d);
            if i + 1 < FAILED_ATTEMPTS_MAX {
                assert!(sent(&actions).iter().any(|(_, w)| matches!(w, ToNode::Prepare { .. })), "retried");
            } else {
                assert!(matches!(events(&actions).last(), Some(JobEvent::Failed { .. })));
            }
        }
    }

    #[test]
    fn at_most_max_nodes_members_and_the_running_ones_keep_their_place() {
        let (v, mut m) = view(1, &["a", "b", "c"]);
        m[1].slots = 2; // "b"
        let nodes = |ranks: Vec<RankSlot>| ranks.into_iter().map(|r| (r.node.0, r.slot)).collect::<Vec<_>>();
        let two = nodes(plan_ranks(&v, &m, 2, 0, 1, &[]));
        assert_eq!(two, vec![("a".into(), 0), ("b".into(), 0), ("b".into(), 1)], "the first two members, every slot");
        let now = [RankSlot { node: "c".into(), slot: 0 }];
        let kept = nodes(plan_ranks(&v, &m, 2, 0, 1, &now));
        assert_eq!(kept, vec![("a".into(), 0), ("c".into(), 0)], "c runs and keeps its place; b waits as a spare");
    }

    #[test]
    fn too_few_nodes_waits_and_cancel_releases() {
        let mut s = spec(10);
        s.config.elastic.min_nodes = 3;
        let mut d = JobDriver::new(1, s);
        let (v, m) = view(1, &["a", "b"]);
        d.on_view(&v, &m, vec![]);
        let actions = drain(&mut d);
        assert!(sent(&actions).is_empty(), "nothing starts below min_nodes: {actions:?}");
        assert_eq!(events(&actions), vec![&JobEvent::Waiting { nodes: 2, min_nodes: 3, wait_s: 600 }]);
        assert_eq!(d.info().state, JobState::Waiting);
        d.cancel();
        assert!(matches!(events(&drain(&mut d))[..], [JobEvent::Cancelled]));
        assert_eq!(d.info().state, JobState::Cancelled);
    }

    /// A job that lost nodes below `min_nodes` holds its committed step, resumes when members come back
    /// within `wait_s`, and fails with a reason naming the keys once it has waited longer.
    #[test]
    fn below_min_nodes_the_job_waits_a_bounded_time_then_fails() {
        let mut s = spec(10);
        s.config.elastic.min_nodes = 2;
        s.config.elastic.wait_s = 30;
        let mut d = JobDriver::new(1, s);
        started(&mut d, 1, &["a", "b"], &[0, 0]);
        for n in ["a", "b"] {
            d.on_vote(T, &n.into(), 1, 0, 0, figures(5.0, 1.0, 0));
        }
        drain(&mut d);
        // b is lost: one node left, below min_nodes. The attempt is aborted and the job waits.
        let (v, m) = view(2, &["a"]);
        d.on_view(&v, &m, vec!["b failed".into()]);
        let actions = drain(&mut d);
        assert!(sent(&actions).iter().all(|(_, w)| matches!(w, ToNode::Abort { .. })), "{actions:?}");
        assert!(events(&actions).contains(&&JobEvent::Waiting { nodes: 1, min_nodes: 2, wait_s: 30 }));
        let secs = Duration::from_secs;
        d.on_tick(secs(100));
        d.on_tick(secs(129));
        assert_eq!(d.info().state, JobState::Waiting, "29 s of 30");
        // b comes back within the wait: a new attempt from the committed step.
        let (v, m) = view(3, &["a", "b"]);
        d.on_view(&v, &m, vec!["b joined".into()]);
        let actions = drain(&mut d);
        assert!(sent(&actions).iter().any(|(_, w)| matches!(w, ToNode::Prepare { .. })), "{actions:?}");
        d.on_tick(secs(1000));
        assert_ne!(d.info().state, JobState::Failed, "the wait ended when b came back");

        // Lost again, and this time nobody comes back: the job fails after wait_s, naming the keys.
        let (v, m) = view(4, &["a"]);
        d.on_view(&v, &m, vec!["b failed".into()]);
        drain(&mut d);
        d.on_tick(secs(2000));
        d.on_tick(secs(2029));
        assert!(drain(&mut d).is_empty());
        d.on_tick(secs(2030));
        let actions = drain(&mut d);
        let Some(JobEvent::Failed { reason }) = events(&actions).last().copied() else { panic!("{actions:?}") };
        for needle in ["elastic.min_nodes = 2", "elastic.wait_s = 30 s", "add nodes"] {
            assert!(reason.contains(needle), "{needle:?} in {reason}");
        }
        assert_eq!(d.info().state, JobState::Failed);
    }

    #[test]
    fn wait_s_zero_waits_forever() {
        let mut s = spec(10);
        s.config.elastic.min_nodes = 2;
        s.config.elastic.wait_s = 0;
        let mut d = JobDriver::new(1, s);
        let (v, m) = view(1, &["a"]);
        d.on_view(&v, &m, vec![]);
        d.on_tick(Duration::ZERO);
        d.on_tick(Duration::from_secs(1 << 30));
        assert_eq!(d.info().state, JobState::Waiting);
    }

    /// A tp = 2 job on two one-slot nodes that loses one: no tensor group of 2 is left, so the next
    /// attempt runs at tensor degree 1 on the survivor (its Prepare's spec says tp = 1, the membership
    /// change says so); when a node joins again it goes back to tp = 2. Before any attempt the degree is
    /// not lowered: a job submitted with too few slots waits.
    #[test]
    fn a_tensor_group_with_no_whole_replica_left_goes_on_at_a_smaller_degree() {
        let mut s = spec(10);
        s.config = troupe_model::config::JobConfig::small_llama(10);
        (s.config.parallel.tp, s.config.parallel.dp, s.config.elastic.min_nodes) = (2, 1, 1);
        s.config.checkpoint.dir = Some("ckpt".into());
        let prepared_tp = |actions: &[DriverAction]| -> Vec<(String, usize)> {
            sent(actions)
                .into_iter()
                .filter_map(|(n, m)| match m {
                    ToNode::Prepare { spec, .. } => Some((n, spec.config.parallel.tp)),
                    _ => None,
                })
                .collect()
        };
        let mut waiting = JobDriver::new(1, s.clone());
        let (v, m) = view(1, &["a"]);
        waiting.on_view(&v, &m, vec![]);
        assert!(prepared_tp(&drain(&mut waiting)).is_empty(), "no attempt yet: the job waits for 2 slots");

        let mut d = JobDriver::new(1, s);
        started(&mut d, 1, &["a", "b"], &[0, 0]);
        drain(&mut d);
        let (v, m) = view(2, &["a"]);
        d.on_view(&v, &m, vec!["b failed".into()]);
        let actions = drain(&mut d);
        assert_eq!(prepared_tp(&actions), vec![("a".to_string(), 1)], "{actions:?}");
        let Some(JobEvent::Membership { world: 1, changes, .. }) = events(&actions).first().copied() else {
            panic!("{actions:?}")
        };
        assert!(changes.iter().any(|c| c.contains("tensor degree 2 → 1") && c.contains("buddy copy")), "{changes:?}");

        let (v, m) = view(3, &["a", "b"]);
        d.on_view(&v, &m, vec!["b joined".into()]);
        let actions = drain(&mut d);
        let mut back = prepared_tp(&actions);
        back.sort();
        assert_eq!(back, vec![("a".to_string(), 2), ("b".to_string(), 2)], "{actions:?}");
    }
}
