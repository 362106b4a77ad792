//! YCSB's scrambled Zipfian key chooser, shared by the benchmarks that drive a key-value
//! workload (`consumer`, `harvest`).

use crate::kv_secure::Rng;

/// YCSB's Zipfian generator (Gray et al.), scrambled over the key space as YCSB's
/// default `ScrambledZipfianGenerator` does (hot keys spread over the file).
pub(crate) struct Zipf {
    n: u64,
    theta: f64,
    alpha: f64,
    zetan: f64,
    eta: f64,
}

impl Zipf {
    pub(crate) fn new(n: u64, theta: f64) -> Zipf {
        let zeta = |n: u64| (1..=n).map(|i| 1.0 / (i as f64).powf(theta)).sum::<f64>();
        let zetan = zeta(n);
        let zeta2 = zeta(2);
        Zipf {
            n,
            theta,
            alpha: 1.0 / (1.0 - theta),
            zetan,
            eta: (1.0 - (2.0 / n as f64).powf(1.0 - theta)) / (1.0 - zeta2 / zetan),
        }
    }

    pub(crate) fn next(&self, rng: &mut Rng) -> u64 {
        let u = (rng.next() >> 11) as f64 / (1u64 << 53) as f64;
        let uz = u * self.zetan;
        let rank = if uz < 1.0 {
            0
        } else if uz < 1.0 + 0.5f64.powf(self.theta) {
            1
        } else {
            ((self.n as f64) * (self.eta * u - self.eta + 1.0).powf(self.alpha)) as u64
        };
        // FNV-1a of the rank, as YCSB scrambles.
        let mut h: u64 = 0xcbf2_9ce4_8422_2325;
        for b in rank.min(self.n - 1).to_le_bytes() {
            h ^= b as u64;
            h = h.wrapping_mul(0x100_0000_01b3);
        }
        h % self.n
    }
}
