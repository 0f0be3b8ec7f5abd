//! What work asks for: tasks with CPU, memory and a GPU request in one sharing
//! mode, grouped into jobs that are placed as gangs.

use std::collections::BTreeMap;
use std::fmt;

use crate::ids::{CpuMilli, GpuMilli, JobId, MemMib};

/// How a task wants GPUs. The mode decides which GPUs it may share with whom.
#[derive(Clone, Debug, PartialEq, Eq, PartialOrd, Ord, Hash, Default)]
pub enum GpuRequest {
    /// No GPU.
    #[default]
    None,
    /// `count` whole GPUs on one node, each carrying nothing else.
    Whole { count: u8 },
    /// One MIG instance of this profile.
    Mig { profile: String },
    /// A share of one GPU's compute plus a GPU-memory limit (`mem` 0: no memory claim).
    Fraction { milli: GpuMilli, mem: MemMib },
    /// One slot on a time-sliced GPU; `mem` is the GPU memory it claims (0: none).
    TimeSlice { mem: MemMib },
}

/// What one time slice counts in quota and fair share: a GPU's default
/// number of slices ([`crate::model::Gpu`]'s `time_slices`, 4) share it.
pub const TIME_SLICE_QUOTA_MILLI: u64 = 250;

/// Compute slices of a whole MIG-capable GPU (A100, H100, H200): a MIG
/// `Ng.*` instance counts N sevenths of a GPU in quota and fair share.
pub const MIG_SLICES_PER_GPU: u64 = 7;

impl GpuRequest {
    /// GPU compute asked for, in milli-GPU (a MIG instance or a time slice counts 0:
    /// neither takes capacity from whole-GPU accounting in milli).
    pub fn milli(&self) -> u64 {
        match self {
            GpuRequest::Whole { count } => *count as u64 * 1000,
            GpuRequest::Fraction { milli, .. } => milli.0 as u64,
            _ => 0,
        }
    }

    /// What the request counts in quota and fair share, in milli-GPU: its
    /// [`milli`](GpuRequest::milli), except that a MIG instance counts its
    /// compute slices (`3g.40gb`: 3/7 of a GPU, rounded up) and a time slice
    /// [`TIME_SLICE_QUOTA_MILLI`], so that neither is free.
    pub fn quota_milli(&self) -> u64 {
        match self {
            GpuRequest::Mig { profile } => {
                let slices = profile
                    .split_once('g')
                    .and_then(|(n, _)| n.parse::<u64>().ok())
                    .unwrap_or(MIG_SLICES_PER_GPU)
                    .clamp(1, MIG_SLICES_PER_GPU);
                (slices * 1000).div_ceil(MIG_SLICES_PER_GPU)
            }
            GpuRequest::TimeSlice { .. } => TIME_SLICE_QUOTA_MILLI,
            r => r.milli(),
        }
    }
}

impl fmt::Display for GpuRequest {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        match self {
            GpuRequest::None => write!(f, "no GPU"),
            GpuRequest::Whole { count } => {
                write!(f, "{count} whole GPU{}", if *count == 1 { "" } else { "s" })
            }
            GpuRequest::Mig { profile } => write!(f, "a MIG {profile} instance"),
            GpuRequest::Fraction { milli, mem } if mem.0 > 0 => {
                write!(f, "{} milli-GPU with {} MiB of GPU memory", milli.0, mem.0)
            }
            GpuRequest::Fraction { milli, .. } => write!(f, "{} milli-GPU", milli.0),
            GpuRequest::TimeSlice { .. } => write!(f, "a time slice of a GPU"),
        }
    }
}

/// The resources of one task.
#[derive(Clone, Debug, PartialEq, Eq, PartialOrd, Ord, Hash, Default)]
pub struct TaskRequest {
    pub cpu: CpuMilli,
    pub mem: MemMib,
    pub gpu: GpuRequest,
    /// GPU models the task accepts; empty accepts any.
    pub models: Vec<String>,
}

/// A set of identical tasks inside a job, e.g. 4 workers or 1 launcher.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct TaskGroup {
    pub name: String,
    pub replicas: u32,
    pub request: TaskRequest,
}

/// How close together a gang's tasks must sit.
#[derive(Clone, Copy, Debug, PartialEq, Eq, PartialOrd, Ord, Hash)]
pub enum TopologyLevel {
    /// All tasks on one node.
    Node,
    /// All GPUs in one NVLink domain.
    NvLink,
    Rack,
    Block,
}

impl TopologyLevel {
    pub fn as_str(self) -> &'static str {
        match self {
            TopologyLevel::Node => "node",
            TopologyLevel::NvLink => "nvlink domain",
            TopologyLevel::Rack => "rack",
            TopologyLevel::Block => "block",
        }
    }
}

/// A topology constraint: `required` fails the gang when no domain fits it;
/// otherwise the gang falls back to any placement.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash)]
pub struct Topology {
    pub level: TopologyLevel,
    pub required: bool,
}

/// Where a job may run, beyond its tasks' resources.
#[derive(Clone, Debug, PartialEq, Eq, Hash, Default)]
pub struct Constraints {
    /// The pool the job must run in; `None` for any pool.
    pub pool: Option<String>,
    /// Labels a node must carry, with these values.
    pub node_selector: BTreeMap<String, String>,
    /// Taint keys the job tolerates.
    pub tolerations: Vec<String>,
    pub topology: Option<Topology>,
    /// Spread replicas over nodes and racks (inference services) rather than packing them.
    pub spread: bool,
    /// The reservation slots to keep off, a bit each (bit `k`: slot `k`, 1
    /// to 63; set by the scheduler for the reservations that start before
    /// the job would end; `u64::MAX`: every reserved node).
    pub avoid_reservations: u64,
}

/// A job: a gang of task groups placed all together or not at all.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct Job {
    pub id: JobId,
    pub groups: Vec<TaskGroup>,
    pub constraints: Constraints,
}

impl Job {
    /// A job of one task with no constraints.
    pub fn single(id: u64, request: TaskRequest) -> Job {
        Job {
            id: JobId(id),
            groups: vec![TaskGroup {
                name: "main".to_string(),
                replicas: 1,
                request,
            }],
            constraints: Constraints::default(),
        }
    }

    pub fn task_count(&self) -> u64 {
        self.groups.iter().map(|g| g.replicas as u64).sum()
    }
}

#[cfg(test)]
mod quota_tests {
    use super::*;

    #[test]
    fn mig_instances_and_time_slices_count_in_quota() {
        let mig = |p: &str| GpuRequest::Mig { profile: p.into() }.quota_milli();
        assert_eq!(mig("1g.10gb"), 143);
        assert_eq!(mig("3g.40gb"), 429);
        assert_eq!(mig("7g.80gb"), 1000);
        // A profile that names no slice count counts a whole GPU, never 0.
        assert_eq!(mig("odd"), 1000);
        assert_eq!(GpuRequest::TimeSlice { mem: MemMib(0) }.quota_milli(), 250);
        assert_eq!(GpuRequest::Whole { count: 2 }.quota_milli(), 2000);
        // Placement accounting is unchanged: neither takes whole-GPU milli.
        assert_eq!(
            GpuRequest::Mig {
                profile: "1g.10gb".into()
            }
            .milli(),
            0
        );
    }
}
