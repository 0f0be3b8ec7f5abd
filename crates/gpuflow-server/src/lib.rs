//! gpuflow's control plane: the `/v1` HTTP API, authentication and roles,
//! the scheduling loop (snapshot → core `schedule` → commit) and the server
//! side of the agent protocol.
//!
//! The working state lives in memory ([`state::World`]) behind one lock and is
//! written through to the [`Store`]: every change is built as a [`Change`],
//! committed in one transaction, and only then applied in memory and
//! acknowledged. After a crash, [`state::World::load`] rebuilds exactly what
//! was acknowledged. The server does no placement or ordering of its own: it
//! asks `gpuflow-core`.

pub mod accounting;
pub mod convert;
pub mod cycle;
pub mod depend;
pub mod event;
pub mod external;
pub mod feasible;
pub mod groupcommit;
pub mod http;
pub mod leader;
pub mod lifecycle;
pub mod listen;
pub mod nodes;
pub mod oidc;
pub mod openapi;
pub mod output;
pub mod ratelimit;
pub mod secret;
pub mod services;
pub mod snapshot;
pub mod state;
pub mod webhooks;

use std::collections::BTreeMap;
use std::net::SocketAddr;
use std::path::PathBuf;
use std::sync::Arc;
use std::time::{Duration, SystemTime, UNIX_EPOCH};

use gpuflow_store::{Batch, NewAudit, NewEvent, Store};
use tokio::sync::{Mutex, Notify};

use crate::state::{JobRec, NodeRec, World};

/// What can fail in the server.
#[derive(Debug, thiserror::Error)]
pub enum ServerError {
    #[error("store")]
    Store(#[from] gpuflow_store::StoreError),
    #[error("stored {what} does not parse: {message}")]
    Corrupt { what: String, message: String },
    #[error("{0}")]
    Io(#[from] std::io::Error),
    #[error("the scheduling cycle's computation failed: {0}")]
    Cycle(String),
    #[error("the committed state does not make a cluster the core accepts: {0}")]
    Snapshot(String),
    #[error("the server is stopping")]
    Stopping,
}

/// Server settings.
#[derive(Clone, Debug)]
pub struct Config {
    pub listen: SocketAddr,
    /// Holds the SQLite database (unless `store_url` says otherwise), the
    /// admin token of a new installation and the agents' join token.
    pub data_dir: PathBuf,
    /// `sqlite://PATH` or `postgres://…`; default: SQLite in `data_dir`.
    pub store_url: Option<String>,
    /// The agents' join token; default: generated once and kept in `data_dir`.
    pub join_token: Option<String>,
    /// Agents heartbeat this often.
    pub heartbeat_s: u64,
    /// A node whose heartbeats stop for this long is lost.
    pub node_timeout_s: u64,
    /// The scheduling loop runs at least this often (and on every change).
    pub cycle_interval: Duration,
    /// A job runs at least this long before it may be preempted.
    pub min_runtime_s: u64,
    /// A job with more work than this since its last checkpoint (or its
    /// start) is not preempted; `None`: no limit.
    pub max_unsaved_s: Option<u64>,
    /// Consolidation: a job no node can take, though the free GPUs would
    /// hold it, may move running preemptible jobs with at most this much
    /// work since their last checkpoint when they all fit elsewhere at
    /// once; `None`: never. See the core's `Config::consolidate_max_unsaved`.
    pub consolidate_max_unsaved_s: Option<u64>,
    /// A notebook or inference job may run beyond its queue's guarantee on
    /// capacity the other queues leave idle, and keeps it this long before
    /// a queue within its guarantee may take it back; `None`: such jobs
    /// stay within their guarantee. See the core's `Config::lease_horizon`.
    pub lease_horizon_s: Option<u64>,
    /// GPU-hours of work a queue may lose to reclaims by batch and training
    /// jobs per hour (inference, notebooks and queues below their share
    /// pass); `None`: no limit. See the core's `Config::disruption_budget`.
    pub disruption_budget: Option<f64>,
    /// How many jobs of a queue those reclaims may stop per hour; `None`:
    /// no limit. See the core's `Config::disruption_max_jobs`.
    pub disruption_max_jobs: Option<usize>,
    /// Seconds a job that passes disruption budgets waits before it does.
    /// See the core's `Config::budget_patience`.
    pub budget_patience_s: u64,
    /// Failed tries a cycle may spend, shared among the queues with pending
    /// jobs (each gets at least 8); see the core's `Config::tries_per_cycle`.
    pub tries_per_cycle: usize,
    /// Request bodies larger than this are refused.
    pub max_body_bytes: usize,
    /// Finished jobs stay in memory this long, then are read from the store.
    pub keep_finished_s: u64,
    /// Output stored per job (all its tasks, streams and attempts); beyond
    /// it each task's last 16 KiB is kept.
    pub job_log_bytes: u64,
    /// Serve HTTPS with this PEM certificate chain and private key.
    pub tls: Option<(PathBuf, PathBuf)>,
    /// Webhooks may call this machine and private networks (`up`, tests).
    pub webhook_private: bool,
    /// The identity providers users sign in through (OpenID Connect);
    /// none: tokens only.
    pub oidc: oidc::Settings,
    /// A failed webhook delivery is tried again after this, then doubling.
    pub webhook_backoff: std::time::Duration,
    /// Where notifications by mail go out; none: mail is refused.
    pub smtp: Option<Smtp>,
    /// Requests a second one token may send (0: no limit).
    pub rate_per_token: u32,
    /// Requests a second one address may send without a valid token (0:
    /// no limit).
    pub rate_anonymous: u32,
    /// Several servers share the store: lead by a lease of this many
    /// seconds ([`leader`]), or wait as a standby until it lapses; `None`:
    /// this server is the only one (SQLite in its data directory).
    pub lease_ttl_s: Option<u64>,
    /// The address standbys and the lease name for this server (default:
    /// `listen`).
    pub advertise: Option<String>,
    /// Tests of the server's supervision only: a fault injected into every
    /// scheduling computation (see [`Fault`]).
    #[doc(hidden)]
    pub fault: Option<Fault>,
    /// The server's clock: the system's, which tests move ahead
    /// ([`Clock::advance`]) instead of sleeping. Servers started from one
    /// `Config` share it, so a restart keeps its time.
    pub clock: Arc<Clock>,
}

/// A fault injected into the scheduling core's cycle, for tests of the
/// server's supervision: no known input makes the core panic, so tests
/// make one. It is called with the pending jobs' ids before each cycle's
/// `schedule()` (and each probe of the search for the job that made it
/// fail); a panic in it is taken for the core's.
#[derive(Clone)]
pub struct Fault(pub Arc<FaultFn>);

/// What a [`Fault`] calls: it panics to fail the cycle.
pub type FaultFn = dyn Fn(&[u64]) + Send + Sync;

impl std::fmt::Debug for Fault {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.write_str("Fault")
    }
}

impl Config {
    pub fn new(listen: SocketAddr, data_dir: PathBuf) -> Config {
        Config {
            listen,
            data_dir,
            store_url: None,
            lease_ttl_s: None,
            advertise: None,
            join_token: None,
            heartbeat_s: 2,
            node_timeout_s: 30,
            cycle_interval: Duration::from_secs(1),
            min_runtime_s: 300,
            max_unsaved_s: Some(3600),
            lease_horizon_s: gpuflow_core::schedule::Config::default().lease_horizon,
            consolidate_max_unsaved_s: gpuflow_core::schedule::Config::default()
                .consolidate_max_unsaved,
            disruption_budget: gpuflow_core::schedule::Config::default().disruption_budget,
            disruption_max_jobs: gpuflow_core::schedule::Config::default().disruption_max_jobs,
            budget_patience_s: gpuflow_core::schedule::Config::default().budget_patience,
            tries_per_cycle: gpuflow_core::schedule::Config::default().tries_per_cycle,
            max_body_bytes: 1 << 20,
            keep_finished_s: 3600,
            job_log_bytes: 16 << 20,
            tls: None,
            webhook_private: false,
            oidc: oidc::Settings::default(),
            webhook_backoff: std::time::Duration::from_secs(1),
            smtp: None,
            rate_per_token: ratelimit::PER_TOKEN,
            rate_anonymous: ratelimit::ANONYMOUS,
            fault: None,
            clock: Arc::default(),
        }
    }
}

/// The SMTP server notifications by mail go through.
#[derive(Clone, Debug)]
pub struct Smtp {
    pub host: String,
    pub port: u16,
    /// The sender address.
    pub from: String,
}

/// What every request handler and the scheduling loop share.
pub struct Shared {
    /// The state lock: held to read the state or change what is not
    /// stored; what is stored changes only through [`Shared::write`].
    pub world: Mutex<World>,
    /// Held by the writer of a change from the state it reads to the
    /// change in memory, through the store's write, where the state lock
    /// is let go ([`Writing::commit`]): writers take turns, so what one
    /// stores and then publishes is what it read, and readers go on.
    writes: Mutex<()>,
    pub store: Arc<dyn Store>,
    pub cfg: Config,
    /// Wakes the scheduling loop.
    pub wake: Notify,
    /// Held by the cycle from its snapshot to its commit: one at a time,
    /// with what the last cycle built that the next may reuse.
    pub applier: Mutex<snapshot::Reuse>,
    /// One diagnosis (`why` of a job the cycle did not reach) at a time.
    pub diagnoses: tokio::sync::Semaphore,
    /// Requests a second per token and per address without one.
    pub rates: ratelimit::RateLimits,
    /// Reports that read the stored jobs: two at a time, so readers cannot
    /// take the server's memory (each holds its jobs while it runs).
    pub reports: tokio::sync::Semaphore,
    /// `/metrics`, rendered one at a time and shared by those who wait.
    pub metrics: Mutex<http::metrics::Rendered>,
    /// Cycles that failed or panicked since the start (each is retried).
    pub cycle_failures: std::sync::atomic::AtomicU64,
    /// Held while the server runs: the data directory's exclusive lock.
    pub data_lock: std::fs::File,
    /// Sessions into running tasks waiting for their agent (`job exec`).
    pub sessions: http::exec::Sessions,
    /// The identity providers, their keys fetched as needed.
    pub oidc: Arc<oidc::Oidc>,
    /// Submissions waiting to be stored together ([`groupcommit`]).
    pub submissions: groupcommit::GroupCommit,
    /// Heartbeats waiting to be folded in together ([`http::agent`]).
    pub beats: groupcommit::Queue<http::agent::Beat>,
    /// This server's leadership lease, when servers share the store.
    pub lease: Option<Arc<leader::Lease>>,
}

/// The server's clock: the system's, plus a lead that tests advance
/// instead of sleeping (always 0 in a running server). Everything the
/// server dates reads it through [`Shared::now`].
#[derive(Debug, Default)]
pub struct Clock {
    ahead: std::sync::atomic::AtomicU64,
}

impl Clock {
    /// Seconds since the Unix epoch.
    pub fn now(&self) -> u64 {
        now() + self.ahead.load(std::sync::atomic::Ordering::Relaxed)
    }

    /// Moves this clock `secs` seconds ahead, for tests: what would wait
    /// that long in real time happens at once.
    pub fn advance(&self, secs: u64) {
        self.ahead
            .fetch_add(secs, std::sync::atomic::Ordering::Relaxed);
    }
}

impl Shared {
    /// The server's time in Unix seconds ([`Clock`]).
    pub fn now(&self) -> u64 {
        self.cfg.clock.now()
    }
}

/// Seconds since the Unix epoch by the system's clock. The server reads
/// its own [`Clock`] instead; this is for its edges (start-up, agents,
/// benchmarks).
pub fn now() -> u64 {
    SystemTime::now()
        .duration_since(UNIX_EPOCH)
        .map_or(0, |d| d.as_secs())
}

/// A time in messages: `2026-12-03T20:38:30Z` (the API's fields keep
/// Unix seconds).
pub fn when(t: u64) -> String {
    humantime::format_rfc3339_seconds(UNIX_EPOCH + std::time::Duration::from_secs(t)).to_string()
}

/// Changes to commit together: records that changed (whole), plus events and
/// audit lines. [`commit`] stores them, then puts the records in memory.
#[derive(Default)]
pub struct Change {
    /// Boxed, as in [`World`]: a record is large, and a map holds its
    /// values inline.
    pub jobs: BTreeMap<u64, Box<JobRec>>,
    pub nodes: BTreeMap<String, NodeRec>,
    /// Other records of `World`, in the order they were put.
    pub records: Vec<Rec>,
    /// Records of `World` removed.
    pub gone: Vec<Gone>,
    /// Events, audit lines, logs, and records `World` does not keep.
    pub batch: Batch,
}

/// A record of `World` other than a job or a node, as a change puts it.
#[derive(Debug)]
pub enum Rec {
    Team(gpuflow_api::Team),
    Project(gpuflow_api::Project),
    User(gpuflow_api::User),
    Token(state::TokenRec),
    Queue(gpuflow_api::QueueSpec),
    Service(Box<state::ServiceRec>),
    Reservation(gpuflow_api::Reservation),
    Webhook(state::WebhookRec),
    Prices(gpuflow_api::Prices),
}

impl Rec {
    fn record(&self) -> gpuflow_store::Record {
        match self {
            Rec::Team(t) => state::team_rec(t),
            Rec::Project(p) => state::project_rec(p),
            Rec::User(u) => state::user_rec(u),
            Rec::Token(t) => state::token_rec(t),
            Rec::Queue(q) => state::queue_rec(q),
            Rec::Service(s) => state::service_rec(s),
            Rec::Reservation(r) => state::reservation_rec(r),
            Rec::Webhook(h) => h.record(),
            Rec::Prices(p) => state::put(gpuflow_store::Table::Meta, "prices", "", "", p),
        }
    }

    fn publish(self, world: &mut World) {
        world.put_record(self);
    }
}

/// A record of `World` a change removes, by its key.
#[derive(Debug)]
pub enum Gone {
    /// A token, by its hash.
    Token(String),
    Queue(String),
    Service(String),
    Reservation(String),
    /// A webhook, by its id: its delivery log and queued notifications go too.
    Webhook(String),
}

impl Gone {
    fn key(&self) -> (gpuflow_store::Table, String) {
        match self {
            Gone::Token(h) => (gpuflow_store::Table::Tokens, h.clone()),
            Gone::Queue(q) => (gpuflow_store::Table::Queues, q.clone()),
            Gone::Service(s) => (gpuflow_store::Table::Meta, format!("service/{s}")),
            Gone::Reservation(r) => (gpuflow_store::Table::Meta, format!("reservation/{r}")),
            Gone::Webhook(id) => (gpuflow_store::Table::Meta, format!("webhook/{id}")),
        }
    }

    fn publish(self, world: &mut World) {
        world.remove_record(self);
    }
}

impl Change {
    /// Adds `other`'s records and entries (a record of both: `other`'s).
    pub fn merge(&mut self, other: Change) {
        let Change {
            jobs,
            nodes,
            records,
            gone,
            batch,
        } = other;
        self.jobs.extend(jobs);
        self.nodes.extend(nodes);
        self.records.extend(records);
        self.gone.extend(gone);
        self.batch.append(batch);
    }

    /// Puts a record of `World` (stored, then in memory).
    pub fn put(&mut self, r: Rec) {
        self.records.push(r);
    }

    /// Removes a record of `World` (from the store, then from memory).
    pub fn remove(&mut self, g: Gone) {
        self.gone.push(g);
    }

    pub fn job(&mut self, j: impl Into<Box<JobRec>>) {
        let j: Box<JobRec> = j.into();
        self.jobs.insert(j.id, j);
    }

    pub fn event(
        &mut self,
        at: u64,
        job: Option<u64>,
        team: &str,
        kind: event::EventKind,
        message: impl Into<String>,
    ) {
        let message = message.into();
        tracing::debug!(job, team, kind = kind.as_str(), %message, "event");
        self.batch.events.push(NewEvent {
            at,
            job,
            team: team.into(),
            kind: kind.as_str().into(),
            message,
        });
    }

    pub fn audit(
        &mut self,
        at: u64,
        actor: &str,
        action: &str,
        target: &str,
        detail: impl Into<String>,
    ) {
        self.batch.audit.push(NewAudit {
            at,
            actor: actor.into(),
            action: action.into(),
            target: target.into(),
            detail: detail.into(),
        });
    }

    pub fn is_empty(&self) -> bool {
        self.jobs.is_empty()
            && self.nodes.is_empty()
            && self.records.is_empty()
            && self.gone.is_empty()
            && self.batch.is_empty()
    }
}

/// Every job ever submitted (the recorded workload's): the store's, with
/// the newer copies of the jobs in memory.
///
/// # Errors
/// When the store cannot be read or holds a job it cannot parse.
pub async fn every_job(shared: &Shared) -> Result<Vec<JobRec>, ServerError> {
    let mut out = Vec::new();
    each_job(shared, None, |j| out.push(j)).await?;
    out.sort_by_key(|j| j.id);
    Ok(out)
}

/// How many stored jobs a reader parses at a time.
const JOB_PAGE: u32 = 500;

/// Calls `f` with every job of `team` (all teams' with `None`), once each,
/// in no particular order: the newer copy in memory for the jobs there,
/// else the store's, read a page at a time. A report folds what it needs
/// as the jobs pass, so it holds one page and its sums, never every job
/// (an admin's report held about 370 MiB per 100,000 jobs).
///
/// # Errors
/// On a store error or a record that does not parse.
pub async fn each_job(
    shared: &Shared,
    team: Option<&str>,
    mut f: impl FnMut(JobRec),
) -> Result<(), ServerError> {
    let live: Vec<JobRec> = {
        let world = shared.world.lock().await;
        world
            .jobs()
            .values()
            .filter(|j| team.is_none_or(|t| j.team == t))
            .map(|j| JobRec::clone(j))
            .collect()
    };
    let in_memory: std::collections::BTreeSet<u64> = live.iter().map(|j| j.id).collect();
    let mut after: Option<String> = None;
    loop {
        let page = shared
            .store
            .load_page(gpuflow_store::Table::Jobs, team, after.as_deref(), JOB_PAGE)
            .await?;
        let whole = page.len() == JOB_PAGE as usize;
        let Some(last) = page.last() else { break };
        after = Some(last.key.clone());
        for r in page {
            let j: JobRec = serde_json::from_str(&r.doc).map_err(|e| ServerError::Corrupt {
                what: format!("job {}", r.key),
                message: e.to_string(),
            })?;
            if !in_memory.contains(&j.id) {
                f(j);
            }
        }
        if !whole {
            break;
        }
    }
    live.into_iter().for_each(f);
    Ok(())
}

impl Shared {
    /// The state to change: the writers' turn, then the state lock.
    pub async fn write(&self) -> Writing<'_> {
        let turn = self.writes.lock().await;
        let world = self.world.lock().await;
        Writing {
            shared: self,
            _turn: turn,
            world,
        }
    }
}

/// A writer's hold on the state ([`Shared::write`]): reads and changes it
/// as a `World`, and stores a change with [`Writing::commit`].
pub struct Writing<'a> {
    shared: &'a Shared,
    _turn: tokio::sync::MutexGuard<'a, ()>,
    world: tokio::sync::MutexGuard<'a, World>,
}

impl std::ops::Deref for Writing<'_> {
    type Target = World;
    fn deref(&self) -> &World {
        &self.world
    }
}

impl std::ops::DerefMut for Writing<'_> {
    fn deref_mut(&mut self) -> &mut World {
        &mut self.world
    }
}

impl<'a> Writing<'a> {
    /// Stores a change, then applies it to the state, and holds the state
    /// again. The state lock is let go while the store writes, so readers
    /// (and submissions, which only add jobs of ids they took) go on; no
    /// other writer runs until this one is done. On a store error nothing
    /// changes in memory either, and the hold is let go.
    ///
    /// # Errors
    /// On a store error.
    pub async fn commit(self, change: Change) -> Result<Writing<'a>, ServerError> {
        let Writing {
            shared,
            _turn: turn,
            mut world,
        } = self;
        if !change.is_empty() {
            // Ids of jobs the change makes are taken before others may
            // submit meanwhile.
            if let Some(&last) = change.jobs.keys().next_back() {
                world.next_job = world.next_job.max(last);
            }
            let (batch, memory) = records(change);
            let started = std::time::Instant::now();
            drop(world);
            let stored = shared.store.commit(&batch).await;
            world = shared.world.lock().await;
            world.stats.commit.observe(started.elapsed().as_secs_f64());
            stored?;
            publish(&mut world, memory, &batch.events);
        }
        Ok(Writing {
            shared,
            _turn: turn,
            world,
        })
    }
}

/// What a stored change puts in memory.
pub(crate) struct Memory {
    pub(crate) jobs: BTreeMap<u64, Box<JobRec>>,
    nodes: Vec<NodeRec>,
    records: Vec<Rec>,
    gone: Vec<Gone>,
}

/// A change as the store takes it (its records added to the batch's puts
/// and deletes), and what [`publish`] puts in memory once it is stored.
pub(crate) fn records(change: Change) -> (Batch, Memory) {
    let Change {
        jobs,
        nodes,
        records,
        gone,
        mut batch,
    } = change;
    batch.put.extend(jobs.values().map(|j| j.record()));
    batch.put.extend(nodes.values().map(NodeRec::record));
    batch.put.extend(records.iter().map(Rec::record));
    batch.delete.extend(gone.iter().map(Gone::key));
    let memory = Memory {
        jobs,
        nodes: nodes.into_values().collect(),
        records,
        gone,
    };
    (batch, memory)
}

/// Applies a stored change to the shared state.
pub(crate) fn publish(world: &mut World, memory: Memory, events: &[NewEvent]) {
    let Memory {
        jobs,
        nodes,
        records,
        gone,
    } = memory;
    for g in gone {
        g.publish(world);
    }
    for r in records {
        r.publish(world);
    }
    for j in jobs.into_values() {
        world.why.remove(&j.id);
        world.storing.remove(&j.id);
        // Jobs made by the server itself (a service's replicas) take ids
        // after the last one.
        world.next_job = world.next_job.max(j.id);
        world.put_job(j);
    }
    for n in nodes {
        world.put_node(n);
    }
    world.notify(events);
}

/// A started server.
pub struct Running {
    pub addr: SocketAddr,
    /// `http` or `https`.
    pub scheme: &'static str,
    /// The admin token, when this start created the installation.
    pub new_admin_token: Option<String>,
    /// The agents' join token, when it is known (generated or configured).
    pub join_token: Option<String>,
    pub shared: Arc<Shared>,
}

impl Running {
    /// Returns once this server has lost its leadership lease (never when
    /// it has none): it must stop, as its writes are refused.
    pub async fn deposed(&self) {
        match &self.shared.lease {
            Some(lease) => loop {
                let woken = lease.lost_notify.notified();
                if lease.lost() {
                    return;
                }
                woken.await;
            },
            None => std::future::pending().await,
        }
    }

    /// Hands the lease on at a clean stop, so that a standby takes over
    /// at once instead of after the lease's term.
    pub async fn release(&self) {
        if let Some(lease) = &self.shared.lease
            && let Err(e) = self.shared.store.release_lease(lease.token).await
        {
            tracing::warn!(error = %e, "cannot hand the lease on; a standby takes over when it lapses");
        }
    }
}

/// The state a server runs on, before it listens.
pub struct Opened {
    pub shared: Arc<Shared>,
    /// The admin token, when this start created the installation.
    pub new_admin_token: Option<String>,
    /// The agents' join token, when it is known (generated or configured).
    pub join_token: Option<String>,
}

/// Opens the store, loads the state and bootstraps a new installation; binds
/// nothing and starts nothing (tests drive the router and cycles themselves).
///
/// # Errors
/// On a store that does not open or a data directory that cannot be written.
pub async fn open(cfg: Config) -> anyhow::Result<Opened> {
    open_with(cfg, |_| {}).await
}

/// [`open`], telling `standby` who leads each time that changes while this
/// server waits for the lease (with [`Config::lease_ttl_s`]).
///
/// # Errors
/// As [`open`].
pub async fn open_with(
    cfg: Config,
    standby: impl Fn(&gpuflow_store::Leader),
) -> anyhow::Result<Opened> {
    use anyhow::Context;
    // The database, its WAL (job environments) and the token files are the
    // server's alone: files it creates are 0600, the directory 0700, and
    // files an older version left readable are closed.
    // SAFETY: umask has no preconditions.
    unsafe { libc::umask(0o077) };
    std::fs::create_dir_all(&cfg.data_dir).with_context(|| {
        format!(
            "cannot create the data directory {}",
            cfg.data_dir.display()
        )
    })?;
    restrict(&cfg.data_dir, 0o700)?;
    // One server per data directory: a second one would schedule the same
    // jobs again and its agent would adopt the first one's tasks.
    let lock_path = cfg.data_dir.join("lock");
    let lock = std::fs::OpenOptions::new()
        .create(true)
        .truncate(false)
        .write(true)
        .open(&lock_path)
        .with_context(|| format!("cannot open {}", lock_path.display()))?;
    match lock.try_lock() {
        Ok(()) => {}
        Err(std::fs::TryLockError::WouldBlock) => anyhow::bail!(
            "another gpuflow server is running on the data directory {} (it holds {}); stop it first, or give this one its own --data-dir",
            cfg.data_dir.display(),
            lock_path.display()
        ),
        Err(std::fs::TryLockError::Error(e)) => {
            return Err(e).with_context(|| format!("cannot lock {}", lock_path.display()));
        }
    }
    for f in [
        "gpuflow.db",
        "gpuflow.db-wal",
        "gpuflow.db-shm",
        "admin.token",
        "join.token",
    ] {
        let p = cfg.data_dir.join(f);
        if p.exists() {
            restrict(&p, 0o600)?;
        }
    }
    let url = cfg
        .store_url
        .clone()
        .unwrap_or_else(|| format!("sqlite://{}", cfg.data_dir.join("gpuflow.db").display()));
    let store = gpuflow_store::open(&url)
        .await
        .with_context(|| format!("cannot open the store {}", redact(&url)))?;
    // A standby waits here, before it reads anything, until the leader's
    // lease lapses; from then on its commits carry its token.
    let lease = match cfg.lease_ttl_s {
        Some(ttl) => {
            let addr = cfg
                .advertise
                .clone()
                .unwrap_or_else(|| cfg.listen.to_string());
            Some(Arc::new(
                leader::acquire(
                    store.as_ref(),
                    &leader::holder_name(),
                    &addr,
                    ttl.max(1),
                    standby,
                )
                .await,
            ))
        }
        None => None,
    };
    let mut world = World::load(store.as_ref())
        .await
        .context("cannot load the state")?;
    let (new_admin_token, join_token) =
        http::auth::bootstrap(store.as_ref(), &mut world, &cfg).await?;
    world.prune_finished(cfg.clock.now(), cfg.keep_finished_s);
    // Heartbeats missed while the server was down say nothing about the
    // nodes: every node gets a full timeout to report in again.
    world.wait_for_heartbeats(cfg.clock.now());
    let rates = ratelimit::RateLimits::new(cfg.rate_per_token, cfg.rate_anonymous);
    let oidc = Arc::new(oidc::Oidc::new(&cfg.oidc));
    let shared = Arc::new(Shared {
        world: Mutex::new(world),
        writes: Mutex::new(()),
        store,
        cfg,
        wake: Notify::new(),
        cycle_failures: Default::default(),
        diagnoses: tokio::sync::Semaphore::new(1),
        reports: tokio::sync::Semaphore::new(2),
        metrics: Mutex::new(None),
        rates,
        applier: Mutex::new(snapshot::Reuse::default()),
        data_lock: lock,
        sessions: Default::default(),
        oidc,
        submissions: Default::default(),
        beats: Default::default(),
        lease,
    });
    groupcommit::GroupCommit::start(&shared);
    http::agent::start_beats(&shared);
    Ok(Opened {
        shared,
        new_admin_token,
        join_token,
    })
}

/// Opens the state, binds the listener and starts the HTTP server and the
/// scheduling loop on the current tokio runtime.
///
/// # Errors
/// As [`open`], and on an address that cannot be bound.
pub async fn start(cfg: Config) -> anyhow::Result<Running> {
    use anyhow::Context;
    let listen = cfg.listen;
    let tls = cfg.tls.clone();
    let listener = std::net::TcpListener::bind(listen)
        .with_context(|| format!("cannot listen on {listen}"))?;
    listener.set_nonblocking(true)?;
    let addr = listener.local_addr()?;
    // The listener's defences (listen.rs): a bound on connections within
    // the open-file limit, header and idle timeouts.
    let nofile = listen::raise_nofile();
    let most = listen::max_connections(nofile);
    tracing::info!(nofile, max_connections = most, "connection limits");
    // A standby answers every request with who leads until it leads.
    let standby = match cfg.lease_ttl_s {
        Some(_) => {
            let (seen, watch) = tokio::sync::watch::channel(None);
            let handle = axum_server::Handle::new();
            let task = serve(
                listener.try_clone()?,
                leader::standby_router(watch, tls.is_some()),
                tls.as_ref(),
                most,
                handle.clone(),
            )
            .await?;
            Some((seen, handle, task))
        }
        None => None,
    };
    let opened = open_with(cfg, |l| {
        if let Some((seen, ..)) = &standby {
            seen.send_replace(Some(l.clone()));
        }
    })
    .await?;
    if let Some((_, handle, task)) = standby {
        handle.shutdown();
        let _ = task.1.await;
    }
    let shared = opened.shared;
    let app = http::router(shared.clone());
    let (scheme, _) = serve(
        listener,
        app,
        tls.as_ref(),
        most,
        axum_server::Handle::new(),
    )
    .await?;
    if let Some(lease) = &shared.lease {
        tokio::spawn(leader::keep(shared.store.clone(), lease.clone()));
    }
    tokio::spawn(cycle::run_loop(shared.clone()));
    tokio::spawn(accounting::budget_loop(shared.clone()));
    tokio::spawn(webhooks::run_loop(shared.clone()));
    {
        // Callers that went quiet leave the rate limiters.
        let shared = shared.clone();
        tokio::spawn(async move {
            loop {
                tokio::time::sleep(Duration::from_secs(60)).await;
                shared.rates.tidy();
            }
        });
    }
    tracing::info!(%addr, scheme, store = shared.store.backend(), "gpuflow server listening");
    Ok(Running {
        addr,
        scheme,
        new_admin_token: opened.new_admin_token,
        join_token: opened.join_token,
        shared,
    })
}

/// Serves `app` on `listener` (HTTPS with `tls`: certificate and key
/// files) with the listener's timeouts and at most `most` connections, until
/// `handle` shuts it down: the scheme and the serving task.
async fn serve(
    listener: std::net::TcpListener,
    app: axum::Router,
    tls: Option<&(PathBuf, PathBuf)>,
    most: usize,
    handle: axum_server::Handle<SocketAddr>,
) -> anyhow::Result<(&'static str, tokio::task::JoinHandle<()>)> {
    use anyhow::Context;
    // Serves with the listener's timeouts (a macro: the two servers'
    // acceptors are of different types).
    macro_rules! serve {
        ($server:expr, $scheme:literal) => {{
            let mut server = $server.handle(handle);
            server
                .http_builder()
                .http1()
                .header_read_timeout(Some(listen::HEADER_TIMEOUT));
            let server = server.first_request_timeout(listen::HEADER_TIMEOUT);
            let task = tokio::spawn(async move {
                let app = app.into_make_service_with_connect_info::<SocketAddr>();
                if let Err(e) = server.serve(app).await {
                    tracing::error!(error = %e, "{} server stopped", $scheme);
                }
            });
            ($scheme, task)
        }};
    }
    Ok(match tls {
        None => serve!(
            axum_server::from_tcp(listener)?.map(|a| listen::Limited::new(a, most)),
            "http"
        ),
        Some((cert, key)) => {
            // One crypto provider for the whole process (ring, as kube and sqlx use).
            let _ = rustls::crypto::ring::default_provider().install_default();
            let config = axum_server::tls_rustls::RustlsConfig::from_pem_file(cert, key)
                .await
                .with_context(|| {
                    format!(
                        "cannot load the TLS certificate {} or key {}",
                        cert.display(),
                        key.display()
                    )
                })?;
            serve!(
                axum_server::from_tcp(listener)?.map(|a| {
                    axum_server::tls_rustls::RustlsAcceptor::new(config)
                        .acceptor(listen::Limited::new(a, most))
                }),
                "https"
            )
        }
    })
}

fn restrict(path: &std::path::Path, mode: u32) -> anyhow::Result<()> {
    use anyhow::Context;
    use std::os::unix::fs::PermissionsExt;
    std::fs::set_permissions(path, std::fs::Permissions::from_mode(mode))
        .with_context(|| format!("cannot restrict the permissions of {}", path.display()))
}

/// A database URL without its password, for messages.
fn redact(url: &str) -> String {
    match (url.find("://"), url.rfind('@')) {
        (Some(s), Some(at)) if at > s => format!("{}://…{}", &url[..s], &url[at..]),
        _ => url.to_string(),
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn team(name: &str) -> gpuflow_api::Team {
        serde_json::from_value(serde_json::json!({"name": name})).unwrap()
    }

    /// A change's records go to the store's batch first and reach memory
    /// only through `publish`, in the order they were put.
    #[test]
    fn a_change_is_stored_then_published() {
        let mut world = World::default();
        world.put_record(Rec::Team(team("old")));
        world.put_record(Rec::Queue(
            serde_json::from_value(serde_json::json!({"name": "q", "team": "old"})).unwrap(),
        ));
        let mut change = Change::default();
        let mut first = team("ml");
        first.uid = 1;
        change.put(Rec::Team(first));
        let mut second = team("ml");
        second.uid = 2;
        change.put(Rec::Team(second));
        change.remove(Gone::Queue("q".into()));
        assert!(!change.is_empty());
        let (batch, memory) = records(change);
        let keys: Vec<(gpuflow_store::Table, &str)> = batch
            .put
            .iter()
            .map(|r| (r.table, r.key.as_str()))
            .collect();
        assert_eq!(
            keys,
            [
                (gpuflow_store::Table::Teams, "ml"),
                (gpuflow_store::Table::Teams, "ml")
            ]
        );
        assert_eq!(
            batch.delete,
            [(gpuflow_store::Table::Queues, "q".to_string())]
        );
        assert!(
            !world.records().teams.contains_key("ml") && world.records().queues.contains_key("q")
        );
        publish(&mut world, memory, &batch.events);
        assert_eq!(world.records().teams["ml"].uid, 2, "the last put wins");
        assert!(!world.records().queues.contains_key("q"));
        assert!(world.records().teams.contains_key("old"));
    }
}
