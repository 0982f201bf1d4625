//! Tunable numbers with their bounds and defaults, for validation and documentation.

use crate::error::CoreError;

/// One tunable number, its bounds and its default, for validation and documentation.
#[derive(Debug, Clone, Copy)]
pub struct Knob {
    /// The knob's configuration name.
    pub name: &'static str,
    /// Smallest accepted value.
    pub min: f64,
    /// Largest accepted value.
    pub max: f64,
    /// The default.
    pub default: f64,
    /// What it does.
    pub meaning: &'static str,
}

impl Knob {
    /// Checks `value` against the bounds.
    pub fn check(&self, value: f64) -> Result<f64, CoreError> {
        if value.is_finite() && value >= self.min && value <= self.max {
            Ok(value)
        } else {
            Err(CoreError::KnobOutOfRange {
                knob: self.name,
                value: format!("{value}"),
                range: format!("a number from {} to {}", self.min, self.max),
            })
        }
    }
}
