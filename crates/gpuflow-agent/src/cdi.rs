//! GPUs in containers the standard way: the Container Device Interface
//! specs a node has (`nvidia-ctk cdi generate` writes them to `/etc/cdi` or
//! `/var/run/cdi`), read for the `nvidia.com/gpu` kind. A task's GPUs and
//! MIG instances are found by UUID (then by index), and their edits, with
//! the spec's own, go into the container: device nodes, mounts (the
//! driver's libraries), environment and hooks. Without a spec for a GPU
//! the container gets its device nodes alone.

use std::path::{Path, PathBuf};

use serde::{Deserialize, Serialize};

/// The kind whose devices are GPUs.
pub const GPU_KIND: &str = "nvidia.com/gpu";

#[derive(Clone, Debug, Default, Deserialize)]
#[serde(rename_all = "camelCase")]
struct SpecFile {
    #[serde(default)]
    cdi_version: String,
    kind: String,
    #[serde(default)]
    devices: Vec<Device>,
    #[serde(default)]
    container_edits: Edits,
}

#[derive(Clone, Debug, Default, Deserialize)]
#[serde(rename_all = "camelCase")]
struct Device {
    name: String,
    #[serde(default)]
    container_edits: Edits,
}

/// What a device (or a spec, for all its devices) adds to a container.
#[derive(Clone, Debug, Default, PartialEq, Serialize, Deserialize)]
#[serde(rename_all = "camelCase")]
pub struct Edits {
    #[serde(default)]
    pub env: Vec<String>,
    #[serde(default)]
    pub device_nodes: Vec<DeviceNode>,
    #[serde(default)]
    pub mounts: Vec<Mount>,
    #[serde(default)]
    pub hooks: Vec<Hook>,
}

#[derive(Clone, Debug, Default, PartialEq, Serialize, Deserialize)]
#[serde(rename_all = "camelCase")]
pub struct DeviceNode {
    pub path: String,
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub host_path: Option<String>,
}

#[derive(Clone, Debug, Default, PartialEq, Serialize, Deserialize)]
#[serde(rename_all = "camelCase")]
pub struct Mount {
    pub host_path: String,
    pub container_path: String,
    #[serde(default)]
    pub options: Vec<String>,
}

#[derive(Clone, Debug, Default, PartialEq, Serialize, Deserialize)]
#[serde(rename_all = "camelCase")]
pub struct Hook {
    pub hook_name: String,
    pub path: String,
    #[serde(default)]
    pub args: Vec<String>,
    #[serde(default)]
    pub env: Vec<String>,
}

impl Edits {
    fn add(&mut self, o: &Edits) {
        self.env.extend(o.env.iter().cloned());
        self.device_nodes.extend(o.device_nodes.iter().cloned());
        self.mounts.extend(o.mounts.iter().cloned());
        self.hooks.extend(o.hooks.iter().cloned());
    }
}

/// The specs' files in `dirs`, by name (a later directory's file of the
/// same name wins, as CDI's own resolution does).
fn spec_files(dirs: &[PathBuf]) -> Vec<PathBuf> {
    let mut by_name: std::collections::BTreeMap<std::ffi::OsString, PathBuf> = Default::default();
    for d in dirs {
        let Ok(rd) = std::fs::read_dir(d) else {
            continue;
        };
        for e in rd.filter_map(Result::ok) {
            let p = e.path();
            if p.extension()
                .is_some_and(|x| x == "json" || x == "yaml" || x == "yml")
            {
                by_name.insert(e.file_name(), p);
            }
        }
    }
    by_name.into_values().collect()
}

/// The edits that give a container the GPUs named (each by UUID, else by
/// index): `None` when some has no device in the node's specs (the caller
/// binds device nodes itself). A spec that does not parse is skipped with
/// a warning.
pub fn edits_for(dirs: &[PathBuf], names: &[(String, String)]) -> Option<Edits> {
    if names.is_empty() {
        return None;
    }
    let mut out = Edits::default();
    let mut found = vec![false; names.len()];
    for path in spec_files(dirs) {
        let Ok(text) = std::fs::read_to_string(&path) else {
            continue;
        };
        let spec: SpecFile = match serde_norway::from_str(&text) {
            Ok(s) => s,
            Err(e) => {
                tracing::warn!(file = %path.display(), error = %e, "a CDI spec that does not parse is skipped");
                continue;
            }
        };
        if spec.kind != GPU_KIND || spec.cdi_version.is_empty() {
            continue;
        }
        let mut used = false;
        for (i, (uuid, index)) in names.iter().enumerate() {
            if found[i] {
                continue;
            }
            let d = spec
                .devices
                .iter()
                .find(|d| &d.name == uuid)
                .or_else(|| spec.devices.iter().find(|d| &d.name == index));
            if let Some(d) = d {
                out.add(&d.container_edits);
                found[i] = true;
                used = true;
            }
        }
        if used {
            out.add(&spec.container_edits);
        }
    }
    found.iter().all(|&f| f).then_some(out)
}

/// Where a container without a CDI spec for its GPUs finds the node's
/// driver: its libraries and tools, bound in read-only.
pub const DRIVER_LIB: &str = "/usr/local/nvidia/lib64";
pub const DRIVER_BIN: &str = "/usr/local/nvidia/bin";

/// The user-space libraries of compute work the driver installs.
const DRIVER_LIBS: [&str; 6] = [
    "libcuda.so",
    "libnvidia-ml.so",
    "libnvidia-ptxjitcompiler.so",
    "libnvidia-nvvm.so",
    "libcudadebugger.so",
    "libnvidia-gpucomp.so",
];

/// The node's driver, as `(host path, path in a container)`: the NVML
/// library the agent loads (`nvml_lib`, else the system's) and the other
/// compute libraries the dynamic linker's cache lists, into
/// [`DRIVER_LIB`] by their names; `nvidia-smi` into [`DRIVER_BIN`].
pub fn driver_files(nvml_lib: Option<&Path>) -> Vec<(PathBuf, String)> {
    let mut out: Vec<(PathBuf, String)> = Vec::new();
    let cache = std::process::Command::new("ldconfig")
        .arg("-p")
        .output()
        .map(|o| String::from_utf8_lossy(&o.stdout).into_owned())
        .unwrap_or_default();
    for line in cache.lines() {
        let Some((name, path)) = line.trim().split_once(" => ") else {
            continue;
        };
        let soname = name.split_whitespace().next().unwrap_or("");
        // This machine's own libraries (not a 32-bit copy).
        if (line.contains("x86-64") || !cfg!(target_arch = "x86_64"))
            && DRIVER_LIBS.iter().any(|l| soname.starts_with(l))
            && !out.iter().any(|(_, c)| c.ends_with(&format!("/{soname}")))
        {
            out.push((PathBuf::from(path), format!("{DRIVER_LIB}/{soname}")));
        }
    }
    if let Some(lib) = nvml_lib {
        out.retain(|(_, c)| !c.contains("/libnvidia-ml.so"));
        out.push((lib.to_path_buf(), format!("{DRIVER_LIB}/libnvidia-ml.so.1")));
    }
    if let Some(smi) = crate::oci::which("nvidia-smi") {
        out.push((smi, format!("{DRIVER_BIN}/nvidia-smi")));
    }
    out
}

/// A device node's host side: its path on the host.
pub fn host_path(n: &DeviceNode) -> &Path {
    Path::new(n.host_path.as_deref().unwrap_or(&n.path))
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn a_gpu_is_found_by_uuid_or_index_with_the_specs_own_edits() {
        let dir = tempfile::tempdir().unwrap();
        std::fs::write(
            dir.path().join("nvidia.yaml"),
            "cdiVersion: 0.5.0\nkind: nvidia.com/gpu\ncontainerEdits:\n  env: [NVIDIA_CTK=1]\ndevices:\n  - name: GPU-aaa\n    containerEdits:\n      deviceNodes: [{path: /dev/nvidia0}]\n  - name: '1'\n    containerEdits:\n      deviceNodes: [{path: /dev/nvidia1}]\n",
        )
        .unwrap();
        std::fs::write(dir.path().join("broken.json"), "{not json").unwrap();
        let dirs = [dir.path().to_path_buf()];
        let e = edits_for(
            &dirs,
            &[
                ("GPU-aaa".into(), "0".into()),
                ("GPU-bbb".into(), "1".into()),
            ],
        )
        .unwrap();
        let nodes: Vec<&str> = e.device_nodes.iter().map(|n| n.path.as_str()).collect();
        assert_eq!(nodes, ["/dev/nvidia0", "/dev/nvidia1"]);
        assert_eq!(e.env, ["NVIDIA_CTK=1"]);
        // A GPU the specs do not know: none of it (the caller falls back).
        assert!(edits_for(&dirs, &[("GPU-ccc".into(), "7".into())]).is_none());
    }
}
