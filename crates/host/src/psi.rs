//! Pressure stall information (PSI): how much of the time tasks were stalled waiting for
//! CPU, memory or I/O — system-wide from `/proc/pressure/{cpu,memory,io}`, and per group
//! from a cgroup v2 `*.pressure` file (see [`crate::ForeignGroup::pressure`]).
//!
//! What it owns: parsing the format (pure, tested on fixed text), one-shot readings, a
//! cheap repeated reader for monitors ([`PressureReader`]: opened once, re-read from
//! offset 0), and turning two readings into stall time per second ([`stall_rate`]), which
//! is what a Senpai-style harvester steers by. It only reads; it never writes the files
//! (a write there registers a trigger, which needs a poller Granule does not run).
//!
//! `some` is the share of time at least one task was stalled; `full`, the share in which
//! all non-idle tasks were stalled at once (for the system's `cpu` file, 0 before Linux
//! 5.13 reported it at all, and undefined by the kernel's documentation).

use crate::file::{read_text, Sampled};
use crate::HostError;
use std::fmt;
use std::path::{Path, PathBuf};
use std::time::{Duration, Instant};

/// The directory of the system-wide files.
pub const PROC_PRESSURE: &str = "/proc/pressure";

/// What tasks may stall on.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash)]
pub enum Resource {
    Cpu,
    Memory,
    Io,
}

impl Resource {
    pub const ALL: [Resource; 3] = [Resource::Cpu, Resource::Memory, Resource::Io];

    /// The file name under `/proc/pressure` (and, with `.pressure`, in a v2 group).
    pub fn name(self) -> &'static str {
        match self {
            Resource::Cpu => "cpu",
            Resource::Memory => "memory",
            Resource::Io => "io",
        }
    }

    /// The system-wide file.
    pub fn system_path(self) -> PathBuf {
        Path::new(PROC_PRESSURE).join(self.name())
    }
}

impl fmt::Display for Resource {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str(self.name())
    }
}

/// One line of a pressure file: running averages (percent of wall time, over 10, 60 and
/// 300 seconds) and the total stall time since boot.
#[derive(Clone, Copy, Debug, Default, PartialEq)]
pub struct Stall {
    pub avg10: f64,
    pub avg60: f64,
    pub avg300: f64,
    /// Total stall time, microseconds (monotonic).
    pub total_us: u64,
}

/// A pressure file: the `some` line and, where the kernel writes one, the `full` line.
#[derive(Clone, Copy, Debug, Default, PartialEq)]
pub struct Pressure {
    pub some: Stall,
    pub full: Option<Stall>,
}

/// Parse a pressure file (`some avg10=0.00 avg60=0.70 avg300=4.61 total=77225257`, then
/// possibly a `full` line). `Err(line)` names a line that does not parse; a `some` line
/// is required.
pub fn parse_pressure(text: &str) -> Result<Pressure, &str> {
    let mut some = None;
    let mut full = None;
    for line in text.lines().filter(|l| !l.trim().is_empty()) {
        let mut words = line.split_ascii_whitespace();
        let slot = match words.next() {
            Some("some") => &mut some,
            Some("full") => &mut full,
            _ => continue,
        };
        let mut s = Stall::default();
        let (mut a10, mut a60, mut a300, mut total) = (false, false, false, false);
        for w in words {
            let (k, v) = w.split_once('=').ok_or(line)?;
            match k {
                "avg10" => (s.avg10, a10) = (v.parse().map_err(|_| line)?, true),
                "avg60" => (s.avg60, a60) = (v.parse().map_err(|_| line)?, true),
                "avg300" => (s.avg300, a300) = (v.parse().map_err(|_| line)?, true),
                "total" => (s.total_us, total) = (v.parse().map_err(|_| line)?, true),
                _ => {}
            }
        }
        if !(a10 && a60 && a300 && total) {
            return Err(line);
        }
        *slot = Some(s);
    }
    Ok(Pressure {
        some: some.ok_or("no `some` line")?,
        full,
    })
}

/// The system-wide pressure of one resource now.
pub fn system(resource: Resource) -> Result<Pressure, HostError> {
    read_file(&resource.system_path())
}

/// The pressure in any file of this format (a cgroup v2 group's `memory.pressure`).
pub fn read_file(path: &Path) -> Result<Pressure, HostError> {
    let text = read_text(path)?;
    parse_pressure(&text).map_err(|line| HostError::parse(path, line))
}

/// Whether this kernel reports pressure (built with PSI and not booted with `psi=0`).
pub fn available() -> bool {
    system(Resource::Memory).is_ok()
}

/// A pressure reading and when it was taken.
#[derive(Clone, Copy, Debug, PartialEq)]
pub struct Reading {
    pub at: Instant,
    pub pressure: Pressure,
}

/// One pressure file read again and again cheaply (see the module doc).
#[derive(Debug)]
pub struct PressureReader(Sampled);

impl PressureReader {
    /// The system-wide file of `resource`.
    pub fn system(resource: Resource) -> Result<PressureReader, HostError> {
        Self::open_at(resource.system_path())
    }

    /// Any file of this format (a cgroup v2 `memory.pressure`; a fake one in tests).
    pub fn open_at(path: impl Into<PathBuf>) -> Result<PressureReader, HostError> {
        Ok(PressureReader(Sampled::open(path)?))
    }

    pub fn read(&mut self) -> Result<Reading, HostError> {
        let path = self.0.path().to_path_buf();
        let at = Instant::now();
        let text = self.0.read()?;
        let pressure = parse_pressure(text).map_err(|line| HostError::parse(path, line))?;
        Ok(Reading { at, pressure })
    }
}

/// Stall time per second of wall time between two readings (0.0 ..= 1.0 for one group or
/// the system: the share of the interval tasks were stalled).
#[derive(Clone, Copy, Debug, Default, PartialEq)]
pub struct StallRate {
    pub some: f64,
    pub full: Option<f64>,
}

/// Stall time per second between `earlier` and `later` (from the `total` counters, so
/// exact over any interval, unlike the kernel's 10 s average). 0 when no time passed.
pub fn stall_rate(earlier: &Reading, later: &Reading) -> StallRate {
    let wall = later.at.saturating_duration_since(earlier.at);
    StallRate {
        some: stall_per_second(
            earlier.pressure.some.total_us,
            later.pressure.some.total_us,
            wall,
        ),
        full: match (earlier.pressure.full, later.pressure.full) {
            (Some(a), Some(b)) => Some(stall_per_second(a.total_us, b.total_us, wall)),
            _ => None,
        },
    }
}

/// Stall seconds per second over `wall`, from two `total` counters (microseconds).
pub fn stall_per_second(total_before_us: u64, total_after_us: u64, wall: Duration) -> f64 {
    if wall.is_zero() {
        return 0.0;
    }
    total_after_us.saturating_sub(total_before_us) as f64 / 1e6 / wall.as_secs_f64()
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn pressure_lines() {
        let p = parse_pressure(
            "some avg10=1.50 avg60=0.70 avg300=4.61 total=77225257\n\
             full avg10=0.00 avg60=0.00 avg300=0.00 total=12\n",
        )
        .unwrap();
        assert_eq!(p.some.avg10, 1.5);
        assert_eq!(p.some.avg300, 4.61);
        assert_eq!(p.some.total_us, 77_225_257);
        assert_eq!(p.full.unwrap().total_us, 12);
        // Before 5.13 the system cpu file had no `full` line.
        let p = parse_pressure("some avg10=0.00 avg60=0.00 avg300=0.00 total=0\n").unwrap();
        assert_eq!(p.full, None);
        for bad in [
            "",
            "full avg10=0.00 avg60=0.00 avg300=0.00 total=0\n",
            "some avg10=x avg60=0.00 avg300=0.00 total=0\n",
            "some avg10=0.00 avg60=0.00 avg300=0.00\n",
            "some avg10 avg60=0.00 avg300=0.00 total=0\n",
        ] {
            assert!(parse_pressure(bad).is_err(), "{bad:?}");
        }
    }

    #[test]
    fn two_readings_give_stall_per_second() {
        let t = Instant::now();
        let at = |ms: u64, some: u64, full: Option<u64>| Reading {
            at: t + Duration::from_millis(ms),
            pressure: Pressure {
                some: Stall {
                    total_us: some,
                    ..Stall::default()
                },
                full: full.map(|f| Stall {
                    total_us: f,
                    ..Stall::default()
                }),
            },
        };
        // 25 ms stalled in 100 ms: a quarter; full 10 ms: a tenth.
        let r = stall_rate(&at(0, 1000, Some(0)), &at(100, 26_000, Some(10_000)));
        assert!((r.some - 0.25).abs() < 1e-9, "{r:?}");
        assert!((r.full.unwrap() - 0.1).abs() < 1e-9, "{r:?}");
        assert_eq!(stall_rate(&at(0, 5, None), &at(100, 5, Some(1))).full, None);
        assert_eq!(stall_per_second(10, 5, Duration::from_secs(1)), 0.0);
        assert_eq!(stall_per_second(0, 5, Duration::ZERO), 0.0);
    }

    #[test]
    fn this_machines_pressure() {
        if !available() {
            eprintln!("skipping: this kernel reports no pressure (PSI)");
            return;
        }
        for r in Resource::ALL {
            let p = system(r).unwrap();
            assert!(p.some.avg10 >= 0.0, "{r}: {p:?}");
            let mut reader = PressureReader::system(r).unwrap();
            let a = reader.read().unwrap();
            std::thread::sleep(Duration::from_millis(5));
            let b = reader.read().unwrap();
            assert!(b.pressure.some.total_us >= a.pressure.some.total_us);
            let rate = stall_rate(&a, &b);
            // System-wide `some` counts one stalled task at a time: at most all the time.
            assert!((0.0..=1.01).contains(&rate.some), "{r}: {rate:?}");
        }
    }

    #[test]
    fn a_group_file_is_read_like_the_systems() {
        let t = tempfile::tempdir().unwrap();
        let f = t.path().join("memory.pressure");
        std::fs::write(
            &f,
            "some avg10=0.00 avg60=0.00 avg300=0.00 total=10\nfull avg10=0.00 avg60=0.00 avg300=0.00 total=4\n",
        )
        .unwrap();
        assert_eq!(read_file(&f).unwrap().full.unwrap().total_us, 4);
        let mut r = PressureReader::open_at(&f).unwrap();
        assert_eq!(r.read().unwrap().pressure.some.total_us, 10);
        std::fs::write(&f, "garbage\n").unwrap();
        let e = r.read().unwrap_err().to_string();
        assert!(e.contains("memory.pressure"), "{e}");
    }
}
