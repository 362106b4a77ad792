//! Granule's shared benchmark report writer and small statistics helpers, and the text
//! the `granule` command prints.
//!
//! Always built: [`usage`], the text tables of a cluster's resource use (`granule status`,
//! the demo, the end of every benchmark), and [`Progress`], a long command's progress.
//!
//! With the `plot` feature (on in `granule-bench`, off in the `granule` command, so that
//! the command's build leaves out plotters, its image and font crates, csv and
//! hdrhistogram), the report writer. Every `granule-bench NAME` run writes, under
//! `DIR/NAME/`:
//!
//! * `results.csv` — the main `Table`;
//! * `results.md` — title, provenance (`Meta`), notes, the table, the headline figures
//!   and a link to the plot;
//! * `plot.png` — the `Plot` (1024×640, bundled font, no system dependencies);
//! * `summary.json` — one flat JSON object: headline figures plus `commit`, `machine`,
//!   `timestamp`, `placement` and `quick`.
//!
//! ```no_run
//! # #[cfg(feature = "plot")] {
//! use granule_report::{Cell, Meta, Plot, Report, Table};
//! let meta = Meta::collect("client and server on core 0", false);
//! let mut table = Table::new(&["mode", "work_us", "calls_per_s"]);
//! table.row(vec![Cell::from("local"), 1.0.into(), 1234.5.into()]);
//! let plot = Plot::line("calls/s vs work").series("local", vec![(1.0, 1234.5)]);
//! let mut rep = Report::new("invoke", meta);
//! rep.table(table);
//! rep.plot(plot);
//! rep.summary("local_efficiency_1us", 0.93);
//! rep.note("baseline: plain function call in the same run");
//! let dir = rep.write(std::path::Path::new("docs/results"))?;
//! # }
//! # Ok::<(), Box<dyn std::error::Error>>(())
//! ```
//!
//! `Report` (in `report.rs`) ties the pieces together and writes the files.
#![forbid(unsafe_code)]
#![warn(missing_docs)]

#[cfg(feature = "plot")]
mod error;
#[cfg(feature = "plot")]
mod meta;
#[cfg(feature = "plot")]
mod plot;
mod progress;
#[cfg(feature = "plot")]
mod report;
#[cfg(feature = "plot")]
pub mod stats;
#[cfg(feature = "plot")]
mod table;
pub mod usage;

#[cfg(feature = "plot")]
pub use error::{ReportError, Result};
#[cfg(feature = "plot")]
pub use meta::{format_utc, Meta, COMMIT_ENV};
#[cfg(feature = "plot")]
pub use plot::{HLine, Legend, Plot, PlotKind, Series, DEFAULT_SIZE};
pub use progress::Progress;
#[cfg(feature = "plot")]
pub use report::{files, Report, RESERVED_KEYS};
#[cfg(feature = "plot")]
pub use stats::{Latency, Summary};
#[cfg(feature = "plot")]
pub use table::{format_number, Cell, Table};
