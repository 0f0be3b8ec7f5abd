//! Accounting: GPU-hours and cost from the ledger each job keeps (one
//! [`Held`](crate::state::Held) per attempt that held GPUs), rolled up by
//! team, project, user, queue, GPU model, cost centre or job, per hour, day,
//! month or the whole range. The reports are pure: the caller passes the
//! jobs, projects, prices and the time. Only the budget count
//! ([`refresh_budgets`], [`budget_loop`]) reads the store and the clock.
//!
//! A hold counts what it held (whole GPUs 1 each, a fraction its share, a
//! MIG instance its slices over 7, a time slice a quarter) for as long as
//! it held it, clipped to the range and split at period boundaries (UTC
//! calendar months), so every row sums to the per-job figures. Used
//! GPU-hours weigh the held time by the GPUs' sampled utilisation, where
//! the agent sampled it; efficiency is used over held, over the held time
//! that was sampled.

use std::collections::{BTreeMap, BTreeSet};

use gpuflow_api as api;

use crate::event::EventKind;
use crate::state::JobRec;

/// What rows are keyed by.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum By {
    Team,
    Project,
    User,
    Queue,
    Model,
    CostCentre,
    Job,
}

impl By {
    pub fn parse(s: &str) -> Option<By> {
        Some(match s {
            "team" => By::Team,
            "project" => By::Project,
            "user" => By::User,
            "queue" => By::Queue,
            "model" => By::Model,
            "cost_centre" | "cost-centre" => By::CostCentre,
            "job" => By::Job,
            _ => return None,
        })
    }
}

/// How rows are split in time.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Period {
    Hour,
    Day,
    Month,
    /// One row per key for the whole range.
    All,
}

impl Period {
    pub fn parse(s: &str) -> Option<Period> {
        Some(match s {
            "hour" => Period::Hour,
            "day" => Period::Day,
            "month" => Period::Month,
            "all" | "none" => Period::All,
            _ => return None,
        })
    }

    /// The start of the period holding `t`, and of the next one.
    fn bounds(self, t: u64, range: (u64, u64)) -> (u64, u64) {
        match self {
            Period::Hour => (t - t % 3600, t - t % 3600 + 3600),
            Period::Day => (t - t % 86_400, t - t % 86_400 + 86_400),
            Period::Month => {
                let (y, m, _) = civil_from_days((t / 86_400) as i64);
                let start = days_from_civil(y, m, 1) as u64 * 86_400;
                let (ny, nm) = if m == 12 { (y + 1, 1) } else { (y, m + 1) };
                (start, days_from_civil(ny, nm, 1) as u64 * 86_400)
            }
            Period::All => range,
        }
    }
}

/// Days since 1970-01-01 of a proleptic Gregorian date (H. Hinnant's algorithm).
fn days_from_civil(y: i64, m: u32, d: u32) -> i64 {
    let y = if m <= 2 { y - 1 } else { y };
    let era = y.div_euclid(400);
    let yoe = y - era * 400;
    let mp = (i64::from(m) + 9) % 12;
    let doy = (153 * mp + 2) / 5 + i64::from(d) - 1;
    let doe = yoe * 365 + yoe / 4 - yoe / 100 + doy;
    era * 146_097 + doe - 719_468
}

/// The date of a day since 1970-01-01.
fn civil_from_days(z: i64) -> (i64, u32, u32) {
    let z = z + 719_468;
    let era = z.div_euclid(146_097);
    let doe = z - era * 146_097;
    let yoe = (doe - doe / 1460 + doe / 36_524 - doe / 146_096) / 365;
    let doy = doe - (365 * yoe + yoe / 4 - yoe / 100);
    let mp = (5 * doy + 2) / 153;
    let d = (doy - (153 * mp + 2) / 5 + 1) as u32;
    let m = if mp < 10 { mp + 3 } else { mp - 9 } as u32;
    (yoe + era * 400 + i64::from(m <= 2), m, d)
}

/// The price of an hour of a GPU of `model`: its own, else `*`'s, else 0.
pub fn gpu_price(prices: &api::Prices, model: &str) -> f64 {
    prices
        .gpu_hour
        .get(model)
        .or_else(|| prices.gpu_hour.get("*"))
        .copied()
        .unwrap_or(0.0)
}

/// The usage rows of `jobs` between `from` and `to`, ordered by key, then
/// period.
pub fn usage(
    jobs: &[JobRec],
    projects: &BTreeMap<String, api::Project>,
    prices: &api::Prices,
    by: By,
    period: Period,
    range: (u64, u64),
    now: u64,
) -> Vec<api::UsageRow> {
    let mut u = Usage::new(projects, prices, by, period, range, now);
    jobs.iter().for_each(|j| u.add(j));
    u.rows()
}

/// The usage report, summed one job at a time: it keeps a row per key and
/// period, never the jobs.
pub struct Usage<'a> {
    projects: &'a BTreeMap<String, api::Project>,
    prices: &'a api::Prices,
    by: By,
    period: Period,
    range: (u64, u64),
    now: u64,
    rows: BTreeMap<(String, u64), UsageSum>,
}

#[derive(Default)]
struct UsageSum {
    gpu_s: f64,
    sampled_s: f64,
    used_s: f64,
    cost: f64,
    jobs: u32,
    /// The last job counted in `jobs`: a job adds to a row from several
    /// holds, all before the next job comes.
    last: Option<u64>,
}

impl<'a> Usage<'a> {
    pub fn new(
        projects: &'a BTreeMap<String, api::Project>,
        prices: &'a api::Prices,
        by: By,
        period: Period,
        range: (u64, u64),
        now: u64,
    ) -> Usage<'a> {
        Usage {
            projects,
            prices,
            by,
            period,
            range,
            now,
            rows: BTreeMap::new(),
        }
    }

    /// Adds what `j` held in the range.
    pub fn add(&mut self, j: &JobRec) {
        let (from, to) = self.range;
        let now = self.now;
        for h in &j.held {
            let end = h.to.unwrap_or(now).min(to);
            let mut t = h.from.max(from);
            while t < end {
                let (p0, p1) = self.period.bounds(t, (from, to));
                let upto = p1.min(end);
                let gpu_s = h.gpu_s(t, upto, now);
                let key = match self.by {
                    By::Team => j.team.clone(),
                    By::Project => j.spec.project.clone().unwrap_or_else(|| "-".into()),
                    By::User => j.user.clone(),
                    By::Queue => j.spec.queue.clone(),
                    By::Model => h.model.clone(),
                    By::CostCentre => j
                        .spec
                        .project
                        .as_ref()
                        .and_then(|p| self.projects.get(p))
                        .map(|p| p.cost_centre.clone())
                        .filter(|c| !c.is_empty())
                        .unwrap_or_else(|| "-".into()),
                    By::Job => j.id.to_string(),
                };
                let a = self.rows.entry((key, p0)).or_default();
                a.gpu_s += gpu_s;
                // An open hold's utilisation so far, from its tasks' samples.
                let util = j.hold_util(h);
                if let Some(u) = util {
                    a.sampled_s += gpu_s;
                    a.used_s += gpu_s * u / 100.0;
                }
                a.cost += gpu_s / 3600.0 * gpu_price(self.prices, &h.model);
                if a.last != Some(j.id) {
                    a.last = Some(j.id);
                    a.jobs += 1;
                }
                t = upto;
            }
        }
    }

    pub fn rows(self) -> Vec<api::UsageRow> {
        self.rows
            .into_iter()
            .map(|((key, period_start), a)| api::UsageRow {
                key,
                period_start,
                gpu_hours: a.gpu_s / 3600.0,
                used_gpu_hours: a.used_s / 3600.0,
                efficiency: (a.sampled_s > 0.0).then(|| a.used_s / a.sampled_s),
                cost: a.cost,
                jobs: a.jobs,
            })
            .collect()
    }
}

/// The jobs report: the jobs submitted in `[from, to)`, by queue or kind
/// (`by`: anything else is the queue): waits (p50, p95 by nearest rank),
/// outcomes, preemptions and the work they lost.
pub fn job_rows(jobs: &[JobRec], by_kind: bool, range: (u64, u64)) -> Vec<api::JobsRow> {
    let mut r = JobRows::new(by_kind, range);
    jobs.iter().for_each(|j| r.add(j));
    r.rows()
}

/// The jobs report, summed one job at a time: a row and the waits of each
/// key.
pub struct JobRows {
    by_kind: bool,
    range: (u64, u64),
    rows: BTreeMap<String, (api::JobsRow, Vec<u64>)>,
}

impl JobRows {
    pub fn new(by_kind: bool, range: (u64, u64)) -> JobRows {
        JobRows {
            by_kind,
            range,
            rows: BTreeMap::new(),
        }
    }

    /// Counts `j` when it was submitted in the range.
    pub fn add(&mut self, j: &JobRec) {
        let (from, to) = self.range;
        if !(from..to).contains(&j.submitted_at) {
            return;
        }
        let key = if self.by_kind {
            format!("{:?}", j.spec.kind).to_lowercase()
        } else {
            j.spec.queue.clone()
        };
        let (r, waits) = self.rows.entry(key.clone()).or_insert_with(|| {
            (
                api::JobsRow {
                    key,
                    submitted: 0,
                    started: 0,
                    wait_p50_s: None,
                    wait_p95_s: None,
                    succeeded: 0,
                    failed: 0,
                    cancelled: 0,
                    failure_rate: None,
                    preemptions: 0,
                    lost_gpu_hours: 0.0,
                },
                Vec::new(),
            )
        });
        r.submitted += 1;
        if let Some(s) = j.started_at {
            r.started += 1;
            waits.push(s.saturating_sub(j.submitted_at));
        }
        match j.state {
            api::JobState::Succeeded => r.succeeded += 1,
            // A job past its max runtime did not finish its work.
            api::JobState::Failed | api::JobState::Timeout => r.failed += 1,
            api::JobState::Cancelled => r.cancelled += 1,
            _ => {}
        }
        r.preemptions += j.preemptions;
        r.lost_gpu_hours += j.lost_gpu_hours;
    }

    pub fn rows(self) -> Vec<api::JobsRow> {
        self.rows
            .into_values()
            .map(|(mut r, mut waits)| {
                waits.sort_unstable();
                let rank = |p: f64| {
                    let n = waits.len();
                    (n > 0).then(|| waits[((n as f64 * p).ceil() as usize).clamp(1, n) - 1])
                };
                r.wait_p50_s = rank(0.50);
                r.wait_p95_s = rank(0.95);
                let finished = r.succeeded + r.failed + r.cancelled;
                r.failure_rate = (finished > 0).then(|| f64::from(r.failed) / f64::from(finished));
                r
            })
            .collect()
    }
}

/// Memory a job must have to spare over its measured peak before a
/// smaller GPU is advised.
const HEADROOM: f64 = 1.25;

/// Below this mean utilisation a MIG slice is advised rather than a whole GPU.
const MIG_BELOW_PCT: f64 = 40.0;

/// What the cluster offers: each model's memory, and the MIG profiles
/// (profile, memory, slices) seen on GPUs of each model.
pub struct Offer {
    pub models: BTreeMap<String, u64>,
    pub mig: BTreeMap<String, Vec<(String, u64, u32)>>,
}

/// Jobs of `jobs` whose measured GPU memory and utilisation would fit a
/// cheaper model, or a MIG slice of theirs, with the saving in a 30-day
/// month at the GPU-hours they held in `[from, to)`. Jobs without
/// samples, shared GPUs and MIG jobs are left out; prices decide what is
/// cheaper, so nothing is advised without them.
pub fn advice(
    jobs: &[JobRec],
    offer: &Offer,
    prices: &api::Prices,
    range: (u64, u64),
    now: u64,
) -> Vec<api::Advice> {
    let mut out: Vec<api::Advice> = jobs
        .iter()
        .filter_map(|j| advice_for(j, offer, prices, range, now))
        .collect();
    sort_advice(&mut out);
    out
}

/// Largest saving first.
pub fn sort_advice(out: &mut [api::Advice]) {
    out.sort_by(|a, b| b.saving_per_month.total_cmp(&a.saving_per_month));
}

/// The advice for one job, if any (see [`advice`]).
pub fn advice_for(
    j: &JobRec,
    offer: &Offer,
    prices: &api::Prices,
    (from, to): (u64, u64),
    now: u64,
) -> Option<api::Advice> {
    let month = 30.0 * 86_400.0 / (to - from) as f64;
    // Whole GPUs only: what it holds is what it could hold less of.
    let whole = j.spec.tasks.iter().all(|g| {
        g.resources
            .gpu
            .as_ref()
            .is_none_or(|s| s.mode == api::GpuMode::Whole)
    });
    let peak = j
        .tasks
        .iter()
        .filter_map(|t| t.usage.as_ref())
        .filter(|u| u.samples > 0)
        .map(|u| u.gpu_memory_peak_mib)
        .max();
    let (Some(peak), Some(h), true) = (peak, j.held.last(), whole) else {
        return None;
    };
    let util = j.hold_util(h)?;
    let gpu_hours: f64 = j.held.iter().map(|h| h.gpu_s(from, to, now)).sum::<f64>() / 3600.0;
    let price = gpu_price(prices, &h.model);
    if gpu_hours <= 0.0 || price <= 0.0 {
        return None;
    }
    let need = (peak as f64 * HEADROOM).ceil() as u64;
    // The cheapest model with room for it.
    let cheaper = offer
        .models
        .iter()
        .filter(|(m, mem)| **m != h.model && **mem >= need)
        .map(|(m, _)| (m.clone(), gpu_price(prices, m)))
        .filter(|(_, p)| *p < price)
        .min_by(|a, b| a.1.total_cmp(&b.1));
    // A MIG slice of its own model, when it uses little of the GPU.
    let slice = (util < MIG_BELOW_PCT)
        .then(|| {
            offer
                .mig
                .get(&h.model)?
                .iter()
                .filter(|(_, mem, _)| *mem >= need)
                .min_by_key(|(_, _, s)| *s)
                .map(|(p, _, s)| (format!("{} MIG {p}", h.model), price * f64::from(*s) / 7.0))
        })
        .flatten();
    let best = [cheaper, slice]
        .into_iter()
        .flatten()
        .min_by(|a, b| a.1.total_cmp(&b.1));
    best.map(|(instead, p)| api::Advice {
        id: j.id,
        name: j.spec.name.clone(),
        team: j.team.clone(),
        model: h.model.clone(),
        peak_gpu_memory_mib: peak,
        util_pct: util,
        instead,
        saving_per_month: (price - p) * gpu_hours * month,
        currency: prices.currency.clone(),
    })
}

/// The start of `period` holding `t` (UTC; weeks start on Monday).
pub fn period_start(period: api::BudgetPeriod, t: u64) -> u64 {
    let day = t / 86_400;
    match period {
        api::BudgetPeriod::Day => day * 86_400,
        // 1970-01-01 was a Thursday: Monday is 3 days before.
        api::BudgetPeriod::Week => (day - (day + 3) % 7) * 86_400,
        api::BudgetPeriod::Month => Period::Month.bounds(t, (0, 0)).0,
    }
}

/// What `jobs` used of a budget from `from` to `now`, in its unit:
/// GPU-hours held, or their cost at `prices`.
pub fn budget_spent<'j>(
    jobs: impl Iterator<Item = &'j JobRec>,
    b: &api::BudgetSpec,
    prices: &api::Prices,
    from: u64,
    now: u64,
) -> f64 {
    jobs.flat_map(|j| &j.held)
        .map(|h| {
            let hours = h.gpu_s(from, now, now) / 3600.0;
            if b.cost.is_some() {
                hours * gpu_price(prices, &h.model)
            } else {
                hours
            }
        })
        .sum()
}

/// The core's view of a budget, given what was last counted for it in its
/// unit (a count from an earlier period is none: the budget renewed).
pub fn core_budget(
    b: &api::BudgetSpec,
    counted: Option<&(u64, f64)>,
    now: u64,
) -> gpuflow_core::queue::Budget {
    let start = period_start(b.period, now);
    let used = counted
        .filter(|(s, _)| *s == start)
        .map_or(0.0, |(_, h)| *h);
    // The core compares used with the budget: both in the budget's unit.
    gpuflow_core::queue::Budget {
        gpu_hours: b.limit(),
        used_gpu_hours: used,
        taper_from: b.taper_from,
        min_weight_factor: b.min_weight_factor,
        when_exhausted: match b.when_exhausted {
            api::WhenExhausted::StopBorrowing => {
                gpuflow_core::queue::BudgetExhausted::StopBorrowing
            }
            api::WhenExhausted::StopAdmitting => {
                gpuflow_core::queue::BudgetExhausted::StopAdmitting
            }
        },
    }
}

/// A budget as its queue's (or project's) viewers see it.
pub fn budget_use(b: &api::BudgetSpec, counted: Option<&(u64, f64)>, now: u64) -> api::BudgetUse {
    let c = core_budget(b, counted, now);
    api::BudgetUse {
        period_start: period_start(b.period, now),
        unit: b.unit().to_string(),
        used: c.used_gpu_hours,
        left: (c.gpu_hours - c.used_gpu_hours).max(0.0),
        weight_factor: c.weight_factor(),
        exhausted: c.exhausted(),
    }
}

/// Counts every budgeted queue's and project's use in its current period
/// from the ledger of every job (the store's, and memory's newer ones) and
/// keeps it for the cycle and the views.
///
/// # Errors
/// When the store cannot be read.
pub async fn refresh_budgets(shared: &crate::Shared, now: u64) -> Result<(), crate::ServerError> {
    let (queues, projects, prices) = {
        let w = shared.world.lock().await;
        let queues: Vec<(String, api::BudgetSpec)> = w
            .records()
            .queues
            .values()
            .filter_map(|q| Some((q.name.clone(), q.budget.clone()?)))
            .collect();
        let projects: Vec<(String, api::BudgetSpec)> = w
            .records()
            .projects
            .values()
            .filter_map(|p| Some((p.name.clone(), p.budget.clone()?)))
            .collect();
        (queues, projects, w.records().prices.clone())
    };
    if queues.is_empty() && projects.is_empty() {
        return Ok(());
    }
    // Summed one job at a time, in each budget's period.
    let mut queue_spent: BTreeMap<String, (u64, f64)> = queues
        .iter()
        .map(|(q, b)| (q.clone(), (period_start(b.period, now), 0.0)))
        .collect();
    let mut project_spent: BTreeMap<String, (u64, f64)> = projects
        .iter()
        .map(|(p, b)| (p.clone(), (period_start(b.period, now), 0.0)))
        .collect();
    let budgets_of_queues: BTreeMap<&str, &api::BudgetSpec> =
        queues.iter().map(|(q, b)| (q.as_str(), b)).collect();
    let budgets_of_projects: BTreeMap<&str, &api::BudgetSpec> =
        projects.iter().map(|(p, b)| (p.as_str(), b)).collect();
    crate::each_job(shared, None, |j| {
        if let (Some(b), Some((start, spent))) = (
            budgets_of_queues.get(j.spec.queue.as_str()),
            queue_spent.get_mut(&j.spec.queue),
        ) {
            *spent += budget_spent(std::iter::once(&j), b, &prices, *start, now);
        }
        if let Some(p) = j.spec.project.as_deref()
            && let (Some(b), Some((start, spent))) =
                (budgets_of_projects.get(p), project_spent.get_mut(p))
        {
            *spent += budget_spent(std::iter::once(&j), b, &prices, *start, now);
        }
    })
    .await?;
    let queues = queue_spent;
    let projects = project_spent;
    let mut w = shared.write().await;
    // A budget past its taper point is "low": said once a period, as an
    // event its team's webhooks may ask for (`budget-low`).
    let mut change = crate::Change::default();
    for (kind, spent, budgets) in [
        ("queue", &queues, &budgets_of_queues),
        ("project", &projects, &budgets_of_projects),
    ] {
        for (name, &(start, used)) in spent {
            let Some(b) = budgets.get(name.as_str()) else {
                continue;
            };
            let limit = b.limit();
            if limit <= 0.0 || used < b.taper_from * limit {
                continue;
            }
            let key = format!("{kind}/{name}");
            if w.budget_warned.get(&key) == Some(&start) {
                continue;
            }
            let team = match kind {
                "queue" => w.records().queues.get(name).map(|q| q.team.clone()),
                _ => w.records().projects.get(name).map(|p| p.team.clone()),
            };
            let Some(team) = team else { continue };
            let unit = if b.unit() == "cost" { "" } else { " GPU-hours" };
            change.event(
                now,
                None,
                &team,
                EventKind::BudgetLow,
                format!(
                    "{kind} {name} has used {:.0} % of its budget of {limit}{unit} this {}: {:.1}{unit} left",
                    100.0 * used / limit,
                    match b.period {
                        api::BudgetPeriod::Day => "day",
                        api::BudgetPeriod::Week => "week",
                        api::BudgetPeriod::Month => "month",
                    },
                    (limit - used).max(0.0)
                ),
            );
            w.budget_warned.insert(key, start);
        }
    }
    w = w.commit(change).await?;
    w.budget_used = queues;
    w.project_budget_used = projects;
    drop(w);
    shared.wake.notify_one();
    Ok(())
}

/// Refreshes the budgets every 30 s, for as long as the server runs; a
/// failed count is logged and tried again.
pub async fn budget_loop(shared: std::sync::Arc<crate::Shared>) {
    loop {
        if let Err(e) = refresh_budgets(&shared, shared.now()).await {
            tracing::error!(error = %e, "counting the budgets failed; retrying");
        }
        tokio::time::sleep(std::time::Duration::from_secs(30)).await;
    }
}

/// The recorded workload of `range` (jobs submitted in it that held GPUs),
/// with the cluster's nodes and each team's quotas, for capacity planning.
pub fn recorded(
    jobs: &[JobRec],
    nodes: &[&crate::state::NodeRec],
    queues: &[&api::QueueSpec],
    (from, to): (u64, u64),
    now: u64,
) -> api::RecordedWorkload {
    use gpuflow_core::request::GpuRequest;
    let mut out = api::RecordedWorkload {
        from,
        to,
        jobs: Vec::new(),
        nodes: Vec::new(),
        teams: Vec::new(),
        prices: api::Prices::default(),
        left_out: BTreeMap::new(),
        cycle_s: 0,
    };
    let mut skip = |why: &str| *out.left_out.entry(why.to_string()).or_default() += 1;
    for j in jobs.iter().filter(|j| (from..to).contains(&j.submitted_at)) {
        let held: u64 = j
            .held
            .iter()
            .map(|h| h.to.unwrap_or(now).saturating_sub(h.from))
            .sum();
        if held == 0 {
            skip("never held a GPU");
            continue;
        }
        let asks: Vec<(GpuRequest, u32)> = j
            .spec
            .tasks
            .iter()
            .map(|g| (crate::convert::gpu_request(g), g.replicas))
            .filter(|(r, _)| !matches!(r, GpuRequest::None))
            .collect();
        let Some((ask, _)) = asks.first() else {
            skip("never held a GPU");
            continue;
        };
        if asks.iter().any(|(a, _)| a != ask) {
            skip("task groups ask for different GPUs");
            continue;
        }
        let (gpus_per_task, milli) = match ask {
            GpuRequest::Whole { count } => (u32::from(*count), None),
            other => (0, Some(other.quota_milli() as u32)),
        };
        out.jobs.push(api::RecordedJob {
            id: j.id,
            submitted_at: j.submitted_at,
            duration_s: held,
            tasks: asks.iter().map(|(_, n)| n).sum(),
            gpus_per_task,
            milli,
            team: j.team.clone(),
            kind: j.spec.kind,
            priority: j.spec.priority,
            max_runtime_s: j.spec.max_runtime_s,
            model: j.held.last().map_or_else(String::new, |h| h.model.clone()),
        });
    }
    let mut shapes: BTreeMap<(String, u32, u64, u64), u32> = BTreeMap::new();
    let mut models: BTreeSet<String> = BTreeSet::new();
    for n in nodes {
        let Some(g) = n.inventory.gpus.first() else {
            continue;
        };
        models.insert(g.model.clone());
        *shapes
            .entry((
                g.model.clone(),
                n.inventory.gpus.len() as u32,
                n.inventory.cpu_milli.div_ceil(1000),
                n.inventory.memory_mib.div_ceil(1024),
            ))
            .or_default() += 1;
    }
    out.nodes = shapes
        .into_iter()
        .map(|((model, gpus, cpu, mem_gib), count)| api::RecordedNodes {
            count,
            gpus,
            model,
            cpu,
            mem_gib,
        })
        .collect();
    let mut teams: BTreeMap<String, api::RecordedTeam> = BTreeMap::new();
    // A model's borrowing is unlimited for a team once one of its queues
    // sets no limit there.
    let mut limits: BTreeMap<(String, String), Option<f64>> = BTreeMap::new();
    for q in queues {
        let t = teams
            .entry(q.team.clone())
            .or_insert_with(|| api::RecordedTeam {
                name: q.team.clone(),
                weight: 0.0,
                guaranteed: BTreeMap::new(),
                borrow_limit: BTreeMap::new(),
            });
        t.weight += q.weight;
        for m in &models {
            let Some(quota) = gpuflow_core::queue::quota_entry(&q.quotas, m) else {
                continue;
            };
            *t.guaranteed.entry(m.clone()).or_default() += quota.guaranteed;
            let l = limits
                .entry((q.team.clone(), m.clone()))
                .or_insert(Some(0.0));
            *l = l.zip(quota.borrow_limit).map(|(a, b)| a + b);
        }
    }
    for ((team, model), limit) in limits {
        if let (Some(l), Some(t)) = (limit, teams.get_mut(&team)) {
            t.borrow_limit.insert(model, l);
        }
    }
    out.teams = teams.into_values().collect();
    out
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn the_jobs_report_counts_waits_outcomes_and_preemptions_per_queue() {
        let spec = api::JobSpec::parse(
            b"name: j\nqueue: q\ntasks:\n  - name: main\n    command: [x]\n",
            false,
        )
        .unwrap();
        let job = |id: u64, submitted: u64, wait: Option<u64>, state: api::JobState| {
            let mut j = crate::lifecycle::submitted(id, spec.clone(), "t", "u", None, submitted);
            j.started_at = wait.map(|w| submitted + w);
            j.state = state;
            j
        };
        let mut preempted = job(3, 100, Some(30), api::JobState::Running);
        preempted.preemptions = 2;
        preempted.lost_gpu_hours = 1.5;
        let jobs = vec![
            job(1, 100, Some(10), api::JobState::Succeeded),
            job(2, 100, Some(20), api::JobState::Failed),
            preempted,
            job(4, 100, None, api::JobState::Pending),
            // Submitted outside the range: left out.
            job(5, 5000, Some(1), api::JobState::Succeeded),
        ];
        let rows = job_rows(&jobs, false, (0, 1000));
        assert_eq!(rows.len(), 1);
        let r = &rows[0];
        assert_eq!((r.key.as_str(), r.submitted, r.started), ("q", 4, 3));
        assert_eq!((r.wait_p50_s, r.wait_p95_s), (Some(20), Some(30)));
        assert_eq!((r.succeeded, r.failed, r.cancelled), (1, 1, 0));
        assert_eq!(r.failure_rate, Some(0.5));
        assert_eq!((r.preemptions, r.lost_gpu_hours), (2, 1.5));
        assert_eq!(job_rows(&jobs, true, (0, 1000))[0].key, "training");
    }

    #[test]
    fn advice_picks_the_cheapest_gpu_or_mig_slice_the_measured_use_fits() {
        let spec = api::JobSpec::parse(
            b"name: j\nqueue: q\ntasks:\n  - name: main\n    command: [x]\n    resources: {gpu: {count: 1}}\n",
            false,
        )
        .unwrap();
        let job = |id: u64, peak: u64, util: f64| {
            let mut j = crate::lifecycle::submitted(id, spec.clone(), "t", "u", None, 0);
            j.held.push(crate::state::Held {
                attempt: 1,
                from: 0,
                to: Some(3600),
                gpu_milli: 1000,
                model: "H100".into(),
                util_pct: Some(util),
            });
            j.tasks.push(crate::state::TaskState {
                group: 0,
                index: 0,
                phase: api::TaskPhase::Exited,
                exit_code: Some(0),
                message: String::new(),
                port: None,
                ports: Default::default(),
                ready: None,
                usage: Some(api::TaskUsage {
                    samples: 10,
                    gpu_memory_peak_mib: peak,
                    gpu_util_avg_pct: util,
                    ..Default::default()
                }),
            });
            j
        };
        let offer = Offer {
            models: [("H100".to_string(), 81_920), ("A10".to_string(), 24_576)].into(),
            mig: [(
                "H100".to_string(),
                vec![
                    ("1g.10gb".to_string(), 10_240, 1),
                    ("3g.40gb".to_string(), 40_960, 3),
                ],
            )]
            .into(),
        };
        let prices = api::Prices {
            currency: "EUR".into(),
            gpu_hour: [("H100".to_string(), 3.5), ("A10".to_string(), 1.0)].into(),
        };
        let jobs = vec![
            job(1, 8_000, 15.0),  // a 1g slice (0.5/h) beats the A10 (1/h)
            job(2, 18_000, 80.0), // busy: the A10 fits its memory
            job(3, 30_000, 10.0), // the 3g slice (1.5/h); the A10 is too small
            job(4, 70_000, 90.0), // nothing smaller fits
        ];
        // One hour held in a 30-day range: the saving is per month at that use.
        let a = advice(&jobs, &offer, &prices, (0, 30 * 86_400), 3600);
        let by: BTreeMap<u64, &api::Advice> = a.iter().map(|x| (x.id, x)).collect();
        assert_eq!(by.len(), 3, "{a:?}");
        assert_eq!(by[&1].instead, "H100 MIG 1g.10gb");
        assert!((by[&1].saving_per_month - 3.0).abs() < 1e-9, "{a:?}");
        assert_eq!(by[&2].instead, "A10");
        assert!((by[&2].saving_per_month - 2.5).abs() < 1e-9);
        assert_eq!(by[&3].instead, "H100 MIG 3g.40gb");
        assert!((by[&3].saving_per_month - 2.0).abs() < 1e-9);
        assert!(!by.contains_key(&4));
        assert_eq!(a[0].id, 1, "largest saving first");
    }

    #[test]
    fn calendar_months_are_split_where_they_begin() {
        // 2026-12-03 12:00 UTC.
        let t = 1_796_299_200;
        let (a, b) = Period::Month.bounds(t, (0, 0));
        assert_eq!(civil_from_days((a / 86_400) as i64), (2026, 12, 1));
        assert_eq!(civil_from_days((b / 86_400) as i64), (2027, 1, 1));
        assert_eq!(days_from_civil(1970, 1, 1), 0);
        assert_eq!(
            days_from_civil(2024, 3, 1) - days_from_civil(2024, 2, 1),
            29
        );
        let (a, b) = Period::Day.bounds(t, (0, 0));
        assert_eq!((b - a, t - a), (86_400, 43_200));
        // 2026-12-03 is a Thursday: its week began on Monday 2026-11-30.
        let w = period_start(api::BudgetPeriod::Week, t);
        assert_eq!(civil_from_days((w / 86_400) as i64), (2026, 11, 30));
    }
}
