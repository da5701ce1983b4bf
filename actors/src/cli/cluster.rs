//! `troupe cluster init --dir DIR` and `troupe cluster add-node NAME --dir DIR`: the cluster CA and
//! node certificates every QUIC connection is authenticated with (troupe_cluster::identity).

use std::path::PathBuf;

use anyhow::Context;

#[derive(Debug, clap::Subcommand)]
pub enum ClusterCommand {
    /// Create a cluster CA (ca.pem, ca.key.pem) in DIR.
    Init {
        /// Directory for the cluster's certificates (created if missing; an existing CA is kept).
        #[arg(long)]
        dir: PathBuf,
    },
    /// Issue a certificate for node NAME, signed by the CA in DIR (nodes/NAME.pem, nodes/NAME.key.pem).
    AddNode {
        /// The node's name: a DNS label (a-z, 0-9, '-'); it is the node's identity on the wire.
        name: String,
        /// The directory `troupe cluster init` wrote.
        #[arg(long)]
        dir: PathBuf,
    },
}

pub fn run(cmd: ClusterCommand) -> anyhow::Result<()> {
    match cmd {
        ClusterCommand::Init { dir } => {
            troupe_cluster::init_cluster(&dir)
                .with_context(|| format!("creating a cluster CA in {}", dir.display()))?;
            println!("cluster CA created in {} (keep ca.key.pem private)", dir.display());
        }
        ClusterCommand::AddNode { name, dir } => {
            troupe_cluster::add_node(&name, &dir)
                .with_context(|| format!("issuing a certificate for {name:?} from {}", dir.display()))?;
            println!("node {name} certificate written to {}", dir.join("nodes").display());
        }
    }
    Ok(())
}
