//! node.toml `devices`: the CUDA devices a node offers, one slot (one worker) each — `"cuda"` for every
//! device the process sees, or a list of ordinals (`[0, 1]`). Without `devices`, `slots` CPU slots.
//!
//! The key is checked twice: its form when the file is read ([`Devices::validate`]), and against the
//! machine when the daemon starts ([`resolve`]): CUDA requested where there is none, or an ordinal the
//! machine does not have, stops the daemon before it joins, naming the key and what the machine has.

use serde::{Deserialize, Serialize};
use troupe_cluster::nccl::CudaDeviceInfo;

use super::SLOTS_MAX;
use crate::protocol::SlotDevice;

/// node.toml `devices`.
#[derive(Clone, Debug, PartialEq, Serialize, Deserialize)]
#[serde(untagged)]
pub enum Devices {
    /// `"cuda"`: every visible CUDA device.
    All(String),
    /// CUDA ordinals, one slot each, in this order.
    List(Vec<u32>),
}

impl Devices {
    /// The form alone: `"cuda"`, or a non-empty list of distinct ordinals.
    pub fn validate(&self) -> Result<(), String> {
        match self {
            Devices::All(word) if word == "cuda" => Ok(()),
            Devices::All(word) => {
                Err(format!("{word:?} is not a device kind; write \"cuda\" (every visible GPU) or a list of CUDA ordinals like [0, 1]"))
            }
            Devices::List(list) if list.is_empty() => {
                Err("is empty; list CUDA ordinals like [0, 1], or leave `devices` out and set `slots` for CPU slots".into())
            }
            Devices::List(list) if list.len() > SLOTS_MAX as usize => {
                Err(format!("lists {} devices; a node offers at most {SLOTS_MAX} slots", list.len()))
            }
            Devices::List(list) => {
                let mut seen = std::collections::BTreeSet::new();
                match list.iter().find(|d| !seen.insert(**d)) {
                    Some(d) => Err(format!("lists device {d} twice; each device is one slot, list it once")),
                    None => Ok(()),
                }
            }
        }
    }
}

/// What the daemon found on its machine: the CUDA devices (or why none can be used), and whether NCCL
/// can be (or why not).
pub struct Probe {
    pub cuda: Result<Vec<CudaDeviceInfo>, String>,
    pub nccl: Result<(), String>,
}

impl Probe {
    /// This machine, through the CUDA driver and the NCCL library (cudarc; nothing is initialised when
    /// a library is missing).
    pub fn machine() -> Probe {
        let cuda = troupe_cluster::nccl::cuda_devices().map_err(|e| e.to_string());
        let nccl = match &cuda {
            Ok(_) => troupe_cluster::nccl::nccl_available().map(drop).map_err(|e| e.to_string()),
            Err(e) => Err(e.clone()),
        };
        Probe { cuda, nccl }
    }
}

/// The slots a node offers: `slots` CPU slots without `devices` (1 when `slots` is absent too), or one
/// slot per CUDA device `devices` names, as `probe` finds them. An error names the key and the fix.
pub fn resolve(
    devices: Option<&Devices>,
    slots: Option<u32>,
    probe: impl FnOnce() -> Probe,
) -> Result<Vec<SlotDevice>, (&'static str, String)> {
    let Some(devices) = devices else {
        return Ok(vec![SlotDevice::Cpu; slots.unwrap_or(1) as usize]);
    };
    devices.validate().map_err(|m| ("devices", m))?;
    let Probe { cuda, nccl } = probe();
    let found = match cuda {
        Ok(found) if !found.is_empty() => found,
        Ok(_) => return Err(("devices", no_cuda(devices, "the CUDA driver reports no device"))),
        Err(why) => return Err(("devices", no_cuda(devices, &why))),
    };
    let ordinals: Vec<u32> = match devices {
        Devices::All(_) => (0..found.len() as u32).collect(),
        Devices::List(list) => list.clone(),
    };
    if let Some(missing) = ordinals.iter().find(|o| **o as usize >= found.len()) {
        let names: Vec<String> = found.iter().map(|d| format!("{}: {}", d.ordinal, d.name)).collect();
        return Err((
            "devices",
            format!(
                "device {missing} does not exist: this machine has {} CUDA device(s) ({}); list ordinals below {}, or write \"cuda\" for all of them",
                found.len(),
                names.join(", "),
                found.len()
            ),
        ));
    }
    if let Some(slots) = slots.filter(|s| *s as usize != ordinals.len()) {
        return Err((
            "slots",
            format!(
                "is {slots} but `devices` gives {} slot(s), one per device; leave `slots` out when `devices` is set",
                ordinals.len()
            ),
        ));
    }
    let nccl_missing = nccl.err();
    Ok(ordinals
        .into_iter()
        .map(|o| {
            let d = &found[o as usize];
            SlotDevice::Cuda {
                ordinal: o,
                name: d.name.clone(),
                memory_bytes: d.memory_bytes,
                nccl_missing: nccl_missing.clone(),
            }
        })
        .collect())
}

fn no_cuda(devices: &Devices, why: &str) -> String {
    let asked = match devices {
        Devices::All(_) => "\"cuda\"".to_owned(),
        Devices::List(list) => format!("{list:?}"),
    };
    format!(
        "{asked} asks for CUDA devices, but none can be used on this machine ({why}); leave `devices` out and set `slots` to offer CPU slots"
    )
}

#[cfg(test)]
mod tests {
    use super::*;

    fn h200s(n: usize) -> impl FnOnce() -> Probe {
        move || Probe {
            cuda: Ok((0..n)
                .map(|ordinal| CudaDeviceInfo {
                    ordinal,
                    name: "NVIDIA H200".into(),
                    memory_bytes: 150_000_000_000,
                    uuid: None,
                })
                .collect()),
            nccl: Ok(()),
        }
    }

    fn no_gpu() -> Probe {
        Probe { cuda: Err("the CUDA driver library (libcuda) is not installed".into()), nccl: Err("no CUDA".into()) }
    }

    #[test]
    fn without_devices_a_node_offers_cpu_slots_and_never_probes() {
        let probe = || -> Probe { panic!("no CUDA device was asked for") };
        assert_eq!(resolve(None, None, probe).unwrap(), vec![SlotDevice::Cpu]);
        assert_eq!(resolve(None, Some(3), no_gpu).unwrap(), vec![SlotDevice::Cpu; 3]);
    }

    #[test]
    fn cuda_gives_a_slot_per_visible_device_and_a_list_those_listed_in_order() {
        let all = resolve(Some(&Devices::All("cuda".into())), None, h200s(2)).unwrap();
        assert_eq!(all.iter().map(SlotDevice::label).collect::<Vec<_>>(), ["cuda:0", "cuda:1"]);
        assert!(matches!(&all[1], SlotDevice::Cuda { name, nccl_missing: None, .. } if name == "NVIDIA H200"));
        let listed = resolve(Some(&Devices::List(vec![3, 1])), None, h200s(4)).unwrap();
        assert_eq!(listed.iter().map(SlotDevice::label).collect::<Vec<_>>(), ["cuda:3", "cuda:1"]);
        // `slots` may repeat the count.
        assert_eq!(resolve(Some(&Devices::List(vec![0])), Some(1), h200s(1)).unwrap().len(), 1);
    }

    #[test]
    fn a_missing_nccl_is_carried_by_every_cuda_slot() {
        let probe = || Probe { nccl: Err("NCCL is installed only as /x/libnccl.so.2".into()), ..h200s(2)() };
        let slots = resolve(Some(&Devices::All("cuda".into())), None, probe).unwrap();
        assert!(slots
            .iter()
            .all(|s| matches!(s, SlotDevice::Cuda { nccl_missing: Some(m), .. } if m.contains("libnccl.so.2"))));
    }

    #[test]
    fn cuda_where_there_is_none_is_refused_naming_the_key_and_the_fix() {
        let (key, message) = resolve(Some(&Devices::All("cuda".into())), None, no_gpu).unwrap_err();
        assert_eq!(key, "devices");
        assert!(message.contains("libcuda") && message.contains("set `slots`"), "{message}");
        let (_, message) = resolve(Some(&Devices::List(vec![0])), None, h200s(0)).unwrap_err();
        assert!(message.contains("reports no device"), "{message}");
    }

    #[test]
    fn an_ordinal_the_machine_does_not_have_is_refused_listing_what_it_has() {
        let (key, message) = resolve(Some(&Devices::List(vec![0, 2])), None, h200s(2)).unwrap_err();
        assert_eq!(key, "devices");
        assert!(message.contains("device 2 does not exist") && message.contains("0: NVIDIA H200"), "{message}");
        assert!(message.contains("below 2"), "{message}");
    }

    #[test]
    fn slots_that_contradict_devices_are_refused() {
        let (key, message) = resolve(Some(&Devices::All("cuda".into())), Some(4), h200s(2)).unwrap_err();
        assert_eq!(key, "slots");
        assert!(message.contains("is 4 but `devices` gives 2"), "{message}");
    }

    #[test]
    fn node_toml_spells_devices_as_a_word_or_a_list() {
        #[derive(Deserialize)]
        struct Doc {
            devices: Devices,
        }
        let all: Doc = toml::from_str("devices = \"cuda\"").unwrap();
        assert_eq!(all.devices, Devices::All("cuda".into()));
        let list: Doc = toml::from_str("devices = [0, 1]").unwrap();
        assert_eq!(list.devices, Devices::List(vec![0, 1]));
        assert!(toml::from_str::<Doc>("devices = -1").is_err());
        assert!(toml::from_str::<Doc>("devices = [-1]").is_err());
    }

    #[test]
    fn malformed_devices_are_refused_when_the_file_is_read() {
        for (devices, expect) in [
            (Devices::All("gpu".into()), "not a device kind"),
            (Devices::List(vec![]), "is empty"),
            (Devices::List(vec![0, 1, 0]), "device 0 twice"),
            (Devices::List((0..=SLOTS_MAX).collect()), "at most"),
        ] {
            let message = devices.validate().unwrap_err();
            assert!(message.contains(expect), "{devices:?}: {message}");
        }
        assert!(Devices::All("cuda".into()).validate().is_ok());
        assert!(Devices::List(vec![1, 0]).validate().is_ok());
    }
}
