//! A bounded record of refused connections, kept for inspection (every refusal is also logged by the
//! code that refuses).

use std::collections::VecDeque;
use std::net::SocketAddr;
use std::sync::Mutex;

/// Refusals remembered for inspection (older ones are dropped; all are logged).
pub const REFUSALS_KEPT_MAX: usize = 256;

#[derive(Clone, Debug)]
pub struct Refusal {
    pub remote: SocketAddr,
    pub reason: String,
}

/// The last [`REFUSALS_KEPT_MAX`] refusals, oldest first.
#[derive(Debug, Default)]
pub struct RefusalLog {
    kept: Mutex<VecDeque<Refusal>>,
}

impl RefusalLog {
    pub fn record(&self, remote: SocketAddr, reason: String) {
        let mut kept = self.kept.lock().unwrap_or_else(|p| p.into_inner());
        if kept.len() == REFUSALS_KEPT_MAX {
            kept.pop_front();
        }
        kept.push_back(Refusal { remote, reason });
    }

    pub fn list(&self) -> Vec<Refusal> {
        self.kept.lock().unwrap_or_else(|p| p.into_inner()).iter().cloned().collect()
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn keeps_only_the_newest() {
        let log = RefusalLog::default();
        let remote: SocketAddr = "127.0.0.1:1".parse().unwrap();
        for i in 0..REFUSALS_KEPT_MAX + 3 {
            log.record(remote, i.to_string());
        }
        let kept = log.list();
        assert_eq!(kept.len(), REFUSALS_KEPT_MAX);
        assert_eq!(kept[0].reason, "3");
        assert_eq!(kept.last().unwrap().reason, (REFUSALS_KEPT_MAX + 2).to_string());
    }
}
