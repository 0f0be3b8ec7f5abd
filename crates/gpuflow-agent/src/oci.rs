//! Tasks in OCI images: pulled by skopeo into the node's cache, unpacked
//! once per digest by umoci, run by runc. Nothing here is a runtime of its
//! own: it writes a bundle's `config.json` and hands over to runc.
//!
//! The agent starts an image task as it starts any task, under its keeper
//! and in its cgroup, but the process it runs is this binary's hidden
//! `oci-run` command, as root, which pulls, unpacks and then becomes
//! `runc run` (exec, same process): runc and the container's processes stay
//! in the task's cgroup (runc joins it: `linux.cgroupsPath`), so limits, OOM
//! reports, the keeper's fencing and kills hold as for processes. Inside,
//! the task runs as its user with no capabilities and `no_new_privs`, on a
//! read-only root with its own `/tmp`, its directory (also `$HOME`) bound
//! in at the same path, the node's network (ports work as for processes)
//! and only its GPUs' device nodes.
//!
//! How the pull went (digest, MiB fetched, seconds, or the registry's
//! error) is written to a status file the agent reports.

use std::io::Write;
use std::os::unix::process::CommandExt;
use std::path::{Path, PathBuf};
use std::process::Command;
use std::time::Instant;

use serde::{Deserialize, Serialize};

/// What `oci-run` needs, written by the agent (root, 0600).
#[derive(Clone, Debug, Serialize, Deserialize)]
pub struct Spec {
    pub image: String,
    pub args: Vec<String>,
    pub env: Vec<(String, String)>,
    /// Its working directory inside (default: its task directory).
    pub cwd: String,
    pub uid: u32,
    pub gid: u32,
    /// The task's directory, bound in at the same path.
    pub task_dir: PathBuf,
    /// The container's cgroup as runc reads `linux.cgroupsPath`: relative,
    /// inside the one runc itself runs in (the task's); none: runc's
    /// default.
    pub cgroup: Option<String>,
    /// Character devices the task may open: (path, major, minor).
    pub devices: Vec<(String, u32, u32)>,
    /// The node's image cache, and its size limit in MiB.
    pub cache: PathBuf,
    pub cache_mib: u64,
    /// runc's state directory and the container's name.
    pub runc_root: PathBuf,
    pub id: String,
    /// Where to say how the pull went ([`gpuflow_api::ImageReport`]).
    pub status: PathBuf,
    /// What the node's CDI specs add for its GPUs (then `devices` holds
    /// none of theirs).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub cdi: Option<crate::cdi::Edits>,
    /// Without CDI, the node's driver files to bind in read-only
    /// (`(host path, path inside)`, see `cdi::driver_files`).
    #[serde(default, skip_serializing_if = "Vec::is_empty")]
    pub driver: Vec<(PathBuf, String)>,
    /// MPS's pipe directory, bound in for a task sharing a GPU through it.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub mps_pipe: Option<String>,
}

/// The variable `oci-run` finds the team's registry login in:
/// `["host", "user", "password"]`.
pub const AUTH_ENV: &str = "GPUFLOW_REGISTRY_AUTH";

/// The login in `AUTH_ENV` written as a registry auth file (0600, removed
/// when dropped), and taken out of this process's environment.
struct AuthFile(PathBuf);

impl AuthFile {
    fn from_env(dir: &Path) -> Result<Option<AuthFile>, String> {
        let Some(raw) = std::env::var_os(AUTH_ENV) else {
            return Ok(None);
        };
        // SAFETY: single-threaded here (before any thread or child).
        unsafe { std::env::remove_var(AUTH_ENV) };
        let (host, user, pass): (String, String, String) =
            serde_json::from_str(&raw.to_string_lossy())
                .map_err(|e| format!("the registry login: {e}"))?;
        use base64::Engine;
        let auth = base64::engine::general_purpose::STANDARD.encode(format!("{user}:{pass}"));
        let doc = serde_json::json!({"auths": {host: {"auth": auth}}});
        std::fs::create_dir_all(dir).map_err(|e| format!("{}: {e}", dir.display()))?;
        let path = dir.join(format!("auth-{}.json", std::process::id()));
        use std::os::unix::fs::OpenOptionsExt;
        let mut f = std::fs::OpenOptions::new()
            .write(true)
            .create(true)
            .truncate(true)
            .mode(0o600)
            .open(&path)
            .map_err(|e| format!("{}: {e}", path.display()))?;
        f.write_all(doc.to_string().as_bytes())
            .map_err(|e| format!("{}: {e}", path.display()))?;
        Ok(Some(AuthFile(path)))
    }
}

impl Drop for AuthFile {
    fn drop(&mut self) {
        let _ = std::fs::remove_file(&self.0);
    }
}

/// The programs a node needs to run images, all on `PATH`.
pub const TOOLS: [&str; 3] = ["runc", "skopeo", "umoci"];

/// Whether this node can run images: root, and every tool found.
pub fn available() -> Result<(), String> {
    if crate::user::agent_uid() != 0 {
        return Err("the agent is not root".into());
    }
    for t in TOOLS {
        if which(t).is_none() {
            return Err(format!("{t} is not installed"));
        }
    }
    Ok(())
}

/// Where `tool` is: on `PATH`, else in `/usr/sbin` or `/usr/bin`.
pub(crate) fn which(tool: &str) -> Option<PathBuf> {
    let path = std::env::var_os("PATH").unwrap_or_else(|| "/usr/sbin:/usr/bin:/sbin:/bin".into());
    std::env::split_paths(&path)
        .chain(["/usr/sbin".into(), "/usr/bin".into()])
        .map(|d| d.join(tool))
        .find(|p| p.is_file())
}

/// FNV-1a of `bytes`: a short name that stays the same across releases.
fn fnv(bytes: &[u8]) -> u64 {
    bytes.iter().fold(0xcbf2_9ce4_8422_2325, |h, &b| {
        (h ^ u64::from(b)).wrapping_mul(0x0100_0000_01b3)
    })
}

/// A registry on this host is spoken to over plain HTTP.
fn loopback(image: &str) -> bool {
    let host = image.split('/').next().unwrap_or("");
    image.contains('/')
        && ["127.0.0.1", "localhost", "[::1]"]
            .iter()
            .any(|h| host == *h || host.starts_with(&format!("{h}:")))
}

fn write_status(spec: &Spec, r: &gpuflow_api::ImageReport) {
    let tmp = spec.status.with_extension("tmp");
    if std::fs::write(&tmp, serde_json::to_vec(r).unwrap_or_default()).is_ok() {
        let _ = std::fs::rename(&tmp, &spec.status);
    }
}

/// Runs a tool; its stdout, or its stderr's last line as the error.
fn tool(cmd: &mut Command) -> Result<String, String> {
    let out = cmd
        .output()
        .map_err(|e| format!("cannot run {:?}: {e}", cmd.get_program()))?;
    if out.status.success() {
        return Ok(String::from_utf8_lossy(&out.stdout).into_owned());
    }
    let err = String::from_utf8_lossy(&out.stderr);
    let last = err
        .lines()
        .rev()
        .find(|l| !l.trim().is_empty())
        .unwrap_or("failed")
        .trim();
    // skopeo says `time=… level=fatal msg="…"`: the message is what matters.
    let msg = last
        .split_once("msg=\"")
        .map_or(last, |(_, m)| m.trim_end_matches('"'));
    Err(msg.to_string())
}

fn dir_bytes(d: &Path) -> u64 {
    std::fs::read_dir(d).map_or(0, |rd| {
        rd.filter_map(Result::ok)
            .filter_map(|e| e.metadata().ok())
            .filter(std::fs::Metadata::is_file)
            .map(|m| m.len())
            .sum()
    })
}

/// Holds `path` locked (`exclusive` or shared) until the descriptor
/// closes; `inherit`: the lock passes to the program this one becomes.
fn lock(path: &Path, exclusive: bool, wait: bool, inherit: bool) -> Option<std::fs::File> {
    use std::os::fd::AsRawFd;
    use std::os::unix::fs::OpenOptionsExt;
    let f = std::fs::OpenOptions::new()
        .create(true)
        .truncate(false)
        .write(true)
        .custom_flags(if inherit { 0 } else { libc::O_CLOEXEC })
        .open(path)
        .ok()?;
    let op = if exclusive {
        libc::LOCK_EX
    } else {
        libc::LOCK_SH
    } | if wait { 0 } else { libc::LOCK_NB };
    // SAFETY: flock on a descriptor we own.
    (unsafe { libc::flock(f.as_raw_fd(), op) } == 0).then_some(f)
}

/// The image, pulled and unpacked: its root filesystem and its config's
/// environment.
struct Ready {
    rootfs: PathBuf,
    env: Vec<String>,
}

fn pull(spec: &Spec) -> Result<Ready, String> {
    let cache = &spec.cache;
    std::fs::create_dir_all(cache.join("rootfs"))
        .map_err(|e| format!("{}: {e}", cache.display()))?;
    // One pull at a time on the node; runners hold their root shared.
    let _pulling = lock(&cache.join(".lock"), true, true, false)
        .ok_or_else(|| "cannot lock the image cache".to_string())?;
    let layout = cache.join("oci");
    let auth = AuthFile::from_env(&spec.runc_root)?;
    let tag = format!("r{:016x}", fnv(spec.image.as_bytes()));
    let at = format!("oci:{}:{tag}", layout.display());
    let before = dir_bytes(&layout.join("blobs/sha256"));
    let started = Instant::now();
    let mut copy = Command::new("skopeo");
    copy.args(["copy", "--quiet"]);
    if loopback(&spec.image) {
        copy.arg("--src-tls-verify=false");
    }
    if let Some(a) = &auth {
        copy.arg("--src-authfile").arg(&a.0);
    }
    copy.arg(format!("docker://{}", spec.image)).arg(&at);
    eprintln!("gpuflow: pulling {}", spec.image);
    write_status(
        spec,
        &gpuflow_api::ImageReport {
            pulling: true,
            ..Default::default()
        },
    );
    tool(&mut copy)?;
    drop(auth);
    let seconds = started.elapsed().as_secs_f64();
    let pulled = dir_bytes(&layout.join("blobs/sha256")).saturating_sub(before);
    let digest = tool(Command::new("skopeo").args(["inspect", "--format", "{{.Digest}}", &at]))?
        .trim()
        .to_string();
    let hex = digest.trim_start_matches("sha256:").to_string();
    if hex.is_empty() || !hex.chars().all(|c| c.is_ascii_hexdigit()) {
        return Err(format!("skopeo gave no digest for {}", spec.image));
    }
    let rootfs = cache.join("rootfs").join(&hex);
    if !rootfs.is_dir() {
        let tmp = cache
            .join("rootfs")
            .join(format!("{hex}.tmp-{}", std::process::id()));
        let _ = std::fs::remove_dir_all(&tmp);
        tool(
            Command::new("umoci")
                .args(["raw", "unpack", "--image"])
                .arg(format!("{}:{tag}", layout.display()))
                .arg(&tmp),
        )?;
        std::fs::rename(&tmp, &rootfs).map_err(|e| format!("{}: {e}", rootfs.display()))?;
    }
    let config = tool(Command::new("skopeo").args(["inspect", "--config", &at]))?;
    let env = serde_json::from_str::<serde_json::Value>(&config)
        .ok()
        .and_then(|v| {
            v["config"]["Env"].as_array().map(|a| {
                a.iter()
                    .filter_map(|e| e.as_str().map(str::to_string))
                    .collect()
            })
        })
        .unwrap_or_default();
    eprintln!(
        "gpuflow: pulled {} ({:.1} MiB in {seconds:.1} s), {digest}",
        spec.image,
        pulled as f64 / 1048576.0
    );
    write_status(
        spec,
        &gpuflow_api::ImageReport {
            digest: digest.clone(),
            pulled_mib: pulled as f64 / 1048576.0,
            seconds,
            ..Default::default()
        },
    );
    // Marks it used now, for eviction.
    let _ = std::fs::File::create(cache.join("rootfs").join(format!("{hex}.used")));
    Ok(Ready { rootfs, env })
}

fn du(p: &Path) -> u64 {
    let Ok(m) = std::fs::symlink_metadata(p) else {
        return 0;
    };
    if m.is_dir() {
        std::fs::read_dir(p).map_or(0, |rd| {
            rd.filter_map(Result::ok).map(|e| du(&e.path())).sum()
        })
    } else {
        m.len()
    }
}

/// Removes the least recently used unpacked images no task runs from
/// while the cache is over `limit_mib` (the one about to run stays).
fn evict(cache: &Path, keep: &Path, limit_mib: u64) {
    let Ok(rd) = std::fs::read_dir(cache.join("rootfs")) else {
        return;
    };
    let mut roots: Vec<(std::time::SystemTime, PathBuf, u64)> = rd
        .filter_map(Result::ok)
        .map(|e| e.path())
        .filter(|p| p.is_dir() && p.extension().is_none())
        .map(|p| {
            let used = std::fs::metadata(p.with_extension("used"))
                .and_then(|m| m.modified())
                .unwrap_or(std::time::UNIX_EPOCH);
            let size = du(&p);
            (used, p, size)
        })
        .collect();
    let mut total: u64 = roots.iter().map(|r| r.2).sum();
    roots.sort();
    for (_, p, size) in roots {
        if total <= limit_mib << 20 {
            break;
        }
        if p == keep {
            continue;
        }
        // A task runs from it while its lock is held shared.
        if let Some(_held) = lock(&p.with_extension("lock"), true, false, false)
            && std::fs::remove_dir_all(&p).is_ok()
        {
            total = total.saturating_sub(size);
            eprintln!("gpuflow: evicted {} from the image cache", p.display());
        }
    }
}

/// The bundle's `config.json`.
fn config(spec: &Spec, ready: &Ready) -> serde_json::Value {
    use serde_json::json;
    // The image's environment, then the task's (its PATH only where the
    // image sets none).
    let cdi = spec.cdi.clone().unwrap_or_default();
    let mut env: Vec<(String, String)> = ready
        .env
        .iter()
        .chain(&cdi.env)
        .filter_map(|e| {
            e.split_once('=')
                .map(|(k, v)| (k.to_string(), v.to_string()))
        })
        .collect();
    for (k, v) in &spec.env {
        if k == "PATH" && env.iter().any(|(ek, _)| ek == "PATH") {
            continue;
        }
        env.retain(|(ek, _)| ek != k);
        env.push((k.clone(), v.clone()));
    }
    // The driver bound in: its libraries found first, its tools last.
    if !spec.driver.is_empty() {
        let mut add =
            |key: &str, dir: &str, first: bool| match env.iter_mut().find(|(k, _)| k == key) {
                Some((_, v)) if first => *v = format!("{dir}:{v}"),
                Some((_, v)) => *v = format!("{v}:{dir}"),
                None => env.push((key.to_string(), dir.to_string())),
            };
        add("LD_LIBRARY_PATH", crate::cdi::DRIVER_LIB, true);
        add("PATH", crate::cdi::DRIVER_BIN, false);
    }
    let task_dir = spec.task_dir.display().to_string();
    let mut mounts = vec![
        json!({"destination": "/proc", "type": "proc", "source": "proc"}),
        json!({"destination": "/dev", "type": "tmpfs", "source": "tmpfs", "options": ["nosuid", "strictatime", "mode=755", "size=65536k"]}),
        json!({"destination": "/dev/pts", "type": "devpts", "source": "devpts", "options": ["nosuid", "noexec", "newinstance", "ptmxmode=0666", "mode=0620"]}),
        json!({"destination": "/dev/shm", "type": "tmpfs", "source": "shm", "options": ["nosuid", "noexec", "nodev", "mode=1777", "size=65536k"]}),
        json!({"destination": "/dev/mqueue", "type": "mqueue", "source": "mqueue", "options": ["nosuid", "noexec", "nodev"]}),
        json!({"destination": "/sys", "type": "sysfs", "source": "sysfs", "options": ["nosuid", "noexec", "nodev", "ro"]}),
        json!({"destination": "/tmp", "type": "tmpfs", "source": "tmpfs", "options": ["nosuid", "nodev", "mode=1777"]}),
        json!({"destination": task_dir, "type": "bind", "source": task_dir, "options": ["rbind", "rw", "nosuid", "nodev"]}),
    ];
    if let Some(p) = &spec.mps_pipe {
        mounts.push(json!({"destination": p, "type": "bind", "source": p, "options": ["rbind", "rw", "nosuid", "nodev"]}));
    }
    for (host, inside) in &spec.driver {
        mounts.push(json!({"destination": inside, "type": "bind", "source": host, "options": ["rbind", "ro", "nosuid", "nodev"]}));
    }
    for m in &cdi.mounts {
        let options = if m.options.is_empty() {
            vec![
                "rbind".to_string(),
                "ro".into(),
                "nosuid".into(),
                "nodev".into(),
            ]
        } else {
            m.options.clone()
        };
        mounts.push(json!({"destination": m.container_path, "type": "bind", "source": m.host_path, "options": options}));
    }
    for f in ["/etc/resolv.conf", "/etc/hosts"] {
        if Path::new(f).is_file() {
            mounts.push(
                json!({"destination": f, "type": "bind", "source": f, "options": ["rbind", "ro"]}),
            );
        }
    }
    // CDI's device nodes, as the host has them.
    let cdi_devices: Vec<(String, u32, u32)> = cdi
        .device_nodes
        .iter()
        .filter_map(|n| {
            use std::os::unix::fs::{FileTypeExt, MetadataExt};
            let m = std::fs::metadata(crate::cdi::host_path(n)).ok()?;
            m.file_type()
                .is_char_device()
                .then(|| (n.path.clone(), libc::major(m.rdev()), libc::minor(m.rdev())))
        })
        .collect();
    let all_devices: Vec<&(String, u32, u32)> = spec.devices.iter().chain(&cdi_devices).collect();
    let devices: Vec<serde_json::Value> = all_devices
        .iter()
        .map(|(path, major, minor)| json!({"path": path, "type": "c", "major": major, "minor": minor, "fileMode": 0o666, "uid": 0, "gid": 0}))
        .collect();
    let mut allow = vec![json!({"allow": false, "access": "rwm"})];
    for (major, minor) in [(1, 3), (1, 5), (1, 7), (1, 8), (1, 9), (5, 0), (5, 2)] {
        allow.push(
            json!({"allow": true, "type": "c", "major": major, "minor": minor, "access": "rwm"}),
        );
    }
    allow.push(json!({"allow": true, "type": "c", "major": 136, "access": "rwm"}));
    for (_, major, minor) in &all_devices {
        allow.push(
            json!({"allow": true, "type": "c", "major": major, "minor": minor, "access": "rwm"}),
        );
    }
    let mut linux = json!({
        "namespaces": [{"type": "pid"}, {"type": "ipc"}, {"type": "uts"}, {"type": "mount"}],
        "devices": devices,
        "resources": {"devices": allow},
        "maskedPaths": ["/proc/acpi", "/proc/kcore", "/proc/keys", "/proc/latency_stats", "/proc/timer_list", "/proc/timer_stats", "/proc/sched_debug", "/sys/firmware", "/proc/scsi"],
        "readonlyPaths": ["/proc/asound", "/proc/bus", "/proc/fs", "/proc/irq", "/proc/sys", "/proc/sysrq-trigger"],
    });
    if let Some(c) = &spec.cgroup {
        linux["cgroupsPath"] = json!(c);
    }
    let mut hooks = serde_json::Map::new();
    for h in &cdi.hooks {
        let entry = json!({"path": h.path, "args": h.args, "env": h.env});
        if let Some(list) = hooks
            .entry(h.hook_name.clone())
            .or_insert_with(|| json!([]))
            .as_array_mut()
        {
            list.push(entry);
        }
    }
    json!({
        "ociVersion": "1.0.2",
        "hooks": hooks,
        "process": {
            "terminal": false,
            "user": {"uid": spec.uid, "gid": spec.gid, "additionalGids": [spec.gid]},
            "args": spec.args,
            "env": env.iter().map(|(k, v)| format!("{k}={v}")).collect::<Vec<_>>(),
            "cwd": spec.cwd,
            "capabilities": {"bounding": [], "effective": [], "permitted": [], "inheritable": [], "ambient": []},
            "noNewPrivileges": true,
        },
        "root": {"path": ready.rootfs.display().to_string(), "readonly": true},
        "hostname": "gpuflow",
        "mounts": mounts,
        "linux": linux,
    })
}

/// Starts `cmd` in the running container of `spec` (`runc exec`: its
/// user, directory, environment, namespaces and cgroup), on the terminal
/// whose other side is `tty` or on pipes.
///
/// # Errors
/// When runc cannot be started.
pub fn exec(
    spec: &Spec,
    cmd: &[String],
    tty: Option<std::os::fd::OwnedFd>,
) -> Result<std::process::Child, String> {
    use crate::task::Io;
    let mut c = Command::new("runc");
    c.arg("--root").arg(&spec.runc_root).args([
        "exec",
        "--user",
        &format!("{}:{}", spec.uid, spec.gid),
        "--cwd",
        &spec.cwd,
    ]);
    let on_tty = tty.is_some();
    if on_tty {
        c.arg("--tty");
    }
    c.arg(&spec.id).args(cmd);
    let io = match tty {
        Some(fd) => {
            // runc gives the container a terminal of its own and relays:
            // ours only carries bytes (else every line echoes twice).
            use std::os::fd::AsRawFd;
            crate::session::raw_mode(fd.as_raw_fd());
            Io::Tty(fd)
        }
        None => Io::Pipes,
    };
    if io.apply(&mut c)? {
        // SAFETY: `take_terminal` is async-signal-safe.
        unsafe { c.pre_exec(crate::task::take_terminal) };
    }
    c.spawn().map_err(|e| format!("cannot start runc: {e}"))
}

/// `gpuflow oci-run SPEC`: pulls, unpacks, writes the bundle and becomes
/// runc. Returns only on failure (exit status 125, the status file saying
/// why).
pub fn run(spec_path: &Path) -> i32 {
    let spec: Spec = match std::fs::read(spec_path)
        .map_err(|e| e.to_string())
        .and_then(|b| serde_json::from_slice(&b).map_err(|e| e.to_string()))
    {
        Ok(s) => s,
        Err(e) => {
            eprintln!(
                "gpuflow: cannot read the task's image spec {}: {e}",
                spec_path.display()
            );
            return 125;
        }
    };
    let fail = |msg: String| {
        eprintln!("gpuflow: cannot run {}: {msg}", spec.image);
        write_status(
            &spec,
            &gpuflow_api::ImageReport {
                error: msg,
                ..Default::default()
            },
        );
        125
    };
    let ready = match pull(&spec) {
        Ok(r) => r,
        Err(e) => return fail(e),
    };
    // Held (shared) by runc for the container's life: eviction skips it.
    let _in_use = lock(&ready.rootfs.with_extension("lock"), false, true, true);
    evict(&spec.cache, &ready.rootfs, spec.cache_mib);
    let bundle = spec.runc_root.join(format!("{}.bundle", spec.id));
    let written = std::fs::create_dir_all(&bundle).and_then(|()| {
        let mut f = std::fs::File::create(bundle.join("config.json"))?;
        f.write_all(&serde_json::to_vec_pretty(&config(&spec, &ready)).unwrap_or_default())
    });
    if let Err(e) = written {
        return fail(format!("cannot write its bundle: {e}"));
    }
    let err = Command::new("runc")
        .arg("--root")
        .arg(&spec.runc_root)
        .arg("--log")
        .arg(spec.runc_root.join(format!("{}.log", spec.id)))
        .args(["run", "--bundle"])
        .arg(&bundle)
        .arg(&spec.id)
        .exec();
    fail(format!("cannot start runc: {err}"))
}

#[cfg(test)]
mod tests {
    use super::*;

    /// Least recently used first, past the limit; the one about to run
    /// and one a task runs from (its lock held) stay.
    #[test]
    fn the_cache_evicts_the_least_recently_used_images_no_task_runs_from() {
        let cache = tempfile::tempdir().unwrap();
        let root = cache.path().join("rootfs");
        let make = |name: &str, mib: usize, age_s: u64| {
            let d = root.join(name);
            std::fs::create_dir_all(&d).unwrap();
            std::fs::write(d.join("blob"), vec![0u8; mib << 20]).unwrap();
            let used = d.with_extension("used");
            std::fs::write(&used, "").unwrap();
            let t = std::time::SystemTime::now() - std::time::Duration::from_secs(age_s);
            std::fs::File::options()
                .write(true)
                .open(&used)
                .unwrap()
                .set_modified(t)
                .unwrap();
            d
        };
        let oldest = make("aaa", 2, 300);
        let busy = make("bbb", 2, 200);
        let newer = make("ccc", 2, 100);
        let current = make("ddd", 2, 400);
        // A task runs from bbb.
        let _held = lock(&busy.with_extension("lock"), false, true, false).unwrap();
        evict(cache.path(), &current, 5);
        assert!(!oldest.exists(), "the least recently used goes first");
        assert!(busy.exists(), "one in use stays");
        assert!(!newer.exists(), "then the next, while over the limit");
        assert!(current.exists(), "the one about to run stays");
    }

    #[test]
    fn a_registry_on_this_host_is_spoken_to_over_http_only() {
        assert!(loopback("127.0.0.1:5000/team/busybox:1"));
        assert!(loopback("localhost/x"));
        assert!(!loopback("registry.example.com/team/x:1"));
        assert!(!loopback("127.0.0.1.example.com/x"));
        assert!(!loopback("busybox"));
    }
}
