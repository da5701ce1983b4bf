//! Running the PyTorch Gloo all-reduce peer (bench/peers/gloo_allreduce.py) for a side-by-side figure.

use std::path::Path;
use std::process::Command;

use anyhow::Context;
use serde::{Deserialize, Serialize};

#[derive(Clone, Debug, Serialize, Deserialize)]
pub struct PeerReport {
    pub name: String,
    pub world: usize,
    pub mib: usize,
    #[serde(rename = "busbw_GBps")]
    pub busbw_gbps: f64,
    pub seconds_per_iter: f64,
    /// CPU time (user and system, every thread) its ranks' processes used together per timed
    /// all-reduce (Python's `time.process_time`); `None` from a script that does not report it.
    #[serde(default)]
    pub cpu_seconds_per_iter: Option<f64>,
}

pub fn run_gloo_peer(
    python: &Path,
    script: &Path,
    world: usize,
    mib: usize,
    iters: usize,
    warmup: usize,
) -> anyhow::Result<PeerReport> {
    let out = Command::new(python)
        .arg(script)
        .args([
            "--world",
            &world.to_string(),
            "--mib",
            &mib.to_string(),
            "--iters",
            &iters.to_string(),
            "--warmup",
            &warmup.to_string(),
            "--json",
        ])
        .output()
        .with_context(|| {
            format!(
                "running {} {} (set TROUPE_TORCH_PYTHON to a python with torch)",
                python.display(),
                script.display()
            )
        })?;
    let stdout = String::from_utf8_lossy(&out.stdout);
    if !out.status.success() {
        anyhow::bail!("gloo peer failed ({}): {}", out.status, String::from_utf8_lossy(&out.stderr));
    }
    let line = stdout.lines().rev().find(|l| l.starts_with('{')).context("gloo peer printed no JSON")?;
    Ok(serde_json::from_str(line)?)
}

/// The Gloo peer's ranks, one process each, every one inside the namespace of its host (as the
/// benchmark's ranks: rank r on host [`super::launch::host_of_rank`]); rank 0's host address is the
/// rendezvous (`MASTER_ADDR`), Gloo's sockets bound to [`super::netns::IFNAME`]. The slowest rank's
/// seconds per iteration, as for ours.
pub fn run_gloo_peer_netns(
    job: &GlooJob<'_>,
    net: &super::netns::NetnsHosts,
    timeout: std::time::Duration,
) -> anyhow::Result<PeerReport> {
    let deadline = std::time::Instant::now() + timeout;
    let mut children = Vec::new();
    for rank in 0..job.world {
        let mut c = net.command(super::launch::host_of_rank(rank, job.world, net.hosts()), job.python);
        c.arg(job.script)
            .args(["--world", &job.world.to_string(), "--mib", &job.mib.to_string()])
            .args(["--iters", &job.iters.to_string(), "--warmup", &job.warmup.to_string(), "--json"])
            .args(["--rank", &rank.to_string(), "--master-addr", &net.addr(0).to_string(), "--master-port", "29511"])
            .env("GLOO_SOCKET_IFNAME", super::netns::IFNAME)
            .stdout(std::process::Stdio::piped());
        match c.spawn() {
            Ok(child) => children.push(child),
            Err(e) => {
                kill_children(&mut children);
                return Err(e).with_context(|| format!("starting gloo rank {rank} with {}", job.python.display()));
            }
        }
    }
    let (mut seconds, mut cpu) = (0f64, Some(0f64));
    for rank in 0..children.len() {
        let line = wait_json_line(&mut children[rank], deadline);
        let parsed = line.as_deref().and_then(|l| serde_json::from_str::<serde_json::Value>(l).ok());
        match parsed.as_ref().and_then(|v| v["seconds_per_iter"].as_f64()) {
            Some(s) => {
                seconds = seconds.max(s);
                cpu = cpu.zip(parsed.as_ref().and_then(|v| v["cpu_seconds_per_iter"].as_f64())).map(|(a, b)| a + b);
            }
            None => {
                kill_children(&mut children);
                let ns = net.namespace(super::launch::host_of_rank(rank, job.world, net.hosts()));
                anyhow::bail!("gloo rank {rank} in namespace {ns} gave no report (its stderr above)");
            }
        }
    }
    let busbw = super::busbw_gbps(job.mib << 20, seconds, job.world);
    Ok(PeerReport {
        name: "gloo".into(),
        world: job.world,
        mib: job.mib,
        busbw_gbps: busbw,
        seconds_per_iter: seconds,
        cpu_seconds_per_iter: cpu,
    })
}

/// What the Gloo peer runs.
pub struct GlooJob<'a> {
    pub python: &'a Path,
    pub script: &'a Path,
    pub world: usize,
    pub mib: usize,
    pub iters: usize,
    pub warmup: usize,
}

/// Kills and reaps every one of `children`.
pub fn kill_children(children: &mut [std::process::Child]) {
    for c in children {
        let _ = c.kill();
        let _ = c.wait();
    }
}

/// The last JSON line `child` printed once it exited successfully; `None` if it failed, or is still
/// running at `deadline` or after an interrupt (then it is killed).
pub fn wait_json_line(child: &mut std::process::Child, deadline: std::time::Instant) -> Option<String> {
    use std::io::Read;
    loop {
        match child.try_wait() {
            Ok(Some(status)) => {
                let mut out = String::new();
                child.stdout.take()?.read_to_string(&mut out).ok()?;
                return status.success().then(|| out.lines().rev().find(|l| l.starts_with('{')).map(String::from))?;
            }
            Ok(None) if std::time::Instant::now() < deadline && !super::netns::interrupted() => {
                std::thread::sleep(std::time::Duration::from_millis(10))
            }
            _ => {
                let _ = child.kill();
                let _ = child.wait();
                return None;
            }
        }
    }
}
