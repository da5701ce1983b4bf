//! `troupe cluster init --dir DIR` and `troupe cluster add-node NAME --dir DIR`: the cluster CA and
//! node certificates every QUIC connection is authenticated with (troupe_cluster::identity);
//! `troupe cluster controllers [add|remove]`: the replicated controller's Raft group of a running cluster.

use std::path::PathBuf;

use anyhow::Context;

#[derive(Debug, clap::Subcommand)]
pub enum ClusterCommand {
    /// Create a cluster CA (ca.pem, ca.key.pem) in DIR.
    Init {
        /// Directory for the cluster's certificates (created if missing; an existing CA is kept).
        #[arg(long)]
        dir: PathBuf,
        /// Print what was written as one JSON object.
        #[arg(long)]
        json: bool,
    },
    /// Issue a certificate for node NAME, signed by the CA in DIR (nodes/NAME.pem, nodes/NAME.key.pem).
    AddNode {
        /// The node's name: a DNS label (a-z, 0-9, '-'); it is the node's identity on the wire.
        name: String,
        /// The directory `troupe cluster init` wrote.
        #[arg(long)]
        dir: PathBuf,
        /// Print what was written as one JSON object.
        #[arg(long)]
        json: bool,
    },
    /// Show the controller-eligible daemons of a running cluster: which one leads (is the controller),
    /// Raft's term, each voter's and learner's match index as the leader knows it; or change them.
    Controllers {
        #[command(subcommand)]
        change: Option<super::controllers::ControllersCommand>,
        #[command(flatten)]
        cluster: super::client::ClusterArgs,
    },
}

pub fn run(cmd: ClusterCommand) -> anyhow::Result<()> {
    match cmd {
        ClusterCommand::Controllers { change, cluster } => super::controllers::run(change, cluster)?,
        ClusterCommand::Init { dir, json } => {
            troupe_cluster::init_cluster(&dir)
                .with_context(|| format!("creating a cluster CA in {}", dir.display()))?;
            if json {
                let (ca, key) = (dir.join("ca.pem"), dir.join("ca.key.pem"));
                println!("{}", serde_json::json!({ "event": "cluster_ca", "dir": dir, "ca": ca, "ca_key": key }));
            } else {
                println!("cluster CA created in {} (keep ca.key.pem private)", dir.display());
            }
        }
        ClusterCommand::AddNode { name, dir, json } => {
            troupe_cluster::add_node(&name, &dir)
                .with_context(|| format!("issuing a certificate for {name:?} from {}", dir.display()))?;
            let nodes = dir.join("nodes");
            if json {
                let (cert, key) = (nodes.join(format!("{name}.pem")), nodes.join(format!("{name}.key.pem")));
                println!(
                    "{}",
                    serde_json::json!({ "event": "node_certificate", "node": name, "cert": cert, "key": key })
                );
            } else {
                println!("node {name} certificate written to {}", nodes.display());
            }
        }
    }
    Ok(())
}
