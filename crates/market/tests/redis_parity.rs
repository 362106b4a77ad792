//! A producer store and a real `redis-server`, side by side: the same commands on each,
//! reply for reply — authentication (`AUTH`, `HELLO … AUTH`, RESP3's nulls), `SET`'s
//! expiry options (`EXAT` in the past, overflowing times), `TTL`'s rounding, `EXPIRE`
//! with its options and overflowing times, `CLIENT SETNAME`/`GETNAME`, `CONFIG GET`,
//! `INFO <section>` and transactions (`MULTI`/`EXEC`/`DISCARD`, `EXECABORT`).
//!
//! Where the two differ by design the script does not go: what `INFO` and `CONFIG GET
//! maxmemory` report, `HELLO`'s version and client id (normalised), commands the store
//! does not have (`KEYS`, `INCR`, ...) and databases other than 0.
//!
//! Needs `redis-server` (Debian's redis-server, scripts/deps.txt); without it the test
//! fails, unless GRANULE_SKIP_REDIS is set (then it says why and skips).

use granule_market::store::{EvictionMode, Store, StoreConfig};
use std::io::{Read, Write};
use std::net::TcpStream;
use std::process::{Child, Command, Stdio};
use std::time::{Duration, Instant};

const SECRET: &str = "parity-lease-secret";

/// A redis-server on a free port, killed when dropped.
struct Redis {
    child: Child,
    port: u16,
}

impl Drop for Redis {
    fn drop(&mut self) {
        let _ = self.child.kill();
        let _ = self.child.wait();
    }
}

fn start_redis() -> Option<Redis> {
    let port = std::net::TcpListener::bind("127.0.0.1:0")
        .and_then(|l| l.local_addr())
        .expect("a free port")
        .port();
    let child = Command::new("redis-server")
        .args(["--port", &port.to_string(), "--bind", "127.0.0.1"])
        .args(["--requirepass", SECRET, "--save", "", "--appendonly", "no"])
        .stdout(Stdio::null())
        .stderr(Stdio::null())
        .spawn();
    let child = match child {
        Ok(c) => c,
        Err(e) => {
            assert!(
                std::env::var_os("GRANULE_SKIP_REDIS").is_some(),
                "cannot run redis-server ({e}): install Debian's redis-server (or set GRANULE_SKIP_REDIS to skip)"
            );
            println!("skipped: redis-server is missing and GRANULE_SKIP_REDIS is set");
            return None;
        }
    };
    let redis = Redis { child, port };
    let deadline = Instant::now() + Duration::from_secs(10);
    while TcpStream::connect(("127.0.0.1", port)).is_err() {
        assert!(Instant::now() < deadline, "redis-server did not start");
        std::thread::sleep(Duration::from_millis(20));
    }
    Some(redis)
}

fn encode(args: &[&[u8]]) -> Vec<u8> {
    let mut v = format!("*{}\r\n", args.len()).into_bytes();
    for a in args {
        v.extend_from_slice(format!("${}\r\n", a.len()).as_bytes());
        v.extend_from_slice(a);
        v.extend_from_slice(b"\r\n");
    }
    v
}

/// One reply at the start of `b` on one line (`+OK`, `$-1`, `*2 $1:a _`, `%1 ...`), and
/// the bytes it took; `None` if incomplete.
fn render(b: &[u8]) -> Option<(String, usize)> {
    let cr = b.windows(2).position(|w| w == b"\r\n")?;
    let line = String::from_utf8_lossy(&b[..cr]).to_string();
    match b[0] {
        b'$' | b'=' => {
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
        b'*' | b'%' | b'~' => {
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

/// Run `script` (commands as space-separated words) on a fresh connection to `port`;
/// the replies, rendered, `HELLO`'s version and id replaced by `*`.
fn run(port: u16, script: &[&str]) -> Vec<String> {
    let mut s = TcpStream::connect(("127.0.0.1", port)).expect("connect");
    s.set_read_timeout(Some(Duration::from_secs(10))).unwrap();
    let mut buf = Vec::new();
    let mut replies = Vec::new();
    for line in script {
        let words: Vec<&[u8]> = line
            .split(' ')
            .map(|w| if w == "<secret>" { SECRET } else { w })
            .map(str::as_bytes)
            .collect();
        s.write_all(&encode(&words)).expect("write");
        let text = loop {
            if let Some((text, n)) = render(&buf) {
                buf.drain(..n);
                break text;
            }
            let mut chunk = [0u8; 65536];
            let n = s.read(&mut chunk).expect("read a reply");
            assert!(n > 0, "{line}: connection closed");
            buf.extend_from_slice(&chunk[..n]);
        };
        let mut words: Vec<&str> = text.split(' ').collect();
        for i in 1..words.len() {
            if words[i - 1] == "$7:version" || words[i - 1] == "$2:id" {
                words[i] = "*";
            }
        }
        replies.push(format!("{line} -> {}", words.join(" ")));
    }
    replies
}

const SESSIONS: &[&[&str]] = &[
    // Authentication, HELLO and RESP3.
    &[
        "GET k",
        "HELLO 3",
        "HELLO 3 AUTH default wrong",
        "HELLO 4 AUTH default <secret>",
        "HELLO x",
        "AUTH wrong",
        "AUTH a b c",
        "HELLO 3 AUTH default <secret>",
        "GET nope",
        "MGET nope nope",
        "CLIENT GETNAME",
        "SET k v NX",
        "SET k v NX",
        "CONFIG GET save",
        "HELLO 2 SETNAME me",
        "CLIENT GETNAME",
        "GET nope",
        "DEL k",
    ],
    // SET, TTL, EXPIRE and the rest.
    &[
        "AUTH <secret>",
        "SET k v",
        "GET k",
        "GET nope",
        "SET k v2 NX",
        "SET k2 v XX",
        "SET k v EX 100",
        "TTL k",
        "SET k v PX 1400",
        "TTL k",
        "PTTL nokey",
        "TTL nokey",
        "SET k v EXAT 1",
        "EXISTS k",
        "SET k v",
        "SET k w NX EXAT 1",
        "GET k",
        "SET k w XX PXAT 1",
        "GET k",
        "SET k v EXAT 0",
        "SET k v EX -5",
        "SET k v EX 9223372036854775",
        "SET k v EX abc",
        "SET k v BOGUS",
        "SET k v NX XX",
        "SET k v EX 10 PX 10",
        "SET k v",
        "EXPIRE k 9223372036854775807",
        "EXPIRE k 9223372036854775",
        "PEXPIRE k 9223372036854775000",
        "EXPIRE k abc",
        "EXPIRE k 100 NX",
        "EXPIRE k 100 XX",
        // Times that differ by whole seconds: Redis and the store both keep milliseconds,
        // so `100 GT` after `100 XX` would say whether a millisecond passed between them.
        "EXPIRE k 101 GT",
        "EXPIRE k 90 LT",
        "EXPIRE k 50 GT",
        "EXPIRE k 200 GT",
        "EXPIRE k 100 XX",
        "EXPIRE k 1 FOO",
        "EXPIRE k 100 NX XX",
        "EXPIRE k 100 GT LT",
        "PERSIST k",
        "PERSIST k",
        "TTL k",
        "EXPIRE k -1",
        "EXISTS k",
        "EXPIRE nokey 10",
        "MSET a 1 b 2",
        "MGET a b c",
        "MSET a",
        "MSET a 1 b",
        "EXISTS a b c a",
        "DEL a c",
        "UNLINK b",
        "DBSIZE",
        "GET",
        "PING",
        "PING hi",
        "ECHO x",
        "SELECT 0",
        "SELECT x",
        "NOSUCH a b",
        "CLIENT GETNAME",
        "CLIENT SETNAME bob",
        "CLIENT GETNAME",
        "CLIENT SETNAME a\tb",
        "CLIENT SETNAME",
        "CLIENT FOO",
        "CONFIG GET save",
        "CONFIG GET appendonly",
        "CONFIG GET nosuch",
        "CONFIG GET",
        "CONFIG FOO",
        "INFO nosuch",
        "FLUSHDB",
        "DBSIZE",
    ],
    // Transactions.
    &[
        "MULTI",
        "AUTH <secret>",
        "EXEC",
        "DISCARD",
        "MULTI",
        "MULTI",
        "SET a 1",
        "NOSUCH x",
        "GET",
        "EXEC",
        "GET a",
        "MULTI",
        "SET a 1",
        "SET a 1 BOGUS",
        "GET a",
        "EXPIRE a 100",
        "TTL a",
        "MGET a nope",
        "PING",
        "EXEC",
        "MULTI",
        "DEL a",
        "DISCARD",
        "EXISTS a",
        "MULTI",
        "EXEC",
        "FLUSHDB",
    ],
];

#[test]
fn the_store_answers_as_redis_server_does() {
    let Some(redis) = start_redis() else {
        return;
    };
    let store = Store::start(
        "127.0.0.1:0",
        StoreConfig::new(16 << 20, SECRET, EvictionMode::Lru),
    )
    .expect("start a store");
    let mut differ = Vec::new();
    for session in SESSIONS {
        let theirs = run(redis.port, session);
        let ours = run(store.addr().port(), session);
        for (t, o) in theirs.iter().zip(&ours) {
            if t != o {
                differ.push(format!("redis: {t}\n store: {o}"));
            }
        }
    }
    assert!(differ.is_empty(), "replies differ:\n{}", differ.join("\n"));
}
