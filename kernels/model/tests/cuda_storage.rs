//! troupe-kernels' CUDA kernels on libtorch CUDA tensors' own storage (`lend_cuda`): the fused AdamW
//! with its bf16 copy-out and the casts give, on the tensors in place, the CPU path's bits on the same
//! values; so does the optimizer a trainer on a GPU steps with (`AdamW` on CUDA parameters, every
//! parameter lent at once). Skips with `no CUDA device` where libtorch or troupe-kernels sees no GPU.

use tch::{Device, Kind, Tensor};
use troupe_kernels::{AdamWConfig, Backend, CudaBackend};
use troupe_model::optim::adamw::{AdamW, AdamWConfig as OptimizerConfig};
use troupe_model::storage::{lend, lend_cuda, lend_f32};

fn backend_or_skip(test: &str) -> Option<CudaBackend> {
    if !tch::Cuda::is_available() {
        println!("{test}: skipped, no CUDA device: libtorch sees none");
        return None;
    }
    match CudaBackend::new(0) {
        Ok(backend) => Some(backend),
        Err(e) => {
            println!("{test}: skipped, {e}");
            None
        }
    }
}

fn bits(t: &Tensor) -> Vec<u32> {
    let t = t.to_device(Device::Cpu).to_kind(Kind::Float).flatten(0, -1);
    Vec::<f32>::try_from(t).unwrap().iter().map(|x| x.to_bits()).collect()
}

#[test]
fn fused_adamw_and_casts_run_on_cuda_tensor_storage_in_place() {
    let Some(cuda) = backend_or_skip("fused_adamw_and_casts_run_on_cuda_tensor_storage_in_place") else {
        return;
    };
    let n = 100_003i64;
    let p0 = Tensor::randn([n], (Kind::Float, Device::Cpu)) * 0.1;
    let g = Tensor::randn([n], (Kind::Float, Device::Cpu)) * 1e-3;
    let config = AdamWConfig::default();

    // The CPU path on copies of the same values.
    let (mut p, mut m, mut v) = (p0.copy(), p0.zeros_like(), p0.zeros_like());
    let mut out = Tensor::zeros([n], (Kind::BFloat16, Device::Cpu));
    for step in 1..=3 {
        let ([p, m, v], [g]) = lend_f32([("p", &mut p), ("m", &mut m), ("v", &mut v)], [("g", &g)]).unwrap();
        let ([o], []) = lend::<half::bf16, 1, 0>([("out", &mut out)], []).unwrap();
        troupe_kernels::adamw_step(
            troupe_kernels::AdamWShard { params: p, exp_avg: m, exp_avg_sq: v },
            g,
            &config,
            step,
            Some(o),
        );
    }

    // The CUDA kernels on CUDA tensors.
    let gpu = Device::Cuda(cuda.ordinal());
    let (mut pc, mut mc, mut vc, gc) =
        (p0.to_device(gpu), p0.zeros_like().to_device(gpu), p0.zeros_like().to_device(gpu), g.to_device(gpu));
    let mut outc = Tensor::zeros([n], (Kind::BFloat16, gpu));
    let backend = Backend::Cuda(cuda.clone());
    for step in 1..=3 {
        let mut lent =
            lend_cuda(&cuda, [("p", &mut pc), ("m", &mut mc), ("v", &mut vc), ("out", &mut outc)], [("g", &gc)])
                .unwrap();
        let ([p, m, v, o], [g]) = lent.buffers();
        backend.adamw_step(p, g, m, v, Some(o), &config, step).unwrap();
    }
    for (cpu, gpu, name) in
        [(&p, &pc, "params"), (&m, &mc, "exp_avg"), (&v, &vc, "exp_avg_sq"), (&out, &outc, "bf16 copy")]
    {
        assert_eq!(bits(gpu), bits(cpu), "{name}");
    }

    // A cast from an f32 CUDA tensor into an f16 one equals libtorch's own rounding.
    let mut halves = Tensor::zeros([n], (Kind::Half, gpu));
    {
        let mut lent = lend_cuda(&cuda, [("halves", &mut halves)], [("params", &pc)]).unwrap();
        let ([dst], [src]) = lent.buffers();
        backend.cast(src, dst).unwrap();
    }
    assert_eq!(bits(&halves), bits(&pc.to_kind(Kind::Half)));
}

#[test]
fn a_cuda_lend_refuses_a_tensor_on_another_device() {
    let Some(cuda) = backend_or_skip("a_cuda_lend_refuses_a_tensor_on_another_device") else {
        return;
    };
    let mut on_cpu = Tensor::zeros([4], (Kind::Float, Device::Cpu));
    let err = lend_cuda(&cuda, [("p", &mut on_cpu)], []).map(drop).unwrap_err();
    assert!(err.to_string().contains("lend_cuda"), "{err}");
}

/// A trainer's optimizer on a GPU runs troupe's fused CUDA kernel, not libtorch's formula: over three
/// steps its parameters and moments are the CPU kernel's bits exactly (the libtorch formula rounds
/// differently), parameters without a gradient untouched, the decay flag honoured per parameter.
#[test]
fn adamw_on_cuda_parameters_runs_the_fused_kernel_with_the_cpu_bits() {
    let Some(cuda) = backend_or_skip("adamw_on_cuda_parameters_runs_the_fused_kernel_with_the_cpu_bits") else {
        return;
    };
    let gpu = Device::Cuda(cuda.ordinal());
    let shapes: [&[i64]; 3] = [&[64, 33], &[33], &[7, 5]];
    let initial: Vec<Tensor> = shapes.iter().map(|s| Tensor::randn(*s, (Kind::Float, Device::Cpu)) * 0.1).collect();
    let config = OptimizerConfig { beta1: 0.9, beta2: 0.95, eps: 1e-8, weight_decay: 0.1 };
    let decays = vec![true, false, true];
    let run = |device: Device| {
        // A copy: on the CPU `to_device` would alias `initial`, and the CPU run would move the GPU run's start.
        let mut params: Vec<Tensor> =
            initial.iter().map(|t| t.copy().to_device(device).set_requires_grad(true)).collect();
        let mut opt = AdamW::new(config, &params, decays.clone());
        for step in 0..3 {
            // The first two get gradients (defined by a backward, then set); the third none.
            (params[0].sum(Kind::Float) + params[1].sum(Kind::Float)).backward();
            for (i, p) in params.iter().enumerate().take(2) {
                let g = Tensor::full(p.size(), 0.01 * (step + i + 1) as f64, (Kind::Float, device));
                tch::no_grad(|| p.grad().copy_(&g));
            }
            opt.apply(&mut params, 1e-2);
        }
        let moments = opt.exp_avg.iter().chain(&opt.exp_avg_sq).map(bits).collect::<Vec<_>>();
        (params.iter().map(bits).collect::<Vec<_>>(), moments)
    };
    let (cpu_params, cpu_moments) = run(Device::Cpu);
    let (gpu_params, gpu_moments) = run(gpu);
    assert_eq!(gpu_params, cpu_params, "parameters");
    assert_eq!(gpu_moments, cpu_moments, "moments");
    assert_eq!(gpu_params[2], bits(&initial[2]), "a parameter without a gradient is left alone");
}
