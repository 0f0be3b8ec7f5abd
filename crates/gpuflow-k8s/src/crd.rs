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
    /// GPU-hours the queue (with its children) may use per period.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub budget: Option<Budget>,
    /// Open (default), Held (nothing new starts) or Draining.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub state: Option<QueueState>,
    /// The team of a gpuflow control plane its pods are charged to, when
    /// the scheduler reports to one (`gpuflow k8s run --control-plane`);
    /// default: the queue's name.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub team: Option<String>,
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

/// A GPU-hour budget per calendar period (UTC). As it is used up, the
/// queue's fair-share weight falls; once it is all used, the queue stops
/// borrowing or starts nothing new until the next period.
#[derive(Serialize, Deserialize, Clone, Debug, PartialEq, JsonSchema)]
#[serde(rename_all = "camelCase", deny_unknown_fields)]
pub struct Budget {
    /// GPU-hours per period (MIG instances and time slices by their share
    /// of a GPU).
    #[schemars(range(min = 0.0))]
    pub gpu_hours: f64,
    /// Day, Week (from Monday) or Month, in UTC.
    pub period: Period,
    /// Once it is used up: StopBorrowing (default; work within the
    /// guarantee still starts) or StopAdmitting.
    #[serde(default)]
    pub when_exhausted: WhenExhausted,
    /// The share of the budget after which the weight starts to fall.
    #[serde(default = "taper_from")]
    #[schemars(range(min = 0.0, max = 1.0))]
    pub taper_from: f64,
    /// The weight's factor once the budget is used up.
    #[serde(default = "min_weight_factor")]
    #[schemars(range(min = 0.0, max = 1.0))]
    pub min_weight_factor: f64,
}

fn taper_from() -> f64 {
    0.8
}

fn min_weight_factor() -> f64 {
    0.25
}

#[derive(Serialize, Deserialize, Clone, Copy, Debug, PartialEq, Eq, JsonSchema)]
pub enum Period {
    Day,
    Week,
    Month,
}

#[derive(Serialize, Deserialize, Clone, Copy, Debug, Default, PartialEq, Eq, JsonSchema)]
pub enum WhenExhausted {
    /// Work within the guarantee still starts.
    #[default]
    StopBorrowing,
    StopAdmitting,
}

impl Period {
    /// The start (UTC, seconds) of the period holding `t`; weeks start on Monday.
    pub fn start(self, t: u64) -> u64 {
        let day = t / 86_400;
        match self {
            Period::Day => day * 86_400,
            // 1970-01-01 was a Thursday: Monday is 3 days before.
            Period::Week => (day - (day + 3) % 7) * 86_400,
            Period::Month => {
                let date = k8s_openapi::jiff::Timestamp::from_second(t as i64)
                    .map(|ts| ts.to_zoned(k8s_openapi::jiff::tz::TimeZone::UTC).date())
                    .unwrap_or_default();
                date.first_of_month()
                    .to_zoned(k8s_openapi::jiff::tz::TimeZone::UTC)
                    .map_or(0, |z| z.timestamp().as_second().max(0) as u64)
            }
        }
    }
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
    /// GPU-hours used of the budget in its current period.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub budget_used_gpu_hours: Option<f64>,
}

#[cfg(test)]
mod tests {
    use super::Period;

    #[test]
    fn periods_start_at_midnight_monday_and_the_first_of_the_month_utc() {
        // 2026-12-04 12:00:00 UTC, a Friday.
        let t = 1_796_385_600;
        assert_eq!(Period::Day.start(t), 1_796_342_400);
        assert_eq!(Period::Week.start(t), 1_796_342_400 - 4 * 86_400);
        assert_eq!(Period::Month.start(t), 1_796_342_400 - 3 * 86_400);
    }
}
