//! The machine's side of harvesting: a swap file when the machine has no swap, and zswap
//! as an in-memory compressed cache in front of it (Memtrade's Silo role), set up on start
//! and undone on stop — and, after a SIGKILL, by the next start from a record.
//!
//! The record (`machine.record` in the state directory) is written *before* each change
//! and names the adjusting process (pid and start time), so that a later process undoes
//! exactly what was changed, and never while its author still runs. Its lines:
//! `adjuster PID START`, `swapfile PATH` (created and turned on by us),
//! `zswap_enabled Y|N` and `zswap_max_pool_percent N` (the values found before).

use super::HarvestError;
use granule_host::mem::Zswap;
use granule_host::swapfile;
use std::path::{Path, PathBuf};

const RECORD: &str = "machine.record";
const MAGIC: &str = "# granule producer: machine changes to undo";

/// What the producer changed on the machine.
#[derive(Clone, Debug, Default, PartialEq, Eq)]
pub(crate) struct Changes {
    pub(crate) swapfile: Option<PathBuf>,
    pub(crate) zswap_enabled: Option<bool>,
    pub(crate) zswap_pool: Option<u32>,
}

impl Changes {
    fn is_empty(&self) -> bool {
        *self == Changes::default()
    }

    fn to_text(&self) -> String {
        let me = std::process::id();
        let start = granule_host::process_start_time(me).unwrap_or(0);
        let mut t = format!("{MAGIC}\nadjuster {me} {start}\n");
        if let Some(p) = &self.swapfile {
            t += &format!("swapfile {}\n", p.display());
        }
        if let Some(e) = self.zswap_enabled {
            t += &format!("zswap_enabled {}\n", if e { "Y" } else { "N" });
        }
        if let Some(n) = self.zswap_pool {
            t += &format!("zswap_max_pool_percent {n}\n");
        }
        t
    }

    /// Parse a record: the changes and the adjuster (pid, start time).
    fn parse(text: &str) -> Option<(Changes, Option<(u32, u64)>)> {
        let mut lines = text.lines();
        if lines.next() != Some(MAGIC) {
            return None;
        }
        let mut c = Changes::default();
        let mut adjuster = None;
        for line in lines {
            let (k, v) = line.split_once(' ')?;
            match k {
                "adjuster" => {
                    let (p, s) = v.split_once(' ')?;
                    adjuster = Some((p.parse().ok()?, s.parse().ok()?));
                }
                "swapfile" => c.swapfile = Some(PathBuf::from(v)),
                "zswap_enabled" => c.zswap_enabled = Some(v == "Y"),
                "zswap_max_pool_percent" => c.zswap_pool = Some(v.parse().ok()?),
                _ => return None,
            }
        }
        Some((c, adjuster))
    }
}

/// The machine set-up while a producer runs.
#[derive(Debug)]
pub(crate) struct Machine {
    record: PathBuf,
    changes: Changes,
    zswap: Zswap,
}

fn record_path(state_dir: &Path) -> PathBuf {
    state_dir.join(RECORD)
}

fn write_record(path: &Path, c: &Changes) -> Result<(), HarvestError> {
    if c.is_empty() {
        return remove_record(path);
    }
    let tmp = path.with_extension("tmp");
    let io = |e| HarvestError::State {
        path: path.to_path_buf(),
        source: e,
    };
    std::fs::write(&tmp, c.to_text()).map_err(io)?;
    std::fs::rename(&tmp, path).map_err(io)
}

fn remove_record(path: &Path) -> Result<(), HarvestError> {
    match std::fs::remove_file(path) {
        Ok(()) => Ok(()),
        Err(e) if e.kind() == std::io::ErrorKind::NotFound => Ok(()),
        Err(e) => Err(HarvestError::State {
            path: path.to_path_buf(),
            source: e,
        }),
    }
}

impl Machine {
    /// Set the machine up as the configuration says; returns it and one line per change.
    pub(crate) fn setup(
        cfg: &granule_config::Market,
        state_dir: &Path,
    ) -> Result<(Machine, Vec<String>), HarvestError> {
        let mut m = Machine {
            record: record_path(state_dir),
            changes: Changes::default(),
            zswap: Zswap::system(),
        };
        let mut said = Vec::new();
        let areas = granule_host::mem::swaps()?;
        if areas.is_empty() {
            if let Some(file) = &cfg.swap_file {
                let path = PathBuf::from(file);
                // Recorded first: a kill between creating and recording would leave it.
                m.changes.swapfile = Some(path.clone());
                write_record(&m.record, &m.changes)?;
                if let Err(e) = swapfile::create_and_enable(&path, cfg.swap_size) {
                    let _ = swapfile::remove(&path);
                    m.changes.swapfile = None;
                    write_record(&m.record, &m.changes)?;
                    return Err(e.into());
                }
                said.push(format!(
                    "created and turned on swap file {} ({} MiB): the machine had no swap",
                    path.display(),
                    cfg.swap_size >> 20
                ));
            } else {
                said.push("the machine has no swap and market.swap_file is off: harvesting can only take unused page cache".into());
            }
        }
        if cfg.zswap && m.zswap.present() {
            let p = m.zswap.params()?;
            if p.max_pool_percent != cfg.zswap_pool_percent {
                m.changes.zswap_pool = Some(p.max_pool_percent);
                write_record(&m.record, &m.changes)?;
                m.zswap.set_max_pool_percent(cfg.zswap_pool_percent)?;
                said.push(format!(
                    "set zswap max_pool_percent {} (was {})",
                    cfg.zswap_pool_percent, p.max_pool_percent
                ));
            }
            if !p.enabled {
                m.changes.zswap_enabled = Some(false);
                write_record(&m.record, &m.changes)?;
                m.zswap.set_enabled(true)?;
                said.push(format!(
                    "turned zswap on (compressor {}) as a cache in front of swap",
                    p.compressor
                ));
            }
        }
        Ok((m, said))
    }

    /// Undo every change; returns one line per thing undone.
    pub(crate) fn undo(&mut self) -> Result<Vec<String>, HarvestError> {
        let out = undo_changes(&self.zswap, &mut self.changes, &self.record)?;
        remove_record(&self.record)?;
        Ok(out)
    }
}

impl Drop for Machine {
    fn drop(&mut self) {
        if !self.changes.is_empty() {
            if let Err(e) = self.undo() {
                tracing::warn!("cannot undo the producer's machine changes: {e}");
            }
        }
    }
}

/// Undo `c` (emptying it as it goes, the record rewritten after each step).
fn undo_changes(
    zswap: &Zswap,
    c: &mut Changes,
    record: &Path,
) -> Result<Vec<String>, HarvestError> {
    let mut out = Vec::new();
    // zswap first: turning it off stops new stores before the swap file goes.
    if let Some(was) = c.zswap_enabled {
        zswap.set_enabled(was)?;
        out.push(format!(
            "restored zswap enabled={}",
            if was { "Y" } else { "N" }
        ));
        c.zswap_enabled = None;
        write_record(record, c)?;
    }
    if let Some(was) = c.zswap_pool {
        zswap.set_max_pool_percent(was)?;
        out.push(format!("restored zswap max_pool_percent {was}"));
        c.zswap_pool = None;
        write_record(record, c)?;
    }
    if let Some(path) = c.swapfile.clone() {
        if swapfile::is_active(&path)? {
            swapfile::disable(&path)?;
        }
        swapfile::remove(&path)?;
        out.push(format!(
            "turned off and removed swap file {}",
            path.display()
        ));
        c.swapfile = None;
        write_record(record, c)?;
    }
    Ok(out)
}

/// Undo what a dead producer recorded in `state_dir`; nothing when there is no record.
pub(crate) fn recover(state_dir: &Path) -> Result<Vec<String>, HarvestError> {
    let path = record_path(state_dir);
    let text = match std::fs::read_to_string(&path) {
        Ok(t) => t,
        Err(e) if e.kind() == std::io::ErrorKind::NotFound => return Ok(Vec::new()),
        Err(e) => return Err(HarvestError::State { path, source: e }),
    };
    let Some((mut c, adjuster)) = Changes::parse(&text) else {
        return Err(HarvestError::Record {
            path,
            why: "not a producer's machine record".into(),
        });
    };
    if let Some((pid, start)) = adjuster {
        if pid != std::process::id() && granule_host::process_start_time(pid) == Some(start) {
            return Err(HarvestError::Record {
                path,
                why: format!("its producer, process {pid}, is still running"),
            });
        }
    }
    let out = undo_changes(&Zswap::system(), &mut c, &path)?;
    remove_record(&path)?;
    Ok(out)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn records_round_trip() {
        let c = Changes {
            swapfile: Some("/var/lib/granule/harvest.swap".into()),
            zswap_enabled: Some(false),
            zswap_pool: Some(20),
        };
        let (back, adjuster) = Changes::parse(&c.to_text()).unwrap();
        assert_eq!(back, c);
        assert_eq!(adjuster.map(|a| a.0), Some(std::process::id()));
        assert!(Changes::parse("junk\n").is_none());
    }
}
