//! Calibrated busy work: `spin(iters)` burns CPU for a known time, so "1 µs of work per
//! call" means the same instructions in a plain function, a local proclet, a remote
//! proclet and a raw TCP server.

use granule_host::proc::thread_cpu_time;
use std::hint::black_box;
use std::time::{Duration, Instant};

/// Burn `iters` rounds of integer mixing (no memory traffic, not optimizable away).
#[inline(never)]
pub fn spin(iters: u64) -> u64 {
    let mut x: u64 = 0x9E37_79B9_7F4A_7C15;
    for i in 0..iters {
        x = (x.rotate_left(7) ^ i).wrapping_mul(0x2545_F491_4F6C_DD1D);
    }
    black_box(x)
}

/// How long `f` takes on this thread's CPU clock (`CLOCK_THREAD_CPUTIME_ID`): the time
/// it actually ran, not the time it spent waiting for a core another process holds.
/// Falls back to the wall clock where the thread clock cannot be read.
fn cpu_time_of(f: impl FnOnce()) -> Duration {
    let cpu = thread_cpu_time();
    let wall = Instant::now();
    f();
    if cpu.is_zero() {
        wall.elapsed()
    } else {
        thread_cpu_time().saturating_sub(cpu)
    }
}

/// Iterations of [`spin`] per microsecond of CPU time on this machine (median of several
/// timings). Timed on the thread's CPU clock, so a calibration that shares its core with
/// another process is not skewed by the time it waits for the core (with the wall clock
/// it came out up to 4× low under a CPU hog).
pub fn calibrate() -> f64 {
    let mut rates = Vec::new();
    let mut n = 100_000u64;
    // Grow until one timing takes at least 5 ms (bounded, should the clock stand still).
    while n < 1 << 40 {
        if cpu_time_of(|| {
            spin(n);
        }) >= Duration::from_millis(5)
        {
            break;
        }
        n *= 2;
    }
    for _ in 0..9 {
        let took = cpu_time_of(|| {
            spin(n);
        });
        rates.push(n as f64 / took.as_secs_f64().max(1e-9) / 1e6);
    }
    rates.sort_by(|a, b| a.total_cmp(b));
    rates[rates.len() / 2]
}

/// Iterations for `us` microseconds of work at `per_us` iterations per microsecond.
pub fn iters_for(us: f64, per_us: f64) -> u64 {
    (us * per_us).round().max(1.0) as u64
}

#[cfg(test)]
mod tests {
    use super::*;

    /// CPU time, in µs, of `iters` iterations: median of 5 runs, so one run stretched
    /// by the hypervisor taking the vCPU away does not decide.
    fn micros_of(iters: u64) -> f64 {
        let mut t: Vec<f64> = (0..5)
            .map(|_| {
                cpu_time_of(|| {
                    spin(iters);
                })
                .as_secs_f64()
                    * 1e6
            })
            .collect();
        t.sort_by(|a, b| a.total_cmp(b));
        t[2]
    }

    /// Within a factor of 2 of the 2000 µs asked for.
    fn about_2000(took: f64) -> bool {
        (1000.0..4000.0).contains(&took)
    }

    // Both the calibration and this measurement use the thread's CPU clock, so a process
    // competing for the core (which made the wall-clock version fail with "2000 µs of
    // work took 488 µs") stretches neither; the band is narrower than it was.
    #[test]
    fn calibration_is_roughly_right() {
        let per_us = calibrate();
        assert!(per_us > 1.0, "{per_us}");
        let took = micros_of(iters_for(2000.0, per_us));
        assert!(
            about_2000(took),
            "2000 µs of work took {took:.0} µs of CPU time ({per_us:.1} iterations/µs)"
        );
    }

    // The check above can still fail: a calibration off by 4× either way is caught.
    #[test]
    fn a_calibration_off_by_4x_is_caught() {
        let per_us = calibrate();
        assert!(!about_2000(micros_of(iters_for(2000.0, per_us / 4.0))));
        assert!(!about_2000(micros_of(iters_for(2000.0, per_us * 4.0))));
    }
}
