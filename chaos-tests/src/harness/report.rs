//! The report of a chaos run: what was injected, how fast the job noticed and recovered, what the checker
//! found. A table for people (`Display`), JSON for machines (`serde`).

use std::collections::BTreeMap;
use std::fmt;

use serde::Serialize;

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
    /// Steps trained twice because a rollback to a durable checkpoint redid them.
    pub steps_redone: u64,
    /// Committed steps missing from, or repeated in, the final trajectory. Must be 0.
    pub data_lost: u64,
    /// Bad inputs sent to the cluster while it ran, and whether each was refused as it should be.
    pub bad_inputs: Vec<Check>,
    pub checks: Vec<Check>,
    /// A failed run's directory, kept: the daemons' logs (`node-N.log`) and the checkpoints.
    pub kept: Option<std::path::PathBuf>,
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
            "  {} nodes, {} steps in {:.1} s; faults: {}",
            self.nodes,
            self.steps,
            self.wall_s,
            faults.join(", ")
        )?;
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
        writeln!(
            f,
            "  recoveries {}, steps redone {}, data lost {}",
            self.recoveries, self.steps_redone, self.data_lost
        )?;
        writeln!(f)?;
        for (title, checks) in [("bad inputs", &self.bad_inputs), ("invariants", &self.checks)] {
            writeln!(f, "  {title}:")?;
            for c in checks {
                writeln!(f, "    [{}] {:<44} {}", if c.passed { "ok" } else { "FAIL" }, c.name, c.detail)?;
            }
        }
        if let Some(dir) = &self.kept {
            writeln!(f, "\n  the daemons' logs and the checkpoints are kept in {}", dir.display())?;
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
}
