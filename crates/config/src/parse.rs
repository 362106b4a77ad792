//! Parsing the text forms of values: sizes (`512MiB`), rates (`600MB/s`), durations
//! (`250ms`), node specs (`cpu=1,mem=512MiB`), switches (`on`/`off`). Each parser says
//! in its error what it accepts.

use granule_wire::NodeSpec;
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
    if !v.is_finite() || v < 0.0 || v >= u64::MAX as f64 {
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

/// Parse a duration such as `1s`, `250ms`, `2.5s`, `100us`, `1m`.
pub fn parse_duration(s: &str) -> Result<Duration, String> {
    let (num, unit) = split_number(s);
    let n: f64 = num
        .parse()
        .map_err(|_| format!("'{s}' is not a duration (examples: 1s, 250ms, 100us)"))?;
    // Whole numbers are converted exactly (a float would round some nanoseconds away).
    let unit_ns: Option<u64> = match unit.trim() {
        "s" | "" => Some(1_000_000_000),
        "ms" => Some(1_000_000),
        "us" | "µs" => Some(1_000),
        "ns" => Some(1),
        "m" | "min" => Some(60_000_000_000),
        "h" => Some(3_600_000_000_000),
        _ => None,
    };
    if let (Ok(whole), Some(u)) = (num.parse::<u64>(), unit_ns) {
        if let Some(ns) = whole
            .checked_mul(u)
            .filter(|ns| *ns <= 1_000_000_000_000_000_000)
        {
            return Ok(Duration::from_nanos(ns));
        }
    }
    let secs = match unit.trim() {
        "s" | "" => n,
        "ms" => n / 1e3,
        "us" | "µs" => n / 1e6,
        "ns" => n / 1e9,
        "m" | "min" => n * 60.0,
        "h" => n * 3600.0,
        other => {
            return Err(format!(
                "unknown duration unit '{other}' in '{s}' (use ns, us, ms, s, m, h)"
            ))
        }
    };
    if !secs.is_finite() || !(0.0..=1e12).contains(&secs) {
        return Err(format!("'{s}' is not a valid duration"));
    }
    Ok(Duration::from_secs_f64(secs))
}

/// A duration as its shortest exact text (`100us`, `1.5s`), the inverse of
/// [`parse_duration`].
pub fn format_duration(d: Duration) -> String {
    let ns = d.as_nanos();
    if ns == 0 {
        "0s".into()
    } else if ns.is_multiple_of(1_000_000_000) {
        format!("{}s", ns / 1_000_000_000)
    } else if ns.is_multiple_of(1_000_000) {
        format!("{}ms", ns / 1_000_000)
    } else if ns.is_multiple_of(1_000) {
        format!("{}us", ns / 1_000)
    } else {
        format!("{ns}ns")
    }
}

/// A size as its shortest exact text in binary units (`512MiB`, `4096B`).
pub fn format_size(b: u64) -> String {
    for (unit, m) in [
        ("TiB", 1u64 << 40),
        ("GiB", 1 << 30),
        ("MiB", 1 << 20),
        ("KiB", 1 << 10),
    ] {
        if b >= m && b.is_multiple_of(m) {
            return format!("{}{unit}", b / m);
        }
    }
    format!("{b}B")
}

/// Parse `on`/`off` (also `true`/`false`, `yes`/`no`, `1`/`0`).
pub fn parse_switch(s: &str) -> Result<bool, String> {
    match s.trim().to_ascii_lowercase().as_str() {
        "on" | "true" | "yes" | "1" => Ok(true),
        "off" | "false" | "no" | "0" => Ok(false),
        other => Err(format!("'{other}' is not on or off")),
    }
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

/// A node spec as text, the inverse of [`parse_spec`].
pub fn format_spec(s: &NodeSpec) -> String {
    format!("cpu={},mem={}", s.cores, format_size(s.mem_bytes))
}

/// Parse `;`-separated node specs.
pub fn parse_specs(s: &str) -> Result<Vec<NodeSpec>, String> {
    s.split(';')
        .map(str::trim)
        .filter(|p| !p.is_empty())
        .map(parse_spec)
        .collect()
}

/// Check that this machine can listen on `host` (an address of one of its interfaces, or
/// `0.0.0.0` for all), so a wrong listen host is reported as such before anything
/// starts, not as a failed node later.
pub fn check_listen_host(host: &str) -> Result<(), String> {
    match std::net::TcpListener::bind((host.trim(), 0)) {
        Ok(_) => Ok(()),
        Err(e) => Err(format!(
            "cannot listen on '{host}' ({e}): use an address of this machine, e.g. 127.0.0.1 \
             for one machine or 0.0.0.0 (or the machine's own IP) for several"
        )),
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use proptest::prelude::*;

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
        assert!(parse_size("-1").is_err());
        assert_eq!(parse_duration("250ms").unwrap(), Duration::from_millis(250));
        assert_eq!(parse_duration("2s").unwrap(), Duration::from_secs(2));
        assert_eq!(parse_duration("100us").unwrap(), Duration::from_micros(100));
        assert!(parse_duration("soon").is_err());
        assert!(parse_duration("1e300").is_err());
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
        assert_eq!(format_spec(&v[0]), "cpu=1,mem=512MiB");
    }

    #[test]
    fn switches() {
        assert_eq!(parse_switch(" On "), Ok(true));
        assert_eq!(parse_switch("0"), Ok(false));
        assert!(parse_switch("maybe").is_err());
    }

    #[test]
    fn listen_hosts() {
        assert!(check_listen_host("127.0.0.1").is_ok());
        // 192.0.2.0/24 is for documentation only: never an address of this machine.
        let e = check_listen_host("192.0.2.1").unwrap_err();
        assert!(e.contains("use an address of this machine"), "{e}");
    }

    proptest! {
        #[test]
        fn durations_round_trip(ns in 0u64..10_000_000_000_000) {
            let d = Duration::from_nanos(ns);
            prop_assert_eq!(parse_duration(&format_duration(d)).unwrap(), d);
        }

        #[test]
        fn sizes_round_trip(b in 0u64..(1 << 50)) {
            prop_assert_eq!(parse_size(&format_size(b)).unwrap(), b);
        }

        #[test]
        fn parsers_never_panic(s in ".{0,40}") {
            let _ = parse_size(&s);
            let _ = parse_rate(&s);
            let _ = parse_duration(&s);
            let _ = parse_specs(&s);
            let _ = parse_switch(&s);
        }
    }
}
