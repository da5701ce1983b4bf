//! rustls configurations (ring provider, TLS 1.3 only) for mutual authentication inside one cluster.

use std::sync::Arc;

use rustls::client::WebPkiServerVerifier;
use rustls::crypto::CryptoProvider;
use rustls::pki_types::{CertificateDer, ServerName};
use rustls::server::WebPkiClientVerifier;
use rustls::{CipherSuite, RootCertStore};

use super::NodeIdentity;
use crate::ClusterError;

/// ALPN protocol id; a peer speaking anything else fails the handshake.
pub const ALPN: &[u8] = b"troupe/1";

/// ring's provider with AES-128-GCM first: the provider of every connection (QUIC and TLS over TCP).
fn provider() -> Arc<CryptoProvider> {
    aes_128_first(rustls::crypto::ring::default_provider())
}

/// `provider` with AES-128-GCM first. Every byte a rank sends is sealed and opened with the
/// negotiated cipher, so on bulk tensors its cost is the transport's: AES-128 runs 10 rounds to
/// AES-256's 14 (ring's default order puts AES-256 first), with the same 128-bit authentication tag.
fn aes_128_first(mut provider: CryptoProvider) -> Arc<CryptoProvider> {
    provider.cipher_suites.sort_by_key(|s| s.suite() != CipherSuite::TLS13_AES_128_GCM_SHA256);
    Arc::new(provider)
}

/// The crypto providers this build has, by name, each with AES-128-GCM first: ring (the one used),
/// and aws-lc-rs with the `aws-lc-rs` feature — for `troupe-cluster-rank crypto` to compare.
pub fn providers() -> Vec<(&'static str, Arc<CryptoProvider>)> {
    vec![
        ("ring", provider()),
        #[cfg(feature = "aws-lc-rs")]
        ("aws-lc-rs", aes_128_first(rustls::crypto::aws_lc_rs::default_provider())),
    ]
}

fn roots(id: &NodeIdentity) -> Result<Arc<RootCertStore>, ClusterError> {
    let mut roots = RootCertStore::empty();
    roots.add(id.ca.clone()).map_err(|e| ClusterError::Tls(format!("cluster CA: {e}")))?;
    Ok(Arc::new(roots))
}

/// Server side: requires a client certificate chaining to the cluster CA.
pub fn server_config(id: &NodeIdentity) -> Result<rustls::ServerConfig, ClusterError> {
    server_config_with(id, provider())
}

/// [`server_config`] with another crypto provider (one of [`providers`]).
pub fn server_config_with(
    id: &NodeIdentity,
    provider: Arc<CryptoProvider>,
) -> Result<rustls::ServerConfig, ClusterError> {
    let tls = |e: rustls::Error| ClusterError::Tls(e.to_string());
    let verifier = WebPkiClientVerifier::builder_with_provider(roots(id)?, provider.clone())
        .build()
        .map_err(|e| ClusterError::Tls(e.to_string()))?;
    let mut cfg = rustls::ServerConfig::builder_with_provider(provider)
        .with_protocol_versions(&[&rustls::version::TLS13])
        .map_err(tls)?
        .with_client_cert_verifier(verifier)
        .with_single_cert(vec![id.cert.clone()], id.key.clone_key())
        .map_err(tls)?;
    cfg.alpn_protocols = vec![ALPN.to_vec()];
    cfg.max_early_data_size = 0;
    Ok(cfg)
}

/// Checks a server's certificate chain against the cluster CA and its name against the name dialed.
pub fn server_verifier(id: &NodeIdentity) -> Result<Arc<WebPkiServerVerifier>, ClusterError> {
    server_verifier_with(id, provider())
}

fn server_verifier_with(
    id: &NodeIdentity,
    provider: Arc<CryptoProvider>,
) -> Result<Arc<WebPkiServerVerifier>, ClusterError> {
    WebPkiServerVerifier::builder_with_provider(roots(id)?, provider)
        .build()
        .map_err(|e| ClusterError::Tls(e.to_string()))
}

/// Client side: presents this node's certificate, and checks the server's against the cluster CA and
/// the server name dialed.
pub fn client_config(id: &NodeIdentity) -> Result<rustls::ClientConfig, ClusterError> {
    client_config_with(id, provider())
}

/// [`client_config`] with another crypto provider (one of [`providers`]).
pub fn client_config_with(
    id: &NodeIdentity,
    provider: Arc<CryptoProvider>,
) -> Result<rustls::ClientConfig, ClusterError> {
    let tls = |e: rustls::Error| ClusterError::Tls(e.to_string());
    let verifier = server_verifier_with(id, provider.clone())?;
    let mut cfg = rustls::ClientConfig::builder_with_provider(provider)
        .with_protocol_versions(&[&rustls::version::TLS13])
        .map_err(tls)?
        .with_webpki_verifier(verifier)
        .with_client_auth_cert(vec![id.cert.clone()], id.key.clone_key())
        .map_err(tls)?;
    cfg.alpn_protocols = vec![ALPN.to_vec()];
    Ok(cfg)
}

/// Checks that `certs` (as `Connection::peer_identity()` returns them, already verified against the CA
/// during the handshake) name `name`.
pub fn verify_peer_name(certs: &[CertificateDer<'static>], name: &str) -> Result<(), String> {
    let leaf = certs.first().ok_or("peer presented no certificate")?;
    let cert = webpki::EndEntityCert::try_from(leaf).map_err(|e| format!("unparsable peer certificate: {e}"))?;
    let server_name = ServerName::try_from(name.to_string()).map_err(|e| format!("bad name {name:?}: {e}"))?;
    cert.verify_is_valid_for_subject_name(&server_name).map_err(|e| format!("certificate is not for {name:?}: {e}"))?;
    Ok(())
}
