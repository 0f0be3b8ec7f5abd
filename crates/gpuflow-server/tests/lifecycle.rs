//! The job lifecycle as fixtures: a job, then what happens to it line by
//! line (admissions, task reports from its node, actions, preemptions,
//! evictions, lost nodes, timers), rendered with the state, reason and
//! event kind after each. `UPDATE_EXPECT=1 cargo test` rewrites the expected
//! text after a deliberate change; read the diff.

use expect_test::{Expect, expect};
use gpuflow_api::{JobSpec, TaskPhase, TaskReport};
use gpuflow_server::lifecycle::{self, Action};
use gpuflow_server::state::{Alloc, JobRec, Pick};

fn job(yaml: &str) -> JobRec {
    let spec = JobSpec::parse(yaml.as_bytes(), false).unwrap();
    lifecycle::submitted(1, spec, "t", "ana", None, 0)
}

fn phase(s: &str) -> (TaskPhase, Option<i32>) {
    match s.split_once(':') {
        Some(("exited", c)) => (TaskPhase::Exited, Some(c.parse().unwrap())),
        _ => match s {
            "running" => (TaskPhase::Running, None),
            "stopped" => (TaskPhase::Stopped, None),
            "failed-to-start" => (TaskPhase::FailedToStart, None),
            other => panic!("no phase {other:?}"),
        },
    }
}

/// Runs the script against `yaml`'s job and renders every step.
fn check(yaml: &str, script: &str, want: Expect) {
    let mut j = job(yaml);
    let mut out = String::new();
    let mut at = 100;
    for line in script.lines().map(str::trim).filter(|l| !l.is_empty()) {
        at += 10;
        let w: Vec<&str> = line.split_whitespace().collect();
        let kind: Result<Option<gpuflow_server::event::EventKind>, String> = match w[..] {
            ["admit", node] => {
                let n = j.task_count();
                let allocs = (0..n)
                    .map(|i| Alloc {
                        group: 0,
                        index: i,
                        node: node.into(),
                        cpu_milli: 1000,
                        mem_mib: 1024,
                        pick: Pick::Whole(1 << i),
                        gpu_uuids: vec![format!("GPU-{i}")],
                    })
                    .collect();
                Ok(Some(lifecycle::admit(&mut j, "H100", allocs, at)))
            }
            ["report", node, phases, ..] => {
                // `ckpt=T`: the tasks report a checkpoint at T (`max`: 2^64-1).
                let ckpt = w
                    .get(3)
                    .and_then(|c| c.strip_prefix("ckpt="))
                    .map(|c| match c {
                        "max" => u64::MAX,
                        t => t.parse().unwrap(),
                    });
                let reports: Vec<TaskReport> = phases
                    .split(',')
                    .enumerate()
                    .map(|(i, p)| {
                        let (phase, exit_code) = phase(p);
                        TaskReport {
                            job: 1,
                            attempt: j.attempts,
                            group: 0,
                            index: i as u32,
                            phase,
                            exit_code,
                            started_at: Some(at - 5),
                            checkpoint_at: ckpt,
                            stdout: None,
                            message: String::new(),
                            breach: None,
                            usage: None,
                            port: None,
                            ports: Default::default(),
                            image: None,
                            ready: None,
                            stderr: None,
                        }
                    })
                    .collect();
                let refs: Vec<&TaskReport> = reports.iter().collect();
                Ok(lifecycle::report(&mut j, node, &refs, at))
            }
            ["act", action, who] => {
                lifecycle::act(&mut j, Action::parse(action).unwrap(), who, at).map(Some)
            }
            ["preempt", by] => Ok(Some(lifecycle::preempt(
                &mut j,
                by.parse().unwrap(),
                "its queue's guarantee is reclaimed",
                at + 30,
                0.5,
            ))),
            ["evict"] => Ok(lifecycle::evict(
                &mut j,
                at,
                "node n1 no longer holds its allocation",
            )),
            ["lost", node] => Ok(Some(lifecycle::node_lost(&mut j, node, at))),
            ["tick", t] => {
                at = t.parse().unwrap();
                Ok(lifecycle::max_runtime(&mut j, at))
            }
            _ => panic!("no step {line:?}"),
        };
        let kind = match kind {
            Ok(Some(k)) => format!("[{k}]"),
            Ok(None) => "[-]".into(),
            Err(e) => format!("refused: {e}"),
        };
        out += &format!(
            "{line}\n  {} (attempt {}): {} {kind}\n",
            j.state.as_str(),
            j.attempts,
            j.reason
        );
        if let Some(c) = j.last_checkpoint {
            out += &format!("  last checkpoint {c}\n");
        }
    }
    // The ledger: what each attempt held, from when to when.
    for h in &j.held {
        out += &format!(
            "held a{} {}..{} {}m {}\n",
            h.attempt,
            h.from,
            h.to.map_or("open".into(), |t| t.to_string()),
            h.gpu_milli,
            h.model
        );
    }
    want.assert_eq(&out);
}

const GANG: &str = "name: g\nqueue: q\nretry: {limit: 1, backoff_s: 10}\ntasks:\n  - name: w\n    replicas: 2\n    command: [train]\n";

#[test]
fn a_gang_starts_runs_and_succeeds() {
    check(
        GANG,
        "admit n1
         report n1 running
         report n1 running,running
         report n1 exited:0,running
         report n1 exited:0,exited:0",
        expect![[r#"
            admit n1
              admitted (attempt 1): admitted to n1 (attempt 1) [admitted]
            report n1 running
              starting (attempt 1): 1 of 2 tasks started [starting]
            report n1 running,running
              running (attempt 1): 2 tasks running [running]
            report n1 exited:0,running
              running (attempt 1): 2 tasks running [-]
            report n1 exited:0,exited:0
              succeeded (attempt 1): all tasks exited with code 0 [succeeded]
        "#]],
    );
}

#[test]
fn a_failed_task_retries_once_then_fails_the_job() {
    check(
        GANG,
        "admit n1
         report n1 running,exited:3
         report n1 stopped,exited:3
         admit n1
         report n1 failed-to-start,running
         report n1 failed-to-start,stopped",
        expect![[r#"
            admit n1
              admitted (attempt 1): admitted to n1 (attempt 1) [admitted]
            report n1 running,exited:3
              stopping (attempt 1): task 0/1 exited with code 3 [stopping]
            report n1 stopped,exited:3
              pending (attempt 1): task 0/1 exited with code 3; retry 1 of 1 in 10 s [retry]
            admit n1
              admitted (attempt 2): admitted to n1 (attempt 2) [admitted]
            report n1 failed-to-start,running
              stopping (attempt 2): task 0/0 could not start [stopping]
            report n1 failed-to-start,stopped
              failed (attempt 2): task 0/0 could not start [failed]
        "#]],
    );
}

#[test]
fn reports_from_another_node_or_attempt_change_nothing() {
    check(
        GANG,
        "admit n1
         report n2 exited:0,exited:0
         report n1 running,running",
        expect![[r#"
            admit n1
              admitted (attempt 1): admitted to n1 (attempt 1) [admitted]
            report n2 exited:0,exited:0
              admitted (attempt 1): admitted to n1 (attempt 1) [-]
            report n1 running,running
              running (attempt 1): 2 tasks running [running]
        "#]],
    );
}

/// A node that lies about checkpoints (a time far in the future made the
/// job look as if it had no unsaved work, so the cheapest victim) is not
/// believed: a time after the report's is ignored.
#[test]
fn a_checkpoint_reported_in_the_future_is_ignored() {
    check(
        GANG,
        "admit n1
         report n1 running,running ckpt=115
         report n1 running,running ckpt=max
         report n1 running,running ckpt=500
         report n1 running,running ckpt=140",
        expect![[r#"
            admit n1
              admitted (attempt 1): admitted to n1 (attempt 1) [admitted]
            report n1 running,running ckpt=115
              running (attempt 1): 2 tasks running [running]
              last checkpoint 115
            report n1 running,running ckpt=max
              running (attempt 1): 2 tasks running [-]
              last checkpoint 115
            report n1 running,running ckpt=500
              running (attempt 1): 2 tasks running [-]
              last checkpoint 115
            report n1 running,running ckpt=140
              running (attempt 1): 2 tasks running [-]
              last checkpoint 140
        "#]],
    );
}

#[test]
fn a_task_stopped_on_its_node_without_an_order_requeues_a_new_attempt() {
    check(
        GANG,
        "admit n1
         report n1 running,running
         report n1 stopped,running
         report n1 stopped,stopped
         admit n1",
        expect![[r#"
            admit n1
              admitted (attempt 1): admitted to n1 (attempt 1) [admitted]
            report n1 running,running
              running (attempt 1): 2 tasks running [running]
            report n1 stopped,running
              stopping (attempt 1): task 0/0 was stopped on its node [stopping]
            report n1 stopped,stopped
              pending (attempt 1): task 0/0 was stopped on its node; requeued [requeued]
            admit n1
              admitted (attempt 2): admitted to n1 (attempt 2) [admitted]
        "#]],
    );
}

#[test]
fn preemption_eviction_and_lost_nodes_requeue() {
    check(
        GANG,
        "admit n1
         report n1 running,running
         preempt 7
         evict
         report n1 stopped,stopped
         admit n1
         evict
         lost n1
         admit n2
         lost n2",
        expect![[r#"
            admit n1
              admitted (attempt 1): admitted to n1 (attempt 1) [admitted]
            report n1 running,running
              running (attempt 1): 2 tasks running [running]
            preempt 7
              stopping (attempt 1): preempted by job 7: its queue's guarantee is reclaimed; signalled now, killed at 1970-01-01T00:02:40Z (0.50 GPU-hours since the last checkpoint) [preempted]
            evict
              stopping (attempt 1): preempted by job 7: its queue's guarantee is reclaimed; signalled now, killed at 1970-01-01T00:02:40Z (0.50 GPU-hours since the last checkpoint) [-]
            report n1 stopped,stopped
              pending (attempt 1): preempted by job 7: its queue's guarantee is reclaimed; signalled now, killed at 1970-01-01T00:02:40Z (0.50 GPU-hours since the last checkpoint); requeued [requeued]
            admit n1
              admitted (attempt 2): admitted to n1 (attempt 2) [admitted]
            evict
              stopping (attempt 2): evicted: node n1 no longer holds its allocation [evicted]
            lost n1
              pending (attempt 2): node n1 lost; requeued [requeued]
            admit n2
              admitted (attempt 3): admitted to n2 (attempt 3) [admitted]
            lost n2
              pending (attempt 3): node n2 lost; requeued [requeued]
        "#]],
    );
}

#[test]
fn owners_and_admins_act_within_what_each_state_allows() {
    check(
        "name: s\nqueue: q\nmax_runtime_s: 100\ntasks:\n  - name: m\n    command: [serve]\n",
        "act hold admin
         act resume ana
         act release admin
         act suspend ana
         act resume ana
         admit n1
         report n1 running
         act suspend ana
         report n1 stopped
         act resume ana
         admit n1
         report n1 running
         tick 400
         act cancel ana
         report n1 stopped
         act cancel ana",
        expect![[r#"
            act hold admin
              held (attempt 0): held by admin [held]
            act resume ana
              held (attempt 0): held by admin refused: only suspended jobs can be resumed
            act release admin
              pending (attempt 0): released by admin [released]
            act suspend ana
              suspended (attempt 0): suspended by ana [suspended]
            act resume ana
              pending (attempt 0): resumed by ana [resumed]
            admit n1
              admitted (attempt 1): admitted to n1 (attempt 1) [admitted]
            report n1 running
              running (attempt 1): 1 task running [running]
            act suspend ana
              stopping (attempt 1): suspended by ana [stopping]
            report n1 stopped
              suspended (attempt 1): suspended by ana; GPUs released [suspended]
            act resume ana
              pending (attempt 1): resumed by ana [resumed]
            admit n1
              admitted (attempt 2): admitted to n1 (attempt 2) [admitted]
            report n1 running
              running (attempt 2): 1 task running [running]
            tick 400
              stopping (attempt 2): exceeded its max runtime of 100 s [stopping]
            act cancel ana
              stopping (attempt 2): cancelled by ana; stopping [stopping]
            report n1 stopped
              cancelled (attempt 2): cancelled by ana; stopping [cancelled]
            act cancel ana
              cancelled (attempt 2): cancelled by ana; stopping refused: it has finished
        "#]],
    );
}

const GPU_GANG: &str = "name: g\nqueue: q\nretry: {limit: 1, backoff_s: 10}\ntasks:\n  - name: w\n    replicas: 2\n    command: [train]\n    resources: {gpu: {count: 1}}\n";

/// The ledger follows every attempt: preempted, failed and retried,
/// suspended by its owner, lost with its node, each hold closes when the
/// GPUs are released and the next attempt opens its own.
#[test]
fn every_attempt_holds_its_gpus_in_the_ledger_from_admission_to_release() {
    check(
        GPU_GANG,
        "admit n1
         report n1 running,running
         preempt 9
         report n1 stopped,stopped
         admit n2
         report n2 exited:1,running
         report n2 exited:1,stopped
         admit n1
         report n1 running,running
         act suspend ana
         report n1 stopped,stopped
         act resume ana
         admit n3
         lost n3
         admit n1
         report n1 exited:0,exited:0",
        expect![[r#"
            admit n1
              admitted (attempt 1): admitted to n1 (attempt 1) [admitted]
            report n1 running,running
              running (attempt 1): 2 tasks running [running]
            preempt 9
              stopping (attempt 1): preempted by job 9: its queue's guarantee is reclaimed; signalled now, killed at 1970-01-01T00:02:40Z (0.50 GPU-hours since the last checkpoint) [preempted]
            report n1 stopped,stopped
              pending (attempt 1): preempted by job 9: its queue's guarantee is reclaimed; signalled now, killed at 1970-01-01T00:02:40Z (0.50 GPU-hours since the last checkpoint); requeued [requeued]
            admit n2
              admitted (attempt 2): admitted to n2 (attempt 2) [admitted]
            report n2 exited:1,running
              stopping (attempt 2): task 0/0 exited with code 1 [stopping]
            report n2 exited:1,stopped
              pending (attempt 2): task 0/0 exited with code 1; retry 1 of 1 in 10 s [retry]
            admit n1
              admitted (attempt 3): admitted to n1 (attempt 3) [admitted]
            report n1 running,running
              running (attempt 3): 2 tasks running [running]
            act suspend ana
              stopping (attempt 3): suspended by ana [stopping]
            report n1 stopped,stopped
              suspended (attempt 3): suspended by ana; GPUs released [suspended]
            act resume ana
              pending (attempt 3): resumed by ana [resumed]
            admit n3
              admitted (attempt 4): admitted to n3 (attempt 4) [admitted]
            lost n3
              pending (attempt 4): node n3 lost; requeued [requeued]
            admit n1
              admitted (attempt 5): admitted to n1 (attempt 5) [admitted]
            report n1 exited:0,exited:0
              succeeded (attempt 5): all tasks exited with code 0 [succeeded]
            held a1 110..140 2000m H100
            held a2 150..170 2000m H100
            held a3 180..210 2000m H100
            held a4 230..240 2000m H100
            held a5 250..260 2000m H100
        "#]],
    );
}
