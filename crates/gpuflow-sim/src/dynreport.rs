//! Reports of the dynamic simulator: a table, a CSV and an SVG chart.

use std::fmt::Write as _;

use crate::dynamic::{
    Outcome, SimResult, accuracy, group_stats, jain, kind_name, makespan, team_shares, waits,
};
use crate::workload::KINDS;

/// The text report: waits per kind (and for all jobs) and per team, then
/// cluster-wide figures.
pub fn table(results: &[SimResult]) -> String {
    let mut out = String::new();
    let _ = writeln!(
        out,
        "wait (to the first start; queued: all the time waited, after preemptions too) and job completion time (JCT), hours, per kind"
    );
    let _ = writeln!(
        out,
        "{:<11} {:<10} {:>6} {:>8} {:>8} {:>8} {:>8} {:>10} {:>8} {:>8}",
        "policy",
        "kind",
        "jobs",
        "wait avg",
        "p50",
        "p95",
        "max",
        "queued p95",
        "JCT avg",
        "JCT p95"
    );
    for r in results {
        let kinds = (0..KINDS.len()).map(|k| (kind_name(k), Some(k)));
        for (name, k) in kinds.chain([("all", None)]) {
            let of = |o: &&Outcome| k.is_none_or(|k| o.kind == k);
            let w = waits(r.outcomes.iter().filter(of));
            if w.jobs == 0 && k.is_some() {
                continue;
            }
            let (_, _, _, mj, pj) = group_stats(r.outcomes.iter().filter(of));
            let _ = writeln!(
                out,
                "{:<11} {name:<10} {:>6} {:>8.2} {:>8.2} {:>8.2} {:>8.2} {:>10.2} {mj:>8.2} {pj:>8.2}",
                r.policy, w.jobs, w.mean, w.p50, w.p95, w.max, w.queued_p95
            );
        }
    }
    let _ = writeln!(
        out,
        "\nper team: wait (hours), share of GPU-hours against the weighted share, share of the demand"
    );
    let _ = writeln!(
        out,
        "{:<11} {:<8} {:>8} {:>8} {:>8} {:>8} {:>8} {:>8} {:>8}",
        "policy", "team", "p50", "p95", "max", "share", "target", "off by", "demand"
    );
    for r in results {
        for (team, share, target) in team_shares(r) {
            let w = waits(r.outcomes.iter().filter(|o| o.team == team));
            let off = if target > 0.0 {
                (share / target - 1.0) * 100.0
            } else {
                0.0
            };
            let _ = writeln!(
                out,
                "{:<11} {team:<8} {:>8.2} {:>8.2} {:>8.2} {:>7.1}% {:>7.1}% {off:>+7.1}% {:>7.1}%",
                r.policy,
                w.p50,
                w.p95,
                w.max,
                share * 100.0,
                target * 100.0,
                demand_share(r, &team) * 100.0
            );
        }
    }
    let _ = writeln!(
        out,
        "\n{:<11} {:>11} {:>11} {:>6} {:>12} {:>11} {:>7} {:>10} {:>11} {:>7}",
        "policy",
        "GPU alloc %",
        "idle-wait %",
        "Jain",
        "preemptions",
        "GPU-h lost",
        "lost %",
        "makespan h",
        "unfinished",
        "cycles"
    );
    for r in results {
        let _ = writeln!(
            out,
            "{:<11} {:>11.1} {:>10.2}% {:>6.3} {:>12} {:>11.1} {:>6.2}% {:>10.1} {:>11} {:>7}",
            r.policy,
            alloc_pct(r),
            idle_waiting_pct(r),
            jain(r),
            r.preemptions,
            r.lost_gpu_hours,
            lost_pct(r),
            makespan(r),
            r.unfinished,
            r.cycles
        );
    }
    let _ = writeln!(
        out,
        "\nstart estimates (at each job's first cycle, then hourly while it waited) against its real start"
    );
    let _ = writeln!(
        out,
        "{:<11} {:<10} {:>9} {:>8} {:>11} {:>10} {:>7} {:>9} {:>12}",
        "policy",
        "kind",
        "estimates",
        "unknown",
        "median err h",
        "p90 err h",
        "bias h",
        "within",
        "first / wait"
    );
    for r in results {
        for (name, k, a) in accuracies(r) {
            if a.estimates == 0 && k.is_some() {
                continue;
            }
            let _ = writeln!(
                out,
                "{:<11} {name:<10} {:>9} {:>7.1}% {:>12.2} {:>10.2} {:>+7.2} {:>8.1}% {:>12.2}",
                r.policy,
                a.estimates,
                a.unknown * 100.0,
                a.median_h,
                a.p90_h,
                a.bias_h,
                a.within * 100.0,
                a.long_median_rel
            );
        }
    }
    let _ = writeln!(
        out,
        "(bias: the median of estimated less real start, late above 0; within: of the known estimates, those within 25 % of the wait still ahead or 10 minutes; first / wait: jobs that waited over 10 minutes, the median of their first estimate's error over their wait)"
    );
    out
}

/// A run's estimate accuracy per kind (its index), then for all jobs.
fn accuracies(r: &SimResult) -> Vec<(&'static str, Option<usize>, crate::dynamic::Accuracy)> {
    (0..KINDS.len())
        .map(|k| (kind_name(k), Some(k)))
        .chain([("all", None)])
        .map(|(name, k)| {
            let of = |o: &&Outcome| k.is_none_or(|k| o.kind == k);
            (name, k, accuracy(r.outcomes.iter().filter(of)))
        })
        .collect()
}

/// The estimates' accuracy per policy and kind, CSV.
pub fn estimates_csv(results: &[SimResult]) -> String {
    let mut out = String::from(
        "policy,kind,estimates,unknown_pct,median_error_h,p90_error_h,bias_h,within_pct,long_waits,long_median_relative_error\n",
    );
    for r in results {
        for (name, _, a) in accuracies(r) {
            let _ = writeln!(
                out,
                "{},{name},{},{:.2},{:.4},{:.4},{:.4},{:.2},{},{:.4}",
                r.policy,
                a.estimates,
                a.unknown * 100.0,
                a.median_h,
                a.p90_h,
                a.bias_h,
                a.within * 100.0,
                a.long_waits,
                a.long_median_rel
            );
        }
    }
    out
}

/// Every start estimate, one a row, against the job's real start (for
/// runs with [`crate::dynamic::SimConfig::log_estimates`]): when it was
/// told, the estimate (empty: unknown), the first start (empty: never),
/// estimate − start in seconds, and the job's reasons then.
pub fn estimates_log_csv(results: &[SimResult]) -> String {
    let mut out =
        String::from("policy,job,team,kind,at_s,estimate_s,start_s,error_s,wait_left_s,reasons\n");
    let opt = |t: Option<u64>| t.map(|t| t.to_string()).unwrap_or_default();
    for r in results {
        for o in &r.outcomes {
            for (k, &(at, eta)) in o.estimates.iter().enumerate() {
                let error = match (eta, o.first_start) {
                    (Some(e), Some(s)) => (e as i64 - s as i64).to_string(),
                    _ => String::new(),
                };
                let left = o.first_start.map(|s| s.saturating_sub(at));
                let _ = writeln!(
                    out,
                    "{},{},{},{},{at},{},{},{error},{},{}",
                    r.policy,
                    o.id,
                    o.team,
                    kind_name(o.kind),
                    opt(eta),
                    opt(o.first_start),
                    opt(left),
                    o.estimate_reasons.get(k).map_or("", String::as_str),
                );
            }
        }
    }
    out
}

/// GPU-hours allocated in the arrival window over the cluster's, percent.
fn alloc_pct(r: &SimResult) -> f64 {
    r.team_gpu_hours.values().sum::<f64>() / r.capacity_gpu_hours * 100.0
}

/// GPU-hours idle while work that fits them waited (quota aside), over
/// the cluster's GPU-hours in the arrival window, percent.
pub fn idle_waiting_pct(r: &SimResult) -> f64 {
    r.idle_waiting_gpu_hours / r.capacity_gpu_hours * 100.0
}

/// The GPUs idle beside one group's waiting jobs (a kind, a team), over
/// the cluster's GPU-hours in the arrival window, percent.
fn idle_waiting_pct_of(r: &SimResult, of: &dyn Fn(&Outcome) -> bool) -> f64 {
    r.outcomes
        .iter()
        .filter(|o| of(o))
        .map(|o| o.idle_waiting_gpu_hours)
        .fold(0.0, |a, b| a + b)
        / r.capacity_gpu_hours
        * 100.0
}

/// GPU-hours lost to preemption over the GPU-hours run, percent.
fn lost_pct(r: &SimResult) -> f64 {
    if r.run_gpu_hours > 0.0 {
        r.lost_gpu_hours / r.run_gpu_hours * 100.0
    } else {
        0.0
    }
}

/// CSV: one row per policy and group (kind, team, and `all` with the
/// cluster-wide figures).
pub fn csv(results: &[SimResult]) -> String {
    let mut out = String::from(
        "policy,group,name,jobs,wait_avg_h,wait_p50_h,wait_p95_h,wait_max_h,queued_p95_h,jct_avg_h,jct_p95_h,gpu_hours,share,target_share,makespan_h,lost_pct,alloc_pct,jain,idle_waiting_pct\n",
    );
    let row = |out: &mut String,
               r: &SimResult,
               group: &str,
               name: &str,
               of: &dyn Fn(&Outcome) -> bool| {
        let w = waits(r.outcomes.iter().filter(|o| of(o)));
        let (_, _, _, mj, pj) = group_stats(r.outcomes.iter().filter(|o| of(o)));
        let _ = write!(
            out,
            "{},{group},{name},{},{:.4},{:.4},{:.4},{:.4},{:.4},{mj:.4},{pj:.4}",
            r.policy, w.jobs, w.mean, w.p50, w.p95, w.max, w.queued_p95
        );
    };
    for r in results {
        for k in 0..KINDS.len() {
            row(&mut out, r, "kind", kind_name(k), &|o| o.kind == k);
            let _ = writeln!(
                out,
                ",,,,,,,,{:.4}",
                idle_waiting_pct_of(r, &|o| o.kind == k)
            );
        }
        for (team, share, target) in team_shares(r) {
            row(&mut out, r, "team", &team, &|o| o.team == team);
            let _ = writeln!(
                out,
                ",{:.2},{share:.4},{target:.4},,,,,{:.4}",
                r.team_gpu_hours[&team],
                idle_waiting_pct_of(r, &|o| o.team == team)
            );
        }
        row(&mut out, r, "all", "all", &|_| true);
        let _ = writeln!(
            out,
            ",{:.2},,,{:.2},{:.4},{:.2},{:.4},{:.4}",
            r.run_gpu_hours,
            makespan(r),
            lost_pct(r),
            alloc_pct(r),
            jain(r),
            idle_waiting_pct(r)
        );
    }
    out
}

/// CSV: one row per policy and job (its team, kind, GPUs, when it was
/// submitted, first started and finished, seconds; how often it was
/// preempted, the hours it waited again after that and the GPU-hours it
/// lost), to see which jobs make a tail.
pub fn jobs_csv(results: &[SimResult]) -> String {
    let mut out = String::from(
        "policy,job,team,kind,gpus,submit_s,first_start_s,finish_s,wait_h,preemptions,requeued_wait_h,lost_gpu_hours\n",
    );
    let opt = |t: Option<u64>| t.map(|t| t.to_string()).unwrap_or_default();
    for r in results {
        for o in &r.outcomes {
            let wait = o
                .first_start
                .map(|s| format!("{:.4}", (s - o.submit) as f64 / 3600.0))
                .unwrap_or_default();
            let _ = writeln!(
                out,
                "{},{},{},{},{},{},{},{},{wait},{},{:.4},{:.4}",
                r.policy,
                o.id,
                o.team,
                kind_name(o.kind),
                o.gpu_milli as f64 / 1000.0,
                o.submit,
                opt(o.first_start),
                opt(o.finish),
                o.preemptions,
                o.requeued_wait as f64 / 3600.0,
                o.lost_gpu_hours
            );
        }
    }
    out
}

/// A team's share of all submitted GPU-hours.
fn demand_share(r: &SimResult, team: &str) -> f64 {
    let total: f64 = r.team_demand_gpu_hours.values().sum();
    if total > 0.0 {
        r.team_demand_gpu_hours.get(team).copied().unwrap_or(0.0) / total
    } else {
        0.0
    }
}

const COLORS: &[&str] = &["#888888", "#1f77b4", "#111111", "#d62728"];

/// A grouped bar chart of p95 wait per kind, one bar per policy.
pub fn svg(results: &[SimResult]) -> String {
    let (w, h, left, top, bottom) = (720.0, 400.0, 60.0, 40.0, 60.0);
    let ph = h - top - bottom;
    let pw = w - left - 150.0;
    let values: Vec<Vec<f64>> = results
        .iter()
        .map(|r| {
            (0..KINDS.len())
                .map(|k| group_stats(r.outcomes.iter().filter(|o| o.kind == k)).2)
                .collect()
        })
        .collect();
    let max = values
        .iter()
        .flatten()
        .copied()
        .fold(0.0_f64, f64::max)
        .max(0.1);
    let y = |v: f64| top + ph - v / max * ph;
    let group = pw / KINDS.len() as f64;
    let bar = group * 0.8 / results.len().max(1) as f64;
    let mut out = crate::report::svg_open(w, h, left, "p95 wait by kind of job (hours)");
    for k in 0..=4 {
        let v = max * k as f64 / 4.0;
        let _ = writeln!(
            out,
            r##"<line x1="{left}" x2="{}" y1="{:.1}" y2="{:.1}" stroke="#ddd"/><text x="{}" y="{:.1}" text-anchor="end">{v:.1}</text>"##,
            left + pw,
            y(v),
            y(v),
            left - 6.0,
            y(v) + 4.0
        );
    }
    for (k, kind) in KINDS.iter().enumerate() {
        let gx = left + k as f64 * group + group * 0.1;
        for (p, r) in values.iter().enumerate() {
            let v = r[k];
            let _ = writeln!(
                out,
                r#"<rect x="{:.1}" y="{:.1}" width="{:.1}" height="{:.1}" fill="{}"/>"#,
                gx + p as f64 * bar,
                y(v),
                bar * 0.9,
                (top + ph - y(v)).max(0.0),
                COLORS[p % COLORS.len()]
            );
        }
        let _ = writeln!(
            out,
            r#"<text x="{:.1}" y="{}" text-anchor="middle">{kind}</text>"#,
            gx + group * 0.4,
            top + ph + 18.0
        );
    }
    for (p, r) in results.iter().enumerate() {
        let ly = top + 14.0 + p as f64 * 18.0;
        let _ = writeln!(
            out,
            r#"<rect x="{}" y="{}" width="14" height="10" fill="{}"/><text x="{}" y="{}">{}</text>"#,
            left + pw + 14.0,
            ly - 9.0,
            COLORS[p % COLORS.len()],
            left + pw + 34.0,
            ly,
            r.policy
        );
    }
    out.push_str("</svg>\n");
    out
}
