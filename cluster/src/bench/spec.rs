//! What a launched rank process is told to do (JSON in an environment variable) and what it reports
//! (one JSON line on stdout).

use std::net::SocketAddr;
use std::path::PathBuf;

use serde::{Deserialize, Serialize};

use super::PeerReport;
use crate::TransportConfig;

#[derive(Clone, Copy, Debug, PartialEq, Eq, Serialize, Deserialize)]
#[serde(rename_all = "snake_case")]
pub enum BenchTransport {
    Quic,
    Local,
    /// The plaintext TCP data plane, set up through the QUIC mesh ([`crate::transport::tcp`]).
    PlaintextTcp,
    /// The encrypted TCP data plane: the same over mutual TLS 1.3 ([`crate::transport::tcp`]).
    EncryptedTcp,
}

impl BenchTransport {
    /// Whether the ranks form a QUIC mesh (certificates, one address each): every transport but `local`.
    pub fn uses_quic(self) -> bool {
        self != BenchTransport::Local
    }

    /// Over TCP, how its payloads travel; `None` for QUIC or same-host.
    pub fn tcp_payloads(self) -> Option<crate::transport::tcp::TcpPayloads> {
        use crate::transport::tcp::TcpPayloads;
        match self {
            BenchTransport::PlaintextTcp => Some(TcpPayloads::Plaintext),
            BenchTransport::EncryptedTcp => Some(TcpPayloads::Encrypted),
            BenchTransport::Quic | BenchTransport::Local => None,
        }
    }
}

impl std::str::FromStr for BenchTransport {
    type Err = String;
    fn from_str(s: &str) -> Result<Self, String> {
        match s {
            "quic" => Ok(BenchTransport::Quic),
            "local" => Ok(BenchTransport::Local),
            "plaintext-tcp" => Ok(BenchTransport::PlaintextTcp),
            "encrypted-tcp" => Ok(BenchTransport::EncryptedTcp),
            other => Err(format!("unknown transport {other:?}: use quic, local, encrypted-tcp or plaintext-tcp")),
        }
    }
}

#[derive(Clone, Debug, PartialEq, Serialize, Deserialize)]
pub enum RankMode {
    /// Time `iters` all-reduces of `elems` f32 after `warmup_iters`.
    Bench { elems: usize, iters: usize, warmup_iters: usize },
    /// Run every collective on known data and check the results.
    Check,
    /// All-reduce `elems` repeatedly for up to `seconds` (for kill tests).
    Loop { elems: usize, seconds: u64 },
}

#[derive(Clone, Debug, Serialize, Deserialize)]
pub struct RankSpec {
    pub rank: usize,
    pub world: usize,
    pub transport: BenchTransport,
    /// Cluster directory (certificates) for QUIC; socket directory for the same-host transport.
    pub dir: PathBuf,
    /// Node names are `rank-<i>`.
    pub addrs: Vec<SocketAddr>,
    pub config: TransportConfig,
    pub mode: RankMode,
    /// QUIC ranks whose addresses are on several hosts (IPs) all-reduce in two tiers unless this is set.
    #[serde(default)]
    pub flat: bool,
}

#[derive(Clone, Debug, Default, Serialize, Deserialize)]
pub struct RankReport {
    pub rank: usize,
    pub seconds_per_iter: f64,
    /// Bench mode: the CPU time (user and system, every thread) the rank's process used per timed
    /// all-reduce.
    #[serde(default)]
    pub cpu_seconds_per_iter: f64,
    pub iterations: usize,
    /// The error, if the rank failed, and its variant name (e.g. `PeerLost`).
    pub error: Option<String>,
    pub error_kind: Option<String>,
    /// Milliseconds from the start of the failing call to its error.
    pub failed_after_ms: Option<u64>,
    pub checks_passed: usize,
    /// Whether the rank's collectives ran in the same-host transport's shared-memory arena.
    #[serde(default)]
    pub shared_memory: bool,
    /// Whether its all-reduce ran in two tiers (within hosts in their arenas, across hosts over QUIC).
    #[serde(default)]
    pub host_tier: bool,
    /// Whether its messages to ranks on its own host took the same-host transport (QUIC ranks spread
    /// over hosts, some sharing one).
    #[serde(default)]
    pub same_host_routes: bool,
    /// Bench mode: whether one more all-reduce after the timed ones, of rank-dependent integers,
    /// gave exactly their sum on this rank.
    #[serde(default)]
    pub verified: bool,
}

#[derive(Clone, Debug, Serialize, Deserialize)]
pub struct AllreduceReport {
    pub bench: String,
    pub transport: BenchTransport,
    pub world: usize,
    /// Hosts the ranks were spread over (loopback addresses 127.0.0.1, 127.0.0.2, …, or with `netns`
    /// that many network namespaces).
    pub hosts: usize,
    /// Whether every rank's all-reduce ran in two tiers.
    pub host_tier: bool,
    /// Whether every rank's messages to ranks on its own host took the same-host transport (Unix
    /// sockets) rather than QUIC.
    pub same_host_routes: bool,
    pub mib: usize,
    pub iters: usize,
    pub seconds_per_iter: f64,
    #[serde(rename = "algbw_GBps")]
    pub algbw_gbps: f64,
    #[serde(rename = "busbw_GBps")]
    pub busbw_gbps: f64,
    /// CPU time (user and system) all ranks' processes used together per timed all-reduce, and per
    /// byte of the payload (nanoseconds): the cost of moving it, whatever the cores' count.
    #[serde(default)]
    pub cpu_seconds_per_iter: f64,
    #[serde(default)]
    pub cpu_ns_per_byte: f64,
    /// Whether every rank's collectives ran in the shared-memory arena (`local` transport only).
    pub shared_memory: bool,
    /// Network namespaces the ranks ran in (`--netns`; 0: none, loopback).
    #[serde(default)]
    pub netns: usize,
    /// The tc tbf rate each namespace's link was shaped to, in Gbit/s (`--rate-gbit`).
    #[serde(default)]
    pub rate_gbit: Option<f64>,
    /// Whether every rank's check all-reduce (after the timed ones) gave exactly the sum.
    #[serde(default)]
    pub verified: bool,
    pub peer: Option<PeerReport>,
    pub ratio_vs_peer: Option<f64>,
    /// Our CPU per byte over the peer's (below 1: we spend less CPU to move the same bytes).
    #[serde(default)]
    pub cpu_ratio_vs_peer: Option<f64>,
}
