//! Sampling this process's resource use from /proc (CPU time and resident memory).

use std::time::Instant;

/// CPU seconds (user + system) this process has used so far.
pub(crate) fn process_cpu_seconds() -> Option<f64> {
    let stat = std::fs::read_to_string("/proc/self/stat").ok()?;
    // The command name (field 2) may contain spaces; fields after it follow the last ')'.
    let rest = &stat[stat.rfind(')')? + 2..];
    let f: Vec<&str> = rest.split_ascii_whitespace().collect();
    // After the name: state is field 3, so utime (14) and stime (15) are at 11 and 12.
    let utime: f64 = f.get(11)?.parse().ok()?;
    let stime: f64 = f.get(12)?.parse().ok()?;
    Some((utime + stime) / clock_ticks())
}

fn clock_ticks() -> f64 {
    nix::unistd::sysconf(nix::unistd::SysconfVar::CLK_TCK)
        .ok()
        .flatten()
        .map(|v| v as f64)
        .unwrap_or(100.0)
}

/// Resident memory of this process, bytes.
pub(crate) fn resident_bytes() -> u64 {
    let page = nix::unistd::sysconf(nix::unistd::SysconfVar::PAGE_SIZE)
        .ok()
        .flatten()
        .unwrap_or(4096) as u64;
    std::fs::read_to_string("/proc/self/statm")
        .ok()
        .and_then(|s| s.split_ascii_whitespace().nth(1)?.parse::<u64>().ok())
        .map(|pages| pages * page)
        .unwrap_or(0)
}

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
        assert!(process_cpu_seconds().is_some());
        assert!(resident_bytes() > 1 << 20);
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
