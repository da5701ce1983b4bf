//! The checkpoint catalog: an index of the committed checkpoints of a root, behind a small trait so the
//! store can be replaced (sled today, DESIGN.md §2; redb is the alternative the crash test would call
//! for). It is written after a checkpoint's directory is renamed into place and cleared before a
//! directory is removed, so it never lists a checkpoint that was not committed; the directories stay
//! authoritative (see `super` and `store`).

use std::collections::BTreeMap;
use std::path::{Path, PathBuf};
use std::sync::Mutex;
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

/// The sled catalog at `ROOT/catalog.sled`: keys are big-endian steps (so iteration is step order),
/// values the JSON of a [`CatalogEntry`]. Every change is flushed before it returns.
///
/// The database is opened for each operation and closed after it: several writers of one root (rank 0
/// moving between daemons of one process) and readers then never hold sled's exclusive file lock for
/// longer than an operation; a contended open is retried for up to [`LOCK_WAIT`].
#[derive(Debug)]
pub struct SledCatalog {
    path: PathBuf,
}

/// Longest wait for another process's or writer's operation on the same catalog.
pub const LOCK_WAIT: Duration = Duration::from_secs(10);

/// The catalog's directory name under a checkpoint root.
pub const SLED_CATALOG_DIR: &str = "catalog.sled";

impl SledCatalog {
    pub fn at_root(root: &Path) -> Self {
        Self { path: root.join(SLED_CATALOG_DIR) }
    }

    pub fn path(&self) -> &Path {
        &self.path
    }

    fn error(&self, message: String) -> CheckpointError {
        CheckpointError::Catalog { path: self.path.clone(), message }
    }

    fn with_db<T>(&self, op: impl FnOnce(&sled::Db) -> sled::Result<T>) -> Result<T, CheckpointError> {
        let t0 = Instant::now();
        let db = loop {
            match sled::Config::new().path(&self.path).flush_every_ms(None).open() {
                Ok(db) => break db,
                Err(e) if e.to_string().contains("could not acquire lock") && t0.elapsed() < LOCK_WAIT => {
                    std::thread::sleep(Duration::from_millis(5));
                }
                Err(e) => return Err(self.error(format!("cannot open it: {e}"))),
            }
        };
        let result = op(&db).and_then(|v| db.flush().map(|_| v));
        result.map_err(|e| self.error(e.to_string()))
    }
}

impl Catalog for SledCatalog {
    fn record(&self, entry: &CatalogEntry) -> Result<(), CheckpointError> {
        let value = serde_json::to_vec(entry).expect("an entry serialises");
        self.with_db(|db| db.insert(entry.step.to_be_bytes(), value).map(|_| ()))
    }

    fn remove(&self, step: u64) -> Result<(), CheckpointError> {
        self.with_db(|db| db.remove(step.to_be_bytes()).map(|_| ()))
    }

    fn entries(&self) -> Result<Vec<CatalogEntry>, CheckpointError> {
        let raw = self.with_db(|db| db.iter().values().collect::<sled::Result<Vec<_>>>())?;
        raw.iter()
            .map(|v| serde_json::from_slice(v).map_err(|e| self.error(format!("an entry does not parse: {e}"))))
            .collect()
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
    fn memory_and_sled_catalogs_keep_entries_in_step_order() {
        check(&MemoryCatalog::default());
        let dir = tempfile::tempdir().unwrap();
        let sled = SledCatalog::at_root(dir.path());
        check(&sled);
        // A second handle (another writer) sees the same, durable entries.
        assert_eq!(SledCatalog::at_root(dir.path()).entries().unwrap(), vec![entry(3), entry(12)]);
    }
}
