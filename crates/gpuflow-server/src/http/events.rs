//! The event log (jobs and nodes, by team) and the audit log (admins).

use super::jobs::visible;
use super::*;

pub(super) fn router() -> Router<Arc<Shared>> {
    Router::new()
        .route("/v1/events", get(events))
        .route("/v1/audit", get(audit))
}

async fn events(
    State(shared): State<Arc<Shared>>,
    caller: Caller,
    Query(q): Query<BTreeMap<String, String>>,
) -> Reply<Vec<api::Event>> {
    let num = |k: &str| -> Result<Option<i64>, Error> {
        q.get(k)
            .map(|v| {
                v.parse::<i64>().map_err(|_| {
                    Error(ApiError::bad_request(
                        "bad_query",
                        format!("{k}: must be a number"),
                    ))
                })
            })
            .transpose()
    };
    for k in q.keys() {
        if !["job", "after", "limit", "since", "until", "newest"].contains(&k.as_str()) {
            return Err(ApiError::bad_request(
                "bad_query",
                format!(
                    "unknown filter {k:?}; allowed: job, after, limit, since, until (Unix seconds), newest"
                ),
            )
            .into());
        }
    }
    let time = |k: &str| -> Result<Option<u64>, Error> {
        num(k)?
            .map(|t| {
                u64::try_from(t).map_err(|_| {
                    Error(ApiError::bad_request(
                        "bad_query",
                        format!("{k}: Unix seconds, not negative"),
                    ))
                })
            })
            .transpose()
    };
    let newest = match q.get("newest").map(String::as_str) {
        None | Some("false") => false,
        Some("true") => true,
        Some(v) => {
            return Err(ApiError::bad_request(
                "bad_query",
                format!("newest: true or false, not {v:?}"),
            )
            .into());
        }
    };
    let job = num("job")?.map(|j| j as u64);
    if let Some(j) = job {
        let world = shared.world.lock().await;
        visible(&world, &caller, j)?;
    }
    let query = gpuflow_store::EventQuery {
        job,
        team: (!caller.admin()).then(|| caller.user.team.clone()),
        after: num("after")?.unwrap_or(0),
        limit: page_limit(q.get("limit"))? as i64,
        since: time("since")?,
        until: time("until")?,
        newest,
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
async fn audit(
    State(shared): State<Arc<Shared>>,
    caller: Caller,
    Query(q): Query<BTreeMap<String, String>>,
) -> Reply<Vec<api::AuditEntry>> {
    caller.need_admin("reading the audit log")?;
    for k in q.keys() {
        if !["after", "limit"].contains(&k.as_str()) {
            return Err(ApiError::bad_request(
                "bad_query",
                format!("unknown filter {k:?}; allowed: after, limit"),
            )
            .into());
        }
    }
    let after = match q.get("after") {
        Some(v) => v.parse::<i64>().map_err(|_| {
            Error(ApiError::bad_request(
                "bad_query",
                "after: must be a number",
            ))
        })?,
        None => 0,
    };
    let limit = page_limit(q.get("limit"))?;
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
                let i = world.users.get(&a.entry.actor)?.identity.as_ref()?;
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
