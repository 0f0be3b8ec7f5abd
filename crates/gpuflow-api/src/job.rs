//! The job spec users write (YAML or JSON) and its validation. Parsing rejects
//! unknown fields and wrong types with the path of the field; [`JobSpec::validate`]
//! then checks values and names every field that is wrong and what is allowed.

use std::collections::BTreeMap;

use schemars::JsonSchema;
use serde::{Deserialize, Serialize};

use crate::depend::{Dependency, OnUnmet};
use crate::error::{ApiError, FieldError};

/// What kind of work a job is; it picks the default priority class.
#[derive(
    Clone,
    Copy,
    Debug,
    Default,
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
pub enum Kind {
    Inference,
    Notebook,
    #[default]
    Training,
    Batch,
}

impl Kind {
    /// Its name, as the API writes it.
    pub fn as_str(self) -> &'static str {
        self.into()
    }
}

/// A job: one or more task groups placed together as a gang.
#[serde_with::skip_serializing_none]
#[derive(Clone, Debug, PartialEq, Serialize, Deserialize, JsonSchema)]
#[serde(deny_unknown_fields)]
pub struct JobSpec {
    pub name: String,
    pub queue: String,
    /// The project of the queue's team the job is accounted to.
    #[serde(default)]
    pub project: Option<String>,
    #[serde(default)]
    pub kind: Kind,
    /// `inference`, `notebook`, `training` or `batch`; defaults to the kind.
    #[serde(default)]
    pub priority_class: Option<String>,
    /// Priority inside the class, -1000..=1000.
    #[serde(default)]
    pub priority: i32,
    #[serde(deserialize_with = "exact_vec")]
    pub tasks: Vec<TaskGroupSpec>,
    #[serde(default)]
    pub topology: Option<TopologySpec>,
    /// Seconds; the job is stopped when it runs longer.
    #[serde(default)]
    pub max_runtime_s: Option<u64>,
    #[serde(default)]
    pub retry: RetrySpec,
    #[serde(default)]
    pub checkpoint: CheckpointSpec,
    #[serde(default)]
    pub idle: Option<IdleSpec>,
    /// A job array, as Slurm writes it: `0-999`, `1,3,8-15`, with `%50` to
    /// run at most 50 elements at once. One submission stores one job per
    /// index; each task sees its index in `GPUFLOW_ARRAY_INDEX`.
    #[serde(default)]
    pub array: Option<String>,
    /// What it waits for, as Slurm writes it (`sbatch --dependency`):
    /// `afterok:12:13,afterany:14`, `after`, `afternotok`, `aftercorr`
    /// (element by element of two arrays), `singleton` (no earlier job of
    /// the same name and user unfinished). Jobs of the same team only.
    #[serde(default)]
    pub dependency: Option<String>,
    /// What becomes of it when its dependency can no longer be met:
    /// `cancel` (the default) or `hold`.
    #[serde(default, skip_serializing_if = "OnUnmet::is_cancel")]
    pub on_unmet_dependency: OnUnmet,
    /// Runs in this reservation (`gpuflow reservation ls`): only on its
    /// nodes, only while it is open, only for the teams and users it names.
    #[serde(default)]
    pub reservation: Option<String>,
}

/// How the agent checks that a task serves, every `period_s`: an HTTP GET
/// of `http_path` on its port (a 2xx or 3xx answer within a second is
/// ready), or a `command` run beside the task, as its user, in its cgroup,
/// with its environment and directory (exit 0 within `timeout_s` is ready).
/// One of the two.
#[serde_with::skip_serializing_none]
#[derive(Clone, Debug, PartialEq, Eq, Serialize, Deserialize, JsonSchema)]
#[serde(deny_unknown_fields)]
pub struct Readiness {
    #[serde(default)]
    pub http_path: Option<String>,
    #[serde(default)]
    pub command: Option<Vec<String>>,
    #[serde(default = "two")]
    pub period_s: u64,
    /// How long a command may run before it counts as a failure.
    #[serde(default = "one_s")]
    pub timeout_s: u64,
}

fn two() -> u64 {
    2
}

fn one_s() -> u64 {
    1
}

impl Readiness {
    /// An HTTP check of `path`.
    #[must_use]
    pub fn http(path: &str, period_s: u64) -> Readiness {
        Readiness {
            http_path: Some(path.to_string()),
            command: None,
            period_s,
            timeout_s: 1,
        }
    }

    /// Adds what is wrong with it to `bad`.
    pub fn check(&self, at: &str, bad: &mut dyn FnMut(String, String)) {
        match (&self.http_path, &self.command) {
            (Some(_), Some(_)) | (None, None) => bad(
                at.to_string(),
                "give one check: http_path (an HTTP GET on the task's port) or command".into(),
            ),
            (Some(path), None) => {
                if !path.starts_with('/')
                    || path.len() > 256
                    || path.chars().any(|c| c.is_whitespace() || c.is_control())
                {
                    bad(
                        format!("{at}.http_path"),
                        "a path on the task's port, starting with '/' (at most 256 characters, no spaces)"
                            .into(),
                    );
                }
            }
            (None, Some(cmd)) => {
                if cmd.is_empty()
                    || cmd[0].is_empty()
                    || cmd.len() > 64
                    || cmd.iter().any(|a| a.len() > 4096 || a.contains('\0'))
                {
                    bad(
                        format!("{at}.command"),
                        "a program and its arguments (at most 64, each at most 4096 bytes, no NUL)"
                            .into(),
                    );
                }
            }
        }
        if !(1..=300).contains(&self.period_s) {
            bad(format!("{at}.period_s"), "must be 1 to 300 seconds".into());
        }
        if !(1..=60).contains(&self.timeout_s) {
            bad(format!("{at}.timeout_s"), "must be 1 to 60 seconds".into());
        }
    }
}

/// The most elements one array submission may hold.
pub const MAX_ARRAY: usize = 10_000;

/// A parsed `array`: its indices, in order, and how many may run at once.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct ArraySpec {
    pub indices: Vec<u32>,
    pub max_concurrent: Option<u32>,
}

impl ArraySpec {
    /// The `%N` of an array, without expanding its indices.
    pub fn limit_of(s: &str) -> Option<u32> {
        s.split_once('%').and_then(|(_, n)| n.trim().parse().ok())
    }

    /// Parses `0-999%50`, `1,3,8-15`, `7`.
    ///
    /// # Errors
    /// What is wrong, with the form that works.
    pub fn parse(s: &str) -> Result<ArraySpec, String> {
        let form =
            "write it as Slurm does: 0-999, 1,3,8-15, with %N to run at most N at once (0-999%50)";
        let (list, limit) =
            match s.split_once('%') {
                Some((l, n)) => {
                    let n: u32 =
                        n.trim().parse().ok().filter(|n| *n >= 1).ok_or_else(|| {
                            format!("{s:?}: %N takes a number of at least 1; {form}")
                        })?;
                    (l, Some(n))
                }
                None => (s, None),
            };
        let mut indices = std::collections::BTreeSet::new();
        for part in list.split(',') {
            let part = part.trim();
            let (a, b) = match part.split_once('-') {
                Some((a, b)) => (a, b),
                None => (part, part),
            };
            let (Ok(a), Ok(b)) = (a.trim().parse::<u32>(), b.trim().parse::<u32>()) else {
                return Err(format!(
                    "{s:?}: {part:?} is not an index or a range; {form}"
                ));
            };
            if a > b || b > 1_000_000 {
                return Err(format!(
                    "{s:?}: {part:?}: ranges go up (FIRST-LAST) and indices up to 1000000"
                ));
            }
            if (b - a) as usize + indices.len() >= MAX_ARRAY {
                return Err(format!(
                    "{s:?}: more than {MAX_ARRAY} elements; split it into several arrays"
                ));
            }
            indices.extend(a..=b);
        }
        Ok(ArraySpec {
            indices: indices.into_iter().collect(),
            max_concurrent: limit,
        })
    }
}

/// Replicas of one task with the same command and resources.
#[serde_with::skip_serializing_none]
#[derive(Clone, Debug, PartialEq, Serialize, Deserialize, JsonSchema)]
#[serde(deny_unknown_fields)]
pub struct TaskGroupSpec {
    pub name: String,
    #[serde(default = "one")]
    pub replicas: u32,
    /// The program and its fixed arguments.
    pub command: Vec<String>,
    #[serde(default, skip_serializing_if = "Vec::is_empty")]
    pub args: Vec<String>,
    #[serde(default, skip_serializing_if = "BTreeMap::is_empty")]
    pub env: BTreeMap<String, String>,
    #[serde(default)]
    pub working_dir: Option<String>,
    #[serde(default)]
    pub resources: Resources,
    /// Ports each task serves on, by name (at most 4; lowercase letters,
    /// digits and '-', up to 15 characters): its agent picks a free port on
    /// its node for each, given in `GPUFLOW_PORT_<NAME>` (the first also in
    /// `PORT`), and the server proxies HTTP and WebSocket to it at
    /// `/v1/jobs/{id}/proxy/{port}/`, a path the task gets in
    /// `GPUFLOW_BASE_URL_<NAME>` (the first also in `GPUFLOW_BASE_URL`),
    /// for those who may see the job. A notebook that names none gets
    /// `[http]`.
    #[serde(default, skip_serializing_if = "Vec::is_empty")]
    pub ports: Vec<String>,
    /// An OCI image the task runs in (`registry.example.com/team/pytorch:2.4`,
    /// `127.0.0.1:5000/team/busybox@sha256:…`), pulled by its node and run
    /// by runc as the task runs otherwise (its user, limits, environment,
    /// directory and `$HOME` bound in at the same path, the node's
    /// network). The digest pulled is recorded on the job and a retry runs
    /// the same one. None: a process on the node itself.
    #[serde(default)]
    pub image: Option<String>,
}

/// Whether `image` reads as an image reference: `[host[:port]/]path[:tag][@digest]`.
pub fn valid_image(image: &str) -> bool {
    !image.is_empty()
        && image.len() <= 512
        && !image.starts_with(['/', '.', '-', ':', '@'])
        && image
            .chars()
            .all(|c| c.is_ascii_alphanumeric() || "/:._-@+".contains(c))
        && image.split('@').count() <= 2
        && !image.contains("//")
}

/// The most ports one task may declare.
pub const MAX_PORTS: usize = 4;

/// Whether `name` is a valid port name: what `GPUFLOW_PORT_<NAME>` needs.
pub fn valid_port_name(name: &str) -> bool {
    (1..=15).contains(&name.len())
        && name.starts_with(|c: char| c.is_ascii_lowercase())
        && name
            .chars()
            .all(|c| c.is_ascii_lowercase() || c.is_ascii_digit() || c == '-')
}

/// The names of the ports a task group's tasks get: those it declares, or
/// `[http]` for a notebook's.
pub fn ports_of(kind: Kind, g: &TaskGroupSpec) -> Vec<String> {
    if g.ports.is_empty() && kind == Kind::Notebook {
        vec!["http".into()]
    } else {
        g.ports.clone()
    }
}

fn one() -> u32 {
    1
}

#[serde_with::skip_serializing_none]
#[derive(Clone, Debug, PartialEq, Serialize, Deserialize, JsonSchema)]
#[serde(deny_unknown_fields)]
pub struct Resources {
    /// CPU cores (fractions allowed).
    #[serde(default = "default_cpu")]
    pub cpu: f64,
    #[serde(default = "default_mem")]
    pub memory_mib: u64,
    #[serde(default)]
    pub gpu: Option<GpuSpec>,
}

fn default_cpu() -> f64 {
    1.0
}
fn default_mem() -> u64 {
    1024
}

impl Default for Resources {
    fn default() -> Resources {
        Resources {
            cpu: default_cpu(),
            memory_mib: default_mem(),
            gpu: None,
        }
    }
}

/// How a task uses GPUs.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Default, Serialize, Deserialize, JsonSchema)]
#[serde(rename_all = "kebab-case")]
pub enum GpuMode {
    #[default]
    Whole,
    Mig,
    Fraction,
    TimeSlice,
}

#[serde_with::skip_serializing_none]
#[derive(Clone, Debug, PartialEq, Default, Serialize, Deserialize, JsonSchema)]
#[serde(deny_unknown_fields)]
pub struct GpuSpec {
    #[serde(default)]
    pub mode: GpuMode,
    /// Whole GPUs per task (mode `whole`).
    #[serde(default)]
    pub count: Option<u32>,
    /// MIG profile such as `1g.10gb` (mode `mig`).
    #[serde(default)]
    pub profile: Option<String>,
    /// Share of one GPU's compute, 0 < f < 1 (mode `fraction`).
    #[serde(default)]
    pub fraction: Option<f64>,
    /// GPU memory claimed (modes `fraction` and `time-slice`).
    #[serde(default)]
    pub memory_mib: Option<u64>,
    /// GPU models the task accepts; empty: any.
    #[serde(default, skip_serializing_if = "Vec::is_empty")]
    pub models: Vec<String>,
}

#[derive(Clone, Copy, Debug, PartialEq, Eq, Serialize, Deserialize, JsonSchema)]
#[serde(rename_all = "kebab-case")]
pub enum TopologyLevel {
    Node,
    Nvlink,
    Rack,
    Block,
}

#[derive(Clone, Debug, PartialEq, Serialize, Deserialize, JsonSchema)]
#[serde(deny_unknown_fields)]
pub struct TopologySpec {
    pub level: TopologyLevel,
    #[serde(default)]
    pub required: bool,
}

#[derive(Clone, Debug, PartialEq, Serialize, Deserialize, JsonSchema)]
#[serde(deny_unknown_fields)]
pub struct RetrySpec {
    /// Retries after a failure (0: none).
    #[serde(default)]
    pub limit: u32,
    /// First backoff in seconds; it doubles per retry, capped at one hour.
    #[serde(default = "default_backoff")]
    pub backoff_s: u64,
}

fn default_backoff() -> u64 {
    10
}

impl Default for RetrySpec {
    fn default() -> RetrySpec {
        RetrySpec {
            limit: 0,
            backoff_s: default_backoff(),
        }
    }
}

#[derive(Clone, Debug, PartialEq, Serialize, Deserialize, JsonSchema)]
#[serde(deny_unknown_fields)]
pub struct CheckpointSpec {
    /// Seconds between the stop signal and the kill.
    #[serde(default = "default_grace")]
    pub grace_s: u64,
    #[serde(default = "default_signal")]
    pub signal: String,
}

fn default_grace() -> u64 {
    30
}
fn default_signal() -> String {
    "SIGTERM".into()
}

impl Default for CheckpointSpec {
    fn default() -> CheckpointSpec {
        CheckpointSpec {
            grace_s: default_grace(),
            signal: default_signal(),
        }
    }
}

/// What to do with a job whose GPUs sit idle: below `below_pct` GPU
/// utilisation on every task for `after_s`, it is warned (an event); if it
/// is still idle `warn_s` later, its action is taken.
#[derive(Clone, Debug, PartialEq, Serialize, Deserialize, JsonSchema)]
#[serde(deny_unknown_fields)]
pub struct IdleSpec {
    pub after_s: u64,
    pub action: IdleAction,
    /// Idle below this GPU utilisation, in percent (default 5).
    #[serde(default = "default_idle_below")]
    pub below_pct: u32,
    /// Between the warning and the action (default 300 s).
    #[serde(default = "default_idle_warn")]
    pub warn_s: u64,
}

impl IdleSpec {
    /// Reports each wrong field (`at.after_s`, …) to `bad`.
    pub fn check(&self, at: &str, bad: &mut impl FnMut(String, String)) {
        if self.after_s < 10 || self.after_s > MAX_RUNTIME_S {
            bad(
                format!("{at}.after_s"),
                "must be 10 seconds to a year".into(),
            );
        }
        if self.warn_s > MAX_RUNTIME_S {
            bad(format!("{at}.warn_s"), "must be at most a year".into());
        }
        if !(1..=100).contains(&self.below_pct) {
            bad(
                format!("{at}.below_pct"),
                "must be 1 to 100 (percent GPU utilisation)".into(),
            );
        }
    }
}

fn default_idle_below() -> u32 {
    5
}
fn default_idle_warn() -> u64 {
    300
}

#[derive(Clone, Copy, Debug, PartialEq, Eq, Serialize, Deserialize, JsonSchema)]
#[serde(rename_all = "kebab-case")]
pub enum IdleAction {
    /// Only the warning.
    Notify,
    /// Stopped and held as suspended; its owner resumes it.
    Suspend,
    /// Stopped and queued again (it gives its GPUs back and waits its turn).
    Requeue,
    Cancel,
}

/// Signals a job may ask to be stopped with.
pub const SIGNALS: &[&str] = &[
    "SIGTERM", "SIGINT", "SIGUSR1", "SIGUSR2", "SIGHUP", "SIGQUIT",
];
pub const CLASSES: &[&str] = &["inference", "notebook", "training", "batch"];

const MAX_CPU: f64 = 4096.0;
const MAX_MEM_MIB: u64 = 64 * 1024 * 1024;
const MAX_REPLICAS: u32 = 4096;
const MAX_GPUS_PER_TASK: u32 = 64;
const MAX_RUNTIME_S: u64 = 366 * 24 * 3600;

/// A parse error at `path`, the path said once: YAML's errors start with
/// the path of the mapping they are in (`tasks[0]: unknown field …`),
/// which the full path already names.
fn at_path(path: &str, message: &str) -> String {
    let message = match message.split_once(": ") {
        Some((head, rest)) if !head.contains(' ') && path.starts_with(head) => rest,
        _ => message,
    };
    if path == "." || path.is_empty() {
        message.to_string()
    } else {
        format!("{path}: {message}")
    }
}

/// Deserialises a list at its exact length. A list read item by item grows
/// its buffer by doubling, and a job's one task group would otherwise keep
/// room for four: about 860 bytes per job, held for the job's life.
fn exact_vec<'de, D, T>(d: D) -> Result<Vec<T>, D::Error>
where
    D: serde::Deserializer<'de>,
    T: Deserialize<'de>,
{
    let mut v = Vec::<T>::deserialize(d)?;
    v.shrink_to_fit();
    Ok(v)
}

impl JobSpec {
    /// Parses a body as JSON (`json`) or YAML, then validates it.
    ///
    /// # Errors
    /// A 400 naming the field and what is allowed.
    pub fn parse(body: &[u8], json: bool) -> Result<JobSpec, ApiError> {
        let spec: JobSpec = if json {
            let de = &mut serde_json::Deserializer::from_slice(body);
            serde_path_to_error::deserialize(de).map_err(|e| {
                ApiError::bad_request(
                    "invalid_spec",
                    at_path(&e.path().to_string(), &e.inner().to_string()),
                )
            })?
        } else {
            let text = std::str::from_utf8(body)
                .map_err(|_| ApiError::bad_request("invalid_spec", "the body is not UTF-8 text"))?;
            let de = serde_norway::Deserializer::from_str(text);
            serde_path_to_error::deserialize(de).map_err(|e| {
                ApiError::bad_request(
                    "invalid_spec",
                    at_path(&e.path().to_string(), &e.inner().to_string()),
                )
            })?
        };
        spec.validate()?;
        Ok(spec)
    }

    /// The priority class, from the spec or the kind.
    pub fn class(&self) -> &str {
        self.priority_class.as_deref().unwrap_or(self.kind.as_str())
    }

    /// GPUs the whole job asks for, in milli-GPU (MIG and time slices count 0).
    pub fn gpu_milli(&self) -> u64 {
        self.tasks
            .iter()
            .map(|g| g.replicas as u64 * g.resources.gpu.as_ref().map_or(0, GpuSpec::milli))
            .sum()
    }

    /// Checks every value.
    ///
    /// # Errors
    /// A 400 listing each wrong field.
    pub fn validate(&self) -> Result<(), ApiError> {
        let mut errs = Vec::new();
        let mut bad = |field: String, msg: String| {
            errs.push(FieldError {
                field,
                message: msg,
            })
        };
        check_name("name", &self.name, &mut bad);
        if let Some(a) = &self.array
            && let Err(e) = ArraySpec::parse(a)
        {
            bad("array".into(), e);
        }
        if let Some(d) = &self.dependency {
            match Dependency::parse(d) {
                Err(e) => bad("dependency".into(), e),
                Ok(d) => {
                    let corr = d
                        .terms
                        .iter()
                        .any(|t| t.kind == crate::depend::DepKind::AfterCorr);
                    if corr && self.array.is_none() {
                        bad(
                            "dependency".into(),
                            "aftercorr pairs the elements of two arrays: this job is not an array"
                                .into(),
                        );
                    }
                }
            }
        }
        if self.queue.trim().is_empty() {
            bad("queue".into(), "must name a queue".into());
        }
        if !CLASSES.contains(&self.class()) {
            bad(
                "priority_class".into(),
                format!(
                    "unknown class {:?}; allowed: {}",
                    self.class(),
                    CLASSES.join(", ")
                ),
            );
        }
        if !(-1000..=1000).contains(&self.priority) {
            bad("priority".into(), "must be between -1000 and 1000".into());
        }
        if self.tasks.is_empty() {
            bad("tasks".into(), "must list at least one task group".into());
        }
        if self.tasks.len() > 64 {
            bad("tasks".into(), "at most 64 task groups".into());
        }
        let mut names = std::collections::BTreeSet::new();
        let mut total: u64 = 0;
        for (i, g) in self.tasks.iter().enumerate() {
            let at = |f: &str| format!("tasks[{i}].{f}");
            check_name(&at("name"), &g.name, &mut bad);
            if !names.insert(&g.name) {
                bad(
                    at("name"),
                    format!("{:?} is used by another task group", g.name),
                );
            }
            if g.replicas == 0 || g.replicas > MAX_REPLICAS {
                bad(at("replicas"), format!("must be 1 to {MAX_REPLICAS}"));
            }
            total += g.replicas as u64;
            if let Some(i) = &g.image
                && !valid_image(i)
            {
                bad(
                    at("image"),
                    format!(
                        "{i:?} is not an image reference: [HOST[:PORT]/]PATH[:TAG][@sha256:DIGEST], e.g. 127.0.0.1:5000/team/busybox:1"
                    ),
                );
            }
            if g.ports.len() > MAX_PORTS {
                bad(at("ports"), format!("at most {MAX_PORTS} ports a task"));
            }
            let mut seen = std::collections::BTreeSet::new();
            for p in &g.ports {
                if !valid_port_name(p) {
                    bad(
                        at("ports"),
                        format!(
                            "{p:?} is not a valid port name: 1 to 15 lowercase letters, digits or '-', starting with a letter (e.g. http)"
                        ),
                    );
                } else if !seen.insert(p) {
                    bad(at("ports"), format!("{p:?} is named twice"));
                }
            }
            if g.command.is_empty() || g.command[0].trim().is_empty() {
                bad(at("command"), "must name a program to run".into());
            }
            for k in g.env.keys() {
                if k.is_empty()
                    || k.starts_with(|c: char| c.is_ascii_digit())
                    || !k.chars().all(|c| c.is_ascii_alphanumeric() || c == '_')
                {
                    bad(
                        at("env"),
                        format!("{k:?} is not a valid variable name (letters, digits, _)"),
                    );
                }
            }
            let r = &g.resources;
            if !(r.cpu.is_finite() && r.cpu > 0.0 && r.cpu <= MAX_CPU) {
                bad(
                    at("resources.cpu"),
                    format!("must be more than 0 and at most {MAX_CPU} cores"),
                );
            }
            if r.memory_mib == 0 || r.memory_mib > MAX_MEM_MIB {
                bad(
                    at("resources.memory_mib"),
                    format!("must be 1 to {MAX_MEM_MIB} MiB"),
                );
            }
            if let Some(gpu) = &r.gpu {
                check_gpu(&at("resources.gpu"), gpu, &mut bad);
            }
        }
        if total > MAX_REPLICAS as u64 {
            bad(
                "tasks".into(),
                format!("at most {MAX_REPLICAS} tasks in all"),
            );
        }
        if let Some(t) = self.max_runtime_s
            && (t == 0 || t > MAX_RUNTIME_S)
        {
            bad(
                "max_runtime_s".into(),
                format!("must be 1 to {MAX_RUNTIME_S} seconds"),
            );
        }
        if self.retry.limit > 100 {
            bad("retry.limit".into(), "at most 100 retries".into());
        }
        if self.retry.backoff_s > 3600 {
            bad("retry.backoff_s".into(), "at most 3600 seconds".into());
        }
        if self.checkpoint.grace_s > 24 * 3600 {
            bad("checkpoint.grace_s".into(), "at most 86400 seconds".into());
        }
        if !SIGNALS.contains(&self.checkpoint.signal.as_str()) {
            bad(
                "checkpoint.signal".into(),
                format!(
                    "unknown signal {:?}; allowed: {}",
                    self.checkpoint.signal,
                    SIGNALS.join(", ")
                ),
            );
        }
        if let Some(idle) = &self.idle {
            idle.check("idle", &mut bad);
        }
        if errs.is_empty() {
            Ok(())
        } else {
            Err(ApiError::invalid(errs))
        }
    }
}

impl GpuSpec {
    /// Compute asked for per task, in milli-GPU.
    pub fn milli(&self) -> u64 {
        match self.mode {
            GpuMode::Whole => self.count.unwrap_or(1) as u64 * 1000,
            GpuMode::Fraction => (self.fraction.unwrap_or(0.0) * 1000.0).round() as u64,
            GpuMode::Mig | GpuMode::TimeSlice => 0,
        }
    }
}

fn check_name(field: &str, name: &str, bad: &mut impl FnMut(String, String)) {
    if !crate::wire::valid_name(name) {
        bad(
            field.into(),
            format!(
                "{name:?} is not a valid name: 1 to 63 lowercase letters, digits, '-', '_' or '.', starting with a letter or digit"
            ),
        );
    }
}

fn check_gpu(at: &str, g: &GpuSpec, bad: &mut impl FnMut(String, String)) {
    let f = |x: &str| format!("{at}.{x}");
    let only = |bad: &mut dyn FnMut(String, String), name: &str, set: bool| {
        if set {
            bad(
                f(name),
                format!("not allowed with mode {:?}", mode_name(g.mode)),
            );
        }
    };
    match g.mode {
        GpuMode::Whole => {
            let c = g.count.unwrap_or(1);
            if c == 0 || c > MAX_GPUS_PER_TASK {
                bad(
                    f("count"),
                    format!("must be 1 to {MAX_GPUS_PER_TASK} whole GPUs per task"),
                );
            }
            only(bad, "profile", g.profile.is_some());
            only(bad, "fraction", g.fraction.is_some());
            only(bad, "memory_mib", g.memory_mib.is_some());
        }
        GpuMode::Mig => {
            match &g.profile {
                None => bad(
                    f("profile"),
                    "mode mig needs a profile such as \"1g.10gb\"".into(),
                ),
                Some(p) if !p.contains('g') || p.len() > 32 => bad(
                    f("profile"),
                    format!("{p:?} is not a MIG profile such as \"1g.10gb\""),
                ),
                _ => {}
            }
            only(bad, "count", g.count.is_some());
            only(bad, "fraction", g.fraction.is_some());
            only(bad, "memory_mib", g.memory_mib.is_some());
        }
        GpuMode::Fraction => {
            match g.fraction {
                Some(x) if x.is_finite() && x > 0.0 && x < 1.0 => {}
                _ => bad(
                    f("fraction"),
                    "mode fraction needs a fraction between 0 and 1 (exclusive)".into(),
                ),
            }
            only(bad, "count", g.count.is_some());
            only(bad, "profile", g.profile.is_some());
        }
        GpuMode::TimeSlice => {
            only(bad, "count", g.count.is_some());
            only(bad, "profile", g.profile.is_some());
            only(bad, "fraction", g.fraction.is_some());
        }
    }
    if g.memory_mib.is_some_and(|m| m > 1024 * 1024) {
        bad(f("memory_mib"), "at most 1048576 MiB".into());
    }
    for m in &g.models {
        if m.trim().is_empty() || m.len() > 64 {
            bad(f("models"), format!("{m:?} is not a GPU model name"));
        }
    }
}

fn mode_name(m: GpuMode) -> &'static str {
    match m {
        GpuMode::Whole => "whole",
        GpuMode::Mig => "mig",
        GpuMode::Fraction => "fraction",
        GpuMode::TimeSlice => "time-slice",
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    const GOOD: &str = "
name: train-1
queue: research
kind: training
tasks:
  - name: worker
    replicas: 2
    command: [python, train.py]
    resources: {cpu: 4, memory_mib: 8192, gpu: {count: 2}}
";

    #[test]
    fn arrays_parse_as_slurm_writes_them() {
        let a = ArraySpec::parse("0-3,7%2").unwrap();
        assert_eq!(a.indices, vec![0, 1, 2, 3, 7]);
        assert_eq!(a.max_concurrent, Some(2));
        assert_eq!(ArraySpec::parse("5").unwrap().indices, vec![5]);
        for bad in ["3-1", "a-b", "0-9%0", "0-20000", ""] {
            assert!(ArraySpec::parse(bad).is_err(), "{bad}");
        }
        let e = JobSpec::parse(
            GOOD.replace("kind: training", "kind: training\narray: 0-9%x")
                .as_bytes(),
            false,
        )
        .unwrap_err();
        assert!(e.to_string().contains("array"), "{e}");
    }

    #[test]
    fn an_image_reference_is_checked_for_what_a_registry_takes() {
        for ok in [
            "busybox",
            "127.0.0.1:5000/team/busybox:1",
            "registry.example.com/team/pytorch:2.4-cuda12",
            "127.0.0.1:5000/team/busybox@sha256:1deb40ce5ce4733a4d9f1dfbc121e2f968256bc0bd6de94d6e559b91f5714ecb",
        ] {
            assert!(valid_image(ok), "{ok}");
        }
        for bad in [
            "",
            "-rm",
            "a b",
            "x;rm -rf /",
            "a//b",
            "/abs",
            "a@b@c",
            "a\nb",
        ] {
            assert!(!valid_image(bad), "{bad:?}");
        }
        let spec = GOOD.replace(
            "    command: [python, train.py]",
            "    command: [python, train.py]\n    image: 'x y'",
        );
        let e = JobSpec::parse(spec.as_bytes(), false).unwrap_err();
        assert!(e.message.contains("tasks[0].image"), "{e}");
    }

    #[test]
    fn ports_are_named_once_each_and_a_notebook_gets_http() {
        let with = |ports: &str| {
            GOOD.replace(
                "    command: [python, train.py]",
                &format!("    command: [python, train.py]\n    ports: {ports}"),
            )
        };
        let ok = JobSpec::parse(with("[http, tensorboard]").as_bytes(), false).unwrap();
        assert_eq!(
            ports_of(Kind::Training, &ok.tasks[0]),
            ["http", "tensorboard"]
        );
        for (bad, says) in [
            ("[HTTP]", "not a valid port name"),
            ("[8888]", "not a valid port name"),
            ("[http, http]", "named twice"),
            ("[a, b, c, d, e]", "at most 4 ports"),
        ] {
            let e = JobSpec::parse(with(bad).as_bytes(), false).unwrap_err();
            assert!(
                e.message.contains("tasks[0].ports") && e.message.contains(says),
                "{bad}: {e}"
            );
        }
        let nb = JobSpec::parse(
            GOOD.replace("kind: training", "kind: notebook").as_bytes(),
            false,
        )
        .unwrap();
        assert_eq!(ports_of(Kind::Notebook, &nb.tasks[0]), ["http"]);
        assert!(ports_of(Kind::Training, &nb.tasks[0]).is_empty());
    }

    #[test]
    fn parses_yaml_and_json() {
        let y = JobSpec::parse(GOOD.as_bytes(), false).unwrap();
        assert_eq!(y.tasks[0].replicas, 2);
        assert_eq!(y.gpu_milli(), 4000);
        let j = serde_json::to_vec(&y).unwrap();
        assert_eq!(JobSpec::parse(&j, true).unwrap(), y);
    }

    /// A server holds every live job's spec: its task groups must not keep
    /// the spare room a list read item by item grows (room for four).
    #[test]
    fn a_parsed_job_holds_its_task_groups_without_spare_room() {
        for json in [false, true] {
            let body = if json {
                serde_json::to_vec(&JobSpec::parse(GOOD.as_bytes(), false).unwrap()).unwrap()
            } else {
                GOOD.as_bytes().to_vec()
            };
            let spec = JobSpec::parse(&body, json).unwrap();
            assert_eq!(spec.tasks.capacity(), spec.tasks.len(), "json: {json}");
        }
    }

    #[test]
    fn unknown_field_is_named_with_its_path() {
        let e = JobSpec::parse(GOOD.replace("replicas", "replica").as_bytes(), false).unwrap_err();
        assert!(
            e.message
                .starts_with("tasks[0].replica: unknown field `replica`"),
            "the path once: {}",
            e.message
        );
        let e = JobSpec::parse(
            GOOD.replace("kind: training", "kind: trainin").as_bytes(),
            false,
        )
        .unwrap_err();
        assert!(
            e.message.starts_with("kind: unknown variant `trainin`"),
            "the path once: {}",
            e.message
        );
        let j = serde_json::to_string(&JobSpec::parse(GOOD.as_bytes(), false).unwrap())
            .unwrap()
            .replace("\"training\"", "\"trainin\"");
        let e = JobSpec::parse(j.as_bytes(), true).unwrap_err();
        assert!(
            e.message.starts_with("kind: unknown variant"),
            "{}",
            e.message
        );
    }

    #[test]
    fn bad_values_name_each_field() {
        let y = GOOD
            .replace("cpu: 4", "cpu: -1")
            .replace("count: 2", "count: 1000")
            .replace("train-1", "Train 1");
        let e = JobSpec::parse(y.as_bytes(), false).unwrap_err();
        let fields: Vec<&str> = e.fields.iter().map(|f| f.field.as_str()).collect();
        assert_eq!(
            fields,
            [
                "name",
                "tasks[0].resources.cpu",
                "tasks[0].resources.gpu.count"
            ]
        );
    }

    #[test]
    fn gpu_modes_reject_foreign_fields() {
        let y = GOOD.replace("{count: 2}", "{mode: fraction, fraction: 0.5, count: 1}");
        let e = JobSpec::parse(y.as_bytes(), false).unwrap_err();
        assert!(
            e.message
                .contains("gpu.count: not allowed with mode \"fraction\""),
            "{}",
            e.message
        );
        let y = GOOD.replace("{count: 2}", "{mode: fraction, fraction: 1.5}");
        assert!(JobSpec::parse(y.as_bytes(), false).is_err());
    }
}
