//! Machines on one Linux host: N network namespaces, each with its own network stack (loopback, one
//! veth interface [`IFNAME`], its own ports), joined by veth pairs to a bridge in a further "switch"
//! namespace — one Ethernet segment, so every byte between nodes crosses a real (virtual) link and the
//! kernel's full IP stack, not loopback. Node i is `a.b.c.(i + 1)` of the run's /24; with
//! [`Layout::host_address`] the root namespace joins the segment too, at `a.b.c.254`, for a caller that
//! talks to the nodes from outside them (a controller, a test). Optional tc tbf rate shaping of each
//! node's egress; `cut(i)`: iptables DROP both ways in node i's namespace, a machine that went silent.
//!
//! Here, in troupe-cluster, because it is the lowest crate its three users share: `troupe bench
//! allreduce --netns` ([`crate::bench::netns`]), `troupe bench recovery --silent` (actors CLI) and the
//! chaos harness's `Network` (which adds link degrading on top, through [`Namespaces::namespace`],
//! [`Namespaces::switch_port`] and [`Namespaces::iptables`]). The bridge lives in its own namespace so
//! that the root namespace gets at most one interface (the host's end), whatever the root's firewall.
//!
//! Names are unique per process and run (`<prefix><pid>-<run>-…`): a namespace's deletion completes
//! asynchronously, so the next run of the same process must not reuse them. Needs root (CAP_NET_ADMIN),
//! iproute2's `ip` (and `tc` for a rate), `iptables` where the caller cuts; [`NetnsError`] names what is
//! missing, and the caller prefixes its own flag. Everything is deleted when [`Namespaces`] is dropped
//! (deleting a namespace deletes its interfaces), after an error too; namespaces of the same prefix
//! whose process is gone (killed before it could clean up) are deleted by the next [`Namespaces::create`].

use std::net::Ipv4Addr;
use std::path::Path;
use std::process::Command;
use std::sync::atomic::{AtomicU32, Ordering};

use anyhow::{bail, Context};

/// The interface each node's namespace reaches the others by (for Gloo: `GLOO_SOCKET_IFNAME`).
pub const IFNAME: &str = "troupe0";

/// The tool or privilege a machine lacks for network namespaces, or the set-up step that failed. Its
/// message reads after the caller's flag: "--netns needs root (…)".
#[derive(Debug, thiserror::Error)]
pub enum NetnsError {
    #[error("needs root (CAP_NET_ADMIN, to create network namespaces)")]
    NotRoot,
    #[error("needs iproute2's `ip` (Debian: apt-get install iproute2)")]
    NoIp,
    #[error("needs `iptables` (Debian: apt-get install iptables)")]
    NoIptables,
    #[error("needs iproute2's `tc` (Debian: apt-get install iproute2)")]
    NoTc,
    #[error("could not set up network namespaces: {0:#}")]
    Setup(anyhow::Error),
}

/// The /24 the nodes are on.
#[derive(Clone, Copy, Debug)]
pub enum Subnet {
    /// Always this one (no host address: nothing in the root namespace can clash).
    Fixed([u8; 3]),
    /// `10.(from + k).m.0/24`, k < `span` and m drawn from the pid and run, so that runs side by side,
    /// and callers with ranges apart, get subnets apart.
    PerRun { from: u8, span: u8 },
}

/// What [`Namespaces::create`] builds.
#[derive(Clone, Debug)]
pub struct Layout {
    /// Every namespace is named `<prefix><pid>-<run>-…`.
    pub prefix: &'static str,
    pub nodes: usize,
    pub subnet: Subnet,
    /// Whether the root namespace joins the segment (at .254).
    pub host_address: bool,
    /// Shape each node's egress to this many Gbit/s (tc tbf).
    pub rate_gbit: Option<f64>,
    /// Whether the caller will cut nodes off (then `iptables` must be here).
    pub iptables: bool,
}

/// N nodes as network namespaces on a bridge (see the module docs).
pub struct Namespaces {
    /// `<prefix><pid>-<run>`.
    tag: String,
    /// The root namespace's end of the host's veth pair, when it has one.
    host_link: Option<String>,
    subnet: [u8; 3],
    /// Node namespaces created so far; the switch's is deleted after them.
    nodes: Vec<String>,
    switch: Option<String>,
}

/// Runs `args[0] args[1..]`; Err names the command and its stderr.
pub fn run_command(args: &[&str]) -> anyhow::Result<String> {
    let out = Command::new(args[0]).args(&args[1..]).output().with_context(|| format!("running {}", args[0]))?;
    if !out.status.success() {
        bail!("`{}` failed: {}", args.join(" "), String::from_utf8_lossy(&out.stderr).trim());
    }
    Ok(String::from_utf8_lossy(&out.stdout).into_owned())
}

/// Why this machine cannot build `layout`, if it cannot.
pub fn check(layout: &Layout) -> Result<(), NetnsError> {
    // SAFETY: geteuid has no preconditions.
    if unsafe { libc::geteuid() } != 0 {
        return Err(NetnsError::NotRoot);
    }
    if run_command(&["ip", "-V"]).is_err() {
        return Err(NetnsError::NoIp);
    }
    if layout.iptables && run_command(&["iptables", "--version"]).is_err() {
        return Err(NetnsError::NoIptables);
    }
    if layout.rate_gbit.is_some() && run_command(&["tc", "-V"]).is_err() {
        return Err(NetnsError::NoTc);
    }
    Ok(())
}

/// The namespaces named with `prefix` that exist now, as `(name, pid of the process that made it)`.
pub fn namespaces_of(prefix: &str) -> Vec<(String, u32)> {
    let Ok(list) = run_command(&["ip", "netns", "list"]) else { return Vec::new() };
    list.lines()
        .filter_map(|l| l.split_whitespace().next())
        .filter_map(|name| {
            let pid = name.strip_prefix(prefix)?.split('-').next()?.parse().ok()?;
            Some((name.to_string(), pid))
        })
        .collect()
}

/// Deletes namespaces named with `prefix` whose process is gone (killed before it could clean up).
fn sweep_stale(prefix: &str) {
    for (name, pid) in namespaces_of(prefix) {
        if !Path::new(&format!("/proc/{pid}")).exists() {
            let _ = run_command(&["ip", "netns", "del", &name]);
        }
    }
}

/// This process's runs so far: each gets names and a subnet of its own.
static RUNS: AtomicU32 = AtomicU32::new(0);

/// The subnet of run `run` of process `pid`.
fn subnet_of(subnet: Subnet, pid: u32, run: u32) -> [u8; 3] {
    match subnet {
        Subnet::Fixed(s) => s,
        Subnet::PerRun { from, span } => {
            let id = pid % 1_000 * 100 + run % 100;
            [10, from + (id % u32::from(span.max(1))) as u8, (id / u32::from(span.max(1)) % 250) as u8]
        }
    }
}

/// The root namespace's end of the host's veth pair: at most 15 characters (an interface name).
fn host_link_name(pid: u32, run: u32) -> String {
    format!("tr{pid}r{}", run % 1_000)
}

impl Namespaces {
    /// Builds `layout`; Err says what this machine lacks (the caller adds its flag), or which step failed.
    pub fn create(layout: &Layout) -> Result<Self, NetnsError> {
        if !(1..=250).contains(&layout.nodes) {
            return Err(NetnsError::Setup(anyhow::anyhow!("{} namespaces: use 1 to 250", layout.nodes)));
        }
        check(layout)?;
        sweep_stale(layout.prefix);
        let (pid, run) = (std::process::id(), RUNS.fetch_add(1, Ordering::Relaxed));
        let mut net = Namespaces {
            tag: format!("{}{pid}-{run}", layout.prefix),
            host_link: None,
            subnet: subnet_of(layout.subnet, pid, run),
            nodes: Vec::new(),
            switch: None,
        };
        net.setup(layout, host_link_name(pid, run)).map_err(NetnsError::Setup)?;
        Ok(net)
    }

    fn setup(&mut self, layout: &Layout, host_link: String) -> anyhow::Result<()> {
        let switch = format!("{}-sw", self.tag);
        run_command(&["ip", "netns", "add", &switch])?;
        self.switch = Some(switch.clone());
        run_command(&["ip", "-n", &switch, "link", "add", "br0", "type", "bridge"])?;
        run_command(&["ip", "-n", &switch, "link", "set", "br0", "up"])?;
        if layout.host_address {
            run_command(&["ip", "link", "add", &host_link, "type", "veth", "peer", "name", "host", "netns", &switch])?;
            self.host_link = Some(host_link.clone());
            run_command(&["ip", "addr", "add", &format!("{}/24", self.host_addr()), "dev", &host_link])?;
            run_command(&["ip", "link", "set", &host_link, "up"])?;
            run_command(&["ip", "-n", &switch, "link", "set", "host", "master", "br0"])?;
            run_command(&["ip", "-n", &switch, "link", "set", "host", "up"])?;
        }
        for i in 0..layout.nodes {
            self.add_node(i, &switch, layout.rate_gbit)?;
        }
        Ok(())
    }

    fn add_node(&mut self, i: usize, switch: &str, rate_gbit: Option<f64>) -> anyhow::Result<()> {
        let ns = format!("{}-{i}", self.tag);
        run_command(&["ip", "netns", "add", &ns])?;
        self.nodes.push(ns.clone());
        let port = format!("p{i}");
        run_command(&["ip", "-n", &ns, "link", "set", "lo", "up"])?;
        run_command(&["ip", "-n", &ns, "link", "add", IFNAME, "type", "veth", "peer", "name", &port, "netns", switch])?;
        run_command(&["ip", "-n", &ns, "addr", "add", &format!("{}/24", self.addr(i)), "dev", IFNAME])?;
        run_command(&["ip", "-n", &ns, "link", "set", IFNAME, "up"])?;
        run_command(&["ip", "-n", switch, "link", "set", &port, "master", "br0"])?;
        run_command(&["ip", "-n", switch, "link", "set", &port, "up"])?;
        if let Some(gbit) = rate_gbit {
            // A bucket of 10 ms at the rate (at least 64 KiB: one GSO segment), queueing up to 100 ms.
            let burst = ((gbit * 1e9 / 8.0 / 100.0) as u64).max(64 << 10);
            let (rate, burst) = (format!("{}mbit", (gbit * 1000.0).round() as u64), burst.to_string());
            run_command(&[
                "tc", "-n", &ns, "qdisc", "add", "dev", IFNAME, "root", "tbf", "rate", &rate, "burst", &burst,
                "latency", "100ms",
            ])
            .context("shaping the link with tc tbf: this kernel may lack sch_tbf")?;
        }
        Ok(())
    }

    pub fn nodes(&self) -> usize {
        self.nodes.len()
    }

    /// Node i's address on the segment.
    pub fn addr(&self, i: usize) -> Ipv4Addr {
        Ipv4Addr::new(self.subnet[0], self.subnet[1], self.subnet[2], i as u8 + 1)
    }

    /// The root namespace's address on the segment (with [`Layout::host_address`]).
    pub fn host_addr(&self) -> Ipv4Addr {
        Ipv4Addr::new(self.subnet[0], self.subnet[1], self.subnet[2], 254)
    }

    /// The segment, `a.b.c.0/24`.
    pub fn cidr(&self) -> String {
        format!("{}.{}.{}.0/24", self.subnet[0], self.subnet[1], self.subnet[2])
    }

    /// Node i's namespace name.
    pub fn namespace(&self, i: usize) -> &str {
        &self.nodes[i]
    }

    /// The bridge's side of node i's link: (the switch's namespace, the interface), e.g. for tc.
    pub fn switch_port(&self, i: usize) -> (&str, String) {
        (self.switch.as_deref().expect("a built network has its switch"), format!("p{i}"))
    }

    /// The words that run a program inside node i's namespace (`ip netns exec NS`, which execs it:
    /// the child's pid is the program's).
    pub fn exec_prefix(&self, i: usize) -> Vec<String> {
        ["ip", "netns", "exec", self.namespace(i)].map(String::from).to_vec()
    }

    /// `program` to be run inside node i's namespace (see [`Self::exec_prefix`]).
    pub fn command(&self, i: usize, program: &Path) -> Command {
        let mut c = Command::new("ip");
        c.args(["netns", "exec", self.namespace(i)]).arg(program);
        c
    }

    /// `iptables <rule>` in node i's namespace.
    pub fn iptables(&self, i: usize, rule: &[&str]) -> anyhow::Result<()> {
        let mut args = vec!["ip", "netns", "exec", self.namespace(i), "iptables"];
        args.extend_from_slice(rule);
        run_command(&args).map(|_| ())
    }

    /// Cuts node i off from the segment, inbound only (it still sends): iptables DROP.
    pub fn cut_inbound(&self, i: usize) -> anyhow::Result<()> {
        self.iptables(i, &["-A", "INPUT", "-s", &self.cidr(), "-j", "DROP"])
    }

    /// Cuts node i off from the segment both ways — no reset, no FIN, nothing its peers' kernels could
    /// report: what a machine that loses power or its link looks like to the others.
    pub fn cut(&self, i: usize) -> anyhow::Result<()> {
        self.cut_inbound(i)?;
        self.iptables(i, &["-A", "OUTPUT", "-d", &self.cidr(), "-j", "DROP"])
    }
}

impl Drop for Namespaces {
    fn drop(&mut self) {
        // The root's interface at once (a deleted namespace, and the peers of its interfaces, may
        // linger a while), then the nodes, then the switch.
        if let Some(link) = &self.host_link {
            let _ = run_command(&["ip", "link", "del", link]);
        }
        for ns in self.nodes.iter().chain(self.switch.iter()) {
            if let Err(e) = run_command(&["ip", "netns", "del", ns]) {
                eprintln!("troupe: could not delete network namespace {ns}: {e} (delete it with `ip netns del {ns}`)");
            }
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn names_fit_an_interface_and_runs_of_a_process_get_their_own_names_and_subnets() {
        let pid = 4_194_304; // the largest pid Linux hands out
        assert!(host_link_name(pid, 999).len() <= 15, "{}", host_link_name(pid, 999));
        assert_ne!(host_link_name(pid, 1), host_link_name(pid, 2));
        let subnet = Subnet::PerRun { from: 150, span: 50 };
        let (a, b) = (subnet_of(subnet, pid, 1), subnet_of(subnet, pid, 2));
        assert_ne!(a, b);
        for s in [a, b, subnet_of(subnet, 999_999, 99)] {
            assert!(s[0] == 10 && (150..200).contains(&s[1]), "{s:?}");
        }
        assert_eq!(subnet_of(Subnet::Fixed([10, 77, 0]), pid, 5), [10, 77, 0]);
    }

    fn is_root() -> bool {
        // SAFETY: geteuid has no preconditions.
        unsafe { libc::geteuid() == 0 }
    }

    /// Whether node 0's namespace reaches `addr:port` over TCP within 2 s.
    fn reaches(net: &Namespaces, addr: Ipv4Addr, port: u16) -> bool {
        let script = format!("echo hi > /dev/tcp/{addr}/{port}");
        let mut c = Command::new("timeout");
        c.args(["2", "ip", "netns", "exec", net.namespace(0), "bash", "-c", &script]);
        c.output().is_ok_and(|o| o.status.success())
    }

    #[test]
    fn nodes_reach_the_host_until_cut_and_nothing_is_left_after_drop() {
        let layout = Layout {
            prefix: "troupe-test-",
            nodes: 2,
            subnet: Subnet::PerRun { from: 100, span: 50 },
            host_address: true,
            rate_gbit: Some(1.0),
            iptables: true,
        };
        if !is_root() {
            let err = Namespaces::create(&layout).err().expect("refused without root");
            assert!(err.to_string().contains("needs root"), "{err}");
            return;
        }
        let net = Namespaces::create(&layout).expect("namespaces");
        let listener = std::net::TcpListener::bind((net.host_addr(), 0)).expect("bind the host address");
        let port = listener.local_addr().unwrap().port();
        assert!(reaches(&net, net.host_addr(), port), "node 0 cannot reach the host at {}", net.host_addr());
        let mine = format!("{}{}-", layout.prefix, std::process::id());
        assert_eq!(namespaces_of(layout.prefix).iter().filter(|(n, _)| n.starts_with(&mine)).count(), 3);
        net.cut(0).expect("cut");
        assert!(!reaches(&net, net.host_addr(), port), "node 0 still reaches the host after cut(0)");
        let host_link = net.host_link.clone().expect("a host link");
        drop(net);
        assert!(namespaces_of(layout.prefix).iter().all(|(n, _)| !n.starts_with(&mine)), "namespaces left");
        assert!(run_command(&["ip", "link", "show", &host_link]).is_err(), "{host_link} left in the root namespace");
    }
}
