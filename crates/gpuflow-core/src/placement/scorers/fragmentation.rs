//! `fragmentation`: the FGD rule. The score is minus the growth of the node's
//! expected fragmentation (see [`crate::mix`]) caused by the pick, in GPUs.

use super::ScoreInput;

/// The placer measures fragmentation before and after the pick (and remembers
/// it per node state); see [`crate::mix::fragmentation`].
pub(crate) fn score(i: &ScoreInput) -> f64 {
    -(i.frag_after - i.frag_before) / 1000.0
}
