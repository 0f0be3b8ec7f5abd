//! A way into running jobs through the CLI: `job exec` runs a command
//! beside a task as the task runs (its user, directory, environment), on
//! pipes or a terminal, with input passed and the command's exit status;
//! `job attach` follows the task's output. Another team gets 404, the
//! audit log names who ran what, and a client that vanishes takes its
//! command with it. On `gpuflow up` with emulated GPUs.

mod common;

use std::io::Write;
use std::process::{Command, Stdio};
use std::time::Duration;

use common::*;

const LONG: Duration = Duration::from_secs(60);

/// `gpuflow` with a server and token, `input` on its stdin; `(exit code,
/// stdout, stderr)`.
fn gpuflow(url: &str, token: &str, args: &[&str], input: &str) -> (i32, String, String) {
    let mut child = Command::new(BIN)
        .args(args)
        .env("GPUFLOW_SERVER", url)
        .env("GPUFLOW_TOKEN", token)
        .stdin(Stdio::piped())
        .stdout(Stdio::piped())
        .stderr(Stdio::piped())
        .spawn()
        .unwrap();
    child
        .stdin
        .take()
        .unwrap()
        .write_all(input.as_bytes())
        .unwrap();
    let out = child.wait_with_output().unwrap();
    (
        out.status.code().unwrap_or(-1),
        String::from_utf8_lossy(&out.stdout).into_owned(),
        String::from_utf8_lossy(&out.stderr).into_owned(),
    )
}

/// Processes whose command line contains `marker`.
fn processes_with(marker: &str) -> usize {
    std::fs::read_dir("/proc")
        .unwrap()
        .filter_map(|e| {
            let cmd = std::fs::read(e.ok()?.path().join("cmdline")).ok()?;
            String::from_utf8_lossy(&cmd)
                .replace('\0', " ")
                .contains(marker)
                .then_some(())
        })
        .count()
}

#[test]
fn exec_and_attach_reach_a_running_task_as_it_runs_for_its_team_only() {
    let dir = tempfile::tempdir().unwrap();
    let (_up, api, admin) = up(&dir.path().join("data"), free_port(), "2xemu-gpu", &[]);
    let (alpha, beta) = api.alpha_and_beta(&admin);
    let (s, v) = api.submit_yaml(
        &alpha,
        "name: loop\nqueue: alpha-q\nkind: batch\ntasks:\n  - name: main\n    command: [sh, -c, 'i=0; while true; do i=$((i+1)); echo tick $i; sleep 0.2; done']\n    env: {GREETING: hello}\n    resources: {cpu: 0.1, memory_mib: 64}\n",
    );
    assert_eq!(s, 201, "{v}");
    let id = v["id"].as_u64().unwrap();
    api.wait_state(id, &alpha, "running", LONG);
    let ids = id.to_string();
    let url = api.url.clone();

    // On pipes: input passes, stdout and stderr stay apart, the exit
    // status is the command's; it runs where and as the task runs.
    let (code, out, err) = gpuflow(
        &url,
        &alpha,
        &[
            "job",
            "exec",
            &ids,
            "-T",
            "--",
            "sh",
            "-c",
            "id -u; echo \"greeting=$GREETING\"; ls -d \"$HOME\" >/dev/null && echo home-ok; cat; echo to-stderr >&2; exit 3",
        ],
        "piped-in\n",
    );
    assert_eq!(code, 3, "{out}\n{err}");
    assert!(out.contains("greeting=hello"), "{out}");
    assert!(out.contains("home-ok"), "{out}");
    assert!(out.contains("piped-in"), "{out}");
    assert!(
        !out.contains("to-stderr") && err.contains("to-stderr"),
        "{out}\n{err}"
    );
    // SAFETY: geteuid has no preconditions.
    if unsafe { libc::geteuid() } == 0 {
        assert_ne!(out.lines().next(), Some("0"), "ran as root: {out}");
    }

    // On a terminal: the shell reads its input from it and its exit
    // status comes back.
    let (code, out, err) = gpuflow(
        &url,
        &alpha,
        &["job", "exec", &ids, "-t", "--", "sh"],
        "echo $((6*7)); tty\nexit 7\n",
    );
    assert_eq!(code, 7, "{out}\n{err}");
    assert!(out.contains("42") && out.contains("/dev/pts/"), "{out}");

    // A command that does not exist: a clear failure.
    let (code, _, err) = gpuflow(
        &url,
        &alpha,
        &["job", "exec", &ids, "--", "no-such-program"],
        "",
    );
    assert_eq!(code, 1);
    assert!(err.contains("cannot start \"no-such-program\""), "{err}");

    // Attach follows the output as it is written.
    let child = Command::new(BIN)
        .args(["job", "attach", &ids])
        .env("GPUFLOW_SERVER", &url)
        .env("GPUFLOW_TOKEN", &alpha)
        .stdout(Stdio::piped())
        .spawn()
        .unwrap();
    std::thread::sleep(Duration::from_secs(3));
    // SAFETY: kill has no memory-safety preconditions.
    unsafe { libc::kill(child.id() as i32, libc::SIGINT) };
    let out = child.wait_with_output().unwrap();
    let text = String::from_utf8_lossy(&out.stdout);
    assert!(text.matches("tick ").count() >= 5, "{text}");

    // Another team's member: as if the job did not exist.
    let (code, _, err) = gpuflow(&url, &beta, &["job", "exec", &ids, "--", "true"], "");
    assert_eq!(code, 1);
    assert!(err.contains("404") && err.contains("not found"), "{err}");
    let (code, _, err) = gpuflow(&url, &beta, &["job", "attach", &ids], "");
    assert_eq!(code, 1);
    assert!(err.contains("404"), "{err}");
    // A teammate: not into another member's job, unless the team shares
    // control.
    let mate = api.user_token(&admin, "alpha", "mate", "member");
    for args in [
        vec!["job", "exec", &ids, "--", "true"],
        vec!["job", "attach", &ids],
    ] {
        let (code, _, err) = gpuflow(&url, &mate, &args, "");
        assert_eq!(code, 1, "{err}");
        assert!(err.contains("403") && err.contains("mallory's"), "{err}");
    }

    // A client that vanishes mid-session takes its command with it.
    let mut child = Command::new(BIN)
        .args(["job", "exec", &ids, "-T", "--", "sleep", "3171"])
        .env("GPUFLOW_SERVER", &url)
        .env("GPUFLOW_TOKEN", &alpha)
        .stdin(Stdio::piped())
        .spawn()
        .unwrap();
    poll("the command runs", LONG, || {
        (processes_with("sleep 3171") > 0).then_some(())
    });
    child.kill().unwrap();
    let _ = child.wait();
    poll("the command is killed", LONG, || {
        (processes_with("sleep 3171") == 0).then_some(())
    });

    // The audit log names who ran what.
    let audit = api.get("/v1/audit?limit=1000", &admin);
    let execs: Vec<&serde_json::Value> = audit
        .as_array()
        .unwrap()
        .iter()
        .filter(|a| a["action"] == "job.exec")
        .collect();
    assert!(
        execs.iter().any(|a| a["actor"] == "mallory"
            && a["target"] == format!("job/{id}")
            && a["detail"]
                .as_str()
                .unwrap_or("")
                .contains("no-such-program")),
        "{audit}"
    );
    assert!(
        !execs.iter().any(|a| a["actor"] == "victor"),
        "a refused exec is not run: {audit}"
    );

    // Once the job ends there is nothing to exec into.
    let (s, v) = api.post_json(
        &format!("/v1/jobs/{id}/cancel"),
        &alpha,
        &serde_json::json!({}),
    );
    assert!(s == 200 || s == 202, "{v}");
    api.wait_state(id, &alpha, "cancelled", LONG);
    let (code, _, err) = gpuflow(&url, &alpha, &["job", "exec", &ids, "--", "true"], "");
    assert_eq!(code, 1);
    assert!(err.contains("has ended (cancelled)"), "{err}");
}
