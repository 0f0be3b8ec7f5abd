//! Job dependencies as Slurm writes them (`sbatch --dependency`):
//! `afterok:12:13,afterany:14`, `aftercorr:20`, `singleton`. Every term
//! must hold (`,`); Slurm's `?` (any one term) is refused, not read as `,`.

use schemars::JsonSchema;
use serde::{Deserialize, Serialize};

/// What a dependency waits for of the jobs it names.
#[derive(
    Clone,
    Copy,
    Debug,
    PartialEq,
    Eq,
    PartialOrd,
    Ord,
    Serialize,
    Deserialize,
    JsonSchema,
    strum::IntoStaticStr,
    strum::EnumString,
)]
#[serde(rename_all = "lowercase")]
#[strum(serialize_all = "lowercase")]
pub enum DepKind {
    /// The job has started (or ended without starting).
    After,
    /// The job has ended, however.
    AfterAny,
    /// The job has succeeded.
    AfterOk,
    /// The job has failed, timed out or was cancelled.
    AfterNotOk,
    /// Each element of this array waits for the element with the same
    /// index of the array named to succeed.
    AfterCorr,
}

impl DepKind {
    /// Its name, as Slurm's `--dependency` writes it.
    pub fn as_str(self) -> &'static str {
        self.into()
    }

    fn parse(s: &str) -> Option<DepKind> {
        s.parse().ok()
    }
}

/// A job a dependency names: a job, a whole array (its id), or one
/// element of an array (`ID_INDEX`).
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct DepTarget {
    pub id: u64,
    pub index: Option<u32>,
}

/// One term: a kind and the jobs it names.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct DepTerm {
    pub kind: DepKind,
    pub targets: Vec<DepTarget>,
}

/// A parsed `dependency`.
#[derive(Clone, Debug, Default, PartialEq, Eq)]
pub struct Dependency {
    pub terms: Vec<DepTerm>,
    /// Waits until no earlier job of the same name and user is unfinished.
    pub singleton: bool,
}

/// The most jobs one dependency may name.
pub const MAX_DEPENDENCIES: usize = 100;

impl Dependency {
    /// Parses `afterok:12:13,afterany:14_3,singleton`.
    ///
    /// # Errors
    /// What is wrong, with the form that works.
    pub fn parse(s: &str) -> Result<Dependency, String> {
        let form = "write it as Slurm does: afterok:ID[:ID...], after, afterany, afternotok, \
                    aftercorr or singleton, terms joined by ',' (ID_INDEX names one array element)";
        if s.contains('?') {
            return Err(format!(
                "{s:?}: '?' (any one term) is not supported; join terms with ',' (every term must hold)"
            ));
        }
        let mut out = Dependency::default();
        let mut named = 0;
        for term in s.split(',') {
            let term = term.trim();
            if term == "singleton" {
                out.singleton = true;
                continue;
            }
            let mut parts = term.split(':');
            let head = parts.next().unwrap_or_default();
            let Some(kind) = DepKind::parse(head) else {
                return Err(format!("{s:?}: {head:?} is not a dependency type; {form}"));
            };
            let mut targets = Vec::new();
            for p in parts {
                let p = p.trim();
                if p.contains('+') {
                    return Err(format!(
                        "{s:?}: a time offset ({p:?}) is not supported; name the job alone"
                    ));
                }
                let (id, index) = match p.split_once('_') {
                    Some((a, b)) => (a, Some(b)),
                    None => (p, None),
                };
                let id: u64 = id
                    .parse()
                    .ok()
                    .filter(|&n| n > 0)
                    .ok_or_else(|| format!("{s:?}: {p:?} is not a job id; {form}"))?;
                let index = match index {
                    Some(b) => Some(b.parse::<u32>().map_err(|_| {
                        format!("{s:?}: {p:?}: the array index is not a number; {form}")
                    })?),
                    None => None,
                };
                if kind == DepKind::AfterCorr && index.is_some() {
                    return Err(format!(
                        "{s:?}: aftercorr names a whole array (its id), not an element"
                    ));
                }
                targets.push(DepTarget { id, index });
            }
            if targets.is_empty() {
                return Err(format!("{s:?}: {head} names no job; {form}"));
            }
            named += targets.len();
            out.terms.push(DepTerm { kind, targets });
        }
        if named > MAX_DEPENDENCIES {
            return Err(format!(
                "{s:?}: names {named} jobs; at most {MAX_DEPENDENCIES} (depend on an array by its id)"
            ));
        }
        Ok(out)
    }
}

/// What becomes of a job whose dependency can no longer be met.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq, Serialize, Deserialize, JsonSchema)]
#[serde(rename_all = "lowercase")]
pub enum OnUnmet {
    /// Cancelled, with the reason (Slurm's `kill_invalid_depend`).
    #[default]
    Cancel,
    /// Held with the reason; an admin's release runs it without that
    /// dependency.
    Hold,
}

impl OnUnmet {
    pub fn is_cancel(&self) -> bool {
        *self == OnUnmet::Cancel
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn slurm_forms_parse() {
        let d = Dependency::parse("afterok:12:13,afterany:14_3,singleton").unwrap();
        assert!(d.singleton);
        assert_eq!(d.terms.len(), 2);
        assert_eq!(d.terms[0].kind, DepKind::AfterOk);
        assert_eq!(
            d.terms[0].targets,
            vec![
                DepTarget {
                    id: 12,
                    index: None
                },
                DepTarget {
                    id: 13,
                    index: None
                }
            ]
        );
        assert_eq!(
            d.terms[1].targets,
            vec![DepTarget {
                id: 14,
                index: Some(3)
            }]
        );
        let d = Dependency::parse("singleton").unwrap();
        assert!(d.singleton && d.terms.is_empty());
    }

    #[test]
    fn wrong_forms_say_what_to_write() {
        for (s, says) in [
            ("afterok", "names no job"),
            ("afterok:x", "is not a job id"),
            ("afterok:0", "is not a job id"),
            ("aftrok:12", "is not a dependency type"),
            ("afterok:12?afterany:13", "is not supported"),
            ("after:12+5", "time offset"),
            ("aftercorr:12_3", "whole array"),
            ("afterok:12_x", "array index"),
            ("", "is not a dependency type"),
        ] {
            let e = Dependency::parse(s).unwrap_err();
            assert!(e.contains(says), "{s:?}: {e}");
        }
        let many = format!(
            "afterok:{}",
            (1..=101)
                .map(|n| n.to_string())
                .collect::<Vec<_>>()
                .join(":")
        );
        assert!(
            Dependency::parse(&many)
                .unwrap_err()
                .contains("at most 100")
        );
    }
}
