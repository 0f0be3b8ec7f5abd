//! Lending through the real router and cycle: a queue's guarantee lent to
//! others comes back to it (#35). A lender's job is not starved by a stream
//! of borrowers, is told the truth while it waits, and a notebook beyond
//! its team's guarantee runs on a lease of idle guarantee.

mod support;

use serde_json::{Value, json};
use support::{H, harness_with};

/// Teams `lender` (queue `lend-q`, 3 H100 guaranteed) and `borrower`
/// (queue `borrow-q`, 1), and node `n1` with 4 H100s; the node's token.
async fn two_teams(h: &H) -> String {
    let a = &h.admin;
    for team in ["lender", "borrower"] {
        let (s, v) = h.json("POST", "/v1/teams", a, json!({"name": team})).await;
        assert_eq!(s, 201, "{v}");
    }
    for (q, team, g) in [("lend-q", "lender", 3), ("borrow-q", "borrower", 1)] {
        let (s, v) = h
            .json(
                "POST",
                "/v1/queues",
                a,
                json!({"name": q, "team": team, "quotas": {"H100": {"guaranteed": g}}}),
            )
            .await;
        assert_eq!(s, 201, "{v}");
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
    v["node_token"].as_str().unwrap().to_string()
}

fn inventory() -> Value {
    let gpus: Vec<Value> = (0..4)
        .map(|i| json!({"index": i, "uuid": format!("GPU-{i}"), "model": "H100", "memory_mib": 81920}))
        .collect();
    json!({"cpu_milli": 64000, "memory_mib": 262144, "gpus": gpus, "emulated": true})
}

/// A job of `kind` with `gpus` H100s in `queue`, submitted by the admin.
async fn submit(h: &H, queue: &str, kind: &str, gpus: u32) -> u64 {
    h.submit_spec(format!(
        "name: j\nqueue: {queue}\nkind: {kind}\ntasks:\n  - name: main\n    command: [sleep, '1000']\n    resources: {{cpu: 1, memory_mib: 1024, gpu: {{count: {gpus}}}}}\n"
    ))
    .await
}

/// Node `n1`'s heartbeat reporting these jobs' tasks in `phase`
/// (`running`, `done` or `stopped`), at their current attempts.
async fn beat(h: &H, token: &str, jobs: &[u64], phase: &str) {
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
            let (phase, code) = match phase {
                "done" => ("exited", Some(0)),
                p => (p, None),
            };
            json!({"job": id, "attempt": attempt, "group": 0, "index": 0, "phase": phase, "exit_code": code})
        })
        .collect();
    let (s, v) = h
        .json(
            "POST",
            "/v1/agent/heartbeat",
            token,
            json!({"node": "n1", "inventory": inventory(), "tasks": tasks}),
        )
        .await;
    assert_eq!(s, 200, "{v}");
}

async fn cycle(h: &H) {
    gpuflow_server::cycle::run_once(&h.shared).await.unwrap();
}

async fn state(h: &H, id: u64) -> String {
    let (_, v) = h.get(&format!("/v1/jobs/{id}"), &h.admin).await;
    v["state"].as_str().unwrap_or_default().to_string()
}

async fn why(h: &H, id: u64) -> Value {
    let (s, v) = h.get(&format!("/v1/jobs/{id}/why"), &h.admin).await;
    assert_eq!(s, 200, "{v}");
    v
}

/// The live walk-through of #35: a lender's 3-GPU job within its
/// guarantee waited while another team's borrowing array took every GPU
/// freed on the node, each new borrower resetting the minimum runtime the
/// reclaim waited for. Now the GPU a borrower frees is kept from new
/// borrowing, the lender is told it is within its guarantee (not "the
/// cluster has 0 left to lend") and when it starts, and it starts once the
/// borrowers pass their minimum runtime.
#[tokio::test]
async fn a_lenders_job_is_not_starved_by_a_stream_of_borrowers() {
    let h = harness_with(|c| c.min_runtime_s = 6).await;
    let node = two_teams(&h).await;
    let mut stream = Vec::new();
    for _ in 0..12 {
        stream.push(submit(&h, "borrow-q", "batch", 1).await);
    }
    cycle(&h).await;
    let running: Vec<u64> = {
        let mut v = Vec::new();
        for &id in &stream {
            if state(&h, id).await == "admitted" {
                v.push(id);
            }
        }
        v
    };
    assert_eq!(running.len(), 4, "the borrowers fill the node");
    beat(&h, &node, &running, "running").await;
    let lender = submit(&h, "lend-q", "training", 3).await;
    cycle(&h).await;
    assert_eq!(state(&h, lender).await, "pending");
    // One borrower ends: its GPU is not lent again.
    beat(&h, &node, &running[..1], "done").await;
    cycle(&h).await;
    let mut started = 0;
    for &id in &stream[4..] {
        if state(&h, id).await != "pending" {
            started += 1;
        }
    }
    assert_eq!(
        started,
        0,
        "no new borrower takes the GPU the lender needs: {}",
        why(&h, lender).await
    );
    let w = why(&h, lender).await;
    let text = w.to_string();
    assert!(text.contains("within queue lend-q's guarantee"), "{w}");
    assert!(!text.contains("left to lend"), "{w}");
    let now = h.shared.now();
    let eta = w["eta"].as_u64().expect("an estimated start");
    assert!(
        eta <= now + 6,
        "the lender starts within the minimum runtime: {w}"
    );
    let w = why(&h, stream[4]).await;
    assert!(
        w.to_string()
            .contains(&format!("kept from new borrowing for job {lender}")),
        "{w}"
    );
    // Past the borrowers' minimum runtime the lender takes its GPUs back.
    h.shared.cfg.clock.advance(7);
    cycle(&h).await;
    let mut victims = Vec::new();
    for &id in &running[1..] {
        if state(&h, id).await == "stopping" {
            victims.push(id);
        }
    }
    assert_eq!(
        victims.len(),
        2,
        "two borrowers give back what the lender needs"
    );
    let w = why(&h, lender).await;
    assert!(w["eta"].as_u64().is_some(), "a preemptor knows when: {w}");
    beat(&h, &node, &victims, "stopped").await;
    cycle(&h).await;
    assert_eq!(state(&h, lender).await, "admitted");
}

/// A notebook beyond its team's guarantee starts on a lease of the
/// guarantee another team leaves idle, where it used to wait ("notebook
/// jobs must fit the guaranteed quota") with GPUs free beside it; once the
/// other team has work pending for its guarantee, no more is lent and the
/// notebook is told why in numbers.
#[tokio::test]
async fn a_notebook_beyond_its_guarantee_runs_on_a_lease_of_idle_guarantee() {
    let h = harness_with(|c| c.min_runtime_s = 2).await;
    let node = two_teams(&h).await;
    let first = submit(&h, "borrow-q", "notebook", 1).await;
    let leased = submit(&h, "borrow-q", "notebook", 1).await;
    cycle(&h).await;
    assert_eq!(state(&h, first).await, "admitted");
    assert_eq!(
        state(&h, leased).await,
        "admitted",
        "{}",
        why(&h, leased).await
    );
    beat(&h, &node, &[first, leased], "running").await;
    // The lender's work comes: what is left of its guarantee is not lent.
    let lenders = submit(&h, "lend-q", "batch", 2).await;
    let more = submit(&h, "borrow-q", "notebook", 1).await;
    cycle(&h).await;
    assert_eq!(
        state(&h, lenders).await,
        "admitted",
        "{}",
        why(&h, lenders).await
    );
    assert_eq!(state(&h, more).await, "pending");
    let w = why(&h, more).await.to_string();
    assert!(w.contains("run only on idle capacity lent to them"), "{w}");
    assert!(w.contains("1 GPUs are lent already"), "{w}");
}

/// `GET /metrics` as an admin sees it: the value of one unlabelled series.
async fn metric(h: &H, name: &str) -> f64 {
    use tower::ServiceExt;
    let req = axum::http::Request::builder()
        .uri("/metrics")
        .header("authorization", format!("Bearer {}", h.admin))
        .body(axum::body::Body::empty())
        .unwrap();
    let resp = h.router.clone().oneshot(req).await.unwrap();
    assert_eq!(resp.status().as_u16(), 200);
    let bytes = axum::body::to_bytes(resp.into_body(), 1 << 24)
        .await
        .unwrap();
    let text = String::from_utf8_lossy(&bytes).into_owned();
    text.lines()
        .find_map(|l| l.strip_prefix(&format!("{name} ")))
        .unwrap_or_else(|| panic!("no {name} in\n{text}"))
        .parse()
        .unwrap()
}

/// GPUs idle while work that fits them waits, on `/metrics` and
/// `/v1/idle-waiting` (the dashboard's): with leases
/// off, a notebook beyond its team's guarantee waits beside three free
/// GPUs and the gauge says one GPU; with leases (the default) it starts
/// and the gauge says none.
#[tokio::test]
async fn gpus_idle_while_work_that_fits_them_waits_are_on_metrics() {
    for (lease, idle) in [(None, 1.0), (Some(4 * 3600), 0.0)] {
        let h = harness_with(|c| c.lease_horizon_s = lease).await;
        two_teams(&h).await;
        submit(&h, "borrow-q", "notebook", 1).await;
        let second = submit(&h, "borrow-q", "notebook", 1).await;
        cycle(&h).await;
        let waits = state(&h, second).await == "pending";
        assert_eq!(waits, lease.is_none(), "{}", why(&h, second).await);
        assert_eq!(
            metric(&h, "gpuflow_scheduler_idle_waiting_gpus").await,
            idle,
            "leases {lease:?}"
        );
        assert_eq!(
            metric(&h, "gpuflow_scheduler_idle_waiting_gpu_hours_total").await,
            0.0,
            "nothing has stood idle for any time yet"
        );
        // The same for the dashboard, to any token: the cluster's figure.
        let (s, v) = h.get("/v1/idle-waiting", &h.admin).await;
        assert_eq!(s, 200, "{v}");
        assert_eq!(v["gpus"], idle, "{v}");
        assert!(v["at"].as_u64().unwrap() > 0, "{v}");
        let (s, _) = h.call("GET", "/v1/idle-waiting", None, "", vec![]).await;
        assert_eq!(s, 401);
    }
}

/// A job waiting behind one that declares 24 hours is told when that job
/// is expected to end from its user's recent jobs of the same kind (which
/// ran about a second), not in 24 hours: before, the estimate was the
/// declared maximum (#35: "6 of 9 start estimates checked were wrong").
#[tokio::test]
async fn a_start_estimate_expects_the_users_recent_runtimes() {
    let h = harness_with(|_| {}).await;
    let token = two_teams(&h).await;
    let spec = "name: long\nqueue: lend-q\nkind: batch\nmax_runtime_s: 86400\ntasks:\n  - name: main\n    command: [sleep, '1000']\n    resources: {cpu: 1, memory_mib: 1024, gpu: {count: 3}}\n";
    let job = async |h: &H| h.submit_spec(spec.to_string()).await;
    // Two of the user's batch jobs run and succeed at once.
    for _ in 0..2 {
        let id = job(&h).await;
        cycle(&h).await;
        beat(&h, &token, &[id], "running").await;
        beat(&h, &token, &[id], "done").await;
        cycle(&h).await;
        assert_eq!(state(&h, id).await, "succeeded");
    }
    // A third runs; a fourth waits behind it for the queue's guarantee.
    let running = job(&h).await;
    cycle(&h).await;
    beat(&h, &token, &[running], "running").await;
    assert_eq!(state(&h, running).await, "running");
    let waiting = job(&h).await;
    cycle(&h).await;
    let w = why(&h, waiting).await;
    let eta = w["eta"]
        .as_u64()
        .unwrap_or_else(|| panic!("an estimate: {w}"));
    let now = gpuflow_server::now();
    assert!(
        eta < now + 3600,
        "expected within the hour (its user's jobs run about a second), not when the running job's 24 h run out: {w}"
    );
}

/// #35's walk-through: a job blocked on CPU was told "now (at the next
/// cycle)" and did not start. Its node has GPUs free but not the CPUs it
/// asks for until the running job's declared hour is over: the estimate
/// says so, also for a job beyond the cycle's backfill reservations.
#[tokio::test]
async fn a_job_short_of_cpus_is_not_told_it_starts_now() {
    let h = harness_with(|_| {}).await;
    let token = two_teams(&h).await;
    let spec = |cpu: u32, max_s: u32| {
        format!(
            "name: c\nqueue: lend-q\nkind: batch\nmax_runtime_s: {max_s}\ntasks:\n  - name: main\n    command: [sleep, '1000']\n    resources: {{cpu: {cpu}, memory_mib: 1024, gpu: {{count: 1}}}}\n"
        )
    };
    let running = h.submit_spec(spec(48, 3600)).await;
    cycle(&h).await;
    beat(&h, &token, &[running], "running").await;
    assert_eq!(state(&h, running).await, "running");
    // Five wait: the first four get backfill reservations (which see CPUs);
    // the fifth's estimate comes from the list schedule and the nodes.
    // They are short: a job as long as the running one's hour would not
    // end before the first reservation once a second has passed since it
    // started, and would be told that instead (true too: this test failed
    // so on a busy machine, whose cycle ran a second later).
    let mut waiting = 0;
    for _ in 0..5 {
        waiting = h.submit_spec(spec(32, 600)).await;
    }
    h.shared.cfg.clock.advance(2);
    cycle(&h).await;
    assert_eq!(state(&h, waiting).await, "pending");
    let w = why(&h, waiting).await;
    assert!(w.to_string().contains("too little free CPU"), "{w}");
    let eta = w["eta"]
        .as_u64()
        .unwrap_or_else(|| panic!("an estimate: {w}"));
    assert!(
        eta >= gpuflow_server::now() + 3000,
        "not before the running job's hour is over: {w}"
    );
}
