//! troupe on a real Slurm: Debian's slurmctld, three slurmd (nodes n1, n2 and n3 on 127.0.0.1-3,
//! Slurm's multiple-slurmd mode) and a private munged, configured and started by each test in a
//! temporary directory and stopped at its end. The batch script is the one `troupe slurm sbatch` writes,
//! submitted with the real `sbatch`. Skipped, saying why, where Slurm is not installed or the tests do
//! not run as root (scripts/provision-host.sh installs slurm-wlm when run as root).

mod common;

use std::path::{Path, PathBuf};
use std::process::{Child, Command, Stdio};
use std::time::{Duration, Instant};

use troupe_model::config::JobConfig;
use troupe_model::oracle::{compare_params, worst_loss_diff};
use troupe_model::Trainer;

const TOLERANCE: f64 = 1e-5;
/// slurm.conf's KillWait: scancel's SIGTERM, then SIGKILL this much later.
const KILL_WAIT_S: u64 = 30;
/// Longest a batch job of these tests may run before `sbatch --wait` is given up on.
const BATCH_TIMEOUT: Duration = Duration::from_secs(300);
const NODES: [(&str, &str); 3] = [("n1", "127.0.0.1"), ("n2", "127.0.0.2"), ("n3", "127.0.0.3")];

/// A Slurm cluster of three nodes on this machine, stopped when dropped.
struct Slurm {
    dir: tempfile::TempDir,
    conf: PathBuf,
    daemons: Vec<(String, Child)>,
}

impl Slurm {
    /// Starts munged, slurmctld and three slurmd; None (with the reason on stderr) where it cannot.
    fn start() -> Option<Slurm> {
        let root = Command::new("id").arg("-u").output().is_ok_and(|o| o.stdout.trim_ascii() == b"0");
        let tools = ["munged", "slurmctld", "slurmd", "sbatch", "scontrol", "scancel", "squeue", "sinfo"];
        let missing: Vec<&str> = tools.into_iter().filter(|t| !on_path(t)).collect();
        if !root || !missing.is_empty() {
            eprintln!(
                "SKIPPED: a real Slurm needs root and Debian's slurm-wlm and munge (missing: {missing:?}, root: \
                 {root}); run scripts/provision-host.sh as root"
            );
            return None;
        }
        let dir = tempfile::Builder::new().prefix("troupe-slurm-").tempdir().unwrap();
        let d = dir.path();
        for sub in ["state", "spool", "log", "submit"] {
            std::fs::create_dir_all(d.join(sub)).unwrap();
        }
        let key = d.join("munge.key");
        let mut bytes = vec![0u8; 1024];
        use std::io::Read;
        std::fs::File::open("/dev/urandom").unwrap().read_exact(&mut bytes).unwrap();
        write_private(&key, &bytes);
        let socket = d.join("munge.sock");
        let mut daemons = Vec::new();
        let munged = Command::new("munged")
            .args(["--foreground", "--force"])
            .arg(format!("--socket={}", socket.display()))
            .arg(format!("--key-file={}", key.display()))
            .arg(format!("--log-file={}", d.join("log/munged.log").display()))
            .arg(format!("--pid-file={}", d.join("munged.pid").display()))
            .arg(format!("--seed-file={}", d.join("munged.seed").display()))
            .stdout(Stdio::null())
            .stderr(Stdio::null())
            .spawn()
            .expect("munged starts");
        daemons.push(("munged".to_string(), munged));
        wait_until(Duration::from_secs(10), "munged's socket", || socket.exists());
        let conf = d.join("slurm.conf");
        std::fs::write(&conf, slurm_conf(d, &socket)).unwrap();
        let mut slurm = Slurm { dir, conf, daemons };
        let log = |name: &str| std::fs::File::create(slurm.dir.path().join("log").join(format!("{name}.out"))).unwrap();
        let ctld = Command::new("slurmctld")
            .args(["-D", "-i", "-f"])
            .arg(&slurm.conf)
            .stdout(log("ctld"))
            .stderr(log("ctld.err"))
            .spawn();
        slurm.daemons.push(("slurmctld".into(), ctld.expect("slurmctld starts")));
        for (node, _) in NODES {
            let slurmd = Command::new("slurmd")
                .args(["-D", "-f"])
                .arg(&slurm.conf)
                .args(["-N", node])
                .stdout(log(node))
                .stderr(log(&format!("{node}.err")))
                .spawn();
            slurm.daemons.push((format!("slurmd {node}"), slurmd.expect("slurmd starts")));
        }
        let idle = || {
            let out = slurm.cmd("sinfo").args(["-h", "-N", "-o", "%N %T"]).output().ok()?;
            let text = String::from_utf8_lossy(&out.stdout).into_owned();
            (text.lines().filter(|l| l.ends_with(" idle")).count() == NODES.len()).then_some(())
        };
        let started = Instant::now();
        while idle().is_none() {
            assert!(
                started.elapsed() < Duration::from_secs(60),
                "Slurm's nodes are not idle after 60 s: {}",
                slurm.logs()
            );
            std::thread::sleep(Duration::from_millis(250));
        }
        Some(slurm)
    }

    /// A Slurm client command talking to this cluster.
    fn cmd(&self, program: &str) -> Command {
        let mut command = Command::new(program);
        command.env("SLURM_CONF", &self.conf).current_dir(self.submit_dir());
        command
    }

    fn submit_dir(&self) -> PathBuf {
        self.dir.path().join("submit")
    }

    fn logs(&self) -> String {
        let mut text = String::new();
        for entry in std::fs::read_dir(self.dir.path().join("log")).unwrap() {
            let path = entry.unwrap().path();
            let body = std::fs::read_to_string(&path).unwrap_or_default();
            let tail: Vec<&str> = body.lines().rev().take(20).collect();
            text += &format!("\n--- {}\n{}", path.display(), tail.into_iter().rev().collect::<Vec<_>>().join("\n"));
        }
        text
    }

    /// `troupe slurm sbatch job.toml --nodes 2 ...` for a job of `config`: the script's path.
    fn script(&self, config: &str, extra: &[&str]) -> PathBuf {
        self.script_on(2, config, extra)
    }

    /// `troupe slurm sbatch job.toml --nodes NODES ...` for a job of `config`: the script's path.
    fn script_on(&self, nodes: usize, config: &str, extra: &[&str]) -> PathBuf {
        let submit = self.submit_dir();
        std::fs::write(submit.join("job.toml"), config).unwrap();
        let script = submit.join("job.sh");
        let out = Command::new(common::binary())
            .current_dir(&submit)
            .args(["slurm", "sbatch", "job.toml", "--nodes", &nodes.to_string(), "--output", "out-%j.txt", "--json"])
            .arg("--out")
            .arg(&script)
            .args(extra)
            .output()
            .unwrap();
        assert!(out.status.success(), "troupe slurm sbatch: {}", String::from_utf8_lossy(&out.stderr));
        script
    }

    /// Submits `script`; the Slurm job id.
    fn sbatch(&self, script: &Path, wait: bool) -> (u64, Option<Child>) {
        let mut command = self.cmd("sbatch");
        command.arg("--parsable");
        if wait {
            command.arg("--wait");
        }
        let mut child = command.arg(script).stdout(Stdio::piped()).stderr(Stdio::inherit()).spawn().unwrap();
        let mut line = String::new();
        use std::io::BufRead;
        std::io::BufReader::new(child.stdout.take().unwrap()).read_line(&mut line).unwrap();
        let id = line.trim().split(';').next().unwrap().parse().unwrap_or_else(|_| panic!("sbatch printed {line:?}"));
        if wait {
            (id, Some(child))
        } else {
            assert!(child.wait().unwrap().success());
            (id, None)
        }
    }

    /// Waits for `sbatch --wait` of `job` (`child`) to end, at most [`BATCH_TIMEOUT`]. Past it, kills
    /// it and fails with what says why it hung: Slurm's view of the job, the troupe tasks still running,
    /// the job's output (every task's events and logs) and the Slurm daemons' logs.
    fn wait_batch(&self, job: u64, child: Option<Child>) -> std::process::ExitStatus {
        let mut child = child.expect("sbatch --wait");
        let started = Instant::now();
        loop {
            if let Some(status) = child.try_wait().expect("try_wait") {
                return status;
            }
            if started.elapsed() > BATCH_TIMEOUT {
                break;
            }
            std::thread::sleep(Duration::from_millis(50));
        }
        let shown = |args: &[&str]| match self.cmd(args[0]).args(&args[1..]).output() {
            Ok(out) => String::from_utf8_lossy(&out.stdout).into_owned() + &String::from_utf8_lossy(&out.stderr),
            Err(e) => format!("({} failed: {e})", args[0]),
        };
        let job_text = shown(&["scontrol", "show", "job", &job.to_string()]);
        let queue = shown(&["squeue", "--all"]);
        let tasks = troupe_tasks();
        let _ = child.kill();
        let _ = child.wait();
        let output = self.output(job);
        let logs = self.logs();
        panic!(
            "sbatch --wait of job {job} still running after {BATCH_TIMEOUT:?}; killed it.\n--- scontrol show job\n\
             {job_text}\n--- squeue\n{queue}\n--- troupe tasks still running: {tasks:?}\n--- the job's output\n\
             {output}{logs}"
        );
    }

    fn output(&self, job: u64) -> String {
        std::fs::read_to_string(self.submit_dir().join(format!("out-{job}.txt"))).unwrap_or_default()
    }

    /// Waits until the job's output shows a committed step at or past `step`.
    fn wait_for_step(&self, job: u64, step: u64) {
        self.wait_for_event(job, "step", step);
    }

    /// Waits until the job's output shows an event `name` (`step`, `checkpoint`) of a step at or past
    /// `step`.
    fn wait_for_event(&self, job: u64, name: &str, step: u64) {
        let started = Instant::now();
        while !events(&self.output(job), name).iter().any(|e| e["step"].as_u64() >= Some(step)) {
            assert!(
                started.elapsed() < Duration::from_secs(180),
                "job {job}: no {name} event of step {step} or later:\n{}{}",
                self.output(job),
                self.logs()
            );
            std::thread::sleep(Duration::from_millis(100));
        }
    }

    /// `scontrol show job`'s `key=value` fields of `job` (Slurm keeps a finished job's record for
    /// MinJobAge, 300 s).
    fn job_fields(&self, job: u64) -> std::collections::HashMap<String, String> {
        let out = self.cmd("scontrol").args(["show", "job", &job.to_string()]).output().unwrap();
        let text = String::from_utf8_lossy(&out.stdout);
        text.split_whitespace()
            .filter_map(|field| field.split_once('='))
            .map(|(k, v)| (k.to_string(), v.to_string()))
            .collect()
    }

    /// Whether `squeue` still lists `job`.
    fn queued(&self, job: u64) -> bool {
        let out = self.cmd("squeue").args(["-h", "-j", &job.to_string()]).output().unwrap();
        !String::from_utf8_lossy(&out.stdout).trim().is_empty()
    }
}

impl Drop for Slurm {
    fn drop(&mut self) {
        let _ = self.cmd("scancel").arg("--user=root").status();
        let started = Instant::now();
        while started.elapsed() < Duration::from_secs(KILL_WAIT_S + 5) && !troupe_tasks().is_empty() {
            std::thread::sleep(Duration::from_millis(200));
        }
        for (_, child) in self.daemons.iter_mut().rev() {
            let _ = Command::new("kill").arg(child.id().to_string()).status();
            let _ = child.wait();
        }
    }
}

fn slurm_conf(d: &Path, munge_socket: &Path) -> String {
    let host = std::fs::read_to_string("/proc/sys/kernel/hostname").unwrap().trim().to_string();
    let port = || std::net::TcpListener::bind("127.0.0.1:0").unwrap().local_addr().unwrap().port();
    let mut conf = format!(
        "ClusterName=troupetest
SlurmctldHost={host}(127.0.0.1)
SlurmctldPort={ctld}
AuthType=auth/munge
AuthInfo=socket={socket}
CredType=cred/munge
SlurmUser=root
SlurmdUser=root
StateSaveLocation={d}/state
SlurmdSpoolDir={d}/spool/%n
SlurmctldPidFile={d}/slurmctld.pid
SlurmdPidFile={d}/slurmd-%n.pid
SlurmctldLogFile={d}/log/slurmctld.log
SlurmdLogFile={d}/log/slurmd-%n.log
ProctrackType=proctrack/linuxproc
TaskPlugin=task/none
SelectType=select/cons_tres
SelectTypeParameters=CR_CPU
ReturnToService=2
KillWait={KILL_WAIT_S}
MpiDefault=none
JobAcctGatherType=jobacct_gather/none
AccountingStorageType=accounting_storage/none
",
        ctld = port(),
        socket = munge_socket.display(),
        d = d.display()
    );
    for (node, addr) in NODES {
        conf +=
            &format!("NodeName={node} NodeHostname={host} NodeAddr={addr} Port={} CPUs=1 RealMemory=2000\n", port());
    }
    conf += "PartitionName=debug Nodes=n1,n2,n3 Default=YES MaxTime=INFINITE State=UP\n";
    conf
}

fn write_private(path: &Path, bytes: &[u8]) {
    use std::io::Write;
    use std::os::unix::fs::OpenOptionsExt;
    let mut file = std::fs::OpenOptions::new().write(true).create_new(true).mode(0o600).open(path).unwrap();
    file.write_all(bytes).unwrap();
}

fn on_path(tool: &str) -> bool {
    std::env::var_os("PATH").map(|paths| std::env::split_paths(&paths).any(|p| p.join(tool).exists())).unwrap_or(false)
        || Path::new("/usr/sbin").join(tool).exists()
}

fn wait_until(bound: Duration, what: &str, mut done: impl FnMut() -> bool) {
    let started = Instant::now();
    while !done() {
        assert!(started.elapsed() < bound, "timed out after {bound:?} waiting for {what}");
        std::thread::sleep(Duration::from_millis(50));
    }
}

/// Process ids of `troupe slurm run` tasks (of this build) still alive.
fn troupe_tasks() -> Vec<u32> {
    let binary = common::binary().to_string_lossy().into_owned();
    let mut pids = Vec::new();
    for entry in std::fs::read_dir("/proc").unwrap().flatten() {
        let Ok(pid) = entry.file_name().to_string_lossy().parse::<u32>() else { continue };
        let Ok(cmdline) = std::fs::read(entry.path().join("cmdline")) else { continue };
        let args: Vec<String> = cmdline.split(|b| *b == 0).map(|a| String::from_utf8_lossy(a).into_owned()).collect();
        if args.len() > 2 && args[0] == binary && args[1] == "slurm" && args[2] == "run" {
            pids.push(pid);
        }
    }
    pids
}

/// The process id of the `troupe slurm run` task on Slurm node `node` (SLURMD_NODENAME in its
/// environment).
fn task_on(node: &str) -> Option<u32> {
    let wanted = format!("SLURMD_NODENAME={node}");
    troupe_tasks().into_iter().find(|pid| {
        let environ = std::fs::read(format!("/proc/{pid}/environ")).unwrap_or_default();
        environ.split(|b| *b == 0).any(|var| var == wanted.as_bytes())
    })
}

/// The JSON events named `name` in a job's output (the first task's `--json` lines).
fn events(output: &str, name: &str) -> Vec<serde_json::Value> {
    output
        .lines()
        .filter_map(|l| serde_json::from_str::<serde_json::Value>(l).ok())
        .filter(|e| e["event"] == name)
        .collect()
}

/// The oracle test's small model: 2 blocks, d_model 128, context 64, 8 samples a step in micro-batches
/// of 4, one torch thread.
fn job(steps: u64) -> String {
    format!(
        "[model]\nn_layers = 2\nd_model = 128\ncontext = 64\n\n[train]\nsteps = {steps}\nglobal_batch = 8\n\
         micro_batch = 4\nwarmup_steps = 2\ntorch_threads = 1\n"
    )
}

/// Every step (number, loss) in `output`, in order.
fn losses(output: &str) -> Vec<(u64, f64)> {
    events(output, "step").iter().map(|e| (e["step"].as_u64().unwrap(), e["loss"].as_f64().unwrap())).collect()
}

/// Each step's loss in `losses` (from `output`; in order, the last step the job's last) and the final
/// parameters equal the single-process reference's.
fn check_on_the_reference(job_toml: &Path, losses: &[(u64, f64)], output: &str, final_params: &Path) {
    let config = JobConfig::from_file(job_toml).unwrap();
    tch::set_num_threads(1);
    let mut reference = Trainer::new(config.clone()).unwrap();
    let ref_losses: Vec<f64> = (0..config.train.steps).map(|_| reference.train_step().loss).collect();
    let steps: Vec<u64> = losses.iter().map(|(step, _)| *step).collect();
    assert!(steps.windows(2).all(|w| w[0] < w[1]), "steps in order: {steps:?}\n{output}");
    assert_eq!(steps.last(), Some(&config.train.steps), "the job ran to its last step:\n{output}");
    let at_steps: Vec<f64> = steps.iter().map(|step| ref_losses[*step as usize - 1]).collect();
    let losses: Vec<f64> = losses.iter().map(|(_, loss)| *loss).collect();
    let loss_diff = worst_loss_diff(&losses, &at_steps);
    let params = common::saved_params(final_params, &reference);
    let comparison = compare_params(reference.model.specs(), &params, &reference.param_values());
    eprintln!("loss diff {loss_diff:.1e}, params {comparison:?}");
    assert!(loss_diff <= TOLERANCE, "losses differ by {loss_diff:e}");
    assert!(comparison.within(TOLERANCE), "{comparison:?}");
}

/// Each step's world size.
fn worlds(output: &str) -> Vec<u64> {
    events(output, "step").iter().map(|e| e["world"].as_u64().unwrap()).collect()
}

/// The step events of an output the first node's task and the task that followed the job in its place
/// printed (the follower prints again the events of the 30 s before the first node was missed, so some
/// steps appear twice): each step once, in order, with its loss and world size. A step printed more than
/// once is the same (loss and world) each time, except a step past a `rollback` event's `to_step`: the
/// job computed it again (the controller recorded its commit but died before sending it,
/// runtime-semantics.md), possibly on fewer ranks, to the same loss — the report of the latest epoch
/// stands.
fn steps_once(output: &str) -> (Vec<(u64, f64)>, Vec<u64>) {
    let all: Vec<serde_json::Value> =
        output.lines().filter_map(|l| serde_json::from_str::<serde_json::Value>(l).ok()).collect();
    let mut redone = std::collections::BTreeSet::new();
    for rollback in all.iter().filter(|e| e["event"] == "rollback") {
        redone.extend(rollback["to_step"].as_u64().unwrap() + 1..=rollback["from_step"].as_u64().unwrap());
    }
    // Per step: (epoch, loss, world) of the report that stands.
    let mut seen: std::collections::BTreeMap<u64, (u64, f64, u64)> = Default::default();
    for event in all.iter().filter(|e| e["event"] == "step") {
        let [step, epoch, world] = ["step", "epoch", "world"].map(|k| event[k].as_u64().unwrap());
        let loss = event["loss"].as_f64().unwrap();
        let Some(&(was_epoch, was_loss, was_world)) = seen.get(&step) else {
            seen.insert(step, (epoch, loss, world));
            continue;
        };
        if redone.contains(&step) {
            assert!(
                (was_loss - loss).abs() <= TOLERANCE * loss.abs(),
                "step {step} redone to {loss}, was {was_loss}:\n{output}"
            );
            if epoch > was_epoch {
                seen.insert(step, (epoch, loss, world));
            }
        } else {
            assert_eq!(
                (was_epoch, was_loss, was_world),
                (epoch, loss, world),
                "step {step} printed twice, differently:\n{output}"
            );
        }
    }
    (
        seen.iter().map(|(step, (_, loss, _))| (*step, *loss)).collect(),
        seen.values().map(|(_, _, world)| *world).collect(),
    )
}

#[test]
fn an_sbatch_of_the_generated_script_trains_on_two_nodes_and_equals_the_reference() {
    let Some(slurm) = Slurm::start() else { return };
    let script = slurm.script(&job(8), &["--save-final", "final.safetensors"]);
    let (id, child) = slurm.sbatch(&script, true);
    let status = slurm.wait_batch(id, child);
    let output = slurm.output(id);
    assert!(status.success(), "the batch job failed ({status}):\n{output}{}", slurm.logs());
    assert_eq!(worlds(&output), vec![2; 8], "both nodes trained every step:\n{output}");
    let submit = slurm.submit_dir();
    check_on_the_reference(&submit.join("job.toml"), &losses(&output), &output, &submit.join("final.safetensors"));
    // Both tasks named their node and the controller on n1.
    for node in ["n1", "n2"] {
        assert!(output.contains(&format!("troupe slurm: node {node} (Slurm node {node})")), "{output}");
    }
    let certs = submit.join(format!(".troupe/slurm-{id}"));
    assert!(certs.join("nodes/n2.pem").exists(), "the certificates are in the submit directory");
    assert!(troupe_tasks().is_empty(), "no task is left: {:?}", troupe_tasks());
}

#[test]
fn scancel_mid_run_drains_every_node_within_kill_wait_and_leaves_no_process() {
    let Some(slurm) = Slurm::start() else { return };
    let script = slurm.script(&job(2_000), &[]);
    let (id, _) = slurm.sbatch(&script, false);
    slurm.wait_for_step(id, 2);
    let cancelled = Instant::now();
    assert!(slurm.cmd("scancel").arg(id.to_string()).status().unwrap().success());
    while !troupe_tasks().is_empty() || slurm.queued(id) {
        assert!(
            cancelled.elapsed() < Duration::from_secs(KILL_WAIT_S - 5),
            "tasks {:?} still alive {:?} after scancel (KillWait {KILL_WAIT_S} s):\n{}",
            troupe_tasks(),
            cancelled.elapsed(),
            slurm.output(id)
        );
        std::thread::sleep(Duration::from_millis(100));
    }
    eprintln!("scancel: every task gone after {:?}", cancelled.elapsed());
    let output = slurm.output(id);
    // Both daemons drained on SIGTERM (SIGKILL comes only after KillWait), and the job was cancelled.
    assert!(output.matches("draining").count() >= 2, "both daemons drained:\n{output}");
    assert!(output.contains("interrupted after step"), "the first task says the job was interrupted:\n{output}");
}

#[test]
fn a_node_slurm_takes_away_is_a_node_loss_the_job_survives_on_the_reference() {
    let Some(slurm) = Slurm::start() else { return };
    let script = slurm.script(&job(24), &["--save-final", "final.safetensors"]);
    let (id, child) = slurm.sbatch(&script, true);
    slurm.wait_for_step(id, 4);
    // Slurm SIGKILLs the step's task on a node set DOWN; with --no-kill the job keeps its other node.
    let down = slurm.cmd("scontrol").args(["update", "nodename=n2", "state=down", "reason=troupe-test"]).status();
    assert!(down.unwrap().success());
    let status = slurm.wait_batch(id, child);
    let output = slurm.output(id);
    assert!(status.success(), "the batch job failed ({status}):\n{output}{}", slurm.logs());
    let worlds = worlds(&output);
    assert_eq!((worlds.first(), worlds.last()), (Some(&2), Some(&1)), "2 ranks, then n1's alone: {worlds:?}");
    assert_eq!(worlds.len(), 24, "one committed step each:\n{output}");
    assert!(output.contains("n2: task 1: Killed"), "srun says Slurm killed n2's task:\n{output}");
    let submit = slurm.submit_dir();
    check_on_the_reference(&submit.join("job.toml"), &losses(&output), &output, &submit.join("final.safetensors"));
    assert!(troupe_tasks().is_empty(), "no task is left: {:?}", troupe_tasks());
}

#[test]
fn with_three_controllers_losing_the_first_node_is_survived_and_the_next_task_follows_the_job() {
    let Some(slurm) = Slurm::start() else { return };
    const STEPS: u64 = 80;
    let script = slurm.script_on(3, &job(STEPS), &["--save-final", "final.safetensors"]);
    let text = std::fs::read_to_string(&script).unwrap();
    assert!(!text.contains("--controllers"), "three nodes get three controllers by default:\n{text}");
    let (id, child) = slurm.sbatch(&script, true);
    slurm.wait_for_step(id, 4);
    // n1's task submitted the job, streams its events and is a controller (the Raft leader or not): it
    // dies as a process does on a GPU fault or the OOM killer. (Setting n1 DOWN would end the Slurm job
    // itself: the batch script runs there.)
    let task = task_on("n1").expect("n1's troupe task");
    assert!(Command::new("kill").args(["-KILL", &task.to_string()]).status().unwrap().success());
    let status = slurm.wait_batch(id, child);
    let output = slurm.output(id);
    // The script's exit status is the job's outcome, which n2's task recorded in n1's place.
    assert!(status.success(), "the batch job failed ({status}):\n{output}{}", slurm.logs());
    assert!(output.contains("3 controllers (Raft) n1 (127.0.0.1:"), "every task names the controllers:\n{output}");
    let follows = "troupe slurm: the first node n1 left the cluster; node n2 follows job ";
    assert!(output.contains(follows), "n2's task follows the job once n1 is gone:\n{output}");
    // n3's task stays until n2's has the outcome, then ends with it: it does not follow the ended job too.
    let followers = output.matches("troupe slurm: the first node n1 left the cluster; node").count();
    assert_eq!(followers, 1, "one task follows the job in n1's place:\n{output}");
    let (losses, worlds) = steps_once(&output);
    assert_eq!((worlds.first(), worlds.last()), (Some(&3), Some(&2)), "3 ranks, then n2's and n3's: {worlds:?}");
    let submit = slurm.submit_dir();
    check_on_the_reference(&submit.join("job.toml"), &losses, &output, &submit.join("final.safetensors"));
    assert_eq!(losses.len() as u64, STEPS, "every step printed, by n1's task or n2's:\n{output}");
    assert!(troupe_tasks().is_empty(), "no task is left: {:?}", troupe_tasks());
}

/// The steps (number, loss) of each run of a job's output that Slurm appended to: a run begins where the
/// first task names its node.
fn runs(output: &str) -> Vec<Vec<(u64, f64)>> {
    let mut runs: Vec<Vec<(u64, f64)>> = Vec::new();
    for line in output.lines() {
        if line.starts_with("troupe slurm: node n1 ") {
            runs.push(Vec::new());
        }
        let Ok(event) = serde_json::from_str::<serde_json::Value>(line) else { continue };
        if event["event"] == "step" {
            let run = runs.last_mut().expect("a step before the first task's node line");
            run.push((event["step"].as_u64().unwrap(), event["loss"].as_f64().unwrap()));
        }
    }
    runs
}

#[test]
fn a_requeued_job_continues_from_its_newest_checkpoint_with_its_ca_and_equals_the_reference() {
    let Some(slurm) = Slurm::start() else { return };
    const STEPS: u64 = 30;
    // A relative checkpoint.dir is the task's working directory's: the submit directory, shared.
    let config = format!("{}\n[checkpoint]\ndir = \"checkpoints\"\nevery_steps = 2\n", job(STEPS));
    let script = slurm.script(&config, &["--requeue", "--save-final", "final.safetensors"]);
    let (id, _) = slurm.sbatch(&script, false);
    let submit = slurm.submit_dir();
    slurm.wait_for_event(id, "checkpoint", 4);
    let ca = submit.join(format!(".troupe/slurm-{id}/ca.pem"));
    let ca_before = std::fs::read(&ca).expect("the first run made the CA");

    // What preemption with PreemptMode=REQUEUE does, and an administrator: Slurm sends every task
    // SIGTERM (the first task cancels the job, every daemon drains), then queues the job again.
    assert!(slurm.cmd("scontrol").args(["requeue", &id.to_string()]).status().unwrap().success());
    let requeued = Instant::now();
    while !troupe_tasks().is_empty() || slurm.job_fields(id).get("JobState").map(String::as_str) != Some("PENDING") {
        assert!(
            requeued.elapsed() < Duration::from_secs(KILL_WAIT_S + 30),
            "after scontrol requeue: tasks {:?} alive, job {:?} after {:?}:\n{}{}",
            troupe_tasks(),
            slurm.job_fields(id).get("JobState"),
            requeued.elapsed(),
            slurm.output(id),
            slurm.logs()
        );
        std::thread::sleep(Duration::from_millis(100));
    }
    // The checkpoint a job continues from, as `troupe checkpoint list` names it.
    let listed = Command::new(common::binary())
        .args(["checkpoint", "list", "--json"])
        .arg(submit.join("checkpoints"))
        .output()
        .unwrap();
    assert!(listed.status.success(), "troupe checkpoint list: {}", String::from_utf8_lossy(&listed.stderr));
    let newest = String::from_utf8_lossy(&listed.stdout)
        .lines()
        .map(|l| serde_json::from_str::<serde_json::Value>(l).unwrap())
        .find(|c| c["resume_from"] == true)
        .and_then(|c| c["step"].as_u64())
        .unwrap_or_else(|| panic!("no checkpoint to continue from: {}", String::from_utf8_lossy(&listed.stdout)));
    assert!(newest >= 4 && newest < STEPS, "the newest checkpoint is of step {newest}");
    // Slurm 22.05 holds a requeued job for 120 s (BeginTime); start it now instead of waiting.
    let release = slurm.cmd("scontrol").args(["update", &format!("jobid={id}"), "StartTime=now"]).status();
    assert!(release.unwrap().success());

    let started = Instant::now();
    while slurm.queued(id) {
        assert!(
            started.elapsed() < Duration::from_secs(300),
            "the requeued job is still queued after {:?}:\n{}{}",
            started.elapsed(),
            slurm.output(id),
            slurm.logs()
        );
        std::thread::sleep(Duration::from_millis(200));
    }
    let output = slurm.output(id);
    let fields = slurm.job_fields(id);
    let (state, restarts) = (fields.get("JobState"), fields.get("Restarts"));
    assert_eq!(state.map(String::as_str), Some("COMPLETED"), "the requeued run finished:\n{output}{}", slurm.logs());
    assert_eq!(restarts.map(String::as_str), Some("1"), "Slurm ran the job twice");

    // The output holds both runs (--open-mode=append). The second says it is Slurm's restart and reuses
    // the CA, and starts after the newest checkpoint's step.
    let runs = runs(&output);
    assert_eq!(runs.len(), 2, "two runs in the output:\n{output}");
    let restart_line = format!("troupe slurm: Slurm restart 1 of job {id}: reusing the CA in ");
    assert!(output.contains(&restart_line), "the requeued run names its restart and the CA:\n{output}");
    assert_eq!(std::fs::read(&ca).unwrap(), ca_before, "the requeued run kept the cluster's CA");
    let starts: Vec<Option<u64>> = events(&output, "start").iter().map(|e| e["from_step"].as_u64()).collect();
    assert_eq!(starts, vec![Some(0), Some(newest)], "the requeued run starts from step {newest}:\n{output}");
    let steps_of = |run: &[(u64, f64)]| run.iter().map(|(step, _)| *step).collect::<Vec<u64>>();
    let (first, second) = (&runs[0], &runs[1]);
    let first_steps = steps_of(first);
    assert_eq!(first_steps, (1..=first_steps.len() as u64).collect::<Vec<_>>(), "the first run from step 1");
    assert_eq!(steps_of(second), (newest + 1..=STEPS).collect::<Vec<_>>(), "the requeued run's steps");
    // Steps the first run committed after its newest checkpoint are done again, the same way. (SIGTERM
    // may also cut off the events of steps up to the checkpoint: committed and saved, but not printed.)
    for (step, lost) in first.iter().filter(|(step, _)| *step > newest) {
        let again = second[(step - newest - 1) as usize].1;
        assert!((lost - again).abs() <= TOLERANCE, "step {step}: {lost} in the first run, {again} requeued");
    }
    // The whole run (the first run up to the checkpoint, then the requeued one) is the reference's.
    let whole: Vec<(u64, f64)> = first.iter().filter(|(step, _)| *step <= newest).chain(second).copied().collect();
    check_on_the_reference(&submit.join("job.toml"), &whole, &output, &submit.join("final.safetensors"));
    assert!(troupe_tasks().is_empty(), "no task is left: {:?}", troupe_tasks());
}
