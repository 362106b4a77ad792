//! Turning this process's CPU time (read through the host crate) into cores busy.

use std::time::Instant;

use granule_host::proc::process_cpu_seconds;

/// Turns successive CPU-time readings into "cores busy" over each interval.
pub(crate) struct CpuMeter {
    last: Option<(Instant, f64)>,
}

impl CpuMeter {
    pub(crate) fn new() -> Self {
        CpuMeter {
            last: process_cpu_seconds().map(|c| (Instant::now(), c)),
        }
    }

    /// Cores busy since the previous call.
    pub(crate) fn sample(&mut self) -> f64 {
        let now = Instant::now();
        let Some(cpu) = process_cpu_seconds() else {
            return 0.0;
        };
        let busy = match self.last {
            Some((t, c)) => {
                let wall = now.duration_since(t).as_secs_f64();
                if wall > 0.0 {
                    ((cpu - c) / wall).max(0.0)
                } else {
                    0.0
                }
            }
            None => 0.0,
        };
        self.last = Some((now, cpu));
        busy
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn readings_are_plausible() {
        let mut m = CpuMeter::new();
        let t = Instant::now();
        let mut x = 0u64;
        while t.elapsed().as_millis() < 200 {
            x = std::hint::black_box(x.wrapping_mul(31).wrapping_add(1));
        }
        let busy = m.sample();
        assert!(busy > 0.3 && busy < 2.5, "busy={busy}");
    }
}
