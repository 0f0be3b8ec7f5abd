//! GPU discovery, samples and health: NVML through `nvml-wrapper` where the
//! library loads, and emulated GPUs from the configuration where it does
//! not. A library that does not load means "no GPUs here", never a crash.
//!
//! Samples (utilisation, memory, power, temperature, compute processes)
//! are kept apart from the inventory, which changes only when the GPUs do.
//! A GPU is unhealthy after a critical XID event (a thread waits on NVML's
//! event set), when its uncorrected ECC errors grow, or when NVML cannot
//! reach it (it stays in the inventory as it was last seen, unhealthy).
//! XID marks last until an admin clears them (`gpuflow node clear`).

use std::collections::BTreeMap;
use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::{Arc, Mutex};

use gpuflow_api::{GpuInfo, GpuSample};
use nvml_wrapper::Nvml;
use nvml_wrapper::enum_wrappers::device::{EccCounter, MemoryError, TemperatureSensor};
use nvml_wrapper::error::NvmlError;

/// XID errors that mean the GPU itself is at fault (not the program on it):
/// ECC and memory-remapping failures, NVLink errors, fallen off the bus,
/// GSP errors.
const CRITICAL_XIDS: &[u64] = &[48, 62, 63, 64, 74, 79, 92, 94, 95, 119, 120, 140];

/// A compute process on a GPU, as NVML sees it.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct GpuProcess {
    /// The GPU's index in the inventory.
    pub gpu: u32,
    pub pid: u32,
    pub memory_mib: u64,
    /// Its SM utilisation in percent, where NVML gives it.
    pub sm_util: Option<u32>,
}

/// Emulated GPUs: `count` of `model` with `memory_mib` each, in MIG mode
/// with these instance profiles when `mig` is not empty.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct Emulated {
    pub count: u32,
    pub model: String,
    pub memory_mib: u64,
    pub mig: Vec<String>,
    /// All GPUs of the node reach each other over NVLink.
    pub nvlink: bool,
    /// The node's name, in its GPUs' UUIDs (`EMU-n1-0`), so that no two
    /// nodes report the same UUID; empty: `EMU-0`.
    pub node: String,
}

impl Emulated {
    /// Parses `N`, `NxMODEL` or `NxMODEL:MEM_MIB` (e.g. `4`, `8xH100`, `2xA10:24576`).
    ///
    /// # Errors
    /// A message saying what form is expected.
    pub fn parse(s: &str) -> Result<Emulated, String> {
        let bad = || {
            format!(
                "{s:?} is not an emulated GPU list: use N, NxMODEL or NxMODEL:MEM_MIB (e.g. 4xH100:81920)"
            )
        };
        let (n, rest) = s.split_once('x').map_or((s, None), |(n, r)| (n, Some(r)));
        let count: u32 = n.trim().parse().map_err(|_| bad())?;
        if count > 64 {
            return Err(format!("{count} emulated GPUs: at most 64 per node"));
        }
        let (model, mem) = match rest {
            None => ("emulated".to_string(), 81920),
            Some(r) => match r.split_once(':') {
                Some((m, mem)) => (m.to_string(), mem.parse().map_err(|_| bad())?),
                None => (r.to_string(), 81920),
            },
        };
        if model.is_empty() {
            return Err(bad());
        }
        Ok(Emulated {
            count,
            model,
            memory_mib: mem,
            mig: vec![],
            nvlink: false,
            node: String::new(),
        })
    }

    /// Declares every emulated GPU in MIG mode with these instances:
    /// `1g.10gb,1g.10gb,3g.40gb` (profiles `Ng.Mgb`, at most 7 slices in all).
    ///
    /// # Errors
    /// A message saying what form is expected.
    pub fn with_mig(mut self, layout: &str) -> Result<Emulated, String> {
        let mut slices = 0;
        for p in layout.split(',').map(str::trim) {
            let parsed = p
                .split_once('g')
                .and_then(|(n, rest)| Some((n.parse::<u32>().ok()?, rest.strip_prefix('.')?)))
                .and_then(|(n, mem)| Some((n, mem.strip_suffix("gb")?.parse::<u32>().ok()?)));
            let Some((n, _)) = parsed.filter(|(n, gb)| (1..=7).contains(n) && *gb > 0) else {
                return Err(format!(
                    "{p:?} is not a MIG profile: use Ng.Mgb (e.g. 1g.10gb, 3g.40gb), comma-separated"
                ));
            };
            slices += n;
            self.mig.push(p.to_string());
        }
        if slices > 7 {
            return Err(format!(
                "MIG layout {layout:?} has {slices} compute slices; a GPU has 7"
            ));
        }
        Ok(self)
    }

    fn mig_memory_mib(profile: &str) -> u64 {
        profile
            .split_once('.')
            .and_then(|(_, m)| m.strip_suffix("gb")?.parse::<u64>().ok())
            .map_or(0, |gb| gb * 1024)
    }

    fn uuid_node(&self) -> String {
        if self.node.is_empty() {
            String::new()
        } else {
            format!("{}-", self.node)
        }
    }

    pub fn gpus(&self) -> Vec<GpuInfo> {
        (0..self.count)
            .map(|i| GpuInfo {
                index: i,
                uuid: format!("EMU-{}{i}", self.uuid_node()),
                model: self.model.clone(),
                memory_mib: self.memory_mib,
                unhealthy: None,
                mig: self
                    .mig
                    .iter()
                    .enumerate()
                    .map(|(k, p)| gpuflow_api::MigInfo {
                        uuid: format!("MIG-EMU-{}{i}-{k}", self.uuid_node()),
                        profile: p.clone(),
                        memory_mib: Emulated::mig_memory_mib(p),
                    })
                    .collect(),
                numa: None,
                nvlink: if self.nvlink {
                    (0..self.count).filter(|&j| j != i).collect()
                } else {
                    vec![]
                },
            })
            .collect()
    }
}

/// NVML when it loads and initialises.
pub struct Gpus {
    nvml: Option<Arc<Nvml>>,
    emulated: Option<Emulated>,
    /// Why NVML is not used, for the log.
    pub nvml_error: Option<String>,
    /// Critical XID events by GPU UUID: (when, in Unix seconds, and what).
    marks: Arc<Mutex<BTreeMap<String, (u64, String)>>>,
    /// Uncorrected ECC errors by UUID when the agent started or an admin
    /// last cleared the GPU.
    ecc_base: Mutex<BTreeMap<String, u64>>,
    /// The inventory as last read, to report a GPU NVML lost as it was.
    last: Mutex<Vec<GpuInfo>>,
    /// Stops the event thread.
    stop: Arc<AtomicBool>,
    /// The event thread, joined on drop: nothing calls into NVML after the
    /// `Gpus` are gone (its wait returns within 250 ms).
    events: Option<std::thread::JoinHandle<()>>,
}

impl Drop for Gpus {
    fn drop(&mut self) {
        self.stop.store(true, Ordering::Relaxed);
        if let Some(t) = self.events.take() {
            let _ = t.join();
        }
    }
}

/// Waits on NVML's event set for critical XID errors and marks their GPUs;
/// says on `registered` once it watches (or has given up), as NVML
/// delivers only the events that come after.
fn watch_events(
    nvml: Arc<Nvml>,
    marks: Arc<Mutex<BTreeMap<String, (u64, String)>>>,
    stop: Arc<AtomicBool>,
    registered: std::sync::mpsc::Sender<()>,
) {
    use nvml_wrapper::bitmasks::event::EventTypes;
    use nvml_wrapper::enums::event::XidError;
    let set = match nvml.create_event_set() {
        Ok(s) => s,
        Err(e) => {
            tracing::warn!(error = %e, "no NVML event set: XID errors are not watched");
            return;
        }
    };
    let mut set = Some(set);
    for i in 0..nvml.device_count().unwrap_or(0) {
        let Ok(d) = nvml.device_by_index(i) else {
            continue;
        };
        let wanted = d
            .supported_event_types()
            .map_or(EventTypes::empty(), |t| t & EventTypes::CRITICAL_XID_ERROR);
        if wanted.is_empty() {
            continue;
        }
        set = match d.register_events(wanted, set.take().expect("kept between devices")) {
            Ok(s) => Some(s),
            Err(e) => {
                tracing::warn!(gpu = i, error = %e.error, "cannot watch XID errors");
                return;
            }
        };
    }
    let set = set.expect("kept between devices");
    let _ = registered.send(());
    while !stop.load(Ordering::Relaxed) {
        match set.wait(250) {
            Ok(ev) => {
                let Some(XidError::Value(xid)) = ev.event_data else {
                    continue;
                };
                let uuid = ev.device.uuid().unwrap_or_default();
                tracing::warn!(gpu = %uuid, xid, "XID error");
                if CRITICAL_XIDS.contains(&xid) {
                    marks.lock().expect("not poisoned").insert(
                        uuid,
                        (
                            crate::unix_now(),
                            format!("XID {xid} error reported by the driver"),
                        ),
                    );
                }
            }
            Err(NvmlError::Timeout) => {}
            Err(e) => {
                tracing::warn!(error = %e, "NVML's event set failed: XID errors are no longer watched");
                return;
            }
        }
    }
}

impl Gpus {
    /// Tries NVML (from `lib`, or the system's `libnvidia-ml.so.1`), unless
    /// emulation is asked for.
    pub fn open(lib: Option<&std::path::Path>, emulated: Option<Emulated>) -> Gpus {
        let blank = |nvml: Option<Arc<Nvml>>, emulated, nvml_error| Gpus {
            nvml,
            emulated,
            nvml_error,
            marks: Arc::default(),
            ecc_base: Mutex::default(),
            last: Mutex::default(),
            stop: Arc::default(),
            events: None,
        };
        if emulated.is_some() {
            return blank(None, emulated, Some("emulated GPUs were asked for".into()));
        }
        let init = match lib {
            Some(p) => Nvml::builder().lib_path(p.as_os_str()).init(),
            None => Nvml::init(),
        };
        match init {
            Ok(nvml) => {
                let nvml = Arc::new(nvml);
                let mut g = blank(Some(nvml.clone()), None, None);
                // The baseline of uncorrected ECC errors: only new ones count.
                for i in 0..nvml.device_count().unwrap_or(0) {
                    if let Ok(d) = nvml.device_by_index(i)
                        && let (Ok(uuid), Ok(n)) = (d.uuid(), uncorrected(&d))
                    {
                        g.ecc_base.lock().expect("not poisoned").insert(uuid, n);
                    }
                }
                let (marks, stop) = (g.marks.clone(), g.stop.clone());
                // The GPUs are watched once `open` returns: an XID error
                // that comes after is never missed because the thread had
                // not registered yet (the sender dropped: it gave up).
                let (registered, watching) = std::sync::mpsc::channel();
                g.events = std::thread::Builder::new()
                    .name("nvml-events".into())
                    .spawn(move || watch_events(nvml, marks, stop, registered))
                    .ok();
                if g.events.is_some() {
                    let _ = watching.recv_timeout(std::time::Duration::from_secs(10));
                }
                g
            }
            Err(e) => blank(None, None, Some(e.to_string())),
        }
    }

    /// Clears the XID marks made at or before `before` (Unix seconds) and
    /// takes the ECC errors counted now as the new baseline.
    pub fn clear_health(&self, before: u64) {
        if before == 0 {
            return;
        }
        self.marks
            .lock()
            .expect("not poisoned")
            .retain(|_, (at, _)| *at > before);
        let Some(nvml) = &self.nvml else {
            return;
        };
        let mut base = self.ecc_base.lock().expect("not poisoned");
        for i in 0..nvml.device_count().unwrap_or(0) {
            if let Ok(d) = nvml.device_by_index(i)
                && let (Ok(uuid), Ok(n)) = (d.uuid(), uncorrected(&d))
                && base.get(&uuid).is_some_and(|&b| b < n)
            {
                base.insert(uuid, n);
            }
        }
    }

    /// The inventory as [`Gpus::list`] last read it (for a sample, which
    /// needs only each GPU's index and UUID, without reading it all again).
    pub fn last_listed(&self) -> Vec<GpuInfo> {
        match &self.nvml {
            Some(_) => self.last.lock().expect("not poisoned").clone(),
            None => self.list(),
        }
    }

    /// Each GPU's state now, and the compute processes on them (none for
    /// emulated GPUs).
    pub fn sample(&self) -> (Vec<GpuSample>, Vec<GpuProcess>) {
        let Some(nvml) = &self.nvml else {
            return (vec![], vec![]);
        };
        let mut gpus = Vec::new();
        let mut procs = Vec::new();
        for i in 0..nvml.device_count().unwrap_or(0) {
            let Ok(d) = nvml.device_by_index(i) else {
                continue;
            };
            let (Ok(uuid), Ok(util), Ok(mem)) = (d.uuid(), d.utilization_rates(), d.memory_info())
            else {
                continue;
            };
            gpus.push(GpuSample {
                uuid,
                util_pct: util.gpu,
                memory_util_pct: util.memory,
                memory_used_mib: mem.used / (1024 * 1024),
                power_w: d.power_usage().ok().map(|mw| f64::from(mw) / 1000.0),
                temperature_c: d.temperature(TemperatureSensor::Gpu).ok(),
            });
            let sm: BTreeMap<u32, u32> = d
                .process_utilization_stats(None)
                .unwrap_or_default()
                .into_iter()
                .map(|p| (p.pid, p.sm_util))
                .collect();
            for p in d.running_compute_processes().unwrap_or_default() {
                use nvml_wrapper::enums::device::UsedGpuMemory;
                procs.push(GpuProcess {
                    gpu: i,
                    pid: p.pid,
                    memory_mib: match p.used_gpu_memory {
                        UsedGpuMemory::Used(b) => b / (1024 * 1024),
                        UsedGpuMemory::Unavailable => 0,
                    },
                    sm_util: sm.get(&p.pid).copied(),
                });
            }
        }
        (gpus, procs)
    }

    /// Each GPU's device-node minor (`/dev/nvidiaN`), by index: NVML's
    /// minor number; the index itself for emulated GPUs (and where NVML
    /// does not say, with a warning).
    pub fn minors(&self) -> Vec<u32> {
        let Some(nvml) = &self.nvml else {
            return self
                .emulated
                .as_ref()
                .map(|e| e.gpus().iter().map(|g| g.index).collect())
                .unwrap_or_default();
        };
        (0..nvml.device_count().unwrap_or(0))
            .map(|i| {
                match nvml.device_by_index(i).and_then(|d| d.minor_number()) {
                    Ok(m) => m,
                    Err(e) => {
                        tracing::warn!(gpu = i, error = %e, "NVML gives no device minor: taking /dev/nvidia{i}");
                        i
                    }
                }
            })
            .collect()
    }

    /// Each MIG instance's place, by its UUID: NVML's GPU and compute
    /// instance ids. An emulated GPU's instance `k` is GPU instance `k + 1`,
    /// compute instance 0, on the minor of its GPU's index.
    pub fn mig_ids(&self) -> BTreeMap<String, crate::migcaps::MigId> {
        let mut out = BTreeMap::new();
        let Some(nvml) = &self.nvml else {
            for g in self
                .emulated
                .as_ref()
                .map(Emulated::gpus)
                .unwrap_or_default()
            {
                for (k, m) in g.mig.iter().enumerate() {
                    let id = crate::migcaps::MigId {
                        gpu_minor: g.index,
                        gi: k as u32 + 1,
                        ci: 0,
                    };
                    out.insert(m.uuid.clone(), id);
                }
            }
            return out;
        };
        let minors = self.minors();
        for i in 0..nvml.device_count().unwrap_or(0) {
            let Ok(d) = nvml.device_by_index(i) else {
                continue;
            };
            if d.mig_mode().map_or(true, |m| m.current == 0) {
                continue;
            }
            let gpu_minor = minors.get(i as usize).copied().unwrap_or(i);
            for k in 0..d.mig_device_count().unwrap_or(0) {
                let Ok(m) = d.mig_device_by_index(k) else {
                    continue;
                };
                let (Ok(uuid), Some(gi), Some(ci)) = (
                    m.uuid(),
                    instance_id(nvml, &m, true),
                    instance_id(nvml, &m, false),
                ) else {
                    continue;
                };
                out.insert(uuid, crate::migcaps::MigId { gpu_minor, gi, ci });
            }
        }
        out
    }

    pub fn is_emulated(&self) -> bool {
        self.nvml.is_none()
    }

    /// The GPUs now, with their health. A GPU NVML can no longer reach is
    /// reported as it was last seen, unhealthy (a GPU it never read is left
    /// out).
    pub fn list(&self) -> Vec<GpuInfo> {
        let Some(nvml) = &self.nvml else {
            return self
                .emulated
                .as_ref()
                .map(Emulated::gpus)
                .unwrap_or_default();
        };
        let n = nvml.device_count().unwrap_or(0);
        let devices: Vec<Option<nvml_wrapper::Device<'_>>> =
            (0..n).map(|i| nvml.device_by_index(i).ok()).collect();
        let marks = self.marks.lock().expect("not poisoned").clone();
        let ecc_base = self.ecc_base.lock().expect("not poisoned").clone();
        let mut last = self.last.lock().expect("not poisoned");
        let list: Vec<GpuInfo> = (0..n)
            .filter_map(|i| {
                let d = devices[i as usize].as_ref()?;
                let seen = last.iter().find(|g| g.index == i);
                if let Err(NvmlError::GpuLost) = d.memory_info() {
                    let mut g = seen?.clone();
                    g.unhealthy =
                        Some("NVML cannot reach it: it fell off the bus (GPU is lost)".into());
                    return Some(g);
                }
                let uuid = d.uuid().ok()?;
                let unhealthy = marks.get(&uuid).map(|(_, why)| why.clone()).or_else(|| {
                    let now = uncorrected(d).ok()?;
                    let base = ecc_base.get(&uuid).copied().unwrap_or(0);
                    (now > base).then(|| {
                        format!("{} new uncorrected ECC errors", now - base)
                    })
                });
                // Peers over NVLink: GPUs NVML says it can reach peer to peer by NVLink.
                let nvlink = (0..n)
                    .filter(|&j| j != i)
                    .filter(|&j| {
                        devices[j as usize].as_ref().is_some_and(|other| {
                            matches!(
                                d.p2p_status(other, nvml_wrapper::enum_wrappers::device::P2pCapabilitiesIndex::NvLink),
                                Ok(nvml_wrapper::enum_wrappers::device::P2pStatus::Ok)
                            )
                        })
                    })
                    .collect();
                Some(GpuInfo {
                    index: i,
                    uuid,
                    model: normalise_model(&d.name().ok()?),
                    memory_mib: d.memory_info().ok()?.total / (1024 * 1024),
                    unhealthy,
                    mig: mig_instances(d),
                    numa: d.numa_node_id().ok(),
                    nvlink,
                })
            })
            .collect();
        *last = list.clone();
        list
    }
}

/// A MIG device's GPU instance id (`gpu`) or compute instance id, through
/// NVML's C functions (the wrapper has no call for them); none where the
/// library lacks them or answers an error.
fn instance_id(nvml: &Nvml, d: &nvml_wrapper::Device<'_>, gpu: bool) -> Option<u32> {
    let lib = nvml.lib();
    let f = if gpu {
        lib.nvmlDeviceGetGpuInstanceId.as_ref().ok()?
    } else {
        lib.nvmlDeviceGetComputeInstanceId.as_ref().ok()?
    };
    let mut id: std::os::raw::c_uint = 0;
    // SAFETY: a handle NVML gave for a device that lives as long as `nvml`,
    // and a pointer to a local the call writes.
    let r = unsafe { f(d.handle(), &mut id) };
    (r == 0).then_some(id)
}

/// Uncorrected ECC errors since the driver loaded.
fn uncorrected(d: &nvml_wrapper::Device<'_>) -> Result<u64, NvmlError> {
    d.total_ecc_errors(MemoryError::Uncorrected, EccCounter::Volatile)
}

/// A GPU's MIG instances as NVML lists them (none when it is not in MIG
/// mode, or NVML cannot tell); only read, never changed.
fn mig_instances(d: &nvml_wrapper::Device<'_>) -> Vec<gpuflow_api::MigInfo> {
    if d.mig_mode().map_or(true, |m| m.current == 0) {
        return vec![];
    }
    let slots = d.mig_device_count().unwrap_or(0);
    (0..slots)
        .filter_map(|k| {
            let m = d.mig_device_by_index(k).ok()?;
            let name = m.name().ok()?;
            Some(gpuflow_api::MigInfo {
                uuid: m.uuid().ok()?,
                // "NVIDIA H100 80GB HBM3 MIG 1g.10gb" → "1g.10gb".
                profile: name.rsplit_once("MIG ")?.1.trim().to_string(),
                memory_mib: m.memory_info().ok()?.total / (1024 * 1024),
            })
        })
        .collect()
}

/// "NVIDIA H100 80GB HBM3" → "H100-80GB-HBM3": the flavor name quotas use.
pub fn normalise_model(name: &str) -> String {
    let s = name.trim().strip_prefix("NVIDIA ").unwrap_or(name.trim());
    s.split_whitespace().collect::<Vec<_>>().join("-")
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn parses_emulated_lists() {
        assert_eq!(Emulated::parse("4").unwrap().model, "emulated");
        let e = Emulated::parse("2xA10:24576").unwrap();
        assert_eq!((e.count, e.model.as_str(), e.memory_mib), (2, "A10", 24576));
        assert!(Emulated::parse("x").is_err());
        assert!(Emulated::parse("100").is_err());
    }

    #[test]
    fn emulated_gpus_take_a_declared_mig_layout() {
        let e = Emulated::parse("2xA100:40960")
            .unwrap()
            .with_mig("3g.20gb,2g.10gb,1g.5gb,1g.5gb")
            .unwrap();
        let gpus = e.gpus();
        assert_eq!(gpus[1].mig.len(), 4);
        assert_eq!(gpus[1].mig[3].uuid, "MIG-EMU-1-3");
        // Each node's emulated GPUs have UUIDs of their own.
        let on = |node: &str| {
            let mut e = Emulated::parse("2").unwrap();
            e.node = node.into();
            e.gpus().into_iter().map(|g| g.uuid).collect::<Vec<_>>()
        };
        assert_eq!(on("n1"), ["EMU-n1-0", "EMU-n1-1"]);
        assert_ne!(on("n1"), on("n2"));
        assert_eq!(gpus[0].mig[0].memory_mib, 20 * 1024);
        let err = Emulated::parse("1")
            .unwrap()
            .with_mig("4g.40gb,4g.40gb")
            .unwrap_err();
        assert!(err.contains("8 compute slices"), "{err}");
        assert!(Emulated::parse("1").unwrap().with_mig("big").is_err());
    }

    #[test]
    fn model_names_become_flavors() {
        assert_eq!(normalise_model("NVIDIA H100 80GB HBM3"), "H100-80GB-HBM3");
        assert_eq!(normalise_model("Tesla T4"), "Tesla-T4");
    }

    #[test]
    fn missing_nvml_means_no_gpus() {
        let g = Gpus::open(
            Some(std::path::Path::new("/nonexistent/libnvidia-ml.so.1")),
            None,
        );
        assert!(g.is_emulated());
        assert!(g.list().is_empty());
        assert!(g.nvml_error.is_some());
    }
}
