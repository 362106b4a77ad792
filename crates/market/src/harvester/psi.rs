//! The PSI policy (Senpai's, as in Meta's TMO), free of I/O: every period, probe the
//! limit down while memory stall time stays under a target, in proportion to how far
//! under it is; above the target, back off in proportion to how far above.
//!
//! With `p` the stall seconds per second over the period and `t` the target:
//! `p <= t` lowers by `chunk × (1 − p/t)`; `p > t` raises by
//! `chunk × min(max_backoff, (p − t)/t)`.

use super::policy::Decision;

/// The PSI policy's parameters.
#[derive(Clone, Copy, Debug)]
pub struct PsiPolicy {
    pub target: f64,
    pub chunk: u64,
    /// The largest back-off, in chunks.
    pub max_backoff: f64,
}

impl PsiPolicy {
    pub fn new(target: f64, chunk: u64) -> PsiPolicy {
        PsiPolicy {
            target,
            chunk,
            max_backoff: 4.0,
        }
    }

    /// Decide from the stall rate (seconds per second) of the last period.
    pub fn step(&self, stall: f64) -> Decision {
        let stall = if stall.is_finite() {
            stall.max(0.0)
        } else {
            1.0
        };
        let target = self.target.max(1e-9);
        let bytes = |f: f64| (self.chunk as f64 * f).round() as u64;
        if stall <= target {
            match bytes(1.0 - stall / target) {
                0 => Decision::Hold,
                n => Decision::Lower(n),
            }
        } else {
            let over = ((stall - target) / target).min(self.max_backoff);
            match bytes(over) {
                0 => Decision::Hold,
                n => Decision::Raise(n),
            }
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn probes_in_proportion_to_the_distance_under_the_target() {
        let p = PsiPolicy::new(0.01, 1000);
        assert_eq!(p.step(0.0), Decision::Lower(1000));
        assert_eq!(p.step(0.005), Decision::Lower(500));
        assert_eq!(p.step(0.01), Decision::Hold);
    }

    #[test]
    fn backs_off_in_proportion_to_stall_with_a_cap() {
        let p = PsiPolicy::new(0.01, 1000);
        assert_eq!(p.step(0.015), Decision::Raise(500));
        assert_eq!(p.step(0.02), Decision::Raise(1000));
        assert_eq!(p.step(0.5), Decision::Raise(4000));
        assert_eq!(p.step(f64::NAN), Decision::Raise(4000));
    }
}
