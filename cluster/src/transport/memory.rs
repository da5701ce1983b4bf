//! In-memory transport: every rank's mailbox in one process. For tests and simulation; `kill` makes a
//! rank vanish the way a crashed process would.

use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::Arc;

use bytes::Bytes;

use super::{LossScope, Mailbox, Payload, Transport};
use crate::error::Rank;
use crate::wire::Tag;
use crate::ClusterError;

struct Shared {
    mailboxes: Vec<Mailbox>,
    dead: Vec<AtomicBool>,
}

#[derive(Clone)]
pub struct MemoryTransport {
    rank: Rank,
    shared: Arc<Shared>,
}

impl MemoryTransport {
    /// One transport per rank, all connected.
    pub fn mesh(world: usize, unmatched_messages_max: usize) -> Vec<MemoryTransport> {
        let shared = Arc::new(Shared {
            mailboxes: (0..world).map(|r| Mailbox::new(r, unmatched_messages_max)).collect(),
            dead: (0..world).map(|_| AtomicBool::new(false)).collect(),
        });
        (0..world).map(|rank| MemoryTransport { rank, shared: shared.clone() }).collect()
    }

    /// Simulates a crash of this rank: every other rank sees it lost.
    pub fn kill(&self) {
        self.shared.dead[self.rank].store(true, Ordering::SeqCst);
        self.shared.mailboxes[self.rank].close();
        for (r, mb) in self.shared.mailboxes.iter().enumerate() {
            if r != self.rank {
                mb.peer_lost(self.rank, "killed".into());
            }
        }
    }
}

impl Transport for MemoryTransport {
    fn rank(&self) -> Rank {
        self.rank
    }

    fn world(&self) -> usize {
        self.shared.mailboxes.len()
    }

    async fn send(&self, to: Rank, tag: Tag, payload: Bytes) -> Result<(), ClusterError> {
        if self.shared.dead[self.rank].load(Ordering::SeqCst) {
            return Err(ClusterError::Closed { rank: self.rank });
        }
        if self.shared.dead[to].load(Ordering::SeqCst) {
            return Err(ClusterError::PeerLost {
                rank: self.rank,
                peer: to,
                epoch: tag.epoch,
                reason: "killed".into(),
            });
        }
        self.shared.mailboxes[to].deliver(self.rank, tag, Payload::from(payload)).map_err(|source| ClusterError::Wire {
            rank: to,
            peer: self.rank,
            source,
        })
    }

    async fn recv(&self, from: Rank, tag: Tag, scope: LossScope, timeout_ms: u64) -> Result<Payload, ClusterError> {
        self.shared.mailboxes[self.rank].recv(from, tag, scope, timeout_ms).await
    }

    fn fence(&self, epoch: u64) {
        self.shared.mailboxes[self.rank].fence(epoch);
    }

    async fn any_loss(&self) -> (Rank, String) {
        self.shared.mailboxes[self.rank].any_loss().await
    }

    async fn loss_among(&self, peers: &[Rank]) -> (Rank, String) {
        self.shared.mailboxes[self.rank].loss_among(peers).await
    }

    async fn shutdown(&self) {
        for (r, mb) in self.shared.mailboxes.iter().enumerate() {
            if r != self.rank {
                mb.peer_departed(self.rank);
            }
        }
    }
}
