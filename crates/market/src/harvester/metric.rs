//! The workload's performance signal, one value per epoch ("lower is better"):
//!
//! - [`MetricSource::SwapIn`]: the anonymous refault rate, pages per second — the
//!   workload group's `workingset_refault_anon` (anonymous pages faulted back after
//!   reclaim pushed them out, from swap or zswap alike; cgroup v1's `memory.stat` has it
//!   on this kernel). Not `pgmajfault`, which counts file faults too, and not the
//!   system-wide `pswpin`, which other programs' swapping would move;
//! - [`MetricSource::Socket`]: the application connects to a Unix stream socket the
//!   harvester listens on and writes one latency sample per line (microseconds, or any
//!   unit as long as it is the same); the epoch's value is the p99 of the samples;
//! - [`MetricSource::Http`]: a URL (`http://host:port/path`) polled once per epoch whose
//!   body is one number, the application's current p99.

use super::{HarvestError, MetricSource};
use parking_lot::Mutex;
use std::io::{BufRead, BufReader, Read, Write};
use std::net::TcpStream;
use std::os::unix::net::UnixListener;
use std::path::PathBuf;
use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::Arc;
use std::time::Duration;

/// Samples the socket listener collected since the last epoch, at most this many kept.
const MAX_SAMPLES: usize = 1 << 20;

/// A live metric reader.
pub(crate) enum Metric {
    SwapIn,
    Socket {
        samples: Arc<Mutex<Vec<f64>>>,
        path: PathBuf,
        stop: Arc<AtomicBool>,
    },
    Http(String),
}

impl Metric {
    pub(crate) fn open(source: &MetricSource) -> Result<Metric, HarvestError> {
        Ok(match source {
            MetricSource::SwapIn => Metric::SwapIn,
            MetricSource::Http(url) => {
                parse_url(url)?;
                Metric::Http(url.clone())
            }
            MetricSource::Socket(path) => {
                // A socket file left by an earlier producer is in the way of bind.
                let _ = std::fs::remove_file(path);
                let listener = UnixListener::bind(path).map_err(|e| HarvestError::Metric {
                    what: format!("cannot listen on {}: {e}", path.display()),
                })?;
                listener
                    .set_nonblocking(true)
                    .map_err(|e| HarvestError::Metric {
                        what: format!("socket {}: {e}", path.display()),
                    })?;
                let samples = Arc::new(Mutex::new(Vec::new()));
                let stop = Arc::new(AtomicBool::new(false));
                let (s2, stop2) = (samples.clone(), stop.clone());
                std::thread::Builder::new()
                    .name("harvest-metric".into())
                    .spawn(move || accept_loop(listener, s2, stop2))
                    .map_err(|e| HarvestError::Metric {
                        what: format!("cannot start the metric thread: {e}"),
                    })?;
                Metric::Socket {
                    samples,
                    path: path.clone(),
                    stop,
                }
            }
        })
    }

    /// The epoch's value: `refault_rate` is what the loop measured (pages/s).
    pub(crate) fn epoch_value(&self, refault_rate: f64) -> Option<f64> {
        match self {
            Metric::SwapIn => Some(refault_rate),
            Metric::Socket { samples, .. } => {
                let mut v = std::mem::take(&mut *samples.lock());
                p99(&mut v)
            }
            Metric::Http(url) => match poll_http(url) {
                Ok(v) => Some(v),
                Err(e) => {
                    tracing::warn!("harvester metric {url}: {e}");
                    None
                }
            },
        }
    }
}

impl Drop for Metric {
    fn drop(&mut self) {
        if let Metric::Socket { path, stop, .. } = self {
            stop.store(true, Ordering::Relaxed);
            let _ = std::fs::remove_file(path);
        }
    }
}

/// The p99 (nearest rank) of `v`, `None` when empty.
pub(crate) fn p99(v: &mut [f64]) -> Option<f64> {
    if v.is_empty() {
        return None;
    }
    v.sort_by(f64::total_cmp);
    let rank = ((0.99 * v.len() as f64).ceil() as usize).clamp(1, v.len());
    Some(v[rank - 1])
}

fn accept_loop(listener: UnixListener, samples: Arc<Mutex<Vec<f64>>>, stop: Arc<AtomicBool>) {
    while !stop.load(Ordering::Relaxed) {
        match listener.accept() {
            Ok((conn, _)) => {
                let (s, st) = (samples.clone(), stop.clone());
                let _ = conn.set_nonblocking(false);
                let _ = conn.set_read_timeout(Some(Duration::from_millis(500)));
                let _ = std::thread::Builder::new()
                    .name("harvest-metric-conn".into())
                    .spawn(move || {
                        let mut r = BufReader::new(conn);
                        let mut line = String::new();
                        while !st.load(Ordering::Relaxed) {
                            line.clear();
                            match r.read_line(&mut line) {
                                Ok(0) => break,
                                Ok(_) => {
                                    if let Ok(v) = line.trim().parse::<f64>() {
                                        if v.is_finite() && v >= 0.0 {
                                            let mut g = s.lock();
                                            if g.len() < MAX_SAMPLES {
                                                g.push(v);
                                            }
                                        }
                                    }
                                }
                                Err(e)
                                    if matches!(
                                        e.kind(),
                                        std::io::ErrorKind::WouldBlock
                                            | std::io::ErrorKind::TimedOut
                                    ) => {}
                                Err(_) => break,
                            }
                        }
                    });
            }
            Err(e) if e.kind() == std::io::ErrorKind::WouldBlock => {
                std::thread::sleep(Duration::from_millis(50));
            }
            Err(_) => std::thread::sleep(Duration::from_millis(50)),
        }
    }
}

/// (host:port, path) of an `http://` URL.
fn parse_url(url: &str) -> Result<(String, String), HarvestError> {
    let bad = || HarvestError::Metric {
        what: format!("'{url}' is not an http://host:port/path URL"),
    };
    let rest = url.strip_prefix("http://").ok_or_else(bad)?;
    let (hostport, path) = match rest.find('/') {
        Some(i) => (&rest[..i], &rest[i..]),
        None => (rest, "/"),
    };
    if hostport.is_empty() {
        return Err(bad());
    }
    let hostport = if hostport.contains(':') {
        hostport.to_string()
    } else {
        format!("{hostport}:80")
    };
    Ok((hostport, path.to_string()))
}

/// GET the URL; its body is one number.
fn poll_http(url: &str) -> Result<f64, HarvestError> {
    let (hostport, path) = parse_url(url)?;
    let err = |e: std::io::Error| HarvestError::Metric {
        what: format!("GET {url}: {e}"),
    };
    let addr = std::net::ToSocketAddrs::to_socket_addrs(&hostport)
        .map_err(err)?
        .next()
        .ok_or_else(|| HarvestError::Metric {
            what: format!("{hostport} resolves to nothing"),
        })?;
    let mut s = TcpStream::connect_timeout(&addr, Duration::from_secs(1)).map_err(err)?;
    s.set_read_timeout(Some(Duration::from_secs(1)))
        .map_err(err)?;
    // One write: `write!` straight onto the socket sends each formatted piece as its own
    // segment, and a server that reads the request line in one go sees just "GET ".
    let request = format!("GET {path} HTTP/1.0\r\nHost: {hostport}\r\nConnection: close\r\n\r\n");
    s.write_all(request.as_bytes()).map_err(err)?;
    let mut text = String::new();
    s.take(64 * 1024).read_to_string(&mut text).map_err(err)?;
    let (head, body) = text.split_once("\r\n\r\n").unwrap_or(("", &text));
    if !head.starts_with("HTTP/1.") || head.split_whitespace().nth(1) != Some("200") {
        return Err(HarvestError::Metric {
            what: format!("GET {url}: {}", head.lines().next().unwrap_or("no answer")),
        });
    }
    body.trim().parse().map_err(|_| HarvestError::Metric {
        what: format!("GET {url}: the body {:?} is not a number", body.trim()),
    })
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn p99_by_nearest_rank() {
        let mut v: Vec<f64> = (1..=200).map(f64::from).collect();
        assert_eq!(p99(&mut v), Some(198.0));
        assert_eq!(p99(&mut []), None);
    }

    #[test]
    fn urls() {
        assert_eq!(
            parse_url("http://127.0.0.1:9/p99").unwrap(),
            ("127.0.0.1:9".into(), "/p99".into())
        );
        assert!(parse_url("ftp://x").is_err());
    }

    #[test]
    fn samples_pushed_over_the_socket_give_the_epoch_p99() {
        let dir = std::env::temp_dir().join(format!("harvest-metric-{}", std::process::id()));
        let m = Metric::open(&MetricSource::Socket(dir.clone())).unwrap();
        let mut c = std::os::unix::net::UnixStream::connect(&dir).unwrap();
        for i in 1..=100 {
            writeln!(c, "{i}").unwrap();
        }
        c.flush().unwrap();
        let deadline = std::time::Instant::now() + Duration::from_secs(5);
        let mut got = None;
        while std::time::Instant::now() < deadline {
            if let Metric::Socket { samples, .. } = &m {
                if samples.lock().len() == 100 {
                    got = m.epoch_value(0.0);
                    break;
                }
            }
            std::thread::sleep(Duration::from_millis(20));
        }
        assert_eq!(got, Some(99.0));
        assert_eq!(m.epoch_value(0.0), None, "drained");
        drop(m);
        assert!(!dir.exists());
    }

    #[test]
    fn a_polled_endpoint_gives_its_number() {
        let l = std::net::TcpListener::bind("127.0.0.1:0").unwrap();
        let port = l.local_addr().unwrap().port();
        let t = std::thread::spawn(move || {
            // Answer the first connection that sends a GET (another program probing ports
            // on this shared machine may connect first).
            for conn in l.incoming() {
                let mut s = conn.unwrap();
                s.set_read_timeout(Some(std::time::Duration::from_secs(5)))
                    .unwrap();
                // The whole request head, however the client's segments arrived.
                let mut head = Vec::new();
                let mut buf = [0u8; 1024];
                while !head.windows(4).any(|w| w == b"\r\n\r\n") {
                    match s.read(&mut buf) {
                        Ok(n) if n > 0 => head.extend_from_slice(&buf[..n]),
                        _ => break,
                    }
                }
                if head.starts_with(b"GET /p99") {
                    s.write_all(b"HTTP/1.0 200 OK\r\n\r\n1234.5\n").unwrap();
                    return;
                }
            }
        });
        Metric::open(&MetricSource::Http(format!("http://127.0.0.1:{port}/p99"))).unwrap();
        assert_eq!(
            poll_http(&format!("http://127.0.0.1:{port}/p99")).unwrap(),
            1234.5
        );
        t.join().unwrap();
    }
}
