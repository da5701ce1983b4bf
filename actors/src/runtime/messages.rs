//! The runtime's actor messages: what the node, its workers and its job controllers tell each other
//! inside one daemon. They sit below the actors that send them, so that a worker or a job controller
//! knows its node's mailbox without knowing the node (Architecture Invariant: `node` spawns `worker` and
//! `controller`; those two reach back only through [`NodeMsg`]).

use ractor::{ActorRef, RpcReplyPort};
use troupe_cluster::control::ControlEvent;
use troupe_cluster::membership::{NodeId, View};
use troupe_cluster::transport::quic::PeerInfo;

use super::raft::Leadership;
use crate::engine::CommittedState;
use crate::protocol::{
    AttemptOutcome, ClusterStatus, EvalFigures, GradientPlane, JobEvent, JobId, JobInfo, JobSpec, MemberInfo,
    PhaseSpan, StepFigures, ToController, ToNode,
};

pub enum NodeMsg {
    Control(ControlEvent),
    Tick,
    /// A local worker's message for the controller.
    FromWorker(ToController),
    /// A job controller's message for a node.
    Outgoing {
        node: NodeId,
        msg: ToNode,
    },
    JobEvent {
        job: JobId,
        event: JobEvent,
        info: JobInfo,
    },
    JobInfo(JobInfo),
    StepBoundary,
    /// A dial of this address ended: connected to the named peer, or why not.
    Connected(std::net::SocketAddr, Result<String, String>),
    Status(RpcReplyPort<ClusterStatus>),
    /// A member's dashboard page: the controller's page fragment, asked of the controller over this
    /// node's connection to it, or why there is none.
    ControllerDashboard(RpcReplyPort<Result<String, String>>),
    /// SIGTERM: leave the cluster cleanly, then stop.
    Drain(RpcReplyPort<()>),
    Worker(u32, RpcReplyPort<Option<ActorRef<WorkerMsg>>>),
    /// The Raft group's (term, leader) changed (replicated controllers).
    Leadership(Leadership),
    /// A job controller's write was not committed (replicated controllers): this node may no longer
    /// lead, so it stops acting as the controller.
    NotCommitted(String),
}

pub enum WorkerMsg {
    Prepare {
        job: JobId,
        attempt: u64,
        spec: Box<JobSpec>,
        rank: usize,
        epoch: u64,
        /// Drop a committed state of this step or later first (see `ToNode::Prepare`).
        discard_from: Option<u64>,
    },
    Start {
        job: JobId,
        attempt: u64,
        roster: Vec<PeerInfo>,
        source: Option<usize>,
        /// Where the attempt sums its gradients (`ToNode::Start`).
        plane: GradientPlane,
    },
    Commit {
        job: JobId,
        attempt: u64,
        step: u64,
    },
    Abort {
        job: JobId,
        attempt: u64,
    },
    /// The job is over: drop its state.
    Release {
        job: JobId,
    },
    /// The controller runs only `jobs` (with each view): release every other job this worker holds — one
    /// whose `Release` was lost.
    Retain {
        jobs: Vec<JobId>,
    },
    /// This node was fenced (removed from the view, or its controller restarted): abort every attempt.
    /// The committed states of `keep` (jobs the controller still runs) stay — each is the state of its
    /// step, as any rank's — and are offered, with their steps, to the next attempt that includes this
    /// node; every other job's state is dropped.
    AbortAll {
        keep: Vec<JobId>,
    },
    /// The node drains: abort everything and drop all job state.
    DropAll,
    /// An attempt task ended and gives the committed state back (None if it was lost to a panic, or
    /// found incomplete).
    Returned {
        job: JobId,
        attempt: u64,
        state: Option<CommittedState>,
        outcome: AttemptOutcome,
    },
    /// Fault injection: the handler panics (tests, the chaos harness).
    Panic(String),
}

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
        bytes: u64,
    },
    /// Rank 0's validation loss of the model after `step` committed steps.
    Evaluated {
        attempt: u64,
        step: u64,
        figures: EvalFigures,
    },
    /// A rank's step phases: passed straight to the job's watchers.
    Phases {
        node: NodeId,
        attempt: u64,
        rank: usize,
        step: u64,
        spans: Vec<PhaseSpan>,
        stage: Option<usize>,
    },
    Cancel,
    /// Once a second: bounds the wait below `elastic.min_nodes`.
    Tick,
}
