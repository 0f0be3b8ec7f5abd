//! Workloads another scheduler runs: gpuflow on Kubernetes reports its gangs
//! of pods (`PUT /v1/clusters/{cluster}/workloads`), and they are accounted,
//! reported and shown like the jobs this server runs (the ledger, usage and
//! jobs reports, metrics, `job get`/`why`, the dashboard). This server never
//! schedules them: their records stay out of [`World::jobs`], which the
//! cycle reads.
//!
//! A report lists every workload of the cluster that is not finished. A
//! workload's hold opens when it first runs and closes when it stops
//! running (preempted: it waits again) or leaves the report (finished);
//! times are this server's clock, not the cluster's, except the start of
//! a hold, which cannot be later than now.

use std::collections::{BTreeMap, BTreeSet};

use gpuflow_api::{self as api, JobSpec, TaskGroupSpec};

use crate::state::{JobRec, World};

/// Bounds of one report's fields.
const MAX_KEY: usize = 512;
const MAX_NAME: usize = 256;
const MAX_GPU_MILLI: u64 = 1_000_000_000;

/// Why a workload cannot be recorded, if it cannot.
fn refusal(world: &World, w: &api::ExternalWorkload) -> Option<String> {
    let long = |what: &str, v: &str, max: usize| {
        (v.is_empty() || v.len() > max).then(|| format!("{what}: 1 to {max} characters"))
    };
    if let Some(e) = long("key", &w.key, MAX_KEY)
        .or_else(|| long("name", &w.name, MAX_NAME))
        .or_else(|| long("user", &w.user, MAX_NAME))
        .or_else(|| long("queue", &w.queue, MAX_NAME))
    {
        return Some(e);
    }
    if !world.records().teams.contains_key(&w.team) {
        return Some(format!(
            "team {:?} does not exist: create it (gpuflow team create) or charge the queue to another team",
            w.team
        ));
    }
    if w.tasks.is_empty() || w.tasks.iter().any(|t| t.replicas == 0) {
        return Some("tasks: at least one group of at least one pod".into());
    }
    if w.tasks
        .iter()
        .any(|t| !t.resources.cpu.is_finite() || t.resources.cpu < 0.0)
    {
        return Some("tasks: cpu must be a finite number of cores, at least 0".into());
    }
    if let Some(h) = &w.running {
        if h.gpu_milli > MAX_GPU_MILLI {
            return Some(format!("running.gpu_milli: at most {MAX_GPU_MILLI}"));
        }
        if h.gpu_milli > 0 && (h.model.is_empty() || h.model.len() > MAX_NAME) {
            return Some(format!(
                "running.model: the GPU model, 1 to {MAX_NAME} characters"
            ));
        }
    }
    None
}

/// A new record for a workload first seen at `now`.
fn record(id: u64, cluster: &str, w: &api::ExternalWorkload, now: u64) -> JobRec {
    let spec = JobSpec {
        name: w.name.clone(),
        queue: w.queue.clone(),
        project: None,
        kind: w.kind,
        priority_class: None,
        priority: w.priority,
        tasks: w
            .tasks
            .iter()
            .enumerate()
            .map(|(i, t)| TaskGroupSpec {
                name: format!("pods-{i}"),
                replicas: t.replicas,
                command: Vec::new(),
                args: Vec::new(),
                env: BTreeMap::new(),
                working_dir: None,
                resources: t.resources.clone(),
                ports: Vec::new(),
                image: None,
            })
            .collect(),
        topology: None,
        max_runtime_s: None,
        retry: Default::default(),
        checkpoint: Default::default(),
        idle: None,
        array: None,
        dependency: None,
        on_unmet_dependency: Default::default(),
        reservation: None,
    };
    let mut j =
        crate::lifecycle::submitted(id, spec, &w.team, &w.user, None, w.submitted_at.min(now));
    j.external = Some(api::ExternalRef {
        cluster: cluster.to_string(),
        key: w.key.clone(),
    });
    j
}

/// A cluster's report applied at `now`: the records that changed (new ones
/// with ids from `world.next_job` on), and what became of each workload.
pub fn apply(
    world: &World,
    cluster: &str,
    report: &api::WorkloadReport,
    now: u64,
) -> (Vec<JobRec>, api::WorkloadReportResult) {
    let mut out = Vec::new();
    let mut result = api::WorkloadReportResult {
        recorded: 0,
        finished: 0,
        refused: BTreeMap::new(),
    };
    let mut next = world.next_job;
    let mut seen: BTreeSet<&str> = BTreeSet::new();
    for w in &report.workloads {
        if !seen.insert(w.key.as_str()) {
            result.refused.insert(
                w.key.clone(),
                "reported twice: keys are unique in a cluster".into(),
            );
            continue;
        }
        if let Some(why) = refusal(world, w) {
            result.refused.insert(w.key.clone(), why);
            continue;
        }
        let mut j = match world
            .external_id(cluster, &w.key)
            .and_then(|id| world.external().get(&id))
        {
            Some(old) => old.clone(),
            None => {
                next += 1;
                record(next, cluster, w, now)
            }
        };
        let before = j.clone();
        crate::lifecycle::reported_elsewhere(&mut j, cluster, w, now);
        if j != before || !world.external().contains_key(&j.id) {
            out.push(j);
        }
        result.recorded += 1;
    }
    // Those the last report had and this one does not have finished.
    for j in world.external().values() {
        let Some(e) = &j.external else { continue };
        if e.cluster != cluster || seen.contains(e.key.as_str()) {
            continue;
        }
        let mut j = j.clone();
        crate::lifecycle::gone_elsewhere(&mut j, cluster, now);
        out.push(j);
        result.finished += 1;
    }
    (out, result)
}

#[cfg(test)]
mod tests {
    use gpuflow_api::JobState;

    use super::*;

    fn world() -> World {
        let mut w = World::default();
        w.put_record(crate::Rec::Team(api::Team {
            name: "ml".into(),
            ..serde_json::from_value(serde_json::json!({"name": "ml"})).unwrap()
        }));
        w
    }

    fn workload(key: &str, running: Option<(u64, u64)>) -> api::ExternalWorkload {
        api::ExternalWorkload {
            key: key.into(),
            name: key.into(),
            team: "ml".into(),
            user: "ann".into(),
            queue: "team-a".into(),
            kind: api::Kind::Training,
            priority: 0,
            submitted_at: 100,
            tasks: vec![api::ExternalTasks {
                replicas: 2,
                resources: api::Resources::default(),
            }],
            running: running.map(|(since, gpu_milli)| api::ExternalHold {
                since,
                gpu_milli,
                model: "H100".into(),
            }),
            reason: String::new(),
        }
    }

    fn put(w: &mut World, recs: Vec<JobRec>) {
        for j in recs {
            w.put_external(j);
        }
    }

    #[test]
    fn a_workload_holds_from_its_start_until_it_leaves_the_report() {
        let mut w = world();
        let report = |ws| api::WorkloadReport { workloads: ws };
        let (recs, r) = apply(&w, "k", &report(vec![workload("ml/a", None)]), 110);
        assert_eq!((r.recorded, recs.len()), (1, 1));
        assert_eq!(recs[0].state, JobState::Pending);
        put(&mut w, recs);
        // Runs since 120 (reported at 130) on 4 GPUs.
        let (recs, _) = apply(
            &w,
            "k",
            &report(vec![workload("ml/a", Some((120, 4000)))]),
            130,
        );
        assert_eq!(recs[0].held.len(), 1);
        assert_eq!((recs[0].held[0].from, recs[0].held[0].to), (120, None));
        put(&mut w, recs);
        // The same again changes nothing.
        let (recs, _) = apply(
            &w,
            "k",
            &report(vec![workload("ml/a", Some((120, 4000)))]),
            140,
        );
        assert!(recs.is_empty());
        // Gone: finished at 200, its hold closed.
        let (recs, r) = apply(&w, "k", &report(vec![]), 200);
        assert_eq!(r.finished, 1);
        assert_eq!(recs[0].state, JobState::Succeeded);
        assert_eq!(recs[0].held[0].to, Some(200));
        put(&mut w, recs);
        assert!(w.external().is_empty());
        assert_eq!(w.summaries().len(), 1);
    }

    #[test]
    fn a_report_cannot_charge_a_team_that_does_not_exist_or_hold_before_it_was_submitted() {
        let w = world();
        let mut bad = workload("x/b", None);
        bad.team = "nobody".into();
        let mut early = workload("ml/early", Some((5, 1000)));
        early.submitted_at = 50;
        let (recs, r) = apply(
            &w,
            "k",
            &api::WorkloadReport {
                workloads: vec![bad, early, workload("ml/early", None)],
            },
            60,
        );
        assert!(r.refused["x/b"].contains("team \"nobody\" does not exist"));
        assert!(r.refused["ml/early"].contains("reported twice"));
        assert_eq!(recs.len(), 1);
        // The hold starts no earlier than the submission.
        assert_eq!(recs[0].held[0].from, 50);
    }

    #[test]
    fn a_workload_that_stops_running_and_waits_again_was_preempted() {
        let mut w = world();
        let r = |run| api::WorkloadReport {
            workloads: vec![workload("ml/a", run)],
        };
        let (recs, _) = apply(&w, "k", &r(Some((100, 1000))), 100);
        put(&mut w, recs);
        let (recs, _) = apply(&w, "k", &r(None), 160);
        assert_eq!(recs[0].preemptions, 1);
        assert_eq!(recs[0].held[0].to, Some(160));
        assert_eq!(recs[0].state, JobState::Pending);
        put(&mut w, recs);
        // Another cluster's report does not finish it.
        let (recs, _) = apply(&w, "other", &api::WorkloadReport { workloads: vec![] }, 170);
        assert!(recs.is_empty());
    }
}
