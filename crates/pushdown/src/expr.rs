//! Expressions ([`Expr`]) and predicates ([`Pred`]) as data, and their vectorized
//! evaluation over one row group.
//!
//! A predicate evaluates to a *selection vector*: the ascending row numbers that pass.
//! Each node runs one tight loop over its input rows (all rows for the first, only the
//! survivors for the rest of an `AND`), with the operator chosen once per node, not per
//! row, and a branch-free write of the selection (`out[n] = row; n += keep`). A
//! selective first conjunct therefore makes the whole filter cost about one pass over
//! its column. An expression evaluates to one `i64` per selected row (gathered, then
//! combined element-wise); arithmetic wraps on overflow rather than panicking on
//! hostile data (the queries here stay far from the limits).
//!
//! Expressions travel to data nodes, so decoding one is bounded: nesting deeper than
//! [`MAX_DEPTH`] is refused while decoding (postcard has no depth limit of its own, and
//! a deep enough nesting would overflow the decoder's stack).

use crate::table::Columns;
use crate::OpError;
use serde::{Deserialize, Deserializer, Serialize, Serializer};
use std::borrow::Cow;
use std::cell::Cell;

/// Deepest nesting of expressions and predicates accepted (decoded or evaluated).
pub const MAX_DEPTH: usize = 64;

/// A comparison operator.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Serialize, Deserialize)]
pub enum CmpOp {
    /// `<`
    Lt,
    /// `<=`
    Le,
    /// `>`
    Gt,
    /// `>=`
    Ge,
    /// `=`
    Eq,
    /// `<>`
    Ne,
}

/// A value per row. Column numbers are the table's (not the stage's).
#[derive(Clone, Debug, PartialEq, Eq, Serialize, Deserialize)]
#[serde(remote = "Self")]
pub enum Expr {
    /// An `I64` column's value.
    Col(usize),
    /// A `Dict` column's code, as an integer (for grouping by it).
    Code(usize),
    /// A constant.
    Const(i64),
    /// Sum (wrapping).
    Add(Box<Expr>, Box<Expr>),
    /// Difference (wrapping).
    Sub(Box<Expr>, Box<Expr>),
    /// Product (wrapping).
    Mul(Box<Expr>, Box<Expr>),
    /// `CASE WHEN pred THEN a ELSE b END`.
    Case(Box<Pred>, Box<Expr>, Box<Expr>),
    /// The payload of the join-table entry the row matched (only after a probe).
    Joined,
}

/// A condition on a row's columns.
#[derive(Clone, Debug, PartialEq, Eq, Serialize, Deserialize)]
#[serde(remote = "Self")]
pub enum Pred {
    /// Every row.
    True,
    /// `I64` column `op` constant.
    Cmp(usize, CmpOp, i64),
    /// `I64` column `op` `I64` column.
    CmpCols(usize, CmpOp, usize),
    /// `lo <= column <= hi` (both inclusive) on an `I64` column.
    Between(usize, i64, i64),
    /// A `Dict` column's code is one of these (`IN (...)`, or `LIKE` resolved against
    /// the dictionary at plan time).
    InSet(usize, Vec<u8>),
    /// All of them (evaluated in order, each on the previous ones' survivors).
    And(Vec<Pred>),
    /// Any of them.
    Or(Vec<Pred>),
    /// Not this one.
    Not(Box<Pred>),
}

thread_local! {
    /// How deep the decoder is in nested expressions and predicates on this thread.
    static DEPTH: Cell<usize> = const { Cell::new(0) };
}

/// Runs `f` one nesting level deeper, refusing past [`MAX_DEPTH`].
fn nested<'de, D: Deserializer<'de>, T>(
    d: D,
    f: impl FnOnce(D) -> Result<T, D::Error>,
) -> Result<T, D::Error> {
    struct Up;
    impl Drop for Up {
        fn drop(&mut self) {
            DEPTH.with(|c| c.set(c.get().saturating_sub(1)));
        }
    }
    let depth = DEPTH.with(|c| {
        let d = c.get() + 1;
        c.set(d);
        d
    });
    let _up = Up;
    if depth > MAX_DEPTH {
        return Err(serde::de::Error::custom(format!(
            "expression nested deeper than {MAX_DEPTH}"
        )));
    }
    f(d)
}

impl Serialize for Expr {
    fn serialize<S: Serializer>(&self, s: S) -> Result<S::Ok, S::Error> {
        Expr::serialize(self, s)
    }
}

impl<'de> Deserialize<'de> for Expr {
    fn deserialize<D: Deserializer<'de>>(d: D) -> Result<Expr, D::Error> {
        nested(d, Expr::deserialize)
    }
}

impl Serialize for Pred {
    fn serialize<S: Serializer>(&self, s: S) -> Result<S::Ok, S::Error> {
        Pred::serialize(self, s)
    }
}

impl<'de> Deserialize<'de> for Pred {
    fn deserialize<D: Deserializer<'de>>(d: D) -> Result<Pred, D::Error> {
        nested(d, Pred::deserialize)
    }
}

/// How a stage reads a column.
#[derive(Clone, Copy, Debug, PartialEq, Eq, PartialOrd, Ord)]
pub(crate) enum Kind {
    I64,
    Dict,
    Text,
}

/// Shorthands for building expressions.
impl Expr {
    /// `a + b`
    pub fn plus(a: Expr, b: Expr) -> Expr {
        Expr::Add(Box::new(a), Box::new(b))
    }
    /// `a - b`
    pub fn minus(a: Expr, b: Expr) -> Expr {
        Expr::Sub(Box::new(a), Box::new(b))
    }
    /// `a * b`
    pub fn times(a: Expr, b: Expr) -> Expr {
        Expr::Mul(Box::new(a), Box::new(b))
    }
    /// `CASE WHEN p THEN a ELSE b END`
    pub fn case(p: Pred, a: Expr, b: Expr) -> Expr {
        Expr::Case(Box::new(p), Box::new(a), Box::new(b))
    }

    /// Checks nesting (at most `left` more levels) without recursing past it.
    pub(crate) fn check_depth(&self, left: usize) -> Result<(), OpError> {
        let left = left.checked_sub(1).ok_or(OpError::TooDeep(MAX_DEPTH))?;
        match self {
            Expr::Col(_) | Expr::Code(_) | Expr::Const(_) | Expr::Joined => Ok(()),
            Expr::Add(a, b) | Expr::Sub(a, b) | Expr::Mul(a, b) => {
                a.check_depth(left)?;
                b.check_depth(left)
            }
            Expr::Case(p, a, b) => {
                p.check_depth(left)?;
                a.check_depth(left)?;
                b.check_depth(left)
            }
        }
    }

    /// Adds the columns this reads, with how, to `out`.
    pub(crate) fn uses(&self, out: &mut Vec<(usize, Kind)>) {
        match self {
            Expr::Col(c) => out.push((*c, Kind::I64)),
            Expr::Code(c) => out.push((*c, Kind::Dict)),
            Expr::Const(_) | Expr::Joined => {}
            Expr::Add(a, b) | Expr::Sub(a, b) | Expr::Mul(a, b) => {
                a.uses(out);
                b.uses(out);
            }
            Expr::Case(p, a, b) => {
                p.uses(out);
                a.uses(out);
                b.uses(out);
            }
        }
    }

    /// Whether this has at most `n` nodes (counting no further than that).
    fn nodes_at_most(&self, n: usize) -> bool {
        fn count(e: &Expr, left: &mut usize) -> bool {
            if *left == 0 {
                return false;
            }
            *left -= 1;
            match e {
                Expr::Col(_) | Expr::Code(_) | Expr::Const(_) | Expr::Joined => true,
                Expr::Add(a, b) | Expr::Sub(a, b) | Expr::Mul(a, b) => {
                    count(a, left) && count(b, left)
                }
                // A case's predicate is not counted node by node: never shared.
                Expr::Case(..) => false,
            }
        }
        let mut left = n;
        count(self, &mut left)
    }

    /// Whether this reads the join payload.
    pub(crate) fn reads_joined(&self) -> bool {
        match self {
            Expr::Joined => true,
            Expr::Col(_) | Expr::Code(_) | Expr::Const(_) => false,
            Expr::Add(a, b) | Expr::Sub(a, b) | Expr::Mul(a, b) => {
                a.reads_joined() || b.reads_joined()
            }
            Expr::Case(_, a, b) => a.reads_joined() || b.reads_joined(),
        }
    }

    /// One value per row of `sel`; `joined[i]` is row `sel[i]`'s join payload.
    pub(crate) fn eval(
        &self,
        f: &Frame<'_>,
        sel: &[u32],
        joined: Option<&[i64]>,
    ) -> Result<Vec<i64>, OpError> {
        Ok(match self {
            Expr::Col(c) => {
                let v = f.i64s(*c)?;
                sel.iter().map(|&i| v[i as usize]).collect()
            }
            Expr::Code(c) => {
                let v = f.codes(*c)?;
                sel.iter().map(|&i| v[i as usize] as i64).collect()
            }
            Expr::Const(k) => vec![*k; sel.len()],
            Expr::Joined => joined
                .ok_or_else(|| OpError::Join("the joined payload read without a probe".into()))?
                .to_vec(),
            Expr::Add(a, b) => zip(a, b, f, sel, joined, i64::wrapping_add)?,
            Expr::Sub(a, b) => zip(a, b, f, sel, joined, i64::wrapping_sub)?,
            Expr::Mul(a, b) => zip(a, b, f, sel, joined, i64::wrapping_mul)?,
            Expr::Case(p, a, b) => {
                let hit = p.select(f, Some(sel))?;
                let mut out = b.eval(f, sel, joined)?;
                if !hit.is_empty() {
                    let then = a.eval(f, sel, joined)?;
                    // `hit` is an ascending subsequence of `sel`: walk both once.
                    let mut k = 0;
                    for (i, &row) in sel.iter().enumerate() {
                        if k < hit.len() && hit[k] == row {
                            out[i] = then[i];
                            k += 1;
                        }
                    }
                }
                out
            }
        })
    }
}

fn zip(
    a: &Expr,
    b: &Expr,
    f: &Frame<'_>,
    sel: &[u32],
    joined: Option<&[i64]>,
    op: fn(i64, i64) -> i64,
) -> Result<Vec<i64>, OpError> {
    // A constant operand is applied directly, saving a vector and a pass.
    match (a, b) {
        (_, Expr::Const(k)) => {
            let mut v = a.eval(f, sel, joined)?;
            let k = *k;
            v.iter_mut().for_each(|x| *x = op(*x, k));
            Ok(v)
        }
        (Expr::Const(k), _) => {
            let mut v = b.eval(f, sel, joined)?;
            let k = *k;
            v.iter_mut().for_each(|x| *x = op(k, *x));
            Ok(v)
        }
        _ => {
            let mut v = a.eval(f, sel, joined)?;
            let w = b.eval(f, sel, joined)?;
            v.iter_mut().zip(&w).for_each(|(x, &y)| *x = op(*x, y));
            Ok(v)
        }
    }
}

/// Shorthands for building predicates.
impl Pred {
    /// `a AND b AND ...`
    pub fn and(ps: impl IntoIterator<Item = Pred>) -> Pred {
        Pred::And(ps.into_iter().collect())
    }
    /// `NOT p`
    pub fn negate(p: Pred) -> Pred {
        Pred::Not(Box::new(p))
    }

    /// Checks nesting (at most `left` more levels) without recursing past it.
    pub(crate) fn check_depth(&self, left: usize) -> Result<(), OpError> {
        let left = left.checked_sub(1).ok_or(OpError::TooDeep(MAX_DEPTH))?;
        match self {
            Pred::And(ps) | Pred::Or(ps) => ps.iter().try_for_each(|p| p.check_depth(left)),
            Pred::Not(p) => p.check_depth(left),
            _ => Ok(()),
        }
    }

    /// Adds the columns this reads, with how, to `out`.
    pub(crate) fn uses(&self, out: &mut Vec<(usize, Kind)>) {
        match self {
            Pred::True => {}
            Pred::Cmp(c, _, _) | Pred::Between(c, _, _) => out.push((*c, Kind::I64)),
            Pred::CmpCols(a, _, b) => {
                out.push((*a, Kind::I64));
                out.push((*b, Kind::I64));
            }
            Pred::InSet(c, _) => out.push((*c, Kind::Dict)),
            Pred::And(ps) | Pred::Or(ps) => ps.iter().for_each(|p| p.uses(out)),
            Pred::Not(p) => p.uses(out),
        }
    }

    /// The rows of `input` (all rows when `None`) that satisfy this, ascending.
    pub(crate) fn select(&self, f: &Frame<'_>, input: Option<&[u32]>) -> Result<Vec<u32>, OpError> {
        Ok(match self {
            Pred::True => match input {
                Some(s) => s.to_vec(),
                None => (0..f.rows as u32).collect(),
            },
            Pred::Cmp(c, op, k) => {
                let v = f.i64s(*c)?;
                let k = *k;
                match op {
                    CmpOp::Lt => keep(v, input, |x| x < k),
                    CmpOp::Le => keep(v, input, |x| x <= k),
                    CmpOp::Gt => keep(v, input, |x| x > k),
                    CmpOp::Ge => keep(v, input, |x| x >= k),
                    CmpOp::Eq => keep(v, input, |x| x == k),
                    CmpOp::Ne => keep(v, input, |x| x != k),
                }
            }
            Pred::CmpCols(a, op, b) => {
                let (a, b) = (f.i64s(*a)?, f.i64s(*b)?);
                match op {
                    CmpOp::Lt => keep2(a, b, input, |x, y| x < y),
                    CmpOp::Le => keep2(a, b, input, |x, y| x <= y),
                    CmpOp::Gt => keep2(a, b, input, |x, y| x > y),
                    CmpOp::Ge => keep2(a, b, input, |x, y| x >= y),
                    CmpOp::Eq => keep2(a, b, input, |x, y| x == y),
                    CmpOp::Ne => keep2(a, b, input, |x, y| x != y),
                }
            }
            Pred::Between(c, lo, hi) => {
                let v = f.i64s(*c)?;
                if lo > hi {
                    Vec::new()
                } else {
                    // One unsigned comparison: x - lo wraps past the width when x < lo.
                    let (lo, width) = (*lo, hi.wrapping_sub(*lo) as u64);
                    keep(v, input, |x| (x.wrapping_sub(lo) as u64) <= width)
                }
            }
            Pred::InSet(c, codes) => {
                let v = f.codes(*c)?;
                let mut set = [false; 256];
                for &k in codes {
                    set[k as usize] = true;
                }
                keep(v, input, |x| set[x as usize])
            }
            Pred::And(ps) => {
                let mut cur: Option<Vec<u32>> = None;
                for p in ps {
                    let next = p.select(f, cur.as_deref().or(input))?;
                    let done = next.is_empty();
                    cur = Some(next);
                    if done {
                        break;
                    }
                }
                match cur {
                    Some(c) => c,
                    None => Pred::True.select(f, input)?,
                }
            }
            Pred::Or(ps) => {
                let mut acc: Vec<u32> = Vec::new();
                for p in ps {
                    let s = p.select(f, input)?;
                    acc = union(&acc, &s);
                }
                acc
            }
            Pred::Not(p) => {
                let hit = p.select(f, input)?;
                let all = Pred::True.select(f, input)?;
                difference(&all, &hit)
            }
        })
    }
}

/// The rows of `input` (all when `None`) whose value passes `pass`.
#[inline]
fn keep<T: Copy>(vals: &[T], input: Option<&[u32]>, pass: impl Fn(T) -> bool) -> Vec<u32> {
    match input {
        None => {
            let mut out = vec![0u32; vals.len()];
            let mut n = 0;
            for (i, &x) in vals.iter().enumerate() {
                out[n] = i as u32;
                n += pass(x) as usize;
            }
            out.truncate(n);
            out
        }
        Some(sel) => {
            let mut out = vec![0u32; sel.len()];
            let mut n = 0;
            for &i in sel {
                out[n] = i;
                n += pass(vals[i as usize]) as usize;
            }
            out.truncate(n);
            out
        }
    }
}

/// [`keep`] over two columns.
#[inline]
fn keep2(a: &[i64], b: &[i64], input: Option<&[u32]>, pass: impl Fn(i64, i64) -> bool) -> Vec<u32> {
    match input {
        None => {
            let mut out = vec![0u32; a.len()];
            let mut n = 0;
            for (i, (&x, &y)) in a.iter().zip(b).enumerate() {
                out[n] = i as u32;
                n += pass(x, y) as usize;
            }
            out.truncate(n);
            out
        }
        Some(sel) => {
            let mut out = vec![0u32; sel.len()];
            let mut n = 0;
            for &i in sel {
                out[n] = i;
                n += pass(a[i as usize], b[i as usize]) as usize;
            }
            out.truncate(n);
            out
        }
    }
}

/// The ascending union of two ascending lists.
fn union(a: &[u32], b: &[u32]) -> Vec<u32> {
    let mut out = Vec::with_capacity(a.len() + b.len());
    let (mut i, mut j) = (0, 0);
    while i < a.len() && j < b.len() {
        match a[i].cmp(&b[j]) {
            std::cmp::Ordering::Less => {
                out.push(a[i]);
                i += 1;
            }
            std::cmp::Ordering::Greater => {
                out.push(b[j]);
                j += 1;
            }
            std::cmp::Ordering::Equal => {
                out.push(a[i]);
                i += 1;
                j += 1;
            }
        }
    }
    out.extend_from_slice(&a[i..]);
    out.extend_from_slice(&b[j..]);
    out
}

/// The ascending list `a` without the elements of its ascending subsequence `b`.
fn difference(a: &[u32], b: &[u32]) -> Vec<u32> {
    let mut out = Vec::with_capacity(a.len().saturating_sub(b.len()));
    let mut j = 0;
    for &x in a {
        if j < b.len() && b[j] == x {
            j += 1;
        } else {
            out.push(x);
        }
    }
    out
}

/// Evaluates expressions over one batch of rows, each distinct small (sub)expression
/// once (`price × (100 − discount)` is computed once for Q1's two sums that use it), and
/// keeps its vectors' buffers from batch to batch.
///
/// Only expressions of at most [`Evaluator::SHARED_NODES`] nodes are looked up, among at
/// most [`Evaluator::SHARED_MAX`] values, so a hostile stage with a huge expression costs
/// a bounded amount of comparison per node it evaluates.
pub(crate) struct Evaluator<'e> {
    /// This batch's values: (expression, one value per selected row).
    done: Vec<(&'e Expr, Vec<i64>)>,
    /// Buffers of earlier batches, for reuse.
    free: Vec<Vec<i64>>,
}

impl<'e> Evaluator<'e> {
    /// Largest expression (in nodes) whose value is shared.
    const SHARED_NODES: usize = 16;
    /// Most values kept per batch for sharing.
    const SHARED_MAX: usize = 64;

    pub(crate) fn new() -> Evaluator<'e> {
        Evaluator {
            done: Vec::new(),
            free: Vec::new(),
        }
    }

    /// Forgets the values of the batch (or selection) before, keeping their buffers.
    pub(crate) fn reset(&mut self) {
        self.free.extend(self.done.drain(..).map(|(_, v)| v));
    }

    /// The values [`Evaluator::eval`] returned the index of.
    pub(crate) fn values(&self, at: usize) -> &[i64] {
        &self.done[at].1
    }

    fn buf(&mut self) -> Vec<i64> {
        let mut v = self.free.pop().unwrap_or_default();
        v.clear();
        v
    }

    /// Evaluates `e` over the rows `sel` of `f` (as [`Expr::eval`] does) unless this
    /// batch already has it; returns where its values are ([`Evaluator::values`]).
    pub(crate) fn eval(
        &mut self,
        e: &'e Expr,
        f: &Frame<'_>,
        sel: &[u32],
        joined: Option<&[i64]>,
    ) -> Result<usize, OpError> {
        let shared = e.nodes_at_most(Self::SHARED_NODES);
        if shared {
            // Only the first values are searched; later ones are found by index only.
            if let Some(at) = self
                .done
                .iter()
                .take(Self::SHARED_MAX)
                .position(|(d, _)| std::ptr::eq(*d, e) || *d == e)
            {
                return Ok(at);
            }
        }
        let mut out = self.buf();
        match e {
            Expr::Col(c) => {
                let v = f.i64s(*c)?;
                out.extend(sel.iter().map(|&i| v[i as usize]));
            }
            Expr::Code(c) => {
                let v = f.codes(*c)?;
                out.extend(sel.iter().map(|&i| v[i as usize] as i64));
            }
            Expr::Const(k) => out.resize(sel.len(), *k),
            Expr::Joined => {
                out.extend_from_slice(joined.ok_or_else(|| {
                    OpError::Join("the joined payload read without a probe".into())
                })?)
            }
            Expr::Add(a, b) => self.zip(a, b, f, sel, joined, &mut out, BinOp::Add)?,
            Expr::Sub(a, b) => self.zip(a, b, f, sel, joined, &mut out, BinOp::Sub)?,
            Expr::Mul(a, b) => self.zip(a, b, f, sel, joined, &mut out, BinOp::Mul)?,
            Expr::Case(..) => {
                self.free.push(out);
                out = e.eval(f, sel, joined)?;
            }
        }
        self.done.push((e, out));
        Ok(self.done.len() - 1)
    }

    /// `a op b`, with `op` chosen once here rather than called through a pointer per row.
    #[allow(clippy::too_many_arguments)]
    fn zip(
        &mut self,
        a: &'e Expr,
        b: &'e Expr,
        f: &Frame<'_>,
        sel: &[u32],
        joined: Option<&[i64]>,
        out: &mut Vec<i64>,
        op: BinOp,
    ) -> Result<(), OpError> {
        #[inline(always)]
        fn each(out: &mut Vec<i64>, x: &[i64], y: &[i64], op: impl Fn(i64, i64) -> i64) {
            out.extend(x.iter().zip(y).map(|(&x, &y)| op(x, y)));
        }
        #[inline(always)]
        fn with_const(out: &mut Vec<i64>, x: &[i64], op: impl Fn(i64) -> i64) {
            out.extend(x.iter().map(|&x| op(x)));
        }
        // A constant operand is applied directly, saving a vector.
        match (a, b) {
            (_, Expr::Const(k)) => {
                let x = self.eval(a, f, sel, joined)?;
                let (x, k) = (self.values(x), *k);
                match op {
                    BinOp::Add => with_const(out, x, |x| x.wrapping_add(k)),
                    BinOp::Sub => with_const(out, x, |x| x.wrapping_sub(k)),
                    BinOp::Mul => with_const(out, x, |x| x.wrapping_mul(k)),
                }
            }
            (Expr::Const(k), _) => {
                let y = self.eval(b, f, sel, joined)?;
                let (y, k) = (self.values(y), *k);
                match op {
                    BinOp::Add => with_const(out, y, |y| k.wrapping_add(y)),
                    BinOp::Sub => with_const(out, y, |y| k.wrapping_sub(y)),
                    BinOp::Mul => with_const(out, y, |y| k.wrapping_mul(y)),
                }
            }
            _ => {
                let x = self.eval(a, f, sel, joined)?;
                let y = self.eval(b, f, sel, joined)?;
                let (x, y) = (self.values(x), self.values(y));
                match op {
                    BinOp::Add => each(out, x, y, i64::wrapping_add),
                    BinOp::Sub => each(out, x, y, i64::wrapping_sub),
                    BinOp::Mul => each(out, x, y, i64::wrapping_mul),
                }
            }
        }
        Ok(())
    }
}

/// An arithmetic operator of [`Evaluator::zip`].
#[derive(Clone, Copy)]
enum BinOp {
    Add,
    Sub,
    Mul,
}

/// A row group's columns resolved once for a stage: `I64` columns as aligned slices,
/// `Dict` columns as code slices, checked against the row count. Looked up per
/// expression node, not per row.
pub(crate) struct Frame<'a> {
    pub(crate) rows: usize,
    i64s: Vec<(usize, Cow<'a, [i64]>)>,
    codes: Vec<(usize, &'a [u8])>,
}

impl<'a> Frame<'a> {
    /// Resolves the columns `uses` names (each with one kind) from `cols`.
    pub(crate) fn new(cols: &Columns<'a>, uses: &[(usize, Kind)]) -> Result<Frame<'a>, OpError> {
        let mut f = Frame {
            rows: cols.rows(),
            i64s: Vec::new(),
            codes: Vec::new(),
        };
        for &(c, k) in uses {
            match k {
                Kind::I64 if f.i64s.iter().all(|&(i, _)| i != c) => f.i64s.push((c, cols.i64s(c)?)),
                Kind::Dict if f.codes.iter().all(|&(i, _)| i != c) => {
                    f.codes.push((c, cols.codes(c)?))
                }
                _ => {}
            }
        }
        Ok(f)
    }

    /// Rows `start..start + len` of this frame (within its rows).
    pub(crate) fn window(&self, start: usize, len: usize) -> Frame<'_> {
        let end = start + len;
        Frame {
            rows: len,
            i64s: self
                .i64s
                .iter()
                .map(|(c, v)| (*c, Cow::Borrowed(&v[start..end])))
                .collect(),
            codes: self
                .codes
                .iter()
                .map(|&(c, v)| (c, &v[start..end]))
                .collect(),
        }
    }

    pub(crate) fn i64s(&self, c: usize) -> Result<&[i64], OpError> {
        self.i64s
            .iter()
            .find(|(i, _)| *i == c)
            .map(|(_, v)| &v[..])
            .ok_or(OpError::ColumnMissing(c))
    }

    pub(crate) fn codes(&self, c: usize) -> Result<&'a [u8], OpError> {
        self.codes
            .iter()
            .find(|(i, _)| *i == c)
            .map(|&(_, v)| v)
            .ok_or(OpError::ColumnMissing(c))
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::table::{i64_blob, RowGroup};
    use granule_runtime::Blob;

    /// Rows 0..n: col 0 = i, col 1 = i % 7, col 2 = code i % 5, col 3 = 10 - i.
    fn group(n: i64) -> RowGroup {
        RowGroup {
            rows: n as u32,
            cols: vec![
                i64_blob((0..n).collect()),
                i64_blob((0..n).map(|i| i % 7).collect()),
                Blob::from((0..n).map(|i| (i % 5) as u8).collect::<Vec<u8>>()),
                i64_blob((0..n).map(|i| 10 - i).collect()),
            ],
        }
    }

    fn select(p: &Pred, rg: &RowGroup) -> Vec<u32> {
        let mut uses = Vec::new();
        p.uses(&mut uses);
        let cols = Columns::of_group(rg);
        let f = Frame::new(&cols, &uses).unwrap();
        p.select(&f, None).unwrap()
    }

    /// The same predicate, one row at a time: what `select` must agree with.
    fn naive(p: &Pred, row: i64) -> bool {
        let col = |c: usize| match c {
            0 => row,
            1 => row % 7,
            3 => 10 - row,
            _ => unreachable!(),
        };
        let cmp = |x: i64, op: CmpOp, y: i64| match op {
            CmpOp::Lt => x < y,
            CmpOp::Le => x <= y,
            CmpOp::Gt => x > y,
            CmpOp::Ge => x >= y,
            CmpOp::Eq => x == y,
            CmpOp::Ne => x != y,
        };
        match p {
            Pred::True => true,
            Pred::Cmp(c, op, k) => cmp(col(*c), *op, *k),
            Pred::CmpCols(a, op, b) => cmp(col(*a), *op, col(*b)),
            Pred::Between(c, lo, hi) => *lo <= col(*c) && col(*c) <= *hi,
            Pred::InSet(_, codes) => codes.contains(&((row % 5) as u8)),
            Pred::And(ps) => ps.iter().all(|p| naive(p, row)),
            Pred::Or(ps) => ps.iter().any(|p| naive(p, row)),
            Pred::Not(p) => !naive(p, row),
        }
    }

    #[test]
    fn predicates_select_what_a_row_at_a_time_check_selects() {
        let rg = group(100);
        let preds = vec![
            Pred::Cmp(0, CmpOp::Lt, 30),
            Pred::Cmp(1, CmpOp::Eq, 3),
            Pred::Cmp(1, CmpOp::Ne, 3),
            Pred::Cmp(0, CmpOp::Ge, 95),
            Pred::Cmp(0, CmpOp::Gt, 95),
            Pred::Cmp(0, CmpOp::Le, 0),
            Pred::CmpCols(1, CmpOp::Lt, 3),
            Pred::CmpCols(0, CmpOp::Ge, 3),
            Pred::Between(0, 10, 20),
            Pred::Between(0, 20, 10),
            Pred::Between(3, i64::MIN, -50),
            Pred::InSet(2, vec![1, 4]),
            Pred::and([
                Pred::Between(0, 5, 80),
                Pred::InSet(2, vec![0, 2]),
                Pred::Cmp(1, CmpOp::Gt, 2),
            ]),
            Pred::and([Pred::Cmp(0, CmpOp::Lt, 0), Pred::Cmp(1, CmpOp::Eq, 1)]),
            Pred::Or(vec![
                Pred::Cmp(0, CmpOp::Lt, 10),
                Pred::Cmp(1, CmpOp::Eq, 6),
                Pred::Between(0, 5, 15),
            ]),
            Pred::negate(Pred::Or(vec![
                Pred::InSet(2, vec![3]),
                Pred::Cmp(0, CmpOp::Gt, 50),
            ])),
            Pred::And(vec![]),
            Pred::Or(vec![]),
        ];
        for p in &preds {
            let want: Vec<u32> = (0..100)
                .filter(|&r| naive(p, r))
                .map(|r| r as u32)
                .collect();
            assert_eq!(select(p, &rg), want, "{p:?}");
        }
    }

    #[test]
    fn expressions_compute_per_selected_row() {
        let rg = group(50);
        let e = Expr::plus(
            Expr::times(Expr::Col(0), Expr::Col(1)),
            Expr::case(
                Pred::InSet(2, vec![0]),
                Expr::Const(1000),
                Expr::minus(Expr::Const(5), Expr::Code(2)),
            ),
        );
        let mut uses = Vec::new();
        e.uses(&mut uses);
        let cols = Columns::of_group(&rg);
        let f = Frame::new(&cols, &uses).unwrap();
        let sel: Vec<u32> = (0..50).filter(|i| i % 3 == 1).collect();
        let got = e.eval(&f, &sel, None).unwrap();
        let want: Vec<i64> = sel
            .iter()
            .map(|&r| {
                let r = r as i64;
                r * (r % 7) + if r % 5 == 0 { 1000 } else { 5 - r % 5 }
            })
            .collect();
        assert_eq!(got, want);
        assert!(Expr::Joined.eval(&f, &sel, None).is_err());
    }

    #[test]
    fn deep_nesting_is_refused_when_decoding() {
        let mut p = Pred::True;
        for _ in 0..(MAX_DEPTH + 5) {
            p = Pred::negate(p);
        }
        let bytes = postcard::to_allocvec(&p).unwrap();
        assert!(postcard::from_bytes::<Pred>(&bytes).is_err());
        assert!(p.check_depth(MAX_DEPTH).is_err());
        let mut ok = Pred::True;
        for _ in 0..10 {
            ok = Pred::negate(ok);
        }
        let bytes = postcard::to_allocvec(&ok).unwrap();
        assert_eq!(postcard::from_bytes::<Pred>(&bytes).unwrap(), ok);
        // A decoding error leaves the depth at zero for the next decode.
        assert_eq!(DEPTH.with(|c| c.get()), 0);
    }
}
