//! Small statistics helpers for benchmarks: [`Summary`] (min/median/max/mean and
//! percentiles of repeated measurements), [`percentile`], and [`Latency`], an HDR
//! histogram of durations with coordinated-omission correction.

use std::time::Duration;

use hdrhistogram::Histogram;
use serde::Serialize;

/// Order statistics of a sample of measurements (e.g. one figure over repeated runs).
#[derive(Debug, Clone, Copy, PartialEq, Serialize)]
pub struct Summary {
    /// Number of values (NaNs excluded).
    pub n: usize,
    /// Smallest value.
    pub min: f64,
    /// Median; for an even count, the mean of the two middle values.
    pub median: f64,
    /// Largest value.
    pub max: f64,
    /// Arithmetic mean.
    pub mean: f64,
    /// 90th percentile (linear interpolation between closest ranks).
    pub p90: f64,
    /// 99th percentile (linear interpolation between closest ranks).
    pub p99: f64,
}

impl Summary {
    /// Summarises `values`, ignoring NaNs. `None` if no (non-NaN) value is given.
    ///
    /// Percentiles interpolate linearly between closest ranks (numpy's default), so the
    /// median of an even count is the mean of the two middle values.
    ///
    /// ```
    /// use granule_report::stats::Summary;
    /// let s = Summary::of(&[4.0, 1.0, 3.0, 2.0]).unwrap();
    /// assert_eq!((s.min, s.median, s.max, s.mean), (1.0, 2.5, 4.0, 2.5));
    /// assert!(Summary::of(&[]).is_none());
    /// ```
    pub fn of(values: &[f64]) -> Option<Summary> {
        let mut v: Vec<f64> = values.iter().copied().filter(|x| !x.is_nan()).collect();
        if v.is_empty() {
            return None;
        }
        v.sort_by(f64::total_cmp);
        let n = v.len();
        let mean = v.iter().sum::<f64>() / n as f64;
        Some(Summary {
            n,
            min: v[0],
            median: percentile_sorted(&v, 0.5),
            max: v[n - 1],
            mean,
            p90: percentile_sorted(&v, 0.9),
            p99: percentile_sorted(&v, 0.99),
        })
    }

    /// `(max - min) / median`: a quick noise indicator for repeated runs.
    pub fn relative_spread(&self) -> f64 {
        (self.max - self.min) / self.median
    }
}

/// The `q`-quantile (`q` in 0..=1, clamped) of `values`, NaNs ignored, interpolating
/// linearly between closest ranks. `None` if there is no value.
pub fn percentile(values: &[f64], q: f64) -> Option<f64> {
    let mut v: Vec<f64> = values.iter().copied().filter(|x| !x.is_nan()).collect();
    if v.is_empty() {
        return None;
    }
    v.sort_by(f64::total_cmp);
    Some(percentile_sorted(&v, q))
}

/// Quantile of a sorted, non-empty slice.
fn percentile_sorted(sorted: &[f64], q: f64) -> f64 {
    let q = if q.is_nan() { 0.5 } else { q.clamp(0.0, 1.0) };
    let h = (sorted.len() - 1) as f64 * q;
    let lo = h.floor() as usize;
    let hi = h.ceil() as usize;
    if lo == hi {
        sorted[lo]
    } else {
        sorted[lo] + (h - lo as f64) * (sorted[hi] - sorted[lo])
    }
}

/// Values above this many nanoseconds (~292 years) are clamped when recorded.
const MAX_NANOS: u64 = i64::MAX as u64;

/// A latency histogram: an auto-resizing `hdrhistogram::Histogram<u64>` of nanoseconds
/// with 3 significant figures.
#[derive(Debug, Clone)]
pub struct Latency {
    hist: Histogram<u64>,
}

impl Default for Latency {
    fn default() -> Self {
        Latency::new()
    }
}

fn nanos(d: Duration) -> u64 {
    u64::try_from(d.as_nanos())
        .unwrap_or(u64::MAX)
        .min(MAX_NANOS)
}

impl Latency {
    /// An empty histogram.
    pub fn new() -> Latency {
        let hist = Histogram::<u64>::new(3)
            .expect("3 significant figures is a valid hdrhistogram configuration");
        Latency { hist }
    }

    /// Records one latency.
    pub fn record(&mut self, d: Duration) {
        let v = nanos(d);
        if self.hist.record(v).is_err() {
            self.hist.saturating_record(v);
        }
    }

    /// Records one latency measured by a load generator that meant to issue a request
    /// every `expected_interval`: when `d` exceeds the interval, the requests that a
    /// stalled closed-loop generator failed to send are back-filled (latencies
    /// `d - interval`, `d - 2·interval`, … down to `interval`), correcting coordinated
    /// omission. A zero interval records `d` alone.
    pub fn record_correct(&mut self, d: Duration, expected_interval: Duration) {
        let v = nanos(d);
        let interval = nanos(expected_interval);
        if interval == 0 {
            self.record(d);
            return;
        }
        if self.hist.record_correct(v, interval).is_err() {
            self.hist.saturating_record(v);
        }
    }

    /// The latency at quantile `q` (0..=1; e.g. 0.99 for p99). Zero if empty.
    pub fn p(&self, q: f64) -> Duration {
        if self.hist.is_empty() {
            return Duration::ZERO;
        }
        let q = if q.is_nan() { 0.5 } else { q.clamp(0.0, 1.0) };
        Duration::from_nanos(self.hist.value_at_quantile(q))
    }

    /// Number of recorded values (including back-filled ones).
    pub fn count(&self) -> u64 {
        self.hist.len()
    }

    /// Whether nothing was recorded.
    pub fn is_empty(&self) -> bool {
        self.hist.is_empty()
    }

    /// Smallest recorded latency (zero if empty).
    pub fn min(&self) -> Duration {
        if self.hist.is_empty() {
            return Duration::ZERO;
        }
        Duration::from_nanos(self.hist.min())
    }

    /// Largest recorded latency (zero if empty).
    pub fn max(&self) -> Duration {
        if self.hist.is_empty() {
            return Duration::ZERO;
        }
        Duration::from_nanos(self.hist.max())
    }

    /// Mean recorded latency (zero if empty).
    pub fn mean(&self) -> Duration {
        Duration::from_secs_f64(self.hist.mean().max(0.0) / 1e9)
    }

    /// Adds all of `other`'s values to this histogram.
    pub fn merge(&mut self, other: &Latency) {
        if self.hist.add(&other.hist).is_err() {
            // Cannot happen with auto-resize; fall back to value-by-value anyway.
            for v in other.hist.iter_recorded() {
                self.hist
                    .saturating_record_n(v.value_iterated_to(), v.count_at_value());
            }
        }
    }

    /// Forgets all values.
    pub fn reset(&mut self) {
        self.hist.reset();
    }

    /// The underlying histogram (values in nanoseconds).
    pub fn histogram(&self) -> &Histogram<u64> {
        &self.hist
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn empty_is_none() {
        assert!(Summary::of(&[]).is_none());
        assert!(Summary::of(&[f64::NAN]).is_none());
        assert!(percentile(&[], 0.5).is_none());
    }

    #[test]
    fn one_element() {
        let s = Summary::of(&[7.5]).unwrap();
        assert_eq!(
            s,
            Summary {
                n: 1,
                min: 7.5,
                median: 7.5,
                max: 7.5,
                mean: 7.5,
                p90: 7.5,
                p99: 7.5
            }
        );
        assert_eq!(s.relative_spread(), 0.0);
    }

    #[test]
    fn even_and_odd_counts() {
        let s = Summary::of(&[3.0, 1.0, 4.0, 2.0]).unwrap();
        assert_eq!(s.n, 4);
        assert_eq!(s.median, 2.5);
        assert_eq!(s.min, 1.0);
        assert_eq!(s.max, 4.0);
        assert_eq!(s.mean, 2.5);
        let s = Summary::of(&[5.0, 1.0, 3.0]).unwrap();
        assert_eq!(s.median, 3.0);
        assert_eq!(s.mean, 3.0);
        let s = Summary::of(&[2.0, 1.0]).unwrap();
        assert_eq!(s.median, 1.5);
    }

    #[test]
    fn percentiles() {
        let v: Vec<f64> = (1..=100).map(f64::from).collect();
        let s = Summary::of(&v).unwrap();
        assert!((s.p90 - 90.1).abs() < 1e-9, "{}", s.p90);
        assert!((s.p99 - 99.01).abs() < 1e-9, "{}", s.p99);
        assert_eq!(s.median, 50.5);
        assert_eq!(percentile(&v, 0.0), Some(1.0));
        assert_eq!(percentile(&v, 1.0), Some(100.0));
        assert_eq!(percentile(&v, 7.0), Some(100.0));
        assert_eq!(percentile(&[10.0, 20.0], 0.25), Some(12.5));
    }

    #[test]
    fn nans_are_ignored() {
        let s = Summary::of(&[f64::NAN, 1.0, 3.0]).unwrap();
        assert_eq!((s.n, s.median, s.max), (2, 2.0, 3.0));
    }

    #[test]
    fn latency_percentiles() {
        let mut l = Latency::new();
        assert_eq!(l.p(0.5), Duration::ZERO);
        for us in 1..=1000u64 {
            l.record(Duration::from_micros(us));
        }
        assert_eq!(l.count(), 1000);
        let close = |d: Duration, us: f64| (d.as_secs_f64() * 1e6 - us).abs() / us < 0.002;
        assert!(close(l.p(0.5), 500.0), "{:?}", l.p(0.5));
        assert!(close(l.p(0.99), 990.0), "{:?}", l.p(0.99));
        assert!(close(l.max(), 1000.0), "{:?}", l.max());
        assert!(close(l.min(), 1.0), "{:?}", l.min());
        assert!(close(l.mean(), 500.5), "{:?}", l.mean());
        // Very large and zero values are accepted (auto-resize / clamping).
        l.record(Duration::from_secs(3600));
        l.record(Duration::ZERO);
        l.record(Duration::MAX);
        assert_eq!(l.count(), 1003);
    }

    #[test]
    fn latency_coordinated_omission() {
        let mut l = Latency::new();
        // One 10 ms stall at a 1 ms expected interval: 10 values (10, 9, ..., 1 ms).
        l.record_correct(Duration::from_millis(10), Duration::from_millis(1));
        assert_eq!(l.count(), 10);
        // A value below the interval is recorded once.
        l.record_correct(Duration::from_micros(100), Duration::from_millis(1));
        assert_eq!(l.count(), 11);
        // A zero interval does no correction.
        l.record_correct(Duration::from_millis(10), Duration::ZERO);
        assert_eq!(l.count(), 12);
    }

    #[test]
    fn latency_merge() {
        let mut a = Latency::new();
        let mut b = Latency::new();
        a.record(Duration::from_micros(10));
        b.record(Duration::from_secs(2));
        b.record(Duration::from_secs(2));
        a.merge(&b);
        assert_eq!(a.count(), 3);
        assert!(a.p(0.9) >= Duration::from_millis(1999));
        assert!(a.p(0.1) <= Duration::from_micros(11));
        a.reset();
        assert!(a.is_empty());
    }
}
