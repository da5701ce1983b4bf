//! Restart policy, sans-IO: a supervisor records each failure of a child with the time it happened and
//! is told whether to restart it or to give up and escalate to its own parent.

use std::collections::VecDeque;
use std::time::Duration;

use serde::{Deserialize, Serialize};

/// At most `max_restarts` restarts within any `window_ms`; the next failure inside the window escalates.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Serialize, Deserialize)]
#[serde(deny_unknown_fields, default)]
pub struct RestartPolicy {
    pub max_restarts: u32,
    pub window_ms: u64,
}

impl Default for RestartPolicy {
    /// Three restarts a minute: a transient fault (a panic on a bad batch, an OOM) is retried, a
    /// deterministic one stops the node instead of looping forever.
    fn default() -> Self {
        RestartPolicy { max_restarts: 3, window_ms: 60_000 }
    }
}

#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Decision {
    /// Restart the child; this is restart number `attempt` inside the window.
    Restart { attempt: u32 },
    /// Too many failures in the window: stop and report to the parent.
    Escalate { failures: u32 },
}

/// Failure history of one child.
#[derive(Clone, Debug)]
pub struct RestartTracker {
    policy: RestartPolicy,
    failures: VecDeque<Duration>,
}

impl RestartTracker {
    pub fn new(policy: RestartPolicy) -> Self {
        RestartTracker { policy, failures: VecDeque::new() }
    }

    /// Records a failure at `now` (time since any fixed origin) and decides.
    pub fn on_failure(&mut self, now: Duration) -> Decision {
        let window = Duration::from_millis(self.policy.window_ms);
        while self.failures.front().is_some_and(|&t| now.saturating_sub(t) >= window) {
            self.failures.pop_front();
        }
        self.failures.push_back(now);
        let count = self.failures.len() as u32;
        if count > self.policy.max_restarts {
            Decision::Escalate { failures: count }
        } else {
            Decision::Restart { attempt: count }
        }
    }

    /// Restarts inside the current window.
    pub fn recent_failures(&self) -> u32 {
        self.failures.len() as u32
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    const S: fn(u64) -> Duration = Duration::from_secs;

    #[test]
    fn restarts_up_to_the_limit_then_escalates() {
        let mut t = RestartTracker::new(RestartPolicy { max_restarts: 2, window_ms: 10_000 });
        assert_eq!(t.on_failure(S(0)), Decision::Restart { attempt: 1 });
        assert_eq!(t.on_failure(S(1)), Decision::Restart { attempt: 2 });
        assert_eq!(t.on_failure(S(2)), Decision::Escalate { failures: 3 });
    }

    #[test]
    fn failures_older_than_the_window_are_forgotten() {
        let mut t = RestartTracker::new(RestartPolicy { max_restarts: 1, window_ms: 10_000 });
        assert_eq!(t.on_failure(S(0)), Decision::Restart { attempt: 1 });
        assert_eq!(t.on_failure(S(10)), Decision::Restart { attempt: 1 }, "the first one left the window");
        assert_eq!(t.on_failure(S(19)), Decision::Escalate { failures: 2 });
        assert_eq!(t.recent_failures(), 2);
    }

    #[test]
    fn zero_restarts_escalates_at_once() {
        let mut t = RestartTracker::new(RestartPolicy { max_restarts: 0, window_ms: 1 });
        assert_eq!(t.on_failure(S(5)), Decision::Escalate { failures: 1 });
    }
}
