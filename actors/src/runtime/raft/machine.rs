//! The state machine is the catalog: applying a committed entry performs the write the single
//! controller performs ([`CatalogWrite::apply_in`]), with `applied` (the last applied log id) and, for a
//! membership entry, the membership written in the same redb transaction, so that a crash never
//! applies an entry twice nor loses one. A snapshot is the catalog's replicated contents as the list of
//! writes that rebuild them, with the applied log id and membership; the last one built or installed is
//! kept in the catalog too.

// The error type is openraft's `StorageError`, which its storage traits require.
#![allow(clippy::result_large_err)]

use std::io::Cursor;

use openraft::storage::RaftStateMachine;
use openraft::{EntryPayload, RaftSnapshotBuilder, SnapshotMeta, StorageIOError};
use serde::{Deserialize, Serialize};

use super::store::{read_meta, write_meta};
use super::{io_error, Controller, Entry, LogId, NodeId, StorageError, StoredMembership, TypeConfig};
use crate::catalog::{Catalog, CatalogWrite};

pub type Snapshot = openraft::Snapshot<TypeConfig>;

/// A snapshot as kept in the catalog.
#[derive(Serialize, Deserialize)]
struct KeptSnapshot {
    meta: SnapshotMeta<NodeId, Controller>,
    data: Vec<u8>,
}

/// A snapshot's data.
#[derive(Serialize, Deserialize)]
struct Contents {
    writes: Vec<CatalogWrite>,
}

/// The catalog as Raft's state machine. Cheap to clone (the snapshot builder is a clone).
#[derive(Clone)]
pub struct StateMachine {
    catalog: Catalog,
}

impl StateMachine {
    pub fn new(catalog: Catalog) -> Self {
        StateMachine { catalog }
    }

    fn read<T>(&self, op: impl FnOnce(&redb::ReadTransaction) -> anyhow::Result<T>) -> Result<T, StorageError> {
        let make = StorageIOError::read_state_machine;
        let txn = self.catalog.database().begin_read().map_err(|e| io_error(make, e))?;
        op(&txn).map_err(|e| io_error(make, format!("{e:#}")))
    }

    fn write(&self, op: impl FnOnce(&redb::WriteTransaction) -> anyhow::Result<()>) -> Result<(), StorageError> {
        let make = StorageIOError::write_state_machine;
        let txn = self.catalog.database().begin_write().map_err(|e| io_error(make, e))?;
        op(&txn).map_err(|e| io_error(make, format!("{e:#}")))?;
        txn.commit().map_err(|e| io_error(make, e))
    }

    /// The last applied log id and the membership applied with it.
    pub fn applied(&self) -> Result<(Option<LogId>, StoredMembership), StorageError> {
        self.read(|txn| {
            let applied = read_meta::<Option<LogId>>(txn, "applied")?.flatten();
            Ok((applied, read_meta(txn, "membership")?.unwrap_or_default()))
        })
    }

    /// Applies one committed entry in one durable transaction.
    pub fn apply_entry(&self, entry: &Entry) -> Result<(), StorageError> {
        self.write(|txn| {
            match &entry.payload {
                EntryPayload::Blank => {}
                EntryPayload::Normal(write) => write.apply_in(txn)?,
                EntryPayload::Membership(m) => {
                    write_meta(txn, "membership", &StoredMembership::new(Some(entry.log_id), m.clone()))?
                }
            }
            write_meta(txn, "applied", &Some(entry.log_id))
        })
    }

    fn kept_snapshot(&self) -> Result<Option<Snapshot>, StorageError> {
        let kept: Option<KeptSnapshot> = self.read(|txn| read_meta(txn, "snapshot"))?;
        Ok(kept.map(|k| Snapshot { meta: k.meta, snapshot: Box::new(Cursor::new(k.data)) }))
    }
}

impl RaftSnapshotBuilder<TypeConfig> for StateMachine {
    async fn build_snapshot(&mut self) -> Result<Snapshot, StorageError> {
        let (applied, membership, writes) = self.read(|txn| {
            let applied = read_meta::<Option<LogId>>(txn, "applied")?.flatten();
            let membership: StoredMembership = read_meta(txn, "membership")?.unwrap_or_default();
            Ok((applied, membership, self.catalog.contents_in(txn)?))
        })?;
        let data = serde_json::to_vec(&Contents { writes }).expect("a snapshot serialises");
        let snapshot_id = match applied {
            Some(id) => format!("{}-{}", id.leader_id.term, id.index),
            None => "empty".into(),
        };
        let meta = SnapshotMeta { last_log_id: applied, last_membership: membership, snapshot_id };
        let kept = KeptSnapshot { meta: meta.clone(), data: data.clone() };
        self.write(|txn| write_meta(txn, "snapshot", &kept))?;
        Ok(Snapshot { meta, snapshot: Box::new(Cursor::new(data)) })
    }
}

impl RaftStateMachine<TypeConfig> for StateMachine {
    type SnapshotBuilder = StateMachine;

    async fn applied_state(&mut self) -> Result<(Option<LogId>, StoredMembership), StorageError> {
        self.applied()
    }

    async fn apply<I>(&mut self, entries: I) -> Result<Vec<()>, StorageError>
    where
        I: IntoIterator<Item = Entry> + Send,
        I::IntoIter: Send,
    {
        entries.into_iter().map(|entry| self.apply_entry(&entry)).collect()
    }

    async fn get_snapshot_builder(&mut self) -> Self::SnapshotBuilder {
        self.clone()
    }

    async fn begin_receiving_snapshot(&mut self) -> Result<Box<Cursor<Vec<u8>>>, StorageError> {
        Ok(Box::new(Cursor::new(Vec::new())))
    }

    async fn install_snapshot(
        &mut self,
        meta: &SnapshotMeta<NodeId, Controller>,
        snapshot: Box<Cursor<Vec<u8>>>,
    ) -> Result<(), StorageError> {
        let data = snapshot.into_inner();
        let contents: Contents = serde_json::from_slice(&data)
            .map_err(|e| io_error(StorageIOError::read_state_machine, format!("snapshot {}: {e}", meta.snapshot_id)))?;
        let kept = KeptSnapshot { meta: meta.clone(), data };
        self.write(|txn| {
            Catalog::replace_in(txn, &contents.writes)?;
            write_meta(txn, "applied", &meta.last_log_id)?;
            write_meta(txn, "membership", &meta.last_membership)?;
            write_meta(txn, "snapshot", &kept)
        })
    }

    async fn get_current_snapshot(&mut self) -> Result<Option<Snapshot>, StorageError> {
        self.kept_snapshot()
    }
}
