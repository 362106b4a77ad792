//! Dashboard panels that layers above the controller publish (the file system's space and
//! repair figures, say): kept by publisher and name, dropped when not refreshed within
//! their time to live or when the publisher's connection closes, and bounded in number
//! and size. Pure logic, no I/O: the server keeps it in the controller's state, the HTTP
//! side shows it. The controller never interprets a panel's contents.

use granule_wire::{Panel, PanelTable};
use serde::Serialize;
use std::collections::BTreeMap;
use std::time::{Duration, Instant};
use thiserror::Error;

/// Longest panel name, in bytes.
pub const PANEL_MAX_NAME: usize = 64;
/// Longest title, fact, column name or cell, in bytes.
pub const PANEL_MAX_TEXT: usize = 256;
/// Most facts in one panel.
pub const PANEL_MAX_FACTS: usize = 32;
/// Most tables in one panel.
pub const PANEL_MAX_TABLES: usize = 8;
/// Most columns in one table.
pub const PANEL_MAX_COLUMNS: usize = 16;
/// Most rows in one table.
pub const PANEL_MAX_ROWS: usize = 256;
/// Most text in one panel (every string summed), in bytes.
pub const PANEL_MAX_BYTES: usize = 64 << 10;
/// Most panels one connection keeps published.
pub const PANELS_PER_PUBLISHER: usize = 8;
/// Most panels the controller keeps in all.
pub const PANELS_MAX: usize = 64;
/// Time to live of a panel that asks for none.
pub const PANEL_DEFAULT_TTL: Duration = Duration::from_secs(5);
/// Bounds of the time to live a panel asks for.
pub const PANEL_MIN_TTL: Duration = Duration::from_millis(100);
pub const PANEL_MAX_TTL: Duration = Duration::from_secs(60);

/// Why a panel was refused.
#[derive(Debug, Clone, PartialEq, Eq, Error)]
pub enum PanelError {
    #[error("panel refused: it has no name")]
    NoName,
    #[error("panel '{name}' refused: {what} is {got} (at most {max})")]
    TooLarge {
        name: String,
        what: String,
        got: usize,
        max: usize,
    },
    #[error(
        "panel '{name}' refused: {what} has {got} cells for {columns} columns (at most one per column)"
    )]
    RowTooWide {
        name: String,
        what: String,
        got: usize,
        columns: usize,
    },
    #[error(
        "panel '{name}' refused: its publisher keeps {limit} panels already (at most {limit} per connection)"
    )]
    TooManyFromOne { name: String, limit: usize },
    #[error(
        "panel '{name}' refused: the controller keeps {limit} panels already (at most {limit})"
    )]
    TooMany { name: String, limit: usize },
}

/// Check a panel against the bounds above.
pub fn check_panel(p: &Panel) -> Result<(), PanelError> {
    if p.name.is_empty() {
        return Err(PanelError::NoName);
    }
    let too_large = |what: String, got: usize, max: usize| {
        if got > max {
            Err(PanelError::TooLarge {
                name: clip(&p.name, PANEL_MAX_NAME),
                what,
                got,
                max,
            })
        } else {
            Ok(())
        }
    };
    too_large("its name's length".into(), p.name.len(), PANEL_MAX_NAME)?;
    too_large("its title's length".into(), p.title.len(), PANEL_MAX_TEXT)?;
    too_large("the number of facts".into(), p.facts.len(), PANEL_MAX_FACTS)?;
    too_large(
        "the number of tables".into(),
        p.tables.len(),
        PANEL_MAX_TABLES,
    )?;
    for (i, (k, v)) in p.facts.iter().enumerate() {
        too_large(
            format!("fact {i}'s length"),
            k.len().max(v.len()),
            PANEL_MAX_TEXT,
        )?;
    }
    for (t, table) in p.tables.iter().enumerate() {
        let which = if table.title.is_empty() {
            format!("table {t}")
        } else {
            format!("table '{}'", clip(&table.title, 40))
        };
        too_large(
            format!("{which}'s title length"),
            table.title.len(),
            PANEL_MAX_TEXT,
        )?;
        too_large(
            format!("the number of columns of {which}"),
            table.columns.len(),
            PANEL_MAX_COLUMNS,
        )?;
        too_large(
            format!("the number of rows of {which}"),
            table.rows.len(),
            PANEL_MAX_ROWS,
        )?;
        let longest = table.columns.iter().map(String::len).max().unwrap_or(0);
        too_large(
            format!("a column name's length in {which}"),
            longest,
            PANEL_MAX_TEXT,
        )?;
        for (r, row) in table.rows.iter().enumerate() {
            if row.len() > table.columns.len() {
                return Err(PanelError::RowTooWide {
                    name: clip(&p.name, PANEL_MAX_NAME),
                    what: format!("row {r} of {which}"),
                    got: row.len(),
                    columns: table.columns.len(),
                });
            }
            let longest = row.iter().map(String::len).max().unwrap_or(0);
            too_large(
                format!("a cell's length in row {r} of {which}"),
                longest,
                PANEL_MAX_TEXT,
            )?;
        }
    }
    too_large("its text in bytes".into(), text_bytes(p), PANEL_MAX_BYTES)
}

/// Every string of a panel, summed.
fn text_bytes(p: &Panel) -> usize {
    let table = |t: &PanelTable| {
        t.title.len()
            + t.columns.iter().map(String::len).sum::<usize>()
            + t.rows.iter().flatten().map(String::len).sum::<usize>()
    };
    p.name.len()
        + p.title.len()
        + p.facts
            .iter()
            .map(|(k, v)| k.len() + v.len())
            .sum::<usize>()
        + p.tables.iter().map(table).sum::<usize>()
}

/// At most `max` bytes of `s`, cut at a character boundary.
fn clip(s: &str, max: usize) -> String {
    let mut end = s.len().min(max);
    while !s.is_char_boundary(end) {
        end -= 1;
    }
    s[..end].to_string()
}

/// A published panel as `/api/panels` and `/api/cluster` show it.
#[derive(Serialize, Debug, Clone, PartialEq)]
pub struct PanelView {
    pub name: String,
    pub title: String,
    /// Who published it: its node (`n3`) or, for an unregistered peer, its address.
    pub from: String,
    /// When the last copy arrived, milliseconds since the UNIX epoch (controller's clock).
    pub updated_ms: u64,
    /// It disappears this long from now unless refreshed.
    pub expires_in_ms: u64,
    pub facts: Vec<(String, String)>,
    pub tables: Vec<PanelTable>,
}

struct Kept {
    panel: Panel,
    from: String,
    updated_ms: u64,
    expires: Instant,
}

/// The published panels, by (publishing connection, name).
#[derive(Default)]
pub struct Panels {
    kept: BTreeMap<(u64, String), Kept>,
}

impl Panels {
    /// Keep (or refresh) a panel from connection `source` (described as `from`), checked
    /// against the bounds; `now_ms` is the wall clock for display.
    pub fn publish(
        &mut self,
        source: u64,
        from: String,
        panel: Panel,
        now: Instant,
        now_ms: u64,
    ) -> Result<(), PanelError> {
        check_panel(&panel)?;
        self.prune(now);
        let key = (source, panel.name.clone());
        if !self.kept.contains_key(&key) {
            let mine = self.kept.keys().filter(|(s, _)| *s == source).count();
            if mine >= PANELS_PER_PUBLISHER {
                return Err(PanelError::TooManyFromOne {
                    name: panel.name,
                    limit: PANELS_PER_PUBLISHER,
                });
            }
            if self.kept.len() >= PANELS_MAX {
                return Err(PanelError::TooMany {
                    name: panel.name,
                    limit: PANELS_MAX,
                });
            }
        }
        let ttl = match panel.ttl_ms {
            0 => PANEL_DEFAULT_TTL,
            ms => Duration::from_millis(ms).clamp(PANEL_MIN_TTL, PANEL_MAX_TTL),
        };
        self.kept.insert(
            key,
            Kept {
                panel,
                from,
                updated_ms: now_ms,
                expires: now + ttl,
            },
        );
        Ok(())
    }

    /// Drop the panels of a connection that closed.
    pub fn drop_source(&mut self, source: u64) {
        self.kept.retain(|(s, _), _| *s != source);
    }

    /// Drop the panels not refreshed in time.
    pub fn prune(&mut self, now: Instant) {
        self.kept.retain(|_, k| k.expires > now);
    }

    /// The live panels, ordered by title, then publisher.
    pub fn views(&self, now: Instant) -> Vec<PanelView> {
        let mut v: Vec<PanelView> = self
            .kept
            .iter()
            .filter(|(_, k)| k.expires > now)
            .map(|((_, name), k)| PanelView {
                name: name.clone(),
                title: k.panel.title.clone(),
                from: k.from.clone(),
                updated_ms: k.updated_ms,
                expires_in_ms: k.expires.saturating_duration_since(now).as_millis() as u64,
                facts: k.panel.facts.clone(),
                tables: k.panel.tables.clone(),
            })
            .collect();
        v.sort_by(|a, b| (&a.title, &a.from, &a.name).cmp(&(&b.title, &b.from, &b.name)));
        v
    }

    pub fn len(&self) -> usize {
        self.kept.len()
    }

    pub fn is_empty(&self) -> bool {
        self.kept.is_empty()
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn panel(name: &str, rows: usize) -> Panel {
        Panel {
            name: name.into(),
            title: format!("title {name}"),
            ttl_ms: 1000,
            facts: vec![("stripes draining".into(), "0".into())],
            tables: vec![PanelTable {
                title: "stores".into(),
                columns: vec!["store".into(), "used".into()],
                rows: (0..rows)
                    .map(|i| vec![format!("s{i}"), "1 GiB".into()])
                    .collect(),
            }],
        }
    }

    #[test]
    fn a_panel_lives_until_its_ttl_passes_unless_refreshed() {
        let mut p = Panels::default();
        let t0 = Instant::now();
        p.publish(1, "n1".into(), panel("fs", 2), t0, 5).unwrap();
        let v = p.views(t0);
        assert_eq!(v.len(), 1);
        assert_eq!((v[0].name.as_str(), v[0].from.as_str()), ("fs", "n1"));
        assert_eq!(v[0].expires_in_ms, 1000);
        assert_eq!(v[0].tables[0].rows.len(), 2);
        // Refreshed at 0.8 s: still there at 1.5 s, gone at 1.9 s.
        let t1 = t0 + Duration::from_millis(800);
        p.publish(1, "n1".into(), panel("fs", 3), t1, 6).unwrap();
        assert_eq!(p.views(t0 + Duration::from_millis(1500)).len(), 1);
        assert_eq!(p.views(t1).len(), 1, "a refresh replaces, not adds");
        assert_eq!(p.views(t1)[0].updated_ms, 6);
        let late = t0 + Duration::from_millis(1900);
        assert!(p.views(late).is_empty());
        p.prune(late);
        assert!(p.is_empty());
    }

    #[test]
    fn ttl_is_clamped_and_defaulted() {
        let mut p = Panels::default();
        let t0 = Instant::now();
        let mut long = panel("long", 1);
        long.ttl_ms = 3_600_000;
        let mut dflt = panel("default", 1);
        dflt.ttl_ms = 0;
        p.publish(1, "n1".into(), long, t0, 0).unwrap();
        p.publish(1, "n1".into(), dflt, t0, 0).unwrap();
        let ttl: BTreeMap<String, u64> = p
            .views(t0)
            .into_iter()
            .map(|v| (v.name, v.expires_in_ms))
            .collect();
        assert_eq!(ttl["long"], PANEL_MAX_TTL.as_millis() as u64);
        assert_eq!(ttl["default"], PANEL_DEFAULT_TTL.as_millis() as u64);
    }

    #[test]
    fn panels_are_per_publisher_and_go_with_its_connection() {
        let mut p = Panels::default();
        let t0 = Instant::now();
        p.publish(1, "n1".into(), panel("fs", 1), t0, 0).unwrap();
        p.publish(2, "n2".into(), panel("fs", 1), t0, 0).unwrap();
        assert_eq!(p.views(t0).len(), 2, "same name, two publishers");
        p.drop_source(1);
        let v = p.views(t0);
        assert_eq!(v.len(), 1);
        assert_eq!(v[0].from, "n2");
    }

    #[test]
    fn oversize_panels_are_refused_saying_which_bound() {
        let e = check_panel(&panel("fs", PANEL_MAX_ROWS + 1)).unwrap_err();
        assert_eq!(
            e.to_string(),
            format!(
                "panel 'fs' refused: the number of rows of table 'stores' is {} (at most {PANEL_MAX_ROWS})",
                PANEL_MAX_ROWS + 1
            )
        );
        let mut wide = panel("fs", 1);
        wide.tables[0].rows[0].push("extra".into());
        assert_eq!(
            check_panel(&wide).unwrap_err().to_string(),
            "panel 'fs' refused: row 0 of table 'stores' has 3 cells for 2 columns (at most one per column)"
        );
        let mut long = panel("fs", 1);
        long.facts[0].1 = "x".repeat(PANEL_MAX_TEXT + 1);
        assert!(matches!(
            check_panel(&long),
            Err(PanelError::TooLarge { what, .. }) if what == "fact 0's length"
        ));
        // Within every per-string bound, but too much text in all.
        let mut big = panel("fs", 0);
        big.tables = (0..PANEL_MAX_TABLES)
            .map(|t| PanelTable {
                title: format!("t{t}"),
                columns: vec!["a".into(); PANEL_MAX_COLUMNS],
                rows: vec![vec!["y".repeat(PANEL_MAX_TEXT); PANEL_MAX_COLUMNS]; 4],
            })
            .collect();
        assert!(matches!(
            check_panel(&big),
            Err(PanelError::TooLarge { what, .. }) if what == "its text in bytes"
        ));
        assert_eq!(check_panel(&panel("", 1)), Err(PanelError::NoName));
        assert_eq!(
            check_panel(&panel(&"n".repeat(PANEL_MAX_NAME + 1), 1))
                .unwrap_err()
                .to_string(),
            format!(
                "panel '{}' refused: its name's length is {} (at most {PANEL_MAX_NAME})",
                "n".repeat(PANEL_MAX_NAME),
                PANEL_MAX_NAME + 1
            )
        );
        // Refused panels are not kept.
        let mut p = Panels::default();
        assert!(p
            .publish(
                1,
                "n1".into(),
                panel("fs", PANEL_MAX_ROWS + 1),
                Instant::now(),
                0
            )
            .is_err());
        assert!(p.is_empty());
    }

    #[test]
    fn the_number_of_panels_is_bounded() {
        let mut p = Panels::default();
        let t0 = Instant::now();
        for i in 0..PANELS_PER_PUBLISHER {
            p.publish(1, "n1".into(), panel(&format!("p{i}"), 1), t0, 0)
                .unwrap();
        }
        let e = p
            .publish(1, "n1".into(), panel("one more", 1), t0, 0)
            .unwrap_err();
        assert_eq!(
            e.to_string(),
            format!(
                "panel 'one more' refused: its publisher keeps {PANELS_PER_PUBLISHER} panels \
                 already (at most {PANELS_PER_PUBLISHER} per connection)"
            )
        );
        // Refreshing one it has is fine.
        p.publish(1, "n1".into(), panel("p0", 2), t0, 0).unwrap();
        for s in 2..(PANELS_MAX / PANELS_PER_PUBLISHER + 1) as u64 {
            for i in 0..PANELS_PER_PUBLISHER {
                p.publish(s, format!("n{s}"), panel(&format!("p{i}"), 1), t0, 0)
                    .unwrap();
            }
        }
        assert_eq!(p.len(), PANELS_MAX);
        let e = p
            .publish(999, "n999".into(), panel("x", 1), t0, 0)
            .unwrap_err();
        assert!(matches!(e, PanelError::TooMany { limit, .. } if limit == PANELS_MAX));
        // Expired panels make room.
        let later = t0 + Duration::from_secs(2);
        p.publish(999, "n999".into(), panel("x", 1), later, 0)
            .unwrap();
        assert_eq!(p.len(), 1);
    }
}
