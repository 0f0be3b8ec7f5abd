//! Idle and half-sent connections: 2,000 connections that say nothing,
//! or send half a request and stall, against a server started with
//! systemd's default soft limit of 1,024 open files. They took the API
//! down (every call timed out and a restarting agent lost its node); now
//! the API answers, the agent heartbeats, and the server closes them.

mod common;

use std::io::{Read, Write};
use std::net::TcpStream;
use std::time::{Duration, Instant};

use common::*;

const LONG: Duration = Duration::from_secs(60);

/// Raises this process's own open-file limit to hold the connections.
fn raise_own_nofile() {
    let mut l = libc::rlimit {
        rlim_cur: 0,
        rlim_max: 0,
    };
    // SAFETY: getrlimit/setrlimit read and write `l` only.
    unsafe {
        libc::getrlimit(libc::RLIMIT_NOFILE, &mut l);
        l.rlim_cur = l.rlim_max;
        libc::setrlimit(libc::RLIMIT_NOFILE, &l);
    }
}

#[test]
fn idle_and_half_sent_connections_leave_the_api_answering_and_agents_heartbeating() {
    raise_own_nofile();
    let dir = tempfile::tempdir().unwrap();
    let srv = server_nofile(dir.path(), free_port(), &[], Some(1024));
    let _agent = agent(dir.path(), &srv.url, "n1", "1");
    let api = Api::new(&srv.url);
    let admin = admin_token(dir.path());
    poll("the node is ready", LONG, || {
        (api.get("/v1/nodes", &admin)[0]["state"] == "ready").then_some(())
    });
    let addr = format!("127.0.0.1:{}", srv.port);
    let mut held = Vec::new();
    for i in 0..2000 {
        let Ok(mut c) = TcpStream::connect(&addr) else {
            break;
        };
        if i % 10 == 0 {
            // Half a request: a head promising a body that never comes.
            let _ = c.write_all(
                b"POST /v1/jobs HTTP/1.1\r\nHost: x\r\nContent-Type: application/json\r\nContent-Length: 1000\r\n\r\n{\"name\":",
            );
        } else if i % 10 == 1 {
            // Half a head.
            let _ = c.write_all(b"GET /v1/nodes HTTP/1.1\r\nHost: x\r\n");
        }
        held.push(c);
    }
    println!("{} connections held", held.len());
    assert!(held.len() >= 1900, "only {} connected", held.len());
    // The API answers while they are held, and the agent keeps its node
    // past the node timeout (6 s).
    let start = Instant::now();
    while start.elapsed() < Duration::from_secs(8) {
        let t = Instant::now();
        let nodes = poll("the API answers", Duration::from_secs(20), || {
            let (s, v) = api.call("GET", "/v1/nodes", &admin, None);
            (s == 200).then_some(v)
        });
        assert_eq!(nodes[0]["state"], "ready", "{nodes}");
        println!("answered in {:?}", t.elapsed());
        std::thread::sleep(Duration::from_millis(500));
    }
    // Submissions go through too.
    let (s, v) = api.submit_yaml(
        &admin,
        &job_yaml("after", "default", "batch", 1, "echo ok", 1),
    );
    assert_eq!(s, 201, "{v}");
    // The server closes what stalls: every held connection is closed (or
    // answered with an error and closed) within the header and idle
    // timeouts.
    let deadline = Instant::now() + Duration::from_secs(90);
    let mut open = 0;
    for c in &mut held {
        let left = deadline.saturating_duration_since(Instant::now());
        c.set_read_timeout(Some(left.max(Duration::from_millis(10))))
            .unwrap();
        let mut buf = [0u8; 4096];
        let closed = loop {
            match c.read(&mut buf) {
                Ok(0) => break true,
                Ok(_) => continue,
                Err(e)
                    if matches!(
                        e.kind(),
                        std::io::ErrorKind::WouldBlock | std::io::ErrorKind::TimedOut
                    ) =>
                {
                    break false;
                }
                Err(_) => break true,
            }
        };
        if !closed {
            open += 1;
        }
    }
    assert_eq!(
        open, 0,
        "{open} stalled connections still open after the timeouts"
    );
    let nodes = api.get("/v1/nodes", &admin);
    assert_eq!(nodes[0]["state"], "ready", "{nodes}");
}
