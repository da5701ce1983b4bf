//! The all-reduce benchmark's command line, one definition for both launchers: `troupe bench allreduce`
//! and the libtorch-free `troupe-cluster-rank bench`.

use std::path::PathBuf;

use super::{default_peer_script, default_python, AllreduceBench, BenchTransport};

#[derive(Debug, clap::Args)]
pub struct AllreduceArgs {
    /// Number of rank processes.
    #[arg(long, default_value_t = 2)]
    pub world: usize,
    /// Spread the ranks over this many hosts (loopback addresses 127.0.0.1, 127.0.0.2, …): all-reduce
    /// then runs in two tiers, within each host in shared memory and across hosts over the transport
    /// (QUIC, or encrypted or plaintext TCP).
    #[arg(long, default_value_t = 1)]
    pub hosts: usize,
    /// With --hosts: one flat ring among all ranks, no tiers, for comparison (messages between ranks
    /// of one host still take the same-host transport, as in the runtime).
    #[arg(long)]
    pub flat: bool,
    /// Run the ranks as on this many hosts: Linux network namespaces joined by veth pairs through a
    /// bridge (host h at 10.77.0.(h + 1)), ranks spread evenly over them, each inside its own (and
    /// with --peer Gloo's ranks over the same namespaces), over the network transport profile (QUIC
    /// MTU 1452, as between real hosts). Needs root and iproute2; the namespaces are deleted when the
    /// benchmark ends. 0: loopback, no namespaces.
    #[arg(long, default_value_t = 0)]
    pub netns: usize,
    /// With --netns: shape each namespace's link to this many Gbit/s (tc tbf), a link-limited path.
    #[arg(long)]
    pub rate_gbit: Option<f64>,
    /// Size of the f32 buffer all-reduced, in MiB.
    #[arg(long, default_value_t = 64)]
    pub mib: usize,
    /// Timed iterations (after `--warmup` untimed ones).
    #[arg(long, default_value_t = 10)]
    pub iters: usize,
    #[arg(long, default_value_t = 2)]
    pub warmup: usize,
    /// quic (mutual-TLS QUIC on loopback), local (the same-host transport), encrypted-tcp (the opt-in
    /// TCP data plane, mutual TLS 1.3 with the cluster's certificates, set up through QUIC) or plaintext-tcp (the same
    /// unencrypted, for trusted fabrics).
    #[arg(long, default_value = "quic")]
    pub transport: BenchTransport,
    /// Also run PyTorch Gloo (bench/peers/gloo_allreduce.py) and report both.
    #[arg(long)]
    pub peer: bool,
    /// Python with torch for --peer (default: $TROUPE_TORCH_PYTHON or the provisioned venv).
    #[arg(long)]
    pub python: Option<PathBuf>,
    /// The Gloo peer script (default: bench/peers/gloo_allreduce.py of this checkout).
    #[arg(long)]
    pub peer_script: Option<PathBuf>,
    /// One JSON object on one line.
    #[arg(long)]
    pub json: bool,
    /// Kill every rank after this many seconds.
    #[arg(long, default_value_t = 600)]
    pub timeout_s: u64,
}

impl AllreduceArgs {
    /// The benchmark these flags ask for, defaults filled in.
    pub fn bench(self) -> AllreduceBench {
        AllreduceBench {
            world: self.world,
            hosts: self.hosts,
            netns: self.netns,
            rate_gbit: self.rate_gbit,
            flat: self.flat,
            mib: self.mib,
            iters: self.iters,
            warmup_iters: self.warmup,
            transport: self.transport,
            peer: self.peer,
            python: self.python.unwrap_or_else(default_python),
            peer_script: self.peer_script.unwrap_or_else(default_peer_script),
            rank_timeout_ms: self.timeout_s * 1000,
        }
    }
}
