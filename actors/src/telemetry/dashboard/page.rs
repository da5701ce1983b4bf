//! The dashboard page: one self-contained HTML document (inline style, a few lines of script, no asset
//! fetched from anywhere) whose live part — the cluster's members, the jobs, per job its loss and
//! throughput chart, its ranks' step phases and its event log — is rendered here, on the daemon, as an
//! HTML fragment with the SVG pictures `troupe plot` and `troupe trace` draw. The page shows the fragment
//! it was served with, then replaces it with each one the daemon pushes over `/events` (server-sent
//! events). Rows and log entries carry `data-*` attributes so that tests (and scripts) can read them.
//! A member's page is the controller's fragment under a line naming the member ([`through_controller`]).

use std::collections::BTreeMap;
use std::fmt::Write as _;

use serde_json::Value;

use super::history::JobHistory;
use crate::protocol::{ClusterStatus, JobId, JobInfo};
use crate::telemetry::svg::escape;
use crate::telemetry::{plot, run_dir, timeline};

/// Jobs drawn in full (charts, timeline, log): those running, then the newest.
const JOBS_DRAWN_MAX: usize = 3;
/// Steps whose phases the timeline shows.
const TIMELINE_STEPS: u64 = 3;
/// Points per chart: longer histories are thinned to about this many steps.
const CHART_POINTS_MAX: usize = 600;
/// Log lines shown per job, and cluster membership changes shown.
const LOG_SHOWN: usize = 30;

/// A job as the dashboard draws it: its history (empty unless the job is drawn in full) and the
/// figures of its last step.
#[derive(Clone, Debug, Default)]
pub struct JobSnapshot {
    pub history: JobHistory,
    pub tokens_per_s: Option<f64>,
    pub mfu: Option<f64>,
}

/// The whole page around `fragment` (what [`fragment`] rendered when it was asked for).
pub fn document(node: &str, fragment: &str) -> String {
    format!(
        r#"<!DOCTYPE html>
<html lang="en"><head><meta charset="utf-8"><meta name="viewport" content="width=device-width, initial-scale=1">
<title>troupe · {node}</title>
<style>{STYLE}</style></head>
<body><header><h1>troupe</h1><span id="connection" class="stale">connecting…</span></header>
<main id="live">{fragment}</main>
<script>{SCRIPT}</script></body></html>
"#,
        node = escape(node),
    )
}

const STYLE: &str = "body{font-family:system-ui,sans-serif;margin:0;color:#222;background:#f6f7f9}\
header{display:flex;align-items:center;gap:1em;background:#223;color:#fff;padding:.4em 1em}\
header h1{font-size:1.2em;margin:0}#connection{font-size:.85em;padding:.1em .6em;border-radius:1em}\
.live{background:#2a7}.stale{background:#a52}main{padding:0 1em 2em}\
section{background:#fff;border:1px solid #ddd;border-radius:6px;margin:1em 0;padding:.5em 1em}\
h2{font-size:1.05em;margin:.3em 0}table{border-collapse:collapse;font-size:.9em}\
th,td{text-align:left;padding:.2em .8em .2em 0;border-bottom:1px solid #eee}td.n{text-align:right}\
svg{max-width:100%;height:auto}ol{font-size:.85em;font-family:monospace;padding-left:1.5em}\
li.membership,li.failed{color:#b22}li.recovery{color:#639}li.checkpoint{color:#555}\
.state-running{color:#2a7;font-weight:bold}.state-failed{color:#b22;font-weight:bold}";

/// The page's whole script: take each fragment the daemon pushes; say whether the stream is live.
const SCRIPT: &str = "const live=document.getElementById('live'),badge=document.getElementById('connection');\
const source=new EventSource('events');\
source.addEventListener('update',e=>{live.innerHTML=e.data;badge.textContent='live';badge.className='live';});\
source.onerror=()=>{badge.textContent='reconnecting…';badge.className='stale';};";

/// A member's fragment: `controllers` (the controller's own fragment, fetched over the control plane)
/// under a line that says which daemon's page this is and whose view it shows.
pub fn through_controller(status: &ClusterStatus, controllers: &str) -> String {
    let controller = controller_name(status);
    format!(
        r#"<section id="viewer" data-node="{node}" data-role="member" data-through="{controller}"><p>This is the page of <b>{node}</b>, a member: the cluster as the controller <b>{controller}</b> sees it, fetched from it over this daemon's control connection.</p></section>{controllers}"#,
        node = escape(&status.node),
        controller = escape(&controller),
    )
}

/// A member's fragment when the controller's did not come: why, then what the member knows (`own`).
pub fn without_controller(status: &ClusterStatus, why: &str, own: &str) -> String {
    format!(
        r#"<section id="viewer" data-node="{node}" data-role="member" data-through=""><p>This is the page of <b>{node}</b>, a member. The controller ({controller}) did not answer — {why} — so this is what {node} itself knows; the page retries every second.</p></section>{own}"#,
        node = escape(&status.node),
        controller = escape(&controller_name(status)),
        why = escape(why.trim()),
    )
}

/// The controller's name as a member knows it (the member at its address), else its address.
fn controller_name(status: &ClusterStatus) -> String {
    let Some(at) = status.controller_addr else { return "unknown".to_owned() };
    status.members.iter().find(|m| m.addr == at).map_or_else(|| at.to_string(), |m| m.name.clone())
}

/// The page's fragment when the node does not answer.
pub fn unavailable(why: &str) -> String {
    format!("<section><h2>This daemon's node did not answer</h2><p>{}</p></section>", escape(why))
}

fn cell(value: Option<f64>, format: impl Fn(f64) -> String) -> String {
    value.filter(|v| v.is_finite()).map_or_else(|| "–".to_owned(), format)
}

fn mib(bytes: u64) -> String {
    format!("{:.0} MiB", bytes as f64 / (1 << 20) as f64)
}

fn state_name<T: serde::Serialize>(state: &T) -> String {
    serde_json::to_value(state).ok().and_then(|v| v.as_str().map(str::to_owned)).unwrap_or_default()
}

/// The live part of the page.
pub fn fragment(status: &ClusterStatus, jobs: &BTreeMap<JobId, JobSnapshot>) -> String {
    let mut out = String::new();
    let role = if status.controller { "controller" } else { "member" };
    let _ = write!(
        out,
        r#"<section id="cluster" data-node="{node}" data-role="{role}" data-epoch="{epoch}"><h2>Cluster</h2><p><b>{node}</b> is the cluster's {role}; membership epoch <b>{epoch}</b>, {n} member(s){joining}.</p>"#,
        node = escape(&status.node),
        epoch = status.epoch,
        n = status.members.len(),
        joining = if status.joining.is_empty() {
            String::new()
        } else {
            format!(", joining at the next step boundary: {}", escape(&status.joining.join(", ")))
        },
    );
    if !status.controller {
        let at = status.controller_addr.map_or_else(|| "unknown".to_owned(), |a| a.to_string());
        let _ = write!(
            out,
            "<p>Jobs run from the controller (at {at}); open the dashboard of the controller's daemon to follow them.</p>"
        );
    }
    members(&mut out, status, jobs);
    if !status.changes.is_empty() {
        out.push_str(r#"<h2>Membership changes</h2><ol id="changes" reversed>"#);
        for change in status.changes.iter().rev().take(LOG_SHOWN) {
            let _ = write!(out, r#"<li class="change">{}</li>"#, escape(change));
        }
        out.push_str("</ol>");
    }
    out.push_str("</section>");
    if status.controller {
        jobs_table(&mut out, status, jobs);
        for id in drawn(status) {
            if let Some(job) = status.jobs.iter().find(|j| j.id == id) {
                job_section(&mut out, job, jobs.get(&id));
            }
        }
    }
    out
}

/// The jobs drawn in full: those running, then the newest, [`JOBS_DRAWN_MAX`] at most.
pub fn drawn(status: &ClusterStatus) -> Vec<JobId> {
    let mut jobs: Vec<&JobInfo> = status.jobs.iter().collect();
    jobs.sort_by_key(|j| (j.state.is_terminal(), std::cmp::Reverse(j.id)));
    jobs.into_iter().take(JOBS_DRAWN_MAX).map(|j| j.id).collect()
}

/// Members with their slots and what runs on them (each rank's job, state, step and peak memory).
fn members(out: &mut String, status: &ClusterStatus, jobs: &BTreeMap<JobId, JobSnapshot>) {
    out.push_str(
        r#"<table id="members"><tr><th>member</th><th>address</th><th>slots</th><th>in use</th><th>ranks</th><th>dashboard</th></tr>"#,
    );
    for m in &status.members {
        let mut ranks = Vec::new();
        for job in status.jobs.iter().filter(|j| !j.state.is_terminal()) {
            for r in job.ranks.iter().filter(|r| r.node == m.name) {
                let Some(rank) = r.rank else { continue };
                let memory = jobs
                    .get(&job.id)
                    .and_then(|s| s.history.peak_rss_bytes.get(rank).copied())
                    .map_or_else(String::new, |b| format!(", {}", mib(b)));
                let step = r.step.map_or_else(String::new, |s| format!(", step {s}"));
                ranks.push(format!("job {} rank {rank} ({}{step}{memory})", job.id, state_name(&r.state)));
            }
        }
        let dashboard = match m.dashboard.as_deref() {
            Some(url) if url.starts_with("http://") || url.starts_with("https://") => {
                format!(r#"<a href="{url}">{url}</a>"#, url = escape(url))
            }
            Some(other) => escape(other),
            None => "–".to_owned(),
        };
        let _ = write!(
            out,
            r#"<tr class="member" data-name="{name}"><td>{name}</td><td>{addr}</td><td class="n">{slots}</td><td class="n">{used}/{slots}</td><td>{ranks}</td><td>{dashboard}</td></tr>"#,
            name = escape(&m.name),
            addr = m.addr,
            slots = m.slots,
            used = ranks.len(),
            ranks = escape(&ranks.join("; ")),
        );
    }
    out.push_str("</table>");
}

fn jobs_table(out: &mut String, status: &ClusterStatus, jobs: &BTreeMap<JobId, JobSnapshot>) {
    out.push_str(r#"<section id="jobs"><h2>Jobs</h2>"#);
    if status.jobs.is_empty() {
        out.push_str("<p>No job submitted yet.</p></section>");
        return;
    }
    out.push_str("<table><tr><th>job</th><th>name</th><th>state</th><th>step</th><th>loss</th><th>tokens/s</th><th>MFU</th><th>ranks</th><th>attempts</th><th>epoch</th></tr>");
    for j in status.jobs.iter().rev() {
        let snapshot = jobs.get(&j.id);
        let state = state_name(&j.state);
        let _ = write!(
            out,
            r#"<tr class="job" data-job="{id}" data-name="{name}" data-state="{state}" data-step="{step}"><td>{id}</td><td>{name}</td><td class="state-{state}">{state}{reason}</td><td class="n">{step}/{total}</td><td class="n">{loss}</td><td class="n">{tokens}</td><td class="n">{mfu}</td><td class="n">{world}</td><td class="n">{attempts}</td><td class="n">{epoch}</td></tr>"#,
            id = j.id,
            name = escape(&j.name),
            reason = j.reason.as_deref().map_or_else(String::new, |r| format!(": {}", escape(r))),
            step = j.step,
            total = j.total_steps,
            loss = cell(j.last_loss, |l| format!("{l:.4}")),
            tokens = cell(snapshot.and_then(|s| s.tokens_per_s), |t| format!("{t:.0}")),
            mfu = cell(snapshot.and_then(|s| s.mfu), |m| format!("{:.1} %", m * 100.0)),
            world = j.world,
            attempts = j.attempts,
            epoch = j.epoch,
        );
    }
    out.push_str("</table></section>");
}

/// A `troupe plot`/`troupe trace` SVG inlined (no XML declaration to strip: the writer has none).
fn picture(out: &mut String, class: &str, svg: Result<String, String>) {
    match svg {
        Ok(svg) => {
            let _ = write!(out, r#"<div class="{class}">{svg}</div>"#);
        }
        Err(why) => {
            let _ = write!(out, r#"<p class="{class}">{}</p>"#, escape(&why));
        }
    }
}

fn job_section(out: &mut String, job: &JobInfo, snapshot: Option<&JobSnapshot>) {
    let _ = write!(
        out,
        r#"<section class="job-detail" id="job-{id}"><h2>Job {id} · {name}</h2>"#,
        id = job.id,
        name = escape(&job.name)
    );
    let Some(s) = snapshot else {
        out.push_str("<p>Submitted before this daemon started: no history here.</p></section>");
        return;
    };
    let history = &s.history;
    // Thin long histories to about CHART_POINTS_MAX steps; every marker is kept.
    let steps = history.chart.iter().filter(|e| e["event"] == "step").count();
    let every = steps.div_ceil(CHART_POINTS_MAX).max(1);
    let mut i = 0;
    let chart: Vec<Value> = history
        .chart
        .iter()
        .filter(|e| {
            if e["event"] != "step" {
                return true;
            }
            i += 1;
            i % every == 0 || i == steps
        })
        .cloned()
        .collect();
    picture(out, "chart", plot::render(&plot::series(&chart), &format!("job {} · loss and throughput", job.id)));
    match history.last_phase_step() {
        Some(last) => {
            let mut events: Vec<Value> = history.chart.iter().cloned().collect();
            events.extend(history.phases.iter().cloned());
            let first = last.saturating_sub(TIMELINE_STEPS - 1).max(1);
            let trace = run_dir::only_steps(&run_dir::trace_from_events(&events), first, last);
            picture(out, "timeline", trace.and_then(|t| timeline::render(&t, &format!("job {} · steps {first}–{last}, phases per rank", job.id))));
        }
        None => out.push_str(r#"<p class="timeline">No step phases: the job was submitted without tracing (<code>Job::trace</code>, set by <code>troupe train</code>).</p>"#),
    }
    out.push_str(r#"<h2>Events</h2><ol class="log" reversed>"#);
    for (kind, line) in history.log.iter().rev().take(LOG_SHOWN) {
        let _ = write!(out, r#"<li class="{kind}" data-kind="{kind}">{}</li>"#, escape(line));
    }
    out.push_str("</ol></section>");
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::protocol::MemberInfo;

    fn member_status() -> ClusterStatus {
        let member = |name: &str, port: u16, dashboard: Option<&str>| MemberInfo {
            name: name.into(),
            addr: ([10, 0, 0, 1], port).into(),
            slots: 1,
            dashboard: dashboard.map(str::to_owned),
            raft_listen: None,
            devices: Vec::new(),
            load: None,
        };
        ClusterStatus {
            node: "node-1".into(),
            controller: false,
            controller_addr: Some(([10, 0, 0, 1], 7000).into()),
            epoch: 2,
            members: vec![
                member("node-0", 7000, Some("http://10.0.0.1:9400/")),
                member("node-1", 7001, Some("javascript:alert(1)")),
            ],
            joining: Vec::new(),
            jobs: Vec::new(),
            refused_stale: 0,
            changes: Vec::new(),
        }
    }

    #[test]
    fn a_members_page_names_itself_and_the_controller_it_shows_the_cluster_through() {
        let status = member_status();
        let page = through_controller(&status, "<section id=\"cluster\">the controller's</section>");
        assert!(
            page.starts_with(r#"<section id="viewer" data-node="node-1" data-role="member" data-through="node-0">"#)
        );
        assert!(page.ends_with("<section id=\"cluster\">the controller's</section>"), "{page}");
        let alone = without_controller(&status, "no answer within 2000 ms\n", "<p>own</p>");
        assert!(alone.contains(r#"data-through="""#) && alone.contains("no answer within 2000 ms —"), "{alone}");
        assert!(alone.ends_with("<p>own</p>"));
    }

    #[test]
    fn members_link_their_dashboards_and_only_http_urls_become_links() {
        let page = fragment(&member_status(), &BTreeMap::new());
        assert!(page.contains(r#"<a href="http://10.0.0.1:9400/">http://10.0.0.1:9400/</a>"#), "{page}");
        assert!(page.contains("<td>javascript:alert(1)</td>") && !page.contains(r#"href="javascript"#), "{page}");
    }
}
