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
        }
    }

    pub fn io(context: impl Into<String>, source: std::io::Error) -> Self {
        ClusterError::Io { context: context.into(), source }
    }
}
