//! Job dependencies through the real router, heartbeats and cycle (#38):
//! `afterok`, `afterany`, `aftercorr` and `singleton` as Slurm users write
//! them; a dependency that can never be met cancels or holds its job; a
//! dependency on another team's job is refused.

mod support;

use serde_json::{Value, json};
use support::{H, harness};

/// Teams `ml` and `other`, each with a queue (`ml-q`, `other-q`) and a
/// member; node `n1` with 4 H100s. The members' tokens and the node's.
async fn setup(h: &H) -> (String, String, String) {
    let a = &h.admin;
    let mut tokens = Vec::new();
    for team in ["ml", "other"] {
        let (s, v) = h.json("POST", "/v1/teams", a, json!({"name": team})).await;
        assert_eq!(s, 201, "{v}");
        let (s, v) = h
            .json(
                "POST",
                "/v1/queues",
                a,
                json!({"name": format!("{team}-q"), "team": team, "quotas": {"H100": {"guaranteed": 2}}}),
            )
            .await;
        assert_eq!(s, 201, "{v}");
        let user = format!("{team}-member");
        let (s, v) = h
            .json(
                "POST",
                "/v1/users",
                a,
                json!({"name": user, "team": team, "role": "member"}),
            )
            .await;
        assert_eq!(s, 201, "{v}");
        let (s, v) = h.json("POST", "/v1/tokens", a, json!({"user": user})).await;
        assert_eq!(s, 201, "{v}");
        tokens.push(v["token"].as_str().unwrap().to_string());
    }
    let (s, v) = h
        .json(
            "POST",
            "/v1/agent/register",
            &h.join,
            json!({"node": "n1", "inventory": inventory()}),
        )
        .await;
    assert_eq!(s, 200, "{v}");
    (
        tokens.remove(0),
        tokens.remove(0),
        v["node_token"].as_str().unwrap().to_string(),
    )
}

fn inventory() -> Value {
    let gpus: Vec<Value> = (0..4)
        .map(|i| json!({"index": i, "uuid": format!("GPU-{i}"), "model": "H100", "memory_mib": 81920}))
        .collect();
    json!({"cpu_milli": 64000, "memory_mib": 262144, "gpus": gpus, "emulated": true})
}

/// Submits a one-GPU job of `ml-q` with these extra spec lines; the status
/// and the answer.
async fn submit(h: &H, token: &str, name: &str, extra: &str) -> (u16, Value) {
    let spec = format!(
        "name: {name}\nqueue: ml-q\nkind: batch\n{extra}tasks:\n  - name: main\n    command: [sleep, '1000']\n    resources: {{cpu: 1, memory_mib: 1024, gpu: {{count: 1}}}}\n"
    );
    h.call(
        "POST",
        "/v1/jobs",
        Some(token),
        "application/yaml",
        spec.into_bytes(),
    )
    .await
}

async fn id_of(h: &H, token: &str, name: &str, extra: &str) -> u64 {
    let (s, v) = submit(h, token, name, extra).await;
    assert_eq!(s, 201, "{v}");
    v["id"].as_u64().unwrap()
}

/// Node `n1` reports these jobs' tasks: `running`, or exited with `code`.
async fn beat(h: &H, node: &str, jobs: &[u64], code: Option<i32>) {
    let attempts: Vec<u32> = {
        let w = h.shared.world.lock().await;
        jobs.iter()
            .map(|id| w.jobs().get(id).map_or(0, |j| j.attempts))
            .collect()
    };
    let tasks: Vec<Value> = jobs
        .iter()
        .zip(attempts)
        .map(|(id, attempt)| {
            let phase = if code.is_some() { "exited" } else { "running" };
            json!({"job": id, "attempt": attempt, "group": 0, "index": 0, "phase": phase, "exit_code": code})
        })
        .collect();
    let (s, v) = h
        .json(
            "POST",
            "/v1/agent/heartbeat",
            node,
            json!({"node": "n1", "inventory": inventory(), "tasks": tasks}),
        )
        .await;
    assert_eq!(s, 200, "{v}");
}

/// Runs `id` to its end with `code`.
async fn finish(h: &H, node: &str, id: u64, code: i32) {
    beat(h, node, &[id], None).await;
    beat(h, node, &[id], Some(code)).await;
}

async fn cycle(h: &H) {
    gpuflow_server::cycle::run_once(&h.shared).await.unwrap();
}

async fn job(h: &H, id: u64) -> Value {
    let (s, v) = h.get(&format!("/v1/jobs/{id}"), &h.admin).await;
    assert_eq!(s, 200, "{v}");
    v
}

async fn state(h: &H, id: u64) -> String {
    job(h, id).await["state"].as_str().unwrap().to_string()
}

async fn why(h: &H, id: u64) -> String {
    let (s, v) = h.get(&format!("/v1/jobs/{id}/why"), &h.admin).await;
    assert_eq!(s, 200, "{v}");
    v["summary"].as_str().unwrap().to_string()
}

/// A three-stage pipeline: prepare, train after prepare succeeds,
/// evaluate after train succeeds, and a report after train ends however.
/// Each stage starts only when its dependency holds and `why` says what it
/// waits for; a failed stage cancels the stage that needed it to succeed,
/// with the reason, and its dependants in turn, while the report runs.
#[tokio::test]
async fn a_pipeline_runs_stage_by_stage_and_a_failed_stage_cancels_its_dependants() {
    let h = harness(None).await;
    let (ml, _, node) = setup(&h).await;
    let prepare = id_of(&h, &ml, "prepare", "").await;
    let train = id_of(
        &h,
        &ml,
        "train",
        &format!("dependency: afterok:{prepare}\n"),
    )
    .await;
    let eval = id_of(&h, &ml, "eval", &format!("dependency: afterok:{train}\n")).await;
    let publish = id_of(&h, &ml, "publish", &format!("dependency: afterok:{eval}\n")).await;
    let report = id_of(
        &h,
        &ml,
        "report",
        &format!("dependency: afterany:{train}\n"),
    )
    .await;
    cycle(&h).await;
    assert_eq!(state(&h, prepare).await, "admitted");
    for id in [train, eval, publish, report] {
        assert_eq!(state(&h, id).await, "pending", "job {id}");
    }
    let w = why(&h, train).await;
    assert!(
        w.contains(&format!(
            "dependency afterok:{prepare}: waits for job {prepare} to succeed"
        )),
        "{w}"
    );
    finish(&h, &node, prepare, 0).await;
    cycle(&h).await;
    assert_eq!(state(&h, train).await, "admitted");
    assert_eq!(state(&h, eval).await, "pending");
    assert_eq!(state(&h, report).await, "pending");
    // Training fails: evaluation can never run, nor what needs it; the
    // report, which waits for training to end however, runs.
    finish(&h, &node, train, 3).await;
    assert_eq!(state(&h, train).await, "failed");
    cycle(&h).await;
    let e = job(&h, eval).await;
    assert_eq!(e["state"], "cancelled", "{e}");
    let reason = e["reason"].as_str().unwrap();
    assert!(
        reason.contains(&format!("afterok:{train}: job {train} failed")),
        "{reason}"
    );
    assert_eq!(state(&h, report).await, "admitted");
    cycle(&h).await;
    let p = job(&h, publish).await;
    assert_eq!(p["state"], "cancelled", "{p}");
    assert!(
        p["reason"]
            .as_str()
            .unwrap()
            .contains(&format!("job {eval} was cancelled")),
        "{p}"
    );
    // Each cancellation is an event.
    let (_, events) = h.get(&format!("/v1/events?job={eval}"), &h.admin).await;
    assert!(
        events
            .as_array()
            .unwrap()
            .iter()
            .any(|e| e["kind"] == "dependency-never-met"),
        "{events}"
    );
}

/// `aftercorr`: element i of one array waits for element i of another to
/// succeed; an index the other array lacks waits for nothing, and a failed
/// counterpart cancels only its own element.
#[tokio::test]
async fn an_array_element_waits_for_its_counterpart_only() {
    let h = harness(None).await;
    let (ml, _, node) = setup(&h).await;
    let (s, v) = submit(&h, &ml, "a", "array: 0-2\n").await;
    assert_eq!(s, 201, "{v}");
    let a = v["id"].as_u64().unwrap();
    let (s, v) = submit(
        &h,
        &ml,
        "b",
        &format!("array: 0-3\ndependency: aftercorr:{a}\n"),
    )
    .await;
    assert_eq!(s, 201, "{v}");
    let b = v["id"].as_u64().unwrap();
    cycle(&h).await;
    for k in 0..3 {
        assert_eq!(state(&h, a + k).await, "admitted");
        assert_eq!(state(&h, b + k).await, "pending");
    }
    // b's index 3 has no counterpart in a: it does not wait.
    assert_eq!(state(&h, b + 3).await, "admitted");
    finish(&h, &node, a, 0).await;
    finish(&h, &node, a + 1, 1).await;
    cycle(&h).await;
    assert_eq!(state(&h, b).await, "admitted");
    let b1 = job(&h, b + 1).await;
    assert_eq!(b1["state"], "cancelled", "{b1}");
    assert_eq!(state(&h, b + 2).await, "pending");
    let w = why(&h, b + 2).await;
    assert!(w.contains(&format!("aftercorr:{}", a + 2)), "{w}");
    // A job that is not an array cannot ask for aftercorr.
    let (s, v) = submit(&h, &ml, "c", &format!("dependency: aftercorr:{a}\n")).await;
    assert_eq!(s, 400, "{v}");
    assert!(
        v["message"].as_str().unwrap().contains("not an array")
            || v.to_string().contains("not an array"),
        "{v}"
    );
}

/// What a dependency may not name is refused at submission, saying what
/// is wrong: another team's job, a job that does not exist, an index an
/// array lacks, a dependency that can already never be met, a form Slurm
/// users might write that is not supported. Nothing is stored.
#[tokio::test]
async fn a_dependency_that_cannot_hold_is_refused_at_submission() {
    let h = harness(None).await;
    let (ml, other, node) = setup(&h).await;
    let theirs = {
        let spec = "name: t\nqueue: other-q\nkind: batch\ntasks:\n  - name: main\n    command: [sleep, '1']\n";
        let (s, v) = h
            .call(
                "POST",
                "/v1/jobs",
                Some(&other),
                "application/yaml",
                spec.as_bytes().to_vec(),
            )
            .await;
        assert_eq!(s, 201, "{v}");
        v["id"].as_u64().unwrap()
    };
    let failed = id_of(&h, &ml, "f", "").await;
    cycle(&h).await;
    finish(&h, &node, failed, 1).await;
    let (s, v) = submit(&h, &ml, "arr", "array: 0-1\n").await;
    assert_eq!(s, 201, "{v}");
    let arr = v["id"].as_u64().unwrap();
    let before = h.stored_jobs().await;
    for (dep, says) in [
        (
            format!("afterok:{theirs}"),
            "may depend only on jobs of its own team",
        ),
        ("afterok:99999".to_string(), "job 99999 does not exist"),
        (
            format!("afterok:{failed}"),
            &format!("afterok:{failed} can never be met: job {failed} failed"),
        ),
        (
            format!("afternotok:{arr}_7"),
            &format!("array {arr} has no index 7"),
        ),
        (format!("afterok:{failed}_0"), "is not an array"),
        ("afterok:1?afterany:2".to_string(), "not supported"),
        ("afterok".to_string(), "names no job"),
    ] {
        let (s, v) = submit(&h, &ml, "x", &format!("dependency: \"{dep}\"\n")).await;
        assert_eq!(s, 400, "{dep}: {v}");
        let text = v.to_string();
        assert!(text.contains(says), "{dep}: {text}");
        assert!(
            text.contains("dependency"),
            "{dep}: names the field: {text}"
        );
    }
    assert_eq!(h.stored_jobs().await, before, "nothing was stored");
    // Depending on a whole array waits for every element.
    let all = id_of(&h, &ml, "all", &format!("dependency: afterany:{arr}\n")).await;
    cycle(&h).await;
    assert_eq!(state(&h, all).await, "pending");
    let w = why(&h, all).await;
    assert!(w.contains("and 1 more"), "{w}");
}

/// `on_unmet_dependency: hold` holds the job instead, with the reason; an
/// admin's release runs it without that dependency.
#[tokio::test]
async fn a_job_asked_to_be_held_is_held_and_runs_once_released() {
    let h = harness(None).await;
    let (ml, _, node) = setup(&h).await;
    let first = id_of(&h, &ml, "first", "").await;
    let second = id_of(
        &h,
        &ml,
        "second",
        &format!("dependency: afterok:{first}\non_unmet_dependency: hold\n"),
    )
    .await;
    cycle(&h).await;
    finish(&h, &node, first, 1).await;
    cycle(&h).await;
    let j = job(&h, second).await;
    assert_eq!(j["state"], "held", "{j}");
    assert!(
        j["reason"].as_str().unwrap().contains("can never be met"),
        "{j}"
    );
    let (s, v) = h
        .json(
            "POST",
            &format!("/v1/jobs/{second}/release"),
            &h.admin,
            json!({}),
        )
        .await;
    assert_eq!(s, 200, "{v}");
    cycle(&h).await;
    assert_eq!(state(&h, second).await, "admitted");
}

/// `singleton`: a job waits while an earlier job of the same name and user
/// is unfinished, as Slurm's does.
#[tokio::test]
async fn a_singleton_waits_for_the_earlier_job_of_its_name() {
    let h = harness(None).await;
    let (ml, _, node) = setup(&h).await;
    let first = id_of(&h, &ml, "nightly", "").await;
    let second = id_of(&h, &ml, "nightly", "dependency: singleton\n").await;
    let other = id_of(&h, &ml, "other", "dependency: singleton\n").await;
    cycle(&h).await;
    assert_eq!(state(&h, first).await, "admitted");
    assert_eq!(state(&h, other).await, "admitted");
    assert_eq!(state(&h, second).await, "pending");
    let w = why(&h, second).await;
    assert!(
        w.contains(&format!("singleton: waits for job {first}")),
        "{w}"
    );
    finish(&h, &node, first, 0).await;
    cycle(&h).await;
    assert_eq!(state(&h, second).await, "admitted");
}

/// `--test-only` of a job that waits for another says so, not "would start
/// now".
#[tokio::test]
async fn a_test_only_submission_with_a_dependency_says_what_it_waits_for() {
    let h = harness(None).await;
    let (ml, _, _) = setup(&h).await;
    let first = id_of(&h, &ml, "first", "").await;
    for (extra, says) in [
        (
            format!("dependency: afterok:{first}\n"),
            format!("waits for job {first} to succeed"),
        ),
        (
            "dependency: singleton\n".to_string(),
            format!("singleton: waits for job {first}"),
        ),
    ] {
        let spec = format!(
            "name: first\nqueue: ml-q\nkind: batch\n{extra}tasks:\n  - name: main\n    command: [sleep, '1']\n"
        );
        let (s, v) = h
            .call(
                "POST",
                "/v1/jobs?test_only=true",
                Some(&ml),
                "application/yaml",
                spec.into_bytes(),
            )
            .await;
        assert_eq!(s, 200, "{v}");
        assert_eq!(v["would_start"], false, "{v}");
        assert!(v["reasons"][0].as_str().unwrap().contains(&says), "{v}");
    }
}
