//! The crate's error type: what a scan stage, a merge or a plan can refuse.

use thiserror::Error;

/// Why a stage could not run, a partial could not merge, or a plan could not be made.
/// Column bytes and stage descriptions may come from the network: every malformed input
/// is one of these, never a panic.
#[derive(Debug, Clone, PartialEq, Eq, Error)]
pub enum OpError {
    /// A plan named a column the schema does not have.
    #[error("no column {0}")]
    NoSuchColumn(String),
    /// A dictionary lookup on a column that is not a dictionary column.
    #[error("column {0} is not a dictionary column")]
    NotDict(usize),
    /// A string (or code) that is not in the column's dictionary.
    #[error("{0} is not in the dictionary")]
    NotInDict(String),
    /// A stage reads a column number past the end of its table's schema (checked before
    /// a query runs).
    #[error("column {col} is not in table {table}, which has {width} columns (0..={last})", last = width.saturating_sub(1))]
    NoColumnIn {
        /// The column number the stage reads.
        col: usize,
        /// The table.
        table: String,
        /// Its columns.
        width: usize,
    },
    /// A column index past the row group's last column.
    #[error("column {0} is out of range")]
    ColumnOutOfRange(usize),
    /// A different number of column buffers than expected.
    #[error("expected {want} column buffers, got {got}")]
    ColumnCount {
        /// Expected.
        want: usize,
        /// Given.
        got: usize,
    },
    /// A stage read a column it was not given.
    #[error("column {0} was not provided")]
    ColumnMissing(usize),
    /// A column buffer whose length does not fit its type and the row count.
    #[error("column {col} has {got} bytes, expected {want}")]
    ColumnSize {
        /// The column.
        col: usize,
        /// Bytes expected.
        want: usize,
        /// Bytes given.
        got: usize,
    },
    /// A malformed `Text` column.
    #[error("text column {col}: {why}")]
    BadText {
        /// The column.
        col: usize,
        /// What is wrong.
        why: String,
    },
    /// A stage reads one column as two different types.
    #[error("column {0} is read as two different types")]
    ColumnKind(usize),
    /// An expression or predicate nested deeper than [`crate::MAX_DEPTH`].
    #[error("expression nested deeper than {0}")]
    TooDeep(usize),
    /// A stage probes a join table but none was given, or uses the joined payload
    /// without probing.
    #[error("join: {0}")]
    Join(String),
    /// Partials of different shapes, which cannot merge.
    #[error("cannot merge: {0}")]
    Mismatch(String),
    /// A stage description that makes no sense (e.g. zero shuffle buckets).
    #[error("bad stage: {0}")]
    BadStage(String),
    /// A query needs a table that was not given.
    #[error("no table {0}")]
    NoTable(String),
    /// A join table could not be built (a duplicate key or the memory budget).
    #[error("join table: {0}")]
    JoinBuild(String),
}
