//! The same-host transport's shared-memory arena, two ranks in one process: what happens when ranks
//! disagree, give up or go silent (every collective's results are checked across processes in
//! `multiprocess.rs`).

use std::sync::Arc;
use std::time::{Duration, Instant};

use troupe_cluster::collective::{CollectiveConfig, Communicator, ReduceOp};
use troupe_cluster::transport::same_host::SameHostTransport;
use troupe_cluster::transport::Transport;
use troupe_cluster::{ClusterError, TransportConfig};

fn config(slot: usize) -> TransportConfig {
    TransportConfig { shared_memory_slot_bytes: slot, collective_timeout_ms: 20_000, ..TransportConfig::default() }
}

async fn pair(
    a: TransportConfig,
    b: TransportConfig,
) -> (tempfile::TempDir, Arc<SameHostTransport>, Arc<SameHostTransport>) {
    let dir = tempfile::tempdir().unwrap();
    let (t0, t1) =
        tokio::join!(SameHostTransport::connect(dir.path(), 0, 2, a), SameHostTransport::connect(dir.path(), 1, 2, b));
    (dir, Arc::new(t0.unwrap()), Arc::new(t1.unwrap()))
}

fn comm(t: &Arc<SameHostTransport>, c: &TransportConfig) -> Communicator<SameHostTransport> {
    Communicator::new(t.clone(), 0, 1, CollectiveConfig::from(c))
}

type Comm = Communicator<SameHostTransport>;

/// Two connected ranks' communicators, in the arena.
async fn two_ranks(c: &TransportConfig) -> (tempfile::TempDir, Comm, Comm) {
    let (dir, t0, t1) = pair(c.clone(), c.clone()).await;
    let (c0, c1) = (comm(&t0, c), comm(&t1, c));
    assert!(c0.uses_shared_memory() && c1.uses_shared_memory());
    (dir, c0, c1)
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn collectives_run_in_the_arena_and_leave_nothing_in_dev_shm() {
    let c = config(64 << 10);
    let (_dir, t0, t1) = pair(c.clone(), c.clone()).await;
    assert!(t0.arena().is_some() && t1.arena().is_some());
    for t in [&t0, &t1] {
        let path = t.arena().unwrap().segment_path().to_path_buf();
        assert!(path.starts_with("/dev/shm") && !path.exists(), "{path:?}: names must be removed once mapped");
    }
    let (mut c0, mut c1) = (comm(&t0, &c), comm(&t1, &c));
    assert!(c0.uses_shared_memory() && c1.uses_shared_memory());
    // A second communicator on the same transport cannot share the arena: it uses the sockets.
    let (mut d0, mut d1) =
        (Communicator::new(t0.clone(), 5, 1, (&c).into()), Communicator::new(t1.clone(), 5, 1, (&c).into()));
    assert!(!d0.uses_shared_memory() && !d1.uses_shared_memory());
    let len = 100_003; // several blocks of 64 KiB slots, odd chunks
    let mut a: Vec<f32> = (0..len).map(|i| (i % 7) as f32).collect();
    let mut b: Vec<f32> = (0..len).map(|i| (i % 5) as f32 - 2.0).collect();
    let want: Vec<f32> = a.iter().zip(&b).map(|(x, y)| x + y).collect();
    let (mut a2, mut b2) = (a.clone(), b.clone());
    let (r0, r1, r2, r3) = tokio::join!(
        c0.all_reduce(&mut a, ReduceOp::Sum),
        c1.all_reduce(&mut b, ReduceOp::Sum),
        d0.all_reduce(&mut a2, ReduceOp::Sum),
        d1.all_reduce(&mut b2, ReduceOp::Sum)
    );
    for r in [r0, r1, r2, r3] {
        r.unwrap();
    }
    assert!(a == want && b == want && a2 == want && b2 == want);
    // Communicators come and go (one per attempt, say): the next one continues in the arena where the
    // last left off.
    drop((c0, c1));
    let (mut e0, mut e1) = (comm(&t0, &c), comm(&t1, &c));
    assert!(e0.uses_shared_memory() && e1.uses_shared_memory());
    let (mut x, mut y) = (vec![3f32; 5000], vec![4f32; 5000]);
    let (r0, r1) = tokio::join!(e0.all_reduce(&mut x, ReduceOp::Min), e1.all_reduce(&mut y, ReduceOp::Min));
    r0.unwrap();
    r1.unwrap();
    assert!(x.iter().chain(&y).all(|&v| v == 3.0));
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn ranks_that_disagree_on_the_slot_size_both_use_the_sockets() {
    let (_dir, t0, t1) = pair(config(1 << 20), config(2 << 20)).await;
    assert!(t0.arena().is_none() && t1.arena().is_none(), "both must fall back, or neither");
    let c = config(1 << 20);
    let (mut c0, mut c1) = (comm(&t0, &c), comm(&t1, &c));
    let (mut a, mut b) = (vec![1f32; 1000], vec![2f32; 1000]);
    let (r0, r1) = tokio::join!(c0.all_reduce(&mut a, ReduceOp::Max), c1.all_reduce(&mut b, ReduceOp::Max));
    r0.unwrap();
    r1.unwrap();
    assert!(a.iter().chain(&b).all(|&v| v == 2.0));
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn mismatched_collectives_fail_instead_of_mixing_data() {
    let c = config(1 << 20);
    let (_dir, mut c0, mut c1) = two_ranks(&c).await;
    let (mut a, mut b) = (vec![1f32; 100], vec![1f32; 101]);
    let (r0, r1) = tokio::join!(c0.all_reduce(&mut a, ReduceOp::Sum), c1.all_reduce(&mut b, ReduceOp::Sum));
    for r in [r0, r1] {
        match r {
            Err(ClusterError::InvalidArgument { reason, .. }) => {
                assert!(reason.contains("different collective"), "{reason}")
            }
            other => panic!("expected a mismatch error, got {other:?}"),
        }
    }
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn an_abandoned_call_fails_the_peer_at_once_and_a_silent_peer_times_out() {
    let c = TransportConfig { collective_timeout_ms: 800, ..config(1 << 20) };
    let (_dir, mut c0, mut c1) = two_ranks(&c).await;
    // Rank 1 is silent: rank 0's call fails with a timeout, not a hang.
    let mut a = vec![1f32; 1 << 20];
    let started = Instant::now();
    match c0.all_reduce(&mut a, ReduceOp::Sum).await {
        Err(ClusterError::Timeout { peer: 1, .. }) => {}
        other => panic!("expected a timeout naming rank 1, got {other:?}"),
    }
    let waited = started.elapsed();
    assert!(waited >= Duration::from_millis(800) && waited < Duration::from_secs(5), "{waited:?}");
    // Rank 0 gave up mid-call: rank 1, arriving later, fails at once instead of waiting 800 ms.
    let mut b = vec![1f32; 1 << 20];
    let started = Instant::now();
    match c1.all_reduce(&mut b, ReduceOp::Sum).await {
        Err(ClusterError::PeerLost { peer: 0, reason, .. }) => assert!(reason.contains("abandoned"), "{reason}"),
        other => panic!("expected rank 0 reported lost, got {other:?}"),
    }
    assert!(started.elapsed() < Duration::from_millis(400), "{:?}", started.elapsed());
    // A rank whose call broke off refuses further arena calls plainly.
    match c0.all_reduce(&mut a, ReduceOp::Sum).await {
        Err(ClusterError::InvalidArgument { reason, .. }) => assert!(reason.contains("unusable"), "{reason}"),
        other => panic!("expected the arena refused, got {other:?}"),
    }
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_call_dropped_mid_way_releases_the_peer() {
    let c = TransportConfig { collective_timeout_ms: 30_000, ..config(1 << 20) };
    let (_dir, mut c0, mut c1) = two_ranks(&c).await;
    let mut a = vec![1f32; 1 << 20];
    // The step is aborted while rank 0 waits for rank 1: the future is dropped.
    assert!(tokio::time::timeout(Duration::from_millis(100), c0.all_reduce(&mut a, ReduceOp::Sum)).await.is_err());
    let mut b = vec![1f32; 1 << 20];
    let started = Instant::now();
    let r = c1.all_reduce(&mut b, ReduceOp::Sum).await;
    assert!(matches!(r, Err(ClusterError::PeerLost { peer: 0, .. })), "{r:?}");
    assert!(started.elapsed() < Duration::from_secs(2), "waited {:?} of a 30 s timeout", started.elapsed());
}

/// Rank 2 crashes; rank 0's call fails on that loss and breaks off. Rank 1, calling after, must name
/// the rank that was lost and why — not rank 0, whose breaking off was only the consequence.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_call_after_a_loss_names_the_lost_rank_not_the_one_that_broke_off() {
    let c = TransportConfig { collective_timeout_ms: 10_000, ..config(1 << 20) };
    let dir = tempfile::tempdir().unwrap();
    let connect = |rank| SameHostTransport::connect(dir.path(), rank, 3, c.clone());
    let (t0, t1, t2) = tokio::join!(connect(0), connect(1), connect(2));
    let (t0, t1) = (Arc::new(t0.unwrap()), Arc::new(t1.unwrap()));
    let (mut c0, mut c1) = (comm(&t0, &c), comm(&t1, &c));
    assert!(c0.uses_shared_memory() && c1.uses_shared_memory());
    drop(t2.unwrap()); // its sockets close without a goodbye: a crash
    for t in [&t0, &t1] {
        assert_eq!(tokio::time::timeout(Duration::from_secs(5), t.any_loss()).await.expect("loss seen").0, 2);
    }
    let mut a = vec![1f32; 1 << 20];
    let r = c0.all_reduce(&mut a, ReduceOp::Sum).await;
    assert!(matches!(r, Err(ClusterError::PeerLost { peer: 2, .. })), "{r:?}");
    let mut b = vec![1f32; 1 << 20];
    match c1.all_reduce(&mut b, ReduceOp::Sum).await {
        Err(ClusterError::PeerLost { peer: 2, reason, .. }) => assert!(reason.contains("without goodbye"), "{reason}"),
        other => panic!("expected rank 2's loss, got {other:?}"),
    }
}
