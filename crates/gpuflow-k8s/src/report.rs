//! What the scheduler reports to a gpuflow control plane
//! (`PUT /v1/clusters/{cluster}/workloads`): each gang it runs or keeps
//! waiting, with its team, user, kind, pods' resources, the GPUs it holds
//! and why it waits, so that Kubernetes work appears in the control
//! plane's accounting, reports and dashboard. Pure: built from a cycle's
//! snapshot and plan.

use std::collections::BTreeMap;

use gpuflow_api as api;
use gpuflow_core::ids::JobId;
use gpuflow_core::request::{GpuRequest, TaskRequest};
use gpuflow_core::schedule::{Pending, Plan, Workload};

use crate::crd::GpuQueue;
use crate::snapshot::{Gang, Snapshot};

/// A waiting gang's explanation: the core's reasons, its position and,
/// when known, its expected start.
pub fn pending_message(p: &Pending, queue: &str) -> String {
    let reasons: Vec<String> = p.reasons.iter().map(ToString::to_string).collect();
    let mut msg = if reasons.is_empty() {
        "gpuflow: waiting for the next cycle".to_string()
    } else {
        format!("gpuflow: {}", reasons.join("; "))
    };
    msg.push_str(&format!("; position {} in queue {queue}", p.position));
    if let Some(eta) = p.eta {
        let at = k8s_openapi::jiff::Timestamp::from_second(eta as i64)
            .map(|t| t.to_string())
            .unwrap_or_default();
        msg.push_str(&format!("; expected to start by {at}"));
    }
    msg
}

fn resources(r: &TaskRequest) -> api::Resources {
    let gpu = match &r.gpu {
        GpuRequest::None => None,
        GpuRequest::Whole { count } => Some(api::GpuSpec {
            count: Some(u32::from(*count)),
            ..api::GpuSpec::default()
        }),
        GpuRequest::Mig { profile } => Some(api::GpuSpec {
            mode: api::GpuMode::Mig,
            profile: Some(profile.clone()),
            ..api::GpuSpec::default()
        }),
        GpuRequest::Fraction { milli, mem } => Some(api::GpuSpec {
            mode: api::GpuMode::Fraction,
            fraction: Some(f64::from(milli.0) / 1000.0),
            memory_mib: (mem.0 > 0).then_some(mem.0),
            ..api::GpuSpec::default()
        }),
        GpuRequest::TimeSlice { mem } => Some(api::GpuSpec {
            mode: api::GpuMode::TimeSlice,
            memory_mib: (mem.0 > 0).then_some(mem.0),
            ..api::GpuSpec::default()
        }),
    };
    api::Resources {
        cpu: r.cpu.0 as f64 / 1000.0,
        memory_mib: r.mem.0,
        gpu,
    }
}

/// The kind a class stands for (its protected twin's too); training for
/// a class of another name.
fn kind(class: &str) -> api::Kind {
    match class.split(" (").next().unwrap_or(class) {
        "inference" => api::Kind::Inference,
        "notebook" => api::Kind::Notebook,
        "batch" => api::Kind::Batch,
        _ => api::Kind::Training,
    }
}

/// One gang's part (running or pending) as a workload.
fn workload(
    ns: &str,
    gang: &Gang,
    w: &Workload,
    snap: &Snapshot,
    teams: &BTreeMap<&str, &str>,
) -> api::ExternalWorkload {
    let pods: Vec<_> = gang.all().collect();
    let name = match pods.as_slice() {
        [one] => one.name.clone(),
        _ => gang.key.clone(),
    };
    api::ExternalWorkload {
        key: format!("{ns}/{}", gang.key),
        name,
        team: teams
            .get(gang.queue.as_str())
            .map_or_else(|| gang.queue.clone(), |t| t.to_string()),
        user: w.user.clone(),
        queue: gang.queue.clone(),
        kind: kind(snap.classes.get(w.class).map_or("", |c| c.name.as_str())),
        priority: w.priority,
        submitted_at: w.submitted,
        tasks: w
            .job
            .groups
            .iter()
            .map(|g| api::ExternalTasks {
                replicas: g.replicas,
                resources: resources(&g.request),
            })
            .collect(),
        running: None,
        reason: String::new(),
    }
}

/// The cycle's workloads: running gangs with what they hold, gangs the
/// cycle admitted as running from `now`, waiting gangs with why. A gang
/// with pods both bound and waiting is one workload, running.
pub fn workloads(
    snap: &Snapshot,
    plan: &Plan,
    queues: &[&GpuQueue],
    now: u64,
) -> api::WorkloadReport {
    let teams: BTreeMap<&str, &str> = queues
        .iter()
        .filter_map(|q| Some((q.metadata.name.as_deref()?, q.spec.team.as_deref()?)))
        .collect();
    let ns_of = |g: &Gang| {
        g.all()
            .next()
            .map(|p| p.namespace.clone())
            .unwrap_or_default()
    };
    let mut out: BTreeMap<String, api::ExternalWorkload> = BTreeMap::new();
    let pending: BTreeMap<JobId, &Workload> = snap.pending.iter().map(|w| (w.job.id, w)).collect();
    for r in &snap.running {
        let Some(g) = snap.gangs.get(&r.work.job.id) else {
            continue;
        };
        let mut w = workload(&ns_of(g), g, &r.work, snap, &teams);
        w.running = Some(api::ExternalHold {
            since: r.started,
            gpu_milli: r.allocations.iter().map(|a| a.gpu.quota_milli()).sum(),
            model: r.flavor.clone(),
        });
        out.insert(w.key.clone(), w);
    }
    for (id, flavor, placement) in &plan.admitted {
        let (Some(g), Some(work)) = (snap.gangs.get(id), pending.get(id)) else {
            continue;
        };
        let mut w = workload(&ns_of(g), g, work, snap, &teams);
        let milli: u64 = placement.iter().map(|a| a.gpu.quota_milli()).sum();
        match out.get_mut(&w.key) {
            // The rest of a gang that runs: it holds more now.
            Some(running) => {
                if let Some(h) = running.running.as_mut() {
                    h.gpu_milli += milli;
                }
            }
            None => {
                w.running = Some(api::ExternalHold {
                    since: now,
                    gpu_milli: milli,
                    model: flavor.clone(),
                });
                out.insert(w.key.clone(), w);
            }
        }
    }
    for p in &plan.pending {
        let (Some(g), Some(work)) = (snap.gangs.get(&p.job), pending.get(&p.job)) else {
            continue;
        };
        let mut w = workload(&ns_of(g), g, work, snap, &teams);
        if out.contains_key(&w.key) {
            continue;
        }
        w.reason = pending_message(p, &g.queue);
        out.insert(w.key.clone(), w);
    }
    api::WorkloadReport {
        workloads: out.into_values().collect(),
    }
}
