//! `troupe slurm run` and `troupe slurm sbatch`: troupe inside a Slurm allocation — one daemon per node,
//! started by `srun`, the first node's the controller (docs/guide.md "Slurm allocation").

mod certs;
mod env;
mod nodes;
mod run;
mod sbatch;

#[derive(Debug, clap::Subcommand)]
pub enum SlurmCommand {
    /// Inside a job step, once per node (`srun --ntasks-per-node=1 troupe slurm run job.toml`): run this
    /// node's daemon; the first node's task also makes the certificates, submits the job and follows it.
    Run(run::RunArgs),
    /// Print (or --out: write) a batch script that runs job.toml on --nodes nodes (`... | sbatch`).
    Sbatch(sbatch::SbatchArgs),
}

pub fn run(command: SlurmCommand) -> anyhow::Result<()> {
    match command {
        SlurmCommand::Run(args) => run::run(args),
        SlurmCommand::Sbatch(args) => sbatch::run(args),
    }
}
