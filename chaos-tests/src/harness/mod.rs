//! The chaos harness on real processes: scenarios (a job, a cluster, a nemesis schedule), the nemesis
//! (SIGKILL, SIGSTOP/SIGCONT, graceful restarts, partitions and lossy, slow, reordering links between
//! network namespaces, corrupt checkpoints, a full disk), the invariant checker
//! and the report. `troupe chaos run` drives it; Rust tests can too:
//!
//! ```no_run
//! # async fn demo() -> anyhow::Result<()> {
//! use troupe_chaos::harness::{run, RunOptions, Scenario};
//! // A shipped scenario or a TOML file; `with_job_file` trains your own job config under it.
//! let scenario = Scenario::load("kill-worker")?.with_job_file("job.toml".as_ref())?;
//! let options = RunOptions { seed: 7, troupe: "target/release/troupe".into(), log: None, keep: false };
//! let report = run(&scenario, &options).await?;
//! assert!(report.passed, "{report}");
//! # Ok(()) }
//! ```

mod checker;
mod link;
mod nemesis;
mod netns;
mod nfqueue;
mod raft_log;
mod report;
mod run;
mod scenario;

pub use link::{LinkShape, LinkStats};
pub use report::{Check, FaultRecord, Report, Summary};
pub use run::{job_config, run, RunOptions};
pub use scenario::{Expect, Fault, FaultKind, NetworkKind, Scenario, Target, Trigger, SHIPPED};
