//! `troupe daemon --config node.toml`.

use std::path::PathBuf;

#[derive(Debug, clap::Args)]
pub struct DaemonArgs {
    /// The node's config: name, listen, join, data_dir, certs, slots (docs/runtime-semantics.md).
    #[arg(long, value_name = "node.toml")]
    pub config: PathBuf,
    /// Drain and exit when the parent process dies (the embedded local cluster sets this).
    #[arg(long, hide = true)]
    pub exit_with_parent: bool,
    /// Print the addresses the daemon listens on as one JSON object (`{"event":"daemon", "node",
    /// "listen", "metrics", "dashboard"}`) instead of lines.
    #[arg(long)]
    pub json: bool,
}

pub fn run(args: DaemonArgs) -> anyhow::Result<()> {
    crate::daemon::run(&args.config, args.exit_with_parent, args.json)
}
