//! Partition tests: a job's node loses the server, once by its agent being
//! frozen (SIGSTOP) and once by its connection being cut (a TCP relay the
//! test controls). Sampled every 50 ms, the job never has two live copies:
//! the node's keepers stop its task before the lease runs out, and only
//! after the lease is the work placed on the other node.

mod common;

use std::net::{Shutdown, TcpListener, TcpStream};
use std::sync::Arc;
use std::sync::atomic::{AtomicBool, AtomicUsize, Ordering};
use std::time::{Duration, Instant};

use common::*;

const LONG: Duration = Duration::from_secs(60);
/// The server's `--node-timeout` in `common::server`: the node lease.
const LEASE_S: u64 = 6;

/// A TCP relay to `target` that can be cut (every connection dropped, new
/// ones refused at once) and healed.
struct Relay {
    port: u16,
    cut: Arc<AtomicBool>,
}

impl Relay {
    fn start(target: u16) -> Relay {
        let listener = TcpListener::bind("127.0.0.1:0").unwrap();
        let port = listener.local_addr().unwrap().port();
        let cut = Arc::new(AtomicBool::new(false));
        let c = cut.clone();
        std::thread::spawn(move || {
            for conn in listener.incoming() {
                let Ok(client) = conn else { continue };
                if c.load(Ordering::SeqCst) {
                    drop(client);
                    continue;
                }
                let Ok(server) = TcpStream::connect(("127.0.0.1", target)) else {
                    continue;
                };
                for (from, to) in [
                    (client.try_clone().unwrap(), server.try_clone().unwrap()),
                    (server, client),
                ] {
                    let c = c.clone();
                    std::thread::spawn(move || pipe(from, to, &c));
                }
            }
        });
        Relay { port, cut }
    }
}

fn pipe(mut from: TcpStream, mut to: TcpStream, cut: &AtomicBool) {
    use std::io::{Read, Write};
    from.set_read_timeout(Some(Duration::from_millis(50)))
        .unwrap();
    let mut buf = [0u8; 16384];
    loop {
        if cut.load(Ordering::SeqCst) {
            break;
        }
        match from.read(&mut buf) {
            Ok(0) => break,
            Ok(n) => {
                if to.write_all(&buf[..n]).is_err() {
                    break;
                }
            }
            Err(e)
                if matches!(
                    e.kind(),
                    std::io::ErrorKind::WouldBlock | std::io::ErrorKind::TimedOut
                ) => {}
            Err(_) => break,
        }
    }
    let _ = from.shutdown(Shutdown::Both);
    let _ = to.shutdown(Shutdown::Both);
}

/// The pid a task wrote to its directory, if it has.
fn pid_of(dir: &std::path::Path, node: &str, job: u64, attempt: u32) -> Option<u32> {
    let p = dir
        .join(format!("work-{node}"))
        .join(format!("job-{job}"))
        .join(format!("a{attempt}-g0-i0"))
        .join("pid");
    std::fs::read_to_string(p).ok()?.trim().parse().ok()
}

/// Runs a job on n1, partitions n1 with `cut`, and checks that the job
/// moves to n2 with never two copies alive; then `heal`s.
fn partition(via_relay: bool, cut: impl FnOnce(&Proc, &Relay), heal: impl FnOnce(&Proc, &Relay)) {
    let dir = tempfile::tempdir().unwrap();
    let srv = server(dir.path(), free_port(), &[]);
    let api = Api::new(&srv.url);
    let admin = admin_token(dir.path());
    let relay = Relay::start(srv.port);
    let n1_url = if via_relay {
        format!("http://127.0.0.1:{}", relay.port)
    } else {
        srv.url.clone()
    };
    let n1 = agent(dir.path(), &n1_url, "n1", "1");
    let (s, v) = api.submit_yaml(
        &admin,
        &job_yaml(
            "long",
            "default",
            "training",
            1,
            "echo $$ > pid; exec sleep 300",
            2,
        ),
    );
    assert_eq!(s, 201, "{v}");
    let id = v["id"].as_u64().unwrap();
    api.wait_state(id, &admin, "running", LONG);
    poll("the task on n1 writes its pid", LONG, || {
        pid_of(dir.path(), "n1", id, 1)
    });
    let _n2 = agent(dir.path(), &srv.url, "n2", "1");
    poll("n2 joins", LONG, || {
        (api.get("/v1/nodes", &admin).as_array()?.len() == 2).then_some(())
    });

    // Sample both copies from here on.
    let done = Arc::new(AtomicBool::new(false));
    let most = Arc::new(AtomicUsize::new(0));
    let samples = Arc::new(AtomicUsize::new(0));
    let sampler = {
        let (done, most, samples) = (done.clone(), most.clone(), samples.clone());
        let dir = dir.path().to_path_buf();
        std::thread::spawn(move || {
            while !done.load(Ordering::SeqCst) {
                let live = [("n1", 1), ("n2", 2)]
                    .iter()
                    .filter(|(n, a)| pid_of(&dir, n, id, *a).is_some_and(alive))
                    .count();
                most.fetch_max(live, Ordering::SeqCst);
                samples.fetch_add(1, Ordering::SeqCst);
                std::thread::sleep(Duration::from_millis(50));
            }
        })
    };
    let cut_at = Instant::now();
    cut(&n1, &relay);
    let j = api.wait_state(id, &admin, "running", LONG);
    let moved = poll("the job runs on n2", LONG, || {
        let j = api.job(id, &admin);
        (j["state"] == "running" && j["tasks"][0]["node"] == "n2").then_some(j)
    });
    assert_eq!(moved["attempts"], 2, "{j}");
    let pid2 = poll("the task on n2 writes its pid", LONG, || {
        pid_of(dir.path(), "n2", id, 2)
    });
    assert!(
        cut_at.elapsed() >= Duration::from_secs(LEASE_S - 1),
        "requeued {:?} after the cut, before the {LEASE_S} s lease",
        cut_at.elapsed()
    );
    let pid1 = pid_of(dir.path(), "n1", id, 1).unwrap();
    assert!(!alive(pid1), "the partitioned copy still runs");
    heal(&n1, &relay);
    poll("n1 is back", LONG, || {
        (api.get("/v1/nodes", &admin)[0]["state"] == "ready").then_some(())
    });
    // A while with both nodes up: still one copy.
    std::thread::sleep(Duration::from_secs(2));
    done.store(true, Ordering::SeqCst);
    sampler.join().unwrap();
    println!(
        "{} samples, at most {} live copies",
        samples.load(Ordering::SeqCst),
        most.load(Ordering::SeqCst)
    );
    assert_eq!(
        most.load(Ordering::SeqCst),
        1,
        "two copies of the job ran at once"
    );
    assert!(alive(pid2));
    let j = api.job(id, &admin);
    assert_eq!(
        (j["state"].as_str(), j["tasks"][0]["node"].as_str()),
        (Some("running"), Some("n2"))
    );
}

#[test]
fn a_frozen_agent_never_leaves_a_second_copy_running() {
    partition(
        false,
        |n1, _| n1.signal("-STOP"),
        |n1, _| n1.signal("-CONT"),
    );
}

#[test]
fn an_agent_cut_off_from_the_server_never_leaves_a_second_copy_running() {
    partition(
        true,
        |_, relay| relay.cut.store(true, Ordering::SeqCst),
        |_, relay| relay.cut.store(false, Ordering::SeqCst),
    );
}
