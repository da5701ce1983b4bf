//! JobController: one actor per job, on the controller (leader) daemon. It owns the job's
//! [`JobDriver`] and carries out its actions through its node: messages to the ranks' nodes, events to
//! the job's watchers, step boundaries to membership.

use ractor::{Actor, ActorProcessingErr, ActorRef};
use troupe_cluster::membership::{NodeId, View};

use super::job::{DriverAction, JobDriver};
use super::node::NodeMsg;
use super::protocol::{AttemptOutcome, JobEvent, JobId, JobSpec, MemberInfo, StepFigures};
use crate::telemetry::PhaseSpan;

pub enum JobMsg {
    View {
        view: View,
        members: Vec<MemberInfo>,
        changes: Vec<String>,
    },
    Ready {
        node: NodeId,
        attempt: u64,
        slot: u32,
        addr: std::net::SocketAddr,
        committed: Option<u64>,
    },
    Vote {
        node: NodeId,
        attempt: u64,
        slot: u32,
        step: u64,
        figures: StepFigures,
        seconds: f64,
    },
    Ended {
        node: NodeId,
        attempt: u64,
        slot: u32,
        outcome: AttemptOutcome,
    },
    Checkpointed {
        attempt: u64,
        step: u64,
        path: std::path::PathBuf,
        seconds: f64,
    },
    /// A rank's step phases: passed straight to the job's watchers.
    Phases {
        node: NodeId,
        attempt: u64,
        rank: usize,
        step: u64,
        spans: Vec<PhaseSpan>,
    },
    Cancel,
    /// Once a second: bounds the wait below `elastic.min_nodes`.
    Tick,
}

pub struct JobArgs {
    pub id: JobId,
    pub spec: JobSpec,
    pub node: ActorRef<NodeMsg>,
    pub view: View,
    pub members: Vec<MemberInfo>,
}

pub struct JobControllerState {
    id: JobId,
    started: std::time::Instant,
    driver: JobDriver,
    node: ActorRef<NodeMsg>,
}

pub struct JobController;

impl JobControllerState {
    fn flush(&mut self) {
        while let Some(action) = self.driver.poll_action() {
            let msg = match action {
                DriverAction::Send { node, msg } => NodeMsg::Outgoing { node, msg },
                DriverAction::Event(event) => NodeMsg::JobEvent { job: self.id, event, info: self.driver.info() },
                DriverAction::StepBoundary => NodeMsg::StepBoundary,
            };
            let _ = self.node.cast(msg);
        }
        let _ = self.node.cast(NodeMsg::JobInfo(self.driver.info()));
    }
}

impl Actor for JobController {
    type Msg = JobMsg;
    type State = JobControllerState;
    type Arguments = JobArgs;

    async fn pre_start(&self, me: ActorRef<JobMsg>, args: JobArgs) -> Result<JobControllerState, ActorProcessingErr> {
        let mut state = JobControllerState {
            id: args.id,
            started: std::time::Instant::now(),
            driver: JobDriver::new(args.id, args.spec),
            node: args.node,
        };
        state.driver.on_view(&args.view, &args.members, Vec::new());
        state.flush();
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
            JobMsg::Checkpointed { attempt, step, path, seconds } => d.on_checkpoint(attempt, step, path, seconds),
            JobMsg::Cancel => d.cancel(),
            JobMsg::Tick => d.on_tick(now),
            JobMsg::Phases { node, attempt, rank, step, spans } => {
                let event = JobEvent::Phases { rank, node: node.0, attempt, step, spans };
                let _ = state.node.cast(NodeMsg::JobEvent { job: state.id, event, info: d.info() });
                return Ok(());
            }
        }
        state.flush();
        Ok(())
    }
}
