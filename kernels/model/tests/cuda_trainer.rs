//! The reference trainer on CUDA (`Trainer::new_on(config, Device::Cuda(0))`): fp32 on the GPU follows
//! the CPU's trajectory (losses within 1e-4 relative over 5 steps: cuBLAS sums in another order), and
//! bf16 on the GPU trains (finite, falling loss). Skips with `no CUDA device` where libtorch sees none.

use tch::Device;
use troupe_model::config::JobConfig;
use troupe_model::Trainer;

fn config(precision: &str) -> JobConfig {
    let mut config = JobConfig::default();
    config.parallel.precision = precision.into();
    config.train.steps = 5;
    config.train.global_batch = 8;
    config.train.micro_batch = 4;
    config
}

fn losses(mut trainer: Trainer) -> Vec<f64> {
    (0..5).map(|_| trainer.train_step().loss).collect()
}

#[test]
fn the_trainer_on_cuda_follows_the_cpu_and_trains_in_bf16() {
    if !tch::Cuda::is_available() {
        println!("the_trainer_on_cuda_follows_the_cpu_and_trains_in_bf16: skipped, no CUDA device: libtorch sees none");
        return;
    }
    let gpu = Device::Cuda(0);
    let on_gpu = Trainer::new_on(config("fp32"), gpu).unwrap();
    assert!(on_gpu.model.params().iter().all(|p| p.device() == gpu));
    let (cpu, gpu_losses) = (losses(Trainer::new(config("fp32")).unwrap()), losses(on_gpu));
    for (step, (c, g)) in cpu.iter().zip(&gpu_losses).enumerate() {
        assert!((c - g).abs() <= 1e-4 * c.abs(), "step {step}: cpu {c} vs cuda {g}");
    }
    let bf16 = losses(Trainer::new_on(config("bf16"), gpu).unwrap());
    assert!(bf16.iter().all(|l| l.is_finite()) && bf16[4] < bf16[0], "{bf16:?}");
}

#[test]
fn the_trainer_on_the_cpu_is_the_default() {
    let trainer = Trainer::new(config("fp32")).unwrap();
    assert_eq!(trainer.device, Device::Cpu);
    assert!(trainer.model.params().iter().all(|p| p.device() == Device::Cpu));
}
