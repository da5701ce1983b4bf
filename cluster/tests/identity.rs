//! Mutual TLS: a valid node certificate is accepted; a certificate from another cluster's CA, a
//! missing certificate, and a valid certificate claiming someone else's rank are refused, with the
//! reason logged and recorded, while the listener keeps serving.

mod support;

use std::sync::Arc;
use std::time::Duration;

use quinn::crypto::rustls::QuicClientConfig;
use rustls::RootCertStore;
use support::{cluster, dial, listener};
use troupe_cluster::transport::quic::quinn_transport_config;
use troupe_cluster::transport::quic::QuicListener;
use troupe_cluster::NodeIdentity;

fn client_with(roots_from: &NodeIdentity, cert_of: Option<&NodeIdentity>) -> quinn::ClientConfig {
    let provider = Arc::new(rustls::crypto::ring::default_provider());
    let mut roots = RootCertStore::empty();
    roots.add(roots_from.ca.clone()).unwrap();
    let builder = rustls::ClientConfig::builder_with_provider(provider)
        .with_protocol_versions(&[&rustls::version::TLS13])
        .unwrap()
        .with_root_certificates(roots);
    let mut tls = match cert_of {
        Some(id) => builder.with_client_auth_cert(vec![id.cert.clone()], id.key.clone_key()).unwrap(),
        None => builder.with_no_client_auth(),
    };
    tls.alpn_protocols = vec![b"troupe/1".to_vec()];
    let mut cfg = quinn::ClientConfig::new(Arc::new(QuicClientConfig::try_from(tls).unwrap()));
    cfg.transport_config(Arc::new(quinn_transport_config(&support::config()).unwrap()));
    cfg
}

/// Connects with `cfg` and returns how the connection ended (it must end: refused).
async fn refused(cfg: quinn::ClientConfig, addr: std::net::SocketAddr) -> String {
    let endpoint = quinn::Endpoint::client("127.0.0.1:0".parse().unwrap()).unwrap();
    let attempt = async {
        match endpoint.connect_with(cfg, addr, "node-a").unwrap().await {
            Err(e) => e.to_string(),
            // TLS 1.3: the client may finish before the server checks its certificate.
            Ok(conn) => conn.closed().await.to_string(),
        }
    };
    tokio::time::timeout(Duration::from_secs(5), attempt).await.expect("a refused connection must end within 5 s")
}

async fn wait_refusals(l: &QuicListener, count: usize) -> Vec<String> {
    for _ in 0..200 {
        let r = l.refusals();
        if r.len() >= count {
            return r.into_iter().map(|r| r.reason).collect();
        }
        tokio::time::sleep(Duration::from_millis(10)).await;
    }
    panic!("expected {count} refusals, got {:?}", l.refusals());
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn foreign_and_missing_certificates_are_refused_valid_accepted() {
    let ours = tempfile::tempdir().unwrap();
    let theirs = tempfile::tempdir().unwrap();
    let ids = cluster(ours.path(), &["node-a", "node-b", "node-c"]);
    let foreign = cluster(theirs.path(), &["node-b"]);
    let (l, addr) = listener(&ids[0], &["node-a", "node-b", "node-c"]);

    let foreign_end = refused(client_with(&ids[0], Some(&foreign[0])), addr).await;
    let missing_end = refused(client_with(&ids[0], None), addr).await;
    let reasons = wait_refusals(&l, 2).await;
    assert!(
        reasons.iter().any(|r| r.contains("UnknownIssuer") || r.contains("invalid peer certificate")),
        "foreign cert refusal not recorded: {reasons:?} / client saw {foreign_end}"
    );
    assert!(
        reasons.iter().any(|r| r.to_lowercase().contains("no certificate")
            || r.contains("NoCertificatesPresented")
            || r.contains("CertificateRequired")),
        "missing cert refusal not recorded: {reasons:?} / client saw {missing_end}"
    );

    // A valid node claiming another node's rank is refused after the handshake.
    let liar = dial(&ids[2], addr, "node-a", 1, 3).await;
    tokio::time::timeout(Duration::from_secs(5), liar.closed()).await.expect("liar not closed");
    let reasons = wait_refusals(&l, 3).await;
    assert!(reasons.iter().any(|r| r.contains("the roster says")), "{reasons:?}");

    // The listener still serves: a valid node is accepted and identified by its certificate.
    let _good = dial(&ids[1], addr, "node-a", 1, 3).await;
    for _ in 0..200 {
        if l.connection(1).is_some() {
            return;
        }
        tokio::time::sleep(Duration::from_millis(10)).await;
    }
    panic!("valid node-b was not accepted; refusals: {:?}", l.refusals());
}

#[test]
fn init_and_add_node_write_files_and_refuse_overwrites() {
    let dir = tempfile::tempdir().unwrap();
    troupe_cluster::init_cluster(dir.path()).unwrap();
    assert!(troupe_cluster::init_cluster(dir.path()).is_err(), "second init must not overwrite the CA");
    troupe_cluster::add_node("worker-1", dir.path()).unwrap();
    assert!(troupe_cluster::add_node("worker-1", dir.path()).is_err());
    assert!(troupe_cluster::add_node("Bad_Name", dir.path()).is_err());
    let id = NodeIdentity::load(dir.path(), "worker-1").unwrap();
    troupe_cluster::identity::verify_peer_name(std::slice::from_ref(&id.cert), "worker-1").unwrap();
    assert!(troupe_cluster::identity::verify_peer_name(std::slice::from_ref(&id.cert), "worker-2").is_err());
    #[cfg(unix)]
    {
        use std::os::unix::fs::PermissionsExt;
        let mode = std::fs::metadata(dir.path().join("ca.key.pem")).unwrap().permissions().mode();
        assert_eq!(mode & 0o777, 0o600);
    }
}

/// Every tensor byte is sealed and opened with the negotiated cipher: the cluster's configs prefer
/// AES-128-GCM (10 rounds) over ring's default first choice, AES-256-GCM (14 rounds).
#[test]
fn connections_negotiate_aes_128_gcm() {
    let dir = tempfile::tempdir().unwrap();
    let ids = cluster(dir.path(), &["node-a", "node-b"]);
    let client_cfg = Arc::new(troupe_cluster::identity::client_config(&ids[0]).unwrap());
    let server_cfg = Arc::new(troupe_cluster::identity::server_config(&ids[1]).unwrap());
    let mut client = rustls::ClientConnection::new(client_cfg, "node-b".try_into().unwrap()).unwrap();
    let mut server = rustls::ServerConnection::new(server_cfg).unwrap();
    for _ in 0..10 {
        if !client.is_handshaking() && !server.is_handshaking() {
            break;
        }
        let mut flight = Vec::new();
        client.write_tls(&mut flight).unwrap();
        server.read_tls(&mut &flight[..]).unwrap();
        server.process_new_packets().unwrap();
        flight.clear();
        server.write_tls(&mut flight).unwrap();
        client.read_tls(&mut &flight[..]).unwrap();
        client.process_new_packets().unwrap();
    }
    assert!(!client.is_handshaking() && !server.is_handshaking(), "the handshake did not complete");
    for suite in [client.negotiated_cipher_suite(), server.negotiated_cipher_suite()] {
        assert_eq!(suite.map(|s| s.suite()), Some(rustls::CipherSuite::TLS13_AES_128_GCM_SHA256));
    }
}
