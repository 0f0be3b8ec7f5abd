//! Webhooks: made, listed, deleted, and their delivery logs. A member's
//! webhook reports their own jobs; a team lead's or an admin's may report
//! a whole team's.

use super::*;
use crate::webhooks::WebhookRec;

pub(super) fn router() -> ApiRouter {
    ApiRouter::new()
        .api_route("/v1/webhooks", post_with(create, doc("any token (team leads and admins for a whole team)", "A webhook: the caller's jobs (or a team's) POST their state changes to a URL, signed with HMAC-SHA256 (X-Gpuflow-Signature); the secret is shown once")).get_with(list, doc("any token", "The webhooks the caller made or may manage")))
        .api_route("/v1/webhooks/{id}", delete_with(remove, doc("its maker, the team lead, admins", "Delete a webhook; what it had queued is not sent")))
        .api_route("/v1/webhooks/{id}/deliveries", get_with(deliveries, doc("its maker, the team lead, admins", "Its last 100 delivery attempts: event, job, attempt, HTTP status, outcome")))
}

/// Webhooks per installation, so that their notifications stay bounded.
const MAX_WEBHOOKS: usize = 1000;

/// Whether the caller may see and delete webhook `h`: its maker, the
/// team's lead, an admin.
fn manages(caller: &Caller, h: &WebhookRec) -> bool {
    caller.admin() || h.created_by == caller.user.name || caller.leads(&h.team)
}

fn not_found(id: &str) -> Error {
    ApiError::not_found(format!("webhook {id:?} not found among those you may see")).into()
}

async fn create(
    State(shared): State<Arc<Shared>>,
    caller: Caller,
    body: JsonBody<api::WebhookSpec>,
) -> Result<Created<api::WebhookView>, Error> {
    let spec: api::WebhookSpec = body.read(shared.cfg.max_body_bytes)?;
    let bad = |m: String| -> Error { ApiError::bad_request("invalid_webhook", m).into() };
    if spec.events.is_empty() {
        return Err(bad(format!(
            "events: name at least one of {}",
            api::WEBHOOK_EVENTS.join(", ")
        )));
    }
    if let Some(e) = spec
        .events
        .iter()
        .find(|e| !api::WEBHOOK_EVENTS.contains(&e.as_str()))
    {
        return Err(bad(format!(
            "events: unknown event {e:?}; events: {}",
            api::WEBHOOK_EVENTS.join(", ")
        )));
    }
    match (&spec.url, &spec.mail) {
        (Some(url), None) => crate::webhooks::check_url(url, shared.cfg.webhook_private)
            .await
            .map_err(|e| bad(format!("url: {e}")))?,
        (None, Some(to)) => {
            if to.parse::<lettre::Address>().is_err() || to.len() > 254 {
                return Err(bad(format!(
                    "mail: {to:?} is not a mail address (name@domain)"
                )));
            }
            if shared.cfg.smtp.is_none() {
                return Err(bad(
                    "mail: this server sends no mail: it runs without --smtp-server".into(),
                ));
            }
        }
        _ => {
            return Err(bad(
                "give one of url (an http:// or https:// webhook) and mail (an address)".into(),
            ));
        }
    }
    // Whose jobs: a team's (its lead, an admin), or the caller's own.
    let (team, user) = match &spec.team {
        Some(t) => {
            if !caller.admin() && !caller.leads(t) {
                return Err(ApiError::forbidden(format!(
                    "a webhook for every job of team {t:?} is its team lead's or an admin's; leave `team` out for your own jobs"
                ))
                .into());
            }
            (t.clone(), None)
        }
        // The caller's own jobs, in whatever team they run (an admin of no
        // team submits to any).
        None => (caller.user.team.clone(), Some(caller.user.name.clone())),
    };
    let world = shared.write().await;
    if !team.is_empty() && !world.records().teams.contains_key(&team) {
        return Err(bad(format!("team: {team:?} does not exist")));
    }
    if world.hooks.by_id.len() >= MAX_WEBHOOKS {
        return Err(ApiError::conflict(format!(
            "there are {MAX_WEBHOOKS} webhooks already; delete some first"
        ))
        .into());
    }
    let at = shared.now();
    let secret = crate::secret::new_token("whsec");
    let id = crate::secret::new_token("wh")[3..19].to_string();
    let mut events = spec.events.clone();
    events.sort();
    events.dedup();
    let h = WebhookRec {
        id: id.clone(),
        url: spec.url.clone().unwrap_or_default(),
        mail: spec.mail.clone(),
        events,
        team: team.clone(),
        user,
        secret,
        created_by: caller.user.name.clone(),
        created_at: at,
    };
    let mut change = Change::default();
    change.put(Rec::Webhook(h.clone()));
    change.audit(
        at,
        &caller.user.name,
        "webhook.create",
        &format!("webhook/{id}"),
        format!(
            "{} for team {team}",
            spec.url
                .as_deref()
                .or(spec.mail.as_deref())
                .unwrap_or_default()
        ),
    );
    world.commit(change).await?;
    let view = h.view(true);
    Ok(Created(view))
}

async fn list(State(shared): State<Arc<Shared>>, caller: Caller) -> Reply<Vec<api::WebhookView>> {
    let world = shared.world.lock().await;
    Ok(Json(
        world
            .hooks
            .by_id
            .values()
            .filter(|h| manages(&caller, h))
            .map(|h| h.view(false))
            .collect(),
    ))
}

async fn remove(
    State(shared): State<Arc<Shared>>,
    caller: Caller,
    Path(id): Path<String>,
) -> Result<axum::response::NoContent, Error> {
    let world = shared.write().await;
    let Some(h) = world.hooks.by_id.get(&id).filter(|h| manages(&caller, h)) else {
        return Err(not_found(&id));
    };
    let mut change = Change::default();
    change.remove(Gone::Webhook(id.clone()));
    change.audit(
        shared.now(),
        &caller.user.name,
        "webhook.delete",
        &format!("webhook/{id}"),
        h.mail.clone().unwrap_or_else(|| h.url.clone()),
    );
    world.commit(change).await?;
    Ok(axum::response::NoContent)
}

async fn deliveries(
    State(shared): State<Arc<Shared>>,
    caller: Caller,
    Path(id): Path<String>,
) -> Reply<Vec<api::Delivery>> {
    let world = shared.world.lock().await;
    if !world
        .hooks
        .by_id
        .get(&id)
        .is_some_and(|h| manages(&caller, h))
    {
        return Err(not_found(&id));
    }
    Ok(Json(
        world
            .hooks
            .log
            .get(&id)
            .map(|l| l.iter().cloned().collect())
            .unwrap_or_default(),
    ))
}
