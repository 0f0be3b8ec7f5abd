//! Everything else on the wire: job, node and queue views, admin requests,
//! events, and the agent protocol (register, heartbeat, desired tasks).

use std::collections::BTreeMap;

use schemars::JsonSchema;
use serde::{Deserialize, Serialize};

use crate::error::{ApiError, FieldError};
use crate::job::JobSpec;

/// Where a job is in its life.
#[derive(
    Clone,
    Copy,
    Debug,
    PartialEq,
    Eq,
    PartialOrd,
    Ord,
    Hash,
    Serialize,
    Deserialize,
    JsonSchema,
    strum::IntoStaticStr,
    strum::EnumString,
    strum::VariantArray,
)]
#[serde(rename_all = "kebab-case")]
#[strum(serialize_all = "kebab-case")]
pub enum JobState {
    /// Waiting for quota or capacity (also after a preemption or a retry).
    Pending,
    /// Held by an admin: never scheduled until released.
    Held,
    /// Suspended by its owner: GPUs released until resumed.
    Suspended,
    /// GPUs allocated; the agent has not started it yet.
    Admitted,
    /// Some of its tasks have started.
    Starting,
    /// All of its tasks run.
    Running,
    /// Told to stop (preempted, cancelled, suspended, over its max runtime);
    /// its GPUs are still in use until its tasks exit or the kill time.
    Stopping,
    Succeeded,
    Failed,
    /// Stopped for running past its max runtime (Slurm's `TIMEOUT`).
    Timeout,
    Cancelled,
}

impl JobState {
    /// Its name, as the API writes it.
    pub fn as_str(self) -> &'static str {
        self.into()
    }

    pub fn parse(s: &str) -> Option<JobState> {
        s.parse().ok()
    }

    /// Holds GPUs.
    pub fn allocated(self) -> bool {
        matches!(
            self,
            JobState::Admitted | JobState::Starting | JobState::Running | JobState::Stopping
        )
    }

    pub fn finished(self) -> bool {
        matches!(
            self,
            JobState::Succeeded | JobState::Failed | JobState::Timeout | JobState::Cancelled
        )
    }
}

pub const ALL_STATES: &[JobState] = <JobState as strum::VariantArray>::VARIANTS;

/// One task's placement and state.
#[serde_with::skip_serializing_none]
#[derive(Clone, Debug, PartialEq, Serialize, Deserialize, JsonSchema)]
pub struct TaskView {
    pub group: String,
    pub index: u32,
    pub node: String,
    /// GPU indices on the node (a MIG instance's: its GPU's).
    pub gpus: Vec<u32>,
    /// GPU share in milli-GPU when the GPU is shared.
    #[serde(default)]
    pub milli: Option<u32>,
    /// The MIG instance it holds, by its index on the GPU.
    #[serde(default)]
    pub mig_instance: Option<u32>,
    /// The UUIDs of what it holds (a MIG instance's own `MIG-…`).
    #[serde(default, skip_serializing_if = "Vec::is_empty")]
    pub uuids: Vec<String>,
    pub state: String,
    #[serde(default)]
    pub exit_code: Option<i32>,
    /// Its use of its GPUs, as its agent sampled it.
    #[serde(default)]
    pub usage: Option<TaskUsage>,
    /// While it runs: the ports it serves on by name, each with the path
    /// the server proxies to it (`/v1/jobs/{id}/proxy/{port}/`).
    #[serde(default, skip_serializing_if = "Vec::is_empty")]
    pub ports: Vec<PortView>,
    /// The digest of the image it runs in, once pulled.
    #[serde(default)]
    pub image_digest: Option<String>,
}

/// The label a node that can run images (runc, skopeo and umoci found)
/// gives itself, `true`; tasks with an image are placed only there.
pub const OCI_LABEL: &str = "gpuflow.io/oci";

/// How a task's image was pulled.
#[derive(Clone, Debug, Default, PartialEq, Serialize, Deserialize, JsonSchema)]
pub struct ImageReport {
    /// The manifest's digest (`sha256:…`).
    #[serde(default, skip_serializing_if = "String::is_empty")]
    pub digest: String,
    /// MiB fetched from the registry (0: it was in the node's cache).
    #[serde(default)]
    pub pulled_mib: f64,
    #[serde(default)]
    pub seconds: f64,
    /// Why it could not be pulled or run (the registry's words).
    #[serde(default, skip_serializing_if = "String::is_empty")]
    pub error: String,
    /// Being pulled now.
    #[serde(default, skip_serializing_if = "std::ops::Not::not")]
    pub pulling: bool,
}

/// A port a running task serves on.
#[derive(Clone, Debug, PartialEq, Serialize, Deserialize, JsonSchema)]
pub struct PortView {
    pub name: String,
    /// On its node.
    pub port: u16,
    /// Where the server proxies HTTP and WebSocket to it, for those who
    /// may see the job: `/v1/jobs/{id}/proxy/{port}/`.
    pub url: String,
}

/// A job as the API shows it.
#[serde_with::skip_serializing_none]
#[derive(Clone, Debug, PartialEq, Serialize, Deserialize, JsonSchema)]
pub struct Job {
    pub id: u64,
    pub name: String,
    pub team: String,
    pub queue: String,
    pub user: String,
    pub state: JobState,
    /// Why it is in this state (the last transition's reason).
    pub reason: String,
    pub submitted_at: u64,
    #[serde(default)]
    pub started_at: Option<u64>,
    #[serde(default)]
    pub finished_at: Option<u64>,
    /// A pending job's estimated start, as the last cycle saw it (`why`
    /// says more); absent when unknown.
    #[serde(default)]
    pub eta: Option<u64>,
    /// Runs started so far (retries and requeues after preemption included).
    pub attempts: u32,
    pub preemptions: u32,
    #[serde(default)]
    pub last_checkpoint: Option<u64>,
    #[serde(default)]
    pub kill_at: Option<u64>,
    pub tasks: Vec<TaskView>,
    pub spec: JobSpec,
    /// What each attempt held, from the accounting ledger.
    #[serde(default, skip_serializing_if = "Vec::is_empty")]
    pub ledger: Vec<Hold>,
    /// The array it is an element of, with its index.
    #[serde(default)]
    pub array: Option<ArrayRef>,
    /// Its GPUs' utilisation over its life, as its tasks were sampled
    /// (at most [`UTIL_POINTS`] points; older ones merged in pairs).
    #[serde(default, skip_serializing_if = "Vec::is_empty")]
    pub util: Vec<UtilPoint>,
    /// Where it runs when another scheduler runs it (gpuflow on
    /// Kubernetes), which reports it: accounted and shown here, not run
    /// by this server.
    #[serde(default)]
    pub external: Option<ExternalRef>,
}

/// A workload another scheduler runs: its cluster and its key there.
#[derive(Clone, Debug, PartialEq, Eq, Serialize, Deserialize, JsonSchema)]
pub struct ExternalRef {
    pub cluster: String,
    /// `namespace/gang` on Kubernetes.
    pub key: String,
}

/// What a cluster's scheduler runs and keeps waiting now, reported to the
/// control plane (`PUT /v1/clusters/{cluster}/workloads`): every workload
/// of the cluster's that is not finished. One the last report had and this
/// one does not has finished.
#[derive(Clone, Debug, PartialEq, Serialize, Deserialize, JsonSchema)]
#[serde(deny_unknown_fields)]
pub struct WorkloadReport {
    pub workloads: Vec<ExternalWorkload>,
}

/// One workload of a cluster: a gang of pods on Kubernetes.
#[serde_with::skip_serializing_none]
#[derive(Clone, Debug, PartialEq, Serialize, Deserialize, JsonSchema)]
#[serde(deny_unknown_fields)]
pub struct ExternalWorkload {
    /// Unique in the cluster, the same in every report (`namespace/gang`).
    pub key: String,
    pub name: String,
    /// The gpuflow team it is charged to; it must exist.
    pub team: String,
    pub user: String,
    /// Its queue in the cluster.
    pub queue: String,
    #[serde(default)]
    pub kind: crate::job::Kind,
    #[serde(default)]
    pub priority: i32,
    pub submitted_at: u64,
    /// Its pods by resources: replicas and what each asks for.
    pub tasks: Vec<ExternalTasks>,
    /// While it runs: since when, and the GPUs it holds.
    #[serde(default)]
    pub running: Option<ExternalHold>,
    /// While it waits: why (the cluster scheduler's explanation).
    #[serde(default)]
    pub reason: String,
}

/// Pods of a workload that ask for the same resources.
#[derive(Clone, Debug, PartialEq, Serialize, Deserialize, JsonSchema)]
#[serde(deny_unknown_fields)]
pub struct ExternalTasks {
    pub replicas: u32,
    pub resources: crate::job::Resources,
}

/// What a running workload holds.
#[derive(Clone, Debug, PartialEq, Serialize, Deserialize, JsonSchema)]
#[serde(deny_unknown_fields)]
pub struct ExternalHold {
    pub since: u64,
    /// Thousandths of a GPU (MIG and time slices at their quota
    /// equivalents).
    pub gpu_milli: u64,
    /// The GPU model its quota is charged to.
    pub model: String,
}

/// What the control plane made of a report.
#[derive(Clone, Debug, PartialEq, Serialize, Deserialize, JsonSchema)]
pub struct WorkloadReportResult {
    /// Workloads recorded (new or updated).
    pub recorded: u32,
    /// Workloads of the last report that have finished.
    pub finished: u32,
    /// Workloads not recorded, by key, with what to fix.
    #[serde(default, skip_serializing_if = "BTreeMap::is_empty")]
    pub refused: BTreeMap<String, String>,
}

/// The most points a job's utilisation history keeps.
pub const UTIL_POINTS: usize = 240;

/// A job's GPU use at one time: the mean utilisation of its tasks' GPUs and
/// the GPU memory its processes held.
#[derive(Clone, Debug, PartialEq, Serialize, Deserialize, JsonSchema)]
pub struct UtilPoint {
    pub at: u64,
    pub util_pct: f64,
    pub memory_mib: u64,
}

/// One attempt's hold on GPUs, as accounted.
#[serde_with::skip_serializing_none]
#[derive(Clone, Debug, PartialEq, Serialize, Deserialize, JsonSchema)]
pub struct Hold {
    pub attempt: u32,
    pub from: u64,
    /// Unset while it holds them.
    #[serde(default)]
    pub to: Option<u64>,
    /// GPUs held (a fraction, MIG slice or time slice at its share).
    pub gpus: f64,
    pub model: String,
    pub gpu_hours: f64,
    /// The GPUs' mean sampled utilisation over the hold, when sampled.
    #[serde(default)]
    pub util_pct: Option<f64>,
}

/// A job's output (`GET /v1/jobs/{id}/logs`): each task's stdout and
/// stderr, by `group/index`, of its latest attempt and of every kept one.
#[derive(Clone, Debug, PartialEq, Eq, Default, Serialize, Deserialize, JsonSchema)]
pub struct JobLogs {
    pub id: u64,
    /// The latest attempt's tasks: `name/index` → its stdout.
    pub tasks: BTreeMap<String, String>,
    /// Every kept attempt (the last five), by attempt number.
    pub attempts: BTreeMap<u32, BTreeMap<String, String>>,
    /// As `tasks` and `attempts`, for stderr.
    pub stderr: BTreeMap<String, String>,
    pub stderr_attempts: BTreeMap<u32, BTreeMap<String, String>>,
}

/// The answer to "why is my job not running".
#[serde_with::skip_serializing_none]
#[derive(Clone, Debug, PartialEq, Serialize, Deserialize, JsonSchema)]
pub struct Why {
    pub id: u64,
    pub state: JobState,
    pub summary: String,
    /// Every reason the last cycle found, in words; for a job that cycle
    /// did not reach, also what its turn would find now, diagnosed when
    /// asked (lines starting "if its turn came now:").
    pub reasons: Vec<String>,
    /// 1-based position among its queue's pending jobs.
    #[serde(default)]
    pub position: Option<usize>,
    /// Estimated start, Unix seconds.
    #[serde(default)]
    pub eta: Option<u64>,
}

#[serde_with::skip_serializing_none]
#[derive(Clone, Debug, PartialEq, Serialize, Deserialize, JsonSchema)]
pub struct Submitted {
    pub id: u64,
    pub state: JobState,
    /// For an array: its id (its first element's) and how many elements
    /// were stored, with consecutive ids from `id`.
    #[serde(default)]
    pub array: Option<ArrayRef>,
}

/// Many job specs to submit in one request (`POST /v1/jobs/batch`).
#[derive(Clone, Debug, PartialEq, Serialize, Deserialize, JsonSchema)]
#[serde(deny_unknown_fields)]
pub struct BatchSubmit {
    /// Job specs, as for `POST /v1/jobs` (JSON), arrays excepted.
    pub jobs: Vec<serde_json::Value>,
}

/// The ids of a batch's jobs, in its order.
#[derive(Clone, Debug, PartialEq, Eq, Serialize, Deserialize, JsonSchema)]
pub struct BatchSubmitted {
    pub ids: Vec<u64>,
}

/// What cancelling an array did.
#[derive(Clone, Debug, PartialEq, Eq, Serialize, Deserialize, JsonSchema)]
pub struct ArrayCancelled {
    pub id: u64,
    /// Elements that had not started: cancelled now.
    pub cancelled: u32,
    /// Elements that were running: signalled, cancelled once stopped.
    pub stopping: u32,
}

/// An array, or one element of it.
#[derive(Clone, Debug, PartialEq, Eq, Serialize, Deserialize, JsonSchema)]
pub struct ArrayRef {
    /// The array's id: its first element's job id.
    pub id: u64,
    /// An element's index; for a submission, how many elements.
    pub index: u32,
}

/// What a submission with `?test_only=true` would meet now (like
/// `sbatch --test-only`); nothing is stored.
#[serde_with::skip_serializing_none]
#[derive(Clone, Debug, PartialEq, Serialize, Deserialize, JsonSchema)]
pub struct TestOnly {
    /// It would be admitted by a cycle run now.
    pub would_start: bool,
    /// Where it would run, when it would start.
    pub nodes: Vec<String>,
    /// Why it would wait, when it would.
    pub reasons: Vec<String>,
    /// Estimated start, Unix seconds; absent when unknown.
    #[serde(default)]
    pub eta: Option<u64>,
}

#[serde_with::skip_serializing_none]
#[derive(Clone, Debug, PartialEq, Eq, Serialize, Deserialize, JsonSchema)]
pub struct Event {
    pub seq: i64,
    pub at: u64,
    #[serde(default)]
    pub job: Option<u64>,
    pub team: String,
    pub kind: String,
    pub message: String,
}

#[serde_with::skip_serializing_none]
#[derive(Clone, Debug, PartialEq, Eq, Serialize, Deserialize, JsonSchema)]
pub struct AuditEntry {
    pub seq: i64,
    pub at: u64,
    pub actor: String,
    pub action: String,
    pub target: String,
    /// What was done, where the action says more than its target (the
    /// command a `job exec` ran, …).
    #[serde(default, skip_serializing_if = "String::is_empty")]
    pub detail: String,
    /// For an actor who signs in through an identity provider: who at the
    /// provider (`PROVIDER:SUBJECT`; a user name here is bound to one).
    #[serde(default)]
    pub subject: Option<String>,
}

// ---- tenants ----

#[derive(
    Clone,
    Copy,
    Debug,
    PartialEq,
    Eq,
    PartialOrd,
    Ord,
    Serialize,
    Deserialize,
    JsonSchema,
    strum::IntoStaticStr,
)]
#[serde(rename_all = "kebab-case")]
#[strum(serialize_all = "kebab-case")]
pub enum Role {
    Admin,
    TeamLead,
    Member,
    Viewer,
}

impl Role {
    /// Its name, as the API writes it.
    pub fn as_str(self) -> &'static str {
        self.into()
    }
}

#[serde_with::skip_serializing_none]
#[derive(Clone, Debug, PartialEq, Serialize, Deserialize, JsonSchema)]
#[serde(deny_unknown_fields)]
pub struct Team {
    #[schemars(regex(pattern = r"^[a-z0-9][a-z0-9._-]{0,62}$"))]
    pub name: String,
    /// The system user the team's tasks run as on nodes whose agent runs as
    /// root (set by an admin; never root). Default: a uid of the team's own
    /// (see `uid`).
    #[serde(default)]
    pub run_as: Option<String>,
    /// The team's number, assigned by the server (not to be sent): a team
    /// with no `run_as` has its tasks run under a uid of its own derived
    /// from it (the agent's `--task-uid-base` plus this), so no two teams'
    /// tasks share a user.
    #[serde(default)]
    pub uid: u32,
    /// Where its images may come from: prefixes of image references
    /// (`127.0.0.1:5000/team/`); empty: anywhere.
    #[serde(default, skip_serializing_if = "Vec::is_empty")]
    pub registries: Vec<String>,
    /// Whether its tasks may run as processes on nodes, without an image
    /// (default true; false: a task without one is refused, unless
    /// `default_image` gives it one).
    #[serde(default = "yes", skip_serializing_if = "is_yes")]
    pub processes: bool,
    /// The image a task of the team without one runs in.
    #[serde(default)]
    pub default_image: Option<String>,
    /// Pull credentials by registry host (`127.0.0.1:5000`): given to the
    /// team's nodes for its pulls only, never to a task, a log or an event;
    /// the API shows the user names, never the passwords.
    #[serde(default, skip_serializing_if = "BTreeMap::is_empty")]
    pub registry_credentials: BTreeMap<String, RegistryCredential>,
    /// Whether its members act on each other's jobs (cancel, hold,
    /// suspend, release, exec, their ports): default false, each member on
    /// their own only, the team's leads on all of them (as Slurm lets users
    /// cancel only their own jobs unless they coordinate the account).
    #[serde(default, skip_serializing_if = "is_no")]
    pub shared_control: bool,
}

fn is_no(b: &bool) -> bool {
    !*b
}

fn yes() -> bool {
    true
}

fn is_yes(b: &bool) -> bool {
    *b
}

/// A registry login.
#[derive(Clone, Debug, PartialEq, Serialize, Deserialize, JsonSchema)]
#[serde(deny_unknown_fields)]
pub struct RegistryCredential {
    pub username: String,
    /// Write-only: empty in every answer.
    #[serde(default)]
    pub password: String,
}

impl Team {
    /// As the API shows it: passwords left out.
    pub fn redacted(&self) -> Team {
        let mut t = self.clone();
        for c in t.registry_credentials.values_mut() {
            c.password.clear();
        }
        t
    }

    /// Why the team may not run `image` (`None`: it may).
    pub fn refuses_image(&self, image: &str) -> Option<String> {
        (!self.registries.is_empty()
            && !self
                .registries
                .iter()
                .any(|p| image.starts_with(p.as_str())))
        .then(|| {
            format!(
                "image {image:?} is not from team {:?}'s registries: {}",
                self.name,
                self.registries.join(", ")
            )
        })
    }

    /// The login for `image`'s registry, if the team has one.
    pub fn credential_for(&self, image: &str) -> Option<(String, &RegistryCredential)> {
        let host = image.split('/').next().filter(|_| image.contains('/'))?;
        self.registry_credentials
            .get(host)
            .map(|c| (host.to_string(), c))
    }
}

/// The deepest queue tree the server accepts (organisation, team, project
/// and a few levels below).
pub const MAX_QUEUE_DEPTH: usize = 8;

/// An admin's change to a team.
#[serde_with::skip_serializing_none]
#[derive(Clone, Debug, PartialEq, Default, Serialize, Deserialize, JsonSchema)]
#[serde(deny_unknown_fields)]
pub struct TeamPatch {
    /// The system user the team's tasks run as from now on; empty: the
    /// agents' default again. Running tasks keep their user.
    #[serde(default)]
    pub run_as: Option<String>,
    /// The registries its images may come from (replaces the list; empty:
    /// anywhere).
    #[serde(default)]
    pub registries: Option<Vec<String>>,
    /// Whether its tasks may run without an image.
    #[serde(default)]
    pub processes: Option<bool>,
    /// The image a task without one runs in; empty: none.
    #[serde(default)]
    pub default_image: Option<String>,
    /// Logins to set, by registry host; one with an empty user name is
    /// removed. Others are kept.
    #[serde(default)]
    pub registry_credentials: Option<BTreeMap<String, RegistryCredential>>,
    /// Whether its members act on each other's jobs (admins, and the
    /// team's leads).
    #[serde(default)]
    pub shared_control: Option<bool>,
}

/// Whether `s` is a POSIX-style system user name that is not root.
pub fn valid_run_as(s: &str) -> bool {
    let mut chars = s.chars();
    s != "root"
        && s.len() <= 32
        && chars
            .next()
            .is_some_and(|c| c.is_ascii_lowercase() || c == '_')
        && chars.all(|c| c.is_ascii_lowercase() || c.is_ascii_digit() || c == '_' || c == '-')
}

/// A project of a team: what jobs are accounted to (GPU-hours, cost).
#[serde_with::skip_serializing_none]
#[derive(Clone, Debug, PartialEq, Serialize, Deserialize, JsonSchema)]
#[serde(deny_unknown_fields)]
pub struct Project {
    #[schemars(regex(pattern = r"^[a-z0-9][a-z0-9._-]{0,62}$"))]
    pub name: String,
    #[schemars(regex(pattern = r"^[a-z0-9][a-z0-9._-]{0,62}$"))]
    pub team: String,
    /// The finance cost centre its usage is reported under.
    #[serde(default, skip_serializing_if = "String::is_empty")]
    pub cost_centre: String,
    /// A budget for the project's jobs, in whichever queues they run; when
    /// spent they stop borrowing (or admitting). Admins set it. A project
    /// has no fair-share weight of its own, so `taper_from` must be 1.
    #[serde(default)]
    pub budget: Option<BudgetSpec>,
}

impl Project {
    /// # Errors
    /// A 400 naming each wrong field.
    pub fn validate(&self) -> Result<(), ApiError> {
        let mut errs = Vec::new();
        let mut bad = |f: String, m: String| {
            errs.push(FieldError {
                field: f,
                message: m,
            })
        };
        if self.cost_centre.len() > 64 {
            bad("cost_centre".into(), "at most 64 characters".into());
        }
        if let Some(b) = &self.budget {
            b.check("budget", &mut bad);
            if b.taper_from < 1.0 {
                bad(
                    "budget.taper_from".into(),
                    "a project has no fair-share weight to taper: its budget stops borrowing or admitting when spent; set taper_from to 1 (a queue's budget tapers)".into(),
                );
            }
        }
        if errs.is_empty() {
            Ok(())
        } else {
            Err(ApiError::invalid(errs))
        }
    }
}

/// A project with its budget as it stands.
#[serde_with::skip_serializing_none]
#[derive(Clone, Debug, PartialEq, Serialize, Deserialize, JsonSchema)]
pub struct ProjectView {
    #[serde(flatten)]
    pub project: Project,
    #[serde(default)]
    pub budget_use: Option<BudgetUse>,
}

/// Changes to a project (admins): its cost centre, its budget (`null`
/// removes it).
#[derive(Clone, Debug, PartialEq, Default, Serialize, Deserialize, JsonSchema)]
#[serde(deny_unknown_fields)]
pub struct ProjectPatch {
    #[serde(default)]
    pub cost_centre: Option<String>,
    #[serde(default, deserialize_with = "present")]
    #[schemars(with = "Option<BudgetSpec>")]
    pub budget: Option<Option<BudgetSpec>>,
}

/// A field that may be `null`: absent is `None`, `null` is `Some(None)`.
fn present<'de, D, T>(d: D) -> Result<Option<Option<T>>, D::Error>
where
    D: serde::Deserializer<'de>,
    T: Deserialize<'de>,
{
    Ok(Some(Option::deserialize(d)?))
}

#[serde_with::skip_serializing_none]
#[derive(Clone, Debug, PartialEq, Serialize, Deserialize, JsonSchema)]
#[serde(deny_unknown_fields)]
pub struct User {
    #[schemars(regex(pattern = r"^[a-z0-9][a-z0-9._-]{0,62}$"))]
    pub name: String,
    /// Empty for admins, who belong to no team.
    #[serde(default)]
    pub team: String,
    pub role: Role,
    /// A disabled user's tokens are all refused, at once, until an admin
    /// (or the user's team lead) enables the user again.
    #[serde(default, skip_serializing_if = "std::ops::Not::not")]
    pub disabled: bool,
    /// Set by the server for a user made by a sign-in through an identity
    /// provider: which, and the user's subject there.
    #[serde(default)]
    pub identity: Option<Identity>,
    /// Sign-ins made at or before this time are refused (set when the
    /// user's sessions are revoked), Unix seconds.
    #[serde(default)]
    pub signed_out_at: Option<u64>,
}

/// Who a user is at an identity provider.
#[derive(Clone, Debug, PartialEq, Serialize, Deserialize, JsonSchema)]
#[serde(deny_unknown_fields)]
pub struct Identity {
    /// The provider's name in the server's OIDC settings.
    pub provider: String,
    /// The `sub` claim: the user's stable id there.
    pub subject: String,
}

/// An identity provider users sign in through (`GET /v1/auth/providers`).
#[serde_with::skip_serializing_none]
#[derive(Clone, Debug, PartialEq, Serialize, Deserialize, JsonSchema)]
pub struct OidcProvider {
    pub name: String,
    /// Its issuer URL: the discovery document is under it.
    pub issuer: String,
    /// The public client a CLI or browser signs in as.
    pub client_id: String,
    /// The scopes to ask for, space separated.
    pub scopes: String,
    /// Where a browser signs in (the authorization code flow with PKCE),
    /// from the provider's discovery document; none while it cannot be read.
    #[serde(default)]
    pub authorization_endpoint: Option<String>,
}

/// `POST /v1/auth/code`: the dashboard's sign-in, the authorization code
/// flow with PKCE. The server exchanges the code at the provider (once: a
/// code is never taken twice) and checks the ID token it gets, its nonce
/// included.
#[derive(Clone, Debug, PartialEq, Serialize, Deserialize, JsonSchema)]
#[serde(deny_unknown_fields)]
pub struct CodeRequest {
    pub provider: String,
    pub code: String,
    /// The PKCE verifier whose S256 challenge the browser sent.
    pub code_verifier: String,
    /// The redirect URI the code was sent to.
    pub redirect_uri: String,
    /// The nonce the browser sent: the ID token must carry it.
    pub nonce: String,
}

#[serde_with::skip_serializing_none]
#[derive(Clone, Debug, PartialEq, Serialize, Deserialize, JsonSchema)]
#[serde(deny_unknown_fields)]
pub struct TokenRequest {
    #[schemars(regex(pattern = r"^[a-z0-9][a-z0-9._-]{0,62}$"))]
    pub user: String,
    /// The token stops working this many seconds after it is made; default:
    /// it works until revoked.
    #[serde(default)]
    pub expires_in_s: Option<u64>,
}

/// A new API token: shown once, stored only as a hash.
#[serde_with::skip_serializing_none]
#[derive(Clone, Debug, PartialEq, Serialize, Deserialize, JsonSchema)]
pub struct TokenCreated {
    pub user: String,
    pub token: String,
    /// What the token is listed and revoked by (not a secret).
    #[serde(default)]
    pub id: String,
    #[serde(default)]
    pub expires_at: Option<u64>,
}

/// A token as listed: never the token itself.
#[serde_with::skip_serializing_none]
#[derive(Clone, Debug, PartialEq, Serialize, Deserialize, JsonSchema)]
pub struct TokenView {
    pub id: String,
    pub user: String,
    pub created_at: u64,
    #[serde(default)]
    pub expires_at: Option<u64>,
    /// For a sign-in session (`gpuflow login`): the identity provider it
    /// came through; none for an API token.
    #[serde(default)]
    pub provider: Option<String>,
}

/// `POST /v1/auth/sessions`: a sign-in through an identity provider
/// becomes a session: the provider's ID token proves who, its refresh
/// token lets the server check the user's groups again as the session goes
/// on (and end it when the provider no longer renews it).
#[serde_with::skip_serializing_none]
#[derive(Clone, Debug, PartialEq, Serialize, Deserialize, JsonSchema)]
#[serde(deny_unknown_fields)]
pub struct SessionRequest {
    pub id_token: String,
    #[serde(default)]
    pub refresh_token: Option<String>,
}

/// At most this many live tokens per user: revoke old ones to make more.
pub const MAX_TOKENS_PER_USER: usize = 20;

#[serde_with::skip_serializing_none]
#[derive(Clone, Debug, PartialEq, Serialize, Deserialize, JsonSchema)]
pub struct WhoAmI {
    pub user: String,
    pub team: String,
    pub role: Role,
    /// How the caller signed in: `token` (an API token) or `oidc`.
    #[serde(default)]
    pub signed_in_with: String,
    /// With `oidc`: the provider and the caller's subject there.
    #[serde(default)]
    pub identity: Option<Identity>,
    /// The id of the token it used (`gpuflow token ls`).
    #[serde(default)]
    pub token_id: String,
    /// When that token (or the ID token) expires, Unix seconds; none: when
    /// revoked.
    #[serde(default)]
    pub expires_at: Option<u64>,
}

// ---- queues ----

/// One flavor's quota in GPUs (fractions allowed). `None`: no limit.
#[serde_with::skip_serializing_none]
#[derive(Clone, Debug, PartialEq, Default, Serialize, Deserialize, JsonSchema)]
#[serde(deny_unknown_fields)]
pub struct QuotaSpec {
    #[serde(default)]
    pub guaranteed: f64,
    #[serde(default)]
    pub borrow_limit: Option<f64>,
    #[serde(default)]
    pub lend_limit: Option<f64>,
    #[serde(default)]
    pub cap: Option<f64>,
}

#[derive(Clone, Copy, Debug, PartialEq, Eq, Default, Serialize, Deserialize, JsonSchema)]
#[serde(rename_all = "kebab-case")]
pub enum QueueState {
    #[default]
    Open,
    Held,
    Draining,
}

#[serde_with::skip_serializing_none]
#[derive(Clone, Debug, PartialEq, Default, Serialize, Deserialize, JsonSchema)]
#[serde(deny_unknown_fields)]
pub struct UserLimitsSpec {
    #[serde(default)]
    pub max_gpus: Option<f64>,
    #[serde(default)]
    pub max_running: Option<u32>,
}

/// A queue: a node of the tree, owned by a team.
#[serde_with::skip_serializing_none]
#[derive(Clone, Debug, PartialEq, Serialize, Deserialize, JsonSchema)]
#[serde(deny_unknown_fields)]
pub struct QueueSpec {
    #[schemars(regex(pattern = r"^[a-z0-9][a-z0-9._-]{0,62}$"))]
    pub name: String,
    #[schemars(regex(pattern = r"^[a-z0-9][a-z0-9._-]{0,62}$"))]
    pub team: String,
    #[serde(default)]
    pub parent: Option<String>,
    #[serde(default = "one")]
    pub weight: f64,
    #[serde(default)]
    pub state: QueueState,
    /// Quota per flavor (GPU model); `*` applies to flavors not listed.
    #[serde(default)]
    pub quotas: BTreeMap<String, QuotaSpec>,
    #[serde(default)]
    pub user_limits: UserLimitsSpec,
    /// The idle policy of notebooks submitted to this queue (or below it)
    /// that name none; admins set it.
    #[serde(default)]
    pub notebook_idle: Option<crate::IdleSpec>,
    /// The longest a notebook submitted to this queue (or below it) may
    /// run, in seconds: those without a `max_runtime_s` take it, longer ones
    /// are refused; admins set it.
    #[serde(default)]
    pub notebook_max_lifetime_s: Option<u64>,
    /// A budget per period (GPU-hours or cost) for the queue's own jobs;
    /// admins set it.
    #[serde(default)]
    pub budget: Option<BudgetSpec>,
}

/// A budget per period, in GPU-hours or in cost (exactly one of the two):
/// once `taper_from` of it is used the queue's fair-share weight falls
/// linearly to `min_weight_factor` of itself; once all is used the queue
/// (or project) stops borrowing (or admitting).
#[serde_with::skip_serializing_none]
#[derive(Clone, Debug, PartialEq, Serialize, Deserialize, JsonSchema)]
#[serde(deny_unknown_fields)]
pub struct BudgetSpec {
    /// GPU-hours per period (a share, MIG slice or time slice at its
    /// equivalent).
    #[serde(default)]
    pub gpu_hours: Option<f64>,
    /// Cost per period at the admins' prices, in their currency.
    #[serde(default)]
    pub cost: Option<f64>,
    pub period: BudgetPeriod,
    #[serde(default = "default_taper")]
    pub taper_from: f64,
    #[serde(default = "default_min_weight")]
    pub min_weight_factor: f64,
    #[serde(default)]
    pub when_exhausted: WhenExhausted,
}

impl BudgetSpec {
    /// The amount per period, in its unit.
    pub fn limit(&self) -> f64 {
        self.gpu_hours.or(self.cost).unwrap_or(0.0)
    }

    /// `gpu-hours` or `cost`.
    pub fn unit(&self) -> &'static str {
        if self.cost.is_some() {
            "cost"
        } else {
            "gpu-hours"
        }
    }

    /// Adds what is wrong with it to `bad`, fields under `at`.
    pub fn check(&self, at: &str, bad: &mut dyn FnMut(String, String)) {
        match (self.gpu_hours, self.cost) {
            (Some(_), Some(_)) | (None, None) => bad(
                at.to_string(),
                "give exactly one of gpu_hours and cost".into(),
            ),
            (Some(h), None) if !(h.is_finite() && (0.0..=1e9).contains(&h)) => bad(
                format!("{at}.gpu_hours"),
                "must be 0 to 1000000000 GPU-hours".into(),
            ),
            (None, Some(c)) if !(c.is_finite() && (0.0..=1e12).contains(&c)) => {
                bad(format!("{at}.cost"), "must be 0 to 1000000000000".into())
            }
            _ => {}
        }
        if !(0.0..=1.0).contains(&self.taper_from) {
            bad(
                format!("{at}.taper_from"),
                "must be a share from 0 to 1".into(),
            );
        }
        if !(0.0..=1.0).contains(&self.min_weight_factor) {
            bad(
                format!("{at}.min_weight_factor"),
                "must be a factor from 0 to 1".into(),
            );
        }
    }
}

fn default_taper() -> f64 {
    0.8
}
fn default_min_weight() -> f64 {
    0.25
}

/// A budget's period (UTC; weeks start on Monday).
#[derive(Clone, Copy, Debug, PartialEq, Eq, Serialize, Deserialize, JsonSchema)]
#[serde(rename_all = "kebab-case")]
pub enum BudgetPeriod {
    Day,
    Week,
    Month,
}

#[derive(Clone, Copy, Debug, Default, PartialEq, Eq, Serialize, Deserialize, JsonSchema)]
#[serde(rename_all = "kebab-case")]
pub enum WhenExhausted {
    /// Work within the guarantee still starts.
    #[default]
    StopBorrowing,
    StopAdmitting,
}

/// A budget as it stands in its current period.
#[derive(Clone, Debug, PartialEq, Serialize, Deserialize, JsonSchema)]
pub struct BudgetUse {
    pub period_start: u64,
    /// `gpu-hours` or `cost`, as the budget counts.
    pub unit: String,
    /// Used in this period, in the unit.
    pub used: f64,
    /// Left in this period, in the unit.
    pub left: f64,
    /// The factor on the queue's weight now (1 until the taper starts).
    pub weight_factor: f64,
    pub exhausted: bool,
}

fn one() -> f64 {
    1.0
}

impl QueueSpec {
    /// # Errors
    /// A 400 naming each wrong field.
    pub fn validate(&self) -> Result<(), ApiError> {
        let mut errs = Vec::new();
        let mut bad = |f: &str, m: String| {
            errs.push(FieldError {
                field: f.into(),
                message: m,
            })
        };
        if !valid_name(&self.name) {
            bad(
                "name",
                format!(
                    "{:?} is not a valid name: 1 to 63 lowercase letters, digits, '-', '_' or '.'",
                    self.name
                ),
            );
        }
        if self.team.is_empty() {
            bad("team", "must name the owning team".into());
        }
        if !(self.weight.is_finite() && self.weight > 0.0 && self.weight <= 1e6) {
            bad("weight", "must be a positive number up to 1000000".into());
        }
        let gpus = |x: f64| x.is_finite() && (0.0..=1e7).contains(&x);
        for (flavor, q) in &self.quotas {
            let at = |f: &str| format!("quotas.{flavor}.{f}");
            if !gpus(q.guaranteed) {
                bad(&at("guaranteed"), "must be 0 to 10000000 GPUs".into());
            }
            for (name, v) in [
                ("borrow_limit", q.borrow_limit),
                ("lend_limit", q.lend_limit),
                ("cap", q.cap),
            ] {
                if v.is_some_and(|v| !gpus(v)) {
                    bad(&at(name), "must be 0 to 10000000 GPUs".into());
                }
            }
        }
        if self.user_limits.max_gpus.is_some_and(|v| !gpus(v)) {
            bad("user_limits.max_gpus", "must be 0 to 10000000 GPUs".into());
        }
        if let Some(idle) = &self.notebook_idle {
            idle.check("notebook_idle", &mut |f, m| bad(&f, m));
        }
        if self
            .notebook_max_lifetime_s
            .is_some_and(|l| !(1..=31_536_000).contains(&l))
        {
            bad(
                "notebook_max_lifetime_s",
                "must be 1 to 31536000 seconds (a year)".into(),
            );
        }
        if let Some(b) = &self.budget {
            b.check("budget", &mut |f, m| bad(&f, m));
        }
        if errs.is_empty() {
            Ok(())
        } else {
            Err(ApiError::invalid(errs))
        }
    }
}

/// A queue with its usage.
#[serde_with::skip_serializing_none]
#[derive(Clone, Debug, PartialEq, Serialize, Deserialize, JsonSchema)]
pub struct QueueView {
    #[serde(flatten)]
    pub spec: QueueSpec,
    /// GPUs in use per flavor.
    pub used: BTreeMap<String, f64>,
    pub pending: usize,
    pub running: usize,
    /// Its budget in the current period, when it has one.
    #[serde(default)]
    pub budget_use: Option<BudgetUse>,
    /// GPUs it uses above its guarantee, per flavor.
    #[serde(default, skip_serializing_if = "BTreeMap::is_empty")]
    pub borrowed: BTreeMap<String, f64>,
    /// Other queues using more than their guarantee on a flavor of which
    /// this one leaves guarantee unused: who may be running on its GPUs
    /// (and whom a job of its would reclaim them from).
    #[serde(default, skip_serializing_if = "Vec::is_empty")]
    pub borrowers: Vec<Borrower>,
}

/// A queue borrowing GPUs.
#[derive(Clone, Debug, PartialEq, Serialize, Deserialize, JsonSchema)]
pub struct Borrower {
    pub queue: String,
    pub team: String,
    pub flavor: String,
    /// GPUs above its guarantee.
    pub gpus: f64,
}

/// Changes a team lead may make to a queue of their team.
#[derive(Clone, Debug, PartialEq, Default, Serialize, Deserialize, JsonSchema)]
#[serde(deny_unknown_fields)]
pub struct QueuePatch {
    #[serde(default)]
    pub weight: Option<f64>,
    #[serde(default)]
    pub state: Option<QueueState>,
    #[serde(default)]
    pub user_limits: Option<UserLimitsSpec>,
    /// Admin only.
    #[serde(default)]
    pub quotas: Option<BTreeMap<String, QuotaSpec>>,
    /// Admin only.
    #[serde(default)]
    pub notebook_idle: Option<crate::IdleSpec>,
    /// Admin only.
    #[serde(default)]
    pub notebook_max_lifetime_s: Option<u64>,
    /// Admin only.
    #[serde(default)]
    pub budget: Option<BudgetSpec>,
}

// ---- nodes ----

#[derive(
    Clone,
    Copy,
    Debug,
    PartialEq,
    Eq,
    Default,
    Serialize,
    Deserialize,
    JsonSchema,
    strum::IntoStaticStr,
)]
#[serde(rename_all = "kebab-case")]
#[strum(serialize_all = "kebab-case")]
pub enum NodeState {
    #[default]
    Ready,
    Cordoned,
    Draining,
    Lost,
}

impl NodeState {
    /// Its name, as the API writes it.
    pub fn as_str(self) -> &'static str {
        self.into()
    }
}

#[serde_with::skip_serializing_none]
#[derive(Clone, Debug, PartialEq, Serialize, Deserialize, JsonSchema)]
pub struct GpuInfo {
    pub index: u32,
    pub uuid: String,
    pub model: String,
    pub memory_mib: u64,
    /// Why it takes no work, when it is unhealthy (an XID error, ECC
    /// errors, NVML cannot reach it); `None` when healthy.
    #[serde(default)]
    pub unhealthy: Option<String>,
    /// Its MIG instances when it is in MIG mode (each allocated whole, to
    /// jobs asking for its profile); empty when it is not.
    #[serde(default, skip_serializing_if = "Vec::is_empty")]
    pub mig: Vec<MigInfo>,
    /// Its NUMA node, when known.
    #[serde(default)]
    pub numa: Option<u32>,
    /// The indices (in this inventory) of the GPUs it reaches over NVLink.
    #[serde(default, skip_serializing_if = "Vec::is_empty")]
    pub nvlink: Vec<u32>,
}

/// One MIG instance of a GPU.
#[derive(Clone, Debug, PartialEq, Serialize, Deserialize, JsonSchema)]
pub struct MigInfo {
    /// `MIG-…`: what `CUDA_VISIBLE_DEVICES` names it by.
    pub uuid: String,
    /// The profile, e.g. `1g.10gb`.
    pub profile: String,
    pub memory_mib: u64,
}

/// What a node has, as its agent reports it.
#[derive(Clone, Debug, PartialEq, Serialize, Deserialize, JsonSchema)]
pub struct Inventory {
    pub cpu_milli: u64,
    pub memory_mib: u64,
    pub gpus: Vec<GpuInfo>,
    /// True when the GPUs are emulated (no NVML on the node).
    pub emulated: bool,
    /// The address other nodes reach this one at (gang rendezvous).
    #[serde(default)]
    pub address: String,
    #[serde(default)]
    pub labels: BTreeMap<String, String>,
    #[serde(default)]
    pub pool: String,
    /// How the node enforces tasks' CPU, memory and pids limits.
    #[serde(default)]
    pub limits: NodeLimits,
}

/// How a node enforces its tasks' limits.
#[serde_with::skip_serializing_none]
#[derive(Clone, Debug, Default, PartialEq, Eq, Serialize, Deserialize, JsonSchema)]
pub struct NodeLimits {
    /// `v1` or `v2`; empty when the node sets no limits.
    #[serde(default)]
    pub cgroup: String,
    /// The controllers it sets limits with: `cpu`, `memory`, `pids`.
    #[serde(default)]
    pub controllers: Vec<String>,
    /// Why it sets none (or fewer), in words.
    #[serde(default, skip_serializing_if = "String::is_empty")]
    pub note: String,
    /// The first uid of its installation's block, when tasks of teams
    /// without `run_as` run under uids of their own (team `N` runs as this
    /// plus `N`).
    #[serde(default)]
    pub task_uid_base: Option<u32>,
}

impl NodeLimits {
    /// Whether tasks' CPU and memory are held to their spec.
    pub fn enforced(&self) -> bool {
        ["cpu", "memory"]
            .iter()
            .all(|c| self.controllers.iter().any(|x| x == c))
    }
}

#[derive(Clone, Debug, PartialEq, Serialize, Deserialize, JsonSchema)]
pub struct NodeView {
    pub name: String,
    pub state: NodeState,
    pub inventory: Inventory,
    /// GPU indices in use (whole or shared).
    pub gpus_in_use: Vec<u32>,
    pub last_heartbeat: u64,
    /// Its GPUs as its agent last sampled them.
    #[serde(default, skip_serializing_if = "Vec::is_empty")]
    pub gpus_now: Vec<GpuSample>,
    /// Who holds its GPUs, one entry per holding task (several on a shared
    /// GPU or on the MIG instances of one GPU).
    #[serde(default, skip_serializing_if = "Vec::is_empty")]
    pub holders: Vec<GpuHolder>,
    /// CPU and memory its allocated jobs' tasks hold.
    #[serde(default)]
    pub cpu_allocated_milli: u64,
    #[serde(default)]
    pub memory_allocated_mib: u64,
    /// The allocated jobs with a task on it that the caller may see.
    #[serde(default, skip_serializing_if = "Vec::is_empty")]
    pub jobs: Vec<u64>,
    /// How many jobs have a task on it, seen or not.
    #[serde(default)]
    pub job_count: u32,
    /// The reservations not over that hold it: `NAME (START–END)`.
    #[serde(default, skip_serializing_if = "Vec::is_empty")]
    pub reservations: Vec<String>,
}

/// A task's hold on one GPU of a node (the dashboard's cluster map).
#[serde_with::skip_serializing_none]
#[derive(Clone, Debug, PartialEq, Serialize, Deserialize, JsonSchema)]
pub struct GpuHolder {
    /// The GPU's index on the node.
    pub gpu: u32,
    /// The holding team; empty when the caller may not see it (another
    /// team's work, to a member or viewer).
    pub team: String,
    /// The holding job, when the caller may see it.
    #[serde(default)]
    pub job: Option<u64>,
    /// `whole`, `fraction`, `time-slice` or `mig`.
    pub mode: String,
    /// Its share of the GPU in thousandths (1000 for a whole GPU; a MIG
    /// instance or time slice at its quota equivalent).
    pub milli: u32,
    /// The MIG instance's profile, for `mig`.
    #[serde(default)]
    pub profile: Option<String>,
}

// ---- the agent protocol ----

#[serde_with::skip_serializing_none]
#[derive(Clone, Debug, PartialEq, Serialize, Deserialize, JsonSchema)]
pub struct Register {
    pub node: String,
    pub inventory: Inventory,
    /// The node token this agent was given before, if any: a node name
    /// belongs to the agent that first registered it, and registering it
    /// again needs that token (or an admin's `gpuflow node replace`).
    #[serde(default)]
    pub node_token: Option<String>,
}

#[derive(Clone, Debug, PartialEq, Serialize, Deserialize, JsonSchema)]
pub struct Registered {
    /// The node's own credential for heartbeats.
    pub node_token: String,
    pub heartbeat_s: u64,
    /// As [`Desired::lease_s`].
    #[serde(default)]
    pub lease_s: u64,
    /// The installation's id: two installations' agents on one node must
    /// not share a uid block.
    #[serde(default)]
    pub installation: String,
    /// The installation's block of task uids: its teams' tasks run as the
    /// agent's `--task-uid-base` plus `uid_block` × [`UID_BLOCK`] plus the
    /// team's number.
    #[serde(default)]
    pub uid_block: u32,
}

/// Team numbers of one installation's uid block.
pub const UID_BLOCK: u32 = 10_000;
/// Blocks above the default uid base (1,600,000,000) that stay below 2^31
/// (tools that take uids for signed numbers break above it).
pub const UID_BLOCKS: u32 = 54_000;

/// Where a task is on the node.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Serialize, Deserialize, JsonSchema)]
#[serde(rename_all = "kebab-case")]
pub enum TaskPhase {
    Running,
    /// Exited by itself; `exit_code` says how.
    Exited,
    /// Stopped by the agent on the server's order.
    Stopped,
    /// Could not be started (no such program, bad working dir).
    FailedToStart,
}

/// A task as its agent sees it; `(job, attempt, group, index)` names it.
#[serde_with::skip_serializing_none]
#[derive(Clone, Debug, PartialEq, Serialize, Deserialize, JsonSchema)]
pub struct TaskReport {
    pub job: u64,
    pub attempt: u32,
    pub group: u16,
    pub index: u32,
    pub phase: TaskPhase,
    /// The port it serves on, when it asked for one.
    #[serde(default)]
    pub port: Option<u16>,
    /// The ports it serves on by name, when it declared some.
    #[serde(default, skip_serializing_if = "BTreeMap::is_empty")]
    pub ports: BTreeMap<String, u16>,
    /// Its image, once its node pulled it (or failed to).
    #[serde(default)]
    pub image: Option<ImageReport>,
    /// Its readiness check's last answer, when it has one.
    #[serde(default)]
    pub ready: Option<bool>,
    /// What it wrote to stderr since the server last acknowledged it (or
    /// the next part of that), when there is something new.
    #[serde(default)]
    pub stderr: Option<LogChunk>,
    #[serde(default)]
    pub exit_code: Option<i32>,
    /// When it started on the node (Unix seconds).
    #[serde(default)]
    pub started_at: Option<u64>,
    /// The last checkpoint the task reported (Unix seconds), via the file
    /// named by `GPUFLOW_CHECKPOINT_FILE`.
    #[serde(default)]
    pub checkpoint_at: Option<u64>,
    /// The same for its stdout.
    #[serde(default)]
    pub stdout: Option<LogChunk>,
    #[serde(default, skip_serializing_if = "String::is_empty")]
    pub message: String,
    /// The limit it was killed at, when it broke one.
    #[serde(default)]
    pub breach: Option<Breach>,
    /// Its use of its GPUs since it started, as its agent sampled it.
    #[serde(default)]
    pub usage: Option<TaskUsage>,
}

/// A piece of what a task wrote to one stream: `len` bytes from byte
/// `offset` of its output, as text (bytes that are not UTF-8 replaced).
/// The server appends it after what it has, skipping a part it already
/// has and marking a gap (the agent skips ahead of output it cannot ship
/// in time).
#[derive(Clone, Debug, PartialEq, Eq, Serialize, Deserialize, JsonSchema)]
pub struct LogChunk {
    pub offset: u64,
    pub len: u64,
    pub text: String,
}

/// A limit a task was killed at.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Serialize, Deserialize, JsonSchema)]
#[serde(rename_all = "kebab-case")]
pub enum Breach {
    /// The kernel's OOM killer, at its memory limit.
    Memory,
    /// The agent's watchdog, past its GPU-memory limit.
    GpuMemory,
}

/// A task's use of its GPUs since it started, sampled by its agent
/// (cumulative, so a lost heartbeat loses nothing).
#[serde_with::skip_serializing_none]
#[derive(Clone, Debug, Default, PartialEq, Serialize, Deserialize, JsonSchema)]
pub struct TaskUsage {
    pub samples: u32,
    /// Mean GPU (SM) utilisation over the samples, in percent of its GPUs.
    pub gpu_util_avg_pct: f64,
    /// At the last sample.
    pub gpu_util_pct: u32,
    /// GPU memory its processes held at the last sample.
    pub gpu_memory_mib: u64,
    pub gpu_memory_peak_mib: u64,
    /// CPU time it used (from its cgroup), when known.
    #[serde(default)]
    pub cpu_s: Option<f64>,
    /// Since when (Unix seconds) its GPU utilisation has stayed below its
    /// idle threshold, when it has one and is below it.
    #[serde(default)]
    pub idle_since: Option<u64>,
}

/// Prices admins set: an hour of a GPU of each model (`*`: the models not
/// listed), in `currency`.
#[derive(Clone, Debug, Default, PartialEq, Serialize, Deserialize, JsonSchema)]
#[serde(deny_unknown_fields)]
pub struct Prices {
    #[serde(default)]
    pub currency: String,
    #[serde(default)]
    pub gpu_hour: BTreeMap<String, f64>,
}

impl Prices {
    /// # Errors
    /// A 400 naming each wrong price.
    pub fn validate(&self) -> Result<(), ApiError> {
        let mut errs = Vec::new();
        for (model, p) in &self.gpu_hour {
            if !(p.is_finite() && (0.0..=1e6).contains(p)) {
                errs.push(FieldError {
                    field: format!("gpu_hour.{model}"),
                    message: "must be a price from 0 to 1000000 per GPU-hour".into(),
                });
            }
            if model != "*" && (model.is_empty() || model.len() > 128) {
                errs.push(FieldError {
                    field: format!("gpu_hour.{model}"),
                    message: "a GPU model name (as `node ls` shows it) or `*`".into(),
                });
            }
        }
        if self.currency.len() > 16 {
            errs.push(FieldError {
                field: "currency".into(),
                message: "at most 16 characters (e.g. USD)".into(),
            });
        }
        if errs.is_empty() {
            Ok(())
        } else {
            Err(ApiError::invalid(errs))
        }
    }
}

/// One row of a usage report: a key (team, project, …) in one period.
#[serde_with::skip_serializing_none]
#[derive(Clone, Debug, PartialEq, Serialize, Deserialize, JsonSchema)]
pub struct UsageRow {
    pub key: String,
    /// Unix seconds; the range's start when the report is not split.
    pub period_start: u64,
    /// GPU-hours held (a fraction, MIG slice or time slice at its share).
    pub gpu_hours: f64,
    /// GPU-hours used: held time weighted by the sampled utilisation.
    pub used_gpu_hours: f64,
    /// Used over held, over the held time that was sampled.
    #[serde(default)]
    pub efficiency: Option<f64>,
    pub cost: f64,
    pub jobs: u32,
}

/// A job holding GPUs it barely uses (the low-utilisation report).
#[derive(Clone, Debug, PartialEq, Serialize, Deserialize, JsonSchema)]
pub struct LowUse {
    pub id: u64,
    pub name: String,
    pub team: String,
    pub user: String,
    pub kind: crate::Kind,
    /// GPUs held (a fraction, MIG slice or time slice at its share).
    pub gpus: f64,
    /// Since when it holds them.
    pub since: u64,
    /// Its GPUs' mean sampled utilisation over the hold.
    pub util_pct: f64,
    pub gpu_hours: f64,
}

/// One row of the jobs report: the jobs of a queue or kind submitted in
/// the range, how long they waited and how they ended.
#[serde_with::skip_serializing_none]
#[derive(Clone, Debug, PartialEq, Serialize, Deserialize, JsonSchema)]
pub struct JobsRow {
    pub key: String,
    pub submitted: u32,
    pub started: u32,
    /// Seconds from submission to first start, of those that started.
    #[serde(default)]
    pub wait_p50_s: Option<u64>,
    #[serde(default)]
    pub wait_p95_s: Option<u64>,
    pub succeeded: u32,
    pub failed: u32,
    pub cancelled: u32,
    /// Failed over finished.
    #[serde(default)]
    pub failure_rate: Option<f64>,
    pub preemptions: u32,
    /// GPU-hours of work lost to preemptions (since the victims' checkpoints).
    pub lost_gpu_hours: f64,
}

/// A job whose measured use would fit a cheaper GPU (the advice report).
#[derive(Clone, Debug, PartialEq, Serialize, Deserialize, JsonSchema)]
pub struct Advice {
    pub id: u64,
    pub name: String,
    pub team: String,
    pub model: String,
    /// The most GPU memory a task of it held (MiB).
    pub peak_gpu_memory_mib: u64,
    /// Its GPUs' mean sampled utilisation.
    pub util_pct: f64,
    /// A cheaper model, or a MIG profile of its model (`H100-80GB-HBM3 MIG 2g.20gb`).
    pub instead: String,
    /// What the change would save in a 30-day month at its use in the range.
    pub saving_per_month: f64,
    pub currency: String,
}

/// A usage report.
#[derive(Clone, Debug, PartialEq, Serialize, Deserialize, JsonSchema)]
pub struct UsageReport {
    pub by: String,
    pub period: String,
    pub from: u64,
    pub to: u64,
    pub currency: String,
    pub rows: Vec<UsageRow>,
}

/// A GPU as its agent last sampled it (not part of the inventory, which
/// would then change on every heartbeat).
#[serde_with::skip_serializing_none]
#[derive(Clone, Debug, PartialEq, Serialize, Deserialize, JsonSchema)]
pub struct GpuSample {
    pub uuid: String,
    pub util_pct: u32,
    pub memory_util_pct: u32,
    pub memory_used_mib: u64,
    #[serde(default)]
    pub power_w: Option<f64>,
    #[serde(default)]
    pub temperature_c: Option<u32>,
}

#[derive(Clone, Debug, PartialEq, Serialize, Deserialize, JsonSchema)]
pub struct Heartbeat {
    pub node: String,
    pub inventory: Inventory,
    pub tasks: Vec<TaskReport>,
    /// The GPUs' last samples (at most one per GPU of the inventory).
    #[serde(default)]
    pub gpus: Vec<GpuSample>,
}

/// Stop a task: send `signal` now, kill its process tree `grace_s` seconds
/// after the agent first sees the order (relative, so clocks need not agree).
#[derive(Clone, Debug, PartialEq, Serialize, Deserialize, JsonSchema)]
pub struct StopOrder {
    pub signal: String,
    pub grace_s: u64,
}

/// A task the server wants on the node (level-triggered: the full list each time).
#[serde_with::skip_serializing_none]
#[derive(Clone, Debug, PartialEq, Serialize, Deserialize, JsonSchema)]
pub struct DesiredTask {
    pub job: u64,
    pub attempt: u32,
    pub group: u16,
    pub index: u32,
    pub name: String,
    pub command: Vec<String>,
    pub env: BTreeMap<String, String>,
    #[serde(default)]
    pub working_dir: Option<String>,
    pub gpus: Vec<u32>,
    /// The MIG instances (their `MIG-…` UUIDs) the task holds on `gpus`:
    /// it may open their capability devices and no other instance's.
    #[serde(default, skip_serializing_if = "Vec::is_empty")]
    pub mig: Vec<String>,
    #[serde(default)]
    pub stop: Option<StopOrder>,
    /// The system user the task runs as (its team's `run_as`); default:
    /// the agent's choice (never root).
    #[serde(default)]
    pub run_as: Option<String>,
    /// The team's number (`Team::uid`): without `run_as`, an agent running
    /// as root runs the task as its `--task-uid-base` plus this.
    #[serde(default)]
    pub team_uid: Option<u32>,
    /// The job's checkpoint signal: what the task is sent when it must stop,
    /// also when its node's lease runs out.
    #[serde(default = "default_signal")]
    pub stop_signal: String,
    /// What the task may use; the agent enforces it where it can (cgroups).
    #[serde(default)]
    pub limits: TaskLimits,
    /// The task serves on a port the agent picks (`PORT`, `GPUFLOW_PORT`).
    #[serde(default, skip_serializing_if = "std::ops::Not::not")]
    pub port: bool,
    /// Ports it serves on, by name, each picked by the agent
    /// (`GPUFLOW_PORT_<NAME>`; the first is `PORT` too, unless `port`).
    #[serde(default, skip_serializing_if = "Vec::is_empty")]
    pub ports: Vec<String>,
    /// The OCI image it runs in (pinned to the digest an earlier attempt
    /// pulled, when there was one).
    #[serde(default)]
    pub image: Option<String>,
    /// The team's login to the image's registry: `(host, user, password)`,
    /// used for the pull alone.
    #[serde(default)]
    pub registry_auth: Option<(String, String, String)>,
    /// How the agent checks the task is ready to serve.
    #[serde(default)]
    pub readiness: Option<crate::job::Readiness>,
}

/// A task's limits, from its spec's resources.
#[serde_with::skip_serializing_none]
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq, Serialize, Deserialize, JsonSchema)]
pub struct TaskLimits {
    /// Thousandths of a CPU (0: none).
    pub cpu_milli: u64,
    /// Memory in MiB (0: none).
    pub memory_mib: u64,
    /// GPU memory in MiB its processes may hold, for a task sharing a GPU
    /// (its fraction of the GPU's memory; 0: none).
    #[serde(default)]
    pub gpu_memory_mib: u64,
    /// Its GPU's share in percent, for a task sharing a GPU (MPS's active
    /// thread percentage; 0: none).
    #[serde(default)]
    pub gpu_percent: u32,
    /// Below this GPU utilisation (percent) the task counts as idle, when
    /// its job has an idle policy.
    #[serde(default)]
    pub idle_below_pct: Option<u32>,
}

fn default_signal() -> String {
    "SIGTERM".into()
}

#[derive(Clone, Debug, PartialEq, Serialize, Deserialize, JsonSchema)]
pub struct Desired {
    pub tasks: Vec<DesiredTask>,
    pub heartbeat_s: u64,
    /// The node's lease, renewed by this reply: unless another heartbeat is
    /// answered within it, the server takes the node for lost and places its
    /// work elsewhere, so the agent stops its tasks before it runs out
    /// (0: no lease).
    #[serde(default)]
    pub lease_s: u64,
    /// GPU health marks (XID errors) the agent recorded at or before this
    /// time (Unix seconds) are cleared: an admin's `gpuflow node clear`.
    #[serde(default)]
    pub health_cleared_at: u64,
    /// Sessions into running tasks (`job exec`, `job attach`) the agent
    /// opens: each connects to `/v1/agent/exec/{session}`.
    #[serde(default, skip_serializing_if = "Vec::is_empty")]
    pub sessions: Vec<SessionOrder>,
}

/// A session into a running task, relayed by the server between a client
/// and the task's agent over WebSocket. Binary messages carry bytes: from
/// the client, the command's input; to it, a channel byte (1: stdout, 2:
/// stderr) then output. Text messages carry [`SessionControl`].
#[derive(Clone, Debug, PartialEq, Serialize, Deserialize, JsonSchema)]
pub struct SessionOrder {
    pub session: String,
    pub job: u64,
    pub attempt: u32,
    pub group: u16,
    pub index: u32,
    /// A command to run as the task runs (its user, cgroup, directory,
    /// environment, namespaces and seccomp filter); empty: attach to the
    /// task's own output instead.
    #[serde(default, skip_serializing_if = "Vec::is_empty")]
    pub command: Vec<String>,
    /// Run the command on a terminal of its own (stdout and stderr as one).
    #[serde(default)]
    pub tty: bool,
    #[serde(default)]
    pub rows: u16,
    #[serde(default)]
    pub cols: u16,
}

/// A session's control messages (JSON in WebSocket text messages).
#[derive(Clone, Debug, PartialEq, Serialize, Deserialize, JsonSchema)]
#[serde(rename_all = "snake_case")]
pub enum SessionControl {
    /// From the client: the terminal's new size.
    Resize { rows: u16, cols: u16 },
    /// From the client: no more input.
    Eof,
    /// To the client: the command ended with this status (128 + a signal's
    /// number when a signal ended it).
    Exit { code: i32 },
    /// To the client: the session could not go on.
    Error { message: String },
}

/// Job lists are filtered by these.
#[derive(Clone, Debug, PartialEq, Default, Serialize, Deserialize, JsonSchema)]
#[serde(deny_unknown_fields)]
pub struct JobFilter {
    #[serde(default)]
    pub team: Option<String>,
    #[serde(default)]
    pub queue: Option<String>,
    #[serde(default)]
    pub state: Option<String>,
    #[serde(default)]
    pub user: Option<String>,
    #[serde(default)]
    pub limit: Option<usize>,
}

/// A valid name for teams, users, queues and nodes.
pub fn valid_name(s: &str) -> bool {
    !s.is_empty()
        && s.len() <= 63
        && s.starts_with(|c: char| c.is_ascii_alphanumeric())
        && s.chars()
            .all(|c| c.is_ascii_lowercase() || c.is_ascii_digit() || matches!(c, '-' | '_' | '.'))
}

// ---- capacity planning ----

/// The cluster's own recorded workload, for `gpuflow sim whatif`: the jobs
/// submitted in a range that held GPUs, the nodes and the teams' quotas.
#[derive(Clone, Debug, PartialEq, Serialize, Deserialize, JsonSchema)]
pub struct RecordedWorkload {
    pub from: u64,
    pub to: u64,
    pub jobs: Vec<RecordedJob>,
    /// The nodes not lost, grouped by shape.
    pub nodes: Vec<RecordedNodes>,
    pub teams: Vec<RecordedTeam>,
    pub prices: Prices,
    /// Jobs of the range left out, by why (never held a GPU, several task
    /// groups asking for different GPUs).
    pub left_out: BTreeMap<String, u32>,
    /// Seconds between the server's scheduling cycles (at least 1): what a
    /// replay cycles at by default. 0 from a server that did not say.
    #[serde(default)]
    pub cycle_s: u64,
}

/// One recorded job: when it came, how long it held its GPUs (over every
/// attempt), what it asked for and on which model it ran.
#[serde_with::skip_serializing_none]
#[derive(Clone, Debug, PartialEq, Serialize, Deserialize, JsonSchema)]
pub struct RecordedJob {
    pub id: u64,
    pub submitted_at: u64,
    pub duration_s: u64,
    pub tasks: u32,
    /// Whole GPUs per task; 0 when each task holds a share of one GPU.
    pub gpus_per_task: u32,
    /// The share of one GPU each task held, in thousandths, when shared (a
    /// MIG instance or time slice at its quota equivalent).
    #[serde(default)]
    pub milli: Option<u32>,
    pub team: String,
    pub kind: crate::Kind,
    pub priority: i32,
    #[serde(default)]
    pub max_runtime_s: Option<u64>,
    pub model: String,
}

/// Nodes of one shape.
#[derive(Clone, Debug, PartialEq, Serialize, Deserialize, JsonSchema)]
pub struct RecordedNodes {
    pub count: u32,
    pub gpus: u32,
    pub model: String,
    pub cpu: u64,
    pub mem_gib: u64,
}

/// A team's queues summed: weight, and GPUs guaranteed and borrowable per
/// GPU model (a `*` quota given to each model).
#[derive(Clone, Debug, PartialEq, Serialize, Deserialize, JsonSchema)]
pub struct RecordedTeam {
    pub name: String,
    pub weight: f64,
    pub guaranteed: BTreeMap<String, f64>,
    /// Absent for a model: no limit.
    pub borrow_limit: BTreeMap<String, f64>,
}

// ---- inference services ----

/// An inference service: `replicas` copies of one task, each its own job
/// (so one that fails is replaced alone), each on a port the agent picks,
/// listed as an endpoint once its readiness check passes. Replicas are of
/// kind inference: never preempted by training.
#[serde_with::skip_serializing_none]
#[derive(Clone, Debug, PartialEq, Serialize, Deserialize, JsonSchema)]
#[serde(deny_unknown_fields)]
pub struct ServiceSpec {
    pub name: String,
    pub queue: String,
    #[serde(default)]
    pub project: Option<String>,
    pub replicas: u32,
    /// The fewest and most replicas `scale` may set (default 1 and 100).
    #[serde(default = "one_u32")]
    pub min_replicas: u32,
    #[serde(default = "hundred")]
    pub max_replicas: u32,
    /// What each replica runs (its `replicas` must stay 1); it serves on
    /// `$PORT`.
    pub task: crate::TaskGroupSpec,
    #[serde(default)]
    pub readiness: Option<crate::job::Readiness>,
    #[serde(default)]
    pub rollout: Rollout,
    #[serde(default)]
    pub priority: i32,
}

fn one_u32() -> u32 {
    1
}
fn hundred() -> u32 {
    100
}

/// How a change of the task replaces replicas: at most `max_surge` more
/// than `replicas` exist, and at least `replicas - max_unavailable` are
/// ready, at any time.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Serialize, Deserialize, JsonSchema)]
#[serde(deny_unknown_fields)]
pub struct Rollout {
    #[serde(default = "one_u32")]
    pub max_surge: u32,
    #[serde(default)]
    pub max_unavailable: u32,
}

impl Default for Rollout {
    fn default() -> Rollout {
        Rollout {
            max_surge: 1,
            max_unavailable: 0,
        }
    }
}

impl ServiceSpec {
    /// # Errors
    /// A 400 naming each wrong field.
    pub fn validate(&self) -> Result<(), ApiError> {
        let mut errs = Vec::new();
        let mut bad = |f: String, m: String| {
            errs.push(FieldError {
                field: f,
                message: m,
            })
        };
        if !valid_name(&self.name) {
            bad(
                "name".into(),
                format!(
                    "{:?} is not a valid name: 1 to 63 lowercase letters, digits, '-', '_' or '.'",
                    self.name
                ),
            );
        }
        if !(1..=1000).contains(&self.max_replicas) || self.min_replicas > self.max_replicas {
            bad(
                "max_replicas".into(),
                "min_replicas ≤ max_replicas ≤ 1000".into(),
            );
        }
        if !(self.min_replicas..=self.max_replicas).contains(&self.replicas) {
            bad(
                "replicas".into(),
                format!(
                    "must be from min_replicas ({}) to max_replicas ({})",
                    self.min_replicas, self.max_replicas
                ),
            );
        }
        if self.task.replicas != 1 {
            bad(
                "task.replicas".into(),
                "a service's copies are its `replicas`; leave task.replicas out".into(),
            );
        }
        if self.rollout.max_surge + self.rollout.max_unavailable == 0 {
            bad(
                "rollout".into(),
                "max_surge or max_unavailable must be above 0, or no replica could ever be replaced".into(),
            );
        }
        if let Some(r) = &self.readiness {
            r.check("readiness", &mut bad);
        }
        if let Err(e) = self.job_spec(0).validate() {
            if e.fields.is_empty() {
                bad("task".into(), e.message);
            }
            for f in e.fields {
                bad(format!("task ({})", f.field), f.message);
            }
        }
        if errs.is_empty() {
            Ok(())
        } else {
            Err(ApiError::invalid(errs))
        }
    }

    /// The job one replica is.
    pub fn job_spec(&self, _version: u32) -> crate::JobSpec {
        crate::JobSpec {
            name: self.name.clone(),
            queue: self.queue.clone(),
            project: self.project.clone(),
            kind: crate::Kind::Inference,
            priority_class: None,
            priority: self.priority,
            tasks: vec![self.task.clone()],
            topology: None,
            max_runtime_s: None,
            retry: crate::job::RetrySpec::default(),
            checkpoint: crate::job::CheckpointSpec::default(),
            idle: None,
            array: None,
            dependency: None,
            on_unmet_dependency: Default::default(),
            reservation: None,
        }
    }
}

/// Changes to a service: its size (within its bounds), its task (a
/// rolling replacement), its readiness check or rollout bounds.
#[derive(Clone, Debug, PartialEq, Default, Serialize, Deserialize, JsonSchema)]
#[serde(deny_unknown_fields)]
pub struct ServicePatch {
    #[serde(default)]
    pub replicas: Option<u32>,
    #[serde(default)]
    pub task: Option<crate::TaskGroupSpec>,
    #[serde(default)]
    pub readiness: Option<crate::job::Readiness>,
    #[serde(default)]
    pub rollout: Option<Rollout>,
}

/// A service as it stands.
#[derive(Clone, Debug, PartialEq, Serialize, Deserialize, JsonSchema)]
pub struct ServiceView {
    #[serde(flatten)]
    pub spec: ServiceSpec,
    pub team: String,
    /// Bumped by each change of the task; replicas of older versions are
    /// being replaced.
    pub version: u32,
    /// Replicas whose readiness check passes (or running, without one).
    pub ready: u32,
    pub members: Vec<ReplicaView>,
    /// `address:port` of each ready replica: where clients connect.
    pub endpoints: Vec<String>,
}

/// One replica of a service.
#[serde_with::skip_serializing_none]
#[derive(Clone, Debug, PartialEq, Serialize, Deserialize, JsonSchema)]
pub struct ReplicaView {
    pub job: u64,
    pub version: u32,
    pub state: JobState,
    #[serde(default)]
    pub node: Option<String>,
    #[serde(default)]
    pub port: Option<u16>,
    pub ready: bool,
}

// ---- webhooks ----

/// The events a webhook may ask for: of a job, `begin` (its tasks run),
/// `end` (it finished, however), `fail`, `timeout` (past its max runtime),
/// `preempted`, `requeued`; of its team, `budget-low` (a queue or project
/// past its budget's taper point, once a period); or `all`.
pub const WEBHOOK_EVENTS: &[&str] = &[
    "begin",
    "end",
    "fail",
    "timeout",
    "preempted",
    "requeued",
    "budget-low",
    "all",
];

/// A new webhook: the jobs of the caller (or, for a team lead or an
/// admin, of a whole team) POST their state changes to `url`, signed.
#[serde_with::skip_serializing_none]
#[derive(Clone, Debug, PartialEq, Serialize, Deserialize, JsonSchema)]
#[serde(deny_unknown_fields)]
pub struct WebhookSpec {
    /// `http://` or `https://`; or give `mail`.
    #[serde(default)]
    pub url: Option<String>,
    /// A mail address, sent through the server's SMTP server.
    #[serde(default)]
    pub mail: Option<String>,
    /// Of [`WEBHOOK_EVENTS`].
    pub events: Vec<String>,
    /// Every job of this team (team leads, for theirs; admins); without
    /// it, the caller's own jobs.
    #[serde(default)]
    pub team: Option<String>,
}

/// A webhook as the API shows it (its secret only once, when made).
#[serde_with::skip_serializing_none]
#[derive(Clone, Debug, PartialEq, Serialize, Deserialize, JsonSchema)]
pub struct WebhookView {
    pub id: String,
    #[serde(default)]
    pub url: Option<String>,
    #[serde(default)]
    pub mail: Option<String>,
    pub events: Vec<String>,
    pub team: String,
    /// Whose jobs; absent: every job of the team.
    #[serde(default)]
    pub user: Option<String>,
    pub created_by: String,
    pub created_at: u64,
    /// The HMAC-SHA256 key of `X-Gpuflow-Signature`, shown once.
    #[serde(default)]
    pub secret: Option<String>,
}

/// One attempt to deliver a notification.
#[serde_with::skip_serializing_none]
#[derive(Clone, Debug, PartialEq, Serialize, Deserialize, JsonSchema)]
pub struct Delivery {
    /// The notification's number (`X-Gpuflow-Delivery`); its attempts share it.
    pub delivery: u64,
    pub at: u64,
    pub event: String,
    pub job: u64,
    pub attempt: u32,
    /// The receiver's HTTP status, when it answered.
    #[serde(default)]
    pub status: Option<u16>,
    /// `delivered`, `retrying` or `failed`, with what went wrong.
    pub outcome: String,
}

// ---- reservations ----

/// A window of time on some nodes: kept for the teams and users it names
/// (their jobs ask for it by name), or for maintenance (no job runs). Jobs
/// of others run there before it only if they end before it starts.
#[serde_with::skip_serializing_none]
#[derive(Clone, Debug, PartialEq, Serialize, Deserialize, JsonSchema)]
#[serde(deny_unknown_fields)]
pub struct ReservationSpec {
    pub name: String,
    /// Unix seconds.
    pub start: u64,
    pub end: u64,
    /// These nodes; or `count` nodes of GPU `model`, chosen at creation.
    #[serde(default, skip_serializing_if = "Vec::is_empty")]
    pub nodes: Vec<String>,
    #[serde(default)]
    pub count: Option<u32>,
    #[serde(default)]
    pub model: Option<String>,
    #[serde(default, skip_serializing_if = "Vec::is_empty")]
    pub teams: Vec<String>,
    #[serde(default, skip_serializing_if = "Vec::is_empty")]
    pub users: Vec<String>,
    /// No job runs on its nodes while it is open.
    #[serde(default)]
    pub maintenance: bool,
}

/// A reservation as made: its nodes named.
#[derive(Clone, Debug, PartialEq, Serialize, Deserialize, JsonSchema)]
pub struct Reservation {
    pub name: String,
    pub start: u64,
    pub end: u64,
    pub nodes: Vec<String>,
    #[serde(default, skip_serializing_if = "Vec::is_empty")]
    pub teams: Vec<String>,
    #[serde(default, skip_serializing_if = "Vec::is_empty")]
    pub users: Vec<String>,
    #[serde(default)]
    pub maintenance: bool,
    pub created_by: String,
}

impl Reservation {
    /// Open at `t`.
    pub fn open(&self, t: u64) -> bool {
        (self.start..self.end).contains(&t)
    }

    /// Who it is for, in words.
    pub fn purpose(&self) -> String {
        if self.maintenance {
            return format!("maintenance {:?}", self.name);
        }
        let mut who: Vec<String> = self.teams.iter().map(|t| format!("team {t}")).collect();
        who.extend(self.users.iter().map(|u| format!("user {u}")));
        format!("reservation {:?} of {}", self.name, who.join(", "))
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::depend::DepKind;
    use crate::job::Kind;

    /// Each name strum gives a variant is the one serde writes, and reads
    /// back as the same variant.
    #[test]
    fn names_are_the_wires() {
        fn same<T: Serialize + std::fmt::Debug>(v: T, name: &str) {
            assert_eq!(serde_json::to_value(&v).unwrap(), name, "{v:?}");
        }
        assert_eq!(ALL_STATES.len(), 11);
        for &s in ALL_STATES {
            same(s, s.as_str());
            assert_eq!(JobState::parse(s.as_str()), Some(s));
        }
        assert_eq!(JobState::parse("Pending"), None);
        for r in [Role::Admin, Role::TeamLead, Role::Member, Role::Viewer] {
            same(r, r.as_str());
        }
        assert_eq!(Role::TeamLead.as_str(), "team-lead");
        for n in [
            NodeState::Ready,
            NodeState::Cordoned,
            NodeState::Draining,
            NodeState::Lost,
        ] {
            same(n, n.as_str());
        }
        for k in [Kind::Inference, Kind::Notebook, Kind::Training, Kind::Batch] {
            same(k, k.as_str());
        }
        for d in [
            DepKind::After,
            DepKind::AfterAny,
            DepKind::AfterOk,
            DepKind::AfterNotOk,
            DepKind::AfterCorr,
        ] {
            same(d, d.as_str());
        }
        assert_eq!(DepKind::AfterNotOk.as_str(), "afternotok");
    }
}
