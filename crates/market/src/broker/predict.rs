//! One producer's availability predictor: an ARIMA(p,1,0) model of the slabs it can
//! lease (free + leased, as reported), fit by least squares on a recent window and
//! refit periodically, with a last-value predictor run beside it so its error can be
//! reported next to a naive one.
//!
//! Samples are the producer's reports, taken as evenly spaced (one step = the report
//! interval; a report that comes less than half an interval after the previous sample
//! replaces it instead of adding a step). The safety margin the broker subtracts before
//! placing is empirical: the recent shortfalls of the predicted minimum over the
//! horizon against the minimum that came (a split-conformal bound), so it widens by
//! itself for a producer whose availability the model gets wrong.

use std::collections::VecDeque;

/// Samples kept (the fit window is at most this long).
const MAX_SAMPLES: usize = 1024;
/// Shortfalls kept for the margin.
const MAX_SHORTFALLS: usize = 256;
/// The quantile of recent shortfalls used as the margin.
const MARGIN_QUANTILE: f64 = 0.95;
/// Ridge term on the AR coefficients: keeps the normal equations solvable on flat series.
const RIDGE: f64 = 1e-3;

/// A fitted ARIMA(p,1,0): `d_t = c + Σ φ_i d_{t-i} + e_t`, `d_t = x_t - x_{t-1}`.
#[derive(Clone, Debug, PartialEq)]
pub struct ArFit {
    pub c: f64,
    pub phi: Vec<f64>,
    /// Residual standard deviation of the differences.
    pub sigma: f64,
}

impl ArFit {
    /// Fit on the series `x` (oldest first) by least squares. None when `x` is too short
    /// (fewer than `2 (p + 1) + 1` samples).
    pub fn fit(x: &[f64], p: usize) -> Option<ArFit> {
        if p == 0 || x.len() < 2 * (p + 1) + 1 {
            return None;
        }
        let d: Vec<f64> = x.windows(2).map(|w| w[1] - w[0]).collect();
        let k = p + 1;
        // Normal equations A β = b with regressors [1, d_{t-1}, ..., d_{t-p}].
        let mut a = vec![vec![0.0; k]; k];
        let mut b = vec![0.0; k];
        let mut row = vec![0.0; k];
        for t in p..d.len() {
            row[0] = 1.0;
            for i in 1..=p {
                row[i] = d[t - i];
            }
            for i in 0..k {
                b[i] += row[i] * d[t];
                for j in 0..k {
                    a[i][j] += row[i] * row[j];
                }
            }
        }
        let n = (d.len() - p) as f64;
        let scale = a[1..]
            .iter()
            .enumerate()
            .map(|(i, r)| r[i + 1])
            .sum::<f64>()
            / p as f64;
        for (i, r) in a.iter_mut().enumerate().skip(1) {
            r[i] += RIDGE * scale.max(1.0);
        }
        let beta = solve(a, b)?;
        let mut sse = 0.0;
        for t in p..d.len() {
            let mut pred = beta[0];
            for i in 1..=p {
                pred += beta[i] * d[t - i];
            }
            sse += (d[t] - pred).powi(2);
        }
        let sigma = (sse / (n - k as f64).max(1.0)).sqrt();
        // An explosive fit (sum of |φ| ≥ 1 can diverge) forecasts nonsense: damp it.
        let mut phi = beta[1..].to_vec();
        let mass: f64 = phi.iter().map(|f| f.abs()).sum();
        if mass >= 0.98 {
            for f in &mut phi {
                *f *= 0.98 / mass;
            }
        }
        Some(ArFit {
            c: beta[0],
            phi,
            sigma,
        })
    }

    /// Forecast `steps` values after the series `x` (which must hold at least p + 1
    /// samples; shorter: the last value repeated).
    pub fn forecast(&self, x: &[f64], steps: usize) -> Vec<f64> {
        let p = self.phi.len();
        let Some(&last) = x.last() else {
            return vec![0.0; steps];
        };
        if x.len() < p + 1 {
            return vec![last; steps];
        }
        // The last p differences, most recent first.
        let mut hist: VecDeque<f64> = (0..p)
            .map(|i| x[x.len() - 1 - i] - x[x.len() - 2 - i])
            .collect();
        let mut level = last;
        let mut out = Vec::with_capacity(steps);
        for _ in 0..steps {
            let mut d = self.c;
            for (i, f) in self.phi.iter().enumerate() {
                d += f * hist[i];
            }
            level += d;
            out.push(level);
            hist.push_front(d);
            hist.truncate(p);
        }
        out
    }
}

/// Gaussian elimination with partial pivoting; None for a singular system.
fn solve(mut a: Vec<Vec<f64>>, mut b: Vec<f64>) -> Option<Vec<f64>> {
    let n = b.len();
    for col in 0..n {
        let piv = (col..n).max_by(|&i, &j| a[i][col].abs().total_cmp(&a[j][col].abs()))?;
        if a[piv][col].abs() < 1e-12 {
            return None;
        }
        a.swap(col, piv);
        b.swap(col, piv);
        for r in col + 1..n {
            let f = a[r][col] / a[col][col];
            if f == 0.0 {
                continue;
            }
            let pivot_row = a[col].clone();
            for (x, p) in a[r][col..n].iter_mut().zip(&pivot_row[col..n]) {
                *x -= f * p;
            }
            b[r] -= f * b[col];
        }
    }
    let mut x = vec![0.0; n];
    for r in (0..n).rev() {
        let mut s = b[r];
        for c in r + 1..n {
            s -= a[r][c] * x[c];
        }
        x[r] = s / a[r][r];
    }
    x.iter().all(|v| v.is_finite()).then_some(x)
}

/// A forecast made at one sample, checked once the horizon has passed.
#[derive(Clone, Debug)]
struct Check {
    /// Index of the sample the forecast was made at.
    at: u64,
    /// ARIMA's value `horizon` steps ahead, and the minimum of its path.
    arima_end: f64,
    arima_min: f64,
    /// The last value (the naive forecast of every step).
    last: f64,
}

/// A producer's availability predictor (see the module doc).
#[derive(Clone, Debug)]
pub struct Predictor {
    order: usize,
    /// Steps ahead errors are measured at (the prediction horizon in report intervals).
    horizon: usize,
    /// The fit window, in samples.
    window: usize,
    samples: VecDeque<f64>,
    /// Index of `samples[0]` since the first sample.
    first: u64,
    last_sample_ms: Option<u64>,
    step_ms: u64,
    fit: Option<ArFit>,
    checks: VecDeque<Check>,
    shortfalls: VecDeque<f64>,
    /// The [`MARGIN_QUANTILE`] of `shortfalls`, kept as they change (placement asks for
    /// the margin of every producer on every request; sorting each time was the cost).
    shortfall_quantile: f64,
    /// Sum of absolute errors at the horizon, ARIMA and last value, and their count.
    arima_abs: f64,
    last_abs: f64,
    errors: u64,
}

impl Predictor {
    /// `order`: p; `step_ms`: the report interval; `horizon_ms`: how far ahead it is
    /// judged and used.
    pub fn new(order: usize, step_ms: u64, horizon_ms: u64) -> Predictor {
        let step_ms = step_ms.max(1);
        let horizon = horizon_ms.div_ceil(step_ms).max(1) as usize;
        // Long enough for a stable fit, short enough that the drift term follows the
        // current trend (a diurnal swing) instead of averaging it away.
        let window = (6 * horizon).max(10 * (order + 1)).min(MAX_SAMPLES);
        Predictor {
            order: order.max(1),
            horizon,
            window,
            samples: VecDeque::new(),
            first: 0,
            last_sample_ms: None,
            step_ms,
            fit: None,
            checks: VecDeque::new(),
            shortfalls: VecDeque::new(),
            shortfall_quantile: 0.0,
            arima_abs: 0.0,
            last_abs: 0.0,
            errors: 0,
        }
    }

    /// The horizon in steps.
    pub fn horizon_steps(&self) -> usize {
        self.horizon
    }

    /// The step (report interval), ms.
    pub fn step_ms(&self) -> u64 {
        self.step_ms
    }

    /// Add a sample (slabs the producer can lease: free + leased).
    pub fn observe(&mut self, now_ms: u64, value: f64) {
        let replace = matches!(self.last_sample_ms, Some(t) if now_ms < t + self.step_ms / 2);
        if replace {
            if let Some(v) = self.samples.back_mut() {
                *v = value;
            }
            return;
        }
        self.last_sample_ms = Some(now_ms);
        self.samples.push_back(value);
        if self.samples.len() > MAX_SAMPLES {
            self.samples.pop_front();
            self.first += 1;
        }
        let idx = self.first + self.samples.len() as u64 - 1;
        // Score the forecasts whose horizon ends here.
        let h = self.horizon as u64;
        let mut scored = false;
        while self.checks.front().is_some_and(|c| c.at + h <= idx) {
            let Some(c) = self.checks.pop_front() else {
                break;
            };
            if c.at + self.horizon as u64 == idx && c.at + 1 >= self.first {
                let from = (c.at + 1 - self.first) as usize;
                let actual_min = self
                    .samples
                    .range(from..)
                    .copied()
                    .fold(f64::INFINITY, f64::min);
                self.arima_abs += (c.arima_end - value).abs();
                self.last_abs += (c.last - value).abs();
                self.errors += 1;
                self.shortfalls.push_back(c.arima_min - actual_min);
                scored = true;
                if self.shortfalls.len() > MAX_SHORTFALLS {
                    self.shortfalls.pop_front();
                }
            }
        }
        if scored {
            self.shortfall_quantile = Self::quantile(&self.shortfalls);
        }
        if let Some(fit) = &self.fit {
            let x = self.series();
            let path = fit.forecast(&x, self.horizon);
            self.checks.push_back(Check {
                at: idx,
                arima_end: path.last().copied().unwrap_or(value),
                arima_min: path.iter().copied().fold(f64::INFINITY, f64::min),
                last: value,
            });
        }
    }

    /// The fit window as a contiguous series.
    fn series(&self) -> Vec<f64> {
        let n = self.samples.len();
        self.samples
            .range(n.saturating_sub(self.window)..)
            .copied()
            .collect()
    }

    /// Refit on the recent window (keeps the old fit when the window is too short).
    pub fn refit(&mut self) {
        if let Some(f) = ArFit::fit(&self.series(), self.order) {
            self.fit = Some(f);
        }
    }

    /// The current fit, if any.
    pub fn fit(&self) -> Option<&ArFit> {
        self.fit.as_ref()
    }

    /// The last sample.
    pub fn last(&self) -> Option<f64> {
        self.samples.back().copied()
    }

    /// The lowest availability predicted over the next `span_ms` (capped at the horizon),
    /// less the safety margin; the last value less a tenth before the first fit.
    pub fn predicted_min(&self, span_ms: u64) -> f64 {
        let Some(last) = self.last() else {
            return 0.0;
        };
        let steps = (span_ms.div_ceil(self.step_ms).max(1) as usize).min(self.horizon);
        match &self.fit {
            Some(fit) => {
                let path = fit.forecast(&self.series(), steps);
                let low = path.iter().copied().fold(last, f64::min);
                (low - self.margin(last)).max(0.0)
            }
            None => (last * 0.9).max(0.0),
        }
    }

    /// What the shortfall of the predicted minimum has recently been at most (its 95th
    /// percentile, at least 0); a tenth of the last value while fewer than 20 are known.
    pub fn margin(&self, last: f64) -> f64 {
        if self.shortfalls.len() < 20 {
            return 0.1 * last;
        }
        self.shortfall_quantile.max(0.0)
    }

    /// The [`MARGIN_QUANTILE`] of the shortfalls (0 for none).
    fn quantile(shortfalls: &VecDeque<f64>) -> f64 {
        if shortfalls.is_empty() {
            return 0.0;
        }
        let mut s: Vec<f64> = shortfalls.iter().copied().collect();
        let i = ((s.len() as f64 * MARGIN_QUANTILE) as usize).min(s.len() - 1);
        *s.select_nth_unstable_by(i, f64::total_cmp).1
    }

    /// (Σ |ARIMA error|, Σ |last-value error|, count) at the horizon.
    pub fn errors(&self) -> (f64, f64, u64) {
        (self.arima_abs, self.last_abs, self.errors)
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use rand::rngs::StdRng;
    use rand::{Rng, SeedableRng};

    /// An integrated AR(2) series: differences follow d_t = 0.5 + 0.6 d_{t-1} - 0.2 d_{t-2} + e.
    fn ar_series(n: usize, seed: u64) -> Vec<f64> {
        let mut rng = StdRng::seed_from_u64(seed);
        let (mut d1, mut d2, mut x) = (0.0, 0.0, 100.0);
        let mut out = Vec::new();
        for _ in 0..n {
            let e: f64 = rng.random_range(-1.0..1.0);
            let d = 0.5 + 0.6 * d1 - 0.2 * d2 + e;
            d2 = d1;
            d1 = d;
            x += d;
            out.push(x);
        }
        out
    }

    #[test]
    fn fit_recovers_known_ar_coefficients() {
        let x = ar_series(5000, 7);
        let f = ArFit::fit(&x, 2).expect("long series fits");
        assert!((f.phi[0] - 0.6).abs() < 0.05, "{f:?}");
        assert!((f.phi[1] + 0.2).abs() < 0.05, "{f:?}");
        assert!((f.c - 0.5).abs() < 0.1, "{f:?}");
        // e is uniform on -1..1: sd = 1/sqrt(3).
        assert!((f.sigma - 0.577).abs() < 0.05, "{f:?}");
    }

    #[test]
    fn fit_needs_enough_samples() {
        assert!(ArFit::fit(&[1.0, 2.0, 3.0], 2).is_none());
    }

    #[test]
    fn forecast_follows_a_linear_trend() {
        let x: Vec<f64> = (0..50).map(|i| 3.0 * i as f64).collect();
        let f = ArFit::fit(&x, 1).expect("fits");
        let path = f.forecast(&x, 3);
        for (i, v) in path.iter().enumerate() {
            assert!((v - 3.0 * (50 + i) as f64).abs() < 0.5, "{path:?}");
        }
    }

    #[test]
    fn arima_beats_last_value_on_a_trend_with_noise() {
        // A slow sine plus mean-reverting noise, like a producer's diurnal availability.
        let mut rng = StdRng::seed_from_u64(3);
        let mut p = Predictor::new(4, 1000, 12_000);
        let mut noise = 0.0;
        for t in 0..3000u64 {
            noise = 0.5 * noise + rng.random_range(-2.0..2.0);
            let v = 100.0 + 40.0 * (t as f64 / 150.0).sin() + noise;
            p.observe(t * 1000, v);
            if t % 10 == 0 {
                p.refit();
            }
        }
        let (a, l, n) = p.errors();
        assert!(n > 2000);
        assert!(a < l, "arima {} vs last {}", a / n as f64, l / n as f64);
        // The margin is positive and the predicted minimum below the last value.
        let last = p.last().expect("samples");
        assert!(p.margin(last) > 0.0);
        assert!(p.predicted_min(12_000) < last + 1e-9);
    }

    #[test]
    fn margin_is_the_95th_percentile_of_recent_shortfalls() {
        // Long enough that the shortfalls window is full and keeps sliding.
        let mut rng = StdRng::seed_from_u64(11);
        let mut p = Predictor::new(2, 1000, 5000);
        for t in 0..(MAX_SHORTFALLS as u64 * 3) {
            let v = 50.0 + 20.0 * (t as f64 / 40.0).sin() + rng.random_range(-5.0..5.0);
            p.observe(t * 1000, v);
            if t % 7 == 0 {
                p.refit();
            }
            if p.shortfalls.len() >= 20 {
                let mut s: Vec<f64> = p.shortfalls.iter().copied().collect();
                s.sort_by(f64::total_cmp);
                let i = ((s.len() as f64 * MARGIN_QUANTILE) as usize).min(s.len() - 1);
                assert_eq!(p.margin(v), s[i].max(0.0), "at sample {t}");
            }
        }
        assert_eq!(p.shortfalls.len(), MAX_SHORTFALLS);
    }

    #[test]
    fn close_reports_replace_the_last_sample() {
        let mut p = Predictor::new(2, 1000, 5000);
        p.observe(0, 10.0);
        p.observe(100, 20.0);
        assert_eq!(p.samples.len(), 1);
        assert_eq!(p.last(), Some(20.0));
        p.observe(1000, 30.0);
        assert_eq!(p.samples.len(), 2);
    }
}
