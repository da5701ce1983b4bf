//! The replicated controller's Raft group, modelled by the guarantees openraft gives (see the module
//! docs of [`super`] for why a model and not openraft itself). The controllers are nodes `0..k` of the
//! run; each holds what openraft keeps in its redb (term, vote, log, committed index — all durable:
//! they survive a crash) and what it knows while it runs (role, leader, when it last heard one).
//!
//! The model moves in rounds the world calls (`tick` every heartbeat, `replicate` a round trip after a
//! proposal) and sees the network as the world does at that instant: two controllers reach each other
//! when both run (up, not paused) and neither is cut off. What it guarantees, and the runtime relies on:
//! - **One leader per term**: a candidate needs a majority of votes, each controller votes once per
//!   term, and a term only rises.
//! - **Leader lease**: a controller that heard a leader within `election_max_ms` refuses to vote
//!   (openraft's lease), so a leader that reaches a majority is never deposed, and a silent one is
//!   replaced `election_max_ms` to `2 × election_max_ms` after its last heartbeat.
//! - **Election restriction**: a vote goes only to a candidate whose log is at least as up to date
//!   (last term, then length), so a new leader holds every committed entry.
//! - **Commit**: an entry commits once a majority holds it and it is of the leader's current term (a
//!   new leader commits its predecessors' entries with a blank entry of its own, as openraft does);
//!   a proposal is answered once committed, `NotLeader` once its leader lost its term, `NotCommitted`
//!   after `propose_ms`. A deposed leader's entries are overwritten by the new leader's log.
//! - **Leadership watch**: each running controller learns `(term, leader)` when it changes; it names
//!   itself only once its blank entry committed (openraft's `ensure_linearizable`, which the node's
//!   `state()` read waits for).

use troupe_actors::catalog::StoredView;
use troupe_actors::protocol::JobInfo;

use super::rng::Rng;

/// What the group replicates: the controller's two catalog writes, and a new leader's blank entry.
#[derive(Clone, Debug)]
pub(super) enum Write {
    Blank,
    View(StoredView),
    Job(Box<JobInfo>),
}

#[derive(Clone, Copy, Debug, PartialEq, Eq)]
enum Role {
    Follower,
    Candidate,
    Leader,
}

/// The group's timing (actors/src/runtime/raft/group.rs `RaftTiming`'s defaults).
#[derive(Clone, Copy, Debug)]
pub struct RaftTiming {
    pub heartbeat_ms: u64,
    pub election_min_ms: u64,
    pub election_max_ms: u64,
    pub propose_ms: u64,
}

impl Default for RaftTiming {
    fn default() -> Self {
        RaftTiming { heartbeat_ms: 100, election_min_ms: 400, election_max_ms: 800, propose_ms: 5_000 }
    }
}

/// One controller's Raft state.
#[derive(Debug)]
pub(super) struct Peer {
    // Durable (redb): survive a crash.
    pub term: u64,
    voted_for: Option<usize>,
    /// `(term, write)`; entry `i` has log index `i + 1`.
    pub log: Vec<(u64, Write)>,
    /// How many entries this controller knows committed.
    pub commit: usize,
    // Volatile.
    role: Role,
    leader: Option<usize>,
    heard_at: u64,
    election_at: u64,
    told: Option<Watch>,
}

/// What a controller's leadership watch says.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub(super) struct Watch {
    pub term: u64,
    pub leader: Option<usize>,
}

/// Who waits for a proposal: the node actor (a view) or its job controller of that incarnation.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub(super) enum Proposer {
    View,
    Job { jc: u32 },
}

#[derive(Debug)]
struct Pending {
    node: usize,
    index: usize,
    term: u64,
    deadline: u64,
    by: Proposer,
}

/// What the world carries out.
#[derive(Debug)]
pub(super) enum RaftOut {
    Decided { node: usize, by: Proposer, result: Result<(), String> },
    Leadership { node: usize, watch: Watch },
}

/// Which controllers run, and which pairs reach each other, at this instant.
pub(super) struct Net {
    pub runs: Vec<bool>,
    pub reach: Vec<Vec<bool>>,
}

#[derive(Debug)]
pub(super) struct RaftModel {
    pub peers: Vec<Peer>,
    pending: Vec<Pending>,
    pub timing: RaftTiming,
    pub elections: u64,
}

impl RaftModel {
    /// `k` controllers, none elected yet; controller 0 (the lowest-named) initialises the group and
    /// stands at once (openraft's `initialize`), the others after an election timeout.
    pub fn new(k: usize, timing: RaftTiming, rng: &mut Rng) -> Self {
        let peers = (0..k)
            .map(|c| Peer {
                term: 0,
                voted_for: None,
                log: Vec::new(),
                commit: 0,
                role: Role::Follower,
                leader: None,
                heard_at: 0,
                election_at: if c == 0 { 0 } else { rng.range(timing.election_min_ms, timing.election_max_ms) },
                told: None,
            })
            .collect();
        RaftModel { peers, pending: Vec::new(), timing, elections: 0 }
    }

    fn majority(&self) -> usize {
        self.peers.len() / 2 + 1
    }

    fn timeout(&self, rng: &mut Rng) -> u64 {
        rng.range(self.timing.election_min_ms, self.timing.election_max_ms)
    }

    /// A heartbeat round: every running leader replicates; every running follower whose election
    /// timeout passed stands; proposals past their deadline fail.
    pub fn tick(&mut self, now: u64, net: &Net, rng: &mut Rng) -> Vec<RaftOut> {
        for c in 0..self.peers.len() {
            if net.runs[c] && self.peers[c].role == Role::Leader {
                self.replicate_from(c, now, net, rng);
            }
        }
        for c in 0..self.peers.len() {
            if net.runs[c] && self.peers[c].role != Role::Leader && now >= self.peers[c].election_at {
                self.stand(c, now, net, rng);
            }
        }
        self.outcomes(now, net)
    }

    /// A round trip after a proposal of leader `c`: it replicates at once (not at the next heartbeat).
    pub fn replicate(&mut self, c: usize, now: u64, net: &Net, rng: &mut Rng) -> Vec<RaftOut> {
        if net.runs[c] && self.peers[c].role == Role::Leader {
            self.replicate_from(c, now, net, rng);
        }
        self.outcomes(now, net)
    }

    /// Leader `c` sends AppendEntries to every controller it reaches: one with a higher term deposes
    /// it; the others adopt its term and log (Raft's log matching, in one step) and reset their
    /// election timers. The highest entry of its own term that a majority holds commits.
    fn replicate_from(&mut self, c: usize, now: u64, net: &Net, rng: &mut Rng) {
        let term = self.peers[c].term;
        let mut acked = 1;
        for f in (0..self.peers.len()).filter(|&f| f != c && net.reach[c][f]) {
            if self.peers[f].term > term {
                let higher = self.peers[f].term;
                self.follow(c, higher, None, now, rng);
                return;
            }
            let log = self.peers[c].log.clone();
            let timeout = self.timeout(rng);
            let p = &mut self.peers[f];
            if p.term < term {
                p.voted_for = None;
            }
            (p.term, p.role, p.leader, p.heard_at, p.election_at) = (term, Role::Follower, Some(c), now, now + timeout);
            p.log = log;
            acked += 1;
        }
        let majority = self.majority();
        let leader = &mut self.peers[c];
        leader.heard_at = now;
        let len = leader.log.len();
        if acked >= majority && len > leader.commit && leader.log[len - 1].0 == term {
            leader.commit = len;
        }
        let commit = leader.commit;
        for f in (0..self.peers.len()).filter(|&f| f != c && net.reach[c][f]) {
            let p = &mut self.peers[f];
            p.commit = p.commit.max(commit.min(p.log.len()));
        }
    }

    /// Controller `c` learns of `term` (and who leads it, if known): it follows.
    fn follow(&mut self, c: usize, term: u64, leader: Option<usize>, now: u64, rng: &mut Rng) {
        let timeout = self.timeout(rng);
        let p = &mut self.peers[c];
        if term > p.term {
            p.voted_for = None;
        }
        (p.term, p.role, p.leader, p.election_at) = (term, Role::Follower, leader, now + timeout);
    }

    /// Controller `c` stands for the next term: it wins with a majority of votes (its own and those of
    /// controllers it reaches that are past the leader lease, have not voted in the term and hold no
    /// more up-to-date log), appends its blank entry and replicates at once.
    fn stand(&mut self, c: usize, now: u64, net: &Net, rng: &mut Rng) {
        self.elections += 1;
        let term = self.peers[c].term + 1;
        let timeout = self.timeout(rng);
        let me = &mut self.peers[c];
        (me.term, me.voted_for, me.role, me.leader, me.election_at) =
            (term, Some(c), Role::Candidate, None, now + timeout);
        let last = last_id(&self.peers[c].log);
        let (mut votes, mut higher) = (1, term);
        for v in (0..self.peers.len()).filter(|&v| v != c && net.reach[c][v]) {
            let lease = self.timing.election_max_ms;
            let p = &mut self.peers[v];
            higher = higher.max(p.term);
            if p.leader.is_some() && now < p.heard_at + lease {
                continue;
            }
            if term > p.term {
                (p.term, p.voted_for, p.role, p.leader) = (term, None, Role::Follower, None);
            }
            if p.term == term && p.voted_for.is_none() && last >= last_id(&p.log) {
                p.voted_for = Some(c);
                p.election_at = now + timeout;
                votes += 1;
            }
        }
        if votes >= self.majority() {
            let me = &mut self.peers[c];
            (me.role, me.leader, me.heard_at) = (Role::Leader, Some(c), now);
            me.log.push((term, Write::Blank));
            self.replicate_from(c, now, net, rng);
        } else if higher > term {
            self.follow(c, higher, None, now, rng);
        }
    }

    /// Leader `c` appends `write`; answered later (see [`RaftOut::Decided`]). A controller that is not
    /// the leader refuses at once, naming the leader it knows.
    pub fn propose(&mut self, c: usize, write: Write, by: Proposer, now: u64) -> Result<(), String> {
        let p = &mut self.peers[c];
        if p.role != Role::Leader {
            return Err(not_leader(p.leader));
        }
        p.log.push((p.term, write));
        let (index, term, deadline) = (p.log.len(), p.term, now + self.timing.propose_ms);
        self.pending.push(Pending { node: c, index, term, deadline, by });
        Ok(())
    }

    /// Proposals decided and leadership watches changed, of the controllers that run now.
    fn outcomes(&mut self, now: u64, net: &Net) -> Vec<RaftOut> {
        let mut out = Vec::new();
        let peers = &self.peers;
        self.pending.retain(|p| {
            if !net.runs[p.node] {
                return true;
            }
            let peer = &peers[p.node];
            let result = if peer.role != Role::Leader || peer.term != p.term {
                Err(not_leader(peer.leader))
            } else if peer.commit >= p.index {
                Ok(())
            } else if now >= p.deadline {
                Err("not committed by a majority within propose_ms (this node may be cut off)".to_owned())
            } else {
                return true;
            };
            out.push(RaftOut::Decided { node: p.node, by: p.by, result });
            false
        });
        for c in (0..self.peers.len()).filter(|&c| net.runs[c]) {
            let watch = self.watch(c);
            if self.peers[c].told != Some(watch) {
                self.peers[c].told = Some(watch);
                out.push(RaftOut::Leadership { node: c, watch });
            }
        }
        out
    }

    /// What controller `c`'s leadership watch says: a leader names itself once its blank entry
    /// committed (everything committed before is applied: the node can read the state).
    fn watch(&self, c: usize) -> Watch {
        let p = &self.peers[c];
        let ready = p.role == Role::Leader && p.log.iter().take(p.commit).any(|(t, _)| *t == p.term);
        let leader = if p.role == Role::Leader { ready.then_some(c) } else { p.leader };
        Watch { term: p.term, leader }
    }

    /// Controller `c`'s process died: what it knew while running is gone, its proposals with it; its
    /// log, vote and committed index stay.
    pub fn crashed(&mut self, c: usize) {
        self.pending.retain(|p| p.node != c);
        let p = &mut self.peers[c];
        (p.role, p.leader, p.told) = (Role::Follower, None, None);
    }

    /// Controller `c`'s daemon starts again: a follower whose election timer starts now.
    pub fn restarted(&mut self, c: usize, now: u64, rng: &mut Rng) {
        let timeout = self.timeout(rng);
        let p = &mut self.peers[c];
        (p.heard_at, p.election_at) = (now, now + timeout);
    }

    /// The catalog as controller `c` applied it (its committed entries): what a new leader restores.
    pub fn state(&self, c: usize) -> (Option<StoredView>, Option<JobInfo>) {
        let (mut view, mut job) = (None, None);
        for (_, write) in self.peers[c].log.iter().take(self.peers[c].commit) {
            match write {
                Write::View(v) => view = Some(v.clone()),
                Write::Job(info) => job = Some((**info).clone()),
                Write::Blank => {}
            }
        }
        (view, job)
    }

    /// How many controllers' logs (durable, whether or not they run) hold an entry `holds` accepts.
    pub fn holders(&self, holds: impl Fn(&Write) -> bool) -> usize {
        self.peers.iter().filter(|p| p.log.iter().any(|(_, w)| holds(w))).count()
    }

    /// Whether a majority of the controllers' logs hold an entry `holds` accepts.
    pub fn in_majority(&self, holds: impl Fn(&Write) -> bool) -> bool {
        self.holders(holds) >= self.majority()
    }

    /// Whether a majority of the controllers moved to a higher term than controller `c`'s: it can
    /// commit nothing more (it may not know yet). A higher term alone does not depose it: a controller
    /// cut off stands in rising terms that no one else follows.
    pub fn deposed(&self, c: usize) -> bool {
        let term = self.peers[c].term;
        self.peers.iter().filter(|p| p.term > term).count() >= self.majority()
    }

    /// The leader controller `c`'s watch names now.
    pub fn leader_of(&self, c: usize) -> Option<usize> {
        self.watch(c).leader
    }
}

/// A log's last entry as `(term, index)`: Raft's "at least as up to date" order.
fn last_id(log: &[(u64, Write)]) -> (u64, usize) {
    (log.last().map_or(0, |(t, _)| *t), log.len())
}

fn not_leader(leader: Option<usize>) -> String {
    match leader {
        Some(l) => format!("this node is not the controller; controller {l} leads"),
        None => "this node is not the controller; an election is under way".to_owned(),
    }
}
