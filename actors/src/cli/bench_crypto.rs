//! `troupe bench crypto [--mib M] [--iters K] [--peer] [--json]`: what sealing and opening TLS 1.3
//! records (AES-128-GCM) cost per core with each rustls crypto provider this build has — the work
//! every byte of the encrypted data planes pays (troupe_cluster::bench::run_crypto_bench, the same
//! report as `troupe-cluster-rank crypto`). With `--peer`, OpenSSL's own AES-128-GCM on one core in
//! the same command (`openssl speed -evp aes-128-gcm`, 16 KiB blocks, the size of a TLS record):
//! the cipher alone, without TLS framing or rustls's copies, so an upper bound for a provider's seal.

use std::process::Command;

use anyhow::Context;
use serde::Serialize;
use troupe_cluster::bench::{run_crypto_bench, CryptoArgs};

#[derive(Debug, clap::Args)]
pub struct BenchCryptoArgs {
    #[command(flatten)]
    pub crypto: CryptoArgs,
    /// Also measure OpenSSL's AES-128-GCM on one core (`openssl speed -evp aes-128-gcm`, 16 KiB
    /// blocks) and print it beside ours.
    #[arg(long)]
    pub peer: bool,
}

/// OpenSSL's figure (`--peer`).
#[derive(Debug, Serialize)]
pub struct OpensslReport {
    pub bench: &'static str,
    pub peer: &'static str,
    pub version: String,
    pub block_bytes: usize,
    /// Bytes encrypted per second on one core, in GB/s.
    pub seal_gbps: f64,
}

pub fn run(args: BenchCryptoArgs) -> anyhow::Result<()> {
    let reports = run_crypto_bench(&args.crypto)?;
    let peer = if args.peer { Some(openssl_speed()?) } else { None };
    for r in &reports {
        if args.crypto.json {
            println!("{}", serde_json::to_string(r)?);
        } else {
            let ratio =
                peer.as_ref().map_or(String::new(), |p| format!(" ({:.2}x openssl's)", r.seal_gbps / p.seal_gbps));
            println!(
                "{} {}: seal {:.3} GB/s{ratio}, open {:.3} GB/s per core ({} MiB)",
                r.provider, r.suite, r.seal_gbps, r.open_gbps, r.mib
            );
        }
    }
    if let Some(p) = peer {
        if args.crypto.json {
            println!("{}", serde_json::to_string(&p)?);
        } else {
            println!(
                "  {} aes-128-gcm, {} B blocks, cipher only: {:.3} GB/s per core",
                p.version, p.block_bytes, p.seal_gbps
            );
        }
    }
    Ok(())
}

/// `openssl speed -evp aes-128-gcm` on one core for 16 KiB blocks, parsed from its machine-readable
/// output (`+F:<n>:AES-128-GCM:<bytes per second>`).
fn openssl_speed() -> anyhow::Result<OpensslReport> {
    const BLOCK: usize = 16384;
    let missing = "--peer runs `openssl speed`: install openssl (Debian: apt-get install openssl) or leave --peer out";
    let version = Command::new("openssl").arg("version").output().context(missing)?;
    let out = Command::new("openssl")
        .args(["speed", "-evp", "aes-128-gcm", "-seconds", "2", "-bytes", &BLOCK.to_string(), "-mr"])
        .output()
        .context(missing)?;
    anyhow::ensure!(
        out.status.success(),
        "`openssl speed -evp aes-128-gcm` failed ({}): {}",
        out.status,
        String::from_utf8_lossy(&out.stderr).trim()
    );
    let stdout = String::from_utf8_lossy(&out.stdout);
    let bytes_per_s: f64 = stdout
        .lines()
        .find_map(|l| l.strip_prefix("+F:")?.rsplit(':').next()?.trim().parse().ok())
        .with_context(|| format!("`openssl speed -mr` printed no +F: line: {stdout}"))?;
    let version = String::from_utf8_lossy(&version.stdout);
    Ok(OpensslReport {
        bench: "crypto",
        peer: "openssl",
        version: version.split(" (").next().unwrap_or("openssl").trim().to_string(),
        block_bytes: BLOCK,
        seal_gbps: bytes_per_s / 1e9,
    })
}
