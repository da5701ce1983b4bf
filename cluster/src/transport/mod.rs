//! Moving tagged messages between ranks. One trait, three implementations: QUIC between hosts
//! ([`quic`]), Unix sockets between processes on one host ([`same_host`]), and in-memory channels for
//! tests and simulation ([`memory`]). A job may opt into a TCP data plane between hosts ([`tcp`]) —
//! TLS 1.3 with the cluster's certificates, or plaintext for trusted fabrics — set up and watched
//! through the QUIC mesh. The same-host transport also sets up a shared-memory arena
//! ([`shm`]) in which the collectives run without messages.
//!
//! A message is addressed by (peer, [`Tag`]); receives match exactly. Messages may arrive before the
//! receive that wants them (they wait in the [`Mailbox`], bounded) and are dropped if their epoch is
//! below the fence.

mod frame_io;
mod mailbox;
pub mod memory;
pub mod quic;
pub mod routed;
pub mod same_host;
pub mod shm;
mod stream_mesh;
pub mod subgroup;
pub mod tcp;

use std::future::Future;

use bytes::Bytes;

pub use frame_io::{
    frame_control, frame_message, frame_parts, read_message, read_message_with, FrameLimits, ReadOutcome, SegmentReader,
};
pub use mailbox::{LossScope, Mailbox};

use crate::error::Rank;
use crate::wire::Tag;
use crate::ClusterError;

/// A received message: its bytes, possibly in several segments (each a multiple of 8 bytes long except
/// the last), in order.
#[derive(Debug, Default, Clone)]
pub struct Payload {
    pub segments: Vec<Bytes>,
}

impl Payload {
    pub fn len(&self) -> usize {
        self.segments.iter().map(|s| s.len()).sum()
    }

    pub fn is_empty(&self) -> bool {
        self.len() == 0
    }

    pub fn to_vec(&self) -> Vec<u8> {
        self.segments.iter().flat_map(|s| s.iter().copied()).collect()
    }
}

impl From<Bytes> for Payload {
    fn from(b: Bytes) -> Self {
        Payload { segments: vec![b] }
    }
}

pub trait Transport: Send + Sync + 'static {
    fn rank(&self) -> Rank;
    fn world(&self) -> usize;

    /// Queues `payload` for `to`. Returns once the transport owns it (not once it is delivered).
    fn send(&self, to: Rank, tag: Tag, payload: Bytes) -> impl Future<Output = Result<(), ClusterError>> + Send;

    /// Whether [`Self::send_slice`] to `to` has copied the bytes when it returns (a socket write), so
    /// that a caller can hand over memory it only borrows instead of copying it into a message first.
    fn copies_on_send(&self, _to: Rank) -> bool {
        false
    }

    /// Sends `data`, borrowed: the transport copies what it keeps. Default: into a new message for
    /// [`Self::send`] (a transport that keeps messages until acknowledged, like QUIC, must own them).
    fn send_slice(&self, to: Rank, tag: Tag, data: &[u8]) -> impl Future<Output = Result<(), ClusterError>> + Send {
        self.send(to, tag, Bytes::copy_from_slice(data))
    }

    /// Waits for the message `tag` from `from`. Fails with `PeerLost` when `from` is lost — or, with
    /// [`LossScope::Group`], when any peer is lost; with [`LossScope::Members`], when one of those is —
    /// and with `Timeout` after `timeout_ms`.
    fn recv(
        &self,
        from: Rank,
        tag: Tag,
        scope: LossScope,
        timeout_ms: u64,
    ) -> impl Future<Output = Result<Payload, ClusterError>> + Send;

    /// Refuses messages of epochs below `epoch` from now on and drops any already buffered.
    fn fence(&self, epoch: u64);

    /// Resolves once some peer is lost (a failed connection, not a goodbye) with that peer and why — at
    /// once if one already was. A transport made of others ([`routed`]) fails a group receive waiting on
    /// one of them when the other loses a peer.
    fn any_loss(&self) -> impl Future<Output = (Rank, String)> + Send;

    /// Resolves once one of `peers` (this transport's ranks) is lost, with that peer and why — at once
    /// if one already was: what a [`LossScope::Members`] receive of a transport made of others waits on.
    fn loss_among(&self, peers: &[Rank]) -> impl Future<Output = (Rank, String)> + Send;

    /// The shared-memory arena among all ranks of this transport, when it has one (the same-host
    /// transport does unless disabled): [`crate::collective::Communicator`] then runs its collectives
    /// there instead of over messages.
    fn arena(&self) -> Option<std::sync::Arc<shm::Arena>> {
        None
    }

    /// Bytes a collective in the arena moved between this rank and `peer` (what the peer read from our
    /// segment, what we read from its): for transports that count traffic per link.
    fn arena_traffic(&self, _peer: Rank, _sent_bytes: u64, _received_bytes: u64) {}

    /// Payload bytes this transport has handed on since it was made — messages, and what its arena's
    /// collectives moved ([`Self::arena_traffic`]) — for transports that count them (None otherwise):
    /// what [`crate::collective::Communicator::take_calls`] attributes to each call.
    fn sent_bytes(&self) -> Option<u64> {
        None
    }

    /// Graceful shutdown: waits (bounded) until what was sent is delivered, then says goodbye to every
    /// peer, so they see a departure rather than a loss.
    fn shutdown(&self) -> impl Future<Output = ()> + Send;
}
