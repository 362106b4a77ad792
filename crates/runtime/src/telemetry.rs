//! What a node tells operators (owned here): the queue of cluster events (moves,
//! splits, merges) that the node's heartbeats carry to the controller, and the node's
//! Prometheus `/metrics` endpoint.
//!
//! Counters on paths that already do real work (a migration, a split) are recorded
//! where they happen, through the `metrics` macros into the process's recorder
//! (`granule-telemetry`). What the node already counts for itself (calls served,
//! proclets hosted, memory) is copied into gauges and counters when `/metrics` is
//! scraped, so the call path pays nothing for metrics; so are the pushdown pool's counts
//! (`granule_pushdown_*`: calls by outcome, refusals, late finishes, queue, running, and
//! `granule_pushdown_cpu_cap_failed`, 1 when a CPU cap was asked for but could not be
//! put in force). The recorder is per process: with
//! several nodes in one process (unusual), every node's `/metrics` shows all of them,
//! told apart by the `node` label.

use crate::node::NodeInner;
use granule_wire::{ClusterEvent, EventKind, Kind};
use parking_lot::Mutex;
use std::collections::VecDeque;
use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::{OnceLock, Weak};

/// What a node keeps for `/metrics` beyond what its parts count anyway.
#[derive(Default)]
pub(crate) struct NodeMetrics {
    /// Cores busy at the last heartbeat (`f64` bits).
    pub cores_busy: AtomicU64,
    /// The histogram of remote calls' service time (made on first use: registering it
    /// per call would allocate its labels every time).
    call_latency: OnceLock<metrics::Histogram>,
}

/// Events waiting for the next heartbeat; beyond this the oldest are dropped (and
/// counted): a controller that is away must not make a node hoard memory.
const MAX_QUEUED: usize = 1000;

static QUEUE: Mutex<VecDeque<ClusterEvent>> = Mutex::new(VecDeque::new());
static DROPPED: AtomicU64 = AtomicU64::new(0);

/// Report an event to the controller, with the next heartbeat of a node of this
/// process (splits and merges: use [`record_split`] and [`record_merge`], which also
/// count them).
pub fn report_event(e: ClusterEvent) {
    let mut q = QUEUE.lock();
    if q.len() == MAX_QUEUED {
        q.pop_front();
        DROPPED.fetch_add(1, Ordering::Relaxed);
    }
    q.push_back(e);
}

/// A split of `subject` (e.g. `"ShardedVec p12"`) by `component` (`"sharded"`,
/// `"service"`): counted, and reported to the controller.
pub fn record_split(component: &'static str, subject: String, detail: String) {
    record(EventKind::Split, component, subject, detail);
}

/// A merge, as [`record_split`].
pub fn record_merge(component: &'static str, subject: String, detail: String) {
    record(EventKind::Merge, component, subject, detail);
}

fn record(kind: EventKind, component: &'static str, subject: String, detail: String) {
    granule_telemetry::install();
    let node = crate::here();
    let label = node.map_or_else(|| "none".to_string(), |n| n.to_string());
    let name = if kind == EventKind::Split {
        "granule_splits_total"
    } else {
        "granule_merges_total"
    };
    metrics::counter!(name, "node" => label, "component" => component).increment(1);
    if let Some(node) = node {
        let mut e = ClusterEvent::now(kind, node, subject);
        e.detail = detail;
        report_event(e);
    }
}

/// Count a split or merge without an event (for components whose workers come and go
/// too often for the event log, such as batch jobs).
pub fn count_scaling(component: &'static str, split: bool) {
    granule_telemetry::install();
    let label = crate::here().map_or_else(|| "none".to_string(), |n| n.to_string());
    let name = if split {
        "granule_splits_total"
    } else {
        "granule_merges_total"
    };
    metrics::counter!(name, "node" => label, "component" => component).increment(1);
}

/// Everything queued, oldest first.
pub(crate) fn drain() -> Vec<ClusterEvent> {
    QUEUE.lock().drain(..).collect()
}

/// A move's outcome, for the metrics and the controller's event log.
pub(crate) fn record_move(node: &NodeInner, e: ClusterEvent) {
    granule_telemetry::install();
    let label = node.id.to_string();
    match e.kind {
        EventKind::Migration => {
            metrics::counter!("granule_migrations_total", "node" => label.clone(), "outcome" => "finished")
                .increment(1);
            metrics::counter!("granule_migration_bytes_total", "node" => label.clone())
                .increment(e.bytes);
            metrics::histogram!("granule_migration_duration_seconds", "node" => label)
                .record(e.micros as f64 / 1e6);
        }
        _ => {
            metrics::counter!("granule_migrations_total", "node" => label, "outcome" => "failed")
                .increment(1);
        }
    }
    report_event(e);
}

/// A remote call was served in `took` (from its arrival to its answer being sent,
/// waiting for the proclet included). Local calls are not timed: they must stay cheap.
pub(crate) fn call_served(node: &NodeInner, took: std::time::Duration) {
    node.metrics
        .call_latency
        .get_or_init(|| {
            granule_telemetry::install();
            metrics::histogram!("granule_call_duration_seconds", "node" => node.id.to_string())
        })
        .record(took.as_secs_f64());
}

/// A move begins.
pub(crate) fn record_move_started(node: &NodeInner) {
    granule_telemetry::install();
    metrics::counter!("granule_migrations_total", "node" => node.id.to_string(), "outcome" => "started")
        .increment(1);
}

/// Copy what the node counts for itself into the recorder, then render everything.
fn scrape(node: &NodeInner) -> String {
    granule_telemetry::install();
    let n = node.id.to_string();
    let r = node.monitor.reading();
    metrics::gauge!("granule_node_cores_busy", "node" => n.clone()).set(f64::from_bits(
        node.metrics.cores_busy.load(Ordering::Relaxed),
    ));
    metrics::gauge!("granule_node_memory_used_bytes", "node" => n.clone()).set(r.rss as f64);
    metrics::gauge!("granule_node_memory_budget_bytes", "node" => n.clone())
        .set(node.monitor.budget() as f64);
    metrics::gauge!("granule_node_cgroup_memory_limit_bytes", "node" => n.clone())
        .set(r.cgroup_limit as f64);
    metrics::gauge!("granule_node_proclet_bytes", "node" => n.clone()).set(r.proclet_bytes as f64);
    let counts = node.hosting.counts();
    for (k, name) in [
        (Kind::Compute, "compute"),
        (Kind::Memory, "memory"),
        (Kind::Hybrid, "hybrid"),
    ] {
        metrics::gauge!("granule_node_proclets", "node" => n.clone(), "kind" => name)
            .set(counts[k.index()] as f64);
    }
    metrics::counter!("granule_calls_served_total", "node" => n.clone())
        .absolute(node.hosting.calls_served.load(Ordering::Relaxed));
    metrics::counter!("granule_bytes_received_by_migration_total", "node" => n.clone())
        .absolute(node.migration.received_bytes.load(Ordering::Relaxed));
    metrics::counter!("granule_events_dropped_total").absolute(DROPPED.load(Ordering::Relaxed));
    let (primaries, backups) = node.replication.counts();
    metrics::gauge!("granule_replicated_primaries", "node" => n.clone()).set(primaries as f64);
    metrics::gauge!("granule_backup_copies", "node" => n.clone()).set(backups as f64);
    metrics::counter!("granule_replicated_calls_total", "node" => n.clone())
        .absolute(node.replication.replicated_calls.load(Ordering::Relaxed));
    // A backup's result that differed from its primary's: a closure that is not
    // deterministic (logged with the proclet and the call where it happened).
    metrics::counter!("granule_replica_divergences_total", "node" => n.clone())
        .absolute(node.replication.divergences.load(Ordering::Relaxed));
    scrape_pushdown(node, &n);
    granule_telemetry::render()
}

/// The pushdown pool's figures: calls by outcome, refusals by reason, late finishes, the
/// queue, and whether the CPU cap asked for is in force.
fn scrape_pushdown(node: &NodeInner, n: &str) {
    let p = node.pushdown.snapshot();
    let c = p.counts;
    for (outcome, count) in [
        ("served", c.served),
        ("timed_out", c.timed_out),
        ("cancelled", c.cancelled),
        ("panicked", c.panicked),
    ] {
        metrics::counter!("granule_pushdown_calls_total", "node" => n.to_string(), "outcome" => outcome)
            .absolute(count);
    }
    for (reason, count) in [
        ("over_budget", c.refused_over_budget),
        ("queue_full", c.refused_queue_full),
    ] {
        metrics::counter!("granule_pushdown_refused_total", "node" => n.to_string(), "reason" => reason)
            .absolute(count);
    }
    metrics::counter!("granule_pushdown_late_finishes_total", "node" => n.to_string())
        .absolute(c.late_finishes);
    metrics::gauge!("granule_pushdown_queued", "node" => n.to_string()).set(p.queued as f64);
    metrics::gauge!("granule_pushdown_running", "node" => n.to_string()).set(p.running as f64);
    metrics::gauge!("granule_pushdown_threads", "node" => n.to_string()).set(p.threads as f64);
    metrics::gauge!("granule_pushdown_cpu_cap_cores", "node" => n.to_string())
        .set(p.cap.unwrap_or(0.0));
    metrics::gauge!("granule_pushdown_cpu_cap_failed", "node" => n.to_string())
        .set(if p.cap_failed { 1.0 } else { 0.0 });
}

/// Bind the node's metrics address now (so an error shows at start-up).
pub(crate) fn bind(host: &str) -> std::io::Result<std::net::TcpListener> {
    let l = std::net::TcpListener::bind(format!("{host}:0"))?;
    l.set_nonblocking(true)?;
    Ok(l)
}

/// Serve `/metrics` until the node is gone, within the bounds of the node's
/// configuration (`http.*`, `node.fd_reserve`).
pub(crate) async fn serve(listener: std::net::TcpListener, node: Weak<NodeInner>) {
    use axum::http::header;
    use axum::response::IntoResponse;
    let Ok(listener) = tokio::net::TcpListener::from_std(listener) else {
        return;
    };
    let Some(limits) = node
        .upgrade()
        .map(|n| granule_http::Limits::from_config(&n.config))
    else {
        return;
    };
    let app = axum::Router::new().route(
        "/metrics",
        axum::routing::get(move || {
            let node = node.clone();
            async move {
                match node.upgrade() {
                    Some(n) => (
                        [(header::CONTENT_TYPE, granule_telemetry::CONTENT_TYPE)],
                        scrape(&n),
                    )
                        .into_response(),
                    None => (axum::http::StatusCode::GONE, "node stopped\n").into_response(),
                }
            }
        }),
    );
    granule_http::serve(listener, app, limits, "the node's /metrics").await;
}

#[cfg(test)]
mod tests {
    use super::*;
    use granule_wire::NodeId;

    #[test]
    fn the_queue_is_bounded_and_drains_in_order() {
        drain();
        let before = DROPPED.load(Ordering::Relaxed);
        for i in 0..MAX_QUEUED + 3 {
            report_event(ClusterEvent::now(
                EventKind::Split,
                NodeId(1),
                format!("s{i}"),
            ));
        }
        let got = drain();
        assert_eq!(got.len(), MAX_QUEUED);
        assert_eq!(got[0].subject, "s3");
        assert_eq!(DROPPED.load(Ordering::Relaxed) - before, 3);
        assert!(drain().is_empty());
    }
}
