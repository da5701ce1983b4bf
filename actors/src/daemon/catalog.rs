//! The daemon's metadata catalog (sled, DESIGN.md §2), behind a small interface so the store can be
//! replaced. Flushed at every commit point.

use std::path::Path;

use anyhow::Context;

pub struct Catalog {
    db: sled::Db,
}

impl Catalog {
    pub fn open(data_dir: &Path) -> anyhow::Result<Self> {
        std::fs::create_dir_all(data_dir).with_context(|| {
            format!("data_dir = {}: cannot create it; pick a writable directory", data_dir.display())
        })?;
        let path = data_dir.join("catalog.sled");
        let db = sled::open(&path).with_context(|| {
            format!("opening the catalog {} (is another daemon using data_dir {}?)", path.display(), data_dir.display())
        })?;
        Ok(Catalog { db })
    }

    /// Counts daemon starts on this data dir: each start is a new incarnation of the node.
    pub fn next_incarnation(&self) -> anyhow::Result<u64> {
        let next = self
            .db
            .update_and_fetch("incarnation", |old| {
                let n = old.map_or(0, |b| u64::from_le_bytes(b.try_into().unwrap_or([0; 8])));
                Some((n + 1).to_le_bytes().to_vec())
            })
            .context("updating the catalog")?
            .map_or(1, |b| u64::from_le_bytes(b.as_ref().try_into().unwrap_or([0; 8])));
        self.db.flush().context("flushing the catalog")?;
        Ok(next)
    }
}
