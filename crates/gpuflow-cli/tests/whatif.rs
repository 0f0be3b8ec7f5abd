//! `gpuflow sim whatif` on a workload the platform really ran: jobs queued
//! on two emulated GPUs, replayed with four GPUs more, wait less; members
//! cannot read the recorded workload; bad changes are refused with the
//! forms that work.

mod common;

use std::process::Command;
use std::time::Duration;

use common::*;
use serde_json::{Value, json};

const LONG: Duration = Duration::from_secs(90);

fn whatif(api: &Api, token: &str, args: &[&str]) -> (bool, String, String) {
    let out = Command::new(BIN)
        .args(["sim", "whatif", "--server", &api.url, "--token", token])
        .args(args)
        .output()
        .unwrap();
    (
        out.status.success(),
        String::from_utf8_lossy(&out.stdout).into_owned(),
        String::from_utf8_lossy(&out.stderr).into_owned(),
    )
}

#[test]
fn adding_gpus_to_the_recorded_workload_shortens_its_waits() {
    let dir = tempfile::tempdir().unwrap();
    let (_up, api, admin) = up(&dir.path().join("data"), free_port(), "2xemu-gpu", &[]);
    let member = api.team_with_member(&admin, "vision", "vera", "member");
    let (s, v) = api.post_json(
        "/v1/queues",
        &admin,
        &json!({"name": "vision-q", "team": "vision", "quotas": {"emu-gpu": {"guaranteed": 2}}}),
    );
    assert_eq!(s, 201, "{v}");
    // Eight one-GPU jobs of about three seconds on two GPUs: they queue.
    let ids: Vec<u64> = (0..8)
        .map(|i| {
            let (s, v) = api.submit_yaml(
                &member,
                &job_yaml(&format!("j{i}"), "vision-q", "batch", 1, "sleep 3", 1),
            );
            assert_eq!(s, 201, "{v}");
            v["id"].as_u64().unwrap()
        })
        .collect();
    for id in &ids {
        api.wait_state(*id, &member, "succeeded", LONG);
    }

    // A member may not read every team's workload.
    let (ok, _, err) = whatif(&api, &member, &["--change", "2x2xemu-gpu"]);
    assert!(!ok);
    assert!(err.contains("admin"), "{err}");
    // A change that is no change is refused with the forms.
    let (ok, _, err) = whatif(&api, &admin, &["--change", "lots"]);
    assert!(!ok);
    assert!(err.contains("NODESxGPUSxMODEL"), "{err}");
    let (ok, _, err) = whatif(&api, &admin, &["--change", "-3xemu-gpu"]);
    assert!(!ok);
    assert!(err.contains("has 1"), "{err}");

    // Two nodes of two GPUs more.
    let (ok, out, err) = whatif(
        &api,
        &admin,
        &[
            "--change",
            "2x2xemu-gpu",
            "--cycle-s",
            "1",
            "--from",
            "1h",
            "--output",
            "json",
        ],
    );
    assert!(ok, "{err}");
    let v: Value = serde_json::from_str(&out).unwrap();
    assert_eq!(v["jobs"], 8, "{v}");
    let (now, then) = (&v["now"], &v["whatif"]);
    assert_eq!(
        (now["gpus"].as_u64(), then["gpus"].as_u64()),
        (Some(2), Some(6))
    );
    let (p95_now, p95_then) = (
        now["wait_p95_h"].as_f64().unwrap(),
        then["wait_p95_h"].as_f64().unwrap(),
    );
    assert!(
        p95_now > 0.0 && p95_then < p95_now,
        "waits with more GPUs: {p95_then} h, not below {p95_now} h: {v}"
    );
    assert_eq!(then["unfinished"], 0, "{v}");
    assert_eq!(now["teams"]["vision"]["share"], 1.0, "{v}");
    // The same work in less time on more GPUs: lower utilisation.
    assert!(
        then["utilisation"].as_f64().unwrap() < now["utilisation"].as_f64().unwrap(),
        "{v}"
    );

    // Without --cycle-s the replay cycles as the server does (every
    // 200 ms here, so every second): a 60 s default made jobs that waited
    // a minute look as if they waited seven.
    let (ok, out, err) = whatif(
        &api,
        &admin,
        &[
            "--change",
            "2x2xemu-gpu",
            "--from",
            "1h",
            "--output",
            "json",
        ],
    );
    assert!(ok, "{err}");
    let v: Value = serde_json::from_str(&out).unwrap();
    assert_eq!(v["cycle_s"], 1, "{v}");

    // The table says the same to a person.
    let (ok, out, err) = whatif(&api, &admin, &["--change", "2x2xemu-gpu", "--cycle-s", "1"]);
    assert!(ok, "{err}");
    assert!(out.contains("replayed 8 recorded jobs"), "{out}");
    assert!(
        out.contains("WHAT-IF") && out.contains("vision: wait p95"),
        "{out}"
    );
    eprintln!("{out}");
}
