//! The dynamic simulator: jobs arrive, run for their duration and leave;
//! every `interval` seconds (when something happened) gpuflow-core's
//! scheduling cycle runs on the current state, and its plan is applied:
//! admitted jobs start, preempted jobs stop at their kill time and are
//! requeued with the work since their last checkpoint lost.
//!
//! Policies are configurations of the same core: FIFO (submission order,
//! head-of-line blocking, no quotas), Slurm-like (Slurm's multifactor
//! priority: fair share with decay, age and job size; EASY backfill on
//! declared max runtimes, no quotas, no preemption) and gpuflow (fair share
//! over quotas, bounded preemption and backfill). Each places tasks as its
//! scheduler does: the baselines as Slurm's node selection
//! ([`slurm_node_selection`]), gpuflow with its own placement policy.

use std::collections::BTreeMap;

use gpuflow_core::policy::{PickChoice, TieBreak};
use gpuflow_core::queue::{QueueId, Queues};
use gpuflow_core::schedule::{self, Config, History, Ordering, Running, Workload};
use gpuflow_core::{Cluster, JobId, Placer, Policy, WorkloadMix};

use crate::error::SimError;
use crate::workload::{ClusterSpec, KINDS, TraceJob};

/// A scheduling policy to compare.
#[derive(Clone, Debug)]
pub struct SimPolicy {
    pub name: String,
    pub config: Config,
    /// Where the policy places tasks.
    pub placement: Policy,
    /// Its start estimates expect jobs to run as long as their user's
    /// recent ones ([`schedule::RecentRuntimes`]), as gpuflow's server does; Slurm's
    /// (`squeue --start`) count on the declared time limits.
    pub predicts_runtimes: bool,
    /// Its start estimates are told each job's real runtime instead
    /// (`predict_runtimes=exact`): what the estimates would be with a
    /// perfect predictor, which sets apart the error of the predictor from
    /// that of the estimate itself.
    pub exact_runtimes: bool,
}

/// Slurm's node selection (select/cons_tres) as these baselines model it:
/// the tightest fit (the nodes with the fewest free resources that still
/// fit the task), the lowest-numbered node among equals, the
/// lowest-numbered free GPU. Slurm picks the tightest set of consecutive
/// nodes that can run the job, the first of equal ones, and takes its
/// nodes in order; on a busy cluster most such sets are single nodes.
/// Multi-node jobs keep to as few racks as they can, as with Slurm's
/// topology/tree plugin.
pub fn slurm_node_selection() -> Policy {
    Policy {
        name: "slurm".into(),
        tie_break: TieBreak::First,
        pick: PickChoice::First,
        ..Policy::best_fit()
    }
}

impl SimPolicy {
    pub fn fifo() -> SimPolicy {
        let config = Config {
            ordering: Ordering::Fifo,
            preemption: false,
            backfill: false,
            quotas: false,
            consolidate_max_unsaved: None,
            ..Config::default()
        };
        SimPolicy {
            name: "fifo".into(),
            config,
            placement: slurm_node_selection(),
            predicts_runtimes: false,
            exact_runtimes: false,
        }
    }

    /// One partition with a single QoS, configured as Slurm's multifactor
    /// priority documentation's example (fair share 100,000 with a 7-day
    /// usage half-life, age 1,000 up to one day, job size 1,000; see
    /// [`schedule::Multifactor`]), EASY backfill on declared max runtimes, no
    /// preemption, no quotas. Every pending job is tried each cycle.
    pub fn slurm() -> SimPolicy {
        let config = Config {
            ordering: Ordering::Multifactor,
            aging_step: 0,
            preemption: false,
            backfill: true,
            // EASY backfill: one reservation.
            max_reservations: 1,
            // Slurm's backfill plans each node on its own (it matters only
            // with more than one reservation).
            backfill_per_node: true,
            quotas: false,
            class_tiers: false,
            consolidate_max_unsaved: None,
            ..Config::default()
        };
        SimPolicy {
            name: "slurm-like".into(),
            config,
            placement: slurm_node_selection(),
            predicts_runtimes: false,
            exact_runtimes: false,
        }
    }

    /// Slurm-like with a QoS tier per kind of job (inference, notebook,
    /// training, batch), still without preemption or quotas.
    pub fn slurm_qos() -> SimPolicy {
        SimPolicy {
            name: "slurm-qos".into(),
            config: Config {
                class_tiers: true,
                // One QoS per kind, training's above batch's.
                preemptible_one_tier: false,
                ..SimPolicy::slurm().config
            },
            placement: slurm_node_selection(),
            predicts_runtimes: false,
            exact_runtimes: false,
        }
    }

    pub fn gpuflow() -> SimPolicy {
        SimPolicy {
            name: "gpuflow".into(),
            config: Config::default(),
            placement: Policy::gpuflow(),
            predicts_runtimes: true,
            exact_runtimes: false,
        }
    }

    pub fn named(name: &str) -> Option<SimPolicy> {
        match name {
            "fifo" => Some(SimPolicy::fifo()),
            "slurm-like" | "slurm" => Some(SimPolicy::slurm()),
            "slurm-qos" => Some(SimPolicy::slurm_qos()),
            "gpuflow" => Some(SimPolicy::gpuflow()),
            _ => None,
        }
    }

    pub const NAMES: &'static [&'static str] = &["fifo", "slurm-like", "slurm-qos", "gpuflow"];

    /// The settings [`SimPolicy::tune`] knows.
    pub const KNOBS: &'static [&'static str] = &[
        "tries_per_queue",
        "tries_per_cycle",
        "max_reservations",
        "min_runtime",
        "history_weight",
        "preemption",
        "notebooks_borrow",
        "disruption_budget",
        "disruption_max_jobs",
        "disruption_window",
        "protected_pass_budgets",
        "budget_patience",
        "underserved_pass_budgets",
        "reclaims_restore_fairness",
        "max_unsaved",
        "batch_rank",
        "preemptible_one_tier",
        "victims_by_lost_work",
        "usage_half_life",
        "aging_step",
        "aging_cap",
        "quotas",
        "class_tiers",
        "backfill_per_node",
        "placement",
        "consolidate",
        "consolidation_interval",
        "max_preemptions_per_cycle",
        "lease_horizon",
        "reclaim_holds",
        "predict_runtimes",
    ];

    /// Changes one setting of the core's configuration, for experiments:
    /// `tries_per_queue=N`, `tries_per_cycle=N`, `max_reservations=N`, `min_runtime=SECONDS`,
    /// `history_weight=X`, `preemption=true|false`,
    /// `notebooks_borrow=true|false`, `lease_horizon=SECONDS|none`,
    /// `reclaim_holds=true|false`,
    /// `disruption_budget=GPU_HOURS|none`, `disruption_max_jobs=N|none`,
    /// `disruption_window=SECONDS`, `protected_pass_budgets=true|false`,
    /// `budget_patience=SECONDS`,
    /// `underserved_pass_budgets=FRACTION` (0: none),
    /// `reclaims_restore_fairness=true|false`, `max_unsaved=SECONDS|none`,
    /// `usage_half_life=SECONDS` (above 0), `aging_step=SECONDS` (0: no
    /// aging), `aging_cap=N`, `quotas=true|false` (false: no guarantees,
    /// borrowing or reclaim, as the Slurm baselines), `class_tiers=true|false`
    /// (false: the classes do not order the queue), `backfill_per_node=true|false`,
    /// `batch_rank=N` (the batch class's rank: 20, training's, makes the
    /// two peers that neither preempt nor outrank each other),
    /// `placement=POLICY` (`slurm`, a placement policy such as `gpuflow` or
    /// `best-fit`, or a weighted sum of scorers), `consolidate=SECONDS|none`
    /// (the most unsaved work a job consolidation moves may hold; none: no
    /// consolidation), `consolidation_interval=SECONDS` (from one to the next),
    /// `max_preemptions_per_cycle=N` (no new victim search once a cycle has
    /// told that many jobs to stop), `predict_runtimes=true|false|exact`
    /// (estimates count on users' recent runtimes, on declared limits, or
    /// on each job's real runtime).
    ///
    /// # Errors
    /// An unknown setting or a value of the wrong type, said as such.
    pub fn tune(&mut self, key: &str, value: &str) -> Result<(), String> {
        let bad = || format!("{key}={value}: not a valid value for {key}");
        if key == "placement" {
            self.placement = match value {
                "slurm" => slurm_node_selection(),
                v => Policy::parse(v).map_err(|e| format!("{key}={value}: {e} (or slurm)"))?,
            };
            return Ok(());
        }
        if key == "predict_runtimes" {
            (self.predicts_runtimes, self.exact_runtimes) = match value {
                "exact" => (true, true),
                v => (
                    v.parse()
                        .map_err(|_| format!("{key}={value}: expected true, false or exact"))?,
                    false,
                ),
            };
            return Ok(());
        }
        let c = &mut self.config;
        match key {
            "tries_per_queue" => c.tries_per_queue = value.parse().map_err(|_| bad())?,
            "tries_per_cycle" => c.tries_per_cycle = value.parse().map_err(|_| bad())?,
            "max_reservations" => c.max_reservations = value.parse().map_err(|_| bad())?,
            "min_runtime" => c.min_runtime = value.parse().map_err(|_| bad())?,
            "history_weight" => {
                c.history_weight = value
                    .parse()
                    .ok()
                    .filter(|w: &f64| (0.0..=1.0).contains(w))
                    .ok_or_else(bad)?;
            }
            "preemption" => c.preemption = value.parse().map_err(|_| bad())?,
            "disruption_budget" => {
                c.disruption_budget = match value {
                    "none" => None,
                    v => Some(
                        v.parse()
                            .ok()
                            .filter(|b: &f64| b.is_finite() && *b >= 0.0)
                            .ok_or_else(bad)?,
                    ),
                }
            }
            "disruption_max_jobs" => {
                c.disruption_max_jobs = match value {
                    "none" => None,
                    v => Some(v.parse().map_err(|_| bad())?),
                }
            }
            "max_unsaved" => {
                c.max_unsaved = match value {
                    "none" => None,
                    v => Some(v.parse().map_err(|_| bad())?),
                }
            }
            "disruption_window" => {
                c.disruption_window = value
                    .parse()
                    .ok()
                    .filter(|w: &u64| *w > 0)
                    .ok_or_else(bad)?
            }
            "protected_pass_budgets" => {
                c.protected_pass_budgets = value.parse().map_err(|_| bad())?
            }
            "budget_patience" => c.budget_patience = value.parse().map_err(|_| bad())?,
            "underserved_pass_budgets" => {
                c.underserved_pass_budgets = value
                    .parse()
                    .ok()
                    .filter(|x: &f64| x.is_finite() && *x >= 0.0)
                    .ok_or_else(bad)?
            }
            "reclaims_restore_fairness" => {
                c.reclaims_restore_fairness = value.parse().map_err(|_| bad())?
            }
            "preemptible_one_tier" => c.preemptible_one_tier = value.parse().map_err(|_| bad())?,
            "victims_by_lost_work" => c.victims_by_lost_work = value.parse().map_err(|_| bad())?,
            "usage_half_life" => {
                c.usage_half_life = value
                    .parse()
                    .ok()
                    .filter(|h: &u64| *h > 0)
                    .ok_or_else(bad)?
            }
            "aging_step" => c.aging_step = value.parse().map_err(|_| bad())?,
            "aging_cap" => c.aging_cap = value.parse().map_err(|_| bad())?,
            "quotas" => c.quotas = value.parse().map_err(|_| bad())?,
            "consolidate" => {
                c.consolidate_max_unsaved = match value {
                    "none" => None,
                    v => Some(v.parse().map_err(|_| bad())?),
                }
            }
            "consolidation_interval" => {
                c.consolidation_interval = value.parse().map_err(|_| bad())?
            }
            "max_preemptions_per_cycle" => {
                c.max_preemptions_per_cycle = value.parse().map_err(|_| bad())?
            }
            "reclaim_holds" => c.reclaim_holds = value.parse().map_err(|_| bad())?,
            "lease_horizon" => {
                c.lease_horizon = match value {
                    "none" => None,
                    v => Some(v.parse().map_err(|_| bad())?),
                }
            }
            "class_tiers" => c.class_tiers = value.parse().map_err(|_| bad())?,
            "backfill_per_node" => c.backfill_per_node = value.parse().map_err(|_| bad())?,
            "batch_rank" => {
                let r = value.parse().map_err(|_| bad())?;
                for class in c.classes.iter_mut().filter(|k| k.name == "batch") {
                    class.rank = r;
                }
            }
            "notebooks_borrow" => {
                let b = value.parse().map_err(|_| bad())?;
                for class in c.classes.iter_mut().filter(|k| k.name == "notebook") {
                    class.may_borrow = b;
                }
            }
            _ => {
                return Err(format!(
                    "unknown setting {key:?}; known: {}",
                    SimPolicy::KNOBS.join(", ")
                ));
            }
        }
        Ok(())
    }
}

/// Simulator settings.
#[derive(Clone, Debug)]
pub struct SimConfig {
    /// Seconds between scheduling cycles.
    pub interval: u64,
    /// Training jobs checkpoint this often, seconds; other kinds never do.
    pub checkpoint_every: u64,
    /// Grace period given to a preempted job, seconds.
    pub grace: u64,
    /// The simulation stops at this multiple of the last arrival, even with work left.
    pub stop_after: f64,
    /// Keep, with each start estimate, the codes of the job's reasons
    /// ([`Outcome::estimate_reasons`]).
    pub log_estimates: bool,
}

impl Default for SimConfig {
    fn default() -> SimConfig {
        SimConfig {
            interval: 60,
            checkpoint_every: 1800,
            grace: 60,
            stop_after: 3.0,
            log_estimates: false,
        }
    }
}

/// How long a job with `left` seconds of work runs once started: until
/// it is done or its declared maximum kills it.
fn runs_for(left: u64, w: &Workload) -> u64 {
    left.min(w.max_runtime.unwrap_or(u64::MAX))
}

/// What happened to one job.
#[derive(Clone, Debug, PartialEq)]
pub struct Outcome {
    pub id: u64,
    pub team: String,
    pub kind: usize,
    pub gpu_milli: u64,
    pub submit: u64,
    pub first_start: Option<u64>,
    pub finish: Option<u64>,
    pub preemptions: u32,
    pub lost_gpu_hours: f64,
    /// Seconds it waited again after being preempted: from each stop to
    /// its next start (still waiting at the end: to the end).
    pub requeued_wait: u64,
    /// GPU-hours (inside the arrival horizon) that stood free beside it
    /// while it waited and they could hold it, quota aside ([`schedule::could_hold`]).
    pub idle_waiting_gpu_hours: f64,
    /// What the cycle estimated for its first start, before it started:
    /// (when, the estimated start or `None` for unknown), at its first
    /// cycle and then at the first cycle of every hour it waited.
    pub estimates: Vec<(u64, Option<u64>)>,
    /// With [`SimConfig::log_estimates`], beside each estimate: the codes
    /// of the job's reasons then ([`schedule::PendingReason::code`]),
    /// joined by `+`.
    pub estimate_reasons: Vec<String>,
}

/// A policy's run.
#[derive(Clone, Debug, PartialEq)]
pub struct SimResult {
    pub policy: String,
    pub outcomes: Vec<Outcome>,
    /// GPU-hours allocated per team inside the arrival horizon.
    pub team_gpu_hours: BTreeMap<String, f64>,
    pub team_weights: BTreeMap<String, f64>,
    /// GPU-hours each team submitted (tasks × GPUs × duration).
    pub team_demand_gpu_hours: BTreeMap<String, f64>,
    /// GPU-hours the cluster had inside the arrival horizon.
    pub capacity_gpu_hours: f64,
    pub preemptions: u32,
    pub lost_gpu_hours: f64,
    /// GPU-hours held by running jobs, all of it (lost work included).
    pub run_gpu_hours: f64,
    pub cycles: u64,
    /// Jobs still waiting or running when the simulation stopped.
    pub unfinished: usize,
    /// GPU-hours, inside the arrival horizon, that the waiting work could
    /// have held on GPUs free after each cycle, quota aside ([`schedule::could_hold`]):
    /// GPUs idle while work that fits them waits.
    pub idle_waiting_gpu_hours: f64,
}

struct Live {
    trace: usize,
    /// Seconds of work left when it (re)started.
    remaining: u64,
    end: u64,
}

/// Runs one policy over the trace.
///
/// # Errors
/// When the cluster description is invalid.
pub fn simulate(
    spec: &ClusterSpec,
    jobs: &[TraceJob],
    policy: &SimPolicy,
    sim: &SimConfig,
    seed: u64,
) -> Result<SimResult, SimError> {
    let nodes = spec.build_nodes();
    let capacity_milli: u64 = nodes.iter().map(|n| n.gpus.len() as u64 * 1000).sum();
    let mut queues: Queues = spec.build_queues(&nodes)?;
    let cluster = Cluster::new(nodes).map_err(|e| SimError::Invalid(e.to_string()))?;
    // The mix is set each cycle from the pending jobs, as the server does.
    let mut placer = Placer::new(
        cluster,
        policy.placement.clone(),
        WorkloadMix::default(),
        seed,
    );
    let team_queue: BTreeMap<String, QueueId> = spec
        .queues
        .iter()
        .map(|q| (q.name.clone(), queues.by_name(&q.name).expect("built")))
        .collect();
    for j in jobs {
        if !team_queue.contains_key(&j.team) {
            return Err(SimError::Invalid(format!(
                "job {} names team {:?}, which has no queue in the cluster file",
                j.id, j.team
            )));
        }
    }
    let horizon = jobs.iter().map(|j| j.submit).max().unwrap_or(0).max(1);
    let stop = (horizon as f64 * sim.stop_after) as u64;
    let mut outcomes: Vec<Outcome> = jobs
        .iter()
        .map(|j| Outcome {
            id: j.id,
            team: j.team.clone(),
            kind: j.kind,
            gpu_milli: j.gpu_milli(),
            submit: j.submit,
            first_start: None,
            finish: None,
            preemptions: 0,
            lost_gpu_hours: 0.0,
            requeued_wait: 0,
            idle_waiting_gpu_hours: 0.0,
            estimates: Vec::new(),
            estimate_reasons: Vec::new(),
        })
        .collect();
    let by_id: BTreeMap<JobId, usize> = jobs
        .iter()
        .enumerate()
        .map(|(i, j)| (JobId(j.id), i))
        .collect();
    let mut remaining: Vec<u64> = jobs.iter().map(|j| j.duration).collect();
    // When each preempted job went back to the queue.
    let mut requeued_at: Vec<Option<u64>> = vec![None; jobs.len()];
    let mut running: Vec<Running> = Vec::new();
    let mut live: BTreeMap<JobId, Live> = BTreeMap::new();
    let mut pending: Vec<Workload> = Vec::new();
    let mut history = History::default();
    let mut team_gpu_hours: BTreeMap<String, f64> =
        spec.queues.iter().map(|q| (q.name.clone(), 0.0)).collect();
    let mut idle_waiting_milli_s = 0.0f64;
    let (mut next_arrival, mut now, mut cycles, mut preemptions, mut lost_total) =
        (0usize, 0u64, 0u64, 0u32, 0.0);
    let class_of = |kind: usize| kind.min(3);
    let workload = |j: &TraceJob| Workload {
        job: j.job(),
        queue: team_queue[&j.team],
        user: format!("{}-user", j.team),
        class: class_of(j.kind),
        priority: j.priority,
        submitted: j.submit,
        max_runtime: j.max_runtime,
        grace: sim.grace,
        expected_runtime: None,
    };
    let mut run_gpu_hours = 0.0;
    let mut account = |team: &str, milli: u64, from: u64, to: u64| {
        run_gpu_hours += milli as f64 / 1000.0 * to.saturating_sub(from) as f64 / 3600.0;
        let (a, b) = (from.min(horizon), to.min(horizon));
        if b > a {
            *team_gpu_hours.get_mut(team).expect("team") +=
                milli as f64 / 1000.0 * (b - a) as f64 / 3600.0;
        }
    };
    let mut budgets = Budgets::new(spec, &team_queue);
    // What each user's jobs of a class ran lately, for start estimates.
    let mut runtimes = schedule::RecentRuntimes::<usize>::default();
    loop {
        // 1. Jobs that finished or whose kill time came leave.
        let mut keep = Vec::new();
        for r in std::mem::take(&mut running) {
            let l = &live[&r.work.job.id];
            let i = l.trace;
            let done_at = r.stopping_at.map_or(l.end, |k| k.min(l.end));
            if done_at > now {
                keep.push(r);
                continue;
            }
            placer.release(&r.allocations);
            if !r.flavor.is_empty() {
                queues.charge(r.work.queue, &r.flavor, -(r.work.gpu_milli() as i64));
            }
            account(&jobs[i].team, r.work.gpu_milli(), r.started, done_at);
            budgets.charge(&r, done_at);
            budgets.forget(r.work.job.id);
            let l = live.remove(&r.work.job.id).expect("live");
            if done_at >= l.end {
                outcomes[i].finish = Some(l.end);
                runtimes.record(
                    &r.work.user,
                    r.work.class,
                    jobs[i].duration.min(r.work.max_runtime.unwrap_or(u64::MAX)),
                );
            } else {
                // Preempted: work since the last checkpoint is lost.
                let kept = r.last_checkpoint.map_or(0, |c| c.saturating_sub(r.started));
                remaining[i] = l.remaining.saturating_sub(kept);
                let lost = (done_at - r.started - kept.min(done_at - r.started)) as f64
                    * r.work.gpu_milli() as f64
                    / 1000.0
                    / 3600.0;
                outcomes[i].lost_gpu_hours += lost;
                lost_total += lost;
                requeued_at[i] = Some(done_at);
                let mut work = r.work;
                if policy.exact_runtimes {
                    work.expected_runtime = Some(runs_for(remaining[i], &work));
                }
                pending.push(work);
            }
        }
        running = keep;
        // 2. Arrivals.
        while next_arrival < jobs.len() && jobs[next_arrival].submit <= now {
            let mut w = workload(&jobs[next_arrival]);
            if policy.exact_runtimes {
                w.expected_runtime = Some(runs_for(remaining[next_arrival], &w));
            } else if policy.predicts_runtimes {
                w.expected_runtime = runtimes.expect(&w.user, &w.class);
            }
            pending.push(w);
            next_arrival += 1;
        }
        // 3. Checkpoints, history, and the cycle.
        for r in &mut running {
            if jobs[live[&r.work.job.id].trace].kind == 2 && sim.checkpoint_every > 0 {
                let k = (now - r.started) / sim.checkpoint_every;
                r.last_checkpoint = (k > 0).then_some(r.started + k * sim.checkpoint_every);
            }
        }
        history.account(now, policy.config.usage_half_life, &running, &queues);
        for r in &running {
            budgets.charge(r, now);
        }
        budgets.apply(now, &mut queues);
        if !pending.is_empty() {
            cycles += 1;
            placer.set_mix(schedule::pending_mix(&pending));
            let plan = schedule::schedule(
                gpuflow_core::schedule::Snapshot {
                    now,
                    placer: &mut placer,
                    queues: &mut queues,
                    running: &running,
                    pending: &pending,
                    cfg: &policy.config,
                },
                &mut history,
            );
            // Start estimates, as `squeue --start` or `job why` would tell
            // them: at a job's first cycle, then hourly while it waits.
            for p in &plan.pending {
                let o = &mut outcomes[by_id[&p.job]];
                if o.first_start.is_none() && now >= o.submit + 3600 * o.estimates.len() as u64 {
                    o.estimates.push((now, p.eta));
                    if sim.log_estimates {
                        let codes: Vec<&str> = p.reasons.iter().map(|r| r.code()).collect();
                        o.estimate_reasons.push(codes.join("+"));
                    }
                }
            }
            for (id, flavor, allocations) in plan.admitted {
                let k = pending
                    .iter()
                    .position(|w| w.job.id == id)
                    .expect("admitted from pending");
                let mut work = pending.swap_remove(k);
                let i = by_id[&id];
                let run_for = runs_for(remaining[i], &work);
                if policy.exact_runtimes {
                    work.expected_runtime = Some(run_for);
                } else if policy.predicts_runtimes {
                    work.expected_runtime = runtimes.expect(&work.user, &work.class);
                }
                outcomes[i].first_start.get_or_insert(now);
                if let Some(t) = requeued_at[i].take() {
                    outcomes[i].requeued_wait += now - t;
                }
                live.insert(
                    id,
                    Live {
                        trace: i,
                        remaining: remaining[i],
                        end: now + run_for,
                    },
                );
                running.push(Running {
                    work,
                    flavor,
                    allocations,
                    started: now,
                    last_checkpoint: None,
                    stopping_at: None,
                });
            }
            for p in plan.preempted {
                if let Some(r) = running.iter_mut().find(|r| r.work.job.id == p.victim) {
                    r.stopping_at = Some(p.kill_at);
                    outcomes[by_id[&p.victim]].preemptions += 1;
                    preemptions += 1;
                }
            }
        }
        // 4. The next moment something can change.
        let next_event = [
            jobs.get(next_arrival).map(|j| j.submit),
            running
                .iter()
                .map(|r| {
                    r.stopping_at.map_or(live[&r.work.job.id].end, |k| {
                        k.min(live[&r.work.job.id].end)
                    })
                })
                .min(),
            // Work held back by a spent budget may start when it renews.
            (!pending.is_empty())
                .then(|| budgets.next_renewal(now))
                .flatten(),
        ]
        .into_iter()
        .flatten()
        .min();
        let Some(next) = next_event else { break };
        let before = now;
        now = (now + sim.interval).max(next.div_ceil(sim.interval) * sim.interval);
        // GPUs idle while work that fits them waits, until the next cycle.
        if before < horizon && !pending.is_empty() {
            let dt = (now.min(horizon) - before) as f64;
            for (id, milli) in schedule::could_hold(&mut placer, &pending, usize::MAX) {
                idle_waiting_milli_s += milli as f64 * dt;
                outcomes[by_id[&id]].idle_waiting_gpu_hours += milli as f64 * dt / 3.6e6;
            }
        }
        if now > stop {
            break;
        }
    }
    for r in &running {
        account(
            &jobs[live[&r.work.job.id].trace].team,
            r.work.gpu_milli(),
            r.started,
            now,
        );
    }
    for (o, t) in outcomes.iter_mut().zip(&requeued_at) {
        if let Some(t) = t {
            o.requeued_wait += now.saturating_sub(*t);
        }
    }
    let unfinished = outcomes.iter().filter(|o| o.finish.is_none()).count();
    let idle_waiting_gpu_hours = idle_waiting_milli_s / 1000.0 / 3600.0;
    Ok(SimResult {
        policy: policy.name.clone(),
        outcomes,
        team_gpu_hours,
        team_demand_gpu_hours: {
            let mut d: BTreeMap<String, f64> =
                spec.queues.iter().map(|q| (q.name.clone(), 0.0)).collect();
            for j in jobs {
                *d.entry(j.team.clone()).or_default() +=
                    j.gpu_milli() as f64 / 1000.0 * j.duration as f64 / 3600.0;
            }
            d
        },
        team_weights: spec
            .queues
            .iter()
            .map(|q| (q.name.clone(), q.weight))
            .collect(),
        capacity_gpu_hours: capacity_milli as f64 / 1000.0 * horizon as f64 / 3600.0,
        preemptions,
        lost_gpu_hours: lost_total,
        run_gpu_hours,
        cycles,
        unfinished,
        idle_waiting_gpu_hours,
    })
}

/// GPU-hours each queue with a budget has used in its current period, kept
/// up to date as jobs run and handed to the core before each cycle.
struct Budgets {
    queues: Vec<BudgetUse>,
    /// Up to when each running job was charged.
    charged: BTreeMap<JobId, u64>,
}

/// One budgeted queue's current period.
struct BudgetUse {
    queue: QueueId,
    spec: crate::workload::BudgetSpec,
    /// Which period (time / period length) `used` counts.
    period: u64,
    used: f64,
}

impl BudgetUse {
    /// Moves on to the period of time `t` if it began since (its budget is
    /// whole again); a time in a period already over changes nothing.
    fn roll(&mut self, t: u64) {
        let p = t / self.spec.period_s();
        if p > self.period {
            self.period = p;
            self.used = 0.0;
        }
    }
}

impl Budgets {
    fn new(spec: &ClusterSpec, team_queue: &BTreeMap<String, QueueId>) -> Budgets {
        Budgets {
            queues: spec
                .queues
                .iter()
                .filter_map(|q| {
                    Some(BudgetUse {
                        queue: team_queue[&q.name],
                        spec: q.budget.clone()?,
                        period: 0,
                        used: 0.0,
                    })
                })
                .collect(),
            charged: BTreeMap::new(),
        }
    }

    /// Charges running job `r` up to `to` to its queue's current period (the
    /// part before the period began counted in the period before, which is over).
    fn charge(&mut self, r: &Running, to: u64) {
        let Some(b) = self.queues.iter_mut().find(|b| b.queue == r.work.queue) else {
            return;
        };
        let from = self.charged.insert(r.work.job.id, to).unwrap_or(r.started);
        b.roll(to);
        let from = from.max(b.period * b.spec.period_s());
        if to > from {
            b.used += r.work.gpu_milli() as f64 / 1000.0 * (to - from) as f64 / 3600.0;
        }
    }

    /// When the next period of any budget begins after `now`.
    fn next_renewal(&self, now: u64) -> Option<u64> {
        self.queues
            .iter()
            .map(|b| (now / b.spec.period_s() + 1) * b.spec.period_s())
            .min()
    }

    /// A job that left: nothing more to charge.
    fn forget(&mut self, id: JobId) {
        self.charged.remove(&id);
    }

    /// Starts the periods that began by `now` and gives the core each
    /// queue's budget as used so far.
    fn apply(&mut self, now: u64, queues: &mut Queues) {
        for b in &mut self.queues {
            b.roll(now);
            let budget = b.spec.budget(b.used);
            queues.update(b.queue, |t| t.budget = Some(budget));
        }
    }
}

/// Mean and 95th percentile (nearest rank) of a list; zeros for an empty one.
pub fn mean_p95(values: &mut [f64]) -> (f64, f64) {
    if values.is_empty() {
        return (0.0, 0.0);
    }
    values.sort_by(f64::total_cmp);
    let mean = values.iter().sum::<f64>() / values.len() as f64;
    let rank = ((0.95 * values.len() as f64).ceil() as usize).clamp(1, values.len());
    (mean, values[rank - 1])
}

/// The waits of a group of jobs that started, hours.
#[derive(Clone, Copy, Debug, Default, PartialEq)]
pub struct Waits {
    pub jobs: usize,
    pub mean: f64,
    pub p50: f64,
    pub p95: f64,
    pub max: f64,
    /// The p95 of all the time a job waited: to its first start and again
    /// after each preemption (the waits above end at the first start).
    pub queued_p95: f64,
}

/// [`Waits`] of some outcomes.
pub fn waits<'a>(outcomes: impl Iterator<Item = &'a Outcome>) -> Waits {
    let (mut w, mut queued): (Vec<f64>, Vec<f64>) = outcomes
        .filter_map(|o| {
            let first = o.first_start? - o.submit;
            Some((
                first as f64 / 3600.0,
                (first + o.requeued_wait) as f64 / 3600.0,
            ))
        })
        .unzip();
    if w.is_empty() {
        return Waits::default();
    }
    let (mean, p95) = mean_p95(&mut w);
    Waits {
        jobs: w.len(),
        mean,
        p50: w[(w.len() - 1) / 2],
        p95,
        max: w[w.len() - 1],
        queued_p95: mean_p95(&mut queued).1,
    }
}

/// How well start estimates held, over a group of jobs' estimates made
/// before their first start (see [`Outcome::estimates`]).
#[derive(Clone, Debug, Default, PartialEq)]
pub struct Accuracy {
    /// Estimates of jobs that started.
    pub estimates: usize,
    /// Of those, the share that said "unknown".
    pub unknown: f64,
    /// Median and p90 of |estimated − real start|, hours, over the known.
    pub median_h: f64,
    pub p90_h: f64,
    /// Median of estimated − real start, hours: above 0, estimates late.
    pub bias_h: f64,
    /// Share of known estimates within 25 % of the wait still ahead or
    /// within 10 minutes, whichever is wider.
    pub within: f64,
    /// Jobs that waited more than 10 minutes: the median of their first
    /// estimate's error over their real wait.
    pub long_waits: usize,
    pub long_median_rel: f64,
}

/// Estimate accuracy of `outcomes` (jobs that never started are left out:
/// their estimates cannot be scored).
pub fn accuracy<'a>(outcomes: impl Iterator<Item = &'a Outcome>) -> Accuracy {
    let (mut errors, mut unknown, mut within) = (Vec::new(), 0usize, 0usize);
    let mut signed = Vec::new();
    let mut rel = Vec::new();
    for o in outcomes {
        let Some(start) = o.first_start else {
            continue;
        };
        for (k, &(at, eta)) in o.estimates.iter().enumerate() {
            let Some(eta) = eta else {
                unknown += 1;
                continue;
            };
            let err = eta.abs_diff(start);
            let ahead = start.saturating_sub(at);
            if err as f64 <= (ahead as f64 * 0.25).max(600.0) {
                within += 1;
            }
            errors.push(err as f64 / 3600.0);
            signed.push((eta as f64 - start as f64) / 3600.0);
            let wait = start - o.submit;
            if k == 0 && wait > 600 {
                rel.push(err as f64 / wait as f64);
            }
        }
    }
    let n = errors.len() + unknown;
    if n == 0 {
        return Accuracy::default();
    }
    let pick = |v: &mut Vec<f64>, q: f64| {
        if v.is_empty() {
            return 0.0;
        }
        v.sort_by(f64::total_cmp);
        v[((v.len() as f64 * q).ceil() as usize).clamp(1, v.len()) - 1]
    };
    Accuracy {
        estimates: n,
        unknown: unknown as f64 / n as f64,
        median_h: pick(&mut errors, 0.5),
        p90_h: pick(&mut errors, 0.9),
        bias_h: pick(&mut signed, 0.5),
        within: if errors.is_empty() {
            0.0
        } else {
            within as f64 / errors.len() as f64
        },
        long_waits: rel.len(),
        long_median_rel: pick(&mut rel, 0.5),
    }
}

/// From the first submission to the last job's end, hours (to the end of
/// the simulation when work was left).
pub fn makespan(r: &SimResult) -> f64 {
    let first = r.outcomes.iter().map(|o| o.submit).min().unwrap_or(0);
    let last = r
        .outcomes
        .iter()
        .filter_map(|o| o.finish)
        .max()
        .unwrap_or(first);
    (last - first) as f64 / 3600.0
}

/// Statistics of a group of jobs: (jobs, mean wait, p95 wait, mean JCT, p95 JCT), hours.
pub fn group_stats<'a>(outcomes: impl Iterator<Item = &'a Outcome>) -> (usize, f64, f64, f64, f64) {
    let mut waits = Vec::new();
    let mut jcts = Vec::new();
    for o in outcomes {
        if let Some(s) = o.first_start {
            waits.push((s - o.submit) as f64 / 3600.0);
        }
        if let Some(f) = o.finish {
            jcts.push((f - o.submit) as f64 / 3600.0);
        }
    }
    let n = waits.len();
    let (mw, pw) = mean_p95(&mut waits);
    let (mj, pj) = mean_p95(&mut jcts);
    (n, mw, pw, mj, pj)
}

/// Jain's fairness index of GPU-hours per unit of weight across teams.
pub fn jain(result: &SimResult) -> f64 {
    let xs: Vec<f64> = result
        .team_gpu_hours
        .iter()
        .map(|(t, h)| h / result.team_weights[t].max(1e-9))
        .collect();
    let s: f64 = xs.iter().sum();
    let sq: f64 = xs.iter().map(|x| x * x).sum();
    if sq == 0.0 {
        1.0
    } else {
        s * s / (xs.len() as f64 * sq)
    }
}

/// Each team's share of allocated GPU-hours against its weighted share.
pub fn team_shares(result: &SimResult) -> Vec<(String, f64, f64)> {
    let total: f64 = result.team_gpu_hours.values().sum();
    let wsum: f64 = result.team_weights.values().sum();
    result
        .team_gpu_hours
        .iter()
        .map(|(t, h)| {
            (
                t.clone(),
                if total > 0.0 { h / total } else { 0.0 },
                result.team_weights[t] / wsum,
            )
        })
        .collect()
}

/// The name of a job kind.
pub fn kind_name(k: usize) -> &'static str {
    KINDS.get(k).copied().unwrap_or("?")
}

#[cfg(test)]
mod tune_tests {
    use super::SimPolicy;

    #[test]
    fn tune_sets_a_known_setting_and_refuses_the_rest_with_the_known_ones() {
        let mut p = SimPolicy::gpuflow();
        p.tune("batch_rank", "20").unwrap();
        let rank = |p: &SimPolicy, name: &str| {
            p.config
                .classes
                .iter()
                .find(|c| c.name == name)
                .unwrap()
                .rank
        };
        assert_eq!(rank(&p, "batch"), rank(&p, "training"));
        p.tune("history_weight", "1").unwrap();
        assert_eq!(p.config.history_weight, 1.0);
        let e = p.tune("history_weight", "2").unwrap_err();
        assert!(e.contains("not a valid value"), "{e}");
        p.tune("usage_half_life", "86400").unwrap();
        assert_eq!(p.config.usage_half_life, 86_400);
        let e = p.tune("usage_half_life", "0").unwrap_err();
        assert!(e.contains("not a valid value"), "{e}");
        p.tune("quotas", "false").unwrap();
        p.tune("class_tiers", "false").unwrap();
        p.tune("backfill_per_node", "true").unwrap();
        assert!(p.config.backfill_per_node);
        assert!(!p.config.quotas && !p.config.class_tiers);
        p.tune("aging_step", "0").unwrap();
        p.tune("aging_cap", "24").unwrap();
        assert_eq!((p.config.aging_step, p.config.aging_cap), (0, 24));
        let e = p.tune("aging_cap", "many").unwrap_err();
        assert!(e.contains("not a valid value"), "{e}");
        p.tune("protected_pass_budgets", "false").unwrap();
        p.tune("underserved_pass_budgets", "0.5").unwrap();
        assert!(!p.config.protected_pass_budgets);
        assert_eq!(p.config.underserved_pass_budgets, 0.5);
        for bad in ["-1", "NaN", "inf"] {
            let e = p.tune("underserved_pass_budgets", bad).unwrap_err();
            assert!(e.contains("not a valid value"), "{e}");
        }
        p.tune("reclaims_restore_fairness", "false").unwrap();
        assert!(!p.config.reclaims_restore_fairness);
        let e = p.tune("reclaims_restore_fairness", "maybe").unwrap_err();
        assert!(e.contains("not a valid value"), "{e}");
        let e = p.tune("speed", "11").unwrap_err();
        assert!(
            e.contains("batch_rank") && e.contains("tries_per_queue"),
            "{e}"
        );
    }
}
