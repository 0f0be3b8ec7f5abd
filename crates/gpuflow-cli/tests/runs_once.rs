//! Every job runs once: agents killed with `kill -9` over many rounds while
//! short jobs run and finish, `gpuflow up` stopped and started again on its
//! data directory, and a second server on a data directory in use.

mod common;

use std::time::Duration;

use common::*;
use serde_json::Value;

const LONG: Duration = Duration::from_secs(120);

/// How many times each task directory of `job` on `node` was run (one line
/// per start, written by the task itself).
fn runs(dir: &std::path::Path, node: &str, job: u64) -> Vec<(String, usize)> {
    let Ok(entries) = std::fs::read_dir(dir.join(format!("work-{node}/job-{job}"))) else {
        return vec![];
    };
    let mut out: Vec<(String, usize)> = entries
        .filter_map(Result::ok)
        .map(|e| {
            let n = std::fs::read_to_string(e.path().join("runs")).map_or(0, |s| s.lines().count());
            (e.file_name().to_string_lossy().into_owned(), n)
        })
        .collect();
    out.sort();
    out
}

#[test]
fn agents_killed_over_many_rounds_rerun_no_finished_task() {
    const JOBS: u64 = 40;
    const ROUNDS: u64 = 12;
    let dir = tempfile::tempdir().unwrap();
    let srv = server(dir.path(), free_port(), &[]);
    let api = Api::new(&srv.url);
    let admin = admin_token(dir.path());
    let mut agent1 = Some(agent(dir.path(), &srv.url, "n1", "4"));
    let mut ids = vec![];
    for i in 0..JOBS {
        // Short tasks of different lengths, each counting its own starts.
        let script = format!("echo $$ >> runs; sleep 0.{}; exit 0", 2 + i % 8);
        let (s, v) = api.submit_yaml(
            &admin,
            &job_yaml(&format!("j{i}"), "default", "batch", 1, &script, 1),
        );
        assert_eq!(s, 201, "{v}");
        ids.push(v["id"].as_u64().unwrap());
    }
    // Kill the agent at odd moments; start it again after a pause shorter
    // than half the lease (so its keepers do not fence the work).
    let mut seed: u64 = 7;
    let mut next = || {
        seed = seed
            .wrapping_mul(6364136223846793005)
            .wrapping_add(1442695040888963407);
        (seed >> 33) % 1000
    };
    for _ in 0..ROUNDS {
        std::thread::sleep(Duration::from_millis(300 + next()));
        agent1.take().unwrap().crash();
        std::thread::sleep(Duration::from_millis(next() * 2));
        agent1 = Some(agent(dir.path(), &srv.url, "n1", "4"));
    }
    let jobs = poll("every job finishes", LONG, || {
        let v = api.get("/v1/jobs?limit=1000", &admin);
        v.as_array()?
            .iter()
            .all(|j| ["succeeded", "failed", "cancelled"].contains(&j["state"].as_str().unwrap()))
            .then_some(v)
    });
    let mut failures = vec![];
    for j in jobs.as_array().unwrap() {
        let id = j["id"].as_u64().unwrap();
        if j["state"] != "succeeded" {
            failures.push(format!("job {id} {}: {}", j["state"], j["reason"]));
        }
        if j["started_at"].is_null() {
            failures.push(format!("job {id} finished without a start: {j}"));
        }
        for (task, n) in runs(dir.path(), "n1", id) {
            if n > 1 {
                failures.push(format!("job {id} task {task} ran {n} times"));
            }
        }
    }
    let events: Value = api.get("/v1/events?limit=1000", &admin);
    let requeued = events
        .as_array()
        .unwrap()
        .iter()
        .filter(|e| e["kind"] == "requeued")
        .count();
    println!("{JOBS} jobs, {ROUNDS} agent crashes, {requeued} attempts requeued");
    assert!(failures.is_empty(), "{}", failures.join("\n"));
    assert_eq!(ids.len() as u64, JOBS);
}

#[test]
fn restarting_gpuflow_up_ends_the_interrupted_attempt_and_runs_a_new_one() {
    let dir = tempfile::tempdir().unwrap();
    let data = dir.path().join("data");
    let port = free_port();
    let (first, api, admin) = up(&data, port, "1", &[]);
    let (s, v) = api.submit_yaml(
        &admin,
        &job_yaml(
            "long",
            "default",
            "training",
            1,
            "echo attempt $GPUFLOW_ATTEMPT; exec sleep 300",
            1,
        ),
    );
    assert_eq!(s, 201, "{v}");
    let id = v["id"].as_u64().unwrap();
    api.wait_state(id, &admin, "running", LONG);
    poll("attempt 1 logs", LONG, || {
        let l = api.get(&format!("/v1/jobs/{id}/logs"), &admin);
        l["tasks"]["main/0"]
            .as_str()?
            .contains("attempt 1")
            .then_some(())
    });
    drop(first);
    let (_second, api, admin) = up(&data, port, "1", &[]);
    // The interrupted attempt ends with an event, and a new one runs.
    let j = poll("attempt 2 runs", LONG, || {
        let j = api.job(id, &admin);
        (j["state"] == "running" && j["attempts"] == 2).then_some(j)
    });
    let events = api.get(&format!("/v1/events?job={id}"), &admin);
    let requeued: Vec<&Value> = events
        .as_array()
        .unwrap()
        .iter()
        .filter(|e| e["kind"] == "requeued")
        .collect();
    assert_eq!(requeued.len(), 1, "{events}");
    assert!(
        requeued[0]["message"]
            .as_str()
            .unwrap()
            .contains("stopped on its node"),
        "{events}"
    );
    // Both attempts' logs are kept.
    let logs = poll("attempt 2 logs", LONG, || {
        let l = api.get(&format!("/v1/jobs/{id}/logs"), &admin);
        l["tasks"]["main/0"]
            .as_str()?
            .contains("attempt 2")
            .then_some(l)
    });
    assert!(
        logs["attempts"]["1"]["main/0"]
            .as_str()
            .unwrap()
            .contains("attempt 1"),
        "{logs}"
    );
    let _ = j;
}

#[test]
fn a_second_server_on_a_data_directory_in_use_is_refused() {
    let dir = tempfile::tempdir().unwrap();
    let _srv = server(dir.path(), free_port(), &[]);
    let out = std::process::Command::new(BIN)
        .args([
            "server",
            "--listen",
            &format!("127.0.0.1:{}", free_port()),
            "--data-dir",
        ])
        .arg(dir.path().join("data"))
        .output()
        .unwrap();
    let err = String::from_utf8_lossy(&out.stderr);
    assert_eq!(out.status.code(), Some(1), "{err}");
    assert!(err.contains("another gpuflow server is running"), "{err}");
}
