//! Nodes (list, drain, cordon, uncordon, replace), pools, and the GPUs
//! idle while work that fits them waits.

use super::*;
use crate::event::EventKind;

pub(super) fn router() -> ApiRouter {
    ApiRouter::new()
        .api_route("/v1/nodes", get_with(list_nodes, doc("any token", "Nodes, their GPUs and what is in use")))
        .api_route("/v1/nodes/{name}", get_with(get_node, doc("any token", "One node: its GPUs (MIG layout, health, holders), CPU and memory allocated, its jobs")))
        .api_route("/v1/nodes/{name}/{action}", post_with(node_action, doc("admin", "drain, cordon, uncordon, replace (release its name for a new machine; its work is requeued) or clear (forget its GPUs' health marks) a node")))
        .api_route("/v1/pools", get_with(pools, doc("any token", "Node pools and their GPUs")))
        .api_route("/v1/idle-waiting", get_with(idle_waiting, doc("any token", "GPUs free after the last cycle that waiting work could hold, quota aside, and their GPU-hours since the server started")))
}

/// GPUs free after the last cycle that waiting work could hold, quota
/// aside (the cluster's figure: no team's jobs are named).
#[derive(Serialize, schemars::JsonSchema)]
struct IdleWaiting {
    gpus: f64,
    /// As the last cycle found them, at this Unix time (0: no cycle yet).
    at: u64,
    /// Those GPUs over time since the server started.
    gpu_hours: f64,
}

async fn idle_waiting(State(shared): State<Arc<Shared>>, _caller: Caller) -> Reply<IdleWaiting> {
    let world = shared.world.lock().await;
    let st = &world.stats;
    Ok(Json(IdleWaiting {
        gpus: st.idle_waiting_gpus,
        at: st.idle_waiting_at,
        gpu_hours: st.idle_waiting_gpu_hours,
    }))
}

fn node_view(
    (world, at): (&World, u64),
    caller: &Caller,
    n: &crate::state::NodeRec,
    used: &BTreeMap<&str, Vec<u32>>,
    holders: &BTreeMap<String, Vec<api::GpuHolder>>,
) -> api::NodeView {
    let (mut cpu, mut mem, mut jobs, mut count) = (0, 0, Vec::new(), 0);
    for j in world.jobs_on(&n.name) {
        for a in j.allocs.iter().filter(|a| a.node == n.name) {
            cpu += a.cpu_milli;
            mem += a.mem_mib;
        }
        count += 1;
        if caller.sees(&j.team) {
            jobs.push(j.id);
        }
    }
    api::NodeView {
        name: n.name.clone(),
        state: n.state,
        inventory: n.inventory.clone(),
        gpus_in_use: used.get(n.name.as_str()).cloned().unwrap_or_default(),
        last_heartbeat: n.last_heartbeat,
        gpus_now: n.gpus_now.clone(),
        holders: holders.get(&n.name).cloned().unwrap_or_default(),
        cpu_allocated_milli: cpu,
        memory_allocated_mib: mem,
        jobs,
        job_count: count,
        reservations: world
            .records()
            .reservations
            .values()
            .filter(|r| r.end > at && r.nodes.contains(&n.name))
            .map(|r| {
                format!(
                    "{} ({}, {} to {})",
                    r.name,
                    if r.maintenance {
                        "maintenance"
                    } else {
                        "reserved"
                    },
                    crate::when(r.start),
                    crate::when(r.end)
                )
            })
            .collect(),
    }
}

async fn get_node(
    State(shared): State<Arc<Shared>>,
    caller: Caller,
    Path(name): Path<String>,
) -> Reply<api::NodeView> {
    let world = shared.world.lock().await;
    let Some(n) = world.nodes().get(&name) else {
        let names: Vec<&str> = world.nodes().keys().map(String::as_str).take(20).collect();
        return Err(ApiError::not_found(format!(
            "node {name:?} not found; nodes: {}",
            names.join(", ")
        ))
        .into());
    };
    let used = world.gpus_in_use();
    let holders = world.holders(|t| caller.sees(t));
    Ok(Json(node_view(
        (&world, shared.now()),
        &caller,
        n,
        &used,
        &holders,
    )))
}
async fn list_nodes(
    State(shared): State<Arc<Shared>>,
    caller: Caller,
    Params(page): Params<NamePage>,
) -> Reply<Vec<api::NodeView>> {
    let world = shared.world.lock().await;
    let used = world.gpus_in_use();
    let holders = world.holders(|t| caller.sees(t));
    Ok(Json(
        page.of(world.nodes())
            .take(page.limit.0)
            .map(|(_, n)| node_view((&world, shared.now()), &caller, n, &used, &holders))
            .collect(),
    ))
}
async fn node_action(
    State(shared): State<Arc<Shared>>,
    caller: Caller,
    Path((name, action)): Path<(String, String)>,
) -> Reply<api::NodeView> {
    caller.need_admin("changing a node")?;
    let mut world = shared.write().await;
    let Some(n) = world.nodes().get(&name) else {
        return Err(ApiError::not_found(format!("node {name:?} not found")).into());
    };
    let mut n = n.clone();
    let at = shared.now();
    let mut change = Change::default();
    if action == "clear" {
        // Its GPUs' health marks (XID errors, ECC counts) are forgotten:
        // the agent learns it with its next heartbeat.
        n.health_cleared_at = at;
        change.event(
            at,
            None,
            "",
            EventKind::NodeClear,
            format!(
                "the GPU health marks of node {name} were cleared by {}",
                caller.user.name
            ),
        );
    } else if action == "replace" {
        // The machine behind the name is gone: its token no longer works,
        // its work is requeued as for a lost node, and the next agent that
        // registers the name with the join token takes it.
        let (kind, said) = crate::nodes::released(&mut n, &caller.user.name);
        change.event(at, None, "", kind, said);
    } else {
        let state = match action.as_str() {
            "drain" => NodeState::Draining,
            "cordon" => NodeState::Cordoned,
            "uncordon" => NodeState::Ready,
            other => {
                return Err(ApiError::not_found(format!(
                    "no node action {other:?}; actions: drain, cordon, uncordon, replace, clear"
                ))
                .into());
            }
        };
        let (kind, said) = crate::nodes::set_by_admin(&mut n, state, &caller.user.name);
        change.event(at, None, "", kind, said);
    }
    change.audit(
        at,
        &caller.user.name,
        &format!("node.{action}"),
        &format!("node/{name}"),
        "",
    );
    change.nodes.insert(name.clone(), n);
    world = world.commit(change).await?;
    let used = world.gpus_in_use();
    let holders = world.holders(|_| true);
    Ok(Json(node_view(
        (&world, shared.now()),
        &caller,
        &world.nodes()[&name],
        &used,
        &holders,
    )))
}
#[derive(Serialize, schemars::JsonSchema)]
struct Pool {
    name: String,
    nodes: usize,
    gpus: usize,
}
async fn pools(State(shared): State<Arc<Shared>>, _caller: Caller) -> Reply<Vec<Pool>> {
    let world = shared.world.lock().await;
    let mut pools: BTreeMap<String, Pool> = BTreeMap::new();
    for n in world.nodes().values() {
        let name = if n.inventory.pool.is_empty() {
            "default".to_string()
        } else {
            n.inventory.pool.clone()
        };
        let p = pools.entry(name.clone()).or_insert(Pool {
            name,
            nodes: 0,
            gpus: 0,
        });
        p.nodes += 1;
        p.gpus += n.inventory.gpus.len();
    }
    Ok(Json(pools.into_values().collect()))
}
