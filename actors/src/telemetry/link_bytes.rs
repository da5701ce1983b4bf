//! Bytes per link: a [`Transport`] wrapper that counts the payload bytes a rank sends to and receives
//! from each peer, into per-peer-node counters the daemon's `/metrics` reports
//! (`troupe_link_bytes_total{peer, direction}`). Two relaxed atomic additions per message: free next to
//! the bytes themselves.

use std::collections::BTreeMap;
use std::future::Future;
use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::{Arc, Mutex};

use bytes::Bytes;
use troupe_cluster::transport::{LossScope, Payload, Transport};
use troupe_cluster::wire::Tag;
use troupe_cluster::ClusterError;

/// One peer node's counters.
#[derive(Debug, Default)]
pub struct LinkCounters {
    pub sent: AtomicU64,
    pub received: AtomicU64,
}

/// Every peer node's counters, over every attempt of every job on this daemon.
#[derive(Debug, Default)]
pub struct LinkBytes {
    links: Mutex<BTreeMap<String, Arc<LinkCounters>>>,
}

impl LinkBytes {
    pub fn link(&self, peer: &str) -> Arc<LinkCounters> {
        self.links.lock().unwrap_or_else(|p| p.into_inner()).entry(peer.to_owned()).or_default().clone()
    }

    /// (peer, bytes sent, bytes received), by peer name.
    pub fn snapshot(&self) -> Vec<(String, u64, u64)> {
        let links = self.links.lock().unwrap_or_else(|p| p.into_inner());
        links
            .iter()
            .map(|(p, c)| (p.clone(), c.sent.load(Ordering::Relaxed), c.received.load(Ordering::Relaxed)))
            .collect()
    }
}

/// A transport whose traffic is counted per peer (`peers[rank]` names rank's node).
#[derive(Debug)]
pub struct Counted<T> {
    inner: Arc<T>,
    links: Vec<Arc<LinkCounters>>,
    /// Everything this wrapper sent, to any peer ([`Transport::sent_bytes`]: what a communicator over it
    /// attributes to each of its calls).
    sent: AtomicU64,
}

impl<T: Transport> Counted<T> {
    pub fn new(inner: Arc<T>, peers: &[String], registry: &LinkBytes) -> Self {
        Counted { inner, links: peers.iter().map(|p| registry.link(p)).collect(), sent: AtomicU64::new(0) }
    }

    /// A transport whose traffic to and from every peer adds up in one pair of counters, `total`.
    pub fn total(inner: Arc<T>, total: Arc<LinkCounters>) -> Self {
        let links = (0..inner.world()).map(|_| total.clone()).collect();
        Counted { inner, links, sent: AtomicU64::new(0) }
    }
}

impl<T: Transport> Transport for Counted<T> {
    fn rank(&self) -> usize {
        self.inner.rank()
    }

    fn world(&self) -> usize {
        self.inner.world()
    }

    fn send(&self, to: usize, tag: Tag, payload: Bytes) -> impl Future<Output = Result<(), ClusterError>> + Send {
        self.sent.fetch_add(payload.len() as u64, Ordering::Relaxed);
        if let Some(link) = self.links.get(to) {
            link.sent.fetch_add(payload.len() as u64, Ordering::Relaxed);
        }
        self.inner.send(to, tag, payload)
    }

    fn copies_on_send(&self, to: usize) -> bool {
        self.inner.copies_on_send(to)
    }

    fn send_slice(&self, to: usize, tag: Tag, data: &[u8]) -> impl Future<Output = Result<(), ClusterError>> + Send {
        self.sent.fetch_add(data.len() as u64, Ordering::Relaxed);
        if let Some(link) = self.links.get(to) {
            link.sent.fetch_add(data.len() as u64, Ordering::Relaxed);
        }
        self.inner.send_slice(to, tag, data)
    }

    async fn recv(&self, from: usize, tag: Tag, scope: LossScope, timeout_ms: u64) -> Result<Payload, ClusterError> {
        let payload = self.inner.recv(from, tag, scope, timeout_ms).await?;
        if let Some(link) = self.links.get(from) {
            link.received.fetch_add(payload.len() as u64, Ordering::Relaxed);
        }
        Ok(payload)
    }

    fn fence(&self, epoch: u64) {
        self.inner.fence(epoch);
    }

    fn any_loss(&self) -> impl Future<Output = (usize, String)> + Send {
        self.inner.any_loss()
    }

    fn loss_among(&self, peers: &[usize]) -> impl Future<Output = (usize, String)> + Send {
        self.inner.loss_among(peers)
    }

    fn shutdown(&self) -> impl Future<Output = ()> + Send {
        self.inner.shutdown()
    }

    fn arena(&self) -> Option<std::sync::Arc<troupe_cluster::transport::shm::Arena>> {
        self.inner.arena()
    }

    fn sent_bytes(&self) -> Option<u64> {
        Some(self.sent.load(Ordering::Relaxed))
    }

    fn arena_traffic(&self, peer: usize, sent_bytes: u64, received_bytes: u64) {
        self.sent.fetch_add(sent_bytes, Ordering::Relaxed);
        if let Some(link) = self.links.get(peer) {
            link.sent.fetch_add(sent_bytes, Ordering::Relaxed);
            link.received.fetch_add(received_bytes, Ordering::Relaxed);
        }
    }
}

#[cfg(test)]
mod tests {
    use troupe_cluster::transport::memory::MemoryTransport;

    use super::*;

    #[tokio::test]
    async fn counts_what_each_rank_sends_and_receives_per_peer() {
        let mut mesh = MemoryTransport::mesh(2, 16).into_iter();
        let (a, b) = (Arc::new(mesh.next().unwrap()), Arc::new(mesh.next().unwrap()));
        let peers = ["node-a".to_owned(), "node-b".to_owned()];
        let (on_a, on_b) = (LinkBytes::default(), LinkBytes::default());
        let (a, b) = (Counted::new(a, &peers, &on_a), Counted::new(b, &peers, &on_b));
        a.send(1, Tag::default(), Bytes::from(vec![7u8; 100])).await.unwrap();
        let got = b.recv(0, Tag::default(), LossScope::Peer, 5_000).await.unwrap();
        assert_eq!(got.len(), 100);
        assert_eq!(on_a.snapshot(), vec![("node-a".into(), 0, 0), ("node-b".into(), 100, 0)]);
        assert_eq!(on_b.snapshot(), vec![("node-a".into(), 0, 100), ("node-b".into(), 0, 0)]);
    }
}
