//! `random`: each decision goes to an eligible worker drawn uniformly (SMG's `random`,
//! `peer-policies.md` §9). A baseline to A/B against on one's own fleet.

use crate::decision::Reason;
use crate::policy::{Choice, Choosing, Policy};

/// The `random` policy.
pub(crate) struct Random;

impl Policy for Random {
    fn choose(&self, c: &mut Choosing<'_>) -> Choice {
        let chosen = (c.draw % c.scored.len() as u64) as usize;
        Choice { chosen, reason: Reason::Baseline(crate::policy_name::PolicyName::Random), enforce: None }
    }
}
