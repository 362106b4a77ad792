//! Calibrated busy work: `spin(iters)` burns CPU for a known time, so "1 µs of work per
//! call" means the same instructions in a plain function, a local proclet, a remote
//! proclet and a raw TCP server.

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

/// Iterations of [`spin`] per microsecond on this machine (median of several timings).
pub fn calibrate() -> f64 {
    let mut rates = Vec::new();
    let mut n = 100_000u64;
    // Grow until one timing takes at least 5 ms.
    loop {
        let t = Instant::now();
        spin(n);
        if t.elapsed() >= Duration::from_millis(5) {
            break;
        }
        n *= 2;
    }
    for _ in 0..9 {
        let t = Instant::now();
        spin(n);
        rates.push(n as f64 / t.elapsed().as_secs_f64() / 1e6);
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

    #[test]
    fn calibration_is_roughly_right() {
        let per_us = calibrate();
        assert!(per_us > 1.0, "{per_us}");
        let n = iters_for(2000.0, per_us);
        let t = Instant::now();
        spin(n);
        let took = t.elapsed().as_secs_f64() * 1e6;
        // Generous: CI machines are noisy.
        assert!(
            took > 500.0 && took < 20_000.0,
            "2000 µs of work took {took} µs"
        );
    }
}
