//! The server side of the agent protocol. An agent registers with the join
//! token and gets a node token; then it heartbeats its inventory and the
//! state of its tasks, and gets back the full list of tasks the server wants
//! on the node (level-triggered: a lost reply is repaired by the next one).
//!
//! Reports are matched to the job's current attempt; reports of an older
//! attempt (a run that was requeued meanwhile) are ignored, and the agent
//! stops such tasks because they are no longer in its desired list.

use std::collections::{BTreeMap, HashSet};
use std::sync::{Arc, Weak};

use axum::Json;
use axum::body::Bytes;
use axum::extract::State;
use axum::http::HeaderMap;
use gpuflow_api::{
    self as api, ApiError, Desired, DesiredTask, Heartbeat, JobState, Register, Registered,
    StopOrder, TaskReport,
};
use gpuflow_core::cluster::{MAX_GPUS_PER_NODE, MAX_MIG_INSTANCES};

use tokio::sync::oneshot;

use crate::event::EventKind;
use crate::groupcommit::{Receiver, group};
use crate::http::{Error, parse_json};
use crate::secret::{hash, new_token};
use crate::state::World;
use crate::{Change, Shared};

fn token(headers: &HeaderMap) -> Result<String, Error> {
    crate::http::auth::bearer(headers)
        .map(str::to_string)
        .ok_or_else(|| {
            ApiError::new(
                401,
                "unauthenticated",
                "missing token: agents send `Authorization: Bearer <token>`",
            )
            .into()
        })
}

fn check_inventory(inv: &api::Inventory) -> Result<(), ApiError> {
    if inv.gpus.len() > MAX_GPUS_PER_NODE {
        return Err(ApiError::bad_request(
            "invalid_inventory",
            format!("inventory.gpus: at most {MAX_GPUS_PER_NODE} GPUs per node"),
        ));
    }
    if inv.cpu_milli == 0 || inv.memory_mib == 0 {
        return Err(ApiError::bad_request(
            "invalid_inventory",
            "inventory: cpu_milli and memory_mib must be positive",
        ));
    }
    // Bounds no real machine reaches: a node that claims more lies, and
    // would make every list of nodes huge or every sum overflow.
    let bad = |what: String| Err(ApiError::bad_request("invalid_inventory", what));
    if inv.cpu_milli > MAX_CPU_MILLI || inv.memory_mib > MAX_MEMORY_MIB {
        return bad(format!(
            "inventory: at most {MAX_CPU_MILLI} milli-CPUs and {MAX_MEMORY_MIB} MiB of memory per node"
        ));
    }
    if inv.labels.len() > MAX_LABELS {
        return bad(format!("inventory.labels: at most {MAX_LABELS} labels"));
    }
    let long = |s: &str| s.len() > MAX_TEXT;
    if inv.labels.iter().any(|(k, v)| long(k) || long(v))
        || long(&inv.address)
        || long(&inv.pool)
        || long(&inv.limits.note)
        || inv.limits.controllers.len() > 16
        || inv.limits.controllers.iter().any(|c| long(c))
    {
        return bad(format!(
            "inventory: labels, address, pool and limits hold at most {MAX_TEXT} bytes each"
        ));
    }
    for g in &inv.gpus {
        if long(&g.uuid) || long(&g.model) || g.unhealthy.as_deref().is_some_and(long) {
            return bad(format!(
                "inventory.gpus[{}]: uuid, model and health hold at most {MAX_TEXT} bytes each",
                g.index
            ));
        }
        if g.memory_mib > MAX_GPU_MEMORY_MIB
            || g.mig.len() > MAX_MIG_INSTANCES
            || g.nvlink.len() > MAX_GPUS_PER_NODE
        {
            return bad(format!(
                "inventory.gpus[{}]: at most {MAX_GPU_MEMORY_MIB} MiB, {MAX_MIG_INSTANCES} MIG instances and {MAX_GPUS_PER_NODE} NVLink peers",
                g.index
            ));
        }
        if g.mig
            .iter()
            .any(|m| long(&m.uuid) || long(&m.profile) || m.memory_mib > g.memory_mib)
        {
            return bad(format!(
                "inventory.gpus[{}].mig: uuid and profile hold at most {MAX_TEXT} bytes, and no instance has more memory than its GPU",
                g.index
            ));
        }
    }
    // Allocations follow GPUs and MIG instances by UUID: one UUID for two
    // devices would put two jobs' tasks on one device.
    let mut seen = std::collections::BTreeSet::new();
    for g in &inv.gpus {
        for uuid in std::iter::once(&g.uuid).chain(g.mig.iter().map(|m| &m.uuid)) {
            if !seen.insert(uuid.as_str()) {
                return bad(format!(
                    "inventory.gpus[{}]: UUID {uuid:?} names two devices; each GPU and MIG instance needs its own",
                    g.index
                ));
            }
        }
    }
    Ok(())
}

/// The most a node may claim: 64,000 CPUs, 64 TiB of memory, 1 TiB per GPU.
const MAX_CPU_MILLI: u64 = 64_000_000;
const MAX_MEMORY_MIB: u64 = 64 << 20;
const MAX_GPU_MEMORY_MIB: u64 = 1 << 20;
/// The most labels, and the longest text field, of an inventory.
const MAX_LABELS: usize = 64;
const MAX_TEXT: usize = 256;

/// Reads a request's body once its sender is known to be trusted: tokens
/// are checked before a byte of the body is read.
async fn read_body(body: axum::body::Body, limit: usize) -> Result<Bytes, Error> {
    axum::body::to_bytes(body, limit).await.map_err(|_| {
        ApiError::new(
            413,
            "too_large",
            format!("the body is larger than {limit} bytes or was cut off"),
        )
        .into()
    })
}

/// The largest agent message (a heartbeat carries every task of a node).
const AGENT_BODY_LIMIT: usize = 16 << 20;

/// `POST /v1/agent/register`: the join token in, a node token out.
///
/// A node name belongs to the agent that first registered it: registering
/// it again needs the node token that agent was given (kept in its work
/// directory), or an admin's `gpuflow node replace NAME` first.
pub async fn register(
    State(shared): State<Arc<Shared>>,
    request: axum::extract::Request,
) -> Result<Json<Registered>, Error> {
    let t = token(request.headers())?;
    {
        let world = shared.world.lock().await;
        if world.join_hash.is_empty() || hash(&t) != world.join_hash {
            return Err(
                ApiError::new(401, "unauthenticated", "the join token is not valid").into(),
            );
        }
    }
    let body = read_body(request.into_body(), AGENT_BODY_LIMIT).await?;
    let req: Register = parse_json(&body)?;
    crate::http::check_name("node", &req.node, "node name")?;
    check_inventory(&req.inventory)?;
    let mut world = shared.write().await;
    let at = shared.now();
    let node_token = new_token("gfn");
    let mut change = Change::default();
    let node = match world.nodes().get(&req.node) {
        Some(n) => {
            let proven = req
                .node_token
                .as_deref()
                .is_some_and(|old| hash(old) == n.token_hash);
            if !proven && !n.token_hash.is_empty() {
                return Err(ApiError::conflict(format!(
                    "node {:?} is registered by another agent; if this machine replaces it, an admin runs `gpuflow node replace {}` first",
                    n.name, n.name
                ))
                .into());
            }
            let mut n = n.clone();
            let (kind, said) = crate::nodes::registered_again(
                &mut n,
                req.inventory.clone(),
                hash(&node_token),
                at,
            );
            change.event(at, None, "", kind, said);
            n
        }
        None => {
            let (n, (kind, said)) =
                crate::nodes::joined(&req.node, req.inventory.clone(), hash(&node_token), at);
            change.event(at, None, "", kind, said);
            n
        }
    };
    change.audit(
        at,
        &format!("node:{}", node.name),
        "node.register",
        &format!("node/{}", node.name),
        "",
    );
    change.nodes.insert(node.name.clone(), node);
    world = world.commit(change).await?;
    shared.wake.notify_one();
    Ok(Json(Registered {
        node_token,
        heartbeat_s: shared.cfg.heartbeat_s,
        lease_s: shared.cfg.node_timeout_s,
        installation: world.installation.id.clone(),
        uid_block: world.installation.uid_block,
    }))
}

/// `POST /v1/agent/heartbeat`: reports in, the desired tasks out. The node
/// token names the node; a heartbeat about another node is refused.
pub async fn heartbeat(
    State(shared): State<Arc<Shared>>,
    request: axum::extract::Request,
) -> Result<Json<Desired>, Error> {
    let t = token(request.headers())?;
    let token_hash = hash(&t);
    let name = {
        let world = shared.world.lock().await;
        world.node_of_token(&token_hash).map(str::to_string)
    };
    let Some(name) = name else {
        return Err(not_registered());
    };
    let body = read_body(request.into_body(), AGENT_BODY_LIMIT).await?;
    let hb: Heartbeat = parse_json(&body)?;
    check_inventory(&hb.inventory)?;
    if hb.node != name {
        return Err(ApiError::forbidden(format!(
            "node: this token belongs to node {name:?}, not {:?}",
            hb.node
        ))
        .into());
    }
    let (done, answer) = oneshot::channel();
    let beat = Beat {
        name,
        token_hash,
        hb,
        done,
    };
    if shared.beats.send(beat).is_err() {
        return Err(crate::ServerError::Stopping.into());
    }
    match answer.await {
        Ok(reply) => reply.map(Json),
        Err(_) => Err(crate::ServerError::Stopping.into()),
    }
}

fn not_registered() -> Error {
    ApiError::new(
        401,
        "unauthenticated",
        "the node token is not valid: register again",
    )
    .into()
}

/// The most heartbeats folded into one transaction.
const MAX_BEATS: usize = 1024;

/// A heartbeat that passed its checks, waiting to be folded in.
pub struct Beat {
    name: String,
    token_hash: String,
    hb: Heartbeat,
    done: oneshot::Sender<Result<Desired, Error>>,
}

/// Starts the task that folds heartbeats in ([`serve_beats`]).
pub fn start_beats(shared: &Arc<Shared>) {
    shared.beats.serve(shared, "heartbeats", serve_beats);
}

/// Folds queued heartbeats in, many to a transaction: with the state lock
/// held, each heartbeat's change is made against what is stored, the
/// changes are committed together (one disk flush for all, where each
/// had its own), then published, and each agent gets its desired tasks.
/// A heartbeat that touches a node or a job that an earlier one of the
/// group changes waits for the next group, so that it reads the stored
/// result (two nodes of one gang, an agent that sent twice).
async fn serve_beats(shared: Weak<Shared>, queue: Receiver<Beat>) {
    let mut rx = queue.lock().await;
    let mut later: Vec<Beat> = Vec::new();
    loop {
        let beats = if later.is_empty() {
            let Some(first) = rx.recv().await else {
                return;
            };
            group(&mut rx, first, MAX_BEATS)
        } else {
            std::mem::take(&mut later)
        };
        let Some(shared) = shared.upgrade() else {
            return;
        };
        let mut world = shared.write().await;
        let at = shared.now();
        let mut all = Change::default();
        let (mut nodes, mut jobs) = (HashSet::new(), HashSet::new());
        let mut folded = Vec::with_capacity(beats.len());
        let mut changed_jobs = false;
        for beat in beats {
            let touched: Vec<u64> = world
                .jobs_on(&beat.name)
                .map(|j| j.id)
                .chain(beat.hb.tasks.iter().map(|t| t.job))
                .collect();
            if nodes.contains(&beat.name) || touched.iter().any(|j| jobs.contains(j)) {
                later.push(beat);
                continue;
            }
            match fold(&shared, &mut world, &beat, at) {
                Ok((change, changed)) => {
                    nodes.insert(beat.name.clone());
                    jobs.extend(touched);
                    all.merge(change);
                    changed_jobs |= changed;
                    folded.push(beat);
                }
                Err(e) => {
                    let _ = beat.done.send(Err(e));
                }
            }
        }
        let stored = world.commit(all).await;
        if let Err(e) = &stored {
            tracing::error!(error = ?e, beats = folded.len(), "heartbeats were not stored");
        }
        for beat in folded {
            let reply = match &stored {
                Ok(world) => Ok(reply(&shared, world, &beat.name, at)),
                Err(_) => Err(ApiError::new(
                    500,
                    "internal",
                    "internal error; the server log has the details",
                )
                .into()),
            };
            // An agent that went away no longer waits.
            let _ = beat.done.send(reply);
        }
        drop(stored);
        if changed_jobs {
            shared.wake.notify_one();
        }
    }
}

/// One heartbeat's change against `world`, and whether a job changed
/// state. Only the node's liveness is written to memory at once (it is
/// not stored every time).
fn fold(shared: &Shared, world: &mut World, beat: &Beat, at: u64) -> Result<(Change, bool), Error> {
    let (name, hb) = (&beat.name, &beat.hb);
    let Some(node) = world.nodes().get(name).cloned() else {
        return Err(not_registered());
    };
    if beat.token_hash != node.token_hash {
        return Err(not_registered());
    }
    let mut change = Change::default();
    let mut n = node;
    if let Some((kind, said)) = crate::nodes::heard(&mut n) {
        change.event(at, None, "", kind, said);
    }
    let inventory_changed = n.inventory != hb.inventory;
    // GPUs that turned unhealthy, or healthy again: events.
    for g in &hb.inventory.gpus {
        let before = n
            .inventory
            .gpus
            .iter()
            .find(|o| o.uuid == g.uuid)
            .and_then(|o| o.unhealthy.clone());
        match (&before, &g.unhealthy) {
            (None, Some(why)) => change.event(
                at,
                None,
                "",
                EventKind::GpuUnhealthy,
                format!(
                    "GPU {} ({}) of node {name} takes no work and its jobs are requeued: {why}",
                    g.index, g.uuid
                ),
            ),
            (Some(_), None) => change.event(
                at,
                None,
                "",
                EventKind::GpuHealthy,
                format!(
                    "GPU {} ({}) of node {name} is healthy again",
                    g.index, g.uuid
                ),
            ),
            _ => {}
        }
    }
    // At most one sample per GPU of the inventory.
    let gpus_now: Vec<api::GpuSample> = hb
        .inventory
        .gpus
        .iter()
        .filter_map(|g| hb.gpus.iter().find(|s| s.uuid == g.uuid).cloned())
        .collect();
    n.gpus_now = gpus_now.clone();
    n.inventory = hb.inventory.clone();
    n.address = hb.inventory.address.clone();
    n.last_heartbeat = at;
    // Heartbeat times are not events; store the node only when something else
    // changed or every tenth of the timeout, to keep write load low.
    let stale = at >= world.nodes()[name].last_heartbeat + shared.cfg.node_timeout_s / 4;
    if inventory_changed || !change.batch.events.is_empty() || stale {
        change.nodes.insert(name.clone(), n);
    } else {
        world.heard_from(name, at, gpus_now);
    }
    let changed_jobs = apply_reports(
        world,
        name,
        &hb.tasks,
        (at, shared.cfg.job_log_bytes),
        &mut change,
    );
    Ok((change, changed_jobs))
}

/// What the agent of `node` is told after its heartbeat.
fn reply(shared: &Shared, world: &World, node: &str, at: u64) -> Desired {
    Desired {
        tasks: desired(world, node, at),
        heartbeat_s: shared.cfg.heartbeat_s,
        lease_s: shared.cfg.node_timeout_s,
        health_cleared_at: world.nodes().get(node).map_or(0, |n| n.health_cleared_at),
        sessions: shared.sessions.orders_for(node),
    }
}

/// Folds a node's task reports into its jobs, and their output (within
/// `log_limit` bytes a job) into the store's log. Returns whether a job
/// changed state.
fn apply_reports(
    world: &World,
    node: &str,
    reports: &[TaskReport],
    (at, log_limit): (u64, u64),
    change: &mut Change,
) -> bool {
    let mut by_job: BTreeMap<u64, Vec<&TaskReport>> = BTreeMap::new();
    for r in reports {
        by_job.entry(r.job).or_default().push(r);
    }
    let mut any = false;
    // Jobs with work on this node, and jobs the node reports.
    let mut ids: Vec<u64> = world.jobs_on(node).map(|j| j.id).collect();
    ids.extend(by_job.keys().copied());
    ids.sort_unstable();
    ids.dedup();
    for id in ids {
        let Some(j) = world.jobs().get(&id) else {
            continue;
        };
        let mine: Vec<&TaskReport> = by_job.get(&id).cloned().unwrap_or_default();
        let mut next = j.clone();
        // Output first, while the tasks are still placed (a task's last
        // output may come with the report that ends the job, or after).
        for r in &mine {
            let pieces = crate::output::take(&mut next, node, r, log_limit);
            change.batch.logs.extend(pieces);
        }
        if !j.state.allocated() {
            if next.log_marks != j.log_marks {
                change.job(next);
            }
            continue;
        }
        // Before the state moves: a job that ends keeps its tasks' views
        // as they were, digests included.
        for (kind, message) in crate::lifecycle::image_events(j, &mut next, &mine) {
            change.event(at, Some(j.id), &j.team, kind, message);
        }
        let kind = crate::lifecycle::report(&mut next, node, &mine, at);
        for (kind, message) in crate::lifecycle::breaches(j, &mine) {
            change.event(at, Some(j.id), &j.team, kind, message);
        }
        if (
            next.state,
            &next.tasks,
            next.last_checkpoint,
            &next.log_marks,
            &next.image_digests,
        ) != (
            j.state,
            &j.tasks,
            j.last_checkpoint,
            &j.log_marks,
            &j.image_digests,
        ) {
            if let Some(kind) = kind {
                change.event(at, Some(next.id), &next.team, kind, next.reason.clone());
                any = true;
            }
            change.job(next);
        }
    }
    any
}

/// `image` pinned to `digest` (`repo@sha256:…`, its tag dropped), once
/// an attempt pulled it.
fn pinned(image: &str, digest: Option<&String>) -> String {
    let Some(d) = digest else {
        return image.to_string();
    };
    let repo = image.split('@').next().unwrap_or(image);
    // A tag follows the last ':' after the last '/' (a ':' before it is
    // the registry's port).
    let repo = match repo.rsplit_once('/') {
        Some((host_path, last)) => match last.split_once(':') {
            Some((name, _)) => format!("{host_path}/{name}"),
            None => repo.to_string(),
        },
        None => repo.split(':').next().unwrap_or(repo).to_string(),
    };
    format!("{repo}@{d}")
}

/// What a task may use on its node: CPU and memory from its spec; for a
/// task sharing a GPU, the GPU memory it claimed (or its fraction of the
/// GPU's) and its share of the GPU's compute; its idle threshold when its
/// job has an idle policy.
fn limits(
    j: &crate::state::JobRec,
    g: &api::TaskGroupSpec,
    gpus: &[u32],
    node: Option<&crate::state::NodeRec>,
) -> api::TaskLimits {
    let mut l = api::TaskLimits {
        cpu_milli: (g.resources.cpu * 1000.0).round() as u64,
        memory_mib: g.resources.memory_mib,
        idle_below_pct: j
            .spec
            .idle
            .as_ref()
            .filter(|_| !gpus.is_empty())
            .map(|i| i.below_pct),
        ..api::TaskLimits::default()
    };
    if let Some(spec) = &g.resources.gpu
        && matches!(spec.mode, api::GpuMode::Fraction | api::GpuMode::TimeSlice)
    {
        let gpu_mib = gpus
            .first()
            .and_then(|&i| node?.inventory.gpus.iter().find(|x| x.index == i))
            .map_or(0, |x| x.memory_mib);
        l.gpu_memory_mib = spec
            .memory_mib
            .unwrap_or_else(|| gpu_mib * spec.milli() / 1000);
        l.gpu_percent = (spec.milli() / 10) as u32;
    }
    l
}

/// The tasks the server wants on a node, with their environment.
pub fn desired(world: &World, node: &str, at: u64) -> Vec<DesiredTask> {
    let mut out = Vec::new();
    for j in world.jobs_on(node) {
        let world_size = j.allocs.len();
        // Rank 0's node is the rendezvous for gangs (PyTorch's env:// init).
        let master = world.node_address(j.allocs.first().map_or("", |a| a.node.as_str()));
        let port = 20000 + (j.id % 20000);
        let mut local_rank = 0;
        for (rank, a) in j.allocs.iter().enumerate() {
            if a.node != node {
                continue;
            }
            let g = &j.spec.tasks[a.group as usize];
            let Some(inv) = world.nodes().get(node).map(|n| &n.inventory) else {
                continue;
            };
            // A GPU the node no longer reports: the cycle evicts the job;
            // nothing is started on whatever took its place.
            let Ok(pick) = a.current_pick(inv) else {
                continue;
            };
            let gpus = pick.gpus();
            // Real GPUs by UUID (stable whatever CUDA's enumeration order),
            // emulated ones by position.
            // A MIG instance by its own UUID, the only name CUDA knows it by.
            let is_mig = matches!(pick, crate::state::Pick::Mig { .. });
            let mig = if is_mig {
                crate::state::Alloc::uuids_of(&pick, inv)
            } else {
                Vec::new()
            };
            let list = if is_mig {
                mig.join(",")
            } else if inv.emulated || a.gpu_uuids.is_empty() {
                gpus.iter()
                    .map(u32::to_string)
                    .collect::<Vec<_>>()
                    .join(",")
            } else {
                a.gpu_uuids.join(",")
            };
            let mut env = g.env.clone();
            let mut set = |k: &str, v: String| {
                env.insert(k.to_string(), v);
            };
            set("CUDA_VISIBLE_DEVICES", list.clone());
            set(
                "NVIDIA_VISIBLE_DEVICES",
                if list.is_empty() { "void".into() } else { list },
            );
            set("CUDA_DEVICE_ORDER", "PCI_BUS_ID".into());
            set("GPUFLOW_JOB_ID", j.id.to_string());
            set("GPUFLOW_JOB_NAME", j.spec.name.clone());
            set("GPUFLOW_TASK_GROUP", g.name.clone());
            set("GPUFLOW_TASK_INDEX", a.index.to_string());
            set("GPUFLOW_ATTEMPT", j.attempts.to_string());
            set("RANK", rank.to_string());
            set("WORLD_SIZE", world_size.to_string());
            set("LOCAL_RANK", local_rank.to_string());
            set("MASTER_ADDR", master.clone());
            set("MASTER_PORT", port.to_string());
            if let Some(a) = &j.array {
                set("GPUFLOW_ARRAY_ID", a.id.to_string());
                set("GPUFLOW_ARRAY_INDEX", a.index.to_string());
            }
            if let Some(c) = j.last_checkpoint {
                // A requeued run resumes from here.
                set("GPUFLOW_LAST_CHECKPOINT", c.to_string());
            }
            if let Some(gs) = &g.resources.gpu
                && matches!(gs.mode, api::GpuMode::Fraction | api::GpuMode::TimeSlice)
            {
                set("GPUFLOW_GPU_MILLI", gs.milli().to_string());
                if let Some(m) = gs.memory_mib {
                    set("GPUFLOW_GPU_MEMORY_MIB", m.to_string());
                }
            }
            local_rank += 1;
            let mut command = g.command.clone();
            command.extend(g.args.iter().cloned());
            out.push(DesiredTask {
                limits: limits(j, g, &gpus, world.nodes().get(node)),
                stop_signal: j.spec.checkpoint.signal.clone(),
                run_as: world
                    .records()
                    .teams
                    .get(&j.team)
                    .and_then(|t| t.run_as.clone()),
                team_uid: world
                    .records()
                    .teams
                    .get(&j.team)
                    .map(|t| t.uid)
                    .filter(|&u| u > 0),
                job: j.id,
                attempt: j.attempts,
                group: a.group,
                index: a.index,
                name: format!("{}-{}-{}", j.spec.name, g.name, a.index),
                command,
                env,
                working_dir: g.working_dir.clone(),
                gpus,
                mig,
                stop: (j.state == JobState::Stopping).then(|| StopOrder {
                    signal: j.spec.checkpoint.signal.clone(),
                    grace_s: j.kill_at.unwrap_or(at).saturating_sub(at),
                }),
                // A service's replica serves on a port, checked for readiness.
                port: j.service.is_some(),
                ports: gpuflow_api::job::ports_of(j.spec.kind, g),
                image: g
                    .image
                    .as_ref()
                    .map(|i| pinned(i, j.image_digests.get(&a.group))),
                registry_auth: g.image.as_ref().and_then(|i| {
                    let (host, c) = world.records().teams.get(&j.team)?.credential_for(i)?;
                    Some((host, c.username.clone(), c.password.clone()))
                }),
                readiness: j.service.as_ref().and_then(|s| s.readiness.clone()),
            });
        }
    }
    out
}
