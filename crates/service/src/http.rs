//! The HTTP/JSON front door: one axum server per node process, on the node's own worker
//! runtime, serving every service installed on that node.
//!
//! A service is installed on a node by a call to a small pinned proclet there (one per
//! node and service, see `service.rs`): the call's wrapper is monomorphized for the
//! service's request and response types and its handler, so it can build a typed
//! *dispatch* function on that node (JSON bytes → `Req` → routed call → `Resp` → JSON)
//! and register it under the service's name. The first service installed on a node
//! starts the node's server. It serves through `granule-http`, within the node's bounds
//! (`http.max_connections`, `http.header_timeout`, `http.idle_timeout`,
//! `node.fd_reserve`).
//!
//! Routes:
//! - `GET /v1/services`: the services installed here, as JSON.
//! - `POST /v1/services/{name}`: call a stateless service; the body is the request.
//! - `POST /v1/services/{name}/clients/{id}`: call a stateful service for client `id`
//!   (JSON, or a bare string).
//!
//! Errors: 404 for an unknown service (or the wrong route for its kind), 400 for a body or
//! client id that does not parse (with serde's message), 503 when the call itself failed.
//! Bad input never panics, and the server keeps serving.

use axum::body::Bytes;
use axum::extract::{Path, State};
use axum::http::StatusCode;
use axum::response::{IntoResponse, Response};
use axum::routing::{get, post};
use axum::{Json, Router};
use futures::future::BoxFuture;
use parking_lot::{Mutex, RwLock};
use serde::{Deserialize, Serialize};
use std::collections::BTreeMap;
use std::net::{IpAddr, SocketAddr};
use std::sync::{Arc, LazyLock};

/// Why a front-door request failed.
#[derive(Debug)]
pub(crate) enum HttpError {
    /// 404.
    NotFound(String),
    /// 400.
    BadRequest(String),
    /// 503.
    Unavailable(String),
}

impl IntoResponse for HttpError {
    fn into_response(self) -> Response {
        let (code, msg) = match self {
            HttpError::NotFound(m) => (StatusCode::NOT_FOUND, m),
            HttpError::BadRequest(m) => (StatusCode::BAD_REQUEST, m),
            HttpError::Unavailable(m) => (StatusCode::SERVICE_UNAVAILABLE, m),
        };
        (code, Json(serde_json::json!({ "error": msg }))).into_response()
    }
}

/// Serve one request: the client id from the path (stateful services), the body.
pub(crate) type Dispatch = Arc<
    dyn Fn(Option<String>, Bytes) -> BoxFuture<'static, Result<Vec<u8>, HttpError>> + Send + Sync,
>;

/// What `GET /v1/services` lists.
#[derive(Clone, Debug, Serialize, Deserialize, PartialEq, Eq)]
pub struct ServiceListing {
    pub name: String,
    /// `"stateless"` or `"stateful"`.
    pub kind: String,
}

struct Registered {
    kind: &'static str,
    dispatch: Dispatch,
}

type Services = Arc<RwLock<BTreeMap<String, Registered>>>;

struct Server {
    addr: SocketAddr,
    services: Services,
    task: tokio::task::JoinHandle<()>,
}

/// The servers of this process, by the address of the node they serve (a test's driver
/// process may be a node of several clusters over its life, one after another or at
/// once).
static SERVERS: LazyLock<Mutex<BTreeMap<String, Server>>> = LazyLock::new(Default::default);

/// Register `name` on the node whose transport address is `node_key`, starting its server
/// (bound to `ip`, on `port` if free, else an ephemeral one) if it has none running.
/// Returns the server's address.
pub(crate) fn register(
    node_key: &str,
    ip: IpAddr,
    port: u16,
    name: String,
    kind: &'static str,
    dispatch: Dispatch,
) -> Result<SocketAddr, String> {
    let mut servers = SERVERS.lock();
    if servers.get(node_key).is_some_and(|s| s.task.is_finished()) {
        servers.remove(node_key);
    }
    if !servers.contains_key(node_key) {
        let s = start_server(ip, port)?;
        servers.insert(node_key.to_string(), s);
    }
    let s = servers
        .get(node_key)
        .ok_or_else(|| "the front door vanished".to_string())?;
    s.services
        .write()
        .insert(name, Registered { kind, dispatch });
    Ok(s.addr)
}

/// Remove `name` from the node's front door (the server keeps running).
pub(crate) fn unregister(node_key: &str, name: &str) {
    if let Some(s) = SERVERS.lock().get(node_key) {
        s.services.write().remove(name);
    }
}

fn start_server(ip: IpAddr, port: u16) -> Result<Server, String> {
    let listener = match std::net::TcpListener::bind((ip, port)) {
        Ok(l) => l,
        Err(e) if port != 0 => {
            tracing::warn!(
                "front door: port {port} on {ip} unavailable ({e}); using an ephemeral port"
            );
            std::net::TcpListener::bind((ip, 0)).map_err(|e| format!("binding {ip}:0: {e}"))?
        }
        Err(e) => return Err(format!("binding {ip}:{port}: {e}")),
    };
    listener
        .set_nonblocking(true)
        .map_err(|e| format!("front door socket: {e}"))?;
    let addr = listener
        .local_addr()
        .map_err(|e| format!("front door socket: {e}"))?;
    // The bounds of the node's configuration (`http.*`, `node.fd_reserve`).
    let limits = granule_runtime::node_config()
        .map(|c| granule_http::Limits::from_config(&c))
        .unwrap_or_default();
    let services: Services = Default::default();
    let app = Router::new()
        .route("/v1/services", get(list))
        .route("/v1/services/{name}", post(call_stateless))
        .route("/v1/services/{name}/clients/{id}", post(call_client))
        .with_state(services.clone());
    let task = granule_runtime::spawn(async move {
        let l = match tokio::net::TcpListener::from_std(listener) {
            Ok(l) => l,
            Err(e) => {
                tracing::warn!("front door on {addr}: {e}");
                return;
            }
        };
        granule_http::serve(l, app, limits, format!("front door on {addr}")).await;
    })
    .ok_or_else(|| "not on a Granule node".to_string())?;
    tracing::debug!("front door listening on http://{addr}");
    Ok(Server {
        addr,
        services,
        task,
    })
}

async fn list(State(s): State<Services>) -> Json<Vec<ServiceListing>> {
    Json(
        s.read()
            .iter()
            .map(|(name, r)| ServiceListing {
                name: name.clone(),
                kind: r.kind.to_string(),
            })
            .collect(),
    )
}

fn find(s: &Services, name: &str, kind: &'static str) -> Result<Dispatch, HttpError> {
    match s.read().get(name) {
        None => Err(HttpError::NotFound(format!(
            "no service named '{name}' here"
        ))),
        Some(r) if r.kind != kind => Err(HttpError::NotFound(format!(
            "service '{name}' is {}: {}",
            r.kind,
            if r.kind == "stateful" {
                "call POST /v1/services/{name}/clients/{id}"
            } else {
                "call POST /v1/services/{name}"
            }
        ))),
        Some(r) => Ok(r.dispatch.clone()),
    }
}

fn reply(r: Result<Vec<u8>, HttpError>) -> Response {
    match r {
        Ok(body) => (
            StatusCode::OK,
            [(axum::http::header::CONTENT_TYPE, "application/json")],
            body,
        )
            .into_response(),
        Err(e) => e.into_response(),
    }
}

async fn call_stateless(
    State(s): State<Services>,
    Path(name): Path<String>,
    body: Bytes,
) -> Response {
    let d = match find(&s, &name, "stateless") {
        Ok(d) => d,
        Err(e) => return e.into_response(),
    };
    reply(d(None, body).await)
}

async fn call_client(
    State(s): State<Services>,
    Path((name, id)): Path<(String, String)>,
    body: Bytes,
) -> Response {
    let d = match find(&s, &name, "stateful") {
        Ok(d) => d,
        Err(e) => return e.into_response(),
    };
    reply(d(Some(id), body).await)
}

/// Parse a request body.
pub(crate) fn parse_body<T: serde::de::DeserializeOwned>(body: &[u8]) -> Result<T, HttpError> {
    serde_json::from_slice(body)
        .map_err(|e| HttpError::BadRequest(format!("malformed request body: {e}")))
}

/// Parse a client id from the path: as JSON (`42`, `"bob"`, `[1,2]`), else as a bare
/// string (`bob`).
pub(crate) fn parse_id<T: serde::de::DeserializeOwned>(id: &str) -> Result<T, HttpError> {
    serde_json::from_str(id)
        .or_else(|_| serde_json::from_value(serde_json::Value::String(id.to_string())))
        .map_err(|e| HttpError::BadRequest(format!("malformed client id '{id}': {e}")))
}

/// Encode a response.
pub(crate) fn encode<T: Serialize>(v: &T) -> Result<Vec<u8>, HttpError> {
    serde_json::to_vec(v).map_err(|e| HttpError::Unavailable(format!("encoding the response: {e}")))
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn client_ids_parse_as_json_or_bare_strings() {
        assert_eq!(parse_id::<u64>("42").unwrap(), 42);
        assert_eq!(parse_id::<String>("bob").unwrap(), "bob");
        assert_eq!(parse_id::<String>("\"bob\"").unwrap(), "bob");
        assert_eq!(parse_id::<(u32, u32)>("[1,2]").unwrap(), (1, 2));
        match parse_id::<u64>("bob") {
            Err(HttpError::BadRequest(m)) => assert!(m.contains("malformed client id 'bob'")),
            other => panic!("{other:?}"),
        }
    }

    #[test]
    fn bodies_that_do_not_parse_are_bad_requests() {
        assert_eq!(
            parse_body::<(u32, String)>(b"[1, \"a\"]").unwrap(),
            (1, "a".into())
        );
        for bad in [&b"[1, "[..], b"", b"{\"a\":1}", b"\xff"] {
            assert!(matches!(
                parse_body::<(u32, String)>(bad),
                Err(HttpError::BadRequest(_))
            ));
        }
    }
}
