//! The reference trainer on CUDA (`Trainer::new_on(config, Device::Cuda(0))`), for gpt-tiny and
//! llama-tiny: fp32 on the GPU follows the CPU's trajectory (losses within 1e-4 relative over 5 steps:
//! cuBLAS sums in another order), and bf16 on the GPU trains (finite, falling loss). Skips with
//! `no CUDA device` where libtorch sees none.

use tch::Device;
use troupe_model::config::JobConfig;
use troupe_model::Trainer;

fn config(model: &str, precision: &str) -> JobConfig {
    let mut config = JobConfig { model: troupe_model::model::presets::preset(model).unwrap(), ..JobConfig::default() };
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
    for model in ["gpt-tiny", "llama-tiny"] {
        let on_gpu = Trainer::new_on(config(model, "fp32"), gpu).unwrap();
        assert!(on_gpu.model.params().iter().all(|p| p.device() == gpu));
        let (cpu, gpu_losses) = (losses(Trainer::new(config(model, "fp32")).unwrap()), losses(on_gpu));
        for (step, (c, g)) in cpu.iter().zip(&gpu_losses).enumerate() {
            assert!((c - g).abs() <= 1e-4 * c.abs(), "{model} step {step}: cpu {c} vs cuda {g}");
        }
        let bf16 = losses(Trainer::new_on(config(model, "bf16"), gpu).unwrap());
        assert!(bf16.iter().all(|l| l.is_finite()) && bf16[4] < bf16[0], "{model}: {bf16:?}");
        println!("{model}: cpu {cpu:?}\n{model}: cuda {gpu_losses:?}\n{model}: cuda bf16 {bf16:?}");
    }
}

#[test]
fn the_trainer_on_the_cpu_is_the_default() {
    let trainer = Trainer::new(config("gpt-tiny", "fp32")).unwrap();
    assert_eq!(trainer.device, Device::Cpu);
    assert!(trainer.model.params().iter().all(|p| p.device() == Device::Cpu));
}
