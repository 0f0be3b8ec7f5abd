//! `gpuflow up`, `gpuflow server` and `gpuflow agent`: wiring of the server
//! and agent crates to flags, logging and signals.

use std::net::SocketAddr;
use std::path::PathBuf;
use std::sync::Arc;
use std::sync::atomic::{AtomicBool, Ordering};
use std::time::Duration;

use anyhow::{Context, anyhow};
use clap::Args;
use gpuflow_agent::gpu::Emulated;

#[derive(Args, Clone)]
pub(crate) struct ServerArgs {
    /// Address to listen on (port 0 picks a free port).
    #[arg(long, env = "GPUFLOW_LISTEN", default_value = "127.0.0.1:7070")]
    pub listen: SocketAddr,
    /// Holds the embedded database, the admin token and the join token.
    #[arg(long, env = "GPUFLOW_DATA", default_value_os_t = default_data_dir())]
    pub data_dir: PathBuf,
    /// `postgres://USER@HOST:PORT/DB` for PostgreSQL; default: SQLite in the data directory.
    #[arg(long, env = "GPUFLOW_STORE")]
    pub store: Option<String>,
    /// On PostgreSQL, servers that share the store lead by a lease of this
    /// many seconds: one leads, the others wait as standbys and take over
    /// when its lease lapses (0: this server assumes it is the only one).
    /// Running jobs keep running through a takeover while it is shorter
    /// than --node-timeout.
    #[arg(long, default_value_t = 10)]
    pub lease_ttl: u64,
    /// The URL standbys name for this server while it leads (default: the
    /// listen address).
    #[arg(long)]
    pub advertise: Option<String>,
    /// A file holding the token agents join with (or set GPUFLOW_JOIN_TOKEN);
    /// default: generated once, kept in the data directory. Never on the
    /// command line, which every process of the machine can read.
    #[arg(long)]
    pub join_token_file: Option<PathBuf>,
    /// Seconds without a heartbeat before a node is lost and its work requeued.
    #[arg(long, default_value_t = 30)]
    pub node_timeout: u64,
    /// Seconds between agent heartbeats.
    #[arg(long, default_value_t = 2)]
    pub heartbeat: u64,
    /// Seconds a job runs before it may be preempted.
    #[arg(long, default_value_t = 300)]
    pub min_runtime: u64,
    /// Seconds of work since its last checkpoint (or its start) above which
    /// a job is not preempted until it checkpoints, so that no preemption
    /// loses more; 0: no limit.
    #[arg(long, default_value_t = 3600)]
    pub max_unsaved: u64,
    /// Consolidation: a job that no node can take, though the free GPUs
    /// would hold it, may move smaller running preemptible jobs holding at
    /// most this many seconds of work since their last checkpoint, when
    /// they all fit elsewhere at once (one move a minute); 0: never.
    #[arg(long, default_value_t = 900)]
    pub consolidate_max_unsaved: u64,
    /// Seconds a notebook or inference job that runs beyond its queue's
    /// guarantee, on capacity other queues leave idle, keeps it before a
    /// queue within its guarantee may take it back; 0: such jobs stay
    /// within their guarantee.
    #[arg(long, default_value_t = 4 * 3600)]
    pub lease_horizon: u64,
    /// GPU-hours of work a queue may lose per hour when batch and training
    /// jobs of other queues reclaim its borrowed GPUs (inference, notebooks
    /// and queues below 0.8 of their share of recent usage pass it); `none`:
    /// no limit.
    #[arg(long, default_value = "1", value_parser = parse_budget)]
    pub disruption_budget: Budget,
    /// How many jobs of a queue those reclaims may stop per hour, however
    /// little work they lose (the same jobs pass it); 0: no limit.
    #[arg(long, default_value_t = 64)]
    pub disruption_max_jobs: usize,
    /// Seconds a job that passes those budgets (inference, notebooks, a
    /// queue below its share) waits before it does; until then budgets
    /// bind its reclaims too. 0: at once.
    #[arg(long, default_value_t = 3600)]
    pub budget_patience: u64,
    /// Identity providers users sign in through (OpenID Connect), a YAML
    /// file: `providers: [{name, issuer, client_id, scopes,
    /// username_claim, groups_claim, rules: [{group, team, role}]}]`
    /// (README, "Sign-in").
    #[arg(long)]
    pub oidc_config: Option<PathBuf>,
    /// Output kept per job, in MiB, over all its tasks, streams and
    /// attempts; beyond it only each task's last 16 KiB is kept.
    #[arg(long, default_value_t = 16)]
    pub job_log_mib: u64,
    /// Let webhooks call this machine and private networks (loopback,
    /// 10/8, 192.168/16, link-local, …); `up` always does.
    #[arg(long)]
    pub webhook_private: bool,
    /// The SMTP relay notifications by mail go through, HOST:PORT (plain
    /// SMTP; without it, mail notifications are refused).
    #[arg(long)]
    pub smtp_server: Option<String>,
    /// The sender of notification mail.
    #[arg(long, default_value = "gpuflow@localhost")]
    pub smtp_from: String,
    /// Longest gap between scheduling cycles, in milliseconds (changes also start one).
    #[arg(long, default_value_t = 1000)]
    pub cycle_ms: u64,
    /// Requests a second one API token may send; past it, 429 (0: no limit).
    #[arg(long, default_value_t = gpuflow_server::ratelimit::PER_TOKEN)]
    pub rate_limit: u32,
    /// Requests a second one address may send without a valid token (0: no
    /// limit).
    #[arg(long, default_value_t = gpuflow_server::ratelimit::ANONYMOUS)]
    pub rate_limit_anonymous: u32,
    /// Serve HTTPS with this PEM certificate chain (needs --tls-key).
    #[arg(long, requires = "tls_key")]
    pub tls_cert: Option<PathBuf>,
    /// The PEM private key of --tls-cert.
    #[arg(long, requires = "tls_cert")]
    pub tls_key: Option<PathBuf>,
}

#[derive(Args, Clone)]
pub(crate) struct AgentArgs {
    /// The server, e.g. http://10.0.0.1:7070; a leader and its standbys
    /// separated by commas (the agent moves on when one does not answer).
    #[arg(long, env = "GPUFLOW_SERVER")]
    pub server: String,
    /// A file holding the join token (the server's `join.token`), or set
    /// GPUFLOW_JOIN_TOKEN. Never on the command line, which every process of
    /// the node can read.
    #[arg(long)]
    pub join_token_file: Option<PathBuf>,
    /// PEM certificate to trust for an https server (e.g. its self-signed one).
    #[arg(long, env = "GPUFLOW_CA_CERT")]
    pub ca_cert: Option<PathBuf>,
    /// Leave tasks running when the agent exits (for an upgrade); the next
    /// agent on this work directory adopts them.
    #[arg(long)]
    pub keep_tasks_on_exit: bool,
    #[command(flatten)]
    pub node: NodeArgs,
}

#[derive(Args, Clone)]
pub(crate) struct NodeArgs {
    /// This node's name; default: the host name.
    #[arg(long)]
    pub node: Option<String>,
    /// Where task directories and logs go; default: DATA/agent.
    #[arg(long)]
    pub work_dir: Option<PathBuf>,
    /// Emulate GPUs instead of using NVML: N, NxMODEL or NxMODEL:MEM_MIB.
    #[arg(long)]
    pub emulate: Option<String>,
    /// Declare the emulated GPUs in MIG mode with these instances, e.g.
    /// 1g.10gb,1g.10gb,3g.40gb (needs --emulate).
    #[arg(long, requires = "emulate")]
    pub emulate_mig: Option<String>,
    /// The emulated GPUs all reach each other over NVLink (one island).
    #[arg(long, requires = "emulate")]
    pub emulate_nvlink: bool,
    /// Load this NVML library instead of the system's libnvidia-ml.so.1.
    #[arg(long)]
    pub nvml_lib: Option<PathBuf>,
    #[arg(long, default_value = "default")]
    pub pool: String,
    /// The address other nodes reach this one at.
    #[arg(long, default_value = "127.0.0.1")]
    pub address: String,
    /// When the agent runs as root and --task-uid-base is 0: the system user
    /// tasks run as unless their team names one (`run_as`). Never root.
    #[arg(long, default_value = "nobody")]
    pub run_as: String,
    /// When the agent runs as root: tasks of a team without `run_as` run as
    /// this uid plus the team's number, a user of the team's own, so teams
    /// cannot read each other's processes; 0 runs them as --run-as.
    #[arg(long, default_value_t = gpuflow_agent::task::DEFAULT_TASK_UID_BASE)]
    pub task_uid_base: u32,
    /// A node label, KEY=VALUE (repeatable); `rack` and `block` place the
    /// node in the topology jobs may ask for.
    #[arg(long = "label", value_parser = parse_label)]
    pub labels: Vec<(String, String)>,
    /// Tasks' limits (CPU, memory, pids) go into this cgroup v2 hierarchy
    /// instead of the one the node mounts (e.g. one mounted for the agent).
    #[arg(long)]
    pub cgroup_root: Option<PathBuf>,
    /// Where the kernel's /proc is, for the NVIDIA driver's MIG capability
    /// devices (`devices`, `driver/nvidia-caps/mig-minors`): the host's
    /// when the agent runs in a container, e.g. /host/proc.
    #[arg(long, default_value = "/proc")]
    pub proc_root: PathBuf,
    /// The most processes and threads one task may have (cgroup pids limit).
    /// Capped at a quarter of the kernel's pid_max; all tasks together get
    /// at most three quarters of it.
    #[arg(long, default_value_t = gpuflow_agent::DEFAULT_TASK_PIDS_MAX)]
    pub task_pids_max: u64,
    /// Let tasks create user namespaces (rootless containers, some
    /// sandboxes); their seccomp filter denies it otherwise.
    #[arg(long)]
    pub task_user_namespaces: bool,
    /// Seconds between samples of the GPUs and of tasks' GPU use (which
    /// also enforce GPU-memory limits and measure idleness).
    #[arg(long, default_value_t = 5)]
    pub sample_s: u64,
    /// The most this node's image cache keeps, MiB: past it, the least
    /// recently used images no task runs from are removed.
    #[arg(long, default_value_t = 20 << 10)]
    pub image_cache_mib: u64,
    /// Where the node's CDI specs are (repeatable): a task's GPUs in an
    /// image get their devices, mounts, environment and hooks from them.
    #[arg(long, default_values = ["/etc/cdi", "/var/run/cdi"])]
    pub cdi_dir: Vec<PathBuf>,
}

fn parse_label(s: &str) -> Result<(String, String), String> {
    match s.split_once('=') {
        Some((k, v)) if gpuflow_api::valid_name(k) && !v.is_empty() && v.len() <= 63 => {
            Ok((k.to_string(), v.to_string()))
        }
        _ => Err(format!(
            "{s:?} is not a label: KEY=VALUE, KEY a name (lowercase letters, digits, '-', '_', '.'), VALUE 1 to 63 characters"
        )),
    }
}

/// The join token from `file`, else from GPUFLOW_JOIN_TOKEN (read once and
/// removed from the environment, so nothing the process starts inherits it).
fn join_token(file: Option<&std::path::Path>) -> anyhow::Result<Option<String>> {
    let from_env = std::env::var("GPUFLOW_JOIN_TOKEN").ok();
    // SAFETY: called at start-up, before any thread that reads the environment.
    unsafe { std::env::remove_var("GPUFLOW_JOIN_TOKEN") };
    if let Some(f) = file {
        let t = std::fs::read_to_string(f)
            .with_context(|| format!("--join-token-file: cannot read {}", f.display()))?;
        let t = t.trim().to_string();
        if t.is_empty() {
            return Err(anyhow!("--join-token-file: {} is empty", f.display()));
        }
        return Ok(Some(t));
    }
    Ok(from_env
        .map(|t| t.trim().to_string())
        .filter(|t| !t.is_empty()))
}

pub(crate) fn default_data_dir() -> PathBuf {
    std::env::var_os("HOME").map_or_else(
        || PathBuf::from(".gpuflow"),
        |h| PathBuf::from(h).join(".gpuflow"),
    )
}

pub(crate) fn init_logging() {
    let filter = tracing_subscriber::EnvFilter::try_from_default_env()
        .unwrap_or_else(|_| tracing_subscriber::EnvFilter::new("info"));
    // Colours for a person at a terminal, none in a log file.
    let _ = tracing_subscriber::fmt()
        .with_env_filter(filter)
        .with_writer(std::io::stderr)
        .with_ansi(std::io::IsTerminal::is_terminal(&std::io::stderr()))
        .try_init();
}

/// `--disruption-budget`: GPU-hours, or none.
#[derive(Clone, Copy, Debug, PartialEq)]
pub(crate) struct Budget(pub Option<f64>);

fn parse_budget(v: &str) -> Result<Budget, String> {
    if v == "none" {
        return Ok(Budget(None));
    }
    v.parse::<f64>()
        .ok()
        .filter(|b| b.is_finite() && *b >= 0.0)
        .map(|b| Budget(Some(b)))
        .ok_or_else(|| {
            format!("{v:?} is not a budget: give GPU-hours (0 or more, e.g. 1 or 2.5) or `none`")
        })
}

fn server_config(a: &ServerArgs) -> anyhow::Result<gpuflow_server::Config> {
    let mut c = gpuflow_server::Config::new(a.listen, a.data_dir.clone());
    c.store_url = a.store.clone();
    let postgres = a
        .store
        .as_deref()
        .is_some_and(|u| u.starts_with("postgres://") || u.starts_with("postgresql://"));
    c.lease_ttl_s = (postgres && a.lease_ttl > 0).then_some(a.lease_ttl);
    c.advertise = a.advertise.clone();
    c.join_token = join_token(a.join_token_file.as_deref())?;
    c.node_timeout_s = a.node_timeout.max(1);
    c.heartbeat_s = a.heartbeat.clamp(1, 60);
    c.min_runtime_s = a.min_runtime;
    c.max_unsaved_s = (a.max_unsaved > 0).then_some(a.max_unsaved);
    c.consolidate_max_unsaved_s =
        (a.consolidate_max_unsaved > 0).then_some(a.consolidate_max_unsaved);
    c.disruption_budget = a.disruption_budget.0;
    c.disruption_max_jobs = (a.disruption_max_jobs > 0).then_some(a.disruption_max_jobs);
    c.budget_patience_s = a.budget_patience;
    c.lease_horizon_s = (a.lease_horizon > 0).then_some(a.lease_horizon);
    c.job_log_bytes = a.job_log_mib << 20;
    c.cycle_interval = Duration::from_millis(a.cycle_ms.max(10));
    c.tls = a.tls_cert.clone().zip(a.tls_key.clone());
    c.rate_per_token = a.rate_limit;
    c.rate_anonymous = a.rate_limit_anonymous;
    c.webhook_private = a.webhook_private;
    if let Some(path) = &a.oidc_config {
        let text = std::fs::read_to_string(path)
            .with_context(|| format!("cannot read --oidc-config {}", path.display()))?;
        c.oidc = gpuflow_server::oidc::Settings::parse(&text)
            .map_err(|e| anyhow::anyhow!("--oidc-config {}: {e}", path.display()))?;
    }
    c.smtp = match &a.smtp_server {
        None => None,
        Some(s) => {
            let (host, port) = s
                .rsplit_once(':')
                .and_then(|(h, p)| Some((h.to_string(), p.parse::<u16>().ok()?)))
                .ok_or_else(|| {
                    anyhow!("--smtp-server {s:?}: write HOST:PORT (e.g. mail.example.com:25)")
                })?;
            Some(gpuflow_server::Smtp {
                host,
                port,
                from: a.smtp_from.clone(),
            })
        }
    };
    Ok(c)
}

fn agent_config(
    server: String,
    join_token: String,
    n: &NodeArgs,
    data_dir: &std::path::Path,
    ca_cert: Option<PathBuf>,
) -> anyhow::Result<gpuflow_agent::Config> {
    let node = n.node.clone().unwrap_or_else(gpuflow_agent::host_name);
    if !gpuflow_api::valid_name(&node) {
        return Err(anyhow!(
            "--node {node:?} is not a valid node name (lowercase letters, digits, '-', '_', '.')"
        ));
    }
    Ok(gpuflow_agent::Config {
        server,
        join_token,
        node: node.clone(),
        work_dir: n.work_dir.clone().unwrap_or_else(|| data_dir.join("agent")),
        emulate: match n.emulate.as_deref().map(Emulated::parse).transpose() {
            Err(e) => return Err(anyhow!("--emulate: {e}")),
            Ok(Some(mut e)) => {
                e.nvlink = n.emulate_nvlink;
                e.node.clone_from(&node);
                Some(match &n.emulate_mig {
                    Some(layout) => e
                        .with_mig(layout)
                        .map_err(|e| anyhow!("--emulate-mig: {e}"))?,
                    None => e,
                })
            }
            Ok(None) => None,
        },
        nvml_lib: n.nvml_lib.clone(),
        pool: n.pool.clone(),
        labels: n.labels.iter().cloned().collect(),
        address: n.address.clone(),
        ca_cert,
        keep_tasks_on_exit: false,
        run_as: n.run_as.clone(),
        task_uid_base: n.task_uid_base,
        cgroup_root: n.cgroup_root.clone(),
        proc_root: n.proc_root.clone(),
        task_pids_max: n.task_pids_max.max(1),
        task_user_namespaces: n.task_user_namespaces,
        sample_interval: Duration::from_secs(n.sample_s.clamp(1, 3600)),
        image_cache_mib: n.image_cache_mib.max(1),
        cdi_dirs: n.cdi_dir.clone(),
    })
}

fn runtime() -> anyhow::Result<tokio::runtime::Runtime> {
    tokio::runtime::Builder::new_multi_thread()
        .enable_all()
        .build()
        .context("cannot start the async runtime")
}

/// `gpuflow server`: runs until interrupted.
pub(crate) fn server(a: ServerArgs) -> anyhow::Result<()> {
    init_logging();
    let rt = runtime()?;
    rt.block_on(async {
        let running = gpuflow_server::start(server_config(&a)?).await?;
        {
            use std::io::Write;
            let mut out = std::io::stdout().lock();
            let _ = writeln!(
                out,
                "gpuflow server listening on {}://{}",
                running.scheme, running.addr
            );
            if let Some(t) = &running.new_admin_token {
                // Printed for a person at a terminal; a log gets where it is.
                let file = a.data_dir.join("admin.token");
                if std::io::IsTerminal::is_terminal(&std::io::stdout()) {
                    let _ = writeln!(out, "admin token (also in {}): {t}", file.display());
                } else {
                    let _ = writeln!(out, "admin token: in {}", file.display());
                }
            }
        }
        use tokio::signal::unix::{SignalKind, signal};
        let mut term = signal(SignalKind::terminate()).context("cannot wait for SIGTERM")?;
        tokio::select! {
            r = tokio::signal::ctrl_c() => {
                r.context("cannot wait for Ctrl-C")?;
                running.release().await;
                Ok(())
            }
            _ = term.recv() => {
                running.release().await;
                Ok(())
            }
            () = running.deposed() => Err(anyhow!(
                "this server lost its leadership lease (another server took over, or the database was out of reach for the lease's term); it stops, and may be started again as a standby"
            )),
        }
    })
}

/// `gpuflow agent`: runs until interrupted; its tasks are stopped on exit.
pub(crate) fn agent(a: AgentArgs) -> anyhow::Result<()> {
    init_logging();
    let data = default_data_dir();
    let join = join_token(a.join_token_file.as_deref())?.ok_or_else(|| {
        anyhow!("no join token: pass --join-token-file FILE (the server's join.token) or set GPUFLOW_JOIN_TOKEN")
    })?;
    let mut cfg = agent_config(a.server, join, &a.node, &data, a.ca_cert)?;
    cfg.keep_tasks_on_exit = a.keep_tasks_on_exit;
    let stop = Arc::new(AtomicBool::new(false));
    let s = stop.clone();
    ctrlc_flag(s)?;
    gpuflow_agent::run(cfg, stop)
}

/// Sets `flag` on SIGINT or SIGTERM.
fn ctrlc_flag(flag: Arc<AtomicBool>) -> anyhow::Result<()> {
    let rt = runtime()?;
    std::thread::spawn(move || {
        rt.block_on(async {
            use tokio::signal::unix::{SignalKind, signal};
            let mut term = signal(SignalKind::terminate()).expect("signal handler");
            tokio::select! {
                _ = tokio::signal::ctrl_c() => {}
                _ = term.recv() => {}
            }
        });
        flag.store(true, Ordering::Relaxed);
    });
    Ok(())
}

#[derive(Args, Clone)]
pub(crate) struct UpArgs {
    #[command(flatten)]
    pub server: ServerArgs,
    #[command(flatten)]
    pub node: NodeArgs,
}

/// `gpuflow up`: the server, embedded SQLite and a local agent (NVML, or four
/// emulated GPUs where there is none) in one process.
pub(crate) fn up(mut a: UpArgs) -> anyhow::Result<()> {
    init_logging();
    let rt = runtime()?;
    // One machine, its own receivers: webhooks may call it.
    let mut cfg = server_config(&a.server)?;
    cfg.webhook_private = true;
    let running = rt.block_on(gpuflow_server::start(cfg))?;
    let join = running
        .join_token
        .clone()
        .ok_or_else(|| anyhow!("no join token is known for the local agent"))?;
    if a.node.emulate.is_none() && a.node.nvml_lib.is_none() {
        let probe = gpuflow_agent::gpu::Gpus::open(None, None);
        if probe.is_emulated() {
            a.node.emulate = Some("4".into());
        }
    }
    let url = format!("{}://{}", running.scheme, running.addr);
    let cfg = agent_config(
        url.clone(),
        join,
        &a.node,
        &a.server.data_dir,
        a.server.tls_cert.clone(),
    )?;
    let gpus = match &cfg.emulate {
        Some(e) if e.count == 1 => "1 emulated GPU".into(),
        Some(e) => format!("{} emulated GPUs", e.count),
        None => "GPUs from NVML".into(),
    };
    // The token is for the person at the terminal; where stdout is a file
    // (a log), only where to find it.
    use std::io::{IsTerminal, Write};
    let token_file = a.server.data_dir.join("admin.token");
    let admin_token = match std::fs::read_to_string(&token_file) {
        Ok(t) if std::io::stdout().is_terminal() => t.trim().to_string(),
        _ => format!("in {}", token_file.display()),
    };
    // The CLI finds this server's token by itself in the default data
    // directory, and through GPUFLOW_DATA in another.
    let mut env = String::new();
    if url != "http://127.0.0.1:7070" {
        env.push_str(&format!("GPUFLOW_SERVER={url} "));
    }
    if a.server.data_dir != default_data_dir() {
        env.push_str(&format!("GPUFLOW_DATA={} ", a.server.data_dir.display()));
    }
    // Printing must not kill the platform when nobody reads stdout any more.
    let mut out = std::io::stdout().lock();
    let _ = writeln!(out, "gpuflow is up at {url}");
    let _ = writeln!(out, "  data:   {}", a.server.data_dir.display());
    let _ = writeln!(out, "  agent:  node {} with {gpus}", cfg.node);
    let _ = writeln!(out, "  dashboard: {url}/ui/ (sign in with the admin token)");
    let _ = writeln!(out, "  try:    {env}gpuflow job ls");
    let _ = writeln!(out, "  admin token: {admin_token}");
    let _ = out.flush();
    drop(out);
    let stop = Arc::new(AtomicBool::new(false));
    let s = stop.clone();
    // An agent that stops early (its node name refused, say) says why at once,
    // not only when the platform is stopped.
    let agent = std::thread::spawn(move || {
        let r = gpuflow_agent::run(cfg, s);
        if let Err(e) = &r {
            eprintln!("error: the local agent stopped ({e:#}); the server goes on without it");
        }
        r
    });
    rt.block_on(async {
        use tokio::signal::unix::{SignalKind, signal};
        let mut term = signal(SignalKind::terminate()).context("signal handler")?;
        tokio::select! {
            _ = tokio::signal::ctrl_c() => {}
            _ = term.recv() => {}
        }
        anyhow::Ok(())
    })?;
    stop.store(true, Ordering::Relaxed);
    agent
        .join()
        .map_err(|_| anyhow!("the agent thread panicked"))??;
    Ok(())
}
