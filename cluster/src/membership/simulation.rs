//! Deterministic simulation of membership: a controller and N nodes on virtual time (1 ms ticks) over an
//! in-memory network that delays (and optionally drops) every message, with nodes crashing and pausing
//! (SIGSTOP-like: nothing processed, messages wait) at seeded times. Every run is a pure function of its
//! seed; a failing seed is printed by proptest and replays exactly.
//!
//! Invariants checked:
//! - every view change increments the epoch by exactly one;
//! - a crashed node is removed within `failure_timeout + max_delay + tick` of its crash (detection bound),
//!   and under `phi_accrual` on a steady network within `failure_timeout_min + max_delay + tick`;
//! - a pause shorter than `failure_timeout_min − interval − max_delay` never changes the view, under either
//!   detector;
//! - with no drops and `interval + max_delay < timeout`, no live, unpaused node is ever removed;
//! - a node paused beyond the timeout is fenced on resume and is a member again, in a newer epoch, within
//!   `2 × timeout` of resuming;
//! - once the network is quiet, every live node holds the controller's view, and views rank by node id.

use std::collections::BTreeMap;
use std::time::Duration;

use proptest::prelude::*;

use super::*;

const TICK: Duration = Duration::from_millis(1);

/// A small seeded generator for the simulation's choices (xorshift64*).
struct Rng(u64);

impl Rng {
    fn new(seed: u64) -> Self {
        Self(seed.wrapping_mul(0x9E37_79B9_7F4A_7C15) | 1)
    }
    fn below(&mut self, n: u64) -> u64 {
        self.0 ^= self.0 >> 12;
        self.0 ^= self.0 << 25;
        self.0 ^= self.0 >> 27;
        (self.0.wrapping_mul(0x2545_F491_4F6C_DD1D) >> 11) % n.max(1)
    }
}

#[derive(Clone, Debug)]
enum Message {
    ToController(MembershipEvent),
    View(View),
    Fence(Epoch),
}

#[derive(Clone, Copy, Debug, PartialEq)]
enum Fault {
    Crash { at_ms: u64 },
    Pause { at_ms: u64, for_ms: u64 },
}

struct Node {
    id: NodeId,
    state: MemberState,
    fault: Option<Fault>,
    inbox: Vec<(Duration, Message)>,
}

impl Node {
    fn crashed(&self, now: Duration) -> bool {
        matches!(self.fault, Some(Fault::Crash { at_ms }) if now >= Duration::from_millis(at_ms))
    }
    fn paused(&self, now: Duration) -> bool {
        matches!(self.fault, Some(Fault::Pause { at_ms, for_ms })
            if now >= Duration::from_millis(at_ms) && now < Duration::from_millis(at_ms + for_ms))
    }
}

struct Outcome {
    /// (when, view) for every view change.
    views: Vec<(Duration, View, Vec<Change>)>,
    final_views: Vec<(NodeId, Option<View>, bool)>,
    controller_view: View,
}

struct Sim {
    config: MembershipConfig,
    max_delay_ms: u64,
    drop_per_mille: u64,
    step_ms: u64,
}

impl Sim {
    fn run(&self, seed: u64, nodes: usize, faults: &[Option<Fault>], end: Duration) -> Outcome {
        let mut rng = Rng::new(seed);
        let ids: Vec<NodeId> = (0..nodes).map(|i| NodeId(format!("node-{i:02}"))).collect();
        let start = View::new(Epoch(1), ids.clone());
        let mut controller = Membership::new(self.config.clone(), Duration::ZERO, ids.clone());
        let mut controller_inbox: Vec<(Duration, Message)> = Vec::new();
        let mut nodes: Vec<Node> = ids
            .iter()
            .zip(faults)
            .map(|(id, &fault)| Node {
                id: id.clone(),
                state: MemberState::member(id.clone(), self.config.clone(), Duration::ZERO, start.clone(), 0),
                fault,
                inbox: Vec::new(),
            })
            .collect();
        let index: BTreeMap<NodeId, usize> = ids.iter().cloned().enumerate().map(|(i, n)| (n, i)).collect();
        let mut views = Vec::new();
        let mut now = Duration::ZERO;
        let quiet_from = end.saturating_sub(Duration::from_millis(3 * self.config.failure_timeout_ms));
        while now <= end {
            // Deliver due messages to the controller.
            let (due, later): (Vec<_>, Vec<_>) = controller_inbox.drain(..).partition(|(t, _)| *t <= now);
            controller_inbox = later;
            for (_, message) in due {
                if let Message::ToController(event) = message {
                    controller.handle(now, event);
                }
            }
            if (now.as_millis() as u64).is_multiple_of(self.step_ms) {
                controller.handle(now, MembershipEvent::StepBoundary);
            }
            // The controller's timer runs every tick (as node.rs's): a gap would be its own stall.
            controller.handle_timeout(now);
            while let Some(action) = controller.poll_action() {
                match action {
                    MembershipAction::ViewChanged { view, changes } => {
                        for member in view.members() {
                            let delay = self.delay(&mut rng, now >= quiet_from);
                            if let Some(delay) = delay {
                                nodes[index[member]].inbox.push((now + delay, Message::View(view.clone())));
                            }
                        }
                        views.push((now, view, changes));
                    }
                    MembershipAction::SendView { node, view } => {
                        if let Some(delay) = self.delay(&mut rng, now >= quiet_from) {
                            nodes[index[&node]].inbox.push((now + delay, Message::View(view)));
                        }
                    }
                    MembershipAction::Fence { node, current, .. } => {
                        if let Some(delay) = self.delay(&mut rng, now >= quiet_from) {
                            nodes[index[&node]].inbox.push((now + delay, Message::Fence(current)));
                        }
                    }
                }
            }
            // Nodes.
            for node in &mut nodes {
                if node.crashed(now) || node.paused(now) {
                    continue;
                }
                let (due, later): (Vec<_>, Vec<_>) = node.inbox.drain(..).partition(|(t, _)| *t <= now);
                node.inbox = later;
                for (_, message) in due {
                    match message {
                        Message::View(view) => node.state.handle_view(now, view),
                        Message::Fence(current) => node.state.handle_fence(now, current),
                        Message::ToController(_) => unreachable!("nodes receive no controller events"),
                    }
                }
                if node.state.poll_timeout() <= now {
                    node.state.handle_timeout(now);
                }
                while let Some(action) = node.state.poll_action() {
                    let event = match action {
                        MemberAction::SendHeartbeat { epoch } => {
                            MembershipEvent::Heartbeat { from: node.id.clone(), epoch }
                        }
                        MemberAction::SendJoinRequest { incarnation } => {
                            MembershipEvent::JoinRequest { from: node.id.clone(), incarnation: Some(incarnation) }
                        }
                        MemberAction::AdoptView(_)
                        | MemberAction::Fenced { .. }
                        | MemberAction::ControllerLost { .. } => continue,
                    };
                    if let Some(delay) = self.delay(&mut rng, now >= quiet_from) {
                        controller_inbox.push((now + delay, Message::ToController(event)));
                    }
                }
            }
            now += TICK;
        }
        let final_views = nodes.iter().map(|n| (n.id.clone(), n.state.view().cloned(), n.crashed(end))).collect();
        Outcome { views, final_views, controller_view: controller.view().clone() }
    }

    /// A message's delay, or None if the network drops it (never in the quiet tail of a run).
    fn delay(&self, rng: &mut Rng, quiet: bool) -> Option<Duration> {
        if !quiet && rng.below(1000) < self.drop_per_mille {
            return None;
        }
        Some(Duration::from_millis(rng.below(self.max_delay_ms + 1)))
    }
}

fn removal_time(outcome: &Outcome, node: &NodeId, after: Duration) -> Option<Duration> {
    outcome.views.iter().find(|(t, view, _)| *t >= after && !view.contains(node)).map(|(t, _, _)| *t)
}

fn check_epochs_step_by_one(outcome: &Outcome, seed: u64) {
    let mut epoch = 1;
    for (t, view, changes) in &outcome.views {
        assert_eq!(view.epoch.0, epoch + 1, "seed {seed}: view at {t:?} skipped an epoch ({changes:?})");
        assert!(view.members().windows(2).all(|w| w[0] < w[1]), "seed {seed}: members not in node-id order");
        epoch = view.epoch.0;
    }
}

/// Runs `nodes` nodes of which about a third crash (drawn from `draw`), and checks that every crash is
/// detected within `bound` of it, that no live node is ever removed and that epochs step by one.
fn crashes_found_within(
    sim: &Sim,
    draw: u64,
    seed: u64,
    nodes: usize,
    bound: Duration,
) -> Result<(Outcome, Vec<Option<Fault>>), TestCaseError> {
    let mut rng = Rng::new(draw);
    let faults: Vec<Option<Fault>> =
        (0..nodes).map(|_| (rng.below(3) == 0).then(|| Fault::Crash { at_ms: 200 + rng.below(3000) })).collect();
    let outcome = sim.run(seed, nodes, &faults, Duration::from_secs(8));
    check_epochs_step_by_one(&outcome, seed);
    for (i, fault) in faults.iter().enumerate() {
        let id = NodeId(format!("node-{i:02}"));
        match fault {
            Some(Fault::Crash { at_ms }) => {
                let crash = Duration::from_millis(*at_ms);
                let removed = removal_time(&outcome, &id, crash)
                    .unwrap_or_else(|| panic!("seed {seed}: crashed {id} never removed"));
                prop_assert!(
                    removed <= crash + bound,
                    "seed {seed}: {id} crashed at {crash:?}, removed at {removed:?}"
                );
            }
            _ => prop_assert!(
                removal_time(&outcome, &id, Duration::ZERO).is_none(),
                "seed {seed}: live {id} was removed"
            ),
        }
    }
    Ok((outcome, faults))
}

fn reliable() -> Sim {
    let config = MembershipConfig { failure_detector: DetectorKind::Fixed, ..MembershipConfig::default() };
    Sim { config, max_delay_ms: 100, drop_per_mille: 0, step_ms: 100 }
}

proptest! {
    #![proptest_config(ProptestConfig { cases: 200, failure_persistence: None, ..ProptestConfig::default() })]

    /// Crashes are detected within the bound; nothing else is ever removed; epochs step by one.
    #[test]
    fn crashes_are_detected_in_time_and_nothing_else_is_removed(seed in any::<u64>(), nodes in 2usize..7) {
        let sim = reliable();
        let bound = Duration::from_millis(sim.config.failure_timeout_ms + sim.max_delay_ms) + TICK;
        let (outcome, faults) = crashes_found_within(&sim, seed ^ 0xC4A5, seed, nodes, bound)?;
        for (i, _) in faults.iter().enumerate().filter(|(_, f)| f.is_none()) {
            let (_, view, _) = &outcome.final_views[i];
            prop_assert_eq!(view.as_ref(), Some(&outcome.controller_view), "seed {}: node-{:02} lags", seed, i);
        }
    }

    /// A node paused past the timeout is removed, fenced on resume, and readmitted in a newer epoch.
    #[test]
    fn paused_nodes_are_fenced_and_rejoin(seed in any::<u64>(), nodes in 2usize..6, pause_ms in 1700u64..4000) {
        let sim = reliable();
        let mut faults = vec![None; nodes];
        let victim = (seed % nodes as u64) as usize;
        faults[victim] = Some(Fault::Pause { at_ms: 500, for_ms: pause_ms });
        let outcome = sim.run(seed, nodes, &faults, Duration::from_millis(500 + pause_ms + 6000));
        check_epochs_step_by_one(&outcome, seed);
        let id = NodeId(format!("node-{victim:02}"));
        let removed = removal_time(&outcome, &id, Duration::ZERO).expect("paused node removed");
        let resumed = Duration::from_millis(500 + pause_ms);
        prop_assert!(removed < resumed, "seed {seed}: removal must happen during the pause");
        let (rejoined_at, rejoined) = outcome
            .views
            .iter()
            .find(|(t, view, _)| *t > removed && view.contains(&id))
            .map(|(t, v, _)| (*t, v.clone()))
            .unwrap_or_else(|| panic!("seed {seed}: {id} never rejoined"));
        prop_assert!(rejoined_at <= resumed + 2 * sim.config.failure_timeout(), "seed {seed}: rejoined late at {rejoined_at:?}");
        prop_assert!(rejoined.epoch.0 >= 3);
        for (node, view, _) in &outcome.final_views {
            prop_assert_eq!(view.as_ref(), Some(&outcome.controller_view), "seed {}: {} lags", seed, node);
        }
    }

    /// On a very lossy network (30% drops, up to 300 ms delay) live nodes are removed spuriously, fenced
    /// and readmitted; epochs still step by one and, once the network is quiet, every node is a member
    /// again and holds the controller's view.
    #[test]
    fn lossy_networks_converge(seed in any::<u64>(), nodes in 2usize..6) {
        let sim = Sim { drop_per_mille: 300, max_delay_ms: 300, ..reliable() };
        let outcome = sim.run(seed, nodes, &vec![None; nodes], Duration::from_secs(12));
        check_epochs_step_by_one(&outcome, seed);
        prop_assert_eq!(outcome.controller_view.len(), nodes, "seed {}: not everyone is back", seed);
        for (node, view, _) in &outcome.final_views {
            prop_assert_eq!(view.as_ref(), Some(&outcome.controller_view), "seed {}: {} lags", seed, node);
        }
    }
}

/// The reliable network with the default detector (`phi_accrual`, floor 1000 ms, ceiling 1500 ms).
fn adaptive() -> Sim {
    let config = MembershipConfig { failure_detector: DetectorKind::PhiAccrual, ..MembershipConfig::default() };
    Sim { config, ..reliable() }
}

proptest! {
    #![proptest_config(ProptestConfig { cases: 200, failure_persistence: None, ..ProptestConfig::default() })]

    /// Under `phi_accrual` on a steady network (delays 0–100 ms), a crash is detected by the floor — two
    /// thirds of the fixed timeout — and no live node is ever removed.
    #[test]
    fn the_adaptive_detector_finds_crashes_by_the_floor_and_nothing_else(seed in any::<u64>(), nodes in 2usize..7) {
        let sim = adaptive();
        let bound = Duration::from_millis(sim.config.failure_timeout_min_ms + sim.max_delay_ms) + TICK;
        crashes_found_within(&sim, seed ^ 0xF1, seed, nodes, bound)?;
    }

    /// A pause shorter than the floor less an interval and the delay is never fatal, under either
    /// detector; a pause past the ceiling is fenced, and the node rejoins.
    #[test]
    fn pauses_below_the_floor_stay_and_beyond_the_ceiling_are_fenced(
        seed in any::<u64>(), nodes in 2usize..6, short_ms in 0u64..400, long_ms in 1700u64..4000,
    ) {
        for sim in [adaptive(), reliable()] {
            let victim = (seed % nodes as u64) as usize;
            let id = NodeId(format!("node-{victim:02}"));
            let mut faults = vec![None; nodes];
            faults[victim] = Some(Fault::Pause { at_ms: 500, for_ms: short_ms });
            let outcome = sim.run(seed, nodes, &faults, Duration::from_secs(4));
            prop_assert!(outcome.views.is_empty(), "seed {seed}: a {short_ms} ms pause changed the view: {:?}", outcome.views);
            faults[victim] = Some(Fault::Pause { at_ms: 500, for_ms: long_ms });
            let outcome = sim.run(seed, nodes, &faults, Duration::from_millis(500 + long_ms + 6000));
            check_epochs_step_by_one(&outcome, seed);
            let removed = removal_time(&outcome, &id, Duration::ZERO).expect("paused node removed");
            prop_assert!(removed < Duration::from_millis(500 + long_ms), "seed {seed}: removal must happen during the pause");
            prop_assert_eq!(outcome.controller_view.len(), nodes, "seed {}: {} did not rejoin", seed, id);
        }
    }
}

/// The lossy scenario must actually exercise removal, fencing and readmission, or it proves little.
#[test]
fn lossy_networks_do_cause_view_changes_in_some_seeds() {
    let sim = Sim { drop_per_mille: 300, max_delay_ms: 300, ..reliable() };
    let changed =
        (0..50u64).filter(|&seed| !sim.run(seed, 4, &[None; 4], Duration::from_secs(12)).views.is_empty()).count();
    assert!(changed >= 5, "only {changed} of 50 lossy runs changed a view");
}
