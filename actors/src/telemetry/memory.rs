//! Peak resident memory of a process (VmHWM from /proc): what a rank's step events and the training
//! benchmark report as peak memory per rank (the model, gradients, optimizer state, activations and
//! transport buffers of the ranks in that process).

/// VmHWM (peak resident set size) from a /proc/PID/status file, in bytes; None if unreadable.
pub fn vm_hwm_bytes(status_path: &str) -> Option<u64> {
    status_bytes(status_path, "VmHWM:")
}

/// This process's resident set size now (VmRSS) in bytes; None where /proc is unavailable.
pub fn rss_bytes() -> Option<u64> {
    status_bytes("/proc/self/status", "VmRSS:")
}

/// A `kB` field (`key` with its colon) of a /proc/PID/status file, in bytes.
fn status_bytes(status_path: &str, key: &str) -> Option<u64> {
    std::fs::read_to_string(status_path)
        .ok()?
        .lines()
        .find_map(|l| l.strip_prefix(key))
        .and_then(|rest| rest.split_whitespace().next())
        .and_then(|kb| kb.parse::<u64>().ok())
        .map(|kb| kb * 1024)
}

/// This process's peak resident set size in bytes (0 where /proc is unavailable).
pub fn peak_rss_bytes() -> u64 {
    vm_hwm_bytes("/proc/self/status").unwrap_or(0)
}

#[cfg(test)]
mod tests {
    #[test]
    fn this_process_has_a_peak_that_grows_with_what_it_touches() {
        let before = super::peak_rss_bytes();
        assert!(before > 1 << 20, "a test process holds more than 1 MiB: {before}");
        let touched = std::hint::black_box(vec![1u8; 64 << 20]);
        let after = super::peak_rss_bytes();
        assert!(after >= before + (60 << 20), "64 MiB touched: {before} → {after} (len {})", touched.len());
    }
}
