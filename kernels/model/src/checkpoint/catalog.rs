//! The checkpoint catalog: an index of the committed checkpoints of a root, behind a small trait so the
//! store can be replaced (redb; DESIGN.md §2 named sled, which the crash test ruled out — see
//! [`RedbCatalog`]). It is written after a checkpoint's directory is renamed into place and cleared before a
//! directory is removed, so it never lists a checkpoint that was not committed; the directories stay
//! authoritative (see `super` and `store`).

use std::collections::BTreeMap;
use std::path::{Path, PathBuf};
use std::sync::{Mutex, MutexGuard};
use std::time::{Duration, Instant};

use serde::{Deserialize, Serialize};

use super::CheckpointError;

/// One committed checkpoint.
#[derive(Clone, Debug, PartialEq, Eq, Serialize, Deserialize)]
pub struct CatalogEntry {
    pub step: u64,
    /// The directory's name under the root (`step-NNNNNNNN`).
    pub dir: String,
    /// Bytes of its shard files.
    pub bytes: u64,
    /// Shard files.
    pub files: usize,
}

pub trait Catalog: Send + Sync {
    /// Records a committed checkpoint (replacing an entry of the same step); durable when it returns.
    fn record(&self, entry: &CatalogEntry) -> Result<(), CheckpointError>;
    /// Forgets the checkpoint of `step`; durable when it returns.
    fn remove(&self, step: u64) -> Result<(), CheckpointError>;
    /// Every entry, lowest step first.
    fn entries(&self) -> Result<Vec<CatalogEntry>, CheckpointError>;
}

/// A catalog in memory (tests; a root whose catalog is not wanted).
#[derive(Debug, Default)]
pub struct MemoryCatalog {
    entries: Mutex<BTreeMap<u64, CatalogEntry>>,
}

impl Catalog for MemoryCatalog {
    fn record(&self, entry: &CatalogEntry) -> Result<(), CheckpointError> {
        self.entries.lock().expect("not poisoned").insert(entry.step, entry.clone());
        Ok(())
    }

    fn remove(&self, step: u64) -> Result<(), CheckpointError> {
        self.entries.lock().expect("not poisoned").remove(&step);
        Ok(())
    }

    fn entries(&self) -> Result<Vec<CatalogEntry>, CheckpointError> {
        Ok(self.entries.lock().expect("not poisoned").values().cloned().collect())
    }
}

/// The catalog at `ROOT/catalog.redb` (redb: copy-on-write B-trees, checksummed, two commit slots, an
/// fsync per commit): one table from step to the JSON of a [`CatalogEntry`]. Every change is one durable
/// transaction before it returns.
///
/// Why redb and not sled: sled 0.34.7 (the version DESIGN.md pinned) did not survive the crash test
/// (kernels/model/tests/checkpoint_crash.rs): after a SIGKILL during its snapshot write it refused to open
/// (`Read corrupted data at file offset None`, sled issues #1527 and #1533), losing every commit it held.
///
/// The database is opened at the first operation and held until the catalog is dropped (a store, and so
/// a job's writer thread, owns one): opening and closing a redb file costs several fsyncs, as much as the
/// commit itself. redb allows one open handle per file; a second writer of the same root (rank 0 moved to
/// another daemon while the old one still runs) retries its open for up to [`LOCK_WAIT`], then gives up
/// for that operation — the checkpoint is committed all the same (the directories are authoritative) and
/// the next store on the root records it.
pub struct RedbCatalog {
    path: PathBuf,
    db: Mutex<Option<redb::Database>>,
}

impl std::fmt::Debug for RedbCatalog {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("RedbCatalog").field("path", &self.path).finish_non_exhaustive()
    }
}

/// Longest wait for another handle on the same catalog to close.
pub const LOCK_WAIT: Duration = Duration::from_secs(2);

/// The catalog's file name under a checkpoint root.
pub const CATALOG_FILE: &str = "catalog.redb";

const TABLE: redb::TableDefinition<u64, &[u8]> = redb::TableDefinition::new("checkpoints");

impl RedbCatalog {
    pub fn at_root(root: &Path) -> Self {
        Self { path: root.join(CATALOG_FILE), db: Mutex::new(None) }
    }

    pub fn path(&self) -> &Path {
        &self.path
    }

    fn error(&self, message: impl std::fmt::Display) -> CheckpointError {
        CheckpointError::Catalog { path: self.path.clone(), message: message.to_string() }
    }

    /// The held database, opened first if this handle has not yet.
    fn open(&self) -> Result<MutexGuard<'_, Option<redb::Database>>, CheckpointError> {
        let mut held = self.db.lock().expect("not poisoned");
        let t0 = Instant::now();
        while held.is_none() {
            match redb::Database::create(&self.path) {
                Ok(db) => *held = Some(db),
                Err(redb::DatabaseError::DatabaseAlreadyOpen) if t0.elapsed() < LOCK_WAIT => {
                    std::thread::sleep(Duration::from_millis(5));
                }
                Err(e) => return Err(self.error(format!("cannot open it: {e}"))),
            }
        }
        Ok(held)
    }

    /// One write transaction, committed durably.
    fn write(
        &self,
        op: impl FnOnce(&mut redb::Table<'_, u64, &[u8]>) -> Result<(), redb::StorageError>,
    ) -> Result<(), CheckpointError> {
        let held = self.open()?;
        let db = held.as_ref().expect("open() holds a database");
        let txn = db.begin_write().map_err(|e| self.error(e))?;
        {
            let mut table = txn.open_table(TABLE).map_err(|e| self.error(e))?;
            op(&mut table).map_err(|e| self.error(e))?;
        }
        txn.commit().map_err(|e| self.error(e))
    }
}

impl Catalog for RedbCatalog {
    fn record(&self, entry: &CatalogEntry) -> Result<(), CheckpointError> {
        let value = serde_json::to_vec(entry).expect("an entry serialises");
        self.write(|t| t.insert(entry.step, value.as_slice()).map(|_| ()))
    }

    fn remove(&self, step: u64) -> Result<(), CheckpointError> {
        self.write(|t| t.remove(step).map(|_| ()))
    }

    fn entries(&self) -> Result<Vec<CatalogEntry>, CheckpointError> {
        use redb::ReadableTable;
        let held = self.open()?;
        let db = held.as_ref().expect("open() holds a database");
        let txn = db.begin_read().map_err(|e| self.error(e))?;
        let table = match txn.open_table(TABLE) {
            Ok(t) => t,
            Err(redb::TableError::TableDoesNotExist(_)) => return Ok(Vec::new()),
            Err(e) => return Err(self.error(e)),
        };
        let mut entries = Vec::new();
        for row in table.iter().map_err(|e| self.error(e))? {
            let (_, value) = row.map_err(|e| self.error(e))?;
            entries.push(
                serde_json::from_slice(value.value())
                    .map_err(|e| self.error(format!("an entry does not parse: {e}")))?,
            );
        }
        Ok(entries)
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn entry(step: u64) -> CatalogEntry {
        CatalogEntry { step, dir: super::super::step_dir_name(step), bytes: step * 10, files: 2 }
    }

    fn check(catalog: &dyn Catalog) {
        for step in [3, 12, 6] {
            catalog.record(&entry(step)).unwrap();
        }
        catalog.remove(6).unwrap();
        catalog.record(&entry(12)).unwrap();
        assert_eq!(catalog.entries().unwrap(), vec![entry(3), entry(12)]);
    }

    #[test]
    fn memory_and_redb_catalogs_keep_entries_in_step_order() {
        check(&MemoryCatalog::default());
        let dir = tempfile::tempdir().unwrap();
        assert_eq!(RedbCatalog::at_root(dir.path()).entries().unwrap(), vec![], "a new catalog is empty");
        check(&RedbCatalog::at_root(dir.path()));
        // A second handle (another writer) sees the same, durable entries.
        assert_eq!(RedbCatalog::at_root(dir.path()).entries().unwrap(), vec![entry(3), entry(12)]);
    }
}
