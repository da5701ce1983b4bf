//! Cluster identity: a cluster CA and per-node certificates (rcgen), and the rustls configurations that
//! make every QUIC connection mutually authenticated. A node's identity is the DNS name in its
//! certificate, checked with webpki against the name it announces — never the announcement alone.

mod files;
mod tls;

pub use files::{add_node, init_cluster, validate_node_name, NodeIdentity};
pub use tls::{
    client_config, client_config_with, providers, server_config, server_config_with, server_verifier, verify_peer_name,
};
