//! troupe-chaos: the chaos-testing harness (nemeses, deterministic simulation, invariant checker,
//! scenarios). It sits on top of the runtime and drives it from outside; see docs/ARCHITECTURE.md for
//! what lands here.
