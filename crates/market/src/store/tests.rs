//! The store's unit tests: real stores on free ports, spoken to over TCP with raw RESP.

use super::*;
use std::io::{Read, Write};
use std::net::TcpStream as StdStream;

const SECRET: &str = "s3cret-lease";

fn start(bytes: u64, mode: EvictionMode) -> Store {
    Store::start("127.0.0.1:0", StoreConfig::new(bytes, SECRET, mode)).unwrap()
}

/// A blocking test client.
struct Client {
    s: StdStream,
    buf: Vec<u8>,
}

fn cmd(args: &[&[u8]]) -> Vec<u8> {
    let mut v = format!("*{}\r\n", args.len()).into_bytes();
    for a in args {
        v.extend_from_slice(format!("${}\r\n", a.len()).as_bytes());
        v.extend_from_slice(a);
        v.extend_from_slice(b"\r\n");
    }
    v
}

impl Client {
    fn connect(store: &Store) -> Client {
        let s = StdStream::connect(store.addr()).unwrap();
        s.set_read_timeout(Some(Duration::from_secs(10))).unwrap();
        Client { s, buf: Vec::new() }
    }

    fn authed(store: &Store) -> Client {
        let mut c = Client::connect(store);
        assert_eq!(c.call(&[b"AUTH", SECRET.as_bytes()]), "+OK");
        c
    }

    fn send(&mut self, bytes: &[u8]) {
        self.s.write_all(bytes).unwrap();
    }

    /// Read one whole reply, rendered on one line (`+OK`, `$-1`, `*2 $1:a $-1`, ...).
    fn reply(&mut self) -> String {
        loop {
            if let Some((text, n)) = render(&self.buf) {
                self.buf.drain(..n);
                return text;
            }
            let mut chunk = [0u8; 65536];
            let n = self.s.read(&mut chunk).unwrap();
            assert!(
                n > 0,
                "connection closed; had {:?}",
                String::from_utf8_lossy(&self.buf)
            );
            self.buf.extend_from_slice(&chunk[..n]);
        }
    }

    fn call(&mut self, args: &[&[u8]]) -> String {
        self.send(&cmd(args));
        self.reply()
    }

    /// Whether the server closed the connection (after any pending replies).
    fn closed(&mut self) -> bool {
        let mut chunk = [0u8; 1024];
        matches!(self.s.read(&mut chunk), Ok(0) | Err(_))
    }
}

/// Render one reply at the start of `b`: `(text, bytes used)`, or `None` if incomplete.
fn render(b: &[u8]) -> Option<(String, usize)> {
    let cr = b.windows(2).position(|w| w == b"\r\n")?;
    let line = String::from_utf8_lossy(&b[..cr]).to_string();
    match b[0] {
        b'$' => {
            let n: i64 = line[1..].parse().ok()?;
            if n < 0 {
                return Some((line, cr + 2));
            }
            let end = cr + 2 + n as usize;
            if b.len() < end + 2 {
                return None;
            }
            let body = String::from_utf8_lossy(&b[cr + 2..end]);
            Some((format!("${n}:{body}"), end + 2))
        }
        b'*' | b'%' => {
            // A RESP3 map of n pairs is 2n elements.
            let n: i64 = line[1..].parse::<i64>().ok()? * if b[0] == b'%' { 2 } else { 1 };
            let mut pos = cr + 2;
            let mut parts = vec![line];
            for _ in 0..n.max(0) {
                let (t, used) = render(&b[pos..])?;
                parts.push(t);
                pos += used;
            }
            Some((parts.join(" "), pos))
        }
        _ => Some((line, cr + 2)),
    }
}

#[test]
fn noauth_until_auth_and_wrong_password() {
    let store = start(1 << 20, EvictionMode::Lru);
    let mut c = Client::connect(&store);
    for args in [
        &[&b"GET"[..], b"k"][..],
        &[b"SET", b"k", b"v"],
        &[b"PING"],
        &[b"INFO"],
        &[b"DBSIZE"],
        &[b"COMMAND"],
        &[b"FLUSHDB"],
        &[b"NOSUCH"],
    ] {
        assert_eq!(c.call(args), "-NOAUTH Authentication required.", "{args:?}");
    }
    assert_eq!(
        c.call(&[b"AUTH", b"wrong"]),
        "-WRONGPASS invalid username-password pair or user is disabled."
    );
    assert_eq!(
        c.call(&[b"AUTH", b"other", SECRET.as_bytes()]),
        "-WRONGPASS invalid username-password pair or user is disabled."
    );
    assert_eq!(c.call(&[b"GET", b"k"]), "-NOAUTH Authentication required.");
    assert_eq!(store.stats().auth_failures, 2);
    assert_eq!(store.stats().keys, 0, "nothing was written before AUTH");
    assert_eq!(c.call(&[b"AUTH", b"default", SECRET.as_bytes()]), "+OK");
    assert_eq!(c.call(&[b"PING"]), "+PONG");
    // A second connection is not authenticated by the first one's AUTH.
    let mut d = Client::connect(&store);
    assert_eq!(d.call(&[b"GET", b"k"]), "-NOAUTH Authentication required.");
    assert_eq!(d.call(&[b"QUIT"]), "+OK");
    assert!(d.closed());
}

#[test]
fn commands_answer_like_redis() {
    let store = start(1 << 20, EvictionMode::Lru);
    let mut c = Client::authed(&store);
    assert_eq!(c.call(&[b"SET", b"a", b"1"]), "+OK");
    assert_eq!(c.call(&[b"get", b"a"]), "$1:1");
    assert_eq!(c.call(&[b"GET", b"nope"]), "$-1");
    assert_eq!(c.call(&[b"SET", b"a", b"2", b"NX"]), "$-1");
    assert_eq!(c.call(&[b"SET", b"b", b"2", b"XX"]), "$-1");
    assert_eq!(c.call(&[b"SET", b"b", b"2", b"NX", b"EX", b"100"]), "+OK");
    assert_eq!(c.call(&[b"TTL", b"b"]), ":100");
    assert_eq!(c.call(&[b"TTL", b"a"]), ":-1");
    assert_eq!(c.call(&[b"TTL", b"zz"]), ":-2");
    assert_eq!(c.call(&[b"SET", b"c", b"3", b"PX", b"100000"]), "+OK");
    let pttl: i64 = c.call(&[b"PTTL", b"c"])[1..].parse().unwrap();
    assert!((99_000..=100_000).contains(&pttl), "{pttl}");
    assert_eq!(
        c.call(&[b"SET", b"c", b"3", b"EX", b"0"]),
        "-ERR invalid expire time in 'set' command"
    );
    assert_eq!(
        c.call(&[b"SET", b"c", b"3", b"EX", b"x"]),
        "-ERR value is not an integer or out of range"
    );
    assert_eq!(c.call(&[b"SET", b"c", b"3", b"BOGUS"]), "-ERR syntax error");
    assert_eq!(
        c.call(&[b"SET", b"c", b"3", b"NX", b"XX"]),
        "-ERR syntax error"
    );
    assert_eq!(c.call(&[b"MSET", b"x", b"1", b"y", b"2"]), "+OK");
    assert_eq!(c.call(&[b"MGET", b"x", b"nope", b"y"]), "*3 $1:1 $-1 $1:2");
    assert_eq!(
        c.call(&[b"MSET", b"x", b"1", b"y"]),
        "-ERR wrong number of arguments for 'mset' command"
    );
    assert_eq!(c.call(&[b"EXISTS", b"x", b"y", b"nope", b"x"]), ":3");
    assert_eq!(c.call(&[b"DEL", b"x", b"nope"]), ":1");
    assert_eq!(c.call(&[b"EXPIRE", b"y", b"50"]), ":1");
    assert_eq!(c.call(&[b"TTL", b"y"]), ":50");
    assert_eq!(c.call(&[b"PERSIST", b"y"]), ":1");
    assert_eq!(c.call(&[b"TTL", b"y"]), ":-1");
    assert_eq!(c.call(&[b"EXPIRE", b"nope", b"50"]), ":0");
    assert_eq!(c.call(&[b"EXPIRE", b"y", b"-1"]), ":1");
    assert_eq!(c.call(&[b"GET", b"y"]), "$-1");
    assert_eq!(c.call(&[b"DBSIZE"]), ":3");
    assert_eq!(c.call(&[b"SELECT", b"0"]), "+OK");
    assert_eq!(c.call(&[b"SELECT", b"1"]), "-ERR DB index is out of range");
    assert_eq!(c.call(&[b"PING", b"hi"]), "$2:hi");
    assert_eq!(
        c.call(&[b"GET"]),
        "-ERR wrong number of arguments for 'get' command"
    );
    assert_eq!(
        c.call(&[b"KEYS", b"*"]),
        "-ERR unknown command 'KEYS', with args beginning with: '*' "
    );
    assert_eq!(c.call(&[b"COMMAND", b"DOCS"]), "*0");
    assert_eq!(
        c.call(&[b"CONFIG", b"GET", b"maxmemory"]),
        "*2 $9:maxmemory $7:1048576"
    );
    let info = c.call(&[b"INFO"]);
    for field in [
        "used_memory:",
        "maxmemory:1048576",
        "keyspace_hits:",
        "keyspace_misses:",
        "evicted_keys:",
        "db0:keys=3",
    ] {
        assert!(info.contains(field), "INFO lacks {field}: {info}");
    }
    assert_eq!(c.call(&[b"FLUSHDB"]), "+OK");
    assert_eq!(c.call(&[b"DBSIZE"]), ":0");
    // Inline commands, as typed over nc.
    c.send(b"PING\r\nSET k 'a b'\r\nGET k\r\n");
    assert_eq!(c.reply(), "+PONG");
    assert_eq!(c.reply(), "+OK");
    assert_eq!(c.reply(), "$3:a b");
    let st = store.stats();
    assert!(st.hits >= 3 && st.misses >= 3, "{st:?}");
}

#[test]
fn pipelined_commands_are_answered_in_order() {
    let store = start(8 << 20, EvictionMode::Lru);
    let mut c = Client::authed(&store);
    let mut batch = Vec::new();
    for i in 0..500 {
        batch.extend(cmd(&[
            b"SET",
            format!("k{i}").as_bytes(),
            format!("v{i}").as_bytes(),
        ]));
        batch.extend(cmd(&[b"GET", format!("k{i}").as_bytes()]));
    }
    // Split at an awkward place: the store must carry the partial command over.
    let (a, b) = batch.split_at(batch.len() / 2 + 3);
    c.send(a);
    std::thread::sleep(Duration::from_millis(20));
    c.send(b);
    for i in 0..500 {
        assert_eq!(c.reply(), "+OK");
        assert_eq!(c.reply(), format!("${}:v{i}", format!("v{i}").len()));
    }
}

#[test]
fn lru_store_stays_within_its_size() {
    let cap = 256 << 10;
    let store = start(cap, EvictionMode::Lru);
    let mut c = Client::authed(&store);
    let val = vec![b'x'; 1000];
    for i in 0..2000 {
        assert_eq!(c.call(&[b"SET", format!("k{i}").as_bytes(), &val]), "+OK");
    }
    let st = store.stats();
    assert!(st.used_bytes <= cap, "{st:?}");
    assert!(st.evicted_bytes > 0 && st.keys < 2000, "{st:?}");
    assert!(c.call(&[b"INFO"]).contains("evicted_keys:"));
    // The most recent write survives.
    assert_eq!(c.call(&[b"EXISTS", b"k1999"]), ":1");
    // Resize evicts down and says how much.
    let before = store.stats().used_bytes;
    let evicted = store.resize(cap / 4);
    let after = store.stats();
    assert!(after.used_bytes <= cap / 4, "{after:?}");
    assert_eq!(before - after.used_bytes, evicted);
    assert_eq!(after.capacity, cap / 4);
}

#[test]
fn no_eviction_store_refuses_writes_past_its_size() {
    let cap = 64 << 10;
    let store = start(cap, EvictionMode::NoEviction);
    let mut c = Client::authed(&store);
    let val = vec![b'x'; 1000];
    let mut refused = 0;
    for i in 0..200 {
        let r = c.call(&[b"SET", format!("k{i}").as_bytes(), &val]);
        if r.starts_with("-OOM") {
            assert_eq!(
                r,
                "-OOM command not allowed when used memory > 'maxmemory'."
            );
            refused += 1;
        } else {
            assert_eq!(r, "+OK");
        }
    }
    let st = store.stats();
    assert!(refused > 100 && st.rejected_writes == refused, "{st:?}");
    assert!(st.used_bytes <= cap && st.evicted_bytes == 0, "{st:?}");
    // Everything accepted is still there: nothing is evicted.
    assert_eq!(c.call(&[b"DBSIZE"]), format!(":{}", 200 - refused));
    assert_eq!(c.call(&[b"GET", b"k0"]).len(), "$1000:".len() + 1000);
    // MSET is all or nothing.
    assert!(c
        .call(&[b"MSET", b"new1", &val, b"new2", &val])
        .starts_with("-OOM"));
    assert_eq!(c.call(&[b"EXISTS", b"new1"]), ":0");
    // A shrink evicts nothing; deleting makes room again.
    assert_eq!(store.resize(cap / 2), 0);
    assert_eq!(store.stats().keys, 200 - refused);
    assert_eq!(c.call(&[b"DEL", b"k0"]), ":1");
    assert!(
        c.call(&[b"SET", b"k0", &val]).starts_with("-OOM"),
        "still over the new size"
    );
}

#[test]
fn rate_limit_refuses_over_budget_without_delaying_others() {
    let mut cfg = StoreConfig::new(4 << 20, SECRET, EvictionMode::Lru);
    cfg.rate_bps = 20_000;
    let store = Store::start("127.0.0.1:0", cfg).unwrap();
    let mut a = Client::authed(&store);
    let mut b = Client::authed(&store);
    let val = vec![b'x'; 1000];
    let mut limited = 0;
    let t0 = Instant::now();
    for i in 0..100 {
        let r = a.call(&[b"SET", format!("k{i}").as_bytes(), &val]);
        if r.starts_with("-ERR rate limit exceeded") {
            assert_eq!(r, "-ERR rate limit exceeded for this lease (20000 bytes/s)");
            limited += 1;
        }
    }
    // Refused at once, never held back: 100 requests take far less than their 5 s of
    // budget.
    assert!(t0.elapsed() < Duration::from_secs(2), "{:?}", t0.elapsed());
    assert!(limited > 50, "only {limited} refused");
    assert_eq!(store.stats().rate_limited, limited);
    // Another connection gets its answer at once too (an error while the bucket is empty).
    let t1 = Instant::now();
    let r = b.call(&[b"GET", b"k0"]);
    assert!(t1.elapsed() < Duration::from_millis(500));
    assert!(r == "$1000:".to_string() + &"x".repeat(1000) || r.starts_with("-ERR rate limit"));
    // The bucket refills.
    std::thread::sleep(Duration::from_millis(300));
    assert_eq!(b.call(&[b"PING"]), "+PONG");
}

#[test]
fn malformed_input_closes_only_that_connection() {
    let store = start(1 << 20, EvictionMode::Lru);
    let mut good = Client::authed(&store);
    assert_eq!(good.call(&[b"SET", b"k", b"v"]), "+OK");
    for junk in [
        &b"*2\r\n$3\r\nGET\r\n+k\r\n"[..],
        b"*x\r\n",
        b"*1\r\n$-7\r\n",
        b"*1\r\n$3\r\nGETxx",
        b"*99999999999\r\n",
        b"*1\r\n$999999999999\r\n",
    ] {
        let mut bad = Client::connect(&store);
        bad.send(junk);
        let r = bad.reply();
        assert!(r.starts_with("-ERR Protocol error: "), "{junk:?} -> {r}");
        assert!(bad.closed(), "{junk:?} left the connection open");
        // The store and other connections go on.
        assert_eq!(good.call(&[b"GET", b"k"]), "$1:v");
    }
    assert_eq!(store.stats().protocol_errors, 6);
    // Before AUTH too (the decoder runs first), and the bulk bound is the configured one.
    let mut cfg = StoreConfig::new(1 << 20, SECRET, EvictionMode::Lru);
    cfg.max_bulk = 1024;
    cfg.max_args = 4;
    let small = Store::start("127.0.0.1:0", cfg).unwrap();
    let mut c = Client::authed(&small);
    assert_eq!(c.call(&[b"SET", b"k", &[b'x'; 1024]]), "+OK");
    c.send(&cmd(&[b"SET", b"k", &[b'x'; 1025]]));
    assert_eq!(
        c.reply(),
        "-ERR Protocol error: bulk length 1025 over this store's limit of 1024 bytes"
    );
    let mut c = Client::authed(&small);
    c.send(&cmd(&[b"MGET", b"a", b"b", b"c", b"d"]));
    assert_eq!(
        c.reply(),
        "-ERR Protocol error: too many arguments (5; this store accepts at most 4)"
    );
}

#[test]
fn connection_limit_is_enforced() {
    let mut cfg = StoreConfig::new(1 << 20, SECRET, EvictionMode::Lru);
    cfg.max_connections = 2;
    let store = Store::start("127.0.0.1:0", cfg).unwrap();
    let mut a = Client::authed(&store);
    let mut b = Client::authed(&store);
    let mut c = Client::connect(&store);
    assert_eq!(c.reply(), "-ERR max number of clients reached");
    assert!(c.closed());
    assert_eq!(store.stats().connections, 2);
    assert_eq!(a.call(&[b"QUIT"]), "+OK");
    assert!(a.closed());
    // The slot frees once the store has seen the close.
    let deadline = Instant::now() + Duration::from_secs(5);
    while store.stats().connections > 1 && Instant::now() < deadline {
        std::thread::sleep(Duration::from_millis(5));
    }
    let mut d = Client::authed(&store);
    assert_eq!(d.call(&[b"PING"]), "+PONG");
    assert_eq!(b.call(&[b"PING"]), "+PONG");
}

#[test]
fn shutdown_closes_connections_and_frees_the_data() {
    let store = start(1 << 20, EvictionMode::Lru);
    let addr = store.addr();
    let mut c = Client::authed(&store);
    assert_eq!(c.call(&[b"SET", b"k", b"v"]), "+OK");
    store.shutdown();
    store.shutdown();
    assert!(c.closed());
    assert_eq!(store.stats().keys, 0);
    assert!(StdStream::connect(addr).is_err(), "listener still open");
}

#[test]
fn start_refuses_empty_secret_and_names_a_bad_address() {
    let e = Store::start(
        "127.0.0.1:0",
        StoreConfig::new(1 << 20, "", EvictionMode::Lru),
    );
    assert!(matches!(e, Err(StoreError::EmptySecret)));
    let taken = start(1 << 20, EvictionMode::Lru);
    let addr = taken.addr().to_string();
    let e = Store::start(&addr, StoreConfig::new(1 << 20, SECRET, EvictionMode::Lru)).unwrap_err();
    assert!(e.to_string().contains(&addr), "{e}");
}

#[test]
fn shrink_in_proportion_to_sizes() {
    let big = start(4 << 20, EvictionMode::Lru);
    let small = start(1 << 20, EvictionMode::Lru);
    let pinned = start(1 << 20, EvictionMode::NoEviction);
    for s in [&big, &small, &pinned] {
        let mut c = Client::authed(s);
        let val = vec![b'x'; 4000];
        for i in 0..2000 {
            c.call(&[b"SET", format!("k{i}").as_bytes(), &val]);
        }
    }
    let full_big = big.stats().used_bytes;
    let full_small = small.stats().used_bytes;
    let got = shrink_in_proportion(&[&big, &small, &pinned], 2500 << 10);
    assert_eq!(got[2], 0);
    assert_eq!(big.stats().capacity, (4 << 20) - (2000 << 10));
    assert_eq!(small.stats().capacity, (1 << 20) - (500 << 10));
    assert_eq!(got[0], full_big - big.stats().used_bytes);
    assert_eq!(got[1], full_small - small.stats().used_bytes);
    assert!(got[0] > 3 * got[1], "{got:?}");
}

// ---- strangers: what a client that has not authenticated may cost ----------------------

/// Numeric fields of one `INFO` reply, asked over `c`.
fn info_fields<const N: usize>(c: &mut Client, names: [&str; N]) -> [u64; N] {
    let r = c.call(&[b"INFO"]);
    names.map(|name| {
        r.split("\r\n")
            .find_map(|l| l.strip_prefix(&format!("{name}:"))?.trim().parse().ok())
            .unwrap_or_else(|| panic!("INFO has no {name}: {r}"))
    })
}

/// A numeric field of `INFO`, asked over `c`.
fn info_field(c: &mut Client, name: &str) -> u64 {
    info_fields(c, [name])[0]
}

/// A store with these bounds for connections.
fn start_guarded(
    max_connections: usize,
    max_unauthenticated: usize,
    auth_timeout: Duration,
) -> Store {
    let mut cfg = StoreConfig::new(64 << 20, SECRET, EvictionMode::Lru);
    cfg.max_connections = max_connections;
    cfg.max_unauthenticated = max_unauthenticated;
    cfg.auth_timeout = auth_timeout;
    Store::start("127.0.0.1:0", cfg).unwrap()
}

/// Unauthenticated clients each sending most of a 16 MB AUTH argument grew a 64 MiB
/// store by hundreds of MiB. Before AUTH, a command is at most 10 arguments of at most
/// 16 KiB (Redis's rule); what strangers do buffer counts against the store's memory.
#[test]
fn strangers_cannot_make_the_store_buffer_large_commands() {
    let store = start(64 << 20, EvictionMode::Lru);
    let mut holder = Client::authed(&store);
    let mut strangers: Vec<Client> = (0..40).map(|_| Client::connect(&store)).collect();
    for s in &mut strangers {
        s.send(b"*2\r\n$4\r\nAUTH\r\n$16000000\r\n");
        // The store may close before all of it is sent.
        let _ = s.s.write_all(&[b'x'; 64 << 10]);
    }
    for s in &mut strangers {
        assert_eq!(
            s.reply(),
            "-ERR Protocol error: unauthenticated bulk length"
        );
        assert!(s.closed());
    }
    let mut c = Client::connect(&store);
    c.send(b"*11\r\n");
    assert_eq!(
        c.reply(),
        "-ERR Protocol error: unauthenticated multibulk length"
    );
    assert!(c.closed());
    // Within the bounds: a wrong password of 16 KiB is just a wrong password.
    let mut c = Client::connect(&store);
    assert_eq!(
        c.call(&[b"AUTH", &[b'p'; 16 << 10]]),
        "-WRONGPASS invalid username-password pair or user is disabled."
    );
    // Strangers in the middle of a (legal) command hold their bytes, counted with the data.
    let mut strangers: Vec<Client> = (0..40).map(|_| Client::connect(&store)).collect();
    for s in &mut strangers {
        s.send(b"*2\r\n$4\r\nAUTH\r\n$16000\r\n");
        s.send(&[b'x'; 15_000]);
    }
    let deadline = Instant::now() + Duration::from_secs(5);
    let mut held = 0;
    while Instant::now() < deadline {
        held = info_field(&mut holder, "mem_clients_normal");
        if held >= 40 * 15_000 {
            break;
        }
        std::thread::sleep(Duration::from_millis(20));
    }
    assert!(held >= 40 * 15_000, "buffers counted: {held}");
    assert!(held <= 41 * (64 << 10), "40 strangers hold {held} bytes");
    let [used, data, bufs] = info_fields(
        &mut holder,
        ["used_memory", "used_memory_dataset", "mem_clients_normal"],
    );
    assert_eq!(used, data + bufs);
    // ... and the one that gave a wrong password.
    assert_eq!(store.stats().unauthenticated, 41);
    drop(strangers);
    drop(c);
    let deadline = Instant::now() + Duration::from_secs(5);
    while store.stats().connections > 1 && Instant::now() < deadline {
        std::thread::sleep(Duration::from_millis(5));
    }
    assert!(
        store.stats().buffer_bytes <= 64 << 10,
        "{:?}",
        store.stats()
    );
}

/// 1,024 silent sockets locked the lease holder out of a store: strangers get a share of
/// the connections (a new one closes the oldest), and are closed if they do not
/// authenticate in time.
#[test]
fn silent_strangers_neither_lock_the_holder_out_nor_stay() {
    let store = start_guarded(32, 8, Duration::from_millis(500));
    let mut silent: Vec<StdStream> = (0..64)
        .map(|_| StdStream::connect(store.addr()).unwrap())
        .collect();
    std::thread::sleep(Duration::from_millis(100));
    let mut holder = Client::connect(&store);
    assert_eq!(holder.call(&[b"AUTH", SECRET.as_bytes()]), "+OK");
    assert_eq!(holder.call(&[b"PING"]), "+PONG");

    // The strangers still open are closed at the deadline; the holder stays.
    let started = Instant::now();
    let mut buf = [0u8; 256];
    let mut timed_out = 0;
    for s in &mut silent {
        s.set_read_timeout(Some(Duration::from_secs(5))).unwrap();
        let mut got = Vec::new();
        loop {
            match s.read(&mut buf) {
                Ok(0) | Err(_) => break,
                Ok(n) => got.extend_from_slice(&buf[..n]),
            }
        }
        if got.starts_with(b"-ERR not authenticated in time") {
            timed_out += 1;
        }
    }
    assert!(timed_out >= 1, "no stranger timed out");
    assert!(started.elapsed() < Duration::from_secs(4));
    while store.stats().unauthenticated > 0 && started.elapsed() < Duration::from_secs(5) {
        std::thread::sleep(Duration::from_millis(5));
    }
    assert_eq!(store.stats().unauthenticated, 0);
    assert_eq!(holder.call(&[b"PING"]), "+PONG");
    // Authenticated clients keep the room strangers cannot take.
    let mut clients: Vec<Client> = (0..31).map(|_| Client::authed(&store)).collect();
    let mut late = Client::connect(&store);
    assert_eq!(late.reply(), "-ERR max number of clients reached");
    assert_eq!(clients[0].call(&[b"PING"]), "+PONG");
}

/// A client opening many connections at once, then authenticating on each (what
/// redis-benchmark does), gets them all: only strangers that had time to authenticate
/// give their place to newer connections.
#[test]
fn a_burst_of_connections_past_the_strangers_share_is_not_cut_off() {
    let store = start_guarded(64, 8, Duration::from_secs(10));
    let mut clients: Vec<Client> = (0..40).map(|_| Client::connect(&store)).collect();
    std::thread::sleep(Duration::from_millis(100));
    for c in &mut clients {
        assert_eq!(c.call(&[b"AUTH", SECRET.as_bytes()]), "+OK");
    }
    for c in &mut clients {
        assert_eq!(c.call(&[b"PING"]), "+PONG");
    }
}

/// A large command's buffer is given back once it ran.
#[test]
fn buffers_shrink_after_a_large_command() {
    let store = start(64 << 20, EvictionMode::Lru);
    let mut c = Client::authed(&store);
    let big = vec![b'v'; 8 << 20];
    assert_eq!(c.call(&[b"SET", b"big", &big]), "+OK");
    assert_eq!(
        c.call(&[b"GET", b"big"]).len(),
        "$8388608:".len() + (8 << 20)
    );
    assert_eq!(c.call(&[b"PING"]), "+PONG");
    let held = info_field(&mut c, "mem_clients_normal");
    assert!(
        held <= 256 << 10,
        "one connection holds {held} bytes after a large command"
    );
}

/// Freed memory goes back to the system after FLUSHDB, a wave of deletes or evictions,
/// and the store's end (the RSS side: `tests/memory.rs`).
#[test]
fn memory_is_given_back_after_flushes_waves_and_the_end() {
    let store = start(8 << 20, EvictionMode::Lru);
    let mut c = Client::authed(&store);
    let releases = || store.stats().memory_releases;
    let val = vec![b'x'; 4000];
    let fill = |c: &mut Client, n: usize| {
        for i in 0..n {
            assert_eq!(c.call(&[b"SET", format!("k{i}").as_bytes(), &val]), "+OK");
        }
    };
    fill(&mut c, 1000);
    assert_eq!(releases(), 0);
    assert_eq!(c.call(&[b"FLUSHDB"]), "+OK");
    assert_eq!(releases(), 1);
    // A full LRU store replacing what it evicts keeps its memory (it is reused at once).
    fill(&mut c, 4000);
    std::thread::sleep(Duration::from_millis(300));
    assert_eq!(releases(), 1);
    // A wave of deletes: given back by the next expiry cycle.
    for i in 0..4000 {
        c.call(&[b"DEL", format!("k{i}").as_bytes()]);
    }
    let deadline = Instant::now() + Duration::from_secs(5);
    while releases() < 2 && Instant::now() < deadline {
        std::thread::sleep(Duration::from_millis(20));
    }
    // (Once or more: the cycle may run while the deletes still come; let it settle.)
    std::thread::sleep(Duration::from_millis(300));
    let after_wave = releases();
    assert!(after_wave >= 2);
    // The harvester taking memory back.
    fill(&mut c, 1000);
    std::thread::sleep(Duration::from_millis(300));
    assert_eq!(releases(), after_wave);
    assert!(store.resize(1 << 20) > 0);
    assert_eq!(releases(), after_wave + 1);
    store.shutdown();
    store.shutdown();
    assert_eq!(releases(), after_wave + 2);
}

// ---- transactions, HELLO and where the store answered otherwise than Redis ------------

/// Nothing queued after MULTI runs before EXEC (redis-py's default pipeline() is a
/// MULTI/EXEC): the store used to refuse MULTI and apply the queued writes at once.
#[test]
fn transactions_queue_until_exec_and_abort_on_a_refused_command() {
    let store = start(1 << 20, EvictionMode::Lru);
    let mut c = Client::authed(&store);
    let mut other = Client::authed(&store);
    assert_eq!(c.call(&[b"MULTI"]), "+OK");
    assert_eq!(c.call(&[b"SET", b"a", b"1"]), "+QUEUED");
    assert_eq!(c.call(&[b"GET", b"a"]), "+QUEUED");
    assert_eq!(other.call(&[b"GET", b"a"]), "$-1");
    assert_eq!(c.call(&[b"EXEC"]), "*2 +OK $1:1");
    // A command Redis refuses when queued aborts the whole transaction.
    assert_eq!(c.call(&[b"MULTI"]), "+OK");
    assert_eq!(c.call(&[b"SET", b"a", b"2"]), "+QUEUED");
    assert_eq!(
        c.call(&[b"NOSUCH", b"x"]),
        "-ERR unknown command 'NOSUCH', with args beginning with: 'x' "
    );
    assert_eq!(
        c.call(&[b"GET"]),
        "-ERR wrong number of arguments for 'get' command"
    );
    assert_eq!(other.call(&[b"GET", b"a"]), "$1:1");
    assert_eq!(
        c.call(&[b"EXEC"]),
        "-EXECABORT Transaction discarded because of previous errors."
    );
    assert_eq!(other.call(&[b"GET", b"a"]), "$1:1");
    // An error when run is that command's reply; the others apply.
    assert_eq!(c.call(&[b"MULTI"]), "+OK");
    assert_eq!(c.call(&[b"MULTI"]), "-ERR MULTI calls can not be nested");
    assert_eq!(c.call(&[b"SET", b"a", b"3", b"BOGUS"]), "+QUEUED");
    assert_eq!(c.call(&[b"SET", b"b", b"3"]), "+QUEUED");
    assert_eq!(c.call(&[b"EXEC"]), "*2 -ERR syntax error +OK");
    assert_eq!(other.call(&[b"MGET", b"a", b"b"]), "*2 $1:1 $1:3");
    assert_eq!(c.call(&[b"MULTI"]), "+OK");
    assert_eq!(c.call(&[b"DEL", b"a"]), "+QUEUED");
    assert_eq!(c.call(&[b"DISCARD"]), "+OK");
    assert_eq!(c.call(&[b"EXISTS", b"a"]), ":1");
    assert_eq!(c.call(&[b"EXEC"]), "-ERR EXEC without MULTI");
    assert_eq!(c.call(&[b"DISCARD"]), "-ERR DISCARD without MULTI");
    // Pipelined, as redis-py sends it.
    let mut batch = cmd(&[b"MULTI"]);
    batch.extend(cmd(&[b"SET", b"p", b"1"]));
    batch.extend(cmd(&[b"EXPIRE", b"p", b"100"]));
    batch.extend(cmd(&[b"EXEC"]));
    c.send(&batch);
    let replies: Vec<String> = (0..4).map(|_| c.reply()).collect();
    assert_eq!(replies, ["+OK", "+QUEUED", "+QUEUED", "*2 +OK :1"]);
}

/// redis-py 8 starts with `HELLO 3 AUTH default <secret>`: it authenticates and
/// switches to RESP3 (whose clients do not read RESP2's `$-1`).
#[test]
fn hello_authenticates_and_chooses_resp3() {
    let store = start(1 << 20, EvictionMode::Lru);
    let mut c = Client::connect(&store);
    assert!(c
        .call(&[b"HELLO", b"3"])
        .starts_with("-NOAUTH HELLO must be called"));
    assert_eq!(
        c.call(&[b"HELLO", b"3", b"AUTH", b"default", b"wrong"]),
        "-WRONGPASS invalid username-password pair or user is disabled."
    );
    assert_eq!(
        c.call(&[b"HELLO", b"4", b"AUTH", b"default", SECRET.as_bytes()]),
        "-NOPROTO unsupported protocol version"
    );
    assert_eq!(c.call(&[b"GET", b"k"]), "-NOAUTH Authentication required.");
    assert_eq!(
        c.call(&[b"HELLO", b"3", b"AUTH", b"default", SECRET.as_bytes(), b"SETNAME", b"me"]),
        "%7 $6:server $5:redis $7:version $5:7.0.0 $5:proto :3 $2:id :1 $4:mode $10:standalone $4:role $6:master $7:modules *0"
    );
    assert_eq!(c.call(&[b"GET", b"k"]), "_");
    assert_eq!(c.call(&[b"MGET", b"k", b"k"]), "*2 _ _");
    assert_eq!(c.call(&[b"CLIENT", b"GETNAME"]), "$2:me");
    assert_eq!(
        c.call(&[b"CONFIG", b"GET", b"maxmemory"]),
        "%1 $9:maxmemory $7:1048576"
    );
    assert!(c.call(&[b"HELLO", b"2"]).starts_with("*14 $6:server"));
    assert_eq!(c.call(&[b"GET", b"k"]), "$-1");
}

/// Where the store answered otherwise than Redis 7 (checked side by side against
/// redis-server in tests/redis_parity.rs).
#[test]
fn expiry_client_info_and_config_answer_as_redis() {
    let store = start(1 << 20, EvictionMode::Lru);
    let mut c = Client::authed(&store);
    // SET with EXAT in the past: written and gone (NX/XX still decide first).
    assert_eq!(c.call(&[b"SET", b"k", b"v", b"EXAT", b"1"]), "+OK");
    assert_eq!(c.call(&[b"EXISTS", b"k"]), ":0");
    assert_eq!(c.call(&[b"SET", b"k", b"v"]), "+OK");
    assert_eq!(c.call(&[b"SET", b"k", b"w", b"NX", b"EXAT", b"1"]), "$-1");
    assert_eq!(c.call(&[b"GET", b"k"]), "$1:v");
    assert_eq!(
        c.call(&[b"SET", b"k", b"v", b"EX", b"9223372036854775"]),
        "-ERR invalid expire time in 'set' command"
    );
    // TTL rounds to the nearest second.
    assert_eq!(c.call(&[b"SET", b"k", b"v", b"PX", b"1400"]), "+OK");
    assert_eq!(c.call(&[b"TTL", b"k"]), ":1");
    // EXPIRE past i64 milliseconds is an error, not a wrapped time.
    assert_eq!(
        c.call(&[b"EXPIRE", b"k", b"9223372036854775807"]),
        "-ERR invalid expire time in 'expire' command"
    );
    assert_eq!(
        c.call(&[b"PEXPIRE", b"k", b"9223372036854775000"]),
        "-ERR invalid expire time in 'pexpire' command"
    );
    assert_eq!(c.call(&[b"EXPIRE", b"k", b"100", b"NX"]), ":0");
    assert_eq!(c.call(&[b"EXPIRE", b"k", b"100", b"GT"]), ":1");
    assert_eq!(c.call(&[b"EXPIRE", b"k", b"50", b"GT"]), ":0");
    assert_eq!(c.call(&[b"EXPIRE", b"k", b"50", b"LT"]), ":1");
    assert_eq!(
        c.call(&[b"EXPIRE", b"k", b"1", b"FOO"]),
        "-ERR Unsupported option FOO"
    );
    assert_eq!(c.call(&[b"EXPIRE", b"k", b"-1"]), ":1");
    assert_eq!(c.call(&[b"EXISTS", b"k"]), ":0");
    // CLIENT SETNAME / GETNAME.
    assert_eq!(c.call(&[b"CLIENT", b"GETNAME"]), "$-1");
    assert_eq!(c.call(&[b"CLIENT", b"SETNAME", b"bob"]), "+OK");
    assert_eq!(c.call(&[b"CLIENT", b"GETNAME"]), "$3:bob");
    assert_eq!(
        c.call(&[b"CLIENT", b"SETNAME", b"a b"]),
        "-ERR Client names cannot contain spaces, newlines or special characters."
    );
    assert_eq!(
        c.call(&[b"CLIENT", b"FOO"]),
        "-ERR unknown subcommand 'FOO'. Try CLIENT HELP."
    );
    // INFO <section> gives that section only.
    assert_eq!(c.call(&[b"SET", b"k", b"v"]), "+OK");
    assert_eq!(
        c.call(&[b"INFO", b"keyspace"]),
        "$44:# Keyspace\r\ndb0:keys=1,expires=0,avg_ttl=0\r\n"
    );
    assert_eq!(c.call(&[b"INFO", b"nosuch"]), "$0:");
    let two = c.call(&[b"INFO", b"clients", b"memory"]);
    assert!(
        two.contains("# Clients\r\n") && two.contains("\r\n\r\n# Memory\r\n"),
        "{two}"
    );
    assert!(
        !two.contains("# Server") && !two.contains("# Stats"),
        "{two}"
    );
    // CONFIG GET takes glob patterns, several of them.
    assert_eq!(
        c.call(&[b"CONFIG", b"GET", b"maxmemory*"]),
        "*4 $9:maxmemory $7:1048576 $16:maxmemory-policy $11:allkeys-lru"
    );
    assert_eq!(
        c.call(&[b"CONFIG", b"GET", b"save", b"appendonly"]),
        "*4 $4:save $0: $10:appendonly $2:no"
    );
    assert_eq!(c.call(&[b"CONFIG", b"GET", b"nosuch"]), "*0");
    assert_eq!(
        c.call(&[b"CONFIG", b"GET"]),
        "-ERR wrong number of arguments for 'config|get' command"
    );
}
