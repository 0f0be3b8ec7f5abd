//! `gpuflow sim …` and `gpuflow bench …`.

use std::path::PathBuf;
use std::time::Duration;
use std::time::Instant;

use anyhow::{Context, bail};
use clap::{Subcommand, ValueEnum};
use gpuflow_core::schedule::{Phase, Tally};
use gpuflow_core::{MixWeighting, Policy};
use gpuflow_sim::bench::{self, BenchConfig};
use gpuflow_sim::fragmentation::{self, Config};
use gpuflow_sim::{openb, report};
use indicatif::{ProgressBar, ProgressStyle};

use crate::client::Usage;

#[derive(Clone, Copy, ValueEnum)]
pub(crate) enum Output {
    Table,
    Json,
}

#[derive(Subcommand)]
pub(crate) enum SimCommand {
    /// The FGD paper's fragmentation experiment on the Alibaba openb trace.
    ///
    /// The trace is the public alibaba/clusterdata `cluster-trace-gpu-v2023`
    /// (csv/ folder). Writes a table to stdout and, per pod list, a CSV and an
    /// SVG chart to --out.
    Openb {
        /// Folder with openb_node_list_gpu_node.csv and the openb_pod_list_*.csv files.
        #[arg(long, default_value_os_t = openb::default_dir())]
        data: PathBuf,
        /// Pod lists, comma separated (`default`, `gpushare40`, … or `all`).
        #[arg(long, default_value = "default")]
        trace: String,
        /// Policies, comma separated, or `all`.
        #[arg(long, default_value = "all")]
        policy: String,
        /// Seeds as FIRST..LAST (inclusive) or a comma-separated list.
        #[arg(long, default_value = "42..51")]
        seeds: String,
        /// Total arriving GPU request as a multiple of GPU capacity.
        #[arg(long, default_value_t = 1.3)]
        inflation: f64,
        /// Where the CSV and SVG files go.
        #[arg(long, default_value = "sim-out")]
        out: PathBuf,
        /// Share of the pod list's tasks whose shapes form the fragmentation mix
        /// (most common shapes first), between 0 and 1. Default: each policy's
        /// own (all GPU tasks; 95 % of all tasks for `fgd`, as in the paper).
        #[arg(long)]
        mix_coverage: Option<f64>,
        /// Also print, per policy, the GPU request dropped before 100 % arrived, by request kind.
        #[arg(long)]
        show_drops: bool,
        /// How tasks count in the mix: `tasks` (popularity) or `gpus` (GPU demand).
        #[arg(long, value_enum, default_value = "tasks")]
        mix_weighting: Weighting,
        #[arg(long, value_enum, default_value = "table")]
        output: Output,
    },
    /// Discrete-event simulation of queues, fair share, preemption and
    /// backfill: FIFO vs Slurm-like vs gpuflow on a trace or a synthetic workload.
    Run(RunArgs),
    /// Capacity planning: the cluster's own recorded workload (from the
    /// server, admins) replayed against the cluster as it is and as it
    /// would be with nodes added or removed or guarantees changed; waits,
    /// utilisation, cost and each team's share side by side.
    Whatif(crate::whatif::WhatifArgs),
}

#[derive(Clone, Copy, ValueEnum)]
pub(crate) enum Weighting {
    Tasks,
    Gpus,
}

/// `gpuflow sim run` arguments.
#[derive(clap::Args)]
pub(crate) struct RunArgs {
    /// Cluster file (TOML: node groups and team queues); default: the synthetic study's.
    #[arg(long)]
    cluster: Option<PathBuf>,
    /// Job trace; default: a generated workload (--workload). Its format is
    /// --trace-format.
    #[arg(long, conflicts_with = "workload")]
    trace: Option<PathBuf>,
    /// The --trace's format: `csv` (gpuflow's own), `sacct` (Slurm's
    /// `sacct --parsable2 --allocations` with JobID, Submit, Start, End,
    /// AllocTRES or ReqTRES, and Account, User, Timelimit, State, NNodes
    /// where present; teams are accounts), `helios` (SenseTime Helios'
    /// cluster_log.csv; teams are virtual clusters) or `openb` (an Alibaba
    /// openb pod list replayed as arriving jobs; teams are QoS classes).
    /// Without --cluster, a log runs on --gpus GPUs with a queue per team,
    /// guaranteed in proportion to its GPU-hours, borrowing up to half.
    #[arg(long, default_value = "csv", requires = "trace")]
    trace_format: String,
    /// Kinds of an imported log's jobs: `size` (one GPU or less under an
    /// hour: notebook; one GPU longer: batch; more: training) or one kind
    /// for all (inference, notebook, training, batch).
    #[arg(long, default_value = "size", requires = "trace")]
    kinds: String,
    /// Replay only the jobs submitted in a window of the log, in days from
    /// its first submission: `30..51` (21 days from day 30); the first of
    /// them is submitted at 0.
    #[arg(long, requires = "trace")]
    trace_window: Option<String>,
    /// The generated workload: `synthetic` (four teams, our own study) or
    /// `realistic` (after published studies of production GPU clusters:
    /// one-GPU jobs, heavy-tailed durations, sweeps, daily and weekly
    /// cycles, Zipf-sized teams, early failures, rough time limits).
    #[arg(long, value_parser = ["synthetic", "realistic"])]
    workload: Option<String>,
    /// Seed of the generated workload and of tie-breaking.
    #[arg(long, default_value_t = 7)]
    seed: u64,
    /// Hours of arrivals in the generated workload (default: 72 synthetic,
    /// 168 realistic).
    #[arg(long)]
    hours: Option<u64>,
    /// Offered GPU load (share of capacity) of the generated workload
    /// (default 0.9), or the load a --trace is rescaled to (its arrival
    /// times stretched or compressed).
    #[arg(long)]
    load: Option<f64>,
    /// GPUs of the realistic workload's cluster, or of an imported log's
    /// (8-GPU nodes).
    #[arg(long, default_value_t = 512)]
    gpus: u64,
    /// Teams of the realistic workload.
    #[arg(long, default_value_t = 10)]
    teams: usize,
    /// Relative GPU demand of the synthetic teams, comma separated (default:
    /// their weights 1,1,2,1); e.g. 3,1,2,1 makes team-a over-submit.
    #[arg(long)]
    demand: Option<String>,
    /// Settings of a policy changed for an experiment, `POLICY.KEY=VALUE`,
    /// repeatable: e.g. `--tune gpuflow.tries_per_queue=100000 --tune
    /// slurm-like.max_reservations=100` (settings: tries_per_queue, tries_per_cycle,
    /// max_reservations, min_runtime, history_weight, preemption,
    /// notebooks_borrow, lease_horizon, reclaim_holds, predict_runtimes (true, false or exact: each job's real runtime), disruption_budget, disruption_max_jobs, disruption_window, protected_pass_budgets, budget_patience, underserved_pass_budgets, reclaims_restore_fairness, max_unsaved, batch_rank, preemptible_one_tier, victims_by_lost_work, usage_half_life, aging_step, aging_cap, quotas, class_tiers, backfill_per_node, placement: `slurm`, a placement policy or a weighted sum of scorers).
    #[arg(long)]
    tune: Vec<String>,
    /// Policies, comma separated: fifo, slurm-like, slurm-qos, gpuflow.
    #[arg(long, default_value = "fifo,slurm-like,slurm-qos,gpuflow")]
    policy: String,
    /// Where the CSV, SVG and (for synthetic runs) the trace go.
    #[arg(long, default_value = "sim-out")]
    out: PathBuf,
    /// Also write every start estimate, with the job's real start and its
    /// reasons then, to sim_estimates_log.csv (one row per estimate: a
    /// job's first cycle, then one an hour while it waits).
    #[arg(long)]
    estimates_log: bool,
}

#[derive(Subcommand)]
pub(crate) enum BenchCommand {
    /// Pods bound per second by gpuflow on Kubernetes, against the in-process
    /// fake API server (watch caches, cycles, binding subresource): nodes of
    /// 8 GPUs, pending pods of one GPU (one in five CPU-only), all fitting.
    K8sBind {
        #[arg(long, default_value_t = 1000)]
        nodes: usize,
        #[arg(long, default_value_t = 10000)]
        pods: usize,
        /// Pods per gang (1: single pods); a team's consecutive pods form a gang.
        #[arg(long, default_value_t = 1)]
        gang: usize,
        /// Give up after this many seconds.
        #[arg(long, default_value_t = 300)]
        limit_s: u64,
    },
    /// A burst: `jobs` jobs (1, 2, 4 and 8 GPUs, 60/20/10/10 %) queued on a
    /// held queue of an in-process server (SQLite) with `nodes` nodes of 8
    /// GPUs whose agents are emulated at the protocol level (each answers
    /// every heartbeat reply at once, its tasks running); the queue opens
    /// and cycles and heartbeats run back to back: the time until half and
    /// all of the GPUs are allocated, and running.
    Burst {
        #[arg(long, default_value_t = 2048)]
        nodes: usize,
        #[arg(long, default_value_t = 10000)]
        jobs: usize,
        /// Give up after this many seconds.
        #[arg(long, default_value_t = 300)]
        limit_s: u64,
    },
    /// The server's scheduling cycle (snapshot, core, commit to SQLite) on
    /// registered nodes with a backlog: a cold cycle, then cycles after a few
    /// new submissions.
    ServerCycle {
        #[arg(long, default_value_t = 500)]
        nodes: usize,
        #[arg(long, default_value_t = 5000)]
        pending: usize,
        #[arg(long, default_value_t = 5)]
        cycles: usize,
    },
    /// Job submissions per second and their latency through the HTTP API, on
    /// an in-process server with SQLite (default) or a throwaway PostgreSQL.
    Submit {
        #[arg(long, default_value_t = 2000)]
        jobs: usize,
        /// Concurrent clients.
        #[arg(long, default_value_t = 8)]
        clients: usize,
        /// `sqlite`, `postgres` (a throwaway server from the installed binaries, fsync off) or `postgres-fsync` (the same with fsync on).
        #[arg(long, default_value = "sqlite")]
        store: String,
        /// Also run the submissions again while this many clients poll
        /// `why` and list jobs, and print the ratio of the two rates.
        #[arg(long, default_value_t = 0)]
        readers: usize,
        /// Each reader waits this long between its requests (0: none, as
        /// fast as the server answers).
        #[arg(long, default_value_t = 0)]
        read_pause_ms: u64,
        /// Submit arrays of this many jobs instead of single jobs.
        #[arg(long, default_value_t = 1)]
        array: usize,
        /// Queue this many jobs first (untimed, no node takes them), so
        /// that every cycle meanwhile runs over at least this backlog.
        #[arg(long, default_value_t = 0)]
        backlog: usize,
    },
    /// What readers cost the server: its memory while 8 and 32 clients read
    /// reports over many stored jobs (as another team's viewer and as an
    /// admin), and submissions per second alone and with 16 readers of
    /// each kind (why/ls/metrics, reports, callers without a token).
    Readers {
        /// Finished jobs stored first.
        #[arg(long, default_value_t = 100_000)]
        jobs: usize,
        /// How long each memory measure reads.
        #[arg(long, default_value_t = 10)]
        seconds: u64,
        /// Submissions per run of the availability measure.
        #[arg(long, default_value_t = 2000)]
        submissions: usize,
    },
    /// Placement decisions per second on a synthetic cluster (one thread), with
    /// departures that hold the cluster near --target allocation.
    Placement {
        #[arg(long, default_value_t = 10_000)]
        nodes: u32,
        #[arg(long, default_value_t = 100_000)]
        tasks: u32,
        /// Share of jobs that are 4-task gangs asking for one rack.
        #[arg(long, default_value_t = 0.0)]
        gangs: f64,
        /// GPU allocation share the run is held near.
        #[arg(long, default_value_t = 0.85)]
        target: f64,
        #[arg(long, default_value_t = 1)]
        seed: u64,
        #[arg(long, default_value = "gpuflow")]
        policy: String,
    },
    /// Scheduling cycles on a large, busy cluster with a deep backlog: one cold
    /// cycle, then cycles after a few arrivals and departures.
    Cycle {
        #[arg(long, default_value_t = 10_000)]
        nodes: u32,
        #[arg(long, default_value_t = 40)]
        teams: u32,
        #[arg(long, default_value_t = 24)]
        projects: u32,
        #[arg(long, default_value_t = 100_000)]
        pending: u32,
        /// Arrivals and departures between incremental cycles.
        #[arg(long, default_value_t = 5)]
        churn: usize,
        #[arg(long, default_value_t = 5)]
        cycles: usize,
        /// Priority classes of the jobs, comma separated (inference, notebook, training, batch).
        #[arg(long, default_value = "inference,notebook,training,batch")]
        classes: String,
        /// Cycles run (without churn) before measuring, to reach a steady state.
        #[arg(long, default_value_t = 0)]
        warmup: usize,
        /// Change one of gpuflow's settings, as `sim run --tune gpuflow.KEY=VALUE`
        /// does; repeatable: e.g. `--tune max_reservations=4`.
        #[arg(long, value_name = "KEY=VALUE")]
        tune: Vec<String>,
        /// Give the queues decayed usage as on a cluster that has run for a
        /// while (each leaf 0.2 to 1.8 times a day of its guarantee), so that
        /// victim searches of the queues at or above their share are paced by
        /// disruption budgets and reclaim fairness; without it no queue has
        /// history and no search is.
        #[arg(long)]
        history: bool,
        /// After each measured cycle, how long each of the core's phases
        /// took (index, order, admit, explain; the rest is the benchmark's
        /// own bookkeeping) and what admission did (tries, placements,
        /// victim searches); and the median of each phase at the end.
        #[arg(long)]
        phases: bool,
        #[arg(long, default_value_t = 1)]
        seed: u64,
    },
}

/// A phase of the core's cycle as `bench cycle --phases` names it.
fn phase_name(p: Phase) -> &'static str {
    match p {
        Phase::Index => "index",
        Phase::Order => "order",
        Phase::Admit => "admit",
        Phase::Explain => "explain",
    }
}

fn parse_seeds(s: &str) -> anyhow::Result<Vec<u64>> {
    if let Some((a, b)) = s.split_once("..") {
        let a: u64 = a
            .trim()
            .parse()
            .context("--seeds: FIRST in FIRST..LAST must be a number")?;
        let b: u64 = b
            .trim()
            .parse()
            .context("--seeds: LAST in FIRST..LAST must be a number")?;
        if b < a {
            bail!("--seeds {s}: LAST must not be below FIRST");
        }
        return Ok((a..=b).collect());
    }
    s.split(',')
        .map(|x| {
            x.trim()
                .parse()
                .with_context(|| format!("--seeds: {x:?} is not a number"))
        })
        .collect()
}

fn parse_policies(s: &str) -> anyhow::Result<Vec<Policy>> {
    if s == "all" {
        return Ok(Policy::NAMES
            .iter()
            .filter_map(|n| Policy::named(n))
            .collect());
    }
    s.split(',')
        .map(|n| Policy::parse(n).context("--policy"))
        .collect()
}

fn progress(len: u64, what: &str) -> ProgressBar {
    let bar = ProgressBar::new(len);
    bar.set_style(
        ProgressStyle::with_template("{msg} [{bar:30}] {pos}/{len} runs, {elapsed}")
            .expect("valid template")
            .progress_chars("=> "),
    );
    bar.set_message(what.to_string());
    bar
}

pub(crate) fn run(cmd: SimCommand) -> anyhow::Result<()> {
    match cmd {
        SimCommand::Run(a) => run_dynamic(a),
        SimCommand::Whatif(a) => crate::whatif::run(a),
        SimCommand::Openb {
            data,
            trace,
            policy,
            seeds,
            inflation,
            out,
            mix_coverage,
            mix_weighting,
            show_drops,
            output,
        } => {
            if let Some(c) = mix_coverage
                && !(c > 0.0 && c <= 1.0)
            {
                bail!("--mix-coverage {c}: must be above 0 and at most 1");
            }
            if !(1.0..=3.0).contains(&inflation) {
                bail!("--inflation {inflation}: must be between 1.0 and 3.0");
            }
            let traces: Vec<String> = if trace == "all" {
                openb::POD_LISTS.iter().map(|s| s.to_string()).collect()
            } else {
                trace.split(',').map(|s| s.trim().to_string()).collect()
            };
            let cfg = Config {
                seeds: parse_seeds(&seeds)?,
                inflation,
                policies: parse_policies(&policy)?,
                mix_coverage,
                mix_weighting: match mix_weighting {
                    Weighting::Tasks => MixWeighting::Tasks,
                    Weighting::Gpus => MixWeighting::Gpus,
                },
            };
            std::fs::create_dir_all(&out)
                .with_context(|| format!("cannot create {}", out.display()))?;
            let mut json = Vec::new();
            for t in &traces {
                let (nodes, pods) = openb::load(&data, t).with_context(|| {
                    format!(
                        "loading the openb trace from {} (see README: where the trace comes from)",
                        data.display()
                    )
                })?;
                let bar = progress((cfg.seeds.len() * cfg.policies.len()) as u64, t);
                let start = Instant::now();
                let runs = fragmentation::run_all(&nodes, &pods, &cfg, &|| bar.inc(1))?;
                let secs = start.elapsed().as_secs_f64();
                bar.finish_and_clear();
                let summaries = fragmentation::summarize(&runs, &cfg);
                if show_drops {
                    for p in &cfg.policies {
                        let mut by: std::collections::BTreeMap<&str, u64> = Default::default();
                        let mine: Vec<_> = runs.iter().filter(|r| r.policy == p.name).collect();
                        for r in &mine {
                            for (k, v) in &r.dropped_by_kind {
                                *by.entry(k.as_str()).or_default() += v;
                            }
                        }
                        let cap: u64 = nodes.iter().map(|n| n.gpus.len() as u64 * 1000).sum();
                        let parts: Vec<String> = by
                            .iter()
                            .map(|(k, v)| {
                                format!(
                                    "{k}: {:.2}%",
                                    *v as f64 * 100.0 / cap as f64 / mine.len() as f64
                                )
                            })
                            .collect();
                        eprintln!("dropped before 100% ({}): {}", p.name, parts.join(", "));
                    }
                }
                let decisions: u64 = runs.iter().map(|r| r.pods).sum();
                eprintln!(
                    "{t}: {} runs, {decisions} placement decisions in {secs:.2}s ({:.2}s per run, {:.1} µs per decision, on {} threads)",
                    runs.len(),
                    secs / runs.len() as f64 * rayon_threads() as f64,
                    secs * 1e6 * rayon_threads() as f64 / decisions as f64,
                    rayon_threads()
                );
                let name = format!("openb_{t}");
                report::write(
                    &out.join(format!("{name}.csv")),
                    &report::csv(t, &summaries),
                )?;
                report::write(
                    &out.join(format!("{name}.svg")),
                    &report::svg(t, &summaries),
                )?;
                match output {
                    Output::Table => println!("{}", report::table(t, &summaries)),
                    Output::Json => {
                        for s in &summaries {
                            json.push(format!(
                                "{{\"trace\":\"{t}\",\"policy\":\"{}\",\"seeds\":{},\"unallocated_gpu_pct\":[{}]}}",
                                s.policy,
                                s.seeds,
                                s.unallocated.iter().map(|u| format!("{u:.4}")).collect::<Vec<_>>().join(",")
                            ));
                        }
                    }
                }
            }
            if let Output::Json = output {
                println!("[{}]", json.join(",\n"));
            }
            eprintln!("wrote CSV and SVG files to {}", out.display());
            Ok(())
        }
    }
}

fn run_dynamic(a: RunArgs) -> anyhow::Result<()> {
    use gpuflow_sim::dynamic::{self, SimConfig, SimPolicy};
    use gpuflow_sim::dynreport;
    use gpuflow_sim::realistic::{self, Realistic};
    use gpuflow_sim::workload::{self, ClusterSpec, Synthetic};
    let load = a.load.unwrap_or(0.9);
    if !(0.05..=2.0).contains(&load) || a.hours == Some(0) {
        bail!("--load must be between 0.05 and 2 and --hours above 0");
    }
    let realistic_run = a.workload.as_deref() == Some("realistic");
    if realistic_run && (a.demand.is_some()) {
        bail!("--demand shapes the synthetic workload; the realistic one sizes its teams itself");
    }
    if !(8..=100_000).contains(&a.gpus) || !(1..=100).contains(&a.teams) {
        bail!("--gpus must be 8 to 100000 and --teams 1 to 100");
    }
    let realistic = Realistic {
        gpus: a.gpus,
        load,
        hours: a.hours.unwrap_or(168),
        seed: a.seed,
        teams: a.teams,
    };
    let mut synthetic = Synthetic {
        hours: a.hours.unwrap_or(72),
        load,
        ..Synthetic::four_teams(a.seed)
    };
    if let Some(d) = &a.demand {
        let v: Vec<f64> = d
            .split(',')
            .map(|x| {
                x.trim()
                    .parse::<f64>()
                    .ok()
                    .filter(|v| v.is_finite() && *v >= 0.0)
            })
            .collect::<Option<_>>()
            .with_context(|| format!("--demand {d:?}: give one non-negative number per team"))?;
        if v.len() != synthetic.teams.len() || v.iter().sum::<f64>() <= 0.0 {
            bail!(
                "--demand {d:?}: give {} numbers, not all zero",
                synthetic.teams.len()
            );
        }
        synthetic.demand = v;
    }
    let format = gpuflow_sim::import::Format::parse(&a.trace_format).ok_or_else(|| {
        Usage(format!(
            "--trace-format {:?}: expected one of {}",
            a.trace_format,
            gpuflow_sim::import::Format::NAMES.join(", ")
        ))
    })?;
    let kinds = gpuflow_sim::import::KindRule::parse(&a.kinds).ok_or_else(|| {
        Usage(format!(
            "--kinds {:?}: expected size or one of {}",
            a.kinds,
            workload::KINDS.join(", ")
        ))
    })?;
    let imported = match &a.trace {
        Some(p) => {
            let mut got = gpuflow_sim::import::import(p, format, kinds)?;
            if let Some(w) = &a.trace_window {
                let days = |s: &str| {
                    s.trim()
                        .parse::<f64>()
                        .ok()
                        .filter(|d| d.is_finite() && *d >= 0.0)
                };
                let (from, to) = w
                    .split_once("..")
                    .and_then(|(a, b)| Some((days(a)?, days(b)?)))
                    .filter(|(a, b)| a < b)
                    .ok_or_else(|| {
                        Usage(format!(
                            "--trace-window {w:?}: write FROM..TO in days from the log's first submission, FROM before TO (e.g. 30..51)"
                        ))
                    })?;
                got.window((from * 86_400.0) as u64, (to * 86_400.0) as u64);
            }
            if format != gpuflow_sim::import::Format::Csv {
                eprintln!(
                    "{}: {} jobs read; left out: {}",
                    p.display(),
                    got.jobs.len(),
                    got.skipped_text()
                );
            }
            if got.jobs.is_empty() {
                bail!("{}: no job to replay", p.display());
            }
            Some(got.jobs)
        }
        None => None,
    };
    let spec = match (&a.cluster, &imported) {
        (Some(p), _) => ClusterSpec::load(p)?,
        (None, Some(jobs)) if format != gpuflow_sim::import::Format::Csv => {
            gpuflow_sim::import::cluster(jobs, a.gpus)
        }
        (None, _) if realistic_run => realistic.cluster(),
        (None, _) => synthetic.cluster(),
    };
    let jobs = match imported {
        Some(mut jobs) => {
            if let Some(l) = a.load {
                let gpus: u64 = spec
                    .nodes
                    .iter()
                    .map(|g| g.count as u64 * g.gpus as u64)
                    .sum();
                let was = realistic::offered_load(&jobs, gpus);
                realistic::rescale(&mut jobs, gpus, l);
                eprintln!(
                    "offered load {was:.2} rescaled to {l:.2} (arrival times × {:.3})",
                    was / l
                );
            }
            jobs
        }
        None if realistic_run => realistic.jobs(),
        None => synthetic.jobs(),
    };
    let mut policies: Vec<SimPolicy> = a
        .policy
        .split(',')
        .map(|n| {
            SimPolicy::named(n.trim()).with_context(|| {
                format!(
                    "--policy: unknown policy {n:?}; expected one of {}",
                    SimPolicy::NAMES.join(", ")
                )
            })
        })
        .collect::<anyhow::Result<_>>()?;
    for t in &a.tune {
        let Some((policy, key, value)) = t
            .split_once('.')
            .and_then(|(p, kv)| kv.split_once('=').map(|(k, v)| (p, k, v)))
        else {
            return Err(Usage(format!("--tune {t:?}: write POLICY.KEY=VALUE")).into());
        };
        let Some(p) = policies.iter_mut().find(|p| p.name == policy) else {
            return Err(Usage(format!(
                "--tune {t:?}: policy {policy:?} is not in --policy"
            ))
            .into());
        };
        p.tune(key, value)
            .map_err(|e| Usage(format!("--tune {t:?}: {e}")))?;
        eprintln!("{policy}: {key} = {value}");
    }
    std::fs::create_dir_all(&a.out)
        .with_context(|| format!("cannot create {}", a.out.display()))?;
    if a.trace.is_none() {
        report::write(
            &a.out.join(if realistic_run {
                "realistic_trace.csv"
            } else {
                "synthetic_trace.csv"
            }),
            &workload::trace_csv(&jobs),
        )?;
    }
    let gpus: u64 = spec
        .nodes
        .iter()
        .map(|g| g.count as u64 * g.gpus as u64)
        .sum();
    eprintln!(
        "{} jobs, {} teams, {gpus} GPUs",
        jobs.len(),
        spec.queues.len()
    );
    let bar = progress(policies.len() as u64, "sim run");
    let start = Instant::now();
    let results: Vec<_> = std::thread::scope(|s| {
        let handles: Vec<_> = policies
            .iter()
            .map(|p| {
                let (spec, jobs, bar) = (&spec, &jobs, &bar);
                s.spawn(move || {
                    let cfg = SimConfig {
                        log_estimates: a.estimates_log,
                        ..SimConfig::default()
                    };
                    let r = dynamic::simulate(spec, jobs, p, &cfg, a.seed);
                    bar.inc(1);
                    r
                })
            })
            .collect();
        handles
            .into_iter()
            .map(|h| h.join().expect("simulation thread"))
            .collect::<Result<Vec<_>, _>>()
    })?;
    bar.finish_and_clear();
    eprintln!("simulated in {:.1}s", start.elapsed().as_secs_f64());
    println!("{}", dynreport::table(&results));
    report::write(&a.out.join("sim_run.csv"), &dynreport::csv(&results))?;
    report::write(&a.out.join("sim_jobs.csv"), &dynreport::jobs_csv(&results))?;
    report::write(
        &a.out.join("sim_estimates.csv"),
        &dynreport::estimates_csv(&results),
    )?;
    report::write(
        &a.out.join("sim_run_p95_wait.svg"),
        &dynreport::svg(&results),
    )?;
    if a.estimates_log {
        report::write(
            &a.out.join("sim_estimates_log.csv"),
            &dynreport::estimates_log_csv(&results),
        )?;
    }
    eprintln!(
        "wrote sim_run.csv, sim_jobs.csv, sim_estimates.csv{} and sim_run_p95_wait.svg to {}",
        if a.estimates_log {
            ", sim_estimates_log.csv"
        } else {
            ""
        },
        a.out.display()
    );
    Ok(())
}

fn rayon_threads() -> usize {
    std::thread::available_parallelism()
        .map(|n| n.get())
        .unwrap_or(1)
}

pub(crate) fn bench(cmd: BenchCommand) -> anyhow::Result<()> {
    match cmd {
        BenchCommand::Readers {
            jobs,
            seconds,
            submissions,
        } => crate::bench_api::readers(jobs, seconds, submissions),
        BenchCommand::Submit {
            jobs,
            clients,
            store,
            readers,
            read_pause_ms,
            array,
            backlog,
        } => crate::bench_api::submit(
            jobs,
            clients,
            &store,
            readers,
            Duration::from_millis(read_pause_ms),
            array,
            backlog,
        ),
        BenchCommand::Burst {
            nodes,
            jobs,
            limit_s,
        } => crate::bench_api::burst(nodes, jobs, limit_s),
        BenchCommand::ServerCycle {
            nodes,
            pending,
            cycles,
        } => crate::bench_api::server_cycle(nodes, pending, cycles),
        BenchCommand::K8sBind {
            nodes,
            pods,
            gang,
            limit_s,
        } => k8s_bind(nodes, pods, gang, limit_s),
        BenchCommand::Cycle {
            nodes,
            teams,
            projects,
            pending,
            churn,
            cycles,
            warmup,
            classes,
            tune,
            history,
            phases,
            seed,
        } => {
            if nodes == 0 || teams == 0 || projects == 0 {
                bail!("--nodes, --teams and --projects must be above 0");
            }
            let names = ["inference", "notebook", "training", "batch"];
            let classes: Vec<usize> = classes
                .split(',')
                .map(|c| {
                    names.iter().position(|n| *n == c.trim()).with_context(|| {
                        format!(
                            "--classes: unknown class {c:?}; expected {}",
                            names.join(", ")
                        )
                    })
                })
                .collect::<anyhow::Result<_>>()?;
            let b = bench::CycleBench {
                classes,
                nodes,
                teams,
                projects_per_team: projects,
                pending,
                seed,
                ..Default::default()
            };
            let mut policy = gpuflow_sim::dynamic::SimPolicy::gpuflow();
            for t in &tune {
                let (key, value) = t
                    .split_once('=')
                    .ok_or_else(|| Usage(format!("--tune {t:?}: write KEY=VALUE")))?;
                policy
                    .tune(key, value)
                    .map_err(|e| Usage(format!("--tune {t:?}: {e}")))?;
            }
            let start = Instant::now();
            let mut world = bench::CycleWorld::build(&b)?;
            world.config = policy.config;
            if history {
                world.seed_history();
            }
            println!(
                "cycle benchmark: {nodes} nodes, {} queues, {} running, {} pending (setup {:.1}s)",
                world.queues.list().len(),
                world.running.len(),
                world.pending.len(),
                start.elapsed().as_secs_f64()
            );
            let t = Instant::now();
            let f = world.cycle();
            println!(
                "  cold cycle: {:.1} ms, admitted {}, preempted {}",
                t.elapsed().as_secs_f64() * 1e3,
                f.admitted,
                f.preempted
            );
            for k in 0..warmup {
                let t = Instant::now();
                let f = world.cycle();
                world.churn(0, 1 + teams, teams * projects);
                eprintln!(
                    "  warm-up {}: {:.1} ms, admitted {}, preempted {}",
                    k + 1,
                    t.elapsed().as_secs_f64() * 1e3,
                    f.admitted,
                    f.preempted
                );
            }
            let mut times = Vec::new();
            // Per phase, each measured cycle's milliseconds.
            let mut by_phase: Vec<Vec<f64>> = vec![Vec::new(); Phase::ALL.len()];
            for _ in 0..cycles {
                world.churn(churn, 1 + teams, teams * projects);
                let mut ends = Vec::with_capacity(Phase::ALL.len());
                let mut tally = Tally::default();
                let t = Instant::now();
                let f = world.cycle_observed(|_, seen| {
                    ends.push(t.elapsed().as_secs_f64() * 1e3);
                    tally = *seen;
                });
                let ms = t.elapsed().as_secs_f64() * 1e3;
                times.push(ms);
                println!(
                    "  cycle after {churn} arrivals + {churn} departures: {ms:.1} ms, admitted {}, preempted {}, pending {}",
                    f.admitted, f.preempted, f.pending
                );
                if phases {
                    let took: Vec<f64> = ends
                        .iter()
                        .scan(0.0, |at, &end| Some(end - std::mem::replace(at, end)))
                        .collect();
                    let named: Vec<String> = Phase::ALL
                        .iter()
                        .zip(&took)
                        .map(|(p, ms)| format!("{} {ms:.1}", phase_name(*p)))
                        .collect();
                    println!(
                        "    phases (ms): {}, rest {:.1}; tries {}, placements {}, victim searches {}",
                        named.join(", "),
                        ms - ends.last().copied().unwrap_or(0.0),
                        tally.tries,
                        tally.placements,
                        tally.victim_searches
                    );
                    for (list, ms) in by_phase.iter_mut().zip(took) {
                        list.push(ms);
                    }
                }
            }
            times.sort_by(f64::total_cmp);
            if let Some(m) = times.get(times.len() / 2) {
                println!("  median incremental cycle {m:.1} ms");
            }
            if phases && cycles > 0 {
                let medians: Vec<String> = Phase::ALL
                    .iter()
                    .zip(&mut by_phase)
                    .map(|(p, list)| {
                        list.sort_by(f64::total_cmp);
                        format!("{} {:.1}", phase_name(*p), list[list.len() / 2])
                    })
                    .collect();
                println!("  median by phase (ms): {}", medians.join(", "));
            }
            if let Some(m) = bench::peak_rss_mib() {
                println!("  peak memory (VmHWM) {m:.0} MiB");
            }
            Ok(())
        }
        BenchCommand::Placement {
            nodes,
            tasks,
            gangs,
            target,
            seed,
            policy,
        } => {
            if nodes == 0 || tasks == 0 {
                bail!("--nodes and --tasks must be above 0");
            }
            if !(0.0..=1.0).contains(&gangs) || !(0.0..=1.0).contains(&target) {
                bail!("--gangs and --target are shares between 0 and 1");
            }
            let policy = Policy::parse(&policy).context("--policy")?;
            let cfg = BenchConfig {
                nodes,
                tasks,
                gang_share: gangs,
                target_allocation: target,
                seed,
                ..BenchConfig::default()
            };
            let start = Instant::now();
            let cluster = bench::cluster(&cfg);
            let jobs = bench::jobs(&cfg);
            let setup = start.elapsed().as_secs_f64();
            let start = Instant::now();
            let out = bench::run(cluster, &jobs, policy.clone(), &cfg)?;
            let secs = start.elapsed().as_secs_f64();
            println!(
                "placement benchmark: {nodes} nodes x {} GPUs, racks of {}, policy {}",
                cfg.gpus_per_node, cfg.rack_size, policy.name
            );
            println!(
                "  jobs {} (tasks {}), placed {}, released {}, mean GPU allocation {:.1}%",
                out.jobs,
                out.tasks,
                out.placed_jobs,
                out.released_jobs,
                out.mean_allocation * 100.0
            );
            println!("  setup {setup:.2}s, placement {secs:.2}s");
            println!(
                "  {:.0} task decisions/s, {:.2} µs per task decision",
                out.tasks as f64 / secs,
                secs * 1e6 / out.tasks as f64
            );
            match bench::peak_rss_mib() {
                Some(m) => println!("  peak memory (VmHWM) {m:.0} MiB"),
                None => println!("  peak memory: not available on this system"),
            }
            Ok(())
        }
    }
}

/// What the benchmarks that bring their own test doubles say in a build
/// without them.
#[cfg(not(feature = "bench"))]
pub(crate) const WITHOUT_BENCH: &str = "this gpuflow was built without the benchmarks' test doubles (a throwaway PostgreSQL, a fake Kubernetes API server): build it with `cargo build --release --bin gpuflow --features bench`";

/// Pods bound per second against the in-process fake Kubernetes API server.
#[cfg(feature = "bench")]
fn k8s_bind(nodes: usize, pods: usize, gang: usize, limit_s: u64) -> anyhow::Result<()> {
    let rt = tokio::runtime::Runtime::new()?;
    let r = rt.block_on(gpuflow_k8s::bench::bind_throughput(
        nodes,
        pods,
        gang.max(1),
        std::time::Duration::from_secs(limit_s),
    ))?;
    println!(
        "nodes {}  pods {}  gang {}  bound {}  cycles {}  seconds {:.2}  pods/s {:.0}  longest cycle {:.2} s",
        r.nodes,
        r.pods,
        r.gang,
        r.bound,
        r.cycles,
        r.seconds,
        r.per_second(),
        r.longest_cycle_s
    );
    Ok(())
}

#[cfg(not(feature = "bench"))]
fn k8s_bind(_: usize, _: usize, _: usize, _: u64) -> anyhow::Result<()> {
    bail!(WITHOUT_BENCH)
}
