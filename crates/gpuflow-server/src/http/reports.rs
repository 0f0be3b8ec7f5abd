//! Reports: GPU-hours, used GPU-hours and cost from the jobs' ledger
//! (`accounting.rs`), and the prices admins set for them. Admins see every
//! team; everyone else their own team's jobs only.

use super::params::{Age, FromParam, ParamSet, Percent, When, from_param, schema};
use super::*;

pub(super) fn router() -> ApiRouter {
    ApiRouter::new()
        .api_route("/v1/reports/usage", get_with(usage, doc("any token (own team; admins all)", "GPU-hours held and used, efficiency and cost from the jobs' ledger, by team, project, user, queue, model, cost_centre or job, per hour, day, month or all")))
        .api_route("/v1/reports/low-utilization", get_with(low_use, doc("any token (own team; admins all)", "Jobs holding GPUs below a sampled utilisation for a while, by GPU-hours held")))
        .api_route("/v1/reports/jobs", get_with(jobs_report, doc("any token (own team; admins all)", "Waits (p50, p95), outcomes, preemptions and the GPU-hours they lost, of the jobs submitted in a range, by queue or kind")))
        .api_route("/v1/reports/advice", get_with(advice, doc("any token (own team; admins all)", "Jobs whose measured GPU memory and utilisation would fit a cheaper GPU model or a MIG slice, with the saving per month at the configured prices")))
        .api_route("/v1/reports/workload", get_with(workload, doc("admin", "The recorded workload of a range (jobs that held GPUs, how long, on which model), the nodes and each team's quotas: what `gpuflow sim whatif` replays")))
        .api_route("/v1/prices", get_with(prices, doc("any token", "The prices of a GPU-hour per model")).put_with(set_prices, doc("admin", "Set the prices of a GPU-hour per model (`*`: the others)")))
}

async fn prices(State(shared): State<Arc<Shared>>, _caller: Caller) -> Reply<api::Prices> {
    Ok(Json(shared.world.lock().await.records().prices.clone()))
}

async fn set_prices(
    State(shared): State<Arc<Shared>>,
    caller: Caller,
    body: JsonBody<api::Prices>,
) -> Reply<api::Prices> {
    caller.need_admin("setting prices")?;
    let p: api::Prices = body.read(shared.cfg.max_body_bytes)?;
    p.validate()?;
    let world = shared.write().await;
    let mut change = Change::default();
    change.put(Rec::Prices(p.clone()));
    change.audit(
        shared.now(),
        &caller.user.name,
        "prices.set",
        "prices",
        serde_json::to_string(&p).unwrap_or_default(),
    );
    world.commit(change).await?;
    Ok(Json(p))
}

/// Whose jobs a report reads: the caller's team's, or every team's for an
/// admin.
fn seen_team(caller: &Caller) -> Option<&str> {
    (!caller.admin()).then_some(caller.user.team.as_str())
}

/// A report's range (default: the last 30 days).
#[derive(serde::Deserialize, schemars::JsonSchema)]
pub(super) struct Range {
    /// use measured from: Unix seconds, 2026-12-01, 2026-12-01T08:00:00Z or an age such as 7d (default 30d)
    from: Option<When>,
    /// as from (default now)
    to: Option<When>,
}
impl ParamSet for Range {}

impl Range {
    /// The range's start and end, ages counted back from `t`.
    fn at(&self, t: u64) -> Result<(u64, u64), Error> {
        let from = self.from.map_or(t.saturating_sub(30 * 86_400), |w| w.at(t));
        let to = self.to.map_or(t, |w| w.at(t));
        if from >= to {
            return Err(ApiError::bad_request("bad_query", "from: must be before to").into());
        }
        Ok((from, to))
    }
}

/// What the jobs report's rows are keyed by.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
enum RowsBy {
    #[default]
    Queue,
    Kind,
}
impl FromParam for RowsBy {
    fn from_param(v: &str) -> Result<Self, String> {
        match v {
            "queue" => Ok(RowsBy::Queue),
            "kind" => Ok(RowsBy::Kind),
            _ => Err(format!("{v:?}; allowed: queue, kind")),
        }
    }
}
from_param!(RowsBy);
schema!(RowsBy, {"type": "string", "enum": ["queue", "kind"]});

#[derive(serde::Deserialize, schemars::JsonSchema)]
pub(super) struct JobsParams {
    /// what rows are keyed by (default queue)
    #[serde(default)]
    by: RowsBy,
    /// submitted from: Unix seconds, 2026-12-01, 2026-12-01T08:00:00Z or an age such as 7d (default 30d)
    from: Option<When>,
    /// as from (default now)
    to: Option<When>,
}
impl ParamSet for JobsParams {}

/// Waits, outcomes and preemptions of the jobs submitted in a range, by
/// queue or kind.
async fn jobs_report(
    State(shared): State<Arc<Shared>>,
    caller: Caller,
    Params(q): Params<JobsParams>,
) -> Reply<Vec<api::JobsRow>> {
    let by_kind = q.by == RowsBy::Kind;
    let (from, to) = Range {
        from: q.from,
        to: q.to,
    }
    .at(shared.now())?;
    let _turn = shared.reports.acquire().await;
    let mut rows = crate::accounting::JobRows::new(by_kind, (from, to));
    crate::each_job(&shared, seen_team(&caller), |j| rows.add(&j)).await?;
    Ok(Json(rows.rows()))
}

#[derive(serde::Deserialize, schemars::JsonSchema)]
pub(super) struct UsageParams {
    /// what rows are keyed by (default team)
    #[schemars(schema_with = "usage_by")]
    by: Option<String>,
    /// how rows are split in time (default all)
    #[schemars(schema_with = "usage_period")]
    period: Option<String>,
    /// Unix seconds, 2026-12-01, 2026-12-01T08:00:00Z or an age such as 7d (default 30d)
    from: Option<When>,
    /// as from (default now)
    to: Option<When>,
}

fn usage_by(_: &mut schemars::SchemaGenerator) -> schemars::Schema {
    schemars::json_schema!({"type": "string", "enum": ["team", "project", "user", "queue", "model", "cost_centre", "job"]})
}

fn usage_period(_: &mut schemars::SchemaGenerator) -> schemars::Schema {
    schemars::json_schema!({"type": "string", "enum": ["hour", "day", "month", "all"]})
}
impl ParamSet for UsageParams {}

async fn usage(
    State(shared): State<Arc<Shared>>,
    caller: Caller,
    Params(q): Params<UsageParams>,
) -> Reply<api::UsageReport> {
    let by_name = q.by.as_deref().unwrap_or("team");
    let by = crate::accounting::By::parse(by_name).ok_or_else(|| {
        Error(ApiError::bad_request(
            "bad_query",
            format!(
                "by: {by_name:?}; allowed: team, project, user, queue, model, cost_centre, job"
            ),
        ))
    })?;
    let period_name = q.period.as_deref().unwrap_or("all");
    let period = crate::accounting::Period::parse(period_name).ok_or_else(|| {
        Error(ApiError::bad_request(
            "bad_query",
            format!("period: {period_name:?}; allowed: hour, day, month, all"),
        ))
    })?;
    let t = shared.now();
    let (from, to) = Range {
        from: q.from,
        to: q.to,
    }
    .at(t)?;
    let (projects, prices) = {
        let world = shared.world.lock().await;
        (
            world.records().projects.clone(),
            world.records().prices.clone(),
        )
    };
    let _turn = shared.reports.acquire().await;
    let mut sums = crate::accounting::Usage::new(&projects, &prices, by, period, (from, to), t);
    crate::each_job(&shared, seen_team(&caller), |j| sums.add(&j)).await?;
    let rows = sums.rows();
    Ok(Json(api::UsageReport {
        by: by_name.to_string(),
        period: period_name.to_string(),
        from,
        to,
        currency: prices.currency,
        rows,
    }))
}

/// Jobs holding GPUs whose sampled utilisation stays below `below_pct`
/// (default 10) and that have held them for at least `for` (an age, default
/// 1h): the jobs and notebooks to ask about, by GPU-hours held.
#[derive(serde::Deserialize, schemars::JsonSchema)]
pub(super) struct LowUseParams {
    /// utilisation below this percentage (default 10)
    below_pct: Option<Percent>,
    /// held at least this long, e.g. 30m or 2h (default 1h)
    r#for: Option<Age>,
}
impl ParamSet for LowUseParams {}

async fn low_use(
    State(shared): State<Arc<Shared>>,
    caller: Caller,
    Params(q): Params<LowUseParams>,
) -> Reply<Vec<api::LowUse>> {
    let below = q.below_pct.map_or(10.0, |p| p.0);
    let held_for = q.r#for.map_or(3600, |a| a.0);
    let t = shared.now();
    let world = shared.world.lock().await;
    let mut out: Vec<api::LowUse> = world
        .jobs()
        .values()
        .filter(|j| j.state.allocated() && caller.sees(&j.team))
        .filter_map(|j| {
            let hold = j.held.last().filter(|h| h.to.is_none())?;
            let util = j.hold_util(hold)?;
            (util < below && t.saturating_sub(hold.from) >= held_for).then(|| api::LowUse {
                id: j.id,
                name: j.spec.name.clone(),
                team: j.team.clone(),
                user: j.user.clone(),
                kind: j.spec.kind,
                gpus: hold.gpu_milli as f64 / 1000.0,
                since: hold.from,
                util_pct: util,
                gpu_hours: hold.gpu_s(0, u64::MAX, t) / 3600.0,
            })
        })
        .collect();
    out.sort_by(|a, b| b.gpu_hours.total_cmp(&a.gpu_hours));
    Ok(Json(out))
}

/// Jobs that would fit a cheaper GPU model or a MIG slice, by saving.
async fn advice(
    State(shared): State<Arc<Shared>>,
    caller: Caller,
    Params(range): Params<Range>,
) -> Reply<Vec<api::Advice>> {
    let t = shared.now();
    let range = range.at(t)?;
    let (offer, prices) = {
        let world = shared.world.lock().await;
        let mut offer = crate::accounting::Offer {
            models: BTreeMap::new(),
            mig: BTreeMap::new(),
        };
        for n in world.nodes().values() {
            for g in &n.inventory.gpus {
                offer.models.entry(g.model.clone()).or_insert(g.memory_mib);
                for m in &g.mig {
                    let slices = m
                        .profile
                        .split_once('g')
                        .and_then(|(n, _)| n.parse().ok())
                        .unwrap_or(7);
                    let list = offer.mig.entry(g.model.clone()).or_default();
                    if !list.iter().any(|(p, _, _)| p == &m.profile) {
                        list.push((m.profile.clone(), m.memory_mib, slices));
                    }
                }
            }
        }
        (offer, world.records().prices.clone())
    };
    let _turn = shared.reports.acquire().await;
    let mut out = Vec::new();
    crate::each_job(&shared, seen_team(&caller), |j| {
        out.extend(crate::accounting::advice_for(&j, &offer, &prices, range, t));
    })
    .await?;
    crate::accounting::sort_advice(&mut out);
    Ok(Json(out))
}

/// The recorded workload of a range (default: the last 30 days), the
/// nodes and the teams' quotas, for `gpuflow sim whatif`. Admins only: it
/// spans every team.
async fn workload(
    State(shared): State<Arc<Shared>>,
    caller: Caller,
    Params(range): Params<Range>,
) -> Reply<api::RecordedWorkload> {
    caller.need_admin("reading the recorded workload")?;
    let t = shared.now();
    let range = range.at(t)?;
    let _turn = shared.reports.acquire().await;
    let jobs = crate::every_job(&shared).await?;
    let world = shared.world.lock().await;
    let nodes: Vec<&crate::state::NodeRec> = world
        .nodes()
        .values()
        .filter(|n| n.state != api::NodeState::Lost)
        .collect();
    let queues: Vec<&api::QueueSpec> = world.records().queues.values().collect();
    let mut out = crate::accounting::recorded(&jobs, &nodes, &queues, range, t);
    out.cycle_s = shared.cfg.cycle_interval.as_secs().max(1);
    out.prices = world.records().prices.clone();
    Ok(Json(out))
}
