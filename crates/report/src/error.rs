//! The crate's typed error: [`ReportError`], for everything that can go wrong while
//! writing a report (file I/O with the offending path, CSV encoding, plot rendering,
//! and misuse such as a summary key that collides with a provenance field).

use std::path::PathBuf;

/// Everything that can go wrong while building or writing a report.
#[derive(Debug, thiserror::Error)]
#[non_exhaustive]
pub enum ReportError {
    /// A file or directory could not be created or written.
    #[error("I/O error on {path}: {source}")]
    Io {
        /// The file or directory being accessed.
        path: PathBuf,
        /// The underlying error.
        #[source]
        source: std::io::Error,
    },
    /// The CSV encoder failed.
    #[error("CSV error: {0}")]
    Csv(String),
    /// `summary.json` could not be serialised.
    #[error("JSON error: {0}")]
    Json(#[from] serde_json::Error),
    /// Rendering a plot failed (font registration, drawing or PNG encoding).
    #[error("plot error for {path}: {message}")]
    Plot {
        /// The PNG file being rendered.
        path: PathBuf,
        /// What plotters (or the font loader) said.
        message: String,
    },
    /// A table row had the wrong number of cells.
    #[error("row has {got} cells but the table has {expected} columns")]
    RowWidth {
        /// Number of columns in the table.
        expected: usize,
        /// Number of cells in the offending row.
        got: usize,
    },
    /// A summary key is used twice, or collides with a provenance field
    /// (`benchmark`, `commit`, `machine`, `timestamp`, `placement`, `quick`).
    #[error("summary key {0:?} is reserved or already used by a provenance field")]
    ReservedKey(String),
    /// A report name that cannot be used as a single directory name.
    #[error("invalid report name {0:?}: must be non-empty and contain no path separators")]
    InvalidName(String),
}

impl ReportError {
    pub(crate) fn io(path: impl Into<PathBuf>, source: std::io::Error) -> Self {
        ReportError::Io {
            path: path.into(),
            source,
        }
    }
}

/// Shorthand for `Result<T, ReportError>`.
pub type Result<T, E = ReportError> = std::result::Result<T, E>;
