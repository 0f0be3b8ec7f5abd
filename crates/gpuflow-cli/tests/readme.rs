//! The README's quick start, pasted into a shell as a new user would:
//! every line of its first two `sh` blocks, in order, with `set -e`, on a
//! fresh `gpuflow up` the block itself starts (the `cargo build` line is
//! the one left out: the test runs the binary cargo built for it).

mod common;

use std::process::Command;
use std::time::Duration;

use common::*;

/// The `sh` block that follows the first line starting with `marker`.
fn block_after(readme: &str, marker: &str) -> String {
    let from = readme
        .find(marker)
        .unwrap_or_else(|| panic!("the README has no {marker:?}"));
    let rest = &readme[from..];
    let start = rest.find("```sh\n").expect("an sh block") + "```sh\n".len();
    let end = rest[start..].find("```").expect("the block's end");
    rest[start..start + end].to_string()
}

#[test]
fn the_readme_quick_start_works_pasted_line_by_line() {
    quick_start(None);
}

/// The same as an ordinary user (`nobody`, with a home of its own): no
/// root, so no cgroups and tasks run as that user. Run where the tests run
/// as root (as CI does); otherwise the test above is already that.
#[test]
fn the_readme_quick_start_works_for_an_ordinary_user() {
    // SAFETY: geteuid has no preconditions.
    if unsafe { libc::geteuid() } != 0 {
        eprintln!("skipped: the tests already run as an ordinary user");
        return;
    }
    if Command::new("setpriv").arg("--version").output().is_err() {
        eprintln!("skipped: setpriv (util-linux) is not installed");
        return;
    }
    quick_start(Some((65534, 65534)));
}

/// Pastes the quick start into bash, as the caller or as `user` (uid,
/// gid), and checks what a new user reads on the way.
fn quick_start(user: Option<(u32, u32)>) {
    let readme = std::fs::read_to_string(
        std::path::Path::new(env!("CARGO_MANIFEST_DIR")).join("../../README.md"),
    )
    .unwrap();
    let quick = block_after(&readme, "## Run the platform");
    let tenants = block_after(&readme, "Tenants:");
    let port = free_port();
    // The contexts' example names `gpuflow up`'s default address.
    let contexts = block_after(&readme, "Contexts keep")
        .replace("http://127.0.0.1:7070", &format!("http://127.0.0.1:{port}"));
    assert!(quick.contains("gpuflow up"), "{quick}");
    let pasted: String = format!("{quick}{tenants}{contexts}")
        .lines()
        .map(|l| {
            if l.starts_with("cargo ") {
                format!(": left out by the test: {l}")
            } else {
                l.to_string()
            }
        })
        .collect::<Vec<_>>()
        .join("\n");
    let dir = tempfile::tempdir().unwrap();
    // An ordinary user gets a home of its own and a copy of the binary
    // (the checkout may be out of its reach).
    let bin_dir = match user {
        None => std::path::Path::new(BIN).parent().unwrap().to_path_buf(),
        Some((uid, gid)) => {
            use std::os::unix::fs::PermissionsExt;
            let bin = dir.path().join("bin");
            std::fs::create_dir(&bin).unwrap();
            std::fs::copy(BIN, bin.join("gpuflow")).unwrap();
            for p in [dir.path(), bin.as_path(), bin.join("gpuflow").as_path()] {
                std::os::unix::fs::chown(p, Some(uid), Some(gid)).unwrap();
                std::fs::set_permissions(p, std::fs::Permissions::from_mode(0o755)).unwrap();
            }
            bin
        }
    };
    // A fresh machine's shell: this checkout's binary on the PATH, and the
    // platform on a port and data directory of its own.
    let script = format!(
        "set -euo pipefail\n\
         trap 'kill $(jobs -p) 2>/dev/null || true' EXIT\n\
         {pasted}\n\
         echo AFTER-THE-QUICK-START\n\
         gpuflow whoami\n\
         echo QUICK-START-DONE\n"
    );
    let mut cmd = match user {
        None => Command::new("timeout"),
        Some((uid, gid)) => {
            let mut c = Command::new("setpriv");
            c.args([
                &format!("--reuid={uid}"),
                &format!("--regid={gid}"),
                "--clear-groups",
                "timeout",
            ]);
            c
        }
    };
    let out = cmd
        .args(["180", "bash", "-c", &script])
        .current_dir(dir.path())
        .env(
            "PATH",
            format!("{}:{}", bin_dir.display(), std::env::var("PATH").unwrap()),
        )
        .env("HOME", dir.path())
        .env("GPUFLOW_LISTEN", format!("127.0.0.1:{port}"))
        .env("GPUFLOW_SERVER", format!("http://127.0.0.1:{port}"))
        .env("GPUFLOW_DATA", dir.path().join("data"))
        .env_remove("GPUFLOW_TOKEN")
        .output()
        .unwrap();
    let stdout = String::from_utf8_lossy(&out.stdout);
    let stderr = String::from_utf8_lossy(&out.stderr);
    let log = std::fs::read_to_string(dir.path().join("gpuflow-up.log")).unwrap_or_default();
    assert!(
        out.status.success() && stdout.contains("QUICK-START-DONE"),
        "the quick start stopped ({:?}):\n--- stdout\n{stdout}\n--- stderr\n{stderr}\n--- gpuflow-up.log\n{log}",
        out.status
    );
    // What a new user reads on the way.
    assert!(stdout.contains("job 1 submitted"), "{stdout}");
    // A light array: the next examples do not wait behind it.
    assert!(stdout.contains("array 2 submitted: 4 jobs"), "{stdout}");
    // The hello job, the --wrap one and ana's.
    let singles = stdout
        .lines()
        .filter(|l| l.starts_with("job ") && l.contains(" submitted ("))
        .count();
    assert_eq!(singles, 3, "{stdout}");
    // ana's context, for that command only: what follows is the admin's
    // again (making a context does not make it current).
    assert!(stdout.contains("user:        ana"), "{stdout}");
    let after = stdout
        .split("AFTER-THE-QUICK-START")
        .nth(1)
        .unwrap_or_default();
    assert!(after.contains("user:        admin"), "{stdout}");
    assert!(log.contains("gpuflow is up at"), "{log}");
}

/// Every file the README's examples use is shown, and parses as what it is
/// given to: `service update web -f task.yaml` used a file the README never
/// showed.
#[test]
fn the_readme_shows_every_spec_file_it_uses_and_each_parses() {
    let readme = std::fs::read_to_string(
        std::path::Path::new(env!("CARGO_MANIFEST_DIR")).join("../../README.md"),
    )
    .unwrap();
    let file = |name: &str| -> String {
        let start = readme
            .find(&format!("cat > {name} <<"))
            .unwrap_or_else(|| panic!("the README never shows {name}"));
        let body = &readme[start..];
        let body = &body[body.find('\n').unwrap() + 1..];
        let end = body.find("\nYAML\n").expect("the heredoc's end");
        body[..end].to_string()
    };
    let task: gpuflow_api::TaskGroupSpec =
        serde_norway::from_str(&file("task.yaml")).expect("task.yaml is a task group spec");
    assert_eq!(task.name, "main");
    let web: gpuflow_api::ServiceSpec =
        serde_norway::from_str(&file("web.yaml")).expect("web.yaml is a service spec");
    assert_eq!(web.name, "web");
    gpuflow_api::JobSpec::parse(file("job.yaml").as_bytes(), false).expect("job.yaml");
    // The files the shell blocks give to `-f`.
    let blocks: Vec<&str> = readme
        .split("```sh\n")
        .skip(1)
        .filter_map(|b| b.split("```").next())
        .collect();
    for used in blocks.iter().flat_map(|b| {
        b.split_whitespace()
            .collect::<Vec<_>>()
            .windows(2)
            .filter(|w| w[0] == "-f" && w[1].ends_with(".yaml"))
            .map(|w| w[1].to_string())
            .collect::<Vec<_>>()
    }) {
        let shown =
            readme.contains(&format!("cat > {used} <<")) || readme.contains(&format!("> {used}"));
        assert!(shown, "the README uses {used} and never shows it");
    }
}

/// The README's service example serves on a root install: the agent runs
/// tasks as their team's user, so a task must reach its own working
/// directory and `$HOME` by absolute path. It did not: they sat under the
/// agent's `drwx------ root` directories (the data directory here is a
/// fresh temporary one, `0700` as `/root` is), so Python's `http.server`
/// answered every readiness probe with 404 and the service never became
/// ready. Without root, tasks run as the agent's own user and the test
/// says so and stops.
#[test]
fn the_readmes_service_example_serves_on_a_root_install() {
    // SAFETY: geteuid has no preconditions.
    if unsafe { libc::geteuid() } != 0 {
        eprintln!("skipped: tasks change user only under a root agent");
        return;
    }
    if Command::new("python3").arg("--version").output().is_err() {
        eprintln!("skipped: python3 is not installed");
        return;
    }
    let readme = std::fs::read_to_string(
        std::path::Path::new(env!("CARGO_MANIFEST_DIR")).join("../../README.md"),
    )
    .unwrap();
    let start = readme.find("cat > web.yaml <<").expect("web.yaml");
    let body = &readme[start..];
    let body = &body[body.find('\n').unwrap() + 1..];
    let web = &body[..body.find("\nYAML\n").unwrap()];

    let dir = tempfile::tempdir().unwrap();
    let (_up, api, admin) = up(&dir.path().join("data"), free_port(), "2xemu-gpu", &[]);
    // A job's task reaches its directory and home by absolute path.
    let (s, v) = api.submit_yaml(
        &admin,
        "name: home\nqueue: default\nkind: batch\ntasks:\n  - name: main\n    command: [sh, -c, 'id -u; ls -d \"$PWD\" && echo kept > \"$HOME/f\" && cat \"$HOME/f\"']\n    resources: {cpu: 0.1, memory_mib: 64}\n",
    );
    assert_eq!(s, 201, "{v}");
    let id = v["id"].as_u64().unwrap();
    let j = poll("the job ends", Duration::from_secs(60), || {
        let j = api.job(id, &admin);
        matches!(j["state"].as_str(), Some("succeeded" | "failed")).then_some(j)
    });
    let log = api.get(&format!("/v1/jobs/{id}/logs"), &admin);
    assert_eq!(j["state"], "succeeded", "{j}\n{log}");
    let out = log["tasks"]["main/0"].as_str().unwrap_or("");
    assert!(out.contains("kept"), "{log}");
    assert_ne!(out.lines().next(), Some("0"), "the task ran as root: {log}");

    let file = dir.path().join("web.yaml");
    std::fs::write(&file, web).unwrap();
    let out = Command::new(BIN)
        .args(["service", "create", "-f"])
        .arg(&file)
        .env("GPUFLOW_SERVER", &api.url)
        .env("GPUFLOW_TOKEN", &admin)
        .output()
        .unwrap();
    assert!(out.status.success(), "{out:?}");

    // Both replicas pass their readiness probe and serve.
    let v = poll(
        "the service's replicas are ready",
        Duration::from_secs(90),
        || {
            let v = api.get("/v1/services/web", &admin);
            (v["endpoints"].as_array()?.len() == 2).then_some(v)
        },
    );
    for e in v["endpoints"].as_array().unwrap() {
        let agent: ureq::Agent = ureq::Agent::config_builder()
            .timeout_global(Some(Duration::from_secs(5)))
            .build()
            .into();
        let r = agent
            .get(&format!("http://{}/", e.as_str().unwrap()))
            .call();
        assert_eq!(r.map(|r| r.status().as_u16()).ok(), Some(200), "{e}");
    }
}
