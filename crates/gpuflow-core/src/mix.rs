//! The workload mix and the fragmentation measure built on it.
//!
//! Following the FGD paper (Weng et al., "Beware of Fragmentation", USENIX ATC'23),
//! a node's free GPU capacity is *fragmented for a task shape* when that shape
//! cannot use it: all of it when the shape does not fit the node at all (too
//! little CPU or memory, no accepted model, too few suitable GPUs), otherwise the
//! free share of each GPU that is too small for the shape. A node's fragmentation
//! is the expectation of that over the mix of shapes the cluster sees. Placing a
//! task so that this expectation grows least keeps capacity usable for what comes.
//!
//! Host memory is left out of the shapes, as in the paper; MIG and time-sliced
//! tasks do not enter the mix (they fragment nothing in milli-GPU terms). Tasks
//! that need no GPU enter it only when asked ([`Typical::cpu_tasks`], as the
//! paper's simulator does): all free GPU capacity is fragmented for them.

use std::collections::BTreeMap;

use crate::ids::CpuMilli;
use crate::model::{GpuHealth, Node};
use crate::request::{GpuRequest, TaskGroup, TaskRequest};

/// Which tasks' shapes form a policy's mix.
#[derive(Clone, Copy, Debug, PartialEq)]
pub struct Typical {
    /// Share of the tasks covered, most common shapes first (0 < coverage ≤ 1).
    pub coverage: f64,
    /// Whether tasks that need no GPU enter the mix.
    pub cpu_tasks: bool,
}

impl Typical {
    /// Every GPU task's shape.
    pub const ALL_GPU: Typical = Typical {
        coverage: 1.0,
        cpu_tasks: false,
    };
    /// The FGD paper's simulator: the most common shapes of all tasks, with
    /// and without GPUs, until they cover 95 % of them.
    pub const PAPER: Typical = Typical {
        coverage: 0.95,
        cpu_tasks: true,
    };
}

/// One task shape of the mix and its share of arrivals.
#[derive(Clone, Debug, PartialEq)]
pub struct MixShape {
    pub cpu: CpuMilli,
    /// Milli-GPU per GPU (1000 for whole GPUs, 0 for a task without GPUs).
    pub milli: u32,
    /// GPUs per task (1 for a fractional task, 0 for a task without GPUs).
    pub count: u32,
    /// Accepted models; empty for any.
    pub models: Vec<String>,
    /// Share of this shape, summing to 1 over the mix.
    pub weight: f64,
}

/// The task shapes a cluster expects, with their shares.
#[derive(Clone, Debug, Default, PartialEq)]
pub struct WorkloadMix {
    pub shapes: Vec<MixShape>,
}

/// How each task counts when shapes are tallied.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Default)]
pub enum MixWeighting {
    /// Every task counts one (the paper's popularity).
    #[default]
    Tasks,
    /// Every task counts its GPU request: big tasks matter as much as the GPUs they need.
    Gpus,
}

impl WorkloadMix {
    /// Tallies the shapes of `tasks` and keeps the most common ones until they
    /// cover `coverage` (0 < coverage ≤ 1) of the total, renormalised.
    pub fn from_tasks<'a>(
        tasks: impl IntoIterator<Item = &'a TaskRequest>,
        weighting: MixWeighting,
        coverage: f64,
    ) -> WorkloadMix {
        WorkloadMix::from_counted(tasks.into_iter().map(|t| (t, 1)), weighting, coverage)
    }

    /// The mix of the tasks of these task groups (the schedulers pass the
    /// pending jobs'): each replica counts.
    pub fn from_groups<'a>(
        groups: impl IntoIterator<Item = &'a TaskGroup>,
        weighting: MixWeighting,
        coverage: f64,
    ) -> WorkloadMix {
        WorkloadMix::from_counted(
            groups.into_iter().map(|g| (&g.request, g.replicas)),
            weighting,
            coverage,
        )
    }

    /// As [`WorkloadMix::from_tasks`], for task shapes given with how many
    /// tasks have them (a task group and its replicas): a gang of eight
    /// tasks counts eight times, as eight pods would.
    pub fn from_counted<'a>(
        tasks: impl IntoIterator<Item = (&'a TaskRequest, u32)>,
        weighting: MixWeighting,
        coverage: f64,
    ) -> WorkloadMix {
        WorkloadMix::typical_counted(
            tasks,
            weighting,
            Typical {
                coverage,
                cpu_tasks: false,
            },
        )
    }

    /// Tallies the shapes of `tasks` as `typical` says: the most common ones
    /// until they cover its share of the total, renormalised.
    pub fn typical<'a>(
        tasks: impl IntoIterator<Item = &'a TaskRequest>,
        weighting: MixWeighting,
        typical: Typical,
    ) -> WorkloadMix {
        WorkloadMix::typical_counted(tasks.into_iter().map(|t| (t, 1)), weighting, typical)
    }

    /// As [`WorkloadMix::typical`], each shape given with its number of tasks.
    fn typical_counted<'a>(
        tasks: impl IntoIterator<Item = (&'a TaskRequest, u32)>,
        weighting: MixWeighting,
        typical: Typical,
    ) -> WorkloadMix {
        let coverage = typical.coverage;
        // Each shape's weight, in the order first seen, found through
        // `index` (or as the last task's: shapes come in runs); each task's
        // weight is added to its shape's sum in the order given, so the sums
        // do not depend on how they are found. 100,000 pending tasks are
        // tallied every cycle.
        type Key<'k> = (u64, u32, u32, &'k [String]);
        let mut tally: Vec<(Key<'a>, f64)> = Vec::new();
        let mut index: rustc_hash::FxHashMap<Key<'a>, usize> = Default::default();
        let mut last: Option<usize> = None;
        for (t, n) in tasks {
            let (milli, count) = match &t.gpu {
                GpuRequest::Whole { count } if *count > 0 => (1000, *count as u32),
                GpuRequest::Fraction { milli, .. } if milli.0 > 0 => (milli.0, 1),
                GpuRequest::None | GpuRequest::Whole { .. } | GpuRequest::Fraction { .. }
                    if typical.cpu_tasks =>
                {
                    (0, 0)
                }
                _ => continue,
            };
            let w = n as f64
                * match weighting {
                    MixWeighting::Tasks => 1.0,
                    MixWeighting::Gpus => (milli * count) as f64 / 1000.0,
                };
            let key: Key<'a> = (t.cpu.0, milli, count, &t.models);
            let i = match last {
                Some(i) if tally[i].0 == key => i,
                _ => *index.entry(key).or_insert_with(|| {
                    tally.push((key, 0.0));
                    tally.len() - 1
                }),
            };
            last = Some(i);
            tally[i].1 += w;
        }
        // In key order, as the total and the ties below are read.
        tally.sort_unstable_by(|a, b| a.0.cmp(&b.0));
        let total: f64 = tally.iter().map(|(_, w)| w).sum();
        let mut shapes: Vec<MixShape> = tally
            .into_iter()
            .map(|((cpu, milli, count, models), w)| MixShape {
                cpu: CpuMilli(cpu),
                milli,
                count,
                models: models.to_vec(),
                weight: w,
            })
            .collect();
        // Most common first; ties keep the key order, so the result is deterministic.
        shapes.sort_by(|a, b| b.weight.total_cmp(&a.weight));
        let mut kept = 0.0;
        let mut n = 0;
        while n < shapes.len() && kept < coverage * total {
            kept += shapes[n].weight;
            n += 1;
        }
        shapes.truncate(n);
        for s in &mut shapes {
            s.weight /= kept;
        }
        WorkloadMix { shapes }
    }

    /// Expected milli-GPU per milli-CPU of the mix's tasks (0 for an empty mix).
    pub fn gpu_milli_per_cpu_milli(&self) -> f64 {
        let gpu: f64 = self
            .shapes
            .iter()
            .map(|s| s.weight * (s.milli * s.count) as f64)
            .sum();
        let cpu: f64 = self.shapes.iter().map(|s| s.weight * s.cpu.0 as f64).sum();
        if cpu > 0.0 { gpu / cpu } else { 0.0 }
    }

    /// Pressure per GPU model: the GPU demand of shapes restricted to a set of
    /// models that includes it (shared equally among the set's models present
    /// in the cluster), divided by the model's share of the cluster's GPUs.
    /// `gpus_by_model` counts the cluster's GPUs per model.
    pub fn model_pressure(&self, gpus_by_model: &BTreeMap<String, u64>) -> Vec<(String, f64)> {
        let total: u64 = gpus_by_model.values().sum();
        let mut demand: BTreeMap<&str, f64> = BTreeMap::new();
        for s in self.shapes.iter().filter(|s| !s.models.is_empty()) {
            let present: Vec<&String> = s
                .models
                .iter()
                .filter(|m| gpus_by_model.contains_key(*m))
                .collect();
            let gpus = s.weight * (s.milli * s.count) as f64 / 1000.0;
            for m in &present {
                *demand.entry(m.as_str()).or_default() += gpus / present.len() as f64;
            }
        }
        gpus_by_model
            .iter()
            .map(|(m, &n)| {
                let share = n as f64 / total.max(1) as f64;
                (
                    m.clone(),
                    demand.get(m.as_str()).copied().unwrap_or(0.0) / share.max(f64::MIN_POSITIVE),
                )
            })
            .collect()
    }

    pub fn is_empty(&self) -> bool {
        self.shapes.is_empty()
    }
}

/// Expected fragmented GPU capacity of a node, in milli-GPU, given its free CPU
/// and the free compute share of each GPU (0 for GPUs that take no whole or
/// fractional work: exclusive, MIG, time-sliced or unhealthy).
pub fn fragmentation(node: &Node, free_cpu: u64, free_milli: &[u32], mix: &WorkloadMix) -> f64 {
    let total: u64 = free_milli.iter().map(|&m| m as u64).sum();
    if total == 0 {
        return 0.0;
    }
    let mut frag = 0.0;
    for s in &mix.shapes {
        let accepts =
            |i: usize| s.models.is_empty() || s.models.iter().any(|m| *m == node.gpus[i].model);
        let lost = if s.cpu.0 > free_cpu || s.count == 0 {
            total
        } else {
            // GPUs this shape could use, and the free share it could not.
            let mut fitting = 0u32;
            let mut lost = 0u64;
            for (i, &m) in free_milli.iter().enumerate() {
                if m >= s.milli && accepts(i) {
                    fitting += 1;
                } else {
                    lost += m as u64;
                }
            }
            if fitting >= s.count { lost } else { total }
        };
        frag += s.weight * lost as f64;
    }
    frag
}

/// The free compute share of each GPU of a node, in milli-GPU, for [`fragmentation`].
pub(crate) fn free_milli(node: &Node, usage: &crate::cluster::NodeUsage, out: &mut Vec<u32>) {
    out.clear();
    out.extend(node.gpus.iter().zip(&usage.gpus).map(|(g, u)| {
        if g.health != GpuHealth::Healthy || g.mig_enabled() {
            0
        } else {
            u.free_milli()
        }
    }));
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::ids::{GpuMilli, MemMib};
    use crate::model::Gpu;

    fn task(cpu: u64, gpu: GpuRequest) -> TaskRequest {
        TaskRequest {
            cpu: CpuMilli(cpu),
            mem: MemMib(0),
            gpu,
            models: vec![],
        }
    }

    #[test]
    fn fragmentation_counts_what_each_shape_cannot_use() {
        let node = Node::new(
            0,
            "n",
            CpuMilli(64_000),
            MemMib(1 << 20),
            vec![Gpu::plain("V100", MemMib(16_384)); 2],
        );
        let half = GpuRequest::Fraction {
            milli: GpuMilli(500),
            mem: MemMib(0),
        };
        let mix = WorkloadMix::from_tasks(
            &[
                task(1000, half.clone()),
                task(1000, GpuRequest::Whole { count: 1 }),
            ],
            MixWeighting::Tasks,
            1.0,
        );
        assert_eq!(mix.shapes.len(), 2);
        // One GPU with 300 free, one idle: the half-GPU shape loses the 300, and so
        // does the whole-GPU shape.
        assert_eq!(fragmentation(&node, 64_000, &[300, 1000], &mix), 300.0);
        // Both GPUs at 300: nothing fits, everything is lost for both shapes.
        assert_eq!(fragmentation(&node, 64_000, &[300, 300], &mix), 600.0);
        // No CPU left: all free GPU is lost.
        assert_eq!(fragmentation(&node, 0, &[1000, 1000], &mix), 2000.0);
    }

    #[test]
    fn the_papers_mix_counts_tasks_without_gpus_and_loses_all_free_gpu_to_them() {
        let node = Node::new(
            0,
            "n",
            CpuMilli(64_000),
            MemMib(1 << 20),
            vec![Gpu::plain("V100", MemMib(16_384)); 2],
        );
        let mut tasks = vec![task(1000, GpuRequest::Whole { count: 1 }); 3];
        tasks.push(task(8000, GpuRequest::None));
        let gpu_only = WorkloadMix::typical(&tasks, MixWeighting::Tasks, Typical::ALL_GPU);
        assert_eq!(gpu_only.shapes.len(), 1);
        let paper = WorkloadMix::typical(&tasks, MixWeighting::Tasks, Typical::PAPER);
        assert_eq!(paper.shapes.len(), 2);
        let cpu = paper.shapes.iter().find(|s| s.count == 0).unwrap();
        assert_eq!((cpu.milli, cpu.weight), (0, 0.25));
        // An idle node: the whole-GPU shape loses nothing, the CPU-only shape
        // all 2000 milli-GPU, a quarter of the mix.
        assert_eq!(fragmentation(&node, 64_000, &[1000, 1000], &paper), 500.0);
        assert_eq!(fragmentation(&node, 64_000, &[1000, 1000], &gpu_only), 0.0);
        // The CPU ratio of the mix counts CPU-only tasks too.
        assert!(paper.gpu_milli_per_cpu_milli() < gpu_only.gpu_milli_per_cpu_milli());
    }

    /// A gang of eight 8-GPU tasks is eight tasks of the mix, as eight pods
    /// are in the FGD paper's popularity, not one.
    #[test]
    fn every_replica_of_a_task_group_counts_in_the_mix() {
        let gang = TaskGroup {
            name: "workers".into(),
            replicas: 8,
            request: task(64_000, GpuRequest::Whole { count: 8 }),
        };
        let single = TaskGroup {
            name: "main".into(),
            replicas: 1,
            request: task(8_000, GpuRequest::Whole { count: 1 }),
        };
        let mut groups = vec![gang];
        groups.extend(std::iter::repeat_n(single, 24));
        let mix = WorkloadMix::from_groups(&groups, MixWeighting::Tasks, 1.0);
        let weight = |count| mix.shapes.iter().find(|s| s.count == count).unwrap().weight;
        assert_eq!((weight(8), weight(1)), (0.25, 0.75));
        let by_gpus = WorkloadMix::from_groups(&groups, MixWeighting::Gpus, 1.0);
        let weight = |count| {
            by_gpus
                .shapes
                .iter()
                .find(|s| s.count == count)
                .unwrap()
                .weight
        };
        assert_eq!((weight(8), weight(1)), (64.0 / 88.0, 24.0 / 88.0));
    }

    #[test]
    fn coverage_keeps_the_most_common_shapes() {
        let mut tasks = vec![task(1000, GpuRequest::Whole { count: 1 }); 8];
        tasks.push(task(2000, GpuRequest::Whole { count: 8 }));
        let all = WorkloadMix::from_tasks(&tasks, MixWeighting::Tasks, 1.0);
        assert_eq!(all.shapes.len(), 2);
        let top = WorkloadMix::from_tasks(&tasks, MixWeighting::Tasks, 0.8);
        assert_eq!(top.shapes.len(), 1);
        assert_eq!(top.shapes[0].weight, 1.0);
        // Weighted by GPUs, the 8-GPU shape is half of the demand.
        let by_gpu = WorkloadMix::from_tasks(&tasks, MixWeighting::Gpus, 1.0);
        assert_eq!(by_gpu.shapes[0].weight, 0.5);
    }
}
