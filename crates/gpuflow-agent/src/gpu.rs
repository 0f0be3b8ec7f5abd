//! GPU discovery: NVML through `nvml-wrapper` where the library loads, and
//! emulated GPUs from the configuration where it does not. A library that
//! does not load means "no GPUs here", never a crash.

use gpuflow_api::GpuInfo;
use nvml_wrapper::Nvml;

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

    pub fn gpus(&self) -> Vec<GpuInfo> {
        (0..self.count)
            .map(|i| GpuInfo {
                index: i,
                uuid: format!("EMU-{i}"),
                model: self.model.clone(),
                memory_mib: self.memory_mib,
                utilization: None,
                mig: self
                    .mig
                    .iter()
                    .enumerate()
                    .map(|(k, p)| gpuflow_api::MigInfo {
                        uuid: format!("MIG-EMU-{i}-{k}"),
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
    nvml: Option<Nvml>,
    emulated: Option<Emulated>,
    /// Why NVML is not used, for the log.
    pub nvml_error: Option<String>,
}

impl Gpus {
    /// Tries NVML (from `lib`, or the system's `libnvidia-ml.so.1`), unless
    /// emulation is asked for.
    pub fn open(lib: Option<&std::path::Path>, emulated: Option<Emulated>) -> Gpus {
        if emulated.is_some() {
            return Gpus {
                nvml: None,
                emulated,
                nvml_error: Some("emulated GPUs were asked for".into()),
            };
        }
        let init = match lib {
            Some(p) => Nvml::builder().lib_path(p.as_os_str()).init(),
            None => Nvml::init(),
        };
        match init {
            Ok(nvml) => Gpus {
                nvml: Some(nvml),
                emulated: None,
                nvml_error: None,
            },
            Err(e) => Gpus {
                nvml: None,
                emulated: None,
                nvml_error: Some(e.to_string()),
            },
        }
    }

    pub fn is_emulated(&self) -> bool {
        self.nvml.is_none()
    }

    /// The GPUs now, with utilisation where NVML gives it. A GPU NVML cannot
    /// read is left out (it is reported as gone, not as healthy).
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
        (0..n)
            .filter_map(|i| {
                let d = devices[i as usize].as_ref()?;
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
                    uuid: d.uuid().ok()?,
                    model: normalise_model(&d.name().ok()?),
                    memory_mib: d.memory_info().ok()?.total / (1024 * 1024),
                    utilization: d.utilization_rates().ok().map(|u| u.gpu),
                    mig: mig_instances(d),
                    numa: d.numa_node_id().ok(),
                    nvlink,
                })
            })
            .collect()
    }
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
