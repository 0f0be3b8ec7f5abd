//! The server's working state: every team, user, token, queue, node and job,
//! held in memory and written through to the store. Records serialise to the
//! store's JSON documents; [`World::load`] rebuilds the state after a restart.

use std::collections::BTreeMap;

use gpuflow_api::{self as api, Inventory, JobSpec, JobState, NodeState, QueueSpec, Role};
use gpuflow_store::{Record, Store, Table};
use serde::{Deserialize, Serialize};

use crate::ServerError;

/// Where a task's GPUs are: a mirror of the core's `GpuPick`, by node name.
#[derive(Clone, Debug, PartialEq, Eq, Serialize, Deserialize)]
#[serde(rename_all = "kebab-case")]
pub enum Pick {
    None,
    /// Whole GPUs: bit i set means GPU i.
    Whole(u64),
    Shared(u8),
    Mig {
        gpu: u8,
        instance: u8,
    },
}

impl From<gpuflow_core::cluster::GpuPick> for Pick {
    fn from(p: gpuflow_core::cluster::GpuPick) -> Pick {
        use gpuflow_core::cluster::GpuPick;
        match p {
            GpuPick::None => Pick::None,
            GpuPick::Whole(m) => Pick::Whole(m),
            GpuPick::Shared(g) => Pick::Shared(g),
            GpuPick::Mig { gpu, instance } => Pick::Mig { gpu, instance },
        }
    }
}

impl From<Pick> for gpuflow_core::cluster::GpuPick {
    fn from(p: Pick) -> gpuflow_core::cluster::GpuPick {
        use gpuflow_core::cluster::GpuPick;
        match p {
            Pick::None => GpuPick::None,
            Pick::Whole(m) => GpuPick::Whole(m),
            Pick::Shared(g) => GpuPick::Shared(g),
            Pick::Mig { gpu, instance } => GpuPick::Mig { gpu, instance },
        }
    }
}

impl Pick {
    /// Whether it holds any GPU (whole, shared or a MIG instance).
    pub fn gpus_held(&self) -> bool {
        *self != Pick::None
    }

    pub fn gpus(&self) -> Vec<u32> {
        match *self {
            Pick::None => vec![],
            Pick::Whole(mask) => (0..64).filter(|i| mask & (1 << i) != 0).collect(),
            Pick::Shared(g) | Pick::Mig { gpu: g, .. } => vec![g as u32],
        }
    }
}

/// One task's allocation.
#[derive(Clone, Debug, PartialEq, Eq, Serialize, Deserialize)]
pub struct Alloc {
    pub group: u16,
    pub index: u32,
    pub node: String,
    pub cpu_milli: u64,
    pub mem_mib: u64,
    /// By position in the node's inventory when it was admitted; read it
    /// through [`Alloc::current_pick`], which follows the UUIDs.
    pub pick: Pick,
    /// The UUIDs of the picked GPUs: what identifies them, whatever their
    /// position in the node's inventory becomes (records of older versions
    /// have none and go by position).
    #[serde(default, skip_serializing_if = "Vec::is_empty")]
    pub gpu_uuids: Vec<String>,
}

impl Alloc {
    /// The UUIDs of `pick`'s GPUs in `inv` (a MIG instance's own `MIG-…`).
    pub fn uuids_of(pick: &Pick, inv: &api::Inventory) -> Vec<String> {
        if let Pick::Mig { gpu, instance } = *pick {
            return inv
                .gpus
                .get(gpu as usize)
                .and_then(|g| g.mig.get(instance as usize))
                .map(|m| vec![m.uuid.clone()])
                .unwrap_or_default();
        }
        pick.gpus()
            .iter()
            .filter_map(|&i| inv.gpus.get(i as usize).map(|g| g.uuid.clone()))
            .collect()
    }

    /// The pick by the GPUs' positions in `inv` now, found by UUID.
    ///
    /// # Errors
    /// Names the first GPU the node no longer reports.
    /// The first of its GPUs the node reports unhealthy, with why.
    pub fn unhealthy_gpu(&self, inv: &api::Inventory) -> Option<String> {
        inv.gpus.iter().find_map(|g| {
            let why = g.unhealthy.as_ref()?;
            let held = self
                .gpu_uuids
                .iter()
                .any(|u| *u == g.uuid || g.mig.iter().any(|m| &m.uuid == u));
            held.then(|| {
                format!(
                    "its GPU {} ({}) on node {} is unhealthy: {why}",
                    g.index, g.uuid, self.node
                )
            })
        })
    }

    pub fn current_pick(&self, inv: &api::Inventory) -> Result<Pick, String> {
        if self.gpu_uuids.is_empty() {
            return Ok(self.pick.clone());
        }
        if let Pick::Mig { .. } = self.pick {
            let u = &self.gpu_uuids[0];
            for (g, gpu) in inv.gpus.iter().enumerate() {
                if let Some(k) = gpu.mig.iter().position(|m| &m.uuid == u) {
                    return Ok(Pick::Mig {
                        gpu: g as u8,
                        instance: k as u8,
                    });
                }
            }
            return Err(format!(
                "its MIG instance {u} is gone from node {}",
                self.node
            ));
        }
        let mut at = Vec::with_capacity(self.gpu_uuids.len());
        for u in &self.gpu_uuids {
            match inv.gpus.iter().position(|g| &g.uuid == u) {
                Some(i) => at.push(i as u8),
                None => return Err(format!("its GPU {u} is gone from node {}", self.node)),
            }
        }
        Ok(match self.pick {
            Pick::None => Pick::None,
            Pick::Whole(_) => Pick::Whole(at.iter().fold(0u64, |m, &i| m | (1 << i))),
            Pick::Shared(_) => Pick::Shared(at[0]),
            Pick::Mig { instance, .. } => Pick::Mig {
                gpu: at[0],
                instance,
            },
        })
    }
}

/// What happens to a stopping job once its tasks are gone.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Serialize, Deserialize)]
#[serde(rename_all = "kebab-case")]
pub enum AfterStop {
    /// Back to pending (preempted, or its node was lost).
    Requeue,
    Suspend,
    Cancel,
    /// Failed: a task failed with no retry left.
    Fail,
    /// Over its max runtime.
    Timeout,
    /// A task failed and a retry is left: pending again after a backoff.
    Retry,
}

/// A task as its agent last reported it.
#[derive(Clone, Debug, PartialEq, Serialize, Deserialize)]
pub struct TaskState {
    pub group: u16,
    pub index: u32,
    pub phase: api::TaskPhase,
    pub exit_code: Option<i32>,
    /// What the agent said about it (why it could not start, …).
    #[serde(default, skip_serializing_if = "String::is_empty")]
    pub message: String,
    /// Its GPU use, as its agent sampled it.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub usage: Option<api::TaskUsage>,
    /// The port it serves on and whether its readiness check passes.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub port: Option<u16>,
    /// The ports it declared, by name, as its agent picked them.
    #[serde(default, skip_serializing_if = "BTreeMap::is_empty")]
    pub ports: BTreeMap<String, u16>,
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub ready: Option<bool>,
}

#[derive(Clone, Debug, PartialEq, Serialize, Deserialize)]
pub struct JobRec {
    pub id: u64,
    pub spec: JobSpec,
    pub team: String,
    pub user: String,
    /// The client's `Idempotency-Key`: a retried submission with the same key
    /// (from the same user) gets this job back instead of a second one.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub idempotency_key: Option<String>,
    pub state: JobState,
    pub reason: String,
    pub submitted_at: u64,
    pub started_at: Option<u64>,
    pub finished_at: Option<u64>,
    /// Runs started so far; the current run's tasks carry this number.
    pub attempts: u32,
    pub preemptions: u32,
    pub failures: u32,
    /// Pending but not to be started before this (retry backoff).
    pub not_before: Option<u64>,
    pub last_checkpoint: Option<u64>,
    pub kill_at: Option<u64>,
    pub after_stop: Option<AfterStop>,
    /// When its idle policy last warned it (the current idle spell).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub idle_warned_at: Option<u64>,
    /// The flavor (GPU model) its quota is charged to.
    pub flavor: String,
    pub allocs: Vec<Alloc>,
    pub tasks: Vec<TaskState>,
    /// The last 16 KiB of each task's output per attempt,
    /// `attempt/group/index` → text (the last [`LOG_ATTEMPTS`] attempts;
    /// records of older versions hold `group/index` keys, read as the
    /// latest attempt's). The whole output, up to the job's log limit, is
    /// in the store's log (see [`crate::output`]).
    pub logs: BTreeMap<String, String>,
    /// The same for what the tasks wrote to stderr (`logs` hold stdout;
    /// records of older versions hold both there).
    #[serde(default, skip_serializing_if = "BTreeMap::is_empty")]
    pub err_logs: BTreeMap<String, String>,
    /// How far each task's stream reached and how much of it is stored,
    /// `attempt/group/index/out|err` → mark (the kept attempts only).
    #[serde(default, skip_serializing_if = "BTreeMap::is_empty")]
    pub log_marks: BTreeMap<String, Mark>,
    /// Bytes of output stored for it, counted against the job log limit.
    #[serde(default, skip_serializing_if = "is_zero_u64")]
    pub log_kept: u64,
    /// GPU-hours of work lost to preemptions (since each victim's last
    /// checkpoint), summed over its preemptions.
    #[serde(default, skip_serializing_if = "is_zero")]
    pub lost_gpu_hours: f64,
    /// What each attempt held, for accounting (the ledger).
    #[serde(default, skip_serializing_if = "Vec::is_empty")]
    pub held: Vec<Held>,
    /// Its GPUs' utilisation over its life (bounded; see [`push_util`]).
    #[serde(default, skip_serializing_if = "Vec::is_empty")]
    pub util: Vec<api::UtilPoint>,
    /// A finished job's last tasks as they ended: where they ran, on which
    /// GPUs, with their exit codes.
    #[serde(default, skip_serializing_if = "Vec::is_empty")]
    pub last_tasks: Vec<api::TaskView>,
    /// The digest each task group's image resolved to when first pulled:
    /// later attempts run exactly it.
    #[serde(default, skip_serializing_if = "BTreeMap::is_empty")]
    pub image_digests: BTreeMap<u16, String>,
    /// The array it is an element of, with its index.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub array: Option<api::ArrayRef>,
    /// The service it is a replica of.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub service: Option<ServiceRef>,
    /// Run by another scheduler, which reports it (`external.rs`): never
    /// in [`World::jobs`], never scheduled here.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub external: Option<api::ExternalRef>,
    /// Its dependencies not met yet (`spec.dependency` resolved to jobs at
    /// submission); each leaves as it is met ([`crate::depend`]).
    #[serde(default, skip_serializing_if = "Vec::is_empty")]
    pub waits_on: Vec<Wait>,
}

/// Adds a point to a utilisation history; a full history merges its points
/// in pairs first (mean utilisation, peak memory), so that it keeps the
/// whole life at a coarser grain.
pub fn push_util(util: &mut Vec<api::UtilPoint>, p: api::UtilPoint) {
    if util.last().is_some_and(|l| l.at >= p.at) {
        return;
    }
    if util.len() >= api::UTIL_POINTS {
        let merged = util
            .chunks(2)
            .map(|c| api::UtilPoint {
                at: c[0].at,
                util_pct: c.iter().map(|x| x.util_pct).sum::<f64>() / c.len() as f64,
                memory_mib: c.iter().map(|x| x.memory_mib).max().unwrap_or(0),
            })
            .collect();
        *util = merged;
    }
    util.push(p);
}

fn is_zero_u64(x: &u64) -> bool {
    *x == 0
}

fn is_zero(x: &f64) -> bool {
    *x == 0.0
}

/// One attempt's hold on GPUs, for accounting: how much it held (in
/// thousandths of a GPU; a MIG slice and a time slice at their quota
/// equivalents), of which model, from when to when (open while it holds
/// them), and its GPUs' mean utilisation as its tasks were sampled.
#[serde_with::skip_serializing_none]
#[derive(Clone, Debug, PartialEq, Serialize, Deserialize)]
pub struct Held {
    pub attempt: u32,
    pub from: u64,
    #[serde(default)]
    pub to: Option<u64>,
    pub gpu_milli: u64,
    pub model: String,
    #[serde(default)]
    pub util_pct: Option<f64>,
}

impl Held {
    /// GPU-seconds held between `from` and `to` (clipped to the hold; an
    /// open hold counts up to `now`).
    pub fn gpu_s(&self, from: u64, to: u64, now: u64) -> f64 {
        let end = self.to.unwrap_or(now).min(to);
        let start = self.from.max(from);
        end.saturating_sub(start) as f64 * self.gpu_milli as f64 / 1000.0
    }
}

impl JobRec {
    pub fn record(&self) -> Record {
        Record {
            table: Table::Jobs,
            key: job_key(self.id),
            team: self.team.clone(),
            state: self.state.as_str().into(),
            doc: serde_json::to_string(self).expect("a job serialises"),
        }
    }

    /// Its current attempt's tasks where they run (for a finished job, as
    /// they ended).
    pub fn task_views(&self) -> Vec<api::TaskView> {
        if self.allocs.is_empty() && self.state.finished() {
            return self.last_tasks.clone();
        }
        self.allocs
            .iter()
            .map(|a| {
                let t = self
                    .tasks
                    .iter()
                    .find(|t| t.group == a.group && t.index == a.index);
                api::TaskView {
                    group: self
                        .spec
                        .tasks
                        .get(a.group as usize)
                        .map_or_else(String::new, |g| g.name.clone()),
                    index: a.index,
                    node: a.node.clone(),
                    gpus: a.pick.gpus(),
                    milli: match a.pick {
                        Pick::Shared(_) => Some(
                            self.spec.tasks[a.group as usize]
                                .resources
                                .gpu
                                .as_ref()
                                .map_or(0, |g| g.milli() as u32),
                        ),
                        _ => None,
                    },
                    mig_instance: match a.pick {
                        Pick::Mig { instance, .. } => Some(u32::from(instance)),
                        _ => None,
                    },
                    uuids: a.gpu_uuids.clone(),
                    state: t.map_or("assigned", |t| phase_name(t.phase)).into(),
                    exit_code: t.and_then(|t| t.exit_code),
                    usage: t.and_then(|t| t.usage.clone()),
                    ports: self.port_views(t),
                    image_digest: self.image_digests.get(&a.group).cloned(),
                }
            })
            .collect()
    }

    /// A running task's declared ports, in its spec's order, with the
    /// paths the server proxies to them.
    fn port_views(&self, t: Option<&TaskState>) -> Vec<api::PortView> {
        let Some(t) = t.filter(|t| t.phase == api::TaskPhase::Running) else {
            return Vec::new();
        };
        let Some(g) = self.spec.tasks.get(t.group as usize) else {
            return Vec::new();
        };
        api::job::ports_of(self.spec.kind, g)
            .into_iter()
            .filter_map(|name| {
                let port = *t.ports.get(&name)?;
                Some(api::PortView {
                    url: format!("/v1/jobs/{}/proxy/{port}/", self.id),
                    name,
                    port,
                })
            })
            .collect()
    }

    /// The job as the API shows it at `at` (an open hold counts to then).
    pub fn view(&self, at: u64) -> api::Job {
        let tasks = self.task_views();
        api::Job {
            id: self.id,
            name: self.spec.name.clone(),
            team: self.team.clone(),
            queue: self.spec.queue.clone(),
            user: self.user.clone(),
            state: self.state,
            reason: self.reason.clone(),
            submitted_at: self.submitted_at,
            started_at: self.started_at,
            finished_at: self.finished_at,
            eta: None,
            attempts: self.attempts,
            preemptions: self.preemptions,
            last_checkpoint: self.last_checkpoint,
            kill_at: self.kill_at,
            tasks,
            spec: self.spec.clone(),
            ledger: self
                .held
                .iter()
                .map(|h| api::Hold {
                    attempt: h.attempt,
                    from: h.from,
                    to: h.to,
                    gpus: h.gpu_milli as f64 / 1000.0,
                    model: h.model.clone(),
                    gpu_hours: h.gpu_s(0, u64::MAX, at) / 3600.0,
                    util_pct: self.hold_util(h),
                })
                .collect(),
            util: self.util.clone(),
            array: self.array.clone(),
            external: self.external.clone(),
        }
    }

    /// The mean of its current tasks' sampled GPU utilisation, when any
    /// task was sampled.
    pub fn tasks_util(&self) -> Option<f64> {
        let u: Vec<f64> = self
            .tasks
            .iter()
            .filter_map(|t| t.usage.as_ref())
            .filter(|u| u.samples > 0)
            .map(|u| u.gpu_util_avg_pct)
            .collect();
        (!u.is_empty()).then(|| u.iter().sum::<f64>() / u.len() as f64)
    }

    /// A hold's utilisation: as recorded when it closed, or, while open,
    /// its tasks' so far.
    pub fn hold_util(&self, h: &Held) -> Option<f64> {
        h.util_pct
            .or_else(|| h.to.is_none().then(|| self.tasks_util()).flatten())
    }

    pub fn task_count(&self) -> u32 {
        self.spec.tasks.iter().map(|g| g.replicas).sum()
    }
}

pub fn phase_name(p: api::TaskPhase) -> &'static str {
    match p {
        api::TaskPhase::Running => "running",
        api::TaskPhase::Exited => "exited",
        api::TaskPhase::Stopped => "stopped",
        api::TaskPhase::FailedToStart => "failed-to-start",
    }
}

/// How many attempts' logs a job keeps.
pub const LOG_ATTEMPTS: u32 = 5;

/// `(attempt, group, index)` of a log key; a key without an attempt (an
/// older version's) has attempt `u32::MAX`: the latest.
pub fn log_key(k: &str) -> Option<(u32, u16, u32)> {
    let parts: Vec<&str> = k.split('/').collect();
    match parts[..] {
        [a, g, i] => Some((a.parse().ok()?, g.parse().ok()?, i.parse().ok()?)),
        [g, i] => Some((u32::MAX, g.parse().ok()?, i.parse().ok()?)),
        _ => None,
    }
}

/// Job keys sort numerically as text.
pub fn job_key(id: u64) -> String {
    format!("{id:020}")
}

#[derive(Clone, Debug, PartialEq, Serialize, Deserialize)]
pub struct NodeRec {
    pub name: String,
    pub state: NodeState,
    /// Set by an admin (cordon, drain); `Lost` comes from missed heartbeats and
    /// clears when they resume, the admin's state stays.
    pub admin_state: NodeState,
    pub inventory: Inventory,
    pub address: String,
    pub token_hash: String,
    pub last_heartbeat: u64,
    /// When an admin last cleared its GPUs' health marks (`node clear`).
    #[serde(default)]
    pub health_cleared_at: u64,
    /// Its GPUs as last sampled: in memory only (they change every sample).
    #[serde(skip)]
    pub gpus_now: Vec<api::GpuSample>,
}

impl NodeRec {
    pub fn record(&self) -> Record {
        Record {
            table: Table::Nodes,
            key: self.name.clone(),
            team: String::new(),
            state: self.state.as_str().into(),
            doc: serde_json::to_string(self).expect("a node serialises"),
        }
    }
}

#[serde_with::skip_serializing_none]
#[derive(Clone, Debug, PartialEq, Serialize, Deserialize)]
pub struct TokenRec {
    pub hash: String,
    pub user: String,
    pub created_at: u64,
    #[serde(default)]
    pub expires_at: Option<u64>,
    /// Set when revoked: the record is kept a while, so that the token
    /// is answered "revoked by …", not "unknown" ([`REVOKED_KEPT_S`]).
    #[serde(default)]
    pub revoked: Option<Revoked>,
    /// For a sign-in session: the identity provider's user behind it.
    #[serde(default)]
    pub session: Option<SessionLink>,
}

/// A session's tie to its identity provider.
#[serde_with::skip_serializing_none]
#[derive(Clone, Debug, PartialEq, Serialize, Deserialize)]
pub struct SessionLink {
    pub provider: String,
    pub subject: String,
    /// Renews the user's claims at the provider (a secret: never shown).
    #[serde(default)]
    pub refresh_token: Option<String>,
    /// When the user's groups were last read from the provider.
    pub checked_at: u64,
}

/// Who revoked a token, and when.
#[derive(Clone, Debug, PartialEq, Serialize, Deserialize)]
pub struct Revoked {
    pub at: u64,
    pub by: String,
}

/// How long a revoked or expired token is still recognised, to say so:
/// 30 days. Then its record goes, at the next revocation of its user's.
pub const REVOKED_KEPT_S: u64 = 30 * 86_400;

/// Why a token names no caller.
#[derive(Clone, Debug, PartialEq)]
pub enum Refused {
    /// No such token (never made here, or gone long ago).
    Unknown,
    Expired {
        at: u64,
    },
    Revoked(Revoked),
    /// Its user is disabled.
    Disabled {
        user: String,
    },
}

impl TokenRec {
    /// What the token is listed and revoked by: the start of its hash.
    pub fn id(&self) -> &str {
        &self.hash[..self.hash.len().min(16)]
    }

    pub fn live(&self, now: u64) -> bool {
        self.revoked.is_none() && self.expires_at.is_none_or(|e| now < e)
    }

    /// Whether it has been dead (revoked or expired) longer than
    /// [`REVOKED_KEPT_S`] at `now`.
    pub fn forgotten(&self, now: u64) -> bool {
        let dead_since = self
            .revoked
            .as_ref()
            .map(|r| r.at)
            .or(self.expires_at.filter(|&e| e <= now));
        dead_since.is_some_and(|d| now.saturating_sub(d) > REVOKED_KEPT_S)
    }

    pub fn view(&self) -> api::TokenView {
        api::TokenView {
            id: self.id().to_string(),
            user: self.user.clone(),
            created_at: self.created_at,
            expires_at: self.expires_at,
            provider: self.session.as_ref().map(|s| s.provider.clone()),
        }
    }
}

/// What lists filter on and access checks read, kept for every job.
#[derive(Clone, Debug, PartialEq)]
pub struct JobSummary {
    pub team: String,
    pub queue: String,
    pub user: String,
    pub project: Option<String>,
    pub state: JobState,
    pub array: Option<u64>,
    pub submitted_at: u64,
    /// Unset while it has not finished.
    pub finished_at: Option<u64>,
}

impl JobSummary {
    fn of(j: &JobRec) -> JobSummary {
        JobSummary {
            team: j.team.clone(),
            queue: j.spec.queue.clone(),
            user: j.user.clone(),
            project: j.spec.project.clone(),
            state: j.state,
            array: j.array.as_ref().map(|a| a.id),
            submitted_at: j.submitted_at,
            finished_at: j.finished_at.filter(|_| j.state.finished()),
        }
    }
}

/// The records users and admins change through the API, as committed.
/// Only a committed change puts or removes them ([`World::put_record`],
/// [`World::remove_record`], called by `commit` once the store has
/// answered), besides loading and a new installation's first records.
#[derive(Default)]
pub struct Records {
    pub teams: BTreeMap<String, api::Team>,
    pub projects: BTreeMap<String, api::Project>,
    pub users: BTreeMap<String, api::User>,
    /// By token hash.
    pub tokens: BTreeMap<String, TokenRec>,
    pub queues: BTreeMap<String, QueueSpec>,
    /// Inference services by name.
    pub services: BTreeMap<String, ServiceRec>,
    /// Reservations by name (ended ones too, until deleted).
    pub reservations: BTreeMap<String, api::Reservation>,
    /// Prices for cost reports, set by admins.
    pub prices: api::Prices,
}

/// Everything the server knows. The committed records ([`Records`]) and
/// the jobs and nodes with their indexes are private: records change only
/// as committed changes are published, jobs and nodes only through
/// `put_*`, which keep the indexes in step. The public fields are the
/// working state of the server's own loops, each with one writer: ids
/// and idempotency keys of submissions, the last cycle's output, the
/// accounting figures the budget loop counts, metrics, webhooks' outbox.
#[derive(Default)]
pub struct World {
    /// Read through [`World::records`].
    records: Records,
    nodes: BTreeMap<String, NodeRec>,
    /// Node token hash → node name (kept in step with `nodes` by
    /// [`World::put_node`]).
    node_by_token: BTreeMap<String, String>,
    /// Each node shape the submit path checks against, with how many nodes
    /// have it (kept in step with `nodes` by [`World::put_node`]).
    node_shapes: BTreeMap<crate::feasible::NodeShape, usize>,
    /// Boxed: a record is about 1 KB, and a map's nodes hold their values
    /// inline, filled about half when ids only grow.
    jobs: BTreeMap<u64, Box<JobRec>>,
    /// Node name → the allocated jobs with a task there (kept in step with
    /// `jobs` by [`World::put_job`]), so a heartbeat reads its node's jobs
    /// only, not every job ever submitted.
    on_node: BTreeMap<String, std::collections::BTreeSet<u64>>,
    /// Every job ever submitted, in brief (for lists and access checks):
    /// `jobs` holds the unfinished ones and those finished lately only; the
    /// store has every one in full.
    summaries: BTreeMap<u64, JobSummary>,
    pub next_job: u64,
    /// (user, idempotency key) → job.
    pub idempotency: BTreeMap<(String, String), u64>,
    /// Submitted jobs whose ids are taken but that the store does not have
    /// yet ([`crate::groupcommit`]): a retry with the same idempotency key
    /// is told to wait instead of being told of a job that may not last.
    pub storing: std::collections::BTreeSet<u64>,
    /// The hash of the agents' join token.
    pub join_hash: String,
    /// This installation, as its agents tell it from another on a node.
    pub installation: Installation,
    /// The last cycle's explanation of each pending job.
    pub why: BTreeMap<u64, api::Why>,
    /// Pending jobs the last cycle did not reach (explained by their
    /// position alone): `why` diagnoses them when asked.
    pub unreached: std::collections::BTreeSet<u64>,
    /// Diagnoses of unreached jobs made since the last cycle (`None`: the
    /// core was not asked), so polling `why` costs one per job per cycle.
    pub diagnosed: BTreeMap<u64, Option<Vec<String>>>,
    /// Scheduler memory between cycles (decayed usage, disruptions), by queue name.
    pub history: SavedHistory,
    /// When `history` was last written to the store.
    pub history_saved_at: u64,
    /// Each budgeted queue's use in its current period (in its budget's unit), as last
    /// counted from the ledger: (period start, GPU-hours or cost).
    pub budget_used: BTreeMap<String, (u64, f64)>,
    /// Each budgeted project's use in its current period, as `budget_used`.
    pub project_budget_used: BTreeMap<String, (u64, f64)>,
    /// What `/metrics` counts since the server started (memory only).
    pub stats: Stats,
    /// GPU-seconds of every closed hold of the ledger, per team: counted
    /// from every job as the store is loaded, then as holds close.
    pub team_closed_gpu_s: BTreeMap<String, f64>,
    /// Webhooks, their queued notifications and delivery logs.
    pub hooks: Hooks,
    /// Budgets said to be low, by `queue/NAME` or `project/NAME`, with the
    /// period they were said in.
    pub budget_warned: BTreeMap<String, u64>,
    /// Unfinished workloads other schedulers run (`external.rs`), by id.
    external: BTreeMap<u64, JobRec>,
    /// (cluster, key) → the id of its unfinished workload.
    external_keys: BTreeMap<(String, String), u64>,
    /// What each user's jobs of each kind ran lately, from the jobs that
    /// succeeded since the server started: running jobs' expected runtimes
    /// for start estimates (reservations and backfill keep to the declared
    /// maximum).
    pub runtimes: gpuflow_core::schedule::RecentRuntimes<api::Kind>,
    /// Counts [`World::put_job`]s and the [`World::put_node`]s that change
    /// a node: each job in memory has the count of its last put
    /// ([`World::job_rev`]), each node those of its last changes
    /// ([`NodeRevs`]), so the cycle can tell what changed since it read
    /// them.
    puts: u64,
    /// By id, as `jobs` (the same ids): read beside it in order.
    job_revs: BTreeMap<u64, u64>,
    /// The finished jobs in memory by (finish time, id), so that letting
    /// them leave ([`World::prune_finished`]) reads only those that leave.
    finished: std::collections::BTreeSet<(u64, u64)>,
    /// By name, as `nodes` (the same names): read beside it in order.
    node_revs: BTreeMap<String, NodeRevs>,
    /// The pending jobs that wait on others (`waits_on` not empty), by id:
    /// the timers settle these without walking every job.
    waiting: std::collections::BTreeSet<u64>,
    /// Counts changes of the records ([`World::records_rev`]).
    records_rev: u64,
}

/// A node's revisions ([`World::revision`] at its last changes).
#[derive(Clone, Copy, Debug, Default, PartialEq)]
pub struct NodeRevs {
    /// Changed by a put that changes what the scheduler reads of it
    /// ([`same_shape`]), not by heartbeats: the applier drops decisions
    /// made on another shape.
    pub shape: u64,
    /// Changed by a put that changes its state or anything its agent
    /// reports of what it has (GPU health included): the cycle reads its
    /// running jobs' allocations again.
    pub inventory: u64,
}

/// Whether two records of a node agree on everything the scheduler reads
/// of it: its state, CPU, memory, GPUs (UUID, model, memory), labels and
/// pool; not its heartbeat, address or utilisation.
fn same_shape(a: &NodeRec, b: &NodeRec) -> bool {
    let (x, y) = (&a.inventory, &b.inventory);
    a.state == b.state
        && x.cpu_milli == y.cpu_milli
        && x.memory_mib == y.memory_mib
        && x.gpus.len() == y.gpus.len()
        && x.gpus
            .iter()
            .zip(&y.gpus)
            .all(|(g, h)| g.uuid == h.uuid && g.model == h.model && g.memory_mib == h.memory_mib)
        && x.labels == y.labels
        && x.pool == y.pool
}

/// Bounds of the duration histograms, in seconds.
pub const SECONDS_BUCKETS: [f64; 11] = [
    0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5,
];

/// A histogram of durations in seconds (Prometheus's, cumulative on output).
#[derive(Clone, Debug, Default)]
pub struct Histogram {
    /// Observations at or below each bound of [`SECONDS_BUCKETS`].
    pub counts: [u64; 11],
    pub sum: f64,
    pub count: u64,
}

impl Histogram {
    pub fn observe(&mut self, v: f64) {
        for (i, b) in SECONDS_BUCKETS.iter().enumerate() {
            if v <= *b {
                self.counts[i] += 1;
            }
        }
        self.sum += v;
        self.count += 1;
    }
}

/// Bounds of the wait histogram, seconds.
pub const WAIT_BUCKETS: [u64; 9] = [1, 10, 60, 300, 900, 1800, 3600, 4 * 3600, 86_400];

/// Waits from submission to a job's first start since the server started
/// (cumulative, as Prometheus counts them).
#[derive(Clone, Debug, Default)]
pub struct Waits {
    /// Observations at or below each bound of [`WAIT_BUCKETS`].
    pub counts: [u64; 9],
    pub sum: f64,
    pub count: u64,
}

impl Waits {
    pub fn observe(&mut self, secs: u64) {
        for (i, b) in WAIT_BUCKETS.iter().enumerate() {
            if secs <= *b {
                self.counts[i] += 1;
            }
        }
        self.sum += secs as f64;
        self.count += 1;
    }
}

/// Counters and timings since the server started.
#[derive(Clone, Debug, Default)]
pub struct Stats {
    pub cycle_take: Histogram,
    pub cycle_compute: Histogram,
    pub cycle_apply: Histogram,
    pub commit: Histogram,
    pub admissions: u64,
    pub preemptions: u64,
    /// Admissions and preemptions (of its jobs) per queue.
    pub admissions_by_queue: BTreeMap<String, u64>,
    pub preemptions_by_queue: BTreeMap<String, u64>,
    /// Waits to a first start, by job kind.
    pub waits: BTreeMap<&'static str, Waits>,
    pub lost_gpu_hours: f64,
    /// GPUs free after the last cycle that waiting work could hold, quota
    /// aside, and when that cycle ran.
    pub idle_waiting_gpus: f64,
    pub idle_waiting_at: u64,
    /// Those GPUs over time since the server started.
    pub idle_waiting_gpu_hours: f64,
}

/// The core's `History` keyed by queue names, so it survives restarts and
/// changes of the queue set (the core's queue ids are positions).
#[derive(Clone, Debug, Default, PartialEq, Serialize, Deserialize)]
pub struct SavedHistory {
    pub usage: BTreeMap<String, f64>,
    pub decayed_at: u64,
    pub disruptions: BTreeMap<String, Vec<(u64, f64)>>,
    pub waiting_for: BTreeMap<u64, Vec<u64>>,
    /// When the last consolidation started (absent in records written
    /// before consolidation).
    #[serde(default)]
    pub consolidated_at: Option<u64>,
    /// Jobs within their guarantee holding nodes from new borrowing, and
    /// the flavor (absent in records written before holds).
    #[serde(default)]
    pub holding: BTreeMap<u64, String>,
    /// Jobs reclaimed from, and the running jobs that reclaimed from them
    /// (absent in records written before).
    #[serde(default)]
    pub reclaimed_by: BTreeMap<u64, Vec<u64>>,
}

impl SavedHistory {
    pub fn to_core(&self, queues: &gpuflow_core::queue::Queues) -> gpuflow_core::schedule::History {
        let named = gpuflow_core::schedule::NamedHistory {
            usage: self.usage.clone(),
            decayed_at: self.decayed_at,
            disruptions: self.disruptions.clone(),
            waiting_for: self.waiting_for.clone(),
            consolidated_at: self.consolidated_at,
            holding: self.holding.clone(),
            reclaimed_by: self.reclaimed_by.clone(),
        };
        gpuflow_core::schedule::History::from_named(&named, queues)
    }

    pub fn from_core(
        h: &gpuflow_core::schedule::History,
        queues: &gpuflow_core::queue::Queues,
    ) -> SavedHistory {
        let named = h.named(queues);
        SavedHistory {
            usage: named.usage,
            decayed_at: named.decayed_at,
            disruptions: named.disruptions,
            waiting_for: named.waiting_for,
            consolidated_at: named.consolidated_at,
            holding: named.holding,
            reclaimed_by: named.reclaimed_by,
        }
    }

    pub fn record(&self) -> Record {
        put(Table::Meta, "history", "", "", self)
    }
}

pub fn put<T: Serialize>(table: Table, key: &str, team: &str, state: &str, v: &T) -> Record {
    Record {
        table,
        key: key.into(),
        team: team.into(),
        state: state.into(),
        doc: serde_json::to_string(v).expect("serialises"),
    }
}

pub fn team_rec(t: &api::Team) -> Record {
    put(Table::Teams, &t.name, &t.name, "", t)
}
pub fn project_rec(p: &api::Project) -> Record {
    put(Table::Projects, &p.name, &p.team, "", p)
}
/// An installation's identity on its nodes: a random id, and the block of
/// uids its teams' tasks run under (`--task-uid-base` plus the block times
/// [`api::UID_BLOCK`] plus the team's number), so that two installations
/// sharing a node do not give their teams the same uids.
#[derive(Clone, Debug, Default, PartialEq, Eq, serde::Serialize, serde::Deserialize)]
pub struct Installation {
    pub id: String,
    pub uid_block: u32,
}

pub fn installation_rec(i: &Installation) -> Record {
    put(Table::Meta, "installation", "", "", i)
}

pub fn user_rec(u: &api::User) -> Record {
    put(Table::Users, &u.name, &u.team, u.role.as_str(), u)
}
pub fn token_rec(t: &TokenRec) -> Record {
    put(Table::Tokens, &t.hash, "", "", t)
}
pub fn queue_rec(q: &QueueSpec) -> Record {
    put(Table::Queues, &q.name, &q.team, "", q)
}

/// An inference service: its spec, the version of its task (bumped by each
/// change of the task) and its owners. Kept in the meta table under
/// `service/NAME`.
#[derive(Clone, Debug, PartialEq, Serialize, Deserialize)]
pub struct ServiceRec {
    pub spec: api::ServiceSpec,
    pub version: u32,
    pub team: String,
    pub user: String,
    /// Deleted: its replicas are being stopped; gone once none is left.
    #[serde(default)]
    pub deleted: bool,
}

pub fn reservation_rec(r: &api::Reservation) -> Record {
    put(Table::Meta, &format!("reservation/{}", r.name), "", "", r)
}

pub fn service_rec(s: &ServiceRec) -> Record {
    put(
        Table::Meta,
        &format!("service/{}", s.spec.name),
        &s.team,
        "",
        s,
    )
}

/// A job that is a replica of a service, of its task's `version`.
#[serde_with::skip_serializing_none]
#[derive(Clone, Debug, PartialEq, Serialize, Deserialize)]
pub struct ServiceRef {
    pub name: String,
    pub version: u32,
    #[serde(default)]
    pub readiness: Option<gpuflow_api::job::Readiness>,
}

fn parse<T: for<'de> Deserialize<'de>>(r: &Record) -> Result<T, ServerError> {
    serde_json::from_str(&r.doc).map_err(|e| ServerError::Corrupt {
        what: format!("{:?} {}", r.table, r.key),
        message: e.to_string(),
    })
}

/// GPU-seconds of a job's closed holds.
fn closed_gpu_s(j: &JobRec) -> f64 {
    j.held
        .iter()
        .filter(|h| h.to.is_some())
        .map(|h| h.gpu_s(0, u64::MAX, 0))
        .sum()
}

impl World {
    /// Reads everything from the store.
    ///
    /// # Errors
    /// On a store error or a record that does not parse.
    pub async fn load(store: &dyn Store) -> Result<World, ServerError> {
        let mut w = World::default();
        for r in store.load(Table::Teams).await? {
            let t: api::Team = parse(&r)?;
            w.records.teams.insert(t.name.clone(), t);
        }
        // Teams stored before teams had numbers get the next free ones (in
        // name order; kept when the team is next written).
        let mut next = w.records().teams.values().map(|t| t.uid).max().unwrap_or(0);
        for t in w.records.teams.values_mut().filter(|t| t.uid == 0) {
            next += 1;
            t.uid = next;
        }
        for r in store.load(Table::Projects).await? {
            let p: api::Project = parse(&r)?;
            w.records.projects.insert(p.name.clone(), p);
        }
        for r in store.load(Table::Users).await? {
            let u: api::User = parse(&r)?;
            w.records.users.insert(u.name.clone(), u);
        }
        for r in store.load(Table::Tokens).await? {
            let t: TokenRec = parse(&r)?;
            w.records.tokens.insert(t.hash.clone(), t);
        }
        for r in store.load(Table::Queues).await? {
            let q: QueueSpec = parse(&r)?;
            w.records.queues.insert(q.name.clone(), q);
        }
        for r in store.load(Table::Nodes).await? {
            let n: NodeRec = parse(&r)?;
            w.put_node(n);
        }
        for r in store.load(Table::Jobs).await? {
            let j: JobRec = parse(&r)?;
            w.next_job = w.next_job.max(j.id);
            if j.external.is_some() {
                w.put_external(j);
                continue;
            }
            if let Some(k) = &j.idempotency_key {
                w.idempotency.insert((j.user.clone(), k.clone()), j.id);
            }
            w.put_job(j);
        }
        for r in store.load(Table::Meta).await? {
            if r.key == "join_hash" {
                w.join_hash = r.doc.clone();
            }
            if r.key == "installation" {
                w.installation = parse(&r)?;
            }
            if r.key == "history" {
                w.history = parse(&r)?;
            }
            if r.key == "prices" {
                w.records.prices = parse(&r)?;
            }
            if r.key.starts_with("service/") {
                let s: ServiceRec = parse(&r)?;
                w.records.services.insert(s.spec.name.clone(), s);
            }
            if r.key.starts_with("reservation/") {
                let v: api::Reservation = parse(&r)?;
                w.records.reservations.insert(v.name.clone(), v);
            }
            if r.key.starts_with("webhook/") {
                let h: WebhookRec = parse(&r)?;
                w.hooks.by_id.insert(h.id.clone(), h);
            }
        }
        Ok(w)
    }

    /// Counts the holds `j` closed since it had `old_closed` GPU-seconds
    /// of closed holds in its team's GPU-seconds.
    fn count_closed(&mut self, j: &JobRec, old_closed: f64) {
        // A finished job never changes, so a job is never put again after
        // it left memory: each hold is counted once as it closes.
        let grown = closed_gpu_s(j) - old_closed;
        if grown != 0.0 {
            *self.team_closed_gpu_s.entry(j.team.clone()).or_default() += grown;
        }
    }

    /// Puts a workload another scheduler runs: kept in [`World::external`]
    /// while unfinished, never in [`World::jobs`].
    pub fn put_external(&mut self, j: JobRec) {
        let old = self.external.remove(&j.id);
        self.count_closed(&j, old.as_ref().map_or(0.0, closed_gpu_s));
        self.next_job = self.next_job.max(j.id);
        self.summaries.insert(j.id, JobSummary::of(&j));
        let Some(e) = j.external.clone() else {
            return;
        };
        if j.state.finished() {
            self.external_keys.remove(&(e.cluster, e.key));
        } else {
            self.external_keys.insert((e.cluster, e.key), j.id);
            self.external.insert(j.id, j);
        }
    }

    /// The jobs in memory (unfinished, and finished lately), by id; they
    /// change only through [`World::put_job`], which keeps the indexes in
    /// step.
    pub fn jobs(&self) -> &BTreeMap<u64, Box<JobRec>> {
        &self.jobs
    }

    /// Every job ever submitted, in brief, by id.
    pub fn summaries(&self) -> &BTreeMap<u64, JobSummary> {
        &self.summaries
    }

    /// The nodes by name; they change only through [`World::put_node`]
    /// (and [`World::heard_from`]), which keep the token index in step.
    pub fn nodes(&self) -> &BTreeMap<String, NodeRec> {
        &self.nodes
    }

    /// Each node shape, with how many nodes have it.
    pub fn node_shapes(&self) -> &BTreeMap<crate::feasible::NodeShape, usize> {
        &self.node_shapes
    }

    /// Node name → the allocated jobs with a task there, as the index
    /// heartbeats read ([`World::jobs_on`]).
    pub fn on_node(&self) -> &BTreeMap<String, std::collections::BTreeSet<u64>> {
        &self.on_node
    }

    /// The node whose token has this hash.
    pub fn node_of_token(&self, hash: &str) -> Option<&str> {
        self.node_by_token.get(hash).map(String::as_str)
    }

    /// A heartbeat's liveness and GPU samples, kept in memory only (not
    /// stored every time): nothing an index reads.
    pub fn heard_from(&mut self, node: &str, at: u64, gpus_now: Vec<api::GpuSample>) {
        if let Some(n) = self.nodes.get_mut(node) {
            n.last_heartbeat = at;
            n.gpus_now = gpus_now;
        }
    }

    /// Counts every node as heard from at `t` (a server starting: the
    /// heartbeats missed while it was down say nothing about the nodes).
    pub fn wait_for_heartbeats(&mut self, t: u64) {
        for n in self.nodes.values_mut() {
            n.last_heartbeat = n.last_heartbeat.max(t);
        }
    }

    /// Unfinished workloads other schedulers run, by id.
    pub fn external(&self) -> &BTreeMap<u64, JobRec> {
        &self.external
    }

    /// The unfinished workload a cluster reports under `key`.
    pub fn external_id(&self, cluster: &str, key: &str) -> Option<u64> {
        self.external_keys
            .get(&(cluster.to_string(), key.to_string()))
            .copied()
    }

    /// Puts a job, keeping the index by node in step.
    pub fn put_job(&mut self, j: impl Into<Box<JobRec>>) {
        let j: Box<JobRec> = j.into();
        self.count_closed(&j, self.jobs.get(&j.id).map_or(0.0, |o| closed_gpu_s(o)));
        // A job that just succeeded: how long its last run took.
        let was_done = self.jobs.get(&j.id).is_some_and(|o| o.state.finished());
        if j.state == api::JobState::Succeeded
            && !was_done
            && let Some(h) = j.held.last()
            && let Some(end) = h.to.or(j.finished_at)
        {
            self.runtimes
                .record(&j.user, j.spec.kind, end.saturating_sub(h.from));
        }
        if let Some(old) = self.jobs.get(&j.id)
            && old.state.finished()
        {
            self.finished
                .remove(&(old.finished_at.unwrap_or(0), old.id));
        }
        if j.state.finished() {
            self.finished.insert((j.finished_at.unwrap_or(0), j.id));
        }
        if let Some(old) = self.jobs.get(&j.id) {
            for a in &old.allocs {
                if let Some(ids) = self.on_node.get_mut(&a.node) {
                    ids.remove(&old.id);
                }
            }
        }
        if j.state.allocated() {
            for a in &j.allocs {
                self.on_node.entry(a.node.clone()).or_default().insert(j.id);
            }
        }
        if j.state == api::JobState::Pending && !j.waits_on.is_empty() {
            self.waiting.insert(j.id);
        } else {
            self.waiting.remove(&j.id);
        }
        self.summaries.insert(j.id, JobSummary::of(&j));
        self.puts += 1;
        self.job_revs.insert(j.id, self.puts);
        self.jobs.insert(j.id, j);
    }

    /// The pending jobs that wait on others, by id.
    pub fn waiting_jobs(&self) -> impl Iterator<Item = &JobRec> {
        debug_assert_eq!(
            self.waiting.len(),
            self.jobs
                .values()
                .filter(|j| j.state == api::JobState::Pending && !j.waits_on.is_empty())
                .count(),
            "the index of waiting jobs is out of step"
        );
        self.waiting.iter().map(|id| &*self.jobs[id])
    }

    /// Job `id`'s revision: it changes with every [`World::put_job`] of it
    /// (0 for a job not in memory).
    pub fn job_rev(&self, id: u64) -> u64 {
        self.job_revs.get(&id).copied().unwrap_or(0)
    }

    /// Each job's id and revision ([`World::job_rev`]), in id order.
    pub fn job_revs(&self) -> impl Iterator<Item = (u64, u64)> {
        self.job_revs.iter().map(|(&id, &rev)| (id, rev))
    }

    /// The jobs in memory by id, as [`World::jobs`], each with its
    /// revision ([`World::job_rev`]).
    pub fn jobs_and_revs(&self) -> impl Iterator<Item = (&JobRec, u64)> {
        debug_assert_eq!(self.jobs.len(), self.job_revs.len());
        self.jobs
            .values()
            .zip(self.job_revs.iter())
            .map(|(j, (id, rev))| {
                debug_assert_eq!(j.id, *id, "a job's revision is out of step");
                (&**j, *rev)
            })
    }

    /// Node `name`'s revisions (0 for an unknown node).
    pub fn node_revs(&self, name: &str) -> NodeRevs {
        self.node_revs.get(name).copied().unwrap_or_default()
    }

    /// Each node's revisions, in name order (as [`World::nodes`]).
    pub fn all_node_revs(&self) -> impl Iterator<Item = NodeRevs> {
        debug_assert_eq!(self.nodes.len(), self.node_revs.len());
        self.node_revs.values().copied()
    }

    /// The revision now: every revision given so far is at most this.
    pub fn revision(&self) -> u64 {
        self.puts
    }

    /// The records' revision: it changes with every record put or removed.
    pub fn records_rev(&self) -> u64 {
        self.records_rev
    }

    /// Lets jobs finished before `t - keep_s` leave memory (the store keeps
    /// them; reads fetch them from there). Returns how many left.
    pub fn prune_finished(&mut self, t: u64, keep_s: u64) -> usize {
        let mut old = Vec::new();
        while let Some(&(at, id)) = self.finished.first()
            && at + keep_s < t
        {
            self.finished.pop_first();
            old.push(id);
        }
        debug_assert!(
            self.jobs.values().all(|j| !(j.state.finished()
                && j.finished_at.unwrap_or(0) + keep_s < t)
                || old.contains(&j.id)),
            "a finished job is missing from the index"
        );
        for id in &old {
            self.jobs.remove(id);
            self.job_revs.remove(id);
            self.waiting.remove(id);
            self.why.remove(id);
            self.unreached.remove(id);
            self.diagnosed.remove(id);
        }
        old.len()
    }

    /// Where the server and other nodes reach node `node`: the address it
    /// registered, else this host (`gpuflow up`'s local agent).
    pub fn node_address(&self, node: &str) -> String {
        self.nodes
            .get(node)
            .map(|n| n.address.clone())
            .filter(|a| !a.is_empty())
            .unwrap_or_else(|| "127.0.0.1".into())
    }

    /// The allocated jobs with a task on `node`, in id order.
    pub fn jobs_on<'w>(&'w self, node: &str) -> impl Iterator<Item = &'w JobRec> + 'w {
        self.on_node
            .get(node)
            .into_iter()
            .flatten()
            .filter_map(|id| self.jobs.get(id).map(|j| &**j))
    }

    /// The records users and admins change through the API.
    pub fn records(&self) -> &Records {
        &self.records
    }

    /// Puts a committed record: `commit`'s publication, loading, and tests
    /// that stage a state the API refuses (as [`World::put_node`]).
    pub fn put_record(&mut self, rec: crate::Rec) {
        use crate::Rec;
        self.records_rev += 1;
        let r = &mut self.records;
        match rec {
            Rec::Team(t) => {
                r.teams.insert(t.name.clone(), t);
            }
            Rec::Project(p) => {
                r.projects.insert(p.name.clone(), p);
            }
            Rec::User(u) => {
                r.users.insert(u.name.clone(), u);
            }
            Rec::Token(t) => {
                r.tokens.insert(t.hash.clone(), t);
            }
            Rec::Queue(q) => {
                r.queues.insert(q.name.clone(), q);
            }
            Rec::Service(s) => {
                r.services.insert(s.spec.name.clone(), *s);
            }
            Rec::Reservation(v) => {
                r.reservations.insert(v.name.clone(), v);
            }
            Rec::Webhook(h) => {
                self.hooks.by_id.insert(h.id.clone(), h);
            }
            Rec::Prices(p) => r.prices = p,
        }
    }

    /// Removes a record a committed change removed.
    pub fn remove_record(&mut self, gone: crate::Gone) {
        use crate::Gone;
        self.records_rev += 1;
        let r = &mut self.records;
        match gone {
            Gone::Token(h) => {
                r.tokens.remove(&h);
            }
            Gone::Queue(q) => {
                r.queues.remove(&q);
            }
            Gone::Service(s) => {
                r.services.remove(&s);
            }
            Gone::Reservation(v) => {
                r.reservations.remove(&v);
            }
            Gone::Webhook(id) => {
                self.hooks.by_id.remove(&id);
                self.hooks.log.remove(&id);
                self.hooks.outbox.retain(|o| o.hook != id);
            }
        }
    }

    /// Puts a node, keeping the token index and the shape counts in step.
    pub fn put_node(&mut self, n: NodeRec) {
        let old = self.nodes.get(&n.name);
        let reshaped = old.is_none_or(|old| !same_shape(old, &n));
        let changed = old.is_none_or(|old| old.state != n.state || old.inventory != n.inventory);
        if reshaped || changed {
            self.puts += 1;
            let revs = self.node_revs.entry(n.name.clone()).or_default();
            if reshaped {
                revs.shape = self.puts;
            }
            if changed {
                revs.inventory = self.puts;
            }
        }
        if let Some(old) = self.nodes.get(&n.name) {
            self.node_by_token.remove(&old.token_hash);
            let shape = crate::feasible::NodeShape::of(&old.inventory);
            if let Some(k) = self.node_shapes.get_mut(&shape) {
                *k -= 1;
                if *k == 0 {
                    self.node_shapes.remove(&shape);
                }
            }
        }
        *self
            .node_shapes
            .entry(crate::feasible::NodeShape::of(&n.inventory))
            .or_default() += 1;
        if !n.token_hash.is_empty() {
            self.node_by_token
                .insert(n.token_hash.clone(), n.name.clone());
        }
        self.nodes.insert(n.name.clone(), n);
    }

    /// The caller's user record for a token hash.
    /// The user a live token belongs to, with the token; `None` for an
    /// unknown, expired or revoked token or a disabled user.
    /// The user a token names and its record, or why it names none.
    ///
    /// # Errors
    /// Why the token is refused.
    pub fn principal(&self, hash: &str, now: u64) -> Result<(&api::User, &TokenRec), Refused> {
        let t = self.records.tokens.get(hash).ok_or(Refused::Unknown)?;
        if let Some(r) = &t.revoked {
            return Err(Refused::Revoked(r.clone()));
        }
        if let Some(at) = t.expires_at.filter(|&e| now >= e) {
            return Err(Refused::Expired { at });
        }
        let u = self.records.users.get(&t.user).ok_or(Refused::Unknown)?;
        if u.disabled {
            return Err(Refused::Disabled {
                user: u.name.clone(),
            });
        }
        Ok((u, t))
    }

    /// GPU indices in use per node, from the allocations of jobs that hold GPUs.
    /// Who holds each node's GPUs, per node; another team's holds are
    /// anonymous unless `sees` its team.
    pub fn holders(&self, sees: impl Fn(&str) -> bool) -> BTreeMap<String, Vec<api::GpuHolder>> {
        let mut out: BTreeMap<String, Vec<api::GpuHolder>> = BTreeMap::new();
        for j in self.jobs.values().filter(|j| j.state.allocated()) {
            let seen = sees(&j.team);
            for a in &j.allocs {
                let Some(group) = j.spec.tasks.get(a.group as usize) else {
                    continue;
                };
                let ask = crate::convert::gpu_request(group);
                let (mode, milli, profile) = match &ask {
                    gpuflow_core::request::GpuRequest::None => continue,
                    gpuflow_core::request::GpuRequest::Whole { .. } => ("whole", 1000, None),
                    gpuflow_core::request::GpuRequest::Fraction { .. } => {
                        ("fraction", ask.quota_milli(), None)
                    }
                    gpuflow_core::request::GpuRequest::TimeSlice { .. } => {
                        ("time-slice", ask.quota_milli(), None)
                    }
                    gpuflow_core::request::GpuRequest::Mig { profile } => {
                        ("mig", ask.quota_milli(), Some(profile.clone()))
                    }
                };
                for gpu in a.pick.gpus() {
                    out.entry(a.node.clone()).or_default().push(api::GpuHolder {
                        gpu,
                        team: if seen { j.team.clone() } else { String::new() },
                        job: seen.then_some(j.id),
                        mode: mode.to_string(),
                        milli: milli as u32,
                        profile: profile.clone(),
                    });
                }
            }
        }
        out
    }

    pub fn gpus_in_use(&self) -> BTreeMap<&str, Vec<u32>> {
        let mut used: BTreeMap<&str, Vec<u32>> = BTreeMap::new();
        for j in self.jobs.values().filter(|j| j.state.allocated()) {
            for a in &j.allocs {
                used.entry(a.node.as_str())
                    .or_default()
                    .extend(a.pick.gpus());
            }
        }
        for v in used.values_mut() {
            v.sort_unstable();
            v.dedup();
        }
        used
    }

    pub fn is_admin(u: &api::User) -> bool {
        u.role == Role::Admin
    }
}

// Records that the modules acting on them (output, depend, webhooks)
// define their behaviour for; kept here so that the state depends on none
// of them.

/// How far one task's stream reached.
#[derive(Clone, Debug, Default, PartialEq, Eq, Serialize, Deserialize)]
pub struct Mark {
    /// The node that ships it.
    pub node: String,
    /// Bytes of the stream received.
    pub end: u64,
    /// Bytes of it in the store's log: a prefix, since nothing after a
    /// piece over the job's limit is stored.
    pub kept: u64,
}

/// A dependency not met yet: what it waits for of which job.
#[derive(Clone, Debug, PartialEq, Eq, Serialize, Deserialize)]
pub struct Wait {
    pub kind: gpuflow_api::DepKind,
    pub job: u64,
}

/// A stored webhook.
#[derive(Clone, Debug, PartialEq, Serialize, Deserialize)]
pub struct WebhookRec {
    pub id: String,
    /// Where it POSTs (empty for mail).
    pub url: String,
    /// Where it mails instead (absent in records written before mail).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub mail: Option<String>,
    pub events: Vec<String>,
    /// The team whose jobs it reports; with `user`, that user's jobs in it
    /// (in any team when empty: an admin of no team).
    pub team: String,
    /// Whose jobs; `None`: the team's.
    pub user: Option<String>,
    pub secret: String,
    pub created_by: String,
    pub created_at: u64,
}

impl WebhookRec {
    pub fn view(&self, with_secret: bool) -> gpuflow_api::WebhookView {
        gpuflow_api::WebhookView {
            id: self.id.clone(),
            url: (!self.url.is_empty()).then(|| self.url.clone()),
            mail: self.mail.clone(),
            events: self.events.clone(),
            team: self.team.clone(),
            user: self.user.clone(),
            created_by: self.created_by.clone(),
            created_at: self.created_at,
            secret: with_secret.then(|| self.secret.clone()),
        }
    }

    pub fn record(&self) -> gpuflow_store::Record {
        put(
            gpuflow_store::Table::Meta,
            &format!("webhook/{}", self.id),
            &self.team,
            "",
            self,
        )
    }

    /// The name it is notified of a job event `kind` by, if any: the most
    /// specific it asked for (a failed job is `fail`, else `end`).
    pub(crate) fn wants(&self, kind: &str) -> Option<&'static str> {
        use crate::event::EventKind as K;
        let names: &[&'static str] = match K::from_name(kind) {
            Some(K::Running) => &["begin"],
            Some(K::Succeeded | K::Cancelled | K::DependencyNeverMet) => &["end"],
            Some(K::Failed) => &["fail", "end"],
            Some(K::Timeout) => &["timeout", "end"],
            Some(K::Preempted) => &["preempted"],
            Some(K::Requeued) => &["requeued"],
            _ => &[],
        };
        let all = self.events.iter().any(|e| e == "all");
        names
            .iter()
            .copied()
            .find(|n| all || self.events.iter().any(|e| e == n))
    }
}

/// A notification waiting to be sent.
#[derive(Clone, Debug)]
pub struct Outgoing {
    pub hook: String,
    pub delivery: u64,
    pub event: String,
    pub job: u64,
    pub body: String,
    pub attempt: u32,
    pub due: std::time::Instant,
}

/// Webhooks and what they have to send.
#[derive(Default)]
pub struct Hooks {
    pub by_id: BTreeMap<String, WebhookRec>,
    pub outbox: std::collections::VecDeque<Outgoing>,
    pub log: BTreeMap<String, std::collections::VecDeque<gpuflow_api::Delivery>>,
    pub seq: u64,
}

#[cfg(test)]
mod tests {
    use std::collections::BTreeMap;

    use gpuflow_core::queue::{Queue, QueueId, Queues};
    use gpuflow_core::schedule::History;

    use super::*;

    fn queues(names: &[&str]) -> Queues {
        Queues::new(
            names.iter().map(|n| Queue::new(n, None)).collect(),
            BTreeMap::new(),
        )
        .unwrap()
    }

    /// A node's shape revision changes with what the scheduler reads of it
    /// (the applier drops decisions made on another shape), not with a
    /// heartbeat's time or a new address.
    #[test]
    fn a_nodes_shape_revision_follows_what_the_scheduler_reads() {
        let inventory: api::Inventory = serde_json::from_str(
            r#"{"cpu_milli": 1000, "memory_mib": 1024, "gpus": [], "emulated": true}"#,
        )
        .unwrap();
        let (n, _) = crate::nodes::joined("n1", inventory, "h".into(), 100);
        let mut world = World::default();
        assert_eq!(world.node_revs("n1").shape, 0);
        world.put_node(n.clone());
        let first = world.node_revs("n1").shape;
        assert_ne!(first, 0);
        let mut beat = n.clone();
        beat.last_heartbeat = 200;
        beat.address = "10.0.0.9".into();
        world.put_node(beat.clone());
        assert_eq!(
            world.node_revs("n1").shape,
            first,
            "a heartbeat is no new shape"
        );
        for change in [
            |n: &mut NodeRec| n.state = NodeState::Cordoned,
            |n: &mut NodeRec| n.inventory.cpu_milli += 1,
            |n: &mut NodeRec| n.inventory.pool = "p".into(),
            |n: &mut NodeRec| {
                n.inventory.labels.insert("rack".into(), "r1".into());
            },
        ] {
            let before = world.node_revs("n1").shape;
            let mut other = world.nodes()["n1"].clone();
            change(&mut other);
            world.put_node(other);
            assert!(world.node_revs("n1").shape > before);
        }
    }

    #[tokio::test]
    async fn history_follows_queue_names_across_restarts() {
        let before = queues(&["a", "b"]);
        let mut h = History::default();
        h.usage.insert(QueueId(1), 42.0);
        h.disruptions.insert(QueueId(0), vec![(7, 1.5)]);
        h.decayed_at = 99;
        let saved = SavedHistory::from_core(&h, &before);
        assert_eq!(saved.usage["b"], 42.0);
        // Stored and loaded again, then read against a queue set where "b"
        // has another position and "a" is gone.
        let dir = tempfile::tempdir().unwrap();
        let store = gpuflow_store::open(&format!("sqlite://{}", dir.path().join("db").display()))
            .await
            .unwrap();
        let mut batch = gpuflow_store::Batch::default();
        batch.put.push(saved.record());
        store.commit(&batch).await.unwrap();
        let world = World::load(store.as_ref()).await.unwrap();
        let after = queues(&["b", "c"]);
        let back = world.history.to_core(&after);
        assert_eq!(back.usage, BTreeMap::from([(QueueId(0), 42.0)]));
        assert!(back.disruptions.is_empty());
        assert_eq!(back.decayed_at, 99);
    }
}
