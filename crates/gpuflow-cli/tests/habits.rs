//! The CLI's conventions, as Slurm and kubectl users expect them: help on
//! every command and flag, shell completions, exit codes (0 ok, 1 the
//! request failed, 2 usage), `job ls` showing active jobs with USER, GPUS,
//! AGE and TIME (`--all`, comma lists, `--no-headers`, `-o yaml|wide`),
//! `--watch` with a bounded count, human times, finished jobs that keep
//! their tasks, and cancelling several jobs or by filter.

mod common;

use std::process::Command;
use std::time::Duration;

use common::*;

const LONG: Duration = Duration::from_secs(60);

fn gpuflow(args: &[&str]) -> (Option<i32>, String, String) {
    let out = Command::new(BIN)
        .args(args)
        .env_remove("GPUFLOW_TOKEN")
        .env_remove("GPUFLOW_SERVER")
        .output()
        .unwrap();
    (
        out.status.code(),
        String::from_utf8_lossy(&out.stdout).into_owned(),
        String::from_utf8_lossy(&out.stderr).into_owned(),
    )
}

/// Every command and option of `gpuflow` and its subcommands (found from
/// their own `--help`) with the ones lacking a description.
fn undocumented(path: &mut Vec<String>, missing: &mut Vec<String>) {
    let args: Vec<&str> = path.iter().map(String::as_str).chain(["--help"]).collect();
    let (_, text, _) = gpuflow(&args);
    let lines: Vec<&str> = text.lines().collect();
    let mut section = "";
    for (i, l) in lines.iter().enumerate() {
        if !l.starts_with(' ') && l.ends_with(':') {
            section = l;
            continue;
        }
        let t = l.trim();
        // A description follows on the same line (after two spaces) or,
        // for long ones, on the next line, indented deeper.
        let described = t.contains("  ")
            || lines
                .get(i + 1)
                .is_some_and(|n| n.starts_with("          ") && !n.trim().is_empty());
        if section == "Commands:" && !t.is_empty() {
            let name = t.split_whitespace().next().unwrap().to_string();
            if name == "help" {
                continue;
            }
            if !described {
                missing.push(format!("{} {name}", path.join(" ")));
            }
            path.push(name);
            undocumented(path, missing);
            path.pop();
        }
        if section == "Options:" && t.starts_with('-') && !described {
            missing.push(format!("{}: {t}", path.join(" ")));
        }
    }
}

#[test]
fn every_command_and_flag_has_help_and_completions_are_generated() {
    let mut missing = Vec::new();
    undocumented(&mut vec![], &mut missing);
    assert!(missing.is_empty(), "without help: {missing:#?}");
    let (code, out, _) = gpuflow(&["completion", "bash"]);
    assert_eq!(code, Some(0));
    assert!(out.contains("_gpuflow") && out.contains("cancel"), "{out}");
    let (code, out, _) = gpuflow(&["completion", "zsh"]);
    assert_eq!(code, Some(0));
    assert!(out.starts_with("#compdef gpuflow"), "{out}");
    let (code, out, _) = gpuflow(&["completion", "fish"]);
    assert_eq!(code, Some(0));
    assert!(out.contains("complete -c gpuflow"), "{out}");
    // Exit codes: a usage error 2, a request that failed 1.
    let (code, _, err) = gpuflow(&["job", "ls", "--server", "127.0.0.1:9", "--token", "x"]);
    assert_eq!(code, Some(2), "{err}");
    let (code, _, err) = gpuflow(&[
        "job",
        "cancel",
        "--server",
        "http://127.0.0.1:9",
        "--token",
        "x",
    ]);
    assert_eq!(code, Some(2), "{err}");
    assert!(err.contains("one or more ids"), "{err}");
    let (code, _, err) = gpuflow(&[
        "job",
        "ls",
        "--server",
        "http://127.0.0.1:9",
        "--token",
        "x",
    ]);
    assert_eq!(code, Some(1), "{err}");
    assert!(err.contains("cannot reach the server"), "{err}");
    let (code, _, _) = gpuflow(&["job", "frobnicate"]);
    assert_eq!(code, Some(2));
    // A misspelt state is a usage error too (it was 1, from the server),
    // and the message lists the states.
    for cmd in ["ls", "cancel"] {
        let (code, _, err) = gpuflow(&[
            "job",
            cmd,
            "--state",
            "runing",
            "--server",
            "http://127.0.0.1:9",
            "--token",
            "x",
        ]);
        assert_eq!(code, Some(2), "{cmd}: {err}");
        assert!(err.contains("states: pending, held"), "{cmd}: {err}");
    }
    // `job logs --help` tells what the server keeps, as the README does.
    let (_, out, _) = gpuflow(&["job", "logs", "--help"]);
    assert!(
        out.contains("whole output") && out.contains("16 MiB"),
        "{out}"
    );
}

#[test]
fn job_ls_get_watch_cancel_and_events_read_as_people_expect() {
    let dir = tempfile::tempdir().unwrap();
    let (_up, api, admin) = up(&dir.path().join("data"), free_port(), "2xemu-gpu", &[]);
    let cli = |args: &[&str]| {
        let mut all = args.to_vec();
        all.extend(["--server", &api.url, "--token", &admin]);
        gpuflow(&all)
    };
    let submit = |name: &str, gpus: u32, script: &str| {
        let (s, v) = api.submit_yaml(&admin, &job_yaml(name, "default", "batch", gpus, script, 1));
        assert_eq!(s, 201, "{v}");
        v["id"].as_u64().unwrap()
    };
    let quick = submit("quick", 1, "echo done");
    api.wait_state(quick, &admin, "succeeded", LONG);
    let long = submit("long", 1, "sleep 300");
    api.wait_state(long, &admin, "running", LONG);
    let wide = submit("wide", 2, "sleep 300");
    poll("the wide job waits", LONG, || {
        (api.job(wide, &admin)["reason"].as_str()?
            != "submitted; waiting for the next scheduling cycle")
            .then_some(())
    });

    // Active jobs by default, newest first, with USER, GPUS, AGE and TIME.
    let (code, out, err) = cli(&["job", "ls"]);
    assert_eq!(code, Some(0), "{err}");
    let head = out.lines().next().unwrap();
    for col in ["ID", "USER", "GPUS", "STATE", "AGE", "TIME"] {
        assert!(head.contains(col), "{head}");
    }
    assert!(out.contains("long") && out.contains("wide"), "{out}");
    assert!(!out.contains("quick"), "finished jobs are hidden: {out}");
    let (_, out, _) = cli(&["job", "ls", "--all"]);
    assert!(out.contains("quick"), "{out}");
    let (_, out, _) = cli(&["job", "ls", "--state", "running,succeeded", "--no-headers"]);
    assert!(
        out.contains("quick") && out.contains("long") && !out.contains("wide"),
        "{out}"
    );
    assert!(!out.contains("STATE"), "no headers: {out}");
    // Every list takes it; a job's own page keeps its tables' headings.
    let (_, out, _) = cli(&["queue", "ls", "--no-headers"]);
    assert!(out.contains("default") && !out.contains("NAME"), "{out}");
    let (_, out, _) = cli(&["queue", "ls"]);
    assert!(out.starts_with("NAME"), "{out}");
    let (_, out, _) = cli(&["job", "ls", "-o", "wide"]);
    assert!(out.lines().next().unwrap().contains("NODES"), "{out}");
    let (_, out, _) = cli(&["job", "ls", "-o", "yaml"]);
    let y: serde_json::Value = serde_norway::from_str(&out).unwrap();
    assert_eq!(y.as_array().unwrap().len(), 2, "{out}");
    // Watching: a bounded number of refreshes.
    let (code, out, _) = cli(&["job", "ls", "--watch", "--interval", "1", "--count", "2"]);
    assert_eq!(code, Some(0));
    assert_eq!(out.matches("--- ").count(), 2, "{out}");
    assert_eq!(out.matches("long").count(), 2, "{out}");
    let (code, out, _) = cli(&["node", "ls", "-w", "--interval", "1", "--count", "2"]);
    assert_eq!(code, Some(0));
    assert_eq!(out.matches("--- ").count(), 2, "{out}");
    let (code, out, _) = cli(&["queue", "ls", "--watch", "--count", "1"]);
    assert_eq!(code, Some(0));
    assert_eq!(out.matches("--- ").count(), 1, "{out}");

    // A finished job keeps its tasks: node, GPU and exit code.
    let (_, out, _) = cli(&["job", "get", &quick.to_string()]);
    let task = out
        .lines()
        .find(|l| l.starts_with("main/0"))
        .unwrap_or_else(|| panic!("no task row: {out}"));
    let cells: Vec<&str> = task.split_whitespace().collect();
    assert_eq!(cells[1], "vm", "{out}");
    assert_eq!(cells[4], "0", "exit code: {out}");

    // Events in local time, not Unix seconds.
    let (_, out, _) = cli(&["event", "ls", "--job", &quick.to_string()]);
    let row = out.lines().nth(1).unwrap();
    let at = row.split_whitespace().nth(1).unwrap();
    assert!(
        at.len() == 10 && at.chars().nth(4) == Some('-'),
        "a date, not Unix seconds: {out}"
    );
    // `event ls` dumped every event: --limit keeps the newest N (oldest
    // first), --since/--until a window (times or how long ago), -w follows.
    let seqs = |out: &str| -> Vec<u64> {
        out.lines()
            .skip(1)
            .filter_map(|l| l.split_whitespace().next()?.parse().ok())
            .collect()
    };
    let (_, all, _) = cli(&["event", "ls"]);
    let all = seqs(&all);
    assert!(all.len() > 4, "{all:?}");
    let (code, out, err) = cli(&["event", "ls", "--limit", "3"]);
    assert_eq!(code, Some(0), "{err}");
    assert_eq!(seqs(&out), all[all.len() - 3..], "{out}");
    let (_, out, _) = cli(&["event", "ls", "--since", "1h"]);
    assert_eq!(seqs(&out), all, "{out}");
    for window in [["--until", "2h"], ["--since", "2099-01-01"]] {
        let (code, out, err) = cli(&["event", "ls", window[0], window[1]]);
        assert_eq!(code, Some(0), "{err}");
        assert!(seqs(&out).is_empty(), "{window:?}: {out}");
    }
    let (code, _, err) = cli(&["event", "ls", "--since", "yesterday-ish"]);
    assert_eq!(code, Some(2), "{err}");
    assert!(err.contains("how long ago"), "{err}");
    let follow = std::process::Command::new(BIN)
        .args([
            "event",
            "ls",
            "--limit",
            "1",
            "-w",
            "--interval",
            "1",
            "--count",
            "4",
        ])
        .args(["--server", &api.url, "--token", &admin])
        .stdout(std::process::Stdio::piped())
        .spawn()
        .unwrap();
    std::thread::sleep(Duration::from_millis(500));
    let (s, v) = api.submit_yaml(&admin, &job_yaml("later", "default", "batch", 1, "true", 1));
    assert_eq!(s, 201, "{v}");
    let out = follow.wait_with_output().unwrap();
    let out = String::from_utf8_lossy(&out.stdout).into_owned();
    assert_eq!(out.matches("SEQ").count(), 1, "one heading: {out}");
    assert!(
        out.contains("submitted by admin"),
        "new events follow: {out}"
    );

    // Several ids at once; a filter matching nothing is not an error.
    let (code, out, err) = cli(&["job", "cancel", &long.to_string(), &wide.to_string()]);
    assert_eq!(code, Some(0), "{err}");
    assert_eq!(out.lines().count(), 2, "{out}");
    let (code, _, err) = cli(&["job", "cancel", "--name", "nosuch"]);
    assert_eq!(code, Some(0));
    assert!(err.contains("no active job matches"), "{err}");
    let again = submit("again", 2, "sleep 300");
    let (code, out, err) = cli(&[
        "job",
        "cancel",
        "--state",
        "pending,running",
        "--user",
        "admin",
    ]);
    assert_eq!(code, Some(0), "{err}");
    assert!(out.contains(&format!("job {again}:")), "{out}");
    // `queue set --quota` changes the guarantee it names and keeps the
    // borrow limit; `queue ls` shows both (and the default queue's "all").
    let (s, v) = api.post_json(
        "/v1/queues",
        &admin,
        &serde_json::json!({"name": "vision", "team": "default", "quotas": {"emu-gpu": {"guaranteed": 1, "borrow_limit": 1}}}),
    );
    assert_eq!(s, 201, "{v}");
    let (code, _, err) = cli(&["queue", "set", "vision", "--quota", "emu-gpu=2"]);
    assert_eq!(code, Some(0), "{err}");
    let qs = api.get("/v1/queues", &admin);
    let q = qs
        .as_array()
        .unwrap()
        .iter()
        .find(|q| q["name"] == "vision")
        .unwrap();
    assert_eq!(q["quotas"]["emu-gpu"]["guaranteed"], 2.0, "{q}");
    assert_eq!(q["quotas"]["emu-gpu"]["borrow_limit"], 1.0, "kept: {q}");
    let (_, out, _) = cli(&["queue", "ls"]);
    assert!(
        out.contains("emu-gpu:2+1") && out.contains("*:all+any"),
        "{out}"
    );
    // --wrap: a command as a job; logs with --tail, --attempt and -f.
    let (code, out, err) = cli(&[
        "job",
        "submit",
        "--wrap",
        "echo one; echo two; echo three",
        "--name",
        "w",
    ]);
    assert_eq!(code, Some(0), "{err}");
    let w: u64 = out.split_whitespace().nth(1).unwrap().parse().unwrap();
    api.wait_state(w, &admin, "succeeded", LONG);
    poll("its output arrives", LONG, || {
        let l = api.get(&format!("/v1/jobs/{w}/logs"), &admin);
        l["tasks"]["main/0"]
            .as_str()
            .filter(|t| t.contains("three"))
            .map(|_| ())
    });
    let (_, out, _) = cli(&["job", "logs", &w.to_string(), "--tail", "1"]);
    assert!(out.contains("three") && !out.contains("one"), "{out}");
    let (code, _, err) = cli(&["job", "logs", &w.to_string(), "--attempt", "7"]);
    assert_eq!(code, Some(2), "{err}");
    assert!(err.contains("kept: 1"), "{err}");
    // stdout and stderr apart.
    let (_, out, _) = cli(&["job", "submit", "--wrap", "echo to-out; echo to-err >&2"]);
    let e: u64 = out.split_whitespace().nth(1).unwrap().parse().unwrap();
    api.wait_state(e, &admin, "succeeded", LONG);
    let l = poll("both streams arrive", LONG, || {
        let l = api.get(&format!("/v1/jobs/{e}/logs"), &admin);
        l["stderr"]["main/0"]
            .as_str()
            .filter(|t| t.contains("to-err"))
            .map(|_| l.clone())
    });
    assert_eq!(l["tasks"]["main/0"], "to-out\n", "{l}");
    assert_eq!(l["stderr"]["main/0"], "to-err\n", "{l}");
    let (_, out, _) = cli(&["job", "logs", &e.to_string()]);
    assert!(
        out.contains("==> main/0 <==\nto-out") && out.contains("==> main/0 (stderr) <==\nto-err"),
        "{out}"
    );
    let (_, out, _) = cli(&["job", "logs", &e.to_string(), "--stream", "stderr"]);
    assert!(out.contains("to-err") && !out.contains("to-out"), "{out}");
    // The server keeps the whole output, far beyond one report's worth
    // (about 290 KiB here), every line once and in order.
    let (_, out, _) = cli(&["job", "submit", "--wrap", "seq 1 50000"]);
    let big: u64 = out.split_whitespace().nth(1).unwrap().parse().unwrap();
    api.wait_state(big, &admin, "succeeded", LONG);
    let out = poll("the whole output arrives", LONG, || {
        let (_, out, _) = cli(&["job", "logs", &big.to_string()]);
        out.contains("\n50000\n").then_some(out)
    });
    let lines: Vec<&str> = out.lines().skip(1).collect();
    let want: Vec<String> = (1..=50000).map(|i| i.to_string()).collect();
    assert!(lines == want, "{} lines: {:?}…", lines.len(), &lines[..3]);
    let (code, out, err) = cli(&[
        "job",
        "submit",
        "--wrap",
        "for i in 1 2 3; do echo line$i; sleep 1; done",
    ]);
    assert_eq!(code, Some(0), "{err}");
    let f = out.split_whitespace().nth(1).unwrap().to_string();
    let (code, out, err) = cli(&["job", "logs", &f, "-f"]);
    assert_eq!(code, Some(0), "{err}");
    for l in ["line1", "line2", "line3"] {
        assert_eq!(out.matches(l).count(), 1, "followed once each: {out}");
    }
    // Cancelling a finished job fails the request: exit 1.
    let (code, _, err) = cli(&["job", "cancel", &quick.to_string()]);
    assert_eq!(code, Some(1), "{err}");
    assert!(err.contains("has finished (succeeded)"), "{err}");
}

/// Notebooks live at most their queue's lifetime: one without a max
/// runtime takes it and is stopped when it is reached (cancelled, with a
/// `lifetime-reached` event), one asking for longer is refused.
#[test]
fn a_notebook_is_stopped_at_its_queues_maximum_lifetime() {
    let dir = tempfile::tempdir().unwrap();
    let (_up, api, admin) = up(&dir.path().join("data"), free_port(), "1xemu-gpu", &[]);
    let (s, v) = api.call(
        "PATCH",
        "/v1/queues/default",
        &admin,
        Some(("application/json", br#"{"notebook_max_lifetime_s": 3}"#)),
    );
    assert_eq!(s, 200, "{v}");
    let nb = |extra: &str| {
        format!(
            "name: nb\nqueue: default\nkind: notebook\n{extra}tasks:\n  - name: main\n    command: [sleep, '300']\n    resources: {{cpu: 0.1, memory_mib: 64, gpu: {{count: 1}}}}\n"
        )
    };
    let (s, v) = api.submit_yaml(&admin, &nb("max_runtime_s: 10\n"));
    assert_eq!(s, 400, "{v}");
    assert!(
        v["message"].as_str().unwrap().contains("beyond the 3 s"),
        "{v}"
    );
    let (s, v) = api.submit_yaml(&admin, &nb(""));
    assert_eq!(s, 201, "{v}");
    let id = v["id"].as_u64().unwrap();
    assert_eq!(api.job(id, &admin)["spec"]["max_runtime_s"], 3);
    api.wait_state(id, &admin, "running", LONG);
    let j = api.wait_state(id, &admin, "cancelled", LONG);
    assert!(
        j["reason"]
            .as_str()
            .unwrap()
            .contains("maximum lifetime of 3 s"),
        "{j}"
    );
    let events = api.get(&format!("/v1/events?job={id}"), &admin);
    assert!(
        events
            .as_array()
            .unwrap()
            .iter()
            .any(|e| e["kind"] == "lifetime-reached"),
        "{events}"
    );
}

/// A 1,000-element array in one submission: each element knows its index,
/// at most `%3` run at once while GPUs are free, `why` says so, `ls` shows
/// the elements by index, and one call cancels them all.
#[test]
fn a_thousand_element_array_runs_within_its_limit_and_is_cancelled_as_a_whole() {
    let dir = tempfile::tempdir().unwrap();
    let (_up, api, admin) = up(&dir.path().join("data"), free_port(), "4xemu-gpu", &[]);
    let cli = |args: &[&str]| {
        let mut all = args.to_vec();
        all.extend(["--server", &api.url, "--token", &admin]);
        gpuflow(&all)
    };
    let file = dir.path().join("sweep.yaml");
    std::fs::write(
        &file,
        job_yaml(
            "sweep",
            "default",
            "batch",
            1,
            "echo index $GPUFLOW_ARRAY_INDEX; sleep 300",
            1,
        ),
    )
    .unwrap();
    let (code, out, err) = cli(&[
        "job",
        "submit",
        "-f",
        file.to_str().unwrap(),
        "--array",
        "0-999%3",
    ]);
    assert_eq!(code, Some(0), "{err}");
    assert!(out.contains("1000 jobs"), "{out}");
    let first: u64 = out
        .split_whitespace()
        .nth(1)
        .and_then(|w| w.trim_end_matches(':').parse().ok())
        .unwrap_or_else(|| panic!("{out}"));
    // Three run (four GPUs are free), never more.
    let active = || -> Vec<serde_json::Value> {
        api.get(
            &format!("/v1/jobs?array={first}&state=admitted,starting,running,stopping"),
            &admin,
        )
        .as_array()
        .unwrap()
        .clone()
    };
    poll("three elements run", LONG, || {
        let a = active();
        assert!(a.len() <= 3, "more than %3 at once: {}", a.len());
        (a.iter().filter(|j| j["state"] == "running").count() == 3).then_some(())
    });
    for _ in 0..5 {
        assert!(active().len() <= 3);
        std::thread::sleep(Duration::from_millis(300));
    }
    // Each element knows its index.
    let running = active();
    let one = &running[0];
    let index = one["array"]["index"].as_u64().unwrap();
    let logs = poll("an element logs its index", LONG, || {
        let l = api.get(&format!("/v1/jobs/{}/logs", one["id"]), &admin);
        let t = l["tasks"]["main/0"].as_str()?.to_string();
        (!t.is_empty()).then_some(t)
    });
    assert!(logs.contains(&format!("index {index}")), "{logs}");
    // A waiting element says why.
    let last = first + 999;
    let why = api.get(&format!("/v1/jobs/{last}/why"), &admin);
    assert!(
        why["summary"]
            .as_str()
            .unwrap()
            .contains("runs at most 3 elements at once"),
        "{why}"
    );
    let (_, out, _) = cli(&["job", "ls", "--array", &first.to_string(), "--limit", "2"]);
    assert!(
        out.contains("sweep[999]") && out.contains("sweep[998]"),
        "{out}"
    );
    // One call cancels the whole array.
    let (code, out, err) = cli(&["job", "cancel", "--array", &first.to_string()]);
    assert_eq!(code, Some(0), "{err}");
    assert!(out.contains("997 cancelled, 3 stopping"), "{out}");
    poll("every element ends", LONG, || {
        (api.get(&format!("/v1/jobs?array={first}&state=cancelled"), &admin)
            .as_array()?
            .len()
            == 1000)
            .then_some(())
    });
}

/// `job submit -d` as `sbatch --dependency` is used, on a real agent: a
/// stage waits for the one before it to succeed, and a failed stage
/// cancels the stage that needed it, with the reason.
#[test]
fn a_dependency_holds_a_stage_until_the_one_before_it_succeeds() {
    let dir = tempfile::tempdir().unwrap();
    let (_up, api, admin) = up(&dir.path().join("data"), free_port(), "2xemu-gpu", &[]);
    let cli = |args: &[&str]| {
        let mut all = args.to_vec();
        all.extend(["--server", &api.url, "--token", &admin, "-o", "json"]);
        let (code, out, err) = gpuflow(&all);
        assert_eq!(code, Some(0), "{args:?}: {err}");
        serde_json::from_str::<serde_json::Value>(&out).unwrap()["id"]
            .as_u64()
            .unwrap()
    };
    let first = cli(&["job", "submit", "--wrap", "sleep 3"]);
    let dep = format!("afterok:{first}");
    let second = cli(&["job", "submit", "--wrap", "exit 3", "-d", &dep]);
    let dep = format!("afterok:{second}");
    let third = cli(&["job", "submit", "--wrap", "true", "--dependency", &dep]);
    let j = api.job(second, &admin);
    assert_eq!(j["state"], "pending", "{j}");
    assert_eq!(j["spec"]["dependency"], format!("afterok:{first}"), "{j}");
    api.wait_state(first, &admin, "succeeded", LONG);
    api.wait_state(second, &admin, "failed", LONG);
    let j = api.wait_state(third, &admin, "cancelled", LONG);
    let reason = j["reason"].as_str().unwrap();
    assert!(
        reason.contains(&format!("afterok:{second}: job {second} failed")),
        "{reason}"
    );
    // The second never started before the first ended.
    let (a, b) = (api.job(first, &admin), api.job(second, &admin));
    assert!(
        b["started_at"].as_u64().unwrap() >= a["finished_at"].as_u64().unwrap(),
        "{a}\n{b}"
    );
    // A dependency that can no longer be met is refused, exit code 1.
    let (code, _, err) = gpuflow(&[
        "job", "submit", "--wrap", "true", "-d", &dep, "--server", &api.url, "--token", &admin,
    ]);
    assert_eq!(code, Some(1), "{err}");
    assert!(err.contains("can never be met"), "{err}");
}

/// A member cancelling another team's job is told once, and which jobs
/// they may see (it said "job 3: job 3 not found", then the count); it
/// learns nothing of the other team's job.
#[test]
fn cancelling_another_teams_job_says_so_once() {
    let dir = tempfile::tempdir().unwrap();
    let (_up, api, admin) = up(&dir.path().join("data"), free_port(), "1xemu-gpu", &[]);
    let (mallory, victor) = api.alpha_and_beta(&admin);
    let (s, v) = api.submit_yaml(
        &victor,
        "name: v\nqueue: beta-q\nkind: batch\ntasks:\n  - name: main\n    command: [sleep, '300']\n",
    );
    assert_eq!(s, 201, "{v}");
    let id = v["id"].as_u64().unwrap().to_string();
    let (code, _, err) = gpuflow(&[
        "job", "cancel", &id, "--server", &api.url, "--token", &mallory,
    ]);
    assert_eq!(code, Some(1), "{err}");
    assert_eq!(err.matches("not found").count(), 1, "{err}");
    assert!(err.contains("among team \"alpha\"'s jobs"), "{err}");
    assert!(!err.contains("beta"), "{err}");
    assert_ne!(api.job(id.parse().unwrap(), &admin)["state"], "cancelled");
}

/// `job ls` as squeue shows an array: its pending elements one row
/// (`ID_[2-9]`), `--expand` each; a START column with when a job started or
/// is expected to; `--since/--until` as sacct's window.
#[test]
fn job_ls_collapses_an_arrays_pending_elements_and_shows_when_jobs_start() {
    let dir = tempfile::tempdir().unwrap();
    let (_up, api, admin) = up(&dir.path().join("data"), free_port(), "2xemu-gpu", &[]);
    let cli = |args: &[&str]| ok(&api, &admin, args);
    let spec = format!(
        "{}max_runtime_s: 600\narray: 0-9\n",
        job_yaml("sweep", "default", "batch", 1, "sleep 300", 1)
    );
    let (s, v) = api.submit_yaml(&admin, &spec);
    assert_eq!(s, 201, "{v}");
    let first = v["id"].as_u64().unwrap();
    api.wait_state(first + 1, &admin, "running", LONG);
    // The pending ones have an estimate once a cycle has seen them.
    let pending = poll("an estimate for a pending element", LONG, || {
        let j = api.job(first + 9, &admin);
        j["eta"].as_u64().map(|_| j)
    });
    assert_eq!(pending["state"], "pending", "{pending}");
    let out = cli(&["job", "ls"]);
    let rows: Vec<&str> = out.lines().skip(1).collect();
    assert_eq!(
        rows.len(),
        3,
        "two running elements and one row for eight: {out}"
    );
    let collapsed = rows
        .iter()
        .find(|r| r.starts_with(&format!("{first}_[2-9]")))
        .unwrap_or_else(|| panic!("{out}"));
    assert!(collapsed.contains("sweep[2-9]"), "{out}");
    let start = out
        .lines()
        .next()
        .unwrap()
        .find("START")
        .expect("a START column");
    assert!(collapsed[start..].starts_with("in "), "an estimate: {out}");
    let running = rows
        .iter()
        .find(|r| r.starts_with(&format!("{first} ")))
        .unwrap_or_else(|| panic!("{out}"));
    assert_eq!(running[start..].chars().nth(2), Some(':'), "HH:MM: {out}");
    assert_eq!(cli(&["job", "ls", "--expand"]).lines().count(), 11);
    assert_eq!(
        cli(&["job", "ls", "--array", &first.to_string()])
            .lines()
            .count(),
        11
    );
    // A window: submitted before an hour ago, none; active in the last
    // five minutes, all (finished ones too).
    assert_eq!(cli(&["job", "ls", "--until", "1h"]).lines().count(), 1);
    assert_eq!(
        cli(&["job", "ls", "--since", "5m", "--expand"])
            .lines()
            .count(),
        11
    );
}

/// `node get` and `node ls` show what blocks work on a node: CPU and
/// memory allocated (the quick start's hidden blocker), each GPU and who
/// holds it, MIG layout, pool, labels and jobs (`-o wide`); another
/// team's member sees that a job is there, not which.
#[test]
fn node_get_and_wide_ls_show_allocation_gpus_and_jobs() {
    let dir = tempfile::tempdir().unwrap();
    let (_up, api, admin) = up(&dir.path().join("data"), free_port(), "2xemu-gpu", &[]);
    let (mallory, _) = api.alpha_and_beta(&admin);
    let (s, v) = api.submit_yaml(
        &admin,
        "name: held\nqueue: default\nkind: batch\ntasks:\n  - name: main\n    command: [sleep, '300']\n    resources: {cpu: 0.5, memory_mib: 2048, gpu: {count: 1}}\n",
    );
    assert_eq!(s, 201, "{v}");
    let id = v["id"].as_u64().unwrap();
    api.wait_state(id, &admin, "running", LONG);
    let node = api.get("/v1/nodes", &admin)[0]["name"]
        .as_str()
        .unwrap()
        .to_string();
    let run = |token: &str, args: &[&str]| {
        let mut all = args.to_vec();
        all.extend(["--server", &api.url, "--token", token]);
        let (code, out, err) = gpuflow(&all);
        assert_eq!(code, Some(0), "{args:?}: {err}");
        out
    };
    let ls = run(&admin, &["node", "ls"]);
    let row = ls.lines().nth(1).unwrap();
    assert!(row.contains(" 0.5/"), "cpu allocated: {ls}");
    assert!(row.contains(" 2.0/"), "memory allocated: {ls}");
    let wide = run(&admin, &["node", "ls", "-o", "wide"]);
    assert!(wide.lines().next().unwrap().contains("JOBS"), "{wide}");
    assert!(
        wide.lines().nth(1).unwrap().ends_with(&id.to_string()),
        "{wide}"
    );
    let get = run(&admin, &["node", "get", &node]);
    assert!(get.contains(&format!("jobs {id}")), "{get}");
    assert!(
        get.contains(&format!("job {id}")) && get.contains("free"),
        "{get}"
    );
    let theirs = run(&mallory, &["node", "get", &node]);
    assert!(theirs.contains("1 of other teams"), "{theirs}");
    assert!(!theirs.contains(&format!("job {id}")), "{theirs}");
    let (code, _, err) = gpuflow(&[
        "node", "get", "nosuch", "--server", &api.url, "--token", &admin,
    ]);
    assert_eq!(code, Some(1), "{err}");
    assert!(err.contains(&format!("nodes: {node}")), "{err}");
}

/// `queue set` changes every field the API takes, not only weight, state
/// and guarantees (budgets, notebook lifetime and idle policy, user limits
/// were raw `curl -X PATCH`), keeping what it does not name.
#[test]
fn queue_set_changes_every_field_and_keeps_the_rest() {
    let dir = tempfile::tempdir().unwrap();
    let (_up, api, admin) = up(&dir.path().join("data"), free_port(), "1xemu-gpu", &[]);
    let set = |args: &[&str]| {
        let mut all = vec!["queue", "set", "default"];
        all.extend(args);
        all.extend(["--server", &api.url, "--token", &admin]);
        gpuflow(&all)
    };
    let queue = || api.get("/v1/queues", &admin)[0].clone();
    let before = queue();
    let guaranteed = before["quotas"]["*"]["guaranteed"].clone();
    for args in [
        vec![
            "--borrow-limit",
            "*=2",
            "--cap",
            "*=3",
            "--lend-limit",
            "*=1",
        ],
        vec!["--user-max-gpus", "1", "--user-max-running", "2"],
        vec!["--notebook-max-lifetime", "8h"],
        vec![
            "--notebook-idle-after",
            "30m",
            "--notebook-idle-action",
            "suspend",
        ],
        vec!["--budget-gpu-hours", "100", "--budget-period", "week"],
    ] {
        let (code, _, err) = set(&args);
        assert_eq!(code, Some(0), "{args:?}: {err}");
    }
    let q = queue();
    let quota = &q["quotas"]["*"];
    assert_eq!(quota["guaranteed"], guaranteed, "{q}");
    assert_eq!(quota["borrow_limit"], 2.0, "{q}");
    assert_eq!(quota["cap"], 3.0, "{q}");
    assert_eq!(quota["lend_limit"], 1.0, "{q}");
    assert_eq!(q["user_limits"]["max_gpus"], 1.0, "{q}");
    assert_eq!(q["user_limits"]["max_running"], 2, "{q}");
    assert_eq!(q["notebook_max_lifetime_s"], 28800, "{q}");
    assert_eq!(q["notebook_idle"]["after_s"], 1800, "{q}");
    assert_eq!(q["notebook_idle"]["action"], "suspend", "{q}");
    assert_eq!(q["budget"]["gpu_hours"], 100.0, "{q}");
    assert_eq!(q["budget"]["period"], "week", "{q}");
    // `none` lifts a limit; the others stay.
    let (code, _, err) = set(&["--borrow-limit", "*=none", "--user-max-gpus", "none"]);
    assert_eq!(code, Some(0), "{err}");
    let q = queue();
    assert!(q["quotas"]["*"]["borrow_limit"].is_null(), "{q}");
    assert_eq!(q["quotas"]["*"]["cap"], 3.0, "{q}");
    assert!(q["user_limits"]["max_gpus"].is_null(), "{q}");
    assert_eq!(q["user_limits"]["max_running"], 2, "{q}");
    // Usage errors say what to write.
    for (args, says) in [
        (vec![], "nothing to change"),
        (vec!["--cap", "*=x"], "not a number or none"),
        (vec!["--cap", "three"], "FLAVOR=GPUS"),
        (vec!["--notebook-max-lifetime", "soon"], "not a duration"),
    ] {
        let (code, _, err) = set(&args);
        assert_eq!(code, Some(2), "{args:?}: {err}");
        assert!(err.contains(says), "{args:?}: {err}");
    }
}

/// `gpuflow webhook create` on a running platform: a job run by the real
/// agent POSTs `begin` and `end` to a receiver on loopback (`up` lets
/// webhooks call this machine), and `webhook deliveries` shows both.
#[test]
fn a_webhook_tells_a_receiver_when_a_job_begins_and_ends() {
    use std::io::{Read, Write};
    let dir = tempfile::tempdir().unwrap();
    let (_up, api, admin) = up(&dir.path().join("data"), free_port(), "1xemu-gpu", &[]);
    let listener = std::net::TcpListener::bind("127.0.0.1:0").unwrap();
    let port = listener.local_addr().unwrap().port();
    let (tx, rx) = std::sync::mpsc::channel::<String>();
    std::thread::spawn(move || {
        for conn in listener.incoming() {
            let Ok(mut conn) = conn else { continue };
            let mut buf = vec![0u8; 65536];
            let mut got = Vec::new();
            // Headers, then the body its content-length says.
            while let Ok(n) = conn.read(&mut buf) {
                if n == 0 {
                    break;
                }
                got.extend_from_slice(&buf[..n]);
                let text = String::from_utf8_lossy(&got).to_string();
                if let Some((head, body)) = text.split_once("\r\n\r\n") {
                    let len = head
                        .lines()
                        .find_map(|l| {
                            l.to_ascii_lowercase()
                                .strip_prefix("content-length:")
                                .map(|v| v.trim().parse::<usize>().unwrap_or(0))
                        })
                        .unwrap_or(0);
                    if body.len() >= len {
                        break;
                    }
                }
            }
            let _ = conn
                .write_all(b"HTTP/1.1 200 OK\r\ncontent-length: 0\r\nconnection: close\r\n\r\n");
            let _ = tx.send(String::from_utf8_lossy(&got).into_owned());
        }
    });
    let cli = |args: &[&str]| ok(&api, &admin, args);
    let url = format!("http://127.0.0.1:{port}/hook");
    let out = cli(&["webhook", "create", &url, "--events", "begin,end"]);
    assert!(out.contains("secret"), "{out}");
    let id = out.split_whitespace().nth(1).unwrap().to_string();
    let out = cli(&["job", "submit", "--wrap", "sleep 1", "-o", "json"]);
    let job: u64 = serde_json::from_str::<serde_json::Value>(&out).unwrap()["id"]
        .as_u64()
        .unwrap();
    api.wait_state(job, &admin, "succeeded", LONG);
    let mut events = Vec::new();
    while events.len() < 2 {
        let req = rx
            .recv_timeout(Duration::from_secs(20))
            .unwrap_or_else(|_| panic!("two POSTs, got {events:?}"));
        assert!(
            req.to_ascii_lowercase()
                .contains("x-gpuflow-signature: sha256="),
            "{req}"
        );
        let body = req.split_once("\r\n\r\n").unwrap().1;
        let v: serde_json::Value = serde_json::from_str(body).unwrap();
        assert_eq!(v["job"]["id"], job, "{v}");
        events.push(v["event"].as_str().unwrap().to_string());
    }
    assert_eq!(events, ["begin", "end"]);
    let log = cli(&["webhook", "deliveries", &id]);
    assert_eq!(log.matches("delivered").count(), 2, "{log}");
    assert!(cli(&["webhook", "ls"]).contains(&url));
    cli(&["webhook", "rm", &id]);
    assert!(!cli(&["webhook", "ls"]).contains(&url));
}

/// #35's walk-through: a job without an estimate was told "unknown (the
/// work it waits for declares no max runtime)" though nothing ran without
/// one. The CLI guessed a cause; it now says "unknown" and the reasons
/// (here: its queue is held) say why it waits.
#[test]
fn a_job_without_an_estimate_is_not_given_an_invented_cause() {
    let dir = tempfile::tempdir().unwrap();
    let (_up, api, admin) = up(&dir.path().join("data"), free_port(), "1xemu-gpu", &[]);
    let cli = |args: &[&str]| ok(&api, &admin, args);
    cli(&["queue", "set", "default", "--state", "held"]);
    let out = cli(&["job", "submit", "--wrap", "true", "-o", "json"]);
    let id = serde_json::from_str::<serde_json::Value>(&out).unwrap()["id"]
        .as_u64()
        .unwrap()
        .to_string();
    let why = poll("why says the queue is held", LONG, || {
        let out = cli(&["job", "why", &id]);
        out.contains("held").then_some(out)
    });
    assert!(why.contains("estimated start: unknown"), "{why}");
    assert!(!why.contains("max runtime"), "{why}");
}

/// `gpuflow reservation` as `scontrol create reservation` is used for a
/// maintenance window: jobs stay off the node, `job why` says until when,
/// `node ls` shows it, and deleting it lets the job start.
#[test]
fn a_maintenance_reservation_holds_a_node_until_it_is_removed() {
    let dir = tempfile::tempdir().unwrap();
    let (_up, api, admin) = up(&dir.path().join("data"), free_port(), "1xemu-gpu", &[]);
    let node = api.get("/v1/nodes", &admin)[0]["name"]
        .as_str()
        .unwrap()
        .to_string();
    let cli = |args: &[&str]| ok(&api, &admin, args);
    let out = cli(&[
        "reservation",
        "create",
        "fix",
        "--maintenance",
        "--duration",
        "2h",
        "--nodes",
        &node,
    ]);
    assert!(out.contains(&format!("reservation fix on {node}")), "{out}");
    assert!(cli(&["reservation", "ls"]).contains("maintenance"));
    let out = cli(&[
        "job", "submit", "--wrap", "true", "--gpus", "1", "-o", "json",
    ]);
    let id: u64 = serde_json::from_str::<serde_json::Value>(&out).unwrap()["id"]
        .as_u64()
        .unwrap();
    let why = poll("why names the window", LONG, || {
        let out = cli(&["job", "why", &id.to_string()]);
        out.contains("maintenance \"fix\"").then_some(out)
    });
    assert!(
        why.contains("estimated start") || why.contains("in "),
        "{why}"
    );
    assert!(cli(&["node", "ls"]).contains("+reserved"));
    cli(&["reservation", "rm", "fix"]);
    api.wait_state(id, &admin, "succeeded", LONG);
}

/// `gpuflow ARGS` against `api` as `token`, which must succeed: its output.
fn ok(api: &Api, token: &str, args: &[&str]) -> String {
    let mut all = args.to_vec();
    all.extend(["--server", &api.url, "--token", token]);
    let (code, out, err) = gpuflow(&all);
    assert_eq!(code, Some(0), "{args:?}: {err}");
    out
}

/// `gpuflow` with `env` set (and GPUFLOW_TOKEN, GPUFLOW_SERVER and
/// GPUFLOW_CONTEXT unset unless given) and `input` on stdin.
fn gpuflow_env(args: &[&str], env: &[(&str, &str)], input: &str) -> (Option<i32>, String, String) {
    use std::io::Write;
    let mut cmd = Command::new(BIN);
    cmd.args(args)
        .env_remove("GPUFLOW_TOKEN")
        .env_remove("GPUFLOW_SERVER")
        .env_remove("GPUFLOW_CONTEXT")
        .stdin(std::process::Stdio::piped())
        .stdout(std::process::Stdio::piped())
        .stderr(std::process::Stdio::piped());
    for (k, v) in env {
        cmd.env(k, v);
    }
    let mut child = cmd.spawn().unwrap();
    child
        .stdin
        .take()
        .unwrap()
        .write_all(input.as_bytes())
        .unwrap();
    let out = child.wait_with_output().unwrap();
    (
        out.status.code(),
        String::from_utf8_lossy(&out.stdout).into_owned(),
        String::from_utf8_lossy(&out.stderr).into_owned(),
    )
}

/// Contexts as kubectl has them: named servers and tokens in a file only
/// the user reads, one current, `--context` for another; `whoami` says who
/// the server takes you for and where the credentials came from; a refused
/// token is told why and where the CLI found it.
#[test]
fn contexts_keep_servers_apart_and_whoami_says_who_and_whence() {
    use std::os::unix::fs::PermissionsExt;
    let dir = tempfile::tempdir().unwrap();
    let (_up, api, admin) = up(&dir.path().join("data"), free_port(), "1xemu-gpu", &[]);
    let member = api.team_with_member(&admin, "alpha", "ann", "member");
    let config = dir.path().join("conf").join("config");
    let cfg = config.to_str().unwrap();
    let env = [("GPUFLOW_CONFIG", cfg)];
    let run = |args: &[&str], input: &str| gpuflow_env(args, &env, input);
    let ok = |args: &[&str], input: &str| {
        let (code, out, err) = run(args, input);
        assert_eq!(code, Some(0), "{args:?}: {err}");
        out
    };
    ok(
        &[
            "config",
            "set-context",
            "local",
            "--server",
            &api.url,
            "--token-stdin",
        ],
        &format!("{admin}\n"),
    );
    ok(
        &[
            "config",
            "set-context",
            "ann",
            "--server",
            &api.url,
            "--token-stdin",
        ],
        &format!("{member}\n"),
    );
    let mode = std::fs::metadata(&config).unwrap().permissions().mode();
    assert_eq!(mode & 0o777, 0o600);
    // Making contexts leaves the current one as it was (none: commands go
    // where they went before); use-context picks one.
    let text = std::fs::read_to_string(&config).unwrap();
    assert!(!text.contains("current-context"), "{text}");
    let (code, _, err) = run(&["config", "current-context"], "");
    assert_eq!(code, Some(2), "{err}");
    ok(&["config", "use-context", "local"], "");
    let out = ok(&["config", "get-contexts"], "");
    assert!(
        out.lines()
            .any(|l| l.starts_with('*') && l.contains("local")),
        "{out}"
    );
    let out = ok(&["whoami"], "");
    assert!(out.contains("user:        admin"), "{out}");
    assert!(
        out.contains(&format!("context \"local\" in {cfg}")),
        "{out}"
    );
    // --context picks another, for one command.
    let out = ok(&["whoami", "--context", "ann"], "");
    assert!(
        out.contains("user:        ann") && out.contains("team:        alpha"),
        "{out}"
    );
    assert!(
        out.contains("role:        member") && out.contains("signed in:   with token"),
        "{out}"
    );
    ok(&["config", "use-context", "ann"], "");
    assert_eq!(ok(&["config", "current-context"], "").trim(), "ann");
    // GPUFLOW_TOKEN wins over the current context, not over --context.
    let bogus = [("GPUFLOW_CONFIG", cfg), ("GPUFLOW_TOKEN", "gft_bogus")];
    let (code, _, err) = gpuflow_env(&["whoami"], &bogus, "");
    assert_eq!(code, Some(1), "{err}");
    assert!(
        err.contains("not one this server made") && err.contains("came from GPUFLOW_TOKEN"),
        "{err}"
    );
    let (code, out, err) = gpuflow_env(&["whoami", "--context", "ann"], &bogus, "");
    assert_eq!(code, Some(0), "{err}");
    assert!(out.contains("user:        ann"), "{out}");
    // A context's token goes to its own server only.
    let (code, _, err) = run(&["whoami", "--server", "http://127.0.0.1:9"], "");
    assert_eq!(code, Some(2), "{err}");
    assert!(err.contains("no token"), "{err}");
    // Revoked: said by whom, and where the CLI found the token.
    let me: serde_json::Value = serde_json::from_str(&ok(&["whoami", "-o", "json"], "")).unwrap();
    let id = me["token_id"].as_str().unwrap().to_string();
    ok(&["token", "revoke", &id, "--context", "local"], "");
    let (code, _, err) = run(&["job", "ls"], "");
    assert_eq!(code, Some(1), "{err}");
    assert!(err.contains("revoked by admin at"), "{err}");
    assert!(
        err.contains(&format!("came from context \"ann\" in {cfg}")),
        "{err}"
    );
    // Usage errors: a context that is not there; a file others may read.
    let (code, _, err) = run(&["whoami", "--context", "nope"], "");
    assert_eq!(code, Some(2), "{err}");
    assert!(err.contains("its contexts: local, ann"), "{err}");
    let (code, _, err) = run(&["config", "set-context", "new"], "");
    assert_eq!(code, Some(2), "{err}");
    assert!(err.contains("--server"), "{err}");
    std::fs::set_permissions(&config, std::fs::Permissions::from_mode(0o644)).unwrap();
    let (code, _, err) = run(&["whoami"], "");
    assert_eq!(code, Some(2), "{err}");
    assert!(err.contains("chmod 600"), "{err}");
}
