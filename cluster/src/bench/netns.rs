//! Hosts for `troupe bench allreduce --netns H`: H Linux network namespaces on this machine, each
//! with its own network stack (loopback, one veth interface, its own TCP/UDP ports), joined by veth
//! pairs to a bridge in a further "switch" namespace — two or more hosts on one Ethernet segment, so
//! every byte between hosts crosses a real (virtual) link and the kernel's full IP stack, not
//! loopback. Host h is 10.77.0.(h + 1) on interface [`IFNAME`] (MTU 1500); with a rate, each host's
//! egress is shaped by a tc token bucket (tbf), a link-limited path.
//!
//! Needs root (CAP_NET_ADMIN) and iproute2 (`ip`, and `tc` for a rate). Everything is deleted when
//! the [`NetnsHosts`] is dropped (deleting a namespace deletes its interfaces), after an error too; a
//! SIGINT or SIGTERM while it lives is caught so that the benchmark stops its ranks and cleans up, and
//! namespaces a killed benchmark left behind (their process gone) are deleted by the next one.

use std::net::Ipv4Addr;
use std::path::Path;
use std::process::Command;
use std::sync::atomic::{AtomicBool, Ordering};

use anyhow::{bail, Context};

/// Every namespace of this benchmark is named `troupe-bench-<pid>-…`.
pub const NETNS_PREFIX: &str = "troupe-bench-";

/// The interface each host namespace reaches the others by (for Gloo: `GLOO_SOCKET_IFNAME`).
pub const IFNAME: &str = "troupe0";

static INTERRUPTED: AtomicBool = AtomicBool::new(false);

/// Whether a SIGINT or SIGTERM arrived while namespaces were up (the launcher then stops its ranks).
pub fn interrupted() -> bool {
    INTERRUPTED.load(Ordering::Relaxed)
}

extern "C" fn on_signal(_: libc::c_int) {
    INTERRUPTED.store(true, Ordering::Relaxed);
}

/// H hosts as network namespaces (see the module docs).
pub struct NetnsHosts {
    tag: String,
    /// Host namespaces created so far, then the switch's (deleted last).
    namespaces: Vec<String>,
    switch: Option<String>,
    pub rate_gbit: Option<f64>,
}

fn ip_cmd(args: &[&str]) -> anyhow::Result<String> {
    let out = Command::new(args[0]).args(&args[1..]).output().with_context(|| format!("running {}", args[0]))?;
    if !out.status.success() {
        bail!("`{}` failed: {}", args.join(" "), String::from_utf8_lossy(&out.stderr).trim());
    }
    Ok(String::from_utf8_lossy(&out.stdout).into_owned())
}

/// The namespaces named by [`NETNS_PREFIX`] that exist now, as `(name, pid of the run that made it)`.
pub fn bench_namespaces() -> Vec<(String, u32)> {
    let Ok(list) = ip_cmd(&["ip", "netns", "list"]) else { return Vec::new() };
    list.lines()
        .filter_map(|l| l.split_whitespace().next())
        .filter_map(|name| {
            let pid = name.strip_prefix(NETNS_PREFIX)?.split('-').next()?.parse().ok()?;
            Some((name.to_string(), pid))
        })
        .collect()
}

/// Deletes namespaces of benchmark runs whose process is gone (killed before it could clean up).
fn sweep_stale() {
    for (name, pid) in bench_namespaces() {
        if !Path::new(&format!("/proc/{pid}")).exists() {
            let _ = ip_cmd(&["ip", "netns", "del", &name]);
        }
    }
}

impl NetnsHosts {
    /// Creates `hosts` namespaces on a bridge; Err says what this machine lacks and the fix.
    pub fn create(hosts: usize, rate_gbit: Option<f64>) -> anyhow::Result<Self> {
        // SAFETY: geteuid has no preconditions.
        if unsafe { libc::geteuid() } != 0 {
            bail!(
                "--netns needs root (CAP_NET_ADMIN, to create network namespaces): run as root, or leave --netns out"
            );
        }
        if ip_cmd(&["ip", "-V"]).is_err() {
            bail!("--netns needs iproute2's `ip` (Debian: apt-get install iproute2)");
        }
        if rate_gbit.is_some() && ip_cmd(&["tc", "-V"]).is_err() {
            bail!("--rate-gbit needs iproute2's `tc` (Debian: apt-get install iproute2), or leave --rate-gbit out");
        }
        if !(2..=200).contains(&hosts) {
            bail!("--netns {hosts}: use 2 to 200 namespaces");
        }
        sweep_stale();
        let tag = format!("{NETNS_PREFIX}{}", std::process::id());
        let mut net = NetnsHosts { tag, namespaces: Vec::new(), switch: None, rate_gbit };
        // SAFETY: the handler only stores to an atomic, which is async-signal-safe.
        unsafe {
            libc::signal(libc::SIGINT, on_signal as *const () as libc::sighandler_t);
            libc::signal(libc::SIGTERM, on_signal as *const () as libc::sighandler_t);
        }
        let switch = format!("{}-sw", net.tag);
        ip_cmd(&["ip", "netns", "add", &switch])?;
        net.switch = Some(switch.clone());
        ip_cmd(&["ip", "-n", &switch, "link", "add", "br0", "type", "bridge"])?;
        ip_cmd(&["ip", "-n", &switch, "link", "set", "br0", "up"])?;
        for h in 0..hosts {
            net.add_host(h, &switch)?;
        }
        Ok(net)
    }

    fn add_host(&mut self, h: usize, switch: &str) -> anyhow::Result<()> {
        let ns = format!("{}-h{h}", self.tag);
        ip_cmd(&["ip", "netns", "add", &ns])?;
        self.namespaces.push(ns.clone());
        let port = format!("p{h}");
        ip_cmd(&["ip", "-n", &ns, "link", "set", "lo", "up"])?;
        ip_cmd(&["ip", "-n", &ns, "link", "add", IFNAME, "type", "veth", "peer", "name", &port, "netns", switch])?;
        ip_cmd(&["ip", "-n", &ns, "addr", "add", &format!("{}/24", self.addr(h)), "dev", IFNAME])?;
        ip_cmd(&["ip", "-n", &ns, "link", "set", IFNAME, "up"])?;
        ip_cmd(&["ip", "-n", switch, "link", "set", &port, "master", "br0"])?;
        ip_cmd(&["ip", "-n", switch, "link", "set", &port, "up"])?;
        if let Some(gbit) = self.rate_gbit {
            // A bucket of 10 ms at the rate (at least 64 KiB: one GSO segment), queueing up to 100 ms.
            let burst = ((gbit * 1e9 / 8.0 / 100.0) as u64).max(64 << 10);
            let (rate, burst) = (format!("{}mbit", (gbit * 1000.0).round() as u64), burst.to_string());
            ip_cmd(&[
                "tc", "-n", &ns, "qdisc", "add", "dev", IFNAME, "root", "tbf", "rate", &rate, "burst", &burst,
                "latency", "100ms",
            ])
            .context("shaping the link with tc tbf (--rate-gbit): this kernel may lack sch_tbf")?;
        }
        Ok(())
    }

    pub fn hosts(&self) -> usize {
        self.namespaces.len()
    }

    /// Host h's address on the shared segment.
    pub fn addr(&self, h: usize) -> Ipv4Addr {
        Ipv4Addr::new(10, 77, 0, h as u8 + 1)
    }

    /// Host h's namespace name.
    pub fn namespace(&self, h: usize) -> &str {
        &self.namespaces[h]
    }

    /// `program` to be run inside host h's namespace (`ip netns exec`, which execs it: the child's
    /// pid is the program's).
    pub fn command(&self, h: usize, program: &Path) -> Command {
        let mut c = Command::new("ip");
        c.args(["netns", "exec", self.namespace(h)]).arg(program);
        c
    }
}

impl Drop for NetnsHosts {
    fn drop(&mut self) {
        for ns in self.namespaces.iter().chain(self.switch.iter()) {
            if let Err(e) = ip_cmd(&["ip", "netns", "del", ns]) {
                eprintln!(
                    "troupe bench: could not delete network namespace {ns}: {e} (delete it with `ip netns del {ns}`)"
                );
            }
        }
        // SAFETY: restoring the default dispositions.
        unsafe {
            libc::signal(libc::SIGINT, libc::SIG_DFL);
            libc::signal(libc::SIGTERM, libc::SIG_DFL);
        }
    }
}
