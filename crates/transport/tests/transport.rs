//! Transport behaviour over real loopback sockets: request/response, pipelining,
//! handshake refusals, garbage input, closing.

use granule_transport::{
    serve, Connection, Handler, Identity, Listener, Responder, TransportConfig, TransportError,
};
use granule_wire::{Frame, Msg, RemoteError, Role};
use std::io::Write;
use std::sync::Arc;
use std::time::Duration;

/// Answers every request with its own tail (echo); `Msg::Destroy` is never answered
/// (the responder is dropped) to check that callers still get an error.
struct Echo;
impl Handler for Echo {
    fn on_request(&self, _c: &Arc<Connection>, frame: Frame, reply: Responder) {
        match frame.msg {
            Msg::Destroy { .. } => drop(reply),
            _ => {
                let _ = reply.send(&Msg::Value, &frame.tail);
            }
        }
    }
}

fn host(h: u8) -> Arc<Identity> {
    Arc::new(Identity {
        role: Role::Node,
        node: None,
        binary: Some([h; 32]),
        program: format!("prog{h}"),
    })
}

async fn server(identity: Arc<Identity>) -> String {
    let l = Listener::bind("127.0.0.1:0").await.unwrap();
    let addr = l.local_addr().to_string();
    tokio::spawn(serve(
        l,
        identity,
        Arc::new(TransportConfig::default()),
        Arc::new(Echo),
    ));
    addr
}

/// `n` requests in flight at once on `c`, each carrying its index; all must succeed.
async fn concurrent_requests(c: &Arc<Connection>, n: u32) {
    let mut futs = Vec::new();
    for i in 0..n {
        let c = c.clone();
        futs.push(tokio::spawn(async move {
            c.request(&Msg::Done, &i.to_le_bytes()).await.unwrap()
        }));
    }
    for f in futs {
        f.await.unwrap();
    }
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn request_response_and_pipelining() {
    let addr = server(host(1)).await;
    let c = Connection::connect(
        &addr,
        host(1),
        Arc::new(TransportConfig::default()),
        Arc::new(Echo),
    )
    .await
    .unwrap();
    assert!(c.peer().unwrap().verified);
    let f = c.request(&Msg::Ping, &[]).await.unwrap();
    assert_eq!(f.msg, Msg::Pong);
    // 2000 requests in flight at once, each with a distinct payload, some large.
    let mut futs = Vec::new();
    for i in 0..2000u32 {
        let c = c.clone();
        futs.push(tokio::spawn(async move {
            let payload: Vec<u8> = if i % 100 == 0 {
                vec![(i % 251) as u8; 200_000]
            } else {
                i.to_le_bytes().to_vec()
            };
            let f = c.request(&Msg::Done, &payload).await.unwrap();
            assert_eq!(&f.tail[..], &payload[..]);
        }));
    }
    for f in futs {
        f.await.unwrap();
    }
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn dropped_responder_answers_with_error() {
    let addr = server(host(1)).await;
    let c = Connection::connect(
        &addr,
        host(1),
        Arc::new(TransportConfig::default()),
        Arc::new(Echo),
    )
    .await
    .unwrap();
    let f = c
        .request(
            &Msg::Destroy {
                proclet: granule_wire::ProcletId(1),
            },
            &[],
        )
        .await
        .unwrap();
    assert!(matches!(f.msg, Msg::Error(RemoteError::Internal(_))));
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn binary_mismatch_is_refused_with_explanation() {
    let addr = server(host(1)).await;
    let err = Connection::connect(
        &addr,
        host(2),
        Arc::new(TransportConfig::default()),
        Arc::new(Echo),
    )
    .await
    .unwrap_err();
    match err {
        TransportError::BinaryMismatch(m) => assert!(m.contains("identical binary"), "{m}"),
        other => panic!("expected a binary mismatch, got {other:?}"),
    }
    // A tool (no binary) is accepted, unverified.
    let tool = Arc::new(Identity::tool(Role::Tool, "status"));
    let c = Connection::connect(
        &addr,
        tool,
        Arc::new(TransportConfig::default()),
        Arc::new(Echo),
    )
    .await
    .unwrap();
    assert!(!c.peer().unwrap().verified);
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn garbage_closes_only_that_connection() {
    let addr = server(host(1)).await;
    for seed in 0..20u64 {
        let mut s = std::net::TcpStream::connect(&addr).unwrap();
        let mut x = seed.wrapping_mul(0x9E3779B97F4A7C15) | 1;
        let junk: Vec<u8> = (0..4096)
            .map(|_| {
                x ^= x << 13;
                x ^= x >> 7;
                x ^= x << 17;
                x as u8
            })
            .collect();
        let _ = s.write_all(&junk);
    }
    // A frame claiming to be huge before the hello.
    let mut s = std::net::TcpStream::connect(&addr).unwrap();
    let _ = s.write_all(&u32::MAX.to_le_bytes());
    tokio::time::sleep(Duration::from_millis(50)).await;
    let c = Connection::connect(
        &addr,
        host(1),
        Arc::new(TransportConfig::default()),
        Arc::new(Echo),
    )
    .await
    .unwrap();
    let f = c.request(&Msg::Done, b"still serving").await.unwrap();
    assert_eq!(&f.tail[..], b"still serving");
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn close_fails_pending_requests() {
    struct Never;
    impl Handler for Never {
        fn on_request(&self, _c: &Arc<Connection>, _f: Frame, reply: Responder) {
            // Hold the responder forever (leak it) so the request never completes.
            std::mem::forget(reply);
        }
    }
    let l = Listener::bind("127.0.0.1:0").await.unwrap();
    let addr = l.local_addr().to_string();
    tokio::spawn(serve(
        l,
        host(1),
        Arc::new(TransportConfig::default()),
        Arc::new(Never),
    ));
    let c = Connection::connect(
        &addr,
        host(1),
        Arc::new(TransportConfig::default()),
        Arc::new(Echo),
    )
    .await
    .unwrap();
    let c2 = c.clone();
    let waiter = tokio::spawn(async move { c2.request(&Msg::Done, &[]).await });
    tokio::time::sleep(Duration::from_millis(50)).await;
    c.close("test");
    let r = tokio::time::timeout(Duration::from_secs(2), waiter)
        .await
        .unwrap()
        .unwrap();
    assert!(matches!(r, Err(TransportError::Closed { .. })), "{r:?}");
    assert!(c.request(&Msg::Done, &[]).await.is_err());
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn in_flight_limit_bounds_outstanding_requests() {
    let addr = server(host(1)).await;
    let cfg = Arc::new(TransportConfig {
        max_in_flight: 4,
        ..TransportConfig::default()
    });
    let c = Connection::connect(&addr, host(1), cfg, Arc::new(Echo))
        .await
        .unwrap();
    concurrent_requests(&c, 100).await;
}

#[tokio::test]
async fn unreachable_address_is_a_connect_error() {
    let l = std::net::TcpListener::bind("127.0.0.1:0").unwrap();
    let addr = l.local_addr().unwrap().to_string();
    drop(l);
    let err = Connection::connect(
        &addr,
        host(1),
        Arc::new(TransportConfig::default()),
        Arc::new(Echo),
    )
    .await
    .unwrap_err();
    assert!(matches!(err, TransportError::Connect { .. }), "{err:?}");
    assert!(err.never_sent());
}

/// Answers produced while several requests are being served leave in shared writes.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn pipelined_frames_are_coalesced_into_fewer_writes() {
    use std::sync::Mutex;
    struct Spy(Mutex<Option<Arc<Connection>>>);
    impl Handler for Spy {
        fn on_request(&self, c: &Arc<Connection>, frame: Frame, reply: Responder) {
            *self.0.lock().unwrap() = Some(c.clone());
            // Answer from a spawned task, as the runtime does for calls.
            tokio::spawn(async move {
                let _ = reply.send(&Msg::Value, &frame.tail);
            });
        }
    }
    let spy = Arc::new(Spy(Mutex::new(None)));
    let l = Listener::bind("127.0.0.1:0").await.unwrap();
    let addr = l.local_addr().to_string();
    tokio::spawn(serve(
        l,
        host(1),
        Arc::new(TransportConfig::default()),
        spy.clone(),
    ));
    let c = Connection::connect(
        &addr,
        host(1),
        Arc::new(TransportConfig::default()),
        Arc::new(Echo),
    )
    .await
    .unwrap();
    let n = 5000u32;
    concurrent_requests(&c, n).await;
    let server_side = spy.0.lock().unwrap().clone().unwrap();
    let (frames, writes) = server_side.write_stats();
    assert!(frames >= n as u64);
    assert!(
        writes * 4 < frames,
        "answers were not coalesced: {frames} frames in {writes} writes"
    );
    let (frames, writes) = c.write_stats();
    assert!(
        writes * 4 < frames,
        "requests were not coalesced: {frames} frames in {writes} writes"
    );
}
