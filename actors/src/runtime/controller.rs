//! JobController: one actor per job, on the controller daemon. It owns the job's
//! [`JobDriver`] and carries out its actions through its node: messages to the ranks' nodes, events to
//! the job's watchers, step boundaries to membership.
//!
//! It records the job *before* it announces anything: the spec and state, and the events of each batch
//! of actions, in one write through the node's [`ControllerGroup`] — one durable catalog transaction
//! with one controller, committed by a Raft majority with several (a write that is not committed is
//! never announced: the node steps down) — and only then the batch's messages and events go out. So a `Commit` leaves only once its step's event is on disk, an attempt's `Prepare`
//! only once its number is, and a watcher never sees an event a restarted controller would not have —
//! which is what lets the controller restart from its catalog (see [`JobDriver::restore`]).

use ractor::{Actor, ActorProcessingErr, ActorRef};
use troupe_cluster::membership::{NodeId, View};

use super::job::{DriverAction, JobDriver};
pub use super::messages::JobMsg;
use super::messages::NodeMsg;
use super::raft::{CatalogWrite, ControllerGroup};
use crate::protocol::{JobEvent, JobId, JobInfo, JobSpec, JobState, MemberInfo};

pub struct JobArgs {
    pub id: JobId,
    pub spec: JobSpec,
    pub node: ActorRef<NodeMsg>,
    pub view: View,
    pub members: Vec<MemberInfo>,
    /// Where the job's records go: the catalog (one controller) or the Raft group (several).
    pub group: std::sync::Arc<ControllerGroup>,
    /// A job the controller recorded before it restarted: its last recorded state, the number its next
    /// event gets, and the nodes of the last view (see [`JobDriver::restore`]).
    pub restored: Option<(JobInfo, u64, Vec<NodeId>)>,
}

pub struct JobControllerState {
    id: JobId,
    spec: JobSpec,
    started: std::time::Instant,
    driver: JobDriver,
    node: ActorRef<NodeMsg>,
    group: std::sync::Arc<ControllerGroup>,
    /// A write was not committed (replicated controllers): nothing more goes out from this job
    /// controller; its node steps down and stops it.
    stopped: bool,
    /// The number the next recorded event gets.
    next_event: u64,
    /// The attempt and state last recorded (with events: every other change of the job's state — its
    /// step, loss, reason — comes with an event).
    recorded: Option<(u64, JobState)>,
    /// Events not yet recorded (phase reports wait for the next batch that must be durable anyway).
    pending: Vec<DriverAction>,
}

pub struct JobController;

impl JobControllerState {
    /// Records this batch of actions (with any waiting phase reports) in the catalog, then carries them
    /// out. A batch of phase reports alone waits for the next batch, or the next tick: an fsync per
    /// report would cost traced jobs a disk flush per rank per step. Fails when the batch was not
    /// committed (replicated controllers): the job controller has stopped.
    async fn flush(&mut self, force: bool) -> Result<(), String> {
        if self.stopped {
            return Ok(());
        }
        let mut batch = std::mem::take(&mut self.pending);
        while let Some(action) = self.driver.poll_action() {
            batch.push(action);
        }
        let info = self.driver.info();
        let unrecorded = self.recorded != Some((info.attempts, info.state));
        let phases_only = batch.iter().all(|a| matches!(a, DriverAction::Event(JobEvent::Phases { .. })));
        if phases_only && !batch.is_empty() && !force && !unrecorded {
            self.pending = batch;
            return Ok(());
        }
        let events: Vec<JobEvent> = batch
            .iter()
            .filter_map(|a| match a {
                DriverAction::Event(e) => Some(e.clone()),
                _ => None,
            })
            .collect();
        if !events.is_empty() || unrecorded {
            let count = events.len() as u64;
            let write =
                CatalogWrite::Job { spec: self.spec.clone(), info: info.clone(), first: self.next_event, events };
            match self.group.propose(write).await {
                Ok(()) => {}
                Err(e) if self.group.is_replicated() => {
                    // Not committed by a majority: none of this batch may go out.
                    tracing::warn!(job = self.id, "{e}; this node stops acting as the controller");
                    self.stopped = true;
                    let why = format!("job {}'s record was not committed: {e}", self.id);
                    let _ = self.node.cast(NodeMsg::NotCommitted(why.clone()));
                    return Err(why);
                }
                Err(e) => tracing::error!(job = self.id, "{e:#}; a controller restart would not find this"),
            }
            self.next_event += count;
            self.recorded = Some((info.attempts, info.state));
        }
        for action in batch {
            let msg = match action {
                DriverAction::Send { node, msg } => NodeMsg::Outgoing { node, msg },
                DriverAction::Event(event) => NodeMsg::JobEvent { job: self.id, event, info: info.clone() },
                DriverAction::StepBoundary => NodeMsg::StepBoundary,
            };
            let _ = self.node.cast(msg);
        }
        let _ = self.node.cast(NodeMsg::JobInfo(info));
        Ok(())
    }
}

impl Actor for JobController {
    type Msg = JobMsg;
    type State = JobControllerState;
    type Arguments = JobArgs;

    async fn pre_start(&self, me: ActorRef<JobMsg>, args: JobArgs) -> Result<JobControllerState, ActorProcessingErr> {
        let (driver, next_event) = match args.restored {
            Some((info, next_event, expect)) => {
                (JobDriver::restore(args.id, args.spec.clone(), &info, expect), next_event)
            }
            None => (JobDriver::new(args.id, args.spec.clone()), 0),
        };
        let mut state = JobControllerState {
            id: args.id,
            spec: args.spec,
            started: std::time::Instant::now(),
            driver,
            node: args.node,
            group: args.group,
            stopped: false,
            next_event,
            recorded: None,
            pending: Vec::new(),
        };
        state.driver.on_view(&args.view, &args.members, Vec::new());
        // A job whose first record was not committed never started: its submitter is told so (the node
        // answers `job_started` with this error), not `Submitted`.
        if let Err(why) = state.flush(true).await {
            return Err(not_started(state.id, &why).into());
        }
        me.send_interval(std::time::Duration::from_secs(1), || JobMsg::Tick);
        Ok(state)
    }

    async fn handle(
        &self,
        _me: ActorRef<JobMsg>,
        msg: JobMsg,
        state: &mut JobControllerState,
    ) -> Result<(), ActorProcessingErr> {
        let now = state.started.elapsed();
        let d = &mut state.driver;
        match msg {
            JobMsg::View { view, members, changes } => d.on_view(&view, &members, changes),
            JobMsg::Ready { node, attempt, slot, addr, committed } => {
                d.on_ready(now, &node, attempt, slot, addr, committed)
            }
            JobMsg::Vote { node, attempt, slot, step, figures, .. } => {
                d.on_vote(now, &node, attempt, slot, step, figures)
            }
            JobMsg::Ended { node, attempt, slot, outcome } => d.on_ended(&node, attempt, slot, outcome),
            JobMsg::Checkpointed { attempt, step, path, seconds, bytes } => {
                d.on_checkpoint(attempt, step, path, seconds, bytes)
            }
            JobMsg::Evaluated { attempt, step, figures } => d.on_eval(attempt, step, figures),
            JobMsg::Cancel => d.cancel(),
            JobMsg::Tick => {
                d.on_tick(now);
                // A batch not committed stopped this job controller (see `flush`): its node steps down.
                let _ = state.flush(true).await;
                return Ok(());
            }
            JobMsg::Phases { node, attempt, rank, step, spans, stage } => {
                let event = JobEvent::Phases { rank, node: node.0, attempt, step, spans, stage };
                state.pending.push(DriverAction::Event(event));
            }
        }
        let _ = state.flush(false).await;
        Ok(())
    }
}

/// What the submitter of job `id` is told when the job's first record was not committed by a majority:
/// this controller lost its leadership, so the job did not start here. The Raft log may still hold the
/// record uncommitted; a new leader commits it (and runs the job) only if it reached that leader.
pub fn not_started(id: JobId, why: &str) -> String {
    format!(
        "the controller lost its leadership before a majority recorded job {id} ({why}); submit it again \
         to the current controller (`troupe job status {id}` there first: the new leader runs the job only \
         if the record reached it)"
    )
}
