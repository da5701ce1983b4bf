//! The CPU kernel benchmark without libtorch (what `troupe bench kernels` runs, minus libtorch's AdamW):
//! `cargo run --release -p troupe-kernels --example bench_kernels -- [MIB] [ITERS] [THREADS]`.
//! One JSON object per line, each kernel beside a memcpy of the same bytes timed in the same loop.

fn main() {
    let arg = |i: usize, default: usize| std::env::args().nth(i).map_or(default, |a| a.parse().expect("a number"));
    let (mib, iters) = (arg(1, 64), arg(2, 15));
    if let Some(threads) = std::env::args().nth(3) {
        troupe_kernels::set_cpu_threads(threads.parse().expect("a number of threads"));
    }
    for figure in troupe_kernels::bench::run_cpu(mib << 20, iters) {
        println!("{}", serde_json::to_string(&figure).expect("a figure serializes"));
    }
}
