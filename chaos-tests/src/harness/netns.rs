//! Network faults on one Linux machine: every daemon in its own network namespace of
//! [`troupe_cluster::netns`] (a veth pair to a bridge; node i at 10.X.Y.(i+1), X in 200-249, the harness's
//! side at .254), so that its links can be cut (iptables DROP, both ways or inbound only) and degraded
//! (loss, delay with jitter, reordering, duplicates: tc netem where the kernel has it, else the userspace
//! NFQUEUE nemesis of [`super::link`]). What is this module's own is the degrading; the namespaces, the
//! cuts and their deletion are the cluster crate's. Needs root, `ip` (iproute2) and `iptables`; without
//! them `Network::create` says which is missing and the scenario is skipped, as is a link fault on a
//! kernel with neither netem nor NFQUEUE. Everything is removed when the `Network` is dropped.

use std::sync::Mutex;

use anyhow::Context;
use troupe_actors::api::NodeHost;
use troupe_cluster::netns::{run_command as run, Layout, Namespaces, NetnsError, Subnet, IFNAME};

use super::link::{probe, LinkShape, LinkStats, QueueNemesis, DUPLICATE_MARK, QUEUE};

pub struct Network {
    /// Dropped after the links are healed (field order).
    net: Namespaces,
    /// Whether this kernel has tc netem.
    pub netem: bool,
    /// Whether packets can be queued to userspace (NFQUEUE); Err: why not.
    nfqueue: Result<(), String>,
    /// The userspace link nemesis of each node while its links are degraded.
    links: Mutex<Vec<Option<QueueNemesis>>>,
}

impl Network {
    /// A bridge and `nodes` namespaces, node i at 10.X.Y.(i+1), the host at 10.X.Y.254. Err: why
    /// this machine cannot (the caller skips the scenario with it).
    pub fn create(nodes: usize) -> Result<Self, String> {
        let layout = Layout {
            prefix: "troupe-chaos-",
            nodes,
            subnet: Subnet::PerRun { from: 200, span: 50 },
            host_address: true,
            rate_gbit: None,
            iptables: true,
        };
        let net = Namespaces::create(&layout).map_err(|e| match e {
            NetnsError::Setup(_) => e.to_string(),
            e => format!("network namespaces {e}"),
        })?;
        let ns0 = net.namespace(0).to_owned();
        let netem =
            run(&["ip", "netns", "exec", &ns0, "tc", "qdisc", "add", "dev", "lo", "root", "netem", "delay", "1ms"])
                .is_ok();
        if netem {
            let _ = run(&["ip", "netns", "exec", &ns0, "tc", "qdisc", "del", "dev", "lo", "root"]);
        }
        Ok(Network { net, netem, nfqueue: probe(&ns0), links: Mutex::new((0..nodes).map(|_| None).collect()) })
    }

    /// How the local cluster starts node i: inside its namespace, listening on its address.
    pub fn hosts(&self) -> Vec<NodeHost> {
        (0..self.net.nodes())
            .map(|i| NodeHost { prefix: self.net.exec_prefix(i), ip: self.net.addr(i).into() })
            .collect()
    }

    /// Cuts node i off from the other nodes: inbound only when `one_way` (it still sends), else both ways.
    pub fn partition(&self, i: usize, one_way: bool) -> anyhow::Result<()> {
        if one_way {
            self.net.cut_inbound(i)
        } else {
            self.net.cut(i)
        }
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
            // Each way: node i's egress in its namespace, and the bridge's port towards it in the switch's.
            let args = netem_args(shape);
            let (switch, port) = self.net.switch_port(i);
            for (ns, dev) in [(self.net.namespace(i), IFNAME), (switch, port.as_str())] {
                let mut tc = vec!["tc", "-n", ns, "qdisc", "add", "dev", dev, "root", "netem"];
                tc.extend(args.iter().map(String::as_str));
                run(&tc).with_context(|| format!("degrading node {i}'s link with tc netem"))?;
            }
            return Ok(mechanism);
        }
        let nemesis = QueueNemesis::start(self.net.namespace(i), format!("node-{i}"), *shape, seed)?;
        self.links.lock().expect("the links' lock is never poisoned")[i] = Some(nemesis);
        let (cidr, queue, mark) = (self.net.cidr(), QUEUE.to_string(), DUPLICATE_MARK.to_string());
        self.net.iptables(i, &["-A", "INPUT", "-s", &cidr, "-j", "NFQUEUE", "--queue-num", &queue])?;
        // The duplicates the nemesis sends itself carry its mark and go out as they are.
        let out =
            ["-A", "OUTPUT", "-d", &cidr, "-m", "mark", "!", "--mark", &mark, "-j", "NFQUEUE", "--queue-num", &queue];
        self.net.iptables(i, &out)?;
        Ok(mechanism)
    }

    /// Restores node i's links; what the userspace nemesis did to them, if it ran.
    pub fn heal(&self, i: usize) -> anyhow::Result<Option<LinkStats>> {
        self.net.iptables(i, &["-F"])?;
        if self.netem {
            let (switch, port) = self.net.switch_port(i);
            for (ns, dev) in [(self.net.namespace(i), IFNAME), (switch, port.as_str())] {
                let _ = run(&["tc", "-n", ns, "qdisc", "del", "dev", dev, "root"]);
            }
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
        // Stops the userspace nemeses; the namespaces go with `net`, after this.
        for i in 0..self.net.nodes() {
            if self.links.lock().is_ok_and(|l| l[i].is_some()) {
                let _ = self.heal(i);
            }
        }
    }
}
