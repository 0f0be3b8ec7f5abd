//! gpuflow's node agent: finds the node's GPUs (NVML, or emulated ones),
//! registers with the server using a join token, then heartbeats: it reports
//! its inventory and every task it knows, and makes the node match the
//! server's desired list. Level-triggered and idempotent: a task in the list
//! and not running is started; a task running and not in the list is stopped;
//! a stop order is honoured once with its signal and grace period.
//!
//! A task is started at most once per work directory, and runs under its
//! keeper (`keeper.rs`), which records how it ended and stops it when the
//! node's lease runs low: when the server is unreachable the agent keeps
//! trying, and its tasks run on until half the lease (the server's node
//! timeout) has passed without an answered heartbeat; by five sixths they
//! are gone, before the server places their work elsewhere. When the server
//! has forgotten it (a new database) it registers again with its node token.
//! Each task's CPU, memory and pids limits are set through cgroups
//! (`cgroup.rs`) where the agent can make them; it says in its inventory
//! when it cannot. GPU-memory enforcement, telemetry and idle reclamation
//! will live beside `task.rs`.

pub mod cdi;
pub mod cgroup;
pub mod devbpf;
#[cfg(feature = "testing")]
pub mod fake_nvml;
pub mod gpu;
pub mod isolate;
pub mod keeper;
pub mod migcaps;
pub mod oci;
pub mod session;
pub mod task;
pub mod taskroot;
pub mod telemetry;
pub mod user;

use std::collections::BTreeMap;
use std::path::PathBuf;
use std::sync::Arc;
use std::sync::atomic::{AtomicBool, Ordering};
use std::time::{Duration, Instant};

use anyhow::{Context, bail};
use gpuflow_api::{Desired, Heartbeat, Inventory, Register, Registered, TaskReport};

use crate::gpu::{Emulated, Gpus};
use crate::task::{Key, Task};

/// Agent settings.
#[derive(Clone, Debug)]
pub struct Config {
    /// `http://host:port` of the server; several, separated by commas,
    /// for a leader and its standbys (the agent moves on to the next when
    /// one does not answer).
    pub server: String,
    pub join_token: String,
    /// The node's name; default: the host name.
    pub node: String,
    /// The agent's records, tokens and lease live here, and tasks'
    /// directories and logs too unless their users cannot reach it (see
    /// `taskroot.rs`).
    pub work_dir: PathBuf,
    /// Use these instead of NVML.
    pub emulate: Option<Emulated>,
    /// NVML library to load instead of the system's `libnvidia-ml.so.1`.
    pub nvml_lib: Option<PathBuf>,
    pub pool: String,
    pub labels: BTreeMap<String, String>,
    /// The address other nodes reach this one at.
    pub address: String,
    /// PEM certificate(s) to trust for an `https` server (e.g. a self-signed
    /// one); default: the web's public roots.
    pub ca_cert: Option<PathBuf>,
    /// Leave tasks running when the agent exits (an upgrade); the next agent
    /// adopts them. Default: stop them.
    pub keep_tasks_on_exit: bool,
    /// When the agent runs as root: the user tasks run as unless their team
    /// names one (never root), when `task_uid_base` is 0.
    pub run_as: String,
    /// When the agent runs as root: tasks of a team without `run_as` run as
    /// this plus the team's number, a uid of the team's own (0: as `run_as`).
    pub task_uid_base: u32,
    /// A cgroup v2 hierarchy to use instead of the one the node mounts.
    pub cgroup_root: Option<PathBuf>,
    /// Where the kernel's `/proc` is (the NVIDIA driver's `devices` and
    /// `driver/nvidia-caps/mig-minors`): `/proc`, or the host's mounted in
    /// the agent's container.
    pub proc_root: PathBuf,
    /// The most processes (threads included) one task may have.
    pub task_pids_max: u64,
    /// Tasks may create user namespaces (their seccomp filter denies it
    /// otherwise).
    pub task_user_namespaces: bool,
    /// GPUs and tasks' GPU use are sampled this often.
    pub sample_interval: Duration,
    /// The most the node's image cache keeps, MiB (least recently used
    /// images no task runs from are removed past it).
    pub image_cache_mib: u64,
    /// Where the node's CDI specs are (`/etc/cdi`, `/var/run/cdi`).
    pub cdi_dirs: Vec<PathBuf>,
}

/// The client of readiness checks: plain HTTP to the node's own tasks, a
/// second at most. No redirects: a task's readiness answer must not send
/// the agent (root, on the node's network) to another address.
pub fn probe_client() -> ureq::Agent {
    ureq::Agent::config_builder()
        .timeout_global(Some(std::time::Duration::from_secs(1)))
        .http_status_as_error(false)
        .max_redirects(0)
        .build()
        .into()
}

/// The time now, in Unix seconds.
pub(crate) fn unix_now() -> u64 {
    std::time::SystemTime::now()
        .duration_since(std::time::UNIX_EPOCH)
        .map_or(0, |d| d.as_secs())
}

/// The default most processes and threads of one task.
pub const DEFAULT_TASK_PIDS_MAX: u64 = 4_096;

/// The node token, kept so that a restarted agent proves it is the node
/// that registered the name.
const NODE_TOKEN: &str = "node.token";

fn read_node_token(dir: &std::path::Path) -> Option<String> {
    std::fs::read_to_string(dir.join(NODE_TOKEN))
        .ok()
        .map(|s| s.trim().to_string())
        .filter(|s| !s.is_empty())
}

fn write_node_token(dir: &std::path::Path, token: &str) {
    use std::io::Write;
    use std::os::unix::fs::OpenOptionsExt;
    let tmp = dir.join(format!("{NODE_TOKEN}.tmp"));
    let ok = std::fs::OpenOptions::new()
        .write(true)
        .create(true)
        .truncate(true)
        .mode(0o600)
        .open(&tmp)
        .and_then(|mut f| writeln!(f, "{token}").and_then(|()| f.sync_all()))
        .and_then(|()| std::fs::rename(&tmp, dir.join(NODE_TOKEN)));
    if let Err(e) = ok {
        tracing::warn!(error = %e, "cannot keep the node token; a restart will need `gpuflow node replace`");
    }
}

const RECORDS: &str = "tasks.json";

/// The most task output one heartbeat carries (the server takes
/// heartbeats of up to 16 MiB).
const LOG_BUDGET: u64 = 8 << 20;

/// Adopts the tasks a previous agent process left running in `dir`.
fn adopt_all(dir: &std::path::Path, cgroups: Option<&cgroup::Cgroups>) -> BTreeMap<Key, Task> {
    let Ok(text) = std::fs::read_to_string(dir.join(RECORDS)) else {
        return BTreeMap::new();
    };
    let records: Vec<task::Record> = serde_json::from_str(&text).unwrap_or_else(|e| {
        tracing::warn!(error = %e, "cannot read the task records; starting with none");
        Vec::new()
    });
    records
        .iter()
        .map(|r| Task::adopt(r, cgroups))
        .map(|t| (t.key, t))
        .collect()
}

/// Writes the records of running tasks when they changed (write, then rename).
fn save_records(tasks: &BTreeMap<Key, Task>, dir: &std::path::Path, last: &mut Vec<task::Record>) {
    let now: Vec<task::Record> = tasks.values().filter_map(Task::record).collect();
    if &now == last {
        return;
    }
    let tmp = dir.join(format!("{RECORDS}.tmp"));
    let ok = serde_json::to_vec(&now)
        .ok()
        .and_then(|bytes| std::fs::write(&tmp, bytes).ok())
        .and_then(|()| std::fs::rename(&tmp, dir.join(RECORDS)).ok());
    if ok.is_some() {
        *last = now;
    } else {
        tracing::warn!(dir = %dir.display(), "cannot write the task records");
    }
}

/// The API's HTTP agent, trusting `ca_cert` where given.
///
/// # Errors
/// A CA file that cannot be read or holds no certificate.
pub fn http_client(
    ca_cert: Option<&std::path::Path>,
    timeout: Duration,
) -> anyhow::Result<ureq::Agent> {
    gpuflow_client::http_client(ca_cert, timeout).map_err(anyhow::Error::msg)
}

/// The host name, or `node` when it cannot be read.
pub fn host_name() -> String {
    std::fs::read_to_string("/proc/sys/kernel/hostname")
        .map(|s| s.trim().to_lowercase())
        .ok()
        .filter(|s| gpuflow_api::valid_name(s))
        .unwrap_or_else(|| "node".into())
}

fn cpu_and_memory() -> (u64, u64) {
    use procfs::Current;
    let cpus = std::thread::available_parallelism().map_or(1, |n| n.get()) as u64;
    // MemTotal, in bytes; 1 GiB when it cannot be read.
    let mem = procfs::Meminfo::current().map_or(1 << 30, |m| m.mem_total);
    (cpus * 1000, mem >> 20)
}

/// The servers (a leader and its standbys), asked in turn: the next when
/// no connection to one opens, a standby answers, or one fails (5xx: a
/// leader that was deposed).
struct Client {
    api: gpuflow_client::Client,
}

impl Client {
    /// `servers`: one address, or several separated by commas.
    fn new(http: ureq::Agent, servers: &str) -> anyhow::Result<Client> {
        let bases = gpuflow_client::server_urls(servers).map_err(|e| anyhow::anyhow!(e.0))?;
        Ok(Client {
            api: gpuflow_client::Client::new(http, bases, String::new()),
        })
    }

    /// The server asked now.
    fn base(&self) -> &str {
        self.api.base()
    }

    fn post<B: serde::Serialize, R: for<'de> serde::Deserialize<'de>>(
        &self,
        path: &str,
        token: &str,
        body: &B,
    ) -> anyhow::Result<Result<R, (u16, String)>> {
        let bytes = serde_json::to_vec(body)?;
        let base = self.base().to_string();
        let mut resp = self
            .api
            .send_as(
                token,
                "POST",
                path,
                Some(("application/json", &bytes)),
                None,
            )
            .with_context(|| format!("cannot reach the server at {base}"))?;
        let status = resp.status().as_u16();
        let text = resp.body_mut().read_to_string().unwrap_or_default();
        if status >= 500 {
            let from = self.base().to_string();
            self.api.move_on();
            tracing::info!(%from, why = %message(&text), server = %self.base(), "trying the next server");
        }
        if status >= 300 {
            return Ok(Err((status, text)));
        }
        Ok(Ok(
            serde_json::from_str(&text).with_context(|| format!("bad reply from {path}"))?
        ))
    }
}

/// A refusal the agent cannot get past by retrying.
#[derive(Debug, thiserror::Error)]
#[error("{0}")]
struct Fatal(String);

/// The `message` of an API error body, or the body itself.
fn message(body: &str) -> String {
    serde_json::from_str::<serde_json::Value>(body)
        .ok()
        .and_then(|v| v["message"].as_str().map(str::to_string))
        .unwrap_or_else(|| body.to_string())
}

/// Runs until `stop` is set; then kills the tasks it runs and returns.
///
/// # Errors
/// When the join token is refused (the agent cannot do anything useful).
pub fn run(cfg: Config, stop: Arc<AtomicBool>) -> anyhow::Result<()> {
    let gpus = Gpus::open(cfg.nvml_lib.as_deref(), cfg.emulate.clone());
    match &gpus.nvml_error {
        None => tracing::info!(gpus = gpus.list().len(), "GPUs found through NVML"),
        Some(e) if cfg.emulate.is_some() => tracing::info!(reason = %e, "using emulated GPUs"),
        Some(e) => tracing::info!(reason = %e, "NVML not available: no GPUs on this node"),
    }
    // Whatever the agent writes (records, tokens, logs) is its own.
    // SAFETY: umask has no preconditions.
    unsafe { libc::umask(0o077) };
    std::fs::create_dir_all(&cfg.work_dir)
        .with_context(|| format!("cannot create {}", cfg.work_dir.display()))?;
    {
        use std::os::unix::fs::PermissionsExt;
        std::fs::set_permissions(&cfg.work_dir, std::fs::Permissions::from_mode(0o700))
            .with_context(|| format!("cannot restrict {}", cfg.work_dir.display()))?;
    }
    let lease = keeper::Lease::open(&cfg.work_dir)
        .with_context(|| format!("cannot open the lease file in {}", cfg.work_dir.display()))?;
    let cgroups = match cgroup::Cgroups::open(
        &cfg.node,
        &cfg.work_dir,
        cfg.cgroup_root.as_deref(),
        cfg.task_pids_max,
    ) {
        Ok(c) => {
            tracing::info!(
                cgroup = c.version.as_str(),
                controllers = %c.controllers().join(","),
                "tasks get CPU, memory and pids limits"
            );
            Ok(c)
        }
        Err(e) => {
            tracing::warn!(reason = %e, "tasks run WITHOUT CPU, memory and pids limits");
            Err(e)
        }
    };
    let node_limits = match &cgroups {
        Ok(c) => gpuflow_api::NodeLimits {
            cgroup: c.version.as_str().into(),
            controllers: c.controllers(),
            note: c.device_control().err().unwrap_or_default(),
            task_uid_base: None,
        },
        Err(e) => gpuflow_api::NodeLimits {
            cgroup: String::new(),
            controllers: vec![],
            note: e.clone(),
            task_uid_base: None,
        },
    };
    if let Ok(c) = &cgroups
        && let Err(why) = c.device_control()
    {
        tracing::warn!(reason = %why, "tasks are NOT confined to their GPUs");
    }
    let tasks_root = taskroot::choose(&cfg.work_dir, &cfg.node, user::agent_uid() == 0)
        .map_err(|e| anyhow::anyhow!(e))?;
    let isolation = isolate::Policy::new(
        &[&cfg.work_dir, &tasks_root],
        user::agent_uid() == 0,
        cfg.task_user_namespaces,
    )
    .map_err(|e| anyhow::anyhow!(e))?;
    let mig_caps = match migcaps::Caps::read(&cfg.proc_root) {
        Ok(c) => c.map(std::sync::Arc::new),
        Err(e) => bail!("cannot read the driver's MIG capability devices: {e}"),
    };
    let mut launch = task::Launch {
        isolation,
        gpu_minors: gpus.minors(),
        mig_ids: gpus.mig_ids(),
        mig_caps,
        cgroups: cgroups.ok(),
        run_as: cfg.run_as.clone(),
        task_uid_base: cfg.task_uid_base,
        lease_fd: {
            use std::os::fd::AsRawFd;
            lease.file().as_raw_fd()
        },
        tasks: tasks_root,
        no_images: oci::available().err(),
        helper: std::env::current_exe().unwrap_or_else(|_| "gpuflow".into()),
        image_cache_mib: cfg.image_cache_mib,
        cdi_dirs: cfg.cdi_dirs.clone(),
        gpu_uuids: gpus.list().into_iter().map(|g| g.uuid).collect(),
        driver_files: cdi::driver_files(cfg.nvml_lib.as_deref()),
    };
    match &launch.no_images {
        None => {
            tracing::info!(cache = %cfg.work_dir.join("images").display(), "tasks may run in OCI images (runc, skopeo, umoci)")
        }
        Some(why) => tracing::info!(reason = %why, "tasks cannot run in images on this node"),
    }
    // A reply to a request sent at `sent` (boot clock) renews the lease
    // from then: tasks are signalled half-way through it and killed at five
    // sixths, before the server, counting from when it answered, takes the
    // node for lost.
    let renew = |sent: u64, lease_s: u64| {
        if lease_s > 0 {
            let l = lease_s * 1000;
            lease.renew(sent + l / 2, sent + l * 5 / 6);
        }
    };
    if user::agent_uid() == 0 {
        match user::resolve(None, &cfg.run_as) {
            Ok(_) => {
                tracing::info!(user = %cfg.run_as, "running as root: tasks run as an unprivileged user")
            }
            Err(e) => {
                tracing::warn!(error = %e, "tasks cannot start until --run-as names a usable user")
            }
        }
    }
    let client = Client::new(
        http_client(cfg.ca_cert.as_deref(), Duration::from_secs(10))?,
        &cfg.server,
    )?;
    let (cpu_milli, memory_mib) = cpu_and_memory();
    // The installation's uid block on this node, once registered: its
    // first uid, reported with the limits, and the claim held meanwhile.
    let uid_base_now = std::cell::Cell::new(None::<u32>);
    let mut uid_claim: Option<user::UidClaim> = None;
    // A node that can run images says so: tasks in images go only there.
    let mut labels = cfg.labels.clone();
    if launch.no_images.is_none() {
        labels.insert(gpuflow_api::OCI_LABEL.into(), "true".into());
    }
    let inventory = || Inventory {
        cpu_milli,
        memory_mib,
        gpus: gpus.list(),
        emulated: gpus.is_emulated(),
        address: cfg.address.clone(),
        labels: labels.clone(),
        pool: cfg.pool.clone(),
        limits: gpuflow_api::NodeLimits {
            task_uid_base: uid_base_now.get(),
            ..node_limits.clone()
        },
    };
    let mut tasks: BTreeMap<Key, Task> = adopt_all(&cfg.work_dir, launch.cgroups.as_ref());
    let probe_http = probe_client();
    let mut saved: Vec<task::Record> = tasks.values().filter_map(Task::record).collect();
    let mut node_token: Option<String> = None;
    let mut samples: Vec<gpuflow_api::GpuSample> = Vec::new();
    let mut last_sample = Instant::now();
    let mut interval = Duration::from_secs(2);
    let mut last_error = Instant::now() - Duration::from_secs(60);
    let mut beats: usize = 0;
    while !stop.load(Ordering::Relaxed) {
        let tick = Instant::now();
        // After starting or stopping tasks, report back soon rather than a full
        // interval later.
        let mut soon = false;
        for t in tasks.values_mut() {
            t.poll();
        }
        let result = (|| -> anyhow::Result<()> {
            let token = match &node_token {
                Some(t) => t.clone(),
                None => {
                    let reg = Register {
                        node: cfg.node.clone(),
                        inventory: inventory(),
                        node_token: read_node_token(&cfg.work_dir),
                    };
                    let sent = keeper::boot_ms();
                    match client.post::<_, Registered>(
                        "/v1/agent/register",
                        &cfg.join_token,
                        &reg,
                    )? {
                        Ok(r) => {
                            if user::agent_uid() == 0
                                && cfg.task_uid_base > 0
                                && !r.installation.is_empty()
                                && uid_claim.is_none()
                            {
                                // Two installations on one node never give
                                // their teams the same uids.
                                let base = user::block_base(cfg.task_uid_base, r.uid_block)
                                    .map_err(Fatal)?;
                                uid_claim = Some(
                                    user::claim_uid_block(
                                        std::path::Path::new(user::UID_CLAIMS),
                                        r.uid_block,
                                        &r.installation,
                                    )
                                    .map_err(Fatal)?,
                                );
                                tracing::info!(
                                    base,
                                    block = r.uid_block,
                                    "teams' tasks run under this installation's uid block"
                                );
                                launch.task_uid_base = base;
                                uid_base_now.set(Some(base));
                            }
                            renew(sent, r.lease_s);
                            tracing::info!(node = %cfg.node, server = %client.base(), "registered");
                            interval = Duration::from_secs(r.heartbeat_s.clamp(1, 60));
                            write_node_token(&cfg.work_dir, &r.node_token);
                            node_token = Some(r.node_token.clone());
                            r.node_token
                        }
                        Err((401, _)) => {
                            return Err(Fatal("the server refused the join token".into()).into());
                        }
                        Err((409, m)) => {
                            return Err(
                                Fatal(format!("registration refused: {}", message(&m))).into()
                            );
                        }
                        Err((s, m)) => bail!("registration failed ({s}): {m}"),
                    }
                }
            };
            for t in tasks.values_mut() {
                t.probe(&probe_http);
            }
            // Each heartbeat ships at most LOG_BUDGET bytes of output,
            // starting at a different task each time so that none waits
            // behind a noisy one for long.
            let mut budget = LOG_BUDGET;
            let n = tasks.len().max(1);
            let first = beats % n;
            beats = beats.wrapping_add(1);
            let reports: Vec<TaskReport> = tasks
                .values()
                .cycle()
                .skip(first)
                .take(tasks.len())
                .map(|t| t.report(&mut budget))
                .collect();
            let shipped: Vec<(Key, [Option<u64>; 2])> = reports
                .iter()
                .map(|r| {
                    let end =
                        |c: &Option<gpuflow_api::LogChunk>| c.as_ref().map(|c| c.offset + c.len);
                    (
                        (r.job, r.attempt, r.group, r.index),
                        [end(&r.stdout), end(&r.stderr)],
                    )
                })
                .collect();
            let hb = Heartbeat {
                node: cfg.node.clone(),
                inventory: inventory(),
                tasks: reports,
                gpus: samples.clone(),
            };
            let sent = keeper::boot_ms();
            match client.post::<_, Desired>("/v1/agent/heartbeat", &token, &hb)? {
                Ok(d) => {
                    renew(sent, d.lease_s);
                    for (k, ends) in shipped {
                        if let Some(t) = tasks.get_mut(&k) {
                            for (acked, end) in t.acked.iter_mut().zip(ends) {
                                if let Some(end) = end {
                                    *acked = end;
                                }
                            }
                        }
                    }
                    interval = Duration::from_secs(d.heartbeat_s.clamp(1, 60));
                    gpus.clear_health(d.health_cleared_at);
                    // MIG instances come and go: their places, read again
                    // when a task holds one.
                    if launch.mig_caps.is_some() && d.tasks.iter().any(|t| !t.mig.is_empty()) {
                        launch.mig_ids = gpus.mig_ids();
                    }
                    soon = reconcile(&mut tasks, &d, &cfg.work_dir, &launch);
                    if let Some(token) = &node_token {
                        let ctx = session::Context {
                            base: client.base().to_string(),
                            token: token.clone(),
                            ca_cert: cfg.ca_cert.clone(),
                        };
                        for o in &d.sessions {
                            let k = (o.job, o.attempt, o.group, o.index);
                            let want = d.tasks.iter().find(|t| task::key(t) == k);
                            session::start(
                                o.clone(),
                                tasks.get(&k),
                                want,
                                &cfg.work_dir,
                                &launch,
                                &ctx,
                            );
                        }
                    }
                }
                Err((401 | 404, _)) => {
                    // The server forgot us: register again next tick.
                    node_token = None;
                }
                Err((s, m)) => bail!("heartbeat refused ({s}): {m}"),
            }
            Ok(())
        })();
        if let Err(e) = result {
            if e.downcast_ref::<Fatal>().is_some() {
                for t in tasks.values_mut() {
                    t.kill();
                }
                return Err(e);
            }
            if last_error.elapsed() > Duration::from_secs(30) {
                tracing::warn!(error = %format!("{e:#}"), "heartbeat failed; tasks keep running, retrying");
                last_error = Instant::now();
            }
        }
        // Sleep in short steps so task exits are reaped and stop is noticed.
        save_records(&tasks, &cfg.work_dir, &mut saved);
        let wait = if soon {
            Duration::from_millis(300)
        } else {
            interval
        };
        while tick.elapsed() < wait && !stop.load(Ordering::Relaxed) {
            std::thread::sleep(Duration::from_millis(100));
            if last_sample.elapsed() >= cfg.sample_interval {
                last_sample = Instant::now();
                let (s, procs) = gpus.sample();
                telemetry::account(&mut tasks, &gpus.last_listed(), &s, &procs, unix_now());
                samples = s;
            }
            let mut ended = false;
            for t in tasks.values_mut() {
                let was = t.running();
                t.poll();
                ended |= was && !t.running();
            }
            if ended {
                // A task ended: tell the server now.
                break;
            }
        }
    }
    if !cfg.keep_tasks_on_exit {
        for t in tasks.values_mut() {
            t.kill();
            t.poll();
        }
        if let Some(c) = &launch.cgroups {
            c.close();
        }
    }
    save_records(&tasks, &cfg.work_dir, &mut saved);
    Ok(())
}

/// Makes the node match the desired list. Returns whether it started or
/// stopped anything.
fn reconcile(
    tasks: &mut BTreeMap<Key, Task>,
    desired: &Desired,
    dir: &std::path::Path,
    launch: &task::Launch,
) -> bool {
    let mut changed = false;
    let wanted: BTreeMap<Key, &gpuflow_api::DesiredTask> =
        desired.tasks.iter().map(|t| (task::key(t), t)).collect();
    for (k, d) in &wanted {
        match tasks.get_mut(k) {
            None if d.stop.is_none() => {
                if d.command.is_empty() {
                    continue;
                }
                tasks.insert(*k, Task::start_once(d, dir, launch));
                changed = true;
            }
            None => {}
            Some(t) => {
                t.identify(d, dir, launch);
                if let Some(s) = &d.stop {
                    changed |= t.stop(&s.signal, Duration::from_secs(s.grace_s));
                }
            }
        }
    }
    // Tasks the server no longer wants: stop them (short grace), forget them once gone.
    tasks.retain(|k, t| {
        if wanted.contains_key(k) {
            return true;
        }
        if t.running() {
            changed |= t.stop("SIGTERM", Duration::from_secs(10));
            true
        } else {
            t.end_probe();
            false
        }
    });
    changed
}

#[cfg(test)]
mod tests {
    use std::io::{Read, Write};
    use std::net::TcpListener;

    /// A task's readiness endpoint that redirects elsewhere (another host's
    /// service, a cloud metadata address) is answered as it is: the probe
    /// never follows it, so the agent's identity reaches nothing but the
    /// task.
    #[test]
    fn a_readiness_probe_does_not_follow_a_redirect() {
        let elsewhere = TcpListener::bind("127.0.0.1:0").unwrap();
        let target = elsewhere.local_addr().unwrap();
        elsewhere.set_nonblocking(true).unwrap();
        let task = TcpListener::bind("127.0.0.1:0").unwrap();
        let url = format!("http://{}/ready", task.local_addr().unwrap());
        let server = std::thread::spawn(move || {
            let (mut c, _) = task.accept().unwrap();
            let mut buf = [0u8; 1024];
            let _ = c.read(&mut buf);
            let reply = format!(
                "HTTP/1.1 302 Found\r\nLocation: http://{target}/secret\r\nContent-Length: 0\r\nConnection: close\r\n\r\n"
            );
            c.write_all(reply.as_bytes()).unwrap();
        });
        let status = super::probe_client()
            .get(&url)
            .call()
            .map(|r| r.status().as_u16());
        server.join().unwrap();
        assert_eq!(status.ok(), Some(302), "the redirect is the answer");
        std::thread::sleep(std::time::Duration::from_millis(100));
        assert!(
            elsewhere.accept().is_err(),
            "the probe went to the redirect's address"
        );
    }
}
