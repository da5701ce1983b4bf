//! `troupe slurm sbatch job.toml --nodes N ...`: the batch script that runs `troupe slurm run` once per
//! node of the allocation, printed (`| sbatch`) or written to a file.

use std::path::{Path, PathBuf};

use anyhow::Context;

use super::run::RunOptions;

#[derive(Debug, clap::Args)]
pub struct SbatchArgs {
    /// The job (TOML); the script refers to it by its absolute path, so keep it where it is.
    #[arg(value_name = "job.toml")]
    pub config: PathBuf,
    /// Nodes of the allocation (one daemon each; the first runs the controller).
    #[arg(long)]
    pub nodes: u32,
    /// GPUs per node (one slot each); 0 for CPU nodes.
    #[arg(long, default_value_t = 0)]
    pub gpus_per_node: u32,
    /// CPUs per node (the daemon's task gets them all; torch threads are shared by its slots).
    #[arg(long)]
    pub cpus_per_node: Option<u32>,
    /// Wall-clock limit, in Slurm's format (`4:00:00`, `2-00:00:00`).
    #[arg(long)]
    pub time: Option<String>,
    /// Partition to run in.
    #[arg(long)]
    pub partition: Option<String>,
    /// Account to charge.
    #[arg(long)]
    pub account: Option<String>,
    /// Slurm job name [default: troupe-<job.toml's stem>].
    #[arg(long)]
    pub job_name: Option<String>,
    /// The job's output file (Slurm's patterns, `%j` the job id) [default: troupe-%j.out].
    #[arg(long, value_name = "FILE")]
    pub output: Option<String>,
    /// Let Slurm requeue the job (`scontrol requeue`, preemption with PreemptMode=REQUEUE, a node
    /// failing at launch); with checkpoint.dir in the job, the requeued run continues from the newest
    /// checkpoint. The output file is then appended to, so that it keeps every run's events.
    #[arg(long)]
    pub requeue: bool,
    /// Write the script here (mode 0755) instead of printing it.
    #[arg(long, value_name = "FILE")]
    pub out: Option<PathBuf>,
    /// The troupe binary the nodes run [default: this one].
    #[arg(long, value_name = "PATH")]
    pub troupe: Option<PathBuf>,
    #[command(flatten)]
    pub run: RunOptions,
}

pub fn run(args: SbatchArgs) -> anyhow::Result<()> {
    // The job is checked here, before anything is queued.
    troupe_model::config::JobConfig::from_file(&args.config)?;
    if args.nodes == 0 {
        anyhow::bail!("--nodes 0: an allocation needs at least one node");
    }
    let troupe = match &args.troupe {
        Some(path) => std::path::absolute(path)?,
        None => std::env::current_exe().context("locating the troupe binary")?,
    };
    let config = std::path::absolute(&args.config)?;
    let text = script(&args, &troupe, &config);
    match &args.out {
        Some(out) => {
            use std::os::unix::fs::PermissionsExt;
            std::fs::write(out, &text).with_context(|| format!("--out {}", out.display()))?;
            std::fs::set_permissions(out, std::fs::Permissions::from_mode(0o755))?;
            eprintln!("troupe: wrote {}; submit it with `sbatch {}`", out.display(), out.display());
        }
        None => print!("{text}"),
    }
    Ok(())
}

/// The batch script (pure: the tests read it line by line).
pub fn script(args: &SbatchArgs, troupe: &Path, config: &Path) -> String {
    let mut lines = vec![
        "#!/bin/bash".to_string(),
        format!(
            "# Written by `troupe slurm sbatch` (troupe {}); docs/guide.md \"Slurm allocation\".",
            env!("CARGO_PKG_VERSION")
        ),
    ];
    lines.extend(directives(args, config).into_iter().map(|option| format!("#SBATCH {option}")));
    lines.push("# A node Slurm loses is a node loss to troupe: the job shrinks and goes on.".into());
    lines.push("#SBATCH --no-kill".into());
    lines.push(String::new());
    lines.push("set -u".into());
    let dir = match &args.run.cluster_dir {
        Some(dir) => quote(&std::path::absolute(dir).unwrap_or(dir.clone()).display().to_string()),
        None => "\"$SLURM_SUBMIT_DIR/.troupe/slurm-$SLURM_JOB_ID\"".into(),
    };
    lines.push(format!("cluster_dir={dir}"));
    lines.push("exit_code_file=\"$cluster_dir.exit\"".into());
    lines.push("rm -f \"$exit_code_file\"".into());
    lines.push(srun_command(args, troupe, config));
    lines.push("status=$?".into());
    lines.push("# srun reports a task Slurm killed (a lost node) as a failure; the job's own outcome is what".into());
    lines.push("# the first task recorded.".into());
    lines.push("if [[ -s \"$exit_code_file\" ]]; then exit \"$(cat \"$exit_code_file\")\"; fi".into());
    lines.push("exit \"$status\"".into());
    lines.join("\n") + "\n"
}

/// The `#SBATCH` options of the allocation (the job named after `config` unless `--job-name`).
fn directives(args: &SbatchArgs, config: &Path) -> Vec<String> {
    let stem = config.file_stem().map_or("job".into(), |s| s.to_string_lossy().into_owned());
    let mut options = vec![
        format!("--job-name={}", args.job_name.clone().unwrap_or(format!("troupe-{stem}"))),
        format!("--nodes={}", args.nodes),
        "--ntasks-per-node=1".into(),
    ];
    if args.gpus_per_node > 0 {
        options.push(format!("--gpus-per-node={}", args.gpus_per_node));
    }
    if let Some(cpus) = args.cpus_per_node {
        options.push(format!("--cpus-per-task={cpus}"));
    }
    if let Some(time) = &args.time {
        options.push(format!("--time={time}"));
    }
    if let Some(partition) = &args.partition {
        options.push(format!("--partition={partition}"));
    }
    if let Some(account) = &args.account {
        options.push(format!("--account={account}"));
    }
    options.push(format!("--output={}", args.output.as_deref().unwrap_or("troupe-%j.out")));
    if args.requeue {
        options.push("--requeue".into());
        // Slurm truncates the output file when it starts a requeued job, unless told to append.
        options.push("--open-mode=append".into());
    } else {
        options.push("--no-requeue".into());
    }
    options
}

/// The `srun` line: `troupe slurm run` on every node, with the options of `args.run` that are not
/// their defaults.
fn srun_command(args: &SbatchArgs, troupe: &Path, config: &Path) -> String {
    let mut command =
        vec!["srun".to_string(), "--ntasks-per-node=1".into(), "--no-kill".into(), "--kill-on-bad-exit=0".into()];
    if let Some(cpus) = args.cpus_per_node {
        // srun does not take --cpus-per-task over from the allocation (Slurm 22.05 and later).
        command.push(format!("--cpus-per-task={cpus}"));
    }
    command.extend([
        quote(&troupe.display().to_string()),
        "slurm".into(),
        "run".into(),
        quote(&config.display().to_string()),
    ]);
    command.extend([
        "--cluster-dir".into(),
        "\"$cluster_dir\"".into(),
        "--exit-code-file".into(),
        "\"$exit_code_file\"".into(),
    ]);
    let run = &args.run;
    let mut pass = |flag: &str, value: Option<String>| {
        if let Some(value) = value {
            command.push(flag.into());
            command.push(quote(&value));
        }
    };
    let absolute = |p: &PathBuf| std::path::absolute(p).unwrap_or(p.clone()).display().to_string();
    pass("--port", run.port.map(|p| p.to_string()));
    pass("--controllers", run.controllers.map(|n| n.to_string()));
    pass("--slots", run.slots.map(|s| s.to_string()));
    pass("--node-template", run.node_template.as_ref().map(absolute));
    pass("--wait-s", (run.wait_s != RunOptions::WAIT_S).then(|| run.wait_s.to_string()));
    pass("--data-plane", (run.data_plane != "auto").then(|| run.data_plane.clone()));
    pass("--save-final", run.save_final.as_ref().map(absolute));
    pass("--run-dir", run.run_dir.as_ref().map(absolute));
    pass("--log-every", (run.log_every > 0).then(|| run.log_every.to_string()));
    if run.json {
        command.push("--json".into());
    }
    command.join(" ")
}

/// `value` as one word for the shell: single-quoted unless it is plainly safe.
fn quote(value: &str) -> String {
    let safe = !value.is_empty() && value.bytes().all(|b| b.is_ascii_alphanumeric() || b"/._-+:=@%,".contains(&b));
    if safe {
        value.into()
    } else {
        format!("'{}'", value.replace('\'', "'\\''"))
    }
}

#[cfg(test)]
mod tests {
    use clap::Parser;

    use super::*;

    #[derive(Parser)]
    struct Cli {
        #[command(flatten)]
        args: SbatchArgs,
    }

    fn script_of(argv: &[&str]) -> String {
        let cli = Cli::try_parse_from(std::iter::once("sbatch").chain(argv.iter().copied())).unwrap();
        script(&cli.args, Path::new("/opt/troupe bin/troupe"), Path::new("/home/ada/job.toml"))
    }

    #[test]
    fn the_script_asks_for_one_task_per_node_and_runs_troupe_on_each() {
        let text = script_of(&["job.toml", "--nodes", "4", "--gpus-per-node", "8", "--time", "4:00:00", "--json"]);
        let lines: Vec<&str> = text.lines().collect();
        for expected in [
            "#SBATCH --nodes=4",
            "#SBATCH --ntasks-per-node=1",
            "#SBATCH --gpus-per-node=8",
            "#SBATCH --time=4:00:00",
            "#SBATCH --job-name=troupe-job",
            "#SBATCH --output=troupe-%j.out",
            "#SBATCH --no-requeue",
            "#SBATCH --no-kill",
        ] {
            assert!(lines.contains(&expected), "{expected} in\n{text}");
        }
        assert!(!text.contains("--open-mode"), "without --requeue Slurm's default open mode: {text}");
        let srun = lines.iter().find(|l| l.starts_with("srun ")).unwrap();
        assert_eq!(
            *srun,
            "srun --ntasks-per-node=1 --no-kill --kill-on-bad-exit=0 '/opt/troupe bin/troupe' slurm run \
             /home/ada/job.toml --cluster-dir \"$cluster_dir\" --exit-code-file \"$exit_code_file\" --json"
        );
        assert!(text.ends_with("exit \"$status\"\n"));
    }

    #[test]
    fn run_options_and_cpus_pass_through_to_every_task() {
        let text = script_of(&[
            "job.toml",
            "--nodes",
            "2",
            "--cpus-per-node",
            "16",
            "--requeue",
            "--port",
            "7500",
            "--cluster-dir",
            "/shared/c",
            "--save-final",
            "/out/final.safetensors",
            "--data-plane",
            "quic",
        ]);
        assert!(text.contains("#SBATCH --cpus-per-task=16\n") && text.contains("#SBATCH --requeue\n"), "{text}");
        assert!(text.contains("#SBATCH --open-mode=append\n"), "a requeued run appends to the output: {text}");
        assert!(text.contains("cluster_dir=/shared/c\n"), "{text}");
        let srun = text.lines().find(|l| l.starts_with("srun ")).unwrap();
        assert!(srun.contains(" --cpus-per-task=16 "), "{srun}");
        assert!(srun.contains(" --port 7500 "), "{srun}");
        assert!(srun.contains("--save-final /out/final.safetensors") && srun.contains("--data-plane quic"), "{srun}");
    }

    #[test]
    fn words_the_shell_would_split_are_quoted() {
        assert_eq!(quote("/a/b-c.toml"), "/a/b-c.toml");
        assert_eq!(quote("it's here"), "'it'\\''s here'");
        assert_eq!(quote(""), "''");
    }
}
