//! `fragmentation`: the FGD rule. The score is minus the growth of the node's
//! expected fragmentation (see [`crate::mix`]) caused by the pick, in GPUs.
//!
//! `fgd-kube` is the same rule scored as the FGD paper's simulator scores it:
//! a kube-scheduler score plugin returns a whole number from 0 to 100, and the
//! paper's plugin maps the growth through a sigmoid first. Growths within about
//! 0.04 GPU of each other become equal scores, and kube-scheduler draws among
//! equal nodes at random.

use super::ScoreInput;

/// The placer measures fragmentation before and after the pick (and remembers
/// it per node state); see [`crate::mix::fragmentation`].
pub(crate) fn score(i: &ScoreInput) -> f64 {
    -(i.frag_after - i.frag_before) / 1000.0
}

/// The paper simulator's integer score: `⌊100 · σ(−growth in GPUs)⌋`.
pub(crate) fn score_kube(i: &ScoreInput) -> f64 {
    kube(score(i))
}

/// `⌊100 · σ(x)⌋` for a score `x` in GPUs.
fn kube(x: f64) -> f64 {
    (100.0 / (1.0 + (-x).exp())).floor()
}

#[cfg(test)]
mod tests {
    use super::kube;

    #[test]
    fn the_kube_score_is_a_whole_number_that_makes_near_growths_equal() {
        // Scores are minus the growth: none scores 50, a shrink more.
        assert_eq!(kube(0.0), 50.0);
        assert_eq!(kube(1.0), 73.0);
        // Growths of 0.01 and 0.02 GPU tie; 0.1 and 0.5 do not.
        assert_eq!(kube(-0.01), kube(-0.02));
        assert_eq!(kube(-0.01), 49.0);
        assert!(kube(-0.5) < kube(-0.1));
        assert!(kube(-0.3).fract() == 0.0);
    }
}
