//! `troupe bench recovery --silent`: every daemon in its own network namespace behind a bridge, so that
//! one machine can be cut off by iptables — DROP both ways: no reset, no FIN, nothing its peers' kernels
//! could report — which is what a machine that loses power or its link looks like to the others. Needs
//! root (CAP_NET_ADMIN), `ip` (iproute2) and `iptables`. Everything is removed when dropped.
//!
//! (The chaos harness's `harness::netns` builds the same set-up and also degrades links; this one only
//! cuts, for the benchmark in the `troupe` binary, which cannot depend on the harness.)

use std::net::{IpAddr, Ipv4Addr};
use std::process::Command;
use std::sync::atomic::{AtomicU32, Ordering};

use anyhow::{bail, Context};

use crate::api::NodeHost;

pub struct Namespaces {
    tag: String,
    subnet: [u8; 3],
    nodes: usize,
}

fn ip_command(args: &[&str]) -> anyhow::Result<()> {
    let out = Command::new(args[0]).args(&args[1..]).output().with_context(|| format!("running {}", args[0]))?;
    if !out.status.success() {
        bail!("`{}` failed: {}", args.join(" "), String::from_utf8_lossy(&out.stderr).trim());
    }
    Ok(())
}

impl Namespaces {
    /// A bridge and `nodes` namespaces, node i at 10.X.Y.(i+1), the host at 10.X.Y.254. The error names
    /// `--silent` and what it needs.
    pub fn create(nodes: usize) -> anyhow::Result<Self> {
        // Unique per process and run (a namespace's deletion completes asynchronously, so the next run
        // of `--runs` must not reuse the names), short enough for 15-character interface names; a subnet
        // range apart from the chaos harness's (10.200-249.*), so the two can run at once.
        static RUNS: AtomicU32 = AtomicU32::new(0);
        let id = std::process::id() % 1_000 * 100 + RUNS.fetch_add(1, Ordering::Relaxed) % 100;
        let mut net = Namespaces {
            tag: format!("trb{id}"),
            subnet: [10, 150 + (id % 50) as u8, (id / 50 % 250) as u8],
            nodes: 0,
        };
        net.setup(nodes).context(
            "--silent puts every daemon in a network namespace and cuts one off with iptables: it needs root \
             (CAP_NET_ADMIN), iproute2's `ip` and `iptables`; run it as root, or leave out --silent (SIGKILL)",
        )?;
        Ok(net)
    }

    fn setup(&mut self, nodes: usize) -> anyhow::Result<()> {
        let bridge = format!("{}br", self.tag);
        ip_command(&["ip", "link", "add", &bridge, "type", "bridge"])?;
        let host = format!("{}/24", self.address(253));
        ip_command(&["ip", "addr", "add", &host, "dev", &bridge])?;
        ip_command(&["ip", "link", "set", &bridge, "up"])?;
        for i in 0..nodes {
            let (ns, host_end, node_end) = (self.ns(i), format!("{}h{i}", self.tag), format!("{}n{i}", self.tag));
            ip_command(&["ip", "netns", "add", &ns])?;
            self.nodes = i + 1;
            ip_command(&["ip", "link", "add", &host_end, "type", "veth", "peer", "name", &node_end])?;
            ip_command(&["ip", "link", "set", &node_end, "netns", &ns])?;
            ip_command(&["ip", "link", "set", &host_end, "master", &bridge])?;
            ip_command(&["ip", "link", "set", &host_end, "up"])?;
            let addr = format!("{}/24", self.address(i as u8));
            ip_command(&["ip", "netns", "exec", &ns, "ip", "addr", "add", &addr, "dev", &node_end])?;
            ip_command(&["ip", "netns", "exec", &ns, "ip", "link", "set", &node_end, "up"])?;
            ip_command(&["ip", "netns", "exec", &ns, "ip", "link", "set", "lo", "up"])?;
        }
        ip_command(&["iptables", "--version"])
    }

    fn ns(&self, i: usize) -> String {
        format!("{}-{i}", self.tag)
    }

    /// Node i's address (i = 253: the host's, on the bridge).
    fn address(&self, i: u8) -> Ipv4Addr {
        Ipv4Addr::new(self.subnet[0], self.subnet[1], self.subnet[2], i + 1)
    }

    /// How the local cluster starts node i: inside its namespace, listening on its address.
    pub fn hosts(&self) -> Vec<NodeHost> {
        (0..self.nodes)
            .map(|i| NodeHost {
                prefix: ["ip", "netns", "exec", &self.ns(i)].map(String::from).to_vec(),
                ip: IpAddr::V4(self.address(i as u8)),
            })
            .collect()
    }

    /// Cuts node i off from the others, both ways (iptables DROP in its namespace).
    pub fn cut(&self, i: usize) -> anyhow::Result<()> {
        let (ns, cidr) = (self.ns(i), format!("{}/24", self.address(0)));
        ip_command(&["ip", "netns", "exec", &ns, "iptables", "-A", "INPUT", "-s", &cidr, "-j", "DROP"])?;
        ip_command(&["ip", "netns", "exec", &ns, "iptables", "-A", "OUTPUT", "-d", &cidr, "-j", "DROP"])
    }
}

impl Drop for Namespaces {
    fn drop(&mut self) {
        for i in 0..self.nodes {
            // The host's end of the pair at once (the namespace, and its end with it, may outlive its
            // deletion a while), then the namespace.
            let _ = ip_command(&["ip", "link", "del", &format!("{}h{i}", self.tag)]);
            let _ = ip_command(&["ip", "netns", "del", &self.ns(i)]);
        }
        let _ = ip_command(&["ip", "link", "del", &format!("{}br", self.tag)]);
    }
}
