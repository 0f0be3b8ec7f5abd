//! Webhooks: a user's (or a team's) subscription to its jobs' state
//! changes, each delivered as a JSON POST signed with HMAC-SHA256, retried
//! with doubling backoff, and logged.
//!
//! Committed events are matched to webhooks as they are committed
//! ([`World::notify`]) and queued in memory; [`deliver_due`] sends what is
//! due, off the state lock. A notification queued when the server stops is
//! not sent (the log says what was).

use std::sync::Arc;
use std::time::{Duration, Instant};

use gpuflow_api as api;
use gpuflow_store::NewEvent;
use hmac::{KeyInit, Mac};

use crate::Shared;
use crate::state::World;
pub use crate::state::{Hooks, Outgoing, WebhookRec};

/// Attempts per notification.
pub const ATTEMPTS: u32 = 5;
/// Attempts kept in each webhook's log.
const LOG: usize = 100;

impl World {
    /// Queues a notification for each webhook that asked for one of these
    /// committed events of a job (the job as committed).
    pub fn notify(&mut self, events: &[NewEvent]) {
        if self.hooks.by_id.is_empty() {
            return;
        }
        for e in events {
            if crate::event::EventKind::from_name(&e.kind)
                == Some(crate::event::EventKind::BudgetLow)
            {
                self.notify_team(e);
                continue;
            }
            // The job as a notification shows it, and whose it is.
            let Some((id, user, team, job)) = e.job.and_then(|id| self.jobs().get(&id)).map(|j| {
                let job = serde_json::json!({
                    "id": j.id, "name": j.spec.name, "team": j.team, "user": j.user,
                    "queue": j.spec.queue, "state": j.state.as_str(), "reason": j.reason,
                });
                (j.id, j.user.clone(), j.team.clone(), job)
            }) else {
                continue;
            };
            for h in self.hooks.by_id.values() {
                let theirs = match &h.user {
                    Some(u) => *u == user && (h.team.is_empty() || h.team == team),
                    None => h.team == team,
                };
                if !theirs {
                    continue;
                }
                let Some(event) = h.wants(&e.kind) else {
                    continue;
                };
                self.hooks.seq += 1;
                let body = serde_json::json!({
                    "delivery": self.hooks.seq,
                    "event": event,
                    "kind": e.kind,
                    "at": e.at,
                    "message": e.message,
                    "job": job,
                })
                .to_string();
                self.hooks.outbox.push_back(Outgoing {
                    hook: h.id.clone(),
                    delivery: self.hooks.seq,
                    event: event.to_string(),
                    job: id,
                    body,
                    attempt: 1,
                    due: Instant::now(),
                });
            }
        }
    }
}

impl World {
    /// A team's event (a budget low): its webhooks that asked for it.
    fn notify_team(&mut self, e: &NewEvent) {
        for h in self.hooks.by_id.values() {
            let asked = h.events.iter().any(|x| x == "all" || *x == e.kind);
            if h.team != e.team || !asked {
                continue;
            }
            self.hooks.seq += 1;
            let body = serde_json::json!({
                "delivery": self.hooks.seq,
                "event": e.kind,
                "kind": e.kind,
                "at": e.at,
                "message": e.message,
                "team": e.team,
            })
            .to_string();
            self.hooks.outbox.push_back(Outgoing {
                hook: h.id.clone(),
                delivery: self.hooks.seq,
                event: e.kind.clone(),
                job: 0,
                body,
                attempt: 1,
                due: Instant::now(),
            });
        }
    }
}

/// `sha256=` and the hex HMAC-SHA256 of `body` under `secret`.
#[must_use]
pub fn signature(secret: &str, body: &str) -> String {
    let mut mac =
        hmac::Hmac::<sha2::Sha256>::new_from_slice(secret.as_bytes()).expect("any key length");
    mac.update(body.as_bytes());
    let bytes = mac.finalize().into_bytes();
    let hex: String = bytes.iter().map(|b| format!("{b:02x}")).collect();
    format!("sha256={hex}")
}

/// Whether `url`'s host is this machine or a private network, where
/// webhooks go only when the server allows it (`--webhook-private`): a
/// member's webhook must not make the server call its neighbours.
///
/// # Errors
/// What is wrong with the URL.
pub async fn check_url(url: &str, private_ok: bool) -> Result<(), String> {
    let rest = url
        .strip_prefix("http://")
        .map(|r| (r, 80))
        .or_else(|| url.strip_prefix("https://").map(|r| (r, 443)));
    let Some((rest, port)) = rest else {
        return Err(format!("{url:?}: give an http:// or https:// URL"));
    };
    let authority = rest.split(['/', '?', '#']).next().unwrap_or_default();
    if authority.is_empty() || authority.contains('@') || url.len() > 2048 {
        return Err(format!(
            "{url:?}: give a host (no user or password in it), at most 2048 characters"
        ));
    }
    if private_ok {
        return Ok(());
    }
    let target = if authority
        .rsplit_once(':')
        .is_some_and(|(_, p)| p.parse::<u16>().is_ok())
        && !authority.ends_with(']')
    {
        authority.to_string()
    } else {
        format!("{authority}:{port}")
    };
    let addrs: Vec<std::net::SocketAddr> = tokio::net::lookup_host(target)
        .await
        .map_err(|e| format!("{url:?}: its host does not resolve: {e}"))?
        .collect();
    if let Some(a) = addrs.iter().find(|a| private(a.ip())) {
        return Err(format!(
            "{url:?}: its host is {} on this machine or a private network; webhooks go to public addresses unless the server runs with --webhook-private",
            a.ip()
        ));
    }
    Ok(())
}

fn private(ip: std::net::IpAddr) -> bool {
    match ip {
        std::net::IpAddr::V4(v) => {
            v.is_loopback()
                || v.is_private()
                || v.is_link_local()
                || v.is_unspecified()
                || v.is_broadcast()
                || v.octets()[0] == 100 && (64..128).contains(&v.octets()[1])
        }
        std::net::IpAddr::V6(v) => {
            v.is_loopback()
                || v.is_unspecified()
                || (v.segments()[0] & 0xfe00) == 0xfc00
                || (v.segments()[0] & 0xffc0) == 0xfe80
                || v.to_ipv4_mapped().is_some_and(|m| private(m.into()))
        }
    }
}

/// Sends the notifications that are due, one attempt each: a 2xx answer
/// delivers it; anything else is tried again after 1, 2, 4, 8 times
/// `backoff`, up to [`ATTEMPTS`]. Every attempt is logged.
pub async fn deliver_due(shared: &Arc<Shared>) {
    let now = Instant::now();
    let due: Vec<(Outgoing, Option<WebhookRec>)> = {
        let mut world = shared.world.lock().await;
        let (due, later): (Vec<Outgoing>, Vec<Outgoing>) =
            world.hooks.outbox.drain(..).partition(|o| o.due <= now);
        world.hooks.outbox.extend(later);
        due.into_iter()
            .map(|o| {
                let h = world.hooks.by_id.get(&o.hook).cloned();
                (o, h)
            })
            .collect()
    };
    if due.is_empty() {
        return;
    }
    let private_ok = shared.cfg.webhook_private;
    let backoff = shared.cfg.webhook_backoff;
    let mut results = Vec::new();
    for (o, hook) in due {
        // A webhook deleted since: nothing to send.
        let Some(h) = hook else { continue };
        if let Some(to) = h.mail.clone() {
            let smtp = shared.cfg.smtp.clone();
            let body = o.body.clone();
            let sent = tokio::task::spawn_blocking(move || mail(smtp.as_ref(), &to, &body))
                .await
                .unwrap_or_else(|e| Err((None, e.to_string())));
            results.push((o, sent));
            continue;
        }
        let checked = check_url(&h.url, private_ok).await;
        let sent = match checked {
            Err(e) => Err((None, format!("not sent: {e}"))),
            Ok(()) => {
                let (url, body, sig) =
                    (h.url.clone(), o.body.clone(), signature(&h.secret, &o.body));
                let (event, delivery) = (o.event.clone(), o.delivery);
                tokio::task::spawn_blocking(move || post(&url, &body, &sig, &event, delivery))
                    .await
                    .unwrap_or_else(|e| Err((None, e.to_string())))
            }
        };
        results.push((o, sent));
    }
    let mut world = shared.world.lock().await;
    let t = shared.now();
    for (mut o, sent) in results {
        // After a failed attempt, the next one `backoff` later, doubling.
        let (status, outcome, retry) = match sent {
            Ok(s) => (Some(s), "delivered".to_string(), None),
            Err((status, what)) if o.attempt < ATTEMPTS => {
                let wait = backoff * 2u32.pow(o.attempt - 1);
                (
                    status,
                    format!("retrying in {} ms: {what}", wait.as_millis()),
                    Some(wait),
                )
            }
            Err((status, what)) => (
                status,
                format!("failed after {ATTEMPTS} attempts: {what}"),
                None,
            ),
        };
        let log = world.hooks.log.entry(o.hook.clone()).or_default();
        log.push_back(api::Delivery {
            delivery: o.delivery,
            at: t,
            event: o.event.clone(),
            job: o.job,
            attempt: o.attempt,
            status,
            outcome,
        });
        while log.len() > LOG {
            log.pop_front();
        }
        if let Some(wait) = retry {
            o.due = Instant::now() + wait;
            o.attempt += 1;
            world.hooks.outbox.push_back(o);
        }
    }
}

/// One mail of notification `body` (its JSON) to `to`; an SMTP reply code
/// stands for the status.
fn mail(smtp: Option<&crate::Smtp>, to: &str, body: &str) -> Result<u16, (Option<u16>, String)> {
    let Some(smtp) = smtp else {
        return Err((None, "the server has no SMTP server (--smtp-server)".into()));
    };
    let v: serde_json::Value = serde_json::from_str(body).unwrap_or_default();
    let j = &v["job"];
    let (subject, text) = if j.is_null() {
        (
            format!(
                "[gpuflow] {}: {}",
                v["event"].as_str().unwrap_or_default(),
                v["message"].as_str().unwrap_or_default()
            ),
            format!(
                "{}\n\n{}\n",
                v["message"].as_str().unwrap_or_default(),
                serde_json::to_string_pretty(&v).unwrap_or_default()
            ),
        )
    } else {
        job_mail(&v)
    };
    let parse = |a: &str| {
        a.parse::<lettre::message::Mailbox>()
            .map_err(|e| (None, format!("{a:?} is not a mail address: {e}")))
    };
    mail_send(smtp, &parse(&smtp.from)?, &parse(to)?, subject, text)
}

/// The subject and text of a job's notification.
fn job_mail(v: &serde_json::Value) -> (String, String) {
    let j = &v["job"];
    let subject = format!(
        "[gpuflow] job {} ({}) {}: {}",
        j["id"],
        j["name"].as_str().unwrap_or_default(),
        v["event"].as_str().unwrap_or_default(),
        j["state"].as_str().unwrap_or_default()
    );
    let text = format!(
        "Job {} ({}) of team {}, user {}, queue {}: {}\n\n{}\n\n{}\n",
        j["id"],
        j["name"].as_str().unwrap_or_default(),
        j["team"].as_str().unwrap_or_default(),
        j["user"].as_str().unwrap_or_default(),
        j["queue"].as_str().unwrap_or_default(),
        j["state"].as_str().unwrap_or_default(),
        v["message"].as_str().unwrap_or_default(),
        serde_json::to_string_pretty(v).unwrap_or_default()
    );
    (subject, text)
}

fn mail_send(
    smtp: &crate::Smtp,
    from: &lettre::message::Mailbox,
    to: &lettre::message::Mailbox,
    subject: String,
    text: String,
) -> Result<u16, (Option<u16>, String)> {
    use lettre::Transport;
    let msg = lettre::Message::builder()
        .from(from.clone())
        .to(to.clone())
        .subject(subject)
        .header(lettre::message::header::ContentType::TEXT_PLAIN)
        .body(text)
        .map_err(|e| (None, e.to_string()))?;
    // Plain SMTP to the site's relay (TLS to it is not supported yet).
    let transport = lettre::SmtpTransport::builder_dangerous(&smtp.host)
        .port(smtp.port)
        .timeout(Some(Duration::from_secs(10)))
        .build();
    match transport.send(&msg) {
        Ok(r) => Ok(r.code().to_string().parse().unwrap_or(250)),
        Err(e) => Err((
            e.status().and_then(|c| c.to_string().parse().ok()),
            e.to_string(),
        )),
    }
}

/// One POST; the status of a 2xx answer, or what went wrong.
fn post(
    url: &str,
    body: &str,
    signature: &str,
    event: &str,
    delivery: u64,
) -> Result<u16, (Option<u16>, String)> {
    let agent: ureq::Agent = ureq::Agent::config_builder()
        .timeout_global(Some(Duration::from_secs(10)))
        .http_status_as_error(false)
        .max_redirects(0)
        .build()
        .into();
    match agent
        .post(url)
        .header("content-type", "application/json")
        .header("x-gpuflow-event", event)
        .header("x-gpuflow-delivery", &delivery.to_string())
        .header("x-gpuflow-signature", signature)
        .send(body)
    {
        Ok(r) if r.status().is_success() => Ok(r.status().as_u16()),
        Ok(r) => Err((
            Some(r.status().as_u16()),
            format!("the receiver answered {}", r.status()),
        )),
        Err(e) => Err((None, e.to_string())),
    }
}

/// Delivers what is due every quarter second, for as long as the server runs.
pub async fn run_loop(shared: Arc<Shared>) {
    loop {
        deliver_due(&shared).await;
        tokio::time::sleep(Duration::from_millis(250)).await;
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn the_signature_is_hmac_sha256_in_hex() {
        // RFC 4231 test case 2.
        assert_eq!(
            signature("Jefe", "what do ya want for nothing?"),
            "sha256=5bdcc146bf60754e6a042426089575c75a003f089d2739839dec58b964ec3843"
        );
    }

    #[tokio::test]
    async fn private_and_local_hosts_are_refused_unless_allowed() {
        for url in [
            "http://127.0.0.1:9/x",
            "http://10.1.2.3/",
            "http://[::1]:8080/",
            "http://169.254.169.254/latest/meta-data",
            "http://localhost/",
        ] {
            let e = check_url(url, false).await.unwrap_err();
            assert!(e.contains("--webhook-private"), "{url}: {e}");
            assert!(check_url(url, true).await.is_ok(), "{url}");
        }
        for (url, says) in [
            ("ftp://x/", "http:// or https://"),
            ("http://user:pw@example.com/", "no user or password"),
            ("http:///path", "give a host"),
        ] {
            let e = check_url(url, true).await.unwrap_err();
            assert!(e.contains(says), "{url}: {e}");
        }
    }
}
