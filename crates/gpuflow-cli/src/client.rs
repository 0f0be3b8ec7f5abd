//! The client commands: `gpuflow job|queue|node|team|user|token|event …`.
//! They talk to the server's `/v1` API with a token from `--token`,
//! `GPUFLOW_TOKEN` or the admin token `gpuflow up` left in its data directory.

use std::path::PathBuf;

use anyhow::{Context, anyhow};
use clap::{Args, Subcommand, ValueEnum};
use gpuflow_api as api;
use serde_json::Value;

#[derive(Clone, Copy, Default, PartialEq, ValueEnum)]
pub(crate) enum Format {
    /// Columns for a person (times as local times and ages).
    #[default]
    Table,
    /// Columns with more of them (nodes, exact times).
    Wide,
    /// The API's JSON, exact (Unix seconds).
    Json,
    /// The API's answer as YAML.
    Yaml,
}

/// `--no-headers`: tables without their heading line (set once per run).
static NO_HEADERS: std::sync::atomic::AtomicBool = std::sync::atomic::AtomicBool::new(false);

/// The server of `gpuflow up`, when nothing names another.
pub(crate) const LOCAL_SERVER: &str = "http://127.0.0.1:7070";

#[derive(Args, Clone)]
pub(crate) struct Conn {
    /// The server [default: the context's, else $GPUFLOW_SERVER, else
    /// http://127.0.0.1:7070]; a leader and its standbys separated by
    /// commas (the next is tried when no connection to one opens).
    #[arg(long, global = true)]
    pub server: Option<String>,
    /// API token [default: the context's, else $GPUFLOW_TOKEN, else the
    /// admin token in the data directory of `gpuflow up` ($GPUFLOW_DATA,
    /// else ~/.gpuflow)].
    #[arg(long, global = true)]
    pub token: Option<String>,
    /// A context of the config file (`gpuflow config get-contexts`)
    /// instead of the current one [env: GPUFLOW_CONTEXT].
    #[arg(long, global = true)]
    pub context: Option<String>,
    /// How answers are shown.
    #[arg(short = 'o', long, global = true, value_enum, default_value = "table")]
    pub output: Format,
    /// Tables without their heading line (for scripts).
    #[arg(long, global = true)]
    pub no_headers: bool,
    /// PEM certificate to trust for an https server (e.g. its self-signed
    /// one) [env: GPUFLOW_CA_CERT].
    #[arg(long, global = true)]
    pub ca_cert: Option<PathBuf>,
}

#[derive(Subcommand)]
pub(crate) enum JobCmd {
    /// A job's GPU use: each attempt's GPU-hours and utilisation, each
    /// task's utilisation and GPU memory, and what stands out (like jobstats).
    Stats { id: u64 },
    /// Submit a job from a YAML or JSON file (`-` for stdin), or a shell
    /// command with --wrap.
    Submit {
        /// The job spec, YAML or JSON (`-`: stdin).
        #[arg(
            short = 'f',
            long,
            required_unless_present = "wrap",
            conflicts_with = "wrap"
        )]
        file: Option<PathBuf>,
        /// A shell command to run as a one-task job (like sbatch --wrap),
        /// with --queue, --name, --kind, --gpus, --cpu and --memory-mib.
        #[arg(long)]
        wrap: Option<String>,
        /// With --wrap: the queue.
        #[arg(long, default_value = "default", requires = "wrap")]
        queue: String,
        /// With --wrap: the job's name.
        #[arg(long, default_value = "wrap", requires = "wrap")]
        name: String,
        /// With --wrap: inference, notebook, training or batch.
        #[arg(long, default_value = "batch", requires = "wrap")]
        kind: String,
        /// With --wrap: whole GPUs.
        #[arg(long, default_value_t = 0, requires = "wrap")]
        gpus: u32,
        /// With --wrap: CPU cores.
        #[arg(long, default_value_t = 1.0, requires = "wrap")]
        cpu: f64,
        /// With --wrap: memory in MiB.
        #[arg(long, default_value_t = 1024, requires = "wrap")]
        memory_mib: u64,
        /// With --wrap: the OCI image to run it in
        /// (127.0.0.1:5000/team/pytorch:2.4); with -f, every task's image.
        #[arg(long)]
        image: Option<String>,
        /// Store nothing: say whether it would start now, where, or why it
        /// would wait and when it would start (like sbatch --test-only).
        #[arg(long)]
        test_only: bool,
        /// Submit an array, one job per index (like sbatch --array):
        /// 0-999, 1,3,8-15, with %N to run at most N at once (0-999%50).
        #[arg(long)]
        array: Option<String>,
        /// Start only after other jobs of the team (like sbatch
        /// --dependency): afterok:12:13, afterany:14, after, afternotok,
        /// aftercorr:ARRAY, singleton; terms joined by ',' all hold.
        #[arg(long, short = 'd')]
        dependency: Option<String>,
        /// Run in this reservation (`gpuflow reservation ls`).
        #[arg(long)]
        reservation: Option<String>,
    },
    /// List jobs: the active ones (pending to stopping), newest first;
    /// `--all` adds the finished ones.
    Ls {
        /// Only these states, comma separated (running,pending).
        #[arg(long, value_delimiter = ',', value_parser = job_state)]
        state: Vec<String>,
        /// Finished jobs too (with no --state).
        #[arg(long, conflicts_with = "state")]
        all: bool,
        /// Only this queue's.
        #[arg(long)]
        queue: Option<String>,
        /// Only this team's (admins see every team).
        #[arg(long)]
        team: Option<String>,
        /// Only this user's.
        #[arg(long)]
        user: Option<String>,
        /// Only this array's elements (its id: the first element's), each
        /// on its own row.
        #[arg(long)]
        array: Option<u64>,
        /// Each pending array element on its own row (they are one row,
        /// `10_[30-199]`, as squeue shows them).
        #[arg(long)]
        expand: bool,
        /// Only jobs not finished before this time: a local time
        /// (2026-12-05 14:00, 2026-12-05), RFC 3339, or how long ago (2h,
        /// 1d); as sacct -S. Finished jobs are included.
        #[arg(long, value_parser = time_arg)]
        since: Option<i64>,
        /// Only jobs submitted before this time (the forms of --since); as
        /// sacct -E.
        #[arg(long, value_parser = time_arg)]
        until: Option<i64>,
        /// At most this many (1 to 1000).
        #[arg(long)]
        limit: Option<usize>,
        #[command(flatten)]
        watch: Watch,
    },
    /// One job with its tasks (where they run, their GPUs and exit codes).
    Get {
        id: u64,
        #[command(flatten)]
        watch: Watch,
    },
    /// Why a job waits (or what it is doing): a job id, or a Kubernetes
    /// pod gpuflow schedules as NAMESPACE/POD (read through the kubeconfig).
    Why { id: String },
    /// Runs a command beside a running task, as the task runs (its user,
    /// directory, environment, cgroup and namespaces), as `kubectl exec` or
    /// `srun --jobid N --pty` do: input passes through and the exit status
    /// is the command's. Audited. E.g. `gpuflow job exec 12 -t -- bash`.
    Exec {
        id: u64,
        /// The task, GROUP/INDEX (default: the job's first running task).
        #[arg(long)]
        task: Option<String>,
        /// Give the command a terminal (the default when stdin is one).
        #[arg(short = 't', long)]
        tty: bool,
        /// Never give the command a terminal.
        #[arg(short = 'T', long, conflicts_with = "tty")]
        no_tty: bool,
        /// The command and its arguments, after `--`.
        #[arg(required = true, last = true)]
        command: Vec<String>,
    },
    /// Follows a running task's output as it writes it, stdout and stderr
    /// apart, as `sattach` or `kubectl attach` do (a task reads no input, so
    /// none is passed); Ctrl-C detaches.
    Attach {
        id: u64,
        /// The task, GROUP/INDEX (default: the job's first running task).
        #[arg(long)]
        task: Option<String>,
    },
    /// Each task's output: the server keeps the whole output of each task
    /// of the last five attempts, up to the job's log limit (16 MiB by
    /// default), then the last 16 KiB of each stream.
    Logs {
        id: u64,
        /// Only the last N lines of each task.
        #[arg(long)]
        tail: Option<usize>,
        /// This attempt's output (default: the latest).
        #[arg(long)]
        attempt: Option<u32>,
        /// Keep printing what the tasks write, until the job ends.
        #[arg(short = 'f', long)]
        follow: bool,
        /// stdout, stderr or both (each task's stderr shown apart).
        #[arg(long, value_parser = ["stdout", "stderr", "both"], default_value = "both")]
        stream: String,
    },
    /// Cancel jobs: by id, or every active job matching the filters (a
    /// running job is signalled and stopped).
    Cancel {
        ids: Vec<u64>,
        /// Jobs of this name.
        #[arg(long)]
        name: Option<String>,
        /// Jobs of this user.
        #[arg(long)]
        user: Option<String>,
        /// Jobs in these states, comma separated (e.g. pending).
        #[arg(long, value_delimiter = ',', value_parser = job_state)]
        state: Vec<String>,
        /// Every unfinished element of this array, in one change.
        #[arg(long, conflicts_with_all = ["ids", "name", "user", "state"])]
        array: Option<u64>,
    },
    /// Stop a job and release its GPUs until it is resumed.
    Suspend { id: u64 },
    /// Queue a suspended job again.
    Resume { id: u64 },
    /// Keep a pending job from starting (admin).
    Hold { id: u64 },
    /// Let a held job start again (admin).
    Release { id: u64 },
}

/// `--watch`: show it again every `--interval` seconds.
#[derive(Args, Clone, Copy)]
pub(crate) struct Watch {
    /// Show it again every --interval seconds, until interrupted.
    #[arg(short = 'w', long)]
    watch: bool,
    /// Seconds between refreshes.
    #[arg(long, default_value_t = 2, requires = "watch")]
    interval: u64,
    /// Stop after this many refreshes.
    #[arg(long, requires = "watch")]
    count: Option<u64>,
}

impl Watch {
    /// Runs `look` once, or again every interval while watching, without
    /// a banner: for commands that print only what is new.
    fn follow(self, mut look: impl FnMut() -> anyhow::Result<()>) -> anyhow::Result<()> {
        let mut n = 0;
        loop {
            look()?;
            n += 1;
            if !self.watch || self.count.is_some_and(|c| n >= c) {
                return Ok(());
            }
            std::io::Write::flush(&mut std::io::stdout())?;
            std::thread::sleep(std::time::Duration::from_secs(self.interval.max(1)));
        }
    }

    /// Runs `show` once, or again every interval while watching.
    fn run(self, mut show: impl FnMut() -> anyhow::Result<()>) -> anyhow::Result<()> {
        let mut n = 0;
        loop {
            if self.watch {
                use chrono::Local;
                println!("--- {} ---", Local::now().format("%Y-%m-%d %H:%M:%S"));
            }
            show()?;
            n += 1;
            if !self.watch || self.count.is_some_and(|c| n >= c) {
                return Ok(());
            }
            std::thread::sleep(std::time::Duration::from_secs(self.interval.max(1)));
        }
    }
}

/// The states `job ls` shows by default.
const ACTIVE: &str = "pending,held,suspended,admitted,starting,running,stopping";

#[derive(Subcommand)]
pub(crate) enum ServiceCmd {
    /// Services with their size, ready replicas and version.
    Ls,
    /// Create a service from a YAML or JSON file.
    Create {
        /// The service spec, YAML or JSON (`-`: stdin).
        #[arg(short = 'f', long)]
        file: PathBuf,
    },
    /// A service's replicas (node, port, ready) and endpoints.
    Get { name: String },
    /// Set a service's number of replicas (within its bounds).
    Scale { name: String, replicas: u32 },
    /// Roll out a new task from a YAML or JSON file (a task group spec),
    /// replacing replicas within the service's rollout bounds.
    Update {
        name: String,
        /// The new task, YAML or JSON (`-`: stdin).
        #[arg(short = 'f', long)]
        file: PathBuf,
    },
    /// Delete a service and stop its replicas.
    Delete { name: String },
}

// Parsed once per run: the size of the `set` variant costs nothing.
#[allow(clippy::large_enum_variant)]
#[derive(Subcommand)]
pub(crate) enum QueueCmd {
    /// Queues with their guarantees, borrow limits, use and budgets.
    Ls {
        #[command(flatten)]
        watch: Watch,
    },
    /// Create a queue from a YAML or JSON file.
    Create {
        /// The queue spec, YAML or JSON (`-`: stdin).
        #[arg(short = 'f', long)]
        file: PathBuf,
    },
    /// Change a queue.
    Set {
        name: String,
        /// Its fair-share weight.
        #[arg(long)]
        weight: Option<f64>,
        #[arg(long, value_parser = ["open", "held", "draining"])]
        state: Option<String>,
        /// Guarantees as FLAVOR=GPUS[,...] (admin), e.g. H100=8,*=2; the
        /// queue's other quota settings (borrow and lend limits, caps, other
        /// flavors) stay as they are.
        #[arg(long)]
        quota: Option<String>,
        /// How many GPUs beyond its guarantee it may borrow, as
        /// FLAVOR=GPUS[,...]; `none` for no limit (admin).
        #[arg(long)]
        borrow_limit: Option<String>,
        /// How many of its guaranteed GPUs others may borrow, as
        /// FLAVOR=GPUS[,...]; `none` for no limit (admin).
        #[arg(long)]
        lend_limit: Option<String>,
        /// The most GPUs it may use, as FLAVOR=GPUS[,...]; `none` for no
        /// cap (admin).
        #[arg(long)]
        cap: Option<String>,
        /// The most GPUs one user's jobs may hold at once (`none`: no limit).
        #[arg(long)]
        user_max_gpus: Option<String>,
        /// The most jobs one user may run at once (`none`: no limit).
        #[arg(long)]
        user_max_running: Option<String>,
        /// The longest a notebook may run here, e.g. 8h (admin).
        #[arg(long, value_parser = duration_s)]
        notebook_max_lifetime: Option<u64>,
        /// Notebooks whose GPUs idle this long (e.g. 30m) get the idle
        /// action (admin; with --notebook-idle-action).
        #[arg(long, value_parser = duration_s, requires = "notebook_idle_action")]
        notebook_idle_after: Option<u64>,
        /// What happens to an idle notebook.
        #[arg(long, value_parser = ["notify", "suspend", "requeue", "cancel"], requires = "notebook_idle_after")]
        notebook_idle_action: Option<String>,
        /// A budget of GPU-hours per --budget-period (admin).
        #[arg(long, conflicts_with = "budget_cost")]
        budget_gpu_hours: Option<f64>,
        /// A budget of cost per --budget-period, at the prices (admin).
        #[arg(long)]
        budget_cost: Option<f64>,
        #[arg(long, value_parser = ["day", "week", "month"], default_value = "month")]
        budget_period: String,
        /// When the budget is spent.
        #[arg(long, value_parser = ["stop-borrowing", "stop-admitting"], default_value = "stop-borrowing")]
        when_exhausted: String,
    },
    /// Delete a queue with no unfinished jobs.
    Delete { name: String },
}

#[derive(Subcommand)]
pub(crate) enum NodeCmd {
    /// Nodes with their state, GPUs, CPU and memory allocated, and
    /// limits (`-o wide`: pool, labels and jobs too).
    Ls {
        #[command(flatten)]
        watch: Watch,
    },
    /// One node: each GPU (model, memory, MIG instances, health, who holds
    /// it, utilisation), CPU and memory allocated, labels, pool, its jobs.
    Get {
        name: String,
        #[command(flatten)]
        watch: Watch,
    },
    /// Let running work finish, start nothing new.
    Drain { name: String },
    /// Start nothing new on a node (running work goes on).
    Cordon { name: String },
    /// Take a cordoned node back into service.
    Uncordon { name: String },
    /// The machine behind NAME is gone: requeue its work and let the next
    /// agent that registers NAME (with the join token) take it.
    Replace { name: String },
    /// Forget the health marks (XID errors, ECC errors) of NAME's GPUs,
    /// after the fault was dealt with: they take work again.
    Clear { name: String },
}

#[derive(Subcommand)]
pub(crate) enum TeamCmd {
    /// Teams and who their tasks run as.
    Ls,
    /// Create a team (admins).
    Create {
        name: String,
        /// The system user the team's tasks run as on agents running as
        /// root (never root); default: the agent's --run-as.
        #[arg(long)]
        run_as: Option<String>,
    },
    /// Change a team (admins): who its tasks run as from now on, where
    /// its images come from, whether it may run processes without one.
    Set {
        name: String,
        /// The system user; "" for the agents' default.
        #[arg(long)]
        run_as: Option<String>,
        /// Where its images may come from (an image prefix, repeatable;
        /// replaces the list; "" for anywhere).
        #[arg(long)]
        registry: Vec<String>,
        /// Whether its tasks may run without an image (true or false).
        #[arg(long)]
        processes: Option<bool>,
        /// The image its tasks without one run in ("" for none).
        #[arg(long)]
        default_image: Option<String>,
        /// A registry login, HOST=USER, its password read from the first
        /// line of stdin (never from the command line); HOST= removes it.
        #[arg(long)]
        registry_login: Option<String>,
        /// Whether its members act on each other's jobs (true or false;
        /// its leads may set this): by default each member cancels, holds
        /// or enters only their own.
        #[arg(long)]
        shared_control: Option<bool>,
    },
}

#[derive(Subcommand)]
pub(crate) enum ProjectCmd {
    /// Projects with their cost centres and what is left of their budgets.
    Ls,
    /// Create a project of a team (admins; team leads for their team).
    Create {
        name: String,
        /// The team it belongs to.
        #[arg(long)]
        team: String,
        /// The finance cost centre its usage is reported under.
        #[arg(long, default_value = "")]
        cost_centre: String,
    },
    /// Give a project a budget per period, in GPU-hours or cost (admins):
    /// when spent, its jobs stop borrowing (or start no new work) in
    /// whichever queues they run, until the period renews.
    Budget {
        name: String,
        /// GPU-hours per period.
        #[arg(long, conflicts_with_all = ["cost", "clear"], required_unless_present_any = ["cost", "clear"])]
        gpu_hours: Option<f64>,
        /// Cost per period, at the prices (`gpuflow price ls`).
        #[arg(long, conflicts_with = "clear")]
        cost: Option<f64>,
        #[arg(long, value_parser = ["day", "week", "month"], default_value = "month")]
        period: String,
        #[arg(long, value_parser = ["stop-borrowing", "stop-admitting"], default_value = "stop-borrowing")]
        when_exhausted: String,
        /// Remove the project's budget.
        #[arg(long)]
        clear: bool,
    },
}

#[derive(Subcommand)]
pub(crate) enum UserCmd {
    /// Users you may see, with their teams and roles.
    Ls,
    /// Create a user (admins; team leads for their team); then give them a
    /// token with `gpuflow token create`.
    Create {
        name: String,
        #[arg(long, default_value = "")]
        team: String,
        #[arg(long, value_parser = ["admin", "team-lead", "member", "viewer"])]
        role: String,
    },
    /// Disable a user: every token of theirs is refused at once, until
    /// `gpuflow user enable` (admins; team leads for their team's members
    /// and viewers).
    Disable { name: String },
    /// Enable a disabled user again.
    Enable { name: String },
    /// End the user's sign-ins through identity providers: each made until
    /// now is refused, and they sign in again (yourself; admins; team
    /// leads for their team's members and viewers).
    Signout { name: String },
}

#[derive(Subcommand)]
pub(crate) enum TokenCmd {
    /// Create a token for a user; it is printed once.
    Create {
        user: String,
        /// The token stops working after this long (e.g. 90d, 12h, 3600s).
        #[arg(long, value_parser = humantime::parse_duration)]
        expires_in: Option<std::time::Duration>,
    },
    /// The live tokens you manage: ids, users, when made and when they expire.
    Ls,
    /// Revoke a token by its id (from `token ls`).
    Revoke { id: String },
}

#[derive(Subcommand)]
pub(crate) enum ReportCmd {
    /// Waits (p50, p95), outcomes, preemptions and lost GPU-hours of the
    /// jobs submitted in a range, by queue or kind.
    Jobs {
        /// queue or kind.
        #[arg(long, default_value = "queue")]
        by: String,
        /// Jobs submitted from (Unix seconds, 2026-12-01, or an age: 30d).
        #[arg(long, default_value = "30d")]
        from: String,
        /// Jobs submitted until (as --from; default now).
        #[arg(long)]
        to: Option<String>,
    },
    /// Jobs whose measured GPU memory and utilisation would fit a cheaper
    /// model or a MIG slice, with the saving per month at the set prices.
    Advice {
        #[arg(long, default_value = "30d")]
        from: String,
    },
    /// Jobs holding GPUs below a utilisation for a while, by GPU-hours.
    Idle {
        /// Utilisation below this percentage.
        #[arg(long, default_value_t = 10.0)]
        below: f64,
        /// Held at least this long (30m, 2h, …).
        #[arg(long = "for", default_value = "1h")]
        held_for: String,
    },
    /// GPU-hours held and used, efficiency and cost, from the jobs' ledger.
    Usage {
        /// Rows by team, project, user, queue, model, cost_centre or job.
        #[arg(long, default_value = "team")]
        by: String,
        /// Split rows by hour, day or month (default: one row per key).
        #[arg(long, default_value = "all")]
        period: String,
        /// From: Unix seconds, 2026-12-01, 2026-12-01T08:00:00Z or an age (7d).
        #[arg(long, default_value = "30d")]
        from: String,
        /// To (default now), as --from.
        #[arg(long)]
        to: Option<String>,
        /// Print CSV (for spreadsheets) instead of a table.
        #[arg(long)]
        csv: bool,
    },
}

#[derive(Subcommand)]
pub(crate) enum PriceCmd {
    /// The price of a GPU-hour per model.
    Ls,
    /// Set the prices (admins): MODEL=PRICE per GPU-hour, `*` for the
    /// models not listed (replaces all prices).
    Set {
        #[arg(value_name = "MODEL=PRICE", required = true)]
        prices: Vec<String>,
        #[arg(long, default_value = "")]
        currency: String,
    },
}

#[derive(Subcommand)]
pub(crate) enum EventCmd {
    /// Events, oldest first: submissions, admissions, preemptions, node
    /// changes, with their reasons.
    Ls {
        /// Only this job's events.
        #[arg(long)]
        job: Option<u64>,
        /// Events after this sequence number (the last one seen).
        #[arg(long)]
        after: Option<i64>,
        /// Only events at or after this time: a time (2026-12-05 14:00,
        /// 2026-12-05, RFC 3339) or how long ago (30m, 2h, 1d).
        #[arg(long, value_parser = time_arg)]
        since: Option<i64>,
        /// Only events before this time (the forms of --since).
        #[arg(long, value_parser = time_arg)]
        until: Option<i64>,
        /// Only the newest N events (1 to 1000).
        #[arg(long)]
        limit: Option<u32>,
        /// Keep printing new events as they come, every --interval seconds,
        /// until interrupted (--count: stop after that many looks).
        #[command(flatten)]
        watch: Watch,
    },
}

/// A duration on the command line (`8h`, `30m`, `90s`, or seconds), in
/// seconds.
fn duration_s(s: &str) -> Result<u64, String> {
    if let Ok(n) = s.parse::<u64>() {
        return Ok(n);
    }
    humantime::parse_duration(s)
        .map(|d| d.as_secs())
        .map_err(|_| format!("{s:?} is not a duration: write 8h, 30m, 90s or seconds"))
}

/// A time on the command line, as Unix seconds: a local date and time
/// (`2026-12-05 14:00`, `2026-12-05T14:00:30`, `2026-12-05`), RFC 3339
/// with its offset, Unix seconds, or how long ago (`30m`, `2h`, `1d`).
fn time_arg(s: &str) -> Result<i64, String> {
    use chrono::TimeZone;
    let s = s.trim();
    if let Ok(t) = chrono::DateTime::parse_from_rfc3339(s) {
        return Ok(t.timestamp());
    }
    for f in [
        "%Y-%m-%d %H:%M:%S",
        "%Y-%m-%dT%H:%M:%S",
        "%Y-%m-%d %H:%M",
        "%Y-%m-%dT%H:%M",
    ] {
        if let Ok(t) = chrono::NaiveDateTime::parse_from_str(s, f) {
            return chrono::Local
                .from_local_datetime(&t)
                .earliest()
                .map(|t| t.timestamp())
                .ok_or_else(|| format!("{s:?} does not exist in the local time zone"));
        }
    }
    if let Ok(d) = chrono::NaiveDate::parse_from_str(s, "%Y-%m-%d") {
        let t = d.and_hms_opt(0, 0, 0).expect("midnight");
        return chrono::Local
            .from_local_datetime(&t)
            .earliest()
            .map(|t| t.timestamp())
            .ok_or_else(|| format!("{s:?} does not exist in the local time zone"));
    }
    if let Ok(t) = s.parse::<i64>() {
        return Ok(t);
    }
    if let Ok(d) = humantime::parse_duration(s) {
        return Ok(unix_now() - d.as_secs() as i64);
    }
    Err(format!(
        "{s:?} is not a time: write a local time (2026-12-05 14:00, 2026-12-05), RFC 3339 (2026-12-05T14:00:00Z), Unix seconds, or how long ago (30m, 2h, 1d)"
    ))
}

#[derive(Subcommand)]
pub(crate) enum ReservationCmd {
    /// Reserve nodes for a window (admins): for teams or users, whose jobs
    /// ask for it with `job submit --reservation NAME`, or for maintenance
    /// (no job runs). Others' jobs run there before it only if they end
    /// before it starts.
    Create {
        name: String,
        /// When it opens (the forms of `event ls --since`; `now`).
        #[arg(long, default_value = "now")]
        start: String,
        /// When it closes (a time), or give --duration.
        #[arg(
            long,
            conflicts_with = "duration",
            required_unless_present = "duration"
        )]
        end: Option<String>,
        /// How long it lasts: 2h, 1d.
        #[arg(long, value_parser = duration_s)]
        duration: Option<u64>,
        /// These nodes, comma separated; or --count with --model.
        #[arg(long, value_delimiter = ',')]
        nodes: Vec<String>,
        /// That many nodes of --model, chosen at creation (fewest jobs first).
        #[arg(long, requires = "model", conflicts_with = "nodes")]
        count: Option<u32>,
        /// The GPU model of --count's nodes.
        #[arg(long, requires = "count")]
        model: Option<String>,
        /// For these teams' jobs.
        #[arg(long, value_delimiter = ',')]
        teams: Vec<String>,
        /// For these users' jobs.
        #[arg(long, value_delimiter = ',')]
        users: Vec<String>,
        /// A maintenance window: no job runs on its nodes.
        #[arg(long, conflicts_with_all = ["teams", "users"])]
        maintenance: bool,
    },
    /// Reservations, with their nodes and windows.
    Ls,
    /// Delete a reservation (admins).
    Rm { name: String },
}

pub(crate) fn reservation(conn: &Conn, cmd: ReservationCmd) -> anyhow::Result<()> {
    let c = Client::new(conn)?;
    match cmd {
        ReservationCmd::Create {
            name,
            start,
            end,
            duration,
            nodes,
            count,
            model,
            teams,
            users,
            maintenance,
        } => {
            let start = if start == "now" {
                unix_now()
            } else {
                time_arg(&start).map_err(Usage)?
            };
            let end = match (end, duration) {
                (Some(e), _) => time_arg(&e).map_err(Usage)?,
                (None, Some(d)) => start + d as i64,
                (None, None) => return Err(Usage("give --end or --duration".into()).into()),
            };
            let mut body = serde_json::json!({"name": name, "start": start.max(0), "end": end.max(0),
                "teams": teams, "users": users, "maintenance": maintenance});
            if !nodes.is_empty() {
                body["nodes"] = nodes.into();
            }
            if let (Some(n), Some(m)) = (count, model) {
                body["count"] = n.into();
                body["model"] = m.into();
            }
            let v = c.call(
                "POST",
                "/v1/reservations",
                Some(("application/json", serde_json::to_vec(&body)?)),
            )?;
            print_as(
                conn.output,
                "/v1/reservations",
                v,
                |r: &api::Reservation| {
                    format!(
                        "reservation {} on {}, {} to {}\n",
                        r.name,
                        r.nodes.join(","),
                        local_at(r.start),
                        local_at(r.end)
                    )
                },
            )?;
        }
        ReservationCmd::Ls => {
            let v = c.call("GET", "/v1/reservations", None)?;
            print_as(
                conn.output,
                "/v1/reservations",
                v,
                |v: &Vec<api::Reservation>| {
                    let rows = v
                        .iter()
                        .map(|r| {
                            let state = match (r.start as i64, r.end as i64) {
                                (_, e) if e <= unix_now() => "ended",
                                (st, _) if st > unix_now() => "upcoming",
                                _ => "open",
                            };
                            let who = if r.maintenance {
                                "maintenance".to_string()
                            } else {
                                [r.teams.join(","), r.users.join(",")]
                                    .into_iter()
                                    .filter(|x| !x.is_empty())
                                    .collect::<Vec<_>>()
                                    .join(" ")
                            };
                            vec![
                                r.name.clone(),
                                state.into(),
                                local_at(r.start),
                                local_at(r.end),
                                r.nodes.join(","),
                                who,
                            ]
                        })
                        .collect();
                    columns(&["name", "state", "start", "end", "nodes", "for"], rows)
                },
            )?;
        }
        ReservationCmd::Rm { name } => {
            c.call(
                "DELETE",
                &format!("/v1/reservations/{}", urlencoding_path(&name)),
                None,
            )?;
            if matches!(conn.output, Format::Table | Format::Wide) {
                println!("reservation {name} deleted");
            }
        }
    }
    Ok(())
}

#[derive(Subcommand)]
pub(crate) enum WebhookCmd {
    /// Have your jobs (or, for a team lead or an admin, a team's) POST
    /// their state changes to URL as JSON, signed with HMAC-SHA256 in
    /// X-Gpuflow-Signature; the secret is printed once.
    Create {
        /// The http:// or https:// URL; or give --mail.
        #[arg(required_unless_present = "mail", conflicts_with = "mail")]
        url: Option<String>,
        /// Mail this address instead, through the server's SMTP server.
        #[arg(long)]
        mail: Option<String>,
        /// Of begin, end, fail, timeout, preempted, requeued, all; comma
        /// separated.
        #[arg(long, value_delimiter = ',', default_value = "end")]
        events: Vec<String>,
        /// Every job of this team (team leads, admins).
        #[arg(long)]
        team: Option<String>,
    },
    /// The webhooks you made or manage.
    Ls,
    /// Delete a webhook.
    Rm { id: String },
    /// A webhook's last delivery attempts: event, job, HTTP status, outcome.
    Deliveries { id: String },
}

pub(crate) fn webhook(conn: &Conn, cmd: WebhookCmd) -> anyhow::Result<()> {
    let c = Client::new(conn)?;
    match cmd {
        WebhookCmd::Create {
            url,
            mail,
            events,
            team,
        } => {
            let mut body = serde_json::json!({"events": events});
            if let Some(u) = url {
                body["url"] = u.into();
            }
            if let Some(m) = mail {
                body["mail"] = m.into();
            }
            if let Some(t) = team {
                body["team"] = t.into();
            }
            let v = c.call(
                "POST",
                "/v1/webhooks",
                Some(("application/json", serde_json::to_vec(&body)?)),
            )?;
            print_as(conn.output, "/v1/webhooks", v, |h: &api::WebhookView| {
                format!(
                    "webhook {} created for {}'s jobs: {}\nsecret (shown once; verify X-Gpuflow-Signature, sha256= HMAC of the body): {}\n",
                    h.id,
                    h.user.clone().unwrap_or_else(|| format!("team {}", h.team)),
                    h.url.as_deref().or(h.mail.as_deref()).unwrap_or_default(),
                    h.secret.as_deref().unwrap_or("-")
                )
            })?;
        }
        WebhookCmd::Ls => {
            let v = c.call("GET", "/v1/webhooks", None)?;
            print_as(
                conn.output,
                "/v1/webhooks",
                v,
                |v: &Vec<api::WebhookView>| {
                    let rows = v
                        .iter()
                        .map(|h| {
                            vec![
                                h.id.clone(),
                                h.user.clone().unwrap_or_else(|| format!("team {}", h.team)),
                                h.events.join(","),
                                h.url
                                    .clone()
                                    .or_else(|| h.mail.as_ref().map(|m| format!("mail {m}")))
                                    .unwrap_or_default(),
                            ]
                        })
                        .collect();
                    columns(&["id", "jobs of", "events", "to"], rows)
                },
            )?;
        }
        WebhookCmd::Rm { id } => {
            c.call(
                "DELETE",
                &format!("/v1/webhooks/{}", urlencoding_path(&id)),
                None,
            )?;
            if matches!(conn.output, Format::Table | Format::Wide) {
                println!("webhook {id} deleted");
            }
        }
        WebhookCmd::Deliveries { id } => {
            let path = format!("/v1/webhooks/{}/deliveries", urlencoding_path(&id));
            let v = c.call("GET", &path, None)?;
            print_as(conn.output, &path, v, |v: &Vec<api::Delivery>| {
                let rows = v
                    .iter()
                    .map(|d| {
                        vec![
                            d.delivery.to_string(),
                            local_at(d.at),
                            d.event.clone(),
                            d.job.to_string(),
                            d.attempt.to_string(),
                            d.status.map_or_else(|| "-".into(), |x| x.to_string()),
                            d.outcome.clone(),
                        ]
                    })
                    .collect();
                columns(
                    &[
                        "delivery", "at", "event", "job", "attempt", "status", "outcome",
                    ],
                    rows,
                )
            })?;
        }
    }
    Ok(())
}

/// An error in the command line (exit status 2), not in the request.
#[derive(Debug)]
pub(crate) struct Usage(pub String);

impl std::fmt::Display for Usage {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.write_str(&self.0)
    }
}

impl std::error::Error for Usage {}

/// Checks a server address: a URL with its scheme.
/// A `--state` value: a job state's name (a usage error otherwise).
fn job_state(s: &str) -> Result<String, String> {
    match gpuflow_api::JobState::parse(s) {
        Some(_) => Ok(s.to_string()),
        None => Err(format!(
            "unknown state {s:?}; states: {}",
            gpuflow_api::ALL_STATES
                .iter()
                .map(|x| x.as_str())
                .collect::<Vec<_>>()
                .join(", ")
        )),
    }
}

pub(crate) fn server_url(server: &str) -> anyhow::Result<String> {
    gpuflow_client::server_url(server).map_err(|e| Usage(e.0).into())
}

/// Each of a comma-separated list of servers (a leader and its standbys),
/// as [`server_url`].
pub(crate) fn server_urls(servers: &str) -> anyhow::Result<Vec<String>> {
    gpuflow_client::server_urls(servers).map_err(|e| Usage(e.0).into())
}

pub(crate) struct Client {
    /// The servers (a leader and its standbys) and the token.
    api: gpuflow_client::Client,
    pub(crate) token: String,
    /// Where the token came from, said when the server refuses it.
    pub(crate) token_from: String,
    pub(crate) ca_cert: Option<PathBuf>,
    /// The context used, if any.
    pub(crate) context: Option<String>,
}

impl Client {
    pub(crate) fn new(c: &Conn) -> anyhow::Result<Client> {
        NO_HEADERS.store(c.no_headers, std::sync::atomic::Ordering::Relaxed);
        let r = crate::contexts::resolve(c)?;
        let (token, token_from) = match r.token {
            Some(t) => (t, r.token_from),
            None => {
                // `gpuflow up`'s data directory: GPUFLOW_DATA as for `up`.
                let data = std::env::var_os("GPUFLOW_DATA")
                    .map_or_else(crate::platform::default_data_dir, PathBuf::from);
                let path = data.join("admin.token");
                let t = std::fs::read_to_string(&path)
                    .map(|s| s.trim().to_string())
                    .map_err(|_| Usage(format!("no token: pass --token, set GPUFLOW_TOKEN or use a context with one (`gpuflow config set-context`); an admin creates tokens with `gpuflow token create USER`; `gpuflow up`'s admin token was not at {} (after `up --data-dir D`, set GPUFLOW_DATA=D)", path.display())))?;
                (t, format!("the admin token file {}", path.display()))
            }
        };
        let http =
            gpuflow_client::http_client(r.ca_cert.as_deref(), std::time::Duration::from_secs(30))
                .map_err(|e| anyhow!(e))?;
        Ok(Client {
            api: gpuflow_client::Client::new(http, server_urls(&r.server)?, token.clone()),
            token,
            token_from,
            ca_cert: r.ca_cert,
            context: r.context,
        })
    }

    /// The server asked now: the one that answered last.
    pub(crate) fn base(&self) -> &str {
        self.api.base()
    }

    pub(crate) fn call(
        &self,
        method: &str,
        path: &str,
        body: Option<(&str, Vec<u8>)>,
    ) -> anyhow::Result<Value> {
        self.call_with(method, path, body, None)
    }

    /// A call with an optional `Idempotency-Key`; the server's warnings go
    /// to stderr.
    fn call_with(
        &self,
        method: &str,
        path: &str,
        body: Option<(&str, Vec<u8>)>,
        key: Option<&str>,
    ) -> anyhow::Result<Value> {
        let body = body.as_ref().map(|(ct, b)| (*ct, b.as_slice()));
        match self.api.call(method, path, body, key) {
            Ok((v, warnings)) => {
                for w in warnings {
                    eprintln!("warning: {w}");
                }
                Ok(v)
            }
            Err(gpuflow_client::Error::Refused {
                status,
                code,
                message,
            }) => {
                let whence =
                    (status == 401).then(|| (self.token_from.clone(), self.base().to_string()));
                Err(Refusal {
                    status,
                    code,
                    message,
                    whence,
                }
                .into())
            }
            Err(e) => Err(e.into()),
        }
    }
}

/// Submits a job, sent again with the same idempotency `key` while no
/// server answers or the first try is still being stored (`in_progress`):
/// after `first`, then twice as long each time, four times in all; then
/// the error stands. The job is stored once however often it is sent.
fn submit_once(
    c: &Client,
    ct: &str,
    body: &[u8],
    key: &str,
    first: std::time::Duration,
) -> anyhow::Result<Value> {
    use backon::{BlockingRetryable, ExponentialBuilder};
    let backoff = ExponentialBuilder::new()
        .with_min_delay(first)
        .with_factor(2.0)
        .with_max_times(4);
    (|| c.call_with("POST", "/v1/jobs", Some((ct, body.to_vec())), Some(key)))
        .retry(backoff)
        .when(|e| {
            unreachable(e)
                || e.downcast_ref::<Refusal>()
                    .is_some_and(|r| r.code == "in_progress")
        })
        .notify(|e, wait| eprintln!("{e:#}; retrying in {} ms", wait.as_millis()))
        .call()
}

/// Whether `e` says no server answered: a request that carries an
/// idempotency key may be sent again.
pub(crate) fn unreachable(e: &anyhow::Error) -> bool {
    matches!(
        e.downcast_ref::<gpuflow_client::Error>(),
        Some(gpuflow_client::Error::Unreachable { .. })
    )
}

/// The server answered with an error: its HTTP status and the API's
/// `{code, message}` (the code is empty when the body was not the API's).
#[derive(Debug)]
pub(crate) struct Refusal {
    pub(crate) status: u16,
    pub(crate) code: String,
    pub(crate) message: String,
    /// For a 401: where the token came from, and the server it went to.
    whence: Option<(String, String)>,
}

impl std::fmt::Display for Refusal {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        match &self.whence {
            Some((from, base)) => write!(
                f,
                "{} (HTTP {}; the token came from {from}, for {base})",
                self.message, self.status
            ),
            None => write!(f, "{} (HTTP {})", self.message, self.status),
        }
    }
}

impl std::error::Error for Refusal {}

/// A random key naming one submission.
fn idempotency_key() -> String {
    use std::hash::{BuildHasher, Hasher};
    let mut h = std::collections::hash_map::RandomState::new().build_hasher();
    h.write_u128(
        std::time::SystemTime::now()
            .duration_since(std::time::UNIX_EPOCH)
            .map_or(0, |d| d.as_nanos()),
    );
    h.write_u32(std::process::id());
    format!("cli-{:016x}", h.finish())
}

fn read_file(path: &PathBuf) -> anyhow::Result<Vec<u8>> {
    if path.as_os_str() == "-" {
        let mut v = Vec::new();
        std::io::Read::read_to_end(&mut std::io::stdin(), &mut v)?;
        return Ok(v);
    }
    std::fs::read(path).with_context(|| format!("cannot read {}", path.display()))
}

/// YAML or JSON file → JSON bytes.
fn as_json(path: &PathBuf) -> anyhow::Result<Vec<u8>> {
    let raw = read_file(path)?;
    let v: Value = serde_norway::from_slice(&raw)
        .with_context(|| format!("{} is not YAML or JSON", path.display()))?;
    Ok(serde_json::to_vec(&v)?)
}

/// A reply printed as asked: JSON or YAML as the server sent it; a table
/// from the API's type `T` (a reply that is not one is an error naming the
/// field, not a "-").
fn print_as<T: serde::de::DeserializeOwned>(
    format: Format,
    path: &str,
    v: Value,
    table: impl FnOnce(&T) -> String,
) -> anyhow::Result<()> {
    match format {
        Format::Table | Format::Wide => {
            let t: T = gpuflow_client::read(path, v)?;
            print!("{}", table(&t));
        }
        _ => print(format, &v, |_| String::new()),
    }
    Ok(())
}

fn print(format: Format, v: &Value, table: impl FnOnce(&Value) -> String) {
    match format {
        Format::Json => println!("{}", serde_json::to_string_pretty(v).unwrap_or_default()),
        Format::Yaml => print!("{}", serde_norway::to_string(v).unwrap_or_default()),
        Format::Table | Format::Wide => print!("{}", table(v)),
    }
}

/// A Unix time as a person reads it: local date and time.
fn local_at(t: u64) -> String {
    local(&Value::from(t))
}

/// [`local_at`] of a JSON value ("-" when it is not a time).
fn local(v: &Value) -> String {
    use chrono::TimeZone;
    v.as_i64()
        .and_then(|t| chrono::Local.timestamp_opt(t, 0).single())
        .map_or_else(|| "-".into(), |t| t.format("%Y-%m-%d %H:%M:%S").to_string())
}

/// Seconds as a short age: 45s, 12m, 3h, 2d.
fn age_of(secs: i64) -> String {
    let s = secs.max(0);
    match s {
        0..90 => format!("{s}s"),
        90..5400 => format!("{}m", s / 60),
        5400..172_800 => format!("{}h", s / 3600),
        _ => format!("{}d", s / 86_400),
    }
}

/// How long ago a Unix time was.
fn ago(v: &Value) -> String {
    v.as_i64()
        .map_or_else(|| "-".into(), |t| age_of(unix_now() - t))
}

fn unix_now() -> i64 {
    std::time::SystemTime::now()
        .duration_since(std::time::UNIX_EPOCH)
        .map_or(0, |d| d.as_secs() as i64)
}

/// Aligned columns.
pub(crate) fn columns(head: &[&str], rows: Vec<Vec<String>>) -> String {
    let mut w: Vec<usize> = head.iter().map(|h| h.len()).collect();
    for r in &rows {
        for (i, c) in r.iter().enumerate() {
            w[i] = w[i].max(c.chars().count());
        }
    }
    let line = |cells: Vec<String>| {
        let mut s = cells
            .iter()
            .enumerate()
            .map(|(i, c)| format!("{c:<width$}", width = w[i]))
            .collect::<Vec<_>>()
            .join("  ");
        s.truncate(s.trim_end().len());
        s + "\n"
    };
    let mut out = if NO_HEADERS.load(std::sync::atomic::Ordering::Relaxed) {
        String::new()
    } else {
        line(head.iter().map(|s| s.to_uppercase()).collect())
    };
    for r in rows {
        out += &line(r);
    }
    out
}

/// A typed field as its JSON reads in a table (an enum by its name, a
/// float as JSON writes it).
fn text_of<T: serde::Serialize>(x: &T) -> String {
    s(&serde_json::to_value(x).unwrap_or(Value::Null))
}

fn s(v: &Value) -> String {
    match v {
        Value::Null => "-".into(),
        Value::String(x) => x.clone(),
        other => other.to_string(),
    }
}

/// GPUs a job asks for in all (whole GPUs, shares; a MIG instance or time
/// slice counts one).
/// The GPUs a job holds (or held last) as its quota counts them, a MIG
/// instance or time slice at its share; for a job that has not run, what
/// its spec asks for (a MIG profile or a time slice by name, as their
/// share depends on the node).
fn gpus_of(j: &api::Job) -> String {
    let held = j.ledger.last().map(|h| h.gpus);
    let mut n = 0.0;
    let mut shared = Vec::new();
    for t in &j.spec.tasks {
        let Some(g) = &t.resources.gpu else {
            continue;
        };
        let replicas = f64::from(t.replicas);
        let times = if t.replicas == 1 {
            String::new()
        } else {
            format!("{replicas}x")
        };
        match g.mode {
            api::GpuMode::Whole => n += f64::from(g.count.unwrap_or(1)) * replicas,
            api::GpuMode::Fraction => n += g.fraction.unwrap_or(0.0) * replicas,
            api::GpuMode::Mig => {
                shared.push(format!("{times}{}", g.profile.as_deref().unwrap_or("-")));
            }
            api::GpuMode::TimeSlice => shared.push(format!("{times}slice")),
        }
    }
    if let Some(h) = held {
        n = h;
    } else if !shared.is_empty() {
        if n > 0.0 {
            shared.insert(0, gpu_number(n));
        }
        return shared.join("+");
    }
    gpu_number(n)
}

/// A GPU count: whole, or to two places.
fn gpu_number(n: f64) -> String {
    if n == n.trunc() {
        format!("{n}")
    } else {
        format!("{n:.2}")
    }
}

/// How long a job has run: from its start to its end, or to now.
fn elapsed(j: &api::Job) -> String {
    let Some(start) = j.started_at else {
        return "-".into();
    };
    let end = j.finished_at.map_or_else(unix_now, |f| f as i64);
    age_of(end - start as i64)
}

/// A path segment with what a URL does not take as it is escaped.
fn urlencoding_path(s: &str) -> String {
    form_urlencoded::byte_serialize(s.as_bytes())
        .collect::<String>()
        .replace('+', "%20")
}

/// A node's CPU (cores) and memory (GiB) allocated of what it has.
fn node_alloc(n: &api::NodeView) -> (String, String) {
    let cores = |m: u64| {
        let c = m as f64 / 1000.0;
        if c == c.trunc() {
            format!("{c}")
        } else {
            format!("{c:.1}")
        }
    };
    let gib = |m: u64| format!("{:.1}", m as f64 / 1024.0);
    (
        format!(
            "{}/{}",
            cores(n.cpu_allocated_milli),
            cores(n.inventory.cpu_milli)
        ),
        format!(
            "{}/{}Gi",
            gib(n.memory_allocated_mib),
            gib(n.inventory.memory_mib)
        ),
    )
}

/// A node's state; a draining node with no job left is "drained", as
/// Slurm says (a drain that is not done says how many jobs are left); a
/// node in a reservation says so.
fn node_state(n: &api::NodeView) -> String {
    let jobs = n.job_count;
    let state = match n.state {
        api::NodeState::Draining if jobs == 0 => "drained".into(),
        api::NodeState::Draining => format!("draining ({jobs} jobs left)"),
        s => s.as_str().to_string(),
    };
    if n.reservations.is_empty() {
        state
    } else {
        format!("{state}+reserved")
    }
}

/// The MIG layout of a node's GPUs in MIG mode: `0:1g.10gb+3g.40gb`.
fn mig_of(n: &api::NodeView) -> String {
    let l: Vec<String> = n
        .inventory
        .gpus
        .iter()
        .filter(|g| !g.mig.is_empty())
        .map(|g| {
            let m: Vec<&str> = g.mig.iter().map(|m| m.profile.as_str()).collect();
            format!("{}:{}", g.index, m.join("+"))
        })
        .collect();
    if l.is_empty() {
        "-".into()
    } else {
        l.join(" ")
    }
}

fn pool_of(n: &api::NodeView) -> &str {
    Some(n.inventory.pool.as_str())
        .filter(|p| !p.is_empty())
        .unwrap_or("default")
}

fn labels_of(n: &api::NodeView) -> String {
    let l: Vec<String> = n
        .inventory
        .labels
        .iter()
        .map(|(k, v)| format!("{k}={v}"))
        .collect();
    if l.is_empty() {
        "-".into()
    } else {
        l.join(",")
    }
}

/// The jobs on a node the caller may see, and how many others there are.
fn node_jobs(n: &api::NodeView) -> String {
    let seen: Vec<String> = n.jobs.iter().map(u64::to_string).collect();
    let others = u64::from(n.job_count).saturating_sub(seen.len() as u64);
    match (seen.is_empty(), others) {
        (true, 0) => "-".into(),
        (_, 0) => seen.join(","),
        (true, k) => format!("{k} of other teams"),
        (false, k) => format!("{} (+{k} of other teams)", seen.join(",")),
    }
}

/// `node get`: a node and each of its GPUs.
fn node_text(n: &api::NodeView) -> String {
    let inv = &n.inventory;
    let (cpu, mem) = node_alloc(n);
    let pool = pool_of(n);
    let heartbeat = Value::from(n.last_heartbeat);
    let mut out = format!(
        "node {}: {}\n  cpu {cpu} cores allocated, memory {mem}\n  pool {pool}, labels {}\n  jobs {}\n  last heartbeat {} ({} ago){}\n",
        n.name,
        node_state(n),
        labels_of(n),
        node_jobs(n),
        local(&heartbeat),
        ago(&heartbeat),
        if inv.emulated {
            "\n  GPUs emulated (no NVML)"
        } else {
            ""
        },
    );
    for r in &n.reservations {
        out += &format!("  reservation {r}\n");
    }
    // Samples name their GPU by UUID.
    let util: std::collections::BTreeMap<&str, String> = n
        .gpus_now
        .iter()
        .map(|g| (g.uuid.as_str(), format!("{}%", g.util_pct)))
        .collect();
    let rows = inv
        .gpus
        .iter()
        .map(|g| {
            let mig: Vec<&str> = g.mig.iter().map(|m| m.profile.as_str()).collect();
            let held: Vec<String> = n
                .holders
                .iter()
                .filter(|h| h.gpu == g.index)
                .map(|h| {
                    let who = match h.job {
                        Some(j) => format!("job {j}"),
                        None => "other team".into(),
                    };
                    match h.mode.as_str() {
                        "whole" => who,
                        "mig" => format!("{who} ({})", h.profile.as_deref().unwrap_or("-")),
                        mode => format!("{who} ({mode} {:.2})", f64::from(h.milli) / 1000.0),
                    }
                })
                .collect();
            vec![
                g.index.to_string(),
                g.model.clone(),
                format!("{}Gi", g.memory_mib / 1024),
                if mig.is_empty() {
                    "-".into()
                } else {
                    mig.join(",")
                },
                g.unhealthy
                    .as_ref()
                    .map_or("ok".into(), |u| format!("UNHEALTHY: {u}")),
                if held.is_empty() {
                    "free".into()
                } else {
                    held.join(", ")
                },
                util.get(g.uuid.as_str())
                    .cloned()
                    .unwrap_or_else(|| "-".into()),
            ]
        })
        .collect();
    out += &columns(
        &["gpu", "model", "memory", "mig", "health", "held by", "util"],
        rows,
    );
    out
}

/// `job ls`'s table. Pending elements of one array are one row, as
/// Slurm's squeue shows them (`10_[30-199]`), unless `expand`.
fn job_rows(jobs: &[api::Job], wide: bool, expand: bool) -> String {
    // Rows in the answer's order: a job, or an array's pending elements.
    let mut groups: Vec<Vec<&api::Job>> = Vec::new();
    let mut at: std::collections::BTreeMap<u64, usize> = Default::default();
    for j in jobs {
        let array = j
            .array
            .as_ref()
            .map(|a| a.id)
            .filter(|_| !expand && j.state == api::JobState::Pending);
        match array.and_then(|a| at.get(&a)) {
            Some(&g) => groups[g].push(j),
            None => {
                if let Some(a) = array {
                    at.insert(a, groups.len());
                }
                groups.push(vec![j]);
            }
        }
    }
    let rows = groups
        .into_iter()
        .filter_map(|g| {
            // The group's first element (lowest index) speaks for it.
            let j = *g.iter().min_by_key(|j| j.id)?;
            let nodes: Vec<String> = j
                .tasks
                .iter()
                .map(|t| t.node.clone())
                .collect::<std::collections::BTreeSet<_>>()
                .into_iter()
                .collect();
            let (id, name) = match (g.len(), &j.array) {
                (1, Some(a)) => (j.id.to_string(), format!("{}[{}]", j.name, a.index)),
                (1, None) => (j.id.to_string(), j.name.clone()),
                (_, _) => {
                    let indices: Vec<u64> = g
                        .iter()
                        .filter_map(|e| e.array.as_ref().map(|a| u64::from(a.index)))
                        .collect();
                    let list = index_ranges(indices);
                    let array = j.array.as_ref().map_or(j.id, |a| a.id);
                    (format!("{array}_[{list}]"), format!("{}[{list}]", j.name))
                }
            };
            let mut row = vec![
                id,
                name,
                j.user.clone(),
                j.team.clone(),
                j.queue.clone(),
                j.spec.kind.as_str().to_string(),
                gpus_of(j),
                j.state.as_str().to_string(),
                age_of(unix_now() - j.submitted_at as i64),
                elapsed(j),
                start_of(j),
            ];
            if wide {
                row.push(if nodes.is_empty() {
                    "-".into()
                } else {
                    nodes.join(",")
                });
                row.push(local(&Value::from(j.submitted_at)));
            }
            row.push(j.reason.clone());
            Some(row)
        })
        .collect();
    let mut head = vec![
        "id", "name", "user", "team", "queue", "kind", "gpus", "state", "age", "time", "start",
    ];
    if wide {
        head.extend(["nodes", "submitted"]);
    }
    head.push("reason");
    columns(&head, rows)
}

/// Array indices as Slurm writes them: `0-3,7,9-12`.
fn index_ranges(mut v: Vec<u64>) -> String {
    v.sort_unstable();
    v.dedup();
    let mut out: Vec<String> = Vec::new();
    let mut k = 0;
    while k < v.len() {
        let mut e = k;
        while e + 1 < v.len() && v[e + 1] == v[e] + 1 {
            e += 1;
        }
        out.push(if e == k {
            v[k].to_string()
        } else {
            format!("{}-{}", v[k], v[e])
        });
        k = e + 1;
    }
    out.join(",")
}

/// When a job started (local time, the date only when not today), or for
/// a pending job when it is expected to ("in 12m"; "-" when unknown).
fn start_of(j: &api::Job) -> String {
    use chrono::TimeZone;
    if let Some(t) = j.started_at {
        let t = t as i64;
        let Some(t) = chrono::Local.timestamp_opt(t, 0).single() else {
            return "-".into();
        };
        let fmt = if t.date_naive() == chrono::Local::now().date_naive() {
            "%H:%M"
        } else {
            "%m-%d %H:%M"
        };
        return t.format(fmt).to_string();
    }
    match j.eta.map(|e| e as i64) {
        Some(e) if e <= unix_now() => "now".into(),
        Some(e) => format!("in {}", age_of(e - unix_now())),
        None => "-".into(),
    }
}

/// An estimated start in words: "unknown" without one (the reasons said
/// before it tell why it waits; the server gives no cause for the lack of
/// an estimate, so none is guessed here), "now" when it is due.
fn eta_text(eta: Option<u64>) -> String {
    let Some(e) = eta else {
        return "unknown".into();
    };
    let now = std::time::SystemTime::now()
        .duration_since(std::time::UNIX_EPOCH)
        .map_or(0, |d| d.as_secs());
    match e.saturating_sub(now) {
        0 => "now (at the next cycle)".into(),
        secs => format!("in {}", human(secs)),
    }
}

pub(crate) fn job(conn: &Conn, cmd: JobCmd) -> anyhow::Result<()> {
    // A pod on Kubernetes: asked of its cluster, no token needed.
    if let JobCmd::Why { id } = &cmd
        && let Some((ns, pod)) = id.split_once('/')
    {
        println!("{}", crate::k8s::why(ns, pod, "gpuflow")?);
        return Ok(());
    }
    let c = Client::new(conn)?;
    match cmd {
        JobCmd::Submit {
            file,
            wrap,
            queue,
            name,
            kind,
            gpus,
            cpu,
            memory_mib,
            test_only,
            array,
            dependency,
            reservation,
            image,
        } => {
            let (mut body, mut ct, file) = match (file, wrap) {
                (Some(file), _) => {
                    let ct = if file.extension().is_some_and(|e| e == "json") {
                        "application/json"
                    } else {
                        "application/yaml"
                    };
                    (read_file(&file)?, ct, file)
                }
                (None, Some(cmd)) => {
                    let mut resources = serde_json::json!({"cpu": cpu, "memory_mib": memory_mib});
                    if gpus > 0 {
                        resources["gpu"] = serde_json::json!({ "count": gpus });
                    }
                    let spec = serde_json::json!({
                        "name": name, "queue": queue, "kind": kind,
                        "tasks": [{"name": "main", "command": ["sh", "-c", cmd], "resources": resources}],
                    });
                    (
                        serde_json::to_vec(&spec)?,
                        "application/json",
                        PathBuf::from("--wrap"),
                    )
                }
                (None, None) => return Err(Usage("give -f FILE or --wrap COMMAND".into()).into()),
            };
            if array.is_some() || dependency.is_some() || reservation.is_some() || image.is_some() {
                // The file's spec with its `array` and `dependency` set, sent as JSON.
                let mut spec: Value = serde_norway::from_slice(&body)
                    .map_err(|e| Usage(format!("{} is not YAML or JSON: {e}", file.display())))?;
                if let Some(i) = &image
                    && let Some(tasks) = spec["tasks"].as_array_mut()
                {
                    for t in tasks {
                        t["image"] = Value::String(i.clone());
                    }
                }
                if let Some(a) = array {
                    spec["array"] = Value::String(a);
                }
                if let Some(d) = dependency {
                    spec["dependency"] = Value::String(d);
                }
                if let Some(r) = reservation {
                    spec["reservation"] = Value::String(r);
                }
                body = serde_json::to_vec(&spec)?;
                ct = "application/json";
            }
            if test_only {
                let path = "/v1/jobs?test_only=true";
                let v = c.call("POST", path, Some((ct, body)))?;
                return print_as(conn.output, path, v, |t: &api::TestOnly| {
                    if t.would_start {
                        return format!("would start now on {}\n", t.nodes.join(", "));
                    }
                    let mut out = String::from("would wait:\n");
                    for r in &t.reasons {
                        out += &format!("  {r}\n");
                    }
                    out += &format!("  estimated start: {}\n", eta_text(t.eta));
                    out
                });
            }
            // Retried on connection failures with one idempotency key: the job
            // is stored once however often it is sent.
            let key = idempotency_key();
            let v = submit_once(&c, ct, &body, &key, std::time::Duration::from_millis(500))?;
            print_as(conn.output, "/v1/jobs", v, |v: &api::Submitted| {
                match &v.array {
                    Some(a) => {
                        let (id, n) = (a.id, u64::from(a.index));
                        format!(
                            "array {id} submitted: {n} jobs, {id}-{} ({})\n",
                            id + n.saturating_sub(1),
                            v.state.as_str()
                        )
                    }
                    None => format!("job {} submitted ({})\n", v.id, v.state.as_str()),
                }
            })?;
        }
        JobCmd::Ls {
            state,
            all,
            queue,
            team,
            user,
            array,
            expand,
            since,
            until,
            limit,
            watch,
        } => {
            if let (Some(a), Some(b)) = (since, until)
                && a >= b
            {
                return Err(Usage("--since must be before --until".into()).into());
            }
            let mut q = form_urlencoded::Serializer::new(String::new());
            // A time window asks for history: finished jobs too.
            if !state.is_empty() {
                q.append_pair("state", &state.join(","));
            } else if !all && since.is_none() && until.is_none() {
                q.append_pair("state", ACTIVE);
            }
            for (k, t) in [("since", since), ("until", until)] {
                if let Some(t) = t {
                    q.append_pair(k, &t.max(0).to_string());
                }
            }
            for (k, v) in [("queue", queue), ("team", team), ("user", user)] {
                if let Some(v) = v {
                    q.append_pair(k, &v);
                }
            }
            if let Some(a) = array {
                q.append_pair("array", &a.to_string());
            }
            if let Some(l) = limit {
                q.append_pair("limit", &l.to_string());
            }
            let path = format!("/v1/jobs?{}", q.finish());
            let wide = conn.output == Format::Wide;
            watch.run(|| {
                let v = c.call("GET", &path, None)?;
                print_as(conn.output, &path, v, |jobs: &Vec<api::Job>| {
                    job_rows(jobs, wide, expand || array.is_some())
                })
            })?;
        }
        JobCmd::Get { id, watch } => {
            watch.run(|| {
                let path = format!("/v1/jobs/{id}");
                let v = c.call("GET", &path, None)?;
                print_as(conn.output, &path, v, |j| job_text(j, c.base()))?;
                Ok(())
            })?;
        }
        JobCmd::Exec {
            id,
            task,
            tty,
            no_tty,
            command,
        } => {
            let code = crate::session::exec(&c, id, task, tty, no_tty, &command)?;
            std::process::exit(code);
        }
        JobCmd::Attach { id, task } => {
            crate::session::attach(&c, id, task)?;
        }
        JobCmd::Stats { id } => {
            let path = format!("/v1/jobs/{id}");
            let v = c.call("GET", &path, None)?;
            print_as(conn.output, &path, v, job_stats)?;
        }
        JobCmd::Why { id } => {
            let id: u64 = id.parse().map_err(|_| {
                Usage(format!(
                    "{id:?} is neither a job id (a number) nor a Kubernetes pod (NAMESPACE/POD)"
                ))
            })?;
            let path = format!("/v1/jobs/{id}/why");
            let v = c.call("GET", &path, None)?;
            print_as(conn.output, &path, v, |w: &api::Why| {
                let mut out = format!("job {} is {}: {}\n", w.id, w.state.as_str(), w.summary);
                for r in w.reasons.iter().skip(1) {
                    out += &format!("  also: {r}\n");
                }
                if let Some(p) = w.position {
                    out += &format!("  position in its queue: {p}\n");
                }
                if w.state == api::JobState::Pending {
                    out += &format!("  estimated start: {}\n", eta_text(w.eta));
                }
                out
            })?;
        }
        JobCmd::Logs {
            id,
            tail,
            attempt,
            follow,
            stream,
        } => return logs(&c, conn.output, id, (tail, attempt, follow), &stream),
        JobCmd::Cancel { array: Some(a), .. } => {
            let path = format!("/v1/arrays/{a}/cancel");
            let v = c.call("POST", &path, None)?;
            print_as(conn.output, &path, v, |v: &api::ArrayCancelled| {
                format!(
                    "array {}: {} cancelled, {} stopping\n",
                    v.id, v.cancelled, v.stopping
                )
            })?;
        }
        JobCmd::Cancel {
            ids,
            name,
            user,
            state,
            array: None,
        } => return cancel(&c, conn.output, ids, name, user, state),
        JobCmd::Suspend { id } => return job_action(&c, conn.output, "suspend", id),
        JobCmd::Resume { id } => return job_action(&c, conn.output, "resume", id),
        JobCmd::Hold { id } => return job_action(&c, conn.output, "hold", id),
        JobCmd::Release { id } => return job_action(&c, conn.output, "release", id),
    }
    Ok(())
}

/// A job's output: each task's, of one attempt, the last lines or all the
/// server keeps; following, what is new every second until the job ends.
fn logs(
    c: &Client,
    output: Format,
    id: u64,
    (tail, attempt, follow): (Option<usize>, Option<u32>, bool),
    stream: &str,
) -> anyhow::Result<()> {
    // Each task's stdout, then (labelled) its stderr, as asked.
    let texts = |v: &api::JobLogs| -> anyhow::Result<Vec<(String, String)>> {
        let mut out = Vec::new();
        let none = std::collections::BTreeMap::new();
        for (latest, all, label) in [
            (&v.tasks, &v.attempts, ""),
            (&v.stderr, &v.stderr_attempts, " (stderr)"),
        ] {
            if (stream == "stdout" && !label.is_empty()) || (stream == "stderr" && label.is_empty())
            {
                continue;
            }
            let m = match attempt {
                None => latest,
                Some(a) => {
                    if !v.attempts.contains_key(&a) {
                        let kept: Vec<String> = v.attempts.keys().map(u32::to_string).collect();
                        return Err(Usage(format!(
                            "--attempt {a}: no output kept for it; kept: {}",
                            if kept.is_empty() {
                                "none".into()
                            } else {
                                kept.join(", ")
                            }
                        ))
                        .into());
                    }
                    all.get(&a).unwrap_or(&none)
                }
            };
            out.extend(
                m.iter()
                    .map(|(k, t)| (format!("{k}{label}"), t.clone()))
                    .filter(|(_, t)| label.is_empty() || !t.is_empty()),
            );
        }
        Ok(out)
    };
    let path = format!("/v1/jobs/{id}/logs");
    let v = c.call("GET", &path, None)?;
    if !follow {
        let tasks = texts(&gpuflow_client::read(&path, v.clone())?)?;
        print(output, &v, |_| {
            let mut out = String::new();
            for (task, text) in &tasks {
                let text = match tail {
                    Some(n) => {
                        let lines: Vec<&str> = text.lines().collect();
                        lines[lines.len().saturating_sub(n)..].join("\n") + "\n"
                    }
                    None => text.clone(),
                };
                out += &format!("==> {task} <==\n{text}");
                if !out.ends_with('\n') {
                    out.push('\n');
                }
            }
            out
        });
        return Ok(());
    }
    // Following: what each task wrote since the last look (the window asked
    // for is the end of the output: the new part is what follows the part
    // seen before).
    use std::io::Write;
    let mut seen: std::collections::BTreeMap<String, String> = Default::default();
    loop {
        let path = format!("/v1/jobs/{id}/logs?tail_bytes=65536");
        let v: api::JobLogs = gpuflow_client::read(&path, c.call("GET", &path, None)?)?;
        for (task, text) in texts(&v)? {
            let before = seen.get(&task).cloned().unwrap_or_default();
            let new = match text.find(before.as_str()).filter(|_| !before.is_empty()) {
                Some(at) => &text[at + before.len()..],
                None if before.is_empty() => match tail {
                    Some(n) => {
                        let lines: Vec<&str> = text.lines().collect();
                        let start = lines.len().saturating_sub(n);
                        let skip: usize = lines[..start].iter().map(|l| l.len() + 1).sum();
                        &text[skip.min(text.len())..]
                    }
                    None => text.as_str(),
                },
                // The window moved past what was seen: print it whole.
                None => text.as_str(),
            };
            if !new.is_empty() {
                print!("{new}");
                let _ = std::io::stdout().flush();
            }
            // Keep the last part seen, to find the new part next time.
            let keep = text.len().saturating_sub(4096);
            let keep = (keep..=text.len())
                .find(|i| text.is_char_boundary(*i))
                .unwrap_or(text.len());
            seen.insert(task, text[keep..].to_string());
        }
        let path = format!("/v1/jobs/{id}");
        let job: api::Job = gpuflow_client::read(&path, c.call("GET", &path, None)?)?;
        if job.state.finished() {
            return Ok(());
        }
        std::thread::sleep(std::time::Duration::from_secs(1));
    }
}

/// One job as text: what it is, its state, and its tasks.
/// A job in words; `base`: the server's address, for its proxied ports.
fn job_text(j: &api::Job, base: &str) -> String {
    let at = |t: u64| local(&Value::from(t));
    let mut out = format!(
        "job {} {} ({}) in queue {} of team {}, by {}\nstate: {} — {}\nsubmitted {} ({} ago), ran {}\nattempts: {}, preemptions: {}\n",
        j.id,
        j.name,
        j.spec.kind.as_str(),
        j.queue,
        j.team,
        j.user,
        j.state.as_str(),
        j.reason,
        at(j.submitted_at),
        age_of(unix_now() - j.submitted_at as i64),
        elapsed(j),
        j.attempts,
        j.preemptions
    );
    let rows = j
        .tasks
        .iter()
        .map(|t| {
            let gpus = t.gpus.iter().map(u32::to_string).collect::<Vec<_>>();
            vec![
                format!("{}/{}", t.group, t.index),
                t.node.clone(),
                match (t.mig_instance, gpus.first()) {
                    (Some(m), Some(g)) => format!("{g} MIG {m}"),
                    _ if gpus.is_empty() => "-".into(),
                    _ => gpus.join(","),
                },
                t.state.clone(),
                t.exit_code.map_or_else(|| "-".into(), |c| c.to_string()),
            ]
        })
        .collect();
    out += &columns(&["task", "node", "gpus", "state", "exit"], rows);
    for t in &j.tasks {
        for p in &t.ports {
            out += &format!(
                "{}/{} serves {} (port {}) at {}{}\n",
                t.group,
                t.index,
                p.name,
                p.port,
                base.trim_end_matches('/'),
                p.url
            );
        }
    }
    out
}

/// Cancels the jobs named by id, or every active job matching the filters.
fn cancel(
    c: &Client,
    output: Format,
    ids: Vec<u64>,
    name: Option<String>,
    user: Option<String>,
    state: Vec<String>,
) -> anyhow::Result<()> {
    let filtered = name.is_some() || user.is_some() || !state.is_empty();
    if ids.is_empty() && !filtered {
        return Err(Usage(
            "name the jobs to cancel: one or more ids, or --name, --user, --state or --array"
                .into(),
        )
        .into());
    }
    let mut targets = ids;
    if filtered {
        let mut q = form_urlencoded::Serializer::new(String::new());
        q.append_pair(
            "state",
            &if state.is_empty() {
                ACTIVE.to_string()
            } else {
                state.join(",")
            },
        );
        if let Some(u) = &user {
            q.append_pair("user", u);
        }
        let path = format!("/v1/jobs?{}", q.finish());
        let jobs: Vec<api::Job> = gpuflow_client::read(&path, c.call("GET", &path, None)?)?;
        targets.extend(
            jobs.iter()
                .filter(|j| name.as_ref().is_none_or(|n| j.name == *n))
                .map(|j| j.id),
        );
        if targets.is_empty() {
            eprintln!("no active job matches");
            return Ok(());
        }
    }
    // One job: its error as it is. Several: each is tried, each failure
    // said once (the server's message names the job), then how many.
    if let [id] = targets[..] {
        return job_action(c, output, "cancel", id);
    }
    let mut failed = Vec::new();
    for id in targets {
        if let Err(e) = job_action(c, output, "cancel", id) {
            eprintln!("error: {e:#}");
            failed.push(id);
        }
    }
    if failed.is_empty() {
        Ok(())
    } else {
        Err(anyhow!(
            "{} job(s) could not be cancelled: {failed:?}",
            failed.len()
        ))
    }
}

fn job_action(c: &Client, output: Format, action: &str, id: u64) -> anyhow::Result<()> {
    let path = format!("/v1/jobs/{id}/{action}");
    let v = c.call("POST", &path, None)?;
    print_as(output, &path, v, |j: &api::Job| {
        format!("job {}: {} — {}\n", j.id, j.state.as_str(), j.reason)
    })
}

fn human(secs: u64) -> String {
    match secs {
        0..=119 => format!("{secs} s"),
        120..=7199 => format!("{} min", secs / 60),
        _ => format!("{:.1} h", secs as f64 / 3600.0),
    }
}

pub(crate) fn queue(conn: &Conn, cmd: QueueCmd) -> anyhow::Result<()> {
    let c = Client::new(conn)?;
    match cmd {
        QueueCmd::Ls { watch } => {
            watch.run(|| {
                let v = c.call("GET", "/v1/queues", None)?;
                print_as(
                    conn.output,
                    "/v1/queues",
                    v,
                    |queues: &Vec<api::QueueView>| {
                        let rows = queues
                            .iter()
                            .map(|q| {
                                let quotas = q
                                    .spec
                                    .quotas
                                    .iter()
                                    .map(|(f, x)| quota_text(f, x))
                                    .collect::<Vec<_>>()
                                    .join(" ");
                                let used = q
                                    .used
                                    .iter()
                                    .map(|(f, x)| format!("{f}:{}", Value::from(*x)))
                                    .collect::<Vec<_>>()
                                    .join(",");
                                let borrowers = q
                                    .borrowers
                                    .iter()
                                    .map(|b| {
                                        format!("{}:{}:{}", b.queue, b.flavor, Value::from(b.gpus))
                                    })
                                    .collect::<Vec<_>>()
                                    .join(" ");
                                vec![
                                    q.spec.name.clone(),
                                    q.spec.team.clone(),
                                    q.spec.parent.clone().unwrap_or_else(|| "-".into()),
                                    Value::from(q.spec.weight).to_string(),
                                    text_of(&q.spec.state),
                                    quotas,
                                    used,
                                    q.running.to_string(),
                                    q.pending.to_string(),
                                    budget_left(q.spec.budget.as_ref(), q.budget_use.as_ref()),
                                    if borrowers.is_empty() {
                                        "-".into()
                                    } else {
                                        borrowers
                                    },
                                ]
                            })
                            .collect();
                        columns(
                            &[
                                "name",
                                "team",
                                "parent",
                                "weight",
                                "state",
                                "guaranteed",
                                "used",
                                "running",
                                "pending",
                                "budget left",
                                "borrowing its gpus",
                            ],
                            rows,
                        )
                    },
                )
            })?;
        }
        QueueCmd::Create { file } => {
            let v = c.call(
                "POST",
                "/v1/queues",
                Some(("application/json", as_json(&file)?)),
            )?;
            print_as(conn.output, "/v1/queues", v, |q: &api::QueueSpec| {
                format!("queue {} created\n", q.name)
            })?;
        }
        QueueCmd::Set {
            name,
            weight,
            state,
            quota,
            borrow_limit,
            lend_limit,
            cap,
            user_max_gpus,
            user_max_running,
            notebook_max_lifetime,
            notebook_idle_after,
            notebook_idle_action,
            budget_gpu_hours,
            budget_cost,
            budget_period,
            when_exhausted,
        } => {
            let mut patch = serde_json::Map::new();
            // The queue as it is: the API replaces quotas and user limits
            // as wholes, so what is not named stays.
            let current = || -> anyhow::Result<api::QueueView> {
                let queues: Vec<api::QueueView> =
                    gpuflow_client::read("/v1/queues", c.call("GET", "/v1/queues", None)?)?;
                queues
                    .into_iter()
                    .find(|x| x.spec.name == name)
                    .ok_or_else(|| anyhow!("queue {name:?} not found"))
            };
            let limit = |flag: &str, v: &str| -> anyhow::Result<Value> {
                if v == "none" {
                    return Ok(Value::Null);
                }
                let n: f64 = v
                    .parse()
                    .ok()
                    .filter(|n: &f64| *n >= 0.0)
                    .ok_or_else(|| Usage(format!("{flag}: {v:?} is not a number or none")))?;
                Ok(n.into())
            };
            let limits = [
                ("--borrow-limit", "borrow_limit", borrow_limit),
                ("--lend-limit", "lend_limit", lend_limit),
                ("--cap", "cap", cap),
            ];
            if user_max_gpus.is_some() || user_max_running.is_some() {
                let mut l = serde_json::to_value(current()?.spec.user_limits)?;
                if let Some(v) = user_max_gpus {
                    l["max_gpus"] = limit("--user-max-gpus", &v)?;
                }
                if let Some(v) = user_max_running {
                    l["max_running"] = match limit("--user-max-running", &v)? {
                        Value::Null => Value::Null,
                        n => (n.as_f64().unwrap_or(0.0) as u64).into(),
                    };
                }
                patch.insert("user_limits".into(), l);
            }
            if let Some(s) = notebook_max_lifetime {
                patch.insert("notebook_max_lifetime_s".into(), s.into());
            }
            if let (Some(after), Some(action)) = (notebook_idle_after, notebook_idle_action) {
                patch.insert(
                    "notebook_idle".into(),
                    serde_json::json!({"after_s": after, "action": action}),
                );
            }
            if budget_gpu_hours.is_some() || budget_cost.is_some() {
                let mut b = serde_json::json!({
                    "period": budget_period,
                    "when_exhausted": when_exhausted,
                });
                if let Some(h) = budget_gpu_hours {
                    b["gpu_hours"] = h.into();
                }
                if let Some(c) = budget_cost {
                    b["cost"] = c.into();
                }
                patch.insert("budget".into(), b);
            }
            if let Some(w) = weight {
                patch.insert("weight".into(), w.into());
            }
            if let Some(st) = state {
                patch.insert("state".into(), st.into());
            }
            if quota.is_some() || limits.iter().any(|(_, _, v)| v.is_some()) {
                // The API replaces a queue's quotas as a whole: start from
                // the queue's own, so that the guarantees and limits named
                // change and everything else (the other settings, the other
                // flavors) stays.
                let mut m = match serde_json::to_value(current()?.spec.quotas)? {
                    Value::Object(m) => m,
                    _ => serde_json::Map::new(),
                };
                for part in quota.iter().flat_map(|q| q.split(',')) {
                    let (f, g) = part
                        .split_once('=')
                        .ok_or_else(|| Usage(format!("--quota: {part:?} is not FLAVOR=GPUS")))?;
                    let g: f64 = g
                        .parse()
                        .map_err(|_| Usage(format!("--quota: {g:?} is not a number of GPUs")))?;
                    let e = m
                        .entry(f.to_string())
                        .or_insert_with(|| serde_json::json!({}));
                    e["guaranteed"] = g.into();
                }
                for (flag, field, v) in &limits {
                    let Some(v) = v else { continue };
                    for part in v.split(',') {
                        let (f, g) = part.split_once('=').ok_or_else(|| {
                            Usage(format!(
                                "{flag}: {part:?} is not FLAVOR=GPUS (or FLAVOR=none)"
                            ))
                        })?;
                        let e = m
                            .entry(f.to_string())
                            .or_insert_with(|| serde_json::json!({}));
                        e[*field] = limit(flag, g)?;
                    }
                }
                patch.insert("quotas".into(), Value::Object(m));
            }
            if patch.is_empty() {
                return Err(Usage(format!(
                    "nothing to change on queue {name}: give --weight, --state, --quota, --borrow-limit, --lend-limit, --cap, --user-max-gpus, --user-max-running, --notebook-max-lifetime, --notebook-idle-after/--notebook-idle-action or --budget-gpu-hours/--budget-cost"
                ))
                .into());
            }
            let v = c.call(
                "PATCH",
                &format!("/v1/queues/{name}"),
                Some(("application/json", serde_json::to_vec(&patch)?)),
            )?;
            print_as(conn.output, "/v1/queues", v, |q: &api::QueueSpec| {
                format!("queue {} updated\n", q.name)
            })?;
        }
        QueueCmd::Delete { name } => {
            c.call("DELETE", &format!("/v1/queues/{name}"), None)?;
            if matches!(conn.output, Format::Table) {
                println!("queue {name} deleted");
            }
        }
    }
    Ok(())
}

pub(crate) fn node(conn: &Conn, cmd: NodeCmd) -> anyhow::Result<()> {
    let c = Client::new(conn)?;
    let (action, name) = match cmd {
        NodeCmd::Get { name, watch } => {
            let path = format!("/v1/nodes/{}", urlencoding_path(&name));
            watch.run(|| {
                let v = c.call("GET", &path, None)?;
                print_as(conn.output, &path, v, node_text)
            })?;
            return Ok(());
        }
        NodeCmd::Ls { watch } => {
            let wide = conn.output == Format::Wide;
            watch.run(|| {
                let v = c.call("GET", "/v1/nodes", None)?;
                print_as(conn.output, "/v1/nodes", v, |nodes: &Vec<api::NodeView>| {
                    let rows = nodes
                        .iter()
                        .map(|n| {
                            let gpus = n.inventory.gpus.len();
                            let model = n.inventory.gpus.first().map_or("-", |g| g.model.as_str());
                            let emu = if n.inventory.emulated {
                                " (emulated)"
                            } else {
                                ""
                            };
                            let sick = n
                                .inventory
                                .gpus
                                .iter()
                                .filter(|g| g.unhealthy.is_some())
                                .count();
                            let sick = if sick > 0 {
                                format!(", {sick} UNHEALTHY")
                            } else {
                                String::new()
                            };
                            let busy = if n.gpus_now.is_empty() {
                                "-".to_string()
                            } else {
                                let sum: u64 =
                                    n.gpus_now.iter().map(|x| u64::from(x.util_pct)).sum();
                                format!("{}%", sum / n.gpus_now.len() as u64)
                            };
                            let used = n.gpus_in_use.len();
                            let (cpu, mem) = node_alloc(n);
                            let l = &n.inventory.limits;
                            let limits = if l.cgroup.is_empty() {
                                format!("NONE ({})", if l.note.is_empty() { "-" } else { &l.note })
                            } else {
                                format!("cgroup {}: {}", l.cgroup, l.controllers.join(","))
                            };
                            let mut row = vec![
                                n.name.clone(),
                                node_state(n),
                                format!("{gpus} × {model}{emu}{sick}"),
                                format!("{used}/{gpus}"),
                                cpu,
                                mem,
                                busy,
                                limits,
                            ];
                            if wide {
                                row.extend([
                                    pool_of(n).to_string(),
                                    labels_of(n),
                                    mig_of(n),
                                    node_jobs(n),
                                ]);
                            }
                            row
                        })
                        .collect();
                    let mut head = vec![
                        "name", "state", "gpus", "in use", "cpu", "memory", "gpu util", "limits",
                    ];
                    if wide {
                        head.extend(["pool", "labels", "mig", "jobs"]);
                    }
                    columns(&head, rows)
                })
            })?;
            return Ok(());
        }
        NodeCmd::Drain { name } => ("drain", name),
        NodeCmd::Cordon { name } => ("cordon", name),
        NodeCmd::Uncordon { name } => ("uncordon", name),
        NodeCmd::Replace { name } => ("replace", name),
        NodeCmd::Clear { name } => ("clear", name),
    };
    let path = format!("/v1/nodes/{name}/{action}");
    let v = c.call("POST", &path, None)?;
    print_as(conn.output, &path, v, |n: &api::NodeView| {
        format!("node {} is {}\n", n.name, node_state(n))
    })
}

pub(crate) fn team(conn: &Conn, cmd: TeamCmd) -> anyhow::Result<()> {
    let c = Client::new(conn)?;
    match cmd {
        TeamCmd::Ls => {
            let v = c.call("GET", "/v1/teams", None)?;
            print_as(conn.output, "/v1/teams", v, |v: &Vec<api::Team>| {
                columns(&["name"], v.iter().map(|t| vec![t.name.clone()]).collect())
            })?;
        }
        TeamCmd::Create { name, run_as } => {
            let mut body = serde_json::json!({ "name": name });
            if let Some(u) = run_as {
                body["run_as"] = u.into();
            }
            let v = c.call(
                "POST",
                "/v1/teams",
                Some(("application/json", serde_json::to_vec(&body)?)),
            )?;
            print_as(conn.output, "/v1/teams", v, |t: &api::Team| {
                format!("team {} created\n", t.name)
            })?;
        }
        TeamCmd::Set {
            name,
            run_as,
            registry,
            processes,
            default_image,
            registry_login,
            shared_control,
        } => {
            let mut body = serde_json::json!({});
            if let Some(b) = shared_control {
                body["shared_control"] = Value::Bool(b);
            }
            if let Some(r) = run_as {
                body["run_as"] = Value::String(r);
            }
            if !registry.is_empty() {
                let list: Vec<String> = registry.into_iter().filter(|r| !r.is_empty()).collect();
                body["registries"] = serde_json::json!(list);
            }
            if let Some(p) = processes {
                body["processes"] = Value::Bool(p);
            }
            if let Some(i) = default_image {
                body["default_image"] = Value::String(i);
            }
            if let Some(login) = registry_login {
                let (host, user) = login.split_once('=').ok_or_else(|| {
                    Usage(format!(
                        "--registry-login {login:?}: give HOST=USER (HOST= removes the login)"
                    ))
                })?;
                let mut password = String::new();
                if !user.is_empty() {
                    std::io::stdin().read_line(&mut password)?;
                }
                body["registry_credentials"] = serde_json::json!({
                    host: {"username": user, "password": password.trim_end_matches(['\n', '\r'])}
                });
            }
            if body.as_object().is_some_and(serde_json::Map::is_empty) {
                return Err(Usage(
                    "nothing to change: give --run-as, --registry, --processes, --default-image, --registry-login or --shared-control".into(),
                )
                .into());
            }
            let v = c.call(
                "PATCH",
                &format!("/v1/teams/{name}"),
                Some(("application/json", serde_json::to_vec(&body)?)),
            )?;
            print_as(conn.output, "/v1/teams", v, |t: &api::Team| {
                format!(
                    "team {}: tasks run as {}; {}\n",
                    t.name,
                    t.run_as.as_deref().unwrap_or("the agents' default"),
                    if t.shared_control {
                        "members act on each other's jobs"
                    } else {
                        "members act on their own jobs only"
                    }
                )
            })?;
        }
    }
    Ok(())
}

pub(crate) fn project(conn: &Conn, cmd: ProjectCmd) -> anyhow::Result<()> {
    let c = Client::new(conn)?;
    match cmd {
        ProjectCmd::Ls => {
            let v = c.call("GET", "/v1/projects", None)?;
            print_as(
                conn.output,
                "/v1/projects",
                v,
                |v: &Vec<api::ProjectView>| {
                    columns(
                        &["name", "team", "cost centre", "budget left"],
                        v.iter()
                            .map(|p| {
                                let cc = &p.project.cost_centre;
                                vec![
                                    p.project.name.clone(),
                                    p.project.team.clone(),
                                    if cc.is_empty() {
                                        "-".into()
                                    } else {
                                        cc.clone()
                                    },
                                    budget_left(p.project.budget.as_ref(), p.budget_use.as_ref()),
                                ]
                            })
                            .collect(),
                    )
                },
            )?;
        }
        ProjectCmd::Create {
            name,
            team,
            cost_centre,
        } => {
            let body = serde_json::json!({"name": name, "team": team, "cost_centre": cost_centre});
            let v = c.call(
                "POST",
                "/v1/projects",
                Some(("application/json", serde_json::to_vec(&body)?)),
            )?;
            print_as(conn.output, "/v1/projects", v, |p: &api::ProjectView| {
                format!(
                    "project {} of team {} created\n",
                    p.project.name, p.project.team
                )
            })?;
        }
        ProjectCmd::Budget {
            name,
            gpu_hours,
            cost,
            period,
            when_exhausted,
            clear,
        } => {
            let budget = if clear {
                Value::Null
            } else {
                serde_json::json!({
                    "gpu_hours": gpu_hours, "cost": cost, "period": period,
                    "taper_from": 1.0, "when_exhausted": when_exhausted,
                })
            };
            let body = serde_json::json!({ "budget": budget });
            let v = c.call(
                "PATCH",
                &format!("/v1/projects/{name}"),
                Some(("application/json", serde_json::to_vec(&body)?)),
            )?;
            print_as(conn.output, "/v1/projects", v, |p: &api::ProjectView| {
                format!(
                    "project {}: budget {}\n",
                    p.project.name,
                    budget_left(p.project.budget.as_ref(), p.budget_use.as_ref())
                )
            })?;
        }
    }
    Ok(())
}

pub(crate) fn user(conn: &Conn, cmd: UserCmd) -> anyhow::Result<()> {
    let c = Client::new(conn)?;
    let cmd_kind = match &cmd {
        UserCmd::Disable { .. } => "disable",
        _ => "other",
    };
    match cmd {
        UserCmd::Ls => {
            let v = c.call("GET", "/v1/users", None)?;
            print_as(conn.output, "/v1/users", v, |v: &Vec<api::User>| {
                columns(
                    &["name", "team", "role", "state"],
                    v.iter()
                        .map(|u| {
                            let state = if u.disabled { "disabled" } else { "enabled" };
                            vec![
                                u.name.clone(),
                                u.team.clone(),
                                u.role.as_str().to_string(),
                                state.into(),
                            ]
                        })
                        .collect(),
                )
            })?;
        }
        UserCmd::Create { name, team, role } => {
            let body = serde_json::json!({"name": name, "team": team, "role": role});
            let v = c.call(
                "POST",
                "/v1/users",
                Some(("application/json", serde_json::to_vec(&body)?)),
            )?;
            print_as(conn.output, "/v1/users", v, |u: &api::User| {
                format!("user {} ({}) created\n", u.name, u.role.as_str())
            })?;
        }
        UserCmd::Disable { name } | UserCmd::Enable { name } => {
            let verb = if matches!(cmd_kind, "disable") {
                "disable"
            } else {
                "enable"
            };
            let v = c.call("POST", &format!("/v1/users/{name}/{verb}"), None)?;
            print_as(conn.output, "/v1/users", v, |u: &api::User| {
                format!("user {} {verb}d\n", u.name)
            })?;
        }
        UserCmd::Signout { name } => {
            let v = c.call("POST", &format!("/v1/users/{name}/signout"), None)?;
            print_as(conn.output, "/v1/users", v, |u: &api::User| {
                format!(
                    "user {}: sign-ins until now are refused; they sign in again\n",
                    u.name
                )
            })?;
        }
    }
    Ok(())
}

pub(crate) fn token(conn: &Conn, cmd: TokenCmd) -> anyhow::Result<()> {
    let c = Client::new(conn)?;
    match cmd {
        TokenCmd::Create { user, expires_in } => {
            let mut body = serde_json::json!({ "user": user });
            if let Some(d) = expires_in {
                body["expires_in_s"] = d.as_secs().max(1).into();
            }
            let v = c.call(
                "POST",
                "/v1/tokens",
                Some(("application/json", serde_json::to_vec(&body)?)),
            )?;
            print_as(conn.output, "/v1/tokens", v, |t: &api::TokenCreated| {
                format!("{}\n", t.token)
            })?;
        }
        TokenCmd::Ls => {
            let v = c.call("GET", "/v1/tokens", None)?;
            print_as(conn.output, "/v1/tokens", v, |v: &Vec<api::TokenView>| {
                columns(
                    &["id", "user", "created", "expires"],
                    v.iter()
                        .map(|t| {
                            vec![
                                t.id.clone(),
                                t.user.clone(),
                                local_at(t.created_at),
                                t.expires_at.map_or_else(|| "never".into(), local_at),
                            ]
                        })
                        .collect(),
                )
            })?;
        }
        TokenCmd::Revoke { id } => {
            c.call("DELETE", &format!("/v1/tokens/{id}"), None)?;
            if matches!(conn.output, Format::Table) {
                println!("token {id} revoked");
            }
        }
    }
    Ok(())
}

pub(crate) fn event(conn: &Conn, cmd: EventCmd) -> anyhow::Result<()> {
    let c = Client::new(conn)?;
    let EventCmd::Ls {
        job,
        after,
        since,
        until,
        limit,
        watch,
    } = cmd;
    if let (Some(a), Some(b)) = (since, until)
        && a >= b
    {
        return Err(Usage("--since must be before --until".into()).into());
    }
    if limit.is_some_and(|l| !(1..=1000).contains(&l)) {
        return Err(Usage("--limit: 1 to 1000 events".into()).into());
    }
    let mut q = vec![];
    if let Some(j) = job {
        q.push(format!("job={j}"));
    }
    for (k, v) in [("since", since), ("until", until)] {
        if let Some(t) = v {
            q.push(format!("{k}={}", t.max(0)));
        }
    }
    // --limit: the newest N on the first look; later looks take all that came.
    let newest = limit.map(|l| format!("limit={l}&newest=true"));
    // The first look prints the table; each later one the events that
    // came since, without the heading (as `kubectl get events -w`).
    let mut last = after;
    let mut first = true;
    watch.follow(|| {
        let mut q = q.clone();
        if let Some(a) = last {
            q.push(format!("after={a}"));
        }
        if first && let Some(n) = &newest {
            q.push(n.clone());
        }
        let path = format!("/v1/events?{}", q.join("&"));
        let v = c.call("GET", &path, None)?;
        let events: Vec<api::Event> = gpuflow_client::read(&path, v.clone())?;
        let list = v.as_array().cloned().unwrap_or_default();
        if let Some(e) = events.last() {
            last = Some(e.seq);
        }
        if !first && events.is_empty() {
            return Ok(());
        }
        let rows: Vec<Vec<String>> = events
            .iter()
            .map(|e| {
                vec![
                    e.seq.to_string(),
                    local_at(e.at),
                    e.job.map_or_else(|| "-".into(), |j| j.to_string()),
                    e.kind.clone(),
                    e.message.clone(),
                ]
            })
            .collect();
        let head = ["seq", "at", "job", "kind", "message"];
        match (first, conn.output) {
            (true, _) | (false, Format::Json | Format::Yaml) => {
                print(conn.output, &Value::Array(list), |_| columns(&head, rows))
            }
            (false, _) => {
                // Later rows, without the heading again.
                let was = NO_HEADERS.swap(true, std::sync::atomic::Ordering::Relaxed);
                print!("{}", columns(&head, rows));
                NO_HEADERS.store(was, std::sync::atomic::Ordering::Relaxed);
            }
        }
        first = false;
        Ok(())
    })
}

/// A flavor's quota: `H100:8+4` (8 guaranteed, 4 more may be borrowed),
/// `+any` when borrowing is unlimited, `^16` a cap; `all` for a guarantee
/// of the whole cluster.
fn quota_text(flavor: &str, q: &api::QuotaSpec) -> String {
    let g = q.guaranteed;
    let g = if g >= 1e6 {
        "all".to_string()
    } else {
        format!("{g}")
    };
    let borrow = match q.borrow_limit {
        Some(b) => format!("+{b}"),
        None => "+any".into(),
    };
    let cap = q.cap.map_or(String::new(), |c| format!("^{c}"));
    format!("{flavor}:{g}{borrow}{cap}")
}

/// What is left of a budget: `12.5 of 100 GPU-h/month`, `SPENT` once
/// used up; `-` without one.
fn budget_left(spec: Option<&api::BudgetSpec>, used: Option<&api::BudgetUse>) -> String {
    let (Some(spec), Some(b)) = (spec, used) else {
        return "-".into();
    };
    let (limit, unit) = match spec.cost {
        Some(c) => (c, ""),
        None => (spec.gpu_hours.unwrap_or(0.0), " GPU-h"),
    };
    format!(
        "{:.1} of {limit}{unit}/{}{}",
        b.left,
        text_of(&spec.period),
        if b.exhausted { " SPENT" } else { "" }
    )
}

pub(crate) fn report(conn: &Conn, cmd: ReportCmd) -> anyhow::Result<()> {
    let c = Client::new(conn)?;
    let out = conn.output;
    let num = |x: f64, digits: usize| format!("{x:.digits$}");
    let pct = |x: Option<f64>, scale: f64, digits: usize| {
        x.map_or("-".into(), |x| format!("{:.*}%", digits, x * scale))
    };
    match cmd {
        ReportCmd::Usage {
            by,
            period,
            from,
            to,
            csv,
        } => {
            let mut query = vec![("by", by.clone()), ("period", period), ("from", from)];
            query.extend(to.map(|t| ("to", t)));
            let head = [
                by.as_str(),
                "from",
                "gpu-hours",
                "used",
                "efficiency",
                "cost",
                "jobs",
            ];
            show_report(
                &c,
                out,
                csv,
                "/v1/reports/usage",
                &query,
                &head,
                |u: api::UsageReport| u.rows,
                |r: &api::UsageRow| {
                    vec![
                        r.key.clone(),
                        humantime::format_rfc3339_seconds(
                            std::time::UNIX_EPOCH + std::time::Duration::from_secs(r.period_start),
                        )
                        .to_string(),
                        num(r.gpu_hours, 2),
                        num(r.used_gpu_hours, 2),
                        pct(r.efficiency, 100.0, 0),
                        num(r.cost, 2),
                        r.jobs.to_string(),
                    ]
                },
            )
        }
        ReportCmd::Advice { from } => {
            let head = [
                "id",
                "name",
                "team",
                "model",
                "peak gpu mem",
                "util",
                "instead",
                "saving/month",
            ];
            show_report(
                &c,
                out,
                false,
                "/v1/reports/advice",
                &[("from", from)],
                &head,
                |v: Vec<api::Advice>| v,
                |a: &api::Advice| {
                    vec![
                        a.id.to_string(),
                        a.name.clone(),
                        a.team.clone(),
                        a.model.clone(),
                        format!("{} MiB", a.peak_gpu_memory_mib),
                        pct(Some(a.util_pct), 1.0, 0),
                        a.instead.clone(),
                        format!("{} {}", num(a.saving_per_month, 2), a.currency)
                            .trim()
                            .to_string(),
                    ]
                },
            )
        }
        ReportCmd::Jobs { by, from, to } => {
            let mut query = vec![("by", by.clone()), ("from", from)];
            query.extend(to.map(|t| ("to", t)));
            let head = [
                by.as_str(),
                "submitted",
                "started",
                "wait p50",
                "wait p95",
                "succeeded",
                "failed",
                "cancelled",
                "failure rate",
                "preemptions",
                "lost gpu-h",
            ];
            show_report(
                &c,
                out,
                false,
                "/v1/reports/jobs",
                &query,
                &head,
                |v: Vec<api::JobsRow>| v,
                |r: &api::JobsRow| {
                    let secs = |x: Option<u64>| x.map_or("-".into(), |s| format!("{s} s"));
                    vec![
                        r.key.clone(),
                        r.submitted.to_string(),
                        r.started.to_string(),
                        secs(r.wait_p50_s),
                        secs(r.wait_p95_s),
                        r.succeeded.to_string(),
                        r.failed.to_string(),
                        r.cancelled.to_string(),
                        pct(r.failure_rate, 100.0, 0),
                        r.preemptions.to_string(),
                        num(r.lost_gpu_hours, 2),
                    ]
                },
            )
        }
        ReportCmd::Idle { below, held_for } => {
            let head = [
                "id",
                "name",
                "team",
                "user",
                "kind",
                "gpus",
                "util",
                "gpu-hours",
            ];
            let query = [("below_pct", below.to_string()), ("for", held_for)];
            show_report(
                &c,
                out,
                false,
                "/v1/reports/low-utilization",
                &query,
                &head,
                |v: Vec<api::LowUse>| v,
                |j: &api::LowUse| {
                    vec![
                        j.id.to_string(),
                        j.name.clone(),
                        j.team.clone(),
                        j.user.clone(),
                        j.kind.as_str().to_string(),
                        Value::from(j.gpus).to_string(),
                        pct(Some(j.util_pct), 1.0, 1),
                        num(j.gpu_hours, 2),
                    ]
                },
            )
        }
    }
}

/// A report from the API: its rows (`rows` of the answer, read as the
/// API's type), as a table, CSV (`csv`), or the server's JSON or YAML.
#[allow(clippy::too_many_arguments)]
fn show_report<R: serde::de::DeserializeOwned, T>(
    c: &Client,
    output: Format,
    csv: bool,
    path: &str,
    query: &[(&str, String)],
    head: &[&str],
    rows: impl FnOnce(R) -> Vec<T>,
    row: impl Fn(&T) -> Vec<String>,
) -> anyhow::Result<()> {
    let mut q = form_urlencoded::Serializer::new(String::new());
    for (k, v) in query {
        q.append_pair(k, v);
    }
    let path = format!("{path}?{}", q.finish());
    let v = c.call("GET", &path, None)?;
    if !csv && matches!(output, Format::Json | Format::Yaml) {
        print(output, &v, |_| String::new());
        return Ok(());
    }
    let table: Vec<Vec<String>> = rows(gpuflow_client::read(&path, v)?)
        .iter()
        .map(row)
        .collect();
    if csv {
        let mut w = csv::Writer::from_writer(std::io::stdout());
        w.write_record(head)?;
        for r in table {
            w.write_record(r)?;
        }
        w.flush()?;
        return Ok(());
    }
    print!("{}", columns(head, table));
    Ok(())
}

pub(crate) fn price(conn: &Conn, cmd: PriceCmd) -> anyhow::Result<()> {
    let c = Client::new(conn)?;
    let v = match cmd {
        PriceCmd::Ls => c.call("GET", "/v1/prices", None)?,
        PriceCmd::Set { prices, currency } => {
            let mut gpu_hour = serde_json::Map::new();
            for p in &prices {
                let (model, price) = p
                    .split_once('=')
                    .and_then(|(m, v)| Some((m, v.parse::<f64>().ok()?)))
                    .ok_or_else(|| {
                        anyhow!("{p:?}: use MODEL=PRICE, e.g. H100-80GB-HBM3=2.50 or *=1")
                    })?;
                gpu_hour.insert(model.to_string(), price.into());
            }
            let body = serde_json::json!({"currency": currency, "gpu_hour": gpu_hour});
            c.call(
                "PUT",
                "/v1/prices",
                Some(("application/json", body.to_string().into_bytes())),
            )?
        }
    };
    print_as(conn.output, "/v1/prices", v, |v: &api::Prices| {
        let rows = v
            .gpu_hour
            .iter()
            .map(|(m, p)| {
                vec![
                    m.clone(),
                    format!("{} {}", Value::from(*p), v.currency)
                        .trim()
                        .to_string(),
                ]
            })
            .collect();
        columns(&["model", "per gpu-hour"], rows)
    })
}

/// `job stats`: a job's ledger and its tasks' sampled GPU use, with flags.
fn job_stats(j: &api::Job) -> String {
    let held: f64 = j.ledger.iter().map(|h| h.gpu_hours).sum();
    let sampled: Vec<(f64, f64)> = j
        .ledger
        .iter()
        .filter_map(|h| Some((h.gpu_hours, h.util_pct?)))
        .collect();
    let used: f64 = sampled.iter().map(|(g, u)| g * u / 100.0).sum();
    let sampled_hours: f64 = sampled.iter().map(|(g, _)| g).sum();
    let mut out = format!(
        "job {} ({}, team {}, {}): {} attempt(s), {held:.2} GPU-hours held",
        j.id,
        j.name,
        j.team,
        j.state.as_str(),
        j.attempts
    );
    if sampled_hours > 0.0 {
        out += &format!(
            ", {used:.2} used ({:.0}% efficient)",
            used / sampled_hours * 100.0
        );
    }
    out += "\n\n";
    out += &columns(
        &["attempt", "gpus", "model", "gpu-hours", "util"],
        j.ledger
            .iter()
            .map(|h| {
                vec![
                    h.attempt.to_string(),
                    Value::from(h.gpus).to_string(),
                    h.model.clone(),
                    format!("{:.2}", h.gpu_hours),
                    h.util_pct.map_or("-".into(), |u| format!("{u:.1}%")),
                ]
            })
            .collect(),
    );
    if !j.tasks.is_empty() {
        out += "\n";
        out += &columns(
            &[
                "task",
                "node",
                "gpus",
                "util now",
                "util mean",
                "gpu mem",
                "peak",
                "samples",
            ],
            j.tasks
                .iter()
                .map(|t| {
                    let u = t.usage.as_ref();
                    let dash = |f: &dyn Fn(&api::TaskUsage) -> String| u.map_or("-".into(), f);
                    vec![
                        format!("{}/{}", t.group, t.index),
                        t.node.clone(),
                        serde_json::to_string(&t.gpus).unwrap_or_default(),
                        dash(&|u| format!("{}%", u.gpu_util_pct)),
                        dash(&|u| format!("{:.1}%", u.gpu_util_avg_pct)),
                        dash(&|u| format!("{} MiB", u.gpu_memory_mib)),
                        dash(&|u| format!("{} MiB", u.gpu_memory_peak_mib)),
                        dash(&|u| u.samples.to_string()),
                    ]
                })
                .collect(),
        );
    }
    // What a reviewer of GPU use would flag.
    let mut flags = Vec::new();
    if sampled_hours > 0.0 && used / sampled_hours < 0.1 {
        flags.push(format!(
            "its GPUs sat mostly idle: {:.0}% mean utilisation",
            used / sampled_hours * 100.0
        ));
    }
    for t in &j.tasks {
        if t.usage
            .as_ref()
            .is_some_and(|u| u.samples > 0 && u.gpu_memory_peak_mib == 0)
        {
            flags.push(format!(
                "task {}/{} never held GPU memory: does it use its GPU?",
                t.group, t.index
            ));
        }
    }
    if sampled_hours == 0.0 && held > 0.0 {
        flags.push("no GPU samples (emulated GPUs, or the agent could not read them)".into());
    }
    for fl in flags {
        out += &format!("\nnote: {fl}");
    }
    out + "\n"
}

pub(crate) fn service(conn: &Conn, cmd: ServiceCmd) -> anyhow::Result<()> {
    let c = Client::new(conn)?;
    let show = |v: &api::ServiceView| {
        let mut out = format!(
            "service {} of team {} in queue {}: {} of {} replicas ready, version {}\n",
            v.spec.name, v.team, v.spec.queue, v.ready, v.spec.replicas, v.version
        );
        let rows = v
            .members
            .iter()
            .map(|m| {
                vec![
                    m.job.to_string(),
                    m.version.to_string(),
                    m.state.as_str().to_string(),
                    m.node.clone().unwrap_or_else(|| "-".into()),
                    m.port.map_or_else(|| "-".into(), |p| p.to_string()),
                    if m.ready { "yes".into() } else { "no".into() },
                ]
            })
            .collect();
        out += &columns(&["job", "version", "state", "node", "port", "ready"], rows);
        out += &format!(
            "endpoints: {}\n",
            if v.endpoints.is_empty() {
                "none yet".into()
            } else {
                v.endpoints.join(" ")
            }
        );
        out
    };
    let patch = |name: &str, body: Value| -> anyhow::Result<Value> {
        c.call(
            "PATCH",
            &format!("/v1/services/{name}"),
            Some(("application/json", serde_json::to_vec(&body)?)),
        )
    };
    match cmd {
        ServiceCmd::Ls => {
            let v = c.call("GET", "/v1/services", None)?;
            print_as(
                conn.output,
                "/v1/services",
                v,
                |v: &Vec<api::ServiceView>| {
                    columns(
                        &[
                            "name",
                            "team",
                            "queue",
                            "replicas",
                            "ready",
                            "version",
                            "endpoints",
                        ],
                        v.iter()
                            .map(|x| {
                                vec![
                                    x.spec.name.clone(),
                                    x.team.clone(),
                                    x.spec.queue.clone(),
                                    x.spec.replicas.to_string(),
                                    x.ready.to_string(),
                                    x.version.to_string(),
                                    if x.endpoints.is_empty() {
                                        "-".into()
                                    } else {
                                        x.endpoints.join(",")
                                    },
                                ]
                            })
                            .collect(),
                    )
                },
            )?;
        }
        ServiceCmd::Create { file } => {
            let v = c.call(
                "POST",
                "/v1/services",
                Some(("application/json", as_json(&file)?)),
            )?;
            print_as(conn.output, "/v1/services", v, show)?;
        }
        ServiceCmd::Get { name } => {
            let v = c.call("GET", &format!("/v1/services/{name}"), None)?;
            print_as(conn.output, "/v1/services", v, show)?;
        }
        ServiceCmd::Scale { name, replicas } => {
            let v = patch(&name, serde_json::json!({ "replicas": replicas }))?;
            print_as(conn.output, "/v1/services", v, show)?;
        }
        ServiceCmd::Update { name, file } => {
            let task: Value = serde_json::from_slice(&as_json(&file)?)?;
            let v = patch(&name, serde_json::json!({ "task": task }))?;
            print_as(conn.output, "/v1/services", v, show)?;
        }
        ServiceCmd::Delete { name } => {
            c.call("DELETE", &format!("/v1/services/{name}"), None)?;
            if matches!(conn.output, Format::Table | Format::Wide) {
                println!("service {name} deleted; its replicas are stopping");
            }
        }
    }
    Ok(())
}

/// `gpuflow whoami`.
///
/// # Errors
/// A server that cannot be reached, or refuses the token.
pub(crate) fn whoami(conn: &Conn) -> anyhow::Result<()> {
    let c = Client::new(conn)?;
    let v = c.call("GET", "/v1/whoami", None)?;
    let w: api::WhoAmI = serde_json::from_value(v.clone())
        .context("the server's whoami is not one this client reads")?;
    print(conn.output, &v, |_| {
        let expires = match w.expires_at {
            Some(t) => format!(
                "{} (in {})",
                local(&Value::from(t)),
                age_of(t as i64 - unix_now())
            ),
            None => "never (until revoked)".into(),
        };
        let team = if w.team.is_empty() {
            "-"
        } else {
            w.team.as_str()
        };
        let how = match &w.identity {
            Some(i) => format!(
                "through {} (OpenID Connect), subject {}",
                i.provider, i.subject
            ),
            None => format!("with token {}", w.token_id),
        };
        let mut out = format!(
            "user:        {}\nteam:        {team}\nrole:        {}\nsigned in:   {how}\nexpires:     {expires}\nserver:      {}\ncredentials: {}\n",
            w.user,
            w.role.as_str(),
            c.base(),
            c.token_from,
        );
        if let Some(ctx) = &c.context {
            out.push_str(&format!("context:     {ctx}\n"));
        }
        out
    });
    Ok(())
}

#[cfg(test)]
mod tests {
    use super::*;
    use std::io::{Read, Write};

    /// Reads one whole request, headers and body, as text. A fake server
    /// that answers after a single `read` may close with the body unread,
    /// and the kernel then resets the connection: the client sees a reset
    /// instead of the answer.
    fn read_request(s: &mut std::net::TcpStream) -> String {
        let mut buf = Vec::new();
        let mut chunk = [0u8; 4096];
        loop {
            if let Some(end) = buf.windows(4).position(|w| w == b"\r\n\r\n") {
                let head = String::from_utf8_lossy(&buf[..end]).to_lowercase();
                let len: usize = head
                    .lines()
                    .find_map(|l| l.strip_prefix("content-length:"))
                    .and_then(|v| v.trim().parse().ok())
                    .unwrap_or(0);
                if buf.len() >= end + 4 + len {
                    return String::from_utf8_lossy(&buf).into_owned();
                }
            }
            match s.read(&mut chunk) {
                Ok(0) | Err(_) => return String::from_utf8_lossy(&buf).into_owned(),
                Ok(n) => buf.extend_from_slice(&chunk[..n]),
            }
        }
    }

    fn client(base: &str) -> Client {
        let http = gpuflow_client::http_client(None, std::time::Duration::from_secs(5)).unwrap();
        Client {
            api: gpuflow_client::Client::new(http, server_urls(base).unwrap(), "t".into()),
            token: "t".into(),
            token_from: "a test".into(),
            ca_cert: None,
            context: None,
        }
    }

    /// A server that is not there: typed as unreachable, which a submission
    /// with an idempotency key retries (decided on the type, not the text).
    #[test]
    fn a_server_that_is_not_there_is_unreachable() {
        let port = std::net::TcpListener::bind("127.0.0.1:0")
            .unwrap()
            .local_addr()
            .unwrap()
            .port();
        let e = client(&format!("http://127.0.0.1:{port}"))
            .call("GET", "/v1/nodes", None)
            .unwrap_err();
        assert!(unreachable(&e), "{e:#}");
        assert!(
            e.to_string()
                .starts_with("cannot reach the server at http://127.0.0.1:")
        );
    }

    /// A refusal carries the API's code (a submission still being stored is
    /// `in_progress`, which the CLI retries with the same key) and reads as
    /// before: the message and the status.
    #[test]
    fn a_refusal_keeps_the_apis_code_and_reads_as_the_message() {
        let l = std::net::TcpListener::bind("127.0.0.1:0").unwrap();
        let port = l.local_addr().unwrap().port();
        std::thread::spawn(move || {
            if let Ok((mut s, _)) = l.accept() {
                let _ = read_request(&mut s);
                let body = r#"{"code":"in_progress","message":"job 7 is being stored; retry in a moment"}"#;
                let _ = write!(
                    s,
                    "HTTP/1.1 409 Conflict\r\ncontent-type: application/json\r\ncontent-length: {}\r\n\r\n{body}",
                    body.len()
                );
            }
        });
        let e = client(&format!("http://127.0.0.1:{port}"))
            .call(
                "POST",
                "/v1/jobs",
                Some(("application/yaml", b"x".to_vec())),
            )
            .unwrap_err();
        let r = e.downcast_ref::<Refusal>().expect("a refusal");
        assert_eq!((r.status, r.code.as_str()), (409, "in_progress"));
        assert_eq!(
            e.to_string(),
            "job 7 is being stored; retry in a moment (HTTP 409)"
        );
    }

    /// Several servers (a leader and its standbys): a request goes to the
    /// next when no connection to one opens or a standby answers, and later
    /// ones start there. Not after the leader's answer: a refusal is its
    /// word.
    #[test]
    fn a_server_that_does_not_listen_or_stands_by_is_passed_for_the_next() {
        let gone = std::net::TcpListener::bind("127.0.0.1:0")
            .unwrap()
            .local_addr()
            .unwrap()
            .port();
        let l = std::net::TcpListener::bind("127.0.0.1:0").unwrap();
        let port = l.local_addr().unwrap().port();
        std::thread::spawn(move || {
            for (i, s) in l.incoming().enumerate().take(2) {
                let Ok(mut s) = s else { continue };
                let _ = read_request(&mut s);
                let (status, body) = if i == 0 {
                    ("200 OK", r#"{"nodes":1}"#)
                } else {
                    ("403 Forbidden", r#"{"code":"forbidden","message":"no"}"#)
                };
                let _ = write!(
                    s,
                    "HTTP/1.1 {status}\r\ncontent-type: application/json\r\nconnection: close\r\ncontent-length: {}\r\n\r\n{body}",
                    body.len()
                );
            }
        });
        // A standby answers, but does nothing: passed as well.
        let standby = std::net::TcpListener::bind("127.0.0.1:0").unwrap();
        let standby_port = standby.local_addr().unwrap().port();
        std::thread::spawn(move || {
            if let Ok((mut s, _)) = standby.accept() {
                let _ = read_request(&mut s);
                let body = r#"{"code":"standby","message":"this server is a standby"}"#;
                let _ = write!(
                    s,
                    "HTTP/1.1 503 Service Unavailable\r\nx-gpuflow-standby: 1\r\ncontent-type: application/json\r\nconnection: close\r\ncontent-length: {}\r\n\r\n{body}",
                    body.len()
                );
            }
        });
        let c = client(&format!(
            "http://127.0.0.1:{gone}, http://127.0.0.1:{standby_port},http://127.0.0.1:{port}"
        ));
        let v = c.call("GET", "/v1/nodes", None).unwrap();
        assert_eq!(v["nodes"], 1);
        assert_eq!(c.base(), format!("http://127.0.0.1:{port}"));
        let e = c.call("GET", "/v1/nodes", None).unwrap_err();
        assert_eq!(e.downcast_ref::<Refusal>().map(|r| r.status), Some(403));
        assert_eq!(c.base(), format!("http://127.0.0.1:{port}"));
        assert!(
            server_urls("http://a:1,b:2").is_err(),
            "each needs a scheme"
        );
        assert!(server_urls(" , ").is_err(), "at least one");
    }

    /// `node get` shows each GPU's utilisation as its agent last sampled it.
    /// The samples carry the GPU's UUID, not its index: read by field name,
    /// the column was "-" whatever the agent sent.
    #[test]
    fn node_get_shows_each_gpus_sampled_utilisation() {
        let n = serde_json::json!({
            "name": "n1", "state": "ready", "last_heartbeat": 1, "gpus_in_use": [],
            "inventory": {"cpu_milli": 8000, "memory_mib": 16384, "emulated": false,
                "gpus": [
                    {"index": 0, "uuid": "GPU-a", "model": "H100", "memory_mib": 81920},
                    {"index": 1, "uuid": "GPU-b", "model": "H100", "memory_mib": 81920}
                ]},
            "gpus_now": [{"uuid": "GPU-b", "util_pct": 77, "memory_util_pct": 5, "memory_used_mib": 1024}]
        });
        let text = node_text(&serde_json::from_value(n).unwrap());
        let rows: Vec<&str> = text.lines().filter(|l| l.starts_with(['0', '1'])).collect();
        assert_eq!(rows.len(), 2, "{text}");
        assert!(
            rows[0].trim_end().ends_with('-'),
            "GPU 0 has no sample: {text}"
        );
        assert!(
            rows[1].trim_end().ends_with("77%"),
            "GPU 1 was sampled at 77 %: {text}"
        );
    }

    /// A submission still being stored (`409 in_progress`) is sent again
    /// with the same key until it is acknowledged; a refusal of another
    /// kind is not retried.
    #[test]
    fn a_submission_in_progress_is_sent_again_with_its_key() {
        let l = std::net::TcpListener::bind("127.0.0.1:0").unwrap();
        let port = l.local_addr().unwrap().port();
        let keys = std::sync::Arc::new(std::sync::Mutex::new(Vec::new()));
        let seen = keys.clone();
        std::thread::spawn(move || {
            for (i, s) in l.incoming().enumerate().take(4) {
                let Ok(mut s) = s else { continue };
                let text = read_request(&mut s).to_lowercase();
                let key = text
                    .lines()
                    .find_map(|l| l.strip_prefix("idempotency-key: "))
                    .unwrap_or("")
                    .trim()
                    .to_string();
                seen.lock().unwrap().push(key);
                let (status, body) = match i {
                    0 | 1 => (
                        "409 Conflict",
                        r#"{"code":"in_progress","message":"job 7 is being stored"}"#,
                    ),
                    2 => ("201 Created", r#"{"id":7,"state":"pending"}"#),
                    _ => (
                        "400 Bad Request",
                        r#"{"code":"invalid_spec","message":"no"}"#,
                    ),
                };
                let _ = write!(
                    s,
                    "HTTP/1.1 {status}\r\ncontent-type: application/json\r\nconnection: close\r\ncontent-length: {}\r\n\r\n{body}",
                    body.len()
                );
            }
        });
        let c = client(&format!("http://127.0.0.1:{port}"));
        let ms = std::time::Duration::from_millis(10);
        let v = submit_once(&c, "application/yaml", b"x", "k-1", ms).unwrap();
        assert_eq!(v["id"], 7);
        assert_eq!(*keys.lock().unwrap(), ["k-1", "k-1", "k-1"]);
        let e = submit_once(&c, "application/yaml", b"x", "k-2", ms).unwrap_err();
        assert_eq!(e.downcast_ref::<Refusal>().map(|r| r.status), Some(400));
        assert_eq!(
            keys.lock().unwrap().len(),
            4,
            "a plain refusal is not sent again"
        );
    }

    /// Quotas and budgets read from the API's types as the tables wrote
    /// them from JSON: `H100:4+2^8`, "all" for an unbounded guarantee, a
    /// budget's period by its API name.
    #[test]
    fn quotas_and_budgets_read_as_before() {
        let q: api::QuotaSpec = serde_json::from_value(
            serde_json::json!({"guaranteed": 4, "borrow_limit": 2, "cap": 8}),
        )
        .unwrap();
        assert_eq!(quota_text("H100", &q), "H100:4+2^8");
        let all: api::QuotaSpec =
            serde_json::from_value(serde_json::json!({"guaranteed": 1e9})).unwrap();
        assert_eq!(quota_text("A100", &all), "A100:all+any");
        let spec: api::BudgetSpec =
            serde_json::from_value(serde_json::json!({"gpu_hours": 100, "period": "month"}))
                .unwrap();
        let used: api::BudgetUse = serde_json::from_value(serde_json::json!({
            "period_start": 0, "unit": "gpu-hours", "used": 100, "left": 0, "weight_factor": 0.1, "exhausted": true
        }))
        .unwrap();
        assert_eq!(
            budget_left(Some(&spec), Some(&used)),
            "0.0 of 100 GPU-h/month SPENT"
        );
        assert_eq!(budget_left(Some(&spec), None), "-");
    }

    /// A plain HTTP server asked over TLS: said so, with the address to use,
    /// and not taken for an unreachable one.
    #[test]
    fn a_plain_http_server_asked_over_tls_is_said_so() {
        let l = std::net::TcpListener::bind("127.0.0.1:0").unwrap();
        let port = l.local_addr().unwrap().port();
        std::thread::spawn(move || {
            if let Ok((mut s, _)) = l.accept() {
                let mut hello = [0u8; 512];
                let _ = s.read(&mut hello);
                let _ = s.write_all(b"HTTP/1.1 400 Bad Request\r\ncontent-length: 0\r\n\r\n");
            }
        });
        let e = client(&format!("https://127.0.0.1:{port}"))
            .call("GET", "/v1/nodes", None)
            .unwrap_err();
        assert!(!unreachable(&e), "{e:#}");
        assert_eq!(
            e.to_string(),
            format!(
                "the server at https://127.0.0.1:{port} does not speak TLS: try http://127.0.0.1:{port}"
            )
        );
    }
}
