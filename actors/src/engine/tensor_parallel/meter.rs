//! What a tensor-parallel rank sends in a step, measured: each of its groups' communicators runs over a
//! transport that counts the payload bytes it hands on ([`Counted::total`]), and each call notes the
//! counter's growth and its own duration under its group and collective. The engine clears the
//! [`Meter`] when a step starts and reads it when the rank votes ([`crate::protocol::RankUsage`]).

use std::sync::atomic::Ordering;
use std::sync::{Arc, Mutex};
use std::time::Instant;

use troupe_cluster::collective::{Collective, CollectiveConfig, Communicator, ReduceOp};
use troupe_cluster::transport::subgroup::Subgroup;
use troupe_cluster::transport::Transport;
use troupe_cluster::ClusterError;

use crate::protocol::{CollectiveKind, GroupKind, SentBytes};
use crate::telemetry::link_bytes::{Counted, LinkCounters};

/// The step's lines so far, by (group, collective); shared by the rank's metered communicators.
#[derive(Clone, Default)]
pub(super) struct Meter(Arc<Mutex<Vec<SentBytes>>>);

impl Meter {
    pub(super) fn add(&self, group: GroupKind, collective: CollectiveKind, bytes: u64, seconds: f64) {
        let mut lines = self.0.lock().unwrap_or_else(|p| p.into_inner());
        match lines.iter_mut().find(|l| l.group == group && l.collective == collective) {
            Some(line) => {
                line.calls += 1;
                line.bytes += bytes;
                line.seconds += seconds;
            }
            None => lines.push(SentBytes { group, collective, calls: 1, bytes, seconds }),
        }
    }

    /// The lines since the last call, by group then collective; starts again from none.
    pub fn take(&self) -> Vec<SentBytes> {
        let mut lines = std::mem::take(&mut *self.0.lock().unwrap_or_else(|p| p.into_inner()));
        lines.sort_by_key(|l| (l.group, l.collective));
        lines
    }
}

/// A communicator over a subgroup whose calls are metered as `group`'s.
pub(super) struct Metered<T: Transport> {
    comm: Communicator<Counted<Subgroup<T>>>,
    counted: Arc<LinkCounters>,
    group: GroupKind,
    meter: Meter,
}

impl<T: Transport> Metered<T> {
    pub fn new(
        transport: Arc<Subgroup<T>>,
        id: u32,
        epoch: u64,
        config: CollectiveConfig,
        group: GroupKind,
        meter: &Meter,
    ) -> Self {
        let counted = Arc::new(LinkCounters::default());
        let transport = Arc::new(Counted::total(transport, counted.clone()));
        Self { comm: Communicator::new(transport, id, epoch, config), counted, group, meter: meter.clone() }
    }

    pub fn rank(&self) -> usize {
        self.comm.rank()
    }

    pub fn world(&self) -> usize {
        self.comm.world()
    }

    fn mark(&self) -> (Instant, u64) {
        (Instant::now(), self.counted.sent.load(Ordering::Relaxed))
    }

    fn note<R>(&self, collective: CollectiveKind, (at, before): (Instant, u64), result: R) -> R {
        let bytes = self.counted.sent.load(Ordering::Relaxed).saturating_sub(before);
        self.meter.add(self.group, collective, bytes, at.elapsed().as_secs_f64());
        result
    }

    pub async fn all_reduce(&mut self, data: &mut [f32], op: ReduceOp) -> Result<(), ClusterError> {
        let mark = self.mark();
        let result = self.comm.all_reduce(data, op).await;
        self.note(CollectiveKind::AllReduce, mark, result)
    }

    pub async fn all_gather(&mut self, input: &[f32], output: &mut [f32]) -> Result<(), ClusterError> {
        let mark = self.mark();
        let result = self.comm.all_gather(input, output).await;
        self.note(CollectiveKind::AllGather, mark, result)
    }

    pub async fn reduce_scatter(
        &mut self,
        input: &[f32],
        output: &mut [f32],
        op: ReduceOp,
    ) -> Result<(), ClusterError> {
        let mark = self.mark();
        let result = self.comm.reduce_scatter(input, output, op).await;
        self.note(CollectiveKind::ReduceScatter, mark, result)
    }

    pub async fn send(&mut self, to: usize, data: &[f32]) -> Result<(), ClusterError> {
        let mark = self.mark();
        let result = self.comm.send(to, data).await;
        self.note(CollectiveKind::Send, mark, result)
    }

    /// A receive: its wait is the pipeline's, counted under `send` with no bytes.
    pub async fn recv(&mut self, from: usize, out: &mut [f32]) -> Result<(), ClusterError> {
        let mark = self.mark();
        let result = self.comm.recv(from, out).await;
        self.note(CollectiveKind::Send, mark, result)
    }
}

#[cfg(test)]
mod tests {
    use troupe_cluster::transport::memory::MemoryTransport;

    use super::*;

    /// Two ranks: an all-reduce of 1,000 floats sends what a ring sends (2(n−1)/n × 4,000 bytes = 4,000),
    /// an all-gather of 500 each 2,000, a send its payload; the lines come back by group and collective.
    #[tokio::test]
    async fn each_call_is_noted_with_the_bytes_its_rank_sent() {
        let meters = [Meter::default(), Meter::default()];
        let mut ranks: Vec<Metered<MemoryTransport>> = MemoryTransport::mesh(2, 64)
            .into_iter()
            .zip(&meters)
            .map(|(t, meter)| {
                let group = Arc::new(Subgroup::new(Arc::new(t), vec![0, 1]).unwrap());
                let config = CollectiveConfig {
                    small_message_bytes_max: 0,
                    pipeline_slice_bytes: 1 << 20,
                    collective_timeout_ms: 5_000,
                };
                Metered::new(group, 7, 1, config, GroupKind::Tensor, meter)
            })
            .collect();
        let (mut b, mut a) = (ranks.pop().unwrap(), ranks.pop().unwrap());
        let work = |mut m: Metered<MemoryTransport>| async move {
            let mut data = vec![1.0f32; 1000];
            m.all_reduce(&mut data, ReduceOp::Sum).await.unwrap();
            assert!(data.iter().all(|&x| x == 2.0));
            let mut out = vec![0.0f32; 1000];
            m.all_gather(&data[..500], &mut out).await.unwrap();
            match m.rank() {
                0 => m.send(1, &[1.0; 10]).await.unwrap(),
                _ => m.recv(0, &mut [0.0; 10]).await.unwrap(),
            }
            m
        };
        (a, b) = tokio::join!(work(a), work(b));
        drop((a, b));
        let [on_0, on_1] = [meters[0].take(), meters[1].take()];
        let line = |lines: &[SentBytes], c| lines.iter().find(|l| l.collective == c).map(|l| (l.calls, l.bytes));
        assert_eq!(line(&on_0, CollectiveKind::AllReduce), Some((1, 4_000)));
        assert_eq!(line(&on_0, CollectiveKind::AllGather), Some((1, 2_000)));
        assert_eq!(line(&on_0, CollectiveKind::Send), Some((1, 40)));
        assert_eq!(line(&on_1, CollectiveKind::Send), Some((1, 0)), "a receive sends nothing");
        assert!(on_0.windows(2).all(|w| (w[0].group, w[0].collective) < (w[1].group, w[1].collective)));
        assert!(meters[0].take().is_empty(), "taking the lines clears them");
    }
}
