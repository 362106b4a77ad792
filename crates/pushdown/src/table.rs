//! The table layout: a [`Schema`] and chunked, columnar [`RowGroup`]s, and the
//! [`Columns`] view a scan stage reads.
//!
//! **One layout.** A table is a sequence of row groups of at most
//! [`DEFAULT_ROWS_PER_GROUP`] rows (64 Ki; tests use smaller ones). A row group holds one
//! byte buffer ([`Blob`]) per column, in the schema's order, so that a column can be
//! pulled on its own (a [`Blob`] clone, no copy) and a scan reads only the columns it
//! names. The encodings are fixed and little-endian, identical in memory and on the wire:
//!
//! - [`ColType::I64`]: `rows × 8` bytes, each an `i64` LE. Fixed-point decimals (cents,
//!   hundredths), dates (days since 1970-01-01), keys and quantities all use it, so every
//!   computation is exact integer arithmetic.
//! - [`ColType::Dict`]: `rows × 1` bytes, each a code into the dictionary the schema
//!   holds (at most 256 strings). String tests (`IN`, `LIKE 'PROMO%'`) become code sets
//!   at plan time.
//! - [`ColType::Text`]: `(rows + 1)` `u32` LE offsets, then the UTF-8 bytes of all rows;
//!   row `i` is `bytes[off[i]..off[i + 1]]`.
//!
//! A [`Blob`] decoded from a reply frame is a view of that frame and may start at any
//! address, so readers never assume alignment: an aligned `I64` column is read in place
//! (a `bytemuck` cast), an unaligned one is copied once into an aligned vector. Columns
//! this crate builds are 8-aligned (their bytes are owned by a `Vec<i64>`).

use crate::OpError;
use bytes::Bytes;
use granule_runtime::{Blob, Footprint};
use serde::{Deserialize, Serialize};
use std::borrow::Cow;

/// Rows per row group unless a caller chooses otherwise.
pub const DEFAULT_ROWS_PER_GROUP: u32 = 64 * 1024;

/// A column's type, which fixes its encoding (see the module doc).
#[derive(Clone, Debug, PartialEq, Eq, Serialize, Deserialize)]
pub enum ColType {
    /// One `i64` per row.
    I64,
    /// One `u8` code per row into this dictionary.
    Dict(Vec<String>),
    /// Variable-length UTF-8 strings: offsets, then bytes.
    Text,
}

/// One column's name and type.
#[derive(Clone, Debug, PartialEq, Eq, Serialize, Deserialize)]
pub struct ColDef {
    /// The column's name (as in the CSV header and the SQL reference).
    pub name: String,
    /// Its type and encoding.
    pub ty: ColType,
}

/// A table's name and columns.
#[derive(Clone, Debug, PartialEq, Eq, Serialize, Deserialize)]
pub struct Schema {
    /// The table's name.
    pub table: String,
    /// Its columns, in row-group order.
    pub cols: Vec<ColDef>,
}

impl Schema {
    /// The index of the column called `name`.
    pub fn col(&self, name: &str) -> Result<usize, OpError> {
        self.cols
            .iter()
            .position(|c| c.name == name)
            .ok_or_else(|| OpError::NoSuchColumn(format!("{}.{name}", self.table)))
    }

    /// The dictionary of column `col`, when it is a dictionary column.
    pub fn dict(&self, col: usize) -> Result<&[String], OpError> {
        match self.cols.get(col).map(|c| &c.ty) {
            Some(ColType::Dict(d)) => Ok(d),
            _ => Err(OpError::NotDict(col)),
        }
    }

    /// The codes of the dictionary column `col` whose strings satisfy `keep` (how
    /// `IN (...)` and `LIKE 'PROMO%'` become code sets at plan time).
    pub fn codes_where(&self, col: usize, keep: impl Fn(&str) -> bool) -> Result<Vec<u8>, OpError> {
        Ok(self
            .dict(col)?
            .iter()
            .enumerate()
            .filter(|(_, s)| keep(s))
            .map(|(i, _)| i as u8)
            .collect())
    }

    /// The code of `value` in the dictionary column `col`.
    pub fn code(&self, col: usize, value: &str) -> Result<u8, OpError> {
        self.dict(col)?
            .iter()
            .position(|s| s == value)
            .map(|i| i as u8)
            .ok_or_else(|| OpError::NotInDict(value.to_string()))
    }
}

/// A table held in one process: its schema and row groups (what [`crate::run_local`]
/// reads).
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct Table {
    /// The schema.
    pub schema: Schema,
    /// The row groups, in order.
    pub groups: Vec<RowGroup>,
}

/// A chunk of a table's rows, one encoded buffer per column (see the module doc).
#[derive(Clone, Debug, PartialEq, Eq, Serialize, Deserialize)]
pub struct RowGroup {
    /// Rows in this group.
    pub rows: u32,
    /// Column `i`'s bytes, in the schema's order.
    pub cols: Vec<Blob>,
}

impl RowGroup {
    /// The buffers of columns `cols` (cheap clones sharing the bytes), for pulling.
    pub fn project(&self, cols: &[usize]) -> Result<Vec<Blob>, OpError> {
        cols.iter()
            .map(|&c| {
                self.cols
                    .get(c)
                    .cloned()
                    .ok_or(OpError::ColumnOutOfRange(c))
            })
            .collect()
    }

    /// Bytes of the columns `cols` of this group (what pulling them moves).
    pub fn bytes_of(&self, cols: &[usize]) -> u64 {
        cols.iter()
            .filter_map(|&c| self.cols.get(c))
            .map(|b| b.len() as u64)
            .sum()
    }

    /// Checks that every column's length fits its type in `schema`.
    pub fn check(&self, schema: &Schema) -> Result<(), OpError> {
        if self.cols.len() != schema.cols.len() {
            return Err(OpError::ColumnCount {
                want: schema.cols.len(),
                got: self.cols.len(),
            });
        }
        let cols = Columns::of_group(self);
        for (i, def) in schema.cols.iter().enumerate() {
            match def.ty {
                ColType::I64 => {
                    cols.i64s(i)?;
                }
                ColType::Dict(ref d) => {
                    let codes = cols.codes(i)?;
                    if let Some(&c) = codes.iter().find(|&&c| c as usize >= d.len()) {
                        return Err(OpError::NotInDict(format!("code {c} of column {i}")));
                    }
                }
                ColType::Text => {
                    cols.text(i)?;
                }
            }
        }
        Ok(())
    }
}

impl Footprint for RowGroup {
    fn footprint(&self) -> u64 {
        (std::mem::size_of::<Self>() + self.cols.capacity() * std::mem::size_of::<Blob>()) as u64
            + self.cols.iter().map(|b| b.len() as u64).sum::<u64>()
    }
}

/// Owns an `i64` vector and shows it as bytes, so a column built here is 8-aligned.
struct I64Bytes(Vec<i64>);

impl AsRef<[u8]> for I64Bytes {
    fn as_ref(&self) -> &[u8] {
        bytemuck::cast_slice(&self.0)
    }
}

/// An `I64` column's buffer from its values (8-aligned, no copy on little-endian).
pub fn i64_blob(v: Vec<i64>) -> Blob {
    if cfg!(target_endian = "little") {
        Blob(Bytes::from_owner(I64Bytes(v)))
    } else {
        Blob::from(v.iter().flat_map(|x| x.to_le_bytes()).collect::<Vec<u8>>())
    }
}

/// A `Text` column's buffer from its strings.
pub fn text_blob<S: AsRef<str>>(rows: &[S]) -> Blob {
    let total: usize = rows.iter().map(|s| s.as_ref().len()).sum();
    let mut out = Vec::with_capacity(4 * (rows.len() + 1) + total);
    let mut off = 0u32;
    out.extend_from_slice(&off.to_le_bytes());
    for s in rows {
        off += s.as_ref().len() as u32;
        out.extend_from_slice(&off.to_le_bytes());
    }
    for s in rows {
        out.extend_from_slice(s.as_ref().as_bytes());
    }
    Blob::from(out)
}

/// The columns a scan stage reads: the row count and the bytes of the columns it needs,
/// each under its column number in the table.
#[derive(Clone, Debug)]
pub struct Columns<'a> {
    rows: usize,
    /// (column number, bytes), ascending by column number. Sparse, so that a column
    /// number from the network costs nothing however large it is.
    cols: Vec<(usize, &'a [u8])>,
}

/// A `Text` column read: offsets and the UTF-8 bytes they index.
#[derive(Clone, Debug)]
pub struct TextCol<'a> {
    /// `rows + 1` offsets into `bytes`, non-decreasing.
    pub offsets: Cow<'a, [u32]>,
    /// All rows' bytes, valid UTF-8.
    pub bytes: &'a str,
}

impl<'a> Columns<'a> {
    /// Every column of a stored row group (the push side).
    pub fn of_group(rg: &'a RowGroup) -> Columns<'a> {
        Columns {
            rows: rg.rows as usize,
            cols: rg.cols.iter().map(|b| &b[..]).enumerate().collect(),
        }
    }

    /// Pulled buffers: `blobs[k]` is column `needed[k]` of a row group of `rows` rows
    /// (the pull side; `needed` is the stage's [`crate::Stage::columns`]).
    pub fn of_pulled(
        rows: u32,
        needed: &[usize],
        blobs: &'a [Blob],
    ) -> Result<Columns<'a>, OpError> {
        if needed.len() != blobs.len() {
            return Err(OpError::ColumnCount {
                want: needed.len(),
                got: blobs.len(),
            });
        }
        let mut cols: Vec<(usize, &'a [u8])> = needed
            .iter()
            .copied()
            .zip(blobs.iter().map(|b| &b[..]))
            .collect();
        cols.sort_by_key(|&(c, _)| c);
        cols.dedup_by_key(|&mut (c, _)| c);
        Ok(Columns {
            rows: rows as usize,
            cols,
        })
    }

    /// Rows in the group.
    pub fn rows(&self) -> usize {
        self.rows
    }

    fn raw(&self, c: usize) -> Result<&'a [u8], OpError> {
        self.cols
            .binary_search_by_key(&c, |&(i, _)| i)
            .map(|at| self.cols[at].1)
            .map_err(|_| OpError::ColumnMissing(c))
    }

    /// Column `c` as `i64`s: in place when aligned, else copied once.
    pub fn i64s(&self, c: usize) -> Result<Cow<'a, [i64]>, OpError> {
        let raw = self.raw(c)?;
        if raw.len() != self.rows * 8 {
            return Err(OpError::ColumnSize {
                col: c,
                want: self.rows * 8,
                got: raw.len(),
            });
        }
        if cfg!(target_endian = "little") {
            if let Ok(v) = bytemuck::try_cast_slice::<u8, i64>(raw) {
                return Ok(Cow::Borrowed(v));
            }
            let mut v = vec![0i64; self.rows];
            bytemuck::cast_slice_mut::<i64, u8>(&mut v).copy_from_slice(raw);
            return Ok(Cow::Owned(v));
        }
        Ok(Cow::Owned(
            raw.chunks_exact(8)
                .map(|b| i64::from_le_bytes(b.try_into().unwrap_or([0; 8])))
                .collect(),
        ))
    }

    /// Column `c` as dictionary codes.
    pub fn codes(&self, c: usize) -> Result<&'a [u8], OpError> {
        let raw = self.raw(c)?;
        if raw.len() != self.rows {
            return Err(OpError::ColumnSize {
                col: c,
                want: self.rows,
                got: raw.len(),
            });
        }
        Ok(raw)
    }

    /// Column `c` as text, its offsets and UTF-8 checked.
    pub fn text(&self, c: usize) -> Result<TextCol<'a>, OpError> {
        let raw = self.raw(c)?;
        let head = 4 * (self.rows + 1);
        let bad = |why: &str| OpError::BadText {
            col: c,
            why: why.to_string(),
        };
        if raw.len() < head {
            return Err(bad("shorter than its offsets"));
        }
        let (offs, body) = raw.split_at(head);
        let offsets: Cow<'a, [u32]> = match bytemuck::try_cast_slice::<u8, u32>(offs) {
            Ok(v) if cfg!(target_endian = "little") => Cow::Borrowed(v),
            _ => Cow::Owned(
                offs.chunks_exact(4)
                    .map(|b| u32::from_le_bytes([b[0], b[1], b[2], b[3]]))
                    .collect(),
            ),
        };
        if offsets[0] != 0 || offsets.windows(2).any(|w| w[0] > w[1]) {
            return Err(bad("offsets not non-decreasing from 0"));
        }
        if offsets[self.rows] as usize != body.len() {
            return Err(bad("last offset is not the text's length"));
        }
        let bytes = std::str::from_utf8(body).map_err(|_| bad("not UTF-8"))?;
        // Every row must start and end on a character boundary for `&bytes[a..b]`.
        if offsets.iter().any(|&o| !bytes.is_char_boundary(o as usize)) {
            return Err(bad("an offset splits a character"));
        }
        Ok(TextCol { offsets, bytes })
    }
}

impl<'a> TextCol<'a> {
    /// Row `i`'s string (`i` < rows).
    pub fn row(&self, i: usize) -> &'a str {
        &self.bytes[self.offsets[i] as usize..self.offsets[i + 1] as usize]
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn unaligned(b: &Blob) -> Blob {
        // Copy into a buffer at an odd offset and slice it: a view like one into a frame.
        let mut v = vec![0u8; b.len() + 1];
        v[1..].copy_from_slice(b);
        let whole = Bytes::from(v);
        Blob(whole.slice(1..))
    }

    #[test]
    fn i64_columns_read_the_same_aligned_or_not() {
        let vals: Vec<i64> = (0..1000).map(|i| i * 7919 - 300_000).collect();
        let b = i64_blob(vals.clone());
        let u = unaligned(&b);
        assert_ne!(u.as_ptr() as usize % 8, 0);
        for blob in [b, u] {
            let rg = RowGroup {
                rows: 1000,
                cols: vec![blob],
            };
            let cols = Columns::of_group(&rg);
            assert_eq!(&cols.i64s(0).unwrap()[..], &vals[..]);
        }
    }

    #[test]
    fn text_columns_round_trip_and_bad_ones_are_errors() {
        let rows = ["a b", "", "héllo wörld"];
        let b = text_blob(&rows);
        for blob in [b.clone(), unaligned(&b)] {
            let rg = RowGroup {
                rows: 3,
                cols: vec![blob],
            };
            let t = Columns::of_group(&rg).text(0).unwrap();
            assert_eq!((0..3).map(|i| t.row(i)).collect::<Vec<_>>(), rows);
        }
        let mut bad = b.to_vec();
        bad[4] = 200; // the first row's end offset past the text
        let rg = RowGroup {
            rows: 3,
            cols: vec![Blob::from(bad)],
        };
        assert!(Columns::of_group(&rg).text(0).is_err());
    }

    #[test]
    fn wrong_sizes_and_missing_columns_are_errors() {
        let rg = RowGroup {
            rows: 3,
            cols: vec![Blob::from(vec![0u8; 23]), Blob::from(vec![0u8; 3])],
        };
        let c = Columns::of_group(&rg);
        assert!(matches!(c.i64s(0), Err(OpError::ColumnSize { .. })));
        assert!(c.codes(1).is_ok());
        assert!(matches!(c.codes(2), Err(OpError::ColumnMissing(2))));
        assert!(rg.project(&[0, 5]).is_err());
        let pulled = rg.project(&[1]).unwrap();
        let p = Columns::of_pulled(3, &[1], &pulled).unwrap();
        assert!(p.codes(1).is_ok());
        assert!(p.codes(0).is_err());
    }
}
