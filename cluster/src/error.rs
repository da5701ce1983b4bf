//! The one error type at this crate's boundary. Every variant names what it was doing and with whom.

use std::path::PathBuf;

use crate::wire::WireError;

/// Rank of a process inside a group (0-based).
pub type Rank = usize;

#[derive(Debug, thiserror::Error)]
pub enum ClusterError {
    #[error("identity: {what} at {path}: {reason}")]
    Identity { what: &'static str, path: PathBuf, reason: String },

    #[error("tls configuration: {0}")]
    Tls(String),

    #[error("rank {rank}: connecting to peer {peer} at {addr}: {reason}")]
    Connect { rank: Rank, peer: Rank, addr: String, reason: String },

    #[error("node {node}: dialing {addr}: {reason}")]
    Dial { node: String, addr: String, reason: String },

    #[error("node {node}: sending to peer {peer}: {reason}")]
    SendTo { node: String, peer: String, reason: String },

    #[error("rank {rank}: peer {peer} lost (epoch {epoch}): {reason}")]
    PeerLost { rank: Rank, peer: Rank, epoch: u64, reason: String },

    #[error("rank {rank}: {op} (group {group}, epoch {epoch}, seq {seq}) timed out after {waited_ms} ms waiting on peer {peer}")]
    Timeout { rank: Rank, op: &'static str, group: u32, epoch: u64, seq: u64, peer: Rank, waited_ms: u64 },

    #[error("rank {rank}: peer {peer} sent a bad frame: {source}")]
    Wire { rank: Rank, peer: Rank, source: WireError },

    #[error("rank {rank}: {op}: stale epoch {epoch}, the group is fenced at epoch {fenced_at}")]
    StaleEpoch { rank: Rank, op: &'static str, epoch: u64, fenced_at: u64 },

    #[error("rank {rank}: {op}: invalid argument: {reason}")]
    InvalidArgument { rank: Rank, op: &'static str, reason: String },

    #[error("rank {rank}: {op}: peer {peer} sent {got} bytes, expected {expected}")]
    LengthMismatch { rank: Rank, op: &'static str, peer: Rank, got: usize, expected: usize },

    #[error("transport closed on rank {rank}")]
    Closed { rank: Rank },

    #[error("io: {context}: {source}")]
    Io { context: String, source: std::io::Error },

    #[error("no CUDA device: {0}")]
    NoCuda(String),

    #[error("nccl: {0}")]
    Nccl(String),

    /// Not every rank joined an NCCL communicator in time: a peer lost or stalled during the join
    /// (NCCL itself worked, as far as this rank can tell).
    #[error("rank {rank} of {world} (epoch {epoch}): ncclCommInitRank: not every rank joined within {waited_ms} ms")]
    NcclJoinTimeout { rank: Rank, world: usize, epoch: u64, waited_ms: u64 },
}

impl ClusterError {
    /// The variant's name, for reports and logs.
    pub fn kind(&self) -> &'static str {
        match self {
            ClusterError::Identity { .. } => "Identity",
            ClusterError::Tls(_) => "Tls",
            ClusterError::Connect { .. } => "Connect",
            ClusterError::Dial { .. } => "Dial",
            ClusterError::SendTo { .. } => "SendTo",
            ClusterError::PeerLost { .. } => "PeerLost",
            ClusterError::Timeout { .. } => "Timeout",
            ClusterError::Wire { .. } => "Wire",
            ClusterError::StaleEpoch { .. } => "StaleEpoch",
            ClusterError::InvalidArgument { .. } => "InvalidArgument",
            ClusterError::LengthMismatch { .. } => "LengthMismatch",
            ClusterError::Closed { .. } => "Closed",
            ClusterError::Io { .. } => "Io",
            ClusterError::NoCuda(_) => "NoCuda",
            ClusterError::Nccl(_) => "Nccl",
            ClusterError::NcclJoinTimeout { .. } => "NcclJoinTimeout",
        }
    }

    /// The same error with its ranks renumbered by `global` — for an error of a sub-group whose ranks
    /// mean nothing to a reader who knows the whole group's (e.g. a host's arena inside two-tier
    /// collectives).
    pub fn renumbered(self, global: impl Fn(Rank) -> Rank) -> Self {
        use ClusterError::*;
        match self {
            Connect { rank, peer, addr, reason } => Connect { rank: global(rank), peer: global(peer), addr, reason },
            PeerLost { rank, peer, epoch, reason } => {
                PeerLost { rank: global(rank), peer: global(peer), epoch, reason }
            }
            Timeout { rank, op, group, epoch, seq, peer, waited_ms } => {
                Timeout { rank: global(rank), op, group, epoch, seq, peer: global(peer), waited_ms }
            }
            Wire { rank, peer, source } => Wire { rank: global(rank), peer: global(peer), source },
            StaleEpoch { rank, op, epoch, fenced_at } => StaleEpoch { rank: global(rank), op, epoch, fenced_at },
            InvalidArgument { rank, op, reason } => InvalidArgument { rank: global(rank), op, reason },
            LengthMismatch { rank, op, peer, got, expected } => {
                LengthMismatch { rank: global(rank), op, peer: global(peer), got, expected }
            }
            Closed { rank } => Closed { rank: global(rank) },
            other => other,
        }
    }

    pub fn io(context: impl Into<String>, source: std::io::Error) -> Self {
        ClusterError::Io { context: context.into(), source }
    }
}
