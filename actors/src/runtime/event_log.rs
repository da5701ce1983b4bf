//! The events a job has streamed, kept by the controller so that a watcher that lost its connection (a
//! network blip, a machine so loaded that the QUIC idle timeout fired) reconnects and gets exactly the
//! events it missed, in order, instead of a gap or an error.

use std::collections::VecDeque;

use crate::protocol::{JobEvent, EVENTS_KEPT};

/// A job's events, numbered from 0 in the order they were streamed; the newest [`EVENTS_KEPT`] kept.
#[derive(Debug, Default)]
pub struct EventLog {
    events: VecDeque<JobEvent>,
    /// The number of the oldest event kept.
    first: u64,
}

impl EventLog {
    /// A log whose kept events are `events`, the first of them numbered `first` (a restarted controller's,
    /// from its catalog).
    pub fn restore(first: u64, events: Vec<JobEvent>) -> Self {
        let mut log = EventLog { events: events.into(), first };
        while log.events.len() > EVENTS_KEPT {
            log.events.pop_front();
            log.first += 1;
        }
        log
    }

    pub fn push(&mut self, event: JobEvent) {
        if self.events.len() == EVENTS_KEPT {
            self.events.pop_front();
            self.first += 1;
        }
        self.events.push_back(event);
    }

    /// The number the next event will have: how many the job has streamed.
    pub fn end(&self) -> u64 {
        self.first + self.events.len() as u64
    }

    /// The events numbered `from` and later, and how many before them were dropped and cannot be replayed.
    pub fn since(&self, from: u64) -> (impl Iterator<Item = &JobEvent>, u64) {
        let skip = from.saturating_sub(self.first).min(self.events.len() as u64);
        (self.events.iter().skip(skip as usize), self.first.saturating_sub(from))
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn step(step: u64) -> JobEvent {
        JobEvent::Checkpoint { step, path: format!("step-{step}").into(), seconds: 0.0, bytes: 0 }
    }

    fn steps<'a>(events: impl Iterator<Item = &'a JobEvent>) -> Vec<u64> {
        events.map(|e| if let JobEvent::Checkpoint { step, .. } = e { *step } else { unreachable!() }).collect()
    }

    #[test]
    fn replays_exactly_the_events_after_those_seen() {
        let mut log = EventLog::default();
        for i in 0..5 {
            log.push(step(i));
        }
        assert_eq!(log.end(), 5);
        let (events, lost) = log.since(3);
        assert_eq!((steps(events), lost), (vec![3, 4], 0));
        let (events, lost) = log.since(5);
        assert_eq!((steps(events), lost), (vec![], 0));
        let (events, lost) = log.since(9);
        assert_eq!((steps(events), lost), (vec![], 0));
    }

    #[test]
    fn keeps_the_newest_and_says_how_many_older_ones_are_gone() {
        let mut log = EventLog::default();
        for i in 0..EVENTS_KEPT as u64 + 3 {
            log.push(step(i));
        }
        assert_eq!(log.end(), EVENTS_KEPT as u64 + 3);
        let (events, lost) = log.since(1);
        let replayed = steps(events);
        assert_eq!((replayed.len(), replayed[0], lost), (EVENTS_KEPT, 3, 2));
    }
}
