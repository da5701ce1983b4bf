//! The shared-memory arena of the same-host transport: one segment per rank in `/dev/shm`, mapped by
//! every rank of the mesh, in which the collectives of [`crate::collective::shm`] exchange data without
//! sockets — a rank writes its contribution once and its peers reduce straight out of it.
//!
//! A segment is a 4 KiB header followed by two slots of `slot_bytes`:
//!
//! | offset | field | written by |
//! |---|---|---|
//! | 0 | `progress` (u32, wrapping): phases this rank has completed | the owner |
//! | 64 | `waiters` (u32): ranks sleeping on `progress` (a futex) | the sleepers |
//! | 128 | `broken` (u32): non-zero once the owner abandoned a call | the owner |
//! | 192 | call records (what each call is), [`CALL_RECORDS`] of them, round-robin | the owner |
//!
//! Each rank writes only its own segment (its header and slots; a sleeper also counts itself in the
//! `waiters` word of the rank it waits for) and reads its peers'. Who may touch
//! which slot when is decided by the phase protocol in [`crate::collective::shm`]; this module gives the
//! mappings, the counters and the waiting (spin, then sleep on a futex), and turns a lost peer, a peer
//! that gave up or a timeout into a typed error — a wait never outlasts `collective_timeout_ms`.
//!
//! Set-up (in [`SameHostTransport::connect`](super::same_host::SameHostTransport::connect)) runs over
//! the sockets: every rank creates its segment, sends its path to every peer, maps theirs, and says
//! whether it managed; only if every rank did is the arena used (by all, so the ranks agree), and each
//! segment is unlinked as soon as every peer has mapped it — a crash later leaves nothing in /dev/shm.

use std::fs::{File, OpenOptions};
use std::os::fd::AsRawFd;
use std::os::unix::fs::OpenOptionsExt;
use std::path::{Path, PathBuf};
use std::sync::atomic::{AtomicU32, AtomicU64, Ordering};
use std::sync::Arc;
use std::time::{Duration, Instant};

use super::Mailbox;
use crate::error::Rank;
use crate::wire::Tag;
use crate::ClusterError;

/// Bytes before the first slot.
pub const HEADER_BYTES: usize = 4096;
const PROGRESS_AT: usize = 0;
const WAITERS_AT: usize = 64;
const BROKEN_AT: usize = 128;
const CALLS_AT: usize = 192;
/// Call records kept per rank; a peer is never more than one call ahead, so 8 leaves room.
pub const CALL_RECORDS: usize = 8;
const CALL_RECORD_WORDS: usize = 4;
/// Where segments are created; the name says whose they are.
const SHM_DIR: &str = "/dev/shm";
const SEGMENT_PREFIX: &str = "troupe-arena-";
/// How long a waiter spins before it sleeps on the futex — when every rank can have a core; with more
/// ranks than cores the peer waited for is likely not running, and spinning would only delay it.
const SPIN: Duration = Duration::from_micros(200);
/// Longest single futex sleep: between sleeps the waiter checks for lost peers and the timeout, and
/// yields to the async runtime (where a dropped future ends the call).
const SLEEP: Duration = Duration::from_micros(500);

/// One rank's segment, mapped.
struct Mapping {
    ptr: *mut u8,
    len: usize,
}

// SAFETY: the mapping is plain shared memory; every access goes through atomics or through slices whose
// exclusivity the phase protocol guarantees.
unsafe impl Send for Mapping {}
unsafe impl Sync for Mapping {}

impl Mapping {
    fn of(file: &File, len: usize) -> std::io::Result<Mapping> {
        // SAFETY: a fresh shared mapping of `len` bytes of an open file; checked for failure.
        let ptr = unsafe {
            libc::mmap(
                std::ptr::null_mut(),
                len,
                libc::PROT_READ | libc::PROT_WRITE,
                libc::MAP_SHARED,
                file.as_raw_fd(),
                0,
            )
        };
        if ptr == libc::MAP_FAILED {
            return Err(std::io::Error::last_os_error());
        }
        Ok(Mapping { ptr: ptr.cast(), len })
    }
}

impl Drop for Mapping {
    fn drop(&mut self) {
        // SAFETY: unmaps exactly what `of` mapped; nothing borrows it once the arena is dropped.
        unsafe { libc::munmap(self.ptr.cast(), self.len) };
    }
}

/// A segment this rank created; its file is unlinked on drop (the mapping stays valid).
pub struct OwnSegment {
    path: PathBuf,
    mapping: Mapping,
}

impl OwnSegment {
    /// Creates this rank's segment (mode 0600, zero-filled).
    pub fn create(rank: Rank, slot_bytes: usize) -> std::io::Result<OwnSegment> {
        let nanos = std::time::SystemTime::now().duration_since(std::time::UNIX_EPOCH).map_or(0, |d| d.as_nanos());
        let path = Path::new(SHM_DIR).join(format!("{SEGMENT_PREFIX}{}-{rank}-{nanos}", std::process::id()));
        let file = OpenOptions::new().read(true).write(true).create_new(true).mode(0o600).open(&path)?;
        let len = segment_bytes(slot_bytes);
        // Allocated now, not on first touch: a /dev/shm that cannot hold the segment (a container's
        // 64 MiB default, say) fails here with ENOSPC instead of killing the process with SIGBUS later.
        let segment = allocate(&file, len).and_then(|()| Mapping::of(&file, len));
        match segment {
            Ok(mapping) => Ok(OwnSegment { path, mapping }),
            Err(e) => {
                let _ = std::fs::remove_file(&path);
                Err(e)
            }
        }
    }

    pub fn path(&self) -> &Path {
        &self.path
    }

    /// Removes the name (peers that mapped it keep their mapping).
    pub fn unlink(&self) {
        let _ = std::fs::remove_file(&self.path);
    }
}

impl Drop for OwnSegment {
    fn drop(&mut self) {
        self.unlink();
    }
}

fn allocate(file: &File, len: usize) -> std::io::Result<()> {
    // SAFETY: posix_fallocate on an open descriptor; it returns the error number instead of setting errno.
    match unsafe { libc::posix_fallocate(file.as_raw_fd(), 0, len as libc::off_t) } {
        0 => Ok(()),
        errno => Err(std::io::Error::from_raw_os_error(errno)),
    }
}

pub fn segment_bytes(slot_bytes: usize) -> usize {
    HEADER_BYTES + 2 * slot_bytes
}

/// Maps a peer's segment by the path it sent, refusing anything that is not a troupe segment of the
/// expected size.
pub fn map_peer(path: &str, slot_bytes: usize) -> Result<PeerSegment, String> {
    let p = Path::new(path);
    let valid = p.parent() == Some(Path::new(SHM_DIR))
        && p.file_name().and_then(|n| n.to_str()).is_some_and(|n| n.starts_with(SEGMENT_PREFIX));
    if !valid {
        return Err(format!("{path:?} is not a troupe segment under {SHM_DIR}"));
    }
    let file = OpenOptions::new().read(true).write(true).open(p).map_err(|e| format!("opening {path}: {e}"))?;
    let len = segment_bytes(slot_bytes);
    let actual = file.metadata().map_err(|e| format!("{path}: {e}"))?.len();
    if actual != len as u64 {
        return Err(format!(
            "{path} holds {actual} bytes, expected {len}: the ranks disagree on shared_memory_slot_bytes"
        ));
    }
    Mapping::of(&file, len).map(PeerSegment).map_err(|e| format!("mapping {path}: {e}"))
}

/// A peer's segment, mapped.
pub struct PeerSegment(Mapping);

/// What one collective call is, as every rank records it: ranks must issue the same calls in the same
/// order, and a mismatch fails the call instead of mixing two calls' data.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct CallRecord {
    pub op: &'static str,
    /// Operation code (kind, reduce op, root) packed by the caller.
    pub code: u64,
    pub len: u64,
    pub tag: Tag,
}

impl CallRecord {
    fn words(&self) -> [u64; CALL_RECORD_WORDS] {
        [self.code, self.len, self.tag.epoch, self.tag.seq ^ (u64::from(self.tag.group) << 48)]
    }
}

/// The mapped segments of every rank of the mesh.
pub struct Arena {
    rank: Rank,
    slot_bytes: usize,
    /// Base address of every rank's segment (index = rank; ours included).
    bases: Vec<Base>,
    own: OwnSegment,
    _peers: Vec<PeerSegment>,
    mailbox: Arc<Mailbox>,
    /// Held by the communicator using the arena (`None` while one is); a later claim continues where
    /// the last left off, so every rank's counters stay in step across communicators.
    state: std::sync::Mutex<Option<ClaimState>>,
    spin: Duration,
}

/// A claim's counters (see [`ArenaClaim`]).
#[derive(Clone, Copy, Debug, Default)]
struct ClaimState {
    progress: u32,
    calls: u64,
    slot_free_at: [u32; 2],
    broken: bool,
}

#[derive(Clone, Copy)]
struct Base(*mut u8);

// SAFETY: addresses of mappings the arena keeps alive; see `Mapping`.
unsafe impl Send for Base {}
unsafe impl Sync for Base {}

impl std::fmt::Debug for Arena {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("Arena").field("rank", &self.rank).field("slot_bytes", &self.slot_bytes).finish()
    }
}

impl Arena {
    /// `peers[q]` is rank q's mapped segment (`None` at this rank's index, and only there).
    pub fn new(
        rank: Rank,
        slot_bytes: usize,
        own: OwnSegment,
        peers: Vec<Option<PeerSegment>>,
        mailbox: Arc<Mailbox>,
    ) -> Arena {
        let bases_len = peers.len();
        let cores = std::thread::available_parallelism().map_or(1, |c| c.get());
        let bases = peers
            .iter()
            .enumerate()
            .map(|(q, p)| match p {
                Some(PeerSegment(m)) => Base(m.ptr),
                None => {
                    assert_eq!(q, rank, "rank {q}'s segment is missing");
                    Base(own.mapping.ptr)
                }
            })
            .collect();
        Arena {
            rank,
            slot_bytes,
            bases,
            own,
            _peers: peers.into_iter().flatten().collect(),
            mailbox,
            state: std::sync::Mutex::new(Some(ClaimState::default())),
            spin: if bases_len <= cores { SPIN } else { Duration::ZERO },
        }
    }

    pub fn rank(&self) -> Rank {
        self.rank
    }

    pub fn world(&self) -> usize {
        self.bases.len()
    }

    pub fn slot_bytes(&self) -> usize {
        self.slot_bytes
    }

    /// Where this rank's segment was created (its name is removed once every peer mapped it).
    pub fn segment_path(&self) -> &Path {
        self.own.path()
    }

    /// Exclusive use of the arena for one communicator; `None` if another holds it (that one then uses
    /// the sockets: two communicators' calls interleaved in one arena would need a shared order).
    pub fn claim(self: &Arc<Self>) -> Option<ArenaClaim> {
        let state = self.state.lock().unwrap_or_else(|p| p.into_inner()).take()?;
        let ClaimState { progress, calls, slot_free_at, broken } = state;
        Some(ArenaClaim { arena: self.clone(), progress, calls, slot_free_at, broken })
    }

    fn word(&self, q: Rank, at: usize) -> &AtomicU32 {
        // SAFETY: `at` is a 4-aligned offset inside the header of a live mapping.
        unsafe { &*self.bases[q].0.add(at).cast::<AtomicU32>() }
    }

    fn call_word(&self, q: Rank, record: usize, word: usize) -> &AtomicU64 {
        let at = CALLS_AT + (record * CALL_RECORD_WORDS + word) * 8;
        debug_assert!(at + 8 <= HEADER_BYTES);
        // SAFETY: an 8-aligned offset inside the header of a live mapping.
        unsafe { &*self.bases[q].0.add(at).cast::<AtomicU64>() }
    }

    /// Elements of f32 in one slot.
    pub fn slot_elems(&self) -> usize {
        self.slot_bytes / 4
    }

    fn slot_ptr(&self, q: Rank, slot: usize) -> *mut f32 {
        // SAFETY: within the mapping: HEADER_BYTES + 2 * slot_bytes.
        unsafe { self.bases[q].0.add(HEADER_BYTES + slot * self.slot_bytes).cast::<f32>() }
    }
}

/// Whether a wrapping counter at `p` has reached `target`.
fn reached(p: u32, target: u32) -> bool {
    (p.wrapping_sub(target) as i32) >= 0
}

fn futex_wait(word: &AtomicU32, expected: u32, timeout: Duration) {
    let ts = libc::timespec { tv_sec: 0, tv_nsec: timeout.subsec_nanos() as libc::c_long };
    // SAFETY: FUTEX_WAIT (shared, not PRIVATE: the word is in a MAP_SHARED mapping other processes use)
    // on a live, aligned u32; returns on wake, timeout, signal or a changed value.
    unsafe {
        libc::syscall(libc::SYS_futex, word.as_ptr(), libc::FUTEX_WAIT, expected, &ts as *const libc::timespec);
    }
}

fn futex_wake(word: &AtomicU32) {
    // SAFETY: FUTEX_WAKE of every waiter on a live, aligned u32 of a shared mapping.
    unsafe {
        libc::syscall(libc::SYS_futex, word.as_ptr(), libc::FUTEX_WAKE, i32::MAX);
    }
}

/// One communicator's use of the arena: the phase counter and which slot is free when.
pub struct ArenaClaim {
    arena: Arc<Arena>,
    /// Phases this rank has completed (mirrors its `progress` word).
    progress: u32,
    calls: u64,
    /// Slot s may be written again once every rank has completed phase `slot_free_at[s]`.
    slot_free_at: [u32; 2],
    broken: bool,
}

impl std::fmt::Debug for ArenaClaim {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("ArenaClaim").field("progress", &self.progress).field("broken", &self.broken).finish()
    }
}

impl Drop for ArenaClaim {
    fn drop(&mut self) {
        let state = ClaimState {
            progress: self.progress,
            calls: self.calls,
            slot_free_at: self.slot_free_at,
            broken: self.broken,
        };
        *self.arena.state.lock().unwrap_or_else(|p| p.into_inner()) = Some(state);
    }
}

/// One call in progress: marks the claim broken if it does not finish (an error, or the future dropped
/// mid-call), so that peers waiting on this rank fail at once instead of at the timeout.
pub struct CallGuard<'a> {
    claim: &'a mut ArenaClaim,
    record: CallRecord,
    /// The first phase of this call: waits for it or later ones check the peer's record.
    first_phase: u32,
    started: Instant,
    timeout_ms: u64,
    done: bool,
}

impl ArenaClaim {
    pub fn arena(&self) -> &Arena {
        &self.arena
    }

    /// Gives the arena up as a failed call does: peers waiting on this rank fail at once (a caller
    /// whose collective failed outside the arena, between two arena calls its peers expect, says so
    /// with this instead of leaving them to the timeout).
    pub fn abandon(&mut self) {
        let a = &self.arena;
        self.broken = true;
        a.word(a.rank, BROKEN_AT).store(1, Ordering::SeqCst);
        futex_wake(a.word(a.rank, PROGRESS_AT));
    }

    /// Starts a call: records what it is for the peers to check.
    pub fn begin(&mut self, record: CallRecord, timeout_ms: u64) -> Result<CallGuard<'_>, ClusterError> {
        let a = &self.arena;
        if self.broken {
            return Err(ClusterError::InvalidArgument {
                rank: a.rank,
                op: record.op,
                reason: "the shared-memory arena is unusable after a failed or abandoned collective; \
                         connect a new transport"
                    .into(),
            });
        }
        let slot = (self.calls % CALL_RECORDS as u64) as usize;
        for (w, v) in record.words().into_iter().enumerate() {
            a.call_word(a.rank, slot, w).store(v, Ordering::Relaxed);
        }
        // Published by the release store of the first phase.
        let first_phase = self.progress.wrapping_add(1);
        Ok(CallGuard { claim: self, record, first_phase, started: Instant::now(), timeout_ms, done: false })
    }
}

impl Drop for CallGuard<'_> {
    fn drop(&mut self) {
        if !self.done {
            self.claim.abandon();
        }
    }
}

impl CallGuard<'_> {
    pub fn arena(&self) -> &Arena {
        &self.claim.arena
    }

    /// The call completed on this rank.
    pub fn finish(mut self) {
        self.done = true;
        self.claim.calls += 1;
    }

    /// Completes one phase: this rank's writes before it are visible to whoever waits for it.
    pub fn publish(&mut self) -> u32 {
        let a = &self.claim.arena;
        self.claim.progress = self.claim.progress.wrapping_add(1);
        a.word(a.rank, PROGRESS_AT).store(self.claim.progress, Ordering::SeqCst);
        if a.word(a.rank, WAITERS_AT).load(Ordering::SeqCst) > 0 {
            futex_wake(a.word(a.rank, PROGRESS_AT));
        }
        self.claim.progress
    }

    /// Before writing into `slot`: waits until no rank still reads what it last held.
    pub async fn take_slot(&mut self, slot: usize) -> Result<(), ClusterError> {
        let busy_until = self.claim.slot_free_at[slot];
        // A slot unused for 2^20 phases is long free (ranks never drift more than a few phases apart);
        // without this a wrapped counter would look like one still ahead.
        if (self.claim.progress.wrapping_sub(busy_until) as i32) > (1 << 20) {
            return Ok(());
        }
        self.wait_all(busy_until).await
    }

    /// What this rank wrote into `slot` is read by peers until they complete phase `phase`.
    pub fn read_until(&mut self, slot: usize, phase: u32) {
        self.claim.slot_free_at[slot] = phase;
    }

    /// Rank `q`'s slot as f32, for reading.
    ///
    /// # Safety
    /// `q` must have completed the phase that wrote what is read, and must not write the slot again
    /// before this rank has published a phase that the slot's next writer waits for.
    pub unsafe fn slot(&self, q: Rank, slot: usize) -> &[f32] {
        let a = &self.claim.arena;
        // SAFETY: per the contract above, no one writes this memory while the slice lives.
        unsafe { std::slice::from_raw_parts(a.slot_ptr(q, slot), a.slot_elems()) }
    }

    /// This rank's own slot, for writing.
    ///
    /// # Safety
    /// The slot must have been taken with [`Self::take_slot`] for this use, and no peer may be reading
    /// the part written (the protocol's phases say which parts peers read when).
    #[allow(clippy::mut_from_ref)]
    pub unsafe fn own_slot(&self, slot: usize) -> &mut [f32] {
        let a = &self.claim.arena;
        // SAFETY: per the contract above.
        unsafe { std::slice::from_raw_parts_mut(a.slot_ptr(a.rank, slot), a.slot_elems()) }
    }

    /// Waits until every other rank has completed phase `target`.
    pub async fn wait_all(&self, target: u32) -> Result<(), ClusterError> {
        let a = &self.claim.arena;
        for q in 0..a.world() {
            if q != a.rank {
                self.wait_for(q, target).await?;
            }
        }
        Ok(())
    }

    /// Waits until rank `q` has completed phase `target`: spins briefly, then sleeps on its futex in
    /// short turns, checking between turns for a lost or broken peer and the timeout.
    pub async fn wait_for(&self, q: Rank, target: u32) -> Result<(), ClusterError> {
        let a = &self.claim.arena;
        let progress = a.word(q, PROGRESS_AT);
        if reached(progress.load(Ordering::Acquire), target) {
            return self.check_record(q, target);
        }
        let spin_until = Instant::now() + a.spin;
        loop {
            for _ in 0..64 {
                if reached(progress.load(Ordering::Acquire), target) {
                    return self.check_record(q, target);
                }
                std::hint::spin_loop();
            }
            if Instant::now() >= spin_until {
                break;
            }
        }
        loop {
            // A peer that got this far and then broke off is reported by its record (a mismatch) if
            // that is why; only then by its broken flag.
            if reached(progress.load(Ordering::Acquire), target) {
                return self.check_record(q, target);
            }
            self.check_peers()?;
            let waiters = a.word(q, WAITERS_AT);
            waiters.fetch_add(1, Ordering::SeqCst);
            let p = progress.load(Ordering::SeqCst);
            if !reached(p, target) {
                futex_wait(progress, p, SLEEP);
            }
            waiters.fetch_sub(1, Ordering::SeqCst);
            tokio::task::yield_now().await;
        }
    }

    /// Fails if a peer is lost, departed or broke off its call, or the call ran past its timeout. A
    /// peer that is gone is named before one that broke off: the one that broke off most likely did so
    /// because of that loss, which is what the error should tell.
    fn check_peers(&self) -> Result<(), ClusterError> {
        let a = &self.claim.arena;
        let r = &self.record;
        let peers = || (0..a.world()).filter(|&q| q != a.rank);
        let gone = peers().find_map(|q| a.mailbox.gone(q).map(|reason| (q, reason)));
        let broke_off = || {
            peers().find(|&q| a.word(q, BROKEN_AT).load(Ordering::SeqCst) != 0).map(|q| {
                (q, "abandoned a shared-memory collective (its call failed or its step was aborted)".to_string())
            })
        };
        if let Some((peer, reason)) = gone.or_else(broke_off) {
            return Err(ClusterError::PeerLost { rank: a.rank, peer, epoch: r.tag.epoch, reason });
        }
        let waited = self.started.elapsed();
        if waited >= Duration::from_millis(self.timeout_ms) {
            let slowest = (0..a.world())
                .filter(|&q| q != a.rank)
                .min_by_key(|&q| {
                    a.word(q, PROGRESS_AT).load(Ordering::Acquire).wrapping_sub(self.claim.progress) as i32
                })
                .unwrap_or(a.rank);
            return Err(ClusterError::Timeout {
                rank: a.rank,
                op: r.op,
                group: r.tag.group,
                epoch: r.tag.epoch,
                seq: r.tag.seq,
                peer: slowest,
                waited_ms: waited.as_millis() as u64,
            });
        }
        Ok(())
    }

    /// Once `q` reached a phase of this call, its record of the call must match ours.
    fn check_record(&self, q: Rank, target: u32) -> Result<(), ClusterError> {
        if !reached(target, self.first_phase) {
            return Ok(()); // a phase of an earlier call: `q` may not have begun this one
        }
        let a = &self.claim.arena;
        let slot = (self.claim.calls % CALL_RECORDS as u64) as usize;
        let theirs: [u64; CALL_RECORD_WORDS] = std::array::from_fn(|w| a.call_word(q, slot, w).load(Ordering::Relaxed));
        if theirs != self.record.words() {
            return Err(ClusterError::InvalidArgument {
                rank: a.rank,
                op: self.record.op,
                reason: format!(
                    "rank {q} issued a different collective as call {} of this communicator (ours: {} of {} \
                     elements, code {:#x}, seq {}; theirs: {theirs:?}): every rank must issue the same \
                     collectives in the same order",
                    self.claim.calls, self.record.op, self.record.len, self.record.code, self.record.tag.seq
                ),
            });
        }
        Ok(())
    }
}
