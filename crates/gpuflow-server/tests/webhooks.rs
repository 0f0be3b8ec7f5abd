//! Webhooks through the real router, heartbeats and cycle (#38): one
//! signed POST per state change a webhook asked for, retried after the
//! receiver fails, logged; a member's webhook reports only their own jobs
//! and nobody reaches another team's.

mod support;

use std::sync::{Arc, Mutex};
use std::time::Duration;

use axum::http::{HeaderMap, StatusCode};
use hmac::{KeyInit, Mac};
use serde_json::{Value, json};
use support::{H, harness_with};

/// What the receiver got: headers and body of each POST.
type Got = Arc<Mutex<Vec<(HeaderMap, String)>>>;

/// A receiver on loopback that answers 500 to the first `fail` requests,
/// then 200; its URL and what it got.
async fn receiver(fail: usize) -> (String, Got) {
    let got: Got = Arc::default();
    let seen = got.clone();
    let app = axum::Router::new().route(
        "/hook",
        axum::routing::post(move |headers: HeaderMap, body: String| {
            let seen = seen.clone();
            async move {
                let mut g = seen.lock().unwrap();
                g.push((headers, body));
                if g.len() <= fail {
                    StatusCode::INTERNAL_SERVER_ERROR
                } else {
                    StatusCode::OK
                }
            }
        }),
    );
    let listener = tokio::net::TcpListener::bind("127.0.0.1:0").await.unwrap();
    let url = format!("http://{}/hook", listener.local_addr().unwrap());
    tokio::spawn(async move { axum::serve(listener, app).await.unwrap() });
    (url, got)
}

/// Team `ml` (queue `ml-q`) with member `ana` and lead `lee`, team `other`
/// with member `oz`; node `n1` with 2 GPUs. Tokens by user, and the node's.
async fn setup(h: &H) -> (std::collections::BTreeMap<&'static str, String>, String) {
    let a = &h.admin;
    let mut tokens = std::collections::BTreeMap::new();
    for (team, users) in [
        ("ml", vec![("ana", "member"), ("lee", "team-lead")]),
        ("other", vec![("oz", "member")]),
    ] {
        let (s, v) = h.json("POST", "/v1/teams", a, json!({"name": team})).await;
        assert_eq!(s, 201, "{v}");
        let (s, v) = h
            .json(
                "POST",
                "/v1/queues",
                a,
                json!({"name": format!("{team}-q"), "team": team, "quotas": {"*": {"guaranteed": 1}}}),
            )
            .await;
        assert_eq!(s, 201, "{v}");
        for (user, role) in users {
            let (s, v) = h
                .json(
                    "POST",
                    "/v1/users",
                    a,
                    json!({"name": user, "team": team, "role": role}),
                )
                .await;
            assert_eq!(s, 201, "{v}");
            let (s, v) = h.json("POST", "/v1/tokens", a, json!({"user": user})).await;
            assert_eq!(s, 201, "{v}");
            tokens.insert(user, v["token"].as_str().unwrap().to_string());
        }
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
    (tokens, v["node_token"].as_str().unwrap().to_string())
}

fn inventory() -> Value {
    let gpus: Vec<Value> = (0..2)
        .map(|i| json!({"index": i, "uuid": format!("GPU-{i}"), "model": "H100", "memory_mib": 81920}))
        .collect();
    json!({"cpu_milli": 64000, "memory_mib": 262144, "gpus": gpus, "emulated": true})
}

async fn submit(h: &H, token: &str, queue: &str) -> u64 {
    let spec = format!(
        "name: j\nqueue: {queue}\nkind: batch\ntasks:\n  - name: main\n    command: [sleep, '100']\n    resources: {{cpu: 1, memory_mib: 1024, gpu: {{count: 1}}}}\n"
    );
    let (s, v) = h
        .call(
            "POST",
            "/v1/jobs",
            Some(token),
            "application/yaml",
            spec.into_bytes(),
        )
        .await;
    assert_eq!(s, 201, "{v}");
    v["id"].as_u64().unwrap()
}

/// The job's task reported running, then exited with `code` (if any).
async fn report(h: &H, node: &str, id: u64, code: Option<i32>) {
    let attempt = h.shared.world.lock().await.jobs()[&id].attempts;
    let phase = if code.is_some() { "exited" } else { "running" };
    let (s, v) = h
        .json(
            "POST",
            "/v1/agent/heartbeat",
            node,
            json!({"node": "n1", "inventory": inventory(), "tasks": [
                {"job": id, "attempt": attempt, "group": 0, "index": 0, "phase": phase, "exit_code": code}]}),
        )
        .await;
    assert_eq!(s, 200, "{v}");
}

async fn deliver(h: &H) {
    gpuflow_server::webhooks::deliver_due(&h.shared).await;
}

fn verify(secret: &str, headers: &HeaderMap, body: &str) {
    let sig = headers["x-gpuflow-signature"].to_str().unwrap();
    let hex = sig.strip_prefix("sha256=").expect("sha256=");
    let bytes: Vec<u8> = (0..hex.len())
        .step_by(2)
        .map(|i| u8::from_str_radix(&hex[i..i + 2], 16).unwrap())
        .collect();
    let mut mac = hmac::Hmac::<sha2::Sha256>::new_from_slice(secret.as_bytes()).unwrap();
    mac.update(body.as_bytes());
    mac.verify_slice(&bytes).expect("a valid signature");
}

#[tokio::test]
async fn a_webhook_gets_one_signed_post_per_state_change_and_a_retry_after_a_500() {
    let h = harness_with(|c| {
        c.webhook_private = true;
        c.webhook_backoff = Duration::from_millis(20);
    })
    .await;
    let (tok, node) = setup(&h).await;
    // The first POST fails: it is tried again.
    let (url, got) = receiver(1).await;
    let (s, hook) = h
        .json(
            "POST",
            "/v1/webhooks",
            &tok["ana"],
            json!({"url": url, "events": ["begin", "end", "fail"]}),
        )
        .await;
    assert_eq!(s, 201, "{hook}");
    let secret = hook["secret"].as_str().unwrap().to_string();
    let id = hook["id"].as_str().unwrap().to_string();
    assert_eq!(
        hook["user"], "ana",
        "a member's webhook reports her own jobs"
    );

    let mine = submit(&h, &tok["ana"], "ml-q").await;
    // Lee's job is in the same team but not ana's: her webhook says nothing of it.
    let leads = submit(&h, &tok["lee"], "ml-q").await;
    gpuflow_server::cycle::run_once(&h.shared).await.unwrap();
    report(&h, &node, mine, None).await;
    report(&h, &node, leads, None).await;
    deliver(&h).await;
    tokio::time::sleep(Duration::from_millis(50)).await;
    deliver(&h).await;
    report(&h, &node, mine, Some(3)).await;
    report(&h, &node, leads, Some(0)).await;
    deliver(&h).await;

    let got = got.lock().unwrap().clone();
    let events: Vec<(String, u64, String)> = got
        .iter()
        .map(|(hd, body)| {
            verify(&secret, hd, body);
            let v: Value = serde_json::from_str(body).unwrap();
            assert_eq!(hd["x-gpuflow-event"], v["event"].as_str().unwrap());
            (
                v["event"].as_str().unwrap().to_string(),
                v["job"]["id"].as_u64().unwrap(),
                hd["x-gpuflow-delivery"].to_str().unwrap().to_string(),
            )
        })
        .collect();
    // begin (refused with a 500), begin again (the same delivery), fail.
    assert_eq!(events.len(), 3, "{events:?}");
    assert_eq!(events[0].0, "begin");
    assert_eq!(events[1].0, "begin");
    assert_eq!(events[0].2, events[1].2, "a retry is the same delivery");
    assert_eq!(
        events[2].0, "fail",
        "a failed job is `fail`, not also `end`"
    );
    assert!(events.iter().all(|(_, job, _)| *job == mine), "{events:?}");

    // The log: the 500, the retry, the failure's delivery.
    let (s, log) = h
        .get(&format!("/v1/webhooks/{id}/deliveries"), &tok["ana"])
        .await;
    assert_eq!(s, 200, "{log}");
    let log = log.as_array().unwrap();
    assert_eq!(log.len(), 3, "{log:?}");
    assert_eq!(log[0]["status"], 500);
    assert!(
        log[0]["outcome"].as_str().unwrap().starts_with("retrying"),
        "{log:?}"
    );
    assert_eq!(log[1]["attempt"], 2);
    assert_eq!(log[1]["outcome"], "delivered");
    // Nobody else reads it; its maker deletes it.
    let (s, _) = h
        .get(&format!("/v1/webhooks/{id}/deliveries"), &tok["oz"])
        .await;
    assert_eq!(s, 404);
    let (s, _) = h
        .call(
            "DELETE",
            &format!("/v1/webhooks/{id}"),
            Some(&tok["oz"]),
            "application/json",
            vec![],
        )
        .await;
    assert_eq!(s, 404);
    let (s, _) = h
        .call(
            "DELETE",
            &format!("/v1/webhooks/{id}"),
            Some(&tok["ana"]),
            "application/json",
            vec![],
        )
        .await;
    assert_eq!(s, 204);
}

/// Misuse: a member may not subscribe to a whole team (her own or
/// another's), another team's lead may not either; a bad URL or event is
/// refused saying what to write; and a private address is refused unless
/// the server allows it.
#[tokio::test]
async fn a_webhook_reaches_no_work_its_maker_may_not_see() {
    let h = harness_with(|c| c.webhook_private = true).await;
    let (tok, _) = setup(&h).await;
    let (url, _) = receiver(0).await;
    for (who, team, want) in [
        ("ana", "ml", 403),
        ("oz", "ml", 403),
        ("lee", "ml", 201),
        ("lee", "other", 403),
    ] {
        let (s, v) = h
            .json(
                "POST",
                "/v1/webhooks",
                &tok[who],
                json!({"url": url, "events": ["end"], "team": team}),
            )
            .await;
        assert_eq!(s, want, "{who} for team {team}: {v}");
    }
    for (body, says) in [
        (
            json!({"url": "ftp://x/", "events": ["end"]}),
            "http:// or https://",
        ),
        (json!({"url": url, "events": ["ended"]}), "unknown event"),
        (json!({"url": url, "events": []}), "at least one"),
    ] {
        let (s, v) = h.json("POST", "/v1/webhooks", &tok["ana"], body).await;
        assert_eq!(s, 400, "{v}");
        assert!(v["message"].as_str().unwrap().contains(says), "{v}");
    }
    let strict = harness_with(|_| {}).await;
    let (s, v) = strict
        .json(
            "POST",
            "/v1/webhooks",
            &strict.admin,
            json!({"url": url, "events": ["end"], "team": "default"}),
        )
        .await;
    assert_eq!(s, 400, "{v}");
    assert!(
        v["message"].as_str().unwrap().contains("--webhook-private"),
        "{v}"
    );
}

/// Notifications by mail go through a real SMTP server on loopback
/// (aiosmtpd, Debian's python3-aiosmtpd), one message per change asked
/// for; a server with no SMTP server refuses mail, and an address that is
/// not one is refused.
#[tokio::test]
async fn a_mail_notification_reaches_an_smtp_server() {
    if std::process::Command::new("/usr/bin/python3")
        .args(["-c", "import aiosmtpd"])
        .output()
        .map_or(true, |o| !o.status.success())
    {
        eprintln!("skipped: python3-aiosmtpd is not installed (apt-get install python3-aiosmtpd)");
        return;
    }
    let dir = tempfile::tempdir().unwrap();
    let port = std::net::TcpListener::bind("127.0.0.1:0")
        .unwrap()
        .local_addr()
        .unwrap()
        .port();
    let maildir = dir.path().join("mail");
    let mut smtpd = std::process::Command::new("/usr/bin/python3")
        .args(["-m", "aiosmtpd", "-n", "-l", &format!("127.0.0.1:{port}")])
        .args(["-c", "aiosmtpd.handlers.Mailbox"])
        .arg(&maildir)
        .spawn()
        .unwrap();
    let end = std::time::Instant::now() + Duration::from_secs(20);
    while std::net::TcpStream::connect(("127.0.0.1", port)).is_err() {
        assert!(
            std::time::Instant::now() < end,
            "the SMTP server never listened"
        );
        tokio::time::sleep(Duration::from_millis(100)).await;
    }
    let h = harness_with(move |c| {
        c.smtp = Some(gpuflow_server::Smtp {
            host: "127.0.0.1".into(),
            port,
            from: "gpuflow@cluster.example".into(),
        });
    })
    .await;
    let (tok, node) = setup(&h).await;
    let (s, v) = h
        .json(
            "POST",
            "/v1/webhooks",
            &tok["ana"],
            json!({"mail": "not an address", "events": ["end"]}),
        )
        .await;
    assert_eq!(s, 400, "{v}");
    let (s, v) = h
        .json(
            "POST",
            "/v1/webhooks",
            &tok["ana"],
            json!({"mail": "ana@example.com", "events": ["end"]}),
        )
        .await;
    assert_eq!(s, 201, "{v}");
    assert_eq!(v["mail"], "ana@example.com");
    let id = submit(&h, &tok["ana"], "ml-q").await;
    gpuflow_server::cycle::run_once(&h.shared).await.unwrap();
    report(&h, &node, id, None).await;
    report(&h, &node, id, Some(0)).await;
    deliver(&h).await;
    let mail = loop {
        let new = maildir.join("new");
        let found = std::fs::read_dir(&new)
            .ok()
            .and_then(|mut d| d.next())
            .and_then(Result::ok)
            .map(|e| std::fs::read_to_string(e.path()).unwrap());
        if let Some(m) = found {
            break m;
        }
        assert!(std::time::Instant::now() < end, "no mail arrived");
        tokio::time::sleep(Duration::from_millis(100)).await;
    };
    smtpd.kill().unwrap();
    let _ = smtpd.wait();
    assert!(mail.contains("To: ana@example.com"), "{mail}");
    assert!(mail.contains("From: gpuflow@cluster.example"), "{mail}");
    assert!(
        mail.contains(&format!("Subject: [gpuflow] job {id} (j) end: succeeded")),
        "{mail}"
    );
    assert_eq!(
        std::fs::read_dir(maildir.join("new")).unwrap().count(),
        1,
        "one mail: `begin` was not asked for"
    );
    // A server without an SMTP server refuses mail notifications.
    let plain = harness_with(|_| {}).await;
    let (s, v) = plain
        .json(
            "POST",
            "/v1/webhooks",
            &plain.admin,
            json!({"mail": "a@example.com", "events": ["end"]}),
        )
        .await;
    assert_eq!(s, 400, "{v}");
    assert!(
        v["message"].as_str().unwrap().contains("--smtp-server"),
        "{v}"
    );
}

/// `budget-low`: a queue past its budget's taper point is said once a
/// period to its team's webhooks that ask for it.
#[tokio::test]
async fn a_budget_past_its_taper_point_is_notified_once_a_period() {
    let h = harness_with(|c| c.webhook_private = true).await;
    let (tok, node) = setup(&h).await;
    let (url, got) = receiver(0).await;
    let (s, v) = h
        .json(
            "POST",
            "/v1/webhooks",
            &tok["lee"],
            json!({"url": url, "events": ["budget-low"], "team": "ml"}),
        )
        .await;
    assert_eq!(s, 201, "{v}");
    let (s, v) = h
        .json(
            "PATCH",
            "/v1/queues/ml-q",
            &h.admin,
            json!({"budget": {"gpu_hours": 1, "period": "day"}}),
        )
        .await;
    assert_eq!(s, 200, "{v}");
    let id = submit(&h, &tok["ana"], "ml-q").await;
    gpuflow_server::cycle::run_once(&h.shared).await.unwrap();
    report(&h, &node, id, None).await;
    // It has held its GPU for most of an hour: 0.9 of the budget. Counted
    // at least an hour into the day (UTC), so that the hour never falls
    // partly in the day before: run in the first hour after midnight, the
    // budget saw only the minutes since then and was not past its taper.
    let now = std::time::SystemTime::now()
        .duration_since(std::time::UNIX_EPOCH)
        .unwrap()
        .as_secs()
        .max(
            gpuflow_server::accounting::period_start(
                gpuflow_api::BudgetPeriod::Day,
                gpuflow_server::now(),
            ) + 3600,
        );
    {
        let mut w = h.shared.world.lock().await;
        let mut j = w.jobs()[&id].clone();
        j.held[0].from = now - 3240;
        w.put_job(j);
    }
    gpuflow_server::accounting::refresh_budgets(&h.shared, now)
        .await
        .unwrap();
    gpuflow_server::accounting::refresh_budgets(&h.shared, now + 1)
        .await
        .unwrap();
    deliver(&h).await;
    let got = got.lock().unwrap().clone();
    assert_eq!(got.len(), 1, "once a period: {got:?}");
    let v: Value = serde_json::from_str(&got[0].1).unwrap();
    assert_eq!(v["event"], "budget-low");
    assert!(
        v["message"]
            .as_str()
            .unwrap()
            .contains("queue ml-q has used 90 %"),
        "{v}"
    );
}
