//! Splitting one flat-buffer kernel across CPU threads (`std::thread::scope`), only where it pays.
//!
//! Spawning a scoped thread costs tens of microseconds, so buffers below [`PARALLEL_MIN_ELEMS`] run on
//! the calling thread. The number of threads is a process-wide setting ([`set_cpu_threads`]) because
//! several ranks may share one machine: a process running one rank per core should set it to 1.

use std::sync::atomic::{AtomicUsize, Ordering};
use std::sync::OnceLock;

/// Buffers shorter than this run on the calling thread (1 MiB of f32).
pub const PARALLEL_MIN_ELEMS: usize = 1 << 18;

/// Chunk boundaries are multiples of this many elements, so every chunk but the last is a whole number
/// of SIMD blocks and of cache lines.
const CHUNK_ALIGN_ELEMS: usize = 256;

/// 0 means "not set": use `std::thread::available_parallelism()`.
static CPU_THREADS: AtomicUsize = AtomicUsize::new(0);

/// Sets how many threads one kernel call may use (at least 1). Default: the machine's available parallelism.
pub fn set_cpu_threads(threads: usize) {
    CPU_THREADS.store(threads.max(1), Ordering::Relaxed);
}

/// How many threads one kernel call may use.
pub fn cpu_threads() -> usize {
    match CPU_THREADS.load(Ordering::Relaxed) {
        0 => machine_parallelism(),
        n => n,
    }
}

/// `std::thread::available_parallelism()`, asked once per process: it reads the cgroup's CPU quota
/// from /proc and /sys on every call (an `openat` and several reads), which cost the collectives ~6 %
/// of their CPU when asked for every received QUIC chunk.
fn machine_parallelism() -> usize {
    static PARALLELISM: OnceLock<usize> = OnceLock::new();
    *PARALLELISM.get_or_init(|| std::thread::available_parallelism().map_or(1, |n| n.get()))
}

/// The chunk length (in elements, ≥ 1) to split a buffer of `len` elements into: the whole buffer when
/// it is small or only one thread is allowed, else one aligned chunk per thread.
pub(crate) fn chunk_elems(len: usize) -> usize {
    let threads = cpu_threads();
    if len < PARALLEL_MIN_ELEMS || threads == 1 {
        return len.max(1);
    }
    len.div_ceil(threads).div_ceil(CHUNK_ALIGN_ELEMS) * CHUNK_ALIGN_ELEMS
}

/// How many threads a kernel call on `len` elements uses.
pub fn threads_used(len: usize) -> usize {
    len.div_ceil(chunk_elems(len)).max(1)
}

/// Runs `work` on every part: all but the last on scoped threads, the last on the calling thread.
/// Returns the results in part order.
pub(crate) fn map_parts<P, R, F>(parts: impl IntoIterator<Item = P>, work: F) -> Vec<R>
where
    P: Send,
    R: Send,
    F: Fn(P) -> R + Sync,
{
    let work = &work;
    let mut parts = parts.into_iter().peekable();
    std::thread::scope(|scope| {
        let mut handles = Vec::new();
        let mut last = None;
        while let Some(part) = parts.next() {
            if parts.peek().is_none() {
                last = Some(work(part));
            } else {
                handles.push(scope.spawn(move || work(part)));
            }
        }
        let mut results: Vec<R> =
            handles.into_iter().map(|h| h.join().unwrap_or_else(|panic| std::panic::resume_unwind(panic))).collect();
        results.extend(last);
        results
    })
}

/// Like [`map_parts`] for work without a result.
pub(crate) fn for_each_part<P: Send>(parts: impl IntoIterator<Item = P>, work: impl Fn(P) + Sync) {
    map_parts(parts, work);
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn small_buffers_stay_whole_and_large_ones_split_aligned() {
        assert_eq!(chunk_elems(0), 1);
        assert_eq!(chunk_elems(1000), 1000);
        let len = PARALLEL_MIN_ELEMS * 3 + 17;
        let chunk = chunk_elems(len);
        assert!(len.div_ceil(chunk) <= cpu_threads());
        if cpu_threads() > 1 {
            assert_eq!(chunk % CHUNK_ALIGN_ELEMS, 0);
        }
    }

    #[test]
    fn results_come_back_in_part_order() {
        let got = map_parts(0..5, |i| i * 10);
        assert_eq!(got, vec![0, 10, 20, 30, 40]);
    }
}
