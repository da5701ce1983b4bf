//! `troupe` subcommands. Each lives in its own file with a clap `Args`/`Subcommand` type and a `run`.

mod bench_allreduce;
mod bench_checkpoint;
mod bench_crypto;
mod bench_generate;
mod bench_kernels;
mod bench_pipeline;
mod bench_recovery;
mod bench_train;
mod chaos;
mod checkpoint;
mod client;
mod cluster;
mod controllers;
mod daemon;
mod dashboard;
mod data;
mod eval;
mod follow;
mod generate;
mod model_source;
mod plan;
mod plot;
mod slurm;
mod table;
mod trace;
mod train;
mod train_args;
mod train_cluster;
mod train_pipeline;

use std::process::ExitCode;

use clap::{Parser, Subcommand};

/// The `troupe` command line (`Cli::try_parse_from` parses one without running it: the tests check the
/// documentation's command lines so).
#[derive(Debug, Parser)]
#[command(name = "troupe", version, about = "An actor-based elastic cluster runtime for distributed training")]
pub struct Cli {
    #[command(subcommand)]
    command: Command,
}

/// Parsed once per process: the size of the largest variant does not matter.
#[allow(clippy::large_enum_variant)]
#[derive(Debug, Subcommand)]
enum Command {
    /// Train a model (gpt-tiny on the built-in synthetic corpus by default).
    Train(train_args::TrainArgs),
    /// Benchmarks that print figures beside a peer measured in the same run.
    #[command(subcommand)]
    Bench(BenchCommand),
    /// Cluster identity: a certificate authority and node certificates.
    #[command(subcommand)]
    Cluster(cluster::ClusterCommand),
    /// Run this machine's node of a cluster.
    Daemon(daemon::DaemonArgs),
    /// List, verify, reshard and export checkpoints.
    #[command(subcommand)]
    Checkpoint(checkpoint::CheckpointCommand),
    /// Members, epoch, slots and jobs of a running cluster.
    Status(client::StatusArgs),
    /// The URLs of a running cluster's live dashboards: the controller's and each member's.
    Dashboard(dashboard::DashboardArgs),
    /// Submit, inspect and cancel jobs on a running cluster.
    #[command(subcommand)]
    Job(client::JobCommand),
    /// Draw a run's step phases (or any Chrome trace-event file) as an SVG timeline per rank or stage.
    Trace(trace::TraceArgs),
    /// Where the ranks of a --tp/--pp/--dp layout would run, what each holds and sends (nothing runs).
    Plan(plan::PlanArgs),
    /// Plot a run's loss and throughput against step as SVG.
    Plot(plot::PlotArgs),
    /// Crash, pause and restart a running job's nodes and check that nothing was lost (`troupe chaos list`).
    Chaos(chaos::ChaosArgs),
    /// Sample from a model (a Hugging Face directory or a checkpoint) with a key/value cache, streaming.
    Generate(generate::GenerateArgs),
    /// Mean loss and perplexity of a model (a Hugging Face directory or a checkpoint) on a corpus.
    Eval(eval::EvalArgs),
    /// Training data: tokenize text or .jsonl files once into a token file (`troupe data prepare`).
    #[command(subcommand)]
    Data(data::DataCommand),
    /// Run inside a Slurm allocation (`srun ... troupe slurm run job.toml`) or write its batch script
    /// (`troupe slurm sbatch job.toml --nodes N`).
    #[command(subcommand)]
    Slurm(slurm::SlurmCommand),
}

#[derive(Debug, Subcommand)]
enum BenchCommand {
    /// Training throughput (tokens/s) and peak memory, optionally beside PyTorch (--peer).
    Train(bench_train::BenchTrainArgs),
    /// Kernel throughput beside memcpy, and the fused AdamW beside libtorch's.
    Kernels(bench_kernels::KernelsArgs),
    /// All-reduce bus bandwidth over QUIC, TCP or the same-host transport, optionally beside Gloo (--peer).
    Allreduce(bench_allreduce::AllreduceArgs),
    /// Pipeline bubble (measured beside the schedule's theory), tokens/s, and a trace of the spans.
    Pipeline(bench_pipeline::BenchPipelineArgs),
    /// Time to detect a SIGKILLed daemon and to commit the next step without it, checked against the
    /// reference.
    Recovery(bench_recovery::RecoveryArgs),
    /// No false detection under load: a job on a cluster per failure detector while every core is busy
    /// and daemons pause (SIGSTOP) below the floor; false detections and φ's distribution.
    Soak(bench_recovery::soak::SoakArgs),
    /// Checkpoint write throughput beside dd to the same disk, and the snapshot's share of a step.
    Checkpoint(bench_checkpoint::CheckpointArgs),
    /// Greedy decoding tokens/s through the key/value cache, optionally beside transformers' generate (--peer).
    Generate(bench_generate::BenchGenerateArgs),
    /// TLS 1.3 record sealing and opening per core for each rustls crypto provider built in,
    /// optionally beside OpenSSL's AES-128-GCM (--peer).
    Crypto(bench_crypto::BenchCryptoArgs),
    /// One rank of `bench allreduce` (started by it).
    #[command(hide = true)]
    AllreduceRank,
}

/// Warnings to stderr; `RUST_LOG` overrides.
fn client_logging() {
    use tracing_subscriber::EnvFilter;
    let filter = EnvFilter::try_from_default_env().unwrap_or_else(|_| EnvFilter::new("warn"));
    let _ = tracing_subscriber::fmt().with_env_filter(filter).with_writer(std::io::stderr).try_init();
}

/// Parses the command line and runs it; errors print as `troupe: error: ...` with their causes.
pub fn main() -> ExitCode {
    let cli = Cli::parse();
    if matches!(cli.command, Command::Train(_) | Command::Job(_)) {
        // Commands that watch a job say on stderr when their connection to the controller is lost and
        // re-made; the daemon sets up its own, more verbose logging.
        client_logging();
    }
    let result = match cli.command {
        Command::Train(args) => train::run(args),
        Command::Bench(BenchCommand::Train(args)) => bench_train::run(args),
        Command::Bench(BenchCommand::Kernels(args)) => bench_kernels::run(args),
        Command::Bench(BenchCommand::Allreduce(args)) => bench_allreduce::run(args),
        Command::Bench(BenchCommand::Crypto(args)) => bench_crypto::run(args),
        Command::Bench(BenchCommand::AllreduceRank) => bench_allreduce::run_rank(),
        Command::Bench(BenchCommand::Recovery(args)) => bench_recovery::run(args),
        Command::Bench(BenchCommand::Soak(args)) => bench_recovery::soak::run(args),
        Command::Bench(BenchCommand::Checkpoint(args)) => bench_checkpoint::run(args),
        Command::Bench(BenchCommand::Pipeline(args)) => bench_pipeline::run(args),
        Command::Bench(BenchCommand::Generate(args)) => bench_generate::run(args),
        Command::Cluster(command) => cluster::run(command),
        Command::Daemon(args) => daemon::run(args),
        Command::Checkpoint(command) => checkpoint::run(command),
        Command::Status(args) => client::status(args),
        Command::Dashboard(args) => dashboard::run(args),
        Command::Job(command) => client::job(command),
        Command::Trace(args) => trace::run(args),
        Command::Plan(args) => plan::run(args),
        Command::Plot(args) => plot::run(args),
        Command::Chaos(args) => chaos::run(args),
        Command::Generate(args) => generate::run(args),
        Command::Eval(args) => eval::run(args),
        Command::Data(command) => data::run(command),
        Command::Slurm(command) => slurm::run(command),
    };
    match result {
        Ok(()) => ExitCode::SUCCESS,
        Err(error) => {
            eprintln!("troupe: error: {error}");
            for cause in error.chain().skip(1) {
                eprintln!("  caused by: {cause}");
            }
            ExitCode::FAILURE
        }
    }
}
