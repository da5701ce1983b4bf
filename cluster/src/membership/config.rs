use std::time::Duration;

use serde::{Deserialize, Serialize};

/// Failure-detection timing. The hierarchy users can rely on: heartbeat interval < failure timeout <
/// collective timeout < job timeout.
#[derive(Clone, Debug, PartialEq, Eq, Serialize, Deserialize)]
#[serde(deny_unknown_fields, default)]
pub struct MembershipConfig {
    /// How often a member tells the controller it is alive.
    pub heartbeat_interval_ms: u64,
    /// Silence after which a member is declared dead (and a member declares the controller lost).
    pub failure_timeout_ms: u64,
}

impl Default for MembershipConfig {
    fn default() -> Self {
        Self { heartbeat_interval_ms: 250, failure_timeout_ms: 1500 }
    }
}

impl MembershipConfig {
    pub fn heartbeat_interval(&self) -> Duration {
        Duration::from_millis(self.heartbeat_interval_ms)
    }

    pub fn failure_timeout(&self) -> Duration {
        Duration::from_millis(self.failure_timeout_ms)
    }

    /// Checks the values; the message names the key and what is allowed.
    pub fn validate(&self) -> Result<(), String> {
        if self.heartbeat_interval_ms == 0 {
            return Err("heartbeat_interval_ms must be at least 1".into());
        }
        if self.failure_timeout_ms < 2 * self.heartbeat_interval_ms {
            return Err(format!(
                "failure_timeout_ms ({}) must be at least twice heartbeat_interval_ms ({}), or one late heartbeat kills a healthy node",
                self.failure_timeout_ms, self.heartbeat_interval_ms
            ));
        }
        Ok(())
    }
}
