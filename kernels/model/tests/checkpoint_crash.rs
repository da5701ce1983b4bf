//! Crash consistency of the checkpoint commit: a writer process (`troupe-checkpoint-writer`) saving
//! checkpoints in a loop is SIGKILLed 100 times at random points (delays from a seeded RNG). After every
//! kill the newest valid checkpoint is the last one the writer reported durable or the one it was
//! committing, its contents are exactly that step's, and the redb catalog lists the last durable commit
//! and nothing that does not load.

use std::io::{BufRead, BufReader};
use std::path::Path;
use std::process::{Child, Command, Stdio};
use std::sync::mpsc;
use std::time::{Duration, Instant};

use troupe_model::checkpoint::{crash_state, load_state, verify, Catalog, CheckpointStore, RedbCatalog};
use troupe_model::rng::SplitMix64;

const KILLS: usize = 100;
const SEED: u64 = 0x5EED_C4A5;
/// Kill delays after the writer's first commit: uniform below this (a few commits' worth: a commit of
/// this ~1 MB state takes 30–90 ms here, about half of it the catalog).
const DELAY_MS_MAX: u64 = 150;
const KEEP_LAST: usize = 2;

/// A writer process and the lines it prints, read on a thread so that no wait is unbounded.
struct Writer {
    child: Child,
    lines: mpsc::Receiver<String>,
}

impl Writer {
    fn start(root: &Path) -> Self {
        let mut child = Command::new(env!("CARGO_BIN_EXE_troupe-checkpoint-writer"))
            .args([root.to_str().unwrap(), "3", &KEEP_LAST.to_string()])
            .stdout(Stdio::piped())
            .stderr(Stdio::inherit())
            .spawn()
            .expect("the writer starts");
        let stdout = child.stdout.take().unwrap();
        let (tx, lines) = mpsc::channel();
        std::thread::spawn(move || {
            for line in BufReader::new(stdout).lines().map_while(Result::ok) {
                if tx.send(line).is_err() {
                    break;
                }
            }
        });
        Writer { child, lines }
    }

    fn kill(mut self) -> Vec<String> {
        self.child.kill().expect("SIGKILL");
        self.child.wait().expect("reaped");
        // The reader thread ends at EOF; everything printed before the kill is in the channel.
        let deadline = Instant::now() + Duration::from_secs(10);
        let mut lines = Vec::new();
        while let Ok(line) = self.lines.recv_timeout(deadline.saturating_duration_since(Instant::now())) {
            lines.push(line);
        }
        lines
    }
}

impl Drop for Writer {
    fn drop(&mut self) {
        let _ = self.child.kill();
        let _ = self.child.wait();
    }
}

fn step_of(line: &str, prefix: &str) -> Option<u64> {
    line.strip_prefix(prefix).and_then(|s| s.trim().parse().ok())
}

/// What one lane saw: kills while a file was being written, loads that got the previous checkpoint,
/// loads that got the new one, the last durable step.
type LaneStats = (usize, usize, usize, Option<u64>);

/// `kills` rounds of start, random delay, SIGKILL, check — on its own checkpoint root.
fn lane(root: &Path, seed: u64, kills: usize) -> LaneStats {
    let mut rng = SplitMix64::new(seed);
    let mut durable: Option<u64> = None; // the newest step any writer reported durable
    let mut reported = std::collections::BTreeSet::new(); // every step reported durable
    let mut latest_before: Option<u64> = None; // the newest valid checkpoint before this round
    let (mut got_previous, mut got_new, mut mid_write) = (0, 0, 0);
    for kill in 0..kills {
        let writer = Writer::start(root);
        let ready = writer.lines.recv_timeout(Duration::from_secs(30)).expect("the writer says ready within 30 s");
        let first = step_of(&ready, "ready ").unwrap_or_else(|| panic!("kill {kill}: unexpected line {ready:?}"));
        assert_eq!(first, latest_before.map_or(1, |s| s + 1), "kill {kill}: the writer continues after the newest");
        // Once the writer is in its loop (its first commit reported), a random delay, then SIGKILL.
        let first_commit = writer.lines.recv_timeout(Duration::from_secs(30)).expect("a first commit within 30 s");
        std::thread::sleep(Duration::from_millis(rng.below(DELAY_MS_MAX)));
        let mut lines = vec![first_commit];
        lines.extend(writer.kill());
        let committed: Vec<u64> = lines.iter().filter_map(|l| step_of(l, "committed ")).collect();
        assert_eq!(committed.first(), Some(&first), "kill {kill}: {lines:?}");
        reported.extend(committed.iter().copied());
        if let Some(&last) = committed.last() {
            durable = Some(last);
        }

        // The next load gets the previous or the new checkpoint, never a broken one: the last one this
        // round reported durable (or, if none, the newest before the round), or the one after it.
        let (latest, _) = troupe_model::checkpoint::latest_valid(root);
        let latest_step = latest.as_ref().map(|d| load_state(d).unwrap().step);
        let previous = committed.last().copied().or(latest_before);
        let new = previous.map_or(first, |p| p + 1);
        assert!(
            latest_step == previous || latest_step == Some(new),
            "kill {kill}: latest valid checkpoint is step {latest_step:?}; previous {previous:?}, new {new}"
        );
        latest_before = latest_step;
        if let Some(dir) = &latest {
            let loaded = load_state(dir).unwrap();
            assert!(loaded == crash_state(loaded.step), "kill {kill}: step {} loads other values", loaded.step);
        }
        if latest_step == previous {
            got_previous += 1;
        } else {
            got_new += 1;
        }
        let temporary = std::fs::read_dir(root).unwrap().filter_map(|e| e.ok()?.file_name().into_string().ok());
        mid_write += usize::from(temporary.into_iter().any(|n| n.starts_with(".tmp-")));

        // The catalog lists the last durable commit (the catalog store did not lose it) and nothing that does not load.
        let catalog = RedbCatalog::at_root(root);
        let entries = catalog.entries().unwrap_or_else(|e| panic!("kill {kill}: the catalog does not open: {e}"));
        // (A directory older than the newest KEEP_LAST may be half-way through retention: it leaves the
        // catalog before its directory goes.)
        for (step, _) in troupe_model::checkpoint::step_dirs(root).iter().rev().take(KEEP_LAST) {
            if reported.contains(step) {
                assert!(
                    entries.iter().any(|e| e.step == *step),
                    "kill {kill}: the catalog lost durable step {step}: {entries:?}"
                );
            }
        }
        for entry in &entries {
            verify(&root.join(&entry.dir)).unwrap_or_else(|e| {
                panic!("kill {kill}: the catalog lists step {} that does not load: {e}", entry.step)
            });
        }
    }
    // A store opened on the root removes what the killed writers left behind.
    drop(CheckpointStore::open(root, KEEP_LAST).unwrap());
    let leftovers: Vec<_> = std::fs::read_dir(root)
        .unwrap()
        .filter_map(|e| e.ok()?.file_name().into_string().ok())
        .filter(|n| n.starts_with('.'))
        .collect();
    assert!(leftovers.is_empty(), "left behind: {leftovers:?}");
    (mid_write, got_previous, got_new, durable)
}

/// The writer links libtorch, whose start-up takes most of a second on a loaded 2-core machine: the 100
/// kills run in [`LANES`] independent lanes (own root, own seed) at once.
const LANES: usize = 5;

#[test]
fn a_writer_killed_at_random_points_never_leaves_a_broken_latest_checkpoint() {
    let t0 = Instant::now();
    let dir = tempfile::tempdir().unwrap();
    let lanes: Vec<_> = (0..LANES)
        .map(|i| {
            let root = dir.path().join(format!("ckpt-{i}"));
            std::thread::spawn(move || lane(&root, SEED + i as u64, KILLS / LANES))
        })
        .collect();
    let (mut mid_write, mut got_previous, mut got_new) = (0, 0, 0);
    for (i, lane) in lanes.into_iter().enumerate() {
        let (w, p, n, durable) = lane.join().unwrap_or_else(|_| panic!("lane {i} failed (see its message above)"));
        assert!(
            durable.unwrap_or(0) >= (KILLS / LANES) as u64,
            "lane {i}: the writer committed too little to test anything: {durable:?}"
        );
        (mid_write, got_previous, got_new) = (mid_write + w, got_previous + p, got_new + n);
    }
    eprintln!(
        "{KILLS} kills in {:.1} s ({mid_write} while a shard or manifest was being written): the next load got the last durable checkpoint {got_previous} times, the one being committed (renamed, not yet reported) {got_new} times",
        t0.elapsed().as_secs_f64()
    );
    assert!(mid_write > 0, "no kill landed inside a write: the test does not test the commit");
}
