//! The `GpuQueue` custom resource: a team's queue, its quota per GPU model
//! and the namespaces whose pods it takes.

use std::collections::BTreeMap;

use kube::CustomResource;
use schemars::JsonSchema;
use serde::{Deserialize, Serialize};

/// A queue of gpuflow on Kubernetes. Cluster-scoped: its `namespaces` are
/// the teams' namespaces whose pods it schedules; a pod may also name it
/// with the label `kueue.x-k8s.io/queue-name` or `gpuflow.io/queue`, but only
/// from one of those namespaces.
#[derive(CustomResource, Serialize, Deserialize, Clone, Debug, PartialEq, JsonSchema)]
#[kube(
    group = "gpuflow.io",
    version = "v1alpha1",
    kind = "GpuQueue",
    plural = "gpuqueues",
    shortname = "gq",
    status = "GpuQueueStatus",
    printcolumn = r#"{"name":"Parent","type":"string","jsonPath":".spec.parent"}"#,
    printcolumn = r#"{"name":"Weight","type":"number","jsonPath":".spec.weight"}"#,
    printcolumn = r#"{"name":"Running","type":"integer","jsonPath":".status.runningPods"}"#,
    printcolumn = r#"{"name":"Pending","type":"integer","jsonPath":".status.pendingPods"}"#
)]
#[serde(rename_all = "camelCase", deny_unknown_fields)]
pub struct GpuQueueSpec {
    /// The parent queue's name; none for a top-level queue.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub parent: Option<String>,
    /// Fair-share weight among its siblings.
    #[serde(default = "one")]
    #[schemars(range(min = 0.000001))]
    pub weight: f64,
    /// The namespaces whose pods this queue takes.
    #[serde(default)]
    pub namespaces: Vec<String>,
    /// GPUs per GPU model (the node label `nvidia.com/gpu.product`), or `*`
    /// for every model without its own entry.
    #[serde(default)]
    pub quotas: BTreeMap<String, Quota>,
    /// Image prefixes the queue's pods may run (`registry.example.com/ml/`);
    /// empty for any image.
    #[serde(default)]
    pub images: Vec<String>,
    /// At most this many GPUs (per model) for one user's running pods.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    #[schemars(range(min = 0.0))]
    pub max_gpus_per_user: Option<f64>,
    /// Open (default), Held (nothing new starts) or Draining.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub state: Option<QueueState>,
}

fn one() -> f64 {
    1.0
}

/// A queue's GPUs of one model, in GPUs (fractions allowed).
#[derive(Serialize, Deserialize, Clone, Debug, PartialEq, JsonSchema)]
#[serde(rename_all = "camelCase", deny_unknown_fields)]
pub struct Quota {
    /// Always available to the queue (lent to others while it is idle).
    #[schemars(range(min = 0.0))]
    pub guaranteed: f64,
    /// At most this much above the guarantee, borrowed from idle queues.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    #[schemars(range(min = 0.0))]
    pub borrow_limit: Option<f64>,
    /// At most this much of the guarantee lent to others.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    #[schemars(range(min = 0.0))]
    pub lend_limit: Option<f64>,
    /// A hard cap on what the queue holds.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    #[schemars(range(min = 0.0))]
    pub cap: Option<f64>,
}

#[derive(Serialize, Deserialize, Clone, Copy, Debug, PartialEq, Eq, JsonSchema)]
pub enum QueueState {
    Open,
    Held,
    Draining,
}

/// What the scheduler reports on a queue after each cycle that changes it.
#[derive(Serialize, Deserialize, Clone, Debug, Default, PartialEq, JsonSchema)]
#[serde(rename_all = "camelCase")]
pub struct GpuQueueStatus {
    /// Pods of this queue bound (or being bound) to nodes.
    #[serde(default)]
    pub running_pods: u32,
    /// Pods waiting in this queue for the core: each has gpuflow's reason in
    /// its `PodScheduled` condition.
    #[serde(default)]
    pub pending_pods: u32,
    /// GPUs in use per GPU model (MIG instances by their share of a GPU),
    /// this queue and its children together.
    #[serde(default)]
    pub gpus_in_use: BTreeMap<String, f64>,
}
