//! Hosts for `troupe bench allreduce --netns H`: H network namespaces of [`crate::netns`] on one
//! bridge (host h at 10.77.0.(h + 1) on interface [`IFNAME`], MTU 1500, no address in the root
//! namespace); with a rate, each host's egress is shaped by a tc token bucket (tbf), a link-limited
//! path. What is the benchmark's own: its flag names in the errors, and signal handling — a SIGINT or
//! SIGTERM while the hosts live is caught so that the benchmark stops its ranks and the namespaces are
//! deleted on drop. Namespaces a killed benchmark left behind (their process gone) are deleted by the
//! next one ([`crate::netns::Namespaces::create`]).

use std::net::Ipv4Addr;
use std::path::Path;
use std::process::Command;
use std::sync::atomic::{AtomicBool, Ordering};

use anyhow::bail;

pub use crate::netns::IFNAME;
use crate::netns::{Layout, Namespaces, NetnsError, Subnet};

/// Every namespace of this benchmark is named `troupe-bench-<pid>-…`.
pub const NETNS_PREFIX: &str = "troupe-bench-";

static INTERRUPTED: AtomicBool = AtomicBool::new(false);

/// Whether a SIGINT or SIGTERM arrived while namespaces were up (the launcher then stops its ranks).
pub fn interrupted() -> bool {
    INTERRUPTED.load(Ordering::Relaxed)
}

extern "C" fn on_signal(_: libc::c_int) {
    INTERRUPTED.store(true, Ordering::Relaxed);
}

/// The namespaces of benchmark runs that exist now, as `(name, pid of the run that made it)`.
pub fn bench_namespaces() -> Vec<(String, u32)> {
    crate::netns::namespaces_of(NETNS_PREFIX)
}

/// H hosts as network namespaces (see the module docs).
pub struct NetnsHosts {
    /// Taken on drop, so that the namespaces are gone before the signal dispositions are restored.
    net: Option<Namespaces>,
    pub rate_gbit: Option<f64>,
}

impl NetnsHosts {
    /// Creates `hosts` namespaces on a bridge; Err says what this machine lacks and the fix.
    pub fn create(hosts: usize, rate_gbit: Option<f64>) -> anyhow::Result<Self> {
        if !(2..=200).contains(&hosts) {
            bail!("--netns {hosts}: use 2 to 200 namespaces");
        }
        let layout = Layout {
            prefix: NETNS_PREFIX,
            nodes: hosts,
            subnet: Subnet::Fixed([10, 77, 0]),
            host_address: false,
            rate_gbit,
            iptables: false,
        };
        let net = Namespaces::create(&layout).map_err(|e| match e {
            NetnsError::NotRoot => anyhow::anyhow!("--netns {e}: run as root, or leave --netns out"),
            NetnsError::NoTc => anyhow::anyhow!("--rate-gbit {e}, or leave --rate-gbit out"),
            NetnsError::Setup(_) if rate_gbit.is_some() => anyhow::anyhow!("--netns with --rate-gbit: {e}"),
            e => anyhow::anyhow!("--netns {e}"),
        })?;
        // SAFETY: the handler only stores to an atomic, which is async-signal-safe.
        unsafe {
            libc::signal(libc::SIGINT, on_signal as *const () as libc::sighandler_t);
            libc::signal(libc::SIGTERM, on_signal as *const () as libc::sighandler_t);
        }
        Ok(NetnsHosts { net: Some(net), rate_gbit })
    }

    fn net(&self) -> &Namespaces {
        self.net.as_ref().expect("the namespaces live until drop")
    }

    pub fn hosts(&self) -> usize {
        self.net().nodes()
    }

    /// Host h's address on the shared segment.
    pub fn addr(&self, h: usize) -> Ipv4Addr {
        self.net().addr(h)
    }

    /// Host h's namespace name.
    pub fn namespace(&self, h: usize) -> &str {
        self.net().namespace(h)
    }

    /// `program` to be run inside host h's namespace (`ip netns exec`, which execs it: the child's
    /// pid is the program's).
    pub fn command(&self, h: usize, program: &Path) -> Command {
        self.net().command(h, program)
    }
}

impl Drop for NetnsHosts {
    fn drop(&mut self) {
        drop(self.net.take());
        // SAFETY: restoring the default dispositions.
        unsafe {
            libc::signal(libc::SIGINT, libc::SIG_DFL);
            libc::signal(libc::SIGTERM, libc::SIG_DFL);
        }
    }
}
