//! The memory market end to end, as real processes on 127.0.0.1: a controller with the
//! broker (`granule controller --broker`), two producers (`granule producer run
//! --offer`), and consumers (this test process through the library, and `granule kv`).
//! Leasing, use, renewal, expiry, a producer killed with SIGKILL (its keys become
//! misses, then the consumer gets a new lease elsewhere), bad requests, and a producer
//! that tampers with what its store holds (flipped, swapped and replayed values: misses,
//! never wrong data).

mod common;

use common::{start_controller, Reaped, GRANULE};
use granule_market::client::{BrokerClient, BrokerLeases, LeaseTerms};
use granule_market::consumer::{KvCache, LeaseSource, Protection};
use granule_wire::market::{EvictionMode, MarketMsg, MarketView};
use std::process::{Command, Stdio};
use std::sync::Arc;
use std::time::{Duration, Instant};

/// Start `granule producer run` offering `offer` without a workload.
fn producer(broker: &str, name: &str, offer: &str, state: &std::path::Path) -> Reaped {
    Reaped(
        Command::new(GRANULE)
            .args([
                "producer", "run", "--offer", offer, "--name", name, "--broker", broker,
            ])
            .args(["--listen-host", "127.0.0.1", "--advertise", "127.0.0.1"])
            .env("GRANULE_MARKET_REPORT_INTERVAL", "100ms")
            .env("GRANULE_MARKET_SLAB", "8MiB")
            .env("GRANULE_MARKET_STATE_DIR", state)
            .stdout(Stdio::null())
            .stderr(Stdio::null())
            .spawn()
            .expect("start granule producer"),
    )
}

/// One `granule kv` command against the broker at `addr`, its local metadata in `state`.
fn granule_kv(addr: &str, state: &std::path::Path, args: &[&str]) -> std::process::Output {
    Command::new(GRANULE)
        .args(["kv", "--broker", addr, "--state"])
        .arg(state)
        .args(args)
        .output()
        .expect("run granule kv")
}

async fn view(addr: &str) -> MarketView {
    let c = BrokerClient::connect_tool(addr, "market test")
        .await
        .expect("connect to the broker");
    let v = c.status().await.expect("market status");
    c.close("done");
    v
}

/// Poll the market until `ok` holds (at most 20 s).
async fn wait_for(addr: &str, what: &str, ok: impl Fn(&MarketView) -> bool) -> MarketView {
    let start = Instant::now();
    loop {
        let v = view(addr).await;
        if ok(&v) {
            return v;
        }
        assert!(
            start.elapsed() < Duration::from_secs(20),
            "timed out waiting for {what}; market: {v:#?}"
        );
        tokio::time::sleep(Duration::from_millis(100)).await;
    }
}

fn terms(consumer: &str, lease: Duration) -> LeaseTerms {
    LeaseTerms {
        consumer: consumer.into(),
        lease_time: lease,
        budget: f64::MAX,
        mode: EvictionMode::Lru,
    }
}

#[test]
fn lease_use_renew_expire_lose_a_producer_and_lease_again() {
    let dir = tempfile::tempdir().expect("tempdir");
    let (_ctl, addr) = start_controller(&["--listen", "127.0.0.1:0", "--broker"]);
    let mut p1 = producer(&addr, "p1", "64MiB", dir.path());
    let _p2 = producer(&addr, "p2", "64MiB", dir.path());
    let rt = tokio::runtime::Runtime::new().expect("runtime");
    rt.block_on(async {
        wait_for(&addr, "two producers with free slabs", |v| {
            v.producers.len() == 2 && v.producers.iter().all(|p| p.state.free_slabs >= 4)
        })
        .await;

        // Garbage on the broker's port closes only that connection.
        {
            use std::io::{Read, Write};
            let mut s = std::net::TcpStream::connect(&addr).expect("connect");
            s.set_read_timeout(Some(Duration::from_secs(5)))
                .expect("timeout");
            let _ = s.write_all(b"\xff\xff\xff\x7fGET / HTTP/1.1\r\n\r\nnot a frame at all");
            let mut buf = [0u8; 64];
            let _ = s.read(&mut buf);
        }
        // Bad requests get an error; the broker keeps serving.
        let c = BrokerClient::connect_tool(&addr, "market test")
            .await
            .expect("connect");
        let bad = c
            .call(MarketMsg::LeaseRequest {
                consumer: "bad".into(),
                slabs: 0,
                min_slabs: 1,
                lease_ms: 1000,
                budget: 1.0,
                weights: None,
                mode: EvictionMode::Lru,
                wait_ms: 0,
            })
            .await;
        assert!(
            bad.is_err(),
            "a request for 0 slabs must be refused: {bad:?}"
        );
        let renew_unknown = c
            .call(MarketMsg::Renew {
                lease: 12345,
                lease_ms: 1000,
                proof: "0".repeat(64),
            })
            .await;
        assert!(
            renew_unknown.is_err(),
            "renewing an unknown lease must fail"
        );
        c.close("done");

        // Lease and use.
        let source = Arc::new(
            BrokerLeases::connect(&addr, terms("alice", Duration::from_secs(4)))
                .await
                .expect("consumer connects"),
        );
        let cache = KvCache::new(source.clone(), Protection::Encrypt, 4)
            .await
            .expect("cache with leases");
        assert!(!cache.leases().is_empty(), "alice got no lease");
        for i in 0..200u32 {
            cache
                .put(format!("key{i}").as_bytes(), format!("value{i}").as_bytes())
                .await
                .expect("put");
        }
        for i in 0..200u32 {
            let v = cache.get(format!("key{i}").as_bytes()).await.expect("get");
            assert_eq!(v.as_deref(), Some(format!("value{i}").as_bytes()));
        }
        let v = wait_for(&addr, "alice's leases in the view", |v| {
            v.leases.iter().any(|l| l.consumer == "alice")
        })
        .await;
        let before: u64 = v
            .leases
            .iter()
            .filter(|l| l.consumer == "alice")
            .map(|l| l.expires_unix_ms)
            .min()
            .expect("a lease");

        // Renew: the expiry moves on.
        tokio::time::sleep(Duration::from_millis(1500)).await;
        cache
            .maintain(Duration::from_secs(10))
            .await
            .expect("renew");
        let v = view(&addr).await;
        let after: u64 = v
            .leases
            .iter()
            .filter(|l| l.consumer == "alice")
            .map(|l| l.expires_unix_ms)
            .min()
            .expect("a lease after renewal");
        assert!(
            after > before,
            "renewal did not extend: {before} -> {after}"
        );

        // Expiry: bob never renews; after his lease time his lease is gone and his key
        // is a miss, not an error.
        let bob_source = Arc::new(
            BrokerLeases::connect(&addr, terms("bob", Duration::from_secs(1)))
                .await
                .expect("bob connects"),
        );
        let bob = KvCache::new(bob_source, Protection::Integrity, 1)
            .await
            .expect("bob's cache");
        bob.put(b"k", b"v").await.expect("bob put");
        assert_eq!(
            bob.get(b"k").await.expect("bob get").as_deref(),
            Some(&b"v"[..])
        );
        wait_for(&addr, "bob's lease to expire", |v| {
            !v.leases.iter().any(|l| l.consumer == "bob")
        })
        .await;
        tokio::time::sleep(Duration::from_millis(300)).await;
        assert_eq!(bob.get(b"k").await.expect("a miss, not an error"), None);

        // A producer killed: alice's keys there become misses, never errors or wrong
        // values; she then leases again from the producer left.
        let v = view(&addr).await;
        let on_p1 = v
            .leases
            .iter()
            .filter(|l| l.consumer == "alice" && l.producer_name == "p1")
            .count();
        if on_p1 == 0 {
            // All of alice's leases are on p2: kill that one instead (same check).
            drop(_p2);
        } else {
            let _ = p1.0.kill();
            let _ = p1.0.wait();
        }
        wait_for(&addr, "the killed producer's leases to go", |v| {
            v.producers.iter().filter(|p| p.connected).count() == 1
                && v.leases.iter().filter(|l| l.consumer == "alice").all(|l| {
                    v.producers
                        .iter()
                        .any(|p| p.producer == l.producer && p.connected)
                })
        })
        .await;
        let mut misses = 0;
        for i in 0..200u32 {
            match cache
                .get(format!("key{i}").as_bytes())
                .await
                .expect("get after loss")
            {
                Some(v) => assert_eq!(v, format!("value{i}").as_bytes()),
                None => misses += 1,
            }
        }
        assert!(misses > 0, "no key was on the killed producer");
        assert!(cache.stats().lost_leases > 0 || cache.stats().misses >= misses);
        cache
            .maintain(Duration::from_secs(10))
            .await
            .expect("lease again");
        cache
            .put(b"again", b"yes")
            .await
            .expect("put on the new lease");
        assert_eq!(
            cache.get(b"again").await.expect("get").as_deref(),
            Some(&b"yes"[..])
        );
        assert_eq!(cache.stats().verification_failures, 0);
        for l in cache.leases() {
            let _ = source.release(l.lease).await;
        }
    });
}

#[test]
fn granule_kv_puts_and_gets_across_commands() {
    let dir = tempfile::tempdir().expect("tempdir");
    let dash = format!("127.0.0.1:{}", free_port());
    let (_ctl, addr) =
        start_controller(&["--listen", "127.0.0.1:0", "--broker", "--dashboard", &dash]);
    let _p = producer(&addr, "donor", "32MiB", dir.path());
    let state = dir.path().join("kv.json");
    let kv = |args: &[&str]| granule_kv(&addr, &state, args);
    // The producer registers within a report period or two.
    let start = Instant::now();
    loop {
        let out = kv(&["put", "greeting", "hello market"]);
        if out.status.success() {
            break;
        }
        assert!(
            start.elapsed() < Duration::from_secs(20),
            "granule kv put kept failing: {}",
            String::from_utf8_lossy(&out.stderr)
        );
        std::thread::sleep(Duration::from_millis(200));
    }
    let out = kv(&["get", "greeting"]);
    assert!(
        out.status.success(),
        "get: {}",
        String::from_utf8_lossy(&out.stderr)
    );
    assert_eq!(String::from_utf8_lossy(&out.stdout).trim(), "hello market");
    let out = kv(&["get", "absent"]);
    assert_eq!(out.status.code(), Some(1), "a miss exits 1");
    let out = kv(&["stats"]);
    let text = String::from_utf8_lossy(&out.stdout);
    assert!(
        text.contains("lease ") && text.contains("donor"),
        "stats: {text}"
    );
    // The dashboard's JSON and the controller's metrics show the market.
    let api = http_get(&dash, "/api/cluster");
    let json: serde_json::Value =
        serde_json::from_str(api.split("\r\n\r\n").nth(1).unwrap_or("")).expect("JSON");
    let market = &json["extensions"]["market"];
    assert_eq!(market["producers"][0]["name"], "donor", "{json:#}");
    assert!(
        market["leases"].as_array().is_some_and(|l| !l.is_empty()),
        "{json:#}"
    );
    let metrics = http_get(&dash, "/metrics");
    assert!(
        metrics.contains("granule_market_price")
            && metrics.contains("granule_market_producer_free_slabs{producer=\"donor\"}"),
        "{metrics}"
    );
    let out = kv(&["del", "greeting"]);
    assert!(String::from_utf8_lossy(&out.stdout).contains("deleted"));
    let out = kv(&["release"]);
    assert!(
        out.status.success(),
        "release: {}",
        String::from_utf8_lossy(&out.stderr)
    );
    // The status view shows the market.
    let out = Command::new(GRANULE)
        .args(["status", "--controller", &addr])
        .output()
        .expect("granule status");
    let text = String::from_utf8_lossy(&out.stdout);
    assert!(
        text.contains("memory market") && text.contains("donor") && text.contains("RSS"),
        "status: {text}"
    );
}

/// One RESP command on a raw connection; returns the reply's bulk payload (`None` for a
/// nil), or panics on an error reply.
fn resp(conn: &mut std::net::TcpStream, args: &[&[u8]]) -> Option<Vec<u8>> {
    use std::io::{BufRead, Read, Write};
    let mut cmd = format!("*{}\r\n", args.len()).into_bytes();
    for a in args {
        cmd.extend_from_slice(format!("${}\r\n", a.len()).as_bytes());
        cmd.extend_from_slice(a);
        cmd.extend_from_slice(b"\r\n");
    }
    conn.write_all(&cmd).expect("write to the store");
    let mut r = std::io::BufReader::new(conn.try_clone().expect("clone"));
    let mut line = String::new();
    r.read_line(&mut line).expect("read the store's reply");
    match line.as_bytes().first() {
        Some(b'+') | Some(b':') => Some(line.trim_end().as_bytes()[1..].to_vec()),
        Some(b'$') => {
            let n: i64 = line[1..].trim_end().parse().expect("bulk length");
            if n < 0 {
                return None;
            }
            let mut body = vec![0u8; n as usize + 2];
            r.read_exact(&mut body).expect("bulk body");
            body.truncate(n as usize);
            Some(body)
        }
        _ => panic!(
            "store answered {line:?} to {:?}",
            String::from_utf8_lossy(args[0])
        ),
    }
}

/// The producer side turns malicious: with the lease's secret (a producer has it: it
/// opened the store), it flips a byte of one value, swaps two keys' values, and replays
/// a key's older value in place of its newer one. `granule kv get` answers a miss for
/// each (exit status 1), never the wrong bytes; untouched keys still read back.
#[test]
fn a_tampering_producer_never_makes_granule_kv_return_wrong_data() {
    let dir = tempfile::tempdir().expect("tempdir");
    let (_ctl, addr) = start_controller(&["--listen", "127.0.0.1:0", "--broker"]);
    let _p = producer(&addr, "rogue", "32MiB", dir.path());
    let state = dir.path().join("kv.json");
    let kv = |args: &[&str]| granule_kv(&addr, &state, args);
    let start = Instant::now();
    while !kv(&["put", "flip", "value of flip"]).status.success() {
        assert!(
            start.elapsed() < Duration::from_secs(20),
            "granule kv put kept failing"
        );
        std::thread::sleep(Duration::from_millis(200));
    }
    for (k, v) in [
        ("a", "alpha"),
        ("b", "bravo"),
        ("kept", "untouched"),
        ("c", "first"),
    ] {
        assert!(kv(&["put", k, v]).status.success(), "put {k}");
    }
    // The sealed value of c's first version, then c rewritten (a new counter).
    let saved = |key: &str| -> (String, String, u64) {
        let j: serde_json::Value =
            serde_json::from_slice(&std::fs::read(&state).expect("state file")).expect("JSON");
        let hex: String = key.bytes().map(|b| format!("{b:02x}")).collect();
        let entry = j["entries"]
            .as_array()
            .expect("entries")
            .iter()
            .find(|e| e[0] == hex.as_str())
            .unwrap_or_else(|| panic!("no entry for {key}: {j:#}"))[1]
            .clone();
        let lease = &entry["lease"];
        let grant = j["grants"]
            .as_array()
            .expect("grants")
            .iter()
            .find(|g| &g["lease"] == lease)
            .expect("the entry's grant")
            .clone();
        (
            grant["store_addr"].as_str().expect("addr").to_string(),
            grant["secret"].as_str().expect("secret").to_string(),
            entry["counter"].as_u64().expect("counter"),
        )
    };
    let (store, secret, c_old) = saved("c");
    let mut conn = std::net::TcpStream::connect(&store).expect("connect to the store");
    assert_eq!(
        resp(&mut conn, &[b"AUTH", secret.as_bytes()]).as_deref(),
        Some(&b"OK"[..])
    );
    let key = |c: u64| c.to_be_bytes().to_vec();
    // What a replaying producer keeps: c's first version, as sealed.
    let c_first = resp(&mut conn, &[b"GET", &key(c_old)]).expect("c's first value");
    assert!(kv(&["put", "c", "second"]).status.success());
    let (_, _, c_new) = saved("c");
    assert_ne!(c_old, c_new, "a PUT takes a fresh counter");
    let (_, _, flip) = saved("flip");
    let (_, _, a) = saved("a");
    let (_, _, b) = saved("b");

    // Flip one byte of flip's sealed value.
    let mut v = resp(&mut conn, &[b"GET", &key(flip)]).expect("flip's value is in the store");
    let last = v.len() - 1;
    v[last] ^= 0x40;
    resp(&mut conn, &[b"SET", &key(flip), &v]);
    // Swap a's and b's sealed values.
    let va = resp(&mut conn, &[b"GET", &key(a)]).expect("a");
    let vb = resp(&mut conn, &[b"GET", &key(b)]).expect("b");
    resp(&mut conn, &[b"SET", &key(a), &vb]);
    resp(&mut conn, &[b"SET", &key(b), &va]);
    // Replay c's first value under its current counter.
    resp(&mut conn, &[b"SET", &key(c_new), &c_first]);
    drop(conn);

    for k in ["flip", "a", "b", "c"] {
        let out = kv(&["get", k]);
        assert_eq!(
            out.status.code(),
            Some(1),
            "a tampered {k} must be a miss; got {:?} (stderr {})",
            String::from_utf8_lossy(&out.stdout),
            String::from_utf8_lossy(&out.stderr)
        );
        assert!(
            out.stdout.is_empty(),
            "{k} printed tampered data {:?}",
            String::from_utf8_lossy(&out.stdout)
        );
    }
    let out = kv(&["get", "kept"]);
    assert!(out.status.success(), "an untouched key still reads");
    assert_eq!(String::from_utf8_lossy(&out.stdout).trim(), "untouched");
}

/// A free port on 127.0.0.1 (bound, then released for the broker to take).
fn free_port() -> u16 {
    std::net::TcpListener::bind("127.0.0.1:0")
        .expect("bind")
        .local_addr()
        .expect("addr")
        .port()
}

fn start_broker(addr: &str) -> Reaped {
    use std::io::{BufRead, BufReader};
    let mut b = Reaped(
        Command::new(GRANULE)
            .args(["broker", "--listen", addr])
            .stdout(Stdio::piped())
            .stderr(Stdio::null())
            .spawn()
            .expect("start granule broker"),
    );
    let mut lines = BufReader::new(b.0.stdout.take().expect("stdout")).lines();
    loop {
        let l = lines.next().expect("broker output").expect("a line");
        if l.starts_with("granule broker listening on ") {
            break;
        }
    }
    std::thread::spawn(move || lines.for_each(drop));
    b
}

#[test]
fn a_restarted_broker_rebuilds_its_leases_from_the_producers_and_leases_keep_working() {
    let dir = tempfile::tempdir().expect("tempdir");
    let addr = format!("127.0.0.1:{}", free_port());
    let mut broker = start_broker(&addr);
    let _p = producer(&addr, "keeper", "32MiB", dir.path());
    let rt = tokio::runtime::Runtime::new().expect("runtime");
    rt.block_on(async {
        wait_for(&addr, "the producer", |v| {
            v.producers.iter().any(|p| p.state.free_slabs > 0)
        })
        .await;
        let source = Arc::new(
            BrokerLeases::connect(&addr, terms("carol", Duration::from_secs(60)))
                .await
                .expect("consumer connects"),
        );
        let cache = KvCache::new(source, Protection::Encrypt, 2)
            .await
            .expect("cache");
        cache.put(b"survives", b"the broker").await.expect("put");
        let leases: Vec<u64> = cache.leases().iter().map(|l| l.lease).collect();
        assert!(!leases.is_empty());

        // Kill the broker: the store keeps serving the lease.
        let _ = broker.0.kill();
        let _ = broker.0.wait();
        assert_eq!(
            cache
                .get(b"survives")
                .await
                .expect("get while the broker is down")
                .as_deref(),
            Some(&b"the broker"[..])
        );

        // A new broker on the same address learns the lease from the producer.
        broker = start_broker(&addr);
        let v = wait_for(&addr, "the lease rebuilt from the producer's hello", |v| {
            leases.iter().all(|id| {
                v.leases
                    .iter()
                    .any(|l| l.lease == *id && l.consumer == "carol")
            })
        })
        .await;
        assert_eq!(v.producers.len(), 1, "{v:#?}");
        // It can be renewed at the new broker.
        cache
            .maintain(Duration::from_secs(120))
            .await
            .expect("renew at the new broker");
        assert_eq!(
            cache.get(b"survives").await.expect("get").as_deref(),
            Some(&b"the broker"[..])
        );
    });
    drop(broker);
}

/// A plain HTTP/1.0 GET: the whole answer, headers included.
fn http_get(addr: &str, path: &str) -> String {
    use std::io::{Read, Write};
    let mut s = std::net::TcpStream::connect(addr).expect("connect to the dashboard");
    s.set_read_timeout(Some(Duration::from_secs(10)))
        .expect("timeout");
    write!(s, "GET {path} HTTP/1.0\r\nHost: {addr}\r\n\r\n").expect("send");
    let mut out = String::new();
    s.read_to_string(&mut out).expect("read");
    out
}

/// Whether this machine lets the test harvest for real (root, cgroup v1 memory).
fn can_harvest() -> Result<(), String> {
    if !granule_host::proc::is_root() {
        return Err("not root".into());
    }
    granule_host::Hierarchy::detect()
        .map_err(|e| e.to_string())
        .and_then(|h| {
            if h.has(granule_host::Controller::Memory) {
                Ok(())
            } else {
                Err("no cgroup v1 memory controller".into())
            }
        })
}

#[test]
fn a_harvesting_producer_killed_with_sigkill_is_undone_by_the_next_start() {
    if let Err(why) = can_harvest() {
        eprintln!("skipped: harvesting needs root and cgroup v1 memory ({why})");
        return;
    }
    use std::io::{BufRead, BufReader};
    let dir = tempfile::tempdir().expect("tempdir");
    let state = dir.path().join("state");
    let swap = dir.path().join("harvest.swap");
    let (_ctl, addr) = start_controller(&["--listen", "127.0.0.1:0", "--broker"]);
    // Declared before the producers, so it runs after they are killed and reaped
    // (a live producer's changes are not undone by a recovery), pass or fail.
    let mut cleanup = Cleanup {
        state: state.clone(),
        swap: swap.clone(),
        group: None,
    };
    let harvest_env = |c: &mut Command| {
        c.env("GRANULE_MARKET_REPORT_INTERVAL", "100ms")
            .env("GRANULE_MARKET_COOLING_PERIOD", "300ms")
            .env("GRANULE_MARKET_OBSERVE", "0s")
            .env("GRANULE_MARKET_CHUNK", "16MiB")
            .env("GRANULE_MARKET_SLAB", "8MiB")
            .env("GRANULE_MARKET_SWAP_SIZE", "256MiB")
            .env("GRANULE_MARKET_HEADROOM", "32MiB")
            .env("GRANULE_MARKET_SWAP_FILE", &swap)
            .env("GRANULE_MARKET_STATE_DIR", &state);
    };
    // A workload holding 160 MiB it never touches again.
    let mut cmd = Command::new(GRANULE);
    cmd.args(["producer", "run", "--name", "harvester", "--broker", &addr])
        .args(["--", "python3", "-c"])
        .arg("import time; b = bytearray(160 << 20); [b.__setitem__(i, 1) for i in range(0, len(b), 4096)]; time.sleep(600)")
        .stdout(Stdio::piped())
        .stderr(Stdio::null());
    harvest_env(&mut cmd);
    let mut p = Reaped(cmd.spawn().expect("start a harvesting producer"));
    cleanup.group = Some(format!("producer-{}", p.0.id()));
    let mut lines = BufReader::new(p.0.stdout.take().expect("stdout")).lines();
    let mut workload_pid = None;
    let mut printed = Vec::new();
    for l in lines.by_ref() {
        let l = l.expect("a line");
        if let Some(rest) = l.split("(pid ").nth(1) {
            workload_pid = rest.split(')').next().and_then(|n| n.parse::<u32>().ok());
        }
        let registered = l.contains("registered with the broker");
        printed.push(l);
        if registered {
            break;
        }
    }
    std::thread::spawn(move || lines.for_each(drop));
    // What the producer changed is said before it registers (the workload's pid first).
    assert!(
        workload_pid.is_some(),
        "no workload pid before the registration in {printed:#?}"
    );
    let rt = tokio::runtime::Runtime::new().expect("runtime");
    let v = rt.block_on(wait_for(&addr, "memory harvested", |v| {
        v.producers
            .iter()
            .any(|p| p.name == "harvester" && p.state.harvested_bytes >= 48 << 20)
    }));
    let lowered = v.producers[0].state.limit_bytes;
    assert!(lowered > 0 && lowered < 1 << 40, "{v:#?}");

    // SIGKILL: nothing runs to undo the lowered limit, the swap file, zswap. (A machine
    // that already had swap gets no swap file of ours: then only the limit is checked.)
    let made_swap = printed
        .iter()
        .any(|l| l.contains("created and turned on swap file"));
    let _ = p.0.kill();
    let _ = p.0.wait();
    if made_swap {
        assert!(
            granule_host::swapfile::is_active(&swap).expect("the swap areas"),
            "the SIGKILLed producer's swap file should still be on"
        );
    }

    // The next start restores them first, and says so.
    let mut cmd = Command::new(GRANULE);
    cmd.args([
        "producer", "run", "--name", "next", "--broker", &addr, "--offer", "8MiB",
    ])
    .stdout(Stdio::piped())
    .stderr(Stdio::null());
    harvest_env(&mut cmd);
    let mut next = Reaped(cmd.spawn().expect("start the next producer"));
    let mut said = Vec::new();
    for l in BufReader::new(next.0.stdout.take().expect("stdout")).lines() {
        let l = l.expect("a line");
        let registered = l.contains("registered with the broker");
        said.push(l);
        if registered {
            break;
        }
    }
    let text = said.join("\n");
    assert!(
        text.contains("restored") && text.contains("limit"),
        "{text}"
    );
    if made_swap {
        assert!(
            text.contains("swap file"),
            "the swap file's removal not said\n{text}"
        );
    }
    assert!(
        !granule_host::swapfile::is_active(&swap).expect("the swap areas"),
        "swap file still on\n{text}"
    );
}

/// Leaves the machine as the harvesting test found it, pass or fail: the workload that
/// outlived its SIGKILLed producer, its group, and whatever the producers changed. Runs
/// after the producers are reaped.
struct Cleanup {
    state: std::path::PathBuf,
    swap: std::path::PathBuf,
    /// The workload's memory cgroup (under granule-workloads), once the producer runs.
    group: Option<String>,
}

impl Drop for Cleanup {
    fn drop(&mut self) {
        let group = self.group.as_ref().map(|g| {
            granule_host::Hierarchy::default()
                .controller_dir(granule_host::Controller::Memory)
                .join(granule_host::workload::WORKLOAD_DIR)
                .join(g)
        });
        // The workload is whatever is left in its group (its pid may be unknown if the
        // test failed early; the group's list cannot name a stranger's process).
        if let Some(dir) = &group {
            let deadline = Instant::now() + Duration::from_secs(5);
            loop {
                let procs = std::fs::read_to_string(dir.join("cgroup.procs")).unwrap_or_default();
                if procs.trim().is_empty() || Instant::now() > deadline {
                    break;
                }
                for pid in procs.split_whitespace() {
                    let _ = Command::new("kill").args(["-9", pid]).status();
                }
                std::thread::sleep(Duration::from_millis(100));
            }
        }
        let mut m = granule::Config::default().market;
        m.state_dir = self.state.to_string_lossy().into_owned();
        let _ = granule_market::harvester::Harvester::recover(&m);
        // Already off when the recovery above worked: quiet.
        let _ = Command::new("swapoff")
            .arg(&self.swap)
            .stderr(Stdio::null())
            .status();
        if let Some(dir) = &group {
            let _ = std::fs::remove_dir(dir);
        }
    }
}
