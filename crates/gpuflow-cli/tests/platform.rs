//! End to end: the real `gpuflow` binary as server and agent on loopback,
//! emulated GPUs running real processes, two teams with their own tokens.

mod common;

use std::time::Duration;

use common::*;
use serde_json::{Value, json};

const LONG: Duration = Duration::from_secs(60);

#[test]
fn two_teams_run_preempt_cancel_and_explain() {
    let dir = tempfile::tempdir().unwrap();
    let srv = server(dir.path(), free_port(), &[]);
    let _agent = agent(dir.path(), &srv.url, "n1", "4xemu-gpu");
    let api = Api::new(&srv.url);
    let admin = admin_token(dir.path());
    poll("the agent registers", LONG, || {
        let nodes = api.get("/v1/nodes", &admin);
        (nodes.as_array().unwrap().len() == 1).then_some(())
    });

    // Two teams, a member each, a queue each guaranteed half the GPUs.
    let alice = api.team_with_member(&admin, "alpha", "alice", "member");
    let bob = api.team_with_member(&admin, "beta", "bob", "member");
    for (team, q) in [("alpha", "alpha-q"), ("beta", "beta-q")] {
        let (s, v) = api.post_json(
            "/v1/queues",
            &admin,
            &json!({"name": q, "team": team, "quotas": {"emu-gpu": {"guaranteed": 2}}}),
        );
        assert_eq!(s, 201, "{v}");
    }

    // Alice runs two batch jobs of 2 GPUs: the first within alpha's
    // guarantee, the second on beta's idle guarantee. The second writes a
    // checkpoint and says when it gets the stop signal.
    let (s, v) = api.submit_yaml(
        &alice,
        &job_yaml("base", "alpha-q", "batch", 2, "sleep 300", 5),
    );
    assert_eq!(s, 201, "{v}");
    let a0 = v["id"].as_u64().unwrap();
    api.wait_state(a0, &alice, "running", LONG);
    let script = "echo pid $$ rank $RANK world $WORLD_SIZE gpus $CUDA_VISIBLE_DEVICES ckpt=${GPUFLOW_LAST_CHECKPOINT:-none}; \
                  date +%s > $GPUFLOW_CHECKPOINT_FILE; \
                  trap 'echo got TERM; exit 0' TERM; while true; do sleep 0.2; done";
    let (s, v) = api.submit_yaml(
        &alice,
        &job_yaml("borrower", "alpha-q", "batch", 2, script, 20),
    );
    assert_eq!(s, 201, "{v}");
    let a1 = v["id"].as_u64().unwrap();
    let j = api.wait_state(a1, &alice, "running", LONG);
    let gpus = j["tasks"][0]["gpus"].as_array().unwrap().len();
    assert_eq!(gpus, 2);
    poll("alice's job reports its checkpoint", LONG, || {
        api.job(a1, &alice)["last_checkpoint"].as_u64()
    });
    // Emulated GPUs are not sampled: no usage is made up for them (a
    // utilisation of 0 would look idle and cost nothing).
    std::thread::sleep(Duration::from_secs(6));
    let j = api.job(a0, &alice);
    assert!(j["tasks"][0]["usage"].is_null(), "{j}");
    let logs = poll("alice's job logs its environment", LONG, || {
        let l = api.get(&format!("/v1/jobs/{a1}/logs"), &alice);
        let text = l["tasks"]["main/0"].as_str().unwrap_or("").to_string();
        text.contains("gpus").then_some(text)
    });
    assert!(logs.contains("rank 0 world 1 gpus "), "{logs}");

    // Bob cannot see it, but sees which queue borrows his team's GPUs.
    let (s, _) = api.call("GET", &format!("/v1/jobs/{a1}"), &bob, None);
    assert_eq!(s, 404);
    let qs = api.get("/v1/queues", &bob);
    let beta = qs
        .as_array()
        .unwrap()
        .iter()
        .find(|q| q["name"] == "beta-q")
        .unwrap();
    let b = &beta["borrowers"][0];
    assert_eq!(
        (b["queue"].as_str(), b["team"].as_str(), b["gpus"].as_f64()),
        (Some("alpha-q"), Some("alpha"), Some(2.0)),
        "{beta}"
    );
    assert!(api.get("/v1/jobs", &bob).as_array().unwrap().is_empty());

    // Bob's training job is within beta's guarantee: alice's borrowing job is
    // preempted (not the one within alpha's guarantee), told to stop with its
    // signal, given its grace period, and requeued.
    let (s, v) = api.submit_yaml(
        &bob,
        &job_yaml("train", "beta-q", "training", 2, "sleep 300", 5),
    );
    assert_eq!(s, 201, "{v}");
    let b1 = v["id"].as_u64().unwrap();
    let stopping = api.wait_state(a1, &alice, "stopping", LONG);
    assert!(
        stopping["reason"]
            .as_str()
            .unwrap()
            .contains(&format!("preempted by job {b1}")),
        "{stopping}"
    );
    assert!(stopping["kill_at"].as_u64().is_some());
    let requeued = api.wait_state(a1, &alice, "pending", LONG);
    assert_eq!(requeued["preemptions"], 1);
    assert!(
        requeued["last_checkpoint"].as_u64().is_some(),
        "the checkpoint is kept: {requeued}"
    );
    let j = api.wait_state(b1, &bob, "running", LONG);
    assert_eq!(j["tasks"][0]["gpus"].as_array().unwrap().len(), 2);
    assert_eq!(
        api.job(a0, &alice)["state"],
        "running",
        "alpha keeps its guarantee"
    );
    let events = api.get(&format!("/v1/events?job={a1}"), &alice);
    let kinds: Vec<&str> = events
        .as_array()
        .unwrap()
        .iter()
        .map(|e| e["kind"].as_str().unwrap())
        .collect();
    assert_eq!(
        kinds,
        ["submitted", "admitted", "running", "preempted", "requeued"],
        "{events}"
    );
    // The task got the signal (it printed before exiting) rather than a kill.
    let l = api.get(&format!("/v1/jobs/{a1}/logs"), &alice);
    assert!(
        l["tasks"]["main/0"].as_str().unwrap().contains("got TERM"),
        "{l}"
    );

    // Alice's job now waits: `job why` (through the CLI) says why.
    let out = std::process::Command::new(BIN)
        .args([
            "job",
            "why",
            &a1.to_string(),
            "--server",
            &srv.url,
            "--token",
            &alice,
        ])
        .output()
        .unwrap();
    let why = String::from_utf8_lossy(&out.stdout);
    assert!(
        out.status.success(),
        "{why} {}",
        String::from_utf8_lossy(&out.stderr)
    );
    assert!(why.contains(&format!("job {a1} is pending")), "{why}");
    assert!(why.contains("GPUs"), "{why}");
    assert!(why.contains("position in its queue: 1"), "{why}");

    // Bob suspends his running job: it stops and releases its GPUs, which
    // alice's waiting job takes; resumed, bob's job queues again.
    let (s, v) = api.call("POST", &format!("/v1/jobs/{b1}/suspend"), &bob, None);
    assert_eq!(s, 200, "{v}");
    let j = api.wait_state(b1, &bob, "suspended", LONG);
    assert!(j["tasks"].as_array().unwrap().is_empty(), "{j}");
    api.wait_state(a1, &alice, "running", LONG);
    // Its second run is told where its last checkpoint was.
    poll("the requeued job sees its last checkpoint", LONG, || {
        let l = api.get(&format!("/v1/jobs/{a1}/logs"), &alice);
        l["tasks"]["main/0"]
            .as_str()
            .unwrap_or("")
            .contains("ckpt=1")
            .then_some(())
    });
    let (s, v) = api.call("POST", &format!("/v1/jobs/{b1}/resume"), &bob, None);
    assert_eq!((s, v["state"].as_str()), (200, Some("pending")), "{v}");
    let (s, _) = api.call("POST", &format!("/v1/jobs/{b1}/resume"), &bob, None);
    assert_eq!(s, 409, "resuming a pending job is a conflict");
    // Bob's job is within beta's guarantee again: alice's borrower yields once more.
    api.wait_state(b1, &bob, "running", LONG);
    api.wait_state(a1, &alice, "pending", LONG);

    // Bob may not cancel alice's jobs, and learns nothing about them.
    let (s, _) = api.call("POST", &format!("/v1/jobs/{a0}/cancel"), &bob, None);
    assert_eq!(s, 404);
    // Alice cancels her pending job: cancelled at once.
    let (s, v) = api.call("POST", &format!("/v1/jobs/{a1}/cancel"), &alice, None);
    assert_eq!(s, 200, "{v}");
    assert_eq!(api.job(a1, &alice)["state"], "cancelled");
    // And her running one: it is stopped on the node and ends cancelled.
    let (s, v) = api.call("POST", &format!("/v1/jobs/{a0}/cancel"), &alice, None);
    assert_eq!(s, 200, "{v}");
    let j = api.wait_state(a0, &alice, "cancelled", LONG);
    assert!(
        j["reason"].as_str().unwrap().contains("cancelled by alice"),
        "{j}"
    );
    // It keeps its tasks as they ended; its hold on the GPUs is closed and
    // the node holds none of them for it.
    assert_eq!(j["tasks"][0]["state"], "stopped", "{j}");
    assert!(j["ledger"][0]["to"].as_u64().is_some(), "{j}");
    let mine: Vec<Value> = j["tasks"][0]["gpus"].as_array().unwrap().clone();
    let holders = api.get("/v1/nodes", &admin)[0]["holders"].clone();
    for h in holders.as_array().into_iter().flatten() {
        assert!(
            h["job"].as_u64() != Some(a0) && !(mine.contains(&h["gpu"]) && h["team"] == "alpha"),
            "{holders}"
        );
    }
}

#[test]
fn a_task_that_fails_is_retried_with_backoff_then_fails() {
    let dir = tempfile::tempdir().unwrap();
    let srv = server(dir.path(), free_port(), &[]);
    let _agent = agent(dir.path(), &srv.url, "n1", "1");
    let api = Api::new(&srv.url);
    let admin = admin_token(dir.path());
    let spec = "name: flaky\nqueue: default\nkind: batch\nretry: {limit: 1, backoff_s: 1}\ntasks:\n  - name: main\n    command: [sh, -c, 'echo trying; exit 3']\n";
    let (s, v) = api.submit_yaml(&admin, spec);
    assert_eq!(s, 201, "{v}");
    let id = v["id"].as_u64().unwrap();
    let j = api.wait_state(id, &admin, "failed", LONG);
    assert_eq!(j["attempts"], 2, "{j}");
    assert!(
        j["reason"].as_str().unwrap().contains("exited with code 3"),
        "{j}"
    );
    let events = api.get(&format!("/v1/events?job={id}"), &admin);
    let kinds: Vec<&str> = events
        .as_array()
        .unwrap()
        .iter()
        .map(|e| e["kind"].as_str().unwrap())
        .collect();
    assert!(
        kinds.contains(&"retry") && kinds.ends_with(&["failed"]),
        "{kinds:?}"
    );

    // A program that does not exist fails to start, with the reason.
    let spec = "name: missing\nqueue: default\ntasks:\n  - name: main\n    command: [/nonexistent/program]\n";
    let (_, v) = api.submit_yaml(&admin, spec);
    let j = api.wait_state(v["id"].as_u64().unwrap(), &admin, "failed", LONG);
    assert!(
        j["reason"].as_str().unwrap().contains("could not start"),
        "{j}"
    );
}

#[test]
fn a_job_over_its_max_runtime_is_stopped_and_ends_timed_out() {
    let dir = tempfile::tempdir().unwrap();
    let srv = server(dir.path(), free_port(), &[]);
    let _agent = agent(dir.path(), &srv.url, "n1", "1");
    let api = Api::new(&srv.url);
    let admin = admin_token(dir.path());
    let spec = "name: slow\nqueue: default\nmax_runtime_s: 2\ncheckpoint: {grace_s: 1}\ntasks:\n  - name: main\n    command: [sleep, '300']\n";
    let (_, v) = api.submit_yaml(&admin, spec);
    // `timeout`, as Slurm's TIMEOUT, not `failed` (it was), so that users
    // can tell a job that ran out of time from one whose task failed.
    let j = api.wait_state(v["id"].as_u64().unwrap(), &admin, "timeout", LONG);
    assert!(j["reason"].as_str().unwrap().contains("max runtime"), "{j}");
    let ls = api.get("/v1/jobs?state=timeout", &admin);
    assert_eq!(ls.as_array().map(Vec::len), Some(1), "{ls}");
}

#[test]
fn a_lost_node_is_fenced_before_its_work_is_requeued() {
    let dir = tempfile::tempdir().unwrap();
    let srv = server(dir.path(), free_port(), &[]);
    let api = Api::new(&srv.url);
    let admin = admin_token(dir.path());
    let agent1 = agent(dir.path(), &srv.url, "n1", "2");
    let (_, v) = api.submit_yaml(
        &admin,
        &job_yaml(
            "long",
            "default",
            "training",
            2,
            "echo $$ > pid; sleep 300",
            1,
        ),
    );
    let id = v["id"].as_u64().unwrap();
    api.wait_state(id, &admin, "running", LONG);
    let pid_file = dir
        .path()
        .join("work-n1")
        .join(format!("job-{id}"))
        .join("a1-g0-i0")
        .join("pid");
    let pid: u32 = poll("the task writes its pid", LONG, || {
        std::fs::read_to_string(&pid_file).ok()?.trim().parse().ok()
    });
    // The agent freezes: its task's keeper stops the task before the lease
    // runs out, and only then is the work requeued.
    agent1.signal("-STOP");
    api.wait_state(id, &admin, "pending", LONG);
    let events = api.get(&format!("/v1/events?job={id}"), &admin);
    assert!(
        events
            .as_array()
            .unwrap()
            .iter()
            .any(|e| e["kind"] == "requeued"
                && e["message"].as_str().unwrap().contains("node n1 lost")),
        "{events}"
    );
    assert_eq!(api.get("/v1/nodes", &admin)[0]["state"], "lost");
    assert!(
        !alive(pid),
        "the frozen node's task still runs after its lease"
    );
    // A second node takes the work.
    let _agent2 = agent(dir.path(), &srv.url, "n2", "2");
    let j = api.wait_state(id, &admin, "running", LONG);
    assert_eq!(j["tasks"][0]["node"], "n2");
    assert_eq!(j["attempts"], 2);
    // n1 comes back: it is ready again, its fenced task stays gone and the
    // job stays on n2.
    agent1.signal("-CONT");
    poll("n1 is back", LONG, || {
        (api.get("/v1/nodes", &admin)[0]["state"] == "ready").then_some(())
    });
    let j = api.job(id, &admin);
    assert_eq!(
        (j["state"].as_str(), j["tasks"][0]["node"].as_str()),
        (Some("running"), Some("n2"))
    );
}

#[test]
fn a_restarted_agent_adopts_its_running_tasks() {
    let dir = tempfile::tempdir().unwrap();
    let srv = server(dir.path(), free_port(), &[]);
    let api = Api::new(&srv.url);
    let admin = admin_token(dir.path());
    let first = agent(dir.path(), &srv.url, "n1", "1");
    let (_, v) = api.submit_yaml(
        &admin,
        &job_yaml(
            "steady",
            "default",
            "training",
            1,
            "echo $$ > pid; sleep 300",
            1,
        ),
    );
    let id = v["id"].as_u64().unwrap();
    api.wait_state(id, &admin, "running", LONG);
    let pid_file = dir
        .path()
        .join("work-n1")
        .join(format!("job-{id}"))
        .join("a1-g0-i0")
        .join("pid");
    let pid: u32 = poll("the task writes its pid", LONG, || {
        std::fs::read_to_string(&pid_file).ok()?.trim().parse().ok()
    });
    // The agent crashes; its task does not.
    first.crash();
    assert!(alive(pid));
    // A new agent on the same work directory adopts it: same run, same process.
    let _second = agent(dir.path(), &srv.url, "n1", "1");
    std::thread::sleep(Duration::from_secs(3));
    let j = api.job(id, &admin);
    assert_eq!(
        (j["state"].as_str(), j["attempts"].as_u64()),
        (Some("running"), Some(1)),
        "{j}"
    );
    assert!(alive(pid));
    // And it still controls it: a cancel stops the adopted process.
    let (s, _) = api.call("POST", &format!("/v1/jobs/{id}/cancel"), &admin, None);
    assert_eq!(s, 200);
    api.wait_state(id, &admin, "cancelled", LONG);
    poll("the adopted process is stopped", LONG, || {
        (!alive(pid)).then_some(())
    });
}
