//! Real job history read as traces: a small log of each format (in
//! `tests/fixtures/`), what each row becomes, what is left out and why,
//! and malformed rows refused with their line.

use std::path::{Path, PathBuf};

use gpuflow_core::GpuRequest;
use gpuflow_sim::import::{Format, KindRule, cluster, import};
use gpuflow_sim::workload::KINDS;

fn fixture(name: &str) -> PathBuf {
    Path::new(env!("CARGO_MANIFEST_DIR"))
        .join("tests/fixtures")
        .join(name)
}

/// (team, submit, duration, tasks, GPUs a task, kind, max runtime) of each job.
fn rows(path: &Path, format: Format) -> (Vec<String>, String) {
    let got = import(path, format, KindRule::BySize).unwrap();
    let jobs = got
        .jobs
        .iter()
        .map(|j| {
            let gpus = match &j.gpu {
                GpuRequest::Whole { count } => count.to_string(),
                GpuRequest::Fraction { milli, .. } => format!("{}m", milli.0),
                other => format!("{other:?}"),
            };
            format!(
                "{} {} t={} d={} {}x{} {} max={:?}",
                j.id, j.team, j.submit, j.duration, j.tasks, gpus, KINDS[j.kind], j.max_runtime
            )
        })
        .collect();
    (jobs, got.skipped_text())
}

#[test]
fn sacct_allocations_become_jobs_by_account() {
    let (jobs, skipped) = rows(&fixture("sacct.txt"), Format::Sacct);
    assert_eq!(
        jobs,
        [
            // No account: the user is the team.
            "0 erin t=0 d=3600 1x2 training max=Some(5400)",
            "1 vision t=300 d=2400 1x1 notebook max=Some(3600)",
            // 16 GPUs on 2 nodes.
            "2 nlp t=600 d=86400 2x8 training max=Some(172800)",
            "3 vision t=900 d=14400 1x1 batch max=Some(14400)",
        ]
    );
    assert_eq!(
        skipped,
        "1 job steps, 1 never started, 1 still running, 1 without a GPU"
    );
}

/// A window of a long log (the study's 21-day windows): the jobs
/// submitted in it, the first at 0, the others counted as left out.
#[test]
fn a_window_keeps_the_jobs_submitted_in_it() {
    let mut got = import(&fixture("sacct.txt"), Format::Sacct, KindRule::BySize).unwrap();
    got.window(300, 900);
    let kept: Vec<(u64, u64, String)> = got
        .jobs
        .iter()
        .map(|j| (j.id, j.submit, j.team.clone()))
        .collect();
    assert_eq!(
        kept,
        [(0, 0, "vision".to_string()), (1, 300, "nlp".to_string())]
    );
    assert!(
        got.skipped_text().contains("2 outside the window"),
        "{}",
        got.skipped_text()
    );
}

#[test]
fn helios_jobs_become_jobs_by_virtual_cluster() {
    let (jobs, skipped) = rows(&fixture("helios.csv"), Format::Helios);
    assert_eq!(
        jobs,
        [
            "0 vcA t=0 d=14400 1x1 batch max=None",
            "1 vcA t=60 d=1200 1x1 notebook max=None",
            "2 vcB t=120 d=36000 2x8 training max=None",
        ]
    );
    assert_eq!(skipped, "1 never started, 1 without a GPU");
}

#[test]
fn openb_pods_arrive_run_and_leave() {
    let (jobs, skipped) = rows(&fixture("openb.csv"), Format::Openb);
    assert_eq!(
        jobs,
        [
            // A shared GPU: its part of one.
            "0 BE t=0 d=1740 1x460m notebook max=None",
            "1 LS t=100 d=3600 1x1 batch max=None",
            "2 LS t=200 d=7140 1x4 training max=None",
        ]
    );
    assert_eq!(skipped, "1 never started, 1 without a GPU");
}

#[test]
fn a_kind_for_every_job_and_a_cluster_in_proportion_to_demand() {
    let got = import(&fixture("sacct.txt"), Format::Sacct, KindRule::All(3)).unwrap();
    assert!(got.jobs.iter().all(|j| KINDS[j.kind] == "batch"));
    let spec = cluster(&got.jobs, 64);
    assert_eq!(spec.nodes[0].count, 8);
    let g: Vec<(String, u64, u64)> = spec
        .queues
        .iter()
        .map(|q| (q.name.clone(), q.guaranteed["H100"], q.borrow_limit["H100"]))
        .collect();
    // GPU-seconds: nlp 1,382,400, vision 16,800, erin 7,200.
    assert_eq!(
        g,
        [
            ("erin".to_string(), 1, 32),
            ("nlp".to_string(), 62, 32),
            ("vision".to_string(), 1, 32),
        ]
    );
}

/// Each malformed row is refused with its file, line and what to fix.
#[test]
fn malformed_rows_are_refused_with_their_line() {
    let dir = tempfile::tempdir().unwrap();
    let cases: [(&str, Format, &str, &str); 7] = [
        (
            "sacct",
            Format::Sacct,
            "JobID|Submit|Start|End|AllocTRES\n1|2024-03-01T08:00:00|2024-03-01T08:00:01|2024-03-01T09:00:00|gres/gpu=1\n2|2024-03-01T08:00:00|soon|2024-03-01T09:00:00|gres/gpu=1\n",
            "line 3: Start \"soon\": expected a time",
        ),
        (
            "sacct",
            Format::Sacct,
            "JobID|Submit|End|AllocTRES\n1|2024-03-01T08:00:00|2024-03-01T09:00:00|gres/gpu=1\n",
            "line 1: no column \"Start\" in the header",
        ),
        (
            "sacct",
            Format::Sacct,
            "JobID|Submit|Start|End|AllocTRES\n1|2024-03-01T08:00:00|2024-03-01T08:00:01|2024-03-01T09:00:00\n",
            "line 2: 4 fields where the header has 5",
        ),
        (
            "sacct",
            Format::Sacct,
            "JobID|Submit|Start|End|AllocTRES|Timelimit\n1|2024-03-01T08:00:00|2024-03-01T08:00:01|2024-03-01T09:00:00|gres/gpu=1|forever\n",
            "line 2: Timelimit \"forever\"",
        ),
        (
            "helios",
            Format::Helios,
            "job_id,user,vc,gpu_num,cpu_num,node_num,state,submit_time,start_time,end_time,duration,queue\nj1,u,vc,two,4,1,COMPLETED,2020-04-01 10:00:00,2020-04-01 10:00:05,2020-04-01 10:20:05,1200,5\n",
            "line 2: gpu_num \"two\": expected a whole number",
        ),
        (
            "openb",
            Format::Openb,
            "name,cpu_milli,memory_mib,num_gpu,gpu_milli,gpu_spec,qos,pod_phase,creation_time,deletion_time,scheduled_time\np0,1000,1024,2,500,,LS,Running,0,100,0\n",
            "line 2: gpu_milli 500 with num_gpu 2",
        ),
        ("openb", Format::Openb, "", "line 1: empty file"),
    ];
    for (i, (name, format, text, want)) in cases.into_iter().enumerate() {
        let path = dir.path().join(format!("{name}-{i}"));
        std::fs::write(&path, text).unwrap();
        let e = import(&path, format, KindRule::BySize)
            .unwrap_err()
            .to_string();
        assert!(e.contains(want), "case {i}: {e}");
        assert!(e.contains(&path.display().to_string()), "case {i}: {e}");
    }
}
