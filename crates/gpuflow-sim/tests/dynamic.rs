//! The dynamic simulator: the four-team study and its inputs.

use gpuflow_core::placement::task;
use gpuflow_core::{
    Allocation, Cluster, CpuMilli, GpuPick, GpuRequest, Job, JobId, MemMib, MixWeighting, NodeId,
    Placer, Policy, TaskId, WorkloadMix,
};
use gpuflow_sim::dynamic::{self, SimConfig, SimPolicy, group_stats, team_shares};
use gpuflow_sim::workload::{self, ClusterSpec, Synthetic};

#[test]
fn four_team_study_gpuflow_serves_inference_and_notebooks_first_and_keeps_shares() {
    let synth = Synthetic::four_teams(7);
    let (spec, jobs) = (synth.cluster(), synth.jobs());
    let run = |p: SimPolicy| dynamic::simulate(&spec, &jobs, &p, &SimConfig::default(), 7).unwrap();
    let (fifo, slurm, ours) = (
        run(SimPolicy::fifo()),
        run(SimPolicy::slurm()),
        run(SimPolicy::gpuflow()),
    );
    for r in [&fifo, &slurm, &ours] {
        assert_eq!(r.outcomes.len(), jobs.len());
        for o in &r.outcomes {
            assert!(
                o.first_start.is_none_or(|s| s >= o.submit),
                "a job started before it arrived"
            );
            assert!(
                o.finish
                    .is_none_or(|f| o.first_start.is_some_and(|s| f > s))
            );
        }
    }
    let p95 = |r: &dynamic::SimResult, kind: usize| {
        group_stats(r.outcomes.iter().filter(|o| o.kind == kind)).2
    };
    for (kind, name) in [(0, "inference"), (1, "notebook")] {
        let (f, s, g) = (p95(&fifo, kind), p95(&slurm, kind), p95(&ours, kind));
        eprintln!("{name} p95 wait (h): fifo {f:.2}, slurm-like {s:.2}, gpuflow {g:.2}");
        assert!(
            g < f && g < s,
            "{name}: gpuflow {g:.2} h does not beat fifo {f:.2} h and slurm-like {s:.2} h"
        );
    }
    for (team, share, target) in team_shares(&ours) {
        assert!(
            (share / target - 1.0).abs() <= 0.10,
            "{team} got {share:.3} of GPU-hours against {target:.3}"
        );
    }
    assert!(
        ours.preemptions > 0 && ours.lost_gpu_hours > 0.0,
        "the study exercises preemption"
    );
    assert_eq!(fifo.preemptions + slurm.preemptions, 0);
}

#[test]
fn traces_round_trip_and_bad_rows_say_where() {
    let synth = Synthetic {
        hours: 2,
        ..Synthetic::four_teams(3)
    };
    let jobs = synth.jobs();
    let dir = std::env::temp_dir().join(format!("gpuflow-dyn-test-{}", std::process::id()));
    std::fs::create_dir_all(&dir).unwrap();
    let f = dir.join("trace.csv");
    std::fs::write(&f, workload::trace_csv(&jobs)).unwrap();
    assert_eq!(workload::load_trace(&f).unwrap(), jobs);
    std::fs::write(&f, "id,submit_s,duration_s,tasks,gpus_per_task,sharing,team,kind,priority,max_runtime_s\n1,0,60,1,1,whole,a,lunch,0,\n").unwrap();
    let e = workload::load_trace(&f).unwrap_err().to_string();
    assert!(
        e.contains("line 2") && e.contains("lunch") && e.contains("notebook"),
        "{e}"
    );
    std::fs::write(&f, "id,submit_s,duration_s,tasks,gpus_per_task,sharing,team,kind,priority,max_runtime_s\n1,0,60,1,1,frac:1500,a,batch,0,\n").unwrap();
    assert!(
        workload::load_trace(&f)
            .unwrap_err()
            .to_string()
            .contains("1..999")
    );
    let c = dir.join("cluster.toml");
    std::fs::write(&c, "[[nodes]]\ncount = 2\ngpus = 8\nmodel = \"H100\"\ncpu = 64\nmem_gib = 512\n\n[[queues]]\nname = \"a\"\nguaranteed = { H100 = 8 }\n").unwrap();
    let spec = ClusterSpec::load(&c).unwrap();
    assert_eq!(spec.build_nodes().len(), 2);
    std::fs::write(
        &c,
        "[[nodes]]\ncount = 2\ngpus = 8\nmodel = \"H100\"\ncpu = 64\nmem_gib = 512\ncolour = 1\n",
    )
    .unwrap();
    let e = ClusterSpec::load(&c).unwrap_err().to_string();
    assert!(e.contains("colour"), "{e}");
    std::fs::write(&c, "[[nodes]]\ncount = 2\ngpus = 8\nmodel = \"H100\"\ncpu = 64\nmem_gib = 512\n\n[[queues]]\nname = \"a\"\nbudget = { gpu_hours = 10, period_h = 0 }\n").unwrap();
    let e = ClusterSpec::load(&c).unwrap_err().to_string();
    assert!(
        e.contains("queue a: budget needs") && e.contains("period_h > 0"),
        "{e}"
    );
    std::fs::write(&c, "[[nodes]]\ncount = 2\ngpus = 8\nmodel = \"H100\"\ncpu = 64\nmem_gib = 512\n\n[[queues]]\nname = \"a\"\nbudget = { gpu_hours = 10, period_h = 24, when_exhausted = \"panic\" }\n").unwrap();
    let e = ClusterSpec::load(&c).unwrap_err().to_string();
    assert!(
        e.contains("stop-borrowing") && e.contains("stop-admitting"),
        "{e}"
    );
    // A job naming a team without a queue is refused.
    let mut bad = jobs.clone();
    bad[0].team = "nobody".into();
    let e = dynamic::simulate(
        &synth.cluster(),
        &bad,
        &SimPolicy::gpuflow(),
        &SimConfig::default(),
        1,
    )
    .unwrap_err()
    .to_string();
    assert!(e.contains("nobody"), "{e}");
    std::fs::remove_dir_all(&dir).unwrap();
}

#[test]
fn when_one_team_over_submits_fair_share_keeps_the_others_waiting_less_than_qos_tiers_do() {
    // team-a submits 3/7 of the demand against a 1/5 weight.
    let synth = Synthetic {
        demand: vec![3.0, 1.0, 2.0, 1.0],
        ..Synthetic::four_teams(7)
    };
    let (spec, jobs) = (synth.cluster(), synth.jobs());
    let run = |p: SimPolicy| dynamic::simulate(&spec, &jobs, &p, &SimConfig::default(), 7).unwrap();
    let (qos, ours) = (run(SimPolicy::slurm_qos()), run(SimPolicy::gpuflow()));
    let p95 = |r: &dynamic::SimResult, team: &str| {
        group_stats(r.outcomes.iter().filter(|o| o.team == team)).2
    };
    for team in ["team-b", "team-c", "team-d"] {
        let (q, g) = (p95(&qos, team), p95(&ours, team));
        eprintln!("{team} p95 wait (h): slurm-qos {q:.2}, gpuflow {g:.2}");
        assert!(
            g < q,
            "{team}: gpuflow {g:.2} h is not below slurm-qos {q:.2} h"
        );
    }
    // The over-submitting team gets less than under QoS tiers, and waits for it.
    let share = |r: &dynamic::SimResult| {
        team_shares(r)
            .into_iter()
            .find(|(t, _, _)| t == "team-a")
            .unwrap()
            .1
    };
    assert!(share(&ours) < share(&qos));
    assert!(dynamic::jain(&ours) > dynamic::jain(&qos));
}

/// team-a alone on 8 GPUs with a 20 GPU-hour budget per 10-hour period,
/// submitting a 1-GPU, 1-hour batch job every 15 minutes for 30 hours:
/// (start, finish) of its jobs.
/// A cluster file's spec, as `sim run --cluster` reads it.
fn cluster(text: &str) -> ClusterSpec {
    let dir = tempfile::tempdir().unwrap();
    let path = dir.path().join("cluster.toml");
    std::fs::write(&path, text).unwrap();
    ClusterSpec::load(&path).unwrap()
}

/// `n` one-hour one-GPU batch jobs of team-a, job `i` submitted at `submit(i)`.
fn one_gpu_hours(n: u64, submit: impl Fn(u64) -> u64) -> Vec<workload::TraceJob> {
    (0..n)
        .map(|i| workload::TraceJob {
            id: i + 1,
            submit: submit(i),
            duration: 3600,
            tasks: 1,
            gpu: gpuflow_core::GpuRequest::Whole { count: 1 },
            team: "team-a".into(),
            kind: 3,
            priority: 0,
            max_runtime: Some(3600),
            model: None,
        })
        .collect()
}

fn budgeted_run(budget: &str) -> Vec<(u64, u64)> {
    let text = format!(
        "[[nodes]]\ncount = 1\ngpus = 8\nmodel = \"H100\"\ncpu = 64\nmem_gib = 512\n\n\
         [[queues]]\nname = \"team-a\"\nguaranteed = {{ H100 = 2 }}\nbudget = {budget}\n\n\
         [[queues]]\nname = \"team-b\"\nguaranteed = {{ H100 = 6 }}\n"
    );
    let spec = cluster(&text);
    let jobs = one_gpu_hours(120, |i| i * 900);
    let mut policy = SimPolicy::gpuflow();
    policy.config.preemption = false;
    let r = dynamic::simulate(&spec, &jobs, &policy, &SimConfig::default(), 1).unwrap();
    r.outcomes
        .iter()
        .map(|o| (o.first_start.unwrap(), o.finish.unwrap()))
        .collect()
}

/// GPU-hours the 1-GPU jobs used in `t`'s 10-hour period up to `t`.
fn used_in_period(runs: &[(u64, u64)], t: u64) -> f64 {
    let from = t - t % 36_000;
    runs.iter()
        .map(|&(s, f)| f.min(t).saturating_sub(s.max(from)) as f64 / 3600.0)
        .sum()
}

#[test]
fn a_spent_budget_stops_new_work_until_its_period_renews() {
    let runs =
        budgeted_run("{ gpu_hours = 20, period_h = 10, when_exhausted = \"stop-admitting\" }");
    for &(s, _) in &runs {
        let used = used_in_period(&runs, s);
        assert!(
            used < 20.0,
            "a job started at {s} s with {used:.2} GPU-h of 20 used"
        );
    }
    // Every period starts work again, and the budget held some back.
    for period in 0..3u64 {
        assert!(
            runs.iter().any(|&(s, _)| s / 36_000 == period),
            "nothing started in period {period}"
        );
    }
    // Jobs submitted every 15 minutes wait for the next period: job k was
    // submitted at k × 900 s.
    let held = runs
        .iter()
        .enumerate()
        .filter(|&(k, &(s, _))| s / 36_000 > (k as u64 * 900) / 36_000)
        .count();
    assert!(held > 10, "only {held} jobs waited for a later period");
    let first: f64 = used_in_period(&runs, 35_999);
    assert!(
        (20.0..24.5).contains(&first),
        "period 0 used {first:.2} GPU-h"
    );
}

#[test]
fn a_spent_budget_stops_borrowing_but_not_work_within_the_guarantee() {
    let runs = budgeted_run("{ gpu_hours = 20, period_h = 10 }");
    let running_at = |t: u64| runs.iter().filter(|&&(s, f)| s <= t && t < f).count();
    // It borrows while the budget lasts (up to 4 at once: the demand)...
    assert!(
        runs.iter()
            .any(|&(s, _)| used_in_period(&runs, s) < 20.0 && running_at(s) > 2)
    );
    // ...and once it is spent, starts only what fits its guarantee of 2.
    let mut after = 0;
    for &(s, _) in &runs {
        if used_in_period(&runs, s) >= 20.0 {
            after += 1;
            assert!(
                running_at(s) <= 2,
                "{} running at {s} s with the budget spent",
                running_at(s)
            );
        }
    }
    assert!(
        after > 10,
        "only {after} jobs started with the budget spent"
    );
    // A budget large enough never binds: it borrows up to its demand throughout.
    let free = budgeted_run("{ gpu_hours = 1000, period_h = 10 }");
    assert!(free.iter().all(|&(s, _)| used_in_period(&free, s) < 1000.0));
    assert!(used_in_period(&free, 35_999) > 30.0);
}

/// The realistic workload runs under every policy, and the reports carry
/// per-team p50/p95/max waits and one `all` row per policy with the
/// makespan and the share of GPU-hours lost.
#[test]
fn the_realistic_workload_reports_every_policy_whole() {
    use gpuflow_sim::realistic::Realistic;
    let r = Realistic {
        gpus: 128,
        hours: 48,
        ..Realistic::new(2)
    };
    let (spec, jobs) = (r.cluster(), r.jobs());
    let results: Vec<_> = SimPolicy::NAMES
        .iter()
        .map(|p| {
            dynamic::simulate(
                &spec,
                &jobs,
                &SimPolicy::named(p).unwrap(),
                &SimConfig::default(),
                2,
            )
            .unwrap()
        })
        .collect();
    for res in &results {
        assert_eq!(res.outcomes.len(), jobs.len());
        let w = dynamic::waits(res.outcomes.iter());
        assert!(w.p50 <= w.p95 && w.p95 <= w.max, "{w:?}");
        assert!(res.run_gpu_hours >= res.lost_gpu_hours);
    }
    let csv = gpuflow_sim::dynreport::csv(&results);
    let header: Vec<&str> = csv.lines().next().unwrap().split(',').collect();
    for line in csv.lines() {
        assert_eq!(line.split(',').count(), header.len(), "{line}");
    }
    for p in SimPolicy::NAMES {
        let all: Vec<&str> = csv
            .lines()
            .filter(|l| l.starts_with(&format!("{p},all,all,")))
            .collect();
        assert_eq!(all.len(), 1, "{p}: {csv}");
        let cols: Vec<&str> = all[0].split(',').collect();
        let makespan: f64 = cols[header.iter().position(|h| *h == "makespan_h").unwrap()]
            .parse()
            .unwrap();
        assert!(makespan >= 40.0, "{makespan}");
    }
    let table = gpuflow_sim::dynreport::table(&results);
    assert!(
        table.contains("team-10") && table.contains("makespan h"),
        "{table}"
    );
    // One row per policy and job, each agreeing with the job's outcome.
    let jobs_csv = gpuflow_sim::dynreport::jobs_csv(&results);
    let mut lines = jobs_csv.lines();
    let header: Vec<&str> = lines.next().unwrap().split(',').collect();
    let col = |name: &str| header.iter().position(|h| *h == name).unwrap();
    let rows: Vec<Vec<&str>> = lines.map(|l| l.split(',').collect()).collect();
    assert_eq!(rows.len(), results.len() * jobs.len());
    for (row, o) in rows.iter().zip(
        results
            .iter()
            .flat_map(|r| r.outcomes.iter().map(move |o| (r, o))),
    ) {
        let (r, o) = o;
        assert_eq!(row.len(), header.len());
        assert_eq!(row[col("policy")], r.policy);
        assert_eq!(row[col("job")], o.id.to_string());
        assert_eq!(row[col("team")], o.team);
        assert_eq!(row[col("preemptions")], o.preemptions.to_string());
        match o.first_start {
            Some(s) => {
                let wait: f64 = row[col("wait_h")].parse().unwrap();
                assert!((wait - (s - o.submit) as f64 / 3600.0).abs() < 1e-3);
            }
            None => assert_eq!(row[col("wait_h")], ""),
        }
    }
}

/// The baselines place tasks as Slurm's node selection does (the tightest
/// node, the first of equal ones, its first free GPU), not with gpuflow's
/// placement policy, which keeps a hole that fits a common shape.
#[test]
fn the_slurm_baselines_place_tasks_as_slurm_selects_nodes() {
    let nodes = workload::h100_cluster(32, std::iter::empty()).build_nodes();
    assert_eq!(nodes.len(), 4);
    let gpus = |n: u8| task(8_000 * n as u64, 1_024, GpuRequest::Whole { count: n });
    // One- and two-GPU tasks are the common shapes.
    let mix = WorkloadMix::from_tasks([gpus(1), gpus(2)].iter(), MixWeighting::Tasks, 1.0);
    // Node 0 has GPUs 0-4 in use (3 free), nodes 1 and 2 GPUs 0-5 (2 free);
    // node 3 is empty.
    let used = [(0, 5u8), (1, 6), (2, 6)].map(|(node, n)| Allocation {
        task: TaskId {
            job: JobId(100 + node),
            group: 0,
            index: 0,
        },
        node: NodeId(node as u32),
        cpu: CpuMilli(8_000 * n as u64),
        mem: MemMib(1_024),
        gpu: GpuRequest::Whole { count: n },
        pick: GpuPick::Whole((1u64 << n) - 1),
    });
    let placed = |policy: &Policy| {
        let cluster = Cluster::new(nodes.clone()).unwrap();
        let mut placer = Placer::new(cluster, policy.clone(), mix.clone(), 7);
        placer.apply(&used).unwrap();
        let a = placer.place_job(&Job::single(1, gpus(1))).unwrap();
        (a[0].node, a[0].pick)
    };
    for p in [
        SimPolicy::fifo(),
        SimPolicy::slurm(),
        SimPolicy::slurm_qos(),
    ] {
        assert_eq!(
            placed(&p.placement),
            (NodeId(1), GpuPick::Whole(1 << 6)),
            "{} places a one-GPU task on the tightest node, the first of two, on its first free GPU",
            p.name
        );
    }
    // gpuflow keeps both two-GPU holes and takes one of node 0's three.
    assert_eq!(placed(&SimPolicy::gpuflow().placement).0, NodeId(0));
    let mut p = SimPolicy::slurm();
    p.tune("placement", "gpuflow").unwrap();
    assert_eq!(placed(&p.placement).0, NodeId(0));
    p.tune("placement", "slurm").unwrap();
    assert_eq!(placed(&p.placement).0, NodeId(1));
    let e = p.tune("placement", "tightest").unwrap_err();
    assert!(
        e.contains("placement=tightest") && e.contains("slurm"),
        "{e}"
    );
}

/// A job that was preempted and waits again for room: the report's waits
/// end at its first start, the time queued counts the second wait too.
#[test]
fn the_time_a_preempted_job_waits_again_is_reported() {
    let text = "[[nodes]]\ncount = 1\ngpus = 2\nmodel = \"H100\"\ncpu = 64\nmem_gib = 512\n\n\
                [[queues]]\nname = \"team-a\"\nguaranteed = { H100 = 1 }\n\n\
                [[queues]]\nname = \"team-b\"\nguaranteed = { H100 = 1 }\n";
    let spec = cluster(text);
    let batch = |id, submit, hours: u64| workload::TraceJob {
        id,
        submit,
        duration: hours * 3600,
        tasks: 1,
        gpu: GpuRequest::Whole { count: 1 },
        team: if id == 3 { "team-b" } else { "team-a" }.into(),
        kind: 3,
        priority: 0,
        max_runtime: Some(hours * 7200),
        model: None,
    };
    // team-a runs a 10-hour job on its guarantee and a 5-hour one on
    // team-b's GPU; team-b's 2-hour job takes its guarantee back. The last
    // job keeps the simulation going until all have ended.
    let jobs = vec![
        batch(1, 0, 10),
        batch(2, 600, 5),
        batch(3, 1800, 2),
        batch(4, 20 * 3600, 1),
    ];
    let r = dynamic::simulate(
        &spec,
        &jobs,
        &SimPolicy::gpuflow(),
        &SimConfig::default(),
        1,
    )
    .unwrap();
    let (a, b) = (&r.outcomes[1], &r.outcomes[2]);
    assert_eq!((a.first_start, a.preemptions), (Some(600), 1), "{a:?}");
    // It ran until it was stopped (all of it lost: batch never saves), then
    // waited for team-b's job to end, then ran its 5 hours.
    let ran = (a.lost_gpu_hours * 3600.0).round() as u64;
    assert!(ran > 0, "{a:?}");
    let finish = a.finish.unwrap();
    assert_eq!(a.requeued_wait, finish - 600 - ran - 5 * 3600, "{a:?}");
    assert!(
        a.requeued_wait >= b.finish.unwrap() - b.first_start.unwrap(),
        "{a:?} {b:?}"
    );
    assert!(
        r.outcomes
            .iter()
            .all(|o| o.preemptions > 0 || o.requeued_wait == 0)
    );
    let w = dynamic::waits(std::iter::once(a));
    assert_eq!(w.p95, 0.0);
    assert!(
        (w.queued_p95 - a.requeued_wait as f64 / 3600.0).abs() < 1e-9,
        "{w:?}"
    );
    // The reports carry it: the job's row and the cluster-wide one.
    let jobs_csv = gpuflow_sim::dynreport::jobs_csv(std::slice::from_ref(&r));
    let header: Vec<&str> = jobs_csv.lines().next().unwrap().split(',').collect();
    let col = header.iter().position(|h| *h == "requeued_wait_h").unwrap();
    let row: Vec<&str> = jobs_csv.lines().nth(2).unwrap().split(',').collect();
    let h: f64 = row[col].parse().unwrap();
    assert!(
        (h - a.requeued_wait as f64 / 3600.0).abs() < 1e-3,
        "{row:?}"
    );
    let csv = gpuflow_sim::dynreport::csv(std::slice::from_ref(&r));
    let header: Vec<&str> = csv.lines().next().unwrap().split(',').collect();
    let col = header.iter().position(|h| *h == "queued_p95_h").unwrap();
    let all = csv
        .lines()
        .find(|l| l.starts_with("gpuflow,all,all,"))
        .unwrap();
    let v: f64 = all.split(',').nth(col).unwrap().parse().unwrap();
    assert!((v - a.requeued_wait as f64 / 3600.0).abs() < 1e-3, "{all}");
}

/// GPUs idle while work that fits them waits: a team that may not borrow
/// (its guarantee 4 of 8 GPUs, borrowing 0) submits seven one-hour
/// one-GPU jobs at once; four run, three wait an hour for quota while four
/// GPUs sit free: 3 GPU-hours idle while waiting. Without quotas (the Slurm
/// baseline) nothing waits and nothing idles.
#[test]
fn gpus_idle_while_work_that_fits_them_waits_are_measured() {
    let text = "[[nodes]]\ncount = 1\ngpus = 8\nmodel = \"H100\"\ncpu = 64\nmem_gib = 512\n\n\
         [[queues]]\nname = \"team-a\"\nguaranteed = { H100 = 4 }\nborrow_limit = { H100 = 0 }\n\n\
         [[queues]]\nname = \"team-b\"\nguaranteed = { H100 = 4 }\n";
    let spec = cluster(text);
    // The last arrival sets the horizon: one more job, 4 h later.
    let jobs = one_gpu_hours(8, |i| if i == 7 { 4 * 3600 } else { 0 });
    let run = |p: SimPolicy| dynamic::simulate(&spec, &jobs, &p, &SimConfig::default(), 1).unwrap();
    let ours = run(SimPolicy::gpuflow());
    let slurm = run(SimPolicy::slurm());
    eprintln!(
        "idle while waiting: gpuflow {:.2} GPU-h, slurm-like {:.2} GPU-h",
        ours.idle_waiting_gpu_hours, slurm.idle_waiting_gpu_hours
    );
    // Seven jobs at t=0: four run, three wait an hour beside four free GPUs.
    assert!(
        (2.9..=3.1).contains(&ours.idle_waiting_gpu_hours),
        "{}",
        ours.idle_waiting_gpu_hours
    );
    assert_eq!(slurm.idle_waiting_gpu_hours, 0.0);
    // Told per job: the three that waited, an hour each beside a free GPU.
    let per_job: Vec<f64> = ours
        .outcomes
        .iter()
        .map(|o| o.idle_waiting_gpu_hours)
        .filter(|&h| h > 0.0)
        .collect();
    assert_eq!(per_job.len(), 3, "{per_job:?}");
    assert!(
        per_job.iter().all(|h| (h - 1.0).abs() < 0.05),
        "{per_job:?}"
    );
    // And in the CSV's team rows (team-a: all of it; team-b: none).
    let csv = gpuflow_sim::dynreport::csv(std::slice::from_ref(&ours));
    let team = |name: &str| {
        csv.lines()
            .find(|l| l.contains(&format!(",team,{name},")))
            .unwrap()
            .rsplit(',')
            .next()
            .unwrap()
            .parse::<f64>()
            .unwrap()
    };
    assert!((team("team-a") - 3.0 / 32.0 * 100.0).abs() < 0.5, "{csv}");
    assert_eq!(team("team-b"), 0.0, "{csv}");
    let pct = gpuflow_sim::dynreport::idle_waiting_pct(&ours);
    assert!((pct - 3.0 / (8.0 * 4.0) * 100.0).abs() < 0.5, "{pct}");
}

/// One GPU and team-a guaranteed it; one-GPU batch jobs submitted at
/// `submits` that declare 10 hours and run 100 s.
fn one_gpu_batch(submits: &[u64]) -> (workload::ClusterSpec, Vec<workload::TraceJob>) {
    let spec = cluster(
        "[[nodes]]\ncount = 1\ngpus = 1\nmodel = \"H100\"\ncpu = 64\nmem_gib = 512\n\n[[queues]]\nname = \"team-a\"\nguaranteed = { H100 = 1 }\n",
    );
    let jobs = submits
        .iter()
        .enumerate()
        .map(|(i, &submit)| workload::TraceJob {
            id: i as u64 + 1,
            submit,
            duration: 100,
            tasks: 1,
            gpu: gpuflow_core::GpuRequest::Whole { count: 1 },
            team: "team-a".into(),
            kind: 3,
            priority: 0,
            max_runtime: Some(36_000),
            model: None,
        })
        .collect();
    (spec, jobs)
}

/// Start estimates are recorded at a job's first cycle and hourly while it
/// waits, and scored against its real start. On one GPU, team-a's jobs
/// declare 10 hours and run 100 s: after the first has run, gpuflow
/// expects the next ones to run as long and tells the third when it will
/// start to within a cycle; Slurm's rule (the declared limit) is hours off.
#[test]
fn start_estimates_are_recorded_and_gpuflow_expects_recent_runtimes() {
    let (spec, jobs) = one_gpu_batch(&[0, 150, 160]);
    let run = |p: SimPolicy| dynamic::simulate(&spec, &jobs, &p, &SimConfig::default(), 1).unwrap();
    let (slurm, ours) = (run(SimPolicy::slurm()), run(SimPolicy::gpuflow()));
    for r in [&slurm, &ours] {
        let third = &r.outcomes[2];
        let start = third.first_start.expect("it starts");
        assert_eq!(third.estimates.len(), 1, "{:?}", third.estimates);
        let (at, eta) = third.estimates[0];
        assert!(at >= third.submit && at < start);
        let err = eta.expect("an estimate").abs_diff(start);
        let a = dynamic::accuracy(r.outcomes.iter());
        eprintln!("{}: estimate off by {err} s; {a:?}", r.policy);
        if r.policy == "gpuflow" {
            assert!(err <= 60, "gpuflow: {err} s off");
        } else {
            assert!(
                err > 30_000,
                "slurm-like counts on the declared limit: {err} s off"
            );
        }
    }
    // Jobs that started at once have no estimate.
    assert!(ours.outcomes[0].estimates.is_empty());
}

/// `predict_runtimes=exact` tells the estimates each job's real runtime,
/// and `log_estimates` keeps each estimate's reasons, written one row an
/// estimate by `estimates_log_csv`. On one GPU the first job declares 10
/// hours and runs 100 s; the second comes while it runs. With nothing run
/// yet, gpuflow's predictor has no history and counts on the declared
/// limit (hours off); told the real runtime, it is right to the cycle.
/// (The third job, long after, only keeps the run going.)
#[test]
fn exact_runtimes_isolate_the_estimate_and_the_log_keeps_its_reasons() {
    let (spec, jobs) = one_gpu_batch(&[0, 10, 1000]);
    let cfg = SimConfig {
        log_estimates: true,
        ..SimConfig::default()
    };
    let run = |p: &SimPolicy| dynamic::simulate(&spec, &jobs, p, &cfg, 1).unwrap();
    let mut exact = SimPolicy::gpuflow();
    exact.tune("predict_runtimes", "exact").unwrap();
    assert!(exact.exact_runtimes && exact.predicts_runtimes);
    let (recent, told) = (run(&SimPolicy::gpuflow()), run(&exact));
    let off = |r: &dynamic::SimResult| {
        let second = &r.outcomes[1];
        let (_, eta) = second.estimates[0];
        eta.expect("an estimate")
            .abs_diff(second.first_start.expect("it starts"))
    };
    assert!(off(&recent) > 30_000, "no history: {} s off", off(&recent));
    assert!(off(&told) <= 60, "told the runtime: {} s off", off(&told));
    // Decisions do not read estimates: the same starts either way.
    let starts =
        |r: &dynamic::SimResult| -> Vec<_> { r.outcomes.iter().map(|o| o.first_start).collect() };
    assert_eq!(starts(&recent), starts(&told));
    // The log: one row per estimate, the reasons as codes, the error in
    // seconds against the real start.
    let second = &told.outcomes[1];
    assert_eq!(second.estimate_reasons.len(), second.estimates.len());
    let csv = gpuflow_sim::dynreport::estimates_log_csv(std::slice::from_ref(&told));
    let rows: Vec<&str> = csv.lines().skip(1).collect();
    assert_eq!(rows.len(), 1, "{csv}");
    let f: Vec<&str> = rows[0].split(',').collect();
    let (at, eta, start) = (
        f[4].parse::<i64>().unwrap(),
        f[5].parse::<i64>().unwrap(),
        f[6].parse::<i64>().unwrap(),
    );
    assert_eq!(f[1], "2", "{csv}");
    assert_eq!(f[7].parse::<i64>().unwrap(), eta - start, "{csv}");
    assert_eq!(f[8].parse::<i64>().unwrap(), start - at, "{csv}");
    assert_eq!(f[9], second.estimate_reasons[0], "{csv}");
    // Its own queue holds the one GPU: no capacity to lend, no node free.
    assert_eq!(f[9], "Quota.NoLendableCapacity+Placement", "{csv}");
    eprintln!("{csv}");
    // Without the flag, no reasons are kept.
    let plain = dynamic::simulate(&spec, &jobs, &exact, &SimConfig::default(), 1).unwrap();
    assert!(plain.outcomes[1].estimate_reasons.is_empty());
}
