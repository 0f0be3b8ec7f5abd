//! Partition tests: a job's node loses the server, once by its agent being
//! frozen (SIGSTOP) and once by its connection being cut (a TCP relay the
//! test controls). Sampled every 50 ms, the job never has two live copies:
//! the node's keepers stop its task before the lease runs out, and only
//! after the lease is the work placed on the other node. A task that
//! leaves its process group (`setsid`, as `ray start` or `jupyter` do) is
//! fenced whole too: through its cgroup and its keeper's subreaping.

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
    pid_in(dir, node, job, attempt, "pid")
}

/// The pid a task wrote to `file` in its directory, if it has.
fn pid_in(dir: &std::path::Path, node: &str, job: u64, attempt: u32, file: &str) -> Option<u32> {
    let p = dir
        .join(format!("work-{node}"))
        .join(format!("job-{job}"))
        .join(format!("a{attempt}-g0-i0"))
        .join(file);
    std::fs::read_to_string(p).ok()?.trim().parse().ok()
}

/// A task that starts a daemon in a session of its own (out of its
/// process group) and then runs on; both write their pids.
const DAEMONISED: &str = "setsid sh -c 'echo $$ > daemon; exec sleep 901' </dev/null >/dev/null 2>&1 & echo $$ > pid; exec sleep 900";

/// Runs a job on n1, partitions n1 with `cut`, and checks that the job
/// moves to n2 with never two copies alive; then `heal`s (given a way to
/// start n1's agent again). With `daemon`, the job leaves a daemon
/// outside its process group, and a copy is alive while either runs.
fn partition(
    via_relay: bool,
    daemon: bool,
    cut: impl FnOnce(&Proc, &Relay),
    heal: impl FnOnce(&mut Proc, &Relay, &dyn Fn() -> Proc),
) {
    partition_with(via_relay, daemon, &[], cut, heal);
}

/// [`partition`] with more arguments for n1's agent.
fn partition_with(
    via_relay: bool,
    daemon: bool,
    n1_args: &[&str],
    cut: impl FnOnce(&Proc, &Relay),
    heal: impl FnOnce(&mut Proc, &Relay, &dyn Fn() -> Proc),
) {
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
    let restart = || agent_with(dir.path(), &n1_url, "n1", "1", &[], n1_args);
    let mut n1 = restart();
    let script = if daemon {
        DAEMONISED
    } else {
        "echo $$ > pid; exec sleep 300"
    };
    let (s, v) = api.submit_yaml(
        &admin,
        &job_yaml("long", "default", "training", 1, script, 2),
    );
    assert_eq!(s, 201, "{v}");
    let id = v["id"].as_u64().unwrap();
    api.wait_state(id, &admin, "running", LONG);
    poll("the task on n1 writes its pid", LONG, || {
        pid_of(dir.path(), "n1", id, 1)
    });
    let files: &[&str] = if daemon { &["pid", "daemon"] } else { &["pid"] };
    if daemon {
        poll("the daemon on n1 writes its pid", LONG, || {
            pid_in(dir.path(), "n1", id, 1, "daemon")
        });
    }
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
                    .filter(|(n, a)| {
                        files
                            .iter()
                            .any(|f| pid_in(&dir, n, id, *a, f).is_some_and(alive))
                    })
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
    for f in files {
        let pid1 = pid_in(dir.path(), "n1", id, 1, f).unwrap();
        assert!(!alive(pid1), "the partitioned copy's {f} still runs");
    }
    heal(&mut n1, &relay, &restart);
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
        false,
        |n1, _| n1.signal("-STOP"),
        |n1, _, _| n1.signal("-CONT"),
    );
}

#[test]
fn a_daemon_of_a_frozen_agents_task_is_fenced_with_it() {
    partition(
        false,
        true,
        |n1, _| n1.signal("-STOP"),
        |n1, _, _| n1.signal("-CONT"),
    );
}

#[test]
fn a_daemon_of_a_killed_agents_task_is_fenced_with_it() {
    partition(
        false,
        true,
        |n1, _| n1.signal("-KILL"),
        |n1, _, restart| *n1 = restart(),
    );
}

/// Without cgroups (an agent that cannot make them, here one pointed at a
/// directory that is no cgroup hierarchy), the keeper's subreaping alone
/// fences the daemon.
#[test]
fn a_daemon_of_a_killed_agents_task_is_fenced_with_it_without_cgroups() {
    let empty = tempfile::tempdir().unwrap();
    let root = empty.path().to_str().unwrap();
    partition_with(
        false,
        true,
        &["--cgroup-root", root],
        |n1, _| n1.signal("-KILL"),
        |n1, _, restart| *n1 = restart(),
    );
}

/// On cgroup v2 (the node's own hierarchy when it has controllers, or one
/// this test mounts as root): the fence is `cgroup.kill`.
#[test]
fn a_daemon_of_a_killed_agents_task_is_fenced_with_it_on_cgroup_v2() {
    let scratch = tempfile::tempdir().unwrap();
    let root = match v2_hierarchy(scratch.path()) {
        Ok(r) => r,
        Err(why) => {
            eprintln!("cgroup v2 case skipped: {why}");
            return;
        }
    };
    eprintln!("cgroup v2 case ran on {}", root.display());
    let r = root.to_str().unwrap().to_string();
    partition_with(
        false,
        true,
        &["--cgroup-root", &r],
        |n1, _| n1.signal("-KILL"),
        |n1, _, restart| *n1 = restart(),
    );
    if root == scratch.path() {
        let _ = std::process::Command::new("umount").arg(&root).status();
    }
}

/// A cgroup v2 hierarchy with the pids controller: mounted at `/sys/fs/cgroup`
/// or `/sys/fs/cgroup/unified`, or mounted at `scratch` by this test (as
/// root); why not where none has it (every controller bound to v1).
fn v2_hierarchy(scratch: &std::path::Path) -> Result<std::path::PathBuf, String> {
    let has_pids = |p: &std::path::Path| {
        std::fs::read_to_string(p.join("cgroup.controllers"))
            .is_ok_and(|c| c.split_whitespace().any(|c| c == "pids"))
    };
    for p in ["/sys/fs/cgroup", "/sys/fs/cgroup/unified"] {
        if has_pids(std::path::Path::new(p)) {
            // The node's own v2 tree: the agent finds it without a root.
            return Err(format!(
                "{p} is the node's own v2 hierarchy: the default cases run on it"
            ));
        }
    }
    // SAFETY: geteuid has no preconditions.
    if unsafe { libc::geteuid() } != 0 {
        return Err("not root: cannot mount a cgroup v2 hierarchy".into());
    }
    let ok = std::process::Command::new("mount")
        .args(["-t", "cgroup2", "none"])
        .arg(scratch)
        .status()
        .is_ok_and(|s| s.success());
    if !ok {
        return Err("mount -t cgroup2 failed".into());
    }
    if !has_pids(scratch) {
        let _ = std::process::Command::new("umount").arg(scratch).status();
        return Err(
            "a cgroup v2 hierarchy mounts, but its controllers are all bound to v1 hierarchies"
                .into(),
        );
    }
    Ok(scratch.to_path_buf())
}

#[test]
fn an_agent_cut_off_from_the_server_never_leaves_a_second_copy_running() {
    partition(
        true,
        false,
        |_, relay| relay.cut.store(true, Ordering::SeqCst),
        |_, relay, _| relay.cut.store(false, Ordering::SeqCst),
    );
}
