//! Every job transition, in one place: a job and what happened (a cycle's
//! admission or preemption, an eviction, a lost node, a timer, an owner's or
//! admin's action, a node's task reports) in; the job's new state and the
//! event kind out. Pure: no store, no lock, no clock (callers pass `at`).
//! The HTTP handlers, the agent protocol and the scheduling cycle call these
//! functions and commit what they return; none of them sets a state itself.
//!
//! ```text
//!   submitted ─► pending ──admit──► admitted ──report──► starting ─► running ─► succeeded
//!                 ▲  │ ▲                │                    │           │
//!      resume/    │  │ └── requeue ◄────┴── stopping ◄────────┴───────────┘ preempt, evict,
//!      release    │  ▼                    (grace, then kill)             cancel, suspend,
//!   suspended/held   cancelled                 │                          max runtime, failure
//!                                              ▼
//!                       pending (requeue, retry after backoff) | suspended | cancelled | failed
//! ```
//! Workloads another scheduler runs (Kubernetes, `external.rs`) only follow
//! their cluster's reports: pending or running as reported, finished when
//! they leave the report.
//!
//! A lost node requeues at once (its keepers have stopped its tasks by the
//! end of its lease); a task stopped on its node without an order ends the
//! attempt and requeues it.

use gpuflow_api::{self as api, JobSpec, JobState, TaskPhase, TaskReport};

use crate::state::{AfterStop, Alloc, Held, JobRec, TaskState};

/// The kind of the event a transition records.
pub type Kind = crate::event::EventKind;

/// A new job, pending, as submitted by `user` to a queue of `team`.
pub fn submitted(
    id: u64,
    spec: JobSpec,
    team: &str,
    user: &str,
    idempotency_key: Option<String>,
    at: u64,
) -> JobRec {
    JobRec {
        id,
        spec,
        team: team.to_string(),
        user: user.to_string(),
        idempotency_key,
        state: JobState::Pending,
        reason: "submitted; waiting for the next scheduling cycle".into(),
        submitted_at: at,
        started_at: None,
        finished_at: None,
        attempts: 0,
        preemptions: 0,
        failures: 0,
        not_before: None,
        last_checkpoint: None,
        kill_at: None,
        after_stop: None,
        flavor: String::new(),
        allocs: vec![],
        tasks: vec![],
        logs: Default::default(),
        err_logs: Default::default(),
        log_marks: Default::default(),
        log_kept: 0,
        idle_warned_at: None,
        held: vec![],
        lost_gpu_hours: 0.0,
        util: vec![],
        last_tasks: vec![],
        image_digests: Default::default(),
        array: None,
        service: None,
        external: None,
        waits_on: vec![],
    }
}

/// A pending job whose dependency can never be met (`what`: which and
/// why): cancelled, or held with the unmeetable dependencies dropped, so
/// that an admin's release runs it without them.
pub fn dependency_never_met(j: &mut JobRec, what: &str, at: u64) -> Kind {
    match j.spec.on_unmet_dependency {
        api::OnUnmet::Cancel => {
            j.state = JobState::Cancelled;
            j.finished_at = Some(at);
            j.reason = format!("cancelled: its dependency can never be met ({what})");
            Kind::DependencyNeverMet
        }
        api::OnUnmet::Hold => {
            j.state = JobState::Held;
            j.reason = format!(
                "held: its dependency can never be met ({what}); an admin's release runs it without it"
            );
            Kind::Held
        }
    }
}

/// A cycle admitted the job with these allocations: a new attempt.
pub fn admit(j: &mut JobRec, flavor: &str, allocs: Vec<Alloc>, at: u64) -> Kind {
    j.state = JobState::Admitted;
    j.flavor = flavor.to_string();
    j.attempts += 1;
    j.allocs = allocs;
    let gpu_milli = crate::convert::quota_milli(&j.spec);
    if gpu_milli > 0 {
        j.held.push(crate::state::Held {
            attempt: j.attempts,
            from: at,
            to: None,
            gpu_milli,
            model: flavor.to_string(),
            util_pct: None,
        });
    }
    j.tasks.clear();
    let mut nodes: Vec<&str> = j.allocs.iter().map(|a| a.node.as_str()).collect();
    nodes.dedup();
    j.reason = format!("admitted to {} (attempt {})", nodes.join(", "), j.attempts);
    Kind::Admitted
}

/// A cycle preempted the job for job `by`: it is signalled now and killed
/// at `kill_at`, then requeued.
pub fn preempt(j: &mut JobRec, by: u64, why: &str, kill_at: u64, lost_gpu_hours: f64) -> Kind {
    j.state = JobState::Stopping;
    j.kill_at = Some(kill_at);
    j.after_stop = Some(AfterStop::Requeue);
    j.preemptions += 1;
    j.lost_gpu_hours += lost_gpu_hours;
    j.reason = format!(
        "preempted by job {by}: {why}; signalled now, killed at {} ({lost_gpu_hours:.2} GPU-hours since the last checkpoint)",
        crate::when(kill_at)
    );
    Kind::Preempted
}

/// Its node no longer holds its allocation: stopped and requeued. `None`
/// when it is stopping already.
pub fn evict(j: &mut JobRec, at: u64, reason: &str) -> Option<Kind> {
    if j.state == JobState::Stopping {
        return None;
    }
    stop(j, at, AfterStop::Requeue, format!("evicted: {reason}"));
    Some(Kind::Evicted)
}

/// A node it runs on is lost (its lease ran out): requeued, or, if it was
/// stopping, finished as its stop said.
pub fn node_lost(j: &mut JobRec, node: &str, at: u64) -> Kind {
    let msg = format!("node {node} lost");
    if j.state == JobState::Stopping {
        finish_stop(j, at, &msg);
    } else {
        release(j, at);
        j.state = JobState::Pending;
        j.reason = format!("{msg}; requeued");
    }
    Kind::Requeued
}

/// Stops a job that ran past its max runtime; `None` when it has not.
pub fn max_runtime(j: &mut JobRec, at: u64) -> Option<Kind> {
    let (Some(max), Some(start)) = (j.spec.max_runtime_s, j.started_at) else {
        return None;
    };
    if !matches!(j.state, JobState::Running | JobState::Starting) || start + max > at {
        return None;
    }
    if j.spec.kind == api::Kind::Notebook {
        // A notebook's end of life is not its failure: it is stopped and
        // ends cancelled, with its own event.
        stop(
            j,
            at,
            AfterStop::Cancel,
            format!("reached its maximum lifetime of {max} s; stopped"),
        );
        return Some(Kind::LifetimeReached);
    }
    stop(
        j,
        at,
        AfterStop::Timeout,
        format!("exceeded its max runtime of {max} s"),
    );
    Some(Kind::Stopping)
}

/// The server holds a pending job that makes the scheduler fail; an admin
/// releases it.
pub fn set_aside(j: &mut JobRec, reason: &str) -> Kind {
    j.state = JobState::Held;
    j.reason = reason.to_string();
    Kind::Held
}

/// What an owner or an admin asks of a job.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Action {
    Cancel,
    Suspend,
    Resume,
    Hold,
    Release,
}

impl Action {
    pub fn parse(s: &str) -> Option<Action> {
        Some(match s {
            "cancel" => Action::Cancel,
            "suspend" => Action::Suspend,
            "resume" => Action::Resume,
            "hold" => Action::Hold,
            "release" => Action::Release,
            _ => return None,
        })
    }

    /// Hold and release are the admins'; the others the owners'.
    pub fn admins_only(self) -> bool {
        matches!(self, Action::Hold | Action::Release)
    }
}

/// An action by `who`.
///
/// # Errors
/// What the job's state does not allow, in words (a 409).
pub fn act(j: &mut JobRec, action: Action, who: &str, at: u64) -> Result<Kind, String> {
    use Action::*;
    if j.state.finished() {
        return Err("it has finished".into());
    }
    Ok(match (action, j.state) {
        (Cancel, JobState::Pending | JobState::Held | JobState::Suspended) => {
            j.state = JobState::Cancelled;
            j.finished_at = Some(at);
            j.reason = format!("cancelled by {who}");
            Kind::Cancelled
        }
        (Cancel, JobState::Stopping) => {
            j.after_stop = Some(AfterStop::Cancel);
            j.reason = format!("cancelled by {who}; stopping");
            Kind::Stopping
        }
        (Cancel, _) => {
            stop(j, at, AfterStop::Cancel, format!("cancelled by {who}"));
            Kind::Stopping
        }
        (Suspend, JobState::Pending) => {
            j.state = JobState::Suspended;
            j.reason = format!("suspended by {who}");
            Kind::Suspended
        }
        (Suspend, s) if s.allocated() && s != JobState::Stopping => {
            stop(j, at, AfterStop::Suspend, format!("suspended by {who}"));
            Kind::Stopping
        }
        (Suspend, _) => return Err("only pending or running jobs can be suspended".into()),
        (Resume, JobState::Suspended) => {
            j.state = JobState::Pending;
            j.reason = format!("resumed by {who}");
            Kind::Resumed
        }
        (Resume, _) => return Err("only suspended jobs can be resumed".into()),
        (Hold, JobState::Pending) => {
            j.state = JobState::Held;
            j.reason = format!("held by {who}");
            Kind::Held
        }
        (Hold, _) => return Err("only pending jobs can be held".into()),
        (Release, JobState::Held) => {
            j.state = JobState::Pending;
            j.reason = format!("released by {who}");
            Kind::Released
        }
        (Release, _) => return Err("only held jobs can be released".into()),
    })
}

/// How far ahead of the server's clock a node's may be.
const CLOCK_SKEW_S: u64 = 60;

/// Folds `node`'s reports of this job's current attempt into it (reports of
/// tasks not placed on that node, or of another attempt, change nothing),
/// then settles its state. Returns the event kind when the state moved.
pub fn report(j: &mut JobRec, node: &str, reports: &[&TaskReport], at: u64) -> Option<Kind> {
    if !j.state.allocated() {
        return None;
    }
    let mine: Vec<&TaskReport> = reports
        .iter()
        .copied()
        .filter(|r| r.attempt == j.attempts)
        .collect();
    let next = j;
    let j = next.clone();
    for r in &mine {
        if !next
            .allocs
            .iter()
            .any(|a| a.node == node && a.group == r.group && a.index == r.index)
        {
            continue;
        }
        let st = TaskState {
            group: r.group,
            index: r.index,
            phase: r.phase,
            exit_code: r.exit_code,
            message: r.message.clone(),
            usage: r.usage.clone(),
            port: r.port,
            ports: r.ports.clone(),
            ready: r.ready,
        };
        match next
            .tasks
            .iter_mut()
            .find(|t| t.group == r.group && t.index == r.index)
        {
            Some(t) => *t = st,
            None => next.tasks.push(st),
        }
        if let Some(started) = r.started_at {
            // The node's word for when the task started, not when the
            // server heard of it (a short task may end between reports).
            next.started_at.get_or_insert(started.min(at));
        }
        // A checkpoint after the report is a lie or a wrong clock: more
        // than a minute ahead it is ignored, less is taken as now (a job
        // with a checkpoint in the future would look as if it had no
        // unsaved work).
        if let Some(c) = r
            .checkpoint_at
            .filter(|&c| c <= at.saturating_add(CLOCK_SKEW_S))
        {
            let c = c.min(at);
            next.last_checkpoint = Some(next.last_checkpoint.map_or(c, |x| x.max(c)));
        }
    }
    if mine
        .iter()
        .any(|r| r.usage.as_ref().is_some_and(|u| u.samples > 0))
    {
        let sampled: Vec<&api::TaskUsage> = next
            .tasks
            .iter()
            .filter_map(|t| t.usage.as_ref())
            .filter(|u| u.samples > 0)
            .collect();
        crate::state::push_util(
            &mut next.util,
            api::UtilPoint {
                at,
                util_pct: sampled.iter().map(|u| u.gpu_util_pct as f64).sum::<f64>()
                    / sampled.len() as f64,
                memory_mib: sampled.iter().map(|u| u.gpu_memory_mib).sum(),
            },
        );
    }
    if next.state == JobState::Stopping {
        // Tasks of this node the agent no longer runs are gone.
        for a in j.allocs.iter().filter(|a| a.node == node) {
            let running = mine
                .iter()
                .any(|r| r.group == a.group && r.index == a.index && r.phase == TaskPhase::Running);
            if !running {
                match next
                    .tasks
                    .iter_mut()
                    .find(|t| t.group == a.group && t.index == a.index)
                {
                    Some(t) if t.phase == TaskPhase::Running => t.phase = TaskPhase::Stopped,
                    Some(_) => {}
                    None => next.tasks.push(TaskState {
                        group: a.group,
                        index: a.index,
                        phase: TaskPhase::Stopped,
                        exit_code: None,
                        message: String::new(),
                        usage: None,
                        port: None,
                        ports: std::collections::BTreeMap::new(),
                        ready: None,
                    }),
                }
            }
        }
    }
    settle(next, at)
}

/// The limits `reports` say the job's tasks were killed at (out of memory,
/// past their GPU memory): an event of its own for each, once (a task
/// already known to have ended is not reported again), beside the job's
/// failure that [`report`] settles.
pub fn breaches(j: &JobRec, reports: &[&TaskReport]) -> Vec<(Kind, String)> {
    reports
        .iter()
        .filter(|r| r.attempt == j.attempts)
        .filter_map(|r| Some((r, r.breach?)))
        .filter(|(r, _)| {
            j.tasks
                .iter()
                .find(|t| t.group == r.group && t.index == r.index)
                .is_none_or(|t| t.phase == TaskPhase::Running)
        })
        .map(|(r, b)| {
            let kind = match b {
                api::Breach::Memory => Kind::Oom,
                api::Breach::GpuMemory => Kind::GpuMemory,
            };
            (kind, r.message.clone())
        })
        .collect()
}

/// What the reports say of the current attempt's images: the digest each
/// task group's image resolved to, recorded on `next` the first time
/// (`image-pulled`), and pulls that failed (`image-failed`).
pub fn image_events(j: &JobRec, next: &mut JobRec, reports: &[&TaskReport]) -> Vec<(Kind, String)> {
    let mut out = Vec::new();
    for r in reports.iter().filter(|r| r.attempt == j.attempts) {
        let Some(img) = &r.image else { continue };
        let name = j
            .spec
            .tasks
            .get(r.group as usize)
            .and_then(|g| g.image.clone())
            .unwrap_or_default();
        if img.pulling {
            // Told once an attempt: the first report that says so.
            let told = j
                .tasks
                .iter()
                .any(|t| t.group == r.group && t.index == r.index);
            if !told && !next.image_digests.contains_key(&r.group) {
                out.push((Kind::ImagePulling, format!("pulling {name}")));
            }
        } else if !img.error.is_empty() {
            let known = j
                .tasks
                .iter()
                .any(|t| t.group == r.group && t.index == r.index && t.phase != TaskPhase::Running);
            if !known {
                out.push((
                    Kind::ImageFailed,
                    format!("cannot run {name}: {}", img.error),
                ));
            }
        } else if !img.digest.is_empty() && !next.image_digests.contains_key(&r.group) {
            next.image_digests.insert(r.group, img.digest.clone());
            out.push((
                Kind::ImagePulled,
                if img.pulled_mib > 0.0 {
                    format!(
                        "pulled {name} ({:.1} MiB in {:.1} s), digest {}",
                        img.pulled_mib, img.seconds, img.digest
                    )
                } else {
                    format!("{name} was in the node's cache, digest {}", img.digest)
                },
            ));
        }
    }
    out
}

/// A job's next state from its tasks' states; the event kind when it moved.
fn settle(j: &mut JobRec, at: u64) -> Option<Kind> {
    let total = j.allocs.len();
    let done = |p: TaskPhase| p != TaskPhase::Running;
    if j.state == JobState::Stopping {
        let gone = j.tasks.iter().filter(|t| done(t.phase)).count();
        if gone >= total {
            let why = j.reason.clone();
            let after = j.after_stop;
            finish_stop(j, at, &why);
            return Some(match (j.state, after) {
                (JobState::Cancelled, _) => Kind::Cancelled,
                (JobState::Failed, _) => Kind::Failed,
                (JobState::Timeout, _) => Kind::Timeout,
                (JobState::Suspended, _) => Kind::Suspended,
                (_, Some(AfterStop::Retry)) => Kind::Retry,
                _ => Kind::Requeued,
            });
        }
        return None;
    }
    let failed = j.tasks.iter().find(|t| {
        t.phase == TaskPhase::FailedToStart
            || (t.phase == TaskPhase::Exited && t.exit_code != Some(0))
    });
    if let Some(f) = failed {
        let mut what = match f.phase {
            TaskPhase::FailedToStart => format!("task {}/{} could not start", f.group, f.index),
            _ => format!(
                "task {}/{} exited with {}",
                f.group,
                f.index,
                f.exit_code
                    .map_or("an unknown status".into(), |c| format!("code {c}"))
            ),
        };
        if !f.message.is_empty() {
            what = format!("{what} ({})", f.message);
        }
        j.failures += 1;
        let retry = j.failures <= j.spec.retry.limit;
        stop(
            j,
            at,
            if retry {
                AfterStop::Retry
            } else {
                AfterStop::Fail
            },
            what,
        );
        if j.tasks.iter().filter(|t| done(t.phase)).count() >= total {
            let why = j.reason.clone();
            finish_stop(j, at, &why);
            return Some(if retry { Kind::Retry } else { Kind::Failed });
        }
        return Some(Kind::Stopping);
    }
    // A task stopped on its node without the server's order (its agent
    // stopped or crashed, the node's lease ran out): this attempt is over
    // and the job runs again, as a new attempt.
    if let Some(f) = j.tasks.iter().find(|t| t.phase == TaskPhase::Stopped) {
        let mut what = format!("task {}/{} was stopped on its node", f.group, f.index);
        if !f.message.is_empty() {
            what = format!("{what} ({})", f.message);
        }
        stop(j, at, AfterStop::Requeue, what);
        if j.tasks.iter().filter(|t| done(t.phase)).count() >= total {
            let why = j.reason.clone();
            finish_stop(j, at, &why);
            return Some(Kind::Requeued);
        }
        return Some(Kind::Stopping);
    }
    let exited = j
        .tasks
        .iter()
        .filter(|t| t.phase == TaskPhase::Exited)
        .count();
    if exited == total {
        j.state = JobState::Succeeded;
        j.finished_at = Some(at);
        j.reason = "all tasks exited with code 0".into();
        close_held(j, at);
        j.last_tasks = j.task_views();
        j.allocs.clear();
        return Some(Kind::Succeeded);
    }
    let running = j
        .tasks
        .iter()
        .filter(|t| t.phase == TaskPhase::Running)
        .count();
    if running + exited == total && j.state != JobState::Running {
        j.state = JobState::Running;
        j.started_at.get_or_insert(at);
        j.reason = format!("{total} task{} running", if total == 1 { "" } else { "s" });
        return Some(Kind::Running);
    }
    if running > 0 && j.state == JobState::Admitted {
        j.state = JobState::Starting;
        j.started_at.get_or_insert(at);
        j.reason = format!("{running} of {total} tasks started");
        return Some(Kind::Starting);
    }
    None
}

/// A running job with an idle policy, judged by its tasks' reported GPU
/// use: idle when every task with GPUs has been below the policy's
/// threshold for `after_s`. Then it is warned (once a spell), and `warn_s`
/// later its action is taken (suspend, requeue or cancel: it stops and
/// gives its GPUs back). Activity ends the spell. Returns the event, if any.
pub fn idle(j: &mut JobRec, t: u64) -> Option<(Kind, String)> {
    let policy = j.spec.idle.clone()?;
    if j.state != JobState::Running {
        return None;
    }
    // Every task with GPUs must report its idleness.
    let mut since = 0;
    let (mut now_pct, mut avg_pct, mut n) = (0u32, 0.0f64, 0u32);
    for a in j.allocs.iter().filter(|a| a.pick.gpus_held()) {
        let usage = j
            .tasks
            .iter()
            .find(|s| s.group == a.group && s.index == a.index)
            .and_then(|s| s.usage.as_ref());
        match usage.and_then(|u| Some((u, u.idle_since?))) {
            Some((u, s)) => {
                since = since.max(s);
                now_pct = now_pct.max(u.gpu_util_pct);
                avg_pct += u.gpu_util_avg_pct;
                n += 1;
            }
            None => {
                j.idle_warned_at = None;
                return None;
            }
        }
    }
    if n == 0 || t < since + policy.after_s {
        j.idle_warned_at = None;
        return None;
    }
    let measured = format!(
        "GPU utilisation below {}% for {} s (now {now_pct}%, {:.1}% on average since it started)",
        policy.below_pct,
        t - since,
        avg_pct / f64::from(n)
    );
    let action = match policy.action {
        api::IdleAction::Notify => "nothing more is done",
        api::IdleAction::Suspend => "it will be suspended",
        api::IdleAction::Requeue => "it will be stopped and queued again",
        api::IdleAction::Cancel => "it will be cancelled",
    };
    let Some(warned) = j.idle_warned_at else {
        j.idle_warned_at = Some(t);
        let when = if policy.action == api::IdleAction::Notify {
            String::new()
        } else {
            format!(" in {} s unless its GPUs get busy", policy.warn_s)
        };
        return Some((
            Kind::IdleWarning,
            format!("idle: {measured}; {action}{when}"),
        ));
    };
    if policy.action == api::IdleAction::Notify || t < warned + policy.warn_s {
        return None;
    }
    let (after, what) = match policy.action {
        api::IdleAction::Suspend => (AfterStop::Suspend, "suspended"),
        api::IdleAction::Requeue => (AfterStop::Requeue, "stopped and queued again"),
        _ => (AfterStop::Cancel, "cancelled"),
    };
    stop(
        j,
        t,
        after,
        format!("idle: {measured}; {what} by its idle policy"),
    );
    j.idle_warned_at = None;
    Some((Kind::IdleStop, j.reason.clone()))
}

/// Tells a job to stop; it keeps its GPUs until its tasks are gone.
pub fn stop(j: &mut JobRec, t: u64, after: AfterStop, reason: String) {
    j.state = JobState::Stopping;
    j.kill_at = Some(t + j.spec.checkpoint.grace_s);
    j.after_stop = Some(after);
    j.reason = reason;
}

/// Ends the current attempt's hold in the ledger, with its tasks' mean
/// GPU utilisation.
fn close_held(j: &mut JobRec, at: u64) {
    let util = j.tasks_util();
    if let Some(h) = j.held.last_mut().filter(|h| h.to.is_none()) {
        h.to = Some(at.max(h.from));
        h.util_pct = util;
    }
}

fn release(j: &mut JobRec, at: u64) {
    close_held(j, at);
    j.allocs.clear();
    j.tasks.clear();
    j.kill_at = None;
    j.after_stop = None;
    j.flavor.clear();
}

/// A stopping job whose tasks are gone: release its GPUs and move on.
pub fn finish_stop(j: &mut JobRec, t: u64, why: &str) {
    let after = j.after_stop.unwrap_or(AfterStop::Requeue);
    let ended = j.task_views();
    release(j, t);
    let (state, reason) = match after {
        AfterStop::Requeue => (JobState::Pending, format!("{why}; requeued")),
        AfterStop::Suspend => (JobState::Suspended, format!("{}; GPUs released", j.reason)),
        AfterStop::Cancel => (JobState::Cancelled, j.reason.clone()),
        AfterStop::Fail => (JobState::Failed, j.reason.clone()),
        AfterStop::Timeout => (JobState::Timeout, j.reason.clone()),
        AfterStop::Retry => {
            let backoff = j
                .spec
                .retry
                .backoff_s
                .saturating_mul(1 << (j.failures.saturating_sub(1)).min(12))
                .min(3600);
            j.not_before = Some(t + backoff);
            (
                JobState::Pending,
                format!(
                    "{}; retry {} of {} in {backoff} s",
                    j.reason, j.failures, j.spec.retry.limit
                ),
            )
        }
    };
    if state.finished() {
        j.finished_at = Some(t);
        j.last_tasks = ended;
    }
    j.state = state;
    j.reason = reason;
}
/// A workload another scheduler runs (`external.rs`), brought up to its
/// cluster's report at `now`: a hold opens when it first runs and closes
/// when it stops running (preempted: it waits again) or what it holds
/// changes; it is running or pending as reported.
pub fn reported_elsewhere(j: &mut JobRec, cluster: &str, w: &api::ExternalWorkload, now: u64) {
    let open = j.held.iter_mut().rev().find(|h| h.to.is_none());
    match (&w.running, open) {
        (Some(h), Some(o)) if o.gpu_milli == h.gpu_milli && o.model == h.model => {}
        (Some(h), open) => {
            // A new hold: its first, or what it holds changed.
            let from = match open {
                Some(o) => {
                    o.to = Some(now);
                    now
                }
                None => h.since.clamp(j.submitted_at, now),
            };
            j.attempts += 1;
            if h.gpu_milli > 0 {
                j.held.push(Held {
                    attempt: j.attempts,
                    from,
                    to: None,
                    gpu_milli: h.gpu_milli,
                    model: h.model.clone(),
                    util_pct: None,
                });
            }
            j.started_at.get_or_insert(from);
            j.flavor = h.model.clone();
        }
        // It ran and waits again: preempted (or its pods were recreated).
        (None, Some(o)) => {
            o.to = Some(now);
            j.preemptions += 1;
        }
        (None, None) => {}
    }
    let (state, reason) = match &w.running {
        Some(_) => (
            JobState::Running,
            format!("running on Kubernetes cluster {cluster}"),
        ),
        None if w.reason.is_empty() => (
            JobState::Pending,
            format!("waiting in Kubernetes cluster {cluster}"),
        ),
        None => (JobState::Pending, w.reason.chars().take(4096).collect()),
    };
    j.state = state;
    j.reason = reason;
    j.spec.priority = w.priority;
}

/// A workload another scheduler ran that left its cluster's report at
/// `now`: succeeded if it ever ran, else cancelled; its hold closes.
pub fn gone_elsewhere(j: &mut JobRec, cluster: &str, now: u64) {
    let ran = j.started_at.is_some();
    for h in j.held.iter_mut().filter(|h| h.to.is_none()) {
        h.to = Some(now);
    }
    j.state = if ran {
        JobState::Succeeded
    } else {
        JobState::Cancelled
    };
    j.reason = if ran {
        format!("its pods finished or were deleted in Kubernetes cluster {cluster}")
    } else {
        format!("its pods were deleted in Kubernetes cluster {cluster} before they ran")
    };
    j.finished_at = Some(now);
}
