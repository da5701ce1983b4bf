//! The link nemesis: what a degraded link does to each packet (lost, held for a delay with jitter, held
//! longer so that later packets overtake it, sent twice), from the scenario's seed — and, where the kernel
//! has no tc netem, a userspace one that applies it: every packet of a node's links goes through a
//! netfilter queue (iptables `-j NFQUEUE` in the node's namespace), and a thread in that namespace holds
//! each for its delay before letting it go ([`super::nfqueue`] does the netlink).
//!
//! [`LinkPlan`] decides, without IO or clocks; [`QueueNemesis`] is the thread that applies the plan
//! and measures what it really did (packets held, how long, how many overtaken).

use std::cmp::Reverse;
use std::collections::BinaryHeap;
use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::Arc;
use std::thread::JoinHandle;
use std::time::{Duration, Instant};

use anyhow::Context;
use serde::Serialize;

use super::nfqueue::{enter_netns, Packet, QueueSocket, RawSender};
use crate::sim::rng::Rng;

/// What a degraded link does to its packets, each way.
#[derive(Clone, Copy, Debug, Default, PartialEq)]
pub struct LinkShape {
    /// Share of packets lost, in percent.
    pub loss_percent: f64,
    /// Every packet held this long ...
    pub delay_ms: u64,
    /// ... plus or minus up to this much (uniform), so packets close together may swap.
    pub delay_jitter_ms: u64,
    /// Share of packets held `reorder_ms` longer than the rest, so that packets sent after them overtake
    /// them, in percent.
    pub reorder_percent: f64,
    pub reorder_ms: u64,
    /// Share of packets sent twice, in percent (the packets the node sends; see the guide).
    pub duplicate_percent: f64,
}

/// What becomes of one packet.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Fate {
    Drop,
    Pass { hold: Duration, duplicate: bool },
}

/// The per-packet decisions of a link, from a seed.
pub struct LinkPlan {
    shape: LinkShape,
    rng: Rng,
}

impl LinkPlan {
    pub fn new(shape: LinkShape, seed: u64) -> Self {
        LinkPlan { shape, rng: Rng::new(seed) }
    }

    fn percent(&mut self, p: f64) -> bool {
        p > 0.0 && (self.rng.below(1_000_000) as f64) < p * 10_000.0
    }

    pub fn fate(&mut self) -> Fate {
        let s = self.shape;
        if self.percent(s.loss_percent) {
            return Fate::Drop;
        }
        let jitter = self.rng.range(0, 2 * s.delay_jitter_ms);
        let mut hold_ms = (s.delay_ms + jitter).saturating_sub(s.delay_jitter_ms);
        if self.percent(s.reorder_percent) {
            hold_ms += s.reorder_ms;
        }
        Fate::Pass { hold: Duration::from_millis(hold_ms), duplicate: self.percent(s.duplicate_percent) }
    }
}

/// What a link fault did, as measured (NFQUEUE), or how it was applied (tc netem: the kernel counts).
#[derive(Clone, Debug, Default, Serialize, PartialEq)]
pub struct LinkStats {
    /// The daemon whose links were degraded.
    pub node: String,
    /// `nfqueue` (the userspace nemesis) or `tc netem`.
    pub mechanism: String,
    /// Packets that went through the nemesis (NFQUEUE only, as are the counts below).
    pub packets: u64,
    pub dropped: u64,
    /// Packets held before being let go.
    pub delayed: u64,
    /// Packets let go after a packet that reached the nemesis later than they did.
    pub reordered: u64,
    pub duplicated: u64,
    /// Mean time a packet that passed was held, measured from its arrival to its verdict.
    pub mean_hold_ms: f64,
    /// Median time between two committed steps before the fault, and the mean time a step took while
    /// it held (its duration over the steps committed in it), from the job's events: the delay made real.
    pub step_ms_before: Option<f64>,
    pub step_ms_during: Option<f64>,
}

/// The firewall mark of duplicates the nemesis sends itself, which its queue rule lets pass.
pub const DUPLICATE_MARK: u32 = 0x7ce;
/// The queue number in each namespace (queues are per namespace).
pub const QUEUE: u16 = 7;

/// Whether this machine can queue packets to userspace: a queue bound in namespace `ns`. Err: why not.
pub fn probe(ns: &str) -> Result<(), String> {
    let ns = ns.to_owned();
    std::thread::spawn(move || {
        enter_netns(&ns)?;
        QueueSocket::bind(QUEUE, false, 16).map(drop)
    })
    .join()
    .map_err(|_| "the NFQUEUE probe panicked".to_owned())?
    .map_err(|e| format!("no NFQUEUE (CONFIG_NETFILTER_NETLINK_QUEUE): {e}"))
}

/// The userspace nemesis of one node's links: a thread in its namespace that holds the queued packets.
pub struct QueueNemesis {
    stop: Arc<AtomicBool>,
    thread: JoinHandle<anyhow::Result<LinkStats>>,
}

impl QueueNemesis {
    /// Binds the queue in namespace `ns` and starts holding what it queues (the caller then installs the
    /// iptables rules that queue the packets). Returns once the queue is bound.
    pub fn start(ns: &str, node: String, shape: LinkShape, seed: u64) -> anyhow::Result<Self> {
        let stop = Arc::new(AtomicBool::new(false));
        let (ready_tx, ready_rx) = std::sync::mpsc::channel();
        let (ns, flag) = (ns.to_owned(), stop.clone());
        let thread = std::thread::Builder::new().name(format!("link-{node}")).spawn(move || {
            let setup = (|| {
                enter_netns(&ns)?;
                let socket = QueueSocket::bind(QUEUE, shape.duplicate_percent > 0.0, 50_000)?;
                let raw = if shape.duplicate_percent > 0.0 { Some(RawSender::open(DUPLICATE_MARK)?) } else { None };
                std::io::Result::Ok((socket, raw))
            })();
            let (socket, raw) = match setup {
                Ok(s) => {
                    let _ = ready_tx.send(Ok(()));
                    s
                }
                Err(e) => {
                    let _ = ready_tx.send(Err(format!("{e}")));
                    anyhow::bail!("{e}");
                }
            };
            let stats = LinkStats { node, mechanism: "nfqueue".into(), ..LinkStats::default() };
            hold_loop(socket, raw, LinkPlan::new(shape, seed), &flag, stats)
        })?;
        match ready_rx.recv() {
            Ok(Ok(())) => Ok(QueueNemesis { stop, thread }),
            Ok(Err(e)) => anyhow::bail!("binding a netfilter queue: {e}"),
            Err(_) => anyhow::bail!("the link nemesis thread died starting"),
        }
    }

    /// Lets every held and queued packet go and returns what the nemesis did. Remove the queue rules
    /// first, or packets queued after this are dropped.
    pub fn stop(self) -> anyhow::Result<LinkStats> {
        self.stop.store(true, Ordering::Relaxed);
        self.thread.join().map_err(|_| anyhow::anyhow!("the link nemesis thread panicked"))?
    }
}

/// A packet waiting for its verdict: release time, arrival order, arrival time, id, the duplicate to send.
type Held = Reverse<(Instant, u64, Instant, u32, Option<Vec<u8>>)>;

fn hold_loop(
    mut socket: QueueSocket,
    raw: Option<RawSender>,
    mut plan: LinkPlan,
    stop: &AtomicBool,
    mut stats: LinkStats,
) -> anyhow::Result<LinkStats> {
    let mut held: BinaryHeap<Held> = BinaryHeap::new();
    let (mut seq, mut latest_released, mut held_total) = (0u64, None::<u64>, Duration::ZERO);
    let mut packets = Vec::new();
    loop {
        let stopping = stop.load(Ordering::Relaxed);
        let now = Instant::now();
        while held.peek().is_some_and(|Reverse((at, ..))| *at <= now || stopping) {
            let Reverse((_, s, arrived, id, copy)) = held.pop().expect("peeked");
            socket.verdict(id, true).context("letting a packet go")?;
            if let (Some(raw), Some(copy)) = (&raw, copy) {
                if raw.send(&copy).is_ok() {
                    stats.duplicated += 1;
                }
            }
            held_total += now.saturating_duration_since(arrived);
            if latest_released.is_some_and(|l| l > s) {
                stats.reordered += 1;
            }
            latest_released = latest_released.max(Some(s));
        }
        if stopping && held.is_empty() {
            // Drain what the kernel queued before the rules were removed.
            socket.recv(0, &mut packets)?;
            for p in packets.drain(..) {
                socket.verdict(p.id, true)?;
            }
            break;
        }
        let wait = held.peek().map_or(Duration::from_millis(20), |Reverse((at, ..))| at.saturating_duration_since(now));
        let wait_ms = wait.min(Duration::from_millis(20)).as_micros().div_ceil(1000) as i32;
        socket.recv(wait_ms, &mut packets).context("reading the netfilter queue")?;
        let now = Instant::now();
        for Packet { id, payload } in packets.drain(..) {
            stats.packets += 1;
            match plan.fate() {
                Fate::Drop => {
                    stats.dropped += 1;
                    socket.verdict(id, false)?;
                }
                Fate::Pass { hold, duplicate } => {
                    stats.delayed += u64::from(!hold.is_zero());
                    let copy = (duplicate && raw.is_some()).then(|| without_udp_checksum(payload));
                    held.push(Reverse((now + hold, seq, now, id, copy)));
                    seq += 1;
                }
            }
        }
    }
    let passed = stats.packets - stats.dropped;
    if passed > 0 {
        stats.mean_hold_ms = held_total.as_secs_f64() * 1e3 / passed as f64;
    }
    Ok(stats)
}

/// A duplicate of a queued UDP packet carries no UDP checksum (0: none, allowed over IPv4): a packet
/// the node sends is queued before its checksum is filled in (the device would compute it).
fn without_udp_checksum(mut packet: Vec<u8>) -> Vec<u8> {
    if packet.len() >= 20 && packet[9] == 17 {
        let ihl = usize::from(packet[0] & 0x0f) * 4;
        if let Some(sum) = packet.get_mut(ihl + 6..ihl + 8) {
            sum.fill(0);
        }
    }
    packet
}

#[cfg(test)]
mod tests {
    use super::*;

    fn fates(shape: LinkShape, n: usize) -> Vec<Fate> {
        let mut plan = LinkPlan::new(shape, 42);
        (0..n).map(|_| plan.fate()).collect()
    }

    fn holds(fates: &[Fate]) -> Vec<u64> {
        fates
            .iter()
            .filter_map(|f| if let Fate::Pass { hold, .. } = f { Some(hold.as_millis() as u64) } else { None })
            .collect()
    }

    #[test]
    fn loss_delay_reorder_and_duplicates_follow_the_shape_and_the_seed() {
        let shape = LinkShape {
            loss_percent: 5.0,
            delay_ms: 20,
            delay_jitter_ms: 4,
            reorder_percent: 10.0,
            reorder_ms: 15,
            duplicate_percent: 2.0,
        };
        let f = fates(shape, 20_000);
        assert_eq!(f, fates(shape, 20_000), "the same seed decides the same");
        let dropped = f.iter().filter(|f| **f == Fate::Drop).count();
        assert!((800..1200).contains(&dropped), "5% of 20,000 lost: {dropped}");
        let h = holds(&f);
        assert!(h.iter().all(|&ms| (16..=24).contains(&ms) || (31..=39).contains(&ms)), "{h:?}");
        let reordered = h.iter().filter(|&&ms| ms > 24).count();
        assert!((1500..2300).contains(&reordered), "10% held 15 ms longer: {reordered}");
        let dups = f.iter().filter(|f| matches!(f, Fate::Pass { duplicate: true, .. })).count();
        assert!((250..510).contains(&dups), "2% sent twice: {dups}");
    }

    #[test]
    fn a_clean_shape_passes_everything_at_once() {
        let f = fates(LinkShape::default(), 1000);
        assert!(f.iter().all(|f| *f == Fate::Pass { hold: Duration::ZERO, duplicate: false }));
    }

    #[test]
    fn a_duplicate_loses_only_its_udp_checksum() {
        let mut udp = vec![0x45, 0, 0, 28, 0, 0, 0, 0, 64, 17, 0xaa, 0xbb, 10, 0, 0, 1, 10, 0, 0, 2];
        udp.extend([0x12, 0x34, 0x56, 0x78, 0, 8, 0xde, 0xad]);
        let out = without_udp_checksum(udp.clone());
        assert_eq!(&out[26..28], &[0, 0]);
        assert_eq!(&out[..26], &udp[..26]);
        let mut tcp = udp.clone();
        tcp[9] = 6;
        assert_eq!(without_udp_checksum(tcp.clone()), tcp);
    }
}
