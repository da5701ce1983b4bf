//! Starting rank processes on this machine and collecting their reports, every wait bounded.

use std::io::Read;
use std::net::{SocketAddr, UdpSocket};
use std::path::Path;
use std::process::{Child, Command, Stdio};
use std::time::{Duration, Instant};

use anyhow::Context;

use super::netns::{interrupted, NetnsHosts};
use super::{BenchTransport, RankMode, RankReport, RankSpec};
use crate::TransportConfig;

/// Environment variable carrying a rank's [`RankSpec`] as JSON.
pub const RANK_SPEC_ENV: &str = "TROUPE_RANK_SPEC";

pub struct LaunchedRanks {
    pub children: Vec<Child>,
    /// Keeps certificates and sockets alive until the ranks are done.
    pub dir: tempfile::TempDir,
    pub specs: Vec<RankSpec>,
}

/// Free UDP ports on loopback, rank r's on 127.0.0.(h + 1) for its host h = r · hosts / n (hosts of
/// consecutive ranks, as even as can be). Bound and released: a small race the ranks' own binds would
/// reveal.
fn free_udp_addrs(n: usize, hosts: usize) -> anyhow::Result<Vec<SocketAddr>> {
    let hosts = hosts.clamp(1, 254);
    let sockets: Vec<UdpSocket> = (0..n)
        .map(|r| UdpSocket::bind((std::net::Ipv4Addr::new(127, 0, 0, (r * hosts / n) as u8 + 1), 0)))
        .collect::<Result<_, _>>()?;
    Ok(sockets.iter().map(|s| s.local_addr()).collect::<Result<_, _>>()?)
}

pub fn node_name(rank: usize) -> String {
    format!("rank-{rank}")
}

/// Where the ranks run: how many hosts (loopback addresses) QUIC ranks are spread over, and whether
/// they all-reduce flat even when spread.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct Placement {
    pub hosts: usize,
    pub flat: bool,
}

impl Placement {
    /// Every rank on 127.0.0.1.
    pub const ONE_HOST: Placement = Placement { hosts: 1, flat: false };
}

/// Creates a cluster (CA + one certificate per rank) in a temporary directory and starts `world`
/// processes `exe rank_args...`, each with its spec in [`RANK_SPEC_ENV`].
pub fn launch_ranks(
    exe: &Path,
    rank_args: &[&str],
    world: usize,
    transport: BenchTransport,
    mode: RankMode,
    config: TransportConfig,
    placement: Placement,
) -> anyhow::Result<LaunchedRanks> {
    let dir = tempfile::tempdir()?;
    let addrs = if transport.uses_quic() {
        crate::init_cluster(dir.path())?;
        for r in 0..world {
            crate::add_node(&node_name(r), dir.path())?;
        }
        free_udp_addrs(world, placement.hosts)?
    } else {
        Vec::new()
    };
    let specs = rank_specs(dir.path(), world, transport, mode, config, addrs, placement.flat);
    let children = spawn_ranks(exe, rank_args, &specs, None)?;
    Ok(LaunchedRanks { children, dir, specs })
}

/// One spec per rank, all in `dir`, the ranks at `addrs` (empty for the same-host transport).
pub fn rank_specs(
    dir: &Path,
    world: usize,
    transport: BenchTransport,
    mode: RankMode,
    config: TransportConfig,
    addrs: Vec<SocketAddr>,
    flat: bool,
) -> Vec<RankSpec> {
    (0..world)
        .map(|rank| RankSpec {
            rank,
            world,
            transport,
            dir: dir.to_path_buf(),
            addrs: addrs.clone(),
            config: config.clone(),
            mode: mode.clone(),
            flat,
        })
        .collect()
}

/// Starts `exe rank_args...` once per spec, each with its spec in [`RANK_SPEC_ENV`]; with `netns`,
/// each inside the namespace of its host (the host of its address). A failed start kills those
/// already started.
pub fn spawn_ranks(
    exe: &Path,
    rank_args: &[&str],
    specs: &[RankSpec],
    netns: Option<&NetnsHosts>,
) -> anyhow::Result<Vec<Child>> {
    let mut children: Vec<Child> = Vec::new();
    for spec in specs {
        let mut command = match netns {
            Some(net) => net.command(host_of_rank(spec.rank, spec.world, net.hosts()), exe),
            None => Command::new(exe),
        };
        let started = command
            .args(rank_args)
            .env(RANK_SPEC_ENV, serde_json::to_string(spec)?)
            .stdout(Stdio::piped())
            .stderr(Stdio::inherit())
            .spawn()
            .with_context(|| format!("starting rank {} as {}", spec.rank, exe.display()));
        match started {
            Ok(child) => children.push(child),
            Err(e) => {
                for c in &mut children {
                    let _ = c.kill();
                    let _ = c.wait();
                }
                return Err(e);
            }
        }
    }
    Ok(children)
}

/// The host of rank r of n spread over `hosts`: consecutive ranks, as even as can be.
pub fn host_of_rank(rank: usize, world: usize, hosts: usize) -> usize {
    rank * hosts / world.max(1)
}

/// Starts the ranks of a benchmark spread over the namespaces of `net` (rank r on host
/// [`host_of_rank`], at port 41000 + r of its host's address: a fresh namespace has every port free).
pub fn launch_ranks_netns(
    exe: &Path,
    rank_args: &[&str],
    world: usize,
    transport: BenchTransport,
    mode: RankMode,
    config: TransportConfig,
    net: &NetnsHosts,
) -> anyhow::Result<LaunchedRanks> {
    anyhow::ensure!(transport.uses_quic(), "--netns needs --transport quic, encrypted-tcp or plaintext-tcp");
    let dir = tempfile::tempdir()?;
    crate::init_cluster(dir.path())?;
    for r in 0..world {
        crate::add_node(&node_name(r), dir.path())?;
    }
    let addrs = (0..world)
        .map(|r| SocketAddr::from((net.addr(host_of_rank(r, world, net.hosts())), 41000 + r as u16)))
        .collect();
    let specs = rank_specs(dir.path(), world, transport, mode, config, addrs, false);
    let children = spawn_ranks(exe, rank_args, &specs, Some(net))?;
    Ok(LaunchedRanks { children, dir, specs })
}

impl LaunchedRanks {
    /// Waits for every rank to exit (killing all after `timeout_ms`) and parses their reports.
    pub fn wait_all(mut self, timeout_ms: u64) -> anyhow::Result<Vec<RankReport>> {
        let deadline = Instant::now() + Duration::from_millis(timeout_ms);
        let mut reports = Vec::new();
        for (rank, child) in self.children.iter_mut().enumerate() {
            reports.push(wait_one(rank, child, deadline));
        }
        let hung: Vec<usize> = reports.iter().enumerate().filter(|(_, r)| r.is_none()).map(|(i, _)| i).collect();
        if !hung.is_empty() {
            for c in &mut self.children {
                let _ = c.kill();
                let _ = c.wait();
            }
            if interrupted() {
                anyhow::bail!("interrupted (SIGINT or SIGTERM): ranks {hung:?} stopped");
            }
            anyhow::bail!("ranks {hung:?} did not finish within {timeout_ms} ms");
        }
        Ok(reports.into_iter().flatten().collect())
    }
}

/// Waits for `child` until `deadline`; `None` if it is still running. A rank that died without a
/// report yields a report carrying the exit status as its error.
pub fn wait_one(rank: usize, child: &mut Child, deadline: Instant) -> Option<RankReport> {
    loop {
        match child.try_wait() {
            Ok(Some(status)) => {
                let mut out = String::new();
                if let Some(mut s) = child.stdout.take() {
                    let _ = s.read_to_string(&mut out);
                }
                let parsed = out.lines().rev().find_map(|l| serde_json::from_str::<RankReport>(l).ok());
                return Some(parsed.unwrap_or(RankReport {
                    rank,
                    error: Some(format!("exited with {status} without a report")),
                    error_kind: Some("Exited".into()),
                    ..Default::default()
                }));
            }
            Ok(None) if Instant::now() < deadline && !interrupted() => std::thread::sleep(Duration::from_millis(10)),
            _ => return None,
        }
    }
}
