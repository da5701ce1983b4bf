//! Where received messages meet the receives that want them. Shared by every transport.

use std::collections::HashMap;
use std::sync::{Arc, Mutex};
use std::time::Duration;

use tokio::sync::{oneshot, Notify};

use super::Payload;
use crate::error::Rank;
use crate::wire::{Tag, WireError};
use crate::ClusterError;

/// Which peer losses fail a receive (besides the loss of the peer received from, which always does).
#[derive(Clone, Debug, PartialEq, Eq)]
pub enum LossScope {
    /// Only the loss of the peer received from (point-to-point).
    Peer,
    /// The loss of any peer of the transport: a collective among all its ranks cannot complete once
    /// one is gone.
    Group,
    /// The loss of one of these ranks (in the transport's numbering): a collective among a subset of
    /// the transport's ranks ([`super::subgroup::Subgroup`]), which the loss of a rank outside it
    /// does not concern.
    Members(Arc<[Rank]>),
}

impl LossScope {
    /// Whether the loss of `peer` fails a receive in this scope from a peer other than `peer`.
    pub fn covers(&self, peer: Rank) -> bool {
        match self {
            LossScope::Peer => false,
            LossScope::Group => true,
            LossScope::Members(members) => members.contains(&peer),
        }
    }
}

type Key = (Rank, Tag);
type Waiter = oneshot::Sender<Result<Payload, ClusterError>>;

#[derive(Default)]
struct State {
    arrived: HashMap<Key, Payload>,
    arrived_per_peer: HashMap<Rank, usize>,
    waiting: HashMap<Key, (LossScope, Waiter)>,
    fenced_epoch: u64,
    /// Peers whose connection failed (not a goodbye), with the reason.
    lost: HashMap<Rank, String>,
    /// The first of them.
    first_lost: Option<(Rank, String)>,
    /// Peers that said goodbye.
    departed: HashMap<Rank, ()>,
    /// Peers that announced they finished (their connection may still carry unread data).
    finished: std::collections::HashSet<Rank>,
    closed: bool,
}

pub struct Mailbox {
    rank: Rank,
    unmatched_messages_max: usize,
    state: Mutex<State>,
    /// Woken on every loss, for [`Mailbox::any_loss`].
    losses: Notify,
}

impl Mailbox {
    pub fn new(rank: Rank, unmatched_messages_max: usize) -> Self {
        Mailbox { rank, unmatched_messages_max, state: Mutex::new(State::default()), losses: Notify::new() }
    }

    fn lock(&self) -> std::sync::MutexGuard<'_, State> {
        self.state.lock().unwrap_or_else(|p| p.into_inner())
    }

    /// A complete message arrived. An error means the peer broke the protocol; close its connection.
    pub fn deliver(&self, from: Rank, tag: Tag, payload: Payload) -> Result<(), WireError> {
        let mut s = self.lock();
        if tag.epoch < s.fenced_epoch {
            tracing::debug!(rank = self.rank, from, ?tag, fenced = s.fenced_epoch, "dropping stale-epoch message");
            return Ok(());
        }
        let key = (from, tag);
        if let Some((_, waiter)) = s.waiting.remove(&key) {
            let _ = waiter.send(Ok(payload));
            return Ok(());
        }
        if s.arrived.contains_key(&key) {
            return Err(WireError::Protocol(format!("duplicate message {tag:?}")));
        }
        let count = s.arrived_per_peer.entry(from).or_default();
        if *count >= self.unmatched_messages_max {
            return Err(WireError::Protocol(format!(
                "more than unmatched_messages_max = {} unreceived messages",
                self.unmatched_messages_max
            )));
        }
        *count += 1;
        s.arrived.insert(key, payload);
        Ok(())
    }

    fn lost_error(&self, peer: Rank, epoch: u64, reason: &str) -> ClusterError {
        ClusterError::PeerLost { rank: self.rank, peer, epoch, reason: reason.to_string() }
    }

    /// The connection to `peer` failed. Fails every receive that this loss affects.
    pub fn peer_lost(&self, peer: Rank, reason: String) {
        let mut s = self.lock();
        if s.departed.contains_key(&peer) || s.lost.contains_key(&peer) {
            return;
        }
        tracing::warn!(rank = self.rank, peer, %reason, "peer lost");
        s.lost.insert(peer, reason.clone());
        s.first_lost.get_or_insert_with(|| (peer, reason.clone()));
        self.losses.notify_waiters();
        let keys: Vec<Key> = s
            .waiting
            .iter()
            .filter(|((from, _), (scope, _))| *from == peer || scope.covers(peer))
            .map(|(k, _)| *k)
            .collect();
        for key in keys {
            if let Some((_, w)) = s.waiting.remove(&key) {
                let _ = w.send(Err(self.lost_error(peer, key.1.epoch, &reason)));
            }
        }
    }

    /// `peer` said goodbye: only receives from it fail from now on.
    pub fn peer_departed(&self, peer: Rank) {
        let mut s = self.lock();
        s.departed.insert(peer, ());
        let keys: Vec<Key> = s.waiting.keys().filter(|(from, _)| *from == peer).copied().collect();
        for key in keys {
            if let Some((_, w)) = s.waiting.remove(&key) {
                let _ = w.send(Err(self.lost_error(peer, key.1.epoch, "peer departed")));
            }
        }
    }

    /// `peer` announced it has finished all its collectives: closing our side is now safe for it.
    pub fn peer_finished(&self, peer: Rank) {
        self.lock().finished.insert(peer);
    }

    /// Whether every peer in `peers` has finished or is gone.
    pub fn all_finished_or_gone(&self, peers: impl IntoIterator<Item = Rank>) -> bool {
        let s = self.lock();
        peers.into_iter().all(|p| s.finished.contains(&p) || s.lost.contains_key(&p) || s.departed.contains_key(&p))
    }

    /// Waits until some peer is lost (a failed connection, not a goodbye); gives the first one lost and
    /// why. At once when one already was.
    pub async fn any_loss(&self) -> (Rank, String) {
        loop {
            let notified = self.losses.notified();
            tokio::pin!(notified);
            notified.as_mut().enable();
            if let Some(first) = self.lock().first_lost.clone() {
                return first;
            }
            notified.await;
        }
    }

    /// Waits until one of `peers` is lost (a failed connection, not a goodbye); gives it and why. At
    /// once when one already was (the first of `peers` that was).
    pub async fn loss_among(&self, peers: &[Rank]) -> (Rank, String) {
        loop {
            let notified = self.losses.notified();
            tokio::pin!(notified);
            notified.as_mut().enable();
            {
                let s = self.lock();
                if let Some(lost) = peers.iter().find_map(|p| s.lost.get(p).map(|why| (*p, why.clone()))) {
                    return lost;
                }
            }
            notified.await;
        }
    }

    /// Why `peer` was lost, if it was.
    pub fn lost_reason(&self, peer: Rank) -> Option<String> {
        self.lock().lost.get(&peer).cloned()
    }

    /// Why `peer` can no longer take part, if it cannot: lost (with the reason) or departed.
    pub fn gone(&self, peer: Rank) -> Option<String> {
        let s = self.lock();
        s.lost.get(&peer).cloned().or_else(|| s.departed.contains_key(&peer).then(|| "peer departed".to_string()))
    }

    pub fn fence(&self, epoch: u64) {
        let mut s = self.lock();
        if epoch <= s.fenced_epoch {
            return;
        }
        s.fenced_epoch = epoch;
        let stale: Vec<Key> = s.arrived.keys().filter(|(_, t)| t.epoch < epoch).copied().collect();
        for key in stale {
            s.arrived.remove(&key);
            if let Some(c) = s.arrived_per_peer.get_mut(&key.0) {
                *c = c.saturating_sub(1);
            }
        }
        let stale: Vec<Key> = s.waiting.keys().filter(|(_, t)| t.epoch < epoch).copied().collect();
        for key in stale {
            if let Some((_, w)) = s.waiting.remove(&key) {
                let _ = w.send(Err(ClusterError::StaleEpoch {
                    rank: self.rank,
                    op: "recv",
                    epoch: key.1.epoch,
                    fenced_at: epoch,
                }));
            }
        }
    }

    pub fn close(&self) {
        let mut s = self.lock();
        s.closed = true;
        for (_, (_, w)) in s.waiting.drain() {
            let _ = w.send(Err(ClusterError::Closed { rank: self.rank }));
        }
    }

    pub async fn recv(&self, from: Rank, tag: Tag, scope: LossScope, timeout_ms: u64) -> Result<Payload, ClusterError> {
        let rx = {
            let mut s = self.lock();
            if s.closed {
                return Err(ClusterError::Closed { rank: self.rank });
            }
            if tag.epoch < s.fenced_epoch {
                return Err(ClusterError::StaleEpoch {
                    rank: self.rank,
                    op: "recv",
                    epoch: tag.epoch,
                    fenced_at: s.fenced_epoch,
                });
            }
            let key = (from, tag);
            if let Some(p) = s.arrived.remove(&key) {
                if let Some(c) = s.arrived_per_peer.get_mut(&from) {
                    *c = c.saturating_sub(1);
                }
                return Ok(p);
            }
            if let Some(reason) = s.lost.get(&from) {
                return Err(self.lost_error(from, tag.epoch, reason));
            }
            if s.departed.contains_key(&from) {
                return Err(self.lost_error(from, tag.epoch, "peer departed"));
            }
            if let Some((peer, reason)) = s.lost.iter().find(|(peer, _)| scope.covers(**peer)) {
                return Err(self.lost_error(*peer, tag.epoch, reason));
            }
            let (tx, rx) = oneshot::channel();
            s.waiting.insert(key, (scope, tx));
            rx
        };
        match tokio::time::timeout(Duration::from_millis(timeout_ms), rx).await {
            Ok(Ok(result)) => result,
            Ok(Err(_)) => Err(ClusterError::Closed { rank: self.rank }),
            Err(_) => {
                self.lock().waiting.remove(&(from, tag));
                Err(ClusterError::Timeout {
                    rank: self.rank,
                    op: "recv",
                    group: tag.group,
                    epoch: tag.epoch,
                    seq: tag.seq,
                    peer: from,
                    waited_ms: timeout_ms,
                })
            }
        }
    }
}

#[cfg(test)]
mod tests {
    use bytes::Bytes;

    use super::*;

    fn tag(seq: u64) -> Tag {
        Tag { group: 0, epoch: 1, seq, step: 0 }
    }

    fn message() -> Payload {
        Payload::from(Bytes::from_static(b"x"))
    }

    /// A receive among members 0..=2 outlives the loss of rank 3 (waiting, and started after it) and
    /// fails on the loss of member 2, naming it; a group receive fails on either.
    #[tokio::test]
    async fn a_members_receive_fails_on_the_loss_of_a_member_only() {
        let mailbox = Mailbox::new(0, 16);
        let members = LossScope::Members(vec![0, 1, 2].into());
        let waiting = mailbox.recv(1, tag(0), members.clone(), 10_000);
        let (got, ()) = tokio::join!(waiting, async {
            mailbox.peer_lost(3, "killed".into());
            mailbox.deliver(1, tag(0), message()).expect("delivered");
        });
        assert_eq!(got.expect("rank 3 is not a member").to_vec(), b"x");
        let after = mailbox.recv(1, tag(1), members.clone(), 30).await;
        assert!(matches!(after, Err(ClusterError::Timeout { peer: 1, .. })), "{after:?}");
        let group = mailbox.recv(1, tag(1), LossScope::Group, 10_000).await;
        assert!(matches!(group, Err(ClusterError::PeerLost { peer: 3, .. })), "{group:?}");

        let waiting = mailbox.recv(1, tag(2), members.clone(), 10_000);
        let (got, ()) = tokio::join!(waiting, async { mailbox.peer_lost(2, "killed".into()) });
        assert!(matches!(got, Err(ClusterError::PeerLost { rank: 0, peer: 2, .. })), "{got:?}");
        let after = mailbox.recv(1, tag(3), members, 10_000).await;
        assert!(matches!(after, Err(ClusterError::PeerLost { peer: 2, .. })), "{after:?}");
        let p2p = mailbox.recv(1, tag(3), LossScope::Peer, 30).await;
        assert!(matches!(p2p, Err(ClusterError::Timeout { .. })), "{p2p:?}");
    }

    #[tokio::test]
    async fn loss_among_waits_for_one_of_its_peers() {
        let mailbox = Mailbox::new(0, 16);
        mailbox.peer_lost(3, "killed".into());
        let early = tokio::time::timeout(Duration::from_millis(30), mailbox.loss_among(&[1, 2])).await;
        assert!(early.is_err(), "rank 3 is not among them: {early:?}");
        let (lost, ()) = tokio::join!(mailbox.loss_among(&[1, 2]), async { mailbox.peer_lost(2, "gone".into()) });
        assert_eq!(lost, (2, "gone".to_string()));
    }
}
