//! troupe-cluster: everything that crosses a process boundary — identity and certificates, the wire
//! protocol, the QUIC and same-host transports, membership and failure detection, the collectives, and
//! checkpoint storage.
//!
//! Invariant: this crate never depends on tch/libtorch. Plans (collectives, membership) are sans-IO.
