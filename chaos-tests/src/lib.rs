//! troupe-chaos: the chaos-testing harness (nemeses, deterministic simulation, invariant checker,
//! scenarios). It sits on top of the runtime and drives it from outside; see docs/ARCHITECTURE.md for
//! what lands here.
//!
//! - [`harness`]: chaos on real processes — `troupe chaos run --scenario NAME`: a local cluster of
//!   daemons trains a job while the nemesis kills, pauses and restarts them and corrupts or fills their
//!   disk; the checker compares the run with the fault-free reference and the report says what happened.
//! - [`sim`]: the deterministic simulation of a whole cluster running one job — the controller's
//!   membership and job driver, every node's membership and workers — on virtual time over an
//!   adversarial in-memory network, all from one seed, with the invariant checker of the step protocol.
//! - [`cli`]: the command line of `troupe chaos` (the `troupe-chaos` binary).

pub mod cli;
pub mod harness;
pub mod sim;
