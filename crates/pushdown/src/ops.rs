//! Scan stages and their mergeable partials: the part of a query that runs once per row
//! group, at the caller (pull) or at the data (push).
//!
//! A [`Stage`] is data: a filter ([`Pred`]), an optional hash-join probe against a
//! [`JoinTable`] built beforehand, and an [`Output`] (project, aggregate, group-by, or
//! the word count's shuffle). [`Stage::run`] is a pure function of the stage and the
//! columns it names ([`Stage::columns`]), so pull and push give the same [`Partial`] by
//! construction. Partials [`Partial::merge`] associatively (and, except for projected
//! rows, whose order is unspecified, commutatively), so the partials of many row groups
//! and shards may be merged in any grouping and order; [`Stage::empty`] is the identity.
//!
//! Aggregates are exact: sums accumulate in `i128`; an average is carried as its sum
//! and count and reported as `floor(sum × 100 / count)` (hundredths of the column's
//! unit), an integer any SQL engine reproduces.

use crate::expr::{Evaluator, Expr, Frame, Kind, Pred};
use crate::table::{Columns, RowGroup};
use crate::OpError;
use foldhash::fast::FixedState;
use serde::{Deserialize, Serialize};
use std::collections::HashMap;

/// One aggregate function over the selected rows (of a group).
#[derive(Clone, Debug, PartialEq, Eq, Serialize, Deserialize)]
pub enum Agg {
    /// `SUM(expr)` (0 over no rows).
    Sum(Expr),
    /// `COUNT(*)`.
    Count,
    /// `MIN(expr)` (none over no rows).
    Min(Expr),
    /// `MAX(expr)` (none over no rows).
    Max(Expr),
    /// `AVG(expr)`, reported as `floor(sum × 100 / count)`.
    Avg(Expr),
}

/// An aggregate's running state: what partials carry and merge.
#[derive(Clone, Debug, PartialEq, Eq, Serialize, Deserialize)]
pub enum Acc {
    /// A sum.
    Sum(i128),
    /// A row count.
    Count(u64),
    /// The least value so far.
    Min(Option<i64>),
    /// The greatest value so far.
    Max(Option<i64>),
    /// An average's sum and count.
    Avg {
        /// Sum of the values.
        sum: i128,
        /// How many.
        count: u64,
    },
}

impl Acc {
    fn empty(a: &Agg) -> Acc {
        match a {
            Agg::Sum(_) => Acc::Sum(0),
            Agg::Count => Acc::Count(0),
            Agg::Min(_) => Acc::Min(None),
            Agg::Max(_) => Acc::Max(None),
            Agg::Avg(_) => Acc::Avg { sum: 0, count: 0 },
        }
    }

    /// Folds `other` (the same aggregate over other rows) into this.
    pub fn merge(&mut self, other: &Acc) -> Result<(), OpError> {
        match (self, other) {
            (Acc::Sum(a), Acc::Sum(b)) => *a = a.wrapping_add(*b),
            (Acc::Count(a), Acc::Count(b)) => *a = a.wrapping_add(*b),
            (Acc::Min(a), Acc::Min(b)) => *a = opt(*a, *b, i64::min),
            (Acc::Max(a), Acc::Max(b)) => *a = opt(*a, *b, i64::max),
            (Acc::Avg { sum, count }, Acc::Avg { sum: s, count: c }) => {
                *sum = sum.wrapping_add(*s);
                *count = count.wrapping_add(*c);
            }
            (a, b) => return Err(OpError::Mismatch(format!("{a:?} with {b:?}"))),
        }
        Ok(())
    }

    /// The reported value: none for the min/max/avg of no rows.
    pub fn value(&self) -> Option<i128> {
        match *self {
            Acc::Sum(s) => Some(s),
            Acc::Count(c) => Some(c as i128),
            Acc::Min(m) | Acc::Max(m) => m.map(i128::from),
            Acc::Avg { sum, count } => {
                (count > 0).then(|| sum.wrapping_mul(100).div_euclid(count as i128))
            }
        }
    }
}

fn opt(a: Option<i64>, b: Option<i64>, f: fn(i64, i64) -> i64) -> Option<i64> {
    match (a, b) {
        (Some(a), Some(b)) => Some(f(a, b)),
        (a, None) => a,
        (None, b) => b,
    }
}

/// What a stage produces from its selected (and joined) rows.
#[derive(Clone, Debug, PartialEq, Eq, Serialize, Deserialize)]
pub enum Output {
    /// The values of these expressions, one row per selected row (e.g. a join's build
    /// side: key, payload).
    Project(Vec<Expr>),
    /// One row of aggregates over all selected rows.
    Aggregate(Vec<Agg>),
    /// One row of aggregates per distinct key.
    GroupBy {
        /// The grouping key's parts.
        keys: Vec<Expr>,
        /// The aggregates per group.
        aggs: Vec<Agg>,
    },
    /// The word count's map side: the words of a `Text` column (maximal runs of bytes
    /// other than the space, 0x20) counted per row group, split by a fixed hash of the
    /// word into `buckets` buckets for a shuffle.
    WordCount {
        /// The text column.
        col: usize,
        /// How many buckets (reducers).
        buckets: u32,
    },
}

/// The per-row-group part of a query, as data (see the module doc).
#[derive(Clone, Debug, PartialEq, Eq, Serialize, Deserialize)]
pub struct Stage {
    /// Which rows take part.
    pub filter: Pred,
    /// Inner hash join: each selected row's key is looked up in the [`JoinTable`];
    /// rows without a match drop out, and [`Expr::Joined`] is the matched payload.
    pub probe: Option<Expr>,
    /// What the stage makes of the rows.
    pub output: Output,
}

/// A stage's result over some row groups, mergeable with its results over others.
#[derive(Clone, Debug, PartialEq, Eq, Serialize, Deserialize)]
pub enum Partial {
    /// Projected rows, column by column (`cols[j][i]` is row `i`'s value `j`).
    Rows {
        /// One vector per projected expression, all of the same length.
        cols: Vec<Vec<i64>>,
    },
    /// The aggregates over all rows seen.
    Agg(Vec<Acc>),
    /// Per group (key, aggregates), ascending by key, keys distinct.
    Groups(Vec<(Vec<i64>, Vec<Acc>)>),
    /// Per bucket (word, count), ascending by word, words distinct.
    Buckets(Vec<Vec<(String, u64)>>),
}

/// A built hash-join table: key → payload (unique keys, as a primary key join needs).
#[derive(Clone, Debug)]
pub struct JoinTable {
    map: HashMap<i64, i64, FixedState>,
    bytes: u64,
}

/// Why a [`JoinTable`] was not built.
#[derive(Debug, thiserror::Error)]
pub enum JoinError<E> {
    /// The memory budget refused the table's bytes.
    #[error("the memory budget refused {bytes} bytes: {err}")]
    Refused {
        /// What the table would have held.
        bytes: u64,
        /// The budget's answer.
        err: E,
    },
    /// A key occurs twice on the build side.
    #[error("key {0} occurs twice on the build side")]
    DuplicateKey(i64),
    /// Keys and payloads of different lengths.
    #[error("{keys} keys but {payloads} payloads")]
    Lengths {
        /// Keys given.
        keys: usize,
        /// Payloads given.
        payloads: usize,
    },
}

impl JoinTable {
    /// Bytes a table of `n` entries allocates: the standard map's buckets (a power of
    /// two at least 8/7 × n), 16 bytes per (key, payload) and one control byte each,
    /// plus a group of trailing control bytes.
    pub fn bytes_for(n: usize) -> u64 {
        if n == 0 {
            return 0;
        }
        let buckets = if n < 4 {
            4
        } else if n < 8 {
            8
        } else {
            (n.saturating_mul(8) / 7).next_power_of_two()
        };
        (buckets * 17 + 16) as u64
    }

    /// Builds the table from a build side's keys and payloads, first asking `reserve`
    /// for its bytes ([`JoinTable::bytes_for`]): when it refuses, nothing is allocated.
    pub fn build<E>(
        keys: &[i64],
        payloads: &[i64],
        reserve: &mut dyn FnMut(u64) -> Result<(), E>,
    ) -> Result<JoinTable, JoinError<E>> {
        if keys.len() != payloads.len() {
            return Err(JoinError::Lengths {
                keys: keys.len(),
                payloads: payloads.len(),
            });
        }
        let bytes = JoinTable::bytes_for(keys.len());
        reserve(bytes).map_err(|err| JoinError::Refused { bytes, err })?;
        let mut map = HashMap::with_capacity_and_hasher(keys.len(), FixedState::default());
        for (&k, &p) in keys.iter().zip(payloads) {
            if map.insert(k, p).is_some() {
                return Err(JoinError::DuplicateKey(k));
            }
        }
        Ok(JoinTable { map, bytes })
    }

    /// The bytes reserved for it (what to release when it is dropped).
    pub fn bytes(&self) -> u64 {
        self.bytes
    }

    /// Entries.
    pub fn len(&self) -> usize {
        self.map.len()
    }

    /// Whether it has no entries.
    pub fn is_empty(&self) -> bool {
        self.map.is_empty()
    }

    /// The payload of `key`.
    pub fn get(&self, key: i64) -> Option<i64> {
        self.map.get(&key).copied()
    }
}

impl Stage {
    /// The table columns this stage reads, ascending: what pull fetches, in this order.
    pub fn columns(&self) -> Vec<usize> {
        let mut cols: Vec<usize> = self.uses().into_iter().map(|(c, _)| c).collect();
        cols.dedup();
        cols
    }

    /// Bytes of this stage's columns in `rg` (what pulling them moves).
    pub fn bytes_in(&self, rg: &RowGroup) -> u64 {
        rg.bytes_of(&self.columns())
    }

    /// Every (column, how it is read), sorted and deduplicated.
    fn uses(&self) -> Vec<(usize, Kind)> {
        let mut u = Vec::new();
        self.filter.uses(&mut u);
        if let Some(p) = &self.probe {
            p.uses(&mut u);
        }
        match &self.output {
            Output::Project(es) => es.iter().for_each(|e| e.uses(&mut u)),
            Output::Aggregate(aggs) => aggs.iter().for_each(|a| agg_uses(a, &mut u)),
            Output::GroupBy { keys, aggs } => {
                keys.iter().for_each(|e| e.uses(&mut u));
                aggs.iter().for_each(|a| agg_uses(a, &mut u));
            }
            Output::WordCount { col, .. } => u.push((*col, Kind::Text)),
        }
        u.sort_unstable();
        u.dedup();
        u
    }

    /// Every expression of the stage (for checks).
    fn exprs(&self) -> Vec<&Expr> {
        let mut es: Vec<&Expr> = self.probe.iter().collect();
        fn agg_expr(a: &Agg) -> Option<&Expr> {
            match a {
                Agg::Sum(e) | Agg::Min(e) | Agg::Max(e) | Agg::Avg(e) => Some(e),
                Agg::Count => None,
            }
        }
        match &self.output {
            Output::Project(xs) => es.extend(xs),
            Output::Aggregate(aggs) => es.extend(aggs.iter().filter_map(agg_expr)),
            Output::GroupBy { keys, aggs } => {
                es.extend(keys);
                es.extend(aggs.iter().filter_map(agg_expr));
            }
            Output::WordCount { .. } => {}
        }
        es
    }

    /// Checks that every column the stage reads is in `schema`: a bad column number is
    /// refused before anything runs, naming the table's width, rather than by a data node
    /// halfway through a query.
    pub fn check_columns(&self, schema: &crate::Schema) -> Result<(), OpError> {
        let width = schema.cols.len();
        match self.columns().into_iter().find(|&c| c >= width) {
            Some(col) => Err(OpError::NoColumnIn {
                col,
                table: schema.table.clone(),
                width,
            }),
            None => Ok(()),
        }
    }

    /// Checks what can be checked without data: nesting, column kinds, the join's use.
    pub fn check(&self) -> Result<(), OpError> {
        self.filter.check_depth(crate::MAX_DEPTH)?;
        for e in self.exprs() {
            e.check_depth(crate::MAX_DEPTH)?;
        }
        let uses = self.uses();
        if let Some(w) = uses.windows(2).find(|w| w[0].0 == w[1].0) {
            return Err(OpError::ColumnKind(w[0].0));
        }
        if let Some(p) = &self.probe {
            if p.reads_joined() {
                return Err(OpError::Join(
                    "the probe key reads the joined payload".into(),
                ));
            }
        } else if self.exprs().iter().any(|e| e.reads_joined()) {
            return Err(OpError::Join(
                "the joined payload read without a probe".into(),
            ));
        }
        if let Output::WordCount { buckets: 0, .. } = self.output {
            return Err(OpError::BadStage("a shuffle into zero buckets".into()));
        }
        Ok(())
    }

    /// The merge identity: this stage's partial over no rows.
    pub fn empty(&self) -> Partial {
        match &self.output {
            Output::Project(es) => Partial::Rows {
                cols: vec![Vec::new(); es.len()],
            },
            Output::Aggregate(aggs) => Partial::Agg(aggs.iter().map(Acc::empty).collect()),
            Output::GroupBy { .. } => Partial::Groups(Vec::new()),
            Output::WordCount { buckets, .. } => {
                Partial::Buckets(vec![Vec::new(); (*buckets).min(1 << 16) as usize])
            }
        }
    }

    /// Runs the stage over one row group's columns (all of them, or at least those of
    /// [`Stage::columns`]); `join` is the built table when the stage probes one.
    ///
    /// The row group is processed in windows of 16 Ki rows (`WINDOW`), and each window's
    /// selected rows in chunks of at most 2048 (`BATCH`): the filter runs over a window, then
    /// probe and output over one chunk at a time, so that intermediate vectors stay in
    /// the core's caches; the output's state (sums, groups, projected rows, word counts)
    /// carries over from chunk to chunk.
    pub fn run(&self, cols: &Columns<'_>, join: Option<&JoinTable>) -> Result<Partial, OpError> {
        self.check()?;
        let uses = self.uses();
        // Text columns are read by the word count itself; the frame holds the others.
        let frame_uses: Vec<(usize, Kind)> = uses
            .iter()
            .copied()
            .filter(|&(_, k)| k != Kind::Text)
            .collect();
        let f = Frame::new(cols, &frame_uses)?;
        let table =
            match &self.probe {
                Some(_) => Some(join.ok_or_else(|| {
                    OpError::Join("the stage probes but no table was given".into())
                })?),
                None => None,
            };
        let mut out = Sink::new(&self.output, cols)?;
        let mut ev = Evaluator::new();
        let (mut sel, mut pay) = (Vec::<u32>::new(), Vec::<i64>::new());
        for start in (0..f.rows).step_by(WINDOW) {
            let w = f.window(start, WINDOW.min(f.rows - start));
            let passed = self.filter.select(&w, None)?;
            for chunk in passed.chunks(BATCH) {
                ev.reset();
                sel.clear();
                sel.extend_from_slice(chunk);
                let mut joined = None;
                if let (Some(key), Some(table)) = (&self.probe, table) {
                    let at = ev.eval(key, &w, &sel, None)?;
                    pay.clear();
                    let mut n = 0;
                    for (i, &k) in ev.values(at).iter().enumerate() {
                        if let Some(p) = table.get(k) {
                            sel[n] = sel[i];
                            pay.push(p);
                            n += 1;
                        }
                    }
                    sel.truncate(n);
                    // The values computed so far are of the rows before the probe.
                    ev.reset();
                    joined = Some(&pay[..]);
                }
                out.add(&w, &sel, joined, start, &mut ev)?;
            }
        }
        Ok(out.finish())
    }
}

/// Rows per window of a stage's filter (see [`Stage::run`]): its selection vector
/// (4 bytes a row) stays in the L2 cache, and a sparse selection still has enough rows
/// per window that the cache misses of gathering and probing them overlap.
const WINDOW: usize = 16 * 1024;

/// Selected rows per chunk of a stage's probe and output (see [`Stage::run`]): a chunk's
/// vectors (8 bytes a row each) stay in the L1/L2 caches. The exact `i64` sums of
/// [`add_sums`] rely on it being at most 4096.
const BATCH: usize = 2048;
const _: () = assert!(BATCH <= 4096);

/// A stage's output state over the windows of one run.
enum Sink<'s, 'c> {
    Rows(&'s [Expr], Vec<Vec<i64>>),
    Agg(Accums<'s>),
    Groups(Grouper<'s>, Accums<'s>, Vec<u32>),
    Words(
        crate::table::TextCol<'c>,
        HashMap<&'c str, u64, FixedState>,
        u32,
    ),
}

impl<'s, 'c> Sink<'s, 'c> {
    fn new(output: &'s Output, cols: &Columns<'c>) -> Result<Sink<'s, 'c>, OpError> {
        Ok(match output {
            Output::Project(es) => Sink::Rows(es, vec![Vec::new(); es.len()]),
            Output::Aggregate(aggs) => Sink::Agg(Accums::new(aggs)),
            Output::GroupBy { keys, aggs } => {
                Sink::Groups(Grouper::new(keys), Accums::new(aggs), Vec::new())
            }
            Output::WordCount { col, buckets } => {
                Sink::Words(cols.text(*col)?, HashMap::default(), *buckets)
            }
        })
    }

    /// Takes the rows `sel` (at most [`BATCH`]) of the window `w`, which starts at row
    /// `start` of the group.
    fn add(
        &mut self,
        w: &Frame<'_>,
        sel: &[u32],
        joined: Option<&[i64]>,
        start: usize,
        ev: &mut Evaluator<'s>,
    ) -> Result<(), OpError> {
        match self {
            Sink::Rows(es, cols) => {
                for (e, col) in es.iter().zip(cols.iter_mut()) {
                    let at = ev.eval(e, w, sel, joined)?;
                    col.extend_from_slice(ev.values(at));
                }
            }
            Sink::Agg(accs) => accs.add(w, sel, joined, None, ev)?,
            Sink::Groups(grouper, accs, gid) => {
                grouper.assign(w, sel, joined, ev, gid)?;
                accs.grow(grouper.len());
                accs.add(w, sel, joined, Some(gid), ev)?;
            }
            Sink::Words(text, counts, _) => {
                for &r in sel {
                    for word in text.row(start + r as usize).split(' ') {
                        if !word.is_empty() {
                            *counts.entry(word).or_insert(0) += 1;
                        }
                    }
                }
            }
        }
        Ok(())
    }

    fn finish(self) -> Partial {
        match self {
            Sink::Rows(_, cols) => Partial::Rows { cols },
            Sink::Agg(accs) => Partial::Agg(accs.finish(1).pop().unwrap_or_default()),
            Sink::Groups(grouper, accs, _) => {
                let accs = accs.finish(grouper.len());
                let mut groups: Vec<(Vec<i64>, Vec<Acc>)> =
                    grouper.keys.into_iter().zip(accs).collect();
                groups.sort_unstable_by(|a, b| a.0.cmp(&b.0));
                Partial::Groups(groups)
            }
            Sink::Words(_, counts, buckets) => {
                let n = buckets.clamp(1, 1 << 16) as usize;
                let mut out: Vec<Vec<(String, u64)>> = vec![Vec::new(); n];
                for (w, c) in counts {
                    out[word_bucket(w, n as u32)].push((w.to_string(), c));
                }
                for b in &mut out {
                    b.sort_unstable();
                }
                Partial::Buckets(out)
            }
        }
    }
}

fn agg_uses(a: &Agg, out: &mut Vec<(usize, Kind)>) {
    match a {
        Agg::Sum(e) | Agg::Min(e) | Agg::Max(e) | Agg::Avg(e) => e.uses(out),
        Agg::Count => {}
    }
}

/// Assigns each selected row its group's number, numbering groups as they appear.
struct Grouper<'s> {
    keys_of: &'s [Expr],
    /// One or two dictionary codes: their columns, for a direct-indexed table.
    direct: Option<Vec<usize>>,
    /// Direct: the group of codes `(c0 << 8) | c1`, `u32::MAX` for none yet; grown as
    /// higher codes appear (so Q1's three × two codes need 768 entries, not 65 536).
    slot: Vec<u32>,
    map: HashMap<Vec<i64>, u32, FixedState>,
    /// Each group's key, by number.
    keys: Vec<Vec<i64>>,
}

impl<'s> Grouper<'s> {
    fn new(keys: &'s [Expr]) -> Grouper<'s> {
        let direct = (!keys.is_empty() && keys.len() <= 2)
            .then(|| {
                keys.iter()
                    .map(|k| match k {
                        Expr::Code(c) => Some(*c),
                        _ => None,
                    })
                    .collect::<Option<Vec<usize>>>()
            })
            .flatten();
        Grouper {
            keys_of: keys,
            direct,
            slot: Vec::new(),
            map: HashMap::default(),
            keys: Vec::new(),
        }
    }

    fn len(&self) -> usize {
        self.keys.len()
    }

    /// Sets `gid[i]` to row `sel[i]`'s group.
    fn assign(
        &mut self,
        w: &Frame<'_>,
        sel: &[u32],
        joined: Option<&[i64]>,
        ev: &mut Evaluator<'s>,
        gid: &mut Vec<u32>,
    ) -> Result<(), OpError> {
        gid.clear();
        match &self.direct {
            Some(parts) => {
                let c0 = w.codes(parts[0])?;
                let c1 = match parts.get(1) {
                    Some(&c) => Some(w.codes(c)?),
                    None => None,
                };
                gid.reserve(sel.len());
                for &r in sel {
                    let r = r as usize;
                    let at = match c1 {
                        Some(c1) => (c0[r] as usize) << 8 | c1[r] as usize,
                        None => c0[r] as usize,
                    };
                    if at >= self.slot.len() {
                        self.slot.resize((at | 0xff) + 1, u32::MAX);
                    }
                    let mut g = self.slot[at];
                    if g == u32::MAX {
                        g = self.keys.len() as u32;
                        self.slot[at] = g;
                        self.keys.push(match c1 {
                            Some(c1) => vec![c0[r] as i64, c1[r] as i64],
                            None => vec![c0[r] as i64],
                        });
                    }
                    gid.push(g);
                }
            }
            None => {
                let parts: Vec<usize> = self
                    .keys_of
                    .iter()
                    .map(|e| ev.eval(e, w, sel, joined))
                    .collect::<Result<_, _>>()?;
                let mut key = vec![0i64; parts.len()];
                for i in 0..sel.len() {
                    for (k, &p) in key.iter_mut().zip(&parts) {
                        *k = ev.values(p)[i];
                    }
                    let g = match self.map.get(&key[..]) {
                        Some(&g) => g,
                        None => {
                            let g = self.keys.len() as u32;
                            self.map.insert(key.clone(), g);
                            self.keys.push(key.clone());
                            g
                        }
                    };
                    gid.push(g);
                }
            }
        }
        Ok(())
    }
}

/// The running aggregates of a run, per group.
struct Accums<'s> {
    aggs: &'s [Agg],
    /// Per aggregate, the first aggregate whose running sum it shares (`SUM(x)` and
    /// `AVG(x)` of the same `x`), or itself.
    first: Vec<usize>,
    /// Rows per group.
    counts: Vec<u64>,
    /// Per aggregate, per group: the sum (`Sum`, `Avg`; empty for shared ones).
    sums: Vec<Vec<i128>>,
    /// Per aggregate, per group: the least or greatest value (`Min`, `Max`).
    best: Vec<Vec<i64>>,
    /// Scratch for the per-window sums.
    scratch: Vec<i64>,
}

impl<'s> Accums<'s> {
    fn new(aggs: &'s [Agg]) -> Accums<'s> {
        let summed = |a: &'s Agg| match a {
            Agg::Sum(e) | Agg::Avg(e) => Some(e),
            _ => None,
        };
        let first = aggs
            .iter()
            .enumerate()
            .map(|(k, a)| match summed(a) {
                Some(e) => aggs[..k]
                    .iter()
                    .position(|b| summed(b) == Some(e))
                    .unwrap_or(k),
                None => k,
            })
            .collect();
        let mut accs = Accums {
            aggs,
            first,
            counts: Vec::new(),
            sums: vec![Vec::new(); aggs.len()],
            best: vec![Vec::new(); aggs.len()],
            scratch: Vec::new(),
        };
        accs.grow(1);
        accs
    }

    /// Makes room for `groups` groups.
    fn grow(&mut self, groups: usize) {
        if self.counts.len() >= groups {
            return;
        }
        self.counts.resize(groups, 0);
        for (k, a) in self.aggs.iter().enumerate() {
            match a {
                Agg::Sum(_) | Agg::Avg(_) if self.first[k] == k => self.sums[k].resize(groups, 0),
                Agg::Min(_) => self.best[k].resize(groups, i64::MAX),
                Agg::Max(_) => self.best[k].resize(groups, i64::MIN),
                _ => {}
            }
        }
    }

    /// Adds the rows `sel` of `w`, row `sel[i]` to group `gid[i]` (all to group 0
    /// without `gid`).
    fn add(
        &mut self,
        w: &Frame<'_>,
        sel: &[u32],
        joined: Option<&[i64]>,
        gid: Option<&[u32]>,
        ev: &mut Evaluator<'s>,
    ) -> Result<(), OpError> {
        let groups = self.counts.len();
        match gid {
            None => self.counts[0] += sel.len() as u64,
            Some(gid) => add_counts(gid, &mut self.counts, &mut self.scratch),
        }
        for (k, a) in self.aggs.iter().enumerate() {
            match a {
                Agg::Count => {}
                Agg::Sum(e) | Agg::Avg(e) => {
                    if self.first[k] == k {
                        let at = ev.eval(e, w, sel, joined)?;
                        add_sums(ev.values(at), gid, &mut self.sums[k], &mut self.scratch);
                    }
                }
                Agg::Min(e) | Agg::Max(e) => {
                    let at = ev.eval(e, w, sel, joined)?;
                    let v = ev.values(at);
                    let best = &mut self.best[k];
                    let is_min = matches!(a, Agg::Min(_));
                    match gid {
                        None if is_min => {
                            best[0] = v.iter().copied().fold(best[0], i64::min);
                        }
                        None => best[0] = v.iter().copied().fold(best[0], i64::max),
                        Some(gid) => {
                            for (&g, &x) in gid.iter().zip(v) {
                                let b = &mut best[g as usize];
                                *b = if is_min { (*b).min(x) } else { (*b).max(x) };
                            }
                        }
                    }
                }
            }
        }
        debug_assert_eq!(groups, self.counts.len());
        Ok(())
    }

    /// One row of accumulators per group.
    fn finish(self, groups: usize) -> Vec<Vec<Acc>> {
        (0..groups)
            .map(|g| {
                let count = self.counts[g];
                self.aggs
                    .iter()
                    .enumerate()
                    .map(|(k, a)| match a {
                        Agg::Count => Acc::Count(count),
                        Agg::Sum(_) => Acc::Sum(self.sums[self.first[k]][g]),
                        Agg::Avg(_) => Acc::Avg {
                            sum: self.sums[self.first[k]][g],
                            count,
                        },
                        Agg::Min(_) => Acc::Min((count > 0).then_some(self.best[k][g])),
                        Agg::Max(_) => Acc::Max((count > 0).then_some(self.best[k][g])),
                    })
                    .collect()
            })
            .collect()
    }
}

/// `x`'s magnitude bits: `|x|` for `x ≥ 0`, `|x| − 1` for `x < 0`, so that the bitwise
/// OR `m` of these over values shows every one of them has `|x| ≤ m + 1`.
#[inline(always)]
fn magnitude(x: i64) -> u64 {
    (x ^ (x >> 63)) as u64
}

/// Values (OR of [`magnitude`]s) below this bound sum exactly in `i64` in one window.
///
/// Why: every value then has `|x| ≤ 2⁵⁰`, a window has at most 4096 = 2¹² of them
/// ([`BATCH`]), so every partial sum has `|s| ≤ 2⁶²` < 2⁶³: no `i64` addition wraps, and
/// the `i64` sum equals the `i128` one. (Q1's largest value, price × (100 − discount)
/// × (100 + tax), is below 10⁷ cents × 100 × 109 ≈ 1.1 × 10¹¹ < 2³⁷, far inside.) A
/// window with a larger value is summed again in `i128`.
const EXACT_BELOW: u64 = 1 << 50;

/// Adds each `v[i]` to `sums[gid[i]]` (to `sums[0]` without `gid`): in `i64` per window
/// where that is exact ([`EXACT_BELOW`]), folded into the `i128` sums once per window.
fn add_sums(v: &[i64], gid: Option<&[u32]>, sums: &mut [i128], scratch: &mut Vec<i64>) {
    debug_assert!(v.len() <= BATCH);
    let Some(gid) = gid else {
        let (mut s, mut m) = (0i64, 0u64);
        for &x in v {
            s = s.wrapping_add(x);
            m |= magnitude(x);
        }
        sums[0] += if m < EXACT_BELOW {
            s as i128
        } else {
            v.iter().map(|&x| x as i128).sum::<i128>()
        };
        return;
    };
    // Four copies of the per-group sums, one per row modulo 4: consecutive rows of one
    // group then add to different memory words, not one long store-to-load chain.
    let groups = sums.len();
    scratch.clear();
    scratch.resize(4 * groups, 0);
    let (a0, rest) = scratch.split_at_mut(groups);
    let (a1, rest) = rest.split_at_mut(groups);
    let (a2, a3) = rest.split_at_mut(groups);
    let mut m = 0u64;
    let (vs, gs) = (v.chunks_exact(4), gid.chunks_exact(4));
    let (vr, gr) = (vs.remainder(), gs.remainder());
    for (x, g) in vs.zip(gs) {
        a0[g[0] as usize] = a0[g[0] as usize].wrapping_add(x[0]);
        a1[g[1] as usize] = a1[g[1] as usize].wrapping_add(x[1]);
        a2[g[2] as usize] = a2[g[2] as usize].wrapping_add(x[2]);
        a3[g[3] as usize] = a3[g[3] as usize].wrapping_add(x[3]);
        m |= magnitude(x[0]) | magnitude(x[1]) | magnitude(x[2]) | magnitude(x[3]);
    }
    for (&x, &g) in vr.iter().zip(gr) {
        a0[g as usize] = a0[g as usize].wrapping_add(x);
        m |= magnitude(x);
    }
    if m < EXACT_BELOW {
        for (g, s) in sums.iter_mut().enumerate() {
            *s += a0[g] as i128 + a1[g] as i128 + a2[g] as i128 + a3[g] as i128;
        }
    } else {
        for (&x, &g) in v.iter().zip(gid) {
            sums[g as usize] += x as i128;
        }
    }
}

/// Adds one to `counts[g]` per `g` of `gid` (four copies, as in [`add_sums`]).
fn add_counts(gid: &[u32], counts: &mut [u64], scratch: &mut Vec<i64>) {
    let groups = counts.len();
    scratch.clear();
    scratch.resize(4 * groups, 0);
    let (a0, rest) = scratch.split_at_mut(groups);
    let (a1, rest) = rest.split_at_mut(groups);
    let (a2, a3) = rest.split_at_mut(groups);
    let gs = gid.chunks_exact(4);
    for &g in gs.remainder() {
        a0[g as usize] += 1;
    }
    for g in gs {
        a0[g[0] as usize] += 1;
        a1[g[1] as usize] += 1;
        a2[g[2] as usize] += 1;
        a3[g[3] as usize] += 1;
    }
    for (g, c) in counts.iter_mut().enumerate() {
        *c += (a0[g] + a1[g] + a2[g] + a3[g]) as u64;
    }
}

/// FNV-1a: a fixed hash, so a word lands in the same bucket on every machine.
pub fn word_bucket(word: &str, buckets: u32) -> usize {
    let mut h: u64 = 0xcbf2_9ce4_8422_2325;
    for &b in word.as_bytes() {
        h ^= b as u64;
        h = h.wrapping_mul(0x0100_0000_01b3);
    }
    (h % buckets.max(1) as u64) as usize
}

/// Merges two ascending, key-distinct lists, combining equal keys with `both`.
fn merge_sorted<K: Ord, V>(
    a: Vec<(K, V)>,
    b: Vec<(K, V)>,
    mut both: impl FnMut(&mut V, V) -> Result<(), OpError>,
) -> Result<Vec<(K, V)>, OpError> {
    let mut out = Vec::with_capacity(a.len() + b.len());
    let mut b = b.into_iter().peekable();
    for (k, mut v) in a {
        while let Some((bk, _)) = b.peek() {
            if *bk < k {
                out.extend(b.next());
            } else {
                break;
            }
        }
        if b.peek().is_some_and(|(bk, _)| *bk == k) {
            if let Some((_, bv)) = b.next() {
                both(&mut v, bv)?;
            }
        }
        out.push((k, v));
    }
    out.extend(b);
    Ok(out)
}

impl Partial {
    /// Folds `other` (the same stage's partial over other rows) into this one.
    pub fn merge(&mut self, other: Partial) -> Result<(), OpError> {
        match (self, other) {
            (Partial::Rows { cols }, Partial::Rows { cols: more }) => {
                if cols.len() != more.len() {
                    return Err(OpError::Mismatch(format!(
                        "rows of {} and {} columns",
                        cols.len(),
                        more.len()
                    )));
                }
                for (c, m) in cols.iter_mut().zip(more) {
                    c.extend(m);
                }
            }
            (Partial::Agg(a), Partial::Agg(b)) => merge_accs(a, &b)?,
            (Partial::Groups(a), Partial::Groups(b)) => {
                let mine = std::mem::take(a);
                *a = merge_sorted(mine, b, |x, y| merge_accs(x, &y))?;
            }
            (Partial::Buckets(a), Partial::Buckets(b)) => {
                if a.len() != b.len() {
                    return Err(OpError::Mismatch(format!(
                        "{} buckets with {}",
                        a.len(),
                        b.len()
                    )));
                }
                for (x, y) in a.iter_mut().zip(b) {
                    let mine = std::mem::take(x);
                    *x = merge_sorted(mine, y, |c, d| {
                        *c = c.wrapping_add(d);
                        Ok(())
                    })?;
                }
            }
            (a, b) => {
                return Err(OpError::Mismatch(format!(
                    "a {} partial with a {} one",
                    a.kind(),
                    b.kind()
                )))
            }
        }
        Ok(())
    }

    fn kind(&self) -> &'static str {
        match self {
            Partial::Rows { .. } => "rows",
            Partial::Agg(_) => "aggregate",
            Partial::Groups(_) => "group-by",
            Partial::Buckets(_) => "shuffle",
        }
    }

    /// Its encoded size in bytes (postcard): what sending it moves.
    pub fn bytes(&self) -> u64 {
        encoded_len(self)
    }
}

fn merge_accs(a: &mut [Acc], b: &[Acc]) -> Result<(), OpError> {
    if a.len() != b.len() {
        return Err(OpError::Mismatch(format!(
            "{} aggregates with {}",
            a.len(),
            b.len()
        )));
    }
    a.iter_mut().zip(b).try_for_each(|(x, y)| x.merge(y))
}

/// A postcard output that only counts.
struct Count(u64);

impl postcard::ser_flavors::Flavor for Count {
    type Output = u64;

    fn try_push(&mut self, _: u8) -> postcard::Result<()> {
        self.0 += 1;
        Ok(())
    }

    fn try_extend(&mut self, d: &[u8]) -> postcard::Result<()> {
        self.0 += d.len() as u64;
        Ok(())
    }

    fn finalize(self) -> postcard::Result<u64> {
        Ok(self.0)
    }
}

/// The length of `v`'s postcard encoding, without allocating it.
pub fn encoded_len<T: Serialize + ?Sized>(v: &T) -> u64 {
    postcard::serialize_with_flavor(v, Count(0)).unwrap_or(0)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn a_join_table_asks_its_budget_first_and_is_refused_past_it() {
        let keys: Vec<i64> = (0..1000).collect();
        let pay: Vec<i64> = keys.iter().map(|k| k * 2).collect();
        let mut asked = Vec::new();
        let mut budget = |b: u64| {
            asked.push(b);
            if b <= 4096 {
                Ok(())
            } else {
                Err("over budget")
            }
        };
        let small = JoinTable::build(&keys[..10], &pay[..10], &mut budget).unwrap();
        assert_eq!(small.get(7), Some(14));
        assert_eq!(small.get(70), None);
        assert_eq!(small.len(), 10);
        let big = JoinTable::build(&keys, &pay, &mut budget);
        assert!(matches!(
            big,
            Err(JoinError::Refused {
                err: "over budget",
                ..
            })
        ));
        assert_eq!(
            asked,
            vec![JoinTable::bytes_for(10), JoinTable::bytes_for(1000)]
        );
        assert!(JoinTable::bytes_for(1000) >= 1000 * 17);
        let dup = JoinTable::build(&[1, 2, 1], &[0, 0, 0], &mut |_| Ok::<(), ()>(()));
        assert!(matches!(dup, Err(JoinError::DuplicateKey(1))));
        let odd = JoinTable::build(&[1, 2], &[0], &mut |_| Ok::<(), ()>(()));
        assert!(matches!(odd, Err(JoinError::Lengths { .. })));
    }

    #[test]
    fn accumulators_merge_and_report_exactly() {
        let mut a = Acc::Avg { sum: 7, count: 2 };
        a.merge(&Acc::Avg { sum: 0, count: 1 }).unwrap();
        assert_eq!(a.value(), Some(233)); // floor(700 / 3)
        assert_eq!(Acc::Avg { sum: 0, count: 0 }.value(), None);
        let mut m = Acc::Min(None);
        m.merge(&Acc::Min(Some(5))).unwrap();
        m.merge(&Acc::Min(Some(-2))).unwrap();
        m.merge(&Acc::Min(None)).unwrap();
        assert_eq!(m.value(), Some(-2));
        assert!(m.merge(&Acc::Sum(1)).is_err());
        let mut p = Partial::Agg(vec![Acc::Sum(1)]);
        assert!(p.merge(Partial::Groups(vec![])).is_err());
        assert!(p
            .merge(Partial::Agg(vec![Acc::Sum(1), Acc::Count(1)]))
            .is_err());
    }

    #[test]
    fn group_by_and_min_max_over_a_hand_made_group() {
        use crate::table::{i64_blob, RowGroup};
        use granule_runtime::Blob;
        // col 0: i64 value, col 1: code, col 2: i64 second key.
        let vals = vec![5, -1, 7, 3, 9, 2];
        let codes = vec![0u8, 1, 0, 1, 0, 2];
        let k2 = vec![10, 10, 20, 10, 10, 10];
        let rg = RowGroup {
            rows: 6,
            cols: vec![i64_blob(vals), Blob::from(codes), i64_blob(k2)],
        };
        let stage = |keys: Vec<Expr>| Stage {
            filter: Pred::Cmp(0, crate::CmpOp::Ne, 9),
            probe: None,
            output: Output::GroupBy {
                keys,
                aggs: vec![
                    Agg::Min(Expr::Col(0)),
                    Agg::Max(Expr::Col(0)),
                    Agg::Count,
                    Agg::Sum(Expr::Col(0)),
                ],
            },
        };
        let cols = Columns::of_group(&rg);
        let direct = stage(vec![Expr::Code(1)]).run(&cols, None).unwrap();
        let hashed = stage(vec![Expr::plus(Expr::Code(1), Expr::Const(0))])
            .run(&cols, None)
            .unwrap();
        let acc = |min, max, n, sum| {
            vec![
                Acc::Min(Some(min)),
                Acc::Max(Some(max)),
                Acc::Count(n),
                Acc::Sum(sum),
            ]
        };
        let want = Partial::Groups(vec![
            (vec![0], acc(5, 7, 2, 12)),
            (vec![1], acc(-1, 3, 2, 2)),
            (vec![2], acc(2, 2, 1, 2)),
        ]);
        assert_eq!(direct, want);
        assert_eq!(hashed, want);
        let two = stage(vec![Expr::Code(1), Expr::Col(2)])
            .run(&cols, None)
            .unwrap();
        let Partial::Groups(g) = two else {
            panic!("groups")
        };
        assert_eq!(
            g.iter().map(|(k, _)| k.clone()).collect::<Vec<_>>(),
            vec![vec![0, 10], vec![0, 20], vec![1, 10], vec![2, 10]]
        );
        // Over no rows: an ungrouped aggregate is one row of empties.
        let none = Stage {
            filter: Pred::Cmp(0, crate::CmpOp::Gt, 100),
            probe: None,
            output: Output::Aggregate(vec![
                Agg::Min(Expr::Col(0)),
                Agg::Count,
                Agg::Sum(Expr::Col(0)),
            ]),
        };
        assert_eq!(
            none.run(&cols, None).unwrap(),
            Partial::Agg(vec![Acc::Min(None), Acc::Count(0), Acc::Sum(0)])
        );
        // One column read as two types is refused.
        let bad = Stage {
            filter: Pred::InSet(0, vec![1]),
            probe: None,
            output: Output::Aggregate(vec![Agg::Sum(Expr::Col(0))]),
        };
        assert_eq!(bad.run(&cols, None), Err(OpError::ColumnKind(0)));
    }

    #[test]
    fn sums_are_exact_across_chunks_and_past_the_i64_range() {
        use crate::table::{i64_blob, RowGroup};
        use granule_runtime::Blob;
        // More rows than a window, so several windows and chunks; values near the
        // i64 limits in some rows (the i128 fallback), small ones elsewhere.
        let n = 2 * WINDOW + 3 * BATCH + 17;
        let vals: Vec<i64> = (0..n as i64)
            .map(|i| match i % 1000 {
                7 => i64::MAX - i,
                500 => i64::MIN + i,
                _ => i * 37 - 5000,
            })
            .collect();
        let small: Vec<i64> = (0..n as i64).map(|i| i % 100).collect();
        let codes: Vec<u8> = (0..n).map(|i| (i % 3) as u8 + 250).collect();
        let rg = RowGroup {
            rows: n as u32,
            cols: vec![
                i64_blob(vals.clone()),
                i64_blob(small.clone()),
                Blob::from(codes.clone()),
            ],
        };
        let cols = Columns::of_group(&rg);
        let keep = |i: usize| small[i] != 3;
        // Ungrouped.
        let agg = Stage {
            filter: Pred::Cmp(1, crate::CmpOp::Ne, 3),
            probe: None,
            output: Output::Aggregate(vec![
                Agg::Sum(Expr::Col(0)),
                Agg::Avg(Expr::Col(0)),
                Agg::Sum(Expr::times(Expr::Col(1), Expr::Col(1))),
                Agg::Count,
            ]),
        };
        let want: i128 = (0..n).filter(|&i| keep(i)).map(|i| vals[i] as i128).sum();
        let sq: i128 = (0..n)
            .filter(|&i| keep(i))
            .map(|i| (small[i] * small[i]) as i128)
            .sum();
        let count = (0..n).filter(|&i| keep(i)).count() as u64;
        assert_eq!(
            agg.run(&cols, None).unwrap(),
            Partial::Agg(vec![
                Acc::Sum(want),
                Acc::Avg { sum: want, count },
                Acc::Sum(sq),
                Acc::Count(count),
            ])
        );
        // Grouped by a code (direct) and by an expression (hashed).
        for key in [Expr::Code(2), Expr::plus(Expr::Code(2), Expr::Const(0))] {
            let stage = Stage {
                filter: Pred::Cmp(1, crate::CmpOp::Ne, 3),
                probe: None,
                output: Output::GroupBy {
                    keys: vec![key],
                    aggs: vec![Agg::Sum(Expr::Col(0)), Agg::Count, Agg::Max(Expr::Col(0))],
                },
            };
            let want = Partial::Groups(
                (250..253)
                    .map(|c| {
                        let rows: Vec<usize> = (0..n)
                            .filter(|&i| keep(i) && codes[i] as i64 == c)
                            .collect();
                        (
                            vec![c],
                            vec![
                                Acc::Sum(rows.iter().map(|&i| vals[i] as i128).sum()),
                                Acc::Count(rows.len() as u64),
                                Acc::Max(rows.iter().map(|&i| vals[i]).max()),
                            ],
                        )
                    })
                    .collect(),
            );
            assert_eq!(stage.run(&cols, None).unwrap(), want);
        }
    }

    #[test]
    fn word_count_buckets_are_fixed_by_the_word() {
        use crate::table::{text_blob, RowGroup};
        let rg = RowGroup {
            rows: 3,
            cols: vec![text_blob(&["a b  a", " c", "b"])],
        };
        let stage = Stage {
            filter: Pred::True,
            probe: None,
            output: Output::WordCount { col: 0, buckets: 3 },
        };
        let Partial::Buckets(b) = stage.run(&Columns::of_group(&rg), None).unwrap() else {
            panic!("buckets")
        };
        let mut all: Vec<(String, u64)> = b.iter().flatten().cloned().collect();
        all.sort();
        assert_eq!(all, vec![("a".into(), 2), ("b".into(), 2), ("c".into(), 1)]);
        for (i, bucket) in b.iter().enumerate() {
            assert!(bucket.iter().all(|(w, _)| word_bucket(w, 3) == i));
        }
    }
}
