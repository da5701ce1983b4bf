//! One outbox per peer: the node actor hands a control message to the peer's queue and goes on; a task
//! per peer writes the queue in order. A peer that stops reading (QUIC flow control holds its stream)
//! then delays only the messages to that peer — never the node's heartbeats, its answers to other
//! peers, or its failure detection, which an inline `send(...).await` of up to the send timeout did.
//!
//! Ordering is unchanged: one queue and one writer per peer keep the messages to a peer in the order
//! they were handed over (what the commit protocol relies on: `Commit` to every rank before any `Abort`).
//! A lane lives as long as the node: a peer that reconnects keeps its lane, so messages queued before
//! and after the reconnection cannot overtake each other (the lanes are a task and a channel per peer
//! name ever addressed).

use std::collections::HashMap;
use std::time::Duration;

use bytes::Bytes;
use tokio::sync::mpsc;
use tokio::task::JoinHandle;
use troupe_cluster::control::ControlEndpoint;

/// Bound on writing one control message (a peer that stopped reading must not hold its queue forever).
pub const SEND_TIMEOUT: Duration = Duration::from_secs(2);
/// Messages queued for one peer before new ones are dropped (and logged): a peer that far behind is
/// not reading, and the failure detector is about to remove it.
pub const QUEUE_MAX: usize = 4096;

struct Lane {
    tx: mpsc::Sender<(u64, Bytes)>,
    task: JoinHandle<()>,
}

pub struct Outboxes {
    endpoint: ControlEndpoint,
    node: String,
    lanes: HashMap<String, Lane>,
}

impl Outboxes {
    pub fn new(endpoint: ControlEndpoint, node: String) -> Self {
        Self { endpoint, node, lanes: HashMap::new() }
    }

    /// Queues `body` (stamped with `epoch`) for `peer`. Never waits.
    pub fn send(&mut self, peer: &str, epoch: u64, body: Bytes) {
        let lane = self.lanes.entry(peer.to_owned()).or_insert_with(|| spawn_lane(&self.endpoint, &self.node, peer));
        match lane.tx.try_send((epoch, body)) {
            Ok(()) => {}
            Err(mpsc::error::TrySendError::Full(_)) => {
                tracing::warn!(node = %self.node, peer, "dropping a control message: {QUEUE_MAX} are queued for a peer that is not reading");
            }
            Err(mpsc::error::TrySendError::Closed(message)) => {
                // The writer ended (it never does on its own; a panic): start a new one.
                let lane = spawn_lane(&self.endpoint, &self.node, peer);
                let _ = lane.tx.try_send(message);
                self.lanes.insert(peer.to_owned(), lane);
            }
        }
    }

    /// Closes every lane: each writer finishes what is queued and ends (later sends start new lanes).
    /// Returns the writers, for [`written`].
    pub fn close(&mut self) -> Vec<JoinHandle<()>> {
        self.lanes.drain().map(|(_, lane)| lane.task).collect()
    }
}

/// Waits until the closed `writers` have written everything (or `limit` passes), e.g. a `Leave` before
/// the endpoint closes.
pub async fn written(writers: Vec<JoinHandle<()>>, limit: Duration) {
    let all = async {
        for writer in writers {
            let _ = writer.await;
        }
    };
    if tokio::time::timeout(limit, all).await.is_err() {
        tracing::warn!("control messages still queued after {limit:?}; closing anyway");
    }
}

fn spawn_lane(endpoint: &ControlEndpoint, node: &str, peer: &str) -> Lane {
    let (tx, mut rx) = mpsc::channel::<(u64, Bytes)>(QUEUE_MAX);
    let (endpoint, node, peer) = (endpoint.clone(), node.to_owned(), peer.to_owned());
    let task = tokio::spawn(async move {
        while let Some((epoch, body)) = rx.recv().await {
            match tokio::time::timeout(SEND_TIMEOUT, endpoint.send(&peer, epoch, body)).await {
                Ok(Ok(())) => {}
                Ok(Err(e)) => tracing::debug!(node, peer, error = %e, "control send failed"),
                Err(_) => tracing::warn!(node, peer, "control send timed out after {SEND_TIMEOUT:?}"),
            }
        }
    });
    Lane { tx, task }
}
