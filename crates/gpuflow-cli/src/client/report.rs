//! `gpuflow report` and `gpuflow price`: usage, waits, low use, advice.

use super::*;

#[derive(Subcommand)]
pub(crate) enum ReportCmd {
    /// Waits (p50, p95), outcomes, preemptions and lost GPU-hours of the
    /// jobs submitted in a range, by queue or kind.
    Jobs {
        /// queue or kind.
        #[arg(long, default_value = "queue")]
        by: String,
        /// Jobs submitted from (Unix seconds, 2026-12-01, or an age: 30d).
        #[arg(long, default_value = "30d")]
        from: String,
        /// Jobs submitted until (as --from; default now).
        #[arg(long)]
        to: Option<String>,
    },
    /// Jobs whose measured GPU memory and utilisation would fit a cheaper
    /// model or a MIG slice, with the saving per month at the set prices.
    Advice {
        #[arg(long, default_value = "30d")]
        from: String,
    },
    /// Jobs holding GPUs below a utilisation for a while, by GPU-hours.
    Idle {
        /// Utilisation below this percentage.
        #[arg(long, default_value_t = 10.0)]
        below: f64,
        /// Held at least this long (30m, 2h, …).
        #[arg(long = "for", default_value = "1h")]
        held_for: String,
    },
    /// GPU-hours held and used, efficiency and cost, from the jobs' ledger.
    Usage {
        /// Rows by team, project, user, queue, model, cost_centre or job.
        #[arg(long, default_value = "team")]
        by: String,
        /// Split rows by hour, day or month (default: one row per key).
        #[arg(long, default_value = "all")]
        period: String,
        /// From: Unix seconds, 2026-12-01, 2026-12-01T08:00:00Z or an age (7d).
        #[arg(long, default_value = "30d")]
        from: String,
        /// To (default now), as --from.
        #[arg(long)]
        to: Option<String>,
        /// Print CSV (for spreadsheets) instead of a table.
        #[arg(long)]
        csv: bool,
    },
}

#[derive(Subcommand)]
pub(crate) enum PriceCmd {
    /// The price of a GPU-hour per model.
    Ls,
    /// Set the prices (admins): MODEL=PRICE per GPU-hour, `*` for the
    /// models not listed (replaces all prices).
    Set {
        #[arg(value_name = "MODEL=PRICE", required = true)]
        prices: Vec<String>,
        #[arg(long, default_value = "")]
        currency: String,
    },
}

pub(crate) fn report(conn: &Conn, cmd: ReportCmd) -> anyhow::Result<()> {
    let c = Client::new(conn)?;
    let out = conn.output;
    let num = |x: f64, digits: usize| format!("{x:.digits$}");
    let pct = |x: Option<f64>, scale: f64, digits: usize| {
        x.map_or("-".into(), |x| format!("{:.*}%", digits, x * scale))
    };
    match cmd {
        ReportCmd::Usage {
            by,
            period,
            from,
            to,
            csv,
        } => {
            let mut query = vec![("by", by.clone()), ("period", period), ("from", from)];
            query.extend(to.map(|t| ("to", t)));
            let head = [
                by.as_str(),
                "from",
                "gpu-hours",
                "used",
                "efficiency",
                "cost",
                "jobs",
            ];
            show_report(
                &c,
                out,
                csv,
                "/v1/reports/usage",
                &query,
                &head,
                |u: api::UsageReport| u.rows,
                |r: &api::UsageRow| {
                    vec![
                        r.key.clone(),
                        humantime::format_rfc3339_seconds(
                            std::time::UNIX_EPOCH + std::time::Duration::from_secs(r.period_start),
                        )
                        .to_string(),
                        num(r.gpu_hours, 2),
                        num(r.used_gpu_hours, 2),
                        pct(r.efficiency, 100.0, 0),
                        num(r.cost, 2),
                        r.jobs.to_string(),
                    ]
                },
            )
        }
        ReportCmd::Advice { from } => {
            let head = [
                "id",
                "name",
                "team",
                "model",
                "peak gpu mem",
                "util",
                "instead",
                "saving/month",
            ];
            show_report(
                &c,
                out,
                false,
                "/v1/reports/advice",
                &[("from", from)],
                &head,
                |v: Vec<api::Advice>| v,
                |a: &api::Advice| {
                    vec![
                        a.id.to_string(),
                        a.name.clone(),
                        a.team.clone(),
                        a.model.clone(),
                        format!("{} MiB", a.peak_gpu_memory_mib),
                        pct(Some(a.util_pct), 1.0, 0),
                        a.instead.clone(),
                        format!("{} {}", num(a.saving_per_month, 2), a.currency)
                            .trim()
                            .to_string(),
                    ]
                },
            )
        }
        ReportCmd::Jobs { by, from, to } => {
            let mut query = vec![("by", by.clone()), ("from", from)];
            query.extend(to.map(|t| ("to", t)));
            let head = [
                by.as_str(),
                "submitted",
                "started",
                "wait p50",
                "wait p95",
                "succeeded",
                "failed",
                "cancelled",
                "failure rate",
                "preemptions",
                "lost gpu-h",
            ];
            show_report(
                &c,
                out,
                false,
                "/v1/reports/jobs",
                &query,
                &head,
                |v: Vec<api::JobsRow>| v,
                |r: &api::JobsRow| {
                    let secs = |x: Option<u64>| x.map_or("-".into(), |s| format!("{s} s"));
                    vec![
                        r.key.clone(),
                        r.submitted.to_string(),
                        r.started.to_string(),
                        secs(r.wait_p50_s),
                        secs(r.wait_p95_s),
                        r.succeeded.to_string(),
                        r.failed.to_string(),
                        r.cancelled.to_string(),
                        pct(r.failure_rate, 100.0, 0),
                        r.preemptions.to_string(),
                        num(r.lost_gpu_hours, 2),
                    ]
                },
            )
        }
        ReportCmd::Idle { below, held_for } => {
            let head = [
                "id",
                "name",
                "team",
                "user",
                "kind",
                "gpus",
                "util",
                "gpu-hours",
            ];
            let query = [("below_pct", below.to_string()), ("for", held_for)];
            show_report(
                &c,
                out,
                false,
                "/v1/reports/low-utilization",
                &query,
                &head,
                |v: Vec<api::LowUse>| v,
                |j: &api::LowUse| {
                    vec![
                        j.id.to_string(),
                        j.name.clone(),
                        j.team.clone(),
                        j.user.clone(),
                        j.kind.as_str().to_string(),
                        Value::from(j.gpus).to_string(),
                        pct(Some(j.util_pct), 1.0, 1),
                        num(j.gpu_hours, 2),
                    ]
                },
            )
        }
    }
}

/// A report from the API: its rows (`rows` of the answer, read as the
/// API's type), as a table, CSV (`csv`), or the server's JSON or YAML.
#[allow(clippy::too_many_arguments)]
pub(super) fn show_report<R: serde::de::DeserializeOwned, T>(
    c: &Client,
    output: Format,
    csv: bool,
    path: &str,
    query: &[(&str, String)],
    head: &[&str],
    rows: impl FnOnce(R) -> Vec<T>,
    row: impl Fn(&T) -> Vec<String>,
) -> anyhow::Result<()> {
    let mut q = form_urlencoded::Serializer::new(String::new());
    for (k, v) in query {
        q.append_pair(k, v);
    }
    let path = format!("{path}?{}", q.finish());
    let v = c.call("GET", &path, None)?;
    if !csv && matches!(output, Format::Json | Format::Yaml) {
        print(output, &v, |_| String::new());
        return Ok(());
    }
    let table: Vec<Vec<String>> = rows(gpuflow_client::read(&path, v)?)
        .iter()
        .map(row)
        .collect();
    if csv {
        let mut w = csv::Writer::from_writer(std::io::stdout());
        w.write_record(head)?;
        for r in table {
            w.write_record(r)?;
        }
        w.flush()?;
        return Ok(());
    }
    print!("{}", super::table(!c.no_headers, head, table));
    Ok(())
}

pub(crate) fn price(conn: &Conn, cmd: PriceCmd) -> anyhow::Result<()> {
    let c = Client::new(conn)?;
    let v = match cmd {
        PriceCmd::Ls => c.call("GET", "/v1/prices", None)?,
        PriceCmd::Set { prices, currency } => {
            let mut gpu_hour = serde_json::Map::new();
            for p in &prices {
                let (model, price) = p
                    .split_once('=')
                    .and_then(|(m, v)| Some((m, v.parse::<f64>().ok()?)))
                    .ok_or_else(|| {
                        anyhow!("{p:?}: use MODEL=PRICE, e.g. H100-80GB-HBM3=2.50 or *=1")
                    })?;
                gpu_hour.insert(model.to_string(), price.into());
            }
            let body = serde_json::json!({"currency": currency, "gpu_hour": gpu_hour});
            c.call(
                "PUT",
                "/v1/prices",
                Some(("application/json", body.to_string().into_bytes())),
            )?
        }
    };
    print_as(conn.output, "/v1/prices", v, |v: &api::Prices| {
        let rows = v
            .gpu_hour
            .iter()
            .map(|(m, p)| {
                vec![
                    m.clone(),
                    format!("{} {}", Value::from(*p), v.currency)
                        .trim()
                        .to_string(),
                ]
            })
            .collect();
        table(!conn.no_headers, &["model", "per gpu-hour"], rows)
    })
}
