//! The API's job, task and configuration types as the scheduling core's:
//! one place for the conversions the cycle, the snapshot, quota reports
//! and submission checks share.

use gpuflow_api as api;
use gpuflow_core::ids::{CpuMilli, GpuMilli, MemMib};
use gpuflow_core::request::{GpuRequest, TaskRequest};
use gpuflow_core::schedule::{self, Config};

/// The core's configuration for the server's cycles.
pub(crate) fn config(server: &crate::Config) -> Config {
    Config {
        min_runtime: server.min_runtime_s,
        max_unsaved: server.max_unsaved_s,
        consolidate_max_unsaved: server.consolidate_max_unsaved_s,
        lease_horizon: server.lease_horizon_s,
        disruption_budget: server.disruption_budget,
        disruption_max_jobs: server.disruption_max_jobs,
        budget_patience: server.budget_patience_s,
        tries_per_cycle: server.tries_per_cycle,
        classes: classes(),
        ..Config::default()
    }
}

/// The core's priority classes: the four gpuflow ships with, then each
/// again for the jobs of a project whose budget is spent and stops
/// borrowing (same rank, but held to its queue's guarantee).
pub(crate) fn classes() -> Vec<schedule::PriorityClass> {
    let base = schedule::default_classes();
    let spent = base.iter().map(|c| schedule::PriorityClass {
        name: format!("{} (project budget spent)", c.name),
        may_borrow: false,
        may_lease: false,
        ..c.clone()
    });
    base.clone().into_iter().chain(spent).collect()
}

pub(crate) fn milli(gpus: f64) -> u64 {
    (gpus * 1000.0).round() as u64
}

/// What a job counts in quota and fair share, in milli-GPU (MIG instances
/// and time slices by their equivalents, as the core counts them).
pub fn quota_milli(spec: &api::JobSpec) -> u64 {
    spec.tasks
        .iter()
        .map(|g| gpu_request(g).quota_milli() * g.replicas as u64)
        .sum()
}

/// A task group's request as the core sees it.
pub fn task_request(g: &gpuflow_api::TaskGroupSpec) -> TaskRequest {
    let r = &g.resources;
    TaskRequest {
        cpu: CpuMilli((r.cpu * 1000.0).round() as u64),
        mem: MemMib(r.memory_mib),
        gpu: gpu_request(g),
        models: r.gpu.as_ref().map(|g| g.models.clone()).unwrap_or_default(),
    }
}

/// The GPU part of [`task_request`] alone (no copy of the models).
pub fn gpu_request(g: &gpuflow_api::TaskGroupSpec) -> GpuRequest {
    let r = &g.resources;
    match &r.gpu {
        None => GpuRequest::None,
        Some(s) => match s.mode {
            api::GpuMode::Whole => GpuRequest::Whole {
                count: s.count.unwrap_or(1).min(u8::MAX as u32) as u8,
            },
            api::GpuMode::Mig => GpuRequest::Mig {
                profile: s.profile.clone().unwrap_or_default(),
            },
            api::GpuMode::Fraction => GpuRequest::Fraction {
                milli: GpuMilli(s.milli() as u32),
                mem: MemMib(s.memory_mib.unwrap_or(0)),
            },
            api::GpuMode::TimeSlice => GpuRequest::TimeSlice {
                mem: MemMib(s.memory_mib.unwrap_or(0)),
            },
        },
    }
}
