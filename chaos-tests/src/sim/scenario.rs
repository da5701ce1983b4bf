//! What one run simulates: the cluster (node 0 is the controller), the job, and the fault schedule — all
//! drawn from the seed by [`Scenario::random`], or written out by hand for a directed test.

use troupe_actors::runtime::job::RESUME_GRACE;
use troupe_cluster::membership::NodeId;

use super::rng::Rng;

/// Recovery allowed after the last fault is over, on top of the job's own run time: failure detection,
/// reconnection, a rejoin at the next step boundary and a new attempt all fit well inside it.
pub const RECOVERY_MS: u64 = 5_000;

#[derive(Clone, Debug, PartialEq, Eq)]
pub struct NodeSpec {
    pub name: NodeId,
    /// Device slots: one worker (and at most one rank) each.
    pub slots: u32,
}

/// One thing the adversary does. `node` indexes [`Scenario::nodes`]; node 0, the controller, is paused,
/// cut off, and crashed — always with a restart: it restarts from its catalog (there is no standby
/// controller) — but never drained here; its workers may fail or straggle too.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Fault {
    /// SIGKILL: the process and its state are gone; a new incarnation starts after `restart_after_ms`.
    Crash { node: usize, at_ms: u64, restart_after_ms: Option<u64> },
    /// SIGSTOP for `for_ms`, then SIGCONT: nothing runs, messages wait in the socket.
    Pause { node: usize, at_ms: u64, for_ms: u64 },
    /// The node is cut off from every other node (control and data plane) for `for_ms`.
    Isolate { node: usize, at_ms: u64, for_ms: u64 },
    /// The node's control connection to the controller is reset: both sides lose it and what was in
    /// flight on it — the controller's side at once, or (half the time: the close frame was lost) only
    /// when it next sends on it, at its idle timeout, or when the node's newer connection replaces it.
    DropConnection { node: usize, at_ms: u64 },
    /// A worker's handler panics: the node restarts it empty and reports its attempt failed.
    WorkerPanic { node: usize, slot: u32, at_ms: u64 },
    /// SIGTERM: the node drains (leaves cleanly); a new incarnation joins after `rejoin_after_ms`.
    Leave { node: usize, at_ms: u64, rejoin_after_ms: Option<u64> },
    /// Every step this node's workers start during the window computes `extra_ms` longer.
    Straggle { node: usize, at_ms: u64, for_ms: u64, extra_ms: u64 },
    /// The node's control connection is slow (each message `extra_ms` later, order kept) for `for_ms`.
    SlowLink { node: usize, at_ms: u64, for_ms: u64, extra_ms: u64 },
}

impl Fault {
    pub fn at_ms(&self) -> u64 {
        match *self {
            Fault::Crash { at_ms, .. }
            | Fault::Pause { at_ms, .. }
            | Fault::Isolate { at_ms, .. }
            | Fault::DropConnection { at_ms, .. }
            | Fault::WorkerPanic { at_ms, .. }
            | Fault::Leave { at_ms, .. }
            | Fault::Straggle { at_ms, .. }
            | Fault::SlowLink { at_ms, .. } => at_ms,
        }
    }

    /// A crash without restart, or a leave without rejoin.
    pub fn never_back(&self) -> bool {
        matches!(self, Fault::Crash { restart_after_ms: None, .. } | Fault::Leave { rejoin_after_ms: None, .. })
    }

    /// When the fault is over (a node that never comes back counts as over once it is gone).
    pub fn over_at_ms(&self) -> u64 {
        match *self {
            Fault::Crash { at_ms, restart_after_ms, .. } => at_ms + restart_after_ms.unwrap_or(0),
            Fault::Leave { at_ms, rejoin_after_ms, .. } => at_ms + rejoin_after_ms.unwrap_or(0),
            Fault::Pause { at_ms, for_ms, .. }
            | Fault::Isolate { at_ms, for_ms, .. }
            | Fault::Straggle { at_ms, for_ms, .. }
            | Fault::SlowLink { at_ms, for_ms, .. } => at_ms + for_ms,
            Fault::DropConnection { at_ms, .. } | Fault::WorkerPanic { at_ms, .. } => at_ms,
        }
    }
}

#[derive(Clone, Debug, PartialEq, Eq)]
pub struct Scenario {
    /// Node 0 is the controller (the daemon started without `join`); it also has workers.
    pub nodes: Vec<NodeSpec>,
    /// Steps of the job.
    pub steps: u64,
    /// The job's `max_ranks` (0: every slot); below the slots of the cluster, some slots are spares.
    pub max_ranks: usize,
    /// One step's compute, uniform in this range, per rank and step.
    pub step_ms_min: u64,
    pub step_ms_max: u64,
    /// The job's durable checkpoints: `checkpoint.every_steps` (0: only at the end), or none at all.
    pub checkpoint_every: Option<u64>,
    pub faults: Vec<Fault>,
    /// Controller-eligible nodes (node.toml `controllers`): 1 is one controller, node 0, restarting
    /// from its catalog; 3 or 5 are nodes `0..controllers`, a Raft group whose leader is the controller.
    pub controllers: usize,
}

impl Scenario {
    /// A fault-free cluster of `nodes` nodes with one slot each.
    pub fn calm(nodes: usize, steps: u64) -> Self {
        Scenario {
            nodes: (0..nodes).map(|i| NodeSpec { name: NodeId(format!("node-{i}")), slots: 1 }).collect(),
            steps,
            max_ranks: 0,
            step_ms_min: 20,
            step_ms_max: 80,
            checkpoint_every: None,
            faults: Vec::new(),
            controllers: 1,
        }
    }

    /// A random cluster (2–5 nodes, 1–2 slots each, the controller's name anywhere in the node-id
    /// order), job (8–30 steps, sometimes capped below the cluster's slots) and 0–4 faults.
    pub fn random(seed: u64) -> Self {
        let mut rng = Rng::new(seed ^ 0x5EED_5CE7_A810);
        let count = rng.range(2, 5) as usize;
        let mut names: Vec<String> = (0..count).map(|i| format!("node-{}", (b'a' + i as u8) as char)).collect();
        // The controller is node 0 whatever its name: rotate which name it gets.
        names.rotate_left(rng.below(count as u64) as usize);
        let nodes: Vec<NodeSpec> = names
            .into_iter()
            .map(|name| NodeSpec { name: NodeId(name), slots: if rng.chance(300) { 2 } else { 1 } })
            .collect();
        let slots: u64 = nodes.iter().map(|n| u64::from(n.slots)).sum();
        let max_ranks = if slots > 1 && rng.chance(350) { rng.range(1, slots - 1) as usize } else { 0 };
        let steps = rng.range(8, 30);
        let step_ms_min = rng.range(15, 60);
        let step_ms_max = step_ms_min + rng.range(0, 120);
        let checkpoint_every = rng.chance(400).then(|| rng.range(0, 5));
        let job_ms = steps * step_ms_max;
        let mut faults = Vec::new();
        let wanted = [0, 1, 1, 2, 2, 3, 4][rng.below(7) as usize];
        let mut panics = vec![0; count];
        while faults.len() < wanted {
            let at_ms = rng.range(30, job_ms.max(500) + 1500);
            let node = rng.range(1, count as u64 - 1) as usize;
            let any_node = rng.below(count as u64) as usize;
            let paused = if any_node == 0 { 0 } else { node };
            let fault = match rng.below(100) {
                0..=15 => Fault::Crash { node, at_ms, restart_after_ms: rng.chance(700).then(|| rng.range(50, 3000)) },
                // The controller's node is paused too, as often as any other (it is not drained here).
                16..=30 => Fault::Pause { node: paused, at_ms, for_ms: rng.range(100, 4000) },
                // The controller's node is cut off too, now and then.
                31..=45 => {
                    let node = if rng.chance(150) { 0 } else { node };
                    Fault::Isolate { node, at_ms, for_ms: rng.range(100, 5000) }
                }
                46..=55 => Fault::DropConnection { node, at_ms },
                56..=65 => {
                    // The restart policy allows 3 per 60 s; stay under it (escalation is a crash).
                    if panics[any_node] == 3 {
                        continue;
                    }
                    panics[any_node] += 1;
                    let slot = rng.below(u64::from(nodes[any_node].slots)) as u32;
                    Fault::WorkerPanic { node: any_node, slot, at_ms }
                }
                66..=73 => Fault::Leave { node, at_ms, rejoin_after_ms: rng.chance(600).then(|| rng.range(50, 2000)) },
                74..=88 => {
                    Fault::Straggle { node: any_node, at_ms, for_ms: rng.range(0, 600), extra_ms: rng.range(300, 2500) }
                }
                // The controller's daemon is killed and restarted (systemd) on the same data dir.
                89..=93 => Fault::Crash { node: 0, at_ms, restart_after_ms: Some(rng.range(50, 3000)) },
                _ => Fault::SlowLink { node, at_ms, for_ms: rng.range(200, 3000), extra_ms: rng.range(20, 600) },
            };
            faults.push(fault);
        }
        // A node that is down (crashed or left) is not faulted again before it is back, and a node is not
        // paused twice at once: each incarnation's story stays simple to read.
        faults.sort_by_key(Fault::at_ms);
        let mut kept: Vec<Fault> = Vec::new();
        for f in faults {
            let node = fault_node(&f);
            let clash = kept.iter().filter(|k| fault_node(k) == node).any(|k| match (k, &f) {
                (Fault::Crash { .. } | Fault::Leave { .. }, _) => f.at_ms() <= k.over_at_ms() + 1 || k.never_back(),
                (Fault::Pause { .. }, Fault::Pause { .. }) => f.at_ms() <= k.over_at_ms(),
                _ => false,
            });
            // Workers of a node that is down cannot panic or straggle either.
            if !clash {
                kept.push(f);
            }
        }
        Scenario { nodes, steps, max_ranks, step_ms_min, step_ms_max, checkpoint_every, faults: kept, controllers: 1 }
    }

    /// Three controllers (nodes 0–2, node-a lowest-named: it stands first) and 0–2 more nodes, a job
    /// and 1–4 faults: the controllers killed (for good, or restarted), paused and cut off — so the
    /// leader is, whoever it is by then — and the other nodes' faults. At most one controller is
    /// killed for good (two of three keep a majority); a node that is not a controller is not restarted
    /// after node-a, the address its `join` names, is gone for good (it would know no other).
    pub fn random_replicated(seed: u64) -> Self {
        let mut rng = Rng::new(seed ^ 0x3C0_7201_1E25);
        let count = 3 + rng.below(3) as usize;
        let nodes: Vec<NodeSpec> = (0..count)
            .map(|i| NodeSpec {
                name: NodeId(format!("node-{}", (b'a' + i as u8) as char)),
                slots: 1 + u32::from(rng.chance(250)),
            })
            .collect();
        let steps = rng.range(8, 30);
        let step_ms_min = rng.range(15, 60);
        let step_ms_max = step_ms_min + rng.range(0, 120);
        let job_ms = steps * step_ms_max;
        let mut faults: Vec<Fault> = Vec::new();
        let wanted = 1 + rng.below(4) as usize;
        let mut killed_for_good = false;
        while faults.len() < wanted {
            let at_ms = rng.range(300, job_ms.max(500) + 1500);
            let ctrl = rng.below(3) as usize;
            let other = if count > 3 { 3 + rng.below(count as u64 - 3) as usize } else { ctrl };
            let fault = match rng.below(100) {
                0..=24 if !killed_for_good => {
                    let restart = rng.chance(400).then(|| rng.range(50, 3000));
                    killed_for_good |= restart.is_none();
                    Fault::Crash { node: ctrl, at_ms, restart_after_ms: restart }
                }
                0..=44 => Fault::Pause { node: ctrl, at_ms, for_ms: rng.range(300, 4000) },
                45..=69 => Fault::Isolate { node: ctrl, at_ms, for_ms: rng.range(300, 5000) },
                70..=77 => Fault::Crash { node: other, at_ms, restart_after_ms: Some(rng.range(50, 3000)) },
                78..=85 => Fault::DropConnection { node: other, at_ms },
                86..=92 => Fault::WorkerPanic { node: rng.below(count as u64) as usize, slot: 0, at_ms },
                _ => Fault::SlowLink { node: other, at_ms, for_ms: rng.range(200, 3000), extra_ms: rng.range(20, 600) },
            };
            faults.push(fault);
        }
        faults.sort_by_key(Fault::at_ms);
        let mut kept: Vec<Fault> = Vec::new();
        for f in faults {
            let node = fault_node(&f);
            let clash = kept.iter().any(|k| {
                let same = fault_node(k) == node;
                let down = matches!(k, Fault::Crash { .. }) && (f.at_ms() <= k.over_at_ms() + 1 || k.never_back());
                let paused =
                    matches!((k, &f), (Fault::Pause { .. }, Fault::Pause { .. })) && f.at_ms() <= k.over_at_ms();
                (same && (down || paused)) || orphaned(k, &f) || orphaned(&f, k)
            });
            if !clash {
                kept.push(f);
            }
        }
        Scenario {
            nodes,
            steps,
            max_ranks: 0,
            step_ms_min,
            step_ms_max,
            checkpoint_every: None,
            faults: kept,
            controllers: 3,
        }
    }

    /// When the last fault is over.
    pub fn heal_ms(&self) -> u64 {
        self.faults.iter().map(Fault::over_at_ms).max().unwrap_or(0)
    }

    /// The job must have ended by then: every fault over, plus the job's own run time, plus
    /// [`RECOVERY_MS`] — and, when the controller restarted, the grace a restored job waits for the
    /// nodes of its last view ([`RESUME_GRACE`]: one of them may never come back).
    pub fn finish_bound_ms(&self) -> u64 {
        let straggle: u64 = self
            .faults
            .iter()
            .map(|f| match f {
                Fault::Straggle { extra_ms, .. } => *extra_ms,
                _ => 0,
            })
            .sum();
        let grace = self.controller_restarts() as u64 * RESUME_GRACE.as_millis() as u64;
        // Replicated: each controller fault may cost an election (two timeouts past the lease) and a
        // restored job's grace.
        let takeovers = match self.controllers {
            0 | 1 => 0,
            k => self.faults.iter().filter(|f| fault_node(f) < k).count() as u64,
        };
        let grace = grace + takeovers * (RESUME_GRACE.as_millis() as u64 + 3_000);
        self.heal_ms() + self.steps * (self.step_ms_max + 30) + straggle + RECOVERY_MS + grace
    }

    /// When `node`'s daemon, killed before `t_ms` and not yet back, restarts.
    pub fn back_at(&self, node: usize, t_ms: u64) -> Option<u64> {
        self.faults.iter().find_map(|f| match *f {
            Fault::Crash { node: n, at_ms, restart_after_ms: Some(after) }
                if n == node && (at_ms..at_ms + after).contains(&t_ms) =>
            {
                Some(at_ms + after)
            }
            _ => None,
        })
    }

    /// How often the controller's daemon is killed (and restarted), with one controller.
    pub fn controller_restarts(&self) -> usize {
        if self.controllers > 1 {
            return 0;
        }
        self.faults.iter().filter(|f| matches!(f, Fault::Crash { node: 0, .. })).count()
    }

    /// Whether `node` is cut off at `t_ms`, and until when.
    pub fn isolated_until(&self, node: usize, t_ms: u64) -> Option<u64> {
        self.faults
            .iter()
            .filter_map(|f| match *f {
                Fault::Isolate { node: n, at_ms, for_ms } if n == node && (at_ms..at_ms + for_ms).contains(&t_ms) => {
                    Some(at_ms + for_ms)
                }
                _ => None,
            })
            .max()
    }

    /// Whether nodes `a` and `b` are cut off from each other at `t_ms` — either cut off — and until when.
    pub fn cut_until(&self, a: usize, b: usize, t_ms: u64) -> Option<u64> {
        [self.isolated_until(a, t_ms), self.isolated_until(b, t_ms)].into_iter().flatten().max()
    }

    /// Extra delay of the node's control connection at `t_ms`.
    pub fn slow_link_ms(&self, node: usize, t_ms: u64) -> u64 {
        self.faults
            .iter()
            .filter_map(|f| match *f {
                Fault::SlowLink { node: n, at_ms, for_ms, extra_ms }
                    if n == node && (at_ms..at_ms + for_ms).contains(&t_ms) =>
                {
                    Some(extra_ms)
                }
                _ => None,
            })
            .max()
            .unwrap_or(0)
    }

    /// Extra compute of a step the node's workers start at `t_ms`.
    pub fn straggle_ms(&self, node: usize, t_ms: u64) -> u64 {
        self.faults
            .iter()
            .filter_map(|f| match *f {
                Fault::Straggle { node: n, at_ms, for_ms, extra_ms }
                    if n == node && (at_ms..=at_ms + for_ms).contains(&t_ms) =>
                {
                    Some(extra_ms)
                }
                _ => None,
            })
            .max()
            .unwrap_or(0)
    }

    /// Faults that can destroy committed state or make attempts fail on their own.
    pub fn harmful_faults(&self) -> usize {
        self.faults.iter().filter(|f| !matches!(f, Fault::Straggle { .. } | Fault::SlowLink { .. })).count()
    }
}

/// Replicated controllers: `other` restarts a node that is not a controller (nodes 3 and up) after
/// `kill` took node-a, the address its `join` names, for good: it would know no controller to dial.
fn orphaned(kill: &Fault, other: &Fault) -> bool {
    let gone = match *kill {
        Fault::Crash { node: 0, at_ms, restart_after_ms: None } => at_ms,
        _ => return false,
    };
    matches!(*other, Fault::Crash { node, restart_after_ms: Some(_), .. } if node >= 3 && other.over_at_ms() >= gone)
}

pub fn fault_node(f: &Fault) -> usize {
    match *f {
        Fault::Crash { node, .. }
        | Fault::Pause { node, .. }
        | Fault::Isolate { node, .. }
        | Fault::DropConnection { node, .. }
        | Fault::WorkerPanic { node, .. }
        | Fault::Leave { node, .. }
        | Fault::Straggle { node, .. }
        | Fault::SlowLink { node, .. } => node,
    }
}
