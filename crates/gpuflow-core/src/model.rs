//! The static side of the cluster: nodes, their GPUs and MIG instances, labels,
//! taints and topology. What is *used* lives in [`crate::cluster`]; this module
//! knows nothing of jobs.

use std::collections::BTreeMap;

use crate::ids::{CpuMilli, MemMib, NodeId};

/// Whether a node takes new work.
#[derive(Clone, Copy, Debug, PartialEq, Eq, PartialOrd, Ord, Hash, Default)]
pub enum NodeState {
    /// Takes new work.
    #[default]
    Ready,
    /// Keeps its work, takes no new work (an admin's choice).
    Cordoned,
    /// Keeps its work until it ends, takes no new work, is then taken out.
    Draining,
    /// Its agent stopped reporting; its work is being requeued.
    Lost,
}

impl NodeState {
    pub fn as_str(self) -> &'static str {
        match self {
            NodeState::Ready => "ready",
            NodeState::Cordoned => "cordoned",
            NodeState::Draining => "draining",
            NodeState::Lost => "lost",
        }
    }
}

/// A GPU's health as last reported (XID errors, uncorrectable ECC).
#[derive(Clone, Copy, Debug, PartialEq, Eq, PartialOrd, Ord, Hash, Default)]
pub enum GpuHealth {
    #[default]
    Healthy,
    Unhealthy,
}

/// One MIG instance carved out of a GPU in MIG mode; it is allocated whole.
#[derive(Clone, Debug, PartialEq, Eq, PartialOrd, Ord, Hash)]
pub struct MigInstance {
    /// The MIG profile, e.g. `1g.10gb` or `3g.40gb`.
    pub profile: String,
    pub mem: MemMib,
}

/// One physical GPU.
#[derive(Clone, Debug, PartialEq, Eq, PartialOrd, Ord, Hash)]
pub struct Gpu {
    /// The model (the quota flavour), e.g. `H100`, `A10`.
    pub model: String,
    pub mem: MemMib,
    pub numa: u8,
    /// The NVLink island this GPU belongs to, named cluster-wide (an intra-node
    /// island such as `node-7/nvl0`, or a rack-scale NVLink domain). `None`: PCIe only.
    pub nvlink: Option<String>,
    pub health: GpuHealth,
    /// MIG instances when the GPU is in MIG mode; empty when it is not.
    pub mig: Vec<MigInstance>,
    /// How many time-sliced tasks may share this GPU at most.
    pub time_slices: u16,
}

impl Gpu {
    /// A healthy GPU without MIG, NVLink or NUMA detail: the common case in traces and tests.
    pub fn plain(model: &str, mem: MemMib) -> Gpu {
        Gpu {
            model: model.to_string(),
            mem,
            numa: 0,
            nvlink: None,
            health: GpuHealth::Healthy,
            mig: Vec::new(),
            time_slices: 4,
        }
    }

    pub fn mig_enabled(&self) -> bool {
        !self.mig.is_empty()
    }
}

/// A taint keeps work off a node unless the work tolerates the taint's key.
#[derive(Clone, Debug, PartialEq, Eq, PartialOrd, Ord, Hash)]
pub struct Taint {
    pub key: String,
    pub value: String,
}

/// A node of the cluster and everything about it that does not change as work comes and goes.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct Node {
    pub id: NodeId,
    pub name: String,
    pub pool: String,
    pub labels: BTreeMap<String, String>,
    pub taints: Vec<Taint>,
    pub state: NodeState,
    pub rack: Option<String>,
    pub block: Option<String>,
    pub cpu: CpuMilli,
    pub mem: MemMib,
    pub gpus: Vec<Gpu>,
}

impl Node {
    /// A ready node in pool `default` with no labels, taints or topology.
    pub fn new(id: u32, name: &str, cpu: CpuMilli, mem: MemMib, gpus: Vec<Gpu>) -> Node {
        Node {
            id: NodeId(id),
            name: name.to_string(),
            pool: "default".to_string(),
            labels: BTreeMap::new(),
            taints: Vec::new(),
            state: NodeState::Ready,
            rack: None,
            block: None,
            cpu,
            mem,
            gpus,
        }
    }
}
