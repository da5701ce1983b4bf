//! The replicated controller's foundation (issue 32): the controller-eligible daemons (node.toml
//! `controllers`) form a Raft group (openraft 0.9) whose log carries the controller's catalog writes
//! ([`CatalogWrite`]) and whose state machine is the catalog itself. Docs: docs/runtime-semantics.md,
//! "Replicated controller (Raft)".
//!
//! - [`store`]: the Raft log and vote in the daemon's redb catalog, every append durable when it returns.
//! - [`machine`]: applying committed entries to the catalog, `last_applied` and the membership in the same
//!   transaction as the write; snapshots are the catalog's contents.
//! - [`network`]: request/response RPC over the mutually-authenticated QUIC control plane.
//! - [`group`]: the handle the node uses: start, propose (committed by a majority, or `NotLeader`),
//!   leadership events, membership changes, shutdown. One controller: no Raft at all.
//! - [`known`]: the daemons a member last knew, kept across restarts to find the controller again.

pub mod group;
pub mod known;
pub mod machine;
pub mod network;
pub mod store;

use std::fmt;
use std::io::Cursor;

use serde::{Deserialize, Serialize};

pub use crate::catalog::CatalogWrite;
pub use group::{ControllerGroup, GroupConfig, Leadership, ProposeError, RaftTimeouts};
pub use network::RaftEndpoint;

/// A Raft node id: the first 8 bytes of the SHA-256 of the node's name (openraft wants a `Copy` id; the
/// name travels beside it in [`Controller`]). Stable across restarts and membership changes.
pub type NodeId = u64;

/// The node info Raft keeps in its membership: who a member is and where its Raft endpoint listens.
#[derive(Clone, Debug, Default, PartialEq, Eq, Serialize, Deserialize)]
pub struct Controller {
    pub name: String,
    pub addr: String,
}

impl fmt::Display for Controller {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        write!(f, "{}@{}", self.name, self.addr)
    }
}

/// The Raft id of the node called `name`.
pub fn node_id(name: &str) -> NodeId {
    let digest = ring::digest::digest(&ring::digest::SHA256, name.as_bytes());
    u64::from_be_bytes(digest.as_ref()[..8].try_into().expect("a SHA-256 has 8 bytes"))
}

openraft::declare_raft_types!(
    /// The replicated controller's Raft types: entries carry catalog writes; applying one answers `()`.
    pub TypeConfig:
        D = CatalogWrite,
        R = (),
        NodeId = NodeId,
        Node = Controller,
        Entry = openraft::Entry<TypeConfig>,
        SnapshotData = Cursor<Vec<u8>>,
        AsyncRuntime = openraft::TokioRuntime,
);

pub type Raft = openraft::Raft<TypeConfig>;
pub type Entry = openraft::Entry<TypeConfig>;
pub type LogId = openraft::LogId<NodeId>;
pub type Vote = openraft::Vote<NodeId>;
pub type StoredMembership = openraft::StoredMembership<NodeId, Controller>;
pub type StorageError = openraft::StorageError<NodeId>;

/// A storage error for openraft from anything displayable.
fn io_error(make: fn(openraft::AnyError) -> openraft::StorageIOError<NodeId>, e: impl fmt::Display) -> StorageError {
    StorageError::from(make(openraft::AnyError::error(e)))
}
