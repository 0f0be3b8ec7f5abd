//! Real job history as traces: Slurm accounting (`sacct`), SenseTime
//! Helios' `cluster_log.csv`, and the Alibaba openb pod lists replayed as
//! jobs that arrive and leave. Each job becomes a [`TraceJob`]: submitted
//! when it was, running as long as it ran, of the team that ran it, its
//! kind by a [`KindRule`]. What cannot be replayed (no GPU, never started,
//! still running, no duration) is counted by reason, never silently lost.
//!
//! Times are taken as written (a log's wall-clock times, without a zone:
//! only their differences matter) and the first submission becomes 0.

use std::collections::BTreeMap;
use std::path::{Path, PathBuf};

use gpuflow_core::{GpuMilli, GpuRequest, MemMib};

use crate::error::SimError;
use crate::workload::{ClusterSpec, KINDS, QueueSpec, TraceJob};

/// The formats `gpuflow sim run --trace-format` reads.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Format {
    /// gpuflow's own trace CSV (`workload::load_trace`).
    Csv,
    /// `sacct --parsable2 --allocations` with at least JobID, Submit,
    /// Start, End and AllocTRES (or ReqTRES); Account, User, Timelimit,
    /// State and NNodes where present.
    Sacct,
    /// Helios' `cluster_log.csv`: job_id, user, vc, gpu_num, node_num,
    /// state, submit_time, start_time, end_time, duration.
    Helios,
    /// An openb pod list: creation, scheduled and deletion times.
    Openb,
}

impl Format {
    pub const NAMES: &'static [&'static str] = &["csv", "sacct", "helios", "openb"];

    pub fn parse(s: &str) -> Option<Format> {
        Some(match s {
            "csv" => Format::Csv,
            "sacct" => Format::Sacct,
            "helios" => Format::Helios,
            "openb" => Format::Openb,
            _ => return None,
        })
    }
}

/// How an imported job's kind is chosen.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum KindRule {
    /// By size and length: one GPU (or part of one) for under an hour is a
    /// notebook, one GPU for longer is batch, two or more GPUs training.
    BySize,
    /// Every job of this kind (an index into [`KINDS`]).
    All(usize),
}

impl KindRule {
    /// `size`, or a kind's name.
    pub fn parse(s: &str) -> Option<KindRule> {
        if s == "size" {
            return Some(KindRule::BySize);
        }
        KINDS.iter().position(|k| *k == s).map(KindRule::All)
    }

    fn kind(self, gpu_milli: u64, duration: u64) -> usize {
        let named = |k: &str| KINDS.iter().position(|x| *x == k).unwrap_or(0);
        match self {
            KindRule::All(k) => k,
            KindRule::BySize if gpu_milli > 1000 => named("training"),
            KindRule::BySize if duration < 3600 => named("notebook"),
            KindRule::BySize => named("batch"),
        }
    }
}

/// Jobs read from a log, and how many rows were left out, by reason.
#[derive(Clone, Debug, Default)]
pub struct Imported {
    pub jobs: Vec<TraceJob>,
    pub skipped: BTreeMap<&'static str, usize>,
}

impl Imported {
    /// Keeps the jobs submitted in `[from, to)` seconds after the first
    /// submission, as the first of them were submitted at 0 (the study's
    /// 21-day windows of a long log); the others are counted as left out.
    pub fn window(&mut self, from: u64, to: u64) {
        let before = self.jobs.len();
        self.jobs.retain(|j| (from..to).contains(&j.submit));
        let outside = before - self.jobs.len();
        if outside > 0 {
            *self.skipped.entry("outside the window").or_default() += outside;
        }
        for (i, j) in self.jobs.iter_mut().enumerate() {
            j.id = i as u64;
            j.submit -= from;
        }
    }

    /// "12 without a GPU, 3 never started", or "none".
    pub fn skipped_text(&self) -> String {
        if self.skipped.is_empty() {
            return "none".into();
        }
        self.skipped
            .iter()
            .map(|(why, n)| format!("{n} {why}"))
            .collect::<Vec<_>>()
            .join(", ")
    }
}

/// Reads a log of `format` at `path`.
///
/// # Errors
/// When the file cannot be read, lacks a column the format needs, or a row
/// is malformed (the error names its line).
pub fn import(path: &Path, format: Format, kinds: KindRule) -> Result<Imported, SimError> {
    let text = std::fs::read_to_string(path).map_err(|e| SimError::Read {
        path: path.to_path_buf(),
        source: e,
    })?;
    let mut out = match format {
        Format::Csv => Imported {
            jobs: crate::workload::load_trace(path)?,
            skipped: BTreeMap::new(),
        },
        Format::Sacct => rows(path, &text, '|', kinds, &SACCT, sacct_row)?,
        Format::Helios => rows(path, &text, ',', kinds, &HELIOS, helios_row)?,
        Format::Openb => rows(path, &text, ',', kinds, &OPENB, openb_row)?,
    };
    if format != Format::Csv {
        // In submission order, ids from 0, the first submission at 0.
        out.jobs.sort_by_key(|j| (j.submit, j.id));
        let first = out.jobs.first().map_or(0, |j| j.submit);
        for (i, j) in out.jobs.iter_mut().enumerate() {
            j.id = i as u64;
            j.submit -= first;
        }
    }
    Ok(out)
}

/// What a row became: a job, or a reason to leave it out.
enum Row {
    Job(Job),
    Skip(&'static str),
}

/// A job as read, before its id and kind.
struct Job {
    submit: u64,
    duration: u64,
    /// GPUs in milli (1000 a whole GPU).
    gpu_milli: u64,
    nodes: u32,
    team: String,
    max_runtime: Option<u64>,
}

/// A format's columns: those it needs and those it reads when present.
struct Columns {
    need: &'static [&'static str],
    optional: &'static [&'static str],
}

const SACCT: Columns = Columns {
    need: &["JobID", "Submit", "Start", "End"],
    optional: &[
        "AllocTRES",
        "ReqTRES",
        "Account",
        "User",
        "Timelimit",
        "State",
        "NNodes",
    ],
};

const HELIOS: Columns = Columns {
    need: &[
        "job_id",
        "vc",
        "gpu_num",
        "submit_time",
        "start_time",
        "duration",
    ],
    optional: &["user", "node_num", "state", "end_time"],
};

const OPENB: Columns = Columns {
    need: &[
        "name",
        "num_gpu",
        "gpu_milli",
        "creation_time",
        "scheduled_time",
        "deletion_time",
    ],
    optional: &["qos", "pod_phase"],
};

/// One row's fields by column name.
struct Fields<'a> {
    names: &'a BTreeMap<&'a str, usize>,
    values: Vec<&'a str>,
}

impl Fields<'_> {
    fn get(&self, name: &str) -> &str {
        self.names
            .get(name)
            .and_then(|&i| self.values.get(i))
            .map_or("", |v| v.trim())
    }
}

fn rows(
    path: &Path,
    text: &str,
    sep: char,
    kinds: KindRule,
    columns: &Columns,
    row: fn(&Fields<'_>) -> Result<Row, String>,
) -> Result<Imported, SimError> {
    let bad = |line: usize, message: String| SimError::Parse {
        path: PathBuf::from(path),
        line: line as u64,
        message,
    };
    let mut lines = text
        .lines()
        .enumerate()
        .filter(|(_, l)| !l.trim().is_empty());
    let Some((h, header)) = lines.next() else {
        return Err(bad(1, "empty file: expected a header line".into()));
    };
    let names: BTreeMap<&str, usize> = header
        .split(sep)
        .enumerate()
        .map(|(i, n)| (n.trim(), i))
        .collect();
    if let Some(missing) = columns.need.iter().find(|c| !names.contains_key(*c)) {
        return Err(bad(
            h + 1,
            format!(
                "no column {missing:?} in the header; this format needs {} (and reads {} when present)",
                columns.need.join(", "),
                columns.optional.join(", ")
            ),
        ));
    }
    let width = names.len();
    let mut out = Imported::default();
    for (i, line) in lines {
        let values: Vec<&str> = line.split(sep).collect();
        if values.len() != width {
            return Err(bad(
                i + 1,
                format!("{} fields where the header has {width}", values.len()),
            ));
        }
        let f = Fields {
            names: &names,
            values,
        };
        match row(&f).map_err(|m| bad(i + 1, m))? {
            Row::Skip(why) => *out.skipped.entry(why).or_default() += 1,
            Row::Job(j) => {
                let (tasks, gpu) = shape(j.gpu_milli, j.nodes);
                out.jobs.push(TraceJob {
                    id: out.jobs.len() as u64,
                    submit: j.submit,
                    duration: j.duration,
                    tasks,
                    gpu,
                    team: j.team,
                    kind: kinds.kind(j.gpu_milli, j.duration),
                    priority: 0,
                    max_runtime: j.max_runtime,
                    model: None,
                });
            }
        }
    }
    Ok(out)
}

/// Tasks and each one's GPUs for `gpu_milli` over `nodes` nodes: a part of
/// one GPU is a fraction; whole GPUs are spread evenly over the nodes
/// (rounded up), at most 8 a task (the simulated nodes').
fn shape(gpu_milli: u64, nodes: u32) -> (u32, GpuRequest) {
    if gpu_milli < 1000 {
        return (
            1,
            GpuRequest::Fraction {
                milli: GpuMilli(gpu_milli as u32),
                mem: MemMib(0),
            },
        );
    }
    let gpus = gpu_milli.div_ceil(1000);
    let mut tasks = u64::from(nodes.max(1)).min(gpus);
    let mut each = gpus.div_ceil(tasks);
    if each > 8 {
        tasks = gpus.div_ceil(8);
        each = 8;
    }
    (tasks as u32, GpuRequest::Whole { count: each as u8 })
}

fn number<T: std::str::FromStr>(name: &str, v: &str) -> Result<T, String> {
    v.parse()
        .map_err(|_| format!("{name} {v:?}: expected a whole number"))
}

/// Seconds of a wall-clock time `YYYY-MM-DD[T ]HH:MM:SS` since 1970 (as
/// if in UTC); `None` for Slurm's `Unknown`, `None` and empty times.
fn wall_time(name: &str, v: &str) -> Result<Option<u64>, String> {
    if v.is_empty() || v == "Unknown" || v == "None" {
        return Ok(None);
    }
    let bad = || format!("{name} {v:?}: expected a time such as 2024-03-01T08:30:00");
    let (date, time) = v.split_once(['T', ' ']).ok_or_else(bad)?;
    let d: Vec<i64> = date
        .split('-')
        .map(|x| x.parse().map_err(|_| bad()))
        .collect::<Result<_, _>>()?;
    let t: Vec<i64> = time
        .split(':')
        .map(|x| x.parse().map_err(|_| bad()))
        .collect::<Result<_, _>>()?;
    let (&[y, m, dd], &[hh, mm, ss]) = (&d[..], &t[..]) else {
        return Err(bad());
    };
    if !(1970..=9999).contains(&y)
        || !(1..=12).contains(&m)
        || !(1..=31).contains(&dd)
        || !(0..24).contains(&hh)
        || !(0..60).contains(&mm)
        || !(0..61).contains(&ss)
    {
        return Err(bad());
    }
    // Days from 1970-01-01 (the civil calendar).
    let (y, m) = if m <= 2 { (y - 1, m + 9) } else { (y, m - 3) };
    let era = y.div_euclid(400);
    let yoe = y - era * 400;
    let doy = (153 * m + 2) / 5 + dd - 1;
    let doe = yoe * 365 + yoe / 4 - yoe / 100 + doy;
    let days = era * 146_097 + doe - 719_468;
    Ok(Some((days * 86_400 + hh * 3600 + mm * 60 + ss) as u64))
}

/// Slurm's `[DAYS-]HH:MM:SS`, `MM:SS` or minutes; `None` for unlimited.
fn slurm_duration(v: &str) -> Result<Option<u64>, String> {
    if v.is_empty() || matches!(v, "UNLIMITED" | "Partition_Limit" | "INVALID") {
        return Ok(None);
    }
    let bad = || format!("Timelimit {v:?}: expected [DAYS-]HH:MM:SS, MM:SS or minutes");
    let (days, rest) = match v.split_once('-') {
        Some((d, r)) => (d.parse::<u64>().map_err(|_| bad())?, r),
        None => (0, v),
    };
    let parts: Vec<u64> = rest
        .split(':')
        .map(|x| x.parse().map_err(|_| bad()))
        .collect::<Result<_, _>>()?;
    let s = match parts[..] {
        [m] if days == 0 => m * 60,
        [h] => h * 3600,
        [m, s] if days == 0 => m * 60 + s,
        [h, m] => h * 3600 + m * 60,
        [h, m, s] => h * 3600 + m * 60 + s,
        _ => return Err(bad()),
    };
    Ok(Some(days * 86_400 + s))
}

/// GPUs in a TRES list (`cpu=8,gres/gpu=2,node=1` or `gres/gpu:a100=2`).
fn tres_gpus(v: &str) -> Result<u64, String> {
    let mut n = 0;
    for item in v.split(',').map(str::trim) {
        let Some((k, count)) = item.split_once('=') else {
            continue;
        };
        // The plain count, or a typed one where no plain count is given.
        if k == "gres/gpu" {
            return number("gres/gpu", count);
        }
        if k.starts_with("gres/gpu:") {
            n += number::<u64>(k, count)?;
        }
    }
    Ok(n)
}

fn sacct_row(f: &Fields<'_>) -> Result<Row, String> {
    // Steps (`123.batch`, `123.0`) are not jobs; `--allocations` leaves
    // them out, a log without it has them.
    if f.get("JobID").contains('.') {
        return Ok(Row::Skip("job steps"));
    }
    let tres = match f.get("AllocTRES") {
        "" => f.get("ReqTRES"),
        t => t,
    };
    let gpus = tres_gpus(tres)?;
    if gpus == 0 {
        return Ok(Row::Skip("without a GPU"));
    }
    let Some(submit) = wall_time("Submit", f.get("Submit"))? else {
        return Err("Submit: a job needs its submission time".into());
    };
    let Some(start) = wall_time("Start", f.get("Start"))? else {
        return Ok(Row::Skip("never started"));
    };
    let Some(end) = wall_time("End", f.get("End"))? else {
        return Ok(Row::Skip("still running"));
    };
    if end <= start {
        return Ok(Row::Skip("without a run time"));
    }
    let nodes = match f.get("NNodes") {
        "" => 1,
        n => number("NNodes", n)?,
    };
    let team = [f.get("Account"), f.get("User")]
        .into_iter()
        .find(|t| !t.is_empty())
        .unwrap_or("default");
    Ok(Row::Job(Job {
        submit,
        duration: end - start,
        gpu_milli: gpus * 1000,
        nodes,
        team: team.to_string(),
        max_runtime: slurm_duration(f.get("Timelimit"))?,
    }))
}

fn helios_row(f: &Fields<'_>) -> Result<Row, String> {
    let gpus: u64 = number("gpu_num", f.get("gpu_num"))?;
    if gpus == 0 {
        return Ok(Row::Skip("without a GPU"));
    }
    let Some(submit) = wall_time("submit_time", f.get("submit_time"))? else {
        return Err("submit_time: a job needs its submission time".into());
    };
    if wall_time("start_time", f.get("start_time"))?.is_none() {
        return Ok(Row::Skip("never started"));
    }
    let duration: u64 = match f.get("duration") {
        "" => return Ok(Row::Skip("without a run time")),
        d => number("duration", d.split('.').next().unwrap_or(d))?,
    };
    if duration == 0 {
        return Ok(Row::Skip("without a run time"));
    }
    let nodes = match f.get("node_num") {
        "" => 1,
        n => number("node_num", n)?,
    };
    Ok(Row::Job(Job {
        submit,
        duration,
        gpu_milli: gpus * 1000,
        nodes,
        team: f.get("vc").to_string(),
        max_runtime: None,
    }))
}

fn openb_row(f: &Fields<'_>) -> Result<Row, String> {
    let gpus: u64 = number("num_gpu", f.get("num_gpu"))?;
    let milli: u64 = number("gpu_milli", f.get("gpu_milli"))?;
    if gpus == 0 || milli == 0 {
        return Ok(Row::Skip("without a GPU"));
    }
    if gpus > 1 && milli != 1000 {
        return Err(format!(
            "gpu_milli {milli} with num_gpu {gpus}: only a single GPU is shared"
        ));
    }
    if milli > 1000 {
        return Err(format!("gpu_milli {milli}: at most 1000 of a GPU"));
    }
    if f.get("pod_phase") == "Pending" {
        return Ok(Row::Skip("never started"));
    }
    let created: u64 = number("creation_time", f.get("creation_time"))?;
    let deleted: u64 = match f.get("deletion_time") {
        "" => return Ok(Row::Skip("still running")),
        d => number("deletion_time", d)?,
    };
    let scheduled: u64 = match f.get("scheduled_time") {
        "" => return Ok(Row::Skip("never started")),
        s => number("scheduled_time", s)?,
    };
    if deleted <= scheduled {
        return Ok(Row::Skip("without a run time"));
    }
    // No accounts in openb: its QoS classes stand in for teams.
    let team = match f.get("qos") {
        "" => "default",
        q => q,
    };
    Ok(Row::Job(Job {
        submit: created,
        duration: deleted - scheduled,
        gpu_milli: if gpus > 1 { gpus * 1000 } else { milli },
        nodes: 1,
        team: team.to_string(),
        max_runtime: None,
    }))
}

/// A cluster for a replayed log: `gpus` GPUs in 8-GPU nodes, a queue per
/// team with a guarantee in proportion to its GPU-hours in the log, each
/// borrowing up to half the cluster.
pub fn cluster(jobs: &[TraceJob], gpus: u64) -> ClusterSpec {
    let mut demand: BTreeMap<&str, f64> = BTreeMap::new();
    for j in jobs {
        *demand.entry(&j.team).or_default() += j.gpu_milli() as f64 * j.duration as f64;
    }
    let total: f64 = demand.values().sum::<f64>().max(1.0);
    let mut spec = crate::workload::h100_cluster(
        gpus,
        demand.iter().map(|(team, d)| {
            let share = d / total;
            (
                team.to_string(),
                share * 100.0,
                ((gpus as f64 * share).floor() as u64).max(1),
            )
        }),
    );
    for q in &mut spec.queues {
        set_borrow_limit(q, gpus / 2);
    }
    spec
}

fn set_borrow_limit(q: &mut QueueSpec, limit: u64) {
    q.borrow_limit = q.guaranteed.keys().map(|m| (m.clone(), limit)).collect();
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn wall_times_and_slurm_durations() {
        assert_eq!(wall_time("t", "1970-01-02T00:00:01"), Ok(Some(86_401)));
        assert_eq!(
            wall_time("t", "2024-03-01 00:00:00").unwrap(),
            Some(1_709_251_200)
        );
        assert_eq!(wall_time("t", "Unknown"), Ok(None));
        assert!(wall_time("t", "2024-13-01T00:00:00").is_err());
        assert!(wall_time("t", "yesterday").is_err());
        assert_eq!(slurm_duration("1-02:00:00"), Ok(Some(93_600)));
        assert_eq!(slurm_duration("30:00"), Ok(Some(1800)));
        assert_eq!(slurm_duration("90"), Ok(Some(5400)));
        assert_eq!(slurm_duration("2-12"), Ok(Some(216_000)));
        assert_eq!(slurm_duration("UNLIMITED"), Ok(None));
        assert!(slurm_duration("1:2:3:4").is_err());
        assert_eq!(
            tres_gpus("billing=8,cpu=8,gres/gpu=2,mem=64G,node=1"),
            Ok(2)
        );
        assert_eq!(tres_gpus("cpu=8,gres/gpu:a100=4,node=1"), Ok(4));
        assert_eq!(tres_gpus("cpu=8,mem=1G"), Ok(0));
        assert!(tres_gpus("gres/gpu=two").is_err());
    }

    #[test]
    fn shapes_spread_whole_gpus_over_nodes() {
        assert_eq!(
            shape(500, 1),
            (
                1,
                GpuRequest::Fraction {
                    milli: GpuMilli(500),
                    mem: MemMib(0)
                }
            )
        );
        assert_eq!(shape(1000, 1), (1, GpuRequest::Whole { count: 1 }));
        assert_eq!(shape(16_000, 2), (2, GpuRequest::Whole { count: 8 }));
        assert_eq!(shape(16_000, 1), (2, GpuRequest::Whole { count: 8 }));
        assert_eq!(shape(2000, 4), (2, GpuRequest::Whole { count: 1 }));
    }

    #[test]
    fn kinds_by_size_and_length() {
        let k = |m, d| KINDS[KindRule::BySize.kind(m, d)];
        assert_eq!(k(1000, 1800), "notebook");
        assert_eq!(k(500, 1800), "notebook");
        assert_eq!(k(1000, 7200), "batch");
        assert_eq!(k(2000, 60), "training");
        assert_eq!(KindRule::parse("batch"), Some(KindRule::All(3)));
        assert_eq!(KindRule::parse("huge"), None);
    }
}
