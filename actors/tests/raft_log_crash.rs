//! Crash consistency of the Raft log, vote and state machine in the daemon's redb catalog
//! (runtime::raft::store, ::machine): a child process (this test binary, running the ignored
//! `appender` test) appends entries, raises its vote, records the committed id, applies committed
//! entries to the catalog and purges old entries in a loop, printing what returned durable; the parent
//! SIGKILLs it at random points (seeded) and, after each kill, reopens the store and checks what
//! openraft relies on: the log contiguous from the last purged id, terms never decreasing, nothing
//! reported durable lost (entries, vote, committed, applied), last_applied ≤ committed, and the
//! catalog holding exactly the last applied entry's write (applied once, in the same transaction).

use std::io::{BufRead, BufReader};
use std::path::Path;
use std::process::{Child, Command, Stdio};
use std::sync::mpsc;
use std::time::{Duration, Instant};

use openraft::{CommittedLeaderId, EntryPayload, LogId};
use troupe_actors::catalog::{Catalog, CatalogWrite, StoredView};
use troupe_actors::runtime::raft::machine::StateMachine;
use troupe_actors::runtime::raft::store::LogStore;
use troupe_actors::runtime::raft::{Entry, Vote};
use troupe_model::rng::SplitMix64;

const KILLS: usize = 30;
const SEED: u64 = 0x5EED_4AF7;
/// Kill delays after the child's first durable append: uniform below this (tens of appends).
const DELAY_MS_MAX: u64 = 200;
const DIR_VAR: &str = "TROUPE_RAFT_CRASH_DIR";
const NODE: u64 = 7;

fn write_for(index: u64) -> CatalogWrite {
    CatalogWrite::View(StoredView { epoch: index, members: vec![format!("m{index}")], ..Default::default() })
}

fn log_id(term: u64, index: u64) -> LogId<u64> {
    LogId::new(CommittedLeaderId::new(term, NODE), index)
}

/// The child: runs until killed. Ignored unless the parent runs it with the directory in `DIR_VAR`.
#[test]
#[ignore = "the child process of raft_log_survives_sigkill_at_random_points"]
fn appender() {
    let Ok(dir) = std::env::var(DIR_VAR) else { return };
    let catalog = Catalog::open(Path::new(&dir)).unwrap();
    let (log, machine) = (LogStore::new(&catalog), StateMachine::new(catalog.clone()));
    let mut next = log.log_state().unwrap().last_log_id.map_or(0, |l| l.index + 1);
    let mut term = log.vote().unwrap().map_or(1, |v| v.leader_id.term);
    let mut applied = machine.applied().unwrap().0.map(|l| l.index);
    for round in 0u64.. {
        if round % 7 == 0 {
            term += 1;
            log.save_vote_durable(&Vote::new(term, NODE)).unwrap();
            println!("vote {term}");
        }
        let batch: Vec<Entry> = (next..next + 1 + round % 3)
            .map(|i| Entry { log_id: log_id(term, i), payload: EntryPayload::Normal(write_for(i)) })
            .collect();
        next += batch.len() as u64;
        log.append_durable(batch).unwrap();
        println!("durable {}", next - 1);
        let committed = next.saturating_sub(3);
        let committed_id = log.entries(committed..=committed).unwrap()[0].log_id;
        log.save_committed_durable(Some(committed_id)).unwrap();
        println!("committed {committed}");
        let from = applied.map_or(0, |a| a + 1);
        for entry in log.entries(from..=committed).unwrap() {
            machine.apply_entry(&entry).unwrap();
            applied = Some(entry.log_id.index);
            println!("applied {}", entry.log_id.index);
        }
        if round % 10 == 9 && committed > 20 {
            let upto = log.entries(committed - 20..=committed - 20).unwrap()[0].log_id;
            log.purge_to(upto).unwrap();
        }
    }
}

struct Appender {
    child: Child,
    lines: mpsc::Receiver<String>,
}

impl Appender {
    fn start(dir: &Path) -> Self {
        let mut child = Command::new(std::env::current_exe().unwrap())
            .args(["appender", "--exact", "--ignored", "--nocapture", "--test-threads=1"])
            .env(DIR_VAR, dir)
            .stdout(Stdio::piped())
            .stderr(Stdio::inherit())
            .spawn()
            .expect("the appender starts");
        let stdout = child.stdout.take().unwrap();
        let (tx, lines) = mpsc::channel();
        std::thread::spawn(move || {
            for line in BufReader::new(stdout).lines().map_while(Result::ok) {
                if tx.send(line).is_err() {
                    break;
                }
            }
        });
        Appender { child, lines }
    }

    /// Waits for the first durable append, lets it run `delay`, SIGKILLs it; every line it printed.
    fn kill_after(mut self, delay: Duration) -> Vec<String> {
        let deadline = Instant::now() + Duration::from_secs(30);
        let mut lines = Vec::new();
        while !lines.iter().any(|l: &String| l.starts_with("durable ")) {
            let line = self.lines.recv_timeout(deadline.saturating_duration_since(Instant::now()));
            lines.push(line.expect("a first durable append within 30 s"));
        }
        std::thread::sleep(delay);
        self.child.kill().expect("SIGKILL");
        self.child.wait().expect("reaped");
        let deadline = Instant::now() + Duration::from_secs(10);
        while let Ok(line) = self.lines.recv_timeout(deadline.saturating_duration_since(Instant::now())) {
            lines.push(line);
        }
        lines
    }
}

impl Drop for Appender {
    fn drop(&mut self) {
        let _ = self.child.kill();
        let _ = self.child.wait();
    }
}

/// The last number printed after `prefix`.
fn last(lines: &[String], prefix: &str) -> Option<u64> {
    lines.iter().rev().find_map(|l| l.strip_prefix(prefix)?.trim().parse().ok())
}

/// What the parent has seen reported durable so far.
#[derive(Default)]
struct Reported {
    durable: Option<u64>,
    vote: Option<u64>,
    committed: Option<u64>,
    applied: Option<u64>,
}

fn check(dir: &Path, kill: usize, seen: &Reported) {
    let catalog = Catalog::open(dir).unwrap_or_else(|e| panic!("kill {kill}: the catalog does not open: {e:#}"));
    let (log, machine) = (LogStore::new(&catalog), StateMachine::new(catalog.clone()));
    let state = log.log_state().unwrap();
    let last_index = state.last_log_id.map(|l| l.index);
    assert!(last_index >= seen.durable, "kill {kill}: log ends at {last_index:?}, {:?} was durable", seen.durable);
    let first = state.last_purged_log_id.map_or(0, |p| p.index + 1);
    let entries = log.entries(..).unwrap();
    let mut term = state.last_purged_log_id.map_or(0, |p| p.leader_id.term);
    for (k, entry) in entries.iter().enumerate() {
        assert_eq!(entry.log_id.index, first + k as u64, "kill {kill}: a hole in the log");
        assert!(entry.log_id.leader_id.term >= term, "kill {kill}: a term went down at {}", entry.log_id.index);
        term = entry.log_id.leader_id.term;
        assert!(
            matches!(&entry.payload, EntryPayload::Normal(w) if *w == write_for(entry.log_id.index)),
            "kill {kill}: entry {} holds another write",
            entry.log_id.index
        );
    }
    assert_eq!(entries.last().map(|e| e.log_id), state.last_log_id.filter(|_| !entries.is_empty()));
    let vote = log.vote().unwrap().map(|v| v.leader_id.term);
    assert!(vote >= seen.vote, "kill {kill}: vote {vote:?}, {:?} was durable", seen.vote);
    let committed = log.committed().unwrap().map(|c| c.index);
    assert!(committed >= seen.committed && committed <= last_index, "kill {kill}: committed {committed:?}");
    let applied = machine.applied().unwrap().0.map(|a| a.index);
    assert!(
        applied >= seen.applied && applied <= committed,
        "kill {kill}: applied {applied:?}, committed {committed:?}"
    );
    let view = catalog.view().unwrap().map(|v| v.epoch);
    assert_eq!(view, applied, "kill {kill}: the catalog holds the write of entry {view:?}, applied {applied:?}");
}

#[test]
fn raft_log_survives_sigkill_at_random_points() {
    let dir = tempfile::tempdir().unwrap();
    let mut rng = SplitMix64::new(SEED);
    let mut seen = Reported::default();
    let mut purged_once = false;
    for kill in 0..KILLS {
        let lines = Appender::start(dir.path()).kill_after(Duration::from_millis(rng.below(DELAY_MS_MAX)));
        seen.durable = last(&lines, "durable ").or(seen.durable);
        seen.vote = last(&lines, "vote ").or(seen.vote);
        seen.committed = last(&lines, "committed ").or(seen.committed);
        seen.applied = last(&lines, "applied ").or(seen.applied);
        check(dir.path(), kill, &seen);
        let catalog = Catalog::open(dir.path()).unwrap();
        purged_once |= LogStore::new(&catalog).log_state().unwrap().last_purged_log_id.is_some();
    }
    eprintln!("{KILLS} kills; last durable entry {:?}, applied {:?}", seen.durable, seen.applied);
    assert!(purged_once, "the children purged at least once (the check covered a purged log)");
}
