//! HAMi's protocol for shared GPUs with memory and compute limits: what
//! HAMi's device plugin registers on a node, and what the scheduler writes
//! on a pod for the device plugin to read (Project-HAMi/HAMi,
//! `docs/develop/protocol.md`). Pure: parsing and encoding only; the
//! scheduler writes the annotations and the node lock.
//!
//! - A node's GPUs: `hami.io/node-nvidia-register`, a JSON list of devices
//!   (newer plugins) or `uuid,split,memory MiB,cores,type,numa,healthy[,index,mode]:`
//!   per device (older ones). The node's `nvidia.com/gpu` is then the count
//!   of shares (GPUs × split), not of GPUs.
//! - A pod's share: `nvidia.com/gpu: 1` with `nvidia.com/gpumem` (MiB) and
//!   optionally `nvidia.com/gpucores` (percent of the GPU's compute).
//! - The decision: `hami.io/vgpu-devices-to-allocate` (and `-allocated`),
//!   one `uuid,NVIDIA,memory,cores:` entry per device, containers separated
//!   by `;`; `hami.io/vgpu-node`, `hami.io/vgpu-time`.
//! - The bind: the node locked (`hami.io/mutex.lock`: `time,namespace,pod`),
//!   the pod marked `hami.io/bind-phase: allocating`, then bound. The device
//!   plugin allocates, marks the pod `success` and unlocks the node.

use serde::Deserialize;

pub const REGISTER: &str = "hami.io/node-nvidia-register";
pub const TO_ALLOCATE: &str = "hami.io/vgpu-devices-to-allocate";
pub const ALLOCATED: &str = "hami.io/vgpu-devices-allocated";
pub const ASSIGNED_NODE: &str = "hami.io/vgpu-node";
pub const ASSIGNED_TIME: &str = "hami.io/vgpu-time";
pub const BIND_PHASE: &str = "hami.io/bind-phase";
pub const BIND_TIME: &str = "hami.io/bind-time";
pub const NODE_LOCK: &str = "hami.io/mutex.lock";
/// GPU memory per share, in MiB.
pub const MEMORY: &str = "nvidia.com/gpumem";
/// Compute per share, in percent of the GPU.
pub const CORES: &str = "nvidia.com/gpucores";
/// GPU memory per share in percent: refused (gpuflow checks MiB).
pub const MEMORY_PERCENT: &str = "nvidia.com/gpumem-percentage";
/// How long a node lock holds before another scheduler may break it
/// (HAMi's default, `HAMI_NODELOCK_EXPIRE`).
pub const LOCK_EXPIRES_S: i64 = 300;

/// One GPU as HAMi's device plugin registers it.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct Device {
    pub uuid: String,
    /// Shares the GPU is split into at most.
    pub split: u32,
    pub mem_mib: u64,
    pub cores: u32,
    pub model: String,
    pub healthy: bool,
    /// `hami-core`, `mig` or `mps`.
    pub mode: String,
}

#[derive(Deserialize)]
struct JsonDevice {
    #[serde(default)]
    id: String,
    #[serde(default)]
    count: i64,
    #[serde(default)]
    devmem: i64,
    #[serde(default)]
    devcore: i64,
    #[serde(default, rename = "type")]
    type_: String,
    #[serde(default)]
    health: bool,
    #[serde(default)]
    mode: String,
}

/// The GPUs a node's registration lists, or why it cannot be read.
///
/// # Errors
/// On a registration in neither of HAMi's two forms, or a device without a
/// UUID, split count or memory.
pub fn parse_register(s: &str) -> Result<Vec<Device>, String> {
    let s = s.trim();
    let devices: Vec<Device> = if s.starts_with('[') {
        let list: Vec<JsonDevice> =
            serde_json::from_str(s).map_err(|e| format!("{REGISTER} is not a device list: {e}"))?;
        list.into_iter()
            .map(|d| Device {
                uuid: d.id,
                split: d.count.clamp(0, i64::from(u32::MAX)) as u32,
                mem_mib: d.devmem.max(0) as u64,
                cores: d.devcore.clamp(0, 100) as u32,
                model: d.type_,
                healthy: d.health,
                mode: if d.mode.is_empty() {
                    "hami-core".into()
                } else {
                    d.mode
                },
            })
            .collect()
    } else {
        let mut out = Vec::new();
        for entry in s.split(':').filter(|e| !e.trim().is_empty()) {
            let f: Vec<&str> = entry.split(',').map(str::trim).collect();
            if f.len() != 7 && f.len() != 9 {
                return Err(format!(
                    "{REGISTER}: device {entry:?} has {} fields, not 7 or 9",
                    f.len()
                ));
            }
            let num = |i: usize, what: &str| {
                f[i].parse::<u64>().map_err(|_| {
                    format!(
                        "{REGISTER}: device {}: {what} {:?} is not a number",
                        f[0], f[i]
                    )
                })
            };
            out.push(Device {
                uuid: f[0].to_string(),
                split: num(1, "split count")?.min(u64::from(u32::MAX)) as u32,
                mem_mib: num(2, "memory")?,
                cores: num(3, "cores")?.min(100) as u32,
                model: f[4].to_string(),
                healthy: f[6].eq_ignore_ascii_case("true"),
                mode: f.get(8).map_or("hami-core", |m| m).to_string(),
            });
        }
        out
    };
    for d in &devices {
        if d.uuid.is_empty() || d.split == 0 || d.mem_mib == 0 {
            return Err(format!(
                "{REGISTER}: device {:?} needs a UUID, a split count and its memory",
                d.uuid
            ));
        }
    }
    Ok(devices)
}

/// One device of a container's allocation.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct Share {
    pub uuid: String,
    pub mem_mib: u64,
    /// Percent of the GPU's compute; 0: no limit.
    pub cores: u32,
}

/// The decision annotation: one entry per container, each listing its
/// devices (`uuid,NVIDIA,memory,cores:`), every container ended by `;`.
pub fn encode(containers: &[Vec<Share>]) -> String {
    let mut out = String::new();
    for devices in containers {
        for d in devices {
            out.push_str(&format!("{},NVIDIA,{},{}:", d.uuid, d.mem_mib, d.cores));
        }
        out.push(';');
    }
    out
}

/// The devices of a pod's decision annotation, all containers together;
/// entries that do not parse are skipped.
pub fn decode(s: &str) -> Vec<Share> {
    s.split([';', ':'])
        .filter_map(|entry| {
            let f: Vec<&str> = entry.split(',').map(str::trim).collect();
            (f.len() == 4 && !f[0].is_empty()).then(|| Share {
                uuid: f[0].to_string(),
                mem_mib: f[2].parse().unwrap_or(0),
                cores: f[3].parse().unwrap_or(0),
            })
        })
        .collect()
}

/// A node lock's value: when, and for which pod.
pub fn lock_value(at: &str, namespace: &str, pod: &str) -> String {
    format!("{at},{namespace},{pod}")
}

/// A node lock: when it was taken (seconds) and for which pod
/// (`namespace`, `name`), when it names one.
pub type Lock = (i64, Option<(String, String)>);

/// A node lock's value read, if it parses.
pub fn parse_lock(v: &str) -> Option<Lock> {
    let mut parts = v.split(',');
    let at = parts.next()?;
    let at = at.parse::<k8s_openapi::jiff::Timestamp>().ok()?.as_second();
    match (parts.next(), parts.next(), parts.next()) {
        (Some(ns), Some(name), None) => Some((at, Some((ns.to_string(), name.to_string())))),
        (None, ..) => Some((at, None)),
        _ => None,
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn both_registration_forms_parse_and_bad_ones_are_refused() {
        let old = "GPU-0,10,32768,100,NVIDIA-Tesla V100-PCIE-32GB,0,true:GPU-1,10,32768,100,NVIDIA-Tesla V100-PCIE-32GB,0,false,1,hami-core:";
        let d = parse_register(old).unwrap();
        assert_eq!(d.len(), 2);
        assert_eq!(d[0].split, 10);
        assert_eq!(d[0].mem_mib, 32768);
        assert!(d[0].healthy && !d[1].healthy);
        assert_eq!(d[1].mode, "hami-core");
        let json = r#"[{"id":"GPU-a","count":4,"devmem":81559,"devcore":100,"type":"NVIDIA-H100","numa":0,"mode":"hami-core","health":true}]"#;
        let d = parse_register(json).unwrap();
        assert_eq!(
            (d[0].uuid.as_str(), d[0].split, d[0].mem_mib),
            ("GPU-a", 4, 81559)
        );
        assert!(parse_register("GPU-0,10,lots,100,x,0,true:").is_err());
        assert!(parse_register("GPU-0,10,100:").is_err());
        assert!(parse_register(r#"[{"id":"GPU-a","count":0,"devmem":1}]"#).is_err());
    }

    #[test]
    fn allocations_encode_as_hami_writes_them_and_decode_back() {
        let a = Share {
            uuid: "GPU-a".into(),
            mem_mib: 3000,
            cores: 0,
        };
        let b = Share {
            uuid: "GPU-b".into(),
            mem_mib: 5000,
            cores: 30,
        };
        let s = encode(&[vec![a.clone()], vec![], vec![b.clone()]]);
        assert_eq!(s, "GPU-a,NVIDIA,3000,0:;;GPU-b,NVIDIA,5000,30:;");
        assert_eq!(decode(&s), vec![a, b]);
    }

    #[test]
    fn node_locks_name_their_pod() {
        let v = lock_value("2026-12-04T06:00:00Z", "ml", "nb-1");
        let (at, who) = parse_lock(&v).unwrap();
        assert_eq!(at, 1_796_364_000);
        assert_eq!(who, Some(("ml".into(), "nb-1".into())));
        assert_eq!(parse_lock("2026-12-04T06:00:00Z").unwrap().1, None);
        assert!(parse_lock("yesterday,ml,nb").is_none());
    }
}
