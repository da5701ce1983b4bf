use std::time::Duration;

use serde::{Deserialize, Serialize};

use super::detector::{Arrivals, DetectorKind};

/// Failure-detection timing. The hierarchy users can rely on: heartbeat interval < failure timeout <
/// collective timeout < job timeout.
#[derive(Clone, Debug, PartialEq, Eq, Serialize, Deserialize)]
#[serde(deny_unknown_fields, default)]
pub struct MembershipConfig {
    /// How often a member tells the controller it is alive.
    pub heartbeat_interval_ms: u64,
    /// Silence after which a member is declared dead (and a member declares the controller lost). Under
    /// `phi_accrual`, the ceiling: a member is declared dead by then whatever its history.
    pub failure_timeout_ms: u64,
    /// How the controller decides a silent member is dead: `fixed` (after `failure_timeout_ms`) or
    /// `phi_accrual` (adaptive, from the member's heartbeat history; see `membership::detector`).
    pub failure_detector: DetectorKind,
    /// `phi_accrual`: the floor — no member is declared dead by silence before this, however regular its
    /// heartbeats (a loaded machine's pauses below it never fail a member).
    pub failure_timeout_min_ms: u64,
    /// `phi_accrual`: the suspicion at which a member is dead, φ = −log10(P(a live member is this late)).
    pub phi_threshold: u32,
    /// `phi_accrual`: the least standard deviation assumed of heartbeat intervals.
    pub phi_min_std_deviation_ms: u64,
    /// The controller's own stall: when its timer (every 50 ms) runs this much later than the previous
    /// tick, the controller was not running (SIGSTOP, a saturated machine) — nobody is declared dead on
    /// that tick, and the gap beyond this is not counted as any member's silence (Cassandra's
    /// `max_local_pause_in_ms`). Either detector.
    pub max_local_pause_ms: u64,
}

impl Default for MembershipConfig {
    fn default() -> Self {
        Self {
            heartbeat_interval_ms: 250,
            failure_timeout_ms: 1500,
            failure_detector: DetectorKind::PhiAccrual,
            failure_timeout_min_ms: 1000,
            phi_threshold: 8,
            phi_min_std_deviation_ms: 50,
            max_local_pause_ms: MAX_LOCAL_PAUSE_MS,
        }
    }
}

/// The default `max_local_pause_ms`: four ticks of the daemon's 50 ms timer.
pub const MAX_LOCAL_PAUSE_MS: u64 = 200;
/// The least `max_local_pause_ms`: twice the daemon's 50 ms timer, so an ordinary tick is never a pause
/// (were every tick one, a dead member's silence would never count).
const MIN_LOCAL_PAUSE_MS: u64 = 100;

impl MembershipConfig {
    /// `max_local_pause_ms` as a duration.
    pub fn max_local_pause(&self) -> Duration {
        Duration::from_millis(self.max_local_pause_ms)
    }

    pub fn heartbeat_interval(&self) -> Duration {
        Duration::from_millis(self.heartbeat_interval_ms)
    }

    pub fn failure_timeout(&self) -> Duration {
        Duration::from_millis(self.failure_timeout_ms)
    }

    /// The silence after which a member heard as `arrivals` is declared dead.
    pub fn silence_allowed(&self, arrivals: &Arrivals) -> Duration {
        match self.failure_detector {
            DetectorKind::Fixed => self.failure_timeout(),
            DetectorKind::PhiAccrual => self.adaptive_silence_allowed(arrivals),
        }
    }

    /// The silence `phi_accrual` allows a member heard as `arrivals`, whichever detector is configured
    /// (the soak reports what it would have decided beside the fixed detector).
    pub fn adaptive_silence_allowed(&self, arrivals: &Arrivals) -> Duration {
        let adaptive = arrivals.silence_at_phi(f64::from(self.phi_threshold), self.phi_min_std_deviation());
        adaptive.clamp(Duration::from_millis(self.failure_timeout_min_ms), self.failure_timeout())
    }

    /// `phi_min_std_deviation_ms` as a duration.
    pub fn phi_min_std_deviation(&self) -> Duration {
        Duration::from_millis(self.phi_min_std_deviation_ms)
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
        let floor = match self.failure_detector {
            DetectorKind::Fixed => ("failure_timeout_ms", self.failure_timeout_ms),
            DetectorKind::PhiAccrual => ("failure_timeout_min_ms", self.failure_timeout_min_ms),
        };
        if self.max_local_pause_ms < MIN_LOCAL_PAUSE_MS || self.max_local_pause_ms >= floor.1 {
            return Err(format!(
                "max_local_pause_ms ({}) must be at least {MIN_LOCAL_PAUSE_MS} (twice the daemon's 50 ms timer) and below {} ({}): a longer stall of the controller is not its members' silence",
                self.max_local_pause_ms, floor.0, floor.1
            ));
        }
        if self.failure_detector == DetectorKind::PhiAccrual {
            if self.failure_timeout_min_ms < 2 * self.heartbeat_interval_ms {
                return Err(format!(
                    "failure_timeout_min_ms ({}) must be at least twice heartbeat_interval_ms ({}), or one late heartbeat kills a healthy node",
                    self.failure_timeout_min_ms, self.heartbeat_interval_ms
                ));
            }
            if self.failure_timeout_min_ms > self.failure_timeout_ms {
                return Err(format!(
                    "failure_timeout_min_ms ({}) is the floor of the adaptive timeout (failure_detector = \"phi_accrual\", \
                     the default): at most failure_timeout_ms ({}), its ceiling; lower failure_timeout_min_ms, or set \
                     failure_detector = \"fixed\" to be declared dead after exactly failure_timeout_ms",
                    self.failure_timeout_min_ms, self.failure_timeout_ms
                ));
            }
            if !(1..=16).contains(&self.phi_threshold) {
                return Err(format!(
                    "phi_threshold ({}) must be 1 to 16 (8: one false suspicion in 10^8 heartbeats)",
                    self.phi_threshold
                ));
            }
        }
        Ok(())
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn check(config: MembershipConfig, expected: Result<(), &str>) {
        let got = config.validate();
        match expected {
            Ok(()) => assert_eq!(got, Ok(())),
            Err(names) => assert!(got.as_ref().is_err_and(|e| e.contains(names)), "{got:?} should name {names}"),
        }
    }

    /// What a node gets without a `[membership]` section: the adaptive detector with the floor the
    /// CPU-saturation soak passed at (docs/benchmarks.md), within the fixed timeout as its ceiling.
    #[test]
    fn the_default_is_phi_accrual_between_one_second_and_the_fixed_timeout() {
        let config: MembershipConfig = serde_json::from_str("{}").unwrap();
        assert_eq!(config, MembershipConfig::default());
        assert_eq!(config.failure_detector, DetectorKind::PhiAccrual);
        assert_eq!((config.failure_timeout_min_ms, config.failure_timeout_ms), (1000, 1500));
        check(config, Ok(()));
    }

    #[test]
    fn the_adaptive_detector_needs_a_floor_between_two_intervals_and_the_ceiling() {
        let phi = MembershipConfig { failure_detector: DetectorKind::PhiAccrual, ..MembershipConfig::default() };
        check(phi.clone(), Ok(()));
        check(MembershipConfig { failure_timeout_min_ms: 499, ..phi.clone() }, Err("failure_timeout_min_ms (499)"));
        check(MembershipConfig { failure_timeout_min_ms: 1600, ..phi.clone() }, Err("ceiling"));
        check(MembershipConfig { phi_threshold: 0, ..phi.clone() }, Err("phi_threshold"));
        check(MembershipConfig { max_local_pause_ms: 50, ..phi.clone() }, Err("max_local_pause_ms (50)"));
        check(MembershipConfig { max_local_pause_ms: 1000, ..phi.clone() }, Err("failure_timeout_min_ms (1000)"));
        let fixed = MembershipConfig { failure_detector: DetectorKind::Fixed, ..MembershipConfig::default() };
        check(MembershipConfig { max_local_pause_ms: 1500, ..fixed.clone() }, Err("failure_timeout_ms"));
        // The fixed detector ignores the adaptive keys.
        check(MembershipConfig { failure_timeout_min_ms: 0, phi_threshold: 0, ..fixed }, Ok(()));
        // A ceiling below the default floor (a node.toml written for the fixed detector's faster timeout):
        // the error names both keys and both ways out.
        let low = MembershipConfig { failure_timeout_ms: 800, ..MembershipConfig::default() };
        check(low.clone(), Err("failure_timeout_min_ms (1000)"));
        check(low.clone(), Err("failure_detector = \"fixed\""));
        check(MembershipConfig { failure_detector: DetectorKind::Fixed, ..low }, Ok(()));
        let parsed: MembershipConfig =
            serde_json::from_str(r#"{"failure_detector": "phi_accrual", "failure_timeout_min_ms": 600}"#).unwrap();
        assert_eq!(parsed, MembershipConfig { failure_timeout_min_ms: 600, ..phi });
    }
}
