//! node.toml's `controllers`: the controller-eligible daemons (issue 32). Each entry is a node name,
//! with its Raft address when there are several: `controllers = ["node-a@10.0.0.1:7401",
//! "node-b@10.0.0.2:7401", "node-c@10.0.0.3:7401"]`. Absent or one entry: the single controller of
//! today (no Raft). 3 or 5 (at most 7): a Raft group; an even count is allowed with a warning (it
//! tolerates no more failures than one fewer). Every node lists the same controllers.
//!
//! `controllers` is the *initial* set: `troupe cluster controllers add|remove` changes the voters in the
//! Raft log, and the committed membership wins over node.toml on a restart ([`committed_differs`]
//! warns). A node to be added at run time gives its Raft endpoint's address as `raft_listen`.

use std::collections::HashSet;
use std::net::SocketAddr;

use troupe_cluster::identity::validate_node_name;

/// Most controllers one group may have: every commit waits for a majority of them.
pub const CONTROLLERS_MAX: usize = 7;

/// One parsed entry.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct ControllerEntry {
    pub name: String,
    /// Where its Raft endpoint listens (required with 2 or more controllers).
    pub raft_addr: Option<SocketAddr>,
}

impl ControllerEntry {
    pub fn parse(entry: &str) -> Result<Self, String> {
        let (name, addr) = match entry.split_once('@') {
            Some((name, addr)) => (name, Some(addr)),
            None => (entry, None),
        };
        validate_node_name(name).map_err(|m| format!("{entry:?}: {m}"))?;
        let raft_addr = addr.map(|a| a.parse::<SocketAddr>()).transpose().map_err(|e| {
            format!("{entry:?}: the Raft address after `@` is not HOST:PORT ({e}), e.g. \"{name}@10.0.0.5:7401\"")
        })?;
        Ok(ControllerEntry { name: name.into(), raft_addr })
    }
}

/// Checks the `controllers` of the node `name` (listening on `listen`, joining `join`), and returns
/// the parsed entries and the warnings to log. An error says what is wrong and the fix.
pub fn check(
    name: &str,
    listen: SocketAddr,
    join: Option<SocketAddr>,
    controllers: &[String],
) -> Result<(Vec<ControllerEntry>, Vec<String>), String> {
    if controllers.len() > CONTROLLERS_MAX {
        return Err(format!(
            "{} controllers listed; at most {CONTROLLERS_MAX} (3 or 5 is usual: every commit waits for a majority)",
            controllers.len()
        ));
    }
    let entries: Vec<ControllerEntry> =
        controllers.iter().map(|c| ControllerEntry::parse(c)).collect::<Result<_, _>>()?;
    let (mut names, mut addrs) = (HashSet::new(), HashSet::new());
    for e in &entries {
        if !names.insert(e.name.as_str()) {
            return Err(format!("{:?} is listed twice; list each controller once", e.name));
        }
        if let Some(addr) = e.raft_addr {
            if !addrs.insert(addr) {
                return Err(format!("{addr} is the Raft address of two controllers; give each its own"));
            }
        }
        if entries.len() >= 2 && e.raft_addr.is_none() {
            return Err(format!(
                "{:?} has no Raft address; with several controllers write each as \"NAME@HOST:PORT\"",
                e.name
            ));
        }
    }
    let me = entries.iter().find(|e| e.name == name);
    if !entries.is_empty() && me.is_none() && join.is_none() {
        return Err(format!(
            "this node ({name:?}) has no `join`, so it would be the controller, but it is not listed; \
             add it to `controllers` or set `join` to a controller's address"
        ));
    }
    if let Some(addr) = me.and_then(|e| e.raft_addr) {
        if addr == listen {
            return Err(format!(
                "this node's Raft address {addr} is its `listen` address; the Raft group needs a port of its own"
            ));
        }
    }
    let mut warnings = Vec::new();
    if entries.len() >= 2 && entries.len().is_multiple_of(2) {
        warnings.push(format!(
            "{} controllers tolerate no more failures than {} (a majority of {} is {}): list an odd number",
            entries.len(),
            entries.len() - 1,
            entries.len(),
            entries.len() / 2 + 1
        ));
    }
    Ok((entries, warnings))
}

/// Checks node.toml's `raft_listen` (a node not in `controllers` that may be added as one at run time).
pub fn check_raft_listen(
    name: &str,
    listen: SocketAddr,
    raft_listen: Option<SocketAddr>,
    controllers: &[String],
) -> Result<(), String> {
    let Some(addr) = raft_listen else { return Ok(()) };
    if controllers.len() < 2 {
        return Err(format!(
            "{addr} given, but `controllers` lists {}: a controller is added at run time only to a replicated \
             one; list 3 controllers as \"NAME@HOST:PORT\" or remove `raft_listen`",
            controllers.len()
        ));
    }
    if addr == listen {
        return Err(format!("{addr} is this node's `listen` address; the Raft endpoint needs a port of its own"));
    }
    let entries = controllers.iter().filter_map(|c| ControllerEntry::parse(c).ok());
    for e in entries {
        if e.name == name {
            return Err(format!(
                "this node ({name:?}) is in `controllers` already, with its Raft address there; remove `raft_listen`"
            ));
        }
        if e.raft_addr == Some(addr) {
            return Err(format!("{addr} is {:?}'s Raft address in `controllers`; give this node its own", e.name));
        }
    }
    Ok(())
}

/// The warning for a node whose node.toml `controllers` (`configured`, by name) is not the committed
/// membership its Raft log holds (`committed`): the committed one wins (it was changed with `troupe
/// cluster controllers add|remove`, or node.toml was edited since).
pub fn committed_differs(configured: &[String], committed: &[String]) -> Option<String> {
    let sorted = |list: &[String]| {
        let mut names = list.to_vec();
        names.sort();
        names
    };
    let (configured, committed) = (sorted(configured), sorted(committed));
    if committed.is_empty() || configured == committed {
        return None;
    }
    Some(format!(
        "node.toml `controllers` lists {} but the committed membership in this node's Raft log is {}: the \
         committed one is used (changed by `troupe cluster controllers add|remove`); update node.toml's \
         `controllers` to match",
        configured.join(", "),
        committed.join(", ")
    ))
}

/// Why the controller `controller` (listing `ours` in its node.toml `controllers`) refuses the join of
/// `joiner` (listing `theirs`, by name), if it does: with a replicated controller on either side every
/// node must list the same controllers — a node that lists others would follow, and vote for, a different
/// group. One controller on both sides (none or one listed) is today's cluster and is not compared.
pub fn join_mismatch(joiner: &str, theirs: &[String], controller: &str, ours: &[String]) -> Option<String> {
    let sorted = |list: &[String]| {
        let mut names = list.to_vec();
        names.sort();
        names
    };
    let (theirs, ours) = (sorted(theirs), sorted(ours));
    if (theirs.len() < 2 && ours.len() < 2) || theirs == ours {
        return None;
    }
    let show = |names: &[String]| if names.is_empty() { "none".to_owned() } else { names.join(", ") };
    Some(format!(
        "{joiner}'s node.toml `controllers` lists {} but the controller {controller}'s node.toml `controllers` \
         lists {}: every node must list the same controllers; copy the controller's list into {joiner}'s node.toml",
        show(&theirs),
        show(&ours)
    ))
}

#[cfg(test)]
mod tests {
    use super::*;

    fn listen() -> SocketAddr {
        "10.0.0.1:7400".parse().unwrap()
    }

    fn list(entries: &[&str]) -> Vec<String> {
        entries.iter().map(|s| s.to_string()).collect()
    }

    fn three() -> Vec<String> {
        list(&["node-a@10.0.0.1:7401", "node-b@10.0.0.2:7401", "node-c@10.0.0.3:7401"])
    }

    #[test]
    fn three_controllers_parse_with_their_raft_addresses() {
        let (entries, warnings) = check("node-a", listen(), None, &three()).unwrap();
        assert_eq!(entries.len(), 3);
        assert_eq!(entries[1].raft_addr, Some("10.0.0.2:7401".parse().unwrap()));
        assert!(warnings.is_empty());
        let (entries, _) = check("node-a", listen(), None, &list(&["node-a"])).unwrap();
        assert_eq!(entries[0].raft_addr, None, "one controller needs no address");
        assert!(check("worker", listen(), Some(listen()), &three()).is_ok(), "a worker joins, listed or not");
    }

    #[test]
    fn an_even_count_is_allowed_with_a_warning() {
        let mut four = three();
        four.push("node-d@10.0.0.4:7401".into());
        let (_, warnings) = check("node-a", listen(), None, &four).unwrap();
        assert_eq!(warnings.len(), 1);
        assert!(warnings[0].contains("tolerate no more failures than 3"), "{}", warnings[0]);
    }

    #[test]
    fn bad_lists_are_refused_with_the_fix() {
        let mut twice = three();
        twice.push("node-b@10.0.0.9:7401".into());
        let err = check("node-a", listen(), None, &twice).unwrap_err();
        assert!(err.contains("\"node-b\" is listed twice"), "{err}");

        let eight: Vec<String> = (0..8).map(|i| format!("n{i}@10.0.0.{i}:7401")).collect();
        let err = check("n0", listen(), None, &eight).unwrap_err();
        assert!(err.contains("at most 7"), "{err}");

        let err = check("node-z", listen(), None, &three()).unwrap_err();
        assert!(err.contains("not listed") && err.contains("`join`"), "{err}");

        let err = check("node-a", listen(), None, &list(&["node-a@10.0.0.1:7401", "node-b"])).unwrap_err();
        assert!(err.contains("\"node-b\" has no Raft address") && err.contains("NAME@HOST:PORT"), "{err}");

        let err = check("node-a", listen(), None, &list(&["node-a@nowhere", "node-b@10.0.0.2:1"])).unwrap_err();
        assert!(err.contains("not HOST:PORT"), "{err}");

        let same = list(&["node-a@10.0.0.1:7400", "node-b@10.0.0.2:7401"]);
        let err = check("node-a", listen(), None, &same).unwrap_err();
        assert!(err.contains("port of its own"), "{err}");

        let shared = list(&["node-a@10.0.0.1:7401", "node-b@10.0.0.1:7401"]);
        assert!(check("node-a", listen(), None, &shared).unwrap_err().contains("two controllers"));
    }

    #[test]
    fn raft_listen_is_checked_naming_the_fix() {
        let addr = |a: &str| Some(a.parse().unwrap());
        assert_eq!(check_raft_listen("node-d", listen(), addr("10.0.0.4:7401"), &three()), Ok(()));
        assert_eq!(check_raft_listen("node-d", listen(), None, &[]), Ok(()));
        let err = check_raft_listen("node-d", listen(), addr("10.0.0.4:7401"), &[]).unwrap_err();
        assert!(err.contains("lists 0") && err.contains("remove `raft_listen`"), "{err}");
        let err = check_raft_listen("node-d", listen(), addr("10.0.0.1:7400"), &three()).unwrap_err();
        assert!(err.contains("`listen` address"), "{err}");
        let err = check_raft_listen("node-a", listen(), addr("10.0.0.9:7401"), &three()).unwrap_err();
        assert!(err.contains("in `controllers` already"), "{err}");
        let err = check_raft_listen("node-d", listen(), addr("10.0.0.2:7401"), &three()).unwrap_err();
        assert!(err.contains("\"node-b\"'s Raft address"), "{err}");
    }

    #[test]
    fn a_committed_membership_unlike_node_toml_is_named_beside_it() {
        let names = |l: &[&str]| l.iter().map(|s| s.to_string()).collect::<Vec<_>>();
        let three = names(&["node-a", "node-b", "node-c"]);
        assert_eq!(committed_differs(&three, &names(&["node-c", "node-b", "node-a"])), None);
        assert_eq!(committed_differs(&three, &[]), None, "a group not initialised yet");
        let w = committed_differs(&three, &names(&["node-a", "node-b", "node-c", "node-d"])).unwrap();
        assert!(w.contains("lists node-a, node-b, node-c"), "{w}");
        assert!(w.contains("Raft log is node-a, node-b, node-c, node-d"), "{w}");
        assert!(w.contains("the committed one is used"), "{w}");
    }

    #[test]
    fn a_joiner_listing_other_controllers_is_refused_naming_both_lists() {
        let names = |l: &[&str]| l.iter().map(|s| s.to_string()).collect::<Vec<_>>();
        let ours = names(&["node-a", "node-b", "node-c"]);
        assert_eq!(
            join_mismatch("node-d", &names(&["node-c", "node-a", "node-b"]), "node-a", &ours),
            None,
            "order aside"
        );
        assert_eq!(join_mismatch("node-d", &[], "node-a", &[]), None, "one controller: nothing to compare");
        assert_eq!(join_mismatch("node-d", &names(&["node-a"]), "node-a", &[]), None);
        let err = join_mismatch("node-d", &names(&["node-a", "node-b"]), "node-a", &ours).unwrap();
        assert!(err.contains("node-d's node.toml `controllers` lists node-a, node-b"), "{err}");
        assert!(err.contains("the controller node-a's node.toml `controllers` lists node-a, node-b, node-c"), "{err}");
        assert!(err.contains("copy the controller's list"), "{err}");
        let err = join_mismatch("node-d", &[], "node-a", &ours).unwrap();
        assert!(err.contains("node-d's node.toml `controllers` lists none"), "{err}");
    }
}
