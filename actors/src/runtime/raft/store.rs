//! The Raft log and vote in the daemon's redb catalog (`daemon.redb`), in tables of their own. Every
//! call is one redb write transaction, committed with redb's default durability (fsynced) before it
//! returns, so an append reported flushed survives a SIGKILL (actors/tests/raft_log_crash.rs). Writes
//! are serialised by openraft (one log-store task) and by redb (one write transaction at a time).

// The error type is openraft's `StorageError`, which its storage traits require.
#![allow(clippy::result_large_err)]

use std::fmt::Debug;
use std::ops::{Bound, RangeBounds};
use std::sync::Arc;

use openraft::storage::{LogFlushed, RaftLogStorage};
use openraft::{LogState, RaftLogId, RaftLogReader, StorageIOError};
use redb::{ReadableTable, TableDefinition};
use serde::de::DeserializeOwned;
use serde::Serialize;

use super::{io_error, Entry, LogId, StorageError, TypeConfig, Vote};
use crate::catalog::Catalog;

/// Log index → the entry's JSON.
pub(crate) const RAFT_LOG: TableDefinition<u64, &[u8]> = TableDefinition::new("raft_log");
/// `vote`, `purged` (the last purged log id), `committed`; the state machine's `applied`, `membership`
/// and `snapshot` ([`super::machine`]).
pub(crate) const RAFT_META: TableDefinition<&str, &[u8]> = TableDefinition::new("raft_meta");

/// Reads one JSON value of [`RAFT_META`] in `txn` (absent table or key: `None`).
pub(crate) fn read_meta<T: DeserializeOwned>(txn: &redb::ReadTransaction, key: &str) -> anyhow::Result<Option<T>> {
    let table = match txn.open_table(RAFT_META) {
        Ok(t) => t,
        Err(redb::TableError::TableDoesNotExist(_)) => return Ok(None),
        Err(e) => return Err(e.into()),
    };
    let Some(value) = table.get(key)? else { return Ok(None) };
    Ok(Some(serde_json::from_slice(value.value())?))
}

pub(crate) fn write_meta(txn: &redb::WriteTransaction, key: &str, value: &impl Serialize) -> anyhow::Result<()> {
    let bytes = serde_json::to_vec(value)?;
    txn.open_table(RAFT_META)?.insert(key, bytes.as_slice())?;
    Ok(())
}

/// The Raft log store of one daemon. Cheap to clone (clones share the database): the clone handed out
/// as the log reader reads what was appended.
#[derive(Clone)]
pub struct LogStore {
    db: Arc<redb::Database>,
}

impl LogStore {
    pub fn new(catalog: &Catalog) -> Self {
        LogStore { db: catalog.database().clone() }
    }

    fn read<T>(
        &self,
        op: impl FnOnce(&redb::ReadTransaction) -> anyhow::Result<T>,
        make: fn(openraft::AnyError) -> StorageIOError<u64>,
    ) -> Result<T, StorageError> {
        let txn = self.db.begin_read().map_err(|e| io_error(make, e))?;
        op(&txn).map_err(|e| io_error(make, format!("{e:#}")))
    }

    /// One durable write transaction.
    fn write(
        &self,
        op: impl FnOnce(&redb::WriteTransaction) -> anyhow::Result<()>,
        make: fn(openraft::AnyError) -> StorageIOError<u64>,
    ) -> Result<(), StorageError> {
        let txn = self.db.begin_write().map_err(|e| io_error(make, e))?;
        op(&txn).map_err(|e| io_error(make, format!("{e:#}")))?;
        txn.commit().map_err(|e| io_error(make, e))
    }

    /// The entries of `range` that are present, in order.
    pub fn entries(&self, range: impl RangeBounds<u64>) -> Result<Vec<Entry>, StorageError> {
        let start = match range.start_bound() {
            Bound::Included(&i) => i,
            Bound::Excluded(&i) => i + 1,
            Bound::Unbounded => 0,
        };
        let end = match range.end_bound() {
            Bound::Included(&i) => Some(i),
            Bound::Excluded(&0) => return Ok(Vec::new()),
            Bound::Excluded(&i) => Some(i - 1),
            Bound::Unbounded => None,
        };
        self.read(
            |txn| {
                let table = match txn.open_table(RAFT_LOG) {
                    Ok(t) => t,
                    Err(redb::TableError::TableDoesNotExist(_)) => return Ok(Vec::new()),
                    Err(e) => return Err(e.into()),
                };
                let mut out = Vec::new();
                for item in table.range(start..=end.unwrap_or(u64::MAX))? {
                    let (_, value) = item?;
                    out.push(serde_json::from_slice(value.value())?);
                }
                Ok(out)
            },
            StorageIOError::read_logs,
        )
    }

    /// The last purged log id and the last log id (the purged one when the log is empty).
    pub fn log_state(&self) -> Result<LogState<TypeConfig>, StorageError> {
        self.read(
            |txn| {
                let purged: Option<LogId> = read_meta(txn, "purged")?;
                let last = match txn.open_table(RAFT_LOG) {
                    Ok(t) => match t.last()? {
                        Some((_, v)) => Some(*serde_json::from_slice::<Entry>(v.value())?.get_log_id()),
                        None => None,
                    },
                    Err(redb::TableError::TableDoesNotExist(_)) => None,
                    Err(e) => return Err(e.into()),
                };
                Ok(LogState { last_purged_log_id: purged, last_log_id: last.or(purged) })
            },
            StorageIOError::read_logs,
        )
    }

    /// Appends `entries` and returns once they are durable.
    pub fn append_durable(&self, entries: impl IntoIterator<Item = Entry>) -> Result<(), StorageError> {
        let encoded: Vec<(u64, Vec<u8>)> = entries
            .into_iter()
            .map(|e| (e.get_log_id().index, serde_json::to_vec(&e).expect("an entry serialises")))
            .collect();
        self.write(
            |txn| {
                let mut table = txn.open_table(RAFT_LOG)?;
                for (index, bytes) in &encoded {
                    table.insert(*index, bytes.as_slice())?;
                }
                Ok(())
            },
            StorageIOError::write_logs,
        )
    }

    /// Removes the entries from `index` on.
    pub fn truncate_from(&self, index: u64) -> Result<(), StorageError> {
        self.write(
            |txn| {
                txn.open_table(RAFT_LOG)?.retain_in(index.., |_, _| false)?;
                Ok(())
            },
            StorageIOError::write_logs,
        )
    }

    /// Removes the entries up to `log_id` inclusive and records it as the last purged.
    pub fn purge_to(&self, log_id: LogId) -> Result<(), StorageError> {
        self.write(
            |txn| {
                write_meta(txn, "purged", &log_id)?;
                txn.open_table(RAFT_LOG)?.retain_in(..=log_id.index, |_, _| false)?;
                Ok(())
            },
            StorageIOError::write_logs,
        )
    }

    pub fn save_vote_durable(&self, vote: &Vote) -> Result<(), StorageError> {
        self.write(|txn| write_meta(txn, "vote", vote), StorageIOError::write_vote)
    }

    pub fn vote(&self) -> Result<Option<Vote>, StorageError> {
        self.read(|txn| read_meta(txn, "vote"), StorageIOError::read_vote)
    }

    pub fn save_committed_durable(&self, committed: Option<LogId>) -> Result<(), StorageError> {
        self.write(|txn| write_meta(txn, "committed", &committed), StorageIOError::write_logs)
    }

    pub fn committed(&self) -> Result<Option<LogId>, StorageError> {
        self.read(|txn| Ok(read_meta::<Option<LogId>>(txn, "committed")?.flatten()), StorageIOError::read_logs)
    }
}

impl RaftLogReader<TypeConfig> for LogStore {
    async fn try_get_log_entries<RB: RangeBounds<u64> + Clone + Debug + Send>(
        &mut self,
        range: RB,
    ) -> Result<Vec<Entry>, StorageError> {
        self.entries(range)
    }
}

impl RaftLogStorage<TypeConfig> for LogStore {
    type LogReader = LogStore;

    async fn get_log_state(&mut self) -> Result<LogState<TypeConfig>, StorageError> {
        self.log_state()
    }

    async fn get_log_reader(&mut self) -> Self::LogReader {
        self.clone()
    }

    async fn save_vote(&mut self, vote: &Vote) -> Result<(), StorageError> {
        self.save_vote_durable(vote)
    }

    async fn read_vote(&mut self) -> Result<Option<Vote>, StorageError> {
        self.vote()
    }

    async fn save_committed(&mut self, committed: Option<LogId>) -> Result<(), StorageError> {
        self.save_committed_durable(committed)
    }

    async fn read_committed(&mut self) -> Result<Option<LogId>, StorageError> {
        self.committed()
    }

    async fn append<I>(&mut self, entries: I, callback: LogFlushed<TypeConfig>) -> Result<(), StorageError>
    where
        I: IntoIterator<Item = Entry> + Send,
        I::IntoIter: Send,
    {
        // Durable on return: the callback can be called at once.
        let result = self.append_durable(entries);
        callback.log_io_completed(result.as_ref().map(|_| ()).map_err(|e| std::io::Error::other(e.to_string())));
        result
    }

    async fn truncate(&mut self, log_id: LogId) -> Result<(), StorageError> {
        self.truncate_from(log_id.index)
    }

    async fn purge(&mut self, log_id: LogId) -> Result<(), StorageError> {
        self.purge_to(log_id)
    }
}
