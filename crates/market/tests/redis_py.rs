//! A producer store against redis-py with its default settings. redis-py 8 speaks RESP3
//! by default and starts with `HELLO 3 AUTH default <secret>` (the store used to answer
//! `-NOAUTH`), and its default `pipeline()` is a MULTI/EXEC transaction (the store used
//! to refuse MULTI and apply the queued writes at once). The script
//! (`py/redis_py_defaults.py`) runs with defaults, then RESP2 and RESP3 asked for.
//!
//! Needs redis-py in the project's venv (scripts/deps.txt); the python is
//! `$GRANULE_PYTHON` (scripts/test.sh sets it) or `target/ray-venv/bin/python`. Without
//! it the test fails and says to run `bash scripts/deps.sh`.

use granule_market::store::{EvictionMode, Store, StoreConfig};
use std::path::PathBuf;
use std::process::{Command, Stdio};
use std::time::{Duration, Instant};

const SECRET: &str = "redis-py-lease-secret";

/// The python with redis-py.
fn python() -> PathBuf {
    let py = std::env::var_os("GRANULE_PYTHON")
        .map(PathBuf::from)
        .unwrap_or_else(|| {
            PathBuf::from(env!("CARGO_MANIFEST_DIR")).join("../../target/ray-venv/bin/python")
        });
    let ok = Command::new(&py)
        .args(["-c", "import redis"])
        .output()
        .map(|o| o.status.success())
        .unwrap_or(false);
    assert!(
        ok,
        "{} cannot import redis: run `bash scripts/deps.sh` (it installs the packages in scripts/deps.txt), or set GRANULE_PYTHON",
        py.display()
    );
    py
}

#[test]
fn redis_py_with_its_defaults_connects_and_works() {
    let py = python();
    let store = Store::start(
        "127.0.0.1:0",
        StoreConfig::new(16 << 20, SECRET, EvictionMode::Lru),
    )
    .expect("start a store");
    let script = PathBuf::from(env!("CARGO_MANIFEST_DIR")).join("tests/py/redis_py_defaults.py");
    let mut child = Command::new(py)
        .arg(script)
        .env("STORE_PORT", store.addr().port().to_string())
        .env("STORE_SECRET", SECRET)
        .stdout(Stdio::piped())
        .stderr(Stdio::piped())
        .spawn()
        .expect("run python");
    // Bounded: a client stuck on an answer it cannot read must not hang the suite.
    let deadline = Instant::now() + Duration::from_secs(60);
    while child.try_wait().expect("wait").is_none() {
        if Instant::now() > deadline {
            let _ = child.kill();
            break;
        }
        std::thread::sleep(Duration::from_millis(20));
    }
    let out = child.wait_with_output().expect("python's output");
    let stderr = String::from_utf8_lossy(&out.stderr);
    assert!(
        out.status.success(),
        "redis-py against the store:\n{stderr}"
    );
    assert!(stderr.contains("ok"), "{stderr}");
}
