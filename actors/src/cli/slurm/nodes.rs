//! The allocation's nodes as troupe sees them: Slurm's node list expanded by `scontrol show hostnames`,
//! each node's address from `scontrol show node` (`NodeAddr`), and the troupe node name of each.

use std::net::{IpAddr, SocketAddr, ToSocketAddrs};
use std::process::Command;

use anyhow::{bail, Context};
use troupe_cluster::identity::validate_node_name;

/// The nodes of `node_list` in Slurm's order (the first one runs the controller).
pub fn expand(node_list: &str) -> anyhow::Result<Vec<String>> {
    let out = scontrol(&["show", "hostnames", node_list])?;
    let hosts: Vec<String> = out.split_whitespace().map(str::to_owned).collect();
    check_hostnames(node_list, &hosts)?;
    Ok(hosts)
}

/// `scontrol` prints whatever it cannot parse back as one "host" (`bad[` gives `bad]`): a list that does
/// not expand to node names is refused here, naming it.
fn check_hostnames(node_list: &str, hosts: &[String]) -> anyhow::Result<()> {
    let bad = hosts.iter().find(|h| !h.bytes().all(|b| b.is_ascii_alphanumeric() || b"-_.".contains(&b)));
    if hosts.is_empty() || bad.is_some() {
        bail!(
            "SLURM_JOB_NODELIST={node_list:?}: `scontrol show hostnames` cannot expand it into node names (got \
             {hosts:?}); run inside the allocation Slurm made (sbatch/salloc), with SLURM_CONF pointing at its \
             slurm.conf"
        );
    }
    Ok(())
}

/// The troupe name of Slurm node `host`: a DNS label (lower case; `_` and `.` become `-`), which its
/// certificate is issued for.
pub fn troupe_name(host: &str) -> anyhow::Result<String> {
    let name: String = host
        .chars()
        .map(|c| c.to_ascii_lowercase())
        .map(|c| if c.is_ascii_alphanumeric() || c == '-' { c } else { '-' })
        .collect();
    // Its client's certificate is `client-NAME`: 7 characters more, within the 63 of a DNS label.
    validate_node_name(&format!("client-{name}")).map_err(|m| anyhow::anyhow!("Slurm node {host:?}: {m}"))?;
    Ok(name)
}

/// The troupe names of `hosts`, refusing two hosts that would get the same name.
pub fn troupe_names(hosts: &[String]) -> anyhow::Result<Vec<String>> {
    let names = hosts.iter().map(|h| troupe_name(h)).collect::<anyhow::Result<Vec<_>>>()?;
    for (i, name) in names.iter().enumerate() {
        if let Some(j) = names[..i].iter().position(|n| n == name) {
            bail!("Slurm nodes {:?} and {:?} both become troupe node {name:?}; rename one", hosts[j], hosts[i]);
        }
    }
    Ok(names)
}

/// Where node `host` listens: its `NodeAddr` (the address slurmctld reaches its slurmd on, which is
/// the node's own name unless slurm.conf says otherwise), resolved, at `port`.
pub fn address(host: &str, port: u16) -> anyhow::Result<SocketAddr> {
    let out = scontrol(&["show", "node", "--oneliner", host])?;
    let node_addr = node_addr(&out).unwrap_or(host);
    resolve(node_addr, port).with_context(|| format!("the address of Slurm node {host} (NodeAddr={node_addr})"))
}

/// `NodeAddr=` of one line of `scontrol show node --oneliner`.
fn node_addr(line: &str) -> Option<&str> {
    line.split_whitespace().find_map(|field| field.strip_prefix("NodeAddr=")).filter(|a| !a.is_empty())
}

/// `addr` (an IP or a name) at `port`, preferring IPv4 as Slurm's own daemons do.
fn resolve(addr: &str, port: u16) -> anyhow::Result<SocketAddr> {
    if let Ok(ip) = addr.parse::<IpAddr>() {
        return Ok(SocketAddr::new(ip, port));
    }
    let all: Vec<SocketAddr> =
        (addr, port).to_socket_addrs().with_context(|| format!("resolving {addr:?} (DNS or /etc/hosts)"))?.collect();
    all.iter().find(|a| a.is_ipv4()).or(all.first()).copied().with_context(|| format!("{addr:?} has no address"))
}

fn scontrol(args: &[&str]) -> anyhow::Result<String> {
    let out = Command::new("scontrol").args(args).output().with_context(|| {
        format!("running `scontrol {}`: is Slurm's client (scontrol) on PATH on this node?", args.join(" "))
    })?;
    if !out.status.success() {
        bail!("`scontrol {}` failed ({}): {}", args.join(" "), out.status, String::from_utf8_lossy(&out.stderr).trim());
    }
    String::from_utf8(out.stdout).context("scontrol printed something that is not UTF-8")
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn slurm_node_names_become_dns_labels_and_collisions_are_refused() {
        assert_eq!(troupe_name("gpu01").unwrap(), "gpu01");
        assert_eq!(troupe_name("Node_A.ib").unwrap(), "node-a-ib");
        let hosts = vec!["a_1".to_string(), "a.1".to_string()];
        let error = troupe_names(&hosts).unwrap_err().to_string();
        assert!(error.contains("\"a_1\" and \"a.1\" both become troupe node \"a-1\""), "{error}");
    }

    #[test]
    fn a_node_list_scontrol_cannot_expand_is_named() {
        let error = check_hostnames("bad[", &["bad]".to_string()]).unwrap_err().to_string();
        assert!(error.starts_with("SLURM_JOB_NODELIST=\"bad[\""), "{error}");
        assert!(check_hostnames("n[1-2]", &["n1".into(), "n2".into()]).is_ok());
    }

    #[test]
    fn the_node_address_comes_from_node_addr() {
        let line = "NodeName=n2 Arch=x86_64 CoresPerSocket=1 NodeAddr=127.0.0.2 NodeHostName=vm Version=22.05.8";
        assert_eq!(node_addr(line), Some("127.0.0.2"));
        assert_eq!(resolve("127.0.0.2", 7401).unwrap(), "127.0.0.2:7401".parse().unwrap());
        assert_eq!(node_addr("NodeName=n2 NodeAddr= State=IDLE"), None);
    }
}
