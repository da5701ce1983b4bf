//! What a task of a Slurm job step learns from its environment: pure, the variables passed in, so the
//! error for each missing or malformed one is tested without Slurm.

use std::path::PathBuf;

/// One task of `srun --ntasks-per-node=1 troupe slurm run`: which allocation, which node, what it holds.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct SlurmTask {
    /// `SLURM_JOB_ID`: names the cluster directory, the troupe job and the default port.
    pub job_id: u64,
    /// `SLURM_JOB_NODELIST`: the allocation's nodes in Slurm's compressed form (`gpu[01-04]`).
    pub node_list: String,
    /// `SLURM_NNODES`: how many nodes the allocation has.
    pub nodes: usize,
    /// `SLURMD_NODENAME`: the Slurm name of the node this task runs on.
    pub node_name: String,
    /// `SLURM_PROCID`: the task's rank in the step.
    pub proc_id: usize,
    /// `SLURM_NTASKS`: the step's tasks (one per node is expected).
    pub tasks: usize,
    /// `SLURM_CPUS_ON_NODE`: CPUs the allocation holds on this node.
    pub cpus_on_node: usize,
    /// `SLURM_GPUS_ON_NODE` (absent without GPUs): GPUs the allocation holds on this node.
    pub gpus_on_node: usize,
    /// `SLURM_SUBMIT_DIR`: where `sbatch` was run; shared by the nodes on every cluster we know of.
    pub submit_dir: PathBuf,
}

#[derive(Debug, thiserror::Error, PartialEq, Eq)]
pub enum SlurmEnvError {
    #[error(
        "{0} is not set: `troupe slurm run` runs inside a Slurm job step, once per node \
         (`srun --ntasks-per-node=1 troupe slurm run job.toml`, or the script of `troupe slurm sbatch`)"
    )]
    Missing(&'static str),
    #[error("{name}={value:?} is not {what}")]
    Malformed { name: &'static str, value: String, what: &'static str },
    #[error(
        "SLURM_NTASKS={tasks} on SLURM_NNODES={nodes} nodes: run one task per node \
         (`srun --ntasks-per-node=1 ...`); each task is a node's daemon and holds all of its GPUs"
    )]
    TasksPerNode { tasks: usize, nodes: usize },
}

impl SlurmTask {
    /// Reads the task from `var` (`std::env::var` in the command, a table in the tests).
    pub fn from_vars(var: impl Fn(&str) -> Option<String>) -> Result<Self, SlurmEnvError> {
        let text = |name: &'static str| var(name).filter(|v| !v.is_empty()).ok_or(SlurmEnvError::Missing(name));
        let number = |name: &'static str| -> Result<usize, SlurmEnvError> {
            let value = text(name)?;
            value.trim().parse().map_err(|_| SlurmEnvError::Malformed { name, value, what: "a number" })
        };
        // Slurm sets SLURM_JOB_NODELIST; SLURM_NODELIST is its older spelling, still set beside it.
        let node_list = text("SLURM_JOB_NODELIST")
            .or_else(|_| text("SLURM_NODELIST").map_err(|_| SlurmEnvError::Missing("SLURM_JOB_NODELIST")))?;
        let task = SlurmTask {
            job_id: number("SLURM_JOB_ID")? as u64,
            node_list,
            nodes: number("SLURM_NNODES").or_else(|_| number("SLURM_JOB_NUM_NODES"))?,
            node_name: text("SLURMD_NODENAME")?,
            proc_id: number("SLURM_PROCID")?,
            tasks: number("SLURM_NTASKS")?,
            cpus_on_node: number("SLURM_CPUS_ON_NODE")?,
            gpus_on_node: match var("SLURM_GPUS_ON_NODE").filter(|v| !v.is_empty()) {
                None => 0,
                Some(_) => number("SLURM_GPUS_ON_NODE")?,
            },
            submit_dir: PathBuf::from(text("SLURM_SUBMIT_DIR")?),
        };
        if task.tasks != task.nodes {
            return Err(SlurmEnvError::TasksPerNode { tasks: task.tasks, nodes: task.nodes });
        }
        Ok(task)
    }

    /// Device slots of this node: one per GPU; on a node without GPUs one slot using all its CPUs
    /// (a CPU rank per core would spend them on communication, not compute).
    pub fn slots(&self) -> u32 {
        (self.gpus_on_node as u32).max(1)
    }

    /// The control plane's default port: 7400 plus the job id modulo 1000, so that two allocations
    /// sharing a node do not collide.
    pub fn default_port(&self) -> u16 {
        7400 + (self.job_id % 1000) as u16
    }
}

#[cfg(test)]
mod tests {
    use std::collections::HashMap;

    use super::*;

    fn vars(overrides: &[(&str, Option<&str>)]) -> HashMap<String, String> {
        let mut vars: HashMap<String, String> = [
            ("SLURM_JOB_ID", "4242"),
            ("SLURM_JOB_NODELIST", "gpu[01-02]"),
            ("SLURM_NNODES", "2"),
            ("SLURMD_NODENAME", "gpu02"),
            ("SLURM_PROCID", "1"),
            ("SLURM_NTASKS", "2"),
            ("SLURM_CPUS_ON_NODE", "64"),
            ("SLURM_GPUS_ON_NODE", "8"),
            ("SLURM_SUBMIT_DIR", "/home/ada/run"),
        ]
        .iter()
        .map(|(k, v)| (k.to_string(), v.to_string()))
        .collect();
        for (k, v) in overrides {
            match v {
                Some(v) => vars.insert(k.to_string(), v.to_string()),
                None => vars.remove(*k),
            };
        }
        vars
    }

    fn task(overrides: &[(&str, Option<&str>)]) -> Result<SlurmTask, SlurmEnvError> {
        let vars = vars(overrides);
        SlurmTask::from_vars(|k| vars.get(k).cloned())
    }

    #[test]
    fn a_gpu_node_offers_one_slot_per_gpu_and_shares_its_cpus() {
        let t = task(&[]).unwrap();
        assert_eq!((t.job_id, t.nodes, t.proc_id, t.node_name.as_str()), (4242, 2, 1, "gpu02"));
        assert_eq!((t.slots(), t.default_port()), (8, 7642));
    }

    #[test]
    fn a_cpu_node_offers_one_slot_with_all_its_cpus() {
        let t = task(&[("SLURM_GPUS_ON_NODE", None), ("SLURM_CPUS_ON_NODE", Some("6")), ("SLURM_PROCID", Some("0"))])
            .unwrap();
        assert_eq!((t.proc_id, t.slots(), t.cpus_on_node), (0, 1, 6));
    }

    #[test]
    fn the_older_spellings_of_the_node_list_and_count_are_read() {
        let t = task(&[
            ("SLURM_JOB_NODELIST", None),
            ("SLURM_NODELIST", Some("n[1-2]")),
            ("SLURM_NNODES", None),
            ("SLURM_JOB_NUM_NODES", Some("2")),
        ])
        .unwrap();
        assert_eq!((t.node_list.as_str(), t.nodes), ("n[1-2]", 2));
    }

    #[test]
    fn each_missing_variable_is_named_with_the_fix() {
        for name in ["SLURM_JOB_ID", "SLURMD_NODENAME", "SLURM_PROCID", "SLURM_CPUS_ON_NODE", "SLURM_SUBMIT_DIR"] {
            let error = task(&[(name, None)]).unwrap_err();
            assert_eq!(error, SlurmEnvError::Missing(name));
            let text = error.to_string();
            assert!(
                text.starts_with(&format!("{name} is not set")) && text.contains("srun --ntasks-per-node=1"),
                "{text}"
            );
        }
        let error = task(&[("SLURM_JOB_NODELIST", None)]).unwrap_err();
        assert_eq!(error, SlurmEnvError::Missing("SLURM_JOB_NODELIST"));
    }

    #[test]
    fn malformed_numbers_and_several_tasks_per_node_are_refused() {
        let error = task(&[("SLURM_GPUS_ON_NODE", Some("eight"))]).unwrap_err();
        assert_eq!(error.to_string(), "SLURM_GPUS_ON_NODE=\"eight\" is not a number");
        let error = task(&[("SLURM_NTASKS", Some("16"))]).unwrap_err();
        assert!(error.to_string().contains("--ntasks-per-node=1"), "{error}");
    }
}
