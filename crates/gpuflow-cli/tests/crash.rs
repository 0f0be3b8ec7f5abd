//! Crash safety: `kill -9` the server while hundreds of jobs are being
//! submitted and scheduled, restart it on the same data directory, and check
//! that no acknowledged job is lost or duplicated, no GPU is allocated twice
//! and running work keeps running.

mod common;

use std::sync::{Arc, Mutex};
use std::time::Duration;

use common::*;
use serde_json::Value;

const JOBS: usize = 300;

#[test]
fn kill_9_while_submitting_loses_and_duplicates_nothing() {
    let dir = tempfile::tempdir().unwrap();
    let port = free_port();
    let srv = server(dir.path(), port, &[]);
    let url = srv.url.clone();
    let _agent = agent(dir.path(), &url, "n1", "8");
    let api = Api::new(&url);
    let admin = admin_token(dir.path());

    // A long job that must survive the crash untouched.
    let (survivor, pid) = survivor(&api, &admin, dir.path());

    // Submit from another thread, through the crash.
    let acked: Arc<Mutex<Vec<(usize, u64)>>> = Arc::default();
    let submitter = submitter(vec![url.clone()], admin.clone(), 0..JOBS, acked.clone());
    poll(
        "a hundred acknowledged submissions",
        Duration::from_secs(120),
        || (acked.lock().unwrap().len() >= 100).then_some(()),
    );
    srv.proc.crash();
    std::thread::sleep(Duration::from_millis(500));
    let srv = server(dir.path(), port, &[]);
    let failed = submitter.join().unwrap();
    let acked = acked.lock().unwrap().clone();
    assert!(failed > 0, "the crash happened while submitting");
    assert_eq!(acked.len(), JOBS, "every job was acknowledged in the end");

    // Every acknowledged job is there once, under its id; nothing is duplicated.
    let all = api.get("/v1/jobs?limit=1000", &admin);
    check_acknowledged_once(&all, &acked);

    // No GPU allocated twice, now and while the backlog drains.
    let done = |jobs: &Value| {
        jobs.as_array().unwrap().iter().all(|j| {
            j["id"].as_u64() == Some(survivor) || matches!(j["state"].as_str(), Some("succeeded"))
        })
    };
    poll("every job finishes", Duration::from_secs(240), || {
        let jobs = api.get("/v1/jobs?limit=1000", &admin);
        check_no_double_allocation(&jobs);
        done(&jobs).then_some(())
    });

    // The survivor kept running through it all: same attempt, same process.
    let j = api.job(survivor, &admin);
    assert_eq!(j["state"], "running", "{j}");
    assert_eq!(j["attempts"], 1, "{j}");
    assert!(alive(pid), "the survivor's process died");
    drop(srv);
}
