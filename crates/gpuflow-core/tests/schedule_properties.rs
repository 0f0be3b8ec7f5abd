//! Invariants of the scheduling cycle over random queue trees, random
//! workloads and many cycles with arrivals, completions and preemptions.

use std::collections::{BTreeMap, BTreeSet};

use gpuflow_core::queue::*;
use gpuflow_core::schedule::*;
use gpuflow_core::*;
use proptest::prelude::*;

/// (guaranteed H100, guaranteed A10, borrow limit, lend limit, cap), in GPUs.
type TeamSpec = (u64, u64, Option<u64>, Option<u64>, Option<u64>);

#[derive(Clone, Debug)]
struct Spec {
    nodes: Vec<(usize, &'static str)>,
    teams: Vec<TeamSpec>,
    /// (team, class, priority, GPUs, model choice, arrival cycle, duration cycles)
    jobs: Vec<(usize, usize, i32, u8, u8, u32, u32)>,
    seed: u64,
}

fn spec() -> impl Strategy<Value = Spec> {
    (
        prop::collection::vec((1usize..=8, prop_oneof![Just("H100"), Just("A10")]), 1..=4),
        prop::collection::vec(
            (
                0u64..=8,
                0u64..=4,
                prop::option::of(0u64..=8),
                prop::option::of(0u64..=4),
                prop::option::of(2u64..=12),
            ),
            2..=4,
        ),
        prop::collection::vec(
            (
                0usize..4,
                0usize..4,
                -2i32..=2,
                1u8..=4,
                0u8..3,
                0u32..12,
                1u32..6,
            ),
            1..30,
        ),
        any::<u64>(),
    )
        .prop_map(|(nodes, teams, jobs, seed)| Spec {
            nodes,
            teams,
            jobs,
            seed,
        })
}

struct World {
    placer: Placer,
    queues: Queues,
    running: Vec<Running>,
    pending: Vec<Workload>,
    history: History,
    log: Vec<String>,
}

fn build(s: &Spec) -> World {
    let nodes: Vec<Node> = s
        .nodes
        .iter()
        .enumerate()
        .map(|(i, (g, m))| {
            Node::new(
                i as u32,
                &format!("n{i}"),
                CpuMilli(64_000),
                MemMib(1 << 20),
                vec![Gpu::plain(m, MemMib(24_576)); *g],
            )
        })
        .collect();
    let mut capacity: BTreeMap<String, u64> = BTreeMap::new();
    for g in nodes.iter().flat_map(|n| &n.gpus) {
        *capacity.entry(g.model.clone()).or_default() += 1000;
    }
    let mut list = vec![Queue::new("org", None)];
    for (i, (h, a, b, l, c)) in s.teams.iter().enumerate() {
        let mut q = Queue::new(&format!("team{i}"), Some(QueueId(0)));
        for (flavor, g) in [("H100", *h), ("A10", *a)] {
            q.quotas.insert(
                flavor.to_string(),
                FlavorQuota {
                    guaranteed: g * 1000,
                    borrow_limit: b.map(|x| x * 1000),
                    lend_limit: l.map(|x| x * 1000),
                    cap: c.map(|x| x * 1000),
                },
            );
        }
        list.push(q);
    }
    let queues = Queues::new(list, capacity).unwrap();
    let placer = Placer::new(
        Cluster::new(nodes).unwrap(),
        Policy::gpuflow(),
        WorkloadMix::default(),
        s.seed,
    );
    World {
        placer,
        queues,
        running: Vec::new(),
        pending: Vec::new(),
        history: History::default(),
        log: Vec::new(),
    }
}

/// The disruption budget of half the worlds, GPU-hours per window (jobs
/// lose up to 4 GPUs × 500 s, about 0.56 GPU-h; most lose a few hundredths),
/// and the window, seconds.
const BUDGET: f64 = 0.05;
const WINDOW: u64 = 600;
/// Jobs a queue may lose to paced reclaims per window, in the worlds that count them.
const MAX_JOBS: usize = 1;

/// `observed`: each cycle through [`schedule_observed`], whose phases must
/// come in order with a tally that only grows; the plans must be
/// [`schedule`]'s (the property compares the two runs' logs).
fn run(s: &Spec, observed: bool) -> Result<Vec<String>, TestCaseError> {
    let cfg = Config {
        min_runtime: 0,
        aging_step: 0,
        // Both backfill rules: every reserved node kept off, or each on its own.
        backfill_per_node: s.seed % 2 == 1,
        // Half the worlds with a tight disruption budget.
        disruption_budget: (s.seed / 2 % 2 == 1).then_some(BUDGET),
        // And half with a tight count of jobs, which every reclaim by
        // batch or training passes through (no queue is underserved).
        disruption_max_jobs: (s.seed / 4 % 2 == 1).then_some(MAX_JOBS),
        underserved_pass_budgets: if s.seed / 4 % 2 == 1 { 0.0 } else { 0.8 },
        disruption_window: WINDOW,
        ..Config::default()
    };
    // GPU-hours lost per queue in the budget's window: (time, GPU-hours).
    let mut lost: BTreeMap<QueueId, Vec<(u64, f64)>> = BTreeMap::new();
    let mut w = build(s);
    let teams = s.teams.len();
    let mut ends: BTreeMap<JobId, u32> = BTreeMap::new();
    // Each preemption: preemptor → victim → the other jobs running then in
    // their two queues.
    type Others = (BTreeSet<JobId>, BTreeSet<JobId>);
    let mut preempted_by: BTreeMap<JobId, BTreeMap<JobId, Others>> = BTreeMap::new();
    for cycle in 0..20u32 {
        let now = cycle as u64 * 100;
        for (k, j) in s.jobs.iter().enumerate() {
            if j.5 == cycle {
                let (team, class, prio, gpus, model, _, _) = *j;
                let models = match model {
                    0 => vec![],
                    1 => vec!["H100".to_string()],
                    _ => vec!["A10".to_string()],
                };
                let req = TaskRequest {
                    cpu: CpuMilli(1000),
                    mem: MemMib(1024),
                    gpu: GpuRequest::Whole { count: gpus },
                    models,
                };
                w.pending.push(Workload {
                    job: Job::single(k as u64, req),
                    queue: QueueId(1 + (team % teams) as u32),
                    user: "u".into(),
                    class,
                    priority: prio,
                    submitted: now,
                    max_runtime: Some(j.6 as u64 * 100),
                    grace: 0,
                    expected_runtime: None,
                });
            }
        }
        w.history
            .account(now, cfg.usage_half_life, &w.running, &w.queues);
        // Queues below the share of the decayed usage that passes budgets
        // (the teams weigh the same).
        let usage = |q: &QueueId| w.history.usage.get(q).copied().unwrap_or(0.0);
        let team_ids: Vec<QueueId> = (0..teams).map(|t| QueueId(1 + t as u32)).collect();
        let used: f64 = team_ids.iter().map(usage).sum();
        let underserved: BTreeSet<QueueId> = team_ids
            .iter()
            .copied()
            .filter(|q| {
                used > 0.0 && usage(q) / used * (teams as f64) < cfg.underserved_pass_budgets
            })
            .collect();
        let usage_before: BTreeMap<QueueId, f64> =
            team_ids.iter().map(|q| (*q, usage(q))).collect();
        let snap = gpuflow_core::schedule::Snapshot {
            now,
            placer: &mut w.placer,
            queues: &mut w.queues,
            running: &w.running,
            pending: &w.pending,
            cfg: &cfg,
        };
        let mut seen: Vec<(Phase, Tally)> = Vec::new();
        let plan = if observed {
            schedule_observed(snap, &mut w.history, |p, t| seen.push((p, *t)))
        } else {
            schedule(snap, &mut w.history)
        };
        if observed {
            let phases: Vec<Phase> = seen.iter().map(|s| s.0).collect();
            prop_assert_eq!(&phases[..], &Phase::ALL[..], "phases out of order");
            let tally = seen.last().unwrap().1;
            let grows = seen.windows(2).all(|p| {
                let (a, b) = (p[0].1, p[1].1);
                a.tries <= b.tries
                    && a.placements <= b.placements
                    && a.victim_searches <= b.victim_searches
            });
            prop_assert!(grows, "the tally shrank between phases");
            // Every admission was tried and placed; every preemption but a
            // consolidation's was found by a victim search.
            prop_assert!(tally.tries >= plan.admitted.len() as u64);
            prop_assert!(tally.placements >= plan.admitted.len() as u64);
            let searched = plan
                .preempted
                .iter()
                .any(|p| p.reason != PreemptReason::Consolidation);
            prop_assert!(!searched || tally.victim_searches > 0);
        }
        // Preemption bounds.
        for p in &plan.preempted {
            let victim = w
                .running
                .iter()
                .find(|r| r.work.job.id == p.victim)
                .unwrap();
            let by = w.pending.iter().find(|x| x.job.id == p.by).unwrap();
            let vc = &cfg.classes[victim.work.class];
            prop_assert!(vc.preemptible, "a non-preemptible job was preempted");
            match p.reason {
                PreemptReason::Priority => {
                    prop_assert_eq!(victim.work.queue, by.queue);
                    let rank = |x: &Workload| (cfg.classes[x.class].rank, x.priority);
                    prop_assert!(
                        rank(&victim.work) < rank(by),
                        "only strictly lower priority is preempted"
                    );
                }
                PreemptReason::Reclaim => {
                    // All of this plan's reclaim victims in the queue together
                    // leave it at or above its guarantee. (Its own priority
                    // preemptions make room for its own jobs.)
                    let q = victim.work.queue;
                    let leaving: u64 = w
                        .running
                        .iter()
                        .filter(|r| r.work.queue == q && r.flavor == victim.flavor)
                        .filter(|r| {
                            plan.preempted.iter().any(|x| {
                                x.victim == r.work.job.id && x.reason == PreemptReason::Reclaim
                            })
                        })
                        .map(|r| r.work.gpu_milli())
                        .sum();
                    let after = w.queues.usage(q, &victim.flavor) - leaving;
                    prop_assert!(
                        after >= w.queues.get(q).quota(&victim.flavor).guaranteed,
                        "reclaim pushed a queue below its guarantee"
                    );
                }
                PreemptReason::Consolidation => {
                    // Moved: little unsaved work, its minimum runtime run,
                    // all on one node (it is placed again whole elsewhere).
                    let limit = cfg.consolidate_max_unsaved.expect("consolidation is on");
                    prop_assert!(
                        victim.unsaved(now) <= limit,
                        "moved a job with much unsaved work"
                    );
                    prop_assert!(
                        now - victim.started >= cfg.min_runtime,
                        "moved before its minimum runtime"
                    );
                    prop_assert!(
                        victim
                            .allocations
                            .iter()
                            .all(|a| a.node == victim.allocations[0].node),
                        "moved a job of several nodes"
                    );
                    let rank = |x: &Workload| (cfg.classes[x.class].rank, x.priority);
                    prop_assert!(
                        victim.work.gpu_milli() < by.gpu_milli() && rank(&victim.work) <= rank(by),
                        "moved a job as large as, or above, the job it made room for"
                    );
                }
            }
            // A reclaim by a preemptible job keeps within the victim queue's
            // budget (with what this plan's earlier victims lost); a protected
            // job, or one of a queue below its share, may pass it. A queue's
            // own priority preemptions are not budgeted.
            let q = victim.work.queue;
            let window: f64 = lost
                .get(&q)
                .into_iter()
                .flatten()
                .filter(|(t, _)| now - t < WINDOW)
                .map(|(_, h)| h)
                .sum();
            if let Some(budget) = cfg.disruption_budget
                && p.reason == PreemptReason::Reclaim
                && cfg.classes[by.class].preemptible
                && !underserved.contains(&by.queue)
            {
                prop_assert!(
                    window + p.lost_gpu_hours <= budget + 1e-9,
                    "a preemption passed the disruption budget: {window} + {} of {budget}",
                    p.lost_gpu_hours
                );
            }
            // A paced reclaim (the same that budgets bind) takes only from a
            // queue that has had at least the reclaimer's decayed usage.
            if cfg.reclaims_restore_fairness
                && p.reason == PreemptReason::Reclaim
                && cfg.classes[by.class].preemptible
                && !underserved.contains(&by.queue)
            {
                prop_assert!(
                    usage_before[&q] >= usage_before[&by.queue],
                    "a paced reclaim took from a queue that had less: {} < {}",
                    usage_before[&q],
                    usage_before[&by.queue]
                );
            }
            if let Some(max) = cfg.disruption_max_jobs
                && p.reason == PreemptReason::Reclaim
                && cfg.classes[by.class].preemptible
                && !underserved.contains(&by.queue)
            {
                let jobs = lost
                    .get(&q)
                    .into_iter()
                    .flatten()
                    .filter(|(t, _)| now - t < WINDOW)
                    .count();
                prop_assert!(
                    jobs < max,
                    "a preemption passed the disruption budget's count: {jobs} of {max} already"
                );
            }
            if p.reason == PreemptReason::Reclaim {
                lost.entry(q).or_default().push((now, p.lost_gpu_hours));
            }
            // No cycles: the victim never preempted the preemptor before
            // while the other jobs running in their two queues are the ones
            // that ran then. (Queues take turns as their other work starts
            // and ends: a queue that borrowed lends later, and its job may
            // reclaim from the job that reclaimed from it. With the same
            // other work, the rule that let the first one preempt forbids
            // the second.)
            let others = |q: QueueId| -> BTreeSet<JobId> {
                w.running
                    .iter()
                    .filter(|r| {
                        r.work.queue == q && r.work.job.id != p.victim && r.work.job.id != p.by
                    })
                    .map(|r| r.work.job.id)
                    .collect()
            };
            let now: Others = (others(by.queue), others(victim.work.queue));
            prop_assert!(
                preempted_by
                    .get(&p.victim)
                    .and_then(|v| v.get(&p.by))
                    .is_none_or(|(of_victim, of_by)| (of_victim, of_by) != (&now.1, &now.0)),
                "preemption cycle"
            );
            preempted_by.entry(p.by).or_default().insert(p.victim, now);
        }
        w.log.push(format!(
            "{:?}",
            (
                &plan
                    .admitted
                    .iter()
                    .map(|(id, f, p)| (
                        id.0,
                        f.clone(),
                        p.iter().map(|a| (a.node, a.pick)).collect::<Vec<_>>()
                    ))
                    .collect::<Vec<_>>(),
                plan.preempted
                    .iter()
                    .map(|p| (p.victim.0, p.by.0))
                    .collect::<Vec<_>>()
            )
        ));
        // Apply: admitted run, victims stop, finished jobs leave.
        for (id, flavor, p) in plan.admitted {
            let k = w.pending.iter().position(|x| x.job.id == id).unwrap();
            let work = w.pending.remove(k);
            ends.insert(id, cycle + (work.max_runtime.unwrap() / 100) as u32);
            w.running.push(Running {
                work,
                flavor,
                allocations: p,
                started: now,
                last_checkpoint: None,
                stopping_at: None,
            });
        }
        let victims: BTreeSet<JobId> = plan.preempted.iter().map(|p| p.victim).collect();
        let mut keep = Vec::new();
        for r in std::mem::take(&mut w.running) {
            let done = ends.get(&r.work.job.id).is_some_and(|e| *e <= cycle);
            if victims.contains(&r.work.job.id) || done {
                w.placer.release(&r.allocations);
                if !r.flavor.is_empty() {
                    w.queues
                        .charge(r.work.queue, &r.flavor, -(r.work.gpu_milli() as i64));
                }
                if !done {
                    w.pending.push(r.work);
                }
            } else {
                keep.push(r);
            }
        }
        w.running = keep;
        // Quotas and caps hold for every queue and flavor.
        for (k, q) in w.queues.list().iter().enumerate() {
            for f in ["H100", "A10"] {
                let used = w.queues.usage(QueueId(k as u32), f);
                prop_assert!(
                    used <= q.quota(f).limit(),
                    "{} uses {used} of {f}, limit {}",
                    q.name,
                    q.quota(f).limit()
                );
                if let Some(c) = q.quota(f).cap {
                    prop_assert!(used <= c);
                }
            }
        }
        // Usage equals the running jobs' demand.
        for f in ["H100", "A10"] {
            let sum: u64 = w
                .running
                .iter()
                .filter(|r| r.flavor == f)
                .map(|r| r.work.gpu_milli())
                .sum();
            prop_assert_eq!(w.queues.usage(QueueId(0), f), sum);
        }
    }
    Ok(w.log)
}

proptest! {
    #![proptest_config(ProptestConfig { cases: 512, ..ProptestConfig::default() })]

    #[test]
    fn cycles_keep_quotas_and_preemption_bounds_and_are_deterministic(s in spec()) {
        let a = run(&s, false)?;
        let b = run(&s, true)?;
        prop_assert_eq!(a, b, "equal inputs gave different plans");
    }
}
