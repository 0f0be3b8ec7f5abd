//! A standby that takes over (#39): two `gpuflow server`s on one
//! PostgreSQL, one leading by a lease in the database. `kill -9` of the
//! leader while jobs are submitted and run, five times over: the standby
//! takes over, no acknowledged job is lost or stored twice, none runs
//! twice, no GPU is held twice, and a job that ran through it all keeps
//! its first attempt and process. A leader cut off from the database stops
//! by itself, and what it is sent meanwhile is not acknowledged. Skipped,
//! with the reason printed, where PostgreSQL is not installed.

mod common;

use std::io::{Read, Write};
use std::net::{Shutdown, TcpListener, TcpStream};
use std::path::{Path, PathBuf};
use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::{Arc, Mutex};
use std::time::{Duration, Instant};

use common::*;
use gpuflow_store::pgtest::TempPostgres;
use serde_json::Value;

const ROUNDS: usize = 5;
const PER_ROUND: usize = 60;

fn postgres() -> Option<TempPostgres> {
    match TempPostgres::start() {
        Ok(Some(pg)) => Some(pg),
        Ok(None) => {
            eprintln!("skipped: PostgreSQL is not installed (apt-get install postgresql)");
            None
        }
        Err(e) => panic!("{e}"),
    }
}

/// A server of the pair: on `store`, leading by a 3-s lease, with a node
/// timeout (20 s) longer than a takeover, so that nodes and their tasks
/// outlive it.
fn member(dir: &Path, port: u16, store: &str) -> Server {
    std::fs::create_dir_all(dir).unwrap();
    let url = format!("http://127.0.0.1:{port}");
    server_spawn(
        dir,
        port,
        &[
            "--store",
            store,
            "--lease-ttl",
            "3",
            "--node-timeout",
            "20",
            "--advertise",
            &url,
        ],
        None,
    )
}

fn answers(url: &str) -> bool {
    ureq::get(format!("{url}/v1/openapi.json")).call().is_ok()
}

#[test]
fn a_standby_takes_over_from_a_leader_killed_under_load() {
    let Some(pg) = postgres() else { return };
    let root = tempfile::tempdir().unwrap();
    let ports = [free_port(), free_port()];
    let dirs: [PathBuf; 2] = [root.path().join("a"), root.path().join("b")];
    let urls: Vec<String> = ports
        .iter()
        .map(|p| format!("http://127.0.0.1:{p}"))
        .collect();
    let mut servers: [Option<Server>; 2] = [Some(member(&dirs[0], ports[0], &pg.url)), None];
    poll("the first server leads", Duration::from_secs(30), || {
        answers(&urls[0]).then_some(())
    });
    servers[1] = Some(member(&dirs[1], ports[1], &pg.url));
    // The second waits as a standby: it answers, with who leads.
    let (status, v) = poll("the standby answers", Duration::from_secs(30), || {
        let (s, v) = Api::new(&urls[1]).call("GET", "/v1/jobs", "any", None);
        (s == 503 && v["message"].as_str()?.contains(&urls[0])).then_some((s, v))
    });
    assert_eq!((status, v["code"].as_str()), (503, Some("standby")), "{v}");
    // A browser on the standby is sent on to the same page of the leader;
    // anything else (a POST from a page, an API call) is not.
    let browser: ureq::Agent = ureq::Agent::config_builder()
        .max_redirects(0)
        .http_status_as_error(false)
        .build()
        .into();
    let r = browser
        .get(format!("{}/ui/?page=jobs", urls[1]))
        .header("Accept", "text/html,application/xhtml+xml")
        .call()
        .unwrap();
    assert_eq!(r.status().as_u16(), 307);
    assert_eq!(
        r.headers().get("location").and_then(|l| l.to_str().ok()),
        Some(format!("{}/ui/?page=jobs", urls[0]).as_str())
    );
    let r = browser
        .post(format!("{}/ui/", urls[1]))
        .header("Accept", "text/html")
        .send("")
        .unwrap();
    assert_eq!(r.status().as_u16(), 503);
    let admin = admin_token(&dirs[0]);
    let _agent = agent(root.path(), &urls.join(","), "n1", "8");
    let api = Api::new(&urls[0]);

    // A long job that must run through every takeover untouched.
    let (survivor, pid) = survivor(&api, &admin, root.path());

    let acked: Arc<Mutex<Vec<(usize, u64)>>> = Arc::default();
    let mut leader = 0;
    let mut refused = 0;
    let mut takeovers = Vec::new();
    for round in 0..ROUNDS {
        let first = round * PER_ROUND;
        let sending = submitter(
            urls.clone(),
            admin.clone(),
            first..first + PER_ROUND,
            acked.clone(),
        );
        poll(
            "a third of the round acknowledged",
            Duration::from_secs(120),
            || (acked.lock().unwrap().len() >= first + PER_ROUND / 3).then_some(()),
        );
        let killed = Instant::now();
        servers[leader].take().unwrap().proc.crash();
        let standby = 1 - leader;
        poll("the standby takes over", Duration::from_secs(30), || {
            answers(&urls[standby]).then_some(())
        });
        let took = killed.elapsed();
        println!(
            "round {}: the standby took over {:.2} s after kill -9 of the leader",
            round + 1,
            took.as_secs_f64()
        );
        takeovers.push(took);
        // The killed one comes back as a standby.
        servers[leader] = Some(member(&dirs[leader], ports[leader], &pg.url));
        leader = standby;
        refused += sending.join().unwrap();
        // The new leader runs a while before it is killed in turn.
        std::thread::sleep(Duration::from_secs(2));
    }
    assert!(refused > 0, "the kills happened while submitting");
    let acked = acked.lock().unwrap().clone();
    assert_eq!(acked.len(), ROUNDS * PER_ROUND);

    // Every acknowledged job is there once, under the id it was given.
    let api = Api::new(&urls[leader]);
    let all = api.get("/v1/jobs?limit=1000", &admin);
    check_acknowledged_once(&all, &acked);
    // No GPU held twice while the backlog drains; every job ran once.
    let done = poll("every job finishes", Duration::from_secs(300), || {
        let jobs = api.get("/v1/jobs?limit=1000", &admin);
        check_no_double_allocation(&jobs);
        jobs.as_array()
            .unwrap()
            .iter()
            .all(|j| j["id"].as_u64() == Some(survivor) || j["state"] == "succeeded")
            .then_some(jobs)
    });
    for j in done.as_array().unwrap() {
        let id = j["id"].as_u64().unwrap();
        let attempts = api.job(id, &admin)["attempts"].as_u64();
        assert_eq!(attempts, Some(1), "job {id} ran more than once: {j}");
    }
    let j = api.job(survivor, &admin);
    assert_eq!(j["state"], "running", "{j}");
    assert!(alive(pid), "the survivor's process died");

    // The CLI follows the leader past the standby named first.
    let out = std::process::Command::new(BIN)
        .args(["job", "get", &survivor.to_string(), "--server"])
        .arg(format!("{},{}", urls[1 - leader], urls[leader]))
        .args(["--token", &admin])
        .output()
        .unwrap();
    let text = String::from_utf8_lossy(&out.stdout);
    assert!(
        out.status.success() && text.contains("running"),
        "{text}{}",
        String::from_utf8_lossy(&out.stderr)
    );
    let worst = takeovers.iter().max().unwrap().as_secs_f64();
    println!("takeovers: the slowest {worst:.2} s of {ROUNDS}");
    assert!(worst < 10.0, "a takeover took {worst:.2} s");
}

/// A TCP proxy to `upstream` that the test can cut: every connection
/// through it closes, and no new one opens.
struct Proxy {
    port: u16,
    cut: Arc<AtomicBool>,
    open: Arc<Mutex<Vec<TcpStream>>>,
}

impl Proxy {
    fn start(upstream: u16) -> Proxy {
        let listener = TcpListener::bind("127.0.0.1:0").unwrap();
        listener.set_nonblocking(true).unwrap();
        let port = listener.local_addr().unwrap().port();
        let cut = Arc::new(AtomicBool::new(false));
        let open: Arc<Mutex<Vec<TcpStream>>> = Arc::default();
        let (c, o) = (cut.clone(), open.clone());
        std::thread::spawn(move || {
            while !c.load(Ordering::Relaxed) {
                let Ok((down, _)) = listener.accept() else {
                    std::thread::sleep(Duration::from_millis(10));
                    continue;
                };
                down.set_nonblocking(false).unwrap();
                let Ok(up) = TcpStream::connect(("127.0.0.1", upstream)) else {
                    continue;
                };
                o.lock().unwrap().push(down.try_clone().unwrap());
                o.lock().unwrap().push(up.try_clone().unwrap());
                for (mut from, mut to) in [
                    (down.try_clone().unwrap(), up.try_clone().unwrap()),
                    (up, down),
                ] {
                    std::thread::spawn(move || {
                        let mut buf = [0u8; 16384];
                        while let Ok(n) = from.read(&mut buf) {
                            if n == 0 || to.write_all(&buf[..n]).is_err() {
                                break;
                            }
                        }
                        let _ = to.shutdown(Shutdown::Both);
                    });
                }
            }
        });
        Proxy { port, cut, open }
    }

    fn cut(&self) {
        self.cut.store(true, Ordering::Relaxed);
        for s in self.open.lock().unwrap().drain(..) {
            let _ = s.shutdown(Shutdown::Both);
        }
    }
}

#[test]
fn a_leader_cut_off_from_the_database_stops_and_is_not_acknowledged() {
    let Some(pg) = postgres() else { return };
    let upstream: u16 = pg
        .url
        .rsplit_once(':')
        .and_then(|(_, rest)| rest.split('/').next()?.parse().ok())
        .expect("the test database's port");
    let proxy = Proxy::start(upstream);
    let through = pg
        .url
        .replace(&format!(":{upstream}/"), &format!(":{}/", proxy.port));
    let root = tempfile::tempdir().unwrap();
    let ports = [free_port(), free_port()];
    let urls: Vec<String> = ports
        .iter()
        .map(|p| format!("http://127.0.0.1:{p}"))
        .collect();
    let mut cut_off = member(&root.path().join("a"), ports[0], &through);
    poll("the first server leads", Duration::from_secs(30), || {
        answers(&urls[0]).then_some(())
    });
    let _standby = member(&root.path().join("b"), ports[1], &pg.url);
    let admin = admin_token(&root.path().join("a"));
    let api = Api::new(&urls[0]);
    let (s, v) = api.submit_yaml(&admin, &crash_spec(1));
    assert_eq!(s, 201, "{v}");
    let before = v["id"].as_u64().unwrap();

    proxy.cut();
    let cut_at = Instant::now();
    // What the cut-off leader is sent now is not acknowledged.
    let late = {
        let admin = admin.clone();
        std::thread::spawn(move || api.submit_yaml(&admin, &crash_spec(2)))
    };
    let status = poll(
        "the cut-off leader stops by itself",
        Duration::from_secs(30),
        || cut_off.proc.0.try_wait().unwrap(),
    );
    assert!(!status.success(), "it stops with an error: {status}");
    let (s, v) = late.join().unwrap();
    assert!(
        !(200..300).contains(&s),
        "acknowledged while cut off: {s} {v}"
    );
    let log = std::fs::read_to_string(root.path().join("a/server.log")).unwrap();
    assert!(log.contains("lost its leadership lease"), "{log}");
    poll("the standby takes over", Duration::from_secs(30), || {
        answers(&urls[1]).then_some(())
    });
    println!(
        "the standby took over {:.2} s after the leader was cut off",
        cut_at.elapsed().as_secs_f64()
    );
    let jobs: Value = Api::new(&urls[1]).get("/v1/jobs?limit=100", &admin);
    let names: Vec<&str> = jobs
        .as_array()
        .unwrap()
        .iter()
        .map(|j| j["name"].as_str().unwrap())
        .collect();
    assert_eq!(names, ["job-1"], "{jobs}");
    assert_eq!(jobs[0]["id"].as_u64(), Some(before));
}
