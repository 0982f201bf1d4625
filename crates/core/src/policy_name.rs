//! The names of the routing policies and the modes the projected one is rolled out in: the
//! vocabulary the configuration, the policies and the decision records share.

use std::fmt;
use std::str::FromStr;

use serde::{Deserialize, Serialize};

use crate::error::CoreError;

/// Which policy decides.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash, Serialize, Deserialize)]
#[serde(rename_all = "snake_case")]
pub enum PolicyName {
    /// Projected seconds without cache credit.
    LeastLoad,
    /// Projected seconds with cache credit from exact KV events.
    Projected,
    /// SMG's event-driven cache-aware rule (a baseline).
    CacheAware,
    /// Each worker in turn (a baseline).
    RoundRobin,
    /// A worker drawn uniformly (a baseline).
    Random,
    /// The less loaded of two workers drawn at random (a baseline).
    PowerOfTwo,
}

impl PolicyName {
    /// Every policy, in the order `--help` lists them.
    pub const ALL: [PolicyName; 6] = [
        PolicyName::Projected,
        PolicyName::LeastLoad,
        PolicyName::CacheAware,
        PolicyName::RoundRobin,
        PolicyName::Random,
        PolicyName::PowerOfTwo,
    ];
}

impl PolicyName {
    /// The name as configured.
    pub fn as_str(self) -> &'static str {
        match self {
            PolicyName::LeastLoad => "least_load",
            PolicyName::Projected => "projected",
            PolicyName::CacheAware => "cache_aware",
            PolicyName::RoundRobin => "round_robin",
            PolicyName::Random => "random",
            PolicyName::PowerOfTwo => "power_of_two",
        }
    }

    /// The mode a policy runs in when none is configured (and, but for projected, always).
    pub fn default_mode(self) -> Mode {
        match self {
            PolicyName::LeastLoad | PolicyName::RoundRobin | PolicyName::Random | PolicyName::PowerOfTwo => Mode::Off,
            PolicyName::Projected | PolicyName::CacheAware => Mode::Enforce,
        }
    }
}

impl fmt::Display for PolicyName {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str(self.as_str())
    }
}

impl FromStr for PolicyName {
    type Err = CoreError;

    fn from_str(s: &str) -> Result<Self, CoreError> {
        PolicyName::ALL.into_iter().find(|p| p.as_str() == s).ok_or_else(|| {
            let names: Vec<&str> = PolicyName::ALL.iter().map(|p| p.as_str()).collect();
            CoreError::InvalidPolicy(format!("unknown policy {s:?}: expected one of {}", names.join(", ")))
        })
    }
}

/// How the projected policy is rolled out.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize, Deserialize)]
#[serde(rename_all = "snake_case")]
pub enum Mode {
    /// Dispatch exactly as `least_load`.
    Off,
    /// Dispatch as `off`, and compute and record what `enforce` would have chosen.
    Shadow,
    /// Dispatch the projected decision, with the hard escape to the load-only winner.
    Enforce,
}

impl Mode {
    /// The mode as configured.
    pub fn as_str(self) -> &'static str {
        match self {
            Mode::Off => "off",
            Mode::Shadow => "shadow",
            Mode::Enforce => "enforce",
        }
    }
}

impl fmt::Display for Mode {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str(self.as_str())
    }
}

impl FromStr for Mode {
    type Err = CoreError;

    fn from_str(s: &str) -> Result<Self, CoreError> {
        match s {
            "off" => Ok(Mode::Off),
            "shadow" => Ok(Mode::Shadow),
            "enforce" => Ok(Mode::Enforce),
            other => {
                Err(CoreError::InvalidPolicy(format!("unknown mode {other:?}: expected one of off, shadow, enforce")))
            }
        }
    }
}
