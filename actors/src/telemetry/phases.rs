//! Where a rank's time goes in each step: named spans (compute, all-reduce, commit wait, optimizer,
//! checkpoint, recovery) on the wall clock, reported to the job's watchers when the job asks for them
//! (`JobSpec::trace`, set by `troupe train --run-dir`). Off, a [`PhaseRecorder`] records nothing.
//!
//! Times are microseconds since the Unix epoch, taken from one `SystemTime` reading per attempt plus the
//! monotonic clock: monotonic within a rank, and comparable across ranks as far as the hosts' clocks
//! agree (one host: exactly).

use std::time::{Instant, SystemTime, UNIX_EPOCH};

pub use crate::protocol::PhaseSpan;

/// Collects the spans of one rank between reports.
#[derive(Debug)]
pub struct PhaseRecorder {
    enabled: bool,
    origin: Instant,
    origin_unix_us: u64,
    spans: Vec<PhaseSpan>,
}

impl PhaseRecorder {
    pub fn new(enabled: bool) -> Self {
        let origin_unix_us = SystemTime::now().duration_since(UNIX_EPOCH).map_or(0, |d| d.as_micros() as u64);
        PhaseRecorder { enabled, origin: Instant::now(), origin_unix_us, spans: Vec::new() }
    }

    pub fn is_enabled(&self) -> bool {
        self.enabled
    }

    fn unix_us(&self, at: Instant) -> u64 {
        let since = at.checked_duration_since(self.origin).map_or(0, |d| d.as_micros() as u64);
        let before = self.origin.checked_duration_since(at).map_or(0, |d| d.as_micros() as u64);
        (self.origin_unix_us + since).saturating_sub(before)
    }

    /// Records `[from, to)` (nothing when disabled or empty).
    pub fn span(&mut self, name: &str, cat: &str, from: Instant, to: Instant) {
        self.record(name, cat, from, to, None);
    }

    /// Records a pipeline op of `chunk` and `microbatch`, `[from, to)`.
    pub fn op(&mut self, name: &str, cat: &str, from: Instant, to: Instant, chunk: usize, microbatch: usize) {
        self.record(name, cat, from, to, Some((chunk, microbatch)));
    }

    fn record(&mut self, name: &str, cat: &str, from: Instant, to: Instant, op: Option<(usize, usize)>) {
        if !self.enabled || to <= from {
            return;
        }
        let start_us = self.unix_us(from);
        let dur_us = self.unix_us(to).saturating_sub(start_us).max(1);
        let (chunk, microbatch) = (op.map(|o| o.0), op.map(|o| o.1));
        self.spans.push(PhaseSpan { name: name.to_owned(), cat: cat.to_owned(), start_us, dur_us, chunk, microbatch });
    }

    /// The spans recorded since the last call (None when there are none).
    pub fn take(&mut self) -> Option<Vec<PhaseSpan>> {
        (!self.spans.is_empty()).then(|| std::mem::take(&mut self.spans))
    }
}

#[cfg(test)]
mod tests {
    use std::time::Duration;

    use super::*;

    #[test]
    fn spans_follow_the_monotonic_clock_and_a_disabled_recorder_keeps_nothing() {
        let mut r = PhaseRecorder::new(true);
        let t0 = Instant::now();
        let (t1, t2) = (t0 + Duration::from_millis(3), t0 + Duration::from_millis(5));
        r.span("a", "compute", t0, t1);
        r.span("b", "comm", t1, t2);
        r.span("empty", "idle", t2, t2);
        let spans = r.take().unwrap();
        assert_eq!(spans.len(), 2);
        assert_eq!(spans[0].start_us + spans[0].dur_us, spans[1].start_us);
        assert_eq!((spans[0].dur_us, spans[1].dur_us), (3_000, 2_000));
        assert!(r.take().is_none());
        let mut off = PhaseRecorder::new(false);
        off.span("a", "compute", t0, t1);
        assert!(off.take().is_none());
    }
}
