//! Queues: the tree, quotas, weights, states; team leads below their team's top-level queue.

use super::*;

pub(super) fn router() -> ApiRouter {
    ApiRouter::new()
        .api_route(
            "/v1/queues",
            get_with(
                list_queues,
                doc("any token (own team)", "Queues with quotas and usage"),
            )
            .post_with(
                create_queue,
                doc(
                    "admin; team lead for child queues of their team",
                    "Create a queue",
                ),
            ),
        )
        .api_route(
            "/v1/queues/{name}",
            patch_with(
                patch_queue,
                doc(
                    "admin; team lead of its team (not top-level quotas)",
                    "Change weight, state, user limits or quotas",
                ),
            )
            .delete_with(delete_queue, doc("admin", "Delete an empty queue")),
        )
}

async fn list_queues(
    State(shared): State<Arc<Shared>>,
    caller: Caller,
    Params(page): Params<NamePage>,
) -> Reply<Vec<api::QueueView>> {
    let world = shared.world.lock().await;
    let mut out: BTreeMap<&str, api::QueueView> = page
        .of(&world.records().queues)
        .filter(|(_, q)| caller.sees(&q.team))
        .take(page.limit.0)
        .map(|(name, q)| {
            (
                name.as_str(),
                api::QueueView {
                    spec: q.clone(),
                    used: BTreeMap::new(),
                    pending: 0,
                    running: 0,
                    budget_use: q.budget.as_ref().map(|b| {
                        crate::accounting::budget_use(b, world.budget_used.get(name), shared.now())
                    }),
                    borrowed: BTreeMap::new(),
                    borrowers: Vec::new(),
                },
            )
        })
        .collect();
    // One pass over the jobs: every queue's use per flavor (borrowers may
    // be any queue), and the page's counts.
    let mut used: BTreeMap<(&str, &str), f64> = BTreeMap::new();
    for j in world.jobs().values() {
        if j.state.allocated() {
            *used
                .entry((j.spec.queue.as_str(), j.flavor.as_str()))
                .or_default() += crate::convert::quota_milli(&j.spec) as f64 / 1000.0;
        }
        let Some(v) = out.get_mut(j.spec.queue.as_str()) else {
            continue;
        };
        if j.state == JobState::Pending {
            v.pending += 1;
        }
        if j.state.allocated() {
            v.running += 1;
            *v.used.entry(j.flavor.clone()).or_default() +=
                crate::convert::quota_milli(&j.spec) as f64 / 1000.0;
        }
    }
    let guaranteed = |queue: &str, flavor: &str| -> f64 {
        world.records().queues.get(queue).map_or(0.0, |q| {
            gpuflow_core::queue::quota_entry(&q.quotas, flavor).map_or(0.0, |x| x.guaranteed)
        })
    };
    let borrowing: Vec<api::Borrower> = used
        .iter()
        .filter_map(|(&(queue, flavor), &u)| {
            let over = u - guaranteed(queue, flavor);
            (over > 1e-9).then(|| api::Borrower {
                queue: queue.to_string(),
                team: world
                    .records()
                    .queues
                    .get(queue)
                    .map_or_else(String::new, |q| q.team.clone()),
                flavor: flavor.to_string(),
                gpus: over,
            })
        })
        .collect();
    for (name, v) in out.iter_mut() {
        for b in &borrowing {
            if b.queue == *name {
                v.borrowed.insert(b.flavor.clone(), b.gpus);
            } else {
                let mine = used
                    .get(&(*name, b.flavor.as_str()))
                    .copied()
                    .unwrap_or(0.0);
                if mine + 1e-9 < guaranteed(name, &b.flavor) {
                    v.borrowers.push(b.clone());
                }
            }
        }
    }
    Ok(Json(out.into_values().collect()))
}
/// What is doubtful about a queue's quotas on the registered cluster (not
/// refused: GPUs may still join): a flavor no node has, top-level
/// guarantees of a flavor beyond what the cluster has.
fn quota_warnings(world: &World, q: &QueueSpec) -> Vec<String> {
    if world.nodes().is_empty() {
        return vec![];
    }
    let mut have: BTreeMap<&str, f64> = BTreeMap::new();
    for n in world.nodes().values() {
        for g in &n.inventory.gpus {
            *have.entry(g.model.as_str()).or_default() += 1.0;
        }
    }
    let mut out = vec![];
    for flavor in q.quotas.keys().filter(|f| *f != "*") {
        // The models the entry applies to: its own, or its family's.
        let models: Vec<&str> = have
            .keys()
            .copied()
            .filter(|m| {
                gpuflow_core::queue::quota_key(&q.quotas, m).is_some_and(|(k, _)| k == flavor)
            })
            .collect();
        if models.is_empty() {
            out.push(format!(
                "quotas.{flavor}: no node has GPU model {flavor} yet; the cluster has {} (an entry also covers its family's models, {flavor}-*)",
                if have.is_empty() {
                    "no GPUs".to_string()
                } else {
                    have.keys().copied().collect::<Vec<_>>().join(", ")
                }
            ));
            continue;
        }
        if models != [flavor.as_str()] {
            out.push(format!(
                "quotas.{flavor}: applies to each model of the family on its own: {}",
                models.join(", ")
            ));
        }
        for m in models {
            let gpus = have[m];
            let guaranteed: f64 = world
                .records()
                .queues
                .values()
                .filter(|t| t.parent.is_none() && t.name != "default")
                .filter_map(|t| gpuflow_core::queue::quota_key(&t.quotas, m))
                .filter(|(k, _)| *k != "*")
                .map(|(_, t)| t.guaranteed)
                .sum();
            if guaranteed > gpus + 1e-9 {
                out.push(format!(
                    "quotas.{flavor}: top-level queues are guaranteed {guaranteed} {m} GPUs and the cluster has {gpus}; guarantees beyond it cannot all be met"
                ));
            }
        }
    }
    out
}

/// Team leads may shape their team's queues below an admin-made top queue:
/// children's guarantees must fit in their parent's.
fn check_lead_quotas(world: &World, q: &QueueSpec) -> Result<(), Error> {
    let Some(parent) = q
        .parent
        .as_deref()
        .and_then(|p| world.records().queues.get(p))
    else {
        return Err(
            ApiError::forbidden("only an admin sets the quotas of a top-level queue").into(),
        );
    };
    for (flavor, quota) in &q.quotas {
        let limit =
            gpuflow_core::queue::quota_entry(&parent.quotas, flavor).map_or(0.0, |p| p.guaranteed);
        let siblings: f64 = world
            .records()
            .queues
            .values()
            .filter(|s| s.parent == q.parent && s.name != q.name)
            .filter_map(|s| s.quotas.get(flavor))
            .map(|s| s.guaranteed)
            .sum();
        if quota.guaranteed + siblings > limit + 1e-9 {
            return Err(ApiError::forbidden(format!(
                "quotas.{flavor}.guaranteed: {} plus the siblings' {siblings} exceeds the parent's {limit}; ask an admin",
                quota.guaranteed
            ))
            .into());
        }
    }
    Ok(())
}
async fn create_queue(
    State(shared): State<Arc<Shared>>,
    caller: Caller,
    body: JsonBody<QueueSpec>,
) -> Result<Warned<Created<QueueSpec>>, Error> {
    let q: QueueSpec = body.read(shared.cfg.max_body_bytes)?;
    q.validate()?;
    let mut world = shared.write().await;
    if !caller.leads(&q.team) {
        return Err(ApiError::forbidden(format!(
            "creating a queue of team {:?} needs the admin role or that team's lead",
            q.team
        ))
        .into());
    }
    if !world.records().teams.contains_key(&q.team) {
        return Err(ApiError::bad_request(
            "unknown_team",
            format!("team: {:?} does not exist", q.team),
        )
        .into());
    }
    if world.records().queues.contains_key(&q.name) {
        return Err(ApiError::conflict(format!("queue {:?} already exists", q.name)).into());
    }
    if q.parent.is_none() && !caller.admin() {
        return Err(ApiError::forbidden(
            "only an admin creates top-level queues; team leads create queues under their team's queue (set parent)",
        )
        .into());
    }
    if q.budget.is_some() && !caller.admin() {
        return Err(ApiError::forbidden("only an admin sets a queue's budget").into());
    }
    if q.notebook_max_lifetime_s.is_some() && !caller.admin() {
        return Err(
            ApiError::forbidden("only an admin sets a queue's notebook_max_lifetime_s").into(),
        );
    }
    if q.notebook_idle.is_some() && !caller.admin() {
        return Err(
            ApiError::forbidden("only an admin sets a queue's notebook_idle policy").into(),
        );
    }
    if let Some(p) = &q.parent {
        let mut depth = 2;
        let mut up = world
            .records()
            .queues
            .get(p)
            .and_then(|q| q.parent.as_deref());
        while let Some(name) = up {
            depth += 1;
            up = world
                .records()
                .queues
                .get(name)
                .and_then(|q| q.parent.as_deref());
            if depth > api::MAX_QUEUE_DEPTH {
                break;
            }
        }
        if depth > api::MAX_QUEUE_DEPTH {
            return Err(ApiError::bad_request(
                "too_deep",
                format!(
                    "parent: a queue under {p:?} would be more than {} levels deep; attach it higher up",
                    api::MAX_QUEUE_DEPTH
                ),
            )
            .into());
        }
        match world.records().queues.get(p) {
            None => {
                return Err(ApiError::bad_request(
                    "unknown_queue",
                    format!("parent: queue {p:?} does not exist"),
                )
                .into());
            }
            Some(pq) if pq.team != q.team => {
                return Err(ApiError::bad_request(
                    "wrong_team",
                    format!("parent: queue {p:?} belongs to team {:?}", pq.team),
                )
                .into());
            }
            Some(_) => {}
        }
        if world
            .jobs()
            .values()
            .any(|j| &j.spec.queue == p && !j.state.finished())
        {
            return Err(ApiError::conflict(format!(
                "parent: queue {p:?} has unfinished jobs; a queue with jobs cannot get children"
            ))
            .into());
        }
    }
    if !caller.admin() {
        check_lead_quotas(&world, &q)?;
    }
    let at = shared.now();
    let mut change = Change::default();
    change.put(Rec::Queue(q.clone()));
    change.audit(
        at,
        &caller.user.name,
        "queue.create",
        &format!("queue/{}", q.name),
        serde_json::to_string(&q).unwrap_or_default(),
    );
    world = world.commit(change).await?;
    let warnings = quota_warnings(&world, &q);
    drop(world);
    shared.wake.notify_one();
    Ok(Warned(Created(q), warnings))
}
async fn patch_queue(
    State(shared): State<Arc<Shared>>,
    caller: Caller,
    Path(name): Path<String>,
    body: JsonBody<QueuePatch>,
) -> Result<Warned<Json<QueueSpec>>, Error> {
    let (p, body): (QueuePatch, _) = body.read_raw(shared.cfg.max_body_bytes)?;
    let mut world = shared.write().await;
    let Some(q) = world
        .records()
        .queues
        .get(&name)
        .filter(|q| caller.sees(&q.team))
    else {
        return Err(ApiError::not_found(format!("queue {name:?} not found")).into());
    };
    if !caller.leads(&q.team) {
        return Err(ApiError::forbidden(format!(
            "changing queue {name:?} needs the admin role or its team's lead"
        ))
        .into());
    }
    if q.parent.is_none() && !caller.admin() {
        // A team's top-level queue is what the admins granted it.
        return Err(ApiError::forbidden(format!(
            "queue {name:?} is a top-level queue: only an admin changes it; team leads change the queues below it"
        ))
        .into());
    }
    let mut q = q.clone();
    if let Some(w) = p.weight {
        q.weight = w;
    }
    if let Some(s) = p.state {
        q.state = s;
    }
    if let Some(l) = p.user_limits {
        q.user_limits = l;
    }
    if let Some(b) = p.budget {
        caller.need_admin("setting a queue's budget")?;
        q.budget = Some(b);
    }
    if let Some(l) = p.notebook_max_lifetime_s {
        caller.need_admin("setting a queue's notebook_max_lifetime_s")?;
        q.notebook_max_lifetime_s = Some(l);
    }
    if let Some(idle) = p.notebook_idle {
        caller.need_admin("setting a queue's notebook_idle policy")?;
        q.notebook_idle = Some(idle);
    }
    if let Some(quotas) = p.quotas {
        q.quotas = quotas;
        if !caller.admin() {
            check_lead_quotas(&world, &q)?;
        }
    }
    q.validate()?;
    let at = shared.now();
    let mut change = Change::default();
    change.put(Rec::Queue(q.clone()));
    change.audit(
        at,
        &caller.user.name,
        "queue.update",
        &format!("queue/{name}"),
        String::from_utf8_lossy(&body),
    );
    world = world.commit(change).await?;
    let warnings = quota_warnings(&world, &q);
    drop(world);
    shared.wake.notify_one();
    Ok(Warned(Json(q), warnings))
}
async fn delete_queue(
    State(shared): State<Arc<Shared>>,
    caller: Caller,
    Path(name): Path<String>,
) -> Result<axum::response::NoContent, Error> {
    caller.need_admin("deleting a queue")?;
    let world = shared.write().await;
    if !world.records().queues.contains_key(&name) {
        return Err(ApiError::not_found(format!("queue {name:?} not found")).into());
    }
    if world
        .records()
        .queues
        .values()
        .any(|q| q.parent.as_deref() == Some(name.as_str()))
    {
        return Err(ApiError::conflict(format!(
            "queue {name:?} has child queues; delete them first"
        ))
        .into());
    }
    if world
        .jobs()
        .values()
        .any(|j| j.spec.queue == name && !j.state.finished())
    {
        return Err(ApiError::conflict(format!(
            "queue {name:?} has unfinished jobs; cancel them or let them finish first"
        ))
        .into());
    }
    let mut change = Change::default();
    change.remove(Gone::Queue(name.clone()));
    change.audit(
        shared.now(),
        &caller.user.name,
        "queue.delete",
        &format!("queue/{name}"),
        "",
    );
    world.commit(change).await?;
    Ok(axum::response::NoContent)
}
