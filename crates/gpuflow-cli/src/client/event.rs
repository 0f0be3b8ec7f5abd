//! `gpuflow event`: the event log, followed as it grows.

use super::*;

#[derive(Subcommand)]
pub(crate) enum EventCmd {
    /// Events, oldest first: submissions, admissions, preemptions, node
    /// changes, with their reasons.
    Ls {
        /// Only this job's events.
        #[arg(long)]
        job: Option<u64>,
        /// Events after this sequence number (the last one seen).
        #[arg(long)]
        after: Option<i64>,
        /// Only events at or after this time: a time (2026-12-05 14:00,
        /// 2026-12-05, RFC 3339) or how long ago (30m, 2h, 1d).
        #[arg(long, value_parser = time_arg)]
        since: Option<i64>,
        /// Only events before this time (the forms of --since).
        #[arg(long, value_parser = time_arg)]
        until: Option<i64>,
        /// Only the newest N events (1 to 1000).
        #[arg(long)]
        limit: Option<u32>,
        /// Keep printing new events as they come, every --interval seconds,
        /// until interrupted (--count: stop after that many looks).
        #[command(flatten)]
        watch: Watch,
    },
}

pub(crate) fn event(conn: &Conn, cmd: EventCmd) -> anyhow::Result<()> {
    let c = Client::new(conn)?;
    let EventCmd::Ls {
        job,
        after,
        since,
        until,
        limit,
        watch,
    } = cmd;
    if let (Some(a), Some(b)) = (since, until)
        && a >= b
    {
        return Err(Usage("--since must be before --until".into()).into());
    }
    if limit.is_some_and(|l| !(1..=1000).contains(&l)) {
        return Err(Usage("--limit: 1 to 1000 events".into()).into());
    }
    let mut q = vec![];
    if let Some(j) = job {
        q.push(format!("job={j}"));
    }
    for (k, v) in [("since", since), ("until", until)] {
        if let Some(t) = v {
            q.push(format!("{k}={}", t.max(0)));
        }
    }
    // --limit: the newest N on the first look; later looks take all that came.
    let newest = limit.map(|l| format!("limit={l}&newest=true"));
    // The first look prints the table; each later one the events that
    // came since, without the heading (as `kubectl get events -w`).
    let mut last = after;
    let mut first = true;
    watch.follow(|| {
        let mut q = q.clone();
        if let Some(a) = last {
            q.push(format!("after={a}"));
        }
        if first && let Some(n) = &newest {
            q.push(n.clone());
        }
        let path = format!("/v1/events?{}", q.join("&"));
        let v = c.call("GET", &path, None)?;
        let events: Vec<api::Event> = gpuflow_client::read(&path, v.clone())?;
        let list = v.as_array().cloned().unwrap_or_default();
        if let Some(e) = events.last() {
            last = Some(e.seq);
        }
        if !first && events.is_empty() {
            return Ok(());
        }
        let rows: Vec<Vec<String>> = events
            .iter()
            .map(|e| {
                vec![
                    e.seq.to_string(),
                    local_at(e.at),
                    e.job.map_or_else(|| "-".into(), |j| j.to_string()),
                    e.kind.clone(),
                    e.message.clone(),
                ]
            })
            .collect();
        let head = ["seq", "at", "job", "kind", "message"];
        match (first, conn.output) {
            (true, _) | (false, Format::Json | Format::Yaml) => {
                print(conn.output, &Value::Array(list), |_| {
                    table(!conn.no_headers, &head, rows)
                })
            }
            (false, _) => {
                // Later rows, without the heading again.
                print!("{}", table(false, &head, rows));
            }
        }
        first = false;
        Ok(())
    })
}
