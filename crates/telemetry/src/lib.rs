//! Granule's metrics (owned here): one Prometheus recorder per process, installed on
//! first use, that every Granule library records into through the `metrics` crate's
//! macros, and its rendering in Prometheus' text format for the `/metrics` endpoints
//! (each node process, and the controller).
#![forbid(unsafe_code)]

use metrics_exporter_prometheus::{PrometheusBuilder, PrometheusHandle};
use std::sync::OnceLock;

static HANDLE: OnceLock<Option<PrometheusHandle>> = OnceLock::new();

/// Install this process's recorder (once; later calls are free). Returns false when
/// another recorder was installed first (by the application): Granule's metrics then go
/// to that recorder, and [`render`] has nothing of its own to show.
pub fn install() -> bool {
    HANDLE
        .get_or_init(|| {
            // Durations (all of Granule's histograms are in seconds), 10 µs to 10 s:
            // exported as Prometheus histograms, which aggregate across nodes (the
            // exporter's default, summaries, do not).
            let buckets = [
                1e-5, 2.5e-5, 5e-5, 1e-4, 2.5e-4, 5e-4, 1e-3, 2.5e-3, 5e-3, 1e-2, 2.5e-2, 5e-2,
                0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0,
            ];
            let recorder = match PrometheusBuilder::new().set_buckets(&buckets) {
                Ok(b) => b,
                Err(_) => PrometheusBuilder::new(),
            }
            .build_recorder();
            let handle = recorder.handle();
            match metrics::set_global_recorder(recorder) {
                Ok(()) => Some(handle),
                Err(_) => None,
            }
        })
        .is_some()
}

/// Everything recorded in this process, in Prometheus' text exposition format.
pub fn render() -> String {
    install();
    match HANDLE.get().and_then(|h| h.as_ref()) {
        Some(h) => {
            h.run_upkeep();
            h.render()
        }
        None => "# another metrics recorder was installed in this process first\n".into(),
    }
}

/// The content type of [`render`]'s output.
pub const CONTENT_TYPE: &str = "text/plain; version=0.0.4; charset=utf-8";

#[cfg(test)]
mod tests {
    #[test]
    fn renders_what_was_recorded() {
        assert!(super::install());
        metrics::counter!("granule_test_total", "node" => "n1").increment(3);
        let text = super::render();
        assert!(text.contains("granule_test_total{node=\"n1\"} 3"), "{text}");
    }
}
