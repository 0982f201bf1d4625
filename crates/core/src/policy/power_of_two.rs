//! `power_of_two`: two distinct eligible workers drawn at random, the less loaded of them wins
//! (`peer-policies.md` §2). SMG scores the pair with its expected-wait formula; kvgate scores it with
//! its own load-only projected seconds (the `least_load` score), so the A/B against `least_load`
//! isolates what sampling two instead of all costs.

use crate::decision::Reason;
use crate::policy::{Choice, Choosing, Policy};

/// The `power_of_two` policy.
pub(crate) struct PowerOfTwo;

/// Two distinct indices below `n` (n ≥ 2) from one draw: the first uniform, the second uniform over
/// the others.
pub(crate) fn pair(n: usize, draw: u64) -> (usize, usize) {
    let n = n as u64;
    let i = draw % n;
    let j = (i + 1 + (draw / n) % (n - 1)) % n;
    (i as usize, j as usize)
}

impl Policy for PowerOfTwo {
    fn choose(&self, c: &mut Choosing<'_>) -> Choice {
        let reason = Reason::Baseline(crate::policy_name::PolicyName::PowerOfTwo);
        if c.scored.len() < 2 {
            return Choice { chosen: 0, reason, enforce: None };
        }
        let (i, j) = pair(c.scored.len(), c.draw);
        let load = |k: usize| c.scored[k].terms.load_only_s;
        // An exact tie goes to the first drawn, itself uniform.
        let chosen = if load(j) < load(i) { j } else { i };
        Choice { chosen, reason, enforce: None }
    }
}

#[cfg(test)]
mod tests {
    use super::pair;

    #[test]
    fn a_pair_is_two_distinct_workers_and_every_pair_can_be_drawn() {
        for n in 2..7usize {
            let mut seen = std::collections::BTreeSet::new();
            for draw in 0..(n * n * 4) as u64 {
                let (i, j) = pair(n, draw);
                assert!(i != j && i < n && j < n, "n {n} draw {draw}: {i} {j}");
                seen.insert((i, j));
            }
            assert_eq!(seen.len(), n * (n - 1), "n {n}: every ordered pair");
        }
    }
}
