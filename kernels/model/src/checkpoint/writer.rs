//! The asynchronous checkpoint writer: the step loop hands over a host-memory snapshot and goes on;
//! one background thread writes and commits it and reports when it is durable.
//!
//! One write at a time, so saves never interleave on disk. At most one request waits behind the write in
//! flight: a newer snapshot replaces a queued one (reported `Superseded`), so a slow disk costs
//! checkpoint frequency, never memory or a growing backlog, and never blocks the step loop. A write that
//! fails (a full disk) is reported `Failed`; the checkpoints before it stay valid (the commit is atomic).

use std::sync::{Arc, Condvar, Mutex};
use std::thread::JoinHandle;
use std::time::{Duration, Instant};

use super::manifest::Layout;
use super::state::TrainingState;
use super::store::{CheckpointStore, Saved};
use super::CheckpointError;

/// A snapshot to write, under `layout`; `tag` comes back in its report (e.g. the attempt number).
#[derive(Debug)]
pub struct SaveRequest {
    pub state: Box<TrainingState>,
    pub layout: Layout,
    pub tag: u64,
}

#[derive(Debug)]
pub enum WriteReport {
    /// Committed and recorded: durable.
    Durable {
        tag: u64,
        saved: Saved,
    },
    Failed {
        tag: u64,
        step: u64,
        error: CheckpointError,
    },
    /// Replaced in the queue by the snapshot of step `by` before it was written.
    Superseded {
        tag: u64,
        step: u64,
        by: u64,
    },
}

type OnReport = Arc<dyn Fn(WriteReport) + Send + Sync>;

#[derive(Default)]
struct Slot {
    queued: Option<SaveRequest>,
    /// The step being written.
    writing: Option<u64>,
    closed: bool,
    /// The last snapshot written, handed back for the next one to copy into (`TrainingState::refresh`).
    spare: Option<Box<TrainingState>>,
}

struct Shared {
    slot: Mutex<Slot>,
    changed: Condvar,
}

pub struct CheckpointWriter {
    shared: Arc<Shared>,
    on_report: OnReport,
    thread: Option<JoinHandle<()>>,
}

impl std::fmt::Debug for CheckpointWriter {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("CheckpointWriter").finish_non_exhaustive()
    }
}

impl CheckpointWriter {
    /// Starts the writer thread for `store`; `on_report` is called (on the writer thread, or on the
    /// submitter's for `Superseded`) once per request.
    pub fn spawn(
        store: CheckpointStore,
        on_report: impl Fn(WriteReport) + Send + Sync + 'static,
    ) -> std::io::Result<Self> {
        let shared = Arc::new(Shared { slot: Mutex::new(Slot::default()), changed: Condvar::new() });
        let on_report: OnReport = Arc::new(on_report);
        let thread = std::thread::Builder::new().name("troupe-checkpoint-writer".into()).spawn({
            let (shared, on_report) = (shared.clone(), on_report.clone());
            move || write_loop(&store, &shared, &*on_report)
        })?;
        Ok(Self { shared, on_report, thread: Some(thread) })
    }

    /// Queues `request` behind the write in flight, replacing (and reporting) a request still queued.
    pub fn submit(&self, request: SaveRequest) {
        let by = request.state.step;
        let replaced = {
            let mut slot = self.shared.slot.lock().expect("not poisoned");
            let replaced = slot.queued.replace(request);
            self.shared.changed.notify_all();
            replaced
        };
        if let Some(old) = replaced {
            (self.on_report)(WriteReport::Superseded { tag: old.tag, step: old.state.step, by });
        }
    }

    /// A snapshot already written, to refresh rather than allocate a new one.
    pub fn take_spare(&self) -> Option<Box<TrainingState>> {
        self.shared.slot.lock().expect("not poisoned").spare.take()
    }

    /// Nothing queued and nothing being written.
    pub fn is_idle(&self) -> bool {
        let slot = self.shared.slot.lock().expect("not poisoned");
        slot.queued.is_none() && slot.writing.is_none()
    }

    /// Waits until idle, at most `timeout`; whether it is idle.
    pub fn wait_idle(&self, timeout: Duration) -> bool {
        let deadline = Instant::now() + timeout;
        let mut slot = self.shared.slot.lock().expect("not poisoned");
        while slot.queued.is_some() || slot.writing.is_some() {
            let left = deadline.saturating_duration_since(Instant::now());
            if left.is_zero() {
                return false;
            }
            slot = self.shared.changed.wait_timeout(slot, left).expect("not poisoned").0;
        }
        true
    }

    /// Finishes the queued write and stops the thread.
    pub fn close(mut self) {
        self.shut();
        if let Some(thread) = self.thread.take() {
            let _ = thread.join();
        }
    }

    fn shut(&self) {
        self.shared.slot.lock().expect("not poisoned").closed = true;
        self.shared.changed.notify_all();
    }
}

impl Drop for CheckpointWriter {
    /// Stops taking requests; the thread finishes what was queued on its own (never joined here, so
    /// dropping a writer never waits on a disk).
    fn drop(&mut self) {
        self.shut();
    }
}

fn write_loop(store: &CheckpointStore, shared: &Shared, on_report: &(dyn Fn(WriteReport) + Send + Sync)) {
    loop {
        let request = {
            let mut slot = shared.slot.lock().expect("not poisoned");
            loop {
                if let Some(request) = slot.queued.take() {
                    slot.writing = Some(request.state.step);
                    break request;
                }
                if slot.closed {
                    return;
                }
                slot = shared.changed.wait(slot).expect("not poisoned");
            }
        };
        let (tag, step) = (request.tag, request.state.step);
        let report = match store.save(&request.state, &request.layout) {
            Ok(saved) => WriteReport::Durable { tag, saved },
            Err(error) => WriteReport::Failed { tag, step, error },
        };
        on_report(report);
        {
            let mut slot = shared.slot.lock().expect("not poisoned");
            slot.writing = None;
            slot.spare = Some(request.state);
        }
        shared.changed.notify_all();
    }
}
