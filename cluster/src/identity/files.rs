//! Creating and loading the CA and node certificate files.
//!
//! Layout of a cluster directory: `ca.pem`, `ca.key.pem` (0600), and for each node `nodes/NAME.pem`,
//! `nodes/NAME.key.pem` (0600).

use std::fs;
use std::path::{Path, PathBuf};

use rcgen::{
    BasicConstraints, CertificateParams, DistinguishedName, DnType, ExtendedKeyUsagePurpose, IsCa, Issuer, KeyPair,
    KeyUsagePurpose,
};
use rustls::pki_types::pem::PemObject;
use rustls::pki_types::{CertificateDer, PrivateKeyDer};

use crate::ClusterError;

const CA_COMMON_NAME: &str = "troupe cluster CA";

fn ident_err(what: &'static str, path: &Path, reason: impl ToString) -> ClusterError {
    ClusterError::Identity { what, path: path.to_path_buf(), reason: reason.to_string() }
}

fn ca_params() -> CertificateParams {
    let mut params = CertificateParams::default();
    let mut dn = DistinguishedName::new();
    dn.push(DnType::CommonName, CA_COMMON_NAME);
    params.distinguished_name = dn;
    params.is_ca = IsCa::Ca(BasicConstraints::Unconstrained);
    params.key_usages = vec![KeyUsagePurpose::KeyCertSign, KeyUsagePurpose::CrlSign, KeyUsagePurpose::DigitalSignature];
    params
}

fn write_file(path: &Path, contents: &str, secret: bool) -> Result<(), ClusterError> {
    use std::io::Write;
    let mut options = fs::OpenOptions::new();
    options.write(true).create_new(true);
    #[cfg(unix)]
    {
        use std::os::unix::fs::OpenOptionsExt;
        options.mode(if secret { 0o600 } else { 0o644 });
    }
    let mut f = options.open(path).map_err(|e| ident_err("writing", path, e))?;
    f.write_all(contents.as_bytes()).map_err(|e| ident_err("writing", path, e))?;
    f.sync_all().map_err(|e| ident_err("syncing", path, e))
}

fn read_file(what: &'static str, path: &Path) -> Result<String, ClusterError> {
    fs::read_to_string(path).map_err(|e| ident_err(what, path, e))
}

/// Node names are DNS labels: 1–63 of `a-z 0-9 -`, not starting or ending with `-`.
pub fn validate_node_name(name: &str) -> Result<(), String> {
    let ok_chars = name.bytes().all(|b| b.is_ascii_lowercase() || b.is_ascii_digit() || b == b'-');
    if name.is_empty() || name.len() > 63 || !ok_chars || name.starts_with('-') || name.ends_with('-') {
        return Err(format!(
            "node name {name:?} must be 1-63 characters of a-z, 0-9 and '-', not starting or ending with '-'"
        ));
    }
    Ok(())
}

/// Creates a cluster CA in `dir` (created if missing). Refuses to overwrite an existing CA.
pub fn init_cluster(dir: &Path) -> Result<(), ClusterError> {
    fs::create_dir_all(dir.join("nodes")).map_err(|e| ident_err("creating directory", dir, e))?;
    let key = KeyPair::generate().map_err(|e| ident_err("generating CA key", dir, e))?;
    let cert = ca_params().self_signed(&key).map_err(|e| ident_err("self-signing CA", dir, e))?;
    let ca_path = dir.join("ca.pem");
    if ca_path.exists() {
        return Err(ident_err("creating CA", &ca_path, "a cluster CA already exists here; use another --dir"));
    }
    write_file(&dir.join("ca.key.pem"), &key.serialize_pem(), true)?;
    write_file(&ca_path, &cert.pem(), false)
}

/// Issues a certificate for node `name`, signed by the CA in `dir`.
pub fn add_node(name: &str, dir: &Path) -> Result<(), ClusterError> {
    validate_node_name(name).map_err(|r| ident_err("node name", dir, r))?;
    let ca_key_path = dir.join("ca.key.pem");
    let ca_key_pem = read_file("reading CA key (run `troupe cluster init` first)", &ca_key_path)?;
    let ca_key = KeyPair::from_pem(&ca_key_pem).map_err(|e| ident_err("parsing CA key", &ca_key_path, e))?;
    let issuer = Issuer::new(ca_params(), ca_key);

    let mut params = CertificateParams::new(vec![name.to_string()]).map_err(|e| ident_err("node params", dir, e))?;
    params.distinguished_name.push(DnType::CommonName, name);
    params.extended_key_usages = vec![ExtendedKeyUsagePurpose::ServerAuth, ExtendedKeyUsagePurpose::ClientAuth];
    params.key_usages = vec![KeyUsagePurpose::DigitalSignature];
    let key = KeyPair::generate().map_err(|e| ident_err("generating node key", dir, e))?;
    let cert = params.signed_by(&key, &issuer).map_err(|e| ident_err("signing node certificate", dir, e))?;
    let (cert_path, key_path) = node_paths(dir, name);
    if cert_path.exists() {
        return Err(ident_err("issuing node certificate", &cert_path, "this node already has a certificate"));
    }
    fs::create_dir_all(dir.join("nodes")).map_err(|e| ident_err("creating directory", dir, e))?;
    write_file(&key_path, &key.serialize_pem(), true)?;
    write_file(&cert_path, &cert.pem(), false)
}

fn node_paths(dir: &Path, name: &str) -> (PathBuf, PathBuf) {
    (dir.join("nodes").join(format!("{name}.pem")), dir.join("nodes").join(format!("{name}.key.pem")))
}

/// What a node needs to speak mutual TLS: the CA to trust, its own certificate and key.
#[derive(Debug)]
pub struct NodeIdentity {
    pub name: String,
    pub ca: CertificateDer<'static>,
    pub cert: CertificateDer<'static>,
    pub key: PrivateKeyDer<'static>,
}

impl Clone for NodeIdentity {
    fn clone(&self) -> Self {
        NodeIdentity {
            name: self.name.clone(),
            ca: self.ca.clone(),
            cert: self.cert.clone(),
            key: self.key.clone_key(),
        }
    }
}

impl NodeIdentity {
    /// Loads node `name` from a cluster directory written by [`init_cluster`] and [`add_node`].
    pub fn load(dir: &Path, name: &str) -> Result<Self, ClusterError> {
        let ca_path = dir.join("ca.pem");
        let (cert_path, key_path) = node_paths(dir, name);
        let ca =
            CertificateDer::from_pem_file(&ca_path).map_err(|e| ident_err("reading CA certificate", &ca_path, e))?;
        let cert = CertificateDer::from_pem_file(&cert_path)
            .map_err(|e| ident_err("reading node certificate (run `troupe cluster add-node`)", &cert_path, e))?;
        let key = PrivateKeyDer::from_pem_file(&key_path).map_err(|e| ident_err("reading node key", &key_path, e))?;
        Ok(NodeIdentity { name: name.to_string(), ca, cert, key })
    }
}
