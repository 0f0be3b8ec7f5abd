//! The dynamic simulator: the four-team study and its inputs.

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
