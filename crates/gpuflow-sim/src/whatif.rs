//! Capacity planning: the cluster's own recorded workload replayed, by the
//! same simulator and core, against the cluster as it is and as it would
//! be with nodes added or removed or guarantees changed; the two runs side
//! by side (waits, utilisation, cost, each team's share).
//!
//! The recorded workload arrives as plain rows (the platform's
//! `/v1/reports/workload`, mapped by the caller); everything here is pure.

use std::collections::BTreeMap;

use gpuflow_core::{GpuMilli, GpuRequest, MemMib};

use crate::SimError;
use crate::dynamic::{self, SimConfig, SimPolicy, SimResult};
use crate::workload::{ClusterSpec, NodeGroup, QueueSpec, TraceJob};

/// A change to the cluster.
#[derive(Clone, Debug, PartialEq)]
pub enum Change {
    /// `count` nodes of `gpus` GPUs of `model` more.
    AddNodes {
        count: u32,
        gpus: u32,
        model: String,
    },
    /// `count` nodes of `model` fewer (the largest of that model first).
    RemoveNodes { count: u32, model: String },
    /// A team's guarantee on a model set to `gpus`.
    Guarantee {
        team: String,
        model: String,
        gpus: u64,
    },
}

impl Change {
    /// Parses `2x8xH100` (add), `-1xH100` (remove) and `team=H100:16`
    /// (guarantee).
    ///
    /// # Errors
    /// A message saying what the forms are.
    pub fn parse(s: &str) -> Result<Change, String> {
        let bad = || {
            format!(
                "{s:?}: give NODESxGPUSxMODEL to add nodes (2x8xH100), -NODESxMODEL to remove them (-1xH100), or TEAM=MODEL:GPUS to set a guarantee (vision=H100:16)"
            )
        };
        if let Some((team, rest)) = s.split_once('=') {
            let (model, gpus) = rest.rsplit_once(':').ok_or_else(bad)?;
            return Ok(Change::Guarantee {
                team: team.to_string(),
                model: model.to_string(),
                gpus: gpus.parse().map_err(|_| bad())?,
            });
        }
        if let Some(rest) = s.strip_prefix('-') {
            let (count, model) = rest.split_once('x').ok_or_else(bad)?;
            return Ok(Change::RemoveNodes {
                count: count.parse().map_err(|_| bad())?,
                model: model.to_string(),
            });
        }
        let mut parts = s.splitn(3, 'x');
        let (Some(count), Some(gpus), Some(model)) = (parts.next(), parts.next(), parts.next())
        else {
            return Err(bad());
        };
        let (count, gpus) = (
            count.parse().map_err(|_| bad())?,
            gpus.parse().map_err(|_| bad())?,
        );
        if count == 0 || gpus == 0 || gpus > 64 || model.is_empty() {
            return Err(bad());
        }
        Ok(Change::AddNodes {
            count,
            gpus,
            model: model.to_string(),
        })
    }

    /// Applies the change to a cluster.
    ///
    /// # Errors
    /// When there is nothing to remove or no such team.
    pub fn apply(&self, spec: &mut ClusterSpec) -> Result<(), String> {
        match self {
            Change::AddNodes { count, gpus, model } => {
                // New nodes are like the cluster's nodes of that model.
                let like = spec.nodes.iter().find(|g| &g.model == model);
                let (cpu, mem_gib) = like
                    .map_or((u64::from(*gpus) * 8, u64::from(*gpus) * 64), |g| {
                        (g.cpu, g.mem_gib)
                    });
                spec.nodes.push(NodeGroup {
                    count: *count,
                    gpus: *gpus,
                    model: model.clone(),
                    cpu,
                    mem_gib,
                    rack_size: None,
                });
            }
            Change::RemoveNodes { count, model } => {
                let mut left = *count;
                let mut groups: Vec<&mut NodeGroup> = spec
                    .nodes
                    .iter_mut()
                    .filter(|g| &g.model == model)
                    .collect();
                groups.sort_by_key(|g| std::cmp::Reverse(g.gpus));
                let have: u32 = groups.iter().map(|g| g.count).sum();
                if have < *count {
                    return Err(format!(
                        "cannot remove {count} {model} nodes: the cluster has {have}"
                    ));
                }
                for g in groups {
                    let n = g.count.min(left);
                    g.count -= n;
                    left -= n;
                }
                spec.nodes.retain(|g| g.count > 0);
                if spec.nodes.is_empty() {
                    return Err("no node would be left".into());
                }
            }
            Change::Guarantee { team, model, gpus } => {
                let q = spec
                    .queues
                    .iter_mut()
                    .find(|q| &q.name == team)
                    .ok_or_else(|| format!("no team {team:?} in the recorded workload"))?;
                q.guaranteed.insert(model.clone(), *gpus);
            }
        }
        Ok(())
    }
}

/// A recorded job, as the platform reports it.
#[derive(Clone, Debug, PartialEq)]
pub struct Recorded {
    pub id: u64,
    pub submitted_at: u64,
    pub duration_s: u64,
    pub tasks: u32,
    pub gpus_per_task: u32,
    /// A task's share of one GPU, in thousandths, when shared.
    pub milli: Option<u32>,
    pub team: String,
    /// Index into [`crate::workload::KINDS`].
    pub kind: usize,
    pub priority: i32,
    pub max_runtime_s: Option<u64>,
    pub model: String,
}

/// The recorded jobs as a trace: times from the first submission, each job
/// kept on the model it ran on while the cluster has that model.
pub fn trace(recorded: &[Recorded], spec: &ClusterSpec) -> Vec<TraceJob> {
    let start = recorded.iter().map(|r| r.submitted_at).min().unwrap_or(0);
    let mut jobs: Vec<TraceJob> = recorded
        .iter()
        .map(|r| TraceJob {
            id: r.id,
            submit: r.submitted_at - start,
            duration: r.duration_s.max(1),
            tasks: r.tasks.max(1),
            gpu: match r.milli {
                Some(m) => GpuRequest::Fraction {
                    milli: GpuMilli(m.clamp(1, 999)),
                    mem: MemMib(0),
                },
                None => GpuRequest::Whole {
                    count: r.gpus_per_task.clamp(1, 64) as u8,
                },
            },
            team: r.team.clone(),
            kind: r.kind,
            priority: r.priority,
            max_runtime: r.max_runtime_s,
            model: spec
                .nodes
                .iter()
                .any(|g| g.model == r.model)
                .then(|| r.model.clone()),
        })
        .collect();
    jobs.sort_by_key(|j| (j.submit, j.id));
    jobs
}

/// Fits the teams' guarantees into the cluster: per model, guarantees
/// beyond its GPUs are scaled down together (an org cannot guarantee more
/// than it has). Returns the models scaled.
pub fn fit_guarantees(spec: &mut ClusterSpec) -> Vec<String> {
    let mut have: BTreeMap<String, u64> = BTreeMap::new();
    for g in &spec.nodes {
        *have.entry(g.model.clone()).or_default() += u64::from(g.count) * u64::from(g.gpus);
    }
    let mut scaled = Vec::new();
    for (model, gpus) in &have {
        // No team is guaranteed more than there is (an "unlimited"
        // guarantee such as the default queue's is all of it).
        for q in &mut spec.queues {
            if let Some(g) = q.guaranteed.get_mut(model) {
                *g = (*g).min(*gpus);
            }
        }
        let asked: u64 = spec
            .queues
            .iter()
            .filter_map(|q| q.guaranteed.get(model))
            .sum();
        if asked > *gpus {
            for q in &mut spec.queues {
                if let Some(g) = q.guaranteed.get_mut(model) {
                    *g = *g * gpus / asked;
                }
            }
            scaled.push(model.clone());
        }
    }
    for q in &mut spec.queues {
        q.guaranteed.retain(|m, _| have.contains_key(m));
    }
    scaled
}

/// What one run came to.
#[derive(Clone, Debug, PartialEq)]
pub struct Summary {
    pub gpus: u64,
    pub jobs: usize,
    pub unfinished: usize,
    pub wait_p50_h: f64,
    pub wait_p95_h: f64,
    pub wait_max_h: f64,
    /// GPU-hours run over GPU-hours the cluster had, from the first
    /// submission to the last finish.
    pub utilisation: f64,
    pub gpu_hours: f64,
    /// The cluster's GPUs for that span at the prices.
    pub cluster_cost: f64,
    /// Each team's GPU-hours, share of all, and p95 wait.
    pub teams: BTreeMap<String, (f64, f64, f64)>,
}

fn percentile(v: &mut [f64], p: f64) -> f64 {
    if v.is_empty() {
        return 0.0;
    }
    v.sort_by(f64::total_cmp);
    v[((v.len() - 1) as f64 * p).round() as usize]
}

/// Summarises a run of `jobs`; `price` gives a GPU-hour's price per model.
pub fn summarise(
    spec: &ClusterSpec,
    jobs: &[TraceJob],
    r: &SimResult,
    price: &dyn Fn(&str) -> f64,
) -> Summary {
    // GPU-hours run: each finished job's work, and what preemptions lost.
    let duration: BTreeMap<u64, u64> = jobs.iter().map(|j| (j.id, j.duration)).collect();
    let mut team_hours: BTreeMap<String, f64> = BTreeMap::new();
    for o in &r.outcomes {
        let work = if o.finish.is_some() {
            o.gpu_milli as f64 / 1000.0 * duration.get(&o.id).copied().unwrap_or(0) as f64 / 3600.0
        } else {
            0.0
        };
        *team_hours.entry(o.team.clone()).or_default() += work + o.lost_gpu_hours;
    }
    let waits = |team: Option<&str>| -> Vec<f64> {
        r.outcomes
            .iter()
            .filter(|o| team.is_none_or(|t| o.team == t))
            .filter_map(|o| {
                o.first_start
                    .map(|s| s.saturating_sub(o.submit) as f64 / 3600.0)
            })
            .collect()
    };
    let mut all = waits(None);
    // At least a second, so that rates stay finite.
    let span_h = crate::dynamic::makespan(r).max(1.0 / 3600.0);
    let gpus: u64 = spec
        .nodes
        .iter()
        .map(|g| u64::from(g.count) * u64::from(g.gpus))
        .sum();
    let gpu_hours: f64 = team_hours.values().sum();
    let cluster_cost = spec
        .nodes
        .iter()
        .map(|g| f64::from(g.count * g.gpus) * price(&g.model) * span_h)
        .sum();
    let teams = team_hours
        .iter()
        .map(|(t, h)| {
            let share = if gpu_hours > 0.0 { h / gpu_hours } else { 0.0 };
            (
                t.clone(),
                (*h, share, percentile(&mut waits(Some(t)), 0.95)),
            )
        })
        .collect();
    Summary {
        gpus,
        jobs: r.outcomes.len(),
        unfinished: r.unfinished,
        wait_p50_h: percentile(&mut all, 0.5),
        wait_p95_h: percentile(&mut all, 0.95),
        wait_max_h: all.iter().copied().fold(0.0, f64::max),
        utilisation: if gpus == 0 {
            0.0
        } else {
            gpu_hours / (gpus as f64 * span_h)
        },
        gpu_hours,
        cluster_cost,
        teams,
    }
}

/// Replays `recorded` on `spec` as it is and after `changes`, under
/// `policy`, with cycles every `cfg.interval` seconds.
///
/// # Errors
/// A change that does not apply, or a cluster the simulator refuses.
pub fn compare(
    spec: &ClusterSpec,
    recorded: &[Recorded],
    changes: &[Change],
    policy: &SimPolicy,
    cfg: &SimConfig,
    price: &dyn Fn(&str) -> f64,
) -> Result<(Summary, Summary), SimError> {
    // The replay is of GPUs: a recorded job's CPU and memory are not
    // known to the simulator, which sizes each task by its GPUs (8 cores
    // and 64 GiB a GPU), so no node is short of them.
    let gpu_bound = |s: &mut ClusterSpec| {
        for g in &mut s.nodes {
            g.cpu = g.cpu.max(u64::from(g.gpus) * 8);
            g.mem_gib = g.mem_gib.max(u64::from(g.gpus) * 64);
        }
    };
    let mut spec = spec.clone();
    gpu_bound(&mut spec);
    let spec = &spec;
    let mut changed = spec.clone();
    for c in changes {
        c.apply(&mut changed).map_err(SimError::Invalid)?;
    }
    gpu_bound(&mut changed);
    fit_guarantees(&mut changed);
    // Run until every job could have run one after another on one GPU
    // (the simulator otherwise stops at a multiple of the last arrival,
    // which for a burst is at once).
    let horizon = recorded
        .iter()
        .map(|r| r.submitted_at)
        .max()
        .unwrap_or(0)
        .saturating_sub(recorded.iter().map(|r| r.submitted_at).min().unwrap_or(0))
        .max(1);
    let serial: u64 = recorded
        .iter()
        .map(|r| {
            r.duration_s.max(1) * u64::from(r.tasks.max(1)) * u64::from(r.gpus_per_task.max(1))
        })
        .sum();
    let cfg = SimConfig {
        stop_after: cfg
            .stop_after
            .max((horizon + serial + cfg.interval * recorded.len() as u64) as f64 / horizon as f64),
        ..cfg.clone()
    };
    let run = |s: &ClusterSpec| -> Result<Summary, SimError> {
        let jobs = trace(recorded, s);
        let r = dynamic::simulate(s, &jobs, policy, &cfg, 42)?;
        Ok(summarise(s, &jobs, &r, price))
    };
    Ok((run(spec)?, run(&changed)?))
}

/// One team's queue as the simulator takes it.
pub fn team_queue(
    name: &str,
    weight: f64,
    guaranteed: &BTreeMap<String, f64>,
    borrow_limit: &BTreeMap<String, f64>,
) -> QueueSpec {
    QueueSpec {
        name: name.to_string(),
        weight: if weight > 0.0 { weight } else { 1.0 },
        guaranteed: guaranteed
            .iter()
            .map(|(m, g)| (m.clone(), g.max(0.0).floor() as u64))
            .collect(),
        borrow_limit: borrow_limit
            .iter()
            .map(|(m, b)| (m.clone(), b.max(0.0).floor() as u64))
            .collect(),
        budget: None,
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn changes_parse_and_say_what_the_forms_are() {
        assert_eq!(
            Change::parse("2x8xH100-80GB").unwrap(),
            Change::AddNodes {
                count: 2,
                gpus: 8,
                model: "H100-80GB".into()
            }
        );
        assert_eq!(
            Change::parse("-1xA100").unwrap(),
            Change::RemoveNodes {
                count: 1,
                model: "A100".into()
            }
        );
        assert_eq!(
            Change::parse("vision=H100:16").unwrap(),
            Change::Guarantee {
                team: "vision".into(),
                model: "H100".into(),
                gpus: 16
            }
        );
        for bad in ["8xH100", "0x8xH100", "2x99xH100", "vision=16", "-xH100"] {
            let e = Change::parse(bad).unwrap_err();
            assert!(e.contains("NODESxGPUSxMODEL"), "{bad}: {e}");
        }
    }

    #[test]
    fn guarantees_beyond_the_cluster_are_scaled_down_together() {
        let mut spec = ClusterSpec {
            nodes: vec![NodeGroup {
                count: 1,
                gpus: 8,
                model: "H100".into(),
                cpu: 64,
                mem_gib: 512,
                rack_size: None,
            }],
            queues: vec![
                team_queue(
                    "a",
                    1.0,
                    &BTreeMap::from([("H100".into(), 12.0)]),
                    &BTreeMap::new(),
                ),
                team_queue(
                    "b",
                    1.0,
                    &BTreeMap::from([("H100".into(), 4.0), ("A100".into(), 2.0)]),
                    &BTreeMap::new(),
                ),
            ],
        };
        assert_eq!(fit_guarantees(&mut spec), vec!["H100".to_string()]);
        // 12 capped at the 8 there are, then 8 + 4 scaled into 8.
        assert_eq!(spec.queues[0].guaranteed["H100"], 5);
        assert_eq!(spec.queues[1].guaranteed["H100"], 2);
        assert!(!spec.queues[1].guaranteed.contains_key("A100"));
        let e = Change::RemoveNodes {
            count: 2,
            model: "H100".into(),
        }
        .apply(&mut spec)
        .unwrap_err();
        assert!(e.contains("has 1"), "{e}");
    }
}
