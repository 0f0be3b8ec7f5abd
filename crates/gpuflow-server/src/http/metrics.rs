//! `GET /metrics`: Prometheus's text format, for admins' tokens (Prometheus
//! sends one with `authorization: {credentials: …}`). Names follow
//! `gpuflow_<subsystem>_<name>_<unit>`; per-GPU samples also carry
//! dcgm-exporter's names and labels (`DCGM_FI_DEV_GPU_UTIL{gpu, UUID,
//! device, modelName, Hostname}`), so dashboards made for it work.
//! Everything is read from memory under the state lock, once per scrape.

use std::fmt::Write;

use super::*;

pub(super) fn router() -> ApiRouter {
    ApiRouter::new().route("/metrics", get(metrics))
}

/// Bounds of the wait-time histogram, in seconds.
use crate::state::WAIT_BUCKETS;

/// One reading of a GPU's sample, if it has it.
type Reading = fn(&api::GpuSample) -> Option<f64>;

/// Writes a label value, escaped as the text format wants.
fn push_escaped(out: &mut String, v: &str) {
    if !v.contains(['\\', '"', '\n']) {
        out.push_str(v);
        return;
    }
    for c in v.chars() {
        match c {
            '\\' => out.push_str("\\\\"),
            '"' => out.push_str("\\\""),
            '\n' => out.push_str("\\n"),
            c => out.push(c),
        }
    }
}

struct Out(String);

impl Out {
    fn head(&mut self, name: &str, kind: &str, help: &str) {
        let _ = writeln!(self.0, "# HELP {name} {help}");
        let _ = writeln!(self.0, "# TYPE {name} {kind}");
    }

    /// A histogram's `_bucket`, `_sum` and `_count` lines.
    fn histogram(&mut self, name: &str, label: (&str, &str), h: &crate::state::Histogram) {
        let bucket = format!("{name}_bucket");
        for (b, n) in crate::state::SECONDS_BUCKETS.iter().zip(h.counts) {
            self.line(&bucket, &[label, ("le", &b.to_string())], n as f64);
        }
        self.line(&bucket, &[label, ("le", "+Inf")], h.count as f64);
        self.line(&format!("{name}_sum"), &[label], h.sum);
        self.line(&format!("{name}_count"), &[label], h.count as f64);
    }

    /// One sample, written straight into the text (a scrape at 10,000
    /// nodes writes about 100,000 of them, under the state lock).
    fn line(&mut self, name: &str, labels: &[(&str, &str)], v: f64) {
        let out = &mut self.0;
        out.push_str(name);
        if !labels.is_empty() {
            out.push('{');
            for (i, (k, value)) in labels.iter().enumerate() {
                if i > 0 {
                    out.push(',');
                }
                out.push_str(k);
                out.push_str("=\"");
                push_escaped(out, value);
                out.push('"');
            }
            out.push('}');
        }
        let _ = writeln!(out, " {v}");
    }
}

/// The last text rendered, and when its render began.
pub type Rendered = Option<(std::time::Instant, Arc<String>)>;

async fn metrics(
    State(shared): State<Arc<Shared>>,
    caller: Caller,
) -> Result<axum::response::Response, Error> {
    caller.need_admin("reading /metrics")?;
    let asked = std::time::Instant::now();
    // One render at a time, under the state lock; callers who asked while
    // it ran share the next one, which began after they asked, so nobody
    // reads figures older than their request, and however many scrape at
    // once, the lock sees at most one render in flight and one queued.
    let mut last = shared.metrics.lock().await;
    let text = match last.as_ref() {
        Some((began, text)) if *began >= asked => text.clone(),
        _ => {
            let began = std::time::Instant::now();
            let failures = shared
                .cycle_failures
                .load(std::sync::atomic::Ordering::Relaxed);
            let text = Arc::new(render(&*shared.world.lock().await, failures, shared.now()));
            *last = Some((began, text.clone()));
            text
        }
    };
    drop(last);
    Ok((
        [(
            axum::http::header::CONTENT_TYPE,
            "text/plain; version=0.0.4; charset=utf-8",
        )],
        text.as_str().to_owned(),
    )
        .into_response())
}

/// The metrics' text at `t`.
fn render(world: &crate::state::World, cycle_failures: u64, t: u64) -> String {
    let mut o = Out(String::new());
    queues(&mut o, world);
    cluster(&mut o, world);
    teams(&mut o, world, t);
    budgets(&mut o, world, t);
    server(&mut o, world, cycle_failures);
    nodes(&mut o, world, t);
    o.0
}

/// Queues: jobs by state, GPUs used against guaranteed.
fn queues(o: &mut Out, world: &crate::state::World) {
    let mut jobs: BTreeMap<(&str, &str), u64> = BTreeMap::new();
    // GPUs held per queue and flavor (the GPU model its quota is charged).
    let mut used: BTreeMap<(&str, &str), u64> = BTreeMap::new();
    for j in world.jobs().values().filter(|j| !j.state.finished()) {
        *jobs
            .entry((j.spec.queue.as_str(), j.state.as_str()))
            .or_default() += 1;
        if j.state.allocated() && !j.flavor.is_empty() {
            *used
                .entry((j.spec.queue.as_str(), j.flavor.as_str()))
                .or_default() += j
                .held
                .last()
                .filter(|h| h.to.is_none())
                .map_or_else(|| crate::convert::quota_milli(&j.spec), |h| h.gpu_milli);
        }
    }
    // The cluster's GPUs per model (nodes not lost): what a guarantee of
    // "all" (or more than there is) amounts to.
    let mut models: BTreeMap<&str, f64> = BTreeMap::new();
    for n in world
        .nodes()
        .values()
        .filter(|n| n.state != api::NodeState::Lost)
    {
        for g in &n.inventory.gpus {
            *models.entry(g.model.as_str()).or_default() += 1.0;
        }
    }
    o.head(
        "gpuflow_queue_unfinished_jobs",
        "gauge",
        "Unfinished jobs per queue and state.",
    );
    for ((q, s), n) in &jobs {
        o.line(
            "gpuflow_queue_unfinished_jobs",
            &[("queue", q), ("state", s)],
            *n as f64,
        );
    }
    o.head(
        "gpuflow_queue_used_gpus",
        "gauge",
        "GPUs held by a queue's jobs per flavor (GPU model; shares, MIG and time slices at their equivalents).",
    );
    for q in world.records().queues.keys() {
        for &m in models.keys() {
            let u = used.get(&(q.as_str(), m)).copied().unwrap_or(0);
            o.line(
                "gpuflow_queue_used_gpus",
                &[("queue", q), ("flavor", m)],
                u as f64 / 1000.0,
            );
        }
    }
    o.head(
        "gpuflow_queue_guaranteed_gpus",
        "gauge",
        "A queue's guarantee per flavor (GPU model), at most the GPUs the cluster has of it (a guarantee of \"all\" is all of them).",
    );
    for (name, q) in &world.records().queues {
        for (&m, &have) in &models {
            if let Some(quota) = gpuflow_core::queue::quota_entry(&q.quotas, m) {
                o.line(
                    "gpuflow_queue_guaranteed_gpus",
                    &[("queue", name), ("flavor", m)],
                    quota.guaranteed.min(have),
                );
            }
        }
    }
}

/// The cluster: GPUs per model and pool, allocated, unhealthy, and how much of each GPU is held.
fn cluster(o: &mut Out, world: &crate::state::World) {
    let in_use = world.gpus_in_use();
    let mut total: BTreeMap<(&str, &str), (u64, u64, u64)> = BTreeMap::new();
    for n in world
        .nodes()
        .values()
        .filter(|n| n.state != api::NodeState::Lost)
    {
        let pool = if n.inventory.pool.is_empty() {
            "default"
        } else {
            n.inventory.pool.as_str()
        };
        let held = in_use.get(n.name.as_str());
        for g in &n.inventory.gpus {
            let e = total.entry((g.model.as_str(), pool)).or_default();
            e.0 += 1;
            if held.is_some_and(|h| h.contains(&g.index)) {
                e.1 += 1;
            }
            if g.unhealthy.is_some() {
                e.2 += 1;
            }
        }
    }
    o.head(
        "gpuflow_cluster_total_gpus",
        "gauge",
        "GPUs of the nodes not lost, per model and pool.",
    );
    for ((m, p), (n, _, _)) in &total {
        o.line(
            "gpuflow_cluster_total_gpus",
            &[("model", m), ("pool", p)],
            *n as f64,
        );
    }
    o.head(
        "gpuflow_cluster_allocated_gpus",
        "gauge",
        "GPUs with work on them (whole or shared), per model and pool.",
    );
    for ((m, p), (_, a, _)) in &total {
        o.line(
            "gpuflow_cluster_allocated_gpus",
            &[("model", m), ("pool", p)],
            *a as f64,
        );
    }
    o.head(
        "gpuflow_cluster_unhealthy_gpus",
        "gauge",
        "GPUs their agent reports unhealthy (XID, ECC, lost), per model and pool.",
    );
    for ((m, p), (_, _, u)) in &total {
        o.line(
            "gpuflow_cluster_unhealthy_gpus",
            &[("model", m), ("pool", p)],
            *u as f64,
        );
    }

    // Shares: how much of each GPU is held, and the free capacity of GPUs
    // partly held (shared or split into MIG instances), which no whole-GPU
    // job can use: the fragmentation FGD measures.
    let holders = world.holders(|_| true);
    let mut share: BTreeMap<(&str, &str), (f64, f64)> = BTreeMap::new();
    for n in world
        .nodes()
        .values()
        .filter(|n| n.state != api::NodeState::Lost)
    {
        let pool = if n.inventory.pool.is_empty() {
            "default"
        } else {
            n.inventory.pool.as_str()
        };
        let held = holders.get(&n.name).map_or(&[][..], Vec::as_slice);
        for g in n.inventory.gpus.iter().filter(|g| g.unhealthy.is_none()) {
            let milli: u32 = held
                .iter()
                .filter(|h| h.gpu == g.index)
                .map(|h| h.milli)
                .sum::<u32>()
                .min(1000);
            let e = share.entry((g.model.as_str(), pool)).or_default();
            e.0 += f64::from(milli) / 1000.0;
            if milli > 0 && milli < 1000 {
                e.1 += f64::from(1000 - milli) / 1000.0;
            }
        }
    }
    o.head(
        "gpuflow_cluster_allocation_ratio",
        "gauge",
        "Share of the healthy GPUs' capacity held (shares, MIG and time slices at their equivalents), per model and pool.",
    );
    for ((m, p), (held, _)) in &share {
        let n = total.get(&(*m, *p)).map_or(0, |t| t.0 - t.2);
        let ratio = if n == 0 { 0.0 } else { held / n as f64 };
        o.line(
            "gpuflow_cluster_allocation_ratio",
            &[("model", m), ("pool", p)],
            ratio,
        );
    }
    o.head(
        "gpuflow_cluster_fragmented_gpus",
        "gauge",
        "Free capacity, in GPUs, on GPUs partly held (shared or MIG): free, but not to a whole-GPU job; per model and pool.",
    );
    for ((m, p), (_, frag)) in &share {
        o.line(
            "gpuflow_cluster_fragmented_gpus",
            &[("model", m), ("pool", p)],
            *frag,
        );
    }
}

/// Teams: GPUs held now, and GPU-hours held ever (the ledger).
fn teams(o: &mut Out, world: &crate::state::World, t: u64) {
    let mut team_now: BTreeMap<&str, (f64, f64)> = BTreeMap::new();
    for team in world.records().teams.keys() {
        team_now.insert(team.as_str(), (0.0, 0.0));
    }
    for (team, s) in &world.team_closed_gpu_s {
        team_now.entry(team.as_str()).or_default().1 += s;
    }
    for j in world
        .jobs()
        .values()
        .map(|j| &**j)
        .chain(world.external().values())
    {
        for h in j.held.iter().filter(|h| h.to.is_none()) {
            let e = team_now.entry(j.team.as_str()).or_default();
            e.0 += h.gpu_milli as f64 / 1000.0;
            e.1 += h.gpu_s(0, u64::MAX, t);
        }
    }
    o.head(
        "gpuflow_team_allocated_gpus",
        "gauge",
        "GPUs a team's jobs hold now (shares, MIG and time slices at their equivalents).",
    );
    for (team, (gpus, _)) in &team_now {
        o.line("gpuflow_team_allocated_gpus", &[("team", team)], *gpus);
    }
    o.head(
        "gpuflow_team_gpu_hours_total",
        "counter",
        "GPU-hours a team's jobs have held, from the accounting ledger (all time).",
    );
    for (team, (_, s)) in &team_now {
        o.line(
            "gpuflow_team_gpu_hours_total",
            &[("team", team)],
            s / 3600.0,
        );
    }
}

/// Budgets: what each budgeted queue and project used this period.
fn budgets(o: &mut Out, world: &crate::state::World, t: u64) {
    o.head(
        "gpuflow_queue_budget_gpu_hours",
        "gauge",
        "A queue's GPU-hour budget per period (queues budgeted in GPU-hours).",
    );
    for (name, q) in &world.records().queues {
        if let Some(h) = q.budget.as_ref().and_then(|b| b.gpu_hours) {
            o.line("gpuflow_queue_budget_gpu_hours", &[("queue", name)], h);
        }
    }
    o.head(
        "gpuflow_queue_budget_used_ratio",
        "gauge",
        "Share of a queue's budget (GPU-hours or cost) used in its current period (counted every 30 s).",
    );
    for (name, q) in &world.records().queues {
        if let Some(b) = &q.budget {
            let ratio =
                crate::accounting::core_budget(b, world.budget_used.get(name), t).used_share();
            o.line("gpuflow_queue_budget_used_ratio", &[("queue", name)], ratio);
        }
    }
    o.head(
        "gpuflow_project_budget_used_ratio",
        "gauge",
        "Share of a project's budget (GPU-hours or cost) used in its current period (counted every 30 s).",
    );
    for (name, p) in &world.records().projects {
        if let Some(b) = &p.budget {
            let ratio = crate::accounting::core_budget(b, world.project_budget_used.get(name), t)
                .used_share();
            o.line(
                "gpuflow_project_budget_used_ratio",
                &[("project", name)],
                ratio,
            );
        }
    }
}

/// The server's own: waits, failed cycles, phases and counters.
fn server(o: &mut Out, world: &crate::state::World, cycle_failures: u64) {
    o.head(
        "gpuflow_job_wait_seconds",
        "histogram",
        "From submission to first start, by job kind, since the server started.",
    );
    for (kind, w) in &world.stats.waits {
        for (b, n) in WAIT_BUCKETS.iter().zip(w.counts) {
            o.line(
                "gpuflow_job_wait_seconds_bucket",
                &[("kind", kind), ("le", &b.to_string())],
                n as f64,
            );
        }
        o.line(
            "gpuflow_job_wait_seconds_bucket",
            &[("kind", kind), ("le", "+Inf")],
            w.count as f64,
        );
        o.line("gpuflow_job_wait_seconds_sum", &[("kind", kind)], w.sum);
        o.line(
            "gpuflow_job_wait_seconds_count",
            &[("kind", kind)],
            w.count as f64,
        );
    }

    o.head(
        "gpuflow_scheduler_cycle_failures_total",
        "counter",
        "Scheduling cycles that failed or panicked since the server started (each is retried).",
    );
    o.line(
        "gpuflow_scheduler_cycle_failures_total",
        &[],
        cycle_failures as f64,
    );
    let st = &world.stats;
    o.head(
        "gpuflow_scheduler_cycle_phase_seconds",
        "histogram",
        "Each phase of the scheduling cycles since the server started: take (the snapshot, under the state lock), compute (schedule(), off the lock), apply (re-check and commit).",
    );
    for (phase, h) in [
        ("take", &st.cycle_take),
        ("compute", &st.cycle_compute),
        ("apply", &st.cycle_apply),
    ] {
        o.histogram("gpuflow_scheduler_cycle_phase_seconds", ("phase", phase), h);
    }
    o.head(
        "gpuflow_store_commit_seconds",
        "histogram",
        "Store commits (one transaction each) since the server started.",
    );
    o.histogram("gpuflow_store_commit_seconds", ("store", "all"), &st.commit);
    for (name, help, v) in [
        (
            "gpuflow_scheduler_admissions_total",
            "Jobs admitted since the server started.",
            st.admissions as f64,
        ),
        (
            "gpuflow_scheduler_preemptions_total",
            "Jobs preempted since the server started.",
            st.preemptions as f64,
        ),
        (
            "gpuflow_scheduler_lost_gpu_hours_total",
            "GPU-hours of work the preemptions lost (since the victims' checkpoints).",
            st.lost_gpu_hours,
        ),
        (
            "gpuflow_scheduler_idle_waiting_gpu_hours_total",
            "GPU-hours that stood free while waiting work could have held them, quota aside.",
            st.idle_waiting_gpu_hours,
        ),
    ] {
        o.head(name, "counter", help);
        o.line(name, &[], v);
    }
    o.head(
        "gpuflow_scheduler_idle_waiting_gpus",
        "gauge",
        "GPUs free after the last cycle that waiting work could hold, quota aside.",
    );
    o.line(
        "gpuflow_scheduler_idle_waiting_gpus",
        &[],
        st.idle_waiting_gpus,
    );
    for (name, help, by) in [
        (
            "gpuflow_queue_admissions_total",
            "Jobs of a queue admitted since the server started.",
            &st.admissions_by_queue,
        ),
        (
            "gpuflow_queue_preemptions_total",
            "Jobs of a queue preempted (the victims' queue) since the server started.",
            &st.preemptions_by_queue,
        ),
    ] {
        o.head(name, "counter", help);
        for (q, n) in by {
            o.line(name, &[("queue", q)], *n as f64);
        }
    }
}

/// Nodes: state, build, heartbeat age, and per GPU as dcgm-exporter names them.
fn nodes(o: &mut Out, world: &crate::state::World, t: u64) {
    o.head(
        "gpuflow_node_state_info",
        "gauge",
        "1 for each node's state (ready, cordoned, draining, lost).",
    );
    for n in world.nodes().values() {
        for s in [
            api::NodeState::Ready,
            api::NodeState::Cordoned,
            api::NodeState::Draining,
            api::NodeState::Lost,
        ] {
            o.line(
                "gpuflow_node_state_info",
                &[("node", &n.name), ("state", s.as_str())],
                f64::from(u8::from(n.state == s)),
            );
        }
    }
    o.head(
        "gpuflow_server_build_info",
        "gauge",
        "The server's version (always 1).",
    );
    o.line(
        "gpuflow_server_build_info",
        &[("version", env!("CARGO_PKG_VERSION"))],
        1.0,
    );
    o.head(
        "gpuflow_node_heartbeat_age_seconds",
        "gauge",
        "Seconds since each node's last heartbeat.",
    );
    for n in world.nodes().values() {
        o.line(
            "gpuflow_node_heartbeat_age_seconds",
            &[("node", &n.name)],
            t.saturating_sub(n.last_heartbeat) as f64,
        );
    }

    // Per GPU, as dcgm-exporter names them.
    let dcgm: [(&str, &str, Reading); 4] = [
        ("DCGM_FI_DEV_GPU_UTIL", "GPU utilization (in %).", |s| {
            Some(f64::from(s.util_pct))
        }),
        (
            "DCGM_FI_DEV_FB_USED",
            "Framebuffer memory used (in MiB).",
            |s| Some(s.memory_used_mib as f64),
        ),
        ("DCGM_FI_DEV_POWER_USAGE", "Power draw (in W).", |s| {
            s.power_w
        }),
        ("DCGM_FI_DEV_GPU_TEMP", "GPU temperature (in C).", |s| {
            s.temperature_c.map(f64::from)
        }),
    ];
    for (name, help, value) in dcgm {
        o.head(name, "gauge", help);
        for n in world.nodes().values() {
            for s in &n.gpus_now {
                let Some(g) = n.inventory.gpus.iter().find(|g| g.uuid == s.uuid) else {
                    continue;
                };
                let Some(v) = value(s) else {
                    continue;
                };
                let (gpu, device) = (g.index.to_string(), format!("nvidia{}", g.index));
                o.line(
                    name,
                    &[
                        ("gpu", &gpu),
                        ("UUID", &g.uuid),
                        ("device", &device),
                        ("modelName", &g.model),
                        ("Hostname", &n.name),
                    ],
                    v,
                );
            }
        }
    }
}

#[cfg(test)]
mod tests {
    use super::{Out, push_escaped};

    #[test]
    fn label_values_are_escaped_as_the_text_format_says() {
        for (raw, want) in [
            ("n1", "n1"),
            ("a\"b", "a\\\"b"),
            ("a\\b", "a\\\\b"),
            ("a\nb", "a\\nb"),
            ("\\\"\n", "\\\\\\\"\\n"),
            ("GPU-ü\"}\n x=1", "GPU-ü\\\"}\\n x=1"),
        ] {
            let mut out = String::new();
            push_escaped(&mut out, raw);
            assert_eq!(out, want, "{raw:?}");
        }
        let mut o = Out(String::new());
        o.line("m", &[], 1.5);
        o.line("m", &[("node", "n\"1"), ("gpu", "0")], 2.0);
        assert_eq!(o.0, "m 1.5\nm{node=\"n\\\"1\",gpu=\"0\"} 2\n");
    }
}
