//! Loader for the Alibaba GPU cluster trace v2023 ("openb"), as published in
//! alibaba/clusterdata, `cluster-trace-gpu-v2023/csv/`.
//!
//! Node lists: `sn,cpu_milli,memory_mib,gpu,model`. Pod lists:
//! `name,cpu_milli,memory_mib,num_gpu,gpu_milli[,gpu_spec,...]`, where
//! `gpu_milli` is the share of each of `num_gpu` GPUs and `gpu_spec` lists the
//! accepted GPU models separated by `|` (empty: any).

use std::path::{Path, PathBuf};

use gpuflow_core::{CpuMilli, Gpu, GpuMilli, GpuRequest, MemMib, Node, TaskRequest};
use serde::Deserialize;

use crate::error::SimError;

/// The node list of the paper's experiment.
pub const GPU_NODE_LIST: &str = "openb_node_list_gpu_node.csv";

/// The 23 pod lists published with the trace (and present in this copy).
pub const POD_LISTS: &[&str] = &[
    "default",
    "cpu037",
    "cpu050",
    "cpu072",
    "cpu100",
    "cpu200",
    "cpu235",
    "cpu250",
    "cpu300",
    "gpushare20",
    "gpushare40",
    "gpushare60",
    "gpushare80",
    "gpushare100",
    "gpuspec05",
    "gpuspec10",
    "gpuspec20",
    "gpuspec25",
    "gpuspec33",
    "multigpu20",
    "multigpu30",
    "multigpu40",
    "multigpu50",
];

/// The file name of a pod list, from its short name (`default`) or its file name.
///
/// # Errors
/// When the name is not one of [`POD_LISTS`].
pub fn pod_list_file(name: &str) -> Result<String, SimError> {
    let short = name
        .trim_start_matches("openb_pod_list_")
        .trim_end_matches(".csv");
    if POD_LISTS.contains(&short) {
        Ok(format!("openb_pod_list_{short}.csv"))
    } else {
        Err(SimError::UnknownTrace {
            name: name.to_string(),
            known: POD_LISTS.join(", "),
        })
    }
}

#[derive(Deserialize)]
struct NodeRow {
    sn: String,
    cpu_milli: u64,
    memory_mib: u64,
    gpu: u32,
    model: Option<String>,
}

#[derive(Deserialize)]
struct PodRow {
    name: String,
    cpu_milli: u64,
    memory_mib: u64,
    num_gpu: u32,
    gpu_milli: u32,
    #[serde(default)]
    gpu_spec: Option<String>,
}

/// A pod of the trace as a gpuflow task.
#[derive(Clone, Debug, PartialEq)]
pub struct Pod {
    pub name: String,
    pub request: TaskRequest,
}

impl Pod {
    /// GPU request in milli-GPU (a fractional pod counts its share).
    pub fn gpu_milli(&self) -> u64 {
        self.request.gpu.milli()
    }
}

fn reader(path: &Path) -> Result<csv::Reader<std::fs::File>, SimError> {
    let file = std::fs::File::open(path).map_err(|e| SimError::Read {
        path: path.to_path_buf(),
        source: e,
    })?;
    Ok(csv::ReaderBuilder::new().flexible(true).from_reader(file))
}

fn parse_err(path: &Path, e: &csv::Error) -> SimError {
    let line = e.position().map(|p| p.line()).unwrap_or(0);
    SimError::Parse {
        path: path.to_path_buf(),
        line,
        message: e.to_string(),
    }
}

/// Reads a node list. GPU memory is not in the trace and is set from the model.
///
/// # Errors
/// When the file cannot be read or a row is malformed.
pub fn load_nodes(path: &Path) -> Result<Vec<Node>, SimError> {
    let mut nodes = Vec::new();
    for (i, row) in reader(path)?.deserialize::<NodeRow>().enumerate() {
        let row = row.map_err(|e| parse_err(path, &e))?;
        let model = row.model.unwrap_or_default();
        if row.gpu > 0 && model.is_empty() {
            return Err(SimError::Parse {
                path: path.to_path_buf(),
                line: i as u64 + 2,
                message: format!("node {} has {} GPUs but no model", row.sn, row.gpu),
            });
        }
        let gpus = (0..row.gpu)
            .map(|_| Gpu::plain(&model, gpu_memory(&model)))
            .collect();
        nodes.push(Node::new(
            i as u32,
            &row.sn,
            CpuMilli(row.cpu_milli),
            MemMib(row.memory_mib),
            gpus,
        ));
    }
    Ok(nodes)
}

/// Typical memory of the trace's GPU models, in MiB.
fn gpu_memory(model: &str) -> MemMib {
    MemMib(match model {
        "V100M32" => 32_768,
        "A10" | "G2" | "G3" => 24_576,
        "T4" | "P100" | "V100M16" => 16_384,
        _ => 16_384,
    })
}

/// Reads a pod list.
///
/// # Errors
/// When the file cannot be read, a row is malformed, or a pod asks for a
/// fractional share of more than one GPU or a share above 1000.
pub fn load_pods(path: &Path) -> Result<Vec<Pod>, SimError> {
    let mut pods = Vec::new();
    for (i, row) in reader(path)?.deserialize::<PodRow>().enumerate() {
        let row = row.map_err(|e| parse_err(path, &e))?;
        let bad = |message: String| SimError::Parse {
            path: path.to_path_buf(),
            line: i as u64 + 2,
            message,
        };
        let gpu = match (row.num_gpu, row.gpu_milli) {
            (0, _) => GpuRequest::None,
            (_, m) if m > 1000 => {
                return Err(bad(format!(
                    "pod {} asks for {m} milli-GPU per GPU (at most 1000)",
                    row.name
                )));
            }
            (1, m) if m < 1000 => GpuRequest::Fraction {
                milli: GpuMilli(m),
                mem: MemMib(0),
            },
            (n, 1000) if n <= 64 => GpuRequest::Whole { count: n as u8 },
            (n, m) => {
                return Err(bad(format!(
                    "pod {} asks for {n} GPUs at {m} milli each: only one GPU may be shared",
                    row.name
                )));
            }
        };
        let models = match row.gpu_spec.as_deref().map(str::trim) {
            Some(s) if !s.is_empty() => {
                let mut v: Vec<String> = s.split('|').map(str::to_string).collect();
                v.sort();
                v.dedup();
                v
            }
            _ => Vec::new(),
        };
        let request = TaskRequest {
            cpu: CpuMilli(row.cpu_milli),
            mem: MemMib(row.memory_mib),
            gpu,
            models,
        };
        pods.push(Pod {
            name: row.name,
            request,
        });
    }
    Ok(pods)
}

/// The data folder's node list and a pod list.
///
/// # Errors
/// As [`load_nodes`] and [`load_pods`].
pub fn load(dir: &Path, pod_list: &str) -> Result<(Vec<Node>, Vec<Pod>), SimError> {
    let nodes = load_nodes(&dir.join(GPU_NODE_LIST))?;
    let pods = load_pods(&dir.join(pod_list_file(pod_list)?))?;
    Ok((nodes, pods))
}

/// Where the trace is looked for when no path is given: `../shared/data/openb`
/// beside the checkout, as CI lays it out.
pub fn default_dir() -> PathBuf {
    let here = Path::new(env!("CARGO_MANIFEST_DIR"));
    here.join("../../../shared/data/openb")
}
