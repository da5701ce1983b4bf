//! Writes checkpoints in a loop, for the crash-consistency test (kernels/model/tests/checkpoint_crash.rs),
//! which SIGKILLs it at random points of a commit.
//!
//!     troupe-checkpoint-writer ROOT SHARDS KEEP_LAST
//!
//! Continues after the newest valid checkpoint under ROOT (or from step 1), prints `ready STEP`, then
//! after each durable save (committed and recorded in the redb catalog) `committed STEP`. The state of
//! step s is `troupe_model::checkpoint::crash_state(s)`, so a reader can check it bit for bit.

use std::io::Write;
use std::path::PathBuf;
use std::process::ExitCode;

use troupe_model::checkpoint::{crash_state, load_state, CheckpointStore, Layout};

fn main() -> ExitCode {
    let args: Vec<String> = std::env::args().skip(1).collect();
    let [root, shards, keep] = args.as_slice() else {
        eprintln!("usage: troupe-checkpoint-writer ROOT SHARDS KEEP_LAST");
        return ExitCode::from(2);
    };
    let (Ok(shards), Ok(keep)) = (shards.parse::<usize>(), keep.parse::<usize>()) else {
        eprintln!("troupe-checkpoint-writer: SHARDS and KEEP_LAST must be numbers, got {shards:?} {keep:?}");
        return ExitCode::from(2);
    };
    let root = PathBuf::from(root);
    let store = match CheckpointStore::open(&root, keep) {
        Ok(s) => s,
        Err(e) => {
            eprintln!("troupe-checkpoint-writer: {e}");
            return ExitCode::FAILURE;
        }
    };
    let next = store.latest_valid().0.and_then(|dir| load_state(&dir).ok()).map_or(1, |s| s.step + 1);
    let mut out = std::io::stdout().lock();
    let _ = writeln!(out, "ready {next}");
    let _ = out.flush();
    for step in next.. {
        if let Err(e) = store.save(&crash_state(step), &Layout::ddp(shards)) {
            eprintln!("troupe-checkpoint-writer: step {step}: {e}");
            return ExitCode::FAILURE;
        }
        let _ = writeln!(out, "committed {step}");
        let _ = out.flush();
    }
    ExitCode::SUCCESS
}
