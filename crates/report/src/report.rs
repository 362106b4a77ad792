//! [`Report`]: one benchmark's report, which ties the pieces together and writes the
//! files ([`files`]).

use std::path::{Path, PathBuf};

use serde_json::{Map, Value};

use crate::{Cell, Meta, Plot, ReportError, Result, Table};

pub mod files {
    //! File names written by [`Report::write`](crate::Report::write).
    /// The main table as CSV.
    pub const CSV: &str = "results.csv";
    /// The human-readable report.
    pub const MARKDOWN: &str = "results.md";
    /// The main plot.
    pub const PLOT: &str = "plot.png";
    /// The flat JSON object of headline figures and provenance.
    pub const SUMMARY: &str = "summary.json";
}

/// Keys `summary.json` reserves for provenance.
pub const RESERVED_KEYS: [&str; 6] = [
    "benchmark",
    "commit",
    "machine",
    "timestamp",
    "placement",
    "quick",
];

/// A headline figure's value.
#[derive(Debug, Clone, PartialEq)]
enum Figure {
    Num(f64),
    Text(String),
}

/// One benchmark's report: provenance, a main table, a plot, headline figures and notes.
#[derive(Debug, Clone)]
pub struct Report {
    name: String,
    title: Option<String>,
    meta: Meta,
    table: Option<Table>,
    plot: Option<Plot>,
    extra_tables: Vec<(String, Table)>,
    extra_plots: Vec<(String, Plot)>,
    figures: Vec<(String, Figure)>,
    notes: Vec<String>,
}

impl Report {
    /// A report for benchmark `name` (also the output subdirectory's name).
    pub fn new(name: impl Into<String>, meta: Meta) -> Report {
        Report {
            name: name.into(),
            title: None,
            meta,
            table: None,
            plot: None,
            extra_tables: Vec::new(),
            extra_plots: Vec::new(),
            figures: Vec::new(),
            notes: Vec::new(),
        }
    }

    /// The benchmark's name.
    pub fn name(&self) -> &str {
        &self.name
    }

    /// The provenance.
    pub fn meta(&self) -> &Meta {
        &self.meta
    }

    /// The provenance, for adding notes or fixing the placement late.
    pub fn meta_mut(&mut self) -> &mut Meta {
        &mut self.meta
    }

    /// A human title for `results.md` (default: `Benchmark: NAME`).
    pub fn title(&mut self, title: impl Into<String>) -> &mut Self {
        self.title = Some(title.into());
        self
    }

    /// Sets the main results table (written to `results.csv`); replaces an earlier one.
    pub fn table(&mut self, table: Table) -> &mut Self {
        self.table = Some(table);
        self
    }

    /// Sets the main plot (written to `plot.png`); replaces an earlier one.
    pub fn plot(&mut self, plot: Plot) -> &mut Self {
        self.plot = Some(plot);
        self
    }

    /// Adds a secondary table, written to `STEM.csv` and shown in `results.md` under
    /// its own heading. `stem` should be a plain file stem such as `latency_cdf`.
    pub fn extra_table(&mut self, stem: impl Into<String>, table: Table) -> &mut Self {
        self.extra_tables.push((stem.into(), table));
        self
    }

    /// Adds a secondary plot, written to `STEM.png` and linked from `results.md`.
    pub fn extra_plot(&mut self, stem: impl Into<String>, plot: Plot) -> &mut Self {
        self.extra_plots.push((stem.into(), plot));
        self
    }

    /// Sets a numeric headline figure. Figures keep their insertion order; setting a
    /// name again replaces its value in place. Non-finite values become `null` in JSON.
    pub fn summary(&mut self, name: impl Into<String>, value: f64) -> &mut Self {
        self.set_figure(name.into(), Figure::Num(value));
        self
    }

    /// Sets a string headline field (same ordering rules as [`Report::summary`]).
    pub fn summary_str(&mut self, name: impl Into<String>, value: impl Into<String>) -> &mut Self {
        self.set_figure(name.into(), Figure::Text(value.into()));
        self
    }

    fn set_figure(&mut self, name: String, value: Figure) {
        match self.figures.iter_mut().find(|(k, _)| *k == name) {
            Some(slot) => slot.1 = value,
            None => self.figures.push((name, value)),
        }
    }

    /// A numeric headline figure set so far.
    pub fn figure(&self, name: &str) -> Option<f64> {
        self.figures.iter().find_map(|(k, v)| match v {
            Figure::Num(x) if k == name => Some(*x),
            _ => None,
        })
    }

    /// Adds a free-text note shown in `results.md`.
    pub fn note(&mut self, note: impl Into<String>) -> &mut Self {
        self.notes.push(note.into());
        self
    }

    /// The flat `summary.json` object: `benchmark`, the headline figures in insertion
    /// order, then `commit`, `machine`, `timestamp`, `placement` and `quick`.
    pub fn summary_json(&self) -> Result<Value> {
        let mut obj = Map::new();
        obj.insert("benchmark".into(), Value::String(self.name.clone()));
        for (k, v) in &self.figures {
            if RESERVED_KEYS.contains(&k.as_str()) {
                return Err(ReportError::ReservedKey(k.clone()));
            }
            let v = match v {
                Figure::Num(x) => {
                    serde_json::Number::from_f64(*x).map_or(Value::Null, Value::Number)
                }
                Figure::Text(s) => Value::String(s.clone()),
            };
            obj.insert(k.clone(), v);
        }
        obj.insert("commit".into(), Value::String(self.meta.commit.clone()));
        obj.insert("machine".into(), Value::String(self.meta.machine()));
        obj.insert(
            "timestamp".into(),
            Value::String(self.meta.timestamp.clone()),
        );
        obj.insert(
            "placement".into(),
            Value::String(self.meta.placement.clone()),
        );
        obj.insert("quick".into(), Value::Bool(self.meta.quick));
        Ok(Value::Object(obj))
    }

    /// The text of `results.md`.
    pub fn to_markdown(&self) -> String {
        let m = &self.meta;
        let mut md = String::new();
        let title = self
            .title
            .clone()
            .unwrap_or_else(|| format!("Benchmark: {}", self.name));
        md.push_str(&format!("# {title}\n\n"));
        let mut prov = Table::new(&["field", "value"]);
        prov.row(vec!["benchmark".into(), format!("`{}`", self.name).into()])
            .row(vec!["commit".into(), format!("`{}`", m.commit).into()])
            .row(vec!["machine".into(), m.machine().into()])
            .row(vec!["timestamp".into(), m.timestamp.clone().into()])
            .row(vec!["placement".into(), m.placement.clone().into()])
            .row(vec!["quick".into(), m.quick.to_string().into()]);
        md.push_str(&prov.to_markdown());
        md.push('\n');
        let notes: Vec<&String> = m.notes.iter().chain(self.notes.iter()).collect();
        if !notes.is_empty() {
            md.push_str("## Notes\n\n");
            for n in notes {
                md.push_str(&format!("- {}\n", n.replace('\n', "\n  ")));
            }
            md.push('\n');
        }
        md.push_str("## Results\n\n");
        match &self.table {
            Some(t) => {
                md.push_str(&t.to_markdown());
                md.push_str(&format!("\n([{}]({}))\n\n", files::CSV, files::CSV));
            }
            None => md.push_str("(no table)\n\n"),
        }
        if !self.figures.is_empty() {
            md.push_str("## Summary\n\n");
            let mut s = Table::new(&["figure", "value"]);
            for (k, v) in &self.figures {
                let cell = match v {
                    Figure::Num(x) => Cell::Num(*x),
                    Figure::Text(t) => Cell::Text(t.clone()),
                };
                s.row(vec![format!("`{k}`").into(), cell]);
            }
            md.push_str(&s.to_markdown());
            md.push('\n');
        }
        if self.plot.is_some() {
            md.push_str("## Plot\n\n![plot](plot.png)\n\n");
        }
        for (stem, t) in &self.extra_tables {
            md.push_str(&format!("## {stem}\n\n"));
            md.push_str(&t.to_markdown());
            md.push_str(&format!("\n([{stem}.csv]({stem}.csv))\n\n"));
        }
        for (stem, p) in &self.extra_plots {
            md.push_str(&format!("## {}\n\n![{stem}]({stem}.png)\n\n", p.title()));
        }
        md
    }

    /// Writes the report into `out_dir/NAME/` (created if needed) and returns that
    /// directory. Files: `results.csv` (when a table was set), `results.md`,
    /// `plot.png` (when a plot was set), `summary.json`, and any extra tables/plots.
    pub fn write(&self, out_dir: &Path) -> Result<PathBuf> {
        check_stem(&self.name)?;
        for (stem, _) in &self.extra_tables {
            check_stem(stem)?;
        }
        for (stem, _) in &self.extra_plots {
            check_stem(stem)?;
        }
        // Validate before touching the disk.
        let summary = serde_json::to_string_pretty(&self.summary_json()?)?;
        let dir = out_dir.join(&self.name);
        std::fs::create_dir_all(&dir).map_err(|e| ReportError::io(&dir, e))?;
        if let Some(t) = &self.table {
            write_file(&dir.join(files::CSV), t.to_csv()?.as_bytes())?;
        }
        for (stem, t) in &self.extra_tables {
            write_file(&dir.join(format!("{stem}.csv")), t.to_csv()?.as_bytes())?;
        }
        if let Some(p) = &self.plot {
            p.render(&dir.join(files::PLOT))?;
        }
        for (stem, p) in &self.extra_plots {
            p.render(&dir.join(format!("{stem}.png")))?;
        }
        write_file(&dir.join(files::SUMMARY), format!("{summary}\n").as_bytes())?;
        write_file(&dir.join(files::MARKDOWN), self.to_markdown().as_bytes())?;
        Ok(dir)
    }
}

fn check_stem(name: &str) -> Result<()> {
    let bad = name.is_empty() || name == "." || name == ".." || name.contains(['/', '\\', '\0']);
    if bad {
        Err(ReportError::InvalidName(name.to_owned()))
    } else {
        Ok(())
    }
}

fn write_file(path: &Path, bytes: &[u8]) -> Result<()> {
    std::fs::write(path, bytes).map_err(|e| ReportError::io(path, e))
}

#[cfg(test)]
mod tests {
    use super::*;

    fn meta() -> Meta {
        let mut m = Meta::collect("one current-thread runtime per core", true);
        m.commit = "0123456789ab+dirty".into();
        m.timestamp = "2026-11-22T05:46:00Z".into();
        m.note("machine is shared and noisy");
        m
    }

    fn report() -> Report {
        let mut t = Table::new(&["mode", "work_us", "calls_per_s"]);
        t.row(vec![Cell::from("local"), 1.0.into(), 1234.5.into()])
            .row(vec![Cell::from("remote"), 1.0.into(), 456u64.into()]);
        let plot = Plot::line("calls/s")
            .x_label("work (µs)")
            .y_label("calls/s")
            .log_x(true)
            .series("local", [(0.1, 2000.0), (1.0, 1234.5), (10.0, 99.0)])
            .series("remote", [(0.1, 500.0), (1.0, 456.0), (10.0, 90.0)]);
        let mut rep = Report::new("invoke", meta());
        rep.table(t)
            .plot(plot)
            .summary("local_efficiency_1us", 0.93)
            .summary("remote_efficiency_1us", 0.37)
            .summary_str("baseline", "plain function call")
            .summary("local_efficiency_1us", 0.94)
            .note("ratios are against the same run's baseline");
        rep
    }

    #[test]
    fn summary_json_is_flat_and_ordered() {
        let v = report().summary_json().unwrap();
        let obj = v.as_object().unwrap();
        let keys: Vec<&str> = obj.keys().map(String::as_str).collect();
        assert_eq!(
            keys,
            [
                "benchmark",
                "local_efficiency_1us",
                "remote_efficiency_1us",
                "baseline",
                "commit",
                "machine",
                "timestamp",
                "placement",
                "quick"
            ]
        );
        assert!(obj.values().all(|v| !v.is_object() && !v.is_array()));
        assert_eq!(obj["local_efficiency_1us"], 0.94);
        assert_eq!(obj["remote_efficiency_1us"], 0.37);
        assert_eq!(obj["baseline"], "plain function call");
        assert_eq!(obj["commit"], "0123456789ab+dirty");
        assert_eq!(obj["quick"], true);
        assert_eq!(obj["placement"], "one current-thread runtime per core");
        assert!(obj["machine"].as_str().unwrap().contains("vCPU"));
    }

    #[test]
    fn reserved_keys_are_rejected() {
        let mut rep = report();
        rep.summary("commit", 1.0);
        assert!(matches!(rep.summary_json(), Err(ReportError::ReservedKey(k)) if k == "commit"));
        let dir = tempfile::tempdir().unwrap();
        assert!(rep.write(dir.path()).is_err());
        assert!(!dir.path().join("invoke").exists());
    }

    #[test]
    fn non_finite_figures_become_null() {
        let mut rep = report();
        rep.summary("bad", f64::NAN);
        assert_eq!(rep.summary_json().unwrap()["bad"], Value::Null);
    }

    #[test]
    fn markdown_contents() {
        let md = report().to_markdown();
        assert!(md.starts_with("# Benchmark: invoke\n"));
        for needle in [
            "`0123456789ab+dirty`",
            "2026-11-22T05:46:00Z",
            "one current-thread runtime per core",
            "| quick | true |",
            "- machine is shared and noisy",
            "- ratios are against the same run's baseline",
            "| mode | work_us | calls_per_s |",
            "| local | 1 | 1234.5 |",
            "| `local_efficiency_1us` | 0.94 |",
            "| `baseline` | plain function call |",
            "![plot](plot.png)",
        ] {
            assert!(md.contains(needle), "missing {needle:?} in\n{md}");
        }
    }

    #[test]
    fn write_creates_all_files() {
        let dir = tempfile::tempdir().unwrap();
        let mut rep = report();
        rep.extra_table("latency", {
            let mut t = Table::new(&["q", "us"]);
            t.row(vec![0.5.into(), 12.0.into()]);
            t
        });
        rep.extra_plot(
            "bars",
            Plot::bars("modes")
                .categories(["a", "b"])
                .bar_series("x", [1.0, 2.0]),
        );
        let out = rep.write(&dir.path().join("docs/results")).unwrap();
        assert_eq!(out, dir.path().join("docs/results/invoke"));
        let csv = std::fs::read_to_string(out.join("results.csv")).unwrap();
        assert_eq!(
            csv,
            "mode,work_us,calls_per_s\nlocal,1,1234.5\nremote,1,456\n"
        );
        let md = std::fs::read_to_string(out.join("results.md")).unwrap();
        assert!(md.contains("![plot](plot.png)"));
        assert!(md.contains("![bars](bars.png)"));
        let png = std::fs::read(out.join("plot.png")).unwrap();
        assert!(png.starts_with(b"\x89PNG\r\n\x1a\n") && png.len() > 5 * 1024);
        assert!(out.join("bars.png").is_file());
        assert!(out.join("latency.csv").is_file());
        let json: Value =
            serde_json::from_str(&std::fs::read_to_string(out.join("summary.json")).unwrap())
                .unwrap();
        assert_eq!(json["local_efficiency_1us"], 0.94);
        // Writing again overwrites in place.
        rep.write(&dir.path().join("docs/results")).unwrap();
    }

    #[test]
    fn bad_names_are_rejected() {
        let dir = tempfile::tempdir().unwrap();
        for name in ["", "..", "a/b"] {
            let rep = Report::new(name, meta());
            assert!(matches!(
                rep.write(dir.path()),
                Err(ReportError::InvalidName(_))
            ));
        }
    }

    #[test]
    fn io_errors_carry_the_path() {
        let dir = tempfile::tempdir().unwrap();
        let file = dir.path().join("not-a-dir");
        std::fs::write(&file, b"x").unwrap();
        match report().write(&file) {
            Err(ReportError::Io { path, .. }) => assert_eq!(path, file.join("invoke")),
            other => panic!("unexpected {other:?}"),
        }
    }
}
