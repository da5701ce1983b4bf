//! NCCL backend (placeholder until written).
