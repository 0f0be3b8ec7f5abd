//! The web dashboard in headless Chromium (Debian's `chromium` driven
//! through `chromedriver`, both started here), on `gpuflow up` with the fake
//! NVML library: sign in, the cluster map with its MIG slices and shared
//! GPUs, a pending job's reasons, a running job's utilisation chart, the
//! usage chart; a member of one team sees none of another team's jobs or
//! costs; a job's output cannot become markup in the viewer's page.
//! Screenshots are written to `target/tmp/dashboard/`. Skipped, with the
//! reason printed, without chromium, chromedriver or a C compiler (CI
//! installs them).

mod common;

use std::path::PathBuf;
use std::process::{Command, Stdio};
use std::time::{Duration, Instant};

use common::*;
use fantoccini::{Client, ClientBuilder, Locator};
use serde_json::json;

const LONG: Duration = Duration::from_secs(60);

fn artefacts() -> PathBuf {
    let d = PathBuf::from(env!("CARGO_TARGET_TMPDIR")).join("dashboard");
    std::fs::create_dir_all(&d).unwrap();
    d
}

/// A browser session: chromedriver on a free port, headless Chromium.
struct Browser {
    _driver: Proc,
    client: Client,
    base: String,
}

impl Browser {
    async fn start(base: &str, profile: &std::path::Path) -> Option<Browser> {
        let (Some(chrome), Some(driver)) = (which("chromium"), which("chromedriver")) else {
            eprintln!(
                "skipped: chromium and chromedriver are not installed (apt-get install chromium chromium-driver)"
            );
            return None;
        };
        let port = free_port();
        let driver = Proc(
            Command::new(driver)
                .arg(format!("--port={port}"))
                .stdout(Stdio::null())
                .stderr(Stdio::null())
                .spawn()
                .unwrap(),
        );
        let url = format!("http://127.0.0.1:{port}");
        poll("chromedriver listens", LONG, || {
            std::net::TcpStream::connect(("127.0.0.1", port)).ok()
        });
        let mut caps = serde_json::Map::new();
        caps.insert(
            "goog:chromeOptions".into(),
            json!({
                "binary": chrome,
                "args": [
                    "--headless=new", "--no-sandbox", "--disable-gpu",
                    "--disable-dev-shm-usage", "--window-size=1400,1000",
                    format!("--user-data-dir={}", profile.display()),
                ],
            }),
        );
        let client = ClientBuilder::new(hyper_util::client::legacy::connect::HttpConnector::new())
            .capabilities(caps)
            .connect(&url)
            .await
            .expect("chromedriver starts a Chromium session");
        Some(Browser {
            _driver: driver,
            client,
            base: base.to_string(),
        })
    }

    async fn open(&self, hash: &str) {
        self.client
            .goto(&format!("{}/ui/{hash}", self.base))
            .await
            .unwrap();
    }

    /// The text of the first element matching `css`, once `ok` holds for it.
    async fn text_when(&self, css: &str, ok: impl Fn(&str) -> bool) -> String {
        let end = Instant::now() + LONG;
        let mut last = String::new();
        loop {
            if let Ok(e) = self.client.find(Locator::Css(css)).await {
                last = e.text().await.unwrap_or_default();
                if ok(&last) {
                    return last;
                }
            }
            if let Ok(e) = self.client.find(Locator::Css("#error")).await {
                last = format!("(page error) {}", e.text().await.unwrap_or_default());
            }
            if Instant::now() > end {
                self.shot("failed").await;
                panic!("{css} never satisfied; last: {last:?}");
            }
            tokio::time::sleep(Duration::from_millis(200)).await;
        }
    }

    /// How many elements match `css`, once there are at least `n`.
    async fn count_at_least(&self, css: &str, n: usize) -> usize {
        let end = Instant::now() + LONG;
        loop {
            let found = self
                .client
                .find_all(Locator::Css(css))
                .await
                .map_or(0, |v| v.len());
            if found >= n {
                return found;
            }
            if Instant::now() > end {
                self.shot("failed").await;
                panic!("fewer than {n} of {css}: {found}");
            }
            tokio::time::sleep(Duration::from_millis(200)).await;
        }
    }

    /// An attribute of each element matching `css`. The pages are live
    /// (read again every 10 s), so an element may be replaced while it
    /// is read: then all are read again.
    async fn attrs(&self, css: &str, attr: &str) -> Vec<String> {
        for _ in 0..5 {
            let mut out = Vec::new();
            let mut stale = false;
            for e in self.client.find_all(Locator::Css(css)).await.unwrap() {
                match e.attr(attr).await {
                    Ok(v) => out.push(v.unwrap_or_default()),
                    Err(_) => {
                        stale = true;
                        break;
                    }
                }
            }
            if !stale {
                return out;
            }
            tokio::time::sleep(Duration::from_millis(100)).await;
        }
        panic!("{css}: its elements kept changing");
    }

    async fn sign_in(&self, token: &str) {
        self.open("#/cluster").await;
        let input = self
            .client
            .wait()
            .at_most(LONG)
            .for_element(Locator::Css("#token"))
            .await
            .unwrap();
        input.send_keys(token).await.unwrap();
        self.client
            .find(Locator::Css("#signin"))
            .await
            .unwrap()
            .click()
            .await
            .unwrap();
    }

    async fn sign_out(&self) {
        self.client
            .find(Locator::Css("#logout"))
            .await
            .unwrap()
            .click()
            .await
            .unwrap();
        self.client
            .wait()
            .at_most(LONG)
            .for_element(Locator::Css("#token"))
            .await
            .unwrap();
    }

    async fn shot(&self, name: &str) {
        let png = self.client.screenshot().await.unwrap();
        let path = artefacts().join(format!("{name}.png"));
        std::fs::write(&path, png).unwrap();
        eprintln!("screenshot: {}", path.display());
    }
}

fn which(name: &str) -> Option<String> {
    let out = Command::new("sh")
        .args(["-c", &format!("command -v {name}")])
        .output()
        .ok()?;
    let p = String::from_utf8_lossy(&out.stdout).trim().to_string();
    (out.status.success() && !p.is_empty()).then_some(p)
}

fn submit(api: &Api, token: &str, name: &str, queue: &str, gpu: &str, script: &str) -> u64 {
    let spec = format!(
        "name: {name}\nqueue: {queue}\nkind: training\ntasks:\n  - name: main\n    command: [sh, -c, {script:?}]\n    resources: {{cpu: 0.1, memory_mib: 64, gpu: {gpu}}}\n"
    );
    let (s, v) = api.submit_yaml(token, &spec);
    assert_eq!(s, 201, "{v}");
    v["id"].as_u64().unwrap()
}

#[test]
fn the_dashboard_shows_the_cluster_jobs_and_usage_only_as_far_as_the_role_may_see() {
    let _ = std::fs::remove_dir_all(artefacts());
    let dir = tempfile::tempdir().unwrap();
    let Some(lib) = gpuflow_agent::fake_nvml::build(dir.path()).unwrap() else {
        eprintln!("skipped: no C compiler to build the fake NVML library");
        return;
    };
    if which("chromium").is_none() || which("chromedriver").is_none() {
        eprintln!(
            "skipped: chromium and chromedriver are not installed (apt-get install chromium chromium-driver)"
        );
        return;
    }
    // Four GPUs, the first in MIG mode; samples every second.
    let state = dir.path().join("nvml-state");
    std::fs::write(&state, "").unwrap();
    let (_up, api, admin) = up_with(
        &dir.path().join("data"),
        free_port(),
        &["--sample-s", "1", "--nvml-lib", lib.to_str().unwrap()],
        &[
            ("FAKE_NVML_GPUS", "4"),
            ("FAKE_NVML_MIG", "1g.10gb,1g.10gb,3g.40gb"),
            ("FAKE_NVML_MIG_GPUS", "1"),
            ("FAKE_NVML_STATE", state.to_str().unwrap()),
        ],
    );

    // The page itself: served with a policy that allows only its own files.
    let (s, _) = api.call("GET", "/ui/", "", None);
    assert_eq!(s, 200);
    let head = ureq::get(&format!("{}/ui/", api.url)).call().unwrap();
    let csp = head
        .headers()
        .get("content-security-policy")
        .and_then(|v| v.to_str().ok())
        .unwrap_or_default()
        .to_string();
    assert!(
        csp.contains("script-src 'self'") && csp.contains("default-src 'none'"),
        "{csp}"
    );

    // Two teams with a queue each; vision's member runs a whole GPU and a
    // MIG slice and waits for two GPUs; nlp's runs half a GPU.
    let alice = api.team_with_member(&admin, "vision", "alice", "member");
    let bob = api.team_with_member(&admin, "nlp", "bob", "member");
    for (team, q) in [("vision", "vision-q"), ("nlp", "nlp-q")] {
        let (s, v) = api.post_json(
            "/v1/queues",
            &admin,
            &json!({"name": q, "team": team, "quotas": {"*": {"guaranteed": 2}}}),
        );
        assert_eq!(s, 201, "{v}");
    }
    let (s, v) = api.call(
        "PATCH",
        "/v1/queues/vision-q",
        &admin,
        Some((
            "application/json",
            br#"{"budget": {"gpu_hours": 100, "period": "day"}}"#,
        )),
    );
    assert_eq!(s, 200, "{v}");
    let (s, v) = api.call(
        "PUT",
        "/v1/prices",
        &admin,
        Some((
            "application/json",
            br#"{"currency": "EUR", "gpu_hour": {"*": 2.5}}"#,
        )),
    );
    assert_eq!(s, 200, "{v}");
    let whole = submit(
        &api,
        &alice,
        "trainer",
        "vision-q",
        "{count: 1}",
        "echo pid $$; echo '<b id=injected>bold</b>'; seq 1 400; exec sleep 300",
    );
    let j = api.wait_state(whole, &alice, "running", LONG);
    let whole_gpu = j["tasks"][0]["gpus"][0].as_u64().unwrap();
    let pid: u64 = poll("the task prints its pid", LONG, || {
        let l = api.get(&format!("/v1/jobs/{whole}/logs"), &alice);
        l["tasks"]["main/0"]
            .as_str()?
            .split_whitespace()
            .nth(1)?
            .parse()
            .ok()
    });
    std::fs::write(
        &state,
        format!(
            "gpu {whole_gpu} util 80 memutil 40 used_mib 30000\nproc {whole_gpu} {pid} 30000 80\n"
        ),
    )
    .unwrap();
    let slice = submit(
        &api,
        &alice,
        "small",
        "vision-q",
        "{mode: mig, profile: 1g.10gb}",
        "exec sleep 300",
    );
    api.wait_state(slice, &alice, "running", LONG);
    let half = submit(
        &api,
        &bob,
        "serve",
        "nlp-q",
        "{mode: fraction, fraction: 0.5}",
        "exec sleep 300",
    );
    api.wait_state(half, &bob, "running", LONG);
    let wide = submit(
        &api,
        &alice,
        "wide",
        "vision-q",
        "{count: 2}",
        "exec sleep 300",
    );
    poll("the wide job has been considered", LONG, || {
        let w = api.get(&format!("/v1/jobs/{wide}/why"), &alice);
        (w["state"] == "pending" && !w["reasons"].as_array()?.is_empty()).then_some(())
    });
    poll("the whole-GPU job's utilisation is sampled", LONG, || {
        (api.job(whole, &alice)["util"].as_array()?.len() >= 2).then_some(())
    });

    let rt = tokio::runtime::Runtime::new().unwrap();
    rt.block_on(async {
        let profile = dir.path().join("chromium");
        let b = Browser::start(&api.url, &profile).await.unwrap();

        // A token that is not one is refused with a message.
        b.sign_in("gf_not-a-token").await;
        b.text_when("#login-error", |t| t.contains("not accepted"))
            .await;

        // The admin's cluster map: 4 GPUs, the MIG GPU in slices, the
        // shared GPU hatched, each hold coloured by its team.
        b.sign_in(&admin).await;
        b.count_at_least("#cluster-map .gpu", 4).await;
        let teams = b.attrs("#cluster-map .gpu", "data-team").await;
        assert_eq!(teams.len(), 4, "{teams:?}");
        assert!(teams.iter().any(|t| t == "vision"), "{teams:?}");
        assert!(teams.iter().any(|t| t == "nlp"), "{teams:?}");
        assert_eq!(b.count_at_least(".gpu .seg.mig", 1).await, 1);
        assert_eq!(b.count_at_least(".gpu .seg.shared", 1).await, 1);
        let who = b.text_when("#who", |t| t.contains("admin")).await;
        assert!(who.contains("admin"), "{who}");
        // GPUs idle while work that fits them waits, as the last cycle saw.
        let idle = b
            .text_when("#idle-waiting", |t| {
                t.to_lowercase().contains("idle while work waits")
            })
            .await;
        assert!(idle.contains("GPU"), "{idle}");
        // Each team in a colour of its own (two were nearly the same green).
        let v = b.attrs(".gpu[data-team='vision'] .seg", "style").await;
        let n = b.attrs(".gpu[data-team='nlp'] .seg", "style").await;
        let bg = |s: &str| s.split("background-color:").nth(1).unwrap_or_default().trim().to_string();
        assert_ne!(bg(&v[0]), bg(&n[0]), "{v:?} {n:?}");
        b.shot("cluster-admin").await;

        // Live: a job submitted meanwhile appears without a reload, and a
        // MIG slice counts as the share of the GPU it is (it showed 1.0).
        b.open("#/jobs?show=all").await;
        b.count_at_least("#jobs tbody tr", 4).await;
        let late = submit(&api, &bob, "late", "nlp-q", "{count: 1}", "exec sleep 300");
        b.count_at_least(&format!("#jobs tr[data-job='{late}']"), 1).await;
        let mig = b
            .text_when(&format!("#jobs tr[data-job='{slice}'] td[data-col='gpus']"), |t| !t.is_empty())
            .await;
        assert_eq!(mig, "0.14", "1g.10gb of a 7-slice GPU");

        // Actions: an admin holds the pending job and releases it.
        b.open(&format!("#/jobs/{wide}")).await;
        b.count_at_least("#actions button[data-action='hold']", 1).await;
        b.client
            .find(Locator::Css("#actions button[data-action='hold']"))
            .await
            .unwrap()
            .click()
            .await
            .unwrap();
        poll("the job is held", LONG, || {
            (api.job(wide, &admin)["state"] == "held").then_some(())
        });
        b.count_at_least("#actions button[data-action='release']", 1).await;
        b.client
            .find(Locator::Css("#actions button[data-action='release']"))
            .await
            .unwrap()
            .click()
            .await
            .unwrap();
        poll("the job is released", LONG, || {
            (api.job(wide, &admin)["state"] == "pending").then_some(())
        });
        // Its reasons again once a cycle has seen it (just released, it
        // waits "for the next scheduling cycle").
        poll("the released job has been considered", LONG, || {
            let w = api.get(&format!("/v1/jobs/{wide}/why"), &admin);
            (w["reasons"][0]
                .as_str()
                .is_some_and(|r| !r.contains("next scheduling cycle")))
            .then_some(())
        });

        // The pending job's page gives its reasons and its place.
        b.open(&format!("#/jobs/{wide}")).await;
        // (A cycle whose plan a re-check cut leaves the job without a
        // reason until the next: the page, read again every 10 s, shows it
        // then.)
        let why = b
            .text_when("#why", |t| {
                t.contains("Why it waits") && !t.contains("next scheduling cycle")
            })
            .await;
        let reasons = api.get(&format!("/v1/jobs/{wide}/why"), &admin)["reasons"]
            .as_array()
            .unwrap()
            .clone();
        let first = reasons[0].as_str().unwrap();
        assert!(why.contains(first), "{why:?} lacks {first:?}");
        b.shot("job-pending").await;

        // A pod gpuflow runs on Kubernetes, as its scheduler reports it:
        // a job of nlp's whose page says where it runs.
        let minute_ago = std::time::SystemTime::now()
            .duration_since(std::time::UNIX_EPOCH)
            .unwrap()
            .as_secs()
            - 60;
        let report = json!({"workloads": [{
            "key": "nlp/pod/tune", "name": "tune", "team": "nlp", "user": "bob",
            "queue": "nlp-k8s", "kind": "training", "submitted_at": minute_ago,
            "tasks": [{"replicas": 1, "resources": {"cpu": 1, "memory_mib": 1024, "gpu": {"count": 1}}}],
            "running": {"since": minute_ago, "gpu_milli": 1000, "model": "H100"}}]});
        let (s, v) = api.call(
            "PUT",
            "/v1/clusters/kind-1/workloads",
            &admin,
            Some(("application/json", report.to_string().as_bytes())),
        );
        assert_eq!(s, 200, "{v}");
        let pod = api.get("/v1/jobs?team=nlp", &admin)
            .as_array()
            .unwrap()
            .iter()
            .find(|j| j["name"] == "tune")
            .and_then(|j| j["id"].as_u64())
            .unwrap();
        b.open(&format!("#/jobs/{pod}")).await;
        let facts = b
            .text_when(".facts", |t| t.contains("Kubernetes cluster"))
            .await;
        assert!(facts.contains("Kubernetes cluster kind-1 (nlp/pod/tune)"), "{facts}");

        // The running job: a utilisation chart with points, and its output
        // shown as text, not as markup.
        b.open(&format!("#/jobs/{whole}")).await;
        b.count_at_least("#util svg circle", 2).await;
        let log = b.text_when("pre.log", |t| t.contains("bold")).await;
        assert!(log.contains("<b id=injected>bold</b>"), "{log:?}");
        // The log opens at its end (it opened at the top).
        let at_end = b
            .client
            .execute(
                "const p = document.querySelector('pre.log'); return p.scrollTop > 0 && p.scrollTop + p.clientHeight >= p.scrollHeight - 2;",
                vec![],
            )
            .await
            .unwrap();
        assert_eq!(at_end, serde_json::Value::Bool(true));
        assert!(
            b.client.find(Locator::Css("#injected")).await.is_err(),
            "a job's output became markup in the page"
        );
        b.shot("job-running").await;

        // Usage per team per day: a chart with bars and both teams' totals.
        b.open("#/usage?by=team&period=day&from=1d").await;
        b.count_at_least("#usage-chart rect", 2).await;
        let rows = b.attrs("#usage-totals tbody tr", "data-key").await;
        assert_eq!(rows, vec!["nlp".to_string(), "vision".to_string()]);
        let totals = b.text_when("#usage-totals", |t| t.contains("EUR")).await;
        assert!(totals.contains("EUR"), "{totals}");
        b.shot("usage-admin").await;
        // Over 30 days a day's bar is a thirtieth of the axis, not 80 % of it.
        b.open("#/usage?by=team&period=day&from=30d").await;
        b.count_at_least("#usage-chart rect", 2).await;
        for w in b.attrs("#usage-chart rect", "width").await {
            let w: f64 = w.parse().unwrap();
            assert!(w < 30.0, "a day's bar {w} px wide of 744");
        }

        // Queues show what is guaranteed and used.
        b.open("#/queues").await;
        let q = b.text_when("#queues", |t| t.contains("vision-q")).await;
        assert!(q.contains("nlp-q"), "{q}");
        // Per GPU model, not a sum of different models.
        let g = b
            .text_when("tr[data-queue='vision-q'] td[data-col='guaranteed']", |t| !t.is_empty())
            .await;
        assert_eq!(g, "any model 2", "{q}");
        let budget = b
            .text_when("tr[data-queue='vision-q'] .budget", |t| t.contains("left"))
            .await;
        assert!(budget.contains("of 100 GPU-h left this day"), "{budget}");
        b.shot("queues").await;
        b.sign_out().await;

        // Alice, a member of vision: her team's jobs only, nlp's hold on
        // the map anonymous, nlp's job and costs out of reach.
        b.sign_in(&alice).await;
        b.count_at_least("#cluster-map .gpu", 4).await;
        let teams = b.attrs("#cluster-map .gpu", "data-team").await;
        assert!(!teams.iter().any(|t| t.contains("nlp")), "{teams:?}");
        b.open("#/jobs?show=all").await;
        b.count_at_least("#jobs tbody tr", 3).await;
        let ids = b.attrs("#jobs tbody tr", "data-job").await;
        let mut ids: Vec<u64> = ids.iter().map(|s| s.parse().unwrap()).collect();
        ids.sort_unstable();
        let mut mine = vec![whole, slice, wide];
        mine.sort_unstable();
        assert_eq!(ids, mine, "alice sees exactly vision's jobs");
        // A member may cancel her job, not hold it (an admin's).
        b.open(&format!("#/jobs/{wide}")).await;
        b.count_at_least("#actions button[data-action='cancel']", 1).await;
        assert!(b.attrs("#actions button[data-action='hold']", "data-action").await.is_empty());
        b.open(&format!("#/jobs/{half}")).await;
        let err = b.text_when("#error", |t| !t.is_empty()).await;
        assert!(err.contains("not found"), "{err}");
        b.open("#/usage?by=team&period=day&from=1d").await;
        b.count_at_least("#usage-totals tbody tr", 1).await;
        let rows = b.attrs("#usage-totals tbody tr", "data-key").await;
        assert_eq!(rows, vec!["vision".to_string()]);
        b.open("#/usage?by=user&period=day&from=1d").await;
        b.count_at_least("#usage-totals tbody tr", 1).await;
        let rows = b.attrs("#usage-totals tbody tr", "data-key").await;
        assert_eq!(rows, vec!["alice".to_string()], "no nlp user's costs");
        b.shot("usage-member").await;

        // A notebook's page opens it: a link to its proxied port, which
        // the browser follows with the cookie the page asked for (it has
        // no bearer token to send on a link).
        let server = "import http.server, os\nclass H(http.server.BaseHTTPRequestHandler):\n    def do_GET(self):\n        self.send_response(200)\n        self.end_headers()\n        self.wfile.write(('notebook at ' + self.path).encode())\nhttp.server.HTTPServer(('0.0.0.0', int(os.environ['PORT'])), H).serve_forever()\n";
        let spec = format!(
            "name: nb\nqueue: vision-q\nkind: notebook\nmax_runtime_s: 600\ntasks:\n  - name: main\n    command: [python3, -c, {server:?}]\n    resources: {{cpu: 0.1, memory_mib: 128}}\n"
        );
        let (s, v) = api.submit_yaml(&alice, &spec);
        assert_eq!(s, 201, "{v}");
        let nb = v["id"].as_u64().unwrap();
        api.wait_state(nb, &alice, "running", LONG);
        b.open(&format!("#/jobs/{nb}")).await;
        b.count_at_least("#open a", 1).await;
        let href = b.attrs("#open a", "href").await.remove(0);
        assert!(href.contains(&format!("/v1/jobs/{nb}/proxy/")), "{href}");
        b.client.goto(&href).await.unwrap();
        let end = Instant::now() + LONG;
        loop {
            let text = b.client.source().await.unwrap_or_default();
            if text.contains("notebook at /v1/jobs/") {
                break;
            }
            assert!(Instant::now() < end, "the notebook never opened: {text}");
            tokio::time::sleep(Duration::from_millis(300)).await;
            b.client.goto(&href).await.unwrap();
        }
        b.client.close().await.unwrap();
    });
}
