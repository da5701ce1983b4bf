//! The job API: start a local cluster of two daemons in this process, submit a small training job, and
//! follow its typed events (Started, Step, Saved, Finished) as they stream.
//!
//!     make example-job-api [JOB_API_STEPS=n]

#[tokio::main(flavor = "multi_thread", worker_threads = 3)]
async fn main() -> anyhow::Result<()> {
    let steps: u64 = std::env::args().nth(1).map(|s| s.parse()).transpose()?.unwrap_or(10);
    let out = tempfile::tempdir()?;
    let events = troupe_examples::job_api_demo(steps, out.path()).await?;
    println!("{} events", events.len());
    Ok(())
}
