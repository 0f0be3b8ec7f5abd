//! The cluster as the core sees it: Kubernetes nodes, pods, `GpuQueue`s and
//! disruption budgets turned into the core's nodes, queues, running and
//! pending jobs. Pure: the scheduler loop reads the objects from its watch
//! caches and calls [`build`].
//!
//! - **Nodes** (in name order; the core's node id is the index): allocatable
//!   CPU and memory; `nvidia.com/gpu` whole GPUs of the model and memory the
//!   GPU feature discovery labels say (`nvidia.com/gpu.product`,
//!   `nvidia.com/gpu.memory` in MiB); each MIG resource
//!   (`nvidia.com/mig-1g.10gb: 7`) one GPU in MIG mode holding that many
//!   instances; on a node whose GPUs HAMi shares, the GPUs its device
//!   plugin registers ([`hami`]); topology and NVLink domain from configurable labels;
//!   `NoSchedule`/`NoExecute` taints; cordoned when unschedulable, lost when
//!   not `Ready`.
//! - **Pods** bound by anyone and not finished count as usage. Ours (those
//!   whose `schedulerName` is gpuflow's) are grouped into gangs ([`gang_key`])
//!   and become running or pending jobs; others only hold resources.
//! - **Refusals**: a pod gpuflow cannot schedule as asked (a resource it does
//!   not support, an image its queue does not allow, a namespace no queue
//!   takes) is not given to the core; it gets the reason.

use std::collections::{BTreeMap, BTreeSet};

use gpuflow_core::cluster::{Allocation, Cluster, GpuPick};
use gpuflow_core::ids::{CpuMilli, JobId, MemMib, NodeId, TaskId};
use gpuflow_core::model::{Gpu, GpuHealth, MigInstance, Node, NodeState, Taint};
use gpuflow_core::placement::Placer;
use gpuflow_core::policy::Policy;
use gpuflow_core::queue::{
    Budget, BudgetExhausted, FlavorQuota, Queue, QueueId, QueueState, Queues, UserLimits,
};
use gpuflow_core::request::{
    Constraints, GpuRequest, Job, TaskGroup, TaskRequest, Topology, TopologyLevel,
};
use gpuflow_core::schedule::{PriorityClass, Running, Workload};
use k8s_openapi::api::batch::v1::Job as BatchJob;
use k8s_openapi::api::core::v1::{Container, Node as KNode, Pod};
use k8s_openapi::api::policy::v1::PodDisruptionBudget;
use k8s_openapi::apimachinery::pkg::apis::meta::v1::LabelSelector;

use crate::crd::{self, GpuQueue};
use crate::{hami, quantity};

/// Whole GPUs, as NVIDIA's device plugin names them.
pub const GPU: &str = "nvidia.com/gpu";
/// MIG instances: `nvidia.com/mig-<profile>` (the device plugin's mixed strategy).
pub const MIG_PREFIX: &str = "nvidia.com/mig-";
/// Time slices of a GPU: the device plugin's time-slicing with
/// `renameByDefault`, each GPU advertised as `nvidia.com/gpu.replicas`
/// replicas of this resource.
pub const SHARED: &str = "nvidia.com/gpu.shared";
pub const REPLICAS_LABEL: &str = "nvidia.com/gpu.replicas";
/// How the core keeps whole-GPU and MIG pods off time-sliced nodes and
/// time-slice pods on them: a taint and a label of its own, on its copy of
/// such a node (never written to the cluster).
const SLICED: &str = "gpuflow.io/time-sliced";
/// How the core keeps shares with memory limits on nodes whose GPUs HAMi
/// shares: a label of its own on its copy of such a node.
const HAMI: &str = "gpuflow.io/hami";
/// GPU feature discovery's labels.
pub const PRODUCT_LABEL: &str = "nvidia.com/gpu.product";
pub const MEMORY_LABEL: &str = "nvidia.com/gpu.memory";
/// The annotation holding the node a gang's pod was planned on, written
/// before any of the gang is bound, so that a scheduler that stops half-way
/// is finished by the next.
pub const PLANNED: &str = "gpuflow.io/node";
/// Pod labels naming a queue.
pub const QUEUE_LABELS: [&str; 2] = ["gpuflow.io/queue", "kueue.x-k8s.io/queue-name"];

/// Where topology comes from: the node labels holding a node's rack, block
/// and NVLink domain.
#[derive(Clone, Debug)]
pub struct TopologyLabels {
    pub rack: String,
    pub block: String,
    pub nvlink: String,
}

impl Default for TopologyLabels {
    fn default() -> Self {
        TopologyLabels {
            rack: "gpuflow.io/rack".into(),
            block: "gpuflow.io/block".into(),
            nvlink: "nvidia.com/gpu.clique".into(),
        }
    }
}

/// A pod, by name and uid.
#[derive(Clone, Debug, PartialEq, Eq, PartialOrd, Ord)]
pub struct PodRef {
    pub namespace: String,
    pub name: String,
    pub uid: String,
}

impl std::fmt::Display for PodRef {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        write!(f, "{}/{}", self.namespace, self.name)
    }
}

/// A job's pods: `pods[group][index]` is the pod of task (group, index).
#[derive(Clone, Debug)]
pub struct Gang {
    pub key: String,
    pub queue: String,
    pub pods: Vec<Vec<PodRef>>,
    /// Seconds a victim has to stop after its signal.
    pub grace: u64,
    /// The disruption budgets covering its pods.
    pub budgets: Vec<String>,
}

impl Gang {
    pub fn all(&self) -> impl Iterator<Item = &PodRef> {
        self.pods.iter().flatten()
    }
}

/// Everything a cycle needs, and how to map its plan back to pods.
pub struct Snapshot {
    pub placer: Placer,
    pub queues: Queues,
    pub running: Vec<Running>,
    pub pending: Vec<Workload>,
    pub classes: Vec<PriorityClass>,
    pub gangs: BTreeMap<JobId, Gang>,
    pub node_names: Vec<String>,
    /// Pods not given to the core, with the reason they wait.
    pub held: Vec<(PodRef, String)>,
    /// Pods planned on a node by an earlier cycle and not bound yet.
    pub planned: Vec<(PodRef, String)>,
    /// Disruptions each budget allows now.
    pub budgets: BTreeMap<String, i32>,
    /// The GPUs (UUID and memory in MiB, by the core's GPU index) of each
    /// node whose GPUs HAMi shares: pods bound there carry HAMi's
    /// annotations ([`hami_decision`]).
    pub hami: BTreeMap<String, Vec<(String, u64)>>,
}

/// What [`build`] reads.
pub struct Inputs<'a> {
    pub nodes: &'a [&'a KNode],
    pub pods: &'a [&'a Pod],
    pub queues: &'a [&'a GpuQueue],
    pub budgets: &'a [&'a PodDisruptionBudget],
    /// batch/v1 Jobs: a Job's pods wait for its parallelism.
    pub jobs: &'a [&'a BatchJob],
    /// GPU-hours used per budgeted queue in its current period: (period
    /// start, hours).
    pub budget_used: &'a BTreeMap<String, (u64, f64)>,
    /// Now, in seconds.
    pub now: u64,
    /// Pods this scheduler bound that the cache may not show yet: uid →
    /// (node, the UUIDs of the GPUs HAMi's annotation gave it there).
    pub assumed: &'a BTreeMap<String, (String, Vec<String>)>,
    pub scheduler_name: &'a str,
    pub topology: &'a TopologyLabels,
    pub classes: &'a [PriorityClass],
}

fn pod_ref(p: &Pod) -> PodRef {
    PodRef {
        namespace: p.metadata.namespace.clone().unwrap_or_default(),
        name: p.metadata.name.clone().unwrap_or_default(),
        uid: p.metadata.uid.clone().unwrap_or_default(),
    }
}

fn quantity_of<'a>(
    map: Option<&'a BTreeMap<String, k8s_openapi::apimachinery::pkg::api::resource::Quantity>>,
    key: &str,
) -> Option<&'a str> {
    map.and_then(|m| m.get(key)).map(|q| q.0.as_str())
}

/// A GPU HAMi shares: its UUID and split count.
type HamiGpu = (String, u32);

/// A HAMi node's GPUs, as its device plugin registers them
/// ([`hami::REGISTER`]): `None` on a node without HAMi. Only GPUs in HAMi's
/// own sharing mode (`hami-core`) are used; none while the plugin
/// advertises no shares (it stopped).
fn hami_gpus(n: &KNode, topo: &TopologyLabels) -> Option<(Vec<Gpu>, Vec<HamiGpu>)> {
    let reg = n.metadata.annotations.as_ref()?.get(hami::REGISTER)?;
    let name = n.metadata.name.as_deref().unwrap_or_default();
    let devices = match hami::parse_register(reg) {
        Ok(d) => d,
        Err(why) => {
            tracing::warn!(node = name, %why, "the node's HAMi registration does not parse; its GPUs are not used");
            return Some((Vec::new(), Vec::new()));
        }
    };
    let alloc = n.status.as_ref().and_then(|s| s.allocatable.as_ref());
    if quantity_of(alloc, GPU)
        .and_then(quantity::count)
        .unwrap_or(0)
        == 0
    {
        return Some((Vec::new(), Vec::new()));
    }
    let label = |k: &str| n.metadata.labels.as_ref().and_then(|l| l.get(k)).cloned();
    let nvlink = label(&topo.nvlink);
    let (mut gpus, mut uuids) = (Vec::new(), Vec::new());
    for d in devices.into_iter().take(MAX_GPUS) {
        if d.mode != "hami-core" {
            tracing::warn!(
                node = name,
                gpu = d.uuid,
                mode = d.mode,
                "gpuflow shares GPUs in HAMi's hami-core mode only; this GPU is not used"
            );
            continue;
        }
        // GPU feature discovery's name, where it runs, so that quotas per
        // model read the same on HAMi's nodes and the others.
        let model = label(PRODUCT_LABEL).unwrap_or(d.model);
        let mut g = Gpu::plain(&model, MemMib(d.mem_mib));
        g.nvlink = nvlink.clone();
        if !d.healthy {
            g.health = GpuHealth::Unhealthy;
        }
        gpus.push(g);
        uuids.push((d.uuid, d.split));
    }
    Some((gpus, uuids))
}

/// A node's GPUs: whole ones first, then one MIG-mode GPU per MIG resource.
fn gpus(n: &KNode, topo: &TopologyLabels) -> Vec<Gpu> {
    let labels = n.metadata.labels.clone().unwrap_or_default();
    let model = labels
        .get(PRODUCT_LABEL)
        .cloned()
        .unwrap_or_else(|| "nvidia".into());
    let mem = labels
        .get(MEMORY_LABEL)
        .and_then(|m| m.parse().ok())
        .unwrap_or(0);
    let alloc = n.status.as_ref().and_then(|s| s.allocatable.as_ref());
    let whole = quantity_of(alloc, GPU)
        .and_then(quantity::count)
        .unwrap_or(0)
        .min(MAX_GPUS as u64);
    let nvlink = labels.get(&topo.nvlink).cloned();
    let mut out: Vec<Gpu> = (0..whole)
        .map(|_| {
            let mut g = Gpu::plain(&model, MemMib(mem));
            g.nvlink = nvlink.clone();
            g
        })
        .collect();
    out.extend(time_sliced(n, &model, mem, &labels));
    for (res, q) in alloc.into_iter().flatten() {
        let Some(profile) = res.strip_prefix(MIG_PREFIX) else {
            continue;
        };
        let mut count = quantity::count(&q.0).unwrap_or(0);
        let inst_mem = profile
            .split_once('.')
            .and_then(|(_, m)| m.strip_suffix("gb"))
            .and_then(|g| g.parse::<u64>().ok())
            .unwrap_or(0)
            * 1024;
        // A GPU holds at most 7 MIG instances: the instances of a profile
        // fill as many GPUs as they need.
        while count > 0 && out.len() < MAX_GPUS {
            let here = count.min(7);
            count -= here;
            let mut g = Gpu::plain(&model, MemMib(mem));
            g.mig = (0..here)
                .map(|_| MigInstance {
                    profile: profile.to_string(),
                    mem: MemMib(inst_mem),
                })
                .collect();
            out.push(g);
        }
    }
    if out.len() > MAX_GPUS {
        tracing::warn!(
            node = n.metadata.name.as_deref().unwrap_or_default(),
            gpus = out.len(),
            "the node reports more GPUs than one node can hold; gpuflow uses {MAX_GPUS}"
        );
        out.truncate(MAX_GPUS);
    }
    out
}

/// The most GPUs the core takes on one node.
const MAX_GPUS: usize = gpuflow_core::cluster::MAX_GPUS_PER_NODE;

/// A time-sliced node's GPUs: its `nvidia.com/gpu.shared` replicas over the
/// replicas per GPU its label gives, each GPU holding that many slices.
fn time_sliced(n: &KNode, model: &str, mem: u64, labels: &BTreeMap<String, String>) -> Vec<Gpu> {
    let alloc = n.status.as_ref().and_then(|s| s.allocatable.as_ref());
    let shared = quantity_of(alloc, SHARED)
        .and_then(quantity::count)
        .unwrap_or(0);
    let replicas = labels
        .get(REPLICAS_LABEL)
        .and_then(|r| r.parse::<u64>().ok())
        .unwrap_or(0);
    if shared == 0 {
        return Vec::new();
    }
    if replicas == 0 {
        tracing::warn!(
            node = n.metadata.name.as_deref().unwrap_or_default(),
            "the node advertises {SHARED} without the label {REPLICAS_LABEL}; its shared GPUs are not used"
        );
        return Vec::new();
    }
    (0..(shared / replicas).min(MAX_GPUS as u64))
        .map(|_| {
            let mut g = Gpu::plain(model, MemMib(mem));
            g.time_slices = replicas.min(u16::MAX as u64) as u16;
            g
        })
        .collect()
}

/// The core's node for a Kubernetes node, and the UUIDs and split counts
/// of its GPUs when HAMi shares them.
fn node(i: usize, n: &KNode, topo: &TopologyLabels) -> (Node, Option<Vec<HamiGpu>>) {
    let alloc = n.status.as_ref().and_then(|s| s.allocatable.as_ref());
    let cpu = quantity_of(alloc, "cpu")
        .and_then(quantity::milli)
        .unwrap_or(0);
    let mem = quantity_of(alloc, "memory")
        .and_then(quantity::mib)
        .unwrap_or(0);
    let name = n.metadata.name.clone().unwrap_or_default();
    let (gpus, uuids) = match hami_gpus(n, topo) {
        Some((g, u)) => (g, Some(u)),
        None => (gpus(n, topo), None),
    };
    let mut node = Node::new(i as u32, &name, CpuMilli(cpu), MemMib(mem), gpus);
    let labels = n.metadata.labels.clone().unwrap_or_default();
    node.rack = labels.get(&topo.rack).cloned();
    node.block = labels.get(&topo.block).cloned();
    node.labels = labels;
    let spec = n.spec.clone().unwrap_or_default();
    node.taints = spec
        .taints
        .unwrap_or_default()
        .into_iter()
        .filter(|t| t.effect != "PreferNoSchedule")
        .map(|t| Taint {
            key: t.key,
            value: t.value.unwrap_or_default(),
        })
        .collect();
    let ready = n
        .status
        .as_ref()
        .and_then(|s| s.conditions.as_ref())
        .and_then(|cs| cs.iter().find(|c| c.type_ == "Ready"))
        .is_some_and(|c| c.status == "True");
    if uuids.is_some() {
        node.labels.insert(HAMI.into(), "true".into());
    } else if node
        .gpus
        .iter()
        .any(|g| g.time_slices > 1 && g.mig.is_empty())
        && quantity_of(alloc, SHARED).is_some()
    {
        node.labels.insert(SLICED.into(), "true".into());
        node.taints.push(Taint {
            key: SLICED.into(),
            value: "true".into(),
        });
    }
    node.state = if !ready {
        NodeState::Lost
    } else if spec.unschedulable == Some(true) {
        NodeState::Cordoned
    } else {
        NodeState::Ready
    };
    (node, uuids)
}

/// The gang a pod belongs to, if any: the label conventions users already
/// write (gpuflow's, the coscheduling plugin's, Kueue's pod groups, JobSet's
/// and LeaderWorkerSet's), else the training operator job that owns it.
/// Pods of one key in one namespace are placed all or none.
pub fn gang_key(p: &Pod) -> Option<String> {
    let labels = p.metadata.labels.as_ref();
    for l in [
        "gpuflow.io/gang",
        "scheduling.x-k8s.io/pod-group",
        "kueue.x-k8s.io/pod-group-name",
        JOBSET,
        "leaderworkerset.sigs.k8s.io/group-key",
    ] {
        if let Some(v) = labels.and_then(|m| m.get(l)) {
            return Some(format!("{l}={v}"));
        }
    }
    let owner = p
        .metadata
        .owner_references
        .as_ref()?
        .iter()
        .find(|o| o.controller == Some(true))?;
    let gangs = [
        "Job",
        "PyTorchJob",
        "TFJob",
        "MPIJob",
        "XGBoostJob",
        "PaddleJob",
        "JAXJob",
        "RayCluster",
    ];
    gangs
        .contains(&owner.kind.as_str())
        .then(|| format!("{}/{}", owner.kind, owner.uid))
}

/// The number of pods a gang waits for, when a pod says so.
fn gang_size(p: &Pod) -> Option<usize> {
    let ann = p.metadata.annotations.as_ref()?;
    [
        "gpuflow.io/gang-size",
        "kueue.x-k8s.io/pod-group-total-count",
    ]
    .iter()
    .find_map(|a| ann.get(*a))
    .and_then(|v| v.parse().ok())
}

/// A JobSet's label on its Jobs and pods, and the number of Jobs it has.
const JOBSET: &str = "jobset.sigs.k8s.io/jobset-name";
const JOBSET_JOBS: &str = "jobset.sigs.k8s.io/global-replicas";

/// The pods a batch/v1 Job runs at once: its parallelism, at most its
/// completions.
fn job_pods(job: &BatchJob) -> Option<usize> {
    let spec = job.spec.as_ref()?;
    let parallelism = spec.parallelism.unwrap_or(1).max(0) as usize;
    Some(match spec.completions {
        Some(c) => parallelism.min(c.max(0) as usize),
        None => parallelism,
    })
}

/// For a JobSet's pod: the pods all its Jobs run at once, or (have, want)
/// while fewer of its Jobs exist than it has (JobSet labels its Jobs and
/// pods with their number).
fn jobset_size(p: &Pod, jobs: &JobIndex) -> Option<Result<usize, (usize, usize)>> {
    let name = p.metadata.labels.as_ref()?.get(JOBSET)?;
    let ns = p.metadata.namespace.as_deref().unwrap_or_default();
    let mine: &[&BatchJob] = jobs
        .jobsets
        .get(&(ns, name.as_str()))
        .map_or(&[], Vec::as_slice);
    let want = p
        .metadata
        .labels
        .as_ref()
        .and_then(|l| l.get(JOBSET_JOBS))
        .and_then(|v| v.parse::<usize>().ok());
    match want {
        Some(want) if mine.len() < want => Some(Err((mine.len(), want))),
        _ if mine.is_empty() => None,
        _ => Some(Ok(mine.iter().filter_map(|j| job_pods(j)).sum())),
    }
}

/// batch/v1 Jobs by uid, and a JobSet's Jobs by (namespace, JobSet), so
/// that a gang's size is looked up, not searched for.
#[derive(Default)]
struct JobIndex<'a> {
    by_uid: BTreeMap<&'a str, &'a BatchJob>,
    jobsets: BTreeMap<(&'a str, &'a str), Vec<&'a BatchJob>>,
}

impl<'a> JobIndex<'a> {
    fn new(jobs: &[&'a BatchJob]) -> JobIndex<'a> {
        let mut out = JobIndex::default();
        for &j in jobs {
            if let Some(uid) = j.metadata.uid.as_deref() {
                out.by_uid.insert(uid, j);
            }
            if let Some(set) = j.metadata.labels.as_ref().and_then(|l| l.get(JOBSET)) {
                let ns = j.metadata.namespace.as_deref().unwrap_or_default();
                out.jobsets.entry((ns, set.as_str())).or_default().push(j);
            }
        }
        out
    }
}

/// The pods a batch/v1 Job runs at once, for the pods it owns.
fn owner_size(p: &Pod, jobs: &JobIndex) -> Option<usize> {
    let owner = p
        .metadata
        .owner_references
        .as_ref()?
        .iter()
        .find(|o| o.controller == Some(true) && o.kind == "Job")?;
    job_pods(jobs.by_uid.get(owner.uid.as_str())?)
}

/// What a container asks of resource `key`: its request, else its limit
/// (extended resources are given as limits; requests default to them).
fn asked<'a>(c: &'a Container, key: &str) -> Option<&'a str> {
    let res = c.resources.as_ref()?;
    quantity_of(res.requests.as_ref(), key).or_else(|| quantity_of(res.limits.as_ref(), key))
}

/// A pod's request, or why gpuflow will not schedule it.
pub fn request(p: &Pod) -> Result<TaskRequest, String> {
    let spec = p.spec.as_ref().ok_or("the pod has no spec")?;
    if spec.affinity.is_some() {
        return Err(
            "gpuflow does not evaluate affinity yet; use nodeSelector and gpuflow.io/topology"
                .into(),
        );
    }
    if spec
        .topology_spread_constraints
        .as_ref()
        .is_some_and(|t| !t.is_empty())
    {
        return Err(
            "gpuflow does not evaluate topologySpreadConstraints yet; use gpuflow.io/topology"
                .into(),
        );
    }
    if spec.resource_claims.as_ref().is_some_and(|c| !c.is_empty()) {
        return Err("gpuflow does not allocate DRA resource claims; ask for nvidia.com/gpu, a MIG instance or a time slice".into());
    }
    let host_port = spec
        .containers
        .iter()
        .flat_map(|c| c.ports.iter().flatten())
        .find_map(|p| p.host_port.filter(|h| *h > 0));
    if let Some(port) = host_port {
        return Err(format!(
            "gpuflow does not check host ports (hostPort {port}); use a Service instead"
        ));
    }
    let mut cpu = 0u64;
    let mut mem = 0u64;
    let mut gpu = GpuRequest::None;
    let mut add_gpu = |r: GpuRequest, container: &str| -> Result<(), String> {
        if gpu != GpuRequest::None {
            return Err(format!(
                "container {container}: one pod asks for GPUs in one container and one way only"
            ));
        }
        gpu = r;
        Ok(())
    };
    for c in &spec.containers {
        let res = c.resources.as_ref();
        let get = |k: &str| asked(c, k);
        if let Some(q) = get("cpu") {
            cpu += quantity::milli(q)
                .ok_or_else(|| format!("container {}: cpu {q:?} is not a quantity", c.name))?;
        }
        if let Some(q) = get("memory") {
            mem += quantity::mib(q)
                .ok_or_else(|| format!("container {}: memory {q:?} is not a quantity", c.name))?;
        }
        let mut keys: BTreeSet<&String> = BTreeSet::new();
        keys.extend(
            res.and_then(|r| r.requests.as_ref())
                .into_iter()
                .flatten()
                .map(|(k, _)| k),
        );
        keys.extend(
            res.and_then(|r| r.limits.as_ref())
                .into_iter()
                .flatten()
                .map(|(k, _)| k),
        );
        // A share of a GPU with limits, as HAMi's device plugin enforces them.
        let share = share(&c.name, get(hami::MEMORY), get(hami::CORES))?;
        for k in keys {
            let q = get(k).unwrap_or("0");
            if k == hami::MEMORY || k == hami::CORES {
                continue;
            }
            if k == hami::MEMORY_PERCENT {
                return Err(format!(
                    "container {}: give GPU memory as {} in MiB, not {k}: gpuflow checks GPU memory in MiB",
                    c.name,
                    hami::MEMORY
                ));
            }
            if k == GPU {
                let n = quantity::count(q).ok_or_else(|| {
                    format!("container {}: {GPU} {q:?} is not a whole number", c.name)
                })?;
                if let Some(fraction) = share.clone() {
                    if n != 1 {
                        return Err(format!(
                            "container {}: a share with {} or {} is of one GPU ({GPU}: 1), not {n}; ask for whole GPUs without them",
                            c.name,
                            hami::MEMORY,
                            hami::CORES
                        ));
                    }
                    add_gpu(fraction, &c.name)?;
                    continue;
                }
                if n > MAX_GPUS as u64 {
                    return Err(format!(
                        "container {}: {GPU} {n}: one pod runs on one node, and no node has more than {MAX_GPUS} GPUs; split the work into a gang of pods",
                        c.name
                    ));
                }
                if n > 0 {
                    add_gpu(GpuRequest::Whole { count: n as u8 }, &c.name)?;
                }
            } else if let Some(profile) = k.strip_prefix(MIG_PREFIX) {
                match quantity::count(q) {
                    Some(0) => {}
                    Some(1) => add_gpu(
                        GpuRequest::Mig {
                            profile: profile.to_string(),
                        },
                        &c.name,
                    )?,
                    _ => {
                        return Err(format!(
                            "container {}: ask for one MIG instance ({k}: 1), not {q}",
                            c.name
                        ));
                    }
                }
            } else if k == SHARED {
                match quantity::count(q) {
                    Some(0) => {}
                    Some(1) => add_gpu(GpuRequest::TimeSlice { mem: MemMib(0) }, &c.name)?,
                    _ => {
                        return Err(format!(
                            "container {}: ask for one time slice ({SHARED}: 1), not {q}",
                            c.name
                        ));
                    }
                }
            } else if k.starts_with("nvidia.com/") {
                return Err(format!(
                    "container {}: {k} is not supported on Kubernetes yet (whole GPUs as {GPU}, MIG instances as {MIG_PREFIX}<profile> and time slices as {SHARED} are)",
                    c.name
                ));
            } else if !matches!(k.as_str(), "cpu" | "memory" | "ephemeral-storage") {
                // gpuflow would not count it on the nodes: the kubelet could
                // refuse the pod after it was bound.
                return Err(format!(
                    "container {}: gpuflow does not account for {k} yet (it counts cpu, memory and NVIDIA GPUs)",
                    c.name
                ));
            }
        }
    }
    // An init container runs alone before the others: the pod needs the
    // larger of the two.
    for c in spec.init_containers.iter().flatten() {
        if let Some(q) = asked(c, "cpu") {
            cpu = cpu.max(quantity::milli(q).unwrap_or(0));
        }
        if let Some(q) = asked(c, "memory") {
            mem = mem.max(quantity::mib(q).unwrap_or(0));
        }
    }
    // The runtime class's overhead is the pod's too.
    if let Some(q) = quantity_of(spec.overhead.as_ref(), "cpu") {
        cpu += quantity::milli(q).ok_or_else(|| format!("overhead cpu {q:?} is not a quantity"))?;
    }
    if let Some(q) = quantity_of(spec.overhead.as_ref(), "memory") {
        mem +=
            quantity::mib(q).ok_or_else(|| format!("overhead memory {q:?} is not a quantity"))?;
    }
    if let Some(c) = spec.containers.iter().find(|c| {
        let has = |k: &str| asked(c, k).is_some();
        (has(hami::MEMORY) || has(hami::CORES)) && !has(GPU)
    }) {
        return Err(format!(
            "container {}: {} and {} limit a share of a GPU; ask for it with {GPU}: 1",
            c.name,
            hami::MEMORY,
            hami::CORES
        ));
    }
    Ok(TaskRequest {
        cpu: CpuMilli(cpu),
        mem: MemMib(mem),
        gpu,
        models: Vec::new(),
    })
}

/// A container's share of one GPU from HAMi's resources: `None` without
/// them. Its compute is `gpucores` percent; without it the share has no
/// compute limit and counts the least a share counts (see
/// [`Builder::least_share`]).
fn share(
    container: &str,
    mem: Option<&str>,
    cores: Option<&str>,
) -> Result<Option<GpuRequest>, String> {
    if mem.is_none() && cores.is_none() {
        return Ok(None);
    }
    let Some(mem) = mem else {
        return Err(format!(
            "container {container}: give the share's GPU memory ({}, MiB) with {}",
            hami::MEMORY,
            hami::CORES
        ));
    };
    let mem = quantity::count(mem).filter(|m| *m > 0).ok_or_else(|| {
        format!(
            "container {container}: {} {mem:?} is not a whole number of MiB",
            hami::MEMORY
        )
    })?;
    let cores = match cores {
        None => 0,
        Some(c) => quantity::count(c).filter(|c| *c <= 100).ok_or_else(|| {
            format!(
                "container {container}: {} {c:?} is not a percentage from 0 to 100",
                hami::CORES
            )
        })?,
    };
    Ok(Some(GpuRequest::Fraction {
        milli: gpuflow_core::ids::GpuMilli(cores as u32 * 10),
        mem: MemMib(mem),
    }))
}

fn topology(p: &Pod) -> Result<Option<Topology>, String> {
    let Some(v) = p
        .metadata
        .annotations
        .as_ref()
        .and_then(|a| a.get("gpuflow.io/topology"))
    else {
        return Ok(None);
    };
    let (level, required) = match v.split_once(':') {
        None => (v.as_str(), true),
        Some((l, "required")) => (l, true),
        Some((l, "preferred")) => (l, false),
        Some(_) => {
            return Err(format!(
                "gpuflow.io/topology {v:?}: write LEVEL or LEVEL:preferred"
            ));
        }
    };
    let level = match level {
        "node" => TopologyLevel::Node,
        "nvlink" => TopologyLevel::NvLink,
        "rack" => TopologyLevel::Rack,
        "block" => TopologyLevel::Block,
        _ => {
            return Err(format!(
                "gpuflow.io/topology {v:?}: the level is one of node, nvlink, rack, block"
            ));
        }
    };
    Ok(Some(Topology { level, required }))
}

fn selects(sel: &LabelSelector, labels: &BTreeMap<String, String>) -> bool {
    let ok_labels = sel
        .match_labels
        .iter()
        .flatten()
        .all(|(k, v)| labels.get(k) == Some(v));
    let ok_exprs = sel.match_expressions.iter().flatten().all(|e| {
        let have = labels.get(&e.key);
        let values = e.values.clone().unwrap_or_default();
        match e.operator.as_str() {
            "In" => have.is_some_and(|h| values.contains(h)),
            "NotIn" => have.is_none_or(|h| !values.contains(h)),
            "Exists" => have.is_some(),
            "DoesNotExist" => have.is_none(),
            _ => false,
        }
    });
    ok_labels && ok_exprs
}

/// A disruption budget's name, `namespace/name`.
fn budget_name(b: &PodDisruptionBudget) -> String {
    format!(
        "{}/{}",
        b.metadata.namespace.as_deref().unwrap_or_default(),
        b.metadata.name.as_deref().unwrap_or_default()
    )
}

/// The disruption budgets (`namespace/name`) covering a pod.
fn budgets_of(p: &Pod, budgets: &[&PodDisruptionBudget]) -> Vec<String> {
    let labels = p.metadata.labels.clone().unwrap_or_default();
    budgets
        .iter()
        .filter(|b| b.metadata.namespace == p.metadata.namespace)
        .filter(|b| {
            b.spec
                .as_ref()
                .and_then(|s| s.selector.as_ref())
                .is_some_and(|s| selects(s, &labels))
        })
        .map(|b| budget_name(b))
        .collect()
}

fn seconds(t: Option<&k8s_openapi::apimachinery::pkg::apis::meta::v1::Time>) -> u64 {
    t.map_or(0, |t| t.0.as_second().max(0) as u64)
}

/// The queue tree from the `GpuQueue`s; a queue whose parent is missing is
/// left out with the reason.
fn queues(
    list: &[&GpuQueue],
    capacity: &BTreeMap<String, u64>,
    budget_used: &BTreeMap<String, (u64, f64)>,
    now: u64,
) -> (Queues, BTreeMap<String, String>) {
    let mut left_out = BTreeMap::new();
    let names: BTreeSet<&str> = list
        .iter()
        .filter_map(|q| q.metadata.name.as_deref())
        .collect();
    // A queue whose parent is missing, or in a cycle, is left out with its children.
    let depth = |name: &str| -> Option<usize> {
        let mut seen = BTreeSet::new();
        let mut cur = name;
        let mut d = 0;
        loop {
            if !seen.insert(cur) {
                return None;
            }
            let q = list
                .iter()
                .find(|q| q.metadata.name.as_deref() == Some(cur))?;
            match q.spec.parent.as_deref() {
                None => return Some(d),
                Some(p) if names.contains(p) => {
                    d += 1;
                    cur = p;
                }
                Some(_) => return None,
            }
        }
    };
    let mut specs: Vec<(usize, &GpuQueue)> = Vec::new();
    for q in list {
        let name = q.metadata.name.clone().unwrap_or_default();
        match depth(&name) {
            Some(d) => specs.push((d, q)),
            None => {
                left_out.insert(
                    name.clone(),
                    format!(
                        "GpuQueue {name}: its parent {:?} does not exist or is in a cycle",
                        q.spec.parent.as_deref().unwrap_or_default()
                    ),
                );
            }
        }
    }
    specs.sort_by_key(|(d, q)| (*d, q.metadata.name.clone()));
    let index: BTreeMap<String, QueueId> = specs
        .iter()
        .enumerate()
        .map(|(i, (_, q))| {
            (
                q.metadata.name.clone().unwrap_or_default(),
                QueueId(i as u32),
            )
        })
        .collect();
    let milli = |g: f64| (g * 1000.0).round() as u64;
    let built: Vec<Queue> = specs
        .iter()
        .map(|(_, q)| {
            let s = &q.spec;
            let mut out = Queue::new(
                q.metadata.name.as_deref().unwrap_or_default(),
                s.parent.as_ref().and_then(|p| index.get(p).copied()),
            );
            out.weight = s.weight;
            out.state = match s.state {
                None | Some(crd::QueueState::Open) => QueueState::Open,
                Some(crd::QueueState::Held) => QueueState::Held,
                Some(crd::QueueState::Draining) => QueueState::Draining,
            };
            out.set_quotas(capacity.keys(), &s.quotas, |qs| FlavorQuota {
                guaranteed: milli(qs.guaranteed),
                borrow_limit: qs.borrow_limit.map(milli),
                lend_limit: qs.lend_limit.map(milli),
                cap: qs.cap.map(milli),
            });
            out.budget = s.budget.as_ref().map(|b| {
                let name = q.metadata.name.as_deref().unwrap_or_default();
                let start = b.period.start(now);
                let used = budget_used
                    .get(name)
                    .filter(|(s, _)| *s == start)
                    .map_or(0.0, |(_, h)| *h);
                Budget {
                    gpu_hours: b.gpu_hours,
                    used_gpu_hours: used,
                    taper_from: b.taper_from,
                    min_weight_factor: b.min_weight_factor,
                    when_exhausted: match b.when_exhausted {
                        crd::WhenExhausted::StopBorrowing => BudgetExhausted::StopBorrowing,
                        crd::WhenExhausted::StopAdmitting => BudgetExhausted::StopAdmitting,
                    },
                }
            });
            out.user_limits = UserLimits {
                max_gpu_milli: s.max_gpus_per_user.map(milli),
                max_running: None,
            };
            out
        })
        .collect();
    match Queues::new(built, capacity.clone()) {
        Ok(q) => (q, left_out),
        Err(e) => {
            for q in list {
                left_out.insert(
                    q.metadata.name.clone().unwrap_or_default(),
                    format!("the queue tree does not build: {e}"),
                );
            }
            (
                Queues::new(Vec::new(), capacity.clone()).expect("an empty tree builds"),
                left_out,
            )
        }
    }
}

/// Which GPUs of each node bound pods hold, to give each a concrete pick.
/// (The device plugin chooses the devices; gpuflow needs counts to be
/// right, and the lowest free GPUs stand for them.)
#[derive(Default)]
struct Holdings {
    whole: Vec<u64>,
    /// Per node, per GPU: MIG instances taken (bits).
    mig: Vec<Vec<u64>>,
    /// Per node, per GPU: time slices taken.
    slices: Vec<Vec<u16>>,
    /// Per node, per GPU: shares taken (compute in milli-GPU, memory in MiB).
    shares: Vec<Vec<(u32, u64)>>,
    /// Per node: its GPUs' UUIDs when HAMi shares them (else empty).
    uuids: Vec<Vec<String>>,
}

impl Holdings {
    /// The GPUs a bound pod holds: its request when the node has it free,
    /// else every free GPU of the node it could use (a node that reports
    /// fewer GPUs than its pods hold has none left for new work).
    fn take(&mut self, node: &Node, r: &GpuRequest, hint: &[String]) -> (GpuRequest, GpuPick) {
        if let Some(pick) = self.pick(node, r, hint) {
            return (r.clone(), pick);
        }
        let i = node.id.0 as usize;
        if let GpuRequest::Whole { .. } = r {
            let mut mask = 0u64;
            for (g, gpu) in node.gpus.iter().enumerate() {
                if !gpu.mig_enabled() && self.is_free(i, g) {
                    mask |= 1 << g;
                }
            }
            if mask != 0 {
                self.whole[i] |= mask;
                return (
                    GpuRequest::Whole {
                        count: mask.count_ones() as u8,
                    },
                    GpuPick::Whole(mask),
                );
            }
        }
        (GpuRequest::None, GpuPick::None)
    }

    /// Whether GPU `g` of node `i` carries nothing.
    fn is_free(&self, i: usize, g: usize) -> bool {
        self.whole[i] & (1 << g) == 0 && self.slices[i][g] == 0 && self.shares[i][g].1 == 0
    }

    /// The GPUs the device plugin gave a pod (`hint`: their UUIDs, from
    /// HAMi's annotation) when they can hold the request.
    fn pick_hinted(&mut self, node: &Node, r: &GpuRequest, hint: &[String]) -> Option<GpuPick> {
        let i = node.id.0 as usize;
        let idx: Vec<usize> = hint
            .iter()
            .map(|u| self.uuids[i].iter().position(|x| x == u))
            .collect::<Option<_>>()?;
        match r {
            GpuRequest::Whole { count } if idx.len() == *count as usize => {
                let mut mask = 0u64;
                for &g in &idx {
                    if !self.is_free(i, g) || mask & (1 << g) != 0 {
                        return None;
                    }
                    mask |= 1 << g;
                }
                self.whole[i] |= mask;
                Some(GpuPick::Whole(mask))
            }
            GpuRequest::Fraction { milli, mem } => match idx.as_slice() {
                [g] => self.share(node, *g, milli.0, mem.0),
                _ => None,
            },
            _ => None,
        }
    }

    /// Takes a share of GPU `g` of `node` if it has room.
    fn share(&mut self, node: &Node, g: usize, milli: u32, mem: u64) -> Option<GpuPick> {
        let i = node.id.0 as usize;
        let gpu = &node.gpus[g];
        let (m, b) = self.shares[i][g];
        (gpu.mig.is_empty()
            && self.whole[i] & (1 << g) == 0
            && self.slices[i][g] == 0
            && m + milli <= 1000
            && b + mem <= gpu.mem.0)
            .then(|| {
                self.shares[i][g] = (m + milli, b + mem);
                GpuPick::Shared(g as u8)
            })
    }

    fn pick(&mut self, node: &Node, r: &GpuRequest, hint: &[String]) -> Option<GpuPick> {
        let i = node.id.0 as usize;
        if !hint.is_empty()
            && let Some(p) = self.pick_hinted(node, r, hint)
        {
            return Some(p);
        }
        match r {
            GpuRequest::None => Some(GpuPick::None),
            GpuRequest::Whole { count } => {
                let mut mask = 0u64;
                let mut left = *count;
                for (g, gpu) in node.gpus.iter().enumerate() {
                    if left == 0 {
                        break;
                    }
                    if !gpu.mig_enabled() && self.is_free(i, g) {
                        mask |= 1 << g;
                        left -= 1;
                    }
                }
                (left == 0).then(|| {
                    self.whole[i] |= mask;
                    GpuPick::Whole(mask)
                })
            }
            GpuRequest::Mig { profile } => {
                for (g, gpu) in node.gpus.iter().enumerate() {
                    for (k, inst) in gpu.mig.iter().enumerate() {
                        if inst.profile == *profile && self.mig[i][g] & (1 << k) == 0 {
                            self.mig[i][g] |= 1 << k;
                            return Some(GpuPick::Mig {
                                gpu: g as u8,
                                instance: k as u8,
                            });
                        }
                    }
                }
                None
            }
            GpuRequest::TimeSlice { .. } => {
                for (g, gpu) in node.gpus.iter().enumerate() {
                    let used = &mut self.slices[i][g];
                    if gpu.mig.is_empty()
                        && self.whole[i] & (1 << g) == 0
                        && self.shares[i][g].1 == 0
                        && *used < gpu.time_slices
                    {
                        *used += 1;
                        return Some(GpuPick::Shared(g as u8));
                    }
                }
                None
            }
            GpuRequest::Fraction { milli, mem } => {
                (0..node.gpus.len()).find_map(|g| self.share(node, g, milli.0, mem.0))
            }
        }
    }
}

/// HAMi's decision for a pod given `pick` of a HAMi node's `gpus`, per
/// container (what [`hami::encode`] writes): the devices go to the
/// container that asks for GPUs; whole GPUs get all their memory and
/// compute, a share its `gpumem` and `gpucores`. `None` when the pod asks
/// for no GPU or the pick is not of these GPUs.
pub fn hami_decision(
    pod: &Pod,
    gpus: &[(String, u64)],
    pick: GpuPick,
) -> Option<Vec<Vec<hami::Share>>> {
    let spec = pod.spec.as_ref()?;
    let asks = |c: &Container| {
        asked(c, GPU)
            .and_then(quantity::count)
            .is_some_and(|n| n > 0)
    };
    let at = spec.containers.iter().position(asks)?;
    let shares: Vec<hami::Share> = match (pick, request(pod).ok()?.gpu) {
        (GpuPick::Whole(mask), GpuRequest::Whole { .. }) => (0..gpus.len())
            .filter(|g| mask & (1 << g) != 0)
            .map(|g| hami::Share {
                uuid: gpus[g].0.clone(),
                mem_mib: gpus[g].1,
                cores: 100,
            })
            .collect(),
        (GpuPick::Shared(g), GpuRequest::Fraction { milli, mem }) => vec![hami::Share {
            uuid: gpus.get(g as usize)?.0.clone(),
            mem_mib: mem.0,
            cores: milli.0 / 10,
        }],
        _ => return None,
    };
    if shares.is_empty() {
        return None;
    }
    let mut containers = vec![Vec::new(); spec.containers.len()];
    containers[at] = shares;
    Some(containers)
}

/// The UUIDs of the GPUs HAMi's annotation gives a pod on `node`, if it
/// names that node.
fn hint(p: &Pod, node: &str) -> Vec<String> {
    let Some(ann) = p.metadata.annotations.as_ref() else {
        return Vec::new();
    };
    if ann.get(hami::ASSIGNED_NODE).map(String::as_str) != Some(node) {
        return Vec::new();
    }
    ann.get(hami::ALLOCATED)
        .or_else(|| ann.get(hami::TO_ALLOCATE))
        .map(|a| hami::decode(a).into_iter().map(|d| d.uuid).collect())
        .unwrap_or_default()
}

/// A gang's job id: the same every cycle and in every replica (the core
/// remembers preemptors waiting for their victims by id), from a hash of
/// its namespace, key and part (its running pods or its pending ones); in
/// `1..2^62`, far from the ids of fixed usage at the top of the range.
pub fn job_id(namespace: &str, key: &str, part: &str) -> JobId {
    // FNV-1a, 64 bits.
    let mut h: u64 = 0xcbf2_9ce4_8422_2325;
    for b in [namespace, "/", key, "/", part]
        .iter()
        .flat_map(|s| s.bytes())
    {
        h ^= u64::from(b);
        h = h.wrapping_mul(0x0100_0000_01b3);
    }
    JobId((h >> 2).max(1))
}

/// One of our pods: its request and, when bound, its node and GPUs.
struct Member<'a> {
    pod: &'a Pod,
    request: TaskRequest,
    node: Option<usize>,
    /// When bound: the GPUs it holds there (see [`Holdings::take`]).
    held: Option<(GpuRequest, GpuPick)>,
}

/// A gang as a core job, with its pods per task.
struct GangJob {
    work: Workload,
    pods: Vec<Vec<PodRef>>,
    grace: u64,
    budgets: Vec<String>,
}

/// The snapshot under construction.
struct Builder<'a> {
    input: &'a Inputs<'a>,
    nodes: Vec<Node>,
    node_index: BTreeMap<String, usize>,
    holdings: Holdings,
    /// What a share of a GPU counts at least, in milli-GPU.
    least_share: u32,
    /// Whether any node's GPUs are shared by HAMi.
    any_hami: bool,
    jobs: JobIndex<'a>,
    all_taints: Vec<String>,
    budget_allows: BTreeMap<String, i32>,
    queues: Queues,
    left_out: BTreeMap<String, String>,
    /// Usage that is not the core's to move: others' pods, planned pods,
    /// pods of no queue.
    fixed: Vec<Allocation>,
    held: Vec<(PodRef, String)>,
    planned: Vec<(PodRef, String)>,
    running: Vec<Running>,
    pending: Vec<Workload>,
    gangs: BTreeMap<JobId, Gang>,
}

/// The core's inputs from the cluster's objects.
pub fn build(input: &Inputs) -> Snapshot {
    let mut b = Builder::new(input);
    let gangs = b.read_pods();
    for ((ns, key), members) in gangs {
        b.gang(&ns, key, members);
    }
    b.finish()
}

impl<'a> Builder<'a> {
    fn new(input: &'a Inputs<'a>) -> Builder<'a> {
        let mut knodes: Vec<&KNode> = input.nodes.to_vec();
        knodes.sort_by(|a, b| a.metadata.name.cmp(&b.metadata.name));
        let (nodes, hami): (Vec<Node>, Vec<Option<Vec<HamiGpu>>>) = knodes
            .iter()
            .enumerate()
            .map(|(i, n)| node(i, n, input.topology))
            .unzip();
        // The least a share counts: a GPU split into N shares holds at most
        // N, so each counts at least 1/N of a GPU (of the most finely
        // split GPU; HAMi's default split is 10).
        let least_share = hami
            .iter()
            .flatten()
            .flatten()
            .map(|(_, split)| 1000u32.div_ceil((*split).max(1)))
            .min()
            .unwrap_or(100);
        let any_hami = hami.iter().flatten().any(|g| !g.is_empty());
        let uuids: Vec<Vec<String>> = hami
            .into_iter()
            .map(|h| h.unwrap_or_default().into_iter().map(|(u, _)| u).collect())
            .collect();
        let node_index = nodes
            .iter()
            .enumerate()
            .map(|(i, n)| (n.name.clone(), i))
            .collect();
        let mut capacity: BTreeMap<String, u64> = BTreeMap::new();
        for n in nodes.iter().filter(|n| n.state != NodeState::Lost) {
            for g in &n.gpus {
                let milli = if g.mig_enabled() {
                    g.mig
                        .iter()
                        .map(|m| {
                            GpuRequest::Mig {
                                profile: m.profile.clone(),
                            }
                            .quota_milli()
                        })
                        .sum()
                } else {
                    1000
                };
                *capacity.entry(g.model.clone()).or_default() += milli;
            }
        }
        let (queues, left_out) = queues(input.queues, &capacity, input.budget_used, input.now);
        let budget_allows = input
            .budgets
            .iter()
            .map(|b| {
                (
                    budget_name(b),
                    b.status.as_ref().map_or(0, |s| s.disruptions_allowed),
                )
            })
            .collect();
        Builder {
            input,
            holdings: Holdings {
                whole: vec![0; nodes.len()],
                mig: nodes.iter().map(|n| vec![0; n.gpus.len()]).collect(),
                slices: nodes.iter().map(|n| vec![0; n.gpus.len()]).collect(),
                shares: nodes.iter().map(|n| vec![(0, 0); n.gpus.len()]).collect(),
                uuids,
            },
            least_share,
            any_hami,
            jobs: JobIndex::new(input.jobs),
            // The time-sliced mark is gpuflow's own: no toleration of the
            // pod's covers it.
            all_taints: nodes
                .iter()
                .flat_map(|n| n.taints.iter().map(|t| t.key.clone()))
                .filter(|k| k != SLICED)
                .collect(),
            nodes,
            node_index,
            budget_allows,
            queues,
            left_out,
            fixed: Vec::new(),
            held: Vec::new(),
            planned: Vec::new(),
            running: Vec::new(),
            pending: Vec::new(),
            gangs: BTreeMap::new(),
        }
    }

    /// A request as the core counts it: a share of a GPU counts at least
    /// [`Builder::least_share`].
    fn counted(&self, mut r: TaskRequest) -> TaskRequest {
        if let GpuRequest::Fraction { milli, .. } = &mut r.gpu {
            milli.0 = milli.0.max(self.least_share);
        }
        r
    }

    /// Holds `request` on node `i`, with the GPUs `held`, for work the core
    /// does not move.
    fn hold(&mut self, i: usize, request: &TaskRequest, held: (GpuRequest, GpuPick)) {
        // Ids from the top down: far from the gangs' ids.
        let job = JobId(u64::MAX - self.fixed.len() as u64);
        self.fixed.push(Allocation {
            task: TaskId {
                job,
                group: 0,
                index: 0,
            },
            node: NodeId(i as u32),
            cpu: request.cpu,
            mem: request.mem,
            gpu: held.0,
            pick: held.1,
        });
    }

    /// Others' bound pods become fixed usage; ours are grouped by gang
    /// (namespace, key), bound ones holding their GPUs.
    fn read_pods(&mut self) -> BTreeMap<(String, String), Vec<Member<'a>>> {
        let input = self.input;
        let mut pods: Vec<&'a Pod> = input.pods.to_vec();
        pods.sort_by(|a, b| {
            (&a.metadata.namespace, &a.metadata.name)
                .cmp(&(&b.metadata.namespace, &b.metadata.name))
        });
        let mut gangs: BTreeMap<(String, String), Vec<Member<'a>>> = BTreeMap::new();
        for p in pods {
            let spec = p.spec.as_ref();
            let phase = p
                .status
                .as_ref()
                .and_then(|s| s.phase.as_deref())
                .unwrap_or("Pending");
            if matches!(phase, "Succeeded" | "Failed") {
                continue;
            }
            let uid = p.metadata.uid.clone().unwrap_or_default();
            let bound_to = spec
                .and_then(|s| s.node_name.clone())
                .filter(|n| !n.is_empty())
                .or_else(|| input.assumed.get(&uid).map(|(n, _)| n.clone()));
            let node = bound_to.as_ref().map(|n| self.node_index.get(n).copied());
            let ours = spec.and_then(|s| s.scheduler_name.as_deref()) == Some(input.scheduler_name);
            let request = request(p).map(|r| self.counted(r));
            let hint = match &node {
                Some(Some(i)) => {
                    let h = hint(p, &self.nodes[*i].name);
                    match input.assumed.get(&uid) {
                        Some((_, decided)) if h.is_empty() => decided.clone(),
                        _ => h,
                    }
                }
                _ => Vec::new(),
            };
            match (node, ours) {
                // Bound to a node that is gone: nothing to hold.
                (Some(None), _) => {}
                // Someone else's pod: it holds what it asks for.
                (Some(Some(i)), false) => {
                    if let Ok(r) = request {
                        let held = self.holdings.take(&self.nodes[i], &r.gpu, &hint);
                        self.hold(i, &r, held);
                    }
                }
                (None, false) => {}
                (node, true) => {
                    let node = node.flatten();
                    if node.is_none() && p.metadata.deletion_timestamp.is_some() {
                        continue;
                    }
                    // A gated pod is not to be scheduled until its gates
                    // are removed (Kueue and others hold pods this way).
                    let gates: Vec<&str> = spec
                        .and_then(|s| s.scheduling_gates.as_ref())
                        .into_iter()
                        .flatten()
                        .map(|g| g.name.as_str())
                        .collect();
                    if node.is_none() && !gates.is_empty() {
                        self.held.push((
                            pod_ref(p),
                            format!("waits for its scheduling gates: {}", gates.join(", ")),
                        ));
                        continue;
                    }
                    let request = match request {
                        Ok(r)
                            if node.is_none()
                                && matches!(r.gpu, GpuRequest::Fraction { .. })
                                && !self.any_hami =>
                        {
                            self.held.push((pod_ref(p), format!(
                                "a share of a GPU with {} needs a node whose GPUs HAMi's device plugin shares, and no node has HAMi's registration ({})",
                                hami::MEMORY, hami::REGISTER
                            )));
                            continue;
                        }
                        Ok(r) => r,
                        Err(why) => {
                            if node.is_none() {
                                self.held.push((pod_ref(p), why));
                            }
                            continue;
                        }
                    };
                    let held =
                        node.map(|i| self.holdings.take(&self.nodes[i], &request.gpu, &hint));
                    let key = gang_key(p).unwrap_or_else(|| {
                        format!("pod/{}", p.metadata.name.as_deref().unwrap_or_default())
                    });
                    let ns = p.metadata.namespace.clone().unwrap_or_default();
                    gangs.entry((ns, key)).or_default().push(Member {
                        pod: p,
                        request,
                        node,
                        held,
                    });
                }
            }
        }
        gangs
    }

    /// The queue a gang's pods go to: the one a label names, else the one
    /// taking the namespace; it must take the namespace either way.
    fn queue_of(&self, ns: &str, first: &Pod) -> Result<(QueueId, &'a GpuQueue), String> {
        let input = self.input;
        let named = QUEUE_LABELS.iter().find_map(|l| {
            first
                .metadata
                .labels
                .as_ref()
                .and_then(|m| m.get(*l))
                .cloned()
        });
        let takes = |q: &GpuQueue| q.spec.namespaces.iter().any(|n| n == ns);
        let q: &'a GpuQueue = match &named {
            Some(q) => match input
                .queues
                .iter()
                .find(|g| g.metadata.name.as_deref() == Some(q))
            {
                None => return Err(format!("GpuQueue {q} does not exist")),
                Some(g) if !takes(g) => {
                    return Err(format!(
                        "GpuQueue {q} does not take pods from namespace {ns}"
                    ));
                }
                Some(g) => g,
            },
            None => match input
                .queues
                .iter()
                .filter(|q| takes(q))
                .collect::<Vec<_>>()
                .as_slice()
            {
                [one] => one,
                [] => {
                    return Err(format!(
                        "no GpuQueue takes namespace {ns}: list it in a GpuQueue's spec.namespaces, or label the pod gpuflow.io/queue"
                    ));
                }
                _ => {
                    return Err(format!(
                        "several GpuQueues take namespace {ns}: label the pod gpuflow.io/queue with one of them"
                    ));
                }
            },
        };
        let name = q.metadata.name.clone().unwrap_or_default();
        if let Some(why) = self.left_out.get(&name) {
            return Err(why.clone());
        }
        let id = self
            .queues
            .by_name(&name)
            .ok_or_else(|| format!("GpuQueue {name} is not scheduled"))?;
        Ok((id, q))
    }

    fn hold_back(&mut self, members: &[Member], why: &str) {
        for m in members.iter().filter(|m| m.node.is_none()) {
            self.held.push((pod_ref(m.pod), why.to_string()));
        }
    }

    /// One gang: its bound pods a running job, its planned pods bound next,
    /// the rest a pending job (or held with the reason).
    fn gang(&mut self, ns: &str, key: String, members: Vec<Member<'a>>) {
        let (bound, unbound): (Vec<Member>, Vec<Member>) =
            members.into_iter().partition(|m| m.node.is_some());
        let first = bound
            .first()
            .or(unbound.first())
            .expect("a gang has a pod")
            .pod;
        // Pods planned on a node by an earlier cycle: their gang is being
        // bound; finish it.
        let mut rest = Vec::new();
        for m in unbound {
            let plan = m
                .pod
                .metadata
                .annotations
                .as_ref()
                .and_then(|a| a.get(PLANNED))
                .and_then(|n| self.node_index.get(n).map(|&i| (n.clone(), i)));
            match plan.and_then(|(n, i)| {
                let hint = hint(m.pod, &n);
                Some((
                    n,
                    i,
                    self.holdings.pick(&self.nodes[i], &m.request.gpu, &hint)?,
                ))
            }) {
                Some((n, i, pick)) => {
                    self.hold(i, &m.request, (m.request.gpu.clone(), pick));
                    self.planned.push((pod_ref(m.pod), n));
                }
                None => rest.push(m),
            }
        }
        let unbound = rest;
        let (qid, q) = match self.queue_of(ns, first) {
            Ok(found) => found,
            Err(why) => {
                self.hold_back(&unbound, &why);
                // Bound pods without a queue still hold what they use.
                for m in &bound {
                    if let (Some(i), Some(held)) = (m.node, m.held.clone()) {
                        self.hold(i, &m.request, held);
                    }
                }
                return;
            }
        };
        let qname = q.metadata.name.clone().unwrap_or_default();
        if !bound.is_empty() {
            self.running_gang(ns, &key, &qname, qid, &bound);
        }
        if unbound.is_empty() {
            return;
        }
        if let Some(why) = bad_image(&unbound, q) {
            self.hold_back(&unbound, &why);
            return;
        }
        // A gang that says how many pods it has, or whose JobSet or Job
        // does, waits for all of them.
        let size = unbound.iter().chain(&bound).find_map(|m| {
            gang_size(m.pod)
                .map(Ok)
                .or_else(|| jobset_size(m.pod, &self.jobs))
                .or_else(|| owner_size(m.pod, &self.jobs).map(Ok))
        });
        let present = unbound.len() + bound.len();
        if bound.is_empty() {
            let why = match size {
                Some(Err((have, want))) => Some(format!(
                    "gang {key}: {have} of its {want} Jobs exist; waiting for the rest"
                )),
                Some(Ok(size)) if present < size => Some(format!(
                    "gang {key}: {present} of its {size} pods exist; waiting for the rest"
                )),
                _ => None,
            };
            if let Some(why) = why {
                self.hold_back(&unbound, &why);
                return;
            }
        }
        let id = job_id(ns, &key, "pending");
        match self.job(ns, &unbound, id, qid) {
            Ok(j) => {
                self.pending.push(j.work);
                self.gangs.insert(
                    id,
                    Gang {
                        key,
                        queue: qname,
                        pods: j.pods,
                        grace: j.grace,
                        budgets: j.budgets,
                    },
                );
            }
            Err(why) => self.hold_back(&unbound, &why),
        }
    }

    /// A gang's bound pods as a running job, charged to its queue.
    fn running_gang(&mut self, ns: &str, key: &str, qname: &str, qid: QueueId, bound: &[Member]) {
        let id = job_id(ns, key, "running");
        let j = match self.job(ns, bound, id, qid) {
            Ok(j) => j,
            Err(why) => {
                tracing::warn!(gang = %key, %why, "a running gang gpuflow cannot read; its pods hold their resources");
                for m in bound {
                    if let (Some(i), Some(held)) = (m.node, m.held.clone()) {
                        self.hold(i, &m.request, held);
                    }
                }
                return;
            }
        };
        let mut allocations = Vec::new();
        let mut flavor = String::new();
        for (g, grp) in j.work.job.groups.iter().enumerate() {
            for (k, r) in j.pods[g].iter().enumerate() {
                let m = bound
                    .iter()
                    .find(|m| pod_ref(m.pod) == *r)
                    .expect("a member");
                let (Some(i), Some((gpu, pick))) = (m.node, m.held.clone()) else {
                    continue;
                };
                if flavor.is_empty() && grp.request.gpu != GpuRequest::None {
                    flavor = self.nodes[i]
                        .gpus
                        .first()
                        .map(|g| g.model.clone())
                        .unwrap_or_default();
                }
                allocations.push(Allocation {
                    task: TaskId {
                        job: id,
                        group: g as u16,
                        index: k as u32,
                    },
                    node: NodeId(i as u32),
                    cpu: grp.request.cpu,
                    mem: grp.request.mem,
                    gpu,
                    pick,
                });
            }
        }
        let started = bound
            .iter()
            .map(|m| {
                let start = m.pod.status.as_ref().and_then(|s| s.start_time.as_ref());
                seconds(start).max(seconds(m.pod.metadata.creation_timestamp.as_ref()))
            })
            .min()
            .unwrap_or(0);
        let stopping = bound
            .iter()
            .any(|m| m.pod.metadata.deletion_timestamp.is_some());
        self.running.push(Running {
            work: j.work,
            flavor,
            allocations,
            started,
            last_checkpoint: None,
            stopping_at: stopping.then_some(started),
        });
        self.gangs.insert(
            id,
            Gang {
                key: key.to_string(),
                queue: qname.to_string(),
                pods: j.pods,
                grace: j.grace,
                budgets: j.budgets,
            },
        );
    }

    /// Pods of one gang as a core job: one task group per distinct request.
    fn job(
        &self,
        ns: &str,
        members: &[Member],
        id: JobId,
        queue: QueueId,
    ) -> Result<GangJob, String> {
        let input = self.input;
        let mut groups: Vec<(TaskRequest, Vec<&Member>)> = Vec::new();
        for m in members {
            match groups.iter_mut().find(|(r, _)| *r == m.request) {
                Some((_, v)) => v.push(m),
                None => groups.push((m.request.clone(), vec![m])),
            }
        }
        if groups.len() > u16::MAX as usize {
            return Err(format!(
                "the gang's pods ask for {} different sets of resources; gpuflow takes at most {}",
                groups.len(),
                u16::MAX
            ));
        }
        let p = members[0].pod;
        let spec = p.spec.clone().unwrap_or_default();
        let class = class_of(p, input.classes)?;
        let budgets: Vec<String> = members
            .iter()
            .flat_map(|m| budgets_of(m.pod, input.budgets))
            .collect::<BTreeSet<_>>()
            .into_iter()
            .collect();
        // A gang a budget allows no disruption of is in its class's
        // protected twin (same rank, not preemptible).
        let protected = budgets
            .iter()
            .any(|b| self.budget_allows.get(b).copied().unwrap_or(0) <= 0);
        let mut tolerations: Vec<String> = Vec::new();
        for t in spec.tolerations.iter().flatten() {
            if t.effect.as_deref() == Some("PreferNoSchedule") {
                continue;
            }
            match (&t.key, t.operator.as_deref()) {
                (None, Some("Exists")) => tolerations.extend(self.all_taints.iter().cloned()),
                (Some(k), _) => tolerations.push(k.clone()),
                _ => {}
            }
        }
        // Time slices only on time-sliced nodes; whole GPUs and MIG never
        // there; pods without GPUs anywhere.
        let mut node_selector = spec.node_selector.clone().unwrap_or_default();
        if groups
            .iter()
            .any(|(r, _)| matches!(r.gpu, GpuRequest::TimeSlice { .. }))
        {
            node_selector.insert(SLICED.into(), "true".into());
        }
        if groups
            .iter()
            .all(|(r, _)| matches!(r.gpu, GpuRequest::TimeSlice { .. } | GpuRequest::None))
        {
            tolerations.push(SLICED.into());
        }
        // Shares with limits only where HAMi enforces them.
        if groups
            .iter()
            .any(|(r, _)| matches!(r.gpu, GpuRequest::Fraction { .. }))
        {
            node_selector.insert(HAMI.into(), "true".into());
        }
        let constraints = Constraints {
            node_selector,
            tolerations,
            topology: topology(p)?,
            ..Constraints::default()
        };
        let grace = spec.termination_grace_period_seconds.unwrap_or(30).max(0) as u64;
        let work = Workload {
            job: Job {
                id,
                groups: groups
                    .iter()
                    .enumerate()
                    .map(|(g, (r, v))| TaskGroup {
                        name: format!("g{g}"),
                        replicas: v.len() as u32,
                        request: r.clone(),
                    })
                    .collect(),
                constraints,
            },
            queue,
            user: p
                .metadata
                .labels
                .as_ref()
                .and_then(|l| l.get("gpuflow.io/user"))
                .cloned()
                .unwrap_or_else(|| ns.to_string()),
            class: if protected {
                class + input.classes.len()
            } else {
                class
            },
            priority: spec.priority.unwrap_or(0),
            submitted: members
                .iter()
                .map(|m| seconds(m.pod.metadata.creation_timestamp.as_ref()))
                .min()
                .unwrap_or(0),
            max_runtime: spec.active_deadline_seconds.map(|s| s.max(0) as u64),
            grace,
            expected_runtime: None,
        };
        let pods = groups
            .iter()
            .map(|(_, v)| v.iter().map(|m| pod_ref(m.pod)).collect())
            .collect();
        Ok(GangJob {
            work,
            pods,
            grace,
            budgets,
        })
    }

    fn finish(self) -> Snapshot {
        let node_names: Vec<String> = self.nodes.iter().map(|n| n.name.clone()).collect();
        let hami = self
            .holdings
            .uuids
            .iter()
            .zip(&self.nodes)
            .filter(|(u, _)| !u.is_empty())
            .map(|(u, n)| {
                let gpus = u.iter().cloned().zip(n.gpus.iter().map(|g| g.mem.0));
                (n.name.clone(), gpus.collect())
            })
            .collect();
        let cluster = Cluster::new(self.nodes).expect("node ids are their indices");
        // The placement keeps room for the shapes of the pods that wait.
        let mix = gpuflow_core::schedule::pending_mix(&self.pending);
        let mut placer = Placer::new(cluster, Policy::gpuflow(), mix, 0);
        for a in &self.fixed {
            if placer.apply(std::slice::from_ref(a)).is_err() {
                tracing::warn!(node = %node_names[a.node.0 as usize], "a node holds more than it reports");
            }
        }
        let mut queues = self.queues;
        let mut running = self.running;
        running.retain(|r| match placer.apply(&r.allocations) {
            Ok(()) => {
                if !r.flavor.is_empty() {
                    queues.charge(r.work.queue, &r.flavor, r.work.gpu_milli() as i64);
                }
                true
            }
            Err(_) => {
                tracing::warn!(
                    job = r.work.job.id.0,
                    "a running gang does not fit its nodes as reported"
                );
                false
            }
        });
        let classes = self
            .input
            .classes
            .iter()
            .cloned()
            .chain(self.input.classes.iter().map(|c| PriorityClass {
                name: format!("{} (disruption budget)", c.name),
                preemptible: false,
                ..c.clone()
            }))
            .collect();
        Snapshot {
            placer,
            queues,
            running,
            pending: self.pending,
            classes,
            gangs: self.gangs,
            node_names,
            held: self.held,
            planned: self.planned,
            budgets: self.budget_allows,
            hami,
        }
    }
}

/// A gang's class: the annotation `gpuflow.io/class` (which must name one
/// of gpuflow's classes), else the pod's `priorityClassName` when it names
/// one, else training.
fn class_of(p: &Pod, classes: &[PriorityClass]) -> Result<usize, String> {
    let default = 2.min(classes.len().saturating_sub(1));
    let find = |c: &str| classes.iter().position(|k| k.name == c);
    if let Some(c) = p
        .metadata
        .annotations
        .as_ref()
        .and_then(|a| a.get("gpuflow.io/class"))
    {
        return find(c).ok_or_else(|| {
            let names: Vec<&str> = classes.iter().map(|k| k.name.as_str()).collect();
            format!(
                "gpuflow.io/class {c:?} is not one of gpuflow's classes ({})",
                names.join(", ")
            )
        });
    }
    Ok(p.spec
        .as_ref()
        .and_then(|s| s.priority_class_name.as_deref())
        .and_then(find)
        .unwrap_or(default))
}

/// The first image of the pods that the queue does not allow, as a reason.
fn bad_image(members: &[Member], q: &GpuQueue) -> Option<String> {
    if q.spec.images.is_empty() {
        return None;
    }
    members.iter().find_map(|m| {
        let spec = m.pod.spec.as_ref()?;
        spec.containers
            .iter()
            .chain(spec.init_containers.iter().flatten())
            .filter_map(|c| c.image.as_deref())
            .find(|img| !q.spec.images.iter().any(|p| img.starts_with(p.as_str())))
            .map(|img| {
                format!(
                    "image {img} is not allowed in GpuQueue {} (allowed: {})",
                    q.metadata.name.as_deref().unwrap_or_default(),
                    q.spec.images.join(", ")
                )
            })
    })
}
