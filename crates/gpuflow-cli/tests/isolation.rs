//! Isolation on the node: a task opens only its own GPUs' device nodes
//! (on device nodes this test makes: NVIDIA's major 195, no driver behind
//! them, so an allowed open fails with ENXIO and a denied one with EPERM),
//! does not see another team's processes, has its own `/tmp` and
//! `/dev/shm`, runs with `no_new_privs`, and cannot make a user namespace.
//!
//! All of it needs the agent to run as root (as CI does); without it the
//! tests say so and stop. The work directory is outside `/tmp` (in
//! `/var/lib`, wherever the checkout is), so the agent makes `/tmp` private.

mod common;

use std::path::Path;
use std::time::Duration;

use common::*;

const LONG: Duration = Duration::from_secs(60);

fn as_root() -> bool {
    // SAFETY: geteuid has no preconditions.
    unsafe { libc::geteuid() == 0 }
}

/// A directory outside `/tmp`, reachable by the tasks' users.
/// (The agent keeps `/tmp` shared when its work directory is under it, as
/// a checkout in `/tmp` would put the build's own temporary directory;
/// these tests run as root, so `/var/lib` is theirs.)
fn work_dir() -> tempfile::TempDir {
    use std::os::unix::fs::PermissionsExt;
    let top = std::path::Path::new("/var/lib/gpuflow-tests");
    std::fs::create_dir_all(top).unwrap();
    std::fs::set_permissions(top, std::fs::Permissions::from_mode(0o755)).unwrap();
    let d = tempfile::tempdir_in(top).unwrap();
    std::fs::set_permissions(d.path(), std::fs::Permissions::from_mode(0o755)).unwrap();
    d
}

fn log_of(api: &Api, id: u64, token: &str) -> String {
    let l = api.get(&format!("/v1/jobs/{id}/logs"), token);
    l["tasks"]["main/0"].as_str().unwrap_or("").to_string()
}

fn run(api: &Api, token: &str, queue: &str, gpus: u32, script: &str) -> (u64, String) {
    let yaml = if gpus == 0 {
        format!(
            "name: iso\nqueue: {queue}\nkind: batch\ntasks:\n  - name: main\n    command: [sh, -c, {script:?}]\n    resources: {{cpu: 0.1, memory_mib: 64}}\n"
        )
    } else {
        job_yaml("iso", queue, "batch", gpus, script, 1)
    };
    let (s, v) = api.submit_yaml(token, &yaml);
    assert_eq!(s, 201, "{v}");
    let id = v["id"].as_u64().unwrap();
    let out = poll("the job finishes", LONG, || {
        let j = api.job(id, token);
        matches!(j["state"].as_str(), Some("succeeded" | "failed")).then(|| log_of(api, id, token))
    });
    (id, out)
}

/// A server and one agent (two emulated GPUs) on a work directory outside
/// `/tmp`: the directory, both processes, a client and the admin token.
fn node() -> (tempfile::TempDir, Server, Proc, Api, String) {
    let dir = work_dir();
    let srv = server(dir.path(), free_port(), &[]);
    let agent = agent(dir.path(), &srv.url, "n1", "2");
    let api = Api::new(&srv.url);
    let admin = admin_token(dir.path());
    (dir, srv, agent, api, admin)
}

/// Makes character device nodes `nvidia0` and `nvidia1` (major 195) in `dir`.
fn fake_gpu_nodes(dir: &Path) {
    use std::os::unix::fs::PermissionsExt;
    std::fs::create_dir_all(dir).unwrap();
    std::fs::set_permissions(dir, std::fs::Permissions::from_mode(0o755)).unwrap();
    for minor in 0..2 {
        let p = std::ffi::CString::new(format!("{}/nvidia{minor}", dir.display())).unwrap();
        // SAFETY: a C string; mknod(2) has no memory-safety preconditions.
        let r =
            unsafe { libc::mknod(p.as_ptr(), libc::S_IFCHR | 0o666, libc::makedev(195, minor)) };
        assert_eq!(r, 0, "mknod: {}", std::io::Error::last_os_error());
        std::fs::set_permissions(p.to_str().unwrap(), std::fs::Permissions::from_mode(0o666))
            .unwrap();
    }
}

#[test]
fn a_task_opens_only_its_own_gpus_device_nodes() {
    if !as_root() {
        eprintln!("skipped: the agent is not root, so it sets no device control");
        return;
    }
    let (dir, _srv, _agent, api, admin) = node();
    let limits = api.node_limits(&admin);
    let controllers = limits["controllers"].to_string();
    if !controllers.contains("devices") {
        // A node that cannot confine its tasks says so.
        assert!(
            !limits["note"].as_str().unwrap_or("").is_empty(),
            "{limits}"
        );
        eprintln!("skipped: no device control here: {limits}");
        return;
    }
    let dev = dir.path().join("dev");
    fake_gpu_nodes(&dev);
    let script = format!(
        "for g in 0 1; do if true 2> err < {d}/nvidia$g; then echo \"nvidia$g opened\"; else echo \"nvidia$g $(cat err)\"; fi; done; echo visible=$CUDA_VISIBLE_DEVICES",
        d = dev.display()
    );
    let (id, out) = run(&api, &admin, "default", 1, &script);
    println!("{out}\n{}", api.job(id, &admin));
    // An emulated GPU's index is its device minor; the job got one of two.
    let mine = api.job(id, &admin)["tasks"][0]["gpus"][0].as_u64().unwrap() as u32;
    let other = 1 - mine;
    assert!(
        line_of(&out, mine).contains("No such device or address"),
        "its own GPU's node opens (no driver: ENXIO): {out}"
    );
    assert!(
        line_of(&out, other).contains("Operation not permitted"),
        "another GPU's node is denied: {out}"
    );
    // A job with no GPU opens none.
    let (_, out) = run(&api, &admin, "default", 0, &script);
    for g in 0..2 {
        assert!(!line_of(&out, g).contains("No such device"), "{out}");
    }
}

/// A MIG instance opens through its GPU's node and its two capability
/// nodes (`migcaps.rs`): a task on one instance opens its own and is
/// refused another instance's and the driver's `config` and `monitor`.
/// The driver's tables are given through `--proc-root` (major 508, no
/// driver of this machine), the emulated GPU's instance k being GPU
/// instance k + 1.
#[test]
fn a_task_opens_only_its_own_mig_instances_capabilities() {
    if !as_root() {
        eprintln!("skipped: the agent is not root, so it sets no device control");
        return;
    }
    let dir = work_dir();
    let proc = dir.path().join("proc");
    std::fs::create_dir_all(proc.join("driver/nvidia-caps")).unwrap();
    std::fs::write(
        proc.join("devices"),
        "Character devices:\n  1 mem\n195 nvidia\n508 nvidia-caps\n\nBlock devices:\n  7 loop\n",
    )
    .unwrap();
    std::fs::write(
        proc.join("driver/nvidia-caps/mig-minors"),
        "config 1\nmonitor 2\ngpu0/gi1/access 3\ngpu0/gi1/ci0/access 4\ngpu0/gi2/access 5\ngpu0/gi2/ci0/access 6\n",
    )
    .unwrap();
    let dev = dir.path().join("dev");
    fake_gpu_nodes(&dev);
    for minor in 1..=6 {
        let p = std::ffi::CString::new(format!("{}/nvidia-cap{minor}", dev.display())).unwrap();
        // SAFETY: a C string; mknod(2) has no memory-safety preconditions.
        let r =
            unsafe { libc::mknod(p.as_ptr(), libc::S_IFCHR | 0o666, libc::makedev(508, minor)) };
        assert_eq!(r, 0, "mknod: {}", std::io::Error::last_os_error());
    }
    let srv = server(dir.path(), free_port(), &[]);
    let _agent = agent_with(
        dir.path(),
        &srv.url,
        "n1",
        "1",
        &[],
        &[
            "--emulate-mig",
            "1g.10gb,1g.10gb",
            "--proc-root",
            proc.to_str().unwrap(),
        ],
    );
    let api = Api::new(&srv.url);
    let admin = admin_token(dir.path());
    let limits = api.node_limits(&admin);
    if !limits["controllers"].to_string().contains("devices") {
        eprintln!("skipped: no device control here: {limits}");
        return;
    }
    let script = format!(
        "for m in 1 2 3 4 5 6; do if true 2> err < {d}/nvidia-cap$m; then echo \"cap$m opened\"; else echo \"cap$m $(cat err)\"; fi; done; echo visible=$CUDA_VISIBLE_DEVICES",
        d = dev.display()
    );
    let yaml = format!(
        "name: mig\nqueue: default\nkind: batch\ntasks:\n  - name: main\n    command: [sh, -c, {script:?}]\n    resources: {{cpu: 0.1, memory_mib: 64, gpu: {{mode: mig, profile: 1g.10gb}}}}\n"
    );
    let (s, v) = api.submit_yaml(&admin, &yaml);
    assert_eq!(s, 201, "{v}");
    let id = v["id"].as_u64().unwrap();
    let out = poll("the job finishes", LONG, || {
        let j = api.job(id, &admin);
        matches!(j["state"].as_str(), Some("succeeded" | "failed"))
            .then(|| log_of(&api, id, &admin))
    });
    println!("{out}");
    // MIG-EMU-n1-0-k: GPU instance k + 1, whose capabilities are 2k+3, 2k+4.
    let k: u32 = out
        .lines()
        .find_map(|l| l.strip_prefix("visible=MIG-EMU-n1-0-"))
        .unwrap_or_else(|| panic!("a MIG instance: {out}"))
        .trim()
        .parse()
        .unwrap();
    let own = [2 * k + 3, 2 * k + 4];
    for m in 1..=6u32 {
        let line = out
            .lines()
            .find(|l| l.starts_with(&format!("cap{m} ")))
            .unwrap_or_else(|| panic!("{out}"));
        if own.contains(&m) {
            assert!(
                line.contains("No such device or address"),
                "its own capability opens: {out}"
            );
        } else {
            assert!(
                line.contains("Operation not permitted"),
                "cap{m} is denied: {out}"
            );
        }
    }
}

fn line_of(out: &str, g: u32) -> String {
    out.lines()
        .find(|l| l.starts_with(&format!("nvidia{g} ")))
        .unwrap_or_else(|| panic!("{out}"))
        .to_string()
}

#[test]
fn a_task_sees_no_other_teams_process_and_shares_no_tmp_or_shm() {
    if !as_root() {
        eprintln!("skipped: the agent is not root, so tasks get no namespaces");
        return;
    }
    let (dir, _srv, _agent, api, admin) = node();
    let (mallory, victor) = api.alpha_and_beta(&admin);
    // Beta's job leaves marks in /tmp and /dev/shm and runs on.
    let marks =
        "echo $$ > /tmp/gpuflow-mark; echo $$ > /dev/shm/gpuflow-mark; echo marked; exec sleep 300";
    let (s, v) = api.submit_yaml(&victor, &job_yaml("victim", "beta-q", "batch", 1, marks, 1));
    assert_eq!(s, 201, "{v}");
    let victim = v["id"].as_u64().unwrap();
    poll("the victim marks", LONG, || {
        log_of(&api, victim, &victor)
            .contains("marked")
            .then_some(())
    });
    let task_dir = dir.path().join(format!("work-n1/job-{victim}/a1-g0-i0"));
    let pid: u32 = std::fs::read_to_string(task_dir.join("tmp/gpuflow-mark"))
        .expect("the victim's /tmp is its directory's tmp")
        .trim()
        .parse()
        .unwrap();
    assert!(alive(pid));
    assert!(
        !Path::new("/tmp/gpuflow-mark").exists() || {
            // Another run's leftover would not hold this pid.
            std::fs::read_to_string("/tmp/gpuflow-mark").unwrap().trim() != pid.to_string()
        },
        "the victim wrote to the node's /tmp"
    );
    let attack = format!(
        "test -e /proc/{pid} && echo proc-sees-victim || echo proc-hidden; \
         echo procs=$(ls -d /proc/[0-9]* | wc -l); \
         cat /tmp/gpuflow-mark 2>/dev/null || echo tmp-private; \
         cat /dev/shm/gpuflow-mark 2>/dev/null || echo shm-private; \
         grep NoNewPrivs /proc/self/status; \
         unshare -U true 2>&1 && echo userns-made || echo userns-refused; \
         grep Seccomp: /proc/self/status"
    );
    let (_, out) = run(&api, &mallory, "alpha-q", 1, &attack);
    println!("{out}");
    for want in [
        "proc-hidden",
        "tmp-private",
        "shm-private",
        "userns-refused",
    ] {
        assert!(out.contains(want), "{want}: {out}");
    }
    assert!(out.contains("NoNewPrivs:\t1"), "{out}");
    assert!(out.contains("Seccomp:\t2"), "{out}");
    // The victim's own team still sees its own processes.
    let (_, out) = run(
        &api,
        &victor,
        "beta-q",
        0,
        &format!("test -e /proc/{pid} && echo sees-own || echo own-hidden"),
    );
    assert!(out.contains("sees-own"), "{out}");
}
