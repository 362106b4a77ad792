//! A producer store gives memory back: after `FLUSHDB` and after the store is shut down
//! (its lease ended), the process's resident memory falls back near where it was, rather
//! than staying at the store's peak in the allocator's free lists.
//!
//! One test in its own process, so no other test's allocations move the figures. It
//! reads the process's RSS (the figure an owner sees), which depends on the allocator:
//! the bounds are loose (half of the store's 64 MiB must come back). The writes go
//! through the store several times over, so evictions interleave old and new entries
//! in the allocator's heap as in a store in use (with glibc, 72 MiB stayed resident
//! after FLUSHDB before the store gave memory back).

use granule_host::proc::resident_bytes;
use granule_market::store::{EvictionMode, Store, StoreConfig};
use std::io::{Read, Write};
use std::net::TcpStream;
use std::time::Duration;

const SECRET: &str = "memory-test-secret";
const VALUE: usize = 4000;
const KEYS: usize = 50_000; // 200 MB of values through a 64 MiB store

/// Send `cmds` pipelined and read until `replies` lines starting with `+`/`:` came back.
fn pipeline(s: &mut TcpStream, cmds: &[u8], replies: usize) {
    s.write_all(cmds).expect("write");
    let mut seen = 0;
    let mut buf = vec![0u8; 1 << 16];
    while seen < replies {
        let n = s.read(&mut buf).expect("read");
        assert!(n > 0, "store closed the connection");
        seen += buf[..n].iter().filter(|&&b| b == b'\n').count();
    }
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

fn fill(s: &mut TcpStream) {
    let val = vec![b'v'; VALUE];
    for batch in 0..KEYS / 1000 {
        let mut cmds = Vec::new();
        for i in 0..1000 {
            let k = format!("key:{}", batch * 1000 + i);
            cmds.extend_from_slice(&cmd(&[b"SET", k.as_bytes(), &val]));
        }
        pipeline(s, &cmds, 1000);
    }
}

#[test]
fn flushdb_and_the_end_of_a_lease_give_memory_back() {
    let store = Store::start(
        "127.0.0.1:0",
        StoreConfig::new(64 << 20, SECRET, EvictionMode::Lru),
    )
    .expect("start a store");
    let mut s = TcpStream::connect(store.addr()).expect("connect");
    s.set_read_timeout(Some(Duration::from_secs(30))).unwrap();
    pipeline(&mut s, &cmd(&[b"AUTH", SECRET.as_bytes()]), 1);
    let base = resident_bytes();
    let written = 64u64 << 20;

    fill(&mut s);
    let full = resident_bytes();
    assert!(
        full >= base + written / 2,
        "RSS {base} -> {full} after writing {written}"
    );
    pipeline(&mut s, &cmd(&[b"FLUSHDB"]), 1);
    let flushed = resident_bytes();
    assert!(
        flushed <= base + written / 2,
        "FLUSHDB: RSS {} MiB before writing, {} MiB full, still {} MiB after FLUSHDB",
        base >> 20,
        full >> 20,
        flushed >> 20
    );

    fill(&mut s);
    let full = resident_bytes();
    drop(s);
    store.shutdown();
    let ended = resident_bytes();
    assert!(
        ended <= base + written / 2,
        "lease end: RSS {} MiB before writing, {} MiB full, still {} MiB after shutdown",
        base >> 20,
        full >> 20,
        ended >> 20
    );
}
