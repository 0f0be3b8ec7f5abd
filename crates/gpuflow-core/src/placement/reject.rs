//! Why a node cannot take a task: one variant per filter rule, each with the
//! rule's stable name (used in explanations and metrics) and a phrase for people.

use crate::model::NodeState;

/// A filter's "no", with the rule that said it.
#[derive(Clone, Copy, Debug, PartialEq, Eq, PartialOrd, Ord, Hash)]
pub enum Reject {
    NodeState(NodeState),
    Pool,
    NodeSelector,
    Taint,
    GpuModel,
    GpuHealth,
    Cpu,
    Memory,
    GpuCapacity,
    /// Outside the topology domain being tried.
    Topology,
    /// Held for a reservation the task would not end before.
    Reserved,
}

impl Reject {
    /// The rule's stable name.
    pub fn rule(self) -> &'static str {
        match self {
            Reject::NodeState(_) => "node-state",
            Reject::Pool => "pool",
            Reject::NodeSelector => "node-selector",
            Reject::Taint => "taints",
            Reject::GpuModel => "gpu-model",
            Reject::GpuHealth => "gpu-health",
            Reject::Cpu => "cpu",
            Reject::Memory => "memory",
            Reject::GpuCapacity => "gpu-capacity",
            Reject::Topology => "topology",
            Reject::Reserved => "reservation",
        }
    }

    /// Whether the rule turns a node away for what the node is (its pool,
    /// labels, taints, GPU models), not for what it holds or its state: no
    /// ending job makes it pass.
    pub fn is_static(self) -> bool {
        matches!(
            self,
            Reject::Pool | Reject::NodeSelector | Reject::Taint | Reject::GpuModel
        )
    }

    /// What the rejected nodes are or lack, as the end of "N nodes …".
    pub fn phrase(self) -> &'static str {
        match self {
            Reject::NodeState(s) => match s {
                NodeState::Cordoned => "are cordoned",
                NodeState::Draining => "are draining",
                NodeState::Lost => "are lost",
                NodeState::Ready => "are ready",
            },
            Reject::Pool => "are in another pool",
            Reject::NodeSelector => "lack the selected labels",
            Reject::Taint => "have taints the job does not tolerate",
            Reject::GpuModel => "have no GPU of an accepted model",
            Reject::GpuHealth => "have too few healthy GPUs",
            Reject::Cpu => "have too little free CPU",
            Reject::Memory => "have too little free memory",
            Reject::GpuCapacity => "have too few free GPUs in the requested sharing mode",
            Reject::Topology => "are outside the topology domain tried",
            Reject::Reserved => "are held for a reservation the job would not end before",
        }
    }
}
