//! Train gpt-tiny with the single-process reference trainer from Rust, checkpoint it, and resume.
//!
//!     cargo run --release -p troupe-examples --example train_reference -- [steps]

use troupe_model::config::JobConfig;
use troupe_model::Trainer;

fn main() -> anyhow::Result<()> {
    let steps: u64 = std::env::args().nth(1).map(|s| s.parse()).transpose()?.unwrap_or(60);
    tch::set_num_threads(2);

    let mut config = JobConfig::default(); // gpt-tiny on the synthetic corpus
    config.train.steps = steps;
    let mut trainer = Trainer::new(config.clone())?;
    while trainer.step < steps / 2 {
        let report = trainer.train_step();
        println!("step {:>4}  loss {:.4}", report.step + 1, report.loss);
    }

    let dir = std::env::temp_dir().join(format!("troupe-example-{}", std::process::id()));
    let saved = trainer.save_checkpoint(&dir)?;
    println!("saved {}", saved.display());

    let mut resumed = Trainer::resume(config, &saved)?;
    while resumed.step < steps {
        let report = resumed.train_step();
        println!("step {:>4}  loss {:.4}  (resumed)", report.step + 1, report.loss);
    }
    std::fs::remove_dir_all(dir)?;
    Ok(())
}
