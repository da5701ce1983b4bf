//! `troupe dashboard`: where a running cluster's live dashboards are — the controller's, and each
//! member's (a member's page shows the same cluster, fetched from the controller). It prints URLs and
//! opens nothing: the machines a cluster runs on seldom have a browser, and the URL is what a user
//! pastes into one (or into an SSH tunnel).

use anyhow::{bail, Context};
use serde_json::json;

use super::client::ClusterArgs;
use super::table::Table;
use crate::api::ClusterStatus;

#[derive(Debug, clap::Args)]
pub struct DashboardArgs {
    #[command(flatten)]
    pub cluster: ClusterArgs,
}

/// One daemon's line: name, role, dashboard URL.
struct Member {
    name: String,
    controller: bool,
    dashboard: Option<String>,
}

/// The members as `status` lists them, the controller first; and the URL to open: the controller's,
/// else the first member's that serves one.
fn dashboards(status: &ClusterStatus) -> (Vec<Member>, Option<String>) {
    let mut members: Vec<Member> = status
        .members
        .iter()
        .map(|m| Member {
            name: m.name.clone(),
            controller: Some(m.addr) == status.controller_addr,
            dashboard: m.dashboard.clone(),
        })
        .collect();
    members.sort_by_key(|m| !m.controller);
    let open = members.iter().find_map(|m| m.dashboard.clone());
    (members, open)
}

pub fn run(args: DashboardArgs) -> anyhow::Result<()> {
    let runtime =
        tokio::runtime::Builder::new_current_thread().enable_all().build().context("starting the tokio runtime")?;
    runtime.block_on(async {
        let mut client = args.cluster.connect().await?;
        let answered = client.peer().1;
        let status = client.status().await?;
        client.close().await;
        let (members, open) = dashboards(&status);
        let Some(open) = open else {
            bail!(
                "no daemon of the cluster at {answered} serves a dashboard: add `metrics_listen = \"0.0.0.0:9400\"` \
                 under `[telemetry]` in the node.toml of the controller (or of any daemon) and restart it"
            );
        };
        if args.cluster.json {
            let members: Vec<_> = members
                .iter()
                .map(|m| {
                    let role = if m.controller { "controller" } else { "member" };
                    json!({ "name": m.name, "role": role, "dashboard": m.dashboard })
                })
                .collect();
            println!("{}", json!({ "event": "dashboard", "dashboard": open, "members": members }));
            return Ok(());
        }
        print(&members, &open);
        Ok(())
    })
}

fn print(members: &[Member], open: &str) {
    match members.first().filter(|m| m.controller) {
        Some(m) if m.dashboard.is_some() => println!("troupe: dashboard on {open} (the controller, {})", m.name),
        Some(m) => println!(
            "troupe: dashboard on {open} (a member's page, showing the cluster through the controller {}, which \
             serves none)",
            m.name
        ),
        None => println!("troupe: dashboard on {open}"),
    }
    let mut table = Table::new(&["NODE", "ROLE", "DASHBOARD"]);
    for m in members {
        let role = if m.controller { "controller" } else { "member (the cluster through the controller)" };
        let url = m.dashboard.clone().unwrap_or_else(|| "- (no [telemetry] metrics_listen)".to_owned());
        table.row(vec![m.name.clone(), role.to_owned(), url]);
    }
    print!("{}", table.render());
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::protocol::MemberInfo;

    fn status(dashboards: &[Option<&str>]) -> ClusterStatus {
        let members = dashboards
            .iter()
            .enumerate()
            .map(|(i, d)| MemberInfo {
                name: format!("node-{i}"),
                addr: format!("10.0.0.{}:7000", i + 1).parse().unwrap(),
                slots: 1,
                dashboard: d.map(str::to_owned),
                raft_listen: None,
                devices: Vec::new(),
                load: None,
            })
            .collect();
        ClusterStatus {
            node: "node-1".into(),
            controller: false,
            controller_addr: Some("10.0.0.2:7000".parse().unwrap()),
            epoch: 2,
            members,
            joining: Vec::new(),
            jobs: Vec::new(),
            refused_stale: 0,
            changes: Vec::new(),
        }
    }

    #[test]
    fn the_controllers_dashboard_comes_first_else_the_first_members() {
        let (members, open) = dashboards(&status(&[Some("http://a/"), Some("http://b/"), None]));
        assert_eq!(members.iter().map(|m| m.name.as_str()).collect::<Vec<_>>(), ["node-1", "node-0", "node-2"]);
        assert!(members[0].controller && !members[1].controller);
        assert_eq!(open.as_deref(), Some("http://b/"), "node-1, the controller");
        let (_, open) = dashboards(&status(&[Some("http://a/"), None, None]));
        assert_eq!(open.as_deref(), Some("http://a/"), "a member's page when the controller serves none");
        assert_eq!(dashboards(&status(&[None, None])).1, None);
    }
}
