//! The simulation's fixed timing (every limit named with its unit) and the switches that choose which
//! behaviour of the runtime is modelled: the node code as it is, a proposed fix, or a planted bug.

use troupe_cluster::membership::MembershipConfig;

use super::scenario::Scenario;

/// How the node actor (actors/src/runtime/node.rs) behaves. [`NodeModel::AS_IS`] is the code as of
/// commit 856e3b4; each switch turned on models one fix the simulation showed to be needed (each is
/// pinned by a regression test in tests/simulation.rs that turns it off). [`NodeModel::PROPOSED`] has
/// them all and is what the main properties run — and, since commit ae88e14, what node.rs does.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct NodeModel {
    /// The controller stamps what it sends with its membership epoch (node.rs does since 856e3b4).
    /// Before, it stamped its own node's `MemberState` epoch, which learns a new view only when the
    /// controller's self-addressed `View` comes back through its mailbox — possibly after the job
    /// controller's `Prepare` of that view went out, which members then refused as stale.
    pub stamp_membership_epoch: bool,
    /// The controller accepts job messages (`Ready`, `Vote`, `Ended`) from current members whatever epoch
    /// they carry (the driver already ignores other attempts). As is, a member whose view lags is ignored,
    /// and a vote lost that way stalls an attempt the view change did not abort (its ranks did not change).
    pub accept_lagging_members: bool,
    /// A node keeps its live control connection when the controller has been silent for the failure
    /// timeout (QUIC's idle timeout already detects a dead one). As is, it drops it and dials again, and
    /// what either side sends meanwhile is lost without any membership change.
    pub keep_connection_on_silence: bool,
    /// The controller treats a member's connection being replaced by a newer one as a lost connection
    /// (the member is removed and rejoins), since messages in flight on the old one are gone and the
    /// dialer may be a new incarnation. As is, a replacement emits nothing (control/mod.rs), so messages
    /// vanish with no membership change, and a restarted node that receives a view naming it before its
    /// `Join` gets through adopts it and inherits its old incarnation's membership.
    pub replacement_is_loss: bool,
    /// A node that learns its dial succeeded (`NodeMsg::Connected`, from the dialing task) takes the
    /// controller for its leader peer only if the connection is still up. As is, it takes it anyway:
    /// when the connection's `Lost` (from the endpoint's event channel, another path into the actor)
    /// came first, the node holds a dead connection for good — it never dials again, and its sends go
    /// nowhere.
    pub connected_checks_link: bool,
    /// The controller refuses a job message stamped with an epoch older than the view that admitted its
    /// sender (`Membership::admitted_at`): an earlier membership of the node sent it. As is, a member's
    /// message of any epoch is accepted, and one an earlier membership sent on a connection since
    /// replaced — its reader slow to hand it over — is taken for the current membership's once the node
    /// has rejoined.
    pub refuse_before_admission: bool,
}

impl NodeModel {
    /// node.rs as of 856e3b4, before the fixes the simulation found.
    pub const AS_IS: NodeModel = NodeModel {
        stamp_membership_epoch: true,
        accept_lagging_members: false,
        keep_connection_on_silence: false,
        replacement_is_loss: false,
        connected_checks_link: false,
        refuse_before_admission: false,
    };
    /// node.rs with every fix (node.rs since ae88e14).
    pub const PROPOSED: NodeModel = NodeModel {
        stamp_membership_epoch: true,
        accept_lagging_members: true,
        keep_connection_on_silence: true,
        replacement_is_loss: true,
        connected_checks_link: true,
        refuse_before_admission: true,
    };
}

/// A bug planted in the modelled controller to show the checker catches it (never in the runtime).
#[derive(Clone, Copy, Debug, PartialEq, Eq, Default)]
pub enum PlantedBug {
    #[default]
    None,
    /// The controller sends `Commit` for a step as soon as the first vote for it arrives (a wrapper around
    /// the driver's actions; the driver itself is unchanged).
    CommitOnFirstVote,
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
/// node model [`NodeModel::PROPOSED`], the QUIC network and no planted bug.
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
    pub node_model: NodeModel,
    pub network: Network,
    pub planted: PlantedBug,
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
            node_model: NodeModel::PROPOSED,
            network: Network::Quic,
            planted: PlantedBug::None,
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
    /// votes.
    pub fn finish_bound_ms(&self, scenario: &Scenario) -> u64 {
        scenario.finish_bound_ms() + scenario.steps * self.reader_stall_ms_max
    }

    /// The runtime as of 856e3b4, before the node.rs fixes.
    pub fn as_is() -> Self {
        Self { node_model: NodeModel::AS_IS, ..Self::default() }
    }
}
