//! Placement policies: a weighted list of scorers plus how ties are broken.
//! The named policies are the FGD paper's baselines and gpuflow's own.

use crate::error::CoreError;
use crate::mix::Typical;
use crate::placement::scorers::Scorer;

/// How equal-best nodes are chosen between.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum TieBreak {
    /// Uniformly at random from the seeded generator (as kube-scheduler does).
    Random,
    /// The lowest node id.
    First,
}

/// How a GPU is chosen on a node between picks that score the same.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum PickChoice {
    /// The shared GPU left with the least free share (keeps other GPUs whole).
    Tightest,
    /// Uniformly at random (the random baseline).
    Random,
    /// The lowest-numbered GPU (the FGD paper's simulator).
    First,
}

/// A placement policy.
#[derive(Clone, Debug, PartialEq)]
pub struct Policy {
    pub name: String,
    pub scorers: Vec<(Scorer, f64)>,
    pub tie_break: TieBreak,
    pub pick: PickChoice,
    /// Weight of the gang-locality context scorer for multi-task jobs.
    pub gang_locality: f64,
    /// Weight of the spread context scorer for jobs that ask to be spread.
    pub spread: f64,
    /// Which task shapes form the mix the fragmentation scorers expect.
    pub typical: Typical,
}

impl Policy {
    fn of(name: &str, scorers: &[(Scorer, f64)]) -> Policy {
        Policy {
            name: name.to_string(),
            scorers: scorers.to_vec(),
            tie_break: TieBreak::Random,
            pick: PickChoice::Tightest,
            gang_locality: 1.0,
            spread: 1.0,
            typical: Typical::ALL_GPU,
        }
    }

    /// Any node that fits, uniformly at random.
    pub fn random() -> Policy {
        Policy {
            pick: PickChoice::Random,
            ..Policy::of("random", &[])
        }
    }

    pub fn best_fit() -> Policy {
        Policy::of("best-fit", &[(Scorer::BestFit, 1.0)])
    }

    pub fn packing() -> Policy {
        Policy::of("packing", &[(Scorer::Packing, 1.0)])
    }

    pub fn dot_product() -> Policy {
        Policy::of("dot-product", &[(Scorer::DotProduct, 1.0)])
    }

    pub fn clustering() -> Policy {
        Policy::of("clustering", &[(Scorer::Clustering, 1.0)])
    }

    /// The FGD paper's policy as its simulator runs it: least growth of
    /// expected fragmentation scored as a whole number from 0 to 100
    /// ([`Scorer::FgdKube`]); among equal nodes the one whose name sorts
    /// first (the simulator names nodes after a random rank, and its
    /// kube-scheduler is patched to pick the first name, not a random one);
    /// the first of equal GPUs; and the mix of the shapes that cover 95 % of
    /// all tasks, those without GPUs included.
    pub fn fgd() -> Policy {
        Policy {
            tie_break: TieBreak::First,
            pick: PickChoice::First,
            typical: Typical::PAPER,
            ..Policy::of("fgd", &[(Scorer::FgdKube, 1.0)])
        }
    }

    /// gpuflow's default: least growth of fragmentation (FGD), plus least growth
    /// of GPU capacity stranded for lack of CPU, scarce GPU models kept for work
    /// restricted to them, best-fit to separate near ties, and NVLink/NUMA
    /// locality for multi-GPU tasks. Measured on the openb traces (docs/benchmarks.md).
    pub fn gpuflow() -> Policy {
        Policy::of(
            "gpuflow",
            &[
                (Scorer::Fragmentation, 1.0),
                (Scorer::Balance, 0.5),
                (Scorer::Scarcity, 1.0),
                (Scorer::BestFit, 0.05),
                (Scorer::GpuLocality, 0.01),
            ],
        )
    }

    /// The named policies, for simulators and the CLI.
    pub fn named(name: &str) -> Option<Policy> {
        Some(match name {
            "random" => Policy::random(),
            "best-fit" => Policy::best_fit(),
            "packing" => Policy::packing(),
            "dot-product" => Policy::dot_product(),
            "clustering" => Policy::clustering(),
            "fgd" => Policy::fgd(),
            "gpuflow" => Policy::gpuflow(),
            _ => return None,
        })
    }

    /// A named policy, or a weighted sum of scorers such as
    /// `fragmentation+0.1*best-fit` (named `custom:` followed by the spec).
    ///
    /// # Errors
    /// When the spec names no known policy or scorer, or a weight is not a finite number.
    pub fn parse(spec: &str) -> Result<Policy, CoreError> {
        let spec = spec.trim();
        if let Some(p) = Policy::named(spec) {
            return Ok(p);
        }
        let mut scorers = Vec::new();
        for term in spec.split('+') {
            let term = term.trim();
            let (w, name) = match term.split_once('*') {
                Some((w, n)) => {
                    let w: f64 = w.trim().parse().map_err(|_| CoreError::BadPolicy {
                        spec: spec.to_string(),
                        why: format!("weight {:?} is not a number", w.trim()),
                    })?;
                    (w, n.trim())
                }
                None => (1.0, term),
            };
            if !w.is_finite() {
                return Err(CoreError::BadPolicy {
                    spec: spec.to_string(),
                    why: format!("weight {w} is not finite"),
                });
            }
            let scorer = Scorer::ALL
                .iter()
                .copied()
                .find(|s| s.name() == name)
                .ok_or_else(|| CoreError::BadPolicy {
                    spec: spec.to_string(),
                    why: format!(
                        "{name:?} is neither a policy ({}) nor a scorer ({})",
                        Policy::NAMES.join(", "),
                        Scorer::ALL
                            .iter()
                            .map(|s| s.name())
                            .collect::<Vec<_>>()
                            .join(", ")
                    ),
                })?;
            scorers.push((scorer, w));
        }
        Ok(Policy::of(&format!("custom:{spec}"), &scorers))
    }

    pub const NAMES: &'static [&'static str] = &[
        "random",
        "dot-product",
        "clustering",
        "packing",
        "best-fit",
        "fgd",
        "gpuflow",
    ];

    pub(crate) fn uses(&self, s: Scorer) -> bool {
        self.scorers.iter().any(|(x, w)| *x == s && *w != 0.0)
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn policies_parse_by_name_or_as_weighted_scorers() {
        assert_eq!(Policy::parse("best-fit").unwrap(), Policy::best_fit());
        let p = Policy::parse("fragmentation + 0.5*balance").unwrap();
        assert_eq!(
            p.scorers,
            vec![(Scorer::Fragmentation, 1.0), (Scorer::Balance, 0.5)]
        );
        assert_eq!(p.name, "custom:fragmentation + 0.5*balance");
        let e = Policy::parse("fastest").unwrap_err().to_string();
        assert!(
            e.contains("neither a policy") && e.contains("best-fit") && e.contains("scarcity"),
            "{e}"
        );
        let e = Policy::parse("x*packing").unwrap_err().to_string();
        assert!(e.contains("weight \"x\" is not a number"), "{e}");
        assert!(Policy::parse("inf*packing").is_err());
        for name in Policy::NAMES {
            assert_eq!(Policy::named(name).unwrap().name, *name);
        }
    }
}
