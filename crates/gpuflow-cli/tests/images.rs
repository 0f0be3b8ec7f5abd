//! Tasks in OCI images, run by runc: an image built here from a local root
//! filesystem (busybox-static, with umoci), pushed with skopeo to a
//! registry on loopback (Debian's docker-registry), and run by `gpuflow up`
//! as the team's user with its environment, GPUs and memory limit (an OOM
//! inside is reported as one), its directory and `$HOME` writable, the
//! digest recorded and a retry pinned to it, a pull failure told in the
//! registry's words, `job exec` inside the container, and cancel ending
//! the container. Needs root and runc, skopeo, umoci, busybox and
//! docker-registry (`.ci/run` installs them); without them it says so and
//! stops.

mod common;

use std::path::Path;
use std::process::{Command, Stdio};
use std::time::Duration;

use common::*;

const LONG: Duration = Duration::from_secs(90);

fn have(tool: &str) -> bool {
    Command::new("sh")
        .args(["-c", &format!("command -v {tool}")])
        .stdout(Stdio::null())
        .status()
        .is_ok_and(|s| s.success())
}

fn run(cmd: &mut Command) {
    let out = cmd.output().unwrap();
    assert!(
        out.status.success(),
        "{cmd:?}: {}",
        String::from_utf8_lossy(&out.stderr)
    );
}

/// An OCI layout at `dir` holding `img:latest`: busybox and its links.
fn build_image(dir: &Path) {
    let layout = dir.join("img");
    let bundle = dir.join("bundle");
    run(Command::new("umoci")
        .args(["init", "--layout"])
        .arg(&layout));
    run(Command::new("umoci")
        .args(["new", "--image"])
        .arg(format!("{}:latest", layout.display())));
    run(Command::new("umoci")
        .args(["unpack", "--image"])
        .arg(format!("{}:latest", layout.display()))
        .arg(&bundle));
    let root = bundle.join("rootfs");
    std::fs::create_dir_all(root.join("bin")).unwrap();
    std::fs::create_dir_all(root.join("etc")).unwrap();
    let busybox = ["/bin/busybox", "/usr/bin/busybox"]
        .into_iter()
        .find(|p| Path::new(p).is_file())
        .unwrap();
    std::fs::copy(busybox, root.join("bin/busybox")).unwrap();
    for applet in [
        "sh", "id", "cat", "echo", "ls", "sleep", "awk", "env", "test", "head",
    ] {
        std::os::unix::fs::symlink("busybox", root.join("bin").join(applet)).unwrap();
    }
    std::fs::write(root.join("etc/image-marker"), "from-the-image\n").unwrap();
    run(Command::new("umoci")
        .args(["repack", "--image"])
        .arg(format!("{}:latest", layout.display()))
        .arg(&bundle));
    run(Command::new("umoci")
        .args(["config", "--image"])
        .arg(format!("{}:latest", layout.display()))
        .args([
            "--config.env",
            "PATH=/bin",
            "--config.env",
            "FROM_IMAGE=yes",
        ]));
}

/// A registry on a free loopback port, storing under `dir`; with
/// `htpasswd`, only for the logins that file holds.
fn registry(dir: &Path, htpasswd: Option<&Path>) -> (Proc, String) {
    let port = free_port();
    let config = dir.join("registry.yml");
    let auth = htpasswd.map_or(String::new(), |p| {
        format!(
            "auth:\n  htpasswd:\n    realm: gpuflow-test\n    path: {}\n",
            p.display()
        )
    });
    std::fs::write(
        &config,
        format!(
            "version: 0.1\nlog:\n  level: error\nstorage:\n  filesystem:\n    rootdirectory: {}\nhttp:\n  addr: 127.0.0.1:{port}\n{auth}",
            dir.join("registry").display()
        ),
    )
    .unwrap();
    let proc = Proc(
        Command::new("docker-registry")
            .arg("serve")
            .arg(&config)
            .stdout(Stdio::null())
            .stderr(Stdio::null())
            .spawn()
            .unwrap(),
    );
    let addr = format!("127.0.0.1:{port}");
    poll("the registry answers", LONG, || {
        std::net::TcpStream::connect(&addr).ok().map(|_| ())
    });
    (proc, addr)
}

fn gpuflow(url: &str, token: &str, args: &[&str]) -> (i32, String, String) {
    let out = Command::new(BIN)
        .args(args)
        .env("GPUFLOW_SERVER", url)
        .env("GPUFLOW_TOKEN", token)
        .stdin(Stdio::null())
        .output()
        .unwrap();
    (
        out.status.code().unwrap_or(-1),
        String::from_utf8_lossy(&out.stdout).into_owned(),
        String::from_utf8_lossy(&out.stderr).into_owned(),
    )
}

fn job(name: &str, image: &str, script: &str, extra: &str) -> String {
    format!(
        "name: {name}\nqueue: alpha-q\nkind: batch\n{extra}tasks:\n  - name: main\n    image: {image}\n    command: [sh, -c, {script:?}]\n    env: {{GREETING: hello}}\n    resources: {{cpu: 0.1, memory_mib: 64, gpu: {{count: 1}}}}\n"
    )
}

fn ended(api: &Api, id: u64, token: &str) -> serde_json::Value {
    poll("the job ends", LONG, || {
        let j = api.job(id, token);
        matches!(
            j["state"].as_str(),
            Some("succeeded" | "failed" | "cancelled")
        )
        .then_some(j)
    })
}

fn log_of(api: &Api, id: u64, token: &str) -> (String, String) {
    let l = api.get(&format!("/v1/jobs/{id}/logs"), token);
    (
        l["tasks"]["main/0"].as_str().unwrap_or("").to_string(),
        l["stderr"]["main/0"].as_str().unwrap_or("").to_string(),
    )
}

/// Why these tests cannot run here, if they cannot.
fn cannot() -> Option<String> {
    // SAFETY: geteuid has no preconditions.
    if unsafe { libc::geteuid() } != 0 {
        return Some("running images needs a root agent".into());
    }
    let missing: Vec<&str> = ["runc", "skopeo", "umoci", "busybox", "docker-registry"]
        .into_iter()
        .filter(|t| !have(t))
        .collect();
    (!missing.is_empty()).then(|| {
        format!(
            "not installed: {missing:?} (apt-get install runc skopeo umoci busybox-static docker-registry)"
        )
    })
}

/// The test image built and pushed to a registry on loopback: the
/// registry, its address and the image's reference.
fn pushed(dir: &Path) -> (Proc, String, String) {
    build_image(dir);
    let (registry, reg) = registry(dir, None);
    let image = format!("{reg}/team/busybox:1");
    run(Command::new("skopeo")
        .args(["copy", "--quiet", "--dest-tls-verify=false"])
        .arg(format!("oci:{}:latest", dir.join("img").display()))
        .arg(format!("docker://{image}")));
    (registry, reg, image)
}

#[test]
fn tasks_run_in_images_pulled_from_a_registry_as_they_run_on_the_node() {
    if let Some(why) = cannot() {
        eprintln!("skipped: {why}");
        return;
    }
    let dir = tempfile::tempdir().unwrap();
    let (_registry, reg, image) = pushed(dir.path());

    let cdi = dir.path().join("cdi");
    std::fs::create_dir(&cdi).unwrap();
    let (_up, api, admin) = up_with(
        &dir.path().join("data"),
        free_port(),
        &["--emulate", "2xemu-gpu", "--cdi-dir", cdi.to_str().unwrap()],
        &[],
    );
    let (alpha, _beta) = api.alpha_and_beta(&admin);
    let url = api.url.clone();
    // The node's CDI spec, as NVIDIA's toolkit would write one, for its
    // GPUs by UUID: a device node (here /dev/zero's), a library mounted
    // in, a variable.
    let node = api.get("/v1/nodes", &admin)[0]["name"]
        .as_str()
        .unwrap()
        .to_string();
    std::fs::write(dir.path().join("libfake.so"), "the-driver-library\n").unwrap();
    std::fs::write(
        cdi.join("nvidia.yaml"),
        format!(
            "cdiVersion: 0.5.0\nkind: nvidia.com/gpu\ncontainerEdits:\n  env: [FROM_CDI=yes]\n  mounts:\n    - {{hostPath: {}, containerPath: /usr/lib/libfake.so.1, options: [ro, nosuid, nodev, bind]}}\ndevices:\n  - name: EMU-{node}-0\n    containerEdits:\n      deviceNodes: [{{path: /dev/nvidia-fake0, hostPath: /dev/zero}}]\n  - name: EMU-{node}-1\n    containerEdits:\n      deviceNodes: [{{path: /dev/nvidia-fake1, hostPath: /dev/zero}}]\n",
            dir.path().join("libfake.so").display()
        ),
    )
    .unwrap();

    // It runs in the image, as the team's user, with its environment,
    // its GPU and a writable home; the pull is an event with the digest.
    let (s, v) = api.submit_yaml(
        &alpha,
        &job(
            "inside",
            &image,
            "id -u; cat /etc/image-marker; echo greeting=$GREETING from=$FROM_IMAGE gpus=$CUDA_VISIBLE_DEVICES cdi=$FROM_CDI; echo kept > $HOME/f && cat $HOME/f; test -d /usr/bin || echo no-usr; cat /usr/lib/libfake.so.1; ls /dev | grep nvidia-fake",
            "",
        ),
    );
    assert_eq!(s, 201, "{v}");
    let id = v["id"].as_u64().unwrap();
    let j = ended(&api, id, &alpha);
    let (out, err) = log_of(&api, id, &alpha);
    assert_eq!(j["state"], "succeeded", "{j}\n{out}\n{err}");
    assert_ne!(out.lines().next(), Some("0"), "ran as root: {out}");
    assert!(out.contains("from-the-image"), "{out}");
    assert!(out.contains("greeting=hello from=yes gpus="), "{out}");
    assert!(
        !out.contains("gpus=\n") && !out.contains("gpus= "),
        "no GPU given: {out}"
    );
    assert!(out.contains("kept") && out.contains("no-usr"), "{out}");
    // Its one GPU through the node's CDI spec: its device node alone, the
    // spec's mount and variable.
    assert!(
        out.contains("cdi=yes") && out.contains("the-driver-library"),
        "{out}"
    );
    let gpu = j["tasks"][0]["gpus"][0].as_u64().unwrap();
    let nodes: Vec<&str> = out
        .lines()
        .filter(|l| l.starts_with("nvidia-fake"))
        .collect();
    assert_eq!(nodes, [format!("nvidia-fake{gpu}").as_str()], "{out}");
    let digest = j["tasks"][0]["image_digest"]
        .as_str()
        .unwrap_or("")
        .to_string();
    assert!(digest.starts_with("sha256:"), "{j}");
    let events = api.get(&format!("/v1/events?job={id}"), &alpha);
    assert!(
        events.as_array().unwrap().iter().any(
            |e| e["kind"] == "image-pulled" && e["message"].as_str().unwrap().contains(&digest)
        ),
        "{events}"
    );

    // A retry runs exactly the bits the first attempt pulled.
    let (s, v) = api.submit_yaml(
        &alpha,
        &job(
            "retried",
            &image,
            "exit 3",
            "retry: {limit: 1, backoff_s: 0}\n",
        ),
    );
    assert_eq!(s, 201, "{v}");
    let rid = v["id"].as_u64().unwrap();
    let j = ended(&api, rid, &alpha);
    assert_eq!(j["attempts"], 2, "{j}");
    let (_, err) = log_of(&api, rid, &alpha);
    assert!(
        err.contains(&format!("pulling {reg}/team/busybox@{digest}")),
        "{err}"
    );

    // Over its memory limit inside the container: reported as OOM.
    let (s, v) = api.submit_yaml(
        &alpha,
        &job(
            "hungry",
            &image,
            "dd if=/dev/zero of=/dev/null bs=300M count=1",
            "",
        ),
    );
    assert_eq!(s, 201, "{v}");
    let hid = v["id"].as_u64().unwrap();
    let j = ended(&api, hid, &alpha);
    assert_eq!(j["state"], "failed", "{j}");
    assert!(
        j["reason"].as_str().unwrap().contains("out of memory"),
        "{j}"
    );

    // A tag the registry does not have: the job fails saying so.
    let (s, v) = api.submit_yaml(
        &alpha,
        &job("missing", &format!("{reg}/team/busybox:nope"), "true", ""),
    );
    assert_eq!(s, 201, "{v}");
    let mid = v["id"].as_u64().unwrap();
    let j = ended(&api, mid, &alpha);
    assert_eq!(j["state"], "failed");
    assert!(
        j["reason"].as_str().unwrap().contains("manifest unknown"),
        "{j}"
    );

    // Past its maximum runtime the container is stopped: timeout.
    let (s, v) = api.submit_yaml(
        &alpha,
        &job(
            "overrun",
            &image,
            "exec sleep 3173",
            "max_runtime_s: 3\ncheckpoint: {grace_s: 1}\n",
        ),
    );
    assert_eq!(s, 201, "{v}");
    let oid = v["id"].as_u64().unwrap();
    poll("it times out", LONG, || {
        (api.job(oid, &alpha)["state"] == "timeout").then_some(())
    });
    poll("its container is gone", LONG, || {
        let left = Command::new("pgrep")
            .args(["-f", "sleep 3173"])
            .output()
            .unwrap();
        (!left.status.success()).then_some(())
    });

    // `job exec` enters the container; cancel ends it.
    let (code, out, err) = gpuflow(
        &url,
        &alpha,
        &[
            "job",
            "submit",
            "--wrap",
            "echo up; exec sleep 3172",
            "--queue",
            "alpha-q",
            "--image",
            &image,
        ],
    );
    assert_eq!(code, 0, "{out}{err}");
    let sid: u64 = out.split_whitespace().nth(1).unwrap().parse().unwrap();
    api.wait_state(sid, &alpha, "running", LONG);
    poll("it prints", LONG, || {
        log_of(&api, sid, &alpha).0.contains("up").then_some(())
    });
    let (code, out, err) = gpuflow(
        &url,
        &alpha,
        &[
            "job",
            "exec",
            &sid.to_string(),
            "--",
            "sh",
            "-c",
            "cat /etc/image-marker; test -d /usr/bin || echo no-usr; exit 6",
        ],
    );
    assert_eq!(code, 6, "{out}{err}");
    assert!(
        out.contains("from-the-image") && out.contains("no-usr"),
        "{out}"
    );
    let (code, _, err) = gpuflow(&url, &alpha, &["job", "cancel", &sid.to_string()]);
    assert_eq!(code, 0, "{err}");
    let j = ended(&api, sid, &alpha);
    assert_eq!(j["state"], "cancelled");
    poll("the container is gone", LONG, || {
        let left = Command::new("pgrep")
            .args(["-f", "sleep 3172"])
            .output()
            .unwrap();
        (!left.status.success()).then_some(())
    });
}

/// `kill -9` of the agent while a task runs in its image, and a new agent
/// on the same work directory: the container is adopted, runs on and
/// finishes once.
#[test]
fn a_task_in_an_image_outlives_its_agent_and_runs_once() {
    if let Some(why) = cannot() {
        eprintln!("skipped: {why}");
        return;
    }
    let dir = tempfile::tempdir().unwrap();
    let (_registry, _reg, image) = pushed(dir.path());
    let srv = server(dir.path(), free_port(), &[]);
    let api = Api::new(&srv.url);
    let admin = admin_token(dir.path());
    let first = agent(dir.path(), &srv.url, "n1", "1");
    let (s, v) = api.submit_yaml(
        &admin,
        &format!(
            "name: steady\nqueue: default\nkind: batch\ntasks:\n  - name: main\n    image: {image}\n    command: [sh, -c, 'echo $$ >> $HOME/runs; sleep 6']\n    resources: {{cpu: 0.1, memory_mib: 64}}\n"
        ),
    );
    assert_eq!(s, 201, "{v}");
    let id = v["id"].as_u64().unwrap();
    api.wait_state(id, &admin, "running", LONG);
    let runs = dir.path().join(format!("work-n1/job-{id}/a1-g0-i0/runs"));
    poll("the container starts", LONG, || runs.exists().then_some(()));
    first.crash();
    std::thread::sleep(Duration::from_secs(1));
    let _second = agent(dir.path(), &srv.url, "n1", "1");
    let j = ended(&api, id, &admin);
    assert_eq!(
        (j["state"].as_str(), j["attempts"].as_u64()),
        (Some("succeeded"), Some(1)),
        "{j}"
    );
    let lines = std::fs::read_to_string(&runs).unwrap();
    assert_eq!(lines.lines().count(), 1, "it ran more than once: {lines}");
}

/// A registry that wants a login (htpasswd, bcrypt): the team whose login
/// the admin set pulls its image; the login reaches no task, log, event or
/// API answer; another team's pull is refused by the registry; a team's
/// registries and its rule against processes are enforced at submit.
#[test]
fn a_teams_private_image_is_pulled_with_its_login_alone() {
    if let Some(why) = cannot() {
        eprintln!("skipped: {why}");
        return;
    }
    const PASSWORD: &str = "s3cret-Pw-71";
    let dir = tempfile::tempdir().unwrap();
    build_image(dir.path());
    let hash = Command::new("/usr/bin/python3")
        .args([
            "-c",
            &format!("import crypt; print(crypt.crypt('{PASSWORD}', crypt.mksalt(crypt.METHOD_BLOWFISH)))"),
        ])
        .output()
        .unwrap();
    let hash = String::from_utf8_lossy(&hash.stdout).trim().to_string();
    if !hash.starts_with("$2") {
        eprintln!("skipped: python3 cannot make a bcrypt hash here");
        return;
    }
    std::fs::write(dir.path().join("htpasswd"), format!("puller:{hash}\n")).unwrap();
    let (_registry, reg) = registry(dir.path(), Some(&dir.path().join("htpasswd")));
    let image = format!("{reg}/alpha/busybox:1");
    run(Command::new("skopeo")
        .args(["copy", "--quiet", "--dest-tls-verify=false", "--dest-creds"])
        .arg(format!("puller:{PASSWORD}"))
        .arg(format!("oci:{}:latest", dir.path().join("img").display()))
        .arg(format!("docker://{image}")));

    let (_up, api, admin) = up(&dir.path().join("data"), free_port(), "2xemu-gpu", &[]);
    let (alpha, beta) = api.alpha_and_beta(&admin);
    let (s, v) = api.call(
        "PATCH",
        "/v1/teams/alpha",
        &admin,
        Some((
            "application/json",
            serde_json::json!({"registries": [format!("{reg}/alpha/")],
                "registry_credentials": {reg.clone(): {"username": "puller", "password": PASSWORD}}})
            .to_string()
            .as_bytes(),
        )),
    );
    assert_eq!(s, 200, "{v}");
    assert!(!v.to_string().contains(PASSWORD), "{v}");
    assert_eq!(v["registry_credentials"][&reg]["username"], "puller");
    let (s, v) = api.call(
        "PATCH",
        "/v1/teams/beta",
        &admin,
        Some(("application/json", br#"{"processes": false}"#)),
    );
    assert_eq!(s, 200, "{v}");

    // Alpha's task pulls with the login and never sees it.
    let spec = |name: &str, queue: &str, image: Option<&str>| {
        format!(
            "name: {name}\nqueue: {queue}\nkind: batch\ntasks:\n  - name: main\n{}    command: [sh, -c, 'env; echo done']\n    resources: {{cpu: 0.1, memory_mib: 64}}\n",
            image.map_or(String::new(), |i| format!("    image: {i}\n"))
        )
    };
    let (s, v) = api.submit_yaml(&alpha, &spec("private", "alpha-q", Some(&image)));
    assert_eq!(s, 201, "{v}");
    let id = v["id"].as_u64().unwrap();
    let j = ended(&api, id, &alpha);
    let (out, err) = log_of(&api, id, &alpha);
    assert_eq!(j["state"], "succeeded", "{j}\n{out}\n{err}");
    assert!(out.contains("done"), "{out}");
    let events = api.get(&format!("/v1/events?job={id}"), &admin);
    let teams = api.get("/v1/teams", &admin);
    for (what, text) in [
        ("the task's environment and output", out.clone()),
        ("its stderr", err),
        ("its events", events.to_string()),
        ("the team list", teams.to_string()),
        ("the job", j.to_string()),
        (
            "the audit log",
            api.get("/v1/audit?limit=1000", &admin).to_string(),
        ),
    ] {
        assert!(
            !text.contains(PASSWORD),
            "the password is in {what}: {text}"
        );
    }
    assert!(!out.contains("GPUFLOW_REGISTRY_AUTH"), "{out}");

    // Alpha may not pull from elsewhere.
    let (s, v) = api.submit_yaml(
        &alpha,
        &spec(
            "elsewhere",
            "alpha-q",
            Some(&format!("{reg}/beta/busybox:1")),
        ),
    );
    assert_eq!(s, 400, "{v}");
    assert!(
        v["message"]
            .as_str()
            .unwrap()
            .contains("not from team \"alpha\"'s registries"),
        "{v}"
    );

    // Beta has no login: the registry refuses its pull of alpha's image.
    let (s, v) = api.submit_yaml(&beta, &spec("theirs", "beta-q", Some(&image)));
    assert_eq!(s, 201, "{v}");
    let bid = v["id"].as_u64().unwrap();
    let j = ended(&api, bid, &beta);
    assert_eq!(j["state"], "failed", "{j}");
    assert!(
        j["reason"].as_str().unwrap().contains("unauthorized"),
        "{j}"
    );

    // Beta runs in images only.
    let (s, v) = api.submit_yaml(&beta, &spec("bare", "beta-q", None));
    assert_eq!(s, 400, "{v}");
    assert!(
        v["message"].as_str().unwrap().contains("images only"),
        "{v}"
    );
}

/// A node whose GPUs no CDI spec names (here the repo's fake NVML library
/// stands for the driver): a task in an image finds the driver's library
/// the agent itself loads, bound in read-only and on its library path.
#[test]
fn a_task_in_an_image_finds_the_nodes_driver_without_a_cdi_spec() {
    if let Some(why) = cannot() {
        eprintln!("skipped: {why}");
        return;
    }
    let dir = tempfile::tempdir().unwrap();
    let Some(lib) = gpuflow_agent::fake_nvml::build(dir.path()).unwrap() else {
        eprintln!("skipped: no C compiler to build the fake NVML library");
        return;
    };
    let (_registry, _reg, image) = pushed(dir.path());
    let no_cdi = dir.path().join("no-cdi");
    std::fs::create_dir(&no_cdi).unwrap();
    let (_up, api, admin) = up_with(
        &dir.path().join("data"),
        free_port(),
        &[
            "--nvml-lib",
            lib.to_str().unwrap(),
            "--cdi-dir",
            no_cdi.to_str().unwrap(),
        ],
        &[("FAKE_NVML_GPUS", "2")],
    );
    let (s, v) = api.submit_yaml(
        &admin,
        &format!(
            "name: driver\nqueue: default\nkind: batch\ntasks:\n  - name: main\n    image: {image}\n    command: [sh, -c, 'head -c 4 /usr/local/nvidia/lib64/libnvidia-ml.so.1 | grep -q ELF && echo lib-ok; echo ld=$LD_LIBRARY_PATH; echo visible=$CUDA_VISIBLE_DEVICES; echo x > /usr/local/nvidia/lib64/libnvidia-ml.so.1 || echo read-only']\n    resources: {{cpu: 0.1, memory_mib: 64, gpu: {{count: 1}}}}\n"
        ),
    );
    assert_eq!(s, 201, "{v}");
    let id = v["id"].as_u64().unwrap();
    let j = ended(&api, id, &admin);
    let (out, err) = log_of(&api, id, &admin);
    assert_eq!(j["state"], "succeeded", "{j}\n{out}\n{err}");
    assert!(out.contains("lib-ok"), "{out}\n{err}");
    assert!(out.contains("ld=/usr/local/nvidia/lib64"), "{out}");
    assert!(out.contains("visible=GPU-fa4e0000-"), "{out}");
    assert!(out.contains("read-only"), "{out}");
}
