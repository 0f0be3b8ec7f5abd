//! Per-task GPU use from the GPUs' samples: each compute process NVML
//! lists is traced to its task (its cgroup, else its process group), and
//! each task's utilisation and GPU memory are folded into its usage. A task
//! that shares a GPU and holds more GPU memory than its share is killed
//! (the watchdog), reported with what it used against its limit.

use std::collections::BTreeMap;

use gpuflow_api::{Breach, GpuInfo, GpuSample};

use crate::gpu::GpuProcess;
use crate::task::{Key, Task};

/// A process's cgroups (as `/proc/PID/cgroup` lists them) and process group.
fn identity(pid: u32) -> (String, Option<i32>) {
    let cgroups = std::fs::read_to_string(format!("/proc/{pid}/cgroup")).unwrap_or_default();
    let pgrp = procfs::process::Process::new(pid as i32)
        .and_then(|p| p.stat())
        .ok()
        .map(|s| s.pgrp);
    (cgroups, pgrp)
}

fn gib(mib: u64) -> f64 {
    mib as f64 / 1024.0
}

/// Folds one round of samples into the running tasks' usage and enforces
/// GPU-memory limits. `inventory` maps GPU indices to UUIDs.
pub fn account(
    tasks: &mut BTreeMap<Key, Task>,
    inventory: &[GpuInfo],
    samples: &[GpuSample],
    procs: &[GpuProcess],
    now: u64,
) {
    // Each process's task, looked up once per process.
    let mut mine: BTreeMap<Key, Vec<&GpuProcess>> = BTreeMap::new();
    for p in procs {
        let (cgroups, pgrp) = identity(p.pid);
        if let Some(t) = tasks
            .values()
            .find(|t| t.running() && t.owns(&cgroups, pgrp))
        {
            mine.entry(t.key).or_default().push(p);
        }
    }
    let util_of = |index: u32| -> Option<u32> {
        let uuid = &inventory.iter().find(|g| g.index == index)?.uuid;
        samples.iter().find(|s| &s.uuid == uuid).map(|s| s.util_pct)
    };
    for t in tasks
        .values_mut()
        .filter(|t| t.running() && !t.gpus.is_empty())
    {
        // Nothing is known of GPUs nobody sampled (emulated ones): no
        // usage, rather than a utilisation of 0 that would look idle.
        if t.gpus.iter().all(|&i| util_of(i).is_none()) {
            continue;
        }
        let its = mine.get(&t.key).map_or(&[][..], Vec::as_slice);
        let memory: u64 = its.iter().map(|p| p.memory_mib).sum();
        let per_process: Vec<u32> = its.iter().filter_map(|p| p.sm_util).collect();
        let util = if !per_process.is_empty() {
            (per_process.iter().sum::<u32>() / t.gpus.len() as u32).min(100)
        } else if t.limits.gpu_percent == 0 {
            // Whole GPUs: theirs is the GPUs' utilisation.
            let u: Vec<u32> = t.gpus.iter().filter_map(|&i| util_of(i)).collect();
            if u.is_empty() {
                0
            } else {
                u.iter().sum::<u32>() / u.len() as u32
            }
        } else {
            0
        };
        t.account(util, memory, now);
        let limit = t.limits.gpu_memory_mib;
        if limit > 0 && memory > limit {
            t.fail(
                Breach::GpuMemory,
                format!(
                    "used {:.1} GiB of its {:.1} GiB GPU-memory limit (its share of the GPU)",
                    gib(memory),
                    gib(limit)
                ),
            );
        }
    }
}
