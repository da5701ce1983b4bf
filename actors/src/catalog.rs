//! The daemon's metadata catalog, behind a small interface so the store can be replaced: the node's
//! incarnation counter and, on the controller, what it needs to come back after a crash — the last view
//! (epoch and members), every job's spec and state, and the events each job streamed.
//!
//! redb, like the checkpoint catalog (`troupe_model::checkpoint::RedbCatalog`): sled 0.34.7, the version
//! DESIGN.md pinned, did not survive a SIGKILL during its snapshot write in the checkpoint crash test, and
//! surviving a SIGKILL is this catalog's whole purpose. Every write is one transaction, durable (fsynced)
//! when the call returns.

use std::path::{Path, PathBuf};
use std::sync::Arc;

use anyhow::Context;
use redb::{ReadableTable, TableDefinition};
use serde::{Deserialize, Serialize};

use crate::protocol::EVENTS_KEPT;
use crate::protocol::{JobEvent, JobInfo, JobSpec};

const META: TableDefinition<&str, &[u8]> = TableDefinition::new("meta");
const JOBS: TableDefinition<u64, &[u8]> = TableDefinition::new("jobs");
/// (job, event number) → the event's JSON; the newest [`EVENTS_KEPT`] of each job.
const EVENTS: TableDefinition<(u64, u64), &[u8]> = TableDefinition::new("events");

/// The file under `data_dir`.
pub const CATALOG_FILE: &str = "daemon.redb";

#[derive(Clone)]
pub struct Catalog {
    db: Arc<redb::Database>,
    path: PathBuf,
}

/// The controller's last view, written before the view is sent to anyone.
#[derive(Clone, Debug, Default, PartialEq, Serialize, Deserialize)]
pub struct StoredView {
    pub epoch: u64,
    pub members: Vec<String>,
    /// The controller that recorded it and its control address: with replicated controllers, how the
    /// other controllers find a new leader's address, and which node a take-over does not wait for.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub recorded_by: Option<(String, std::net::SocketAddr)>,
    /// Nodes of an earlier view that a controller which took over was still waiting for when it
    /// recorded this one (not in `members`): they may hold a job's state in memory, so the next
    /// controller waits for them too (within `RESUME_GRACE`), not only for `members`.
    #[serde(default, skip_serializing_if = "Vec::is_empty")]
    pub expecting: Vec<String>,
}

/// A job as the controller last recorded it.
#[derive(Clone, Debug, PartialEq, Serialize, Deserialize)]
pub struct StoredJob {
    pub spec: JobSpec,
    pub info: JobInfo,
    /// The number of the first of `events`.
    #[serde(skip)]
    pub first_event: u64,
    #[serde(skip)]
    pub events: Vec<JobEvent>,
}

impl Catalog {
    pub fn open(data_dir: &Path) -> anyhow::Result<Self> {
        std::fs::create_dir_all(data_dir).with_context(|| {
            format!("data_dir = {}: cannot create it; pick a writable directory", data_dir.display())
        })?;
        let path = data_dir.join(CATALOG_FILE);
        let db = redb::Database::create(&path).map_err(|e| match e {
            redb::DatabaseError::DatabaseAlreadyOpen => anyhow::anyhow!(
                "the catalog {} is open in another daemon: data_dir = {} is in use; give each daemon its own",
                path.display(),
                data_dir.display()
            ),
            e => anyhow::anyhow!("opening the catalog {}: {e}", path.display()),
        })?;
        Ok(Catalog { db: Arc::new(db), path })
    }

    fn error(&self, e: impl std::fmt::Display) -> anyhow::Error {
        anyhow::anyhow!("the catalog {}: {e}", self.path.display())
    }

    /// One durable write transaction.
    fn write(&self, op: impl FnOnce(&redb::WriteTransaction) -> anyhow::Result<()>) -> anyhow::Result<()> {
        let txn = self.db.begin_write().map_err(|e| self.error(e))?;
        op(&txn).map_err(|e| self.error(e))?;
        txn.commit().map_err(|e| self.error(e))
    }

    fn meta<T: for<'de> Deserialize<'de>>(&self, key: &str) -> anyhow::Result<Option<T>> {
        let txn = self.db.begin_read().map_err(|e| self.error(e))?;
        let table = match txn.open_table(META) {
            Ok(t) => t,
            Err(redb::TableError::TableDoesNotExist(_)) => return Ok(None),
            Err(e) => return Err(self.error(e)),
        };
        let Some(value) = table.get(key).map_err(|e| self.error(e))? else { return Ok(None) };
        serde_json::from_slice(value.value()).map(Some).map_err(|e| self.error(format!("{key}: {e}")))
    }

    fn put_meta(&self, key: &str, value: &impl Serialize) -> anyhow::Result<()> {
        let bytes = serde_json::to_vec(value).expect("metadata serialises");
        self.write(|txn| {
            txn.open_table(META)?.insert(key, bytes.as_slice())?;
            Ok(())
        })
    }

    /// Counts daemon starts on this data dir: each start is a new incarnation of the node.
    pub fn next_incarnation(&self) -> anyhow::Result<u64> {
        let next = self.meta::<u64>("incarnation")?.unwrap_or(0) + 1;
        self.put_meta("incarnation", &next)?;
        Ok(next)
    }

    pub fn view(&self) -> anyhow::Result<Option<StoredView>> {
        self.meta("view")
    }

    pub fn save_view(&self, view: &StoredView) -> anyhow::Result<()> {
        self.apply(&CatalogWrite::View(view.clone()))
    }

    /// Records a job's spec and state, and `events` numbered from `first` (older ones past
    /// [`EVENTS_KEPT`] are dropped), in one transaction.
    pub fn save_job(&self, spec: &JobSpec, info: &JobInfo, first: u64, events: &[JobEvent]) -> anyhow::Result<()> {
        self.write(|txn| put_job(txn, spec, info, first, events))
    }

    /// Performs one controller write in its own durable transaction.
    pub fn apply(&self, write: &CatalogWrite) -> anyhow::Result<()> {
        self.write(|txn| write.apply_in(txn))
    }

    /// The database, for the replicated controller's tables (`runtime::raft`), which it writes in the
    /// same transactions as the catalog's.
    pub(crate) fn database(&self) -> &Arc<redb::Database> {
        &self.db
    }

    /// The replicated part of the catalog (the view, every job with its kept events) as the writes
    /// that rebuild it in an empty catalog, read in `txn`.
    pub(crate) fn contents_in(&self, txn: &redb::ReadTransaction) -> anyhow::Result<Vec<CatalogWrite>> {
        let mut out = Vec::new();
        let view = match txn.open_table(META) {
            Ok(t) => t.get("view")?.map(|v| serde_json::from_slice::<StoredView>(v.value())).transpose()?,
            Err(redb::TableError::TableDoesNotExist(_)) => None,
            Err(e) => return Err(self.error(e)),
        };
        out.extend(view.map(CatalogWrite::View));
        for job in self.jobs_in(txn)? {
            let StoredJob { spec, info, first_event, events } = job;
            out.push(CatalogWrite::Job { spec, info, first: first_event, events });
        }
        Ok(out)
    }

    /// Replaces the replicated part of the catalog by `contents` (see [`Self::contents_in`]) in `txn`;
    /// the incarnation counter, local to this node, stays.
    pub(crate) fn replace_in(txn: &redb::WriteTransaction, contents: &[CatalogWrite]) -> anyhow::Result<()> {
        txn.open_table(META)?.remove("view")?;
        txn.open_table(JOBS)?.retain(|_, _| false)?;
        txn.open_table(EVENTS)?.retain(|_, _| false)?;
        contents.iter().try_for_each(|write| write.apply_in(txn))
    }

    /// Every job recorded, lowest id first, with its kept events.
    pub fn jobs(&self) -> anyhow::Result<Vec<StoredJob>> {
        let txn = self.db.begin_read().map_err(|e| self.error(e))?;
        self.jobs_in(&txn)
    }

    fn jobs_in(&self, txn: &redb::ReadTransaction) -> anyhow::Result<Vec<StoredJob>> {
        let jobs = match txn.open_table(JOBS) {
            Ok(t) => t,
            Err(redb::TableError::TableDoesNotExist(_)) => return Ok(Vec::new()),
            Err(e) => return Err(self.error(e)),
        };
        let events = match txn.open_table(EVENTS) {
            Ok(t) => Some(t),
            Err(redb::TableError::TableDoesNotExist(_)) => None,
            Err(e) => return Err(self.error(e)),
        };
        let mut out = Vec::new();
        for entry in jobs.iter().map_err(|e| self.error(e))? {
            let (id, value) = entry.map_err(|e| self.error(e))?;
            let mut job: StoredJob =
                serde_json::from_slice(value.value()).map_err(|e| self.error(format!("job {}: {e}", id.value())))?;
            if let Some(table) = &events {
                let range = table.range((id.value(), 0)..=(id.value(), u64::MAX)).map_err(|e| self.error(e))?;
                for (i, entry) in range.enumerate() {
                    let (key, value) = entry.map_err(|e| self.error(e))?;
                    if i == 0 {
                        job.first_event = key.value().1;
                    }
                    let event = serde_json::from_slice(value.value())
                        .map_err(|e| self.error(format!("job {} event {}: {e}", id.value(), key.value().1)))?;
                    job.events.push(event);
                }
            }
            out.push(job);
        }
        Ok(out)
    }
}

/// One write the controller makes to its catalog, exactly what [`Catalog::save_view`] and
/// [`Catalog::save_job`] write: the unit the replicated controller commits through Raft
/// (`runtime::raft`) before applying it to every controller's catalog.
// One per write, moved into Raft's log at once: its size does not matter.
#[allow(clippy::large_enum_variant)]
#[derive(Clone, Debug, PartialEq, Serialize, Deserialize)]
pub enum CatalogWrite {
    View(StoredView),
    /// A job's spec and state, and its `events` numbered from `first`.
    Job {
        spec: JobSpec,
        info: JobInfo,
        first: u64,
        events: Vec<JobEvent>,
    },
}

impl CatalogWrite {
    /// Performs this write inside `txn` (committed by the caller, with whatever else belongs with it).
    pub(crate) fn apply_in(&self, txn: &redb::WriteTransaction) -> anyhow::Result<()> {
        match self {
            CatalogWrite::View(view) => {
                let bytes = serde_json::to_vec(view).expect("a view serialises");
                txn.open_table(META)?.insert("view", bytes.as_slice())?;
                Ok(())
            }
            CatalogWrite::Job { spec, info, first, events } => put_job(txn, spec, info, *first, events),
        }
    }
}

fn put_job(
    txn: &redb::WriteTransaction,
    spec: &JobSpec,
    info: &JobInfo,
    first: u64,
    events: &[JobEvent],
) -> anyhow::Result<()> {
    #[derive(Serialize)]
    struct Record<'a> {
        spec: &'a JobSpec,
        info: &'a JobInfo,
    }
    let record = serde_json::to_vec(&Record { spec, info }).expect("a job serialises");
    txn.open_table(JOBS)?.insert(info.id, record.as_slice())?;
    let mut table = txn.open_table(EVENTS)?;
    for (i, event) in events.iter().enumerate() {
        let encoded = serde_json::to_vec(event).expect("an event serialises");
        table.insert((info.id, first + i as u64), encoded.as_slice())?;
    }
    let end = first + events.len() as u64;
    if !events.is_empty() && end > EVENTS_KEPT as u64 {
        let drop_below = end - EVENTS_KEPT as u64;
        table.retain_in((info.id, 0)..(info.id, drop_below), |_, _| false)?;
    }
    Ok(())
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::protocol::{JobId, JobState};
    use troupe_model::config::JobConfig;

    fn spec() -> JobSpec {
        JobSpec {
            config: JobConfig::small(3),
            name: "t".into(),
            save_final: None,
            data_plane: Default::default(),
            trace: false,
            trace_seed: 0,
        }
    }

    fn info(id: JobId, step: u64) -> JobInfo {
        JobInfo {
            id,
            name: "t".into(),
            state: JobState::Running,
            step,
            total_steps: 3,
            epoch: 4,
            world: 2,
            attempts: 2,
            last_loss: Some(1.5),
            reason: None,
            events: 0,
            ranks: vec![],
            data_plane: Default::default(),
            plane: Default::default(),
            plane_reason: String::new(),
        }
    }

    fn event(step: u64) -> JobEvent {
        JobEvent::Checkpoint { step, path: format!("step-{step}").into(), seconds: 0.0, bytes: 0 }
    }

    #[test]
    fn what_the_controller_records_is_there_after_a_reopen() {
        let dir = tempfile::tempdir().unwrap();
        {
            let c = Catalog::open(dir.path()).unwrap();
            assert_eq!(c.next_incarnation().unwrap(), 1);
            assert_eq!(c.view().unwrap(), None);
            assert!(c.jobs().unwrap().is_empty());
            c.save_view(&StoredView { epoch: 7, members: vec!["a".into(), "b".into()], ..Default::default() }).unwrap();
            c.save_job(&spec(), &info(1, 0), 0, &[event(0), event(1)]).unwrap();
            c.save_job(&spec(), &info(1, 2), 2, &[event(2)]).unwrap();
            c.save_job(&spec(), &info(2, 0), 0, &[]).unwrap();
            let err = Catalog::open(dir.path()).err().expect("one daemon per data dir");
            assert!(format!("{err:#}").contains("in use"), "{err:#}");
        }
        let c = Catalog::open(dir.path()).unwrap();
        assert_eq!(c.next_incarnation().unwrap(), 2);
        assert_eq!(
            c.view().unwrap(),
            Some(StoredView { epoch: 7, members: vec!["a".into(), "b".into()], ..Default::default() })
        );
        let jobs = c.jobs().unwrap();
        assert_eq!(jobs.len(), 2);
        assert_eq!((jobs[0].info.step, jobs[0].spec.name.as_str()), (2, "t"));
        assert_eq!(jobs[0].events, vec![event(0), event(1), event(2)]);
        assert_eq!(jobs[0].first_event, 0);
        assert!(jobs[1].events.is_empty());
    }

    #[test]
    fn its_contents_rebuild_another_catalog_and_keep_its_incarnation() {
        let (a, b) = (tempfile::tempdir().unwrap(), tempfile::tempdir().unwrap());
        let source = Catalog::open(a.path()).unwrap();
        source.save_view(&StoredView { epoch: 3, members: vec!["a".into()], ..Default::default() }).unwrap();
        let events: Vec<JobEvent> = (0..EVENTS_KEPT as u64 + 2).map(event).collect();
        source.save_job(&spec(), &info(1, 5), 0, &events).unwrap();
        let contents = source.contents_in(&source.db.begin_read().unwrap()).unwrap();

        let target = Catalog::open(b.path()).unwrap();
        assert_eq!(target.next_incarnation().unwrap(), 1);
        target.save_job(&spec(), &info(9, 1), 0, &[event(0)]).unwrap();
        let txn = target.db.begin_write().unwrap();
        Catalog::replace_in(&txn, &contents).unwrap();
        txn.commit().unwrap();
        assert_eq!(target.view().unwrap(), source.view().unwrap());
        assert_eq!(target.jobs().unwrap(), source.jobs().unwrap(), "job 9 is gone, job 1 is as in the source");
        assert_eq!(target.jobs().unwrap()[0].first_event, 2);
        assert_eq!(target.next_incarnation().unwrap(), 2, "the incarnation is the node's own");
    }

    #[test]
    fn keeps_the_newest_events_of_each_job() {
        let dir = tempfile::tempdir().unwrap();
        let c = Catalog::open(dir.path()).unwrap();
        let events: Vec<JobEvent> = (0..EVENTS_KEPT as u64 + 5).map(event).collect();
        c.save_job(&spec(), &info(1, 0), 0, &events).unwrap();
        c.save_job(&spec(), &info(2, 0), 0, &events[..3]).unwrap();
        let jobs = c.jobs().unwrap();
        assert_eq!((jobs[0].first_event, jobs[0].events.len()), (5, EVENTS_KEPT));
        assert_eq!(jobs[0].events[0], event(5));
        assert_eq!(jobs[1].events.len(), 3, "another job's events are its own");
    }
}
