//! The body of one launched rank process: connect, run the mode, report one JSON line.

use std::sync::Arc;
use std::time::{Duration, Instant};

use anyhow::Context;
use half::bf16;

use super::launch::node_name;
use super::{BenchTransport, RankMode, RankReport, RankSpec, RANK_SPEC_ENV};
use crate::collective::{chunk_range, CollectiveConfig, Communicator, HostLayout, ReduceOp};
use crate::identity::NodeIdentity;
use crate::transport::quic::{PeerInfo, QuicTransport};
use crate::transport::routed::Routed;
use crate::transport::same_host::SameHostTransport;
use crate::transport::tcp::TcpTransport;
use crate::transport::Transport;
use crate::ClusterError;

/// Reads the spec from [`RANK_SPEC_ENV`], runs it, prints the report as one JSON line.
pub fn run_rank_from_env() -> anyhow::Result<()> {
    let spec = std::env::var(RANK_SPEC_ENV).with_context(|| {
        format!("{RANK_SPEC_ENV} is not set: a launcher sets it when it starts this process as a rank")
    })?;
    let spec: RankSpec = serde_json::from_str(&spec).with_context(|| format!("{RANK_SPEC_ENV} is not a rank spec"))?;
    let report = run_rank(&spec);
    println!("{}", serde_json::to_string(&report)?);
    Ok(())
}

pub fn run_rank(spec: &RankSpec) -> RankReport {
    // One runtime worker per core this rank can have to itself: with more ranks than cores, extra
    // workers only add cross-thread wake-ups (measured on 2 cores, n=2 and 4: ~20 % more busbw with 1).
    let cores = std::thread::available_parallelism().map_or(1, |n| n.get());
    let workers = (cores / spec.world.max(1)).clamp(1, 4);
    // The same budget for the reduction kernels, as the runtime gives a rank (its torch threads):
    // otherwise a reduction of a 1 MiB piece or more starts threads on cores the other ranks use.
    troupe_kernels::set_cpu_threads(workers);
    let rt = match tokio::runtime::Builder::new_multi_thread().worker_threads(workers).enable_all().build() {
        Ok(rt) => rt,
        Err(e) => return failed(spec.rank, &ClusterError::io("starting runtime", e), 0),
    };
    rt.block_on(async {
        match spec.transport {
            BenchTransport::Quic | BenchTransport::PlaintextTcp | BenchTransport::EncryptedTcp => {
                let id = match NodeIdentity::load(&spec.dir, &node_name(spec.rank)) {
                    Ok(id) => id,
                    Err(e) => return failed(spec.rank, &e, 0),
                };
                let roster: Vec<PeerInfo> =
                    spec.addrs.iter().enumerate().map(|(r, a)| PeerInfo { name: node_name(r), addr: *a }).collect();
                let quic = match QuicTransport::connect(&id, spec.rank, roster.clone(), spec.config.clone()).await {
                    Ok(t) => Arc::new(t),
                    Err(e) => return failed(spec.rank, &e, 0),
                };
                if let Some(payloads) = spec.transport.tcp_payloads() {
                    return match TcpTransport::connect(quic, &id, &roster, spec.config.clone(), payloads).await {
                        Ok(tcp) => between_hosts(Arc::new(tcp), spec).await,
                        Err(e) => failed(spec.rank, &e, 0),
                    };
                }
                let report = between_hosts(quic.clone(), spec).await;
                if let Some(stats) = quic.path_stats((spec.rank + 1) % spec.world) {
                    tracing::info!(rank = spec.rank, %stats, "path to next rank");
                }
                report
            }
            BenchTransport::Local => {
                match SameHostTransport::connect(&spec.dir, spec.rank, spec.world, spec.config.clone()).await {
                    Ok(t) => run_mode(Arc::new(t), spec, None).await,
                    Err(e) => failed(spec.rank, &e, 0),
                }
            }
        }
    })
}

/// Runs the mode over `t`, the mesh between hosts. Ranks that share a host talk over their same-host
/// transport, as the runtime's do; `--flat` only turns the tiers off.
async fn between_hosts<T: Transport>(t: Arc<T>, spec: &RankSpec) -> RankReport {
    let tier = match host_tier(spec).await {
        Ok(tier) => tier,
        Err(e) => return failed(spec.rank, &e, 0),
    };
    match tier {
        Some((layout, Some(local))) => match Routed::new(t, local.clone(), layout.members(spec.rank).to_vec()) {
            Ok(routed) => {
                let tier = (!spec.flat).then_some((layout, Some(local)));
                let report = run_mode(Arc::new(routed), spec, tier).await;
                RankReport { same_host_routes: true, ..report }
            }
            Err(e) => failed(spec.rank, &e, 0),
        },
        tier => run_mode(t, spec, tier.filter(|_| !spec.flat)).await,
    }
}

fn failed(rank: usize, e: &ClusterError, after_ms: u64) -> RankReport {
    RankReport {
        rank,
        error: Some(e.to_string()),
        error_kind: Some(e.kind().into()),
        failed_after_ms: Some(after_ms),
        ..Default::default()
    }
}

/// What a QUIC rank needs for two-tier all-reduce: the host layout of the roster (hosts are IPs) and,
/// when other ranks share its host, a same-host transport among them (which its messages to them take
/// even with `--flat`). `None` when every rank is on one host or alone on its host.
async fn host_tier(spec: &RankSpec) -> Result<Option<Tier>, ClusterError> {
    let layout = HostLayout::of(&spec.addrs.iter().map(|a| a.ip()).collect::<Vec<_>>());
    if !layout.is_tiered() {
        return Ok(None);
    }
    let members = layout.members(spec.rank).len();
    if members == 1 {
        return Ok(Some((layout, None)));
    }
    let dir = spec.dir.join(format!("host-{}", layout.host_of(spec.rank)));
    std::fs::create_dir_all(&dir).map_err(|e| ClusterError::io(format!("creating {}", dir.display()), e))?;
    let local = SameHostTransport::connect(&dir, layout.local_rank(spec.rank), members, spec.config.clone()).await?;
    Ok(Some((layout, Some(Arc::new(local)))))
}

type Tier = (HostLayout, Option<Arc<SameHostTransport>>);

async fn run_mode<T: Transport>(t: Arc<T>, spec: &RankSpec, tier: Option<Tier>) -> RankReport {
    let mut c = Communicator::new(t.clone(), 0, 1, CollectiveConfig::from(&spec.config));
    let rank = spec.rank;
    let shared_memory = c.uses_shared_memory();
    let host_tier = match tier {
        Some((layout, local)) => match c.with_host_tier(layout, local).await {
            Ok(on) => on,
            Err(e) => return failed(rank, &e, 0),
        },
        None => false,
    };
    let mut report = match &spec.mode {
        RankMode::Bench { elems, iters, warmup_iters } => bench(&mut c, rank, *elems, *iters, *warmup_iters).await,
        RankMode::Check => check(&mut c, rank, spec.world).await,
        RankMode::Loop { elems, seconds } => run_loop(&mut c, rank, *elems, *seconds).await,
    };
    report.shared_memory = shared_memory;
    report.host_tier = host_tier;
    if report.error.is_none() {
        t.shutdown().await;
    }
    report
}

async fn bench<T: Transport>(
    c: &mut Communicator<T>,
    rank: usize,
    elems: usize,
    iters: usize,
    warmup: usize,
) -> RankReport {
    let mut data = vec![1f32; elems];
    let started = Instant::now();
    let result = async {
        for _ in 0..warmup {
            c.all_reduce(&mut data, ReduceOp::Sum).await?;
        }
        c.barrier().await?;
        let (t0, cpu0) = (Instant::now(), cpu_seconds());
        for _ in 0..iters {
            c.all_reduce(&mut data, ReduceOp::Sum).await?;
        }
        let per_iter = |total: f64| total / iters.max(1) as f64;
        let (seconds, cpu) = (per_iter(t0.elapsed().as_secs_f64()), per_iter(cpu_seconds() - cpu0));
        verify_sum(c, rank, &mut data).await?;
        Ok::<_, ClusterError>((seconds, cpu))
    }
    .await;
    match result {
        Ok((seconds_per_iter, cpu_seconds_per_iter)) => RankReport {
            rank,
            seconds_per_iter,
            cpu_seconds_per_iter,
            iterations: iters,
            verified: true,
            ..Default::default()
        },
        Err(e) => failed(rank, &e, started.elapsed().as_millis() as u64),
    }
}

/// CPU time this process has used so far (user and system, every thread), in seconds: what the kernel
/// charges it, including the socket copies and, on most paths, the receive processing of its packets.
fn cpu_seconds() -> f64 {
    let mut usage = std::mem::MaybeUninit::<libc::rusage>::zeroed();
    // SAFETY: getrusage writes a whole `rusage` into the pointer it is given and reads nothing.
    if unsafe { libc::getrusage(libc::RUSAGE_SELF, usage.as_mut_ptr()) } != 0 {
        return 0.0;
    }
    // SAFETY: initialised by the successful call above (and zeroed before it).
    let usage = unsafe { usage.assume_init() };
    let seconds = |t: libc::timeval| t.tv_sec as f64 + t.tv_usec as f64 * 1e-6;
    seconds(usage.ru_utime) + seconds(usage.ru_stime)
}

/// One all-reduce (untimed) of rank-dependent small integers in `data`'s buffer, checked bit for bit
/// against their sum: the timed ones moved the same bytes along the same paths.
async fn verify_sum<T: Transport>(c: &mut Communicator<T>, rank: usize, data: &mut [f32]) -> Result<(), ClusterError> {
    let n = c.transport().world();
    data.iter_mut().enumerate().for_each(|(i, v)| *v = value(rank, i));
    c.all_reduce(data, ReduceOp::Sum).await?;
    match data.iter().enumerate().find(|(i, v)| **v != (0..n).map(|r| value(r, *i)).sum::<f32>()) {
        None => Ok(()),
        Some((i, v)) => Err(ClusterError::InvalidArgument {
            rank,
            op: "bench",
            reason: format!("the check all-reduce after the timed ones gave {v} at element {i}, not the sum"),
        }),
    }
}

/// Small integers: f32 sums of them are exact, so results compare bit for bit.
fn value(rank: usize, i: usize) -> f32 {
    ((rank * 31 + i * 7) % 19) as f32 - 9.0
}

fn expected(n: usize, len: usize, op: ReduceOp) -> Vec<f32> {
    (0..len)
        .map(|i| {
            let col = (0..n).map(|r| value(r, i));
            match op {
                ReduceOp::Sum => col.sum(),
                ReduceOp::Avg => col.sum::<f32>() * (1.0 / n as f32),
                ReduceOp::Max => col.fold(f32::MIN, f32::max),
                ReduceOp::Min => col.fold(f32::MAX, f32::min),
            }
        })
        .collect()
}

async fn check<T: Transport>(c: &mut Communicator<T>, rank: usize, n: usize) -> RankReport {
    let mut passed = 0;
    let started = Instant::now();
    let result: Result<(), ClusterError> = async {
        let fail = |what: String| ClusterError::InvalidArgument { rank, op: "check", reason: what };
        for len in [0, 1, n.saturating_sub(1), 37, 300_001] {
            for op in [ReduceOp::Sum, ReduceOp::Avg, ReduceOp::Max, ReduceOp::Min] {
                let mut data: Vec<f32> = (0..len).map(|i| value(rank, i)).collect();
                c.all_reduce(&mut data, op).await?;
                if data != expected(n, len, op) {
                    return Err(fail(format!("all_reduce len {len} {op:?} differs")));
                }
                passed += 1;
            }
            let mut half: Vec<bf16> = (0..len).map(|i| bf16::from_f32(value(rank, i))).collect();
            c.all_reduce(&mut half, ReduceOp::Max).await?;
            if half.iter().map(|v| v.to_f32()).collect::<Vec<_>>() != expected(n, len, ReduceOp::Max) {
                return Err(fail(format!("bf16 all_reduce len {len} differs")));
            }
            let mut b: Vec<f32> = (0..len).map(|i| value(rank, i)).collect();
            c.broadcast(&mut b, n - 1).await?;
            if b != (0..len).map(|i| value(n - 1, i)).collect::<Vec<_>>() {
                return Err(fail(format!("broadcast len {len} differs")));
            }
            let full = expected(n, len, ReduceOp::Sum);
            let input: Vec<f32> = (0..len).map(|i| value(rank, i)).collect();
            let mut mine = vec![0f32; chunk_range(len, n, rank).len()];
            c.reduce_scatter(&input, &mut mine, ReduceOp::Sum).await?;
            let mut all = vec![0f32; len];
            c.all_gather(&mine, &mut all).await?;
            if all != full {
                return Err(fail(format!("reduce_scatter + all_gather len {len} differs")));
            }
            c.barrier().await?;
            passed += 3;
        }
        Ok(())
    }
    .await;
    match result {
        Ok(()) => RankReport { rank, checks_passed: passed, ..Default::default() },
        Err(e) => RankReport { checks_passed: passed, ..failed(rank, &e, started.elapsed().as_millis() as u64) },
    }
}

async fn run_loop<T: Transport>(c: &mut Communicator<T>, rank: usize, elems: usize, seconds: u64) -> RankReport {
    let mut data = vec![1f32; elems];
    let end = Instant::now() + Duration::from_secs(seconds);
    let mut iterations = 0;
    while Instant::now() < end {
        let call = Instant::now();
        if let Err(e) = c.all_reduce(&mut data, ReduceOp::Sum).await {
            return RankReport { iterations, ..failed(rank, &e, call.elapsed().as_millis() as u64) };
        }
        data.iter_mut().for_each(|v| *v = 1.0);
        iterations += 1;
    }
    RankReport { rank, iterations, ..Default::default() }
}
