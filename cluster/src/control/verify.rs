//! The dialer's check of the acceptor's certificate when the acceptor's name is not known in advance:
//! the chain must lead to the cluster CA, as always; only a name mismatch is tolerated, because the
//! name is checked afterwards, against the acceptor's introduction.

use std::sync::Arc;

use quinn::crypto::rustls::QuicClientConfig;
use rustls::client::danger::{HandshakeSignatureValid, ServerCertVerified, ServerCertVerifier};
use rustls::client::WebPkiServerVerifier;
use rustls::pki_types::{CertificateDer, ServerName, UnixTime};
use rustls::{CertificateError, DigitallySignedStruct, SignatureScheme};

use crate::identity::{client_config, server_verifier, NodeIdentity};
use crate::transport::quic::quinn_transport_config;
use crate::{ClusterError, TransportConfig};

/// The server name the dialer asks for; acceptors have one certificate and ignore it.
pub const DIAL_SERVER_NAME: &str = "troupe-node";

/// [`WebPkiServerVerifier`] that accepts a certificate valid in every respect but its name.
#[derive(Debug)]
pub struct AnyNodeName {
    inner: Arc<WebPkiServerVerifier>,
}

impl AnyNodeName {
    pub fn new(id: &NodeIdentity) -> Result<Self, ClusterError> {
        Ok(AnyNodeName { inner: server_verifier(id)? })
    }
}

impl ServerCertVerifier for AnyNodeName {
    fn verify_server_cert(
        &self,
        end_entity: &CertificateDer<'_>,
        intermediates: &[CertificateDer<'_>],
        server_name: &ServerName<'_>,
        ocsp_response: &[u8],
        now: UnixTime,
    ) -> Result<ServerCertVerified, rustls::Error> {
        // webpki checks the chain (to the CA, validity, usage) before the name, so a name error
        // means everything else held.
        match self.inner.verify_server_cert(end_entity, intermediates, server_name, ocsp_response, now) {
            Err(rustls::Error::InvalidCertificate(
                CertificateError::NotValidForName | CertificateError::NotValidForNameContext { .. },
            )) => Ok(ServerCertVerified::assertion()),
            other => other,
        }
    }

    fn verify_tls12_signature(
        &self,
        message: &[u8],
        cert: &CertificateDer<'_>,
        dss: &DigitallySignedStruct,
    ) -> Result<HandshakeSignatureValid, rustls::Error> {
        self.inner.verify_tls12_signature(message, cert, dss)
    }

    fn verify_tls13_signature(
        &self,
        message: &[u8],
        cert: &CertificateDer<'_>,
        dss: &DigitallySignedStruct,
    ) -> Result<HandshakeSignatureValid, rustls::Error> {
        self.inner.verify_tls13_signature(message, cert, dss)
    }

    fn supported_verify_schemes(&self) -> Vec<SignatureScheme> {
        self.inner.supported_verify_schemes()
    }
}

/// [`client_config`] (this node's certificate, TLS 1.3, ALPN) with [`AnyNodeName`]: the dialer's TLS,
/// over QUIC or over TCP (the control connection's companion).
pub fn any_node_name_tls(id: &NodeIdentity) -> Result<rustls::ClientConfig, ClusterError> {
    let mut tls = client_config(id)?;
    tls.dangerous().set_certificate_verifier(Arc::new(AnyNodeName::new(id)?));
    Ok(tls)
}

/// [`any_node_name_tls`] as a QUIC client configuration, tuned like every
/// other QUIC connection of the cluster.
pub fn dialer_client_config(id: &NodeIdentity, cfg: &TransportConfig) -> Result<quinn::ClientConfig, ClusterError> {
    let tls = any_node_name_tls(id)?;
    let crypto = QuicClientConfig::try_from(tls).map_err(|e| ClusterError::Tls(e.to_string()))?;
    let mut client = quinn::ClientConfig::new(Arc::new(crypto));
    client.transport_config(Arc::new(quinn_transport_config(cfg)?));
    Ok(client)
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::identity::{add_node, init_cluster};

    fn identities(names: &[&str]) -> (tempfile::TempDir, Vec<NodeIdentity>) {
        let dir = tempfile::tempdir().unwrap();
        init_cluster(dir.path()).unwrap();
        let ids = names
            .iter()
            .map(|n| {
                add_node(n, dir.path()).unwrap();
                NodeIdentity::load(dir.path(), n).unwrap()
            })
            .collect();
        (dir, ids)
    }

    fn check(verifier: &AnyNodeName, cert: &CertificateDer<'_>, name: &str) -> Result<(), rustls::Error> {
        let name = ServerName::try_from(name.to_string()).unwrap();
        verifier.verify_server_cert(cert, &[], &name, &[], UnixTime::now()).map(|_| ())
    }

    #[test]
    fn tolerates_only_the_name() {
        let (_ours, ids) = identities(&["node-a", "node-b"]);
        let (_theirs, foreign) = identities(&["node-b"]);
        let verifier = AnyNodeName::new(&ids[0]).unwrap();
        check(&verifier, &ids[1].cert, "node-b").expect("right name");
        check(&verifier, &ids[1].cert, DIAL_SERVER_NAME).expect("any name, same CA");
        // Both CAs are named alike, so webpki finds "the" issuer and reports a bad signature.
        let err = check(&verifier, &foreign[0].cert, "node-b").expect_err("foreign CA");
        assert!(matches!(err, rustls::Error::InvalidCertificate(CertificateError::BadSignature)), "{err:?}");
        let err = check(&verifier, &foreign[0].cert, DIAL_SERVER_NAME).expect_err("foreign CA, any name");
        assert!(matches!(err, rustls::Error::InvalidCertificate(CertificateError::BadSignature)), "{err:?}");
    }
}
