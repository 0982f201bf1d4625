//! `round_robin`: each decision goes to the next eligible worker in turn (SMG's `round_robin`,
//! `peer-policies.md` §9), whatever it holds or carries. A baseline to A/B against on one's own fleet.

use crate::decision::Reason;
use crate::policy::{Choice, Choosing, Policy};

/// The `round_robin` policy.
pub(crate) struct RoundRobin;

impl Policy for RoundRobin {
    fn choose(&self, c: &mut Choosing<'_>) -> Choice {
        // `turn` counts committed decisions, so a preview shows what the next request would get.
        let chosen = (c.turn % c.scored.len() as u64) as usize;
        Choice { chosen, reason: Reason::Baseline(crate::policy_name::PolicyName::RoundRobin), enforce: None }
    }
}
