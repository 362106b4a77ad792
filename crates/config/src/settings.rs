//! The table of every setting: key, environment variable, what it accepts, what it does,
//! and how to parse and print its value. Adding a setting is one entry here, one field
//! in its section, and one row in `docs/guide/configuration.md` (a test checks the last).

use crate::parse::{
    format_duration, format_size, format_spec, parse_duration, parse_rate, parse_size, parse_spec,
    parse_specs, parse_switch,
};
use crate::{CgroupsMode, Config, HarvestPolicy};
use std::time::Duration;

/// One setting.
pub struct Setting {
    /// `section.name`, as in the TOML file and [`Config::set`].
    pub key: &'static str,
    /// Its environment variable.
    pub env: &'static str,
    /// What it accepts, for error messages and the guide.
    pub accepts: &'static str,
    /// What it does, in one line.
    pub doc: &'static str,
    pub(crate) set: fn(&mut Config, &str) -> Result<(), String>,
    pub(crate) get: fn(&Config) -> String,
}

impl std::fmt::Debug for Setting {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("Setting")
            .field("key", &self.key)
            .field("env", &self.env)
            .finish()
    }
}

/// The setting with this key.
pub fn setting(key: &str) -> Option<&'static Setting> {
    SETTINGS.iter().find(|s| s.key == key.trim())
}

// ---- value kinds ----------------------------------------------------------------------

fn dur(v: &str) -> Result<Duration, String> {
    parse_duration(v)
}

fn dur_nonzero(v: &str) -> Result<Duration, String> {
    match parse_duration(v)? {
        d if d.is_zero() => Err("must be more than 0".into()),
        d => Ok(d),
    }
}

fn dur_in(v: &str, lo: Duration, hi: Duration) -> Result<Duration, String> {
    let d = parse_duration(v)?;
    if d < lo || d > hi {
        return Err(format!(
            "{} is outside {}..={}",
            format_duration(d),
            format_duration(lo),
            format_duration(hi)
        ));
    }
    Ok(d)
}

fn size_in(v: &str, lo: u64, hi: u64) -> Result<u64, String> {
    let b = parse_size(v)?;
    if b < lo || b > hi {
        return Err(format!(
            "{} is outside {}..={}",
            format_size(b),
            format_size(lo),
            format_size(hi)
        ));
    }
    Ok(b)
}

fn int_in(v: &str, lo: i64, hi: i64) -> Result<i64, String> {
    let n: i64 = v
        .trim()
        .parse()
        .map_err(|_| format!("'{v}' is not a whole number"))?;
    if n < lo || n > hi {
        return Err(format!("{n} is outside {lo}..={hi}"));
    }
    Ok(n)
}

fn number_at_least(v: &str, lo: f64) -> Result<f64, String> {
    let x: f64 = v
        .trim()
        .parse()
        .map_err(|_| format!("'{v}' is not a number"))?;
    if !x.is_finite() || x < lo {
        return Err(format!("{x} is below {lo}"));
    }
    Ok(x)
}

fn fraction(v: &str) -> Result<f64, String> {
    let x = number_at_least(v, 0.0)?;
    if x > 1.0 {
        return Err(format!("{x} is above 1"));
    }
    Ok(x)
}

fn is_off(v: &str) -> bool {
    matches!(v.trim().to_ascii_lowercase().as_str(), "off" | "none")
}

fn is_auto(v: &str) -> bool {
    v.trim().eq_ignore_ascii_case("auto")
}

fn switch_text(b: bool) -> String {
    if b { "on" } else { "off" }.into()
}

fn non_empty(v: &str) -> Result<String, String> {
    let t = v.trim();
    if t.is_empty() {
        return Err("must not be empty".into());
    }
    Ok(t.to_string())
}

fn host_port(v: &str) -> Result<String, String> {
    let t = non_empty(v)?;
    match t.rsplit_once(':') {
        Some((host, port)) if !host.is_empty() && port.parse::<u16>().is_ok() => Ok(t),
        _ => Err(format!("'{t}' is not host:port")),
    }
}

fn log_filter(v: &str) -> Result<String, String> {
    let t = non_empty(v)?;
    tracing_subscriber::EnvFilter::try_new(&t).map_err(|e| format!("'{t}': {e}"))?;
    Ok(t)
}

/// One row of the table: `section.field`, its variable, what it accepts, what it does, a
/// parser from text to the field's type, and a printer back.
macro_rules! setting {
    ($key:literal, $env:literal, $accepts:literal, $doc:literal,
     $section:ident . $field:ident, $parse:expr, $print:expr $(,)?) => {
        Setting {
            key: $key,
            env: $env,
            accepts: $accepts,
            doc: $doc,
            set: |c: &mut Config, v: &str| {
                c.$section.$field = ($parse)(v)?;
                Ok(())
            },
            get: |c: &Config| ($print)(&c.$section.$field),
        }
    };
}

/// Every setting, by section.
pub static SETTINGS: &[Setting] = &[
    // ---- cluster -------------------------------------------------------------------------
    setting!(
        "cluster.nodes",
        "GRANULE_NODES",
        "';'-separated node specs such as cpu=1,mem=512MiB;cpu=2,mem=2GiB (in TOML, a list of specs)",
        "the node processes an embedded cluster starts",
        cluster.nodes,
        parse_specs,
        |v: &Vec<granule_wire::NodeSpec>| v.iter().map(format_spec).collect::<Vec<_>>().join(";"),
    ),
    setting!(
        "cluster.driver",
        "GRANULE_DRIVER",
        "a node spec such as cpu=1,mem=1GiB",
        "the driver's own node spec (the driver hosts proclets too)",
        cluster.driver,
        parse_spec,
        format_spec,
    ),
    setting!(
        "cluster.controller",
        "GRANULE_CONTROLLER",
        "host:port of a running controller, or off",
        "join that controller's cluster instead of starting one",
        cluster.controller,
        |v: &str| if is_off(v) { Ok(None) } else { host_port(v).map(Some) },
        |v: &Option<String>| v.clone().unwrap_or_else(|| "off".into()),
    ),
    setting!(
        "cluster.listen_host",
        "GRANULE_LISTEN_HOST",
        "an address of this machine, or 0.0.0.0 for all",
        "the address nodes listen on for other nodes",
        cluster.listen_host,
        |v: &str| {
            let h = non_empty(v)?;
            crate::parse::check_listen_host(&h)?;
            Ok::<String, String>(h)
        },
        |v: &String| v.clone(),
    ),
    setting!(
        "cluster.failure_timeout",
        "GRANULE_FAILURE_TIMEOUT",
        "a duration such as 1s (longer than cluster.heartbeat)",
        "silence after which the controller declares a node dead",
        cluster.failure_timeout,
        dur_nonzero,
        |d: &Duration| format_duration(*d),
    ),
    setting!(
        "cluster.heartbeat",
        "GRANULE_HEARTBEAT",
        "a duration such as 100ms (shorter than cluster.failure_timeout)",
        "how often nodes send heartbeats to the controller",
        cluster.heartbeat,
        dur_nonzero,
        |d: &Duration| format_duration(*d),
    ),
    setting!(
        "cluster.start_timeout",
        "GRANULE_START_TIMEOUT",
        "a duration such as 30s",
        "how long a driver waits for the node processes it started to register",
        cluster.start_timeout,
        dur_nonzero,
        |d: &Duration| format_duration(*d),
    ),
    setting!(
        "cluster.replace_dead",
        "GRANULE_REPLACE_DEAD",
        "on or off",
        "whether an embedded cluster's driver replaces a node process that ends or is declared dead (killing it) with a new one of the same spec",
        cluster.replace_dead,
        parse_switch,
        |b: &bool| switch_text(*b),
    ),
    setting!(
        "cluster.rejoin",
        "GRANULE_REJOIN",
        "on or off",
        "whether a node declared dead while still running rejoins as a new node (no proclets) when it finds out, instead of exiting; for nodes no driver replaces",
        cluster.rejoin,
        parse_switch,
        |b: &bool| switch_text(*b),
    ),
    setting!(
        "cluster.forget_dead_after",
        "GRANULE_FORGET_DEAD_AFTER",
        "a duration such as 60s (0s: at once)",
        "how long a dead or departed node stays in the node list (Cluster::nodes, granule status, the dashboard) after it died or left; calls to the proclets it held still fail as unreachable after that, and its id is never reused",
        cluster.forget_dead_after,
        dur,
        |d: &Duration| format_duration(*d),
    ),
    setting!(
        "cluster.cgroups",
        "GRANULE_CGROUPS",
        "auto or off",
        "auto: node processes run in cgroup v1 groups limited to their spec when possible (root, v1 memory and cpu controllers); off: never",
        cluster.cgroups,
        |v: &str| match v.trim().to_ascii_lowercase().as_str() {
            "auto" => Ok(CgroupsMode::Auto),
            "off" => Ok(CgroupsMode::Off),
            other => Err(format!("'{other}' is not a cgroups mode")),
        },
        |m: &CgroupsMode| match m {
            CgroupsMode::Auto => "auto".to_string(),
            CgroupsMode::Off => "off".to_string(),
        },
    ),
    setting!(
        "cluster.cfs_period",
        "GRANULE_CFS_PERIOD",
        "a duration in 1ms..=1s",
        "the CFS period of the node cgroups Granule creates (bounds how long a throttled node stalls)",
        cluster.cfs_period,
        |v: &str| dur_in(v, Duration::from_millis(1), Duration::from_secs(1)),
        |d: &Duration| format_duration(*d),
    ),
    setting!(
        "cluster.dashboard",
        "GRANULE_DASHBOARD",
        "IP:PORT (port 0 = a free one), or off",
        "where an embedded or standalone controller serves its dashboard, /api/cluster, /api/events and /metrics",
        cluster.dashboard,
        |v: &str| if is_off(v) { Ok(None) } else { host_port(v).map(Some) },
        |v: &Option<String>| v.clone().unwrap_or_else(|| "off".into()),
    ),
    setting!(
        "cluster.log",
        "GRANULE_LOG",
        "a log filter such as warn, info or granule_runtime=debug",
        "what the process logs to stderr",
        cluster.log,
        log_filter,
        |v: &String| v.clone(),
    ),
    // ---- node ----------------------------------------------------------------------------
    setting!(
        "node.worker_slice",
        "GRANULE_WORKER_SLICE",
        "a duration in 100us..=100ms, or off for the kernel's default",
        "the scheduler slice a node's threads ask for, so a woken worker preempts a CPU-bound neighbour",
        node.worker_slice,
        |v: &str| if is_off(v) || v.trim() == "0" {
            Ok(None)
        } else {
            dur_in(v, Duration::from_micros(100), Duration::from_millis(100)).map(Some)
        },
        |v: &Option<Duration>| v.map(format_duration).unwrap_or_else(|| "off".into()),
    ),
    setting!(
        "node.fd_reserve",
        "GRANULE_FD_RESERVE",
        "a whole number in 0..=1000000",
        "file descriptors kept free for cluster traffic: HTTP listeners refuse connections that would leave fewer below the process's limit",
        node.fd_reserve,
        |v: &str| int_in(v, 0, 1_000_000).map(|n| n as u64),
        |n: &u64| n.to_string(),
    ),
    // ---- transport -----------------------------------------------------------------------
    setting!(
        "transport.max_frame",
        "GRANULE_MAX_FRAME",
        "a size in 64KiB..=4GiB",
        "the largest frame a connection accepts after the handshake",
        transport.max_frame,
        |v: &str| size_in(v, 64 << 10, 4 << 30),
        |b: &u64| format_size(*b),
    ),
    setting!(
        "transport.max_in_flight",
        "GRANULE_MAX_IN_FLIGHT",
        "a whole number in 1..=1000000",
        "requests that may await a response at once on one connection (flow control)",
        transport.max_in_flight,
        |v: &str| int_in(v, 1, 1_000_000).map(|n| n as u64),
        |n: &u64| n.to_string(),
    ),
    setting!(
        "transport.max_incoming",
        "GRANULE_MAX_INCOMING",
        "a whole number in 1..=1000000",
        "incoming requests served at once on one connection; beyond, TCP pushes back",
        transport.max_incoming,
        |v: &str| int_in(v, 1, 1_000_000).map(|n| n as u64),
        |n: &u64| n.to_string(),
    ),
    setting!(
        "transport.handshake_timeout",
        "GRANULE_HANDSHAKE_TIMEOUT",
        "a duration such as 5s",
        "time allowed for connecting and for the hello exchange",
        transport.handshake_timeout,
        dur_nonzero,
        |d: &Duration| format_duration(*d),
    ),
    setting!(
        "transport.spin",
        "GRANULE_SPIN",
        "a duration in 0s..=10ms (0: never spin)",
        "how long a thread waiting for a reply polls before it sleeps",
        transport.spin,
        |v: &str| dur_in(v, Duration::ZERO, Duration::from_millis(10)),
        |d: &Duration| format_duration(*d),
    ),
    // ---- http ----------------------------------------------------------------------------
    setting!(
        "http.max_connections",
        "GRANULE_HTTP_MAX_CONNECTIONS",
        "a whole number in 1..=1000000",
        "connections each HTTP listener (node /metrics, service front door, dashboard) serves at once; beyond, 503 and closed",
        http.max_connections,
        |v: &str| int_in(v, 1, 1_000_000).map(|n| n as u64),
        |n: &u64| n.to_string(),
    ),
    setting!(
        "http.header_timeout",
        "GRANULE_HTTP_HEADER_TIMEOUT",
        "a duration in 10ms..=1h",
        "an HTTP connection that has not sent a request's complete headers this long after opening (or after its next request's first byte) is closed",
        http.header_timeout,
        |v: &str| dur_in(v, Duration::from_millis(10), Duration::from_secs(3600)),
        |d: &Duration| format_duration(*d),
    ),
    setting!(
        "http.idle_timeout",
        "GRANULE_HTTP_IDLE_TIMEOUT",
        "a duration in 10ms..=24h",
        "an HTTP connection with no request running and no bytes moving this long is closed",
        http.idle_timeout,
        |v: &str| dur_in(v, Duration::from_millis(10), Duration::from_secs(86_400)),
        |d: &Duration| format_duration(*d),
    ),
    // ---- migration -----------------------------------------------------------------------
    setting!(
        "migration.throttle",
        "GRANULE_MIGRATION_THROTTLE",
        "a rate such as 600MB/s, or off",
        "pace state transfers to this rate (a slow-migration baseline)",
        migration.throttle,
        |v: &str| if is_off(v) { Ok(None) } else { parse_rate(v).map(Some) },
        |v: &Option<u64>| v.map(|b| format!("{}/s", format_size(b))).unwrap_or_else(|| "off".into()),
    ),
    setting!(
        "migration.delay",
        "GRANULE_MIGRATION_DELAY",
        "a duration such as 200ms",
        "wait this long before starting each move (a slow-to-react baseline)",
        migration.delay,
        dur,
        |d: &Duration| format_duration(*d),
    ),
    setting!(
        "migration.duty",
        "GRANULE_MIGRATION_DUTY",
        "a share in (0, 1], e.g. 0.5 (1: no pacing)",
        "the share of the time a shedding move may keep its node's CPU busy encoding",
        migration.duty,
        |v: &str| {
            let d = number_at_least(v, 0.0)?;
            if d > 0.0 && d <= 1.0 {
                Ok(d)
            } else {
                Err(format!("{d} is not in (0, 1]"))
            }
        },
        |d: &f64| d.to_string(),
    ),
    setting!(
        "migration.nice",
        "GRANULE_MIGRATION_NICE",
        "a nice value in -20..=19",
        "the priority of the threads that decode arriving states",
        migration.nice,
        |v: &str| int_in(v, -20, 19).map(|n| n as i32),
        |n: &i32| n.to_string(),
    ),
    setting!(
        "migration.chunk",
        "GRANULE_MIGRATION_CHUNK",
        "a size in 4KiB..=64MiB",
        "the size of one chunk of a state stream",
        migration.chunk,
        |v: &str| size_in(v, 4 << 10, 64 << 20),
        |b: &u64| format_size(*b),
    ),
    setting!(
        "migration.window",
        "GRANULE_MIGRATION_WINDOW",
        "a whole number of chunks in 1..=1024",
        "chunks of a state stream in flight at once",
        migration.window,
        |v: &str| int_in(v, 1, 1024).map(|n| n as u64),
        |n: &u64| n.to_string(),
    ),
    setting!(
        "migration.stall_timeout",
        "GRANULE_MIGRATION_STALL_TIMEOUT",
        "a duration such as 30s",
        "a state stream whose receiver acknowledges nothing for this long (decoding the state included) is abandoned",
        migration.stall_timeout,
        dur_nonzero,
        |d: &Duration| format_duration(*d),
    ),
    // ---- pressure ------------------------------------------------------------------------
    setting!(
        "pressure.shed",
        "GRANULE_SHED",
        "on or off",
        "whether nodes move proclets away on their own under memory or CPU pressure",
        pressure.shed,
        parse_switch,
        |b: &bool| switch_text(*b),
    ),
    setting!(
        "pressure.mem_interval",
        "GRANULE_MEM_INTERVAL",
        "a duration in 1ms..=10s",
        "how often the monitor samples memory",
        pressure.mem_interval,
        |v: &str| dur_in(v, Duration::from_millis(1), Duration::from_secs(10)),
        |d: &Duration| format_duration(*d),
    ),
    setting!(
        "pressure.cpu_interval",
        "GRANULE_CPU_INTERVAL",
        "a duration in 1ms..=10s",
        "how often the monitor samples CPU (throttling, run-queue delay, per-proclet use)",
        pressure.cpu_interval,
        |v: &str| dur_in(v, Duration::from_millis(1), Duration::from_secs(10)),
        |d: &Duration| format_duration(*d),
    ),
    setting!(
        "pressure.mem_free_min",
        "GRANULE_MEM_FREE_MIN",
        "a size such as 64MiB, or auto (10% of the limit, within 32MiB..=256MiB)",
        "memory pressure below this much free memory",
        pressure.mem_free_min,
        |v: &str| if v.trim() == "auto" { Ok(None) } else { parse_size(v).map(Some) },
        |v: &Option<u64>| v.map(format_size).unwrap_or_else(|| "auto".into()),
    ),
    setting!(
        "pressure.mem_horizon",
        "GRANULE_MEM_HORIZON",
        "a duration such as 2s",
        "memory pressure also when free memory would last less than this at the current growth",
        pressure.mem_horizon,
        dur_nonzero,
        |d: &Duration| format_duration(*d),
    ),
    setting!(
        "pressure.cpu_throttled_max",
        "GRANULE_CPU_THROTTLED_MAX",
        "a fraction in 0..=1",
        "CPU pressure above this fraction of throttled CFS periods (over 300 ms)",
        pressure.cpu_throttled_max,
        |v: &str| {
            let x = number_at_least(v, 0.0)?;
            if x <= 1.0 {
                Ok(x)
            } else {
                Err(format!("{x} is above 1"))
            }
        },
        |x: &f64| x.to_string(),
    ),
    setting!(
        "pressure.runq_delay_max",
        "GRANULE_RUNQ_DELAY_MAX",
        "a number ≥ 0 (threads kept waiting per core)",
        "CPU pressure above this run-queue delay per core, three samples in a row",
        pressure.runq_delay_max,
        |v: &str| number_at_least(v, 0.0),
        |x: &f64| x.to_string(),
    ),
    setting!(
        "pressure.cpu_window",
        "GRANULE_CPU_WINDOW",
        "a duration such as 1s",
        "the time constant of each proclet's CPU average",
        pressure.cpu_window,
        dur_nonzero,
        |d: &Duration| format_duration(*d),
    ),
    setting!(
        "pressure.compute_min_cores_per_mib",
        "GRANULE_COMPUTE_MIN_CORES_PER_MIB",
        "a number ≥ 0 (cores per MiB)",
        "warn when a compute proclet of 1 MiB or more uses fewer cores per MiB",
        pressure.compute_min_cores_per_mib,
        |v: &str| number_at_least(v, 0.0),
        |x: &f64| x.to_string(),
    ),
    setting!(
        "pressure.memory_max_cores_per_mib",
        "GRANULE_MEMORY_MAX_CORES_PER_MIB",
        "a number ≥ 0 (cores per MiB)",
        "warn when a memory proclet uses more cores per MiB",
        pressure.memory_max_cores_per_mib,
        |v: &str| number_at_least(v, 0.0),
        |x: &f64| x.to_string(),
    ),
    // ---- faults --------------------------------------------------------------------------
    setting!(
        "faults.enabled",
        "GRANULE_FAULTS",
        "on or off",
        "whether nodes accept fault-injection orders (transport filter, failpoints) from their driver; for tests only",
        faults.enabled,
        parse_switch,
        |b: &bool| switch_text(*b),
    ),
    setting!(
        "faults.failpoints",
        "GRANULE_FAILPOINTS",
        "name=spec pairs separated by ';', e.g. stream.chunk_sent=2*off->crash (names: see the failpoints crate)",
        "failpoints armed from the start (needs faults.enabled)",
        faults.failpoints,
        |v: &str| {
            granule_failpoints::check_list(v).map_err(|e| e.to_string())?;
            Ok::<String, String>(v.trim().to_string())
        },
        |v: &String| v.clone(),
    ),
    // ---- market: harvester ---------------------------------------------------------------
    setting!(
        "market.policy",
        "GRANULE_MARKET_POLICY",
        "baseline or psi",
        "the harvester's control law: baseline (p99 against swap-free periods, Memtrade) or psi (memory stall target, Senpai/TMO)",
        market.policy,
        |v: &str| match v.trim() {
            "baseline" => Ok(HarvestPolicy::Baseline),
            "psi" => Ok(HarvestPolicy::Psi),
            other => Err(format!("'{other}' is neither baseline nor psi")),
        },
        |p: &HarvestPolicy| p.name().to_string(),
    ),
    setting!(
        "market.chunk",
        "GRANULE_MARKET_CHUNK",
        "a size in 1MiB..=16GiB",
        "how much one harvesting step lowers the producer workload's memory limit",
        market.chunk,
        |v: &str| size_in(v, 1 << 20, 16 << 30),
        |b: &u64| format_size(*b),
    ),
    setting!(
        "market.cooling_period",
        "GRANULE_MARKET_COOLING_PERIOD",
        "a duration in 100ms..=1h",
        "time between two harvesting steps",
        market.cooling_period,
        |v: &str| dur_in(v, Duration::from_millis(100), Duration::from_secs(3600)),
        |d: &Duration| format_duration(*d),
    ),
    setting!(
        "market.observe",
        "GRANULE_MARKET_OBSERVE",
        "a duration in 0s..=1h",
        "how long the harvester watches the workload (its referenced bits cleared) before its first step",
        market.observe,
        |v: &str| dur_in(v, Duration::ZERO, Duration::from_secs(3600)),
        |d: &Duration| format_duration(*d),
    ),
    setting!(
        "market.slowdown_threshold",
        "GRANULE_MARKET_SLOWDOWN_THRESHOLD",
        "a fraction in 0..=1",
        "a drop: the workload's recent p99 worse than its baseline p99 by more than this fraction",
        market.slowdown_threshold,
        |v: &str| fraction(v),
        |x: &f64| x.to_string(),
    ),
    setting!(
        "market.baseline_window",
        "GRANULE_MARKET_BASELINE_WINDOW",
        "a duration in 1s..=1d",
        "how long a swap-free performance sample stays in the harvester's baseline",
        market.baseline_window,
        |v: &str| dur_in(v, Duration::from_secs(1), Duration::from_secs(86400)),
        |d: &Duration| format_duration(*d),
    ),
    setting!(
        "market.state_dir",
        "GRANULE_MARKET_STATE_DIR",
        "a directory path",
        "where a producer records what it changed on the machine (limit, swap, zswap) so the next start undoes it after a SIGKILL",
        market.state_dir,
        non_empty,
        |s: &String| s.clone(),
    ),
    setting!(
        "market.severe_epochs",
        "GRANULE_MARKET_SEVERE_EPOCHS",
        "an integer in 1..=100",
        "a severe drop: the workload's recent p99 worse than every baseline sample for this many epochs in a row (then the harvester prefetches)",
        market.severe_epochs,
        |v: &str| int_in(v, 1, 100).map(|n| n as u32),
        |n: &u32| n.to_string(),
    ),
    setting!(
        "market.prefetch",
        "GRANULE_MARKET_PREFETCH",
        "on or off",
        "on a severe drop or a burst, ask the kernel to read the workload's swapped-out memory back (process_madvise MADV_WILLNEED)",
        market.prefetch,
        parse_switch,
        |b: &bool| switch_text(*b),
    ),
    setting!(
        "market.psi_target",
        "GRANULE_MARKET_PSI_TARGET",
        "a fraction in 0..=1",
        "the psi policy's target: memory stall time (some) per second of wall time it probes down under and backs off above",
        market.psi_target,
        |v: &str| fraction(v),
        |x: &f64| x.to_string(),
    ),
    setting!(
        "market.headroom",
        "GRANULE_MARKET_HEADROOM",
        "a size in 0..=64GiB",
        "free swap (and memory) that must remain after a harvesting step; below it the harvester does not lower the limit",
        market.headroom,
        |v: &str| size_in(v, 0, 64 << 30),
        |b: &u64| format_size(*b),
    ),
    setting!(
        "market.swapin_tolerance",
        "GRANULE_MARKET_SWAPIN_TOLERANCE",
        "a number of pages per second, 0 or more",
        "without an application metric: the anonymous refault rate above which the workload counts as slowed down",
        market.swapin_tolerance,
        |v: &str| number_at_least(v, 0.0),
        |x: &f64| x.to_string(),
    ),
    setting!(
        "market.burst_swapin",
        "GRANULE_MARKET_BURST_SWAPIN",
        "a number of pages per second, 1 or more",
        "a burst: the anonymous refault rate over a quarter of a second above this; the harvester lifts the limit at once",
        market.burst_swapin,
        |v: &str| number_at_least(v, 1.0),
        |x: &f64| x.to_string(),
    ),
    setting!(
        "market.swap_file",
        "GRANULE_MARKET_SWAP_FILE",
        "a file path, or off",
        "the swap file a producer creates when the machine has no swap (removed on exit); off: never create one",
        market.swap_file,
        |v: &str| if is_off(v) { Ok(None) } else { non_empty(v).map(Some) },
        |v: &Option<String>| v.clone().unwrap_or_else(|| "off".into()),
    ),
    setting!(
        "market.swap_size",
        "GRANULE_MARKET_SWAP_SIZE",
        "a size in 64MiB..=1TiB",
        "the size of the swap file a producer creates",
        market.swap_size,
        |v: &str| size_in(v, 64 << 20, 1 << 40),
        |b: &u64| format_size(*b),
    ),
    setting!(
        "market.zswap",
        "GRANULE_MARKET_ZSWAP",
        "on or off",
        "turn zswap on as a compressed in-memory cache in front of swap while producing (restored on exit)",
        market.zswap,
        parse_switch,
        |b: &bool| switch_text(*b),
    ),
    setting!(
        "market.zswap_pool_percent",
        "GRANULE_MARKET_ZSWAP_POOL_PERCENT",
        "an integer in 1..=100",
        "the largest share of RAM zswap's pool may take while producing",
        market.zswap_pool_percent,
        |v: &str| int_in(v, 1, 100).map(|n| n as u32),
        |n: &u32| n.to_string(),
    ),
    setting!(
        "market.metric",
        "GRANULE_MARKET_METRIC",
        "swapin, socket:PATH or http:URL",
        "the producer workload's performance signal: the anonymous refault rate, latency samples the application pushes to a Unix socket (one number per line, microseconds), or a URL polled for the current p99 latency",
        market.metric,
        |v: &str| {
            let v = v.trim();
            if v == "swapin" || v.strip_prefix("socket:").is_some_and(|p| !p.is_empty())
                || v.strip_prefix("http:").is_some_and(|p| !p.is_empty())
            {
                Ok(v.to_string())
            } else {
                Err(format!("'{v}' is none of swapin, socket:PATH, http:URL"))
            }
        },
        |s: &String| s.clone(),
    ),
    // ---- market: harvester, more settings go above this line ----
    // ---- market: stores --------------------------------------------------------------------
    setting!(
        "market.slab",
        "GRANULE_MARKET_SLAB",
        "a size in 1MiB..=64GiB",
        "the unit of leasing: harvested memory is offered in slabs of this size",
        market.slab,
        |v: &str| size_in(v, 1 << 20, 64 << 30),
        |b: &u64| format_size(*b),
    ),
    setting!(
        "market.store_max_connections",
        "GRANULE_MARKET_STORE_MAX_CONNECTIONS",
        "a whole number in 1..=1000000",
        "connections one producer store serves at once; beyond, an -ERR and closed",
        market.store_max_connections,
        |v: &str| int_in(v, 1, 1_000_000).map(|n| n as u64),
        |n: &u64| n.to_string(),
    ),
    setting!(
        "market.store_max_bulk",
        "GRANULE_MARKET_STORE_MAX_BULK",
        "a size in 1KiB..=512MiB",
        "the largest bulk string (key or value) a producer store accepts; a longer one gets an -ERR and the connection is closed",
        market.store_max_bulk,
        |v: &str| size_in(v, 1 << 10, 512 << 20),
        |b: &u64| format_size(*b),
    ),
    setting!(
        "market.store_max_args",
        "GRANULE_MARKET_STORE_MAX_ARGS",
        "a whole number in 3..=16777216",
        "the most arguments in one command a producer store accepts (MSET, MGET, DEL); more get an -ERR and the connection is closed",
        market.store_max_args,
        |v: &str| int_in(v, 3, 1 << 24).map(|n| n as u64),
        |n: &u64| n.to_string(),
    ),
    setting!(
        "market.store_rate",
        "GRANULE_MARKET_STORE_RATE",
        "a size per second in 1KiB..=1TiB (e.g. 100MiB), or off",
        "default token-bucket limit of one lease's consumer, bytes of requests and replies per second; over it a request gets an -ERR at once (off: unlimited)",
        market.store_rate,
        |v: &str| if is_off(v) || v.trim() == "0" { Ok(0) } else { size_in(v, 1 << 10, 1 << 40) },
        |b: &u64| if *b == 0 { "off".into() } else { format_size(*b) },
    ),
    setting!(
        "market.revoke_grace",
        "GRANULE_MARKET_REVOKE_GRACE",
        "a duration in 0s..=1h",
        "how long the holder of a no-eviction lease has to move its data after a revocation notice before the store is dropped",
        market.revoke_grace,
        |v: &str| dur_in(v, Duration::ZERO, Duration::from_secs(3600)),
        |d: &Duration| format_duration(*d),
    ),
    setting!(
        "market.store_auth_timeout",
        "GRANULE_MARKET_STORE_AUTH_TIMEOUT",
        "a duration in 100ms..=1h",
        "how long a connection to a producer store may stay without authenticating (AUTH, or HELLO with AUTH) before it is closed",
        market.store_auth_timeout,
        |v: &str| dur_in(v, Duration::from_millis(100), Duration::from_secs(3600)),
        |d: &Duration| format_duration(*d),
    ),
    setting!(
        "market.store_max_unauthenticated",
        "GRANULE_MARKET_STORE_MAX_UNAUTHENTICATED",
        "a whole number in 1..=1000000",
        "connections of one producer store that have not authenticated yet: past this many (or when store_max_connections are open), a new connection closes the oldest of them that had a tenth of store_auth_timeout to authenticate, so strangers cannot take the lease holder's room",
        market.store_max_unauthenticated,
        |v: &str| int_in(v, 1, 1_000_000).map(|n| n as u64),
        |n: &u64| n.to_string(),
    ),
    // ---- market: stores, more settings go above this line ----
    // ---- market: broker --------------------------------------------------------------------
    setting!(
        "market.broker",
        "GRANULE_MARKET_BROKER",
        "host:port, or none for the cluster's controller",
        "the memory market's broker",
        market.broker,
        |v: &str| if is_off(v) { Ok(None) } else { host_port(v).map(Some) },
        |b: &Option<String>| b.clone().unwrap_or_else(|| "none".into()),
    ),
    setting!(
        "market.report_interval",
        "GRANULE_MARKET_REPORT_INTERVAL",
        "a duration in 10ms..=10min",
        "how often a producer reports its free memory to the broker",
        market.report_interval,
        |v: &str| dur_in(v, Duration::from_millis(10), Duration::from_secs(600)),
        |d: &Duration| format_duration(*d),
    ),
    setting!(
        "market.lease_time",
        "GRANULE_MARKET_LEASE_TIME",
        "a duration in 1s..=30d",
        "how long a lease lasts when the consumer does not say",
        market.lease_time,
        |v: &str| dur_in(v, Duration::from_secs(1), Duration::from_secs(30 * 86400)),
        |d: &Duration| format_duration(*d),
    ),
    setting!(
        "market.spot_price",
        "GRANULE_MARKET_SPOT_PRICE",
        "a number above 0",
        "reference price of memory per GiB-hour (e.g. a spot instance's price over its memory); the broker's price starts at a quarter of it",
        market.spot_price,
        |v: &str| match number_at_least(v, 0.0)? {
            x if x > 0.0 => Ok(x),
            _ => Err("must be more than 0".to_string()),
        },
        |x: &f64| x.to_string(),
    ),
    setting!(
        "market.price_period",
        "GRANULE_MARKET_PRICE_PERIOD",
        "a duration in 1s..=1d",
        "how often the broker moves its price (to whichever of p, p±step earns producers most against the demand seen)",
        market.price_period,
        |v: &str| dur_in(v, Duration::from_secs(1), Duration::from_secs(86400)),
        |d: &Duration| format_duration(*d),
    ),
    setting!(
        "market.price_step",
        "GRANULE_MARKET_PRICE_STEP",
        "a fraction in 0.001..=0.5",
        "how far one price move goes, as a fraction of the current price",
        market.price_step,
        |v: &str| match fraction(v)? {
            x if (0.001..=0.5).contains(&x) => Ok(x),
            x => Err(format!("{x} is outside 0.001..=0.5")),
        },
        |x: &f64| x.to_string(),
    ),
    setting!(
        "market.refit_period",
        "GRANULE_MARKET_REFIT_PERIOD",
        "a duration in 1s..=1d",
        "how often the broker refits each producer's availability predictor",
        market.refit_period,
        |v: &str| dur_in(v, Duration::from_secs(1), Duration::from_secs(86400)),
        |d: &Duration| format_duration(*d),
    ),
    setting!(
        "market.ar_order",
        "GRANULE_MARKET_AR_ORDER",
        "a whole number in 1..=32",
        "the order p of the broker's availability predictor, ARIMA(p,1,0) fit by least squares",
        market.ar_order,
        |v: &str| int_in(v, 1, 32).map(|n| n as u64),
        |n: &u64| n.to_string(),
    ),
    setting!(
        "market.prediction_horizon",
        "GRANULE_MARKET_PREDICTION_HORIZON",
        "a duration in 1s..=1d",
        "how far ahead the broker predicts a producer's availability; a lease never gets more slabs than predicted to stay free over min(its term, this)",
        market.prediction_horizon,
        |v: &str| dur_in(v, Duration::from_secs(1), Duration::from_secs(86400)),
        |d: &Duration| format_duration(*d),
    ),
    setting!(
        "market.producer_timeout",
        "GRANULE_MARKET_PRODUCER_TIMEOUT",
        "a duration in 100ms..=1h",
        "silence after which the broker treats a producer as gone and its leases as lost",
        market.producer_timeout,
        |v: &str| dur_in(v, Duration::from_millis(100), Duration::from_secs(3600)),
        |d: &Duration| format_duration(*d),
    ),
    setting!(
        "market.max_queue",
        "GRANULE_MARKET_MAX_QUEUE",
        "a whole number in 0..=1000000",
        "requests the broker's FIFO queue holds at most; beyond, what cannot be placed at once is refused",
        market.max_queue,
        |v: &str| int_in(v, 0, 1_000_000).map(|n| n as u64),
        |n: &u64| n.to_string(),
    ),
    // ---- market: broker, more settings go above this line ----
    // ---- market: consumer ------------------------------------------------------------------
    setting!(
        "market.protection",
        "GRANULE_MARKET_PROTECTION",
        "encrypt, integrity or none",
        "how a consumer protects the values it puts in leased stores: encrypt (AEAD), integrity (keyed BLAKE3) or none",
        market.protection,
        |v: &str| match v.trim() {
            p @ ("encrypt" | "integrity" | "none") => Ok(p.to_string()),
            other => Err(format!("'{other}' is not encrypt, integrity or none")),
        },
        |s: &String| s.clone(),
    ),
    setting!(
        "market.store_timeout",
        "GRANULE_MARKET_STORE_TIMEOUT",
        "a duration in 1ms..=1min",
        "how long a consumer waits for one leased store's answer (or connection) before counting a miss",
        market.store_timeout,
        |v: &str| dur_in(v, Duration::from_millis(1), Duration::from_secs(60)),
        |d: &Duration| format_duration(*d),
    ),
    setting!(
        "market.consumer_slabs",
        "GRANULE_MARKET_CONSUMER_SLABS",
        "an integer in 0..=1000000",
        "slabs a consumer's cache leases (and asks the broker to replace when leases are lost)",
        market.consumer_slabs,
        |v: &str| match v.trim().parse::<u32>() {
            Ok(n) if n <= 1_000_000 => Ok(n),
            _ => Err(format!("'{v}' is not an integer in 0..=1000000")),
        },
        |n: &u32| n.to_string(),
    ),
    // ---- market: consumer, more settings go above this line ----
    // ---- fs --------------------------------------------------------------------------------
    setting!(
        "fs.stripe",
        "GRANULE_FS_STRIPE",
        "a size in 4KiB..=64MiB",
        "bytes per stripe: the file system cuts files into stripes of this size and places each on a store",
        fs.stripe,
        |v: &str| size_in(v, 4 << 10, 64 << 20),
        |b: &u64| format_size(*b),
    ),
    setting!(
        "fs.replicas",
        "GRANULE_FS_REPLICAS",
        "1 or 2",
        "copies of each stripe; 2 keeps a replica on the second store of the stripe's hash order",
        fs.replicas,
        |v: &str| int_in(v, 1, 2).map(|n| n as u32),
        |n: &u32| n.to_string(),
    ),
    setting!(
        "fs.victim_weight",
        "GRANULE_FS_VICTIM_WEIGHT",
        "a number in 0..=1000",
        "weight of the victim class in stripe placement (the own class weighs 1): 2 puts about two thirds of the stripes on victims",
        fs.victim_weight,
        |v: &str| match number_at_least(v, 0.0)? {
            x if x > 1000.0 => Err(format!("{x} is above 1000")),
            x => Ok(x),
        },
        |x: &f64| x.to_string(),
    ),
    setting!(
        "fs.own_share",
        "GRANULE_FS_OWN_SHARE",
        "a fraction in 0..=1",
        "share of each own node's memory its stripe store may fill (the rest is the node's own headroom)",
        fs.own_share,
        fraction,
        |x: &f64| x.to_string(),
    ),
    setting!(
        "fs.driver_store",
        "GRANULE_FS_DRIVER_STORE",
        "on or off",
        "whether the mount's own process keeps stripes too (own_share of cluster.driver's mem) when its nodes are embedded; never under an outside controller, whose nodes outlive the mount",
        fs.driver_store,
        parse_switch,
        |b: &bool| switch_text(*b),
    ),
    setting!(
        "fs.cache",
        "GRANULE_FS_CACHE",
        "a size in 0B..=64GiB",
        "the mount's cache of stripes it has read (0: none)",
        fs.cache,
        |v: &str| size_in(v, 0, 64 << 30),
        |b: &u64| format_size(*b),
    ),
    setting!(
        "fs.readahead",
        "GRANULE_FS_READAHEAD",
        "a whole number in 0..=256",
        "stripes fetched ahead of a sequential reader",
        fs.readahead,
        |v: &str| int_in(v, 0, 256).map(|n| n as u32),
        |n: &u32| n.to_string(),
    ),
    setting!(
        "fs.write_behind",
        "GRANULE_FS_WRITE_BEHIND",
        "a whole number in 1..=256",
        "stripe writes the mount keeps in flight at once before a writer waits",
        fs.write_behind,
        |v: &str| int_in(v, 1, 256).map(|n| n as u32),
        |n: &u32| n.to_string(),
    ),
    setting!(
        "fs.dirty",
        "GRANULE_FS_DIRTY",
        "a size in 1MiB..=64GiB",
        "bytes of partly written stripes the mount buffers before it sends a file's buffers (random writers rewrite buffered stripes without a round trip to a store)",
        fs.dirty,
        |v: &str| size_in(v, 1 << 20, 64 << 30),
        |b: &u64| format_size(*b),
    ),
    setting!(
        "fs.probe_every",
        "GRANULE_FS_PROBE_EVERY",
        "a duration in 50ms..=1min",
        "how often the mount probes each store it keeps stripes on (a victim with a PING, an own store with a no-op call), so a dead store is noticed without I/O to it",
        fs.probe_every,
        |v: &str| dur_in(v, Duration::from_millis(50), Duration::from_secs(60)),
        |d: &Duration| format_duration(*d),
    ),
    setting!(
        "fs.probe_misses",
        "GRANULE_FS_PROBE_MISSES",
        "a whole number in 1..=100",
        "probes in a row that find a store unreachable (connection refused or dropped, node gone) before it counts as lost and its stripes are re-replicated",
        fs.probe_misses,
        |v: &str| int_in(v, 1, 100).map(|n| n as u32),
        |n: &u32| n.to_string(),
    ),
    setting!(
        "fs.state_dir",
        "GRANULE_FS_STATE_DIR",
        "a directory path",
        "where each mount records its pid and status address, for granule fs status and umount",
        fs.state_dir,
        non_empty,
        |s: &String| s.clone(),
    ),
    // ---- pushdown ------------------------------------------------------------------------
    setting!(
        "pushdown.threads",
        "GRANULE_PUSHDOWN_THREADS",
        "a whole number in 1..=1024, or auto (the node's cores in its spec)",
        "threads of each node's pushdown pool, which runs pushed calls (Proclet::push) apart from the transport and ordinary calls",
        pushdown.threads,
        |v: &str| if is_auto(v) { Ok(None) } else { int_in(v, 1, 1024).map(|n| Some(n as u32)) },
        |v: &Option<u32>| v.map_or_else(|| "auto".into(), |n| n.to_string()),
    ),
    setting!(
        "pushdown.queue",
        "GRANULE_PUSHDOWN_QUEUE",
        "a whole number in 1..=1000000",
        "pushed calls that may wait for a pool thread or for memory at once, in arrival order; one more is refused",
        pushdown.queue,
        |v: &str| int_in(v, 1, 1_000_000).map(|n| n as u64),
        |n: &u64| n.to_string(),
    ),
    setting!(
        "pushdown.memory",
        "GRANULE_PUSHDOWN_MEMORY",
        "a size such as 512MiB (at least 1MiB), or auto (a quarter of the node's memory in its spec)",
        "the memory a node's running pushed calls may reserve together (the sum of their budgets); a call whose budget is larger is refused, one that does not fit now waits",
        pushdown.memory,
        |v: &str| if is_auto(v) { Ok(None) } else { size_in(v, 1 << 20, 1 << 50).map(Some) },
        |v: &Option<u64>| v.map_or_else(|| "auto".into(), format_size),
    ),
    setting!(
        "pushdown.call_memory",
        "GRANULE_PUSHDOWN_CALL_MEMORY",
        "a size in 0B..=1TiB",
        "the memory budget of a pushed call that asks for none (at most pushdown.memory): what its closure may reserve through pushdown::reserve",
        pushdown.call_memory,
        |v: &str| size_in(v, 0, 1 << 40),
        |b: &u64| format_size(*b),
    ),
    setting!(
        "pushdown.caller_build_memory",
        "GRANULE_PUSHDOWN_CALLER_BUILD_MEMORY",
        "a size in 1MiB..=1TiB",
        "the memory a pushdown query's caller may take for a hash join's table it builds for the shards it pulls; a larger build is refused (and the cost rule pushes those shards where the pushed calls' budgets hold it)",
        pushdown.caller_build_memory,
        |v: &str| size_in(v, 1 << 20, 1 << 40),
        |b: &u64| format_size(*b),
    ),
    setting!(
        "pushdown.cpu_cap",
        "GRANULE_PUSHDOWN_CPU_CAP",
        "a number of cores in (0, 1024] such as 0.2 or 0.5, or off (0 is off too)",
        "cap each node's pushdown pool at this much CPU (a cpu cgroup of its threads with a CFS quota); the transport and ordinary calls are not capped",
        pushdown.cpu_cap,
        |v: &str| {
            if is_off(v) {
                return Ok(None);
            }
            let x = number_at_least(v, 0.0)?;
            if x > 1024.0 {
                Err(format!("{x} is above 1024"))
            } else {
                Ok((x > 0.0).then_some(x))
            }
        },
        |v: &Option<f64>| v.map_or_else(|| "off".into(), |x| x.to_string()),
    ),
];
