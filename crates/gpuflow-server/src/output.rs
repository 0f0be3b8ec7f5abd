//! Tasks' output. A node ships each task's stdout and stderr in pieces,
//! each from a byte offset ([`gpuflow_api::LogChunk`]); [`take`] folds them into
//! what the job keeps: every byte in the store's log while the job is under
//! its log limit, and the last 16 KiB of each stream in the job's record
//! whatever the limit. [`texts`] reads it back. Pure, like the lifecycle:
//! the agent protocol commits the pieces `take` returns, the logs endpoint
//! passes in what the store read.
//!
//! A piece the server already has (a heartbeat sent again, an agent
//! restarted) is skipped, a part of it the server has is cut off, and a gap
//! before it (the agent skipped output it could not ship in time) is
//! marked in the text. Only the node a task runs on, or the node that
//! shipped its output before, adds to it.

use std::collections::BTreeMap;

use gpuflow_api::TaskReport;
use gpuflow_store::LogPiece;

pub use crate::state::Mark;
use crate::state::{JobRec, LOG_ATTEMPTS, log_key};

/// The end of each stream kept in the job's record.
pub const TAIL: usize = 16 * 1024;

/// Folds a report's output into `j` (of its current attempt only; from
/// `node` only if the task runs there or `node` shipped its output
/// before). Returns the pieces to append to the store's log, as long as
/// the job stays within `limit` bytes.
pub fn take(j: &mut JobRec, node: &str, r: &TaskReport, limit: u64) -> Vec<LogPiece> {
    let mut pieces = Vec::new();
    if r.attempt != j.attempts || (r.stdout.is_none() && r.stderr.is_none()) {
        return pieces;
    }
    let key = format!("{}/{}/{}", r.attempt, r.group, r.index);
    let placed = j
        .allocs
        .iter()
        .any(|a| a.node == node && a.group == r.group && a.index == r.index);
    for (stream, chunk) in [("out", &r.stdout), ("err", &r.stderr)] {
        let Some(c) = chunk else { continue };
        let mkey = format!("{key}/{stream}");
        let mark = match j.log_marks.get(&mkey) {
            Some(m) if m.node == node => m.clone(),
            Some(_) => continue,
            None if placed => Mark {
                node: node.to_string(),
                ..Mark::default()
            },
            None => continue,
        };
        let end = c.offset.saturating_add(c.len);
        if end <= mark.end {
            continue;
        }
        // Nothing a database refuses: PostgreSQL's text holds no NUL.
        let mut text = c.text.replace('\0', "\u{fffd}");
        if c.offset < mark.end {
            let cut = ceil_boundary(&text, (mark.end - c.offset) as usize);
            text.drain(..cut);
        } else if c.offset > mark.end {
            text.insert_str(
                0,
                &format!(
                    "[gpuflow: {} bytes of output skipped: the task wrote faster than its node ships output]\n",
                    c.offset - mark.end
                ),
            );
        }
        let kept = if mark.kept == mark.end && j.log_kept + text.len() as u64 <= limit {
            j.log_kept += text.len() as u64;
            pieces.push(LogPiece {
                job: j.id,
                attempt: r.attempt,
                group: r.group,
                index: r.index,
                stream: stream.to_string(),
                offset: mark.end.max(c.offset),
                text: text.clone(),
            });
            end
        } else {
            mark.kept
        };
        let tails = if stream == "out" {
            &mut j.logs
        } else {
            &mut j.err_logs
        };
        let tail = tails.entry(key.clone()).or_default();
        tail.push_str(&text);
        let over = ceil_boundary(tail, tail.len().saturating_sub(TAIL));
        tail.drain(..over);
        j.log_marks.insert(
            mkey,
            Mark {
                node: mark.node,
                end,
                kept,
            },
        );
    }
    let oldest = r.attempt.saturating_sub(LOG_ATTEMPTS - 1);
    let recent = |k: &String| log_key(k).is_none_or(|(a, _, _)| a >= oldest);
    j.logs.retain(|k, _| recent(k));
    j.err_logs.retain(|k, _| recent(k));
    j.log_marks
        .retain(|k, _| recent(&k.rsplit_once('/').map_or(k.clone(), |(t, _)| t.to_string())));
    pieces
}

/// The smallest character boundary of `s` at or after `i` (its length at
/// most).
pub fn ceil_boundary(s: &str, i: usize) -> usize {
    (i.min(s.len())..=s.len())
        .find(|&i| s.is_char_boundary(i))
        .unwrap_or(s.len())
}

/// Each task's kept output of one stream (`out` or `err`), by attempt and
/// `(group, index)`: the pieces from the store's log (those of `j`, in the
/// order stored), and where the job went over its log limit (`limit`
/// bytes), a line saying how much is missing before the stream's last
/// 16 KiB.
pub fn texts(
    j: &JobRec,
    pieces: &[LogPiece],
    stream: &str,
    limit: u64,
) -> BTreeMap<u32, BTreeMap<(u16, u32), String>> {
    let tails = if stream == "out" {
        &j.logs
    } else {
        &j.err_logs
    };
    let mut heads: BTreeMap<(u32, u16, u32), String> = BTreeMap::new();
    for p in pieces.iter().filter(|p| p.stream == stream) {
        heads
            .entry((p.attempt, p.group, p.index))
            .or_default()
            .push_str(&p.text);
    }
    let mut out: BTreeMap<u32, BTreeMap<(u16, u32), String>> = BTreeMap::new();
    for (k, tail) in tails {
        let Some((a, g, i)) = log_key(k) else {
            continue;
        };
        let a = if a == u32::MAX { j.attempts } else { a };
        let head = heads.remove(&(a, g, i));
        let text = match j.log_marks.get(&format!("{a}/{g}/{i}/{stream}")) {
            // A record of an older version: its tail is all there is.
            None => head.unwrap_or_else(|| tail.clone()),
            Some(m) => {
                let mut text = head.unwrap_or_default();
                let missing = m.end - m.kept;
                if missing <= tail.len() as u64 {
                    text += &tail[ceil_boundary(tail, tail.len() - missing as usize)..];
                } else {
                    text += &format!(
                        "\n[gpuflow: {} bytes not kept: the job's output went over its log limit of {}; the last {} follow]\n",
                        missing - tail.len() as u64,
                        bytes(limit),
                        bytes(tail.len() as u64)
                    );
                    text += tail;
                }
                text
            }
        };
        out.entry(a).or_default().insert((g, i), text);
    }
    // Attempts older than those the record keeps: the store's part.
    for ((a, g, i), text) in heads {
        out.entry(a).or_default().insert((g, i), text);
    }
    out
}

/// Bytes for people: `16 MiB`, `12.5 KiB`, `300 B`.
fn bytes(n: u64) -> String {
    let units = [(1u64 << 30, "GiB"), (1 << 20, "MiB"), (1 << 10, "KiB")];
    for (size, unit) in units {
        if n >= size {
            let v = n as f64 / size as f64;
            return if v.fract() == 0.0 {
                format!("{v:.0} {unit}")
            } else {
                format!("{v:.1} {unit}")
            };
        }
    }
    format!("{n} B")
}

/// The same for every task's stdout and stderr, by attempt, as the
/// logs endpoint shows them: `name/index` → text.
pub fn by_name(
    j: &JobRec,
    texts: BTreeMap<u32, BTreeMap<(u16, u32), String>>,
) -> BTreeMap<u32, BTreeMap<String, String>> {
    texts
        .into_iter()
        .map(|(a, tasks)| {
            let named = tasks
                .into_iter()
                .map(|((g, i), text)| {
                    let name = j
                        .spec
                        .tasks
                        .get(g as usize)
                        .map_or_else(|| g.to_string(), |t| t.name.clone());
                    (format!("{name}/{i}"), text)
                })
                .collect();
            (a, named)
        })
        .collect()
}
