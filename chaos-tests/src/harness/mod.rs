//! The chaos harness on real processes: scenarios (a job, a cluster, a nemesis schedule), the nemesis
//! (SIGKILL, SIGSTOP/SIGCONT, graceful restarts, corrupt checkpoints, a full disk), the invariant checker
//! and the report. `troupe chaos run` drives it; Rust tests can too:
//!
//! ```no_run
//! # async fn demo() -> anyhow::Result<()> {
//! use troupe_chaos::harness::{run, RunOptions, Scenario};
//! let scenario = Scenario::load("kill-worker")?;
//! let options = RunOptions { seed: 7, troupe: "target/release/troupe".into(), log: None };
//! let report = run(&scenario, &options).await?;
//! assert!(report.passed, "{report}");
//! # Ok(()) }
//! ```

mod checker;
mod nemesis;
mod report;
mod run;
mod scenario;

pub use report::{Check, Report, Summary};
pub use run::{job_config, run, RunOptions};
pub use scenario::{Fault, FaultKind, Scenario, Target, SHIPPED};
