//! `troupe cluster controllers [add NODE [--address HOST:PORT] | remove NODE]`: the replicated
//! controller's Raft group of a running cluster — shown, or changed by joint consensus (issue 32;
//! docs/runtime-semantics.md, "Changing the controllers").

use std::net::SocketAddr;

use super::client::{runtime, ClusterArgs};
use super::table::Table;
use crate::protocol::{ControllersChange, ControllersStatus};

#[derive(Debug, clap::Subcommand)]
pub enum ControllersCommand {
    /// Make the member NODE a controller: it catches up with the Raft log as a learner, then votes. Its
    /// daemon must run (a member of the cluster, with the cluster's certificate) with `raft_listen` in
    /// its node.toml.
    Add {
        /// The node's name (as in its certificate).
        node: String,
        /// NODE's Raft address, its node.toml `raft_listen` (default: the one NODE's daemon announced
        /// when it joined).
        #[arg(long, value_name = "HOST:PORT")]
        address: Option<SocketAddr>,
        #[command(flatten)]
        cluster: ClusterArgs,
    },
    /// Remove the controller NODE from the Raft group (the leader too: another takes over). The last
    /// controller cannot be removed.
    Remove {
        node: String,
        #[command(flatten)]
        cluster: ClusterArgs,
    },
}

/// Shows the group (`command` none), or changes it and shows the group as the leader has it after.
pub fn run(command: Option<ControllersCommand>, cluster: ClusterArgs) -> anyhow::Result<()> {
    let (change, cluster) = match command {
        None => (None, cluster),
        Some(ControllersCommand::Add { node, address, cluster }) => {
            (Some(ControllersChange::Add { node, raft_addr: address }), cluster)
        }
        Some(ControllersCommand::Remove { node, cluster }) => (Some(ControllersChange::Remove { node }), cluster),
    };
    runtime()?.block_on(async {
        let mut client = cluster.connect().await?;
        let status = match change {
            None => client.controllers().await,
            Some(change) => client.change_controllers(change).await,
        };
        client.close().await;
        let status = status?;
        if cluster.json {
            println!("{}", serde_json::to_string(&status)?);
        } else {
            print!("{}", render(&status));
        }
        Ok(())
    })
}

/// The group as a table: each voter (leader or follower) and learner, with its Raft address and the
/// log index the leader knows it holds.
fn render(status: &ControllersStatus) -> String {
    let leader = status.leader.as_deref().unwrap_or("none known (an election is under way?)");
    if !status.replicated {
        return format!("one controller ({leader}): no Raft group (node.toml `controllers` lists one or none)\n");
    }
    let mut out = format!("Raft term {}: the controller is {leader}; answered by {}\n", status.term, status.node);
    let mut table = Table::new(&["NODE", "RAFT ADDRESS", "ROLE", "MATCHED"]);
    let voters = status.controllers.iter().map(|c| (c, status.leader.as_ref() == Some(&c.name)));
    let roles = voters.map(|(c, leads)| (c, if leads { "leader" } else { "follower" }));
    for (c, role) in roles.chain(status.learners.iter().map(|c| (c, "learner"))) {
        let matched = c.matched.map_or("-".to_owned(), |m| m.to_string());
        table.row(vec![c.name.clone(), c.raft_addr.clone().unwrap_or_default(), role.into(), matched]);
    }
    out.push_str(&table.render());
    out
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::protocol::ControllerInfo;

    fn info(name: &str, matched: Option<u64>) -> ControllerInfo {
        ControllerInfo { name: name.into(), raft_addr: Some(format!("10.0.0.1:74{}", name.len())), matched }
    }

    #[test]
    fn the_table_names_the_leader_followers_and_learners() {
        let status = ControllersStatus {
            node: "node-0".into(),
            replicated: true,
            term: 4,
            leader: Some("node-1".into()),
            last_log_index: Some(30),
            controllers: vec![info("node-0", Some(30)), info("node-1", None)],
            learners: vec![info("node-3", Some(12))],
        };
        let text = render(&status);
        assert!(text.starts_with("Raft term 4: the controller is node-1; answered by node-0"), "{text}");
        let role = |name: &str| {
            let line = text.lines().find(|l| l.starts_with(name)).unwrap_or_else(|| panic!("{name} in {text}"));
            line.split_whitespace().nth(2).unwrap().to_owned()
        };
        assert_eq!(
            (role("node-0"), role("node-1"), role("node-3")),
            ("follower".into(), "leader".into(), "learner".into())
        );
    }
}
