//! The replicated controller's record of a chaos run, read after every daemon stopped: each
//! controller's Raft log (`raft_log` in its `daemon.redb`: every entry with the term and the leader that
//! proposed it) and its catalog (the state machine: the events of every entry it applied), and the two
//! checks on them:
//!
//! - **every committed step is in a majority's log**: each step event the client saw, as event number n
//!   of the job, is event n of the job in a majority of the controllers' records (their catalog, or an
//!   entry of their log not yet applied when they stopped) — what "committed by a Raft majority before
//!   announce" promises;
//! - **at most one leader commits a given step**: along the job's events as a majority's logs hold them,
//!   no step is committed again without a rollback between (a rollback redoes steps openly, with the
//!   same bits), whichever leader committed it; the terms of the entries never decrease; and the detail
//!   names which leader (and term) committed which steps.
//!
//! An entry's leader is its log id's (openraft's `CommittedLeaderId`: term and node id, the node id the
//! hash of the controller's name, `runtime::raft::node_id`).

use std::collections::BTreeMap;
use std::path::Path;

use anyhow::Context;
use troupe_actors::catalog::{Catalog, CatalogWrite};
use troupe_actors::protocol::{JobEvent, JobId};
use troupe_actors::runtime::raft::{node_id, store::LogStore};

use super::report::Check;

/// One controller's record of a job.
#[derive(Clone, Debug, Default)]
pub struct ControllerRecord {
    pub name: String,
    /// The events its catalog holds (from the entries it applied), by event number.
    pub applied: BTreeMap<u64, JobEvent>,
    /// The events of the job's entries in its Raft log, by event number (a later entry's copy of an
    /// event wins, as applying it would).
    pub logged: BTreeMap<u64, Logged>,
}

/// An event as an entry of a Raft log carries it.
#[derive(Clone, Debug)]
pub struct Logged {
    /// The entry's log index, term and proposing leader (its name; the node id in hex if no controller
    /// has that id).
    pub index: u64,
    pub term: u64,
    pub leader: String,
    pub event: JobEvent,
}

/// Reads controller `name`'s record of `job` from its data directory; `names` are every controller's,
/// to name the leaders of the entries.
pub fn read(name: &str, data_dir: &Path, job: JobId, names: &[String]) -> anyhow::Result<ControllerRecord> {
    let catalog = Catalog::open(data_dir).with_context(|| format!("opening {name}'s catalog"))?;
    let mut record = ControllerRecord { name: name.to_owned(), ..ControllerRecord::default() };
    for stored in catalog.jobs()?.into_iter().filter(|j| j.info.id == job) {
        record.applied.extend((stored.first_event..).zip(stored.events));
    }
    let entries = LogStore::new(&catalog).entries(..).map_err(|e| anyhow::anyhow!("reading {name}'s Raft log: {e}"))?;
    let leader_name =
        |id: u64| names.iter().find(|n| node_id(n) == id).cloned().unwrap_or_else(|| format!("{id:016x}"));
    for entry in entries {
        let payload = serde_json::to_value(&entry.payload)?;
        let Some(normal) = payload.get("Normal") else { continue }; // blank and membership entries
        let write: CatalogWrite = serde_json::from_value(normal.clone())?;
        let CatalogWrite::Job { info, first, events, .. } = write else { continue };
        if info.id != job {
            continue;
        }
        let (term, leader) = (entry.log_id.leader_id.term, leader_name(entry.log_id.leader_id.node_id));
        for (n, event) in (first..).zip(events) {
            let logged = Logged { index: entry.log_id.index, term, leader: leader.clone(), event };
            record.logged.insert(n, logged);
        }
    }
    Ok(record)
}

/// A step event's identity: its step, loss bits and epoch (the other figures are the same event's).
fn same_step(a: &JobEvent, b: &JobEvent) -> bool {
    match (a, b) {
        (
            JobEvent::Step { step: s1, loss: l1, epoch: e1, .. },
            JobEvent::Step { step: s2, loss: l2, epoch: e2, .. },
        ) => s1 == s2 && e1 == e2 && (l1.to_bits() == l2.to_bits() || (l1.is_nan() && l2.is_nan())),
        _ => false,
    }
}

fn majority(controllers: usize) -> usize {
    controllers / 2 + 1
}

/// Every step event of `seen` (the client's events, the k-th being the job's event number k) is that
/// event number in a majority of `records` (applied, or logged and not yet applied).
pub fn steps_in_majority(seen: &[JobEvent], records: &[ControllerRecord]) -> Check {
    let name = "every committed step is in a majority's log";
    let need = majority(records.len());
    let (mut steps, mut missing) = (0usize, Vec::new());
    for (n, event) in (0u64..).zip(seen) {
        let JobEvent::Step { step, .. } = event else { continue };
        steps += 1;
        let holders: Vec<&str> = records
            .iter()
            .filter(|r| {
                let applied = r.applied.get(&n).is_some_and(|e| same_step(e, event));
                applied || r.logged.get(&n).is_some_and(|l| same_step(&l.event, event))
            })
            .map(|r| r.name.as_str())
            .collect();
        if holders.len() < need {
            missing.push(format!("step {step} (event {n}) held by {holders:?}"));
        }
    }
    let passed = missing.is_empty() && steps > 0;
    let detail = match (passed, steps) {
        (_, 0) => "the client saw no step".to_owned(),
        (true, _) => format!("{steps} step(s) seen, each in at least {need} of {} controllers' logs", records.len()),
        (false, _) => format!("{} of {steps} not in {need} logs: {}", missing.len(), first_few(&missing)),
    };
    Check { name: name.into(), passed, detail }
}

/// The job's events as a majority of the logs hold them: for each event number, the copy (term and
/// event) most controllers' logs agree on, if a majority does.
fn committed_log(records: &[ControllerRecord]) -> BTreeMap<u64, Logged> {
    let need = majority(records.len());
    let numbers: std::collections::BTreeSet<u64> = records.iter().flat_map(|r| r.logged.keys().copied()).collect();
    let mut out = BTreeMap::new();
    for n in numbers {
        let copies: Vec<&Logged> = records.iter().filter_map(|r| r.logged.get(&n)).collect();
        let agreed = copies.iter().find(|c| {
            copies.iter().filter(|o| o.term == c.term && o.index == c.index && same_event(&o.event, &c.event)).count()
                >= need
        });
        if let Some(c) = agreed {
            out.insert(n, (*c).clone());
        }
    }
    out
}

fn same_event(a: &JobEvent, b: &JobEvent) -> bool {
    same_step(a, b) || (!matches!(a, JobEvent::Step { .. }) && a == b)
}

/// Along the job's committed events (a majority's logs): no step committed twice without a rollback
/// between, terms never decreasing; the detail says which leader committed which steps, and which
/// events the logs no longer hold (purged after a snapshot: `steps_in_majority` still finds them in the
/// catalogs, but not who committed them).
pub fn one_leader_per_step(records: &[ControllerRecord]) -> Check {
    let name = "at most one leader commits a given step";
    let log = committed_log(records);
    let (mut next, mut last_term, mut problems) = (1u64, 0u64, Vec::new());
    let mut by: BTreeMap<u64, (String, u64)> = BTreeMap::new(); // step -> (leader, term) that committed it
    let mut spans: Vec<(String, u64, u64, u64)> = Vec::new(); // (leader, term, first step, last step)
    for (n, l) in &log {
        if l.term < last_term {
            problems.push(format!("event {n} in term {} after term {last_term}", l.term));
        }
        last_term = last_term.max(l.term);
        match &l.event {
            JobEvent::RolledBack { to_step, .. } => next = to_step + 1,
            JobEvent::Step { step, .. } => {
                if *step < next {
                    let (first, term) = by.get(step).cloned().unwrap_or_default();
                    problems.push(format!(
                        "step {step} committed by {first} (term {term}) and again by {} (term {}) with no rollback between",
                        l.leader, l.term
                    ));
                }
                next = step + 1;
                by.insert(*step, (l.leader.clone(), l.term));
                match spans.last_mut() {
                    Some((who, term, _, last)) if *who == l.leader && *term == l.term => *last = *step,
                    _ => spans.push((l.leader.clone(), l.term, *step, *step)),
                }
            }
            _ => {}
        }
    }
    let passed = problems.is_empty() && !by.is_empty();
    let mut leaders: Vec<String> =
        spans.iter().map(|(who, term, a, b)| format!("steps {a}-{b} by {who} (term {term})")).collect();
    if let Some(first) = log.keys().next().filter(|n| **n > 0) {
        // Snapshots purge the log: `snapshot_every` entries after one, the entries before it go.
        leaders.push(format!("events 0-{} purged from the logs after snapshots (in the catalogs only)", first - 1));
    }
    let detail = if by.is_empty() {
        "no step in a majority's logs".to_owned()
    } else if passed {
        leaders.join("; ")
    } else {
        format!("{}; {}", first_few(&problems), leaders.join("; "))
    };
    Check { name: name.into(), passed, detail }
}

fn first_few(items: &[String]) -> String {
    let mut text = items.iter().take(3).cloned().collect::<Vec<_>>().join("; ");
    if items.len() > 3 {
        text.push_str(&format!("; and {} more", items.len() - 3));
    }
    text
}

#[cfg(test)]
mod tests {
    use super::*;

    fn step(step: u64, loss: f64, epoch: u64) -> JobEvent {
        JobEvent::Step {
            step,
            loss,
            lr: 1e-3,
            grad_norm: 1.0,
            skipped: false,
            loss_scale: 1.0,
            tokens_per_s: 1.0,
            epoch,
            world: 3,
            peak_rss_bytes: Vec::new(),
            bubble: None,
            mfu: None,
        }
    }

    fn logged(index: u64, term: u64, leader: &str, event: JobEvent) -> Logged {
        Logged { index, term, leader: leader.into(), event }
    }

    /// Three controllers: node-0 led term 1 (steps 1-2), node-1 term 3 (step 3); node-0 died after step 2.
    fn records() -> Vec<ControllerRecord> {
        let log = |upto: usize| -> BTreeMap<u64, Logged> {
            let all = [
                logged(2, 1, "node-0", step(1, 3.0, 1)),
                logged(3, 1, "node-0", step(2, 2.0, 1)),
                logged(5, 3, "node-1", step(3, 1.0, 2)),
            ];
            (0u64..).zip(all).take(upto).collect()
        };
        vec![
            ControllerRecord { name: "node-0".into(), applied: BTreeMap::new(), logged: log(2) },
            ControllerRecord {
                name: "node-1".into(),
                applied: log(3).into_iter().map(|(n, l)| (n, l.event)).collect(),
                logged: log(3),
            },
            ControllerRecord { name: "node-2".into(), applied: BTreeMap::new(), logged: log(3) },
        ]
    }

    #[test]
    fn a_step_the_client_saw_must_be_in_a_majority() {
        let seen = [step(1, 3.0, 1), step(2, 2.0, 1), step(3, 1.0, 2)];
        let check = steps_in_majority(&seen, &records());
        assert!(check.passed, "{check:?}");
        // A step only the deposed leader announced (another loss at event 2): one holder of three.
        let stray = [step(1, 3.0, 1), step(2, 2.0, 1), step(3, 1.5, 1)];
        let check = steps_in_majority(&stray, &records());
        assert!(!check.passed && check.detail.contains("step 3 (event 2)"), "{check:?}");
    }

    #[test]
    fn the_leaders_of_the_steps_are_named_and_a_second_commit_is_caught() {
        let check = one_leader_per_step(&records());
        assert!(check.passed, "{check:?}");
        assert_eq!(check.detail, "steps 1-2 by node-0 (term 1); steps 3-3 by node-1 (term 3)");

        // node-1 commits step 2 again in term 3 with no rollback.
        let mut twice = records();
        for r in &mut twice[1..] {
            r.logged.insert(3, logged(6, 3, "node-1", step(2, 2.0, 2)));
        }
        let check = one_leader_per_step(&twice);
        assert!(!check.passed, "{check:?}");
        assert!(check.detail.contains("step 2 committed by node-0 (term 1) and again by node-1 (term 3)"), "{check:?}");

        // The same after a rollback to step 1 is a redo, not a second commit.
        let mut redo = records();
        for r in &mut redo[1..] {
            r.logged.insert(3, logged(6, 3, "node-1", JobEvent::RolledBack { from_step: 2, to_step: 1 }));
            r.logged.insert(4, logged(7, 3, "node-1", step(2, 2.0, 2)));
        }
        assert!(one_leader_per_step(&redo).passed);
    }
}
