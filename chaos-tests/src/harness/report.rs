//! The report of a chaos run: what was injected, how fast the job noticed and recovered, what the checker
//! found. A table for people (`Display`), JSON for machines (`serde`).

use std::collections::BTreeMap;
use std::fmt;
use std::time::Instant;

use serde::Serialize;
use troupe_actors::api::JobEvent;

use super::link::LinkStats;
use super::nemesis::Injected;

#[derive(Clone, Debug, Serialize)]
pub struct Report {
    pub scenario: String,
    pub description: String,
    pub seed: u64,
    /// Every check passed.
    pub passed: bool,
    /// Set when the scenario could not run here (a missing privilege): the reason. Nothing was checked.
    pub skipped: Option<String>,
    pub nodes: usize,
    /// How the job's tensors travelled between hosts (the scenario's `data_plane`).
    pub data_plane: troupe_actors::api::DataPlane,
    pub steps: u64,
    pub wall_s: f64,
    /// Faults injected, by kind.
    pub faults: BTreeMap<String, usize>,
    /// Attempts that resumed training after a membership change.
    pub recoveries: usize,
    /// Fault → the controller's membership change naming the node (seconds).
    pub detection_s: Summary,
    /// Fault → the next step committed after the job recovered (seconds).
    pub recovery_s: Summary,
    /// Each fault that took nodes away but has no detection sample, and why.
    pub undetected: Vec<String>,
    /// Steps trained twice because a rollback to a durable checkpoint redid them.
    pub steps_redone: u64,
    /// Committed steps missing from, or repeated in, the final trajectory. Must be 0.
    pub data_lost: u64,
    /// Bad inputs sent to the cluster while it ran, and whether each was refused as it should be.
    pub bad_inputs: Vec<Check>,
    pub checks: Vec<Check>,
    /// Every fault as injected, in the order they started.
    pub injected: Vec<FaultRecord>,
    /// What each link fault did (how it was applied, packets held, dropped, reordered, duplicated, and
    /// the step time before and while it held).
    pub links: Vec<LinkStats>,
    /// A failed run's directory, kept: the daemons' logs (`node-N.log`) and the checkpoints.
    pub kept: Option<std::path::PathBuf>,
}

/// One injected fault.
#[derive(Clone, Debug, Serialize)]
pub struct FaultRecord {
    pub kind: String,
    pub nodes: Vec<String>,
    /// Seconds after the job committed its first step (what `at_s` counts from).
    pub after_first_step_s: Option<f64>,
    /// How long until it healed (None: it lasted to the end).
    pub lasted_s: Option<f64>,
    /// How it was applied where there was a choice (link faults: tc netem or nfqueue).
    pub note: Option<String>,
    /// Why it could not be applied as asked.
    pub error: Option<String>,
    /// The controller's membership change that named the node (how it was found: `Failed` by the
    /// heartbeat detector's silence, with `silent_ms`; `ConnectionLost` by the transport), if one did.
    pub detected_by: Option<String>,
    /// Seconds from the fault to that change reaching the client.
    pub detected_after_s: Option<f64>,
    /// A fault on the controller: the leader it hit and the one elected after it, with their Raft terms
    /// (`node-0 (term 1) -> node-2 (term 3)`).
    pub takeover: Option<String>,
}

impl FaultRecord {
    pub fn of(fault: &Injected, first_step: Option<Instant>, events: &[(Instant, JobEvent)]) -> Self {
        let detection = super::checker::detection(events, fault);
        FaultRecord {
            detected_by: detection.map(|(_, change)| change.to_owned()),
            detected_after_s: detection.map(|(t, _)| t.saturating_duration_since(fault.at).as_secs_f64()),
            kind: fault.kind.as_str().into(),
            nodes: fault.nodes.clone(),
            after_first_step_s: first_step.map(|t| fault.at.saturating_duration_since(t).as_secs_f64()),
            lasted_s: fault.healed.map(|h| h.saturating_duration_since(fault.at).as_secs_f64()),
            note: fault.note.clone(),
            error: fault.error.clone(),
            takeover: fault.takeover.as_ref().map(|t| {
                let after =
                    t.after.as_ref().map_or("no new leader named".into(), |l| format!("{} (term {})", l.name, l.term));
                format!("{} (term {}) -> {after}", t.before.name, t.before.term)
            }),
        }
    }
}

#[derive(Clone, Debug, Serialize)]
pub struct Check {
    pub name: String,
    pub passed: bool,
    pub detail: String,
}

/// p50 / p99 / max of a few samples (nearest rank).
#[derive(Clone, Debug, Default, Serialize)]
pub struct Summary {
    pub samples: usize,
    pub p50: Option<f64>,
    pub p99: Option<f64>,
    pub max: Option<f64>,
}

impl Summary {
    pub fn of(mut values: Vec<f64>) -> Self {
        values.sort_by(f64::total_cmp);
        let at = |q: f64| {
            let rank = ((q * values.len() as f64).ceil() as usize).clamp(1, values.len());
            values[rank - 1]
        };
        if values.is_empty() {
            return Summary::default();
        }
        Summary { samples: values.len(), p50: Some(at(0.5)), p99: Some(at(0.99)), max: values.last().copied() }
    }
}

fn secs(v: Option<f64>) -> String {
    v.map_or("-".into(), |v| format!("{v:.2} s"))
}

impl fmt::Display for Report {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        let verdict = match (&self.skipped, self.passed) {
            (Some(_), _) => "SKIPPED",
            (None, true) => "PASSED",
            (None, false) => "FAILED",
        };
        writeln!(f, "chaos scenario {} (seed {}): {verdict}", self.scenario, self.seed)?;
        writeln!(f, "  {}", self.description)?;
        if let Some(why) = &self.skipped {
            return writeln!(f, "  skipped: {why}");
        }
        let faults: Vec<String> = self.faults.iter().map(|(k, n)| format!("{k} ×{n}")).collect();
        writeln!(
            f,
            "  {} nodes (data plane {}), {} steps in {:.1} s; faults: {}",
            self.nodes,
            self.data_plane,
            self.steps,
            self.wall_s,
            faults.join(", ")
        )?;
        for i in &self.injected {
            let at = i.after_first_step_s.map_or(String::new(), |s| format!(" {s:.2} s after the first step"));
            let lasted = i.lasted_s.map_or(String::new(), |s| format!(", healed after {s:.1} s"));
            let how = i.note.as_ref().map_or(String::new(), |n| format!("; {n}"));
            writeln!(f, "    {} on {}{at}{lasted}{how}", i.kind, i.nodes.join(", "))?;
            if let (Some(change), Some(s)) = (&i.detected_by, i.detected_after_s) {
                writeln!(f, "      detected after {s:.2} s: {change}")?;
            }
            if let Some(takeover) = &i.takeover {
                writeln!(f, "      controller: {takeover}")?;
            }
        }
        writeln!(f)?;
        writeln!(f, "  {:<28} {:>10} {:>10} {:>10}", "", "p50", "p99", "max")?;
        for (name, s) in [("detection", &self.detection_s), ("recovery", &self.recovery_s)] {
            writeln!(
                f,
                "  {:<28} {:>10} {:>10} {:>10}",
                format!("{name} ({} samples)", s.samples),
                secs(s.p50),
                secs(s.p99),
                secs(s.max)
            )?;
        }
        for u in &self.undetected {
            writeln!(f, "    not detected: {u}")?;
        }
        writeln!(
            f,
            "  recoveries {}, steps redone {}, data lost {}",
            self.recoveries, self.steps_redone, self.data_lost
        )?;
        for l in &self.links {
            let ms = |v: Option<f64>| v.map_or("-".into(), |v| format!("{v:.0} ms"));
            writeln!(
                f,
                "  link of {} ({}): {} packets, {} dropped, {} delayed (mean hold {:.1} ms), {} reordered, {} duplicated; \
                 step {} before, {} during",
                l.node,
                l.mechanism,
                l.packets,
                l.dropped,
                l.delayed,
                l.mean_hold_ms,
                l.reordered,
                l.duplicated,
                ms(l.step_ms_before),
                ms(l.step_ms_during)
            )?;
        }
        writeln!(f)?;
        for (title, checks) in [("bad inputs", &self.bad_inputs), ("invariants", &self.checks)] {
            writeln!(f, "  {title}:")?;
            for c in checks {
                writeln!(f, "    [{}] {:<44} {}", if c.passed { "ok" } else { "FAIL" }, c.name, c.detail)?;
            }
        }
        if let Some(dir) = &self.kept {
            writeln!(f, "\n  the daemons' logs, the job's events and the checkpoints are in {}", dir.display())?;
        }
        Ok(())
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn percentiles_use_the_nearest_rank() {
        let s = Summary::of(vec![3.0, 1.0, 2.0, 4.0]);
        assert_eq!((s.p50, s.p99, s.max, s.samples), (Some(2.0), Some(4.0), Some(4.0), 4));
        assert_eq!(Summary::of(vec![]).p50, None);
    }

    #[test]
    fn the_table_lists_every_fault_and_link() {
        let report = Report {
            scenario: "s".into(),
            description: "d".into(),
            seed: 1,
            passed: true,
            skipped: None,
            nodes: 3,
            data_plane: troupe_actors::api::DataPlane::EncryptedTcp,
            steps: 10,
            wall_s: 1.0,
            faults: BTreeMap::from([("flaky-link".to_owned(), 1)]),
            recoveries: 0,
            detection_s: Summary::default(),
            recovery_s: Summary::default(),
            undetected: vec!["kill on node-0: the controller's own node".into()],
            steps_redone: 0,
            data_lost: 0,
            bad_inputs: Vec::new(),
            checks: Vec::new(),
            injected: vec![FaultRecord {
                kind: "flaky-link".into(),
                nodes: vec!["node-2".into()],
                after_first_step_s: Some(0.5),
                lasted_s: Some(8.0),
                note: Some("links degraded with nfqueue".into()),
                error: None,
                detected_by: None,
                detected_after_s: None,
                takeover: Some("node-0 (term 1) -> node-2 (term 3)".into()),
            }],
            links: vec![LinkStats {
                node: "node-2".into(),
                mechanism: "nfqueue".into(),
                packets: 100,
                dropped: 5,
                delayed: 95,
                mean_hold_ms: 20.4,
                step_ms_before: Some(10.0),
                step_ms_during: Some(2000.0),
                ..LinkStats::default()
            }],
            kept: None,
        };
        let table = report.to_string();
        for line in [
            "3 nodes (data plane encrypted-tcp), 10 steps in 1.0 s; faults: flaky-link ×1",
            "flaky-link on node-2 0.50 s after the first step, healed after 8.0 s; links degraded with nfqueue",
            "link of node-2 (nfqueue): 100 packets, 5 dropped, 95 delayed (mean hold 20.4 ms)",
            "step 10 ms before, 2000 ms during",
            "    not detected: kill on node-0: the controller's own node",
            "      controller: node-0 (term 1) -> node-2 (term 3)",
        ] {
            assert!(table.contains(line), "{line:?} missing from\n{table}");
        }
    }
}
