//! The run's trace: every event that changed something, as one line each. All lines are hashed (two runs
//! of one seed must hash the same); the last few are kept to print with a failure.

use std::collections::VecDeque;
use std::fmt::{self, Write};

#[derive(Debug)]
pub struct Trace {
    hash: u64,
    lines: u64,
    keep: usize,
    tail: VecDeque<String>,
    buf: String,
}

impl Trace {
    /// Keeps the last `keep` lines (0: only the hash).
    pub fn new(keep: usize) -> Self {
        Trace { hash: 0xCBF2_9CE4_8422_2325, lines: 0, keep, tail: VecDeque::new(), buf: String::new() }
    }

    pub fn log(&mut self, now_ms: u64, what: fmt::Arguments<'_>) {
        self.buf.clear();
        let _ = write!(self.buf, "{now_ms:>7} {what}");
        for b in self.buf.bytes().chain([b'\n']) {
            self.hash = (self.hash ^ u64::from(b)).wrapping_mul(0x0000_0100_0000_01B3);
        }
        self.lines += 1;
        if self.keep > 0 {
            if self.tail.len() == self.keep {
                self.tail.pop_front();
            }
            self.tail.push_back(self.buf.clone());
        }
    }

    /// FNV-1a of every line.
    pub fn hash(&self) -> u64 {
        self.hash
    }

    pub fn lines(&self) -> u64 {
        self.lines
    }

    pub fn into_tail(self) -> Vec<String> {
        self.tail.into()
    }
}
