//! A store that misbehaves never makes [`KvCache`] return wrong data: a tiny malicious
//! Redis-protocol store (the adversary, written here) flips bytes, swaps values between
//! keys, replays an older value, truncates, or hands one consumer another's data; the
//! cache must answer a miss, count the failure, and keep working. Also: a store whose
//! connection drops is a miss, a revoked lease's keys are misses and `maintain` replaces
//! the lease, and the metadata file carries a cache across instances.

use granule_market::consumer::{
    ConsumerError, KvCache, LeaseGrant, LeaseSource, Protection, StaticLeases,
};
use granule_wire::market::EvictionMode;
use std::collections::HashMap;
use std::sync::Arc;
use std::time::Duration;
use tokio::io::{AsyncBufReadExt, AsyncReadExt, AsyncWriteExt, BufReader};
use tokio::net::{TcpListener, TcpStream};

const SECRET: &str = "lease-secret-0123";

#[derive(Clone, Copy, Debug, PartialEq)]
enum Attack {
    Honest,
    /// Flip one bit of every value it returns.
    FlipByte,
    /// Answer GET k with the value most recently SET under another key.
    Swap,
    /// Answer GET k with the value SET just before k (an older PUT).
    Replay,
    /// Cut the last byte off.
    Truncate,
    /// Never answer a GET.
    Stall,
}

#[derive(Default)]
struct Data {
    map: HashMap<Vec<u8>, Vec<u8>>,
    /// Every SET in order, never forgotten (a replaying store keeps old values).
    history: Vec<(Vec<u8>, Vec<u8>)>,
}

type Shared = Arc<parking_lot::Mutex<Data>>;

/// The adversary: a RESP store on 127.0.0.1 (port 0) that requires AUTH and then lies
/// as `attack` says. Returns its address.
async fn evil_store(attack: Attack) -> String {
    let l = TcpListener::bind("127.0.0.1:0").await.unwrap();
    let addr = l.local_addr().unwrap().to_string();
    let data = Shared::default();
    tokio::spawn(async move {
        while let Ok((s, _)) = l.accept().await {
            tokio::spawn(serve(s, attack, data.clone()));
        }
    });
    addr
}

async fn read_command(r: &mut BufReader<TcpStream>) -> Option<Vec<Vec<u8>>> {
    let mut line = String::new();
    r.read_line(&mut line).await.ok()?;
    let n: usize = line.trim_end().strip_prefix('*')?.parse().ok()?;
    let mut args = Vec::with_capacity(n);
    for _ in 0..n {
        line.clear();
        r.read_line(&mut line).await.ok()?;
        let len: usize = line.trim_end().strip_prefix('$')?.parse().ok()?;
        let mut buf = vec![0; len + 2];
        r.read_exact(&mut buf).await.ok()?;
        buf.truncate(len);
        args.push(buf);
    }
    Some(args)
}

fn bulk(v: &[u8]) -> Vec<u8> {
    let mut out = format!("${}\r\n", v.len()).into_bytes();
    out.extend_from_slice(v);
    out.extend_from_slice(b"\r\n");
    out
}

async fn serve(s: TcpStream, attack: Attack, data: Shared) {
    let mut r = BufReader::new(s);
    let mut authed = false;
    while let Some(args) = read_command(&mut r).await {
        let cmd = String::from_utf8_lossy(&args[0]).to_ascii_uppercase();
        let reply: Vec<u8> = match cmd.as_str() {
            "AUTH" => {
                authed = args.last().map(|p| p == SECRET.as_bytes()) == Some(true);
                if authed {
                    b"+OK\r\n".to_vec()
                } else {
                    b"-WRONGPASS invalid password\r\n".to_vec()
                }
            }
            _ if !authed => b"-NOAUTH Authentication required.\r\n".to_vec(),
            "SET" if args.len() >= 3 => {
                let mut d = data.lock();
                d.map.insert(args[1].clone(), args[2].clone());
                d.history.push((args[1].clone(), args[2].clone()));
                b"+OK\r\n".to_vec()
            }
            "DEL" => {
                let mut d = data.lock();
                let n = args[1..]
                    .iter()
                    .filter(|k| d.map.remove(*k).is_some())
                    .count();
                format!(":{n}\r\n").into_bytes()
            }
            "GET" if attack == Attack::Stall => std::future::pending().await,
            "GET" if args.len() >= 2 => {
                let d = data.lock();
                let k = &args[1];
                let honest = d.map.get(k).cloned();
                let lie = match attack {
                    Attack::Honest | Attack::Stall => honest,
                    Attack::FlipByte => honest.map(|mut v| {
                        let i = v.len() / 2;
                        v[i] ^= 0x01;
                        v
                    }),
                    Attack::Truncate => honest.map(|mut v| {
                        v.pop();
                        v
                    }),
                    Attack::Swap => d
                        .history
                        .iter()
                        .rev()
                        .find(|(hk, _)| hk != k)
                        .map(|(_, v)| v.clone()),
                    Attack::Replay => {
                        let at = d.history.iter().rposition(|(hk, _)| hk == k);
                        at.and_then(|i| i.checked_sub(1))
                            .map(|i| d.history[i].1.clone())
                    }
                };
                match lie {
                    Some(v) => bulk(&v),
                    None => b"$-1\r\n".to_vec(),
                }
            }
            // CLIENT SETINFO and anything else a client sends on connect.
            _ => b"+OK\r\n".to_vec(),
        };
        if r.get_mut().write_all(&reply).await.is_err() {
            return;
        }
    }
}

fn grant(lease: u64, addr: &str, secret: &str) -> LeaseGrant {
    LeaseGrant {
        lease,
        producer: 1,
        producer_name: "evil".into(),
        store_addr: addr.into(),
        secret: secret.into(),
        slabs: 1,
        slab_bytes: 64 << 20,
        expires_unix_ms: u64::MAX / 2,
        price: 1.0,
        mode: EvictionMode::Lru,
    }
}

async fn cache_on(addr: &str, p: Protection) -> KvCache {
    let src: Arc<dyn LeaseSource> = Arc::new(StaticLeases::new(vec![grant(1, addr, SECRET)]));
    let c = KvCache::new(src, p, 1).await.unwrap();
    assert_eq!(c.stats().leases, 1, "the cache must hold the store's lease");
    c
}

/// A value padded to 32 bytes: every value of the scenario has the same length, so the
/// metadata's length check alone cannot catch a swap or a replay.
fn val(s: &str) -> Vec<u8> {
    format!("{s:.<32}").into_bytes()
}

/// Two keys, the first written twice; returns (what GET returned, the right value).
async fn scenario(c: &KvCache) -> Vec<(Option<Vec<u8>>, Vec<u8>)> {
    c.put(b"alice", &val("alice's first balance: 100"))
        .await
        .unwrap();
    c.put(b"bob", &val("bob's balance: 999999")).await.unwrap();
    c.put(b"alice", &val("alice's new balance: 5"))
        .await
        .unwrap();
    let mut out = Vec::new();
    for (k, want) in [
        (&b"alice"[..], val("alice's new balance: 5")),
        (&b"bob"[..], val("bob's balance: 999999")),
    ] {
        out.push((c.get(k).await.unwrap(), want));
    }
    out
}

#[tokio::test]
async fn an_honest_store_returns_the_values() {
    for p in [Protection::None, Protection::Integrity, Protection::Encrypt] {
        let addr = evil_store(Attack::Honest).await;
        let c = cache_on(&addr, p).await;
        for (got, want) in scenario(&c).await {
            assert_eq!(got.as_deref(), Some(&want[..]), "{p:?}");
        }
        assert_eq!(c.stats().hits, 2);
        assert_eq!(c.stats().verification_failures, 0);
    }
}

#[tokio::test]
async fn tampering_stores_never_make_the_cache_return_wrong_data() {
    for attack in [
        Attack::FlipByte,
        Attack::Swap,
        Attack::Replay,
        Attack::Truncate,
    ] {
        for p in [Protection::Integrity, Protection::Encrypt] {
            let addr = evil_store(attack).await;
            let c = cache_on(&addr, p).await;
            let results = scenario(&c).await;
            let mut lied = 0;
            for (got, want) in &results {
                // Never wrong data: the right value or a miss.
                assert!(
                    got.is_none() || got.as_ref() == Some(want),
                    "{attack:?} {p:?}: wrong data {got:?}"
                );
                lied += got.is_none() as u64;
            }
            let s = c.stats();
            assert!(
                lied >= 1,
                "{attack:?} {p:?}: the attack should have hit a GET"
            );
            assert_eq!(s.verification_failures, lied, "{attack:?} {p:?}: {s:?}");
            assert_eq!(s.misses, lied);
            // A discarded value's metadata is gone: the next GET misses without asking.
            assert_eq!(
                c.get(b"alice").await.unwrap().is_none(),
                results[0].0.is_none()
            );
            assert_eq!(c.stats().verification_failures, lied);
            // The cache keeps working.
            c.put(b"carol", b"c").await.unwrap();
        }
    }
}

/// Without protection the same adversary does fool the cache: the attacks are real.
#[tokio::test]
async fn without_protection_the_adversary_succeeds() {
    for attack in [Attack::FlipByte, Attack::Swap, Attack::Replay] {
        let addr = evil_store(attack).await;
        let c = cache_on(&addr, Protection::None).await;
        let results = scenario(&c).await;
        assert!(
            results
                .iter()
                .any(|(got, want)| got.is_some() && got.as_ref() != Some(want)),
            "{attack:?}: an unprotected cache should have returned the store's lie"
        );
    }
}

/// Another consumer with its own key material cannot read (or plant) data: a value
/// sealed by one cache does not open under the other's keys.
#[tokio::test]
async fn one_consumer_cannot_read_anothers_values() {
    let addr = evil_store(Attack::Honest).await;
    let a = cache_on(&addr, Protection::Encrypt).await;
    a.put(b"k", b"a's secret").await.unwrap();
    // b shares the store and, both being fresh, the same counters: b's PUT overwrites
    // the store key a's value was under.
    let b = cache_on(&addr, Protection::Encrypt).await;
    b.put(b"k", b"b's value").await.unwrap();
    assert_eq!(a.get(b"k").await.unwrap(), None);
    assert_eq!(a.stats().verification_failures, 1);
    assert_eq!(
        b.get(b"k").await.unwrap().as_deref(),
        Some(&b"b's value"[..])
    );
}

#[tokio::test]
async fn a_wrong_secret_is_a_lost_lease_not_an_error() {
    let addr = evil_store(Attack::Honest).await;
    let src: Arc<dyn LeaseSource> = Arc::new(StaticLeases::new(vec![grant(1, &addr, "wrong")]));
    let c = KvCache::new(src, Protection::Encrypt, 1).await.unwrap();
    assert_eq!(c.stats().leases, 0);
    assert_eq!(c.stats().lost_leases, 1);
    assert_eq!(c.get(b"x").await.unwrap(), None);
    assert!(matches!(
        c.put(b"x", b"y").await,
        Err(ConsumerError::NoLease)
    ));
}

/// A revoked lease's keys are misses; `maintain` asks the source for a replacement.
#[tokio::test]
async fn a_revoked_lease_is_a_miss_and_is_replaced() {
    let first = evil_store(Attack::Honest).await;
    let spare = evil_store(Attack::Honest).await;
    let src = Arc::new(StaticLeases::new(vec![
        grant(1, &first, SECRET),
        grant(2, &spare, SECRET),
    ]));
    let c = KvCache::new(src.clone(), Protection::Encrypt, 1)
        .await
        .unwrap();
    c.put(b"k", b"v").await.unwrap();
    assert_eq!(c.get(b"k").await.unwrap().as_deref(), Some(&b"v"[..]));
    src.revoke(1, Duration::from_secs(10));
    c.maintain(Duration::from_secs(1)).await.unwrap();
    assert_eq!(
        c.get(b"k").await.unwrap(),
        None,
        "a revoked lease's key is a miss"
    );
    let s = c.stats();
    assert_eq!(s.lost_leases, 1);
    assert_eq!(s.leases, 1, "maintain asked for a replacement");
    assert_eq!(c.leases()[0].lease, 2);
    c.put(b"k", b"v2").await.unwrap();
    assert_eq!(c.get(b"k").await.unwrap().as_deref(), Some(&b"v2"[..]));
}

/// A store whose connections drop: the GET is a miss and the lease is dropped.
#[tokio::test]
async fn a_dropped_connection_is_a_miss() {
    let l = TcpListener::bind("127.0.0.1:0").await.unwrap();
    let addr = l.local_addr().unwrap().to_string();
    let data = Shared::default();
    let (kill_tx, kill_rx) = tokio::sync::watch::channel(false);
    tokio::spawn(async move {
        while let Ok((s, _)) = l.accept().await {
            let data = data.clone();
            let mut kill = kill_rx.clone();
            tokio::spawn(async move {
                tokio::select! {
                    _ = serve(s, Attack::Honest, data) => {}
                    _ = kill.wait_for(|k| *k) => {}
                }
            });
        }
    });
    let src: Arc<dyn LeaseSource> = Arc::new(StaticLeases::new(vec![grant(7, &addr, SECRET)]));
    let c = KvCache::new(src, Protection::Integrity, 1).await.unwrap();
    c.set_store_timeout(Duration::from_millis(500));
    c.put(b"k", b"v").await.unwrap();
    kill_tx.send(true).unwrap();
    tokio::time::sleep(Duration::from_millis(50)).await;
    assert_eq!(c.get(b"k").await.unwrap(), None);
    let s = c.stats();
    assert_eq!(s.lost_leases, 1, "{s:?}");
    assert_eq!(s.leases, 0);
    assert!(matches!(
        c.put(b"k", b"v").await,
        Err(ConsumerError::NoLease)
    ));
}

/// `open` and `save`: a second cache opened from the file reads what the first stored;
/// the file is private.
#[tokio::test]
async fn the_metadata_file_carries_the_cache_across_instances() {
    use std::os::unix::fs::PermissionsExt;
    let dir = tempfile::tempdir().unwrap();
    let path = dir.path().join("kv.json");
    let addr = evil_store(Attack::Honest).await;
    let src: Arc<dyn LeaseSource> = Arc::new(StaticLeases::new(vec![grant(3, &addr, SECRET)]));
    let a = KvCache::open(&path, src, Protection::Encrypt, 1)
        .await
        .unwrap();
    a.put(b"k", b"persisted").await.unwrap();
    a.save().await.unwrap();
    drop(a);
    let mode = std::fs::metadata(&path).unwrap().permissions().mode() & 0o777;
    assert_eq!(mode, 0o600);
    // The second instance's source has nothing to give: the grant comes from the file.
    let empty: Arc<dyn LeaseSource> = Arc::new(StaticLeases::new(vec![]));
    let b = KvCache::open(&path, empty, Protection::Encrypt, 1)
        .await
        .unwrap();
    assert_eq!(b.stats().leases, 1);
    assert_eq!(
        b.get(b"k").await.unwrap().as_deref(),
        Some(&b"persisted"[..])
    );
    assert!(b.delete(b"k").await.unwrap());
    assert_eq!(b.get(b"k").await.unwrap(), None);
    assert!(!b.delete(b"k").await.unwrap());
}

/// A real `redis-server` (an unmodified store) with `--requirepass`, on a free port;
/// killed on drop.
struct RedisServer {
    child: std::process::Child,
    addr: String,
    _dir: tempfile::TempDir,
}

impl RedisServer {
    fn start(maxmemory: &str) -> RedisServer {
        let dir = tempfile::tempdir().unwrap();
        let port = std::net::TcpListener::bind("127.0.0.1:0")
            .unwrap()
            .local_addr()
            .unwrap()
            .port();
        let child = std::process::Command::new("redis-server")
            .args(["--port", &port.to_string(), "--bind", "127.0.0.1"])
            .args(["--requirepass", SECRET, "--save", "", "--appendonly", "no"])
            .args([
                "--maxmemory",
                maxmemory,
                "--maxmemory-policy",
                "allkeys-lru",
            ])
            .arg("--dir")
            .arg(dir.path())
            .stdout(std::process::Stdio::null())
            .spawn()
            .expect("redis-server (Debian package redis-server) must be installed");
        let addr = format!("127.0.0.1:{port}");
        let t0 = std::time::Instant::now();
        while std::net::TcpStream::connect(&addr).is_err() {
            assert!(
                t0.elapsed() < Duration::from_secs(10),
                "redis-server did not start"
            );
            std::thread::sleep(Duration::from_millis(20));
        }
        RedisServer {
            child,
            addr,
            _dir: dir,
        }
    }
}

impl Drop for RedisServer {
    fn drop(&mut self) {
        let _ = self.child.kill();
        let _ = self.child.wait();
    }
}

/// Against a real Redis: every mode round-trips, and values evicted by the store's LRU
/// are misses, never errors.
#[tokio::test]
async fn a_real_redis_server_stores_and_evicts() {
    let r = RedisServer::start("4mb");
    for p in [Protection::None, Protection::Integrity, Protection::Encrypt] {
        let c = cache_on(&r.addr, p).await;
        for (got, want) in scenario(&c).await {
            assert_eq!(got.as_deref(), Some(&want[..]), "{p:?}");
        }
    }
    // Integrity mode: keyed BLAKE3 is fast even in a debug build, AES-GCM is not.
    let c = cache_on(&r.addr, Protection::Integrity).await;
    // 16 MiB of values into a 4 MiB store: most are evicted.
    let v = vec![7u8; 16 << 10];
    for i in 0..1024u32 {
        c.put(&i.to_be_bytes(), &v).await.unwrap();
    }
    let mut hits = 0;
    for i in 0..1024u32 {
        if let Some(got) = c.get(&i.to_be_bytes()).await.unwrap() {
            assert_eq!(got, v);
            hits += 1;
        }
    }
    let s = c.stats();
    assert!(hits > 0 && hits < 1024, "hits {hits}");
    assert_eq!(s.verification_failures, 0);
    assert_eq!(s.misses, 1024 - hits);
    assert_eq!(s.store_errors, 0);
}

/// A store that stops answering: the GET is a miss within the store timeout, and the
/// lease is kept (slow is not lost).
#[tokio::test]
async fn a_stalled_store_is_a_miss_within_the_timeout() {
    let addr = evil_store(Attack::Stall).await;
    let c = cache_on(&addr, Protection::Encrypt).await;
    c.set_store_timeout(Duration::from_millis(200));
    c.put(b"k", b"v").await.unwrap();
    let t = std::time::Instant::now();
    assert_eq!(c.get(b"k").await.unwrap(), None);
    assert!(
        t.elapsed() < Duration::from_secs(2),
        "took {:?}",
        t.elapsed()
    );
    let s = c.stats();
    assert_eq!(
        (s.misses, s.store_errors, s.lost_leases, s.leases),
        (1, 1, 0, 1),
        "{s:?}"
    );
}
