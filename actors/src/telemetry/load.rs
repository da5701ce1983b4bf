//! What a daemon's machine is using, for its heartbeats (`protocol::NodeLoad`, `troupe status`): the
//! process's resident memory and CPU time from /proc, and each CUDA slot's memory in use and
//! utilisation from NVML — loaded at the first sample of a node with CUDA slots, each device found by
//! its UUID (CUDA's ordinals and NVML's indices may differ), no CUDA context created. Where NVML
//! cannot be loaded or asked, the sample says why instead of the GPU figures.

use std::time::{Duration, Instant};

use nvml_wrapper::Nvml;

use crate::protocol::{DeviceLoad, NodeLoad, SlotDevice};

/// How often a daemon samples its machine (its heartbeats carry the latest sample).
pub const SAMPLE_EVERY: Duration = Duration::from_secs(1);

/// NVML, and each CUDA slot's ordinal and device UUID (by slot).
type LoadedNvml = (Nvml, Vec<(u32, Option<String>)>);

/// The daemon's sampler: samples at most every [`SAMPLE_EVERY`].
pub struct LoadSampler {
    every: Duration,
    /// The previous sample: when, and the process's CPU seconds then.
    last: Option<(Instant, Option<f64>)>,
    /// NVML and each CUDA slot's device UUID (by slot), or why not; loaded at the first sample that
    /// needs it.
    nvml: Option<Result<LoadedNvml, String>>,
}

impl Default for LoadSampler {
    fn default() -> Self {
        Self::new(SAMPLE_EVERY)
    }
}

impl LoadSampler {
    pub fn new(every: Duration) -> Self {
        LoadSampler { every, last: None, nvml: None }
    }

    /// A sample of the machine if `every` passed since the last one (the first call samples); None
    /// otherwise. `devices`: what each slot computes on.
    pub fn sample(&mut self, now: Instant, devices: &[SlotDevice]) -> Option<NodeLoad> {
        if self.last.is_some_and(|(at, _)| now.duration_since(at) < self.every) {
            return None;
        }
        let cpu = cpu_seconds();
        let cpu_percent = match (self.last, cpu) {
            (Some((at, Some(before))), Some(after)) => {
                let wall = now.duration_since(at).as_secs_f64();
                let cores = std::thread::available_parallelism().map_or(1, |n| n.get()) as f64;
                (wall > 0.0).then(|| (100.0 * (after - before) / (wall * cores)).clamp(0.0, 100.0).round() as u32)
            }
            _ => None,
        };
        self.last = Some((now, cpu));
        let ordinals: Vec<u32> = devices
            .iter()
            .filter_map(|d| match d {
                SlotDevice::Cuda { ordinal, .. } => Some(*ordinal),
                SlotDevice::Cpu => None,
            })
            .collect();
        let (devices, devices_unavailable) =
            if ordinals.is_empty() { (Vec::new(), None) } else { self.devices(&ordinals) };
        Some(NodeLoad { rss_bytes: super::memory::rss_bytes().unwrap_or(0), cpu_percent, devices, devices_unavailable })
    }

    /// Each CUDA slot's figures, or why there are none.
    fn devices(&mut self, ordinals: &[u32]) -> (Vec<DeviceLoad>, Option<String>) {
        let nvml = self.nvml.get_or_insert_with(|| open_nvml(ordinals));
        let (nvml, uuids) = match nvml {
            Ok(loaded) => loaded,
            Err(why) => return (Vec::new(), Some(why.clone())),
        };
        let mut loads = Vec::new();
        for (ordinal, uuid) in uuids.iter() {
            let device = match nvml_device(nvml, *ordinal, uuid.as_deref()) {
                Ok(device) => device,
                Err(why) => return (loads, Some(why)),
            };
            match (device.memory_info(), device.utilization_rates()) {
                (Ok(memory), Ok(busy)) => loads.push(DeviceLoad {
                    ordinal: *ordinal,
                    memory_used_bytes: memory.used,
                    memory_total_bytes: memory.total,
                    busy_percent: busy.gpu,
                }),
                (Err(e), _) | (_, Err(e)) => return (loads, Some(format!("NVML on cuda:{ordinal}: {e}"))),
            }
        }
        (loads, None)
    }
}

/// The GPU memory this process holds on `cuda:ordinal`, as NVML counts it (its CUDA context and
/// everything its allocators reserved, libtorch's cached blocks included), or why it cannot be read.
pub fn process_device_memory(ordinal: u32) -> Result<u64, String> {
    let (nvml, uuids) = open_nvml(&[ordinal])?;
    let device = nvml_device(&nvml, ordinal, uuids[0].1.as_deref())?;
    let processes = device.running_compute_processes().map_err(|e| format!("NVML on cuda:{ordinal}: {e}"))?;
    let pid = std::process::id();
    match processes.iter().find(|p| p.pid == pid).map(|p| &p.used_gpu_memory) {
        Some(nvml_wrapper::enums::device::UsedGpuMemory::Used(bytes)) => Ok(*bytes),
        Some(nvml_wrapper::enums::device::UsedGpuMemory::Unavailable) => {
            Err(format!("NVML does not say what process {pid} uses on cuda:{ordinal}"))
        }
        None => Err(format!("NVML lists no process {pid} on cuda:{ordinal}")),
    }
}

/// NVML's handle of `cuda:ordinal`, found by the UUID the CUDA driver gave it (None: it gave none).
fn nvml_device<'n>(nvml: &'n Nvml, ordinal: u32, uuid: Option<&str>) -> Result<nvml_wrapper::Device<'n>, String> {
    let uuid = uuid.ok_or_else(|| format!("the CUDA driver gave no UUID for cuda:{ordinal}"))?;
    nvml.device_by_uuid(uuid).map_err(|e| format!("NVML has no device {uuid} (cuda:{ordinal}): {e}"))
}

/// NVML, and the UUID of each of `ordinals` (from the CUDA driver, no context created).
fn open_nvml(ordinals: &[u32]) -> Result<LoadedNvml, String> {
    let nvml = Nvml::init().map_err(|e| format!("NVML (libnvidia-ml.so.1) could not be loaded: {e}"))?;
    let known = troupe_cluster::nccl::cuda_devices().map_err(|e| e.to_string())?;
    let uuids = ordinals
        .iter()
        .map(|&o| (o, known.iter().find(|d| d.ordinal == o as usize).and_then(|d| d.uuid.clone())))
        .collect();
    Ok((nvml, uuids))
}

/// The CPU time (user + system) the process used so far, in seconds; None where /proc is unavailable.
fn cpu_seconds() -> Option<f64> {
    let stat = std::fs::read_to_string("/proc/self/stat").ok()?;
    // After the command's closing parenthesis: state (field 3), …, utime (14), stime (15).
    let fields: Vec<&str> = stat.rsplit_once(')')?.1.split_whitespace().collect();
    let ticks = fields.get(11)?.parse::<f64>().ok()? + fields.get(12)?.parse::<f64>().ok()?;
    // SAFETY: sysconf reads a constant of the system.
    let per_second = unsafe { libc::sysconf(libc::_SC_CLK_TCK) };
    (per_second > 0).then(|| ticks / per_second as f64)
}

#[cfg(test)]
mod tests {
    use super::*;

    /// A CPU node's samples: the process's memory, its CPU share once there is a previous sample, no
    /// more often than asked, and no GPU figures or NVML loaded.
    #[test]
    fn a_cpu_nodes_sample_has_its_memory_and_cpu_share_and_comes_once_a_period() {
        let mut sampler = LoadSampler::new(Duration::from_millis(200));
        let start = Instant::now();
        let first = sampler.sample(start, &[SlotDevice::Cpu, SlotDevice::Cpu]).expect("the first call samples");
        assert!(first.rss_bytes > 1 << 20, "a test process holds more than 1 MiB: {first:?}");
        assert_eq!(first.cpu_percent, None, "no CPU share without a previous sample");
        assert!(first.devices.is_empty() && first.devices_unavailable.is_none(), "{first:?}");
        assert!(sampler.nvml.is_none(), "NVML is not loaded for CPU slots");
        assert!(sampler.sample(start + Duration::from_millis(100), &[SlotDevice::Cpu]).is_none(), "too soon");
        // Keep one core busy for a while: the share reflects it.
        let spin = Instant::now();
        let mut x = 0u64;
        while spin.elapsed() < Duration::from_millis(300) {
            x = std::hint::black_box(x.wrapping_mul(6364136223846793005).wrapping_add(1));
        }
        let second = sampler.sample(Instant::now(), &[SlotDevice::Cpu]).expect("a period passed");
        let busy = f64::from(second.cpu_percent.expect("a CPU share"));
        let cores = std::thread::available_parallelism().unwrap().get() as f64;
        assert!(
            busy >= 50.0 / cores && busy <= 100.0,
            "one core spun for most of the period: {busy}% of {cores} cores"
        );
    }

    /// A node with a CUDA slot on a machine without NVML says why instead of inventing figures.
    #[test]
    fn a_cuda_slot_without_nvml_says_why() {
        if Nvml::init().is_ok() {
            println!("skipped: NVML loads here (the device check covers its figures)");
            return;
        }
        let gpu =
            SlotDevice::Cuda { ordinal: 0, name: "NVIDIA H200".into(), memory_bytes: 1 << 37, nccl_missing: None };
        let sample = LoadSampler::default().sample(Instant::now(), &[gpu]).unwrap();
        assert!(sample.devices.is_empty(), "{sample:?}");
        let why = sample.devices_unavailable.expect("a reason");
        assert!(why.contains("NVML (libnvidia-ml.so.1) could not be loaded"), "{why}");
    }
}
