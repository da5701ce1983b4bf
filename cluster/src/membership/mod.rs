//! Membership and failure detection, sans-IO (STYLE.md §1): events and the current time in
//! (`handle_*`), actions out (`poll_*`). No sockets, clocks or tasks here — the node and controller
//! actors feed these machines from the transport and a timer, and the simulation tests feed them from a
//! virtual clock and a lossy in-memory network.
//!
//! Two machines:
//! - [`Membership`], held by the job controller: the authoritative [`View`] (epoch + members ordered by
//!   node id). Members are declared dead after the silence their [`detector`] allows (`failure_timeout_ms`,
//!   or adaptive under `phi_accrual`), or at once when their connection is lost; every batch of changes at one instant bumps the epoch exactly once. Joiners wait
//!   for the next step boundary. A message from a node that is not in the view is answered with a fence;
//!   a heartbeat from a member on an older epoch is answered with the current view (views may be lost),
//!   and so is a join from a member carrying the incarnation it was admitted with (a join resent before
//!   the admitting view arrived); a join with another incarnation is a restart.
//! - [`MemberState`], held by every node: sends heartbeats every `heartbeat_interval_ms`, adopts newer
//!   views, notices when the controller has gone silent, and, once fenced, asks to rejoin as a new member
//!   (a new incarnation).

mod config;
mod controller;
pub mod detector;
mod member;
mod view;

pub use config::MembershipConfig;
pub use controller::{Change, Membership, MembershipAction, MembershipEvent, ARRIVALS_TARGET};
pub use detector::DetectorKind;
pub use member::{MemberAction, MemberState};
pub use view::{Epoch, NodeId, View};

#[cfg(test)]
mod simulation;
