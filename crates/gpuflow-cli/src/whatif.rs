//! `gpuflow sim whatif`: fetches the recorded workload from the server and
//! prints the simulator's two runs (the cluster as it is, and changed) side
//! by side.

use anyhow::{Context, bail};
use clap::Args;
use gpuflow_api as api;
use gpuflow_sim::dynamic::{SimConfig, SimPolicy};
use gpuflow_sim::whatif::{self, Change, Recorded, Summary};
use gpuflow_sim::workload::{ClusterSpec, KINDS, NodeGroup};
use serde_json::json;

use crate::client::{Client, Conn, Format};

#[derive(Args)]
pub(crate) struct WhatifArgs {
    /// A change, repeatable: NODESxGPUSxMODEL adds nodes (2x8xH100),
    /// -NODESxMODEL removes them (-1xH100), TEAM=MODEL:GPUS sets a team's
    /// guarantee (vision=H100:16).
    #[arg(long = "change", required = true, allow_hyphen_values = true)]
    changes: Vec<String>,
    /// The jobs submitted from (Unix seconds, 2026-12-01, or an age: 30d).
    #[arg(long, default_value = "30d")]
    from: String,
    /// The jobs submitted until (as --from; default now).
    #[arg(long)]
    to: Option<String>,
    /// The scheduling policy replayed (as `sim run`).
    #[arg(long, default_value = "gpuflow")]
    policy: String,
    /// Seconds between simulated scheduling cycles; default: the server's
    /// own cycle interval (60 from a server that does not say).
    #[arg(long)]
    cycle_s: Option<u64>,
    #[command(flatten)]
    conn: Conn,
}

pub(crate) fn run(a: WhatifArgs) -> anyhow::Result<()> {
    let changes: Vec<Change> = a
        .changes
        .iter()
        .map(|c| Change::parse(c).map_err(|e| anyhow::anyhow!("--change {e}")))
        .collect::<anyhow::Result<_>>()?;
    let policy = SimPolicy::named(&a.policy).with_context(|| {
        format!(
            "--policy: unknown policy {:?}; expected one of {}",
            a.policy,
            SimPolicy::NAMES.join(", ")
        )
    })?;
    if a.cycle_s == Some(0) {
        bail!("--cycle-s must be above 0");
    }
    let mut query = form_urlencoded::Serializer::new(String::new());
    query.append_pair("from", &a.from);
    if let Some(t) = &a.to {
        query.append_pair("to", t);
    }
    let c = Client::new(&a.conn)?;
    let v = c.call(
        "GET",
        &format!("/v1/reports/workload?{}", query.finish()),
        None,
    )?;
    let w: api::RecordedWorkload =
        serde_json::from_value(v).context("the server's recorded workload")?;
    if w.jobs.is_empty() {
        bail!(
            "no job that held GPUs was submitted in that range: nothing to replay (try an earlier --from)"
        );
    }
    let mut spec = ClusterSpec {
        nodes: w
            .nodes
            .iter()
            .map(|n| NodeGroup {
                count: n.count,
                gpus: n.gpus,
                model: n.model.clone(),
                cpu: n.cpu.max(1),
                mem_gib: n.mem_gib.max(1),
                rack_size: None,
            })
            .collect(),
        queues: Vec::new(),
    };
    let mut teams: Vec<String> = w.teams.iter().map(|t| t.name.clone()).collect();
    spec.queues = w
        .teams
        .iter()
        .map(|t| whatif::team_queue(&t.name, t.weight, &t.guaranteed, &t.borrow_limit))
        .collect();
    // Jobs of teams that no longer have a queue still ran: they replay
    // with no guarantee.
    for j in &w.jobs {
        if !teams.contains(&j.team) {
            teams.push(j.team.clone());
            spec.queues.push(whatif::team_queue(
                &j.team,
                1.0,
                &Default::default(),
                &Default::default(),
            ));
        }
    }
    if spec.nodes.is_empty() {
        bail!("the cluster has no node with GPUs to replay on");
    }
    let scaled = whatif::fit_guarantees(&mut spec);
    let recorded: Vec<Recorded> = w
        .jobs
        .iter()
        .map(|j| Recorded {
            id: j.id,
            submitted_at: j.submitted_at,
            duration_s: j.duration_s,
            tasks: j.tasks,
            gpus_per_task: j.gpus_per_task,
            milli: j.milli,
            team: j.team.clone(),
            kind: KINDS
                .iter()
                .position(|k| *k == j.kind.as_str())
                .unwrap_or(2),
            priority: j.priority,
            max_runtime_s: j.max_runtime_s,
            model: j.model.clone(),
        })
        .collect();
    let prices = w.prices.clone();
    let price = move |m: &str| -> f64 {
        prices
            .gpu_hour
            .get(m)
            .or_else(|| prices.gpu_hour.get("*"))
            .copied()
            .unwrap_or(0.0)
    };
    let cycle_s = a
        .cycle_s
        .unwrap_or(if w.cycle_s > 0 { w.cycle_s } else { 60 });
    let cfg = SimConfig {
        interval: cycle_s,
        ..SimConfig::default()
    };
    let (now, then) = whatif::compare(&spec, &recorded, &changes, &policy, &cfg, &price)?;
    let out = json!({
        "jobs": recorded.len(),
        "cycle_s": cycle_s,
        "left_out": w.left_out,
        "guarantees_scaled": scaled,
        "currency": w.prices.currency,
        "now": summary_json(&now),
        "whatif": summary_json(&then),
    });
    match a.conn.output {
        Format::Json => println!("{}", serde_json::to_string_pretty(&out)?),
        Format::Yaml => print!("{}", serde_norway::to_string(&out)?),
        Format::Table | Format::Wide => print!("{}", table(&w, recorded.len(), &now, &then)),
    }
    Ok(())
}

fn summary_json(s: &Summary) -> serde_json::Value {
    json!({
        "gpus": s.gpus,
        "jobs": s.jobs,
        "unfinished": s.unfinished,
        "wait_p50_h": s.wait_p50_h,
        "wait_p95_h": s.wait_p95_h,
        "wait_max_h": s.wait_max_h,
        "utilisation": s.utilisation,
        "gpu_hours": s.gpu_hours,
        "cluster_cost": s.cluster_cost,
        "teams": s.teams.iter().map(|(t, (h, share, p95))| (t.clone(), json!({
            "gpu_hours": h, "share": share, "wait_p95_h": p95,
        }))).collect::<serde_json::Map<_, _>>(),
    })
}

fn table(w: &api::RecordedWorkload, jobs: usize, now: &Summary, then: &Summary) -> String {
    let mut out = format!("replayed {jobs} recorded jobs");
    if !w.left_out.is_empty() {
        let left: Vec<String> = w.left_out.iter().map(|(k, n)| format!("{n} {k}")).collect();
        out.push_str(&format!(" (left out: {})", left.join(", ")));
    }
    out.push('\n');
    let cur = if w.prices.currency.is_empty() {
        "cost".to_string()
    } else {
        format!("cost ({})", w.prices.currency)
    };
    // (name, now, what-if, how to write it: None a duration in hours,
    // Some(d) a number with d decimals).
    let mut rows: Vec<(String, f64, f64, Option<usize>)> = vec![
        ("GPUs".into(), now.gpus as f64, then.gpus as f64, Some(0)),
        ("wait p50".into(), now.wait_p50_h, then.wait_p50_h, None),
        ("wait p95".into(), now.wait_p95_h, then.wait_p95_h, None),
        ("wait max".into(), now.wait_max_h, then.wait_max_h, None),
        (
            "utilisation (%)".into(),
            100.0 * now.utilisation,
            100.0 * then.utilisation,
            Some(1),
        ),
        (
            "GPU-hours run".into(),
            now.gpu_hours,
            then.gpu_hours,
            Some(2),
        ),
        (
            format!("cluster {cur}"),
            now.cluster_cost,
            then.cluster_cost,
            Some(2),
        ),
        (
            "unfinished jobs".into(),
            now.unfinished as f64,
            then.unfinished as f64,
            Some(0),
        ),
    ];
    for (t, (_, share, p95)) in &now.teams {
        let (_, s2, p2) = then.teams.get(t).copied().unwrap_or_default();
        rows.push((
            format!("{t}: share (%)"),
            100.0 * share,
            100.0 * s2,
            Some(1),
        ));
        rows.push((format!("{t}: wait p95"), *p95, p2, None));
    }
    let w0 = rows.iter().map(|r| r.0.len()).max().unwrap_or(0).max(6);
    out.push_str(&format!(
        "{:<w0$}  {:>12}  {:>12}  {:>12}\n",
        "", "NOW", "WHAT-IF", "CHANGE"
    ));
    for (name, a, b, how) in rows {
        let (a, b, d) = match how {
            Some(d) => (
                format!("{a:.d$}"),
                format!("{b:.d$}"),
                format!("{:+.d$}", b - a),
            ),
            None => (hours(a), hours(b), {
                let d = b - a;
                format!("{}{}", if d < 0.0 { "-" } else { "+" }, hours(d.abs()))
            }),
        };
        out.push_str(&format!("{name:<w0$}  {a:>12}  {b:>12}  {d:>12}\n"));
    }
    out
}

/// A duration given in hours, as a person reads it: 40s, 12.5m, 3.2h.
fn hours(h: f64) -> String {
    let s = h * 3600.0;
    if s < 90.0 {
        format!("{s:.0}s")
    } else if s < 5400.0 {
        format!("{:.1}m", s / 60.0)
    } else {
        format!("{h:.1}h")
    }
}
