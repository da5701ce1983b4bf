//! Daemons as real processes over QUIC on loopback: failure detection, epoch fencing, clean leave and
//! join, `troupe status --json`, and the errors of `troupe daemon` for bad configs.

mod common;

use std::process::Command;
use std::time::{Duration, Instant};

use common::{converged, names, processes, signal, status, wait_for};

const ALL: &[&str] = &["node-0", "node-1", "node-2"];
const SURVIVORS: &[&str] = &["node-0", "node-1"];
/// Failure timeout (1.5 s) plus one heartbeat, a tick and scheduling slack on a loaded 2-core machine.
const DETECTION_BOUND: Duration = Duration::from_millis(3_000);

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn sigkill_is_seen_by_every_survivor_within_the_timeout_and_bumps_the_epoch_once() {
    let cluster = processes(3).await;
    let before = converged(&cluster, &[0, 1, 2], ALL, Duration::from_secs(10)).await;
    signal(cluster.pid(2).unwrap(), "KILL");
    let killed = Instant::now();
    for survivor in [0, 1] {
        let (epoch, _) = wait_for(DETECTION_BOUND * 2, "the survivor to drop node-2", || async {
            let s = status(&cluster, survivor).await;
            (names(&s) == SURVIVORS).then_some(s.epoch)
        })
        .await;
        let seen = killed.elapsed();
        eprintln!("node-{survivor} saw node-2 dead {:.2} s after SIGKILL", seen.as_secs_f64());
        assert!(seen <= DETECTION_BOUND, "node-{survivor} took {seen:?} to see the kill");
        assert_eq!(epoch, before + 1, "node-{survivor}: one membership change, one epoch");
    }
    tokio::time::sleep(Duration::from_secs(2)).await;
    let after = status(&cluster, 0).await;
    assert_eq!(after.epoch, before + 1, "no further epoch bumps: {:?}", after.changes);
    let about_node_2: Vec<_> = after.changes.iter().filter(|c| c.contains("node-2")).collect();
    // Its kernel closed the control connection's companion socket: removed at once, not by silence.
    assert!(about_node_2.iter().any(|c| c.contains("ConnectionLost")), "{about_node_2:?}");
    cluster.shutdown().await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_paused_node_is_fenced_its_stale_messages_refused_and_it_rejoins_with_a_new_epoch() {
    let cluster = processes(3).await;
    let before = converged(&cluster, &[0, 1, 2], ALL, Duration::from_secs(10)).await;
    let pid = cluster.pid(2).unwrap();
    signal(pid, "STOP");
    let removed = converged(&cluster, &[0, 1], SURVIVORS, DETECTION_BOUND * 2).await;
    assert_eq!(removed, before + 1);
    // Stay paused well past the failure timeout (and the transport's idle timeout).
    tokio::time::sleep(Duration::from_millis(2_500)).await;
    signal(pid, "CONT");
    let rejoined = converged(&cluster, &[0, 1, 2], ALL, Duration::from_secs(15)).await;
    assert_eq!(rejoined, before + 2, "removed once, admitted again once");
    let controller = status(&cluster, 0).await;
    assert!(controller.refused_stale >= 1, "the resumed node's stale-epoch messages were refused: {controller:?}");
    let failed = controller.changes.iter().position(|c| c.contains("Failed") && c.contains("node-2"));
    let joined = controller.changes.iter().rposition(|c| c.contains("Joined") && c.contains("node-2"));
    assert!(failed.is_some() && joined > failed, "failed, then joined as a new member: {:?}", controller.changes);
    cluster.shutdown().await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn sigterm_leaves_cleanly_and_a_new_node_joins_while_idle() {
    let mut cluster = processes(3).await;
    let before = converged(&cluster, &[0, 1, 2], ALL, Duration::from_secs(10)).await;
    signal(cluster.pid(1).unwrap(), "TERM");
    let exit = cluster.wait_exit(1, Duration::from_secs(10)).expect("node-1 exits after SIGTERM");
    assert!(exit.success(), "a drained daemon exits 0: {exit:?}");
    let left = converged(&cluster, &[0, 2], &["node-0", "node-2"], Duration::from_secs(5)).await;
    assert_eq!(left, before + 1);
    let s = status(&cluster, 0).await;
    let about_node_1: Vec<_> = s.changes.iter().filter(|c| c.contains("node-1")).collect();
    assert!(about_node_1.iter().any(|c| c.contains("Left")), "a clean leave: {about_node_1:?}");
    let failures = about_node_1.iter().filter(|c| c.contains("Failed") || c.contains("ConnectionLost")).count();
    assert_eq!(failures, 0, "no failure reported: {about_node_1:?}");

    let new = cluster.add_node().unwrap();
    let joined = converged(&cluster, &[0, 2, new], &["node-0", "node-2", "node-3"], Duration::from_secs(10)).await;
    assert_eq!(joined, before + 2);
    cluster.shutdown().await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn status_json_lists_members_epoch_slots_and_jobs() {
    let cluster = processes(2).await;
    converged(&cluster, &[0, 1], &["node-0", "node-1"], Duration::from_secs(10)).await;
    let certs = cluster.certs_dir();
    let output = Command::new(common::binary())
        .args(["status", "--json", "--cluster", &cluster.addr().to_string(), "--as", "client"])
        .arg("--certs")
        .arg(&certs)
        .output()
        .unwrap();
    assert!(output.status.success(), "{}", String::from_utf8_lossy(&output.stderr));
    let line = String::from_utf8(output.stdout).unwrap();
    let status: serde_json::Value = serde_json::from_str(line.trim()).unwrap();
    assert_eq!(status["node"], "node-0");
    assert_eq!(status["leader"], true);
    assert!(status["epoch"].as_u64().unwrap() >= 2);
    let members = status["members"].as_array().unwrap();
    assert_eq!(members.len(), 2);
    assert_eq!(members[1]["name"], "node-1");
    assert_eq!(members[1]["slots"], 1);
    assert!(members[1]["addr"].as_str().unwrap().starts_with("127.0.0.1:"));
    assert!(status["jobs"].as_array().unwrap().is_empty());
    cluster.shutdown().await;
}

/// `troupe status` shows what each member's machine is using, from its heartbeats: the daemon's
/// resident memory and CPU share (CPU slots: no GPU figures and no NVML asked), in the JSON and in the
/// members table.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn status_shows_what_each_members_machine_is_using() {
    let cluster = processes(2).await;
    converged(&cluster, &[0, 1], &["node-0", "node-1"], Duration::from_secs(10)).await;
    let deadline = std::time::Instant::now() + Duration::from_secs(15);
    let members = loop {
        let members = cluster.client().await.unwrap().status().await.unwrap().members;
        // A CPU share needs two samples (a second apart) to have reached the controller.
        if members.iter().all(|m| m.load.as_ref().is_some_and(|l| l.cpu_percent.is_some())) {
            break members;
        }
        assert!(std::time::Instant::now() < deadline, "no load from every member: {members:?}");
        tokio::time::sleep(Duration::from_millis(200)).await;
    };
    for m in &members {
        let load = m.load.as_ref().unwrap();
        assert!(load.rss_bytes > 10 << 20, "{}: a daemon holds more than 10 MiB: {load:?}", m.name);
        assert!(load.cpu_percent.unwrap() <= 100, "{}: {load:?}", m.name);
        assert!(load.devices.is_empty() && load.devices_unavailable.is_none(), "{}: CPU slots: {load:?}", m.name);
    }
    let output = Command::new(common::binary())
        .args(["status", "--cluster", &cluster.addr().to_string(), "--as", "client", "--certs"])
        .arg(cluster.certs_dir())
        .output()
        .unwrap();
    let text = String::from_utf8_lossy(&output.stdout);
    assert!(output.status.success(), "{}", String::from_utf8_lossy(&output.stderr));
    assert!(text.lines().any(|l| l.starts_with("NODE") && l.contains("DEVICES  IN USE")), "{text}");
    for name in ["node-0", "node-1"] {
        let row = text.lines().find(|l| l.starts_with(name)).unwrap_or_else(|| panic!("no row for {name}: {text}"));
        assert!(row.contains(" cpu ") && row.contains(" host ") && row.contains("% cpu"), "{row}");
    }
    cluster.shutdown().await;
}

/// A job asking for the plaintext TCP data plane (`troupe job submit --data-plane plaintext-tcp`) is
/// refused — with the key to set — by a controller whose node.toml does not allow it (the default);
/// nothing of it is recorded, and the cluster goes on taking jobs.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_plaintext_tcp_job_is_refused_unless_the_cluster_allows_it() {
    use troupe_actors::api::{Job, JobEvent, LocalCluster, LocalClusterOptions};
    let options = LocalClusterOptions { allow_plaintext_tcp: false, ..LocalClusterOptions::new(1) };
    let cluster = LocalCluster::processes(common::binary(), options).await.unwrap();
    let dir = tempfile::tempdir().unwrap();
    let job = dir.path().join("job.toml");
    std::fs::write(&job, "[train]\nsteps = 1\nglobal_batch = 2\nmicro_batch = 2\ntorch_threads = 1\n").unwrap();
    let out = Command::new(common::binary())
        .args(["job", "submit", job.to_str().unwrap(), "--data-plane", "plaintext-tcp"])
        .args(["--cluster", &cluster.addr().to_string(), "--as", "client", "--certs"])
        .arg(cluster.certs_dir())
        .output()
        .unwrap();
    let stderr = String::from_utf8_lossy(&out.stderr);
    assert!(!out.status.success(), "a plaintext job was taken: {stderr}");
    assert!(stderr.contains("set `allow_plaintext_tcp = true`"), "{stderr}");
    let jobs = cluster.client().await.unwrap().status().await.unwrap().jobs;
    assert!(jobs.is_empty(), "the refused job was recorded: {jobs:?}");
    let config = troupe_model::config::JobConfig::from_file(&job).unwrap();
    let (end, _) = cluster.client().await.unwrap().submit(Job::new(config)).await.unwrap().wait().await.unwrap();
    assert!(matches!(end, JobEvent::Finished { steps: 1, .. }), "{end:?}");
    cluster.shutdown().await;
}

/// The controller's daemon is SIGKILLed between jobs and started again on its address and data dir: it
/// comes back past every epoch it used, the other node rejoins it, the finished job is still there with
/// every event (a watcher could replay them), and job ids go on from where they were.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_restarted_controller_resumes_its_epochs_jobs_and_job_ids_from_its_catalog() {
    let mut cluster = processes(2).await;
    let both = &["node-0", "node-1"];
    converged(&cluster, &[0, 1], both, Duration::from_secs(10)).await;
    let job = troupe_actors::api::Job::new(troupe_model::config::JobConfig::small(3)).name("before");
    let (end, _) = cluster.client().await.unwrap().submit(job).await.unwrap().wait().await.unwrap();
    assert!(matches!(end, troupe_actors::api::JobEvent::Finished { steps: 3, .. }), "{end:?}");
    let before = status(&cluster, 0).await;
    let finished = before.jobs.iter().find(|j| j.id == 1).cloned().expect("job 1 listed");
    let events = cluster.client().await.unwrap().job_status(1).await.unwrap().events;
    assert!(events >= 5, "started, 3 steps, finished: {events}");

    signal(cluster.pid(0).unwrap(), "KILL");
    assert!(cluster.wait_exit(0, Duration::from_secs(10)).is_some(), "node-0 died");
    tokio::task::block_in_place(|| cluster.restart_node(0)).unwrap();
    let epoch = converged(&cluster, &[0, 1], both, Duration::from_secs(15)).await;
    assert!(epoch >= before.epoch + 2, "past the old epochs ({} before, {epoch} after)", before.epoch);
    let after = status(&cluster, 0).await;
    assert!(after.changes.iter().any(|c| c.contains("restarted as the controller")), "{:?}", after.changes);
    let restored = after.jobs.iter().find(|j| j.id == 1).expect("job 1 still listed");
    assert_eq!(
        (restored.state, restored.step, &restored.name),
        (finished.state, 3, &finished.name),
        "as it ended: {restored:?}"
    );
    let info = cluster.client().await.unwrap().job_status(1).await.unwrap();
    assert_eq!(info.events, events, "every event kept, for watchers to replay: {info:?}");

    let next = troupe_actors::api::Job::new(troupe_model::config::JobConfig::small(2)).name("after");
    let handle = cluster.client().await.unwrap().submit(next).await.unwrap();
    assert_eq!(handle.id(), 2, "job ids go on");
    let (end, _) = handle.wait().await.unwrap();
    assert!(matches!(end, troupe_actors::api::JobEvent::Finished { steps: 2, .. }), "{end:?}");
    cluster.shutdown().await;
}

/// A controller killed again before any node rejoined it still comes back past the epoch its last
/// incarnation started at: that epoch was announced (a `Fenced` names it) though no view changed since.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_controller_restarted_twice_never_reuses_an_epoch() {
    let mut cluster = processes(1).await;
    let mut last = converged(&cluster, &[0], &["node-0"], Duration::from_secs(10)).await;
    for round in 0..2 {
        signal(cluster.pid(0).unwrap(), "KILL");
        assert!(cluster.wait_exit(0, Duration::from_secs(10)).is_some(), "node-0 died");
        tokio::task::block_in_place(|| cluster.restart_node(0)).unwrap();
        let epoch = converged(&cluster, &[0], &["node-0"], Duration::from_secs(15)).await;
        assert!(epoch > last, "restart {round}: epoch {epoch} after {last}");
        last = epoch;
    }
    cluster.shutdown().await;
}

fn daemon_with(config: &str) -> (bool, String) {
    let dir = tempfile::tempdir().unwrap();
    let config = config.replace("DIR", dir.path().to_str().unwrap());
    let path = dir.path().join("node.toml");
    std::fs::write(&path, config).unwrap();
    let certs = dir.path().join("certs");
    troupe_cluster::init_cluster(&certs).unwrap();
    troupe_cluster::add_node("node-a", &certs).unwrap();
    let out = Command::new(common::binary()).args(["daemon", "--config"]).arg(&path).output().unwrap();
    (out.status.success(), String::from_utf8_lossy(&out.stderr).into_owned())
}

#[test]
fn daemon_config_errors_name_the_key_and_the_fix() {
    let base = "name = \"node-a\"\nlisten = \"127.0.0.1:0\"\ndata_dir = \"DIR/data\"\ncerts = \"DIR/certs\"\n";
    let cases: Vec<(String, &[&str])> = vec![
        (format!("{base}slotz = 2\n"), &["unknown field `slotz`", "slots"]),
        (format!("{base}slots = 65\n"), &["`slots`", "0..=64"]),
        (base.replace("node-a", "Node_A"), &["`name`", "a-z, 0-9"]),
        (base.replace("node-a", "node-b"), &["no certificate for node \"node-b\"", "troupe cluster add-node node-b"]),
        (base.replace("DIR/certs", "DIR/nowhere"), &["no ca.pem", "troupe cluster init"]),
        (
            format!("{base}[membership]\nfailure_timeout_ms = 100\n"),
            &["failure_timeout_ms", "twice heartbeat_interval_ms"],
        ),
        (base.replace("127.0.0.1:0", "not-an-address"), &["listen", "invalid socket address"]),
        (format!("{base}devices = \"gpu\"\n"), &["`devices`", "not a device kind", "\"cuda\""]),
        (format!("{base}devices = [0, 0]\n"), &["`devices`", "device 0 twice"]),
    ];
    // CUDA asked for where there is none: refused at start, naming the key and the fix.
    let no_cuda = troupe_cluster::nccl::cuda_devices().map_or(true, |d| d.is_empty());
    let cases: Vec<(String, &[&str])> = if no_cuda {
        let refused: &[&str] = &["`devices`", "none can be used on this machine", "set `slots`"];
        cases.into_iter().chain([(format!("{base}devices = \"cuda\"\n"), refused)]).collect()
    } else {
        cases
    };
    for (config, needles) in &cases {
        let (ok, stderr) = daemon_with(config);
        assert!(!ok, "{config:?} should fail");
        for needle in *needles {
            assert!(stderr.contains(needle), "error for {config:?} lacks {needle:?}: {stderr}");
        }
        assert!(!stderr.contains("panicked"), "{stderr}");
    }
}

#[test]
fn a_daemon_refuses_an_address_in_use() {
    let taken = std::net::UdpSocket::bind("127.0.0.1:0").unwrap();
    let port = taken.local_addr().unwrap().port();
    let config =
        format!("name = \"node-a\"\nlisten = \"127.0.0.1:{port}\"\ndata_dir = \"DIR/data\"\ncerts = \"DIR/certs\"\n");
    let (ok, stderr) = daemon_with(&config);
    assert!(!ok);
    assert!(stderr.contains(&format!("listen = 127.0.0.1:{port}")) && stderr.contains("in use"), "{stderr}");
}
