//! Network faults on one Linux machine: every daemon in its own network namespace, joined to a bridge
//! by a veth pair, so that its links can be cut (iptables DROP, both ways or inbound only) and degraded
//! (loss, delay with jitter, reordering, duplicates: tc netem where the kernel has it, else the userspace
//! NFQUEUE nemesis of [`super::link`]). Needs root, `ip` (iproute2) and `iptables`; without them
//! `Network::create` says which is missing and the scenario is skipped, as is a link fault on a kernel
//! with neither netem nor NFQUEUE. Everything is removed when the `Network` is dropped.

use std::net::{IpAddr, Ipv4Addr};
use std::process::Command;

use std::sync::Mutex;

use anyhow::{bail, Context};
use troupe_actors::api::NodeHost;

use super::link::{probe, LinkShape, LinkStats, QueueNemesis, DUPLICATE_MARK, QUEUE};

pub struct Network {
    tag: String,
    subnet: [u8; 3],
    nodes: usize,
    /// Whether this kernel has tc netem.
    pub netem: bool,
    /// Whether packets can be queued to userspace (NFQUEUE); Err: why not.
    nfqueue: Result<(), String>,
    /// The userspace link nemesis of each node while its links are degraded.
    links: Mutex<Vec<Option<QueueNemesis>>>,
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
        let net = Network {
            tag: format!("trp{id}"),
            subnet,
            nodes: 0,
            netem: false,
            nfqueue: Err("not probed".into()),
            links: Mutex::new((0..nodes).map(|_| None).collect()),
        };
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
        let netem =
            ["ip", "netns", "exec", &self.ns(0), "tc", "qdisc", "add", "dev", "lo", "root", "netem", "delay", "1ms"];
        self.netem = run(&netem).is_ok();
        if self.netem {
            let _ = run(&["ip", "netns", "exec", &self.ns(0), "tc", "qdisc", "del", "dev", "lo", "root"]);
        }
        self.nfqueue = probe(&self.ns(0));
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

    /// How this machine degrades links: tc netem in the kernel, else the userspace NFQUEUE nemesis.
    /// Err: neither is here (the capability that is missing).
    pub fn link_mechanism(&self) -> Result<&'static str, String> {
        match (self.netem, &self.nfqueue) {
            (true, _) => Ok("tc netem"),
            (false, Ok(())) => Ok("nfqueue"),
            (false, Err(why)) => Err(format!(
                "link faults need tc netem (CONFIG_NET_SCH_NETEM) or NFQUEUE; this kernel has no netem, and {why}"
            )),
        }
    }

    /// Degrades node i's links to the other nodes, each way, as `shape` says (the userspace nemesis
    /// draws its choices from `seed`). Returns how: "tc netem" or "nfqueue".
    pub fn degrade(&self, i: usize, shape: &LinkShape, seed: u64) -> anyhow::Result<&'static str> {
        let mechanism = self.link_mechanism().map_err(anyhow::Error::msg)?;
        if self.netem {
            let args = netem_args(shape);
            let node_end = format!("{}n{i}", self.tag);
            let ns = self.ns(i);
            let mut inner = vec!["ip", "netns", "exec", &ns, "tc", "qdisc", "add", "dev", &node_end, "root", "netem"];
            inner.extend(args.iter().map(String::as_str));
            run(&inner)?;
            let host_end = format!("{}h{i}", self.tag);
            let mut outer = vec!["tc", "qdisc", "add", "dev", &host_end, "root", "netem"];
            outer.extend(args.iter().map(String::as_str));
            run(&outer)?;
            return Ok(mechanism);
        }
        let nemesis = QueueNemesis::start(&self.ns(i), format!("node-{i}"), *shape, seed)?;
        self.links.lock().expect("the links' lock is never poisoned")[i] = Some(nemesis);
        let (cidr, queue, mark) = (self.cidr(), QUEUE.to_string(), DUPLICATE_MARK.to_string());
        self.iptables(i, &["-A", "INPUT", "-s", &cidr, "-j", "NFQUEUE", "--queue-num", &queue])?;
        // The duplicates the nemesis sends itself carry its mark and go out as they are.
        let out =
            ["-A", "OUTPUT", "-d", &cidr, "-m", "mark", "!", "--mark", &mark, "-j", "NFQUEUE", "--queue-num", &queue];
        self.iptables(i, &out)?;
        Ok(mechanism)
    }

    /// Restores node i's links; what the userspace nemesis did to them, if it ran.
    pub fn heal(&self, i: usize) -> anyhow::Result<Option<LinkStats>> {
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
        let nemesis = self.links.lock().expect("the links' lock is never poisoned")[i].take();
        nemesis.map(QueueNemesis::stop).transpose()
    }
}

/// tc netem's words for `shape`. Netem reorders its own way: the `reorder` share goes at once, the rest
/// waits the delay — so a reordered packet there overtakes, where the userspace nemesis holds it back.
fn netem_args(shape: &LinkShape) -> Vec<String> {
    let mut args = vec![
        "delay".to_owned(),
        format!("{}ms", shape.delay_ms + if shape.reorder_percent > 0.0 { shape.reorder_ms } else { 0 }),
    ];
    if shape.delay_jitter_ms > 0 {
        args.push(format!("{}ms", shape.delay_jitter_ms));
    }
    for (word, percent) in
        [("loss", shape.loss_percent), ("duplicate", shape.duplicate_percent), ("reorder", shape.reorder_percent)]
    {
        if percent > 0.0 {
            args.extend([word.to_owned(), format!("{percent}%")]);
        }
    }
    args
}

impl Drop for Network {
    fn drop(&mut self) {
        for i in 0..self.nodes {
            if self.links.lock().is_ok_and(|l| l[i].is_some()) {
                let _ = self.heal(i);
            }
        }
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
