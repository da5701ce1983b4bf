//! Network faults on one Linux machine: every daemon in its own network namespace, joined to a bridge
//! by a veth pair, so that its links can be cut (iptables DROP, both ways or inbound only) and degraded
//! (random loss with iptables' statistic match; delay with tc netem where the kernel has it). Needs root,
//! `ip` (iproute2) and `iptables`; without them `Network::create` says which is missing and the scenario
//! is skipped. Everything is removed when the `Network` is dropped.

use std::net::{IpAddr, Ipv4Addr};
use std::process::Command;

use anyhow::{bail, Context};
use troupe_actors::api::NodeHost;

pub struct Network {
    tag: String,
    subnet: [u8; 3],
    nodes: usize,
    /// Whether this kernel has tc netem (delay); loss works without it.
    pub netem: bool,
}

fn run(args: &[&str]) -> anyhow::Result<String> {
    let out = Command::new(args[0]).args(&args[1..]).output().with_context(|| format!("running {}", args[0]))?;
    if !out.status.success() {
        bail!("`{}` failed: {}", args.join(" "), String::from_utf8_lossy(&out.stderr).trim());
    }
    Ok(String::from_utf8_lossy(&out.stdout).into_owned())
}

impl Network {
    /// A bridge and `nodes` namespaces, node i at 10.X.Y.(i+1), the host at 10.X.Y.254. Err: why
    /// this machine cannot (the caller skips the scenario with it).
    pub fn create(nodes: usize) -> Result<Self, String> {
        if effective_uid() != 0 {
            return Err("network namespaces need root (CAP_NET_ADMIN)".into());
        }
        for tool in ["ip", "iptables"] {
            if Command::new(tool).arg("--version").output().is_err() {
                return Err(format!("`{tool}` is not installed (Debian: apt-get install iproute2 iptables)"));
            }
        }
        // Unique per process, short enough for 15-character interface names.
        let id = std::process::id() % 100_000;
        let subnet = [10, 200 + (id % 50) as u8, (id / 50 % 250) as u8];
        let net = Network { tag: format!("trp{id}"), subnet, nodes: 0, netem: false };
        net.setup(nodes).map_err(|e| format!("setting up network namespaces failed: {e:#}"))
    }

    fn setup(mut self, nodes: usize) -> anyhow::Result<Self> {
        let bridge = self.bridge();
        run(&["ip", "link", "add", &bridge, "type", "bridge"])?;
        run(&["ip", "addr", "add", &format!("{}/24", self.host_ip()), "dev", &bridge])?;
        run(&["ip", "link", "set", &bridge, "up"])?;
        for i in 0..nodes {
            let (ns, host_end, node_end) = (self.ns(i), format!("{}h{i}", self.tag), format!("{}n{i}", self.tag));
            run(&["ip", "netns", "add", &ns])?;
            self.nodes = i + 1;
            run(&["ip", "link", "add", &host_end, "type", "veth", "peer", "name", &node_end])?;
            run(&["ip", "link", "set", &node_end, "netns", &ns])?;
            run(&["ip", "link", "set", &host_end, "master", &bridge])?;
            run(&["ip", "link", "set", &host_end, "up"])?;
            run(&["ip", "netns", "exec", &ns, "ip", "addr", "add", &format!("{}/24", self.ip(i)), "dev", &node_end])?;
            run(&["ip", "netns", "exec", &ns, "ip", "link", "set", &node_end, "up"])?;
            run(&["ip", "netns", "exec", &ns, "ip", "link", "set", "lo", "up"])?;
        }
        let probe =
            ["ip", "netns", "exec", &self.ns(0), "tc", "qdisc", "add", "dev", "lo", "root", "netem", "delay", "1ms"];
        self.netem = run(&probe).is_ok();
        if self.netem {
            let _ = run(&["ip", "netns", "exec", &self.ns(0), "tc", "qdisc", "del", "dev", "lo", "root"]);
        }
        Ok(self)
    }

    fn bridge(&self) -> String {
        format!("{}br", self.tag)
    }

    fn ns(&self, i: usize) -> String {
        format!("{}-{i}", self.tag)
    }

    fn host_ip(&self) -> Ipv4Addr {
        Ipv4Addr::new(self.subnet[0], self.subnet[1], self.subnet[2], 254)
    }

    pub fn ip(&self, i: usize) -> Ipv4Addr {
        Ipv4Addr::new(self.subnet[0], self.subnet[1], self.subnet[2], i as u8 + 1)
    }

    fn cidr(&self) -> String {
        format!("{}.{}.{}.0/24", self.subnet[0], self.subnet[1], self.subnet[2])
    }

    /// How the local cluster starts node i: inside its namespace, listening on its address.
    pub fn hosts(&self) -> Vec<NodeHost> {
        (0..self.nodes)
            .map(|i| NodeHost {
                prefix: ["ip", "netns", "exec", &self.ns(i)].map(String::from).to_vec(),
                ip: IpAddr::V4(self.ip(i)),
            })
            .collect()
    }

    fn iptables(&self, i: usize, rule: &[&str]) -> anyhow::Result<()> {
        let ns = self.ns(i);
        let mut args = vec!["ip", "netns", "exec", &ns, "iptables"];
        args.extend_from_slice(rule);
        run(&args).map(|_| ())
    }

    /// Cuts node i off from the other nodes: inbound only when `one_way` (it still sends), else both ways.
    pub fn partition(&self, i: usize, one_way: bool) -> anyhow::Result<()> {
        let cidr = self.cidr();
        self.iptables(i, &["-A", "INPUT", "-s", &cidr, "-j", "DROP"])?;
        if !one_way {
            self.iptables(i, &["-A", "OUTPUT", "-d", &cidr, "-j", "DROP"])?;
        }
        Ok(())
    }

    /// Node i's link loses `percent` of its packets each way, and is delayed by `delay_ms` each way where
    /// the kernel has netem. Returns what could not be applied.
    pub fn degrade(&self, i: usize, percent: f64, delay_ms: u64) -> anyhow::Result<Option<String>> {
        let p = format!("{:.4}", percent / 100.0);
        let cidr = self.cidr();
        for chain in [["-A", "INPUT", "-s"], ["-A", "OUTPUT", "-d"]] {
            let rule = [
                chain[0],
                chain[1],
                chain[2],
                &cidr,
                "-m",
                "statistic",
                "--mode",
                "random",
                "--probability",
                &p,
                "-j",
                "DROP",
            ];
            self.iptables(i, &rule)?;
        }
        if delay_ms == 0 {
            return Ok(None);
        }
        if !self.netem {
            return Ok(Some(format!(
                "{delay_ms} ms delay not applied: this kernel has no tc netem (CONFIG_NET_SCH_NETEM)"
            )));
        }
        let dev = format!("{}n{i}", self.tag);
        let ns = self.ns(i);
        run(&[
            "ip",
            "netns",
            "exec",
            &ns,
            "tc",
            "qdisc",
            "add",
            "dev",
            &dev,
            "root",
            "netem",
            "delay",
            &format!("{delay_ms}ms"),
        ])?;
        run(&[
            "tc",
            "qdisc",
            "add",
            "dev",
            &format!("{}h{i}", self.tag),
            "root",
            "netem",
            "delay",
            &format!("{delay_ms}ms"),
        ])?;
        Ok(None)
    }

    /// Restores node i's links.
    pub fn heal(&self, i: usize) -> anyhow::Result<()> {
        self.iptables(i, &["-F"])?;
        if self.netem {
            let _ = run(&[
                "ip",
                "netns",
                "exec",
                &self.ns(i),
                "tc",
                "qdisc",
                "del",
                "dev",
                &format!("{}n{i}", self.tag),
                "root",
            ]);
            let _ = run(&["tc", "qdisc", "del", "dev", &format!("{}h{i}", self.tag), "root"]);
        }
        Ok(())
    }
}

impl Drop for Network {
    fn drop(&mut self) {
        for i in 0..self.nodes {
            // Deleting the namespace deletes its veth end, and with it the peer on the bridge.
            let _ = run(&["ip", "netns", "del", &self.ns(i)]);
        }
        let _ = run(&["ip", "link", "del", &self.bridge()]);
    }
}

/// The effective user id, read from /proc (no libc call needed).
fn effective_uid() -> u32 {
    std::fs::read_to_string("/proc/self/status")
        .ok()
        .and_then(|s| s.lines().find(|l| l.starts_with("Uid:")).and_then(|l| l.split_whitespace().nth(2)?.parse().ok()))
        .unwrap_or(u32::MAX)
}
