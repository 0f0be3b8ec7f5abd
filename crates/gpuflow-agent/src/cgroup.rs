//! Resource limits through cgroups, v2 or v1, whichever the node has,
//! found at run time from the agent's own mounts and cgroups (`/proc`).
//!
//! The agent makes its own subtree, `gpuflow/NODE.HASH` (the hash of its
//! work directory, so two agents on one machine never share groups), below its own cgroup
//! in each hierarchy it uses (v2: one; v1: memory, cpu and pids), and one
//! group per task in it, named like the task's directory
//! (`job-J-aA-gG-iI`), with the task's limits written before it starts:
//! CPU as a CFS quota from the spec's `cpu`, memory as a hard limit from
//! `memory_mib` (swap included where the kernel accounts it), and a pids
//! maximum. The task joins its group in its launcher, before exec, so
//! nothing it runs escapes the limits; its keeper stays outside, so an OOM
//! kill never takes the keeper and the true exit status is still recorded.
//!
//! A group outlives an agent that crashes: a restarted agent adopts the
//! groups of tasks still running and removes the empty ones. A group is
//! removed when its task ends, after everything left in it is killed (v2's
//! `cgroup.kill`, or each process in turn on v1), which also reaches
//! processes that left the task's process group.
//!
//! Beside the limits, on v1 the task's group is also made in the `freezer`
//! hierarchy (so that killing it is race-free: frozen, every process
//! killed, thawed) and in the `devices` hierarchy, where every NVIDIA GPU
//! device (`c 195:N`, N < 254) the task was not given is denied: it cannot
//! open another GPU of the node whatever `CUDA_VISIBLE_DEVICES` says.
//! On v2 the group is killed with `cgroup.kill`, and the same GPUs are
//! denied by an eBPF device program attached to the group (`devbpf.rs`);
//! a node that cannot load one says so ([`Cgroups::device_control`]).
//!
//! The agent's subtree itself gets a pids limit (three quarters of the
//! kernel's `pid_max`), so the tasks together never take every pid of the
//! node; one task's own limit is capped at a quarter of it.
//!
//! Where no controller can be used (not root, no cgroup mounted, a v2 tree
//! that is not delegated) [`Cgroups::open`] says why; the agent logs it,
//! reports it with its inventory (`node ls` shows it) and the server says
//! so in an event of each job placed there.

use std::fs::File;
use std::io::Write;
use std::path::{Path, PathBuf};

/// The controllers gpuflow sets limits with.
pub const CONTROLLERS: [&str; 3] = ["cpu", "memory", "pids"];

/// The v1 hierarchies a task's group is also made in: to freeze it while
/// it is killed, and to deny it the GPUs it was not given.
pub const V1_CONTROLS: [&str; 2] = ["freezer", "devices"];

/// The character-device major of NVIDIA's GPU device nodes
/// (`/dev/nvidiaN`); minors 254 and 255 are `nvidia-modeset` and
/// `nvidiactl`, which every CUDA process opens.
pub const NVIDIA_MAJOR: u32 = 195;

/// The minors of GPU device nodes (`/dev/nvidia0` to `/dev/nvidia253`).
const GPU_MINORS: std::ops::Range<u32> = 0..254;

/// The kernel's `pid_max`.
fn pid_max() -> u64 {
    read(Path::new("/proc/sys/kernel/pid_max"))
        .trim()
        .parse()
        .unwrap_or(32_768)
}

/// A CFS period of 100 ms; the quota is the CPU share of it.
const PERIOD_US: u64 = 100_000;

#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Version {
    V1,
    V2,
}

impl Version {
    pub fn as_str(self) -> &'static str {
        match self {
            Version::V1 => "v1",
            Version::V2 => "v2",
        }
    }
}

/// The agent's cgroup subtree.
#[derive(Clone, Debug)]
pub struct Cgroups {
    pub version: Version,
    /// `(controller, the agent's subtree in its hierarchy)`; on v2 every
    /// controller names the same directory.
    dirs: Vec<(&'static str, PathBuf)>,
    /// The most processes (threads included) one task may have.
    pub pids_max: u64,
    /// v2: why the eBPF device program cannot be used here (`None`: it can).
    bpf_devices: Option<String>,
}

/// What a task may use.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct Limits {
    /// Thousandths of a CPU; 0: no CPU limit.
    pub cpu_milli: u64,
    /// 0: no memory limit.
    pub memory_mib: u64,
}

/// Where the cgroup file systems are: `(hierarchy type, mount point,
/// controllers of a v1 mount)`, from `/proc/self/mountinfo`.
fn mounts() -> Result<Vec<(Version, PathBuf, Vec<String>)>, String> {
    let me = procfs::process::Process::myself().map_err(|e| e.to_string())?;
    let infos = me.mountinfo().map_err(|e| e.to_string())?;
    Ok(infos
        .into_iter()
        .filter_map(|m| match m.fs_type.as_str() {
            "cgroup2" => Some((Version::V2, m.mount_point, vec![])),
            "cgroup" => Some((
                Version::V1,
                m.mount_point,
                m.super_options.keys().cloned().collect(),
            )),
            _ => None,
        })
        .collect())
}

/// The agent's own cgroups, from `/proc/self/cgroup`: `(v1 controllers or
/// empty for v2, path)`.
fn own_cgroups() -> Result<Vec<(Vec<String>, String)>, String> {
    let me = procfs::process::Process::myself().map_err(|e| e.to_string())?;
    let groups: procfs::ProcessCGroups = me.read("cgroup").map_err(|e| e.to_string())?;
    Ok(groups
        .0
        .into_iter()
        .map(|g| (g.controllers, g.pathname))
        .collect())
}

fn join(mount: &Path, own: &str) -> PathBuf {
    mount.join(own.trim_start_matches('/'))
}

fn write(path: &Path, value: &str) -> std::io::Result<()> {
    std::fs::OpenOptions::new()
        .write(true)
        .open(path)
        .and_then(|mut f| f.write_all(value.as_bytes()))
        .map_err(|e| std::io::Error::new(e.kind(), format!("{}: {e}", path.display())))
}

fn read(path: &Path) -> String {
    std::fs::read_to_string(path).unwrap_or_default()
}

/// The agent's subtree: its node name and a hash of its work directory
/// (FNV-1a, stable across versions, so a restarted agent finds its groups).
fn subtree_name(node: &str, work_dir: &Path) -> String {
    let dir = work_dir
        .canonicalize()
        .unwrap_or_else(|_| work_dir.to_path_buf());
    let mut h: u32 = 0x811c_9dc5;
    for b in dir.as_os_str().as_encoded_bytes() {
        h = (h ^ u32::from(*b)).wrapping_mul(0x0100_0193);
    }
    format!("{node}.{h:08x}")
}

/// The distinct directories of per-controller ones: one per hierarchy
/// (v2: one for all).
fn hierarchies<'a>(dirs: &'a [(&'static str, PathBuf)]) -> Vec<&'a Path> {
    let mut out: Vec<&Path> = Vec::new();
    for (_, d) in dirs {
        if !out.contains(&d.as_path()) {
            out.push(d);
        }
    }
    out
}

/// A task group's name: like its directory, `job-J-aA-gG-iI`.
pub fn group_name(k: crate::task::Key) -> String {
    let (job, attempt, group, index) = k;
    format!("job-{job}-a{attempt}-g{group}-i{index}")
}

impl Cgroups {
    /// Finds the node's cgroups and makes the agent's subtree for `node`
    /// in them: v2 where a v2 hierarchy has the controllers, else v1.
    /// `root` replaces the cgroup v2 mount (tests give one they mounted).
    ///
    /// # Errors
    /// Why no limits can be set here, in words for the log and `node ls`.
    pub fn open(
        node: &str,
        work_dir: &Path,
        root: Option<&Path>,
        pids_max: u64,
    ) -> Result<Cgroups, String> {
        let node = &subtree_name(node, work_dir);
        // One task never takes more than a quarter of the node's pids.
        let pids_max = pids_max.clamp(1, pid_max() / 4);
        if crate::user::agent_uid() != 0 {
            return Err("the agent is not root, so it cannot make cgroups".into());
        }
        let mounts = mounts()?;
        let own = own_cgroups()?;
        let own_v2 = own
            .iter()
            .find(|(c, _)| c.is_empty())
            .map_or("/", |(_, p)| p.as_str());
        let v2 = match root {
            Some(r) => Some((r.to_path_buf(), "/")),
            None => mounts
                .iter()
                .find(|(v, _, _)| *v == Version::V2)
                .map(|(_, m, _)| (m.clone(), own_v2)),
        };
        let mut why_not = Vec::new();
        if let Some((mount, own_path)) = v2 {
            let available = read(&mount.join("cgroup.controllers"));
            if CONTROLLERS
                .iter()
                .any(|c| available.split_whitespace().any(|a| a == *c))
            {
                match Cgroups::open_v2(&mount, own_path, node, pids_max) {
                    Ok(c) => return Ok(c),
                    Err(e) => why_not.push(format!("cgroup v2: {e}")),
                }
            } else if root.is_some() {
                return Err(format!(
                    "{} offers none of the controllers cpu, memory, pids",
                    mount.display()
                ));
            }
        }
        // The agent's subtree in controller `c`'s v1 hierarchy: `None` when
        // none is mounted, else made or why not.
        let v1_dir = |c: &str| -> Option<Result<PathBuf, String>> {
            let (_, mount, _) = mounts
                .iter()
                .find(|(v, _, opts)| *v == Version::V1 && opts.iter().any(|o| o == c))?;
            let own_path = own
                .iter()
                .find(|(ctls, _)| ctls.iter().any(|x| x == c))
                .map_or("/", |(_, p)| p.as_str());
            let dir = join(mount, own_path).join("gpuflow").join(node);
            Some(
                std::fs::create_dir_all(&dir)
                    .map(|()| dir.clone())
                    .map_err(|e| format!("cgroup v1 {c}: {}: {e}", dir.display())),
            )
        };
        let mut dirs = Vec::new();
        for c in CONTROLLERS {
            match v1_dir(c) {
                None => {}
                Some(Ok(dir)) => dirs.push((c, dir)),
                Some(Err(e)) => why_not.push(e),
            }
        }
        if dirs.is_empty() {
            if why_not.is_empty() {
                why_not.push("no cgroup controller is mounted".into());
            }
            return Err(why_not.join("; "));
        }
        for c in V1_CONTROLS {
            match v1_dir(c) {
                Some(Ok(dir)) => dirs.push((c, dir)),
                None => tracing::warn!(
                    controller = c,
                    "no cgroup v1 {c} hierarchy: tasks go without it"
                ),
                Some(Err(e)) => tracing::warn!(error = %e, "tasks go without it"),
            }
        }
        let c = Cgroups {
            version: Version::V1,
            dirs,
            pids_max,
            bpf_devices: None,
        };
        c.limit_subtree();
        c.clean();
        Ok(c)
    }

    /// On v2 a cgroup with processes cannot hand controllers to its
    /// children: below the root, the agent first moves itself into a leaf
    /// of its own cgroup (as a delegated service does).
    fn open_v2(mount: &Path, own: &str, node: &str, pids_max: u64) -> Result<Cgroups, String> {
        let base = join(mount, own);
        let enable = |dir: &Path| -> Result<(), String> {
            let have = read(&dir.join("cgroup.controllers"));
            for c in CONTROLLERS {
                if have.split_whitespace().any(|a| a == c) {
                    write(&dir.join("cgroup.subtree_control"), &format!("+{c}"))
                        .map_err(|e| e.to_string())?;
                }
            }
            Ok(())
        };
        if own != "/" && enable(&base).is_err() {
            let leaf = base.join("gpuflow-agent");
            std::fs::create_dir_all(&leaf).map_err(|e| format!("{}: {e}", leaf.display()))?;
            write(&leaf.join("cgroup.procs"), "0").map_err(|e| e.to_string())?;
            enable(&base).map_err(|e| {
                format!("{e} (the agent's cgroup {own} holds other processes: run it in a delegated cgroup of its own)")
            })?;
        } else if own == "/" {
            enable(&base)?;
        }
        let top = base.join("gpuflow");
        let dir = top.join(node);
        for d in [&top, &dir] {
            std::fs::create_dir_all(d).map_err(|e| format!("{}: {e}", d.display()))?;
            enable(d)?;
        }
        let have = read(&dir.join("cgroup.subtree_control"));
        let dirs: Vec<(&'static str, PathBuf)> = CONTROLLERS
            .iter()
            .filter(|c| have.split_whitespace().any(|a| a == **c))
            .map(|c| (*c, dir.clone()))
            .collect();
        if dirs.is_empty() {
            return Err(format!("{} enables no controller", dir.display()));
        }
        let c = Cgroups {
            version: Version::V2,
            dirs,
            pids_max,
            bpf_devices: crate::devbpf::probe().err(),
        };
        c.limit_subtree();
        c.clean();
        Ok(c)
    }

    /// The node-wide pids limit on the agent's subtree: all tasks together
    /// leave a quarter of `pid_max` to the system, the agent and keepers.
    fn limit_subtree(&self) {
        if let Some((_, d)) = self.dirs.iter().find(|(c, _)| *c == "pids")
            && let Err(e) = write(&d.join("pids.max"), &(pid_max() * 3 / 4).to_string())
        {
            tracing::warn!(error = %e, "cannot set the node-wide pids limit of the tasks");
        }
    }

    /// Whether tasks are denied the GPUs they were not given: `Err` says
    /// why not, for the log and `node ls`.
    ///
    /// # Errors
    /// Without a v1 `devices` hierarchy, or on v2 where the eBPF device
    /// program cannot be loaded.
    pub fn device_control(&self) -> Result<(), String> {
        match self.version {
            Version::V1 if self.dirs.iter().any(|(c, _)| *c == "devices") => Ok(()),
            Version::V1 => {
                Err("no cgroup v1 devices hierarchy: a task can open every GPU of the node".into())
            }
            Version::V2 => match &self.bpf_devices {
                None => Ok(()),
                Some(why) => Err(format!("{why}: a task can open every GPU of the node")),
            },
        }
    }

    /// Removes the agent's own subtree for its node when no task is left
    /// in it (at exit, unless tasks are kept for the next agent).
    pub fn close(&self) {
        self.clean();
        for base in self.bases() {
            let _ = std::fs::remove_dir(base);
        }
    }

    /// The controllers limits are set with.
    pub fn controllers(&self) -> Vec<String> {
        self.dirs.iter().map(|(c, _)| (*c).to_string()).collect()
    }

    /// One directory per hierarchy (v2: one).
    fn bases(&self) -> Vec<&Path> {
        hierarchies(&self.dirs)
    }

    /// Removes the groups no process is in (left by a crashed agent);
    /// groups of tasks still running stay for the agent to adopt.
    fn clean(&self) {
        for base in self.bases() {
            let Ok(entries) = std::fs::read_dir(base) else {
                continue;
            };
            for e in entries.flatten() {
                let p = e.path();
                if p.is_dir()
                    && e.file_name().to_string_lossy().starts_with("job-")
                    && read(&p.join("cgroup.procs")).trim().is_empty()
                {
                    let _ = std::fs::remove_dir(&p);
                }
            }
        }
    }

    /// The group of task `k` (made or not).
    pub fn group(&self, k: crate::task::Key) -> TaskGroup {
        let name = group_name(k);
        TaskGroup {
            version: self.version,
            dirs: self.dirs.iter().map(|(c, d)| (*c, d.join(&name))).collect(),
        }
    }

    /// Makes task `k`'s group with its limits; it may open only the GPU
    /// device nodes of `gpu_minors` (the minors of its GPUs' `/dev/nvidiaN`)
    /// and, where the driver has MIG capability devices, only `caps`'s
    /// allowed ones (see `migcaps.rs`).
    ///
    /// # Errors
    /// When a directory cannot be made or a limit not written; the message
    /// names the file.
    pub fn create(
        &self,
        k: crate::task::Key,
        limits: Limits,
        gpu_minors: &[u32],
        caps: Option<&crate::migcaps::CapsRule>,
    ) -> Result<TaskGroup, String> {
        let g = self.group(k);
        for d in g.bases() {
            std::fs::create_dir_all(d).map_err(|e| format!("{}: {e}", d.display()))?;
        }
        let set = |c: &str, file: &str, value: String| -> Result<(), String> {
            match g.dir(c) {
                Some(d) => write(&d.join(file), &value).map_err(|e| e.to_string()),
                None => Ok(()),
            }
        };
        // A CPU quota below 1 ms a period is refused by the kernel.
        let quota = (limits.cpu_milli * PERIOD_US / 1000).max(1000);
        let bytes = limits.memory_mib * 1024 * 1024;
        match self.version {
            Version::V2 => {
                if limits.cpu_milli > 0 {
                    set("cpu", "cpu.max", format!("{quota} {PERIOD_US}"))?;
                }
                if limits.memory_mib > 0 {
                    set("memory", "memory.max", bytes.to_string())?;
                    // No swap beyond the limit, where the kernel has swap accounting.
                    let _ = set("memory", "memory.swap.max", "0".into());
                }
                set("pids", "pids.max", self.pids_max.to_string())?;
                if self.bpf_devices.is_none()
                    && let Some(d) = g.bases().first()
                {
                    crate::devbpf::deny_gpus(d, gpu_minors, caps)?;
                }
            }
            Version::V1 => {
                if limits.cpu_milli > 0 {
                    set("cpu", "cpu.cfs_period_us", PERIOD_US.to_string())?;
                    set("cpu", "cpu.cfs_quota_us", quota.to_string())?;
                }
                if limits.memory_mib > 0 {
                    set("memory", "memory.limit_in_bytes", bytes.to_string())?;
                    let _ = set("memory", "memory.memsw.limit_in_bytes", bytes.to_string());
                }
                set("pids", "pids.max", self.pids_max.to_string())?;
                if let Some(d) = g.dir("devices") {
                    deny_gpus(d, gpu_minors, caps)?;
                }
            }
        }
        Ok(g)
    }
}

/// Denies the group at `dir` every GPU device node but `allowed`'s, and
/// every MIG capability the driver lists but `caps`'s allowed ones, one
/// rule a write (the v1 devices controller takes one rule per write; a
/// broader deny cannot be narrowed by an allow).
fn deny_gpus(
    dir: &Path,
    allowed: &[u32],
    caps: Option<&crate::migcaps::CapsRule>,
) -> Result<(), String> {
    let path = dir.join("devices.deny");
    let mut f = std::fs::OpenOptions::new()
        .write(true)
        .open(&path)
        .map_err(|e| format!("{}: {e}", path.display()))?;
    let gpus = GPU_MINORS
        .filter(|m| !allowed.contains(m))
        .map(|m| (NVIDIA_MAJOR, m));
    let others = caps.into_iter().flat_map(|c| {
        c.listed
            .iter()
            .filter(|m| !c.allowed.contains(m))
            .map(|&m| (c.major, m))
    });
    for (major, minor) in gpus.chain(others) {
        f.write_all(format!("c {major}:{minor} rwm").as_bytes())
            .map_err(|e| format!("{}: {e}", path.display()))?;
    }
    Ok(())
}

/// Every GPU device minor, for a group that denies none.
pub fn all_gpu_minors() -> Vec<u32> {
    GPU_MINORS.collect()
}

/// The child groups of `d` (a container runtime makes one for its
/// container inside the task's).
fn children(d: &Path) -> Vec<PathBuf> {
    std::fs::read_dir(d).map_or_else(
        |_| Vec::new(),
        |rd| {
            rd.filter_map(Result::ok)
                .filter(|e| e.file_type().is_ok_and(|t| t.is_dir()))
                .map(|e| e.path())
                .collect()
        },
    )
}

/// One task's group, in each hierarchy.
#[derive(Clone, Debug)]
pub struct TaskGroup {
    version: Version,
    dirs: Vec<(&'static str, PathBuf)>,
}

impl TaskGroup {
    fn dir(&self, controller: &str) -> Option<&Path> {
        self.dirs
            .iter()
            .find(|(c, _)| *c == controller)
            .map(|(_, d)| d.as_path())
    }

    fn bases(&self) -> Vec<&Path> {
        hierarchies(&self.dirs)
    }

    /// Each hierarchy's `cgroup.procs`, open for writing: the task writes
    /// `0` to each before exec to join its group.
    ///
    /// # Errors
    /// When one cannot be opened.
    pub fn procs_files(&self) -> Result<Vec<File>, String> {
        self.bases()
            .into_iter()
            .map(|d| {
                let p = d.join("cgroup.procs");
                std::fs::OpenOptions::new()
                    .write(true)
                    .open(&p)
                    .map_err(|e| format!("{}: {e}", p.display()))
            })
            .collect()
    }

    /// Where the task's keeper reaches every process of the group: v2's
    /// `cgroup.kill` open for writing; v1's `cgroup.procs` and
    /// `freezer.state`.
    pub fn reach(&self) -> crate::keeper::Reach {
        let c = |p: PathBuf| std::ffi::CString::new(p.into_os_string().into_encoded_bytes()).ok();
        match self.version {
            Version::V2 => crate::keeper::Reach {
                cgroup_kill: self.bases().into_iter().next().and_then(|d| {
                    std::fs::OpenOptions::new()
                        .write(true)
                        .open(d.join("cgroup.kill"))
                        .ok()
                }),
                procs: None,
                freezer: None,
            },
            Version::V1 => crate::keeper::Reach {
                cgroup_kill: None,
                procs: self
                    .bases()
                    .into_iter()
                    .next()
                    .and_then(|d| c(d.join("cgroup.procs"))),
                freezer: self.dir("freezer").and_then(|d| c(d.join("freezer.state"))),
            },
        }
    }

    /// The processes in the group.
    pub fn pids(&self) -> Vec<i32> {
        let mut out: Vec<i32> = Vec::new();
        for d in self.bases() {
            // Its own and its child groups' (a container runtime's).
            for dir in std::iter::once(d.to_path_buf()).chain(children(d)) {
                for p in read(&dir.join("cgroup.procs"))
                    .split_whitespace()
                    .filter_map(|w| w.parse().ok())
                {
                    if !out.contains(&p) {
                        out.push(p);
                    }
                }
            }
        }
        out
    }

    /// Whether the group's memory use reached its limit (v1: its peak at
    /// its limit; v2 counts OOM kills up the tree, see
    /// [`TaskGroup::oom_kills`]).
    pub fn hit_memory_limit(&self) -> bool {
        let number = |d: &Path, f: &str| read(&d.join(f)).trim().parse::<u64>().ok();
        self.version == Version::V1
            && self.dir("memory").is_some_and(|d| {
                match (
                    number(d, "memory.max_usage_in_bytes"),
                    number(d, "memory.limit_in_bytes"),
                ) {
                    (Some(peak), Some(limit)) => limit < 1 << 62 && peak >= limit,
                    _ => false,
                }
            })
    }

    /// How many times the kernel's OOM killer killed a process of the group
    /// (v1 counts a kill only in the victim's own group: its child groups'
    /// are added).
    pub fn oom_kills(&self) -> u64 {
        let Some(d) = self.dir("memory") else {
            return 0;
        };
        let count = |d: &Path, file: &str| -> u64 {
            read(&d.join(file))
                .lines()
                .find_map(|l| l.strip_prefix("oom_kill "))
                .and_then(|v| v.trim().parse().ok())
                .unwrap_or(0)
        };
        match self.version {
            Version::V2 => count(d, "memory.events"),
            Version::V1 => std::iter::once(d.to_path_buf())
                .chain(children(d))
                .map(|c| count(&c, "memory.oom_control"))
                .sum(),
        }
    }

    /// CPU time the group used, in microseconds, where it is accounted.
    pub fn cpu_usage_us(&self) -> Option<u64> {
        let d = self.dir("cpu")?;
        match self.version {
            Version::V2 => read(&d.join("cpu.stat"))
                .lines()
                .find_map(|l| l.strip_prefix("usage_usec "))
                .and_then(|v| v.trim().parse().ok()),
            // cpuacct sits beside cpu (often mounted with it).
            Version::V1 => read(&d.join("cpuacct.usage"))
                .trim()
                .parse::<u64>()
                .ok()
                .map(|ns| ns / 1000),
        }
    }

    /// Kills every process in the group, also those that left the task's
    /// process group.
    pub fn kill(&self) {
        if self.version == Version::V2
            && let Some(d) = self.bases().first()
            && write(&d.join("cgroup.kill"), "1").is_ok()
        {
            return;
        }
        // Frozen while it is killed, where the freezer is: nothing in it
        // forks a process the kill would miss.
        let freezer = self.dir("freezer").map(|d| d.join("freezer.state"));
        for _ in 0..50 {
            if let Some(f) = &freezer {
                let _ = write(f, "FROZEN");
            }
            let pids = self.pids();
            for p in &pids {
                // SAFETY: kill(2) has no memory-safety preconditions.
                unsafe { libc::kill(*p, libc::SIGKILL) };
            }
            if let Some(f) = &freezer {
                let _ = write(f, "THAWED");
            }
            if pids.is_empty() {
                return;
            }
            std::thread::sleep(std::time::Duration::from_millis(10));
        }
    }

    /// Kills what is left and removes the group (its child groups first).
    pub fn remove(&self) {
        self.kill();
        for d in self.bases() {
            for c in children(d) {
                let _ = std::fs::remove_dir(c);
            }
            for _ in 0..50 {
                match std::fs::remove_dir(d) {
                    Ok(()) => break,
                    Err(e) if e.kind() == std::io::ErrorKind::NotFound => break,
                    // Busy until the killed processes are reaped.
                    Err(_) => std::thread::sleep(std::time::Duration::from_millis(20)),
                }
            }
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    /// A cgroup v2 hierarchy with the memory controller: the node's own,
    /// or one this test mounts (as root). `None`, with the reason, where
    /// neither is possible (e.g. every controller is bound to v1).
    fn v2_hierarchy(scratch: &Path) -> Result<(PathBuf, bool), String> {
        let has_memory = |p: &Path| {
            read(&p.join("cgroup.controllers"))
                .split_whitespace()
                .any(|c| c == "memory")
        };
        for (v, m, _) in mounts()? {
            if v == Version::V2 && has_memory(&m) {
                return Ok((m, false));
            }
        }
        if crate::user::agent_uid() != 0 {
            return Err("not root: cannot mount a cgroup v2 hierarchy".into());
        }
        let target = std::ffi::CString::new(scratch.as_os_str().as_encoded_bytes()).unwrap();
        // SAFETY: plain C strings; mount(2) has no memory-safety preconditions.
        let r = unsafe {
            libc::mount(
                c"none".as_ptr(),
                target.as_ptr(),
                c"cgroup2".as_ptr(),
                0,
                std::ptr::null(),
            )
        };
        if r != 0 {
            return Err(format!(
                "mount -t cgroup2: {}",
                std::io::Error::last_os_error()
            ));
        }
        if !has_memory(scratch) {
            // SAFETY: as above.
            unsafe { libc::umount(target.as_ptr()) };
            return Err(
                "a cgroup v2 hierarchy mounts, but its controllers are all bound to v1 hierarchies"
                    .into(),
            );
        }
        Ok((scratch.to_path_buf(), true))
    }

    #[test]
    fn v2_memory_limit_holds_where_a_v2_hierarchy_is_found_or_mounted() {
        let scratch = tempfile::tempdir().unwrap();
        let (root, mounted) = match v2_hierarchy(scratch.path()) {
            Ok(r) => r,
            Err(why) => {
                eprintln!("cgroup v2 path skipped: {why}");
                return;
            }
        };
        eprintln!("cgroup v2 path ran on {}", root.display());
        let c = Cgroups::open("v2-test", scratch.path(), Some(&root), 64).unwrap();
        assert_eq!(c.version, Version::V2);
        let g = c
            .create(
                (1, 1, 0, 0),
                Limits {
                    cpu_milli: 500,
                    memory_mib: 32,
                },
                &[],
                None,
            )
            .unwrap();
        let procs = g.procs_files().unwrap();
        let fds: Vec<i32> = procs.iter().map(std::os::fd::AsRawFd::as_raw_fd).collect();
        let mut cmd = std::process::Command::new("python3");
        cmd.args(["-c", "x = b'x' * (200 << 20)"]);
        // SAFETY: only write(2) between fork and exec.
        unsafe {
            std::os::unix::process::CommandExt::pre_exec(&mut cmd, move || {
                for &fd in &fds {
                    if libc::write(fd, b"0".as_ptr().cast(), 1) != 1 {
                        return Err(std::io::Error::last_os_error());
                    }
                }
                Ok(())
            });
        }
        let status = cmd.status().unwrap();
        assert!(!status.success());
        assert!(g.oom_kills() > 0, "the kernel killed it at 32 MiB");
        g.remove();
        c.close();
        if mounted {
            let target = std::ffi::CString::new(root.as_os_str().as_encoded_bytes()).unwrap();
            // SAFETY: plain C string.
            unsafe { libc::umount(target.as_ptr()) };
        }
    }

    /// A crashed agent leaves its task groups behind: the next agent on
    /// the same work directory removes the empty ones and keeps those with
    /// processes (tasks it adopts). On this machine's own hierarchy.
    #[test]
    fn an_agent_removes_the_empty_groups_a_crashed_one_left() {
        let work = tempfile::tempdir().unwrap();
        let c = match Cgroups::open("crash-test", work.path(), None, 64) {
            Ok(c) => c,
            Err(why) => {
                eprintln!("skipped: no cgroups here: {why}");
                return;
            }
        };
        eprintln!("cgroup {} path ran", c.version.as_str());
        let empty = c
            .create(
                (1, 1, 0, 0),
                Limits {
                    cpu_milli: 100,
                    memory_mib: 64,
                },
                &[],
                None,
            )
            .unwrap();
        let busy = c
            .create(
                (2, 1, 0, 0),
                Limits {
                    cpu_milli: 100,
                    memory_mib: 64,
                },
                &[],
                None,
            )
            .unwrap();
        let mut sleeper = std::process::Command::new("sleep")
            .arg("30")
            .spawn()
            .unwrap();
        for f in busy.procs_files().unwrap() {
            use std::io::Write;
            (&f).write_all(sleeper.id().to_string().as_bytes()).unwrap();
        }
        // The agent "crashes" (its groups stay) and a new one starts.
        drop(c);
        let again = Cgroups::open("crash-test", work.path(), None, 64).unwrap();
        let dirs = |g: &TaskGroup| g.bases().iter().map(|d| d.exists()).collect::<Vec<_>>();
        assert!(dirs(&empty).iter().all(|e| !e), "the empty group is gone");
        assert!(dirs(&busy).iter().all(|e| *e), "the busy group is kept");
        assert_eq!(again.group((2, 1, 0, 0)).pids(), [sleeper.id() as i32]);
        again.group((2, 1, 0, 0)).remove();
        let _ = sleeper.wait();
        assert!(dirs(&busy).iter().all(|e| !e));
        again.close();
    }

    #[test]
    fn group_names_follow_task_directories() {
        assert_eq!(group_name((7, 2, 1, 3)), "job-7-a2-g1-i3");
    }
}
