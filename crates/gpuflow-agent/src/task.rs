//! Running tasks as process trees. Each task runs under its keeper (see
//! `keeper.rs`), which leads the task's own process group, so a stop reaches
//! everything it started: the stop signal goes to the group, and after the
//! grace period SIGKILL does. Output goes to a log file per task; the task
//! may write a Unix time to the file named by `GPUFLOW_CHECKPOINT_FILE` to
//! report a checkpoint.
//!
//! A task is started at most once per work directory: its directory
//! (`job-J/aA-gG-iI`) is made when it starts, and a task whose directory
//! exists is never started again, only reported as it ended (from its
//! keeper's exit record), whatever happened to the agent meanwhile.

use std::collections::BTreeMap;
use std::io::{Read, Seek, SeekFrom};
use std::os::unix::fs::{OpenOptionsExt, PermissionsExt};
use std::os::unix::process::{CommandExt, ExitStatusExt};
use std::path::{Path, PathBuf};
use std::process::{Child, Command, Stdio};
use std::time::{Duration, Instant};

use gpuflow_api::{Breach, DesiredTask, TaskLimits, TaskPhase, TaskReport, TaskUsage};

/// `(job, attempt, group, index)`.
pub type Key = (u64, u32, u16, u32);

pub fn key(t: &DesiredTask) -> Key {
    (t.job, t.attempt, t.group, t.index)
}

/// How the agent launches tasks.
#[derive(Clone, Debug)]
pub struct Launch {
    /// When the agent is root: the user tasks run as unless their team
    /// names one.
    pub run_as: String,
    /// When the agent is root: tasks of a team without `run_as` run as this
    /// plus the team's number (0: as `run_as`).
    pub task_uid_base: u32,
    /// The node's lease file, open, which the tasks' keepers read (-1: none,
    /// no fencing).
    pub lease_fd: i32,
    /// The agent's cgroups, where tasks get their limits (none: no limits).
    pub cgroups: Option<crate::cgroup::Cgroups>,
    /// Each GPU's device-node minor by index: a task may open only its
    /// GPUs' device nodes.
    pub gpu_minors: Vec<u32>,
    /// The driver's MIG capability devices, where it has them: a task may
    /// open its MIG instances' only (see `migcaps.rs`).
    pub mig_caps: Option<std::sync::Arc<crate::migcaps::Caps>>,
    /// Each MIG instance's place by UUID, as last read from NVML.
    pub mig_ids: BTreeMap<String, crate::migcaps::MigId>,
    /// Namespaces and the seccomp filter (see `isolate.rs`).
    pub isolation: crate::isolate::Policy,
    /// Where tasks' own directories go (see `taskroot.rs`): the work
    /// directory, or a directory the tasks' users can reach when it is
    /// not. Empty: the work directory.
    pub tasks: PathBuf,
    /// Why this node cannot run tasks in images (`None`: it can).
    pub no_images: Option<String>,
    /// This program, whose `oci-run` starts a task in an image.
    pub helper: PathBuf,
    /// The image cache's size limit, MiB.
    pub image_cache_mib: u64,
    /// Where the node's CDI specs are, and its GPUs' UUIDs by index.
    pub cdi_dirs: Vec<PathBuf>,
    pub gpu_uuids: Vec<String>,
    /// The node's driver files, for containers its CDI specs do not cover.
    pub driver_files: Vec<(PathBuf, String)>,
}

impl Launch {
    /// The directory under which tasks' directories go, for an agent on
    /// `dir`.
    pub fn tasks<'a>(&'a self, dir: &'a Path) -> &'a Path {
        if self.tasks.as_os_str().is_empty() {
            dir
        } else {
            &self.tasks
        }
    }
}

impl Default for Launch {
    fn default() -> Launch {
        Launch {
            run_as: "nobody".into(),
            task_uid_base: DEFAULT_TASK_UID_BASE,
            lease_fd: -1,
            cgroups: None,
            gpu_minors: Vec::new(),
            mig_caps: None,
            mig_ids: BTreeMap::new(),
            isolation: crate::isolate::Policy::default(),
            tasks: PathBuf::new(),
            no_images: Some("not set up".into()),
            helper: PathBuf::new(),
            image_cache_mib: 20 << 10,
            cdi_dirs: Vec::new(),
            gpu_uuids: Vec::new(),
            driver_files: Vec::new(),
        }
    }
}

/// The default first uid of the teams' own task users: high, far from the
/// system's and people's uids (systemd's dynamic users sit near 61184).
pub const DEFAULT_TASK_UID_BASE: u32 = 1_600_000_000;

/// The agent's own user name, for a task that runs as the agent.
fn agent_user_name() -> String {
    crate::user::lookup_uid(crate::user::agent_uid()).unwrap_or_else(|| "gpuflow".into())
}

/// Reads a small file the task controls, safely: no symlink is followed, a
/// FIFO or device does not block the agent, at most 64 bytes are read.
fn read_task_file(path: &Path) -> Option<String> {
    let f = std::fs::OpenOptions::new()
        .read(true)
        .custom_flags(libc::O_NOFOLLOW | libc::O_NONBLOCK)
        .open(path)
        .ok()?;
    if !f.metadata().ok()?.is_file() {
        return None;
    }
    let mut buf = Vec::with_capacity(64);
    f.take(64).read_to_end(&mut buf).ok()?;
    Some(String::from_utf8_lossy(&buf).into_owned())
}

/// Where MPS's control daemon listens by default.
const MPS_PIPE: &str = "/tmp/nvidia-mps";

/// MPS's limits for a task sharing a GPU (a no-op where MPS does not run;
/// the agent's GPU-memory watchdog holds the limit in any case).
fn mps_env(l: &TaskLimits) -> Vec<(&'static str, String)> {
    let mut env = Vec::new();
    if l.gpu_memory_mib > 0 {
        env.push((
            "CUDA_MPS_PINNED_DEVICE_MEM_LIMIT",
            format!("0={}M", l.gpu_memory_mib),
        ));
    }
    if l.gpu_percent > 0 {
        env.push((
            "CUDA_MPS_ACTIVE_THREAD_PERCENTAGE",
            l.gpu_percent.to_string(),
        ));
    }
    env
}

/// The task's last checkpoint: the Unix time it wrote to its checkpoint
/// file, or, when it only touched it, the file's modification time.
fn checkpoint_time(path: &Path) -> Option<u64> {
    let text = read_task_file(path)?;
    if let Ok(t) = text.trim().parse() {
        return Some(t);
    }
    std::fs::symlink_metadata(path)
        .ok()
        .filter(std::fs::Metadata::is_file)?
        .modified()
        .ok()?
        .duration_since(std::time::UNIX_EPOCH)
        .ok()
        .map(|d| d.as_secs())
}

/// The most of one stream's output one report carries while the task
/// runs; the rest follows in the next reports.
const CHUNK_RUNNING: u64 = 256 * 1024;
/// The same once it has ended (its last reports before the server lets it
/// go).
const CHUNK_ENDED: u64 = 1024 * 1024;
/// Output further behind than this is skipped, not shipped (the server
/// marks the gap): a task writing faster than its node ships costs a gap in
/// its kept log, never an unbounded heartbeat.
const BEHIND_MAX: u64 = 1024 * 1024;

pub struct Task {
    pub key: Key,
    child: Option<Child>,
    pgid: i32,
    pub phase: TaskPhase,
    pub exit_code: Option<i32>,
    /// Set once told to stop: when to kill.
    kill_at: Option<Instant>,
    killed: bool,
    pub log: PathBuf,
    checkpoint: PathBuf,
    pub message: String,
    /// How much of its stdout and stderr the server has acknowledged: the
    /// next report ships from there.
    pub acked: [u64; 2],
    /// The leader's start time (clock ticks since boot), to recognise it
    /// after an agent restart even if its pid has been reused since.
    start_ticks: u64,
    /// Where its keeper records how it ended.
    exit: PathBuf,
    /// When it started (Unix seconds).
    pub started_at: u64,
    /// Its cgroup, holding its limits, while it runs.
    group: Option<crate::cgroup::TaskGroup>,
    /// Its memory limit (MiB; 0: none), for the OOM message.
    memory_mib: u64,
    /// The limit it was killed at.
    pub breach: Option<Breach>,
    /// A limit it broke, to report once it has ended: what and in words.
    failure: Option<(Breach, String)>,
    /// Its GPUs' indices on the node.
    pub gpus: Vec<u32>,
    /// What it may use.
    pub limits: TaskLimits,
    /// Its GPU use so far, and the sum of its utilisation samples.
    pub usage: TaskUsage,
    util_sum: f64,
    /// The port it serves on (`PORT`), when it asked for one.
    pub port: Option<u16>,
    /// The ports it declared, by name, in its spec's order.
    pub ports: Vec<(String, u16)>,
    /// Where its image's pull is reported (`oci.rs`), when it runs in one.
    pub image_status: Option<PathBuf>,
    /// Its readiness check, and its last answer and when.
    pub readiness: Option<gpuflow_api::job::Readiness>,
    pub ready: Option<bool>,
    probed_at: Option<Instant>,
    /// Who and where a readiness command runs as: the task's identity.
    probe_as: Option<ProbeAs>,
    /// A readiness command under way, and since when.
    probing: Option<(Child, Instant)>,
}

/// A readiness command's identity: the task's user, environment and
/// directory.
#[derive(Clone, Debug)]
pub struct ProbeAs {
    ids: Option<(u32, u32)>,
    env: Vec<(String, String)>,
    task_dir: PathBuf,
    work: Option<std::ffi::CString>,
    isolation: crate::isolate::Prepared,
}

/// What the agent keeps on disk about a running task, to adopt it after a
/// restart of the agent.
#[derive(Clone, Debug, PartialEq, Eq, serde::Serialize, serde::Deserialize)]
pub struct Record {
    pub key: Key,
    pub pgid: i32,
    pub start_ticks: u64,
    pub log: PathBuf,
    pub checkpoint: PathBuf,
    #[serde(default)]
    pub exit: PathBuf,
    #[serde(default)]
    pub started_at: u64,
    #[serde(default)]
    pub memory_mib: u64,
    #[serde(default)]
    pub gpus: Vec<u32>,
    #[serde(default)]
    pub limits: TaskLimits,
    #[serde(default)]
    pub port: Option<u16>,
    #[serde(default, skip_serializing_if = "Vec::is_empty")]
    pub ports: Vec<(String, u16)>,
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub image_status: Option<PathBuf>,
    #[serde(default)]
    pub readiness: Option<gpuflow_api::job::Readiness>,
}

/// A task's directory under the work directory.
pub fn task_dir(dir: &Path, k: Key) -> PathBuf {
    let (job, attempt, group, index) = k;
    dir.join(format!("job-{job}"))
        .join(format!("a{attempt}-g{group}-i{index}"))
}

/// A task's exit record, in the agent's own state directory (out of the
/// task's reach).
pub fn exit_path(dir: &Path, k: Key) -> PathBuf {
    let (job, attempt, group, index) = k;
    dir.join("state")
        .join(format!("job-{job}-a{attempt}-g{group}-i{index}.exit"))
}

/// A process's start time from `/proc/PID/stat` (field 22), if it exists.
fn start_ticks(pid: i32) -> Option<u64> {
    let stat = std::fs::read_to_string(format!("/proc/{pid}/stat")).ok()?;
    // The command name (field 2) may hold spaces: count from its closing parenthesis.
    let rest = &stat[stat.rfind(')')? + 2..];
    let fields: Vec<&str> = rest.split_whitespace().collect();
    if fields.first() == Some(&"Z") {
        return None;
    }
    fields.get(19)?.parse().ok()
}

fn group_alive(pgid: i32) -> bool {
    // SAFETY: kill(2) with signal 0 only checks that the group exists.
    pgid > 0 && unsafe { libc::kill(-pgid, 0) } == 0
}

/// The signal named `name` (`SIGTERM`, `SIGUSR1`, …, as `signal(7)` names
/// them); `None` when there is no such signal.
pub fn signal_number(name: &str) -> Option<i32> {
    name.parse::<nix::sys::signal::Signal>()
        .ok()
        .map(|s| s as i32)
}

impl Task {
    /// A task in its first moments, before it is started or recovered:
    /// its records in the work directory `dir`, its own directory under
    /// `tasks`.
    fn new(k: Key, dir: &Path, tasks: &Path) -> Task {
        let task_dir = task_dir(tasks, k);
        Task {
            key: k,
            child: None,
            pgid: 0,
            phase: TaskPhase::Running,
            exit_code: None,
            kill_at: None,
            killed: false,
            log: task_dir.join("output.log"),
            checkpoint: task_dir.join("checkpoint"),
            message: String::new(),
            acked: [0, 0],
            start_ticks: 0,
            exit: exit_path(dir, k),
            started_at: crate::unix_now(),
            group: None,
            memory_mib: 0,
            breach: None,
            failure: None,
            gpus: Vec::new(),
            limits: TaskLimits::default(),
            usage: TaskUsage::default(),
            util_sum: 0.0,
            port: None,
            ports: Vec::new(),
            image_status: None,
            readiness: None,
            ready: None,
            probed_at: None,
            probe_as: None,
            probing: None,
        }
    }

    /// Starts a desired task, unless it was started before on this work
    /// directory (by this agent or an earlier one): then it is only
    /// reported as it ended, never run twice.
    /// Its directory may be in the work directory itself, where agents
    /// before `taskroot.rs` put every task's.
    pub fn start_once(t: &DesiredTask, dir: &Path, launch: &Launch) -> Task {
        for tasks in [launch.tasks(dir), dir] {
            if task_dir(tasks, key(t)).exists() {
                return Task::recover(key(t), dir, tasks);
            }
        }
        Task::start(t, dir, launch)
    }

    /// A task that was started before and is not running under this agent:
    /// how it ended, from its keeper's record.
    fn recover(k: Key, dir: &Path, tasks: &Path) -> Task {
        let mut task = Task::new(k, dir, tasks);
        task.started_at = std::fs::metadata(task_dir(tasks, k))
            .and_then(|m| m.modified())
            .ok()
            .and_then(|m| m.duration_since(std::time::UNIX_EPOCH).ok())
            .map_or(0, |d| d.as_secs());
        task.ended(crate::keeper::read_exit(&task.exit), None);
        tracing::info!(job = k.0, attempt = k.1, phase = ?task.phase, "task already ran; not starting it again");
        task
    }

    /// Starts a task; a task that cannot start is returned in phase
    /// `FailedToStart` with the reason.
    ///
    /// The task gets a clean environment: a plain `PATH`, `HOME` (its own
    /// directory), `USER`, then the spec's variables and gpuflow's, never
    /// the agent's (which may hold its tokens). When the agent is root, the
    /// task runs as `launch.run_as` or its team's user, never as root. It
    /// runs under its keeper, which fences it with the node's lease and
    /// records how it ended.
    fn start(t: &DesiredTask, dir: &Path, launch: &Launch) -> Task {
        let (job, attempt, group, index) = key(t);
        let task_dir = task_dir(launch.tasks(dir), key(t));
        let mut task = Task::new(key(t), dir, launch.tasks(dir));
        task.gpus = t.gpus.clone();
        task.limits = t.limits;
        task.readiness = t.readiness.clone();
        // A serving task gets a port free now on this node (taken from the
        // kernel's ephemeral range), in PORT and GPUFLOW_PORT; so does each
        // port it declares, the first in PORT unless it serves already.
        let free = || {
            std::net::TcpListener::bind("0.0.0.0:0")
                .and_then(|l| l.local_addr())
                .map(|a| a.port())
                .ok()
        };
        if t.port {
            task.port = free();
        }
        task.ports = t
            .ports
            .iter()
            .filter_map(|name| Some((name.clone(), free()?)))
            .collect();
        if task.port.is_none() {
            task.port = task.ports.first().map(|p| p.1);
        }
        let (log, checkpoint) = (task.log.clone(), task.checkpoint.clone());
        let result = (|| -> Result<Child, String> {
            // A stop signal this machine does not know is refused, not
            // replaced: the job asked for that one.
            let stop_signal = signal_number(&t.stop_signal)
                .ok_or_else(|| format!("unknown stop signal {:?}", t.stop_signal))?;
            let user = crate::user::resolve_task(crate::user::TaskUser {
                run_as: t.run_as.as_deref(),
                team_uid: t.team_uid,
                uid_base: launch.task_uid_base,
                default: &launch.run_as,
            })
            .map_err(|e| e.to_string())?;
            let io = |e: std::io::Error| e.to_string();
            std::fs::create_dir_all(dir.join("state")).map_err(io)?;
            let exit = crate::keeper::create_exit(&task.exit).map_err(io)?;
            std::fs::create_dir_all(&task_dir).map_err(io)?;
            // The job's directory is passed through (searched, not listed)
            // by its tasks' users; each task's is its user's alone.
            if let Some(job_dir) = task_dir.parent() {
                std::fs::set_permissions(job_dir, std::fs::Permissions::from_mode(0o711))
                    .map_err(io)?;
            }
            std::fs::set_permissions(&task_dir, std::fs::Permissions::from_mode(0o700))
                .map_err(io)?;
            // Its cgroup with its limits, joined by the task before exec.
            if let Some(c) = &launch.cgroups {
                let limits = crate::cgroup::Limits {
                    cpu_milli: t.limits.cpu_milli,
                    memory_mib: t.limits.memory_mib,
                };
                // Its GPUs' device nodes; an index the agent does not know
                // (the inventory changed) maps to no device at all.
                let minors: Vec<u32> = t
                    .gpus
                    .iter()
                    .filter_map(|&i| launch.gpu_minors.get(i as usize).copied())
                    .collect();
                // Its MIG instances' capabilities, and no other's.
                let caps = launch.mig_caps.as_ref().map(|caps| {
                    let ids: Vec<crate::migcaps::MigId> = t
                        .mig
                        .iter()
                        .filter_map(|u| {
                            let id = launch.mig_ids.get(u).copied();
                            if id.is_none() {
                                tracing::warn!(instance = %u, "NVML does not know this MIG instance: the task cannot open it");
                            }
                            id
                        })
                        .collect();
                    caps.rule(&ids)
                });
                // In an image, runc confines the container's devices in a
                // group of its own inside the task's, allowing only its GPUs
                // (`oci.rs`); the v1 controller lets a child allow only what
                // its parent allows whole, so the task's own group (runc's
                // alone) stays open.
                let (minors, caps) = if t.image.is_some() {
                    (crate::cgroup::all_gpu_minors(), None)
                } else {
                    (minors, caps)
                };
                task.group = Some(
                    c.create(key(t), limits, &minors, caps.as_ref())
                        .map_err(|e| format!("cannot set its limits: {e}"))?,
                );
                task.memory_mib = t.limits.memory_mib;
            }
            let procs = match &task.group {
                Some(g) => g.procs_files()?,
                None => Vec::new(),
            };
            let reach = task
                .group
                .as_ref()
                .map_or_else(crate::keeper::Reach::none, crate::cgroup::TaskGroup::reach);
            if let Some(u) = &user {
                std::os::unix::fs::chown(&task_dir, Some(u.uid), Some(u.gid)).map_err(io)?;
            }
            // The log belongs to the agent; the task writes it through the
            // descriptor it inherits and cannot replace it.
            let out = std::fs::OpenOptions::new()
                .write(true)
                .create(true)
                .truncate(true)
                .mode(0o600)
                .open(&log)
                .map_err(io)?;
            // stderr apart from stdout, in its own file.
            let err = std::fs::OpenOptions::new()
                .write(true)
                .create(true)
                .truncate(true)
                .mode(0o600)
                .open(err_log(&log))
                .map_err(io)?;
            // A task user who cannot walk the agent's directories to its own
            // finds its checkpoint file relative to where it starts.
            let checkpoint_env = match &user {
                Some(u) if t.working_dir.is_none() && !crate::user::can_reach(u, &task_dir) => {
                    PathBuf::from("checkpoint")
                }
                _ => checkpoint.clone(),
            };
            let env = environment(t, &task_dir, user.as_ref(), task.port, &task.ports);
            let mut cmd = match &t.image {
                None => {
                    let mut cmd = Command::new(&t.command[0]);
                    cmd.args(&t.command[1..])
                        .env_clear()
                        .envs(env.iter().map(|(k, v)| (k, v)))
                        .env("GPUFLOW_CHECKPOINT_FILE", &checkpoint_env)
                        .envs(mps_env(&t.limits));
                    cmd
                }
                Some(image) => {
                    let spec = image_spec(
                        t,
                        image,
                        &task_dir,
                        &env,
                        &checkpoint,
                        user.as_ref(),
                        task.group.as_ref(),
                        dir,
                        launch,
                    )?;
                    task.image_status = Some(spec.status.clone());
                    let path = dir
                        .join("state")
                        .join(format!("job-{job}-a{attempt}-g{group}-i{index}.oci.json"));
                    std::fs::write(&path, serde_json::to_vec(&spec).map_err(|e| e.to_string())?)
                        .map_err(io)?;
                    let mut cmd = Command::new(&launch.helper);
                    cmd.arg("oci-run").arg(&path).env_clear().env(
                        "PATH",
                        "/usr/local/sbin:/usr/local/bin:/usr/sbin:/usr/bin:/sbin:/bin",
                    );
                    // The team's login, for the pull alone: in the helper's
                    // environment (root's to read), never on disk for long
                    // or in the container's.
                    if let Some(auth) = &t.registry_auth {
                        cmd.env(
                            crate::oci::AUTH_ENV,
                            serde_json::to_string(auth).map_err(|e| e.to_string())?,
                        );
                    }
                    cmd
                }
            };
            let in_image = t.image.is_some();
            cmd.stdin(Stdio::null())
                .stdout(out)
                .stderr(err)
                .process_group(0)
                // As the agent: its own directory is made for it.
                .current_dir(&task_dir);
            let ids = user.as_ref().map(|u| (u.uid, u.gid));
            let isolation = crate::isolate::prepare(&launch.isolation, &task_dir, ids)
                .map_err(|e| format!("cannot isolate it: {e}"))?;
            let probe_isolation = isolation.clone();
            let work = match &t.working_dir {
                Some(w) => Some(
                    std::ffi::CString::new(w.as_str())
                        .map_err(|_| format!("working_dir {w:?} holds a NUL byte"))?,
                ),
                None => None,
            };
            let probe_work = work.clone();
            let lease_fd = launch.lease_fd;
            let (exit_fd, procs_fds) = {
                use std::os::fd::AsRawFd;
                (
                    exit.as_raw_fd(),
                    procs.iter().map(AsRawFd::as_raw_fd).collect::<Vec<i32>>(),
                )
            };
            // SAFETY: the closure runs in the forked child before exec and
            // calls only async-signal-safe functions (fork, write, setgroups,
            // setgid, setuid, chdir, umask, and the keeper's loop) on memory
            // prepared before the fork.
            unsafe {
                cmd.pre_exec(move || {
                    // This process becomes the task's keeper, and the
                    // subreaper of its tree; its child the task.
                    if libc::prctl(libc::PR_SET_CHILD_SUBREAPER, 1, 0, 0, 0) != 0 {
                        return Err(std::io::Error::last_os_error());
                    }
                    let pid = libc::fork();
                    if pid < 0 {
                        return Err(std::io::Error::last_os_error());
                    }
                    if pid > 0 {
                        crate::keeper::keep(pid, lease_fd, exit_fd, stop_signal, &reach);
                    }
                    // The task becomes itself; its keeper stays outside
                    // its cgroup. In an image, runc makes it its user,
                    // namespaces and all.
                    if in_image {
                        join(&procs_fds)?;
                    } else {
                        become_task(&procs_fds, ids, work.as_deref(), &isolation)?;
                    }
                    libc::umask(0o022);
                    Ok(())
                });
            }
            let child = cmd
                .spawn()
                .map_err(|e| format!("cannot start {:?}: {e}", t.command[0]));
            drop((exit, procs));
            if t.readiness.as_ref().is_some_and(|r| r.command.is_some()) {
                task.probe_as = Some(ProbeAs {
                    ids,
                    env,
                    task_dir: task_dir.clone(),
                    work: probe_work,
                    isolation: probe_isolation,
                });
            }
            child
        })();
        match result {
            Ok(child) => {
                task.pgid = child.id() as i32;
                task.start_ticks = start_ticks(task.pgid).unwrap_or(0);
                task.child = Some(child);
                tracing::info!(job, attempt, group, index, pid = task.pgid, "task started");
            }
            Err(e) => {
                if let Some(g) = task.group.take() {
                    g.remove();
                }
                task.phase = TaskPhase::FailedToStart;
                tracing::warn!(job, attempt, group, index, error = %e, "task failed to start");
                task.message = e;
            }
        }
        task
    }

    /// Takes over a task a previous agent process started: running, if its
    /// keeper still runs (the same process, by its start time), else ended
    /// as its keeper recorded.
    pub fn adopt(r: &Record, cgroups: Option<&crate::cgroup::Cgroups>) -> Task {
        let mut task = Task {
            key: r.key,
            child: None,
            pgid: r.pgid,
            phase: TaskPhase::Running,
            exit_code: None,
            kill_at: None,
            killed: false,
            log: r.log.clone(),
            checkpoint: r.checkpoint.clone(),
            message: String::new(),
            acked: [0, 0],
            start_ticks: r.start_ticks,
            exit: r.exit.clone(),
            started_at: r.started_at,
            group: cgroups.map(|c| c.group(r.key)),
            memory_mib: r.memory_mib,
            breach: None,
            failure: None,
            gpus: r.gpus.clone(),
            limits: r.limits,
            usage: TaskUsage::default(),
            util_sum: 0.0,
            port: r.port,
            ports: r.ports.clone(),
            image_status: r.image_status.clone(),
            readiness: r.readiness.clone(),
            ready: None,
            probed_at: None,
            probe_as: None,
            probing: None,
        };
        let same = start_ticks(r.pgid).is_some_and(|t| t == r.start_ticks);
        if same && group_alive(r.pgid) {
            tracing::info!(
                job = r.key.0,
                pid = r.pgid,
                "task adopted after an agent restart"
            );
        } else {
            task.pgid = 0;
            task.ended(crate::keeper::read_exit(&r.exit), None);
            task.release_group();
            tracing::info!(job = r.key.0, phase = ?task.phase, "task ended while the agent was away");
        }
        task
    }

    /// The record to keep on disk while it runs.
    pub fn record(&self) -> Option<Record> {
        (self.running() && self.pgid > 0).then(|| Record {
            key: self.key,
            pgid: self.pgid,
            start_ticks: self.start_ticks,
            log: self.log.clone(),
            checkpoint: self.checkpoint.clone(),
            exit: self.exit.clone(),
            started_at: self.started_at,
            memory_mib: self.memory_mib,
            gpus: self.gpus.clone(),
            limits: self.limits,
            port: self.port,
            ports: self.ports.clone(),
            image_status: self.image_status.clone(),
            readiness: self.readiness.clone(),
        })
    }

    pub fn running(&self) -> bool {
        self.phase == TaskPhase::Running
    }

    /// Sends the stop signal to the group once and arms the kill. Returns
    /// whether it did (false when already stopping or ended).
    pub fn stop(&mut self, signal: &str, grace: Duration) -> bool {
        if !self.running() || self.kill_at.is_some() {
            return false;
        }
        self.kill_at = Some(Instant::now() + grace);
        // The stop goes ahead whatever the name: with SIGTERM, and said,
        // when this machine does not know the one asked for.
        let sig = signal_number(signal).unwrap_or_else(|| {
            tracing::warn!(key = ?self.key, signal, "unknown stop signal; sending SIGTERM");
            libc::SIGTERM
        });
        self.signal(sig);
        true
    }

    fn signal(&self, sig: i32) {
        if self.pgid > 0 {
            // SAFETY: kill(2) with a negative pid signals that process group;
            // it has no memory-safety preconditions.
            unsafe {
                libc::kill(-self.pgid, sig);
            }
        }
    }

    /// Settles how the task ended from its keeper's record, or, without
    /// one, from the keeper's own status (`status`: what waitpid said of
    /// the keeper, when it was our child).
    fn ended(&mut self, record: Option<crate::keeper::Ended>, status: Option<i32>) {
        use crate::keeper::Ended;
        let stopped = self.kill_at.is_some();
        let (phase, code, message) = match record {
            Some(Ended::Exited(c)) => (
                if stopped {
                    TaskPhase::Stopped
                } else {
                    TaskPhase::Exited
                },
                Some(c),
                String::new(),
            ),
            Some(Ended::Signalled(s)) => (
                if stopped {
                    TaskPhase::Stopped
                } else {
                    TaskPhase::Exited
                },
                Some(128 + s),
                String::new(),
            ),
            Some(Ended::Fenced) => (
                TaskPhase::Stopped,
                None,
                "stopped on the node: its agent could not renew the node's lease with the server"
                    .to_string(),
            ),
            None if stopped => (TaskPhase::Stopped, status, String::new()),
            None => (
                TaskPhase::Stopped,
                status,
                "its keeper was killed (the agent stopped or crashed); exit status unknown"
                    .to_string(),
            ),
        };
        self.phase = phase;
        self.exit_code = code;
        if !message.is_empty() {
            self.message = message;
        }
    }

    /// Once it has ended: whether the kernel killed it at its memory
    /// limit (then it is reported so), then its cgroup is removed with
    /// anything left in it.
    fn release_group(&mut self) {
        let Some(g) = self.group.take() else {
            return;
        };
        // In an image the container's own group (runc's, inside the task's)
        // is gone with its count by now: a container killed by SIGKILL
        // whose task's group reached its memory limit was the kernel's OOM
        // kill.
        let container_oom = self.image_status.is_some()
            && self.exit_code == Some(128 + libc::SIGKILL)
            && g.hit_memory_limit();
        if g.oom_kills() > 0 || container_oom {
            self.breach = Some(Breach::Memory);
            self.message = if self.memory_mib > 0 {
                format!(
                    "out of memory: the kernel killed it at its memory limit of {} MiB (raise resources.memory_mib)",
                    self.memory_mib
                )
            } else {
                "out of memory: the kernel killed it at its memory limit".into()
            };
        }
        g.remove();
    }

    /// Reaps an exit and enforces the kill time.
    pub fn poll(&mut self) {
        if self.phase != TaskPhase::Running {
            return;
        }
        let status = match self.child.as_mut() {
            // Ours: its keeper's exit is ours to read.
            Some(child) => match child.try_wait() {
                Ok(Some(status)) => {
                    Some(status.code().or_else(|| status.signal().map(|s| 128 + s)))
                }
                _ => None,
            },
            // Adopted: its keeper is not our child; its record tells.
            None => (!group_alive(self.pgid)).then_some(None),
        };
        match status {
            Some(status) => {
                self.ended(crate::keeper::read_exit(&self.exit), status);
                // The leader is gone; make sure the rest of its tree is too.
                self.signal(libc::SIGKILL);
                self.release_group();
                if let Some((breach, message)) = self.failure.take() {
                    // Killed for breaking a limit: it failed, whatever
                    // its keeper could record.
                    self.phase = TaskPhase::Exited;
                    self.exit_code = Some(self.exit_code.unwrap_or(128 + libc::SIGKILL));
                    self.breach = Some(breach);
                    self.message = message;
                }
                tracing::info!(job = self.key.0, code = ?self.exit_code, phase = ?self.phase, "task ended");
            }
            None => {
                if let Some(k) = self.kill_at
                    && Instant::now() >= k
                    && !self.killed
                {
                    self.killed = true;
                    self.signal(libc::SIGKILL);
                    // Also what left its process group.
                    if let Some(g) = &self.group {
                        g.kill();
                    }
                }
            }
        }
    }

    /// Kills it for breaking a limit: it is reported as failed with
    /// `message` once it has ended.
    pub fn fail(&mut self, breach: Breach, message: String) {
        if !self.running() || self.failure.is_some() || self.kill_at.is_some() {
            return;
        }
        tracing::warn!(job = self.key.0, %message, "task broke a limit; killing it");
        self.failure = Some((breach, message));
        // Its cgroup holds the task and not its keeper, which then records
        // how it ended; without one the whole group goes, keeper included.
        match &self.group {
            Some(g) => g.kill(),
            None => self.signal(libc::SIGKILL),
        }
    }

    /// CPU time its cgroup used, in seconds, where it is accounted.
    pub fn cpu_s(&self) -> Option<f64> {
        self.group
            .as_ref()
            .and_then(crate::cgroup::TaskGroup::cpu_usage_us)
            .map(|us| us as f64 / 1e6)
    }

    /// Whether `pid` is one of its processes: in its cgroup, or in its
    /// process group.
    pub fn owns(&self, cgroups_of_pid: &str, pgrp_of_pid: Option<i32>) -> bool {
        let name = crate::cgroup::group_name(self.key);
        (self.group.is_some() && cgroups_of_pid.contains(&format!("/{name}\n")))
            || (self.pgid > 0 && pgrp_of_pid == Some(self.pgid))
    }

    /// Folds one sample of its GPU use in.
    pub fn account(&mut self, util: u32, memory_mib: u64, now: u64) {
        self.util_sum += f64::from(util);
        let cpu_s = self.cpu_s();
        let u = &mut self.usage;
        u.samples += 1;
        u.gpu_util_avg_pct = self.util_sum / f64::from(u.samples);
        u.gpu_util_pct = util;
        u.gpu_memory_mib = memory_mib;
        u.gpu_memory_peak_mib = u.gpu_memory_peak_mib.max(memory_mib);
        u.cpu_s = cpu_s;
        u.idle_since = match self.limits.idle_below_pct {
            Some(below) if util < below => Some(u.idle_since.unwrap_or(now)),
            _ => None,
        };
    }

    /// Kills the tree now.
    pub fn kill(&mut self) {
        if self.running() {
            self.kill_at.get_or_insert_with(Instant::now);
            self.signal(libc::SIGKILL);
            if let Some(g) = &self.group {
                g.kill();
            }
            if let Some(c) = self.child.as_mut() {
                let _ = c.wait();
            }
            self.phase = TaskPhase::Stopped;
        }
    }

    /// Runs its readiness check when one is due: an HTTP GET of its path on
    /// its port on this node (a 2xx or 3xx answer within a second is
    /// ready), or its command (exit 0 within its timeout is ready; looked
    /// at on each call, never waited for).
    pub fn probe(&mut self, http: &ureq::Agent) {
        let Some(r) = self.readiness.clone() else {
            return;
        };
        if !self.running() {
            self.end_probe();
        }
        if let Some((child, since)) = &mut self.probing {
            let answer = match child.try_wait() {
                Ok(Some(status)) => Some(status.success()),
                Ok(None) if since.elapsed() >= Duration::from_secs(r.timeout_s) => {
                    kill_probe(child);
                    Some(false)
                }
                Ok(None) => None,
                Err(_) => Some(false),
            };
            if let Some(ok) = answer {
                self.probing = None;
                self.answer(ok);
            }
            return;
        }
        if !self.running()
            || self
                .probed_at
                .is_some_and(|t| t.elapsed() < Duration::from_secs(r.period_s.max(1)))
        {
            return;
        }
        self.probed_at = Some(Instant::now());
        if let Some(cmd) = &r.command {
            match self
                .probe_as
                .as_ref()
                .map(|p| spawn_probe(p, cmd, self.group.as_ref()))
            {
                Some(Ok(child)) => self.probing = Some((child, Instant::now())),
                Some(Err(e)) => {
                    tracing::warn!(job = self.key.0, error = %e, "readiness command cannot start");
                    self.answer(false);
                }
                // Adopted after a restart: no identity until the server
                // names the task again (see `identify`).
                None => {}
            }
            return;
        }
        let (Some(path), Some(port)) = (&r.http_path, self.port) else {
            return;
        };
        let url = format!("http://127.0.0.1:{port}{path}");
        let ok = http
            .get(&url)
            .call()
            .is_ok_and(|resp| (200..400).contains(&resp.status().as_u16()));
        self.answer(ok);
    }

    /// Stops a readiness command under way (its task is gone).
    pub fn end_probe(&mut self) {
        if let Some((mut child, _)) = self.probing.take() {
            kill_probe(&mut child);
        }
    }

    fn answer(&mut self, ok: bool) {
        if self.ready != Some(ok) {
            tracing::info!(job = self.key.0, ready = ok, "readiness changed");
        }
        self.ready = Some(ok);
    }

    /// Gives an adopted task (after an agent restart) the identity its
    /// readiness command runs as, from the server's word for it.
    pub fn identify(&mut self, t: &DesiredTask, dir: &Path, launch: &Launch) {
        if self.probe_as.is_some() || t.readiness.as_ref().is_none_or(|r| r.command.is_none()) {
            return;
        }
        self.probe_as = self.identity(t, dir, launch).ok();
    }

    /// Who and where a command beside this task runs: its user,
    /// environment, directory and isolation, from the server's word for it.
    ///
    /// # Errors
    /// When its user cannot be resolved or its isolation prepared.
    pub fn identity(
        &self,
        t: &DesiredTask,
        dir: &Path,
        launch: &Launch,
    ) -> Result<ProbeAs, String> {
        let user = crate::user::resolve_task(crate::user::TaskUser {
            run_as: t.run_as.as_deref(),
            team_uid: t.team_uid,
            uid_base: launch.task_uid_base,
            default: &launch.run_as,
        })
        .map_err(|e| e.to_string())?;
        let task_dir = task_dir(launch.tasks(dir), self.key);
        let ids = user.as_ref().map(|u| (u.uid, u.gid));
        let isolation = crate::isolate::prepare(&launch.isolation, &task_dir, ids)?;
        Ok(ProbeAs {
            ids,
            isolation,
            env: environment(t, &task_dir, user.as_ref(), self.port, &self.ports),
            task_dir,
            work: t
                .working_dir
                .as_ref()
                .and_then(|w| std::ffi::CString::new(w.as_str()).ok()),
        })
    }

    /// Its process group (0: none yet).
    pub fn pgid(&self) -> i32 {
        self.pgid
    }

    /// Its cgroup, where the agent made one.
    pub fn cgroup(&self) -> Option<&crate::cgroup::TaskGroup> {
        self.group.as_ref()
    }

    /// Its stdout's and stderr's logs.
    pub fn logs(&self) -> [PathBuf; 2] {
        [self.log.clone(), err_log(&self.log)]
    }

    /// The task's report, with the output the server has not acknowledged
    /// yet (as much as `budget` bytes allow; what it ships is taken from
    /// `budget`).
    pub fn report(&self, budget: &mut u64) -> TaskReport {
        let (job, attempt, group, index) = self.key;
        let most = if self.phase == TaskPhase::Running {
            CHUNK_RUNNING
        } else {
            CHUNK_ENDED
        };
        let mut next = |path: &Path, acked: u64| {
            let c = chunk(path, acked, most.min(*budget))?;
            *budget = budget.saturating_sub(c.len);
            Some(c)
        };
        let image: Option<gpuflow_api::ImageReport> = self
            .image_status
            .as_ref()
            .and_then(|p| std::fs::read(p).ok())
            .and_then(|b| serde_json::from_slice(&b).ok());
        // An image that could not be pulled or run says why it ended.
        let message = match &image {
            Some(i) if !i.error.is_empty() && self.message.is_empty() && !self.running() => {
                format!("its image: {}", i.error)
            }
            _ => self.message.clone(),
        };
        TaskReport {
            job,
            attempt,
            group,
            index,
            phase: self.phase,
            port: self.port,
            ports: self.ports.iter().cloned().collect(),
            ready: self.ready,
            stdout: next(&self.log, self.acked[0]),
            stderr: next(&err_log(&self.log), self.acked[1]),
            exit_code: self.exit_code,
            started_at: Some(self.started_at).filter(|&t| t > 0),
            checkpoint_at: checkpoint_time(&self.checkpoint),
            message,
            breach: self.breach,
            usage: (self.usage.samples > 0).then(|| self.usage.clone()),
            image,
        }
    }
}

/// A task's environment, and its readiness command's: a plain `PATH`,
/// `HOME` (its own directory), `USER`, `LANG`, then the spec's variables
/// and its ports, each with the path the server proxies to it; never the
/// agent's (which may hold its tokens).
fn environment(
    t: &DesiredTask,
    task_dir: &Path,
    user: Option<&crate::user::RunAs>,
    port: Option<u16>,
    ports: &[(String, u16)],
) -> Vec<(String, String)> {
    let name = user.map_or_else(agent_user_name, |u| u.name.clone());
    let mut env: Vec<(String, String)> = vec![
        (
            "PATH".into(),
            "/usr/local/sbin:/usr/local/bin:/usr/sbin:/usr/bin:/sbin:/bin".into(),
        ),
        ("HOME".into(), task_dir.display().to_string()),
        ("USER".into(), name.clone()),
        ("LOGNAME".into(), name),
        ("LANG".into(), "C.UTF-8".into()),
    ];
    env.extend(t.env.iter().map(|(k, v)| (k.clone(), v.clone())));
    if let Some(p) = port {
        env.push(("PORT".into(), p.to_string()));
        env.push(("GPUFLOW_PORT".into(), p.to_string()));
    }
    let base = |p: u16| format!("/v1/jobs/{}/proxy/{p}/", t.job);
    if let Some(&(_, p)) = ports.first() {
        env.push(("GPUFLOW_BASE_URL".into(), base(p)));
    }
    for (name, p) in ports {
        let name = name.to_ascii_uppercase().replace('-', "_");
        env.push((format!("GPUFLOW_PORT_{name}"), p.to_string()));
        env.push((format!("GPUFLOW_BASE_URL_{name}"), base(*p)));
    }
    env
}

/// In a forked child before exec: joins the task's cgroup (writes `0` to
/// each hierarchy's `cgroup.procs`). Async-signal-safe.
fn join(procs_fds: &[i32]) -> std::io::Result<()> {
    for &fd in procs_fds {
        // SAFETY: a write of two bytes from a static buffer.
        if unsafe { libc::write(fd, b"0".as_ptr().cast(), 1) } != 1 {
            return Err(std::io::Error::last_os_error());
        }
    }
    Ok(())
}

/// What `oci-run` needs to run task `t` in `image` (see `oci.rs`).
#[allow(clippy::too_many_arguments)]
fn image_spec(
    t: &DesiredTask,
    image: &str,
    task_dir: &Path,
    env: &[(String, String)],
    checkpoint: &Path,
    user: Option<&crate::user::RunAs>,
    group: Option<&crate::cgroup::TaskGroup>,
    dir: &Path,
    launch: &Launch,
) -> Result<crate::oci::Spec, String> {
    if let Some(why) = &launch.no_images {
        return Err(format!("this node cannot run images: {why}"));
    }
    let Some(u) = user else {
        return Err("this node cannot run images: the agent is not root".into());
    };
    let (job, attempt, g, index) = key(t);
    let mut env = env.to_vec();
    env.push((
        "GPUFLOW_CHECKPOINT_FILE".into(),
        checkpoint.display().to_string(),
    ));
    env.extend(
        mps_env(&t.limits)
            .into_iter()
            .map(|(k, v)| (k.to_string(), v)),
    );
    // Its GPUs through the node's CDI specs, where they name them all;
    // else their device nodes, and the driver's shared ones, where they are.
    let names: Vec<(String, String)> = t
        .gpus
        .iter()
        .filter_map(|&i| Some((launch.gpu_uuids.get(i as usize)?.clone(), i.to_string())))
        .chain(t.mig.iter().map(|u| (u.clone(), u.clone())))
        .collect();
    let cdi = crate::cdi::edits_for(&launch.cdi_dirs, &names);
    let mut devices = Vec::new();
    let mut add = |path: String| {
        use std::os::unix::fs::{FileTypeExt, MetadataExt};
        if let Ok(m) = std::fs::metadata(&path)
            && m.file_type().is_char_device()
        {
            let rdev = m.rdev();
            devices.push((path, libc::major(rdev), libc::minor(rdev)));
        }
    };
    for &i in t.gpus.iter().filter(|_| cdi.is_none()) {
        if let Some(minor) = launch.gpu_minors.get(i as usize) {
            add(format!("/dev/nvidia{minor}"));
        }
    }
    if !t.gpus.is_empty() && cdi.is_none() {
        for d in ["/dev/nvidiactl", "/dev/nvidia-uvm", "/dev/nvidia-uvm-tools"] {
            add(d.into());
        }
    }
    let state = dir.join("state");
    Ok(crate::oci::Spec {
        image: image.to_string(),
        args: t.command.clone(),
        env,
        cwd: t
            .working_dir
            .clone()
            .unwrap_or_else(|| task_dir.display().to_string()),
        uid: u.uid,
        gid: u.gid,
        task_dir: task_dir.to_path_buf(),
        // runc, started in the task's group, puts the container in a
        // group of its own inside it (a relative path is taken from runc's
        // own group in each hierarchy; the agent's groups sit at different
        // depths in different ones): the task's limits hold for both.
        cgroup: group.map(|_| "container".to_string()),
        devices,
        cache: dir.join("images"),
        cache_mib: launch.image_cache_mib,
        runc_root: state.join("runc"),
        id: format!(
            "gpuflow-{job}-{attempt}-{g}-{index}-{:x}",
            std::process::id()
        ),
        status: state.join(format!("job-{job}-a{attempt}-g{g}-i{index}.image.json")),
        driver: if t.gpus.is_empty() || cdi.is_some() {
            Vec::new()
        } else {
            launch.driver_files.clone()
        },
        // MPS clients reach its daemon through its pipe directory.
        mps_pipe: (!mps_env(&t.limits).is_empty() && Path::new(MPS_PIPE).is_dir())
            .then(|| MPS_PIPE.to_string()),
        cdi,
    })
}

/// In a forked child before exec: joins the task's cgroup and enters its
/// own mount namespace (as root, before dropping privileges), becomes its
/// user, enters the spec's working directory as that user (so it grants
/// nothing the user lacks), and last takes on its seccomp filter. Calls
/// only async-signal-safe functions (write, unshare, mount, setgroups,
/// setgid, setuid, chdir, prctl, seccomp).
fn become_task(
    procs_fds: &[i32],
    ids: Option<(u32, u32)>,
    work: Option<&std::ffi::CStr>,
    isolation: &crate::isolate::Prepared,
) -> std::io::Result<()> {
    // SAFETY: plain system calls on descriptors and a C string the caller
    // holds.
    unsafe {
        for &fd in procs_fds {
            if libc::write(fd, b"0".as_ptr().cast(), 1) != 1 {
                return Err(std::io::Error::last_os_error());
            }
        }
        crate::isolate::enter(isolation)?;
        if let Some((uid, gid)) = ids {
            let groups = [gid];
            if libc::setgroups(1, groups.as_ptr()) != 0
                || libc::setgid(gid) != 0
                || libc::setuid(uid) != 0
            {
                return Err(std::io::Error::last_os_error());
            }
        }
        if let Some(w) = work
            && libc::chdir(w.as_ptr()) != 0
        {
            return Err(std::io::Error::last_os_error());
        }
    }
    crate::isolate::confine(isolation)
}

/// Kills a readiness command that has not been reaped (its process group)
/// and reaps it.
fn kill_probe(child: &mut Child) {
    // SAFETY: signals the probe's own process group, whose leader is
    // unreaped, so the id is still its own.
    unsafe { libc::kill(-(child.id() as i32), libc::SIGKILL) };
    let _ = child.wait();
}

/// Starts a readiness command as its task runs: its user, environment,
/// directory and cgroup, in a process group of its own, with no input or
/// output.
fn spawn_probe(
    p: &ProbeAs,
    cmd: &[String],
    group: Option<&crate::cgroup::TaskGroup>,
) -> Result<Child, String> {
    spawn_as(p, cmd, group, Io::Null)
}

/// Starts a session's command as its task runs (see [`Task::identity`]):
/// in its cgroup, on the terminal whose other side is `tty` (a session of
/// its own, the terminal its controlling one) or else on pipes in a
/// process group of its own.
///
/// # Errors
/// When it cannot be started.
pub fn spawn_session(
    p: &ProbeAs,
    cmd: &[String],
    group: Option<&crate::cgroup::TaskGroup>,
    tty: Option<std::os::fd::OwnedFd>,
) -> Result<Child, String> {
    spawn_as(p, cmd, group, tty.map_or(Io::Pipes, Io::Tty))
}

/// A command's input and output beside its task.
pub(crate) enum Io {
    Null,
    Pipes,
    Tty(std::os::fd::OwnedFd),
}

impl Io {
    /// Gives `c` this input and output: the terminal on all three (then
    /// `c` must call [`take_terminal`] before exec), or pipes or nothing in
    /// a process group of its own. Whether it is a terminal.
    pub(crate) fn apply(self, c: &mut Command) -> Result<bool, String> {
        match self {
            Io::Tty(fd) => {
                let dup = |fd: &std::os::fd::OwnedFd| fd.try_clone().map_err(|e| e.to_string());
                c.stdin(Stdio::from(dup(&fd)?))
                    .stdout(Stdio::from(dup(&fd)?))
                    .stderr(Stdio::from(fd));
                return Ok(true);
            }
            Io::Pipes => c
                .stdin(Stdio::piped())
                .stdout(Stdio::piped())
                .stderr(Stdio::piped()),
            Io::Null => c
                .stdin(Stdio::null())
                .stdout(Stdio::null())
                .stderr(Stdio::null()),
        }
        .process_group(0);
        Ok(false)
    }
}

/// In a forked child before exec: a session of its own whose controlling
/// terminal is its stdin. Async-signal-safe (setsid, ioctl).
pub(crate) fn take_terminal() -> std::io::Result<()> {
    // SAFETY: plain system calls on the process itself and its stdin.
    if unsafe { libc::setsid() < 0 || libc::ioctl(0, libc::TIOCSCTTY as _, 0) != 0 } {
        return Err(std::io::Error::last_os_error());
    }
    Ok(())
}

/// Starts `cmd` as task `p` runs (see `become_task`) with `io`.
fn spawn_as(
    p: &ProbeAs,
    cmd: &[String],
    group: Option<&crate::cgroup::TaskGroup>,
    io: Io,
) -> Result<Child, String> {
    let procs = match group {
        Some(g) => g.procs_files()?,
        None => Vec::new(),
    };
    let procs_fds: Vec<i32> = {
        use std::os::fd::AsRawFd;
        procs.iter().map(AsRawFd::as_raw_fd).collect()
    };
    let ids = p.ids;
    let work = p.work.clone();
    let isolation = p.isolation.clone();
    let mut c = Command::new(&cmd[0]);
    c.args(&cmd[1..])
        .env_clear()
        .envs(p.env.iter().map(|(k, v)| (k, v)))
        .current_dir(&p.task_dir);
    let on_tty = io.apply(&mut c)?;
    // SAFETY: the closure runs in the forked child before exec and calls
    // only async-signal-safe functions (`take_terminal` and those of
    // `become_task`) on memory prepared before the fork.
    unsafe {
        c.pre_exec(move || {
            if on_tty {
                take_terminal()?;
            }
            become_task(&procs_fds, ids, work.as_deref(), &isolation)
        });
    }
    let child = c
        .spawn()
        .map_err(|e| format!("cannot start {:?}: {e}", cmd[0]));
    drop(procs);
    child
}

/// Where a task's stderr goes: beside its stdout's log.
fn err_log(log: &Path) -> PathBuf {
    log.with_file_name("errors.log")
}

/// The next piece of a task's output after the `acked` bytes the server
/// has: at most `most` bytes, ending on a whole character unless a longer
/// one is cut by the file's end; from `BEHIND_MAX` before the end when the
/// server is further behind. `None` when there is nothing new.
fn chunk(path: &Path, acked: u64, most: u64) -> Option<gpuflow_api::LogChunk> {
    let mut f = std::fs::OpenOptions::new()
        .read(true)
        .custom_flags(libc::O_NOFOLLOW | libc::O_NONBLOCK)
        .open(path)
        .ok()?;
    let len = f.metadata().ok().filter(std::fs::Metadata::is_file)?.len();
    // A file shorter than acknowledged was replaced: start it again.
    let from = if len < acked { 0 } else { acked }.max(len.saturating_sub(BEHIND_MAX));
    if from >= len || most == 0 {
        return None;
    }
    f.seek(SeekFrom::Start(from)).ok()?;
    let mut buf = Vec::new();
    f.take(most.min(len - from)).read_to_end(&mut buf).ok()?;
    let mut n = buf.len();
    if from + (n as u64) < len {
        // Not the end: leave a character cut in two for the next piece.
        if let Err(e) = std::str::from_utf8(&buf)
            && e.error_len().is_none()
            && e.valid_up_to() > 0
        {
            n = e.valid_up_to();
        }
    }
    buf.truncate(n);
    Some(gpuflow_api::LogChunk {
        offset: from,
        len: n as u64,
        text: String::from_utf8_lossy(&buf).into_owned(),
    })
}

#[cfg(test)]
mod tests {
    use super::*;

    fn write(path: &Path, bytes: &[u8]) {
        std::fs::write(path, bytes).unwrap();
    }

    /// A signal name the old table did not list became SIGTERM without a
    /// word; every signal is known by its name now, and a name that is no
    /// signal is `None` (a task asking for it is refused).
    #[test]
    fn signals_are_known_by_name_and_an_unknown_one_is_not_sigterm() {
        assert_eq!(signal_number("SIGUSR1"), Some(libc::SIGUSR1));
        assert_eq!(signal_number("SIGTERM"), Some(libc::SIGTERM));
        assert_eq!(signal_number("SIGWINCH"), Some(libc::SIGWINCH));
        assert_eq!(signal_number("SIGBOGUS"), None);
        assert_eq!(signal_number(""), None);
    }

    #[test]
    fn chunks_follow_the_acknowledged_offset_and_cut_between_characters() {
        let dir = tempfile::tempdir().unwrap();
        let log = dir.path().join("output.log");
        assert_eq!(chunk(&log, 0, 100), None, "no file yet");
        write(&log, "héllo\n".as_bytes());
        // 2 bytes would cut "é" in two: the piece stops before it.
        let c = chunk(&log, 0, 2).unwrap();
        assert_eq!((c.offset, c.len, c.text.as_str()), (0, 1, "h"));
        let c = chunk(&log, 1, 100).unwrap();
        assert_eq!((c.offset, c.len, c.text.as_str()), (1, 6, "éllo\n"));
        assert_eq!(chunk(&log, 7, 100), None, "nothing new");
        assert_eq!(chunk(&log, 0, 0), None, "no budget left");
        // Replaced by a shorter file: from its start again.
        write(&log, b"new\n");
        assert_eq!(chunk(&log, 7, 100).unwrap().offset, 0);
    }

    #[test]
    fn output_far_behind_is_skipped_not_shipped() {
        let dir = tempfile::tempdir().unwrap();
        let log = dir.path().join("output.log");
        write(&log, &vec![b'x'; (BEHIND_MAX + 5000) as usize]);
        let c = chunk(&log, 0, CHUNK_ENDED).unwrap();
        assert_eq!((c.offset, c.len), (5000, BEHIND_MAX.min(CHUNK_ENDED)));
    }

    #[test]
    fn a_log_replaced_by_a_link_is_not_read() {
        let dir = tempfile::tempdir().unwrap();
        let secret = dir.path().join("secret");
        write(&secret, b"the agent's secret\n");
        let log = dir.path().join("output.log");
        std::os::unix::fs::symlink(&secret, &log).unwrap();
        assert_eq!(chunk(&log, 0, 100), None);
    }
}
