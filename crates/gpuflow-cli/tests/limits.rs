//! Limits that hold, end to end: the real server and agent, tasks as real
//! processes in the agent's cgroups (v1 or v2, whichever this machine
//! has; the test says which ran). A task that allocates past its memory
//! limit is killed by the kernel and reported as out of memory with its
//! event; a busy loop gets no more CPU than its quota; a process that left
//! the task's process group and ignores the stop signal is still killed
//! after the grace period. Skipped, with the reason printed, where the
//! agent cannot make cgroups (not root).

mod common;

use std::time::{Duration, Instant};

use common::*;

const LONG: Duration = Duration::from_secs(60);

fn job(name: &str, cpu: f64, memory_mib: u64, script: &str, grace: u64) -> String {
    format!(
        "name: {name}\nqueue: default\nkind: batch\ncheckpoint: {{grace_s: {grace}}}\ntasks:\n  - name: main\n    command: [sh, -c, {script:?}]\n    resources: {{cpu: {cpu}, memory_mib: {memory_mib}}}\n"
    )
}

fn log_of(api: &Api, id: u64, token: &str) -> String {
    api.get(&format!("/v1/jobs/{id}/logs"), token)["tasks"]
        .as_object()
        .and_then(|t| t.values().next())
        .and_then(|v| v.as_str())
        .unwrap_or_default()
        .to_string()
}

#[test]
fn memory_cpu_and_process_tree_limits_hold() {
    let dir = tempfile::tempdir().unwrap();
    let srv = server(dir.path(), free_port(), &[]);
    let _agent = agent(dir.path(), &srv.url, "lim", "1");
    let api = Api::new(&srv.url);
    let admin = admin_token(dir.path());
    let limits = api.node_limits(&admin);
    let cgroup = limits["cgroup"].as_str().unwrap_or_default().to_string();
    if cgroup.is_empty() {
        assert!(
            !limits["note"].as_str().unwrap_or_default().is_empty(),
            "a node without limits says why: {limits}"
        );
        eprintln!("skipped: the agent sets no limits here: {}", limits["note"]);
        return;
    }
    eprintln!(
        "cgroup {cgroup} path ran, controllers {}",
        limits["controllers"]
    );

    // 1. Memory: 400 MiB written under a 64 MiB limit.
    let (s, v) = api.submit_yaml(
        &admin,
        &job(
            "hog",
            0.5,
            64,
            "exec python3 -c \"x = b'x' * (400 << 20); print('survived')\"",
            1,
        ),
    );
    assert_eq!(s, 201, "{v}");
    let hog = v["id"].as_u64().unwrap();
    let failed = api.wait_state(hog, &admin, "failed", LONG);
    assert!(
        failed["reason"]
            .as_str()
            .unwrap()
            .contains("out of memory: the kernel killed it at its memory limit of 64 MiB"),
        "{failed}"
    );
    let events = api.get(&format!("/v1/events?job={hog}"), &admin);
    assert!(
        events
            .as_array()
            .unwrap()
            .iter()
            .any(|e| e["kind"] == "oom" && e["message"].as_str().unwrap().contains("64 MiB")),
        "{events}"
    );
    assert!(!log_of(&api, hog, &admin).contains("survived"));

    // 2. CPU: a busy loop for 3 s of wall time under a fifth of a CPU.
    let (s, v) = api.submit_yaml(
        &admin,
        &job(
            "spin",
            0.2,
            256,
            "exec python3 -c \"import os, time\nt = time.time()\nwhile time.time() - t < 3: pass\nc = os.times()\nprint('cpu', c.user + c.system, 'wall', time.time() - t)\"",
            1,
        ),
    );
    assert_eq!(s, 201, "{v}");
    let spin = v["id"].as_u64().unwrap();
    api.wait_state(spin, &admin, "succeeded", LONG);
    let out = log_of(&api, spin, &admin);
    let words: Vec<&str> = out.split_whitespace().collect();
    let num = |k: &str| -> f64 {
        let i = words.iter().position(|w| *w == k).expect(&out);
        words[i + 1].parse().unwrap()
    };
    let (cpu, wall) = (num("cpu"), num("wall"));
    eprintln!("busy loop under cpu: 0.2 used {cpu:.2} s of CPU in {wall:.2} s");
    assert!(cpu > 0.0, "{out}");
    assert!(
        cpu / wall < 0.35,
        "a task limited to 0.2 CPU used {cpu:.2} s of CPU in {wall:.2} s"
    );

    // 3. The whole tree: a child leaves the task's process group (its own
    // session) and ignores SIGTERM; cancelling the job still kills it once
    // the grace period is over.
    let (s, v) = api.submit_yaml(
        &admin,
        &job(
            "escape",
            0.2,
            64,
            "setsid sh -c 'trap \"\" TERM; for c in /sys/fs/cgroup/*/cgroup.procs /sys/fs/cgroup/cgroup.procs; do echo $$ > $c; done 2>/dev/null; echo escaped $$; while :; do sleep 1; done' & trap '' TERM; while :; do sleep 1; done",
            1,
        ),
    );
    assert_eq!(s, 201, "{v}");
    let esc = v["id"].as_u64().unwrap();
    api.wait_state(esc, &admin, "running", LONG);
    let pid: u32 = poll("the escaped child reports its pid", LONG, || {
        let out = log_of(&api, esc, &admin);
        let i = out.find("escaped ")?;
        out[i + 8..].split_whitespace().next()?.parse().ok()
    });
    assert!(alive(pid));
    // The escaped child tried to move itself to the root cgroups and is
    // still in the task's, with the task's limits.
    let cgroup_of = |pid: u32| std::fs::read_to_string(format!("/proc/{pid}/cgroup")).unwrap();
    let groups = cgroup_of(pid);
    assert!(
        groups.contains("gpuflow/lim.") && groups.contains(&format!("/job-{esc}-a1-g0-i0")),
        "{groups}"
    );
    if cgroup == "v1" {
        let mount = |c: &str| -> String {
            let line = groups
                .lines()
                .find(|l| {
                    l.split(':')
                        .nth(1)
                        .is_some_and(|cs| cs.split(',').any(|x| x == c))
                })
                .unwrap();
            format!("/sys/fs/cgroup/{c}{}", line.rsplit(':').next().unwrap())
        };
        let read = |p: String| std::fs::read_to_string(&p).unwrap_or_else(|e| panic!("{p}: {e}"));
        assert_eq!(
            read(format!("{}/memory.limit_in_bytes", mount("memory"))).trim(),
            (64u64 << 20).to_string()
        );
        assert_eq!(
            read(format!("{}/cpu.cfs_quota_us", mount("cpu"))).trim(),
            "20000"
        );
        // One task gets 4,096 pids by default, never more than a quarter
        // of the node's; all tasks together three quarters.
        let pid_max: u64 = read("/proc/sys/kernel/pid_max".into())
            .trim()
            .parse()
            .unwrap();
        assert_eq!(
            read(format!("{}/pids.max", mount("pids"))).trim(),
            4096.min(pid_max / 4).to_string()
        );
        assert_eq!(
            read(format!("{}/../pids.max", mount("pids"))).trim(),
            (pid_max * 3 / 4).to_string()
        );
    }
    let (s, v) = api.post_json(
        &format!("/v1/jobs/{esc}/cancel"),
        &admin,
        &serde_json::json!({}),
    );
    assert_eq!(s, 200, "{v}");
    api.wait_state(esc, &admin, "cancelled", LONG);
    let end = Instant::now() + Duration::from_secs(10);
    while alive(pid) && Instant::now() < end {
        std::thread::sleep(Duration::from_millis(100));
    }
    assert!(
        !alive(pid),
        "the process that left the task's group outlived the grace period"
    );

    // 4. A checkpoint reported by touching the file the task is given
    // reaches the server (as does a Unix time written to it).
    let (s, v) = api.submit_yaml(
        &admin,
        &job(
            "ckpt",
            0.2,
            64,
            "touch \"$GPUFLOW_CHECKPOINT_FILE\"; exec sleep 300",
            1,
        ),
    );
    assert_eq!(s, 201, "{v}");
    let ckpt = v["id"].as_u64().unwrap();
    let at = poll("the checkpoint reaches the server", LONG, || {
        api.job(ckpt, &admin)["last_checkpoint"].as_u64()
    });
    let now = std::time::SystemTime::now()
        .duration_since(std::time::UNIX_EPOCH)
        .unwrap()
        .as_secs();
    assert!(now.abs_diff(at) < 120, "checkpoint at {at}, now {now}");
}
