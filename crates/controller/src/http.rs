//! The controller's HTTP side (owned here): the live dashboard page, the JSON it polls
//! (`/api/cluster`, `/api/events`, `/api/panels`), and the controller's Prometheus
//! metrics (`/metrics`).
//! It only reads the controller's state; nothing here changes the cluster.

use crate::panels::PanelView;
use crate::server::Inner;
use axum::extract::{RawQuery, State as AxState};
use axum::http::{header, StatusCode};
use axum::response::{Html, IntoResponse, Response};
use axum::routing::get;
use axum::{Json, Router};
use granule_wire::{ClusterEvent, NodeInfo, NodeState};
use serde::Serialize;
use std::collections::BTreeMap;
use std::sync::Arc;
use std::time::Instant;

/// The dashboard: one self-contained page (no external scripts or styles).
const DASHBOARD: &str = include_str!("dashboard.html");

/// What `/api/cluster` answers: everything the dashboard draws.
#[derive(Serialize)]
pub struct ClusterView {
    /// The controller's clock, milliseconds since the UNIX epoch.
    pub now_ms: u64,
    pub nodes: Vec<NodeInfo>,
    /// Structures and services and their proclets, summed over the nodes' reports.
    pub structures: Vec<StructureView>,
    /// Recent events numbered above the query's `after` (the last 200 without it).
    pub events: Vec<ClusterEvent>,
    /// Ask with `after=` this next time to get only newer events.
    pub last_seq: u64,
    /// Services sharing the controller (the market's broker), by name.
    #[serde(skip_serializing_if = "BTreeMap::is_empty")]
    pub extensions: BTreeMap<String, serde_json::Value>,
    /// Panels published by layers above the controller (see `/api/panels`).
    pub panels: Vec<PanelView>,
}

/// One structure (or service) across the cluster.
#[derive(Serialize, Debug, PartialEq)]
pub struct StructureView {
    pub group: String,
    /// Its proclets (shards), over all nodes.
    pub proclets: u32,
    pub bytes: u64,
    /// Proclets per node.
    pub by_node: BTreeMap<String, u32>,
}

/// Sum the nodes' per-group reports into one row per structure (dead nodes left out).
pub fn structures(nodes: &[NodeInfo]) -> Vec<StructureView> {
    let mut out: BTreeMap<String, StructureView> = BTreeMap::new();
    for n in nodes.iter().filter(|n| n.state == NodeState::Alive) {
        for g in &n.usage.groups {
            let s = out.entry(g.group.clone()).or_insert_with(|| StructureView {
                group: g.group.clone(),
                proclets: 0,
                bytes: 0,
                by_node: BTreeMap::new(),
            });
            s.proclets += g.proclets;
            s.bytes += g.bytes;
            *s.by_node.entry(n.id.to_string()).or_default() += g.proclets;
        }
    }
    out.into_values().collect()
}

fn query_u64(q: &Option<String>, key: &str) -> Option<u64> {
    q.as_deref()?
        .split('&')
        .filter_map(|kv| kv.split_once('='))
        .find(|(k, _)| *k == key)
        .and_then(|(_, v)| v.parse().ok())
}

pub(crate) fn now_ms() -> u64 {
    std::time::SystemTime::now()
        .duration_since(std::time::UNIX_EPOCH)
        .map_or(0, |d| d.as_millis() as u64)
}

async fn cluster(AxState(inner): AxState<Arc<Inner>>, RawQuery(q): RawQuery) -> Response {
    let st = inner.state.lock();
    let now = Instant::now();
    let nodes = st.list(now);
    let last_seq = st.next_event_seq() - 1;
    let events = match query_u64(&q, "after") {
        Some(after) => st.events_after(after, 500),
        None => st.events_after(last_seq.saturating_sub(200), 200),
    };
    let panels = st.panels.views(now);
    drop(st);
    let extensions = inner
        .ext
        .iter()
        .map(|e| (e.name().to_string(), e.view()))
        .collect();
    Json(ClusterView {
        extensions,
        now_ms: now_ms(),
        structures: structures(&nodes),
        nodes,
        events,
        last_seq,
        panels,
    })
    .into_response()
}

async fn panels(AxState(inner): AxState<Arc<Inner>>) -> Response {
    Json(inner.state.lock().panels.views(Instant::now())).into_response()
}

async fn events(AxState(inner): AxState<Arc<Inner>>, RawQuery(q): RawQuery) -> Response {
    let after = query_u64(&q, "after").unwrap_or(0);
    let limit = query_u64(&q, "limit")
        .unwrap_or(500)
        .min(crate::state::EVENT_LOG as u64);
    Json(inner.state.lock().events_after(after, limit as usize)).into_response()
}

async fn metrics(AxState(inner): AxState<Arc<Inner>>) -> Response {
    // Before recording: gauges set with no recorder installed would go nowhere.
    granule_telemetry::install();
    {
        let st = inner.state.lock();
        let nodes = st.list(Instant::now());
        let alive = nodes.iter().filter(|n| n.state == NodeState::Alive).count();
        metrics::gauge!("granule_controller_nodes", "state" => "alive").set(alive as f64);
        metrics::gauge!("granule_controller_nodes", "state" => "dead")
            .set((nodes.len() - alive) as f64);
        metrics::gauge!("granule_controller_located_proclets").set(st.locations_len() as f64);
        metrics::gauge!("granule_controller_events").set((st.next_event_seq() - 1) as f64);
        metrics::gauge!("granule_controller_panels")
            .set(st.panels.views(Instant::now()).len() as f64);
    }
    if let Some(e) = &inner.ext {
        e.refresh_metrics();
    }
    (
        [(header::CONTENT_TYPE, granule_telemetry::CONTENT_TYPE)],
        granule_telemetry::render(),
    )
        .into_response()
}

async fn dashboard() -> Html<&'static str> {
    Html(DASHBOARD)
}

async fn not_found() -> (StatusCode, &'static str) {
    (
        StatusCode::NOT_FOUND,
        "not found: the controller serves / (dashboard), /api/cluster, /api/events, \
         /api/panels, /metrics\n",
    )
}

pub(crate) fn router(inner: Arc<Inner>) -> Router {
    Router::new()
        .route("/", get(dashboard))
        .route("/api/cluster", get(cluster))
        .route("/api/events", get(events))
        .route("/api/panels", get(panels))
        .route("/metrics", get(metrics))
        .fallback(not_found)
        .with_state(inner)
}

/// Serve until the future is dropped, within the configured bounds
/// ([`crate::ControllerConfig::http`]).
pub(crate) async fn serve(listener: std::net::TcpListener, inner: Arc<Inner>) {
    let listener = match tokio::net::TcpListener::from_std(listener) {
        Ok(l) => l,
        Err(e) => {
            tracing::warn!("the dashboard cannot serve: {e}");
            return;
        }
    };
    let limits = inner.state.lock().config.http;
    granule_http::serve(listener, router(inner), limits, "the dashboard").await;
}

/// Bind the dashboard's address now, so a port in use is reported at start-up.
pub(crate) fn bind(addr: &str) -> Result<std::net::TcpListener, crate::ControllerError> {
    let l = std::net::TcpListener::bind(addr).map_err(|e| {
        crate::ControllerError::Io(format!(
            "cannot serve the dashboard on {addr}: {e} (choose another address with \
             GRANULE_DASHBOARD=IP:PORT or --dashboard; port 0 picks a free one)"
        ))
    })?;
    l.set_nonblocking(true)
        .map_err(|e| crate::ControllerError::Io(format!("dashboard socket: {e}")))?;
    Ok(l)
}

#[cfg(test)]
mod tests {
    use super::*;
    use granule_wire::{GroupUsage, NodeId, NodeSpec, Role, Usage};

    fn node(id: u32, groups: Vec<GroupUsage>, state: NodeState) -> NodeInfo {
        NodeInfo {
            id: NodeId(id),
            role: Role::Node,
            addr: String::new(),
            pid: 1,
            spec: NodeSpec {
                cores: 1.0,
                mem_bytes: 1 << 30,
            },
            usage: Usage {
                groups,
                ..Usage::default()
            },
            state,
            last_seen_ms: 0,
            cgroups: None,
            metrics_addr: None,
        }
    }

    fn g(name: &str, proclets: u32, bytes: u64) -> GroupUsage {
        GroupUsage {
            group: name.into(),
            proclets,
            bytes,
        }
    }

    #[test]
    fn structures_sum_alive_nodes_reports() {
        let nodes = vec![
            node(
                1,
                vec![g("ShardedVec p5", 2, 100), g("service s", 1, 0)],
                NodeState::Alive,
            ),
            node(2, vec![g("ShardedVec p5", 3, 50)], NodeState::Alive),
            node(3, vec![g("ShardedVec p5", 9, 9)], NodeState::Dead),
        ];
        let s = structures(&nodes);
        assert_eq!(s.len(), 2);
        assert_eq!(s[0].group, "ShardedVec p5");
        assert_eq!((s[0].proclets, s[0].bytes), (5, 150));
        assert_eq!(s[0].by_node.get("n2"), Some(&3));
        assert_eq!(s[1].group, "service s");
    }

    #[test]
    fn query_parsing() {
        assert_eq!(
            query_u64(&Some("after=12&limit=3".into()), "after"),
            Some(12)
        );
        assert_eq!(query_u64(&Some("after=x".into()), "after"), None);
        assert_eq!(query_u64(&None, "after"), None);
    }
}
