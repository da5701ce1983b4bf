//! `troupe-cluster-rank crypto`: what sealing and opening cost per core with each rustls crypto
//! provider this build has (ring; aws-lc-rs with the `aws-lc-rs` feature). Two in-memory rustls
//! connections with the cluster's own configurations ([`crate::identity::client_config_with`]: TLS
//! 1.3, AES-128-GCM) finish a handshake; then one thread seals `mib` MiB of application data into
//! TLS records (rustls's writer and `write_tls`) and opens them on the other side (`read_tls`,
//! `process_new_packets`, the reader) — the work every byte of the encrypted transports pays, rustls's
//! own copies included, without sockets.

use std::io::{Read, Write};
use std::sync::Arc;
use std::time::Instant;

use anyhow::Context;
use rustls::crypto::CryptoProvider;
use rustls::{ClientConnection, Connection, ServerConnection};
use serde::Serialize;

use crate::identity::{add_node, client_config_with, init_cluster, providers, server_config_with, NodeIdentity};

#[derive(Debug, clap::Args)]
pub struct CryptoArgs {
    /// Application data sealed and opened per iteration, in MiB.
    #[arg(long, default_value_t = 64)]
    pub mib: usize,
    /// Timed iterations (after one untimed).
    #[arg(long, default_value_t = 5)]
    pub iters: usize,
    /// One JSON object per provider, one per line.
    #[arg(long)]
    pub json: bool,
}

#[derive(Debug, Serialize)]
pub struct CryptoReport {
    pub bench: &'static str,
    pub provider: &'static str,
    /// The negotiated cipher suite.
    pub suite: String,
    pub mib: usize,
    /// Plaintext bytes sealed into TLS records per second on one core, in GB/s.
    pub seal_gbps: f64,
    /// Plaintext bytes opened from TLS records per second on one core, in GB/s.
    pub open_gbps: f64,
}

/// Measures every provider this build has, in turn.
pub fn run_crypto_bench(args: &CryptoArgs) -> anyhow::Result<Vec<CryptoReport>> {
    let dir = tempfile::tempdir().context("a directory for the benchmark's certificates")?;
    init_cluster(dir.path())?;
    let ids = ["bench-client", "bench-server"]
        .iter()
        .map(|n| {
            add_node(n, dir.path())?;
            NodeIdentity::load(dir.path(), n)
        })
        .collect::<Result<Vec<_>, _>>()?;
    providers().into_iter().map(|(name, provider)| measure(name, provider, &ids[0], &ids[1], args)).collect()
}

fn measure(
    name: &'static str,
    provider: Arc<CryptoProvider>,
    client_id: &NodeIdentity,
    server_id: &NodeIdentity,
    args: &CryptoArgs,
) -> anyhow::Result<CryptoReport> {
    let client_config = Arc::new(client_config_with(client_id, provider.clone())?);
    let server_config = Arc::new(server_config_with(server_id, provider)?);
    let mut client = Connection::from(ClientConnection::new(client_config, server_id.name.clone().try_into()?)?);
    let mut server = Connection::from(ServerConnection::new(server_config)?);
    let mut flight = Vec::new();
    while client.is_handshaking() || server.is_handshaking() {
        flight.clear();
        client.write_tls(&mut flight)?;
        feed(&mut server, &flight, &mut Vec::new())?;
        flight.clear();
        server.write_tls(&mut flight)?;
        feed(&mut client, &flight, &mut Vec::new())?;
    }
    // Session tickets the server sent after its handshake: read them before timing.
    flight.clear();
    server.write_tls(&mut flight)?;
    feed(&mut client, &flight, &mut Vec::new())?;
    client.set_buffer_limit(None);
    let suite = client.negotiated_cipher_suite().map_or_else(|| "?".into(), |s| format!("{:?}", s.suite()));

    let data: Vec<u8> = (0..args.mib << 20).map(|i| (i % 251) as u8).collect();
    let mut records = Vec::with_capacity(data.len() + data.len() / 512 + 4096);
    let mut opened = Vec::with_capacity(data.len());
    let (mut seal_s, mut open_s) = (0.0, 0.0);
    for iter in 0..=args.iters {
        records.clear();
        opened.clear();
        let started = Instant::now();
        client.writer().write_all(&data)?;
        while client.wants_write() {
            client.write_tls(&mut records)?;
        }
        let sealed = started.elapsed().as_secs_f64();
        let started = Instant::now();
        feed(&mut server, &records, &mut opened)?;
        let open = started.elapsed().as_secs_f64();
        anyhow::ensure!(opened == data, "{name}: what was opened is not what was sealed");
        if iter > 0 {
            seal_s += sealed;
            open_s += open;
        }
    }
    let bytes = (data.len() * args.iters) as f64;
    Ok(CryptoReport {
        bench: "crypto",
        provider: name,
        suite,
        mib: args.mib,
        seal_gbps: bytes / seal_s / 1e9,
        open_gbps: bytes / open_s / 1e9,
    })
}

/// Feeds `tls` bytes to `conn` and appends the plaintext they carry to `plain`.
fn feed(conn: &mut Connection, mut tls: &[u8], plain: &mut Vec<u8>) -> anyhow::Result<()> {
    let mut chunk = vec![0u8; 64 << 10];
    while !tls.is_empty() {
        conn.read_tls(&mut tls)?;
        conn.process_new_packets()?;
        loop {
            match conn.reader().read(&mut chunk) {
                Ok(0) => break,
                Ok(n) => plain.extend_from_slice(&chunk[..n]),
                Err(e) if e.kind() == std::io::ErrorKind::WouldBlock => break,
                Err(e) => return Err(e.into()),
            }
        }
    }
    Ok(())
}
