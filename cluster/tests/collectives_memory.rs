//! Every collective, for n = 1..8, sizes 0, 1, n−1, odd and large, every dtype and op, executed over
//! the in-memory transport and compared with a plain reference: bit-exact for max/min, within the
//! accumulation tolerance of the wire dtype for sum/avg.

use std::future::Future;
use std::sync::Arc;
use std::time::Duration;

use half::{bf16, f16};
use troupe_cluster::collective::{chunk_range, Collective, CollectiveConfig, Communicator, Element, ReduceOp};
use troupe_cluster::transport::memory::MemoryTransport;
use troupe_cluster::ClusterError;

const OPS: [ReduceOp; 4] = [ReduceOp::Sum, ReduceOp::Avg, ReduceOp::Max, ReduceOp::Min];
/// Bigger than `small_message_bytes_max` (so the ring runs) and than a slice (so slices pipeline).
const LARGE: usize = 20_011;

fn config() -> CollectiveConfig {
    CollectiveConfig { small_message_bytes_max: 4 << 10, pipeline_slice_bytes: 16 << 10, collective_timeout_ms: 20_000 }
}

fn sizes(n: usize) -> Vec<usize> {
    vec![0, 1, n.saturating_sub(1), 37, LARGE]
}

fn run_ranks<R, Fut: Future<Output = R>>(n: usize, f: impl Fn(Communicator<MemoryTransport>) -> Fut) -> Vec<R> {
    let rt = tokio::runtime::Builder::new_current_thread().enable_time().build().unwrap();
    rt.block_on(async {
        let ranks =
            MemoryTransport::mesh(n, 1 << 16).into_iter().map(|t| f(Communicator::new(Arc::new(t), 7, 1, config())));
        tokio::time::timeout(Duration::from_secs(60), futures::future::join_all(ranks)).await.expect("collective hung")
    })
}

fn value(rank: usize, i: usize) -> f32 {
    let h = (rank as u64 * 1_000_003 + i as u64).wrapping_mul(0x9E37_79B9_7F4A_7C15) >> 40;
    (h % 4001) as f32 / 1000.0 - 2.0
}

fn input<E: Element>(rank: usize, len: usize) -> Vec<E> {
    (0..len).map(|i| E::from_f32(value(rank, i))).collect()
}

fn eps<E: Element>() -> f32 {
    match E::DTYPE {
        troupe_cluster::collective::Dtype::F32 => 1e-6,
        troupe_cluster::collective::Dtype::Bf16 => 1.0 / 128.0,
        troupe_cluster::collective::Dtype::F16 => 1.0 / 1024.0,
    }
}

fn reference<E: Element>(n: usize, len: usize, op: ReduceOp) -> Vec<(f32, f32)> {
    let inputs: Vec<Vec<E>> = (0..n).map(|r| input::<E>(r, len)).collect();
    (0..len)
        .map(|i| {
            let col: Vec<f64> = inputs.iter().map(|v| v[i].to_f32() as f64).collect();
            let abs: f64 = col.iter().map(|v| v.abs()).sum();
            let v = match op {
                ReduceOp::Sum => col.iter().sum(),
                ReduceOp::Avg => col.iter().sum::<f64>() / n as f64,
                ReduceOp::Max => col.iter().cloned().fold(f64::MIN, f64::max),
                ReduceOp::Min => col.iter().cloned().fold(f64::MAX, f64::min),
            };
            let scale = if op == ReduceOp::Avg { abs / n as f64 } else { abs };
            (v as f32, scale as f32)
        })
        .collect()
}

fn check_close<E: Element>(what: &str, got: &[E], want: &[(f32, f32)], op: ReduceOp, n: usize) {
    assert_eq!(got.len(), want.len(), "{what}: length");
    for (i, (g, (w, scale))) in got.iter().zip(want).enumerate() {
        let g = g.to_f32();
        match op {
            ReduceOp::Max | ReduceOp::Min => {
                assert_eq!(g.to_bits(), E::from_f32(*w).to_f32().to_bits(), "{what}[{i}]: {g} != {w}")
            }
            _ => {
                let tol = eps::<E>() * (n as f32 + 1.0) * (scale + 1.0);
                assert!((g - w).abs() <= tol, "{what}[{i}]: {g} vs {w} (tol {tol})");
            }
        }
    }
}

fn all_reduce_case<E: Element>() {
    for n in 1..=8 {
        for len in sizes(n) {
            for op in OPS {
                let results = run_ranks(n, |mut c| async move {
                    let mut data = input::<E>(c.transport().as_ref().rank_id(), len);
                    c.all_reduce(&mut data, op).await.map(|_| data)
                });
                let want = reference::<E>(n, len, op);
                let first = results[0].as_ref().unwrap().clone();
                for (r, res) in results.into_iter().enumerate() {
                    let got = res.unwrap_or_else(|e| panic!("n={n} len={len} {op:?}: {e}"));
                    check_close(
                        &format!("{:?} all_reduce n={n} len={len} {op:?} rank {r}", E::DTYPE),
                        &got,
                        &want,
                        op,
                        n,
                    );
                    assert!(
                        got.iter().zip(&first).all(|(a, b)| a.to_f32().to_bits() == b.to_f32().to_bits()),
                        "ranks disagree"
                    );
                }
            }
        }
    }
}

trait RankId {
    fn rank_id(&self) -> usize;
}
impl RankId for MemoryTransport {
    fn rank_id(&self) -> usize {
        troupe_cluster::transport::Transport::rank(self)
    }
}

#[test]
fn all_reduce_f32() {
    all_reduce_case::<f32>();
}
#[test]
fn all_reduce_bf16() {
    all_reduce_case::<bf16>();
}
#[test]
fn all_reduce_f16() {
    all_reduce_case::<f16>();
}

fn reduce_scatter_and_gather_case<E: Element>() {
    for n in 1..=8 {
        for len in sizes(n) {
            for op in OPS {
                let results = run_ranks(n, |mut c| async move {
                    let rank = c.transport().rank_id();
                    let data = input::<E>(rank, len);
                    let mut mine = vec![E::from_f32(0.0); chunk_range(len, n, rank).len()];
                    c.reduce_scatter(&data, &mut mine, op).await?;
                    let mut all = vec![E::from_f32(0.0); len];
                    c.all_gather(&mine, &mut all).await?;
                    Ok::<_, ClusterError>((mine, all))
                });
                let want = reference::<E>(n, len, op);
                for (r, res) in results.into_iter().enumerate() {
                    let (mine, all) = res.unwrap_or_else(|e| panic!("n={n} len={len} {op:?}: {e}"));
                    check_close(
                        &format!("reduce_scatter n={n} len={len} {op:?} rank {r}"),
                        &mine,
                        &want[chunk_range(len, n, r)],
                        op,
                        n,
                    );
                    check_close(&format!("all_gather n={n} len={len} {op:?} rank {r}"), &all, &want, op, n);
                }
            }
        }
    }
}

#[test]
fn reduce_scatter_then_all_gather_f32() {
    reduce_scatter_and_gather_case::<f32>();
}
#[test]
fn reduce_scatter_then_all_gather_bf16() {
    reduce_scatter_and_gather_case::<bf16>();
}
#[test]
fn reduce_scatter_then_all_gather_f16() {
    reduce_scatter_and_gather_case::<f16>();
}

fn broadcast_and_reduce_case<E: Element>() {
    for n in 1..=8 {
        for len in sizes(n) {
            for root in [0, n - 1, n / 2] {
                let results = run_ranks(n, |mut c| async move {
                    let mut data = input::<E>(c.transport().rank_id(), len);
                    c.broadcast(&mut data, root).await.map(|_| data)
                });
                let want = input::<E>(root, len);
                for res in results {
                    let got = res.unwrap();
                    assert!(
                        got.iter().zip(&want).all(|(a, b)| a.to_f32().to_bits() == b.to_f32().to_bits()),
                        "broadcast n={n} len={len} root={root}"
                    );
                }
                for op in OPS {
                    let results = run_ranks(n, |mut c| async move {
                        let mut data = input::<E>(c.transport().rank_id(), len);
                        c.reduce(&mut data, op, root).await.map(|_| data)
                    });
                    let got = results.into_iter().nth(root).unwrap().unwrap();
                    check_close(
                        &format!("reduce n={n} len={len} root={root} {op:?}"),
                        &got,
                        &reference::<E>(n, len, op),
                        op,
                        n,
                    );
                }
            }
        }
    }
}

#[test]
fn broadcast_and_reduce_f32() {
    broadcast_and_reduce_case::<f32>();
}
#[test]
fn broadcast_and_reduce_bf16() {
    broadcast_and_reduce_case::<bf16>();
}
#[test]
fn broadcast_and_reduce_f16() {
    broadcast_and_reduce_case::<f16>();
}

#[test]
fn barrier_and_send_recv() {
    for n in 1..=8 {
        let results = run_ranks(n, |mut c| async move {
            let rank = c.transport().rank_id();
            c.barrier().await?;
            // Ring of point-to-point messages, two per pair to check ordering.
            let next = (rank + 1) % n;
            let prev = (rank + n - 1) % n;
            c.send(next, &[rank as f32, 1.0]).await?;
            c.send(next, &[rank as f32, 2.0]).await?;
            let mut a = [0f32; 2];
            let mut b = [0f32; 2];
            c.recv(prev, &mut a).await?;
            c.recv(prev, &mut b).await?;
            c.barrier().await?;
            Ok::<_, ClusterError>((a, b))
        });
        for (r, res) in results.into_iter().enumerate() {
            let (a, b) = res.unwrap();
            let prev = ((r + n - 1) % n) as f32;
            assert_eq!((a, b), ([prev, 1.0], [prev, 2.0]), "n={n} rank {r}");
        }
    }
}

#[test]
fn a_killed_rank_fails_the_collective_on_every_other_rank() {
    let n = 4;
    let rt = tokio::runtime::Builder::new_current_thread().enable_time().build().unwrap();
    let results = rt.block_on(async {
        let transports = MemoryTransport::mesh(n, 1 << 16);
        let victim = transports[2].clone();
        // Rank 2 never joins the all-reduce; it dies while the others wait on the ring.
        let ranks = transports.into_iter().filter(|t| t.rank_id() != 2).map(|t| async move {
            let mut c = Communicator::new(Arc::new(t), 0, 1, config());
            let mut data = vec![1f32; LARGE];
            c.all_reduce(&mut data, ReduceOp::Sum).await
        });
        let kill = async {
            tokio::time::sleep(Duration::from_millis(100)).await;
            victim.kill();
        };
        let (res, _) = tokio::time::timeout(
            Duration::from_secs(10),
            futures::future::join(futures::future::join_all(ranks), kill),
        )
        .await
        .expect("hung");
        res
    });
    for (r, res) in results.into_iter().enumerate() {
        match res {
            Err(ClusterError::PeerLost { peer: 2, .. }) => {}
            other => panic!("rank {r}: expected PeerLost(2), got {other:?}"),
        }
    }
}

#[test]
fn stale_epoch_messages_never_mix_with_a_new_epoch() {
    let rt = tokio::runtime::Builder::new_current_thread().enable_time().build().unwrap();
    rt.block_on(async {
        let t = MemoryTransport::mesh(2, 64);
        let mut old = Communicator::new(Arc::new(t[0].clone()), 0, 1, config());
        // Rank 0 sends in epoch 1; rank 1 has already moved to epoch 2.
        let mut new = Communicator::new(Arc::new(t[1].clone()), 0, 2, config());
        old.send(1, &[9f32]).await.unwrap();
        let mut buf = [0f32];
        let short = CollectiveConfig { collective_timeout_ms: 200, ..config() };
        let mut new_short = Communicator::new(Arc::new(t[1].clone()), 0, 2, short);
        assert!(
            matches!(new_short.recv(0, &mut buf).await, Err(ClusterError::Timeout { .. })),
            "a stale message was delivered"
        );
        // Once rank 0 moves to epoch 2 as well, traffic flows.
        old.set_epoch(2);
        old.send(1, &[5f32]).await.unwrap();
        new.recv(0, &mut buf).await.unwrap();
        assert_eq!(buf, [5.0]);
    });
}

/// reduce_scatter then all_gather through the `Collective` trait alone, as code generic over the
/// backend (a transport here, NCCL on GPUs) calls them.
async fn scatter_then_gather_generic<C: Collective<Buffer<f32> = [f32]>>(
    c: &mut C,
    data: &[f32],
) -> Result<(Vec<f32>, Vec<f32>), ClusterError> {
    let mut mine = vec![0f32; chunk_range(data.len(), c.world(), c.rank()).len()];
    c.reduce_scatter::<f32>(data, &mut mine, ReduceOp::Sum).await?;
    let mut all = vec![0f32; data.len()];
    c.all_gather::<f32>(&mine, &mut all).await?;
    Ok((mine, all))
}

#[test]
fn the_collective_trait_reduce_scatters_and_all_gathers_like_the_communicator() {
    for n in [1, 3, 4] {
        for len in [0, 37, LARGE] {
            let results = run_ranks(n, |mut c| async move {
                let data = input::<f32>(c.rank(), len);
                let generic = scatter_then_gather_generic(&mut c, &data).await?;
                let mut mine = vec![0f32; chunk_range(len, n, c.rank()).len()];
                c.reduce_scatter(&data, &mut mine, ReduceOp::Sum).await?;
                let mut all = vec![0f32; len];
                c.all_gather(&mine, &mut all).await?;
                Ok::<_, ClusterError>((generic, (mine, all)))
            });
            for (r, res) in results.into_iter().enumerate() {
                let (generic, direct) = res.unwrap_or_else(|e| panic!("n={n} len={len}: {e}"));
                assert_eq!(generic, direct, "n={n} len={len} rank {r}");
            }
        }
    }
}
