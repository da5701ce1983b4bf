//! `troupe bench soak`: no false alarms under load (issue 38). For `--minutes` (default 10), a job runs
//! on a local cluster of `--nodes` daemon processes per failure detector (fixed and phi_accrual, side by
//! side, so both see the same load), every core of the machine is kept busy by a busy-loop child, and a
//! daemon is paused now and then (SIGSTOP, then SIGCONT after up to `--pause-max-ms`: a GC-like stall,
//! the same daemon index of every cluster at once). Nothing is really lost, so every membership change
//! the job reports is a false detection. The controllers log each heartbeat's arrival
//! ([`troupe_cluster::membership::ARRIVALS_TARGET`]): the silence it ended, the suspicion φ then, and the
//! silence each detector allowed; the report gives their distribution and the closest call.
//!
//! A pause of `p` silences a daemon for up to `p` + one heartbeat interval (its last heartbeat may have
//! left just before the stop) plus the load's scheduling delay: the default longest pause, 500 ms, takes
//! a silence to the 750 ms floor of the adaptive detector on a quiet machine.

use std::path::{Path, PathBuf};
use std::time::{Duration, Instant};

use anyhow::{bail, Context};
use serde_json::{json, Value};
use troupe_cluster::membership::{DetectorKind, MembershipConfig, ARRIVALS_TARGET};
use troupe_model::config::JobConfig;

use super::quantiles_with;
use crate::api::{Job, JobEvent, LocalCluster, LocalClusterOptions};

/// Steps the soak's job is given: more than it can commit in any soak; it is cancelled at the end.
const SOAK_STEPS: u64 = 10_000_000;

#[derive(Debug, clap::Args)]
pub struct SoakArgs {
    /// How long the soak runs, in minutes.
    #[arg(long, default_value_t = 10.0)]
    pub minutes: f64,
    /// Daemons per cluster (one rank each).
    #[arg(long, default_value_t = 3)]
    pub nodes: usize,
    /// Busy-loop children keeping the CPUs busy (0: one per core of this machine).
    #[arg(long, default_value_t = 0)]
    pub hogs: usize,
    /// The shortest and longest pause of a daemon (SIGSTOP → SIGCONT), in milliseconds.
    #[arg(long, default_value_t = 50)]
    pub pause_min_ms: u64,
    #[arg(long, default_value_t = 500)]
    pub pause_max_ms: u64,
    /// The mean time between two pauses, in milliseconds (each gap drawn from half to 1.5 times it).
    #[arg(long, default_value_t = 4000)]
    pub pause_every_ms: u64,
    /// Which detectors to soak: both (a cluster each, at once), fixed or phi_accrual.
    #[arg(long, value_parser = ["both", "fixed", "phi_accrual"], default_value = "both")]
    pub failure_detector: String,
    /// The adaptive detector's floor (node.toml `[membership] failure_timeout_min_ms`; default: the
    /// node's default), for every cluster (the fixed detector's logs say what phi_accrual would allow).
    #[arg(long)]
    pub failure_timeout_min_ms: Option<u64>,
    /// The adaptive detector's `phi_threshold` (default: the node's default).
    #[arg(long)]
    pub phi_threshold: Option<u32>,
    /// Seed of the pauses' schedule (when, which daemon, how long).
    #[arg(long, default_value_t = 1)]
    pub seed: u64,
    /// Keep the daemons' logs (with every heartbeat arrival) in this directory.
    #[arg(long)]
    pub log_dir: Option<PathBuf>,
    #[arg(long)]
    pub json: bool,
}

pub fn run(args: SoakArgs) -> anyhow::Result<()> {
    let mut phi = membership(&args);
    phi.failure_detector = DetectorKind::PhiAccrual;
    if let Err(e) = phi.validate() {
        bail!("--failure-timeout-min-ms / --phi-threshold: {e}");
    }
    if args.nodes < 2 || args.pause_min_ms > args.pause_max_ms || args.minutes <= 0.0 {
        bail!(
            "--nodes {} (at least 2), --pause-min-ms {} (at most --pause-max-ms {}), --minutes {} (above 0)",
            args.nodes,
            args.pause_min_ms,
            args.pause_max_ms,
            args.minutes
        );
    }
    let runtime = tokio::runtime::Builder::new_multi_thread().worker_threads(2).enable_all().build()?;
    let report = runtime.block_on(soak(&args))?;
    if args.json {
        println!("{report}");
    } else {
        println!("{}", serde_json::to_string_pretty(&report)?);
    }
    Ok(())
}

/// The daemons' `[membership]`: the node's defaults with the soak's floor and threshold.
fn membership(args: &SoakArgs) -> MembershipConfig {
    let mut config = MembershipConfig::default();
    config.failure_timeout_min_ms = args.failure_timeout_min_ms.unwrap_or(config.failure_timeout_min_ms);
    config.phi_threshold = args.phi_threshold.unwrap_or(config.phi_threshold);
    config
}

fn detectors(args: &SoakArgs) -> Vec<DetectorKind> {
    match args.failure_detector.as_str() {
        "fixed" => vec![DetectorKind::Fixed],
        "phi_accrual" => vec![DetectorKind::PhiAccrual],
        _ => vec![DetectorKind::Fixed, DetectorKind::PhiAccrual],
    }
}

/// One detector's cluster for the soak: its daemons log every heartbeat arrival to `log_dir`.
async fn start(args: &SoakArgs, kind: DetectorKind, log_dir: &Path) -> anyhow::Result<LocalCluster> {
    std::fs::create_dir_all(log_dir).with_context(|| format!("creating {}", log_dir.display()))?;
    let mut options = LocalClusterOptions::new(args.nodes);
    options.torch_threads = 1;
    options.membership = membership(args);
    options.membership.failure_detector = kind;
    options.log = Some(format!("warn,{ARRIVALS_TARGET}=debug"));
    options.log_dir = Some(log_dir.to_path_buf());
    let binary = std::env::current_exe().context("locating the troupe binary")?;
    Ok(LocalCluster::processes(&binary, options).await?)
}

async fn soak(args: &SoakArgs) -> anyhow::Result<Value> {
    let scratch = tempfile::tempdir()?;
    let logs = args.log_dir.clone().unwrap_or_else(|| scratch.path().to_path_buf());
    let hogs = Hogs::start(if args.hogs == 0 { num_cpus() } else { args.hogs })?;
    let kinds = detectors(args);
    let mut clusters = Vec::new();
    for &kind in &kinds {
        clusters.push(start(args, kind, &logs.join(detector_name(kind))).await?);
    }
    let mut config = JobConfig::default();
    config.train.steps = SOAK_STEPS;
    config.train.torch_threads = 1;
    let end = Instant::now() + Duration::from_secs_f64(args.minutes * 60.0);
    let mut watches = Vec::new();
    for cluster in &clusters {
        let handle = cluster.client().await?.submit(Job::new(config.clone())).await?;
        watches.push(tokio::spawn(watch(handle, end)));
    }
    let pids: Vec<Vec<u32>> = clusters.iter().map(|c| (0..args.nodes).filter_map(|i| c.pid(i)).collect()).collect();
    let schedule = pause_loop(args, &pids, end).await;
    let mut reports = Vec::new();
    for ((kind, watch), cluster) in kinds.iter().zip(watches).zip(&clusters) {
        let watched = watch.await??;
        let log = logs.join(detector_name(*kind)).join(format!("{}.log", cluster.node_name(0)));
        let text = std::fs::read_to_string(&log).with_context(|| format!("reading {}", log.display()))?;
        reports.push(detector_report(*kind, &watched, &arrivals(&text), &cluster.node_name(0)));
    }
    for cluster in clusters {
        cluster.shutdown().await;
    }
    drop(hogs);
    let schedule = schedule?;
    let membership = membership(args);
    Ok(json!({
        "bench": "soak", "minutes": args.minutes, "nodes": args.nodes, "hogs": hogs_count(args),
        "cores": num_cpus(), "load_1m": schedule.load,
        "heartbeat_interval_ms": membership.heartbeat_interval_ms,
        "failure_timeout_ms": membership.failure_timeout_ms,
        "failure_timeout_min_ms": membership.failure_timeout_min_ms, "phi_threshold": membership.phi_threshold,
        "pauses": {
            "count": schedule.pauses.len(), "min_ms": args.pause_min_ms, "max_ms": args.pause_max_ms,
            "held_ms": quantiles_with(schedule.pauses.iter().map(|p| p.1 as f64).collect(), &[0.5, 0.99]),
            "by_node": (0..args.nodes).map(|i| schedule.pauses.iter().filter(|p| p.0 == i).count()).collect::<Vec<_>>(),
        },
        "detectors": reports,
    }))
}

fn hogs_count(args: &SoakArgs) -> usize {
    if args.hogs == 0 {
        num_cpus()
    } else {
        args.hogs
    }
}

fn num_cpus() -> usize {
    std::thread::available_parallelism().map_or(1, |n| n.get())
}

fn detector_name(kind: DetectorKind) -> &'static str {
    match kind {
        DetectorKind::Fixed => "fixed",
        DetectorKind::PhiAccrual => "phi_accrual",
    }
}

/// What the soak saw of one job: steps committed and the membership changes (each a false detection).
#[derive(Debug, Default)]
struct Watched {
    steps: u64,
    /// Seconds into the job and the controller's words for the change.
    changes: Vec<(f64, String)>,
    /// Why the job ended before the soak did, if it did.
    ended: Option<String>,
}

/// Follows the job's events until `end`, then cancels it.
async fn watch(mut handle: crate::api::JobHandle, end: Instant) -> anyhow::Result<Watched> {
    let start = Instant::now();
    let mut watched = Watched::default();
    loop {
        let next = tokio::time::timeout_at(end.into(), handle.next_event()).await;
        let event = match next {
            Err(_) => break,
            Ok(event) => event?,
        };
        match event {
            Some(JobEvent::Step { .. }) => watched.steps += 1,
            Some(JobEvent::Membership { changes, .. }) => {
                let at = start.elapsed().as_secs_f64();
                watched.changes.extend(changes.into_iter().map(|c| (at, c)));
            }
            Some(event) if event.is_terminal() => {
                watched.ended = Some(format!("{event:?}"));
                return Ok(watched);
            }
            Some(_) => {}
            None => {
                watched.ended = Some("the event stream closed".into());
                return Ok(watched);
            }
        }
    }
    handle.cancel().await?;
    handle.close().await;
    Ok(watched)
}

/// The pauses done (daemon index, milliseconds held) and the 1-minute load average seen between them.
struct Schedule {
    pauses: Vec<(usize, u64)>,
    load: Value,
}

/// Until `end`: wait a gap, SIGSTOP daemon i of every cluster at once, hold, SIGCONT. Each gap, daemon
/// and hold come from the seeded schedule.
async fn pause_loop(args: &SoakArgs, pids: &[Vec<u32>], end: Instant) -> anyhow::Result<Schedule> {
    let mut rng = XorShift(args.seed.max(1));
    let (mut pauses, mut load) = (Vec::new(), Vec::new());
    loop {
        let gap = args.pause_every_ms / 2 + rng.below(args.pause_every_ms + 1);
        let victim = rng.below(args.nodes as u64) as usize;
        let hold = args.pause_min_ms + rng.below(args.pause_max_ms - args.pause_min_ms + 1);
        tokio::time::sleep(Duration::from_millis(gap)).await;
        if Instant::now() + Duration::from_millis(hold) >= end {
            break;
        }
        let victims: Vec<u32> = pids.iter().filter_map(|p| p.get(victim).copied()).collect();
        signal("-STOP", &victims)?;
        tokio::time::sleep(Duration::from_millis(hold)).await;
        signal("-CONT", &victims)?;
        pauses.push((victim, hold));
        load.extend(load_1m());
    }
    Ok(Schedule { pauses, load: quantiles_with(load, &[0.5]) })
}

fn signal(which: &str, pids: &[u32]) -> anyhow::Result<()> {
    let status = std::process::Command::new("kill").arg(which).args(pids.iter().map(u32::to_string)).status()?;
    if !status.success() {
        bail!("kill {which} {pids:?} failed");
    }
    Ok(())
}

/// The 1-minute load average (Linux's /proc/loadavg).
fn load_1m() -> Option<f64> {
    std::fs::read_to_string("/proc/loadavg").ok()?.split_whitespace().next()?.parse().ok()
}

/// The busy-loop children, killed (by their ids) when dropped.
struct Hogs(Vec<std::process::Child>);

impl Hogs {
    fn start(n: usize) -> anyhow::Result<Self> {
        let mut hogs = Hogs(Vec::new());
        for _ in 0..n {
            let child = std::process::Command::new("sh")
                .args(["-c", "while :; do :; done"])
                .spawn()
                .context("starting a busy-loop child (sh)")?;
            hogs.0.push(child);
        }
        Ok(hogs)
    }
}

impl Drop for Hogs {
    fn drop(&mut self) {
        for child in &mut self.0 {
            let _ = child.kill();
            let _ = child.wait();
        }
    }
}

/// xorshift64: the pauses' schedule, reproducible from `--seed`.
struct XorShift(u64);

impl XorShift {
    fn below(&mut self, n: u64) -> u64 {
        self.0 ^= self.0 << 13;
        self.0 ^= self.0 >> 7;
        self.0 ^= self.0 << 17;
        self.0 % n.max(1)
    }
}

/// One heartbeat arrival at the controller, as its log line says.
#[derive(Clone, Debug, PartialEq)]
struct Arrival {
    node: String,
    silence_ms: f64,
    phi: f64,
    phi_allowed_ms: f64,
    allowed_ms: f64,
}

/// The heartbeat arrivals in a controller's log (lines of [`ARRIVALS_TARGET`]; colours stripped).
fn arrivals(log: &str) -> Vec<Arrival> {
    log.lines().filter(|l| l.contains(ARRIVALS_TARGET)).filter_map(|l| parse_arrival(&strip_ansi(l))).collect()
}

fn parse_arrival(line: &str) -> Option<Arrival> {
    let field = |key: &str| {
        let pattern = format!(" {key}=");
        let at = line.find(&pattern)? + pattern.len();
        line[at..].split_whitespace().next()
    };
    let number = |key: &str| field(key)?.parse::<f64>().ok();
    Some(Arrival {
        node: field("node")?.to_string(),
        silence_ms: number("silence_us")? / 1e3,
        phi: number("phi")?,
        phi_allowed_ms: number("phi_allowed_us")? / 1e3,
        allowed_ms: number("allowed_us")? / 1e3,
    })
}

fn strip_ansi(line: &str) -> String {
    let mut out = String::with_capacity(line.len());
    let mut chars = line.chars();
    while let Some(c) = chars.next() {
        if c == '\u{1b}' {
            // CSI: ESC [ parameters final-byte (a letter).
            for c in chars.by_ref() {
                if c.is_ascii_alphabetic() {
                    break;
                }
            }
        } else {
            out.push(c);
        }
    }
    out
}

/// One detector's figures: false detections, φ's distribution at the arrivals, the silences, and the
/// closest call (the least margin between a silence and what each detector allowed then). The headline
/// figures are of the heartbeats that crossed the network: the controller's own entry (`controller`:
/// its daemon hears itself at every tick of its timer) is only in `by_node`.
fn detector_report(kind: DetectorKind, watched: &Watched, all: &[Arrival], controller: &str) -> Value {
    let by_node = by_node(all);
    let arrivals: Vec<Arrival> = all.iter().filter(|a| a.node != controller).cloned().collect();
    let arrivals = &arrivals[..];
    let phis: Vec<f64> = arrivals.iter().map(|a| a.phi).collect();
    let buckets = [(0.0, 1.0), (1.0, 2.0), (2.0, 4.0), (4.0, 8.0), (8.0, f64::INFINITY)];
    let histogram: Vec<Value> = buckets
        .iter()
        .map(|&(lo, hi)| json!({ "phi_from": lo, "count": phis.iter().filter(|&&p| p >= lo && p < hi).count() }))
        .collect();
    let closest = |allowed: fn(&Arrival) -> f64| arrivals.iter().map(|a| allowed(a) - a.silence_ms).reduce(f64::min);
    json!({
        "failure_detector": detector_name(kind),
        "false_detections": watched.changes.len(),
        "changes": watched.changes.iter().map(|(t, c)| json!({ "at_s": t, "change": c })).collect::<Vec<_>>(),
        "steps_committed": watched.steps,
        "job_ended_early": watched.ended,
        "arrivals": arrivals.len(),
        "phi": quantiles_with(phis.clone(), &[0.5, 0.99, 0.999]),
        "phi_histogram": histogram,
        "silence_ms": quantiles_with(arrivals.iter().map(|a| a.silence_ms).collect(), &[0.5, 0.99, 0.999]),
        "by_node": by_node,
        "controller": controller,
        "phi_allowed_ms": quantiles_with(arrivals.iter().map(|a| a.phi_allowed_ms).collect(), &[0.5]),
        "closest_call_ms": { "phi_accrual": closest(|a| a.phi_allowed_ms), "this_detector": closest(|a| a.allowed_ms) },
        "arrivals_past_phi_allowed": arrivals.iter().filter(|a| a.silence_ms >= a.phi_allowed_ms).count(),
    })
}

/// Each member's arrivals, longest silence and highest φ.
fn by_node(arrivals: &[Arrival]) -> Vec<Value> {
    let nodes: std::collections::BTreeSet<&str> = arrivals.iter().map(|a| a.node.as_str()).collect();
    nodes
        .iter()
        .map(|n| {
            let of = || arrivals.iter().filter(|a| a.node == *n);
            json!({
                "node": n, "arrivals": of().count(),
                "silence_ms_max": of().map(|a| a.silence_ms).reduce(f64::max),
                "phi_max": of().map(|a| a.phi).reduce(f64::max),
            })
        })
        .collect()
}

#[cfg(test)]
mod tests {
    use super::*;

    /// A controller's log line as the daemon's fmt subscriber writes it (colours on), and one of another
    /// target: only the arrival is read, every field of it.
    #[test]
    fn arrivals_are_read_from_the_controllers_log() {
        let log = "2026-11-27T16:40:01.123Z \u{1b}[34mDEBUG\u{1b}[0m \u{1b}[2mtroupe_cluster::membership::arrivals\u{1b}[0m\u{1b}[2m:\u{1b}[0m heartbeat arrival \u{1b}[3mnode\u{1b}[0m\u{1b}[2m=\u{1b}[0mnode-1 \u{1b}[3msilence_us\u{1b}[0m\u{1b}[2m=\u{1b}[0m612500 \u{1b}[3mphi\u{1b}[0m\u{1b}[2m=\u{1b}[0m3.25 \u{1b}[3mphi_allowed_us\u{1b}[0m\u{1b}[2m=\u{1b}[0m750000 \u{1b}[3mallowed_us\u{1b}[0m\u{1b}[2m=\u{1b}[0m1500000\n\
                   2026-11-27T16:40:02Z  WARN troupe_actors::runtime: node=node-2 silence_us=1\n";
        let got = arrivals(log);
        assert_eq!(
            got,
            [Arrival {
                node: "node-1".into(),
                silence_ms: 612.5,
                phi: 3.25,
                phi_allowed_ms: 750.0,
                allowed_ms: 1500.0
            }]
        );
    }

    /// Every membership change is counted as a false detection; an arrival later than phi_accrual
    /// allowed is counted apart (the fixed detector's cluster shows what phi_accrual would have done).
    #[test]
    fn the_report_counts_false_detections_and_late_arrivals() {
        let arrival = |silence_ms, phi| Arrival {
            node: "node-1".into(),
            silence_ms,
            phi,
            phi_allowed_ms: 750.0,
            allowed_ms: 1500.0,
        };
        let watched = Watched {
            steps: 10,
            changes: vec![(3.0, "Failed { node: NodeId(\"node-1\"), silent_ms: 1502 }".into())],
            ended: None,
        };
        let mut own = arrival(900.0, 12.0);
        own.node = "node-0".into();
        let arrivals = [arrival(250.0, 0.1), arrival(800.0, 9.0), own];
        let report = detector_report(DetectorKind::Fixed, &watched, &arrivals, "node-0");
        assert_eq!(report["arrivals"], 2, "the controller's own ticks are not heartbeats over the network");
        assert_eq!(report["by_node"][0]["phi_max"], 12.0);
        assert_eq!(report["false_detections"], 1);
        assert_eq!(report["arrivals_past_phi_allowed"], 1);
        assert_eq!(report["closest_call_ms"]["phi_accrual"], -50.0);
        assert_eq!(report["closest_call_ms"]["this_detector"], 700.0);
        assert_eq!(report["phi_histogram"][0]["count"], 1);
        assert_eq!(report["phi_histogram"][4]["count"], 1);
    }
}
