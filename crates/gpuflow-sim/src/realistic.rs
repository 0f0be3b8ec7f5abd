//! A realistic multi-tenant GPU workload, after what published studies of
//! production GPU clusters report (SenseTime Helios, SC'21; Alibaba PAI,
//! NSDI'22; Microsoft Philly, ATC'19):
//! - most jobs ask for one GPU, while multi-GPU jobs (whole 8-GPU nodes for
//!   gangs of several nodes) use most of the GPU-hours;
//! - durations are heavy-tailed (log-normal), from minutes to weeks;
//! - users submit in bursts (sweeps of up to hundreds of alike jobs), more in
//!   working hours and on weekdays;
//! - a few teams create most of the demand (Zipf-like), beside small teams;
//! - about a quarter of the jobs fail or are cancelled early;
//! - declared time limits are rough: a round number well above the real
//!   runtime, or none (the partition's maximum).
//!
//! Kinds follow the trace study: one GPU under an hour is a notebook, one
//! GPU for longer is batch, two GPUs or more is training. Each team is
//! guaranteed GPUs in proportion to its demand; all may borrow.

use gpuflow_core::{GpuRequest, SplitMix64};

use crate::workload::{ClusterSpec, TraceJob, h100_cluster};

/// The generator's settings.
#[derive(Clone, Debug)]
pub struct Realistic {
    /// GPUs of the cluster (8-GPU nodes).
    pub gpus: u64,
    /// Offered load: submitted GPU-hours over the cluster's GPU-hours in
    /// the arrival window.
    pub load: f64,
    /// Hours of arrivals.
    pub hours: u64,
    pub seed: u64,
    /// Teams, with demand falling as 1/rank^1.1.
    pub teams: usize,
}

/// The longest time limit a job may declare (the partition's maximum), and
/// the limit of jobs that declare none: 7 days.
pub const MAX_LIMIT_S: u64 = 7 * 24 * 3600;

/// Human time limits users pick, seconds.
const LIMITS: &[u64] = &[
    3600,
    2 * 3600,
    4 * 3600,
    8 * 3600,
    12 * 3600,
    24 * 3600,
    48 * 3600,
    72 * 3600,
    MAX_LIMIT_S,
];

fn unit(rng: &mut SplitMix64) -> f64 {
    ((rng.next_u64() >> 11) as f64 + 0.5) / (1u64 << 53) as f64
}

/// A standard normal sample (Box–Muller).
fn normal(rng: &mut SplitMix64) -> f64 {
    let (a, b) = (unit(rng), unit(rng));
    (-2.0 * a.ln()).sqrt() * (std::f64::consts::TAU * b).cos()
}

/// A log-normal duration with this median and spread, within bounds.
fn lognormal(rng: &mut SplitMix64, median_s: f64, sigma: f64, lo: u64, hi: u64) -> u64 {
    ((median_s * (sigma * normal(rng)).exp()) as u64).clamp(lo, hi)
}

impl Realistic {
    pub fn new(seed: u64) -> Realistic {
        Realistic {
            gpus: 512,
            load: 0.9,
            hours: 168,
            seed,
            teams: 10,
        }
    }

    fn team_names(&self) -> Vec<String> {
        (0..self.teams.max(1))
            .map(|k| format!("team-{:02}", k + 1))
            .collect()
    }

    /// Each team's share of the demand: 1/rank^1.1, normalised.
    fn demand_shares(&self) -> Vec<f64> {
        let raw: Vec<f64> = (1..=self.teams.max(1))
            .map(|k| 1.0 / (k as f64).powf(1.1))
            .collect();
        let sum: f64 = raw.iter().sum();
        raw.iter().map(|r| r / sum).collect()
    }

    /// 8-GPU H100 nodes in racks of 16; each team guaranteed GPUs in
    /// proportion to its demand (at least one), weighted the same.
    pub fn cluster(&self) -> ClusterSpec {
        let shares = self.demand_shares();
        h100_cluster(
            self.gpus,
            self.team_names().into_iter().zip(shares).map(|(name, s)| {
                (
                    name,
                    s * 100.0,
                    ((self.gpus as f64 * s).floor() as u64).max(1),
                )
            }),
        )
    }

    /// The jobs, in submission order with ids from 0.
    pub fn jobs(&self) -> Vec<TraceJob> {
        let mut rng = SplitMix64::new(self.seed ^ 0x5EA1_1571_C000_0000);
        let horizon = self.hours * 3600;
        let names = self.team_names();
        let shares = self.demand_shares();
        let mut jobs = Vec::new();
        for (team, share) in names.iter().zip(&shares) {
            let demand = self.gpus as f64 * self.load * horizon as f64 * share;
            // A team runs jobs no bigger than its guarantee (in powers of
            // two), and none of more than a fifth of its demand.
            let guaranteed = ((self.gpus as f64 * share).floor() as u32).max(1);
            let widest = 1u32 << (31 - guaranteed.leading_zeros());
            let mut made = 0.0;
            while made < demand {
                for j in self.sweep(&mut rng, team, horizon, widest) {
                    let work = j.gpu_milli() as f64 / 1000.0 * j.duration as f64;
                    if work > demand / 5.0 {
                        continue;
                    }
                    made += work;
                    jobs.push(j);
                    if made >= demand {
                        break;
                    }
                }
            }
        }
        jobs.sort_by(|a, b| {
            (a.submit, &a.team, a.kind, a.duration).cmp(&(b.submit, &b.team, b.kind, b.duration))
        });
        for (i, j) in jobs.iter_mut().enumerate() {
            j.id = i as u64;
        }
        jobs
    }

    /// When a submission happens: uniform over the window, thinned by a
    /// daily cycle (peak mid-afternoon, night at a fifth of it) and
    /// weekends at 40 % of weekdays.
    fn arrival(rng: &mut SplitMix64, horizon: u64) -> u64 {
        loop {
            let t = unit(rng) * horizon as f64;
            let hour = (t / 3600.0) % 24.0;
            let day = (t / 86_400.0) as u64 % 7;
            let daily = 0.6 + 0.4 * ((hour - 14.0) / 24.0 * std::f64::consts::TAU).cos();
            let weekly = if day >= 5 { 0.4 } else { 1.0 };
            if unit(rng) <= daily * weekly {
                return t as u64;
            }
        }
    }

    /// One submission: a single job or a sweep of alike ones a few seconds
    /// apart.
    fn sweep(&self, rng: &mut SplitMix64, team: &str, horizon: u64, widest: u32) -> Vec<TraceJob> {
        // Sweep size: 60 % one job, 30 % 2–20, 10 % 20–300.
        let size = match unit(rng) {
            u if u < 0.6 => 1,
            u if u < 0.9 => 2 + rng.below(19),
            _ => 20 + rng.below(281),
        };
        // GPUs per job: one for most jobs; gangs of whole nodes for big ones.
        let gpus: u32 = match unit(rng) {
            u if u < 0.72 => 1,
            u if u < 0.80 => 2,
            u if u < 0.87 => 4,
            u if u < 0.95 => 8,
            u if u < 0.98 => 16,
            u if u < 0.995 => 32,
            _ => 64,
        }
        .min(widest);
        // Big jobs come in small sweeps.
        let size = if gpus >= 8 { size.min(8) } else { size };
        let interactive = gpus == 1 && unit(rng) < 0.45;
        let (median, sigma, lo, hi) = match (gpus, interactive) {
            (1, true) => (900.0, 0.9, 60, 3599),
            (1, false) => (4.0 * 3600.0, 1.2, 3600, MAX_LIMIT_S),
            (g, _) if g < 8 => (3.0 * 3600.0, 1.4, 300, MAX_LIMIT_S),
            _ => (8.0 * 3600.0, 1.5, 600, MAX_LIMIT_S),
        };
        let start = Realistic::arrival(rng, horizon);
        // One declared limit for the sweep (or none: 20 %).
        let declares = unit(rng) >= 0.2;
        let mut out = Vec::new();
        for n in 0..size {
            let planned = lognormal(rng, median, sigma, lo, hi);
            // A quarter fail or are cancelled early.
            let duration = if unit(rng) < 0.25 {
                ((planned as f64 * (0.01 + 0.3 * unit(rng))) as u64).max(30)
            } else {
                planned
            };
            let limit = if declares {
                let want = planned as f64 * (1.5 + 3.5 * unit(rng));
                LIMITS
                    .iter()
                    .copied()
                    .find(|&l| l as f64 >= want)
                    .unwrap_or(MAX_LIMIT_S)
            } else {
                MAX_LIMIT_S
            };
            let (tasks, per_task) = if gpus > 8 { (gpus / 8, 8) } else { (1, gpus) };
            out.push(TraceJob {
                id: 0,
                submit: (start + n * (1 + rng.below(10))).min(horizon),
                duration: duration.min(limit),
                tasks,
                gpu: GpuRequest::Whole {
                    count: per_task as u8,
                },
                team: team.to_string(),
                kind: match (gpus, interactive) {
                    (1, true) => 1,
                    (1, false) => 3,
                    _ => 2,
                },
                priority: 0,
                max_runtime: Some(limit),
                model: None,
            });
        }
        out
    }
}

/// The offered load of a trace on `gpus` GPUs: its GPU-seconds over the
/// GPU-seconds of its arrival window.
pub fn offered_load(jobs: &[TraceJob], gpus: u64) -> f64 {
    let (Some(first), Some(last)) = (
        jobs.iter().map(|j| j.submit).min(),
        jobs.iter().map(|j| j.submit).max(),
    ) else {
        return 0.0;
    };
    let window = (last - first).max(1) as f64;
    let work: f64 = jobs
        .iter()
        .map(|j| j.gpu_milli() as f64 / 1000.0 * j.duration as f64)
        .sum();
    work / (gpus as f64 * window)
}

/// Rescales a trace's arrival times so that its offered load on `gpus`
/// GPUs becomes `load` (the jobs, their sizes and durations, unchanged).
pub fn rescale(jobs: &mut [TraceJob], gpus: u64, load: f64) {
    let now = offered_load(jobs, gpus);
    if now <= 0.0 || load <= 0.0 {
        return;
    }
    let first = jobs.iter().map(|j| j.submit).min().unwrap_or(0);
    let factor = now / load;
    for j in jobs.iter_mut() {
        j.submit = first + ((j.submit - first) as f64 * factor).round() as u64;
    }
    jobs.sort_by_key(|j| (j.submit, j.id));
}

#[cfg(test)]
mod tests {
    use std::collections::BTreeMap;

    use super::*;

    #[test]
    fn the_shapes_are_those_of_the_studies() {
        let r = Realistic::new(3);
        let jobs = r.jobs();
        let n = jobs.len() as f64;
        let one = jobs.iter().filter(|j| j.gpu_milli() == 1000).count() as f64;
        let gh = |j: &TraceJob| j.gpu_milli() as f64 / 1000.0 * j.duration as f64;
        let total: f64 = jobs.iter().map(gh).sum();
        let multi: f64 = jobs.iter().filter(|j| j.gpu_milli() > 1000).map(gh).sum();
        assert!(one / n > 0.6, "most jobs ask for one GPU: {:.2}", one / n);
        assert!(
            multi / total > 0.6,
            "multi-GPU jobs use most GPU-hours: {:.2}",
            multi / total
        );
        let load = offered_load(&jobs, r.gpus);
        assert!((0.85..1.0).contains(&load), "offered load {load:.3}");
        // Heavy tails: the longest job runs far beyond the median one.
        let mut d: Vec<u64> = jobs.iter().map(|j| j.duration).collect();
        d.sort_unstable();
        assert!(
            d[d.len() - 1] > 50 * d[d.len() / 2],
            "{} vs {}",
            d[d.len() - 1],
            d[d.len() / 2]
        );
        // A few teams make most of the demand.
        let mut by_team: BTreeMap<&str, f64> = BTreeMap::new();
        for j in &jobs {
            *by_team.entry(&j.team).or_default() += gh(j);
        }
        let top3: f64 = {
            let mut v: Vec<f64> = by_team.values().copied().collect();
            v.sort_by(|a, b| b.total_cmp(a));
            v[..3].iter().sum()
        };
        assert!(
            top3 / total > 0.5,
            "the three biggest teams: {:.2}",
            top3 / total
        );
        // Limits are never below the runtime, and some jobs declare none.
        assert!(
            jobs.iter()
                .all(|j| j.max_runtime.is_some_and(|m| m >= j.duration))
        );
        assert!(jobs.iter().any(|j| j.max_runtime == Some(MAX_LIMIT_S)));
        // The same seed, the same jobs.
        assert_eq!(jobs, Realistic::new(3).jobs());
    }

    #[test]
    fn rescaling_sets_the_offered_load() {
        let r = Realistic::new(5);
        let mut jobs = r.jobs();
        rescale(&mut jobs, r.gpus, 1.15);
        let load = offered_load(&jobs, r.gpus);
        assert!((load - 1.15).abs() < 0.01, "{load}");
    }
}
