//! The `gpuflow` binary, run as a user would.

use std::process::Command;

fn gpuflow(args: &[&str]) -> (i32, String, String) {
    let out = Command::new(env!("CARGO_BIN_EXE_gpuflow"))
        .args(args)
        .output()
        .expect("gpuflow runs");
    (
        out.status.code().unwrap_or(-1),
        String::from_utf8_lossy(&out.stdout).into(),
        String::from_utf8_lossy(&out.stderr).into(),
    )
}

#[test]
fn sim_openb_writes_a_table_a_csv_and_an_svg() {
    let data = gpuflow_sim::openb::default_dir();
    if !data.join(gpuflow_sim::openb::GPU_NODE_LIST).exists() {
        eprintln!("skipped: the openb trace is not at {}", data.display());
        return;
    }
    let out = std::env::temp_dir().join(format!("gpuflow-cli-test-{}", std::process::id()));
    let (code, stdout, stderr) = gpuflow(&[
        "sim",
        "openb",
        "--data",
        data.to_str().unwrap(),
        "--trace",
        "gpushare40",
        "--seeds",
        "42",
        "--policy",
        "random,best-fit",
        "--out",
        out.to_str().unwrap(),
    ]);
    assert_eq!(code, 0, "{stderr}");
    assert!(
        stdout.contains("gpushare40") && stdout.contains("best-fit") && stdout.contains("100%"),
        "{stdout}"
    );
    let csv = std::fs::read_to_string(out.join("openb_gpushare40.csv")).unwrap();
    let rows: Vec<&str> = csv.lines().collect();
    assert_eq!(
        rows[0],
        "trace,policy,seeds,arrived_pct,unallocated_gpu_pct"
    );
    assert_eq!(
        rows.len(),
        1 + 2 * 131,
        "one row per policy and percent 0..=130"
    );
    assert!(
        rows.iter()
            .any(|r| r.starts_with("gpushare40,best-fit,1,100,"))
    );
    let svg = std::fs::read_to_string(out.join("openb_gpushare40.svg")).unwrap();
    assert!(svg.starts_with("<svg") && svg.trim_end().ends_with("</svg>"));
    assert_eq!(svg.matches("<polyline").count(), 2);
    std::fs::remove_dir_all(&out).unwrap();
}

/// `--estimates-log` writes every start estimate with the job's real
/// start and reasons; `predict_runtimes=exact` tells estimates the real
/// runtimes; a value it does not know is refused, naming the choices.
#[test]
fn sim_run_logs_each_estimate_and_can_be_told_exact_runtimes() {
    let out = tempfile::tempdir().unwrap();
    let run = |extra: &[&str]| {
        let mut args = vec![
            "sim",
            "run",
            "--workload",
            "realistic",
            "--hours",
            "24",
            "--gpus",
            "64",
            "--teams",
            "3",
            "--load",
            "1.1",
            "--policy",
            "slurm-like,gpuflow",
            "--out",
            out.path().to_str().unwrap(),
        ];
        args.extend_from_slice(extra);
        gpuflow(&args)
    };
    let (code, _, stderr) = run(&[]);
    assert_eq!(code, 0, "{stderr}");
    assert!(!out.path().join("sim_estimates_log.csv").exists());
    let (code, _, stderr) = run(&[
        "--estimates-log",
        "--tune",
        "gpuflow.predict_runtimes=exact",
    ]);
    assert_eq!(code, 0, "{stderr}");
    assert!(stderr.contains("sim_estimates_log.csv"), "{stderr}");
    let log = std::fs::read_to_string(out.path().join("sim_estimates_log.csv")).unwrap();
    let mut lines = log.lines();
    assert_eq!(
        lines.next(),
        Some("policy,job,team,kind,at_s,estimate_s,start_s,error_s,wait_left_s,reasons")
    );
    let rows: Vec<Vec<&str>> = lines.map(|l| l.split(',').collect()).collect();
    // As many rows per policy as the summary counted estimates.
    let summary = std::fs::read_to_string(out.path().join("sim_estimates.csv")).unwrap();
    for policy in ["slurm-like", "gpuflow"] {
        let counted: usize = summary
            .lines()
            .find(|l| l.starts_with(&format!("{policy},all,")))
            .and_then(|l| l.split(',').nth(2))
            .and_then(|n| n.parse().ok())
            .unwrap_or_else(|| panic!("{policy}: no count in {summary}"));
        let logged = rows.iter().filter(|r| r[0] == policy).count();
        assert!(counted > 0, "{summary}");
        assert!(
            logged >= counted,
            "{policy}: {logged} rows, {counted} scored"
        );
    }
    for r in &rows {
        assert_eq!(r.len(), 10, "{r:?}");
        assert!(!r[9].is_empty(), "an estimate without reasons: {r:?}");
        if let (Ok(e), Ok(s)) = (r[5].parse::<i64>(), r[6].parse::<i64>()) {
            assert_eq!(r[7].parse::<i64>().unwrap(), e - s, "{r:?}");
        }
    }
    let (code, _, stderr) = run(&["--tune", "gpuflow.predict_runtimes=sometimes"]);
    assert_eq!(code, 2, "{stderr}");
    assert!(
        stderr.contains("predict_runtimes=sometimes: expected true, false or exact"),
        "{stderr}"
    );
}

/// A Slurm accounting log replayed under Slurm's rules and gpuflow's: the
/// jobs it read, what it left out, per kind and team.
#[test]
fn sim_run_replays_a_slurm_accounting_log() {
    let log = std::path::Path::new(env!("CARGO_MANIFEST_DIR"))
        .join("../gpuflow-sim/tests/fixtures/sacct.txt");
    let out = tempfile::tempdir().unwrap();
    let (code, stdout, stderr) = gpuflow(&[
        "sim",
        "run",
        "--trace",
        log.to_str().unwrap(),
        "--trace-format",
        "sacct",
        "--gpus",
        "16",
        "--policy",
        "slurm-like,gpuflow",
        "--out",
        out.path().to_str().unwrap(),
    ]);
    assert_eq!(code, 0, "{stderr}");
    assert!(
        stderr.contains("4 jobs read; left out: 1 job steps, 1 never started"),
        "{stderr}"
    );
    for team in ["nlp", "vision", "erin"] {
        assert!(stdout.contains(&format!("gpuflow     {team}")), "{stdout}");
    }
    let jobs = std::fs::read_to_string(out.path().join("sim_jobs.csv")).unwrap();
    assert_eq!(jobs.lines().count(), 1 + 2 * 4, "{jobs}");
    let as_format = |f: &str| {
        gpuflow(&[
            "sim",
            "run",
            "--trace",
            log.to_str().unwrap(),
            "--trace-format",
            f,
        ])
    };
    let (code, _, err) = as_format("slurm");
    assert_eq!(code, 2);
    assert!(err.contains("csv, sacct, helios, openb"), "{err}");
    let (code, _, err) = as_format("helios");
    assert_ne!(code, 0);
    assert!(err.contains("line 1: no column \"job_id\""), "{err}");
    // A window of the log: here its first 10 minutes (jobs at 0 and 300 s).
    let window = |w: &str| {
        gpuflow(&[
            "sim",
            "run",
            "--trace",
            log.to_str().unwrap(),
            "--trace-format",
            "sacct",
            "--gpus",
            "16",
            "--policy",
            "gpuflow",
            "--trace-window",
            w,
        ])
    };
    let (code, _, err) = window("0..0.00694");
    assert_eq!(code, 0, "{err}");
    assert!(
        err.contains("2 jobs read") && err.contains("2 outside the window"),
        "{err}"
    );
    let (code, _, err) = window("5..2");
    assert_eq!(code, 2, "{err}");
    assert!(err.contains("FROM..TO in days"), "{err}");
}

#[test]
fn bad_arguments_exit_2_with_a_message_that_says_what_to_fix() {
    let (code, _, err) = gpuflow(&["sim", "openb", "--policy", "fastest"]);
    assert_eq!(code, 2);
    assert!(err.contains("fastest") && err.contains("best-fit"), "{err}");
    let (code, _, err) = gpuflow(&["sim", "openb", "--seeds", "51..42"]);
    assert_eq!(code, 2);
    assert!(err.contains("LAST must not be below FIRST"), "{err}");
    let (code, _, err) = gpuflow(&["sim", "openb", "--trace", "nope"]);
    assert_eq!(code, 2);
    assert!(err.contains("unknown pod list"), "{err}");
    let (code, _, err) = gpuflow(&["sim", "openb", "--data", "/nonexistent"]);
    assert_eq!(code, 2);
    assert!(err.contains("/nonexistent"), "{err}");
}

#[test]
fn bench_placement_prints_its_figures() {
    let (code, out, err) = gpuflow(&[
        "bench",
        "placement",
        "--nodes",
        "64",
        "--tasks",
        "2000",
        "--gangs",
        "0.1",
    ]);
    assert_eq!(code, 0, "{err}");
    assert!(
        out.contains("task decisions/s") && out.contains("tasks 2"),
        "{out}"
    );
}

#[test]
fn bench_server_cycle_and_submit_print_their_figures() {
    let (code, out, err) = gpuflow(&[
        "bench",
        "server-cycle",
        "--nodes",
        "4",
        "--pending",
        "40",
        "--cycles",
        "1",
    ]);
    assert_eq!(code, 0, "{err}");
    assert!(
        out.contains("cold cycle") && out.contains("median cycle after a small change"),
        "{out}"
    );
    let (code, out, err) = gpuflow(&["bench", "submit", "--jobs", "20", "--clients", "2"]);
    assert_eq!(code, 0, "{err}");
    assert!(out.contains("jobs/s") && out.contains("p99"), "{out}");
}

#[test]
fn k8s_manifests_print_the_crd_and_the_install_and_refuse_bad_values() {
    let (code, out, err) = gpuflow(&[
        "k8s",
        "manifests",
        "--namespace",
        "sched",
        "--image",
        "r.example/gpuflow:1",
        "--replicas",
        "3",
    ]);
    assert_eq!(code, 0, "{err}");
    assert!(
        out.starts_with("---\napiVersion: apiextensions.k8s.io/v1\nkind: CustomResourceDefinition"),
        "{out}"
    );
    assert!(
        out.contains("image: r.example/gpuflow:1")
            && out.contains("replicas: 3")
            && out.contains("namespace: sched")
    );
    let (code, out, _) = gpuflow(&["k8s", "manifests", "--crd"]);
    assert_eq!(code, 0);
    assert!(!out.contains("kind: Deployment"));
    let (code, _, err) = gpuflow(&["k8s", "manifests", "--replicas", "0"]);
    assert_eq!(code, 2, "{err}");
    assert!(err.contains("--replicas"), "{err}");
    let (code, _, err) = gpuflow(&["k8s", "why", "no-slash"]);
    assert_ne!(code, 0);
    assert!(err.contains("NAMESPACE/NAME"), "{err}");
}

#[test]
fn bench_k8s_bind_prints_its_figures() {
    let args = |pods: &'static str| {
        [
            "bench", "k8s-bind", "--nodes", "20", "--pods", pods, "--gang", "4",
        ]
    };
    let (code, out, err) = gpuflow(&args("120"));
    assert_eq!(code, 0, "{err}");
    assert!(out.contains("bound 120") && out.contains("pods/s"), "{out}");
    // Gangs that could never be whole are refused, not left to wait.
    let (code, _, err) = gpuflow(&args("100"));
    assert_eq!(code, 2, "{err}");
    assert!(err.contains("multiple of 40"), "{err}");
}

#[test]
fn bench_cycle_takes_a_setting_and_refuses_an_unknown_or_malformed_one() {
    // A small cluster: the run with a setting prints its cycles.
    let (code, stdout, stderr) = gpuflow(&[
        "bench",
        "cycle",
        "--nodes",
        "20",
        "--teams",
        "2",
        "--projects",
        "2",
        "--pending",
        "200",
        "--cycles",
        "1",
        "--tune",
        "max_reservations=1",
        "--history",
        "--phases",
    ]);
    assert_eq!(code, 0, "{stderr}");
    assert!(stdout.contains("median incremental cycle"), "{stdout}");
    // Where the cycle's time went, phase by phase, and what admission did.
    let line = stdout
        .lines()
        .find(|l| l.trim_start().starts_with("phases (ms): index "))
        .unwrap_or_else(|| panic!("no phases line: {stdout}"));
    for part in [
        "order ",
        "admit ",
        "explain ",
        "rest ",
        "tries ",
        "placements ",
        "victim searches ",
    ] {
        assert!(line.contains(part), "{part:?} missing: {line}");
    }
    let tries: u64 = line
        .split("tries ")
        .nth(1)
        .and_then(|t| t.split(',').next())
        .and_then(|t| t.parse().ok())
        .unwrap_or_else(|| panic!("no count of tries: {line}"));
    assert!(
        tries > 0,
        "a cycle over 200 pending jobs tried none: {line}"
    );
    assert!(stdout.contains("median by phase (ms): index "), "{stdout}");
    let (code, _, stderr) = gpuflow(&["bench", "cycle", "--tune", "reservations=4"]);
    assert_ne!(code, 0);
    assert!(
        stderr.contains("unknown setting") && stderr.contains("max_reservations"),
        "{stderr}"
    );
    let (code, _, stderr) = gpuflow(&["bench", "cycle", "--tune", "max_reservations"]);
    assert_ne!(code, 0);
    assert!(stderr.contains("KEY=VALUE"), "{stderr}");
    let (code, _, stderr) = gpuflow(&["bench", "cycle", "--tune", "history_weight=2"]);
    assert_ne!(code, 0);
    assert!(stderr.contains("not a valid value"), "{stderr}");
}

#[test]
fn the_server_refuses_a_malformed_disruption_budget_and_says_what_to_give() {
    for bad in ["-1", "lots", "NaN"] {
        let arg = format!("--disruption-budget={bad}");
        let (code, _, stderr) = gpuflow(&["server", &arg]);
        assert_eq!(code, 2, "{bad}: {stderr}");
        assert!(
            stderr.contains("is not a budget") && stderr.contains("`none`"),
            "{stderr}"
        );
    }
}

/// Output piped into a reader that stops early (`| head`) ends the command
/// quietly, by SIGPIPE as `cat` does: it panicked with exit code 101
/// before (#38).
#[test]
fn a_closed_pipe_ends_a_client_command_quietly() {
    use std::io::Read;
    use std::os::unix::process::ExitStatusExt;
    let mut child = Command::new(env!("CARGO_BIN_EXE_gpuflow"))
        .args(["completion", "bash"])
        .stdout(std::process::Stdio::piped())
        .stderr(std::process::Stdio::piped())
        .spawn()
        .unwrap();
    // Its output (over 200 KB) is more than the pipe holds: read a little,
    // then hang up.
    let mut first = [0u8; 16];
    child.stdout.take().unwrap().read_exact(&mut first).unwrap();
    let mut err = String::new();
    child
        .stderr
        .take()
        .unwrap()
        .read_to_string(&mut err)
        .unwrap();
    let status = child.wait().unwrap();
    assert!(!err.contains("panicked"), "{err}");
    assert_eq!(status.signal(), Some(libc::SIGPIPE), "{status:?}: {err}");
}
