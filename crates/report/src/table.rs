//! Result tables: [`Cell`], [`Table`], and the number formatting shared by the CSV
//! file, the Markdown table and the plot axes ([`format_number`]).

use crate::error::{ReportError, Result};

/// One table cell: a number or a piece of text.
#[derive(Debug, Clone, PartialEq)]
pub enum Cell {
    /// A number, printed with [`format_number`].
    Num(f64),
    /// Text, printed as is (escaped for Markdown).
    Text(String),
}

impl Cell {
    /// An empty text cell.
    pub fn empty() -> Cell {
        Cell::Text(String::new())
    }

    /// The number, if this is a numeric cell.
    pub fn as_f64(&self) -> Option<f64> {
        match self {
            Cell::Num(v) => Some(*v),
            Cell::Text(_) => None,
        }
    }

    /// Whether this is a numeric cell.
    pub fn is_num(&self) -> bool {
        matches!(self, Cell::Num(_))
    }
}

impl std::fmt::Display for Cell {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        match self {
            Cell::Num(v) => f.write_str(&format_number(*v)),
            Cell::Text(s) => f.write_str(s),
        }
    }
}

impl From<&str> for Cell {
    fn from(s: &str) -> Self {
        Cell::Text(s.to_owned())
    }
}
impl From<String> for Cell {
    fn from(s: String) -> Self {
        Cell::Text(s)
    }
}
impl From<&String> for Cell {
    fn from(s: &String) -> Self {
        Cell::Text(s.clone())
    }
}
impl From<f64> for Cell {
    fn from(v: f64) -> Self {
        Cell::Num(v)
    }
}
impl From<f32> for Cell {
    fn from(v: f32) -> Self {
        Cell::Num(f64::from(v))
    }
}
impl From<u64> for Cell {
    fn from(v: u64) -> Self {
        Cell::Num(v as f64)
    }
}
impl From<u32> for Cell {
    fn from(v: u32) -> Self {
        Cell::Num(f64::from(v))
    }
}
impl From<usize> for Cell {
    fn from(v: usize) -> Self {
        Cell::Num(v as f64)
    }
}
impl From<i64> for Cell {
    fn from(v: i64) -> Self {
        Cell::Num(v as f64)
    }
}
impl From<i32> for Cell {
    fn from(v: i32) -> Self {
        Cell::Num(f64::from(v))
    }
}
/// `None` becomes an empty cell.
impl<T: Into<Cell>> From<Option<T>> for Cell {
    fn from(v: Option<T>) -> Self {
        v.map_or_else(Cell::empty, Into::into)
    }
}

/// Formats a number for humans: integers without decimals, numbers of magnitude ≥ 1
/// with at most 3 decimals, smaller ones with 3 significant digits, trailing zeros
/// trimmed; never scientific notation except below 1e-9.
///
/// ```
/// use granule_report::format_number;
/// assert_eq!(format_number(1234.0), "1234");
/// assert_eq!(format_number(1234.5), "1234.5");
/// assert_eq!(format_number(2.34567), "2.346");
/// assert_eq!(format_number(0.000123456), "0.000123");
/// assert_eq!(format_number(1e12), "1000000000000");
/// ```
pub fn format_number(v: f64) -> String {
    if v.is_nan() {
        return "NaN".to_owned();
    }
    if v.is_infinite() {
        return if v > 0.0 { "inf" } else { "-inf" }.to_owned();
    }
    if v == 0.0 {
        return "0".to_owned();
    }
    if v.fract() == 0.0 {
        // f64's Display never uses an exponent: large numbers come out plainly.
        return format!("{v}");
    }
    let a = v.abs();
    let s = if a >= 1.0 {
        format!("{v:.3}")
    } else if a >= 1e-9 {
        let decimals = (2 - a.log10().floor() as i32).max(0) as usize;
        format!("{v:.decimals$}")
    } else {
        return format!("{v:.2e}");
    };
    trim_zeros(s)
}

/// A compact form for axis ticks: SI suffixes (k, M, G, T) from 10 000 upwards.
pub(crate) fn format_axis(v: f64) -> String {
    let a = v.abs();
    let (scaled, suffix) = if a >= 1e12 {
        (v / 1e12, "T")
    } else if a >= 1e9 {
        (v / 1e9, "G")
    } else if a >= 1e6 {
        (v / 1e6, "M")
    } else if a >= 1e4 {
        (v / 1e3, "k")
    } else {
        return format_number(v);
    };
    let s = trim_zeros(format!("{scaled:.2}"));
    format!("{s}{suffix}")
}

fn trim_zeros(s: String) -> String {
    if !s.contains('.') {
        return s;
    }
    let t = s.trim_end_matches('0').trim_end_matches('.');
    if t == "-0" {
        "0".to_owned()
    } else {
        t.to_owned()
    }
}

fn md_escape(s: &str) -> String {
    s.replace('\\', "\\\\")
        .replace('|', "\\|")
        .replace("\r\n", "<br>")
        .replace('\n', "<br>")
}

/// A results table: named columns and rows of [`Cell`]s.
///
/// ```
/// use granule_report::{Cell, Table};
/// let mut t = Table::new(&["mode", "work_us", "calls_per_s"]);
/// t.row(vec![Cell::from("local"), 1.0.into(), 1234.5.into()]);
/// assert_eq!(t.to_csv().unwrap(), "mode,work_us,calls_per_s\nlocal,1,1234.5\n");
/// ```
#[derive(Debug, Clone, PartialEq, Default)]
pub struct Table {
    columns: Vec<String>,
    rows: Vec<Vec<Cell>>,
}

impl Table {
    /// A table with these column names and no rows.
    pub fn new<S: AsRef<str>>(columns: &[S]) -> Table {
        Table {
            columns: columns.iter().map(|c| c.as_ref().to_owned()).collect(),
            rows: Vec::new(),
        }
    }

    /// Appends a row.
    ///
    /// # Panics
    /// If the row's length differs from the number of columns (a programming error that
    /// any `--quick` run shows); use [`Table::try_row`] to get an error instead.
    pub fn row(&mut self, cells: Vec<Cell>) -> &mut Self {
        if let Err(e) = self.try_row(cells) {
            panic!("granule-report: {e}");
        }
        self
    }

    /// Appends a row, or fails if its length differs from the number of columns.
    pub fn try_row(&mut self, cells: Vec<Cell>) -> Result<&mut Self> {
        if cells.len() != self.columns.len() {
            return Err(ReportError::RowWidth {
                expected: self.columns.len(),
                got: cells.len(),
            });
        }
        self.rows.push(cells);
        Ok(self)
    }

    /// The column names.
    pub fn columns(&self) -> &[String] {
        &self.columns
    }

    /// The rows so far.
    pub fn rows(&self) -> &[Vec<Cell>] {
        &self.rows
    }

    /// Number of rows.
    pub fn len(&self) -> usize {
        self.rows.len()
    }

    /// Whether the table has no rows.
    pub fn is_empty(&self) -> bool {
        self.rows.is_empty()
    }

    /// Index of a column by name.
    pub fn column_index(&self, name: &str) -> Option<usize> {
        self.columns.iter().position(|c| c == name)
    }

    /// The numeric values of one column (text cells skipped).
    pub fn column_values(&self, name: &str) -> Vec<f64> {
        match self.column_index(name) {
            Some(i) => self.rows.iter().filter_map(|r| r[i].as_f64()).collect(),
            None => Vec::new(),
        }
    }

    /// The table as CSV (header line first, numbers via [`format_number`]).
    pub fn to_csv(&self) -> Result<String> {
        let mut w = csv::Writer::from_writer(Vec::new());
        w.write_record(&self.columns)
            .map_err(|e| ReportError::Csv(e.to_string()))?;
        for row in &self.rows {
            w.write_record(row.iter().map(Cell::to_string))
                .map_err(|e| ReportError::Csv(e.to_string()))?;
        }
        let bytes = w
            .into_inner()
            .map_err(|e| ReportError::Csv(e.to_string()))?;
        String::from_utf8(bytes).map_err(|e| ReportError::Csv(e.to_string()))
    }

    /// The table as a GitHub-flavoured Markdown table. Columns whose cells are all
    /// numbers are right-aligned.
    pub fn to_markdown(&self) -> String {
        let mut out = String::new();
        if self.columns.is_empty() {
            return out;
        }
        out.push('|');
        for c in &self.columns {
            out.push(' ');
            out.push_str(&md_escape(c));
            out.push_str(" |");
        }
        out.push_str("\n|");
        for i in 0..self.columns.len() {
            let numeric = !self.rows.is_empty() && self.rows.iter().all(|r| r[i].is_num());
            out.push_str(if numeric { "---:|" } else { "---|" });
        }
        out.push('\n');
        for row in &self.rows {
            out.push('|');
            for cell in row {
                out.push(' ');
                out.push_str(&md_escape(&cell.to_string()));
                out.push_str(" |");
            }
            out.push('\n');
        }
        out
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn number_formatting() {
        let cases: &[(f64, &str)] = &[
            (0.0, "0"),
            (-0.0, "0"),
            (1.0, "1"),
            (-7.0, "-7"),
            (1234.0, "1234"),
            (1234.5, "1234.5"),
            (1234.5678, "1234.568"),
            (2.71349, "2.713"),
            (2.5, "2.5"),
            (0.93, "0.93"),
            (0.9333333, "0.933"),
            (0.000123456, "0.000123"),
            (-0.5, "-0.5"),
            (0.99996, "1"),
            (1e12, "1000000000000"),
            (123456789.25, "123456789.25"),
            (1e20, "100000000000000000000"),
            (1.5e-12, "1.50e-12"),
            (f64::NAN, "NaN"),
            (f64::INFINITY, "inf"),
            (f64::NEG_INFINITY, "-inf"),
        ];
        for &(v, want) in cases {
            assert_eq!(format_number(v), want, "formatting {v:e}");
        }
    }

    #[test]
    fn axis_formatting() {
        assert_eq!(format_axis(500.0), "500");
        assert_eq!(format_axis(0.25), "0.25");
        assert_eq!(format_axis(20000.0), "20k");
        assert_eq!(format_axis(1_500_000.0), "1.5M");
        assert_eq!(format_axis(2e9), "2G");
    }

    #[test]
    fn cell_conversions() {
        assert_eq!(Cell::from("a"), Cell::Text("a".into()));
        assert_eq!(Cell::from(String::from("b")), Cell::Text("b".into()));
        assert_eq!(Cell::from(1.5), Cell::Num(1.5));
        assert_eq!(Cell::from(3u64), Cell::Num(3.0));
        assert_eq!(Cell::from(4usize), Cell::Num(4.0));
        assert_eq!(Cell::from(-5i64), Cell::Num(-5.0));
        assert_eq!(Cell::from(None::<f64>), Cell::empty());
        assert_eq!(Cell::from(Some(2u64)), Cell::Num(2.0));
    }

    fn sample() -> Table {
        let mut t = Table::new(&["mode", "work_us", "calls_per_s"]);
        t.row(vec![Cell::from("local"), 1.0.into(), 1234.5.into()])
            .row(vec![Cell::from("remote, tcp"), 0.1.into(), 98765u64.into()])
            .row(vec![
                Cell::from("say \"hi\""),
                50usize.into(),
                0.000123456.into(),
            ]);
        t
    }

    #[test]
    fn csv_output() {
        let csv = sample().to_csv().unwrap();
        assert_eq!(
            csv,
            "mode,work_us,calls_per_s\n\
             local,1,1234.5\n\
             \"remote, tcp\",0.1,98765\n\
             \"say \"\"hi\"\"\",50,0.000123\n"
        );
    }

    #[test]
    fn markdown_output() {
        let mut t = sample();
        t.row(vec![Cell::from("a|b"), 2.0.into(), Cell::from("n/a")]);
        let md = t.to_markdown();
        assert_eq!(
            md,
            "| mode | work_us | calls_per_s |\n\
             |---|---:|---|\n\
             | local | 1 | 1234.5 |\n\
             | remote, tcp | 0.1 | 98765 |\n\
             | say \"hi\" | 50 | 0.000123 |\n\
             | a\\|b | 2 | n/a |\n"
        );
    }

    #[test]
    fn row_width_is_checked() {
        let mut t = Table::new(&["a", "b"]);
        assert!(matches!(
            t.try_row(vec![1.0.into()]),
            Err(ReportError::RowWidth {
                expected: 2,
                got: 1
            })
        ));
        assert!(t.is_empty());
        t.try_row(vec![1.0.into(), "x".into()]).unwrap();
        assert_eq!(t.len(), 1);
        assert_eq!(t.column_values("a"), vec![1.0]);
        assert!(t.column_values("b").is_empty());
    }

    #[test]
    #[should_panic(expected = "columns")]
    fn row_width_panics() {
        Table::new(&["a", "b"]).row(vec![1.0.into()]);
    }

    #[test]
    fn empty_table() {
        let t = Table::new(&["x"]);
        assert_eq!(t.to_csv().unwrap(), "x\n");
        assert_eq!(t.to_markdown(), "| x |\n|---|\n");
    }
}
