//! The simulation's fixed timing (every limit named with its unit), the network's guarantees, and a bug
//! planted in the job controller's plumbing to show the checker catches it. The node's logic is the
//! runtime's own (`NodeCore`): there is no switch for it.

use troupe_cluster::membership::MembershipConfig;

use super::raft::RaftTiming;
use super::scenario::Scenario;

/// A bug planted in the modelled controller to show the checker catches it (never in the runtime).
#[derive(Clone, Copy, Debug, PartialEq, Eq, Default)]
pub enum PlantedBug {
    #[default]
    None,
    /// The controller sends `Commit` for a step as soon as the first vote for it arrives (a wrapper around
    /// the driver's actions; the driver itself is unchanged).
    CommitOnFirstVote,
    /// Replicated controllers: a job controller whose record was not committed by a majority (its node
    /// was deposed, cut off, or paused past an election) carries its batch out anyway — the rule
    /// "committed by a Raft majority before announce" broken (controller.rs `flush`).
    DeposedLeaderAnnounces,
}

/// What the network may do to control messages besides delaying them, cutting nodes off and losing what
/// is in flight on a connection that closes (see the module docs of [`super`]).
#[derive(Clone, Copy, Debug, PartialEq, Eq, Default)]
pub enum Network {
    /// What QUIC and the control plane (cluster/src/control) give troupe: on one connection, in order and
    /// at most once; nothing ordered across connections — a replaced connection's reader may still hand
    /// over what it read after the newer connection's `Connected` and first messages.
    #[default]
    Quic,
    /// Breaks QUIC's guarantees on purpose, to show which invariants rest on them: each control message
    /// is delivered `0..=spread_ms` later than QUIC would, in no order, and a second copy of it (delayed
    /// the same way, independently) is delivered with probability `duplicate_per_mille` / 1000.
    Datagrams { duplicate_per_mille: u64, spread_ms: u64 },
}

impl Network {
    /// The datagram network of the tests: a tenth of the messages twice, spread over 30 ms.
    pub const DATAGRAMS: Network = Network::Datagrams { duplicate_per_mille: 100, spread_ms: 30 };
}

/// Timing of the modelled system. Defaults are the runtime's defaults (docs/runtime-semantics.md), the
/// QUIC network and no planted bug.
#[derive(Clone, Debug)]
pub struct SimConfig {
    pub membership: MembershipConfig,
    /// How often a node drives its timers (node.rs `TICK_MS`).
    pub tick_ms: u64,
    /// Network delay of one control or data-plane message, uniform in this range.
    pub net_delay_ms_min: u64,
    pub net_delay_ms_max: u64,
    /// Delay of a message between actors of one process (mailbox hops), uniform in `0..=` this.
    pub local_delay_ms_max: u64,
    /// How often (per mille of messages) the controller's reader task of a connection is descheduled
    /// between reading a message off the stream and handing it to the node actor, and for how long at
    /// most (uniform in `1..=` this): what lets a replaced connection's last messages reach the node
    /// actor after the newer connection's (each connection has its own reader; they share one channel).
    pub reader_stall_per_mille: u64,
    pub reader_stall_ms_max: u64,
    /// QUIC idle timeout: a connection silent this long is lost on both sides.
    pub idle_timeout_ms: u64,
    /// Dialing gives up after this long (control plane), and a data-plane mesh must connect within it.
    pub connect_timeout_ms: u64,
    /// How long a successful dial takes (handshake and introductions), uniform in this range.
    pub dial_ms_min: u64,
    pub dial_ms_max: u64,
    /// A collective waiting longer than this fails (data plane).
    pub collective_timeout_ms: u64,
    /// How long the network stays quiet after the job ended before the run stops (leak checks).
    pub tail_ms: u64,
    pub network: Network,
    pub planted: PlantedBug,
    /// The replicated controllers' Raft timing (scenarios with several controllers).
    pub raft: RaftTiming,
}

impl Default for SimConfig {
    fn default() -> Self {
        Self {
            membership: MembershipConfig::default(),
            tick_ms: 50,
            net_delay_ms_min: 1,
            net_delay_ms_max: 6,
            local_delay_ms_max: 2,
            reader_stall_per_mille: 50,
            reader_stall_ms_max: 20,
            idle_timeout_ms: 2_000,
            connect_timeout_ms: 10_000,
            dial_ms_min: 2,
            dial_ms_max: 12,
            collective_timeout_ms: 60_000,
            tail_ms: 4_000,
            network: Network::Quic,
            planted: PlantedBug::None,
            raft: RaftTiming::default(),
        }
    }
}

impl SimConfig {
    /// An overloaded machine: the controller's reader of a connection waits up to 300 ms for a thread on
    /// 3 of 10 messages (QUIC's guarantees hold; only what no connection orders is reordered more often).
    pub fn loaded() -> Self {
        Self { reader_stall_per_mille: 300, reader_stall_ms_max: 300, ..Self::default() }
    }

    /// When the job must have ended: [`Scenario::finish_bound_ms`], plus a reader stall for each step's
    /// votes, plus the time the cluster may take to form before the job is submitted.
    pub fn finish_bound_ms(&self, scenario: &Scenario) -> u64 {
        scenario.finish_bound_ms() + scenario.steps * self.reader_stall_ms_max + super::world::SUBMIT_BY_MS
    }
}
