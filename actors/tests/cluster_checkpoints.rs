//! Durable checkpoints of cluster jobs: rank 0 writes one after committed steps; a job whose checkpoint
//! directory holds one continues from it; when every rank holding the committed state is lost, the job
//! rolls back to the latest checkpoint and still lands on the reference trajectory. On daemon processes:
//! a corrupt latest checkpoint is skipped (and logged) for the previous one, and a full disk fails a
//! checkpoint cleanly while training goes on.

mod common;

use std::path::Path;
use std::time::{Duration, Instant};

use troupe_actors::api::{Job, JobEvent, LocalCluster, LocalClusterOptions};
use troupe_actors::runtime::worker::WorkerMsg;
use troupe_model::config::JobConfig;
use troupe_model::oracle::compare_params;
use troupe_model::Trainer;

const TOLERANCE: f64 = 1e-5;

fn config(steps: u64, dir: &std::path::Path) -> JobConfig {
    let mut config = JobConfig::small(steps);
    // A schedule that does not depend on `steps`, so a run extended from 6 to 10 steps follows the same
    // learning rates as one of 10 (decay_steps = 0 would end the cosine at each run's own `steps`).
    config.train.decay_steps = 10;
    config.checkpoint.dir = Some(dir.to_owned());
    config.checkpoint.every_steps = 3;
    config.checkpoint.keep_last = 2;
    config
}

fn reference_params(config: &JobConfig) -> Trainer {
    tch::set_num_threads(1);
    let mut reference = config.clone();
    reference.checkpoint.dir = None;
    let mut trainer = Trainer::new(reference).unwrap();
    while trainer.step < config.train.steps {
        trainer.train_step();
    }
    trainer
}

async fn run_to_end(cluster: &LocalCluster, job: Job) -> Vec<JobEvent> {
    let mut handle = cluster.client().await.unwrap().submit(job).await.unwrap();
    let mut events = Vec::new();
    while let Some(e) = tokio::time::timeout(Duration::from_secs(60), handle.next_event()).await.unwrap().unwrap() {
        events.push(e);
    }
    events
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_job_continues_from_the_checkpoints_of_an_earlier_run() {
    let dir = tempfile::tempdir().unwrap();
    let ckpt = dir.path().join("ckpt");
    let cluster = LocalCluster::in_process(2).await.unwrap();
    let first = run_to_end(&cluster, Job::new(config(6, &ckpt))).await;
    let steps: Vec<u64> = first
        .iter()
        .filter_map(|e| if let JobEvent::Checkpoint { step, .. } = e { Some(*step) } else { None })
        .collect();
    assert_eq!(steps, vec![3, 6], "every 3 steps and at the end: {first:?}");
    assert!(matches!(first.last(), Some(JobEvent::Finished { steps: 6, .. })));
    let kept = troupe_model::checkpoint::step_dirs(&ckpt);
    assert_eq!(kept.len(), 2, "keep_last = 2: {kept:?}");

    // The same job with more steps continues from step 6, and ends where one uninterrupted run ends.
    let out = dir.path().join("final.safetensors");
    let config10 = config(10, &ckpt);
    let second = run_to_end(&cluster, Job::new(config10.clone()).save_final(&out)).await;
    assert!(matches!(second[0], JobEvent::Started { from_step: 6, world: 2, .. }), "{second:?}");
    let reference = reference_params(&config10);
    let comparison =
        compare_params(reference.model.specs(), &common::saved_params(&out, &reference), &reference.param_values());
    assert!(comparison.within(TOLERANCE), "{comparison:?}");
    cluster.shutdown().await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn losing_every_copy_of_the_state_rolls_back_to_the_checkpoint_and_keeps_the_trajectory() {
    let dir = tempfile::tempdir().unwrap();
    let ckpt = dir.path().join("ckpt");
    let cluster = LocalCluster::in_process(2).await.unwrap();
    let out = dir.path().join("final.safetensors");
    let mut config = config(15, &ckpt);
    config.checkpoint.every_steps = 5;
    let mut handle = cluster.client().await.unwrap().submit(Job::new(config.clone()).save_final(&out)).await.unwrap();
    let (mut crashed, mut rolled_back, mut recovered, mut durable) = (false, None, None, 0);
    let mut seen = Vec::new();
    while let Some(event) = tokio::time::timeout(Duration::from_secs(60), handle.next_event()).await.unwrap().unwrap() {
        seen.push(event.clone());
        match event {
            // Checkpoints are written in the background: a checkpoint counts once reported durable.
            JobEvent::Checkpoint { step, .. } => durable = durable.max(step),
            // Just past a checkpointed step, so the committed state is ahead of every checkpoint.
            JobEvent::Step { step, .. } if durable >= 5 && step % 5 != 0 && !crashed => {
                // Both workers fail at once: every in-memory copy of the committed state is gone.
                for i in 0..2 {
                    cluster.daemon(i).unwrap().worker(0).await.unwrap().cast(WorkerMsg::Panic("test".into())).unwrap();
                }
                crashed = true;
            }
            JobEvent::RolledBack { from_step, to_step } => rolled_back = Some((from_step, to_step)),
            JobEvent::Recovered { step, .. } if crashed => recovered = Some(step),
            JobEvent::Finished { steps, .. } => assert_eq!(steps, 15),
            JobEvent::Failed { reason } => panic!("the job failed: {reason}"),
            _ => {}
        }
    }
    assert!(crashed, "the workers were crashed mid-job: {seen:#?}");
    match rolled_back {
        Some((from, to)) => {
            assert!(
                to >= 5 && to % 5 == 0 && from > to,
                "rolled back from {from} to a checkpoint (every 5 steps): {to}"
            )
        }
        // The events trail the job: on a loaded machine the crash can land when the newest committed
        // step is itself checkpointed and durable. Then the restore from that checkpoint loses nothing,
        // and the controller reports a recovery at that step instead of a rollback.
        None => {
            let step = recovered.unwrap_or_else(|| panic!("a rollback or a recovery after the crash: {seen:#?}"));
            assert!(
                step % 5 == 0 && step <= durable,
                "recovered at step {step}, not at a durable checkpoint: {seen:#?}"
            );
        }
    }
    let reference = reference_params(&config);
    let comparison =
        compare_params(reference.model.specs(), &common::saved_params(&out, &reference), &reference.param_values());
    assert!(comparison.within(TOLERANCE), "{comparison:?}");
    cluster.shutdown().await;
}

/// Two daemon processes (one torch thread each) whose logs go to `logs/NAME.log`.
async fn processes_logging_to(logs: &Path) -> LocalCluster {
    std::fs::create_dir_all(logs).unwrap();
    let mut options = LocalClusterOptions::new(2);
    options.torch_threads = 1;
    options.log_dir = Some(logs.to_owned());
    LocalCluster::processes(common::binary(), options).await.expect("local cluster starts")
}

/// Every daemon's log, concatenated, without terminal colour codes.
fn logs_of(logs: &Path) -> String {
    let text: String =
        std::fs::read_dir(logs).unwrap().map(|e| std::fs::read_to_string(e.unwrap().path()).unwrap()).collect();
    let mut plain = String::with_capacity(text.len());
    let mut chars = text.chars();
    while let Some(c) = chars.next() {
        if c == '\u{1b}' {
            chars.by_ref().find(|&c| c == 'm');
        } else {
            plain.push(c);
        }
    }
    plain
}

fn checkpoint_steps(events: &[JobEvent]) -> Vec<u64> {
    events.iter().filter_map(|e| if let JobEvent::Checkpoint { step, .. } = e { Some(*step) } else { None }).collect()
}

fn final_params_match_the_reference(config: &JobConfig, out: &Path) {
    let reference = reference_params(config);
    let comparison =
        compare_params(reference.model.specs(), &common::saved_params(out, &reference), &reference.param_values());
    assert!(comparison.within(TOLERANCE), "{comparison:?}");
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_corrupt_latest_checkpoint_is_skipped_for_the_previous_one_and_logged() {
    let dir = tempfile::tempdir().unwrap();
    let (ckpt, logs) = (dir.path().join("ckpt"), dir.path().join("logs"));
    let cluster = processes_logging_to(&logs).await;
    let first = run_to_end(&cluster, Job::new(config(6, &ckpt))).await;
    assert_eq!(checkpoint_steps(&first), vec![3, 6], "{first:?}");

    // Flip one byte in the middle of the newest checkpoint's second shard.
    let shard = ckpt.join("step-00000006").join("shard-00001-of-00002.safetensors");
    let mut bytes = std::fs::read(&shard).unwrap();
    let middle = bytes.len() / 2;
    bytes[middle] ^= 0x40;
    std::fs::write(&shard, bytes).unwrap();

    let out = dir.path().join("final.safetensors");
    let config10 = config(10, &ckpt);
    let second = run_to_end(&cluster, Job::new(config10.clone()).save_final(&out)).await;
    assert!(matches!(second[0], JobEvent::Started { from_step: 3, .. }), "restored from step 3: {second:?}");
    assert!(matches!(second.last(), Some(JobEvent::Finished { steps: 10, .. })), "{second:?}");
    final_params_match_the_reference(&config10, &out);
    // Step 6 was computed again and its checkpoint rewritten in place of the corrupt one.
    // (Step 9's may be superseded by step 10's if the disk is slow: one write at a time, newest wins.)
    let steps = checkpoint_steps(&second);
    assert!(steps.first() == Some(&6) && steps.last() == Some(&10), "checkpoints: {steps:?}");
    troupe_model::checkpoint::verify(&ckpt.join("step-00000010")).unwrap();
    cluster.shutdown().await;
    let log = logs_of(&logs);
    assert!(
        log.lines().any(|l| l.contains("step-00000006") && l.contains("does not match its checksum")),
        "the daemons' logs say which checkpoint was skipped and why:\n{log}"
    );
}

/// A tmpfs mounted for a test, unmounted when dropped.
struct Tmpfs(std::path::PathBuf);

impl Tmpfs {
    /// The reason, where mounting is not permitted.
    fn mount(at: &Path, bytes: u64) -> Result<Tmpfs, String> {
        std::fs::create_dir_all(at).unwrap();
        let output = std::process::Command::new("mount")
            .args(["-t", "tmpfs", "-o", &format!("size={bytes}"), "tmpfs"])
            .arg(at)
            .output()
            .map_err(|e| format!("cannot run mount: {e}"))?;
        if !output.status.success() {
            return Err(String::from_utf8_lossy(&output.stderr).trim().to_owned());
        }
        Ok(Tmpfs(at.to_owned()))
    }
}

impl Drop for Tmpfs {
    fn drop(&mut self) {
        let _ = std::process::Command::new("umount").arg("-l").arg(&self.0).status();
    }
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_full_disk_fails_that_checkpoint_cleanly_and_training_goes_on() {
    let dir = tempfile::tempdir().unwrap();
    let (ckpt, logs) = (dir.path().join("ckpt"), dir.path().join("logs"));
    let _tmpfs = match Tmpfs::mount(&ckpt, 16 << 20) {
        Ok(t) => t,
        Err(why) => {
            eprintln!("SKIPPED a_full_disk_fails_that_checkpoint_cleanly_and_training_goes_on: cannot mount a tmpfs here ({why}); run as root with CAP_SYS_ADMIN");
            return;
        }
    };
    // 30 steps of 10–20 ms: however late the watcher gets a core on two busy ones, the disk is full before
    // the run ends and a later checkpoint shows that saving recovers once space is back.
    let config = config(30, &ckpt);
    // The disk fills up once the checkpoint of step 3 is in place (a watcher polling every millisecond):
    // the next checkpoint due then fails.
    let filler = ckpt.join("filler");
    let watcher = {
        let (step3, filler) = (ckpt.join("step-00000003"), filler.clone());
        std::thread::spawn(move || {
            let deadline = Instant::now() + Duration::from_secs(120);
            while !step3.exists() {
                assert!(Instant::now() < deadline, "no checkpoint of step 3 within 120 s");
                std::thread::sleep(Duration::from_millis(1));
            }
            let mut file = std::fs::File::create(&filler).unwrap();
            let chunk = vec![0u8; 64 << 10];
            while std::io::Write::write_all(&mut file, &chunk).is_ok() {}
        })
    };

    let cluster = processes_logging_to(&logs).await;
    let out = dir.path().join("final.safetensors");
    let mut handle = cluster.client().await.unwrap().submit(Job::new(config.clone()).save_final(&out)).await.unwrap();
    let mut events = Vec::new();
    let mut freed = false;
    let deadline = Instant::now() + Duration::from_secs(120);
    while let Some(event) = tokio::time::timeout(Duration::from_secs(60), handle.next_event()).await.unwrap().unwrap() {
        assert!(Instant::now() < deadline, "the job did not finish within 120 s: {events:?}");
        if let JobEvent::Failed { reason } = &event {
            panic!("the job failed: {reason}");
        }
        events.push(event);
        let failure_logged = logs_of(&logs).lines().any(|l| l.contains("checkpoint failed"));
        if !freed && failure_logged {
            watcher.is_finished().then_some(()).expect("the disk was filled");
            // While the disk is full: the failed write left nothing behind, and the newest valid checkpoint
            // is the newest one committed before it (step 3, or a later one when the filler was slow).
            let log = logs_of(&logs);
            let failure = log.lines().find(|l| l.contains("checkpoint failed")).unwrap();
            let failed: u64 = failure.rsplit("step=").next().unwrap().trim().parse().unwrap();
            let before = troupe_model::checkpoint::step_dirs(&ckpt).into_iter().rev().find(|(s, _)| *s < failed);
            let latest = troupe_model::checkpoint::latest_valid(&ckpt).0;
            assert!(before.as_ref().is_some_and(|(s, _)| *s >= 3), "logs:\n{log}");
            assert_eq!(latest, before.map(|(_, dir)| dir), "logs:\n{log}");
            let names: Vec<String> =
                std::fs::read_dir(&ckpt).unwrap().map(|e| e.unwrap().file_name().into_string().unwrap()).collect();
            assert!(
                !names.iter().any(|n| n.starts_with(".tmp-")),
                "a failed write left its temporary directory: {names:?}"
            );
            std::fs::remove_file(&filler).unwrap();
            freed = true;
        }
    }
    assert!(freed, "no checkpoint failed for lack of space; logs:\n{}", logs_of(&logs));
    assert!(matches!(events.last(), Some(JobEvent::Finished { steps: 30, .. })), "{events:?}");
    final_params_match_the_reference(&config, &out);
    let log = logs_of(&logs);
    let failure = log.lines().find(|l| l.contains("checkpoint failed")).unwrap();
    assert!(failure.contains("No space left on device"), "{failure}");
    let failed: u64 = failure.rsplit("step=").next().unwrap().trim().parse().unwrap();
    let steps = checkpoint_steps(&events);
    assert!(
        steps.first() == Some(&3) && steps.last() == Some(&30) && !steps.contains(&failed) && failed > 3,
        "checkpoints {steps:?}, step {failed} failed"
    );
    cluster.shutdown().await;
}
