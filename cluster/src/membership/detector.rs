//! The controller's failure detector, per member, sans-IO: heartbeat arrival times in, the instant the
//! member is declared dead out. Two kinds, chosen by `failure_detector` in `[membership]`:
//!
//! - **fixed**: dead after `failure_timeout_ms` of silence, whatever the member's history.
//! - **phi_accrual** (Hayashibara et al. 2004, as Cassandra and Akka use it): the heartbeat inter-arrival
//!   times of the member's last [`WINDOW_SAMPLES`] heartbeats are taken as normally distributed; the
//!   suspicion after `t` of silence is `φ(t) = −log10(P(interval > t))`, and the member is dead once φ
//!   reaches `phi_threshold` (φ = 8: the silence would be longer than this by chance once in 10^8
//!   heartbeats). The silence allowed is clamped to `[failure_timeout_min_ms, failure_timeout_ms]`: the
//!   floor keeps a loaded machine's pauses (scheduling, a GC-like stall) below it from ever failing a
//!   member, however regular its heartbeats were; the ceiling keeps the worst case of the fixed detector.
//!   The standard deviation is at least `phi_min_std_deviation_ms`, so a perfectly regular history (a
//!   simulation, an idle loopback) does not make a few milliseconds of lateness fatal.
//!
//! The normal tail is Akka's logistic approximation, `P(interval > t) ≈ 1 / (1 + e^{y (1.5976 +
//! 0.070566 y²)})` with `y = (t − mean) / σ`, whose inverse is a cubic solved in closed form: the deadline
//! is computed once per arrival, not searched for.

use std::collections::VecDeque;
use std::time::Duration;

use serde::{Deserialize, Serialize};

/// Heartbeat intervals a member's history keeps (Akka and Cassandra keep 1000; at the default 250 ms
/// interval these are the last 50 s).
pub const WINDOW_SAMPLES: usize = 200;

/// Which failure detector the controller uses for its members.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq, Serialize, Deserialize)]
#[serde(rename_all = "snake_case")]
pub enum DetectorKind {
    /// Dead after `failure_timeout_ms` of silence.
    #[default]
    Fixed,
    /// Dead once the silence is improbable for this member's heartbeat history (φ ≥ `phi_threshold`),
    /// never before `failure_timeout_min_ms`, always by `failure_timeout_ms`.
    PhiAccrual,
}

/// The coefficients of the logistic approximation of the normal tail (Akka's `PhiAccrualFailureDetector`).
const A: f64 = 1.5976;
const B: f64 = 0.070566;

/// One member's heartbeat arrivals: when it was last heard and the intervals before that.
#[derive(Clone, Debug)]
pub struct Arrivals {
    last: Duration,
    /// Whether `last` is a heartbeat's arrival (not the admission's instant, which begins no interval:
    /// the controller's start or a step boundary, unrelated to when the member sends).
    heard: bool,
    /// How much of the time since `last` the controller itself was stalled (a local pause, see
    /// [`super::Membership::handle_timeout`]): not the member's silence, which it adds to.
    excused: Duration,
    intervals_us: VecDeque<u64>,
    sum_us: u128,
    sum_sq_us: u128,
}

impl Arrivals {
    /// A member first heard at `now`, expected to send every `interval`: its history starts as two
    /// intervals `interval ± interval/4` (mean `interval`, σ `interval/4`, Akka's bootstrap), so the first
    /// heartbeats are judged by what they should be rather than by nothing.
    pub fn new(now: Duration, interval: Duration) -> Self {
        let us = interval.as_micros() as u64;
        let mut arrivals = Self {
            last: now,
            heard: false,
            excused: Duration::ZERO,
            intervals_us: VecDeque::new(),
            sum_us: 0,
            sum_sq_us: 0,
        };
        arrivals.push(us + us / 4);
        arrivals.push(us - us / 4);
        arrivals
    }

    /// The member was heard at `now`. The first arrival after admission only starts the history, and an
    /// interval during which the controller itself was stalled is no sample of the member's: its
    /// heartbeats waited, unread, and arrive together once the controller runs again.
    pub fn record(&mut self, now: Duration) {
        let interval = now.saturating_sub(self.last);
        self.last = self.last.max(now);
        let stalled = std::mem::take(&mut self.excused) > Duration::ZERO;
        if std::mem::replace(&mut self.heard, true) && !stalled {
            self.push(interval.as_micros() as u64);
        }
    }

    /// The controller was stalled for `pause` since the member was last heard: that time is not the
    /// member's silence (nothing could be heard).
    pub fn excuse(&mut self, pause: Duration) {
        self.excused += pause;
    }

    /// The member's silence at `now`: the time since it was last heard, less the controller's own
    /// stalls since then.
    pub fn silence(&self, now: Duration) -> Duration {
        now.saturating_sub(self.last).saturating_sub(self.excused)
    }

    /// When a silence of `allowed` since the member was last heard ends (its stalls excused).
    pub fn silent_until(&self, allowed: Duration) -> Duration {
        self.last + self.excused + allowed
    }

    /// Whether a heartbeat has arrived since admission (then the silence since [`Self::last`] ends an
    /// interval of the history; before, it ends at an arbitrary instant).
    pub fn heard(&self) -> bool {
        self.heard
    }

    /// When the member was last heard.
    pub fn last(&self) -> Duration {
        self.last
    }

    /// The mean and standard deviation of the recorded intervals, in microseconds.
    pub fn mean_and_std_dev_us(&self) -> (f64, f64) {
        let n = self.intervals_us.len() as f64;
        let mean = self.sum_us as f64 / n;
        let variance = (self.sum_sq_us as f64 / n - mean * mean).max(0.0);
        (mean, variance.sqrt())
    }

    /// The suspicion φ after `silence`, with σ at least `min_std_dev`.
    pub fn phi(&self, silence: Duration, min_std_dev: Duration) -> f64 {
        let (mean, std_dev) = self.std_dev_at_least(min_std_dev);
        let y = (silence.as_micros() as f64 - mean) / std_dev;
        let e = (-y * (A + B * y * y)).exp();
        if y > 0.0 {
            -(e / (1.0 + e)).log10()
        } else {
            -(1.0 - 1.0 / (1.0 + e)).log10()
        }
    }

    /// The silence at which φ reaches `threshold` (the inverse of [`Self::phi`]): `mean + y·σ` where
    /// `y (A + B y²) = ln((1 − p) / p)`, `p = 10^−threshold`.
    pub fn silence_at_phi(&self, threshold: f64, min_std_dev: Duration) -> Duration {
        let (mean, std_dev) = self.std_dev_at_least(min_std_dev);
        let p = 10f64.powf(-threshold);
        let c = ((1.0 - p) / p).ln();
        // B y³ + A y − c = 0: depressed cubic y³ + P y + Q with P > 0, one real root (Cardano).
        let (big_p, big_q) = (A / B, -c / B);
        let root = (big_q * big_q / 4.0 + big_p.powi(3) / 27.0).sqrt();
        let y = (-big_q / 2.0 + root).cbrt() + (-big_q / 2.0 - root).cbrt();
        Duration::from_micros((mean + y * std_dev).max(0.0) as u64)
    }

    fn std_dev_at_least(&self, min_std_dev: Duration) -> (f64, f64) {
        let (mean, std_dev) = self.mean_and_std_dev_us();
        (mean, std_dev.max(min_std_dev.as_micros() as f64).max(1.0))
    }

    fn push(&mut self, interval_us: u64) {
        if self.intervals_us.len() == WINDOW_SAMPLES {
            let old = self.intervals_us.pop_front().expect("a full window") as u128;
            self.sum_us -= old;
            self.sum_sq_us -= old * old;
        }
        self.intervals_us.push_back(interval_us);
        self.sum_us += interval_us as u128;
        self.sum_sq_us += (interval_us as u128) * (interval_us as u128);
    }
}

#[cfg(test)]
mod tests {
    use super::super::MembershipConfig;
    use super::*;

    const MS: fn(u64) -> Duration = Duration::from_millis;

    /// The detector's maths at the 750 ms floor these recorded sequences were written for (the default
    /// floor is 1000 ms since the second soak).
    fn phi_config() -> MembershipConfig {
        MembershipConfig {
            failure_detector: DetectorKind::PhiAccrual,
            failure_timeout_min_ms: 750,
            ..MembershipConfig::default()
        }
    }

    /// The history of a member heard at each of `arrivals_ms` (the first is when it was admitted).
    fn recorded(arrivals_ms: &[u64], interval_ms: u64) -> Arrivals {
        let mut a = Arrivals::new(MS(arrivals_ms[0]), MS(interval_ms));
        for &t in &arrivals_ms[1..] {
            a.record(MS(t));
        }
        a
    }

    /// Checks the silence `config` allows a member with this recorded history, in ms.
    fn check(arrivals_ms: &[u64], expected_ms: u64) {
        let config = phi_config();
        let a = recorded(arrivals_ms, config.heartbeat_interval_ms);
        assert_eq!(config.silence_allowed(&a).as_millis() as u64, expected_ms, "arrivals {arrivals_ms:?}");
    }

    #[test]
    fn phi_and_its_inverse_agree() {
        let a = recorded(&[0, 250, 510, 740, 1000, 1270, 1500], 250);
        for threshold in [1.0, 3.0, 8.0, 12.0] {
            let t = a.silence_at_phi(threshold, MS(50));
            let phi = a.phi(t, MS(50));
            // The deadline is whole microseconds: φ there is the threshold to within that rounding.
            assert!((phi - threshold).abs() < 1e-4, "φ({t:?}) = {phi}, expected {threshold}");
            assert!(a.phi(t - MS(1), MS(50)) < threshold && a.phi(t + MS(1), MS(50)) > threshold);
        }
        assert!(a.phi(MS(0), MS(50)) < 0.01, "no suspicion right after a heartbeat");
    }

    /// Steady heartbeats every 250 ms (σ 14 ms, from the bootstrap's two samples): σ is taken as 50 ms, φ = 8 at 250 + 5.2·50 ≈ 511 ms (5.2: the logistic approximation's quantile), below the
    /// 750 ms floor — the floor decides (the fixed detector would wait 1500 ms).
    #[test]
    fn steady_arrivals_are_judged_by_the_floor() {
        let steady: Vec<u64> = (0..40).map(|i| i * 250).collect();
        let a = recorded(&steady, 250);
        let (mean, std_dev) = a.mean_and_std_dev_us();
        assert!((mean - 250_000.0).abs() < 1.0 && std_dev < 15_000.0, "{mean} {std_dev}");
        assert_eq!(a.silence_at_phi(8.0, MS(50)).as_millis(), 511);
        check(&steady, 750);
    }

    /// Jittery heartbeats (a loaded machine: 250 ± up to 200 ms, recorded as a seeded sequence): σ ≈ 115 ms
    /// and the allowed silence grows past the floor, to mean + 5.2 σ.
    #[test]
    fn jittery_arrivals_widen_the_timeout() {
        let mut t = 0;
        let mut state = 0x2545_F491_4F6C_DD1Du64;
        let jittery: Vec<u64> = (0..60)
            .map(|_| {
                state ^= state << 13;
                state ^= state >> 7;
                state ^= state << 17;
                let arrival = t;
                t += 50 + state % 401;
                arrival
            })
            .collect();
        let a = recorded(&jittery, 250);
        let (mean, std_dev) = a.mean_and_std_dev_us();
        let allowed = phi_config().silence_allowed(&a);
        assert!(std_dev > 100_000.0, "σ {std_dev} µs");
        assert_eq!(allowed, a.silence_at_phi(8.0, MS(50)));
        assert!(allowed > MS(750) && allowed < MS(1500), "{allowed:?} (mean {mean} µs, σ {std_dev} µs)");
    }

    /// One gap of 1.2 s in a steady history of 20 heartbeats (a pause the member survived) raises σ to
    /// 200 ms: the next silence allowed is 1.36 s, near the ceiling; once the gap has left the window,
    /// the floor again.
    #[test]
    fn a_survived_gap_raises_the_timeout_until_it_leaves_the_window() {
        let mut arrivals: Vec<u64> = (0..20).map(|i| i * 250).collect();
        arrivals.push(4750 + 1200);
        check(&arrivals, 1357);
        let last = *arrivals.last().unwrap();
        arrivals.extend((1..=WINDOW_SAMPLES as u64).map(|i| last + i * 250));
        check(&arrivals, 750);
    }

    /// The fixed detector allows `failure_timeout_ms` whatever the history.
    #[test]
    fn the_fixed_detector_ignores_the_history() {
        let config = MembershipConfig { failure_detector: DetectorKind::Fixed, ..MembershipConfig::default() };
        for history in [vec![0, 250, 500], vec![0, 1200, 1300]] {
            assert_eq!(config.silence_allowed(&recorded(&history, 250)), MS(1500));
        }
    }

    /// A member just admitted is judged by the bootstrap history (mean = the interval, σ = interval/4).
    #[test]
    fn a_new_member_is_judged_by_the_expected_interval() {
        check(&[0], 750);
        let a = recorded(&[0], 250);
        let (mean, std_dev) = a.mean_and_std_dev_us();
        assert_eq!((mean, std_dev), (250_000.0, 62_500.0));
    }

    /// Old intervals leave the window; the sums stay exact.
    #[test]
    fn the_window_is_bounded() {
        let arrivals: Vec<u64> = (0..(3 * WINDOW_SAMPLES as u64)).map(|i| i * 100).collect();
        let a = recorded(&arrivals, 250);
        assert_eq!(a.intervals_us.len(), WINDOW_SAMPLES);
        assert_eq!(a.mean_and_std_dev_us(), (100_000.0, 0.0));
    }
}
