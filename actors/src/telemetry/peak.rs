//! The peak FLOP/s a slot's device reaches in a compute precision: the denominator of MFU. Known for
//! the GPUs in the table (dense, no sparsity, from NVIDIA's data sheets), overridable per node with
//! `telemetry.peak_tflops_per_slot`; unknown (no MFU) for CPUs and other devices.

use crate::protocol::SlotDevice;

/// Dense peak TFLOP/s of the CUDA device called `name` in `precision` ("bf16", "fp16" or "fp32": fp32
/// counts the plain FP32 units, not TF32), when the table knows it.
pub fn known_peak_tflops(name: &str, precision: &str) -> Option<f64> {
    let half = matches!(precision, "bf16" | "fp16");
    let (half_tflops, fp32_tflops) = if name.contains("H200") || (name.contains("H100") && !name.contains("PCIe")) {
        (989.0, 67.0)
    } else if name.contains("H100") {
        (756.0, 51.0)
    } else if name.contains("A100") {
        (312.0, 19.5)
    } else {
        return None;
    };
    Some(if half { half_tflops } else { fp32_tflops })
}

/// The peak FLOP/s of a rank on `device` computing in `precision`: `override_tflops` (the node's
/// `telemetry.peak_tflops_per_slot`) when set, else the table's figure for a CUDA device; None otherwise.
pub fn peak_flops(device: &SlotDevice, precision: &str, override_tflops: Option<f64>) -> Option<f64> {
    let tflops = override_tflops.or(match device {
        SlotDevice::Cuda { name, .. } => known_peak_tflops(name, precision),
        SlotDevice::Cpu => None,
    })?;
    Some(tflops * 1e12)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn hopper_and_ampere_peaks_by_precision_and_none_for_what_the_table_lacks() {
        assert_eq!(known_peak_tflops("NVIDIA H100 80GB HBM3", "bf16"), Some(989.0));
        assert_eq!(known_peak_tflops("NVIDIA H200", "fp16"), Some(989.0));
        assert_eq!(known_peak_tflops("NVIDIA H100 PCIe", "bf16"), Some(756.0));
        assert_eq!(known_peak_tflops("NVIDIA H100 80GB HBM3", "fp32"), Some(67.0));
        assert_eq!(known_peak_tflops("NVIDIA A100-SXM4-80GB", "bf16"), Some(312.0));
        assert_eq!(known_peak_tflops("Tesla T4", "fp16"), None);
    }

    #[test]
    fn the_nodes_figure_overrides_the_table_and_a_cpu_has_none_without_it() {
        let h200 = SlotDevice::Cuda { ordinal: 0, name: "NVIDIA H200".into(), memory_bytes: 1, nccl_missing: None };
        assert_eq!(peak_flops(&h200, "bf16", None), Some(989e12));
        assert_eq!(peak_flops(&h200, "bf16", Some(500.0)), Some(500e12));
        assert_eq!(peak_flops(&SlotDevice::Cpu, "fp32", None), None);
        assert_eq!(peak_flops(&SlotDevice::Cpu, "fp32", Some(2.0)), Some(2e12));
    }
}
