//! The event log (jobs and nodes, by team) and the audit log (admins).

use super::jobs::visible;
use super::params::{Flag, PageLimit, ParamSet, Seq, UnixTime, Whole};
use super::*;

pub(super) fn router() -> ApiRouter {
    ApiRouter::new()
        .api_route(
            "/v1/events",
            get_with(
                events,
                doc(
                    "any token (own team; admins all)",
                    "Job and node events; filters: job, after, limit, since, until, newest",
                ),
            ),
        )
        .api_route(
            "/v1/audit",
            get_with(audit, doc("admin", "Every change: who, what, when")),
        )
}

/// The event log's filters.
#[derive(serde::Deserialize, schemars::JsonSchema)]
pub(super) struct EventParams {
    /// only this job's
    job: Option<Whole>,
    /// events after this seq (the next page)
    after: Option<Seq>,
    /// page size (at most 1000)
    #[serde(default)]
    limit: PageLimit,
    /// only events at or after this Unix time
    since: Option<UnixTime>,
    /// only events before this Unix time
    until: Option<UnixTime>,
    /// the newest `limit` events (still oldest first)
    #[serde(default)]
    newest: Flag,
}
impl ParamSet for EventParams {
    const WORD: &'static str = "filter";
    const NOTES: &'static [(&'static str, &'static str)] = &[("until", "Unix seconds")];
}

async fn events(
    State(shared): State<Arc<Shared>>,
    caller: Caller,
    Params(q): Params<EventParams>,
) -> Reply<Vec<api::Event>> {
    let job = q.job.map(|j| j.0);
    if let Some(j) = job {
        let world = shared.world.lock().await;
        visible(&world, &caller, j)?;
    }
    let query = gpuflow_store::EventQuery {
        job,
        team: (!caller.admin()).then(|| caller.user.team.clone()),
        after: q.after.map_or(0, |a| a.0),
        limit: q.limit.0 as i64,
        since: q.since.map(|t| t.0),
        until: q.until.map(|t| t.0),
        newest: q.newest.0,
    };
    let rows = shared
        .store
        .events(&query)
        .await
        .map_err(crate::ServerError::from)?;
    Ok(Json(
        rows.into_iter()
            .map(|e| api::Event {
                seq: e.seq,
                at: e.event.at,
                job: e.event.job,
                team: e.event.team,
                kind: e.event.kind,
                message: e.event.message,
            })
            .collect(),
    ))
}
/// The audit log's page.
#[derive(serde::Deserialize, schemars::JsonSchema)]
pub(super) struct AuditParams {
    /// lines after this seq (the next page)
    after: Option<Seq>,
    /// page size (at most 1000)
    #[serde(default)]
    limit: PageLimit,
}
impl ParamSet for AuditParams {
    const WORD: &'static str = "filter";
}

async fn audit(
    State(shared): State<Arc<Shared>>,
    caller: Caller,
    Params(q): Params<AuditParams>,
) -> Reply<Vec<api::AuditEntry>> {
    caller.need_admin("reading the audit log")?;
    let (after, limit) = (q.after.map_or(0, |a| a.0), q.limit.0);
    let rows = shared
        .store
        .audit(after, limit as i64)
        .await
        .map_err(crate::ServerError::from)?;
    // Who each actor is at its identity provider, if it signs in through one.
    let subjects: BTreeMap<String, String> = {
        let world = shared.world.lock().await;
        rows.iter()
            .filter_map(|a| {
                let i = world
                    .records()
                    .users
                    .get(&a.entry.actor)?
                    .identity
                    .as_ref()?;
                Some((
                    a.entry.actor.clone(),
                    format!("{}:{}", i.provider, i.subject),
                ))
            })
            .collect()
    };
    Ok(Json(
        rows.into_iter()
            .map(|a| api::AuditEntry {
                seq: a.seq,
                at: a.entry.at,
                subject: subjects.get(&a.entry.actor).cloned(),
                actor: a.entry.actor,
                action: a.entry.action,
                target: a.entry.target,
                detail: a.entry.detail,
            })
            .collect(),
    ))
}
