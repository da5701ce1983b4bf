//! The backend dispatch: every kernel through `Backend`, on the CPU always and on CUDA when a device is
//! present (CUDA results must equal the CPU's; the tests say `no CUDA device` and skip otherwise).

use half::{bf16, f16};
use proptest::prelude::*;
use troupe_kernels::{AdamWConfig, Backend, Buffer, HostBuffer, KernelError, ReduceOp};

/// The CUDA backend, or `None` after printing why there is none.
fn cuda_or_skip(test: &str) -> Option<Backend> {
    match Backend::cuda(0) {
        Ok(backend) => Some(backend),
        Err(e) => {
            println!("{test}: skipped, {e}");
            None
        }
    }
}

/// Inputs with every kind of edge value, and deterministic filler for the rest.
fn inputs(len: usize) -> (Vec<f32>, Vec<f32>) {
    let edges = [0.0, -0.0, 1.0, f32::NAN, f32::INFINITY, f32::NEG_INFINITY, 1e-45, -1e-40, f32::MAX, 65520.0];
    let a: Vec<f32> =
        (0..len).map(|i| edges.get(i).copied().unwrap_or(((i * 37) % 101) as f32 * 0.37 - 18.0)).collect();
    let b: Vec<f32> = (0..len).map(|i| edges.get(len - 1 - i).copied().unwrap_or((i as f32 * 0.11).sin())).collect();
    (a, b)
}

/// Every kernel's output through `backend`, downloaded to the host, in a fixed order.
fn all_outputs(backend: &Backend, len: usize) -> Vec<HostBuffer> {
    let (a, b) = inputs(len);
    let up = |h: HostBuffer| backend.upload(h).expect("upload");
    let mut outputs = Vec::new();
    let sources = [
        HostBuffer::F32(b.clone()),
        HostBuffer::Bf16(b.iter().map(|x| bf16::from_f32(*x)).collect()),
        HostBuffer::F16(b.iter().map(|x| f16::from_f32(*x)).collect()),
    ];
    for src in &sources {
        for op in [ReduceOp::Sum, ReduceOp::Avg, ReduceOp::Max, ReduceOp::Min] {
            let mut acc = up(HostBuffer::F32(a.clone()));
            backend.reduce_into(&mut acc, &up(src.clone()), op).expect("reduce_into");
            if op == ReduceOp::Avg {
                backend.finish_avg(&mut acc, 2).expect("finish_avg");
            }
            outputs.push(backend.download(&acc).expect("download"));
        }
    }
    let mut to_bf16 = up(HostBuffer::Bf16(vec![bf16::ZERO; len]));
    backend.cast(&up(HostBuffer::F32(a.clone())), &mut to_bf16).expect("cast");
    let mut to_f16 = up(HostBuffer::F16(vec![f16::ZERO; len]));
    backend.cast(&up(HostBuffer::F32(a.clone())), &mut to_f16).expect("cast");
    for narrow in [&to_bf16, &to_f16] {
        let mut wide = up(HostBuffer::F32(vec![0.0; len]));
        backend.cast(narrow, &mut wide).expect("cast");
        outputs.push(backend.download(&wide).expect("download"));
    }
    outputs.push(backend.download(&to_bf16).expect("download"));
    outputs.push(backend.download(&to_f16).expect("download"));

    let finite_b: Vec<f32> = b.iter().map(|x| if x.is_finite() { x * 1e-3 } else { 0.5 }).collect();
    let (mut p, g) =
        (up(HostBuffer::F32(a.iter().map(|x| x.clamp(-5.0, 5.0)).collect())), up(HostBuffer::F32(finite_b)));
    let (mut m, mut v) = (up(HostBuffer::F32(vec![0.0; len])), up(HostBuffer::F32(vec![0.0; len])));
    let mut out = up(HostBuffer::Bf16(vec![bf16::ZERO; len]));
    for step in 1..=3 {
        backend.adamw_step(&mut p, &g, &mut m, &mut v, Some(&mut out), &AdamWConfig::default(), step).expect("adamw");
    }
    for buffer in [&p, &m, &v, &out] {
        outputs.push(backend.download(buffer).expect("download"));
    }

    let mut grads = up(HostBuffer::F32(a.clone()));
    let found = backend.unscale_grads(&mut grads, 0.25).expect("unscale");
    assert_eq!(found, a.iter().any(|x| !x.is_finite()));
    outputs.push(backend.download(&grads).expect("download"));
    let finite_a: Vec<f32> = a.iter().map(|x| if x.is_finite() { *x } else { 3.0 }).collect();
    let norm = backend.l2_norm(&[&up(HostBuffer::F32(finite_a)), &g]).expect("norm");
    outputs.push(HostBuffer::F32(vec![norm as f32]));
    outputs
}

fn same_f32(x: f32, y: f32) -> bool {
    x == y || (x.is_nan() && y.is_nan())
}

fn assert_same_outputs(got: &[HostBuffer], want: &[HostBuffer]) {
    assert_eq!(got.len(), want.len());
    for (k, (g, w)) in got.iter().zip(want).enumerate() {
        let ok = match (g, w) {
            (HostBuffer::F32(g), HostBuffer::F32(w)) => {
                g.len() == w.len() && g.iter().zip(w).all(|(a, b)| same_f32(*a, *b))
            }
            (HostBuffer::Bf16(g), HostBuffer::Bf16(w)) => {
                g.iter().zip(w).all(|(a, b)| same_f32(a.to_f32(), b.to_f32()))
            }
            (HostBuffer::F16(g), HostBuffer::F16(w)) => g.iter().zip(w).all(|(a, b)| same_f32(a.to_f32(), b.to_f32())),
            _ => false,
        };
        assert!(ok, "output {k} differs:\n got {g:?}\nwant {w:?}");
    }
}

#[test]
fn cpu_backend_runs_every_kernel_on_odd_and_empty_lengths() {
    for len in [0, 1, 7, 33, 1025] {
        let outputs = all_outputs(&Backend::Cpu, len);
        assert_eq!(outputs.len(), 12 + 4 + 4 + 2);
    }
}

#[test]
fn cuda_backend_equals_cpu_backend() {
    let Some(cuda) = cuda_or_skip("cuda_backend_equals_cpu_backend") else {
        return;
    };
    for len in [0, 1, 7, 33, 1025, 1 << 20] {
        assert_same_outputs(&all_outputs(&cuda, len), &all_outputs(&Backend::Cpu, len));
    }
}

/// Buffers for the norm and the checksum: edge values, odd lengths, length 0, and one large enough
/// for many blocks (and, for the checksum, several copied-back pieces).
fn norm_and_checksum_inputs() -> Vec<Vec<f32>> {
    let mut buffers: Vec<Vec<f32>> = [0, 1, 7, 255, 257, 1025, 3 << 20 | 5].iter().map(|&len| inputs(len).1).collect();
    buffers.push(vec![f32::MAX, f32::MAX, 1e-45, -0.0]);
    buffers.push(vec![1.0, f32::INFINITY, 2.0]);
    buffers.push(vec![1.0, f32::NAN, f32::INFINITY]);
    buffers
}

/// Norm within 1e-12 relative (both accumulate in f64, in different orders), inf and NaN alike,
/// checksums equal; the same for the bf16 and f16 bits of the buffer.
fn check_norm_and_checksum(backend: &Backend) {
    for values in norm_and_checksum_inputs() {
        let len = values.len();
        let on_cpu = Buffer::Cpu(HostBuffer::F32(values.clone()));
        let on_backend = backend.upload(HostBuffer::F32(values.clone())).expect("upload");
        let (got, want) = (backend.l2_norm(&[&on_backend]).unwrap(), Backend::Cpu.l2_norm(&[&on_cpu]).unwrap());
        let close = got == want || (got.is_nan() && want.is_nan()) || (got - want).abs() <= 1e-12 * want;
        assert!(close, "{} l2_norm of {len}: {got} vs cpu {want}", backend.name());
        assert_eq!(backend.checksum64(&on_backend).unwrap(), Backend::Cpu.checksum64(&on_cpu).unwrap(), "{len}");
        let halves = HostBuffer::Bf16(values.iter().map(|x| bf16::from_f32(*x)).collect());
        let want = Backend::Cpu.checksum64(&Buffer::Cpu(halves.clone())).unwrap();
        assert_eq!(backend.checksum64(&backend.upload(halves).unwrap()).unwrap(), want, "bf16 {len}");
    }
}

#[test]
fn cpu_checksum_is_xxh3_of_the_element_bytes() {
    let values = [1.0f32, -2.5, f32::NAN];
    let bytes: Vec<u8> = values.iter().flat_map(|x| x.to_le_bytes()).collect();
    let got = Backend::Cpu.checksum64(&Buffer::Cpu(HostBuffer::F32(values.to_vec()))).unwrap();
    assert_eq!(got, troupe_kernels::checksum64(&bytes));
    let halves = [f16::from_f32(1.5), f16::NEG_INFINITY];
    let bytes: Vec<u8> = halves.iter().flat_map(|x| x.to_bits().to_le_bytes()).collect();
    let got = Backend::Cpu.checksum64(&Buffer::Cpu(HostBuffer::F16(halves.to_vec()))).unwrap();
    assert_eq!(got, troupe_kernels::checksum64(&bytes));
    check_norm_and_checksum(&Backend::Cpu);
}

#[test]
fn cuda_norm_and_checksum_equal_the_cpu() {
    let Some(cuda) = cuda_or_skip("cuda_norm_and_checksum_equal_the_cpu") else {
        return;
    };
    check_norm_and_checksum(&cuda);
    // Deterministic: the same bits on every call.
    let big = cuda
        .upload(HostBuffer::F32(inputs(1 << 22).1.iter().map(|x| if x.is_finite() { *x } else { 1.0 }).collect()))
        .unwrap();
    let first = cuda.l2_norm(&[&big]).unwrap();
    for _ in 0..3 {
        assert_eq!(cuda.l2_norm(&[&big]).unwrap().to_bits(), first.to_bits());
    }
}

#[test]
fn cuda_benchmark_reports_every_kernel_beside_the_device_copy() {
    let Some(Backend::Cuda(cuda)) = cuda_or_skip("cuda_benchmark_reports_every_kernel_beside_the_device_copy") else {
        return;
    };
    let figures = troupe_kernels::bench::cuda::run_cuda(&cuda, 4 << 20, 3).expect("benchmark");
    assert_eq!(figures.len(), 14, "{figures:?}");
    assert_eq!(figures[0].kernel, "device_copy");
    for f in &figures {
        assert!(f.gb_per_s.is_finite() && f.gb_per_s > 0.0 && f.backend == "cuda", "{f:?}");
        assert!((f.vs_memcpy - f.gb_per_s / f.memcpy_gb_per_s).abs() < 1e-9, "{f:?}");
    }
}

#[test]
fn missing_device_is_reported_plainly() {
    match Backend::cuda(10_000) {
        Err(e @ KernelError::NoCudaDevice { .. }) => {
            assert!(e.to_string().starts_with("no CUDA device: "), "{e}")
        }
        other => panic!("device 10000 must not exist, got {other:?}"),
    }
    match Backend::best_available() {
        Backend::Cpu => println!("best_available: cpu (no CUDA device)"),
        Backend::Cuda(_) => println!("best_available: cuda"),
    }
}

#[test]
fn mismatched_inputs_are_errors_that_name_the_op() {
    let cpu = Backend::Cpu;
    let mut acc = Buffer::Cpu(HostBuffer::Bf16(vec![bf16::ZERO; 2]));
    let src = Buffer::Cpu(HostBuffer::F32(vec![0.0; 2]));
    let err = cpu.reduce_into(&mut acc, &src, ReduceOp::Sum).unwrap_err();
    assert!(matches!(err, KernelError::DTypeMismatch { expected: "f32", got: "bf16", .. }), "{err}");
    let mut acc = Buffer::Cpu(HostBuffer::F32(vec![0.0; 3]));
    let err = cpu.reduce_into(&mut acc, &src, ReduceOp::Sum).unwrap_err();
    assert!(matches!(err, KernelError::LengthMismatch { left: 3, right: 2, .. }), "{err}");
    let mut dst = Buffer::Cpu(HostBuffer::F32(vec![0.0; 2]));
    let err = cpu.cast(&src, &mut dst).unwrap_err();
    assert!(err.to_string().starts_with("cast"), "{err}");
}

proptest! {
    #[test]
    fn cpu_backend_reduce_equals_the_plain_function(a in prop::collection::vec(any::<u32>(), 0..500), op_index in 0usize..4) {
        let op = [ReduceOp::Sum, ReduceOp::Avg, ReduceOp::Max, ReduceOp::Min][op_index];
        let acc: Vec<f32> = a.iter().map(|x| f32::from_bits(*x)).collect();
        let src: Vec<bf16> = a.iter().map(|x| bf16::from_bits((*x >> 7) as u16)).collect();
        let mut want = acc.clone();
        troupe_kernels::reduce_into(&mut want, &src, op);
        let mut buffer = Buffer::Cpu(HostBuffer::F32(acc));
        Backend::Cpu.reduce_into(&mut buffer, &Buffer::Cpu(HostBuffer::Bf16(src)), op).unwrap();
        let Buffer::Cpu(HostBuffer::F32(got)) = buffer else { panic!("accumulator changed type") };
        prop_assert!(got.iter().zip(&want).all(|(g, w)| same_f32(*g, *w)));
    }
}
