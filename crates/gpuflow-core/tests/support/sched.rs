//! Scheduling-cycle fixtures: nodes, queues, running and pending jobs as text,
//! one or more cycles, the plans rendered as text.
//!
//! ```text
//! node n1 gpus=8*H100                       # as in placement fixtures
//! queue org H100=8                          # guaranteed GPUs per flavor
//! queue team-a parent=org H100=4,borrow=2,lend=2,cap=6 weight=2 state=held
//!       users=gpus:2,running:1 budget=100,used=100,taper=0.5,min=0.25,stop-admitting
//! config ordering=fifo|priority|fair|multifactor preemption=off backfill=off quotas=off min_runtime=0 reservations=N
//!        budget=2|none window=3600 protected_pass=on|off patience=0 underserved_pass=1.0
//!        restore_fairness=on|off aging=3600 history=0.5 tries=8 max_unsaved=3600|none
//!        tries_per_cycle=3000     (tries=N alone means exactly N a queue)
//!        consolidate=1800|none consolidation_interval=60 max_preemptions=256
//!        lease=14400|none holds=on|off
//! usage team-a 100                         # decayed GPU-hours the queue used before
//! run 7 queue=team-b class=batch started=0 checkpoint=100 runtime=3600 grace=30 gpu=whole:4 cpu=1
//! job 1 queue=team-a user=alice class=training prio=0 submit=0 runtime=3600 gpu=whole:4 cpu=1
//! cycle 1000                                # one cycle at t=1000 s
//! why 1 1000                                # diagnose job 1 at t=1000 s
//! ```
//! After a cycle, admitted jobs run, preempted ones stop at once (as if their
//! grace were over by the next cycle), and everyone keeps the order.

use std::collections::BTreeMap;
use std::fmt::Write as _;

use gpuflow_core::queue::*;
use gpuflow_core::schedule::*;
use gpuflow_core::*;

use super::{kv, token_lines};

fn milli(v: &str) -> u64 {
    (v.parse::<f64>().unwrap() * 1000.0) as u64
}

fn parse_queue(toks: &[&str], known: &[Queue]) -> Queue {
    let name = toks[0];
    let mut q = Queue::new(name, None);
    for t in &toks[1..] {
        let (k, v) = kv(t);
        match k {
            "parent" => {
                q.parent = Some(QueueId(
                    known
                        .iter()
                        .position(|x| x.name == v)
                        .expect("parent queue first") as u32,
                ))
            }
            "weight" => q.weight = v.parse().unwrap(),
            "state" => {
                q.state = match v {
                    "held" => QueueState::Held,
                    "draining" => QueueState::Draining,
                    _ => QueueState::Open,
                }
            }
            "users" => {
                for part in v.split(',') {
                    let (a, b) = part.split_once(':').unwrap();
                    match a {
                        "gpus" => q.user_limits.max_gpu_milli = Some(milli(b)),
                        "running" => q.user_limits.max_running = Some(b.parse().unwrap()),
                        _ => panic!("unknown user limit {a}"),
                    }
                }
            }
            "budget" => {
                let mut b = Budget {
                    gpu_hours: 0.0,
                    used_gpu_hours: 0.0,
                    taper_from: 0.5,
                    min_weight_factor: 0.25,
                    when_exhausted: BudgetExhausted::StopBorrowing,
                };
                for (n, part) in v.split(',').enumerate() {
                    let (a, val) = part.split_once('=').unwrap_or(("", part));
                    match (n, a) {
                        (0, _) => b.gpu_hours = val.parse().unwrap(),
                        (_, "used") => b.used_gpu_hours = val.parse().unwrap(),
                        (_, "taper") => b.taper_from = val.parse().unwrap(),
                        (_, "min") => b.min_weight_factor = val.parse().unwrap(),
                        (_, "") if val == "stop-admitting" => {
                            b.when_exhausted = BudgetExhausted::StopAdmitting
                        }
                        _ => panic!("unknown budget part {part}"),
                    }
                }
                q.budget = Some(b);
            }
            flavor => {
                let mut parts = v.split(',');
                let mut quota = FlavorQuota::guaranteed(milli(parts.next().unwrap()));
                for p in parts {
                    let (a, b) = p.split_once('=').unwrap();
                    match a {
                        "borrow" => quota.borrow_limit = Some(milli(b)),
                        "lend" => quota.lend_limit = Some(milli(b)),
                        "cap" => quota.cap = Some(milli(b)),
                        _ => panic!("unknown quota part {a}"),
                    }
                }
                q.quotas.insert(flavor.to_string(), quota);
            }
        }
    }
    q
}

struct Fixture {
    running: Vec<Running>,
    pending: Vec<Workload>,
}

fn parse_work(toks: &[&str], queues: &Queues, cfg: &Config) -> (Workload, BTreeMap<String, u64>) {
    let mut job_toks = vec![toks[0]];
    let mut extra = BTreeMap::new();
    let (mut queue, mut user, mut class) = (None, "user".to_string(), 2usize);
    let mut w_prio = 0;
    let (mut runtime, mut grace, mut expected) = (None, 30, None);
    for t in &toks[1..] {
        let (k, v) = kv(t);
        match k {
            "queue" => queue = Some(queues.by_name(v).expect("known queue")),
            "user" => user = v.to_string(),
            "class" => {
                class = cfg
                    .classes
                    .iter()
                    .position(|c| c.name == v)
                    .expect("known class")
            }
            "prio" => w_prio = v.parse().unwrap(),
            "runtime" => runtime = Some(v.parse().unwrap()),
            "grace" => grace = v.parse().unwrap(),
            "expected" => expected = Some(v.parse().unwrap()),
            "submit" | "started" | "checkpoint" => {
                extra.insert(k.to_string(), v.parse().unwrap());
            }
            _ => job_toks.push(t),
        }
    }
    let job = super::parse_job(&job_toks);
    let w = Workload {
        job,
        queue: queue.expect("queue= is required"),
        user,
        class,
        priority: w_prio,
        submitted: extra.get("submit").copied().unwrap_or(0),
        max_runtime: runtime,
        grace,
        expected_runtime: expected,
    };
    (w, extra)
}

/// Runs a fixture and renders each cycle's plan.
pub(crate) fn run(fixture: &str) -> String {
    let mut nodes = Vec::new();
    let mut queue_list: Vec<Queue> = Vec::new();
    let mut cfg = Config {
        min_runtime: 0,
        aging_step: 0,
        ..Config::default()
    };
    let mut lines: Vec<Vec<&str>> = Vec::new();
    for toks in token_lines(fixture) {
        match toks[0] {
            "node" => nodes.push(super::parse_node(nodes.len() as u32, &toks[1..])),
            "queue" => {
                let q = parse_queue(&toks[1..], &queue_list);
                queue_list.push(q);
            }
            "config" => {
                for t in &toks[1..] {
                    let (k, v) = kv(t);
                    match k {
                        "ordering" => {
                            cfg.ordering = match v {
                                "fifo" => Ordering::Fifo,
                                "priority" => Ordering::Priority,
                                "multifactor" => Ordering::Multifactor,
                                _ => Ordering::FairShare,
                            }
                        }
                        "preemption" => cfg.preemption = v != "off",
                        "backfill" => cfg.backfill = v != "off",
                        "quotas" => cfg.quotas = v != "off",
                        "min_runtime" => cfg.min_runtime = v.parse().unwrap(),
                        "max_unsaved" => {
                            cfg.max_unsaved = (v != "none").then(|| v.parse().unwrap())
                        }
                        "budget" => {
                            cfg.disruption_budget = (v != "none").then(|| v.parse().unwrap())
                        }
                        "max_jobs" => {
                            cfg.disruption_max_jobs = (v != "none").then(|| v.parse().unwrap())
                        }
                        "restore_fairness" => cfg.reclaims_restore_fairness = v == "on",
                        "window" => cfg.disruption_window = v.parse().unwrap(),
                        "protected_pass" => cfg.protected_pass_budgets = v == "on",
                        "patience" => cfg.budget_patience = v.parse().unwrap(),
                        "underserved_pass" => cfg.underserved_pass_budgets = v.parse().unwrap(),
                        "aging" => cfg.aging_step = v.parse().unwrap(),
                        "history" => cfg.history_weight = v.parse().unwrap(),
                        "tries" => {
                            // Exactly N a queue: no cycle-wide share on top.
                            cfg.tries_per_queue = v.parse().unwrap();
                            cfg.tries_per_cycle = 0;
                        }
                        "reservations" => cfg.max_reservations = v.parse().unwrap(),
                        "backfill_per_node" => cfg.backfill_per_node = v == "on",
                        "one_tier" => cfg.preemptible_one_tier = v == "on",
                        "victims" => cfg.victims_by_lost_work = v == "lost-work",
                        "tries_per_cycle" => cfg.tries_per_cycle = v.parse().unwrap(),
                        "consolidate" => {
                            cfg.consolidate_max_unsaved = (v != "none").then(|| v.parse().unwrap())
                        }
                        "consolidation_interval" => cfg.consolidation_interval = v.parse().unwrap(),
                        "max_preemptions" => cfg.max_preemptions_per_cycle = v.parse().unwrap(),
                        "lease" => cfg.lease_horizon = (v != "none").then(|| v.parse().unwrap()),
                        "holds" => cfg.reclaim_holds = v == "on",
                        _ => panic!("unknown config {k}"),
                    }
                }
            }
            _ => lines.push(toks),
        }
    }
    let mut capacity: BTreeMap<String, u64> = BTreeMap::new();
    for g in nodes.iter().flat_map(|n: &Node| &n.gpus) {
        *capacity.entry(g.model.clone()).or_default() += 1000;
    }
    let mut queues = Queues::new(queue_list, capacity).unwrap();
    let mut placer = Placer::new(
        Cluster::new(nodes).unwrap(),
        Policy {
            tie_break: TieBreak::First,
            ..Policy::gpuflow()
        },
        WorkloadMix::default(),
        1,
    );
    let mut fx = Fixture {
        running: Vec::new(),
        pending: Vec::new(),
    };
    let mut history = History::default();
    let mut out = String::new();
    for toks in lines {
        match toks[0] {
            "run" => {
                let (w, extra) = parse_work(&toks[1..], &queues, &cfg);
                let p = placer.place_job(&w.job).expect("a running job fits");
                let flavor = p
                    .iter()
                    .flat_map(|a| a.gpu_indices().into_iter().map(move |g| (a.node, g)))
                    .next()
                    .map(|(n, g)| placer.cluster().node(n).gpus[g as usize].model.clone())
                    .unwrap_or_default();
                if !flavor.is_empty() {
                    queues.charge(w.queue, &flavor, w.gpu_milli() as i64);
                }
                fx.running.push(Running {
                    work: w,
                    flavor,
                    allocations: p,
                    started: extra.get("started").copied().unwrap_or(0),
                    last_checkpoint: extra.get("checkpoint").copied(),
                    stopping_at: None,
                });
            }
            "job" => {
                let (w, _) = parse_work(&toks[1..], &queues, &cfg);
                fx.pending.push(w);
            }
            // After the runs: a node that stops taking work, a GPU that fails.
            "state" => {
                let node = placer
                    .cluster()
                    .node_by_name(toks[1])
                    .expect("a known node");
                placer.set_node_state(node, super::parse_node_state(toks[2]));
            }
            "health" => {
                let node = placer
                    .cluster()
                    .node_by_name(toks[1])
                    .expect("a known node");
                placer.set_gpu_health(node, toks[2].parse().unwrap(), super::parse_health(toks[3]));
            }
            "usage" => {
                let q = queues.by_name(toks[1]).expect("a known queue");
                *history.usage.entry(q).or_default() += toks[2].parse::<f64>().unwrap();
            }
            "cycle" => {
                let now: u64 = toks[1].parse().unwrap();
                history.account(now, cfg.usage_half_life, &fx.running, &queues);
                let plan = schedule(
                    gpuflow_core::schedule::Snapshot {
                        now,
                        placer: &mut placer,
                        queues: &mut queues,
                        running: &fx.running,
                        pending: &fx.pending,
                        cfg: &cfg,
                    },
                    &mut history,
                );
                let _ = writeln!(out, "cycle t={now}");
                for (id, flavor, p) in &plan.admitted {
                    let parts: Vec<String> = p
                        .iter()
                        .map(|a| {
                            format!(
                                "{}{}",
                                placer.cluster().node(a.node).name,
                                super::render_pick(a)
                            )
                        })
                        .collect();
                    let _ = writeln!(
                        out,
                        "  start job {} on {}{}",
                        id.0,
                        if flavor.is_empty() { "-" } else { flavor },
                        format_args!(": {}", parts.join(" "))
                    );
                }
                for pr in &plan.preempted {
                    let _ = writeln!(
                        out,
                        "  preempt job {} for job {} ({:?}): signal now, kill at t={}, loses {:.2} GPU-h",
                        pr.victim.0, pr.by.0, pr.reason, pr.kill_at, pr.lost_gpu_hours
                    );
                }
                for (what, list) in [
                    ("reserve", &plan.reservations),
                    ("hold", &plan.holds),
                    ("nominate", &plan.nominated),
                ] {
                    for r in list {
                        let names: Vec<String> = r
                            .nodes
                            .iter()
                            .map(|n| placer.cluster().node(*n).name.clone())
                            .collect();
                        let _ = writeln!(
                            out,
                            "  {what} {} for job {} from t={}",
                            names.join(","),
                            r.job.0,
                            r.start_at
                        );
                    }
                }
                for p in &plan.pending {
                    let reasons: Vec<String> = p.reasons.iter().map(|r| r.to_string()).collect();
                    let eta = p.eta.map_or("unknown".to_string(), |t| format!("t={t}"));
                    let _ = writeln!(
                        out,
                        "  pending job {} (#{} in queue, eta {eta}): {}",
                        p.job.0,
                        p.position,
                        reasons.join("; ")
                    );
                }
                // Apply: admitted jobs run; victims stop (their grace is over by the next cycle).
                for (id, flavor, p) in plan.admitted {
                    let k = fx.pending.iter().position(|w| w.job.id == id).unwrap();
                    let w = fx.pending.remove(k);
                    fx.running.push(Running {
                        work: w,
                        flavor,
                        allocations: p,
                        started: now,
                        last_checkpoint: None,
                        stopping_at: None,
                    });
                }
                for pr in plan.preempted {
                    let k = fx
                        .running
                        .iter()
                        .position(|r| r.work.job.id == pr.victim)
                        .unwrap();
                    let r = fx.running.remove(k);
                    placer.release(&r.allocations);
                    if !r.flavor.is_empty() {
                        queues.charge(r.work.queue, &r.flavor, -(r.work.gpu_milli() as i64));
                    }
                    fx.pending.push(Workload { ..r.work });
                }
            }
            "why" => {
                // why JOB NOW: what diagnose says, checked to change nothing.
                let id: u64 = toks[1].parse().unwrap();
                let now: u64 = toks[2].parse().unwrap();
                let (mut p0, mut q0, h0) = (placer.clone(), queues.clone(), history.clone());
                let reasons = diagnose(
                    gpuflow_core::schedule::Snapshot {
                        now,
                        placer: &mut placer,
                        queues: &mut queues,
                        running: &fx.running,
                        pending: &fx.pending,
                        cfg: &cfg,
                    },
                    &history,
                    JobId(id),
                )
                .expect("a pending job");
                assert_eq!(queues, q0, "diagnose changed the queues");
                assert_eq!(history, h0, "diagnose changed the history");
                let next = |p: &mut Placer, q: &mut Queues| {
                    let mut h = history.clone();
                    schedule(
                        gpuflow_core::schedule::Snapshot {
                            now,
                            placer: p,
                            queues: q,
                            running: &fx.running,
                            pending: &fx.pending,
                            cfg: &cfg,
                        },
                        &mut h,
                    )
                };
                assert_eq!(
                    next(&mut placer.clone(), &mut queues.clone()),
                    next(&mut p0, &mut q0),
                    "diagnose changed what the next cycle plans"
                );
                let reasons: Vec<String> = reasons.iter().map(|r| r.to_string()).collect();
                let said = if reasons.is_empty() {
                    "it would start".to_string()
                } else {
                    reasons.join("; ")
                };
                let _ = writeln!(out, "why job {id} at t={now}: {said}");
            }
            "finish" => {
                let id: u64 = toks[1].parse().unwrap();
                let k = fx
                    .running
                    .iter()
                    .position(|r| r.work.job.id.0 == id)
                    .unwrap();
                let r = fx.running.remove(k);
                placer.release(&r.allocations);
                if !r.flavor.is_empty() {
                    queues.charge(r.work.queue, &r.flavor, -(r.work.gpu_milli() as i64));
                }
                let _ = writeln!(out, "finish job {id}");
            }
            other => panic!("unknown step {other}"),
        }
    }
    out
}
