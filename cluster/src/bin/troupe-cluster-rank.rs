//! A rank process for multi-process tests and `troupe bench allreduce` when run from this crate:
//! reads its spec from `TROUPE_RANK_SPEC`, prints one JSON report line.

fn main() -> anyhow::Result<()> {
    tracing_subscriber::fmt()
        .with_env_filter(tracing_subscriber::EnvFilter::from_default_env())
        .with_writer(std::io::stderr)
        .init();
    troupe_cluster::bench::run_rank_from_env()
}
