//! Reports of the fragmentation experiment: a text table, a CSV and an SVG chart.

use std::fmt::Write as _;
use std::path::Path;

use crate::error::SimError;
use crate::fragmentation::Summary;

/// The arrived-load points a report shows: every 10 % up to the end.
fn points(summaries: &[Summary]) -> Vec<usize> {
    let last = summaries
        .iter()
        .map(|s| s.unallocated.len())
        .min()
        .unwrap_or(1)
        .saturating_sub(1);
    (10..=last).step_by(10).collect()
}

/// A fixed-width table: one row per policy, unallocated GPU % at each 10 % of arrived load.
pub fn table(trace: &str, summaries: &[Summary]) -> String {
    let pts = points(summaries);
    let mut out = format!(
        "unallocated GPU % by arrived workload (% of GPU capacity), {trace}, mean over seeds\n"
    );
    let width = summaries
        .iter()
        .map(|s| s.policy.len())
        .max()
        .unwrap_or(6)
        .max(6)
        + 2;
    let _ = write!(out, "{:<width$}", "policy");
    for p in &pts {
        let _ = write!(out, "{:>7}", format!("{p}%"));
    }
    out.push('\n');
    for s in summaries {
        let _ = write!(out, "{:<width$}", s.policy);
        for &p in &pts {
            let _ = write!(out, "{:>7.2}", s.unallocated[p]);
        }
        out.push('\n');
    }
    out
}

/// CSV: `trace,policy,seeds,arrived_pct,unallocated_gpu_pct`, one row per percent.
pub fn csv(trace: &str, summaries: &[Summary]) -> String {
    let mut out = String::from("trace,policy,seeds,arrived_pct,unallocated_gpu_pct\n");
    for s in summaries {
        for (p, u) in s.unallocated.iter().enumerate() {
            let _ = writeln!(out, "{trace},{},{},{p},{u:.4}", s.policy, s.seeds);
        }
    }
    out
}

const COLORS: &[&str] = &[
    "#888888", "#1f77b4", "#9467bd", "#ff7f0e", "#2ca02c", "#d62728", "#111111", "#8c564b",
];

/// A line chart of unallocated GPU % against arrived workload, one line per policy.
pub fn svg(trace: &str, summaries: &[Summary]) -> String {
    let (w, h, left, right, top, bottom) = (740.0, 440.0, 60.0, 170.0, 40.0, 50.0);
    let pw = w - left - right;
    let ph = h - top - bottom;
    let max_x = summaries
        .iter()
        .map(|s| s.unallocated.len())
        .min()
        .unwrap_or(1)
        .saturating_sub(1)
        .max(1) as f64;
    // Show the interesting range: from 80 % arrived, where fragmentation starts to show.
    let min_x = 80.0_f64.min(max_x - 1.0);
    let max_y = summaries
        .iter()
        .flat_map(|s| s.unallocated.iter().skip(min_x as usize).copied())
        .fold(0.0_f64, f64::max)
        .max(1.0)
        .ceil();
    let x = |v: f64| left + (v - min_x) / (max_x - min_x) * pw;
    let y = |v: f64| top + ph - v / max_y * ph;
    let mut out = svg_open(
        w,
        h,
        left,
        &format!("Unallocated GPU % vs arrived workload — {trace}"),
    );
    // Axes, grid and ticks.
    let _ = writeln!(out, r##"<g stroke="#ccc">"##);
    let step_y = if max_y > 20.0 {
        5.0
    } else if max_y > 8.0 {
        2.0
    } else {
        1.0
    };
    let mut v = 0.0;
    while v <= max_y {
        let _ = writeln!(
            out,
            r#"<line x1="{left}" x2="{}" y1="{:.1}" y2="{:.1}"/>"#,
            left + pw,
            y(v),
            y(v)
        );
        v += step_y;
    }
    let _ = writeln!(out, "</g>");
    let mut v = 0.0;
    while v <= max_y {
        let _ = writeln!(
            out,
            r#"<text x="{}" y="{:.1}" text-anchor="end">{v}</text>"#,
            left - 6.0,
            y(v) + 4.0
        );
        v += step_y;
    }
    let mut t = (min_x / 10.0).ceil() * 10.0;
    while t <= max_x {
        let _ = writeln!(
            out,
            r#"<text x="{:.1}" y="{}" text-anchor="middle">{t}%</text>"#,
            x(t),
            top + ph + 18.0
        );
        t += 10.0;
    }
    let _ = writeln!(
        out,
        r#"<text x="{:.1}" y="{}" text-anchor="middle">arrived workload (% of GPU capacity)</text>"#,
        left + pw / 2.0,
        h - 10.0
    );
    let _ = writeln!(
        out,
        r#"<text transform="translate(16 {:.1}) rotate(-90)" text-anchor="middle">unallocated GPU %</text>"#,
        top + ph / 2.0
    );
    let _ = writeln!(
        out,
        r#"<rect x="{left}" y="{top}" width="{pw}" height="{ph}" fill="none" stroke="black"/>"#
    );
    for (i, s) in summaries.iter().enumerate() {
        let color = COLORS[i % COLORS.len()];
        let pts: Vec<String> = s
            .unallocated
            .iter()
            .enumerate()
            .skip(min_x as usize)
            .map(|(p, u)| format!("{:.1},{:.1}", x(p as f64), y(u.min(max_y))))
            .collect();
        let _ = writeln!(
            out,
            r#"<polyline fill="none" stroke="{color}" stroke-width="2" points="{}"/>"#,
            pts.join(" ")
        );
        let ly = top + 14.0 + i as f64 * 18.0;
        let _ = writeln!(
            out,
            r#"<line x1="{}" x2="{}" y1="{ly}" y2="{ly}" stroke="{color}" stroke-width="3"/>"#,
            left + pw + 12.0,
            left + pw + 32.0
        );
        let at100 = s.unallocated.get(100).copied().unwrap_or(f64::NAN);
        let _ = writeln!(
            out,
            r#"<text x="{}" y="{}">{} ({at100:.2})</text>"#,
            left + pw + 38.0,
            ly + 4.0,
            escape(&s.policy)
        );
    }
    out.push_str("</svg>\n");
    out
}

/// The start of an SVG chart: the root element, a white background and a title.
pub(crate) fn svg_open(w: f64, h: f64, left: f64, title: &str) -> String {
    let mut out = String::new();
    let _ = writeln!(
        out,
        r#"<svg xmlns="http://www.w3.org/2000/svg" width="{w}" height="{h}" font-family="sans-serif" font-size="12">"#
    );
    let _ = writeln!(out, r#"<rect width="100%" height="100%" fill="white"/>"#);
    let _ = writeln!(
        out,
        r#"<text x="{left}" y="22" font-size="14">{}</text>"#,
        escape(title)
    );
    out
}

pub(crate) fn escape(s: &str) -> String {
    s.replace('&', "&amp;")
        .replace('<', "&lt;")
        .replace('>', "&gt;")
}

/// Writes a report file.
///
/// # Errors
/// When the file cannot be written.
pub fn write(path: &Path, text: &str) -> Result<(), SimError> {
    std::fs::write(path, text).map_err(|e| SimError::Write {
        path: path.to_path_buf(),
        source: e,
    })
}
