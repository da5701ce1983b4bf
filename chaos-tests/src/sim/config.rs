//! The simulation's fixed timing (every limit named with its unit) and the switches that choose which
//! behaviour of the runtime is modelled: the node code as it is, a proposed fix, or a planted bug.

use troupe_cluster::membership::MembershipConfig;

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
}

impl NodeModel {
    /// node.rs as of 856e3b4, before the fixes the simulation found.
    pub const AS_IS: NodeModel = NodeModel {
        stamp_membership_epoch: true,
        accept_lagging_members: false,
        keep_connection_on_silence: false,
        replacement_is_loss: false,
    };
    /// node.rs with every fix (node.rs since ae88e14).
    pub const PROPOSED: NodeModel = NodeModel {
        stamp_membership_epoch: true,
        accept_lagging_members: true,
        keep_connection_on_silence: true,
        replacement_is_loss: true,
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

/// Timing of the modelled system. Defaults are the runtime's defaults (docs/runtime-semantics.md), the
/// node model [`NodeModel::PROPOSED`] and no planted bug.
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
            idle_timeout_ms: 2_000,
            connect_timeout_ms: 10_000,
            dial_ms_min: 2,
            dial_ms_max: 12,
            collective_timeout_ms: 60_000,
            tail_ms: 4_000,
            node_model: NodeModel::PROPOSED,
            planted: PlantedBug::None,
        }
    }
}

impl SimConfig {
    /// The runtime as of 856e3b4, before the node.rs fixes.
    pub fn as_is() -> Self {
        Self { node_model: NodeModel::AS_IS, ..Self::default() }
    }
}
