//! The allocation's cluster directory: made once by the first task (a CA, and per node a certificate
//! for its daemon and one for the task's client connection to the controller — a member's own name is
//! refused as a client while it is connected as a node; keys 0600, the directory 0700), in a staging directory renamed into place so that no other task
//! ever sees half of it; the other tasks wait for their certificate with a bound.

use std::path::{Path, PathBuf};
use std::time::{Duration, Instant};

use anyhow::{bail, Context};
use troupe_cluster::{add_node, init_cluster, NodeIdentity};

/// How often a waiting task looks for its certificate.
const POLL_MS: u64 = 200;

/// The name of node `name`'s client certificate.
pub fn client_name(name: &str) -> String {
    format!("client-{name}")
}

/// Every certificate the nodes `names` need: each node's and each one's client's.
fn all_names(names: &[String]) -> Vec<String> {
    names.iter().flat_map(|n| [n.clone(), client_name(n)]).collect()
}

/// First task: makes sure `dir` holds a CA and a certificate for each of `names` and their clients. A directory that has
/// a CA already (a requeued allocation, or one the user made with `troupe cluster init`) is used as it
/// is; certificates it lacks are issued with its `ca.key.pem`.
pub fn prepare(dir: &Path, names: &[String]) -> anyhow::Result<()> {
    let names = &all_names(names);
    if dir.join("ca.pem").exists() {
        let missing: Vec<&String> = names.iter().filter(|n| !cert_path(dir, n).exists()).collect();
        if !missing.is_empty() && !dir.join("ca.key.pem").exists() {
            bail!(
                "cluster directory {}: no certificate for node(s) {missing:?} and no ca.key.pem to issue them; run \
                 `troupe cluster add-node NAME --dir {}` for each, or pass another --cluster-dir",
                dir.display(),
                dir.display()
            );
        }
        for name in missing {
            add_node(name, dir).with_context(|| format!("issuing a certificate for {name} in {}", dir.display()))?;
        }
        return Ok(());
    }
    let parent = dir.parent().filter(|p| !p.as_os_str().is_empty()).unwrap_or(Path::new("."));
    std::fs::create_dir_all(parent)
        .with_context(|| format!("creating {} (the cluster directory's parent)", parent.display()))?;
    let leaf = dir.file_name().map_or("cluster".into(), |n| n.to_string_lossy().into_owned());
    let staging = parent.join(format!(".{leaf}.partial-{}", std::process::id()));
    let made = (|| -> anyhow::Result<()> {
        init_cluster(&staging)?;
        for name in names {
            add_node(name, &staging)?;
        }
        restrict(&staging)?;
        std::fs::rename(&staging, dir).with_context(|| format!("moving {} to {}", staging.display(), dir.display()))
    })();
    if made.is_err() {
        let _ = std::fs::remove_dir_all(&staging);
    }
    made.with_context(|| format!("making the cluster certificates in {}", dir.display()))
}

/// Only the owner may enter the directory (it holds the CA's key).
fn restrict(dir: &Path) -> anyhow::Result<()> {
    use std::os::unix::fs::PermissionsExt;
    std::fs::set_permissions(dir, std::fs::Permissions::from_mode(0o700))
        .with_context(|| format!("restricting {} to its owner", dir.display()))
}

fn cert_path(dir: &Path, name: &str) -> PathBuf {
    dir.join("nodes").join(format!("{name}.pem"))
}

/// Another task: waits up to `bound` for node `name`'s certificates in `dir`, made by the first task on
/// `first_host`; its client identity once both load.
pub fn wait(dir: &Path, name: &str, first_host: &str, bound: Duration) -> anyhow::Result<NodeIdentity> {
    let started = Instant::now();
    loop {
        // The staging rename makes a fresh directory appear whole; in a reused one a certificate may be
        // half written when first seen, so a load that fails is retried until the bound.
        if let (Ok(_), Ok(client)) = (NodeIdentity::load(dir, name), NodeIdentity::load(dir, &client_name(name))) {
            return Ok(client);
        }
        if started.elapsed() >= bound {
            bail!(
                "{} did not appear within {} s: the first task (on {first_host}) makes it. Is {} on a filesystem \
                 every node of the allocation shares? Pass --cluster-dir on a shared filesystem (your home or \
                 project directory), or make the certificates beforehand (`troupe cluster init --dir DIR`, \
                 `troupe cluster add-node NODE --dir DIR` for each node) and pass --cluster-dir DIR",
                cert_path(dir, name).display(),
                bound.as_secs(),
                dir.display()
            );
        }
        std::thread::sleep(Duration::from_millis(POLL_MS));
    }
}

#[cfg(test)]
mod tests {
    use std::os::unix::fs::PermissionsExt;

    use super::*;

    fn mode(path: &Path) -> u32 {
        std::fs::metadata(path).unwrap().permissions().mode() & 0o777
    }

    #[test]
    fn the_first_task_makes_every_certificate_with_private_keys_and_the_others_load_theirs() {
        let tmp = tempfile::tempdir().unwrap();
        let dir = tmp.path().join("shared").join("slurm-7");
        let names = vec!["n1".to_string(), "n2".to_string()];
        prepare(&dir, &names).unwrap();
        assert_eq!(mode(&dir), 0o700);
        assert_eq!(mode(&dir.join("ca.key.pem")), 0o600);
        for name in &names {
            assert_eq!(mode(&dir.join("nodes").join(format!("{name}.key.pem"))), 0o600);
            assert_eq!(mode(&dir.join("nodes").join(format!("client-{name}.key.pem"))), 0o600);
            wait(&dir, name, "n1", Duration::ZERO).unwrap();
        }
        // No staging directory is left beside it.
        assert_eq!(std::fs::read_dir(dir.parent().unwrap()).unwrap().count(), 1);
        // A requeued allocation on other nodes reuses the CA and issues what is missing.
        prepare(&dir, &["n3".to_string()]).unwrap();
        wait(&dir, "n3", "n1", Duration::ZERO).unwrap();
    }

    #[test]
    fn a_certificate_that_never_appears_names_the_path_and_the_fix() {
        let tmp = tempfile::tempdir().unwrap();
        let error = wait(&tmp.path().join("c"), "n2", "n1", Duration::from_millis(300)).unwrap_err().to_string();
        assert!(error.contains("c/nodes/n2.pem did not appear within 0 s"), "{error}");
        assert!(error.contains("shares") && error.contains("--cluster-dir"), "{error}");
    }

    #[test]
    fn a_directory_without_the_ca_key_cannot_issue_missing_certificates() {
        let tmp = tempfile::tempdir().unwrap();
        let dir = tmp.path().join("c");
        prepare(&dir, &["n1".to_string()]).unwrap();
        std::fs::remove_file(dir.join("ca.key.pem")).unwrap();
        let error = prepare(&dir, &["n1".to_string(), "n2".to_string()]).unwrap_err().to_string();
        assert!(error.contains("[\"n2\", \"client-n2\"]") && error.contains("troupe cluster add-node NAME"), "{error}");
    }
}
