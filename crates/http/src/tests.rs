//! The bounds, on real sockets: a normal request still works, the cap answers 503 and
//! closes at once, a slow-header client and an idle keep-alive connection are closed,
//! a running request is not cut, the descriptor reserve refuses.

use super::*;
use axum::routing::get;
use tokio::io::{AsyncReadExt, AsyncWriteExt};

fn app() -> Router {
    Router::new().route("/", get(|| async { "hello" })).route(
        "/slow",
        get(|| async {
            tokio::time::sleep(Duration::from_millis(600)).await;
            "slow"
        }),
    )
}

fn limits(max: usize, header_ms: u64, idle_ms: u64) -> Limits {
    Limits {
        max_connections: max,
        header_timeout: Duration::from_millis(header_ms),
        idle_timeout: Duration::from_millis(idle_ms),
        fd_reserve: 0,
    }
}

/// Serve `app()` within `l` on a free port; the task ends with the test's runtime.
async fn start(l: Limits) -> std::net::SocketAddr {
    let listener = TcpListener::bind("127.0.0.1:0").await.unwrap();
    let addr = listener.local_addr().unwrap();
    tokio::spawn(serve(listener, app(), l, "test door"));
    addr
}

/// One answer on `s`: its status line and body (answers here are small and carry a
/// content-length).
async fn answer(s: &mut TcpStream) -> (String, String) {
    let mut got = Vec::new();
    let mut buf = [0u8; 1024];
    loop {
        let text = String::from_utf8_lossy(&got).to_string();
        if let Some(end) = text.find("\r\n\r\n") {
            let len: usize = text
                .lines()
                .find_map(|l| {
                    l.to_ascii_lowercase()
                        .strip_prefix("content-length: ")
                        .map(|v| v.trim().parse().unwrap())
                })
                .unwrap_or(0);
            if got.len() >= end + 4 + len {
                let status = text.lines().next().unwrap_or("").to_string();
                return (status, text[end + 4..end + 4 + len].to_string());
            }
        }
        let n = tokio::time::timeout(Duration::from_secs(5), s.read(&mut buf))
            .await
            .expect("an answer within 5 s")
            .expect("read");
        assert!(n > 0, "closed before a whole answer: {text:?}");
        got.extend_from_slice(&buf[..n]);
    }
}

async fn get_on(s: &mut TcpStream, path: &str) -> (String, String) {
    s.write_all(format!("GET {path} HTTP/1.1\r\nhost: x\r\n\r\n").as_bytes())
        .await
        .unwrap();
    answer(s).await
}

/// How long until the server closes `s` (reading and dropping whatever it sends), or
/// `None` if it stays open for `limit`.
async fn closed_within(s: &mut TcpStream, limit: Duration) -> Option<Duration> {
    let t = Instant::now();
    let mut buf = [0u8; 1024];
    loop {
        let left = limit.checked_sub(t.elapsed())?;
        match tokio::time::timeout(left, s.read(&mut buf)).await {
            Err(_) => return None,
            Ok(Ok(0)) | Ok(Err(_)) => return Some(t.elapsed()),
            Ok(Ok(_)) => {}
        }
    }
}

#[tokio::test]
async fn a_normal_request_works_and_keep_alive_serves_several() {
    let addr = start(limits(4, 1000, 1000)).await;
    let mut s = TcpStream::connect(addr).await.unwrap();
    for _ in 0..3 {
        let (status, body) = get_on(&mut s, "/").await;
        assert!(status.contains("200"), "{status}");
        assert_eq!(body, "hello");
    }
}

#[tokio::test]
async fn over_the_cap_a_connection_is_answered_503_and_closed_at_once() {
    let addr = start(limits(2, 5000, 5000)).await;
    let mut held = Vec::new();
    for _ in 0..2 {
        let mut s = TcpStream::connect(addr).await.unwrap();
        let (status, _) = get_on(&mut s, "/").await;
        assert!(status.contains("200"), "{status}");
        held.push(s);
    }
    for _ in 0..5 {
        let mut s = TcpStream::connect(addr).await.unwrap();
        let mut got = Vec::new();
        tokio::time::timeout(Duration::from_secs(2), s.read_to_end(&mut got))
            .await
            .expect("closed at once")
            .expect("read");
        let text = String::from_utf8_lossy(&got);
        assert!(text.starts_with("HTTP/1.1 503"), "{text:?}");
    }
    // The ones admitted still work; a slot given back is taken again.
    let (status, _) = get_on(&mut held[0], "/").await;
    assert!(status.contains("200"), "{status}");
    drop(held.pop());
    let mut again = None;
    for _ in 0..50 {
        let mut s = TcpStream::connect(addr).await.unwrap();
        s.write_all(b"GET / HTTP/1.1\r\nhost: x\r\n\r\n")
            .await
            .unwrap();
        let (status, _) = answer(&mut s).await;
        if status.contains("200") {
            again = Some(s);
            break;
        }
        tokio::time::sleep(Duration::from_millis(20)).await;
    }
    assert!(again.is_some(), "a freed slot is never taken again");
}

#[tokio::test]
async fn a_client_that_does_not_finish_its_headers_is_closed_after_the_header_timeout() {
    let addr = start(limits(8, 300, 5000)).await;
    // Nothing sent at all.
    let mut silent = TcpStream::connect(addr).await.unwrap();
    // Headers begun and never ended, a byte now and then (slowloris).
    let mut slow = TcpStream::connect(addr).await.unwrap();
    slow.write_all(b"GET / HTTP/1.1\r\n").await.unwrap();
    let trickle = async {
        for _ in 0..20 {
            tokio::time::sleep(Duration::from_millis(50)).await;
            if slow.write_all(b"x").await.is_err() {
                break;
            }
        }
    };
    let (silent_closed, ()) =
        tokio::join!(closed_within(&mut silent, Duration::from_secs(3)), trickle);
    let t = silent_closed.expect("a silent connection is closed");
    assert!(
        t >= Duration::from_millis(250) && t < Duration::from_secs(2),
        "{t:?}"
    );
    let t = closed_within(&mut slow, Duration::from_secs(3))
        .await
        .expect("a slow-header connection is closed");
    assert!(t < Duration::from_secs(2), "{t:?}");
}

#[tokio::test]
async fn an_idle_keep_alive_connection_is_closed_after_the_idle_timeout() {
    // The header timeout is shorter: it must not close a connection idle between
    // requests (no byte of a next request has come).
    let addr = start(limits(8, 200, 1000)).await;
    let mut s = TcpStream::connect(addr).await.unwrap();
    let (status, _) = get_on(&mut s, "/").await;
    assert!(status.contains("200"), "{status}");
    let t = closed_within(&mut s, Duration::from_secs(4))
        .await
        .expect("an idle connection is closed");
    assert!(
        t >= Duration::from_millis(800) && t < Duration::from_secs(3),
        "{t:?}"
    );
    // A request running longer than the idle timeout is not cut.
    let addr = start(limits(8, 200, 200)).await;
    let mut s = TcpStream::connect(addr).await.unwrap();
    let (status, body) = get_on(&mut s, "/slow").await;
    assert!(status.contains("200"), "{status}");
    assert_eq!(body, "slow");
}

#[tokio::test]
async fn a_door_refuses_connections_that_would_eat_into_the_descriptor_reserve() {
    let mut l = limits(8, 1000, 1000);
    l.fd_reserve = 1 << 40;
    let addr = start(l).await;
    let mut s = TcpStream::connect(addr).await.unwrap();
    let mut got = Vec::new();
    tokio::time::timeout(Duration::from_secs(2), s.read_to_end(&mut got))
        .await
        .expect("closed at once")
        .expect("read");
    assert!(String::from_utf8_lossy(&got).starts_with("HTTP/1.1 503"));
}

#[test]
fn the_watch_tells_header_from_idle_time() {
    let l = limits(1, 100, 1000);
    let a = Activity::new();
    // Fresh: headers awaited since the start.
    assert_eq!(a.next(50, &l), Next::Wait(Duration::from_millis(50)));
    assert_eq!(a.next(100, &l), Next::Close(Expired::Header));
    // After a request, no headers are awaited until a byte comes: only idle time counts.
    let a = Arc::new(Activity::new());
    drop(a.begin());
    let last = a.last_io.load(Ordering::Relaxed);
    assert!(matches!(a.next(last + 500, &l), Next::Wait(_)));
    assert_eq!(a.next(last + 1000, &l), Next::Close(Expired::Idle));
    // While a request runs, nothing expires.
    let running = a.begin();
    assert!(matches!(a.next(last + 10_000, &l), Next::Wait(_)));
    drop(running);
}
