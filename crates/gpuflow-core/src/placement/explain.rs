//! Why a job could not be placed, as data: the task group that failed, which
//! rule rejected how many nodes, and any topology note. Rendered for people as
//! "needs 8 whole GPUs (H100) on one node: 12 nodes have too few free GPUs, 3 are cordoned".

use std::fmt;

use super::Reject;
use crate::ids::JobId;
use crate::request::{TaskRequest, Topology};

/// A job that could not be placed in this cycle, and why.
#[derive(Clone, Debug, PartialEq)]
pub struct Unplaced {
    pub job: JobId,
    /// The task group whose task found no node.
    pub group: String,
    pub request: TaskRequest,
    /// Tasks in the whole job.
    pub tasks: u64,
    /// Nodes considered.
    pub nodes: u32,
    /// Nodes rejected per rule, most common first.
    pub rejections: Vec<(Reject, u32)>,
    /// Set when the job fits the cluster but not any single topology domain.
    pub topology: Option<Topology>,
}

impl fmt::Display for Unplaced {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        write!(f, "{}: needs {}", self.group, self.request.gpu)?;
        if !self.request.models.is_empty() {
            write!(f, " ({})", self.request.models.join("|"))?;
        }
        if self.request.gpu.milli() >= 2000 {
            write!(f, " on one node")?;
        }
        let cpu = self.request.cpu.0;
        if cpu > 0 {
            let cores = if cpu.is_multiple_of(1000) {
                format!("{}", cpu / 1000)
            } else {
                format!("{:.2}", cpu as f64 / 1000.0)
            };
            write!(f, ", {cores} CPU")?;
        }
        let mem = self.request.mem.0;
        if mem > 0 {
            let mem = if mem.is_multiple_of(1024) {
                format!("{} GiB", mem / 1024)
            } else {
                format!("{mem} MiB")
            };
            write!(f, ", {mem} memory")?;
        }
        if let Some(t) = self.topology {
            write!(
                f,
                "; the job's {} tasks fit the cluster but no single {} has room for all of them",
                self.tasks,
                t.level.as_str()
            )?;
            return Ok(());
        }
        let parts: Vec<String> = self
            .rejections
            .iter()
            .map(|(r, n)| {
                format!(
                    "{n} node{} {}",
                    if *n == 1 { "" } else { "s" },
                    singular(r.phrase(), *n)
                )
            })
            .collect();
        if parts.is_empty() {
            write!(f, ": the cluster has no nodes")
        } else {
            write!(f, ": {}", parts.join(", "))
        }
    }
}

fn singular(phrase: &str, n: u32) -> String {
    if n != 1 {
        return phrase.to_string();
    }
    phrase
        .replacen("are ", "is ", 1)
        .replacen("have ", "has ", 1)
        .replacen("lack ", "lacks ", 1)
}

/// Adds `n` nodes rejected by `r` to a tally.
pub(crate) fn tally(into: &mut Vec<(Reject, u32)>, r: Reject, n: u32) {
    match into.iter_mut().find(|(x, _)| *x == r) {
        Some((_, c)) => *c += n,
        None => into.push((r, n)),
    }
}

/// Orders a tally most common first, ties by rule.
pub(crate) fn finish(mut t: Vec<(Reject, u32)>) -> Vec<(Reject, u32)> {
    t.sort_by(|a, b| b.1.cmp(&a.1).then(a.0.cmp(&b.0)));
    t
}
