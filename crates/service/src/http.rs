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
//! Answers: 200 with the handler's response as JSON. A handler whose response is a
//! `Result<T, E>` answers by its outcome: `Ok(v)` is 200 with `v` alone, `Err(e)` is 503
//! with `e`'s text — the way a handler reports that it could not answer (a sharded
//! structure it reads lost a shard with its node, say), which must never look like an
//! answer: not a 200 with `{"Err": ..}` in it, nor an empty result.
//!
//! Errors, each as `{"error": "<text>"}`: 404 for an unknown service (or the wrong route
//! for its kind), 400 for a body or client id that does not parse (with serde's message),
//! 503 when the call failed — the handler's `Err`, or the service could not run the
//! handler (a panic in it, its proclets unreachable or lost for longer than the service
//! waits for a replacement), with the error's text. Bad input never panics, and the
//! server keeps serving.

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

/// Encode a handler's response: its JSON, or for a `Result`, `Ok(v)` as `v`'s JSON and
/// `Err(e)` as a 503 with `e`'s text (see the module docs).
pub(crate) fn encode<T: Serialize>(v: &T) -> Result<Vec<u8>, HttpError> {
    let failed =
        |e: &dyn std::fmt::Display| HttpError::Unavailable(format!("encoding the response: {e}"));
    match v.serialize(ResultProbe) {
        Ok(Outcome::Ok(body)) => Ok(body),
        Ok(Outcome::Err(text)) => Err(HttpError::Unavailable(text)),
        Err(Probe::Failed(e)) => Err(failed(&e)),
        Err(Probe::NotAResult) => serde_json::to_vec(v).map_err(|e| failed(&e)),
    }
}

// ----- telling a `Result` response apart ------------------------------------------------
//
// Handlers are plain functions returning any serializable `Resp`, so the front door
// cannot ask the type system whether `Resp` is a `Result` (that would take
// specialization). It asks serde instead: `Result` serializes as the newtype variant
// `Ok` or `Err` of an enum named `Result`, and `ResultProbe` accepts exactly that shape
// and refuses everything else at its first step, so the probe costs nothing for other
// responses.

/// What a `Result` response comes to.
enum Outcome {
    /// `Ok(v)`: `v`'s JSON.
    Ok(Vec<u8>),
    /// `Err(e)`: `e`'s text (a string as it is, anything else as its JSON).
    Err(String),
}

/// Why the probe did not produce an [`Outcome`].
#[derive(Debug)]
enum Probe {
    /// The response is not a `Result`: encode it as it is.
    NotAResult,
    /// It is one, and its value could not be encoded.
    Failed(String),
}

impl std::fmt::Display for Probe {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        match self {
            Probe::NotAResult => f.write_str("not a Result"),
            Probe::Failed(m) => f.write_str(m),
        }
    }
}

impl std::error::Error for Probe {}

impl serde::ser::Error for Probe {
    fn custom<M: std::fmt::Display>(msg: M) -> Self {
        Probe::Failed(msg.to_string())
    }
}

/// The serializer that recognizes a `Result` (see above).
struct ResultProbe;

/// Every other shape of value is not a `Result`.
macro_rules! not_a_result {
    ($($method:ident($($arg:ty),*);)*) => {
        $(fn $method(self, $(_: $arg),*) -> Result<Outcome, Probe> {
            Err(Probe::NotAResult)
        })*
    };
}

impl serde::Serializer for ResultProbe {
    type Ok = Outcome;
    type Error = Probe;
    type SerializeSeq = serde::ser::Impossible<Outcome, Probe>;
    type SerializeTuple = serde::ser::Impossible<Outcome, Probe>;
    type SerializeTupleStruct = serde::ser::Impossible<Outcome, Probe>;
    type SerializeTupleVariant = serde::ser::Impossible<Outcome, Probe>;
    type SerializeMap = serde::ser::Impossible<Outcome, Probe>;
    type SerializeStruct = serde::ser::Impossible<Outcome, Probe>;
    type SerializeStructVariant = serde::ser::Impossible<Outcome, Probe>;

    fn serialize_newtype_variant<V: ?Sized + Serialize>(
        self,
        name: &'static str,
        _index: u32,
        variant: &'static str,
        value: &V,
    ) -> Result<Outcome, Probe> {
        let failed = |e: serde_json::Error| Probe::Failed(e.to_string());
        match (name, variant) {
            ("Result", "Ok") => serde_json::to_vec(value).map(Outcome::Ok).map_err(failed),
            ("Result", "Err") => match serde_json::to_value(value).map_err(failed)? {
                serde_json::Value::String(text) => Ok(Outcome::Err(text)),
                other => Ok(Outcome::Err(other.to_string())),
            },
            _ => Err(Probe::NotAResult),
        }
    }

    not_a_result! {
        serialize_bool(bool);
        serialize_i8(i8);
        serialize_i16(i16);
        serialize_i32(i32);
        serialize_i64(i64);
        serialize_u8(u8);
        serialize_u16(u16);
        serialize_u32(u32);
        serialize_u64(u64);
        serialize_f32(f32);
        serialize_f64(f64);
        serialize_char(char);
        serialize_str(&str);
        serialize_bytes(&[u8]);
        serialize_none();
        serialize_unit();
        serialize_unit_struct(&'static str);
        serialize_unit_variant(&'static str, u32, &'static str);
    }

    fn serialize_some<V: ?Sized + Serialize>(self, _: &V) -> Result<Outcome, Probe> {
        Err(Probe::NotAResult)
    }

    fn serialize_newtype_struct<V: ?Sized + Serialize>(
        self,
        _: &'static str,
        _: &V,
    ) -> Result<Outcome, Probe> {
        Err(Probe::NotAResult)
    }

    fn serialize_seq(self, _: Option<usize>) -> Result<Self::SerializeSeq, Probe> {
        Err(Probe::NotAResult)
    }

    fn serialize_tuple(self, _: usize) -> Result<Self::SerializeTuple, Probe> {
        Err(Probe::NotAResult)
    }

    fn serialize_tuple_struct(
        self,
        _: &'static str,
        _: usize,
    ) -> Result<Self::SerializeTupleStruct, Probe> {
        Err(Probe::NotAResult)
    }

    fn serialize_tuple_variant(
        self,
        _: &'static str,
        _: u32,
        _: &'static str,
        _: usize,
    ) -> Result<Self::SerializeTupleVariant, Probe> {
        Err(Probe::NotAResult)
    }

    fn serialize_map(self, _: Option<usize>) -> Result<Self::SerializeMap, Probe> {
        Err(Probe::NotAResult)
    }

    fn serialize_struct(self, _: &'static str, _: usize) -> Result<Self::SerializeStruct, Probe> {
        Err(Probe::NotAResult)
    }

    fn serialize_struct_variant(
        self,
        _: &'static str,
        _: u32,
        _: &'static str,
        _: usize,
    ) -> Result<Self::SerializeStructVariant, Probe> {
        Err(Probe::NotAResult)
    }
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

    fn body(r: Result<Vec<u8>, HttpError>) -> String {
        String::from_utf8(r.expect("a 200")).expect("UTF-8")
    }

    #[test]
    fn responses_are_their_json_and_results_answer_by_their_outcome() {
        assert_eq!(body(encode(&vec![2u64, 3])), "[2,3]");
        assert_eq!(body(encode(&Some("a"))), "\"a\"");
        assert_eq!(body(encode(&())), "null");
        // A result: its value alone, or a 503 with the error's text.
        assert_eq!(body(encode(&Ok::<Vec<u64>, String>(vec![2, 3]))), "[2,3]");
        assert_eq!(body(encode(&Ok::<(), String>(()))), "null");
        match encode(&Err::<Vec<u64>, String>(
            "node n2 is unreachable: gone".into(),
        )) {
            Err(HttpError::Unavailable(m)) => assert_eq!(m, "node n2 is unreachable: gone"),
            other => panic!("{other:?}"),
        }
        // An error that is not a string: its JSON.
        #[derive(Serialize)]
        enum Why {
            Missing { key: u32 },
        }
        match encode(&Err::<u8, Why>(Why::Missing { key: 7 })) {
            Err(HttpError::Unavailable(m)) => assert_eq!(m, r#"{"Missing":{"key":7}}"#),
            other => panic!("{other:?}"),
        }
        // Results inside other values, and look-alike shapes, are plain data.
        assert_eq!(
            body(encode(&vec![Ok::<u8, String>(1), Err("x".into())])),
            r#"[{"Ok":1},{"Err":"x"}]"#
        );
        assert_eq!(body(encode(&Some(Err::<u8, u8>(1)))), r#"{"Err":1}"#);
        #[derive(Serialize)]
        struct Wrapped(Result<u8, String>);
        assert_eq!(body(encode(&Wrapped(Err("x".into())))), r#"{"Err":"x"}"#);
        #[derive(Serialize)]
        enum Answer {
            Err(String),
        }
        assert_eq!(body(encode(&Answer::Err("x".into()))), r#"{"Err":"x"}"#);
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
