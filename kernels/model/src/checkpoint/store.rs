//! A checkpoint root: where checkpoints of one job are saved, kept (`keep_last`), indexed in a catalog
//! and found again.
//!
//! What is authoritative: **the directories**. A checkpoint exists iff `ROOT/step-N` exists and verifies
//! (manifest, every file's length and checksum). The catalog is an index kept consistent in one
//! direction: an entry is recorded only after its directory is renamed into place and the root fsynced,
//! and removed before its directory is, so the catalog never lists a checkpoint that was not committed.
//! It can lack one — a crash between the rename and the record — and opening a store reconciles it:
//! committed directories missing from the catalog are verified and recorded, entries whose directory is
//! gone are dropped. Loading scans the directories, newest first, skipping (and logging) any that does
//! not verify; a catalog that cannot be opened or written never stops a save or a load.

use std::path::{Path, PathBuf};
use std::sync::Arc;
use std::time::Instant;

use super::catalog::{Catalog, CatalogEntry, RedbCatalog};
use super::manifest::Layout;
use super::state::TrainingState;
use super::write::{private_name, write_checkpoint};
use super::{io, read, step_dir_name, step_dirs, CheckpointError};

/// One durable save.
#[derive(Clone, Debug)]
pub struct Saved {
    pub path: PathBuf,
    pub step: u64,
    /// Bytes of the shard files.
    pub bytes: u64,
    /// Write and commit, from the first byte to the catalog commit.
    pub seconds: f64,
    /// Of which recording it in the catalog.
    pub catalog_seconds: f64,
    /// The step's directory already existed and verified, and was kept.
    pub kept_existing: bool,
}

pub struct CheckpointStore {
    root: PathBuf,
    keep_last: usize,
    catalog: Arc<dyn Catalog>,
}

impl std::fmt::Debug for CheckpointStore {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("CheckpointStore").field("root", &self.root).field("keep_last", &self.keep_last).finish()
    }
}

impl CheckpointStore {
    /// The root `root` with its redb catalog (`ROOT/catalog.redb`), keeping the newest `keep_last`
    /// checkpoints (0 keeps all).
    pub fn open(root: &Path, keep_last: usize) -> Result<Self, CheckpointError> {
        Self::with_catalog(root, keep_last, Arc::new(RedbCatalog::at_root(root)))
    }

    /// The root with any catalog; creates it, removes what crashed writers left, reconciles the catalog.
    pub fn with_catalog(root: &Path, keep_last: usize, catalog: Arc<dyn Catalog>) -> Result<Self, CheckpointError> {
        std::fs::create_dir_all(root).map_err(io(root, "create directory"))?;
        let store = Self { root: root.to_owned(), keep_last, catalog };
        store.remove_leftovers();
        if let Err(e) = store.reconcile() {
            tracing::warn!(root = %root.display(), "the checkpoint catalog is not reconciled: {e}");
        }
        Ok(store)
    }

    pub fn root(&self) -> &Path {
        &self.root
    }

    pub fn catalog(&self) -> &dyn Catalog {
        &*self.catalog
    }

    /// Writes `state` in `layout`, commits it, records it in the catalog and applies retention.
    /// An error means this checkpoint did not commit; the previous ones are untouched.
    pub fn save(&self, state: &TrainingState, layout: &Layout) -> Result<Saved, CheckpointError> {
        let t0 = Instant::now();
        let committed = write_checkpoint(state, &self.root, layout)?;
        let entry = CatalogEntry {
            step: state.step,
            dir: step_dir_name(state.step),
            bytes: committed.bytes,
            files: committed.manifest.files.len(),
        };
        let catalog_t0 = Instant::now();
        if let Err(e) = self.catalog.record(&entry) {
            // Committed all the same (the directory is authoritative); the next store reconciles it.
            tracing::warn!(checkpoint = %committed.path.display(), "checkpoint committed but not recorded in the catalog: {e}");
        }
        let (seconds, catalog_seconds) = (t0.elapsed().as_secs_f64(), catalog_t0.elapsed().as_secs_f64());
        if let Err(e) = self.retain() {
            tracing::warn!(root = %self.root.display(), "removing old checkpoints failed: {e}");
        }
        Ok(Saved {
            path: committed.path,
            step: state.step,
            bytes: committed.bytes,
            seconds,
            catalog_seconds,
            kept_existing: committed.kept_existing,
        })
    }

    /// Removes all but the newest `keep_last` checkpoints: each leaves the catalog first, then its
    /// directory is renamed out of the `step-*` namespace and deleted.
    pub fn retain(&self) -> Result<(), CheckpointError> {
        let dirs = step_dirs(&self.root);
        if self.keep_last == 0 || dirs.len() <= self.keep_last {
            return Ok(());
        }
        for (step, dir) in &dirs[..dirs.len() - self.keep_last] {
            self.catalog.remove(*step)?;
            let old = self.root.join(private_name("old", *step));
            match std::fs::rename(dir, &old) {
                Ok(()) => {}
                Err(e) if e.kind() == std::io::ErrorKind::NotFound => continue, // another writer removed it
                Err(e) => return Err(io(dir, "move an old checkpoint out")(e)),
            }
            std::fs::remove_dir_all(&old).map_err(io(&old, "remove an old checkpoint"))?;
        }
        Ok(())
    }

    /// Makes the catalog agree with the directories (which are authoritative).
    pub fn reconcile(&self) -> Result<(), CheckpointError> {
        let dirs = step_dirs(&self.root);
        let entries = self.catalog.entries()?;
        for entry in &entries {
            if !dirs.iter().any(|(step, _)| *step == entry.step) {
                tracing::warn!(root = %self.root.display(), step = entry.step, "the catalog lists a checkpoint whose directory is gone; dropping the entry");
                self.catalog.remove(entry.step)?;
            }
        }
        for (step, dir) in &dirs {
            if entries.iter().any(|e| e.step == *step) {
                continue;
            }
            match read::verify(dir) {
                Ok(manifest) => {
                    let bytes = manifest.files.iter().map(|f| f.bytes).sum();
                    let entry =
                        CatalogEntry { step: *step, dir: step_dir_name(*step), bytes, files: manifest.files.len() };
                    self.catalog.record(&entry)?;
                }
                Err(why) => {
                    tracing::warn!(checkpoint = %dir.display(), "not recording a checkpoint that does not verify: {why}")
                }
            }
        }
        Ok(())
    }

    /// Removes the temporary, torn and half-removed directories of writer processes that are gone.
    fn remove_leftovers(&self) {
        let Ok(entries) = std::fs::read_dir(&self.root) else { return };
        for entry in entries.filter_map(Result::ok) {
            let name = entry.file_name();
            let Some(pid) = name.to_str().and_then(leftover_pid) else { continue };
            if !Path::new(&format!("/proc/{pid}")).exists() {
                let _ = std::fs::remove_dir_all(entry.path());
            }
        }
    }

    /// The newest checkpoint that verifies, and those skipped on the way.
    pub fn latest_valid(&self) -> (Option<PathBuf>, Vec<(PathBuf, CheckpointError)>) {
        latest_valid(&self.root)
    }
}

/// The writer's process id in a leftover's name `.{tmp|torn|old}-step-N-PID-K`.
fn leftover_pid(name: &str) -> Option<u32> {
    let rest = [".tmp-step-", ".torn-step-", ".old-step-"].iter().find_map(|p| name.strip_prefix(p))?;
    let mut parts = rest.split('-');
    let (_step, pid, _k) = (parts.next()?, parts.next()?, parts.next()?);
    pid.parse().ok()
}

/// The newest checkpoint under `root` that verifies; the ones skipped on the way, with why (each also
/// logged).
pub fn latest_valid(root: &Path) -> (Option<PathBuf>, Vec<(PathBuf, CheckpointError)>) {
    let mut skipped = Vec::new();
    for (_, dir) in step_dirs(root).into_iter().rev() {
        match read::verify(&dir) {
            Ok(_) => return (Some(dir), skipped),
            Err(why) => {
                tracing::warn!(checkpoint = %dir.display(), "skipping a checkpoint that does not verify, trying the previous one: {why}");
                skipped.push((dir, why));
            }
        }
    }
    (None, skipped)
}

#[cfg(test)]
mod tests {
    use super::leftover_pid;

    #[test]
    fn leftovers_name_their_writer() {
        assert_eq!(leftover_pid(".tmp-step-00000012-4242-7"), Some(4242));
        assert_eq!(leftover_pid(".old-step-00000012-17-0"), Some(17));
        assert_eq!(leftover_pid("step-00000012"), None);
        assert_eq!(leftover_pid("catalog.redb"), None);
    }
}
