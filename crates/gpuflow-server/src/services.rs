//! Inference services: each replica is a job of its own (kind inference,
//! no retries), so one that fails is replaced alone. [`reconcile`], run
//! with the cycle's timers, keeps every service at its size and replaces
//! replicas of an older version of its task within the rollout bounds:
//! never more than `replicas + max_surge` unfinished replicas, never fewer
//! than `replicas - max_unavailable` ready ones because of a replacement.
//! Pure: the state in, the change out.

use std::collections::BTreeMap;

use gpuflow_api::{self as api, JobState};

use crate::Change;
use crate::event::EventKind;
use crate::state::{JobRec, ServiceRec, ServiceRef, World};

/// Whether a replica serves: running, and its readiness check passes (or
/// it has none).
pub fn ready(j: &JobRec) -> bool {
    j.state == JobState::Running
        && !j.tasks.is_empty()
        && j.tasks.iter().all(|t| match &j.service {
            Some(s) if s.readiness.is_some() => t.ready == Some(true),
            _ => true,
        })
}

/// The unfinished replicas of each service.
fn replicas(world: &World) -> BTreeMap<&str, Vec<&JobRec>> {
    let mut out: BTreeMap<&str, Vec<&JobRec>> = BTreeMap::new();
    for j in world.jobs().values().filter(|j| !j.state.finished()) {
        if let Some(s) = &j.service {
            out.entry(s.name.as_str()).or_default().push(j);
        }
    }
    out
}

/// Creates and stops replicas so that each service converges on its size
/// and version.
pub fn reconcile(world: &World, t: u64) -> Change {
    let mut change = Change::default();
    // Every cycle runs this: without services, no pass over the jobs.
    if world.records().services.is_empty() {
        return change;
    }
    let all = replicas(world);
    let mut next_id = world.next_job;
    for svc in world.records().services.values() {
        let mine = all.get(svc.spec.name.as_str()).cloned().unwrap_or_default();
        // Replicas being stopped no longer count.
        let live: Vec<&JobRec> = mine
            .iter()
            .copied()
            .filter(|j| j.state != JobState::Stopping)
            .collect();
        let stop = |change: &mut Change, j: &JobRec, why: &str| {
            let mut j = j.clone();
            if let Ok(kind) = crate::lifecycle::act(
                &mut j,
                crate::lifecycle::Action::Cancel,
                &format!("service {}", svc.spec.name),
                t,
            ) {
                change.event(
                    t,
                    Some(j.id),
                    &svc.team,
                    kind,
                    format!("{why}; {}", j.reason),
                );
                change.job(j);
            }
        };
        if svc.deleted {
            for j in live {
                stop(&mut change, j, "its service was deleted");
            }
            continue;
        }
        let want = svc.spec.replicas as usize;
        // A replica on a draining node is replaced as an old version is,
        // so that the drain finishes (a replica never ends by itself).
        let draining = |j: &JobRec| {
            j.allocs.iter().any(|a| {
                world
                    .nodes()
                    .get(&a.node)
                    .is_some_and(|n| n.state == api::NodeState::Draining)
            })
        };
        let (current, old): (Vec<&JobRec>, Vec<&JobRec>) = live.iter().partition(|j| {
            j.service.as_ref().is_some_and(|s| s.version == svc.version) && !draining(j)
        });
        let ready_now = live.iter().filter(|j| ready(j)).count();
        // 1. Too many of the current version (scaled down): stop the least
        //    useful first (pending, then not ready, then the newest).
        if current.len() > want {
            let mut extra = current.clone();
            extra.sort_by_key(|j| (ready(j), j.state.allocated(), std::cmp::Reverse(j.id)));
            for j in extra.iter().take(current.len() - want) {
                stop(&mut change, j, "scaled down");
            }
            continue;
        }
        // 2. Too few of the current version: new replicas, within the surge.
        let room = (want + svc.spec.rollout.max_surge as usize).saturating_sub(live.len());
        let missing = want - current.len();
        for _ in 0..missing.min(if old.is_empty() { missing } else { room }) {
            next_id += 1;
            let mut j = crate::lifecycle::submitted(
                next_id,
                svc.spec.job_spec(svc.version),
                &svc.team,
                &svc.user,
                None,
                t,
            );
            j.service = Some(ServiceRef {
                name: svc.spec.name.clone(),
                version: svc.version,
                readiness: svc.spec.readiness.clone(),
            });
            change.event(
                t,
                Some(j.id),
                &svc.team,
                EventKind::Submitted,
                format!(
                    "replica of service {} (version {})",
                    svc.spec.name, svc.version
                ),
            );
            change.job(j);
        }
        // 3. Old replicas go while enough stay ready: those not ready at
        //    once, ready ones one by one as the new ones are ready.
        let floor = want.saturating_sub(svc.spec.rollout.max_unavailable as usize);
        let mut ready_left = ready_now;
        let mut old = old.clone();
        old.sort_by_key(|j| (ready(j), j.id));
        for j in old {
            if ready(j) {
                if ready_left <= floor {
                    break;
                }
                ready_left -= 1;
            }
            let why = if draining(j) {
                "moved off a draining node"
            } else {
                "replaced by a new version"
            };
            stop(&mut change, j, why);
        }
    }
    change
}

/// A service as its viewers see it.
pub fn view(world: &World, svc: &ServiceRec) -> api::ServiceView {
    let mut members: Vec<api::ReplicaView> = world
        .jobs()
        .values()
        .filter(|j| !j.state.finished())
        .filter(|j| j.service.as_ref().is_some_and(|s| s.name == svc.spec.name))
        .map(|j| api::ReplicaView {
            job: j.id,
            version: j.service.as_ref().map_or(0, |s| s.version),
            state: j.state,
            node: j.allocs.first().map(|a| a.node.clone()),
            port: j.tasks.first().and_then(|t| t.port),
            ready: ready(j),
        })
        .collect();
    members.sort_by_key(|m| m.job);
    let endpoints = members
        .iter()
        .filter(|m| m.ready)
        .filter_map(|m| {
            let node = world.nodes().get(m.node.as_deref()?)?;
            let host = if node.inventory.address.is_empty() {
                node.name.clone()
            } else {
                node.inventory.address.clone()
            };
            Some(format!("{host}:{}", m.port?))
        })
        .collect();
    api::ServiceView {
        spec: svc.spec.clone(),
        team: svc.team.clone(),
        version: svc.version,
        ready: members.iter().filter(|m| m.ready).count() as u32,
        members,
        endpoints,
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn world(replicas: u32) -> World {
        let spec: api::ServiceSpec = serde_json::from_value(serde_json::json!({
            "name": "web", "queue": "q", "replicas": replicas,
            "task": {"name": "main", "command": ["serve"]},
            "rollout": {"max_surge": 1, "max_unavailable": 0}
        }))
        .unwrap();
        let mut w = World::default();
        w.put_record(crate::Rec::Service(Box::new(ServiceRec {
            spec,
            version: 1,
            team: "t".into(),
            user: "u".into(),
            deleted: false,
        })));
        w
    }

    /// A running task serving on `port`.
    fn running_task(port: u16, ready: bool) -> crate::state::TaskState {
        crate::state::TaskState {
            group: 0,
            index: 0,
            phase: api::TaskPhase::Running,
            exit_code: None,
            message: String::new(),
            usage: None,
            port: Some(port),
            ports: Default::default(),
            ready: Some(ready),
        }
    }

    /// A running replica of `version`, ready or not.
    fn replica(w: &mut World, version: u32, is_ready: bool) -> u64 {
        let id = w.next_job + 1;
        w.next_job = id;
        let svc = &w.records().services["web"];
        let mut j = crate::lifecycle::submitted(id, svc.spec.job_spec(version), "t", "u", None, 0);
        j.state = JobState::Running;
        j.service = Some(ServiceRef {
            name: "web".into(),
            version,
            readiness: Some(api::job::Readiness::http("/", 1)),
        });
        j.tasks.push(running_task(8000, is_ready));
        w.put_job(j);
        id
    }

    /// Runs reconcile at `t` and applies its change: (made, stopped).
    fn step(w: &mut World, t: u64) -> (usize, usize) {
        let c = reconcile(w, t);
        apply(w, c)
    }

    fn apply(w: &mut World, c: Change) -> (usize, usize) {
        let (mut made, mut stopped) = (0, 0);
        for (_, j) in c.jobs {
            if w.jobs().contains_key(&j.id) {
                stopped += 1;
            } else {
                made += 1;
            }
            w.next_job = w.next_job.max(j.id);
            w.put_job(j);
        }
        (made, stopped)
    }

    #[test]
    fn a_service_is_kept_at_its_size_and_a_lost_replica_is_replaced_alone() {
        let mut w = world(2);
        assert_eq!(step(&mut w, 10), (2, 0), "two made");
        assert_eq!(step(&mut w, 11), (0, 0), "steady");
        // One fails: one new, the other untouched.
        let first = *w.jobs().keys().next().unwrap();
        let mut failed = w.jobs()[&first].clone();
        failed.state = JobState::Failed;
        w.put_job(failed);
        let c = reconcile(&w, 12);
        assert!(
            !c.jobs
                .keys()
                .any(|id| *id != first && w.jobs().contains_key(id))
        );
        assert_eq!(apply(&mut w, c), (1, 0));
    }

    #[test]
    fn a_rollout_surges_by_one_and_stops_old_replicas_only_as_new_ones_are_ready() {
        let mut w = world(2);
        let old = [replica(&mut w, 1, true), replica(&mut w, 1, true)];
        let mut s = w.records().services["web"].clone();
        s.version = 2;
        w.put_record(crate::Rec::Service(Box::new(s)));
        // One new replica (the surge), no old one stopped: none is ready yet.
        assert_eq!(step(&mut w, 10), (1, 0));
        assert_eq!(step(&mut w, 11), (0, 0), "waits for readiness");
        // The new one is ready: one old one goes, and only one.
        let new = *w.jobs().keys().max().unwrap();
        let mut j = w.jobs()[&new].clone();
        j.state = JobState::Running;
        j.tasks.push(running_task(8001, true));
        w.put_job(j);
        let c = reconcile(&w, 12);
        let stopped: Vec<u64> = c
            .jobs
            .keys()
            .copied()
            .filter(|id| old.contains(id))
            .collect();
        assert_eq!(stopped.len(), 1, "{:?}", c.jobs.keys());
        let (_, s) = apply(&mut w, c);
        assert_eq!(s, 1);
        let ready_left = w.jobs().values().filter(|j| ready(j)).count();
        assert!(ready_left >= 2, "never below replicas - max_unavailable");
    }
}
