//! The cluster commands as a user runs them: `troupe train --nodes N` (an embedded local cluster that
//! leaves no process behind, also when interrupted or killed), and `troupe job submit|status|cancel`.

mod common;

use std::io::{BufRead, BufReader};
use std::process::{Child, Command, Stdio};
use std::time::{Duration, Instant};

use serde_json::Value;

const SMALL_JOB: &str = "[model]\nn_layers = 1\nd_model = 64\nn_heads = 2\ncontext = 32\n[train]\nglobal_batch = 4\nmicro_batch = 2\ntorch_threads = 1\n";

fn children(pid: u32) -> Vec<u32> {
    let out = Command::new("pgrep").arg("-P").arg(pid.to_string()).output().expect("pgrep runs");
    String::from_utf8_lossy(&out.stdout).lines().filter_map(|l| l.trim().parse().ok()).collect()
}

fn alive(pid: u32) -> bool {
    std::path::Path::new(&format!("/proc/{pid}")).exists()
        && !std::fs::read_to_string(format!("/proc/{pid}/stat")).unwrap_or_default().contains(") Z ")
}

fn wait_gone(pids: &[u32], timeout: Duration) {
    let t0 = Instant::now();
    while pids.iter().any(|&p| alive(p)) {
        assert!(t0.elapsed() < timeout, "daemons {pids:?} still running after {timeout:?}");
        std::thread::sleep(Duration::from_millis(50));
    }
}

/// Starts `troupe train --json` with `args` and reads events until the first step.
#[allow(clippy::zombie_processes)] // the caller waits for it
fn train_until_first_step(dir: &std::path::Path, args: &[&str]) -> (Child, BufReader<std::process::ChildStdout>) {
    let job = dir.join("job.toml");
    std::fs::write(&job, SMALL_JOB).unwrap();
    let mut child = Command::new(common::binary())
        .args(["train", "--json", "--config"])
        .arg(&job)
        .args(args)
        .stdout(Stdio::piped())
        .stderr(Stdio::inherit())
        .spawn()
        .unwrap();
    let mut out = BufReader::new(child.stdout.take().unwrap());
    let mut line = String::new();
    loop {
        line.clear();
        assert!(out.read_line(&mut line).unwrap() > 0, "train ended before its first step");
        let event: Value = serde_json::from_str(&line).unwrap();
        if event["event"] == "step" {
            return (child, out);
        }
    }
}

#[test]
fn train_on_an_embedded_cluster_reports_world_and_epoch_and_leaves_nothing_behind() {
    let dir = tempfile::tempdir().unwrap();
    let (mut child, out) = train_until_first_step(dir.path(), &["--nodes", "2", "--steps", "6"]);
    let daemons = children(child.id());
    assert_eq!(daemons.len(), 2, "two daemon processes: {daemons:?}");
    let events: Vec<Value> = out.lines().map(|l| serde_json::from_str(&l.unwrap()).unwrap()).collect();
    assert!(common::wait_child(&mut child, Duration::from_secs(30), "troupe train").success());
    let steps: Vec<&Value> = events.iter().filter(|e| e["event"] == "step").collect();
    assert_eq!(steps.len(), 5, "steps 2..=6 after the first: {events:?}");
    for s in &steps {
        assert_eq!(s["world"], 2);
        assert!(s["epoch"].as_u64().unwrap() >= 2);
        assert!(s["tokens_per_s"].as_f64().unwrap() > 0.0);
        // Each daemon's peak memory (a rank holds libtorch, the model and its optimizer: > 50 MiB).
        let peaks = s["peak_rss_mib_per_rank"].as_array().unwrap_or_else(|| panic!("peak memory per rank: {s}"));
        assert_eq!(peaks.len(), 2, "{s}");
        assert!(peaks.iter().all(|p| p.as_f64().is_some_and(|mib| mib > 50.0)), "{s}");
    }
    let summary = events.last().unwrap();
    assert_eq!(summary["event"], "summary");
    assert_eq!(summary["steps"], 6);
    assert_eq!(summary["world"], 2);
    wait_gone(&daemons, Duration::from_secs(5));
}

/// `troupe train --nodes 2` stopped by `sig` after its first step: it exits unsuccessfully, promptly, and
/// takes its daemons with it.
fn stop_train_with(sig: &str) {
    let dir = tempfile::tempdir().unwrap();
    let (mut child, out) = train_until_first_step(dir.path(), &["--nodes", "2", "--steps", "100000"]);
    // Keep reading its output, as a terminal would: a full pipe would block the CLI mid-print.
    let drain = std::thread::spawn(move || out.lines().map_while(Result::ok).count());
    let daemons = children(child.id());
    assert_eq!(daemons.len(), 2);
    common::signal(child.id(), sig);
    let status = common::wait_child(&mut child, Duration::from_secs(30), &format!("troupe train after SIG{sig}"));
    drain.join().unwrap();
    assert!(!status.success(), "an interrupted run says so");
    wait_gone(&daemons, Duration::from_secs(5));
}

#[test]
fn interrupting_train_cancels_the_job_and_stops_every_daemon() {
    stop_train_with("INT");
}

#[test]
fn terminating_train_cancels_the_job_and_stops_every_daemon() {
    stop_train_with("TERM");
}

#[test]
fn killing_train_takes_its_daemons_down_too() {
    let dir = tempfile::tempdir().unwrap();
    let (mut child, _out) = train_until_first_step(dir.path(), &["--nodes", "2", "--steps", "100000"]);
    let daemons = children(child.id());
    // A SIGKILLed CLI cannot remove its temporary cluster directory: find it to clean up after the test.
    let cmdline = std::fs::read(format!("/proc/{}/cmdline", daemons[0])).unwrap();
    let config = cmdline.split(|&b| b == 0).map(String::from_utf8_lossy).find(|a| a.ends_with(".toml")).unwrap();
    let cluster_dir = std::path::Path::new(config.as_ref()).parent().unwrap().to_owned();
    common::signal(child.id(), "KILL");
    common::wait_child(&mut child, Duration::from_secs(10), "troupe train after SIGKILL");
    wait_gone(&daemons, Duration::from_secs(5));
    std::fs::remove_dir_all(&cluster_dir).unwrap();
}

fn troupe_json(args: &[&str], cluster: &troupe_actors::api::LocalCluster) -> Value {
    let out = Command::new(common::binary())
        .args(args)
        .args(["--json", "--cluster", &cluster.addr().to_string(), "--as", "client", "--certs"])
        .arg(cluster.certs_dir())
        .output()
        .unwrap();
    assert!(out.status.success(), "{args:?}: {}", String::from_utf8_lossy(&out.stderr));
    let stdout = String::from_utf8(out.stdout).unwrap();
    serde_json::from_str(stdout.lines().next().unwrap()).unwrap()
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn job_submit_status_and_cancel_from_the_command_line() {
    let cluster = common::processes(2).await;
    let dir = tempfile::tempdir().unwrap();
    let job = dir.path().join("long.toml");
    std::fs::write(&job, format!("{SMALL_JOB}steps = 100000\n")).unwrap();
    let submitted =
        troupe_json(&["job", "submit", job.to_str().unwrap(), "--detach", "--data-plane", "encrypted-tcp"], &cluster);
    assert_eq!(submitted["event"], "submitted");
    let id = submitted["job"].as_u64().unwrap().to_string();
    let (info, _) = common::wait_for(Duration::from_secs(30), "the job to commit a step", || async {
        let info = troupe_json(&["job", "status", &id], &cluster);
        (info["step"].as_u64().unwrap() > 0).then_some(info)
    })
    .await;
    assert_eq!(info["state"], "running");
    assert_eq!(info["name"], "long");
    assert_eq!(info["world"], 2);
    assert_eq!(info["data_plane"], "encrypted_tcp", "the data plane asked for on the command line");
    troupe_json(&["job", "cancel", &id], &cluster);
    let (info, _) = common::wait_for(Duration::from_secs(10), "the job to be cancelled", || async {
        let info = troupe_json(&["job", "status", &id], &cluster);
        (info["state"] == "cancelled").then_some(info)
    })
    .await;
    assert!(info["step"].as_u64().unwrap() < 100000);
    let status = common::status(&cluster, 0).await;
    assert_eq!(status.jobs.len(), 1);

    let out = Command::new(common::binary())
        .args(["job", "status", "99", "--cluster", &cluster.addr().to_string(), "--as", "client", "--certs"])
        .arg(cluster.certs_dir())
        .output()
        .unwrap();
    assert!(!out.status.success());
    assert!(String::from_utf8_lossy(&out.stderr).contains("no job 99"));
    cluster.shutdown().await;
}

/// A watcher starved for longer than the QUIC idle timeout (here: SIGSTOPped, as a loaded laptop might
/// starve it) loses its connection to the controller; it reconnects and the controller replays the events
/// it missed, so it prints every step exactly once, in order, and exits 0 with the job.
/// `troupe job submit --json` of a `steps`-step job as the cluster's "client" certificate, its stdout
/// read on a thread (a message on the channel at each step); the thread returns every line.
fn submit_following(
    cluster: &troupe_actors::api::LocalCluster,
    dir: &std::path::Path,
    steps: u64,
) -> (Child, std::sync::mpsc::Receiver<()>, std::thread::JoinHandle<Vec<String>>) {
    let job = dir.join("watched.toml");
    std::fs::write(&job, format!("{SMALL_JOB}steps = {steps}\n")).unwrap();
    let mut child = Command::new(common::binary())
        .args(["job", "submit", "--json", job.to_str().unwrap(), "--cluster", &cluster.addr().to_string()])
        .args(["--as", "client", "--certs"])
        .arg(cluster.certs_dir())
        .stdout(Stdio::piped())
        .stderr(Stdio::piped())
        .spawn()
        .unwrap();
    let (tx, rx) = std::sync::mpsc::channel();
    let stdout = BufReader::new(child.stdout.take().unwrap());
    let reader = std::thread::spawn(move || {
        let mut lines = Vec::new();
        for line in stdout.lines().map_while(Result::ok) {
            if line.contains("\"event\":\"step\"") {
                let _ = tx.send(());
            }
            lines.push(line);
        }
        lines
    });
    (child, rx, reader)
}

/// Waits for the follower's end; returns its stderr after checking it succeeded and printed every one of
/// `steps` steps once, in order, then its summary.
fn followed_every_step(mut child: Child, reader: std::thread::JoinHandle<Vec<String>>, steps: u64) -> String {
    let status = common::wait_child(&mut child, Duration::from_secs(120), "troupe job submit");
    let lines = reader.join().unwrap();
    let mut stderr = String::new();
    std::io::Read::read_to_string(&mut child.stderr.take().unwrap(), &mut stderr).unwrap();
    assert!(status.success(), "{status:?}: {stderr}");
    let events: Vec<Value> = lines.iter().filter_map(|l| serde_json::from_str(l).ok()).collect();
    let seen: Vec<u64> = events.iter().filter(|e| e["event"] == "step").map(|e| e["step"].as_u64().unwrap()).collect();
    assert_eq!(seen, (1..=steps).collect::<Vec<_>>(), "every step once, in order");
    assert_eq!(events.last().unwrap()["event"], "summary", "{lines:?}");
    assert_eq!(events.last().unwrap()["steps"], steps, "{lines:?}");
    stderr
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_watcher_that_loses_its_connection_reconnects_and_misses_no_event() {
    const STEPS: u64 = 200;
    let cluster = common::processes(2).await;
    let dir = tempfile::tempdir().unwrap();
    let (child, steps, reader) = submit_following(&cluster, dir.path(), STEPS);
    steps.recv_timeout(Duration::from_secs(60)).expect("the first step within 60 s");
    common::signal(child.id(), "STOP");
    std::thread::sleep(Duration::from_millis(3_500)); // past the 2 s idle timeout
    common::signal(child.id(), "CONT");
    let stderr = followed_every_step(child, reader, STEPS);
    assert!(stderr.contains("reconnected to the controller"), "the connection was lost and re-made: {stderr}");
    cluster.shutdown().await;
}

/// A user's `troupe status` beside the `troupe job submit` that follows a job, under the same
/// certificate: each command keeps its own connection — the follower is not disconnected (no
/// reconnection, no stall) and the status gets its own reply.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn status_beside_a_follower_under_the_same_certificate_disturbs_nothing() {
    const STEPS: u64 = 200;
    let cluster = common::processes(2).await;
    let dir = tempfile::tempdir().unwrap();
    let (child, steps, reader) = submit_following(&cluster, dir.path(), STEPS);
    steps.recv_timeout(Duration::from_secs(60)).expect("the first step within 60 s");
    for _ in 0..3 {
        let status = Command::new(common::binary())
            .args(["status", "--json", "--cluster", &cluster.addr().to_string(), "--as", "client", "--certs"])
            .arg(cluster.certs_dir())
            .output()
            .unwrap();
        assert!(status.status.success(), "{}", String::from_utf8_lossy(&status.stderr));
        let reply: Value = serde_json::from_slice(&status.stdout).expect("troupe status --json prints JSON");
        assert_eq!(reply["members"].as_array().map(Vec::len), Some(2), "{reply}");
    }
    let stderr = followed_every_step(child, reader, STEPS);
    assert!(!stderr.contains("lost the connection"), "the follower kept its connection: {stderr}");
    cluster.shutdown().await;
}

/// `troupe job submit` as people read it: the progress lines and summary of `troupe train`, a run
/// directory that `troupe trace` and `troupe plot` draw; and a job that fails exits non-zero saying what
/// happened and where to look.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn job_submit_reports_like_train_records_a_run_dir_and_fails_loudly() {
    let cluster = common::processes(2).await;
    let dir = tempfile::tempdir().unwrap();
    let submit = |job: &std::path::Path, extra: &[&str]| {
        Command::new(common::binary())
            .args(["job", "submit"])
            .arg(job)
            .args(extra)
            .args(["--cluster", &cluster.addr().to_string(), "--as", "client", "--certs"])
            .arg(cluster.certs_dir())
            .output()
            .unwrap()
    };
    let job = dir.path().join("short.toml");
    std::fs::write(&job, format!("{SMALL_JOB}steps = 4\n")).unwrap();
    let run = dir.path().join("run");
    let out = submit(&job, &["--run-dir", run.to_str().unwrap(), "--log-every", "1"]);
    let stdout = String::from_utf8_lossy(&out.stdout);
    assert!(out.status.success(), "{stdout}{}", String::from_utf8_lossy(&out.stderr));
    assert!(!stdout.contains("{\""), "no JSON without --json: {stdout}");
    assert!(stdout.lines().any(|l| l.starts_with("submitted job ")), "{stdout}");
    assert!(stdout.contains("running data-parallel on 2 rank(s)"), "{stdout}");
    let steps = stdout.lines().filter(|l| l.starts_with("step ")).count();
    assert_eq!(steps, 4, "a line per step with --log-every 1: {stdout}");
    assert!(stdout.lines().any(|l| l.starts_with("done: 4 steps on 2 ranks")), "{stdout}");
    assert!(stdout.contains(&format!("run recorded in {}", run.display())), "{stdout}");
    let events = std::fs::read_to_string(run.join("events.jsonl")).unwrap();
    assert_eq!(events.lines().filter(|l| l.contains("\"event\":\"phases\"")).count(), 8, "2 ranks × 4 steps");
    for command in ["trace", "plot"] {
        let drawn = Command::new(common::binary()).args([command, run.to_str().unwrap()]).output().unwrap();
        assert!(drawn.status.success(), "troupe {command}: {}", String::from_utf8_lossy(&drawn.stderr));
    }
    assert!(run.join("timeline.svg").exists() && run.join("plot.svg").exists());

    // Three nodes wanted, two offered, one second to wait: the job fails, and so does the command.
    let job = dir.path().join("starved.toml");
    std::fs::write(&job, format!("{SMALL_JOB}steps = 4\n[elastic]\nmin_nodes = 3\nwait_s = 1\n")).unwrap();
    let out = submit(&job, &[]);
    let stderr = String::from_utf8_lossy(&out.stderr);
    assert!(!out.status.success(), "a failed job fails the command");
    assert!(stderr.contains("failed after step 0 of 4"), "{stderr}");
    assert!(stderr.contains("elastic.min_nodes = 3") && stderr.contains("troupe job status"), "{stderr}");
    let json = submit(&job, &["--json"]);
    assert!(!json.status.success());
    let last: Value = serde_json::from_str(String::from_utf8_lossy(&json.stdout).lines().last().unwrap()).unwrap();
    assert_eq!(last["event"], "failed", "{last}");
    assert!(last["reason"].as_str().unwrap().contains("elastic.wait_s"), "{last}");
    cluster.shutdown().await;
}

#[test]
fn cluster_init_and_add_node_print_what_they_wrote_as_json() {
    let dir = tempfile::tempdir().unwrap();
    let certs = dir.path().join("certs");
    let run = |args: &[&str]| {
        let out = Command::new(env!("CARGO_BIN_EXE_troupe")).args(args).output().expect("troupe runs");
        assert!(out.status.success(), "{}", String::from_utf8_lossy(&out.stderr));
        serde_json::from_slice::<Value>(&out.stdout).expect("one JSON object")
    };
    let certs_arg = certs.to_str().unwrap();
    let init = run(&["cluster", "init", "--dir", certs_arg, "--json"]);
    assert!(std::path::Path::new(init["ca"].as_str().unwrap()).exists(), "{init}");
    let node = run(&["cluster", "add-node", "node-a", "--dir", certs_arg, "--json"]);
    assert_eq!(node["node"], "node-a");
    for key in ["cert", "key"] {
        assert!(std::path::Path::new(node[key].as_str().unwrap()).exists(), "{node}");
    }
}

/// `troupe train --nodes 2 --recompute`: DDP over QUIC between two daemon processes, each rank keeping
/// only its block inputs and recomputing the blocks in the backward, with the bucket all-reduce
/// overlapped (the default) and two micro-batches per rank — equal to the in-process reference (no
/// recomputation) within 1e-5: every step's loss and the final parameters. With the corpus' last tenth
/// held out and `eval_every = 4`, the ranks' validation loss reaches the command as `eval` events after
/// steps 4 and 8, the last equal to the reference's.
#[test]
fn train_with_recompute_on_two_daemons_equals_the_reference() {
    const STEPS: u64 = 8;
    let dir = tempfile::tempdir().unwrap();
    let job = dir.path().join("job.toml");
    let config_text = SMALL_JOB.replace("n_layers = 1", "n_layers = 2").replace("global_batch = 4", "global_batch = 8")
        + "eval_every = 4\neval_samples = 8\n[data]\nval_fraction = 0.1\n";
    std::fs::write(&job, &config_text).unwrap();
    let saved = dir.path().join("final.safetensors");
    let mut child = Command::new(common::binary())
        .args(["train", "--json", "--recompute", "--nodes", "2", "--steps", &STEPS.to_string(), "--config"])
        .arg(&job)
        .arg("--save-final")
        .arg(&saved)
        .stdout(Stdio::piped())
        .stderr(Stdio::inherit())
        .spawn()
        .unwrap();
    let status = common::wait_child(&mut child, Duration::from_secs(120), "troupe train --nodes 2 --recompute");
    assert!(status.success(), "troupe train --nodes 2 --recompute failed: {status}");
    let mut stdout = String::new();
    std::io::Read::read_to_string(&mut child.stdout.take().unwrap(), &mut stdout).unwrap();
    let events: Vec<Value> = stdout.lines().map(|l| serde_json::from_str::<Value>(l).unwrap()).collect();
    assert_eq!(events[0]["event"], "start", "{stdout}");
    assert_eq!(events[0]["data_plane"], "auto", "the start event names the job's data plane: {}", events[0]);
    let losses: Vec<f64> = events
        .iter()
        .filter(|e| e["event"] == "step")
        .map(|e| e["loss"].as_f64().expect("a step event has a loss"))
        .collect();

    let mut config = troupe_model::JobConfig::from_toml(&config_text, "job.toml").unwrap();
    config.train.steps = STEPS;
    tch::set_num_threads(1);
    let mut reference = troupe_model::Trainer::new(config).unwrap();
    let reference_losses: Vec<f64> = (0..STEPS).map(|_| reference.train_step().loss).collect();
    assert_eq!(losses.len(), reference_losses.len(), "one step event per step: {stdout}");
    let loss_diff = troupe_model::oracle::worst_loss_diff(&losses, &reference_losses);
    assert!(loss_diff <= 1e-5, "losses differ from the reference by {loss_diff:e} relative");

    let tensors = tch::Tensor::read_safetensors(&saved).unwrap();
    let specs = reference.model.specs();
    let params: Vec<tch::Tensor> = specs
        .iter()
        .map(|s| tensors.iter().find(|(n, _)| *n == s.name).unwrap_or_else(|| panic!("{} saved", s.name)).1.copy())
        .collect();
    let comparison = troupe_model::oracle::compare_params(specs, &params, &reference.param_values());
    assert!(comparison.within(1e-5), "final parameters: {comparison:?}");

    let evals: Vec<(u64, f64)> = events
        .iter()
        .filter(|e| e["event"] == "eval")
        .map(|e| (e["step"].as_u64().unwrap(), e["loss"].as_f64().unwrap()))
        .collect();
    assert_eq!(evals.iter().map(|e| e.0).collect::<Vec<_>>(), [4, 8], "{stdout}");
    let want = reference.evaluate().expect("held out").loss;
    assert!((evals[1].1 - want).abs() <= 1e-5 * want, "validation loss {} vs the reference's {want}", evals[1].1);
}
