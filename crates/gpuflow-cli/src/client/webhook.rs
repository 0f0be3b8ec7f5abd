//! `gpuflow webhook`: notifications by webhook or mail.

use super::*;

#[derive(Subcommand)]
pub(crate) enum WebhookCmd {
    /// Have your jobs (or, for a team lead or an admin, a team's) POST
    /// their state changes to URL as JSON, signed with HMAC-SHA256 in
    /// X-Gpuflow-Signature; the secret is printed once.
    Create {
        /// The http:// or https:// URL; or give --mail.
        #[arg(required_unless_present = "mail", conflicts_with = "mail")]
        url: Option<String>,
        /// Mail this address instead, through the server's SMTP server.
        #[arg(long)]
        mail: Option<String>,
        /// Of begin, end, fail, timeout, preempted, requeued, all; comma
        /// separated.
        #[arg(long, value_delimiter = ',', default_value = "end")]
        events: Vec<String>,
        /// Every job of this team (team leads, admins).
        #[arg(long)]
        team: Option<String>,
    },
    /// The webhooks you made or manage.
    Ls,
    /// Delete a webhook.
    Rm { id: String },
    /// A webhook's last delivery attempts: event, job, HTTP status, outcome.
    Deliveries { id: String },
}

pub(crate) fn webhook(conn: &Conn, cmd: WebhookCmd) -> anyhow::Result<()> {
    let c = Client::new(conn)?;
    match cmd {
        WebhookCmd::Create {
            url,
            mail,
            events,
            team,
        } => {
            let mut body = serde_json::json!({"events": events});
            if let Some(u) = url {
                body["url"] = u.into();
            }
            if let Some(m) = mail {
                body["mail"] = m.into();
            }
            if let Some(t) = team {
                body["team"] = t.into();
            }
            let v = c.call(
                "POST",
                "/v1/webhooks",
                Some(("application/json", serde_json::to_vec(&body)?)),
            )?;
            print_as(conn.output, "/v1/webhooks", v, |h: &api::WebhookView| {
                format!(
                    "webhook {} created for {}'s jobs: {}\nsecret (shown once; verify X-Gpuflow-Signature, sha256= HMAC of the body): {}\n",
                    h.id,
                    h.user.clone().unwrap_or_else(|| format!("team {}", h.team)),
                    h.url.as_deref().or(h.mail.as_deref()).unwrap_or_default(),
                    h.secret.as_deref().unwrap_or("-")
                )
            })?;
        }
        WebhookCmd::Ls => {
            let v = c.call("GET", "/v1/webhooks", None)?;
            print_as(
                conn.output,
                "/v1/webhooks",
                v,
                |v: &Vec<api::WebhookView>| {
                    let rows = v
                        .iter()
                        .map(|h| {
                            vec![
                                h.id.clone(),
                                h.user.clone().unwrap_or_else(|| format!("team {}", h.team)),
                                h.events.join(","),
                                h.url
                                    .clone()
                                    .or_else(|| h.mail.as_ref().map(|m| format!("mail {m}")))
                                    .unwrap_or_default(),
                            ]
                        })
                        .collect();
                    table(!conn.no_headers, &["id", "jobs of", "events", "to"], rows)
                },
            )?;
        }
        WebhookCmd::Rm { id } => {
            c.call(
                "DELETE",
                &format!("/v1/webhooks/{}", urlencoding_path(&id)),
                None,
            )?;
            if matches!(conn.output, Format::Table | Format::Wide) {
                println!("webhook {id} deleted");
            }
        }
        WebhookCmd::Deliveries { id } => {
            let path = format!("/v1/webhooks/{}/deliveries", urlencoding_path(&id));
            let v = c.call("GET", &path, None)?;
            print_as(conn.output, &path, v, |v: &Vec<api::Delivery>| {
                let rows = v
                    .iter()
                    .map(|d| {
                        vec![
                            d.delivery.to_string(),
                            local_at(d.at),
                            d.event.clone(),
                            d.job.to_string(),
                            d.attempt.to_string(),
                            d.status.map_or_else(|| "-".into(), |x| x.to_string()),
                            d.outcome.clone(),
                        ]
                    })
                    .collect();
                table(
                    !conn.no_headers,
                    &[
                        "delivery", "at", "event", "job", "attempt", "status", "outcome",
                    ],
                    rows,
                )
            })?;
        }
    }
    Ok(())
}
