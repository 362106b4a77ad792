//! Configuration: node specs (`cpu=1,mem=512MiB`), cluster settings from the environment
//! or a TOML file, and their validation with errors that say what to fix.
//!
//! | variable | meaning | default |
//! |---|---|---|
//! | `GRANULE_NODES` | embedded node processes, `;`-separated specs | `cpu=1,mem=1GiB;cpu=1,mem=1GiB` |
//! | `GRANULE_DRIVER` | the driver's own node spec | `cpu=1,mem=1GiB` |
//! | `GRANULE_CONTROLLER` | join the cluster of this controller instead of starting one | unset |
//! | `GRANULE_FAILURE_TIMEOUT` | silence after which a node is declared dead | `1s` |
//! | `GRANULE_HEARTBEAT` | heartbeat interval | `100ms` |
//! | `GRANULE_LISTEN_HOST` | address nodes listen on | `127.0.0.1` |
//! | `GRANULE_CGROUPS` | `auto`: cgroup v1 limits for embedded and hand-started nodes when usable; `off`: none | `auto` |
//! | `GRANULE_CONFIG` | a TOML file with the same settings (environment wins) | unset |
//! | `GRANULE_LOG` | log filter (`warn`, `granule_runtime=debug`, ...) | `warn` |
//! | `GRANULE_DASHBOARD` | where an embedded controller serves its dashboard, `/api/cluster` and `/metrics` (`IP:PORT`, port 0 = a free one; `off`) | `127.0.0.1:0` |

use crate::error::ClusterError;
use granule_wire::NodeSpec;
use serde::Deserialize;
use std::time::Duration;

/// Split `"512MiB"` into `("512", "MiB")` (surrounding spaces trimmed).
fn split_number(s: &str) -> (&str, &str) {
    let t = s.trim();
    let at = t
        .find(|c: char| !(c.is_ascii_digit() || c == '.'))
        .unwrap_or(t.len());
    t.split_at(at)
}

/// Parse a byte size such as `512MiB`, `2GiB`, `1.5G`, `4096`.
pub fn parse_size(s: &str) -> Result<u64, String> {
    let (num, unit) = split_number(s);
    let n: f64 = num
        .parse()
        .map_err(|_| format!("'{s}' is not a size (examples: 512MiB, 2GiB, 4096)"))?;
    let mult: f64 = match unit.trim().to_ascii_lowercase().as_str() {
        "" | "b" => 1.0,
        "k" | "kb" => 1e3,
        "kib" => 1024.0,
        "m" | "mb" => 1e6,
        "mib" => 1024.0 * 1024.0,
        "g" | "gb" => 1e9,
        "gib" => 1024.0 * 1024.0 * 1024.0,
        "t" | "tb" => 1e12,
        "tib" => 1024f64.powi(4),
        other => {
            return Err(format!(
                "unknown size unit '{other}' in '{s}' (use B, KiB, MiB, GiB, KB, MB, GB)"
            ))
        }
    };
    let v = n * mult;
    if !v.is_finite() || v < 0.0 {
        return Err(format!("'{s}' is not a valid size"));
    }
    Ok(v as u64)
}

/// Parse a rate in bytes per second such as `1GiB/s`, `600MB/s` (the `/s` may be left
/// out); it must be more than 0.
pub fn parse_rate(s: &str) -> Result<u64, String> {
    let t = s.trim();
    let size = t.strip_suffix("/s").unwrap_or(t);
    match parse_size(size) {
        Ok(0) => Err(format!("bad rate '{s}': must be more than 0")),
        Ok(v) => Ok(v),
        Err(e) => Err(format!("bad rate '{s}': {e}")),
    }
}

/// Default scheduler slice of a node's threads (`GRANULE_WORKER_SLICE`).
pub const DEFAULT_WORKER_SLICE: Duration = Duration::from_micros(100);

/// The scheduler slice a node's threads ask for (`GRANULE_WORKER_SLICE`: a duration,
/// `off` or `0` for the kernel's default), read once per process.
///
/// Why: a node's worker sleeps until a call arrives. On a core it shares with a CPU-bound
/// process (a co-located tenant, a memory antagonist faulting in pages), Linux's EEVDF
/// scheduler may let that process finish its slice first (1.4 ms here, ended at a 4 ms
/// tick, HZ=250, in a kernel without preemption): calls waited up to ~4 ms. A thread that
/// asks for a shorter slice gets an earlier deadline and preempts on wake-up (Linux 6.12+;
/// older kernels accept and ignore the request). Its CPU share is unchanged: it is only cut
/// into shorter pieces. Long computations (`cpu_bound`) go back to the default slice
/// while they run. Measured in `granule bench pressure`: see the README.
pub fn worker_slice() -> Option<Duration> {
    static SLICE: std::sync::OnceLock<Option<Duration>> = std::sync::OnceLock::new();
    *SLICE.get_or_init(|| match std::env::var("GRANULE_WORKER_SLICE") {
        Err(_) => Some(DEFAULT_WORKER_SLICE),
        Ok(v) if v.trim() == "off" || v.trim() == "0" => None,
        Ok(v) => match parse_duration(&v) {
            // The kernel clamps a requested slice to 0.1..=100 ms.
            Ok(d) if d >= Duration::from_micros(100) && d <= Duration::from_millis(100) => {
                Some(d)
            }
            Ok(_) => {
                tracing::warn!(
                    "ignoring GRANULE_WORKER_SLICE={v}: the kernel takes 100us..=100ms; using {DEFAULT_WORKER_SLICE:?}"
                );
                Some(DEFAULT_WORKER_SLICE)
            }
            Err(e) => {
                tracing::warn!("ignoring GRANULE_WORKER_SLICE: {e}; using {DEFAULT_WORKER_SLICE:?}");
                Some(DEFAULT_WORKER_SLICE)
            }
        },
    })
}

/// Parse a duration such as `1s`, `250ms`, `2.5s`, `100us`.
pub fn parse_duration(s: &str) -> Result<Duration, String> {
    let (num, unit) = split_number(s);
    let n: f64 = num
        .parse()
        .map_err(|_| format!("'{s}' is not a duration (examples: 1s, 250ms)"))?;
    let secs = match unit.trim() {
        "s" | "" => n,
        "ms" => n / 1e3,
        "us" | "µs" => n / 1e6,
        "m" | "min" => n * 60.0,
        other => {
            return Err(format!(
                "unknown duration unit '{other}' in '{s}' (use s, ms, us)"
            ))
        }
    };
    if !secs.is_finite() || secs < 0.0 {
        return Err(format!("'{s}' is not a valid duration"));
    }
    Ok(Duration::from_secs_f64(secs))
}

/// Parse one node spec: `cpu=1,mem=512MiB` (either key may be omitted: cpu=1, mem=1GiB).
pub fn parse_spec(s: &str) -> Result<NodeSpec, String> {
    let mut spec = NodeSpec {
        cores: 1.0,
        mem_bytes: 1 << 30,
    };
    for part in s.split(',').map(str::trim).filter(|p| !p.is_empty()) {
        let (k, v) = part.split_once('=').ok_or_else(|| {
            format!("bad node spec '{s}': '{part}' is not key=value (example: cpu=1,mem=512MiB)")
        })?;
        match k.trim() {
            "cpu" | "cores" => {
                let c: f64 = v
                    .trim()
                    .parse()
                    .map_err(|_| format!("bad node spec '{s}': cpu must be a number, got '{v}'"))?;
                if !(c > 0.0 && c <= 1024.0) {
                    return Err(format!("bad node spec '{s}': cpu must be > 0, got {c}"));
                }
                spec.cores = c;
            }
            "mem" | "memory" => {
                let m = parse_size(v).map_err(|e| format!("bad node spec '{s}': {e}"))?;
                if m < (16 << 20) {
                    return Err(format!("bad node spec '{s}': mem must be at least 16MiB"));
                }
                spec.mem_bytes = m;
            }
            other => {
                return Err(format!(
                    "bad node spec '{s}': unknown key '{other}' (known: cpu, mem)"
                ))
            }
        }
    }
    Ok(spec)
}

/// Whether embedded node processes get real limits (cgroup v1 groups with their spec's
/// memory limit and CPU quota).
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
pub enum CgroupsMode {
    /// Never: budgets are only accounted (reported in heartbeats, used by the monitor).
    Off,
    /// When cgroup v1 is usable here (root, memory and cpu controllers mounted);
    /// otherwise warn once and go on without.
    #[default]
    Auto,
}

/// Parse `off` or `auto`.
pub fn parse_cgroups_mode(s: &str) -> Result<CgroupsMode, String> {
    match s.trim().to_ascii_lowercase().as_str() {
        "off" => Ok(CgroupsMode::Off),
        "auto" => Ok(CgroupsMode::Auto),
        other => Err(format!("'{other}' is not a cgroups mode (use off or auto)")),
    }
}

/// Check that this machine can listen on `host` (an address of one of its interfaces, or
/// `0.0.0.0` for all), so a wrong `GRANULE_LISTEN_HOST` / `--listen-host` is reported as
/// such before anything starts, not as a failed node later.
pub fn check_listen_host(host: &str) -> Result<(), String> {
    match std::net::TcpListener::bind((host.trim(), 0)) {
        Ok(_) => Ok(()),
        Err(e) => Err(format!(
            "cannot listen on '{host}' ({e}): use an address of this machine, e.g. 127.0.0.1 \
             for one machine or 0.0.0.0 (or the machine's own IP) for several"
        )),
    }
}

/// Parse `;`-separated node specs.
pub fn parse_specs(s: &str) -> Result<Vec<NodeSpec>, String> {
    s.split(';')
        .map(str::trim)
        .filter(|p| !p.is_empty())
        .map(parse_spec)
        .collect()
}

/// Settings of an embedded or joined cluster.
#[derive(Clone, Debug)]
pub struct ClusterConfig {
    /// Node processes to spawn (ignored when joining an existing controller).
    pub nodes: Vec<NodeSpec>,
    /// The driver's own node spec.
    pub driver: NodeSpec,
    /// Join this controller instead of starting one.
    pub controller: Option<String>,
    /// Silence after which a node is declared dead (calls to it fail).
    pub failure_timeout: Duration,
    pub heartbeat: Duration,
    /// Host address nodes listen on.
    pub listen_host: String,
    /// How long to wait for spawned nodes to register.
    pub start_timeout: Duration,
    /// Whether spawned node processes get cgroup v1 limits.
    pub cgroups: CgroupsMode,
    /// Whether nodes move proclets away on their own under pressure (off: only explicit
    /// moves; `GRANULE_SHED=off` does the same for every node that reads it).
    pub shed: bool,
}

impl Default for ClusterConfig {
    fn default() -> Self {
        ClusterConfig {
            nodes: vec![
                NodeSpec {
                    cores: 1.0,
                    mem_bytes: 1 << 30,
                };
                2
            ],
            driver: NodeSpec {
                cores: 1.0,
                mem_bytes: 1 << 30,
            },
            controller: None,
            failure_timeout: Duration::from_secs(1),
            heartbeat: Duration::from_millis(100),
            listen_host: "127.0.0.1".into(),
            start_timeout: Duration::from_secs(30),
            cgroups: CgroupsMode::default(),
            shed: true,
        }
    }
}

/// The TOML file's shape (every field optional).
#[derive(Deserialize, Default)]
#[serde(deny_unknown_fields)]
struct FileConfig {
    nodes: Option<Vec<String>>,
    driver: Option<String>,
    controller: Option<String>,
    failure_timeout: Option<String>,
    heartbeat: Option<String>,
    listen_host: Option<String>,
    cgroups: Option<String>,
}

impl ClusterConfig {
    /// Defaults, then `GRANULE_CONFIG` (TOML), then the `GRANULE_*` variables.
    pub fn from_env() -> Result<ClusterConfig, ClusterError> {
        let mut c = ClusterConfig::default();
        if let Ok(path) = std::env::var("GRANULE_CONFIG") {
            let text = std::fs::read_to_string(&path).map_err(|e| {
                ClusterError::Config(format!("cannot read GRANULE_CONFIG={path}: {e}"))
            })?;
            c.apply_toml(&text)
                .map_err(|e| ClusterError::Config(format!("{path}: {e}")))?;
        }
        let var = |k: &str| std::env::var(k).ok().filter(|v| !v.trim().is_empty());
        let cfg = |k: &str, e: String| ClusterError::Config(format!("{k}: {e}"));
        if let Some(v) = var("GRANULE_NODES") {
            c.nodes = parse_specs(&v).map_err(|e| {
                cfg(
                    "GRANULE_NODES",
                    format!("{e}; GRANULE_NODES is a ';'-separated list of specs, e.g. \"cpu=1,mem=512MiB;cpu=2,mem=1GiB\""),
                )
            })?;
        }
        if let Some(v) = var("GRANULE_DRIVER") {
            c.driver = parse_spec(&v).map_err(|e| cfg("GRANULE_DRIVER", e))?;
        }
        if let Some(v) = var("GRANULE_CONTROLLER") {
            c.controller = Some(v);
        }
        if let Some(v) = var("GRANULE_FAILURE_TIMEOUT") {
            c.failure_timeout =
                parse_duration(&v).map_err(|e| cfg("GRANULE_FAILURE_TIMEOUT", e))?;
        }
        if let Some(v) = var("GRANULE_HEARTBEAT") {
            c.heartbeat = parse_duration(&v).map_err(|e| cfg("GRANULE_HEARTBEAT", e))?;
        }
        if let Some(v) = var("GRANULE_LISTEN_HOST") {
            check_listen_host(&v).map_err(|e| cfg("GRANULE_LISTEN_HOST", e))?;
            c.listen_host = v;
        }
        if let Some(v) = var("GRANULE_CGROUPS") {
            c.cgroups = parse_cgroups_mode(&v).map_err(|e| cfg("GRANULE_CGROUPS", e))?;
        }
        c.validate()?;
        Ok(c)
    }

    /// Apply settings from a TOML document, e.g.
    ///
    /// ```toml
    /// nodes = ["cpu=1,mem=512MiB", "cpu=1,mem=2GiB"]
    /// driver = "cpu=1,mem=1GiB"
    /// failure_timeout = "1s"
    /// ```
    pub fn apply_toml(&mut self, text: &str) -> Result<(), String> {
        let f: FileConfig = toml::from_str(text).map_err(|e| e.to_string())?;
        if let Some(n) = f.nodes {
            self.nodes = n.iter().map(|s| parse_spec(s)).collect::<Result<_, _>>()?;
        }
        if let Some(d) = f.driver {
            self.driver = parse_spec(&d)?;
        }
        if let Some(c) = f.controller {
            self.controller = Some(c);
        }
        if let Some(t) = f.failure_timeout {
            self.failure_timeout = parse_duration(&t)?;
        }
        if let Some(t) = f.heartbeat {
            self.heartbeat = parse_duration(&t)?;
        }
        if let Some(h) = f.listen_host {
            self.listen_host = h;
        }
        if let Some(m) = f.cgroups {
            self.cgroups = parse_cgroups_mode(&m)?;
        }
        Ok(())
    }

    /// Reject settings that cannot work, saying why.
    pub fn validate(&self) -> Result<(), ClusterError> {
        if self.heartbeat.is_zero() || self.heartbeat >= self.failure_timeout {
            return Err(ClusterError::Config(format!(
                "the heartbeat ({:?}) must be shorter than the failure timeout ({:?})",
                self.heartbeat, self.failure_timeout
            )));
        }
        if self.nodes.len() > 64 {
            return Err(ClusterError::Config(format!(
                "{} embedded nodes requested; at most 64 are supported on one machine",
                self.nodes.len()
            )));
        }
        Ok(())
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn rates() {
        assert_eq!(parse_rate("1GiB/s").unwrap(), 1 << 30);
        assert_eq!(parse_rate(" 600MB/s ").unwrap(), 600_000_000);
        assert_eq!(parse_rate("256MiB").unwrap(), 256 << 20);
        assert!(parse_rate("0/s").is_err());
        assert!(parse_rate("fast").is_err());
    }

    #[test]
    fn sizes_and_durations() {
        assert_eq!(parse_size("512MiB").unwrap(), 512 << 20);
        assert_eq!(parse_size("2GiB").unwrap(), 2 << 30);
        assert_eq!(parse_size("1.5G").unwrap(), 1_500_000_000);
        assert_eq!(parse_size("4096").unwrap(), 4096);
        assert!(parse_size("lots").is_err());
        assert!(parse_size("5XB").is_err());
        assert_eq!(parse_duration("250ms").unwrap(), Duration::from_millis(250));
        assert_eq!(parse_duration("2s").unwrap(), Duration::from_secs(2));
        assert!(parse_duration("soon").is_err());
    }

    #[test]
    fn specs() {
        let v = parse_specs("cpu=1,mem=512MiB;cpu=2, mem=2GiB").unwrap();
        assert_eq!(v.len(), 2);
        assert_eq!(v[1].cores, 2.0);
        assert_eq!(v[1].mem_bytes, 2 << 30);
        for bad in ["cpu=0", "cpu=x", "mem=1", "gpu=1", "cpu"] {
            let e = parse_spec(bad).unwrap_err();
            assert!(e.contains("bad node spec"), "{e}");
        }
    }

    #[test]
    fn toml_file() {
        let mut c = ClusterConfig::default();
        c.apply_toml(
            "nodes = [\"cpu=1,mem=512MiB\", \"cpu=1,mem=2GiB\"]\nfailure_timeout = \"1500ms\"\n",
        )
        .unwrap();
        assert_eq!(c.nodes.len(), 2);
        assert_eq!(c.failure_timeout, Duration::from_millis(1500));
        assert!(c.apply_toml("bogus = 1").is_err());
        assert_eq!(c.cgroups, CgroupsMode::Auto);
        c.apply_toml("cgroups = \"off\"\n").unwrap();
        assert_eq!(c.cgroups, CgroupsMode::Off);
    }

    #[test]
    fn cgroups_modes() {
        assert_eq!(parse_cgroups_mode("off"), Ok(CgroupsMode::Off));
        assert_eq!(parse_cgroups_mode(" Auto "), Ok(CgroupsMode::Auto));
        let e = parse_cgroups_mode("yes").unwrap_err();
        assert!(e.contains("off or auto"), "{e}");
    }

    #[test]
    fn listen_hosts() {
        assert!(check_listen_host("127.0.0.1").is_ok());
        // 192.0.2.0/24 is for documentation only: never an address of this machine.
        let e = check_listen_host("192.0.2.1").unwrap_err();
        assert!(e.contains("use an address of this machine"), "{e}");
    }

    #[test]
    fn validation() {
        let c = ClusterConfig {
            heartbeat: Duration::from_secs(2),
            ..ClusterConfig::default()
        };
        assert!(c.validate().is_err());
    }
}
