//! The job API: build a job, submit it to a cluster (a running one, by address, or a local one started
//! here), and follow it through typed events.
//!
//! ```no_run
//! # async fn demo() -> anyhow::Result<()> {
//! use troupe_actors::api::{Job, LocalCluster};
//! let cluster = LocalCluster::in_process(2).await?;
//! let mut job = cluster.client().await?.submit(Job::gpt_tiny().steps(20)).await?;
//! while let Some(event) = job.next_event().await? {
//!     println!("{event:?}");
//! }
//! cluster.shutdown().await;
//! # Ok(()) }
//! ```

mod client;
mod job;
mod local;

pub use crate::error::{Error, Result};
pub use client::{Client, JobHandle};
pub use job::Job;
pub use local::{LocalCluster, LocalClusterOptions, NodeHost};

pub use crate::protocol::{
    ClusterStatus, DataPlane, GradientPlane, JobEvent, JobId, JobInfo, JobSpec, JobState, MemberInfo, SlotDevice,
};
