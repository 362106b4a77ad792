//! Compute pushdown (Teleport, SIGMOD'22): a columnar table over sharded vectors,
//! vectorized operators whose per-row-group results merge, queries run pulled, pushed or
//! as a cost rule decides per shard, a TPC-H-style data generator, and the benchmark's
//! queries with an in-process reference executor.
//!
//! A query over a table spread over memory proclets runs either at the caller (*pull*:
//! the columns a stage needs travel to the caller, which computes) or next to the data
//! (*push*: the stage runs on the data's node and only its partial result travels).
//! Both run the very same function: every query is a per-row-group **scan stage**
//! ([`Stage`]: filter, then project / aggregate / group-by / join probe / shuffle) that
//! yields a mergeable [`Partial`], followed by a **final step** at the caller
//! ([`finalize`]). A stage is plain data (serde, sent with postcard), not a closure,
//! and [`Stage::run`] is a pure function of the stage and the columns it names
//! ([`Stage::columns`]), so the two paths agree by construction.
//!
//! Modules, pure logic first:
//!
//! - [`table`]: the layout (one chunked, columnar row-group layout), schemas, and the
//!   [`Columns`] view a stage reads, from a stored row group or from pulled columns.
//! - [`expr`]: expressions and predicates and their vectorized evaluation.
//! - [`ops`]: stages, partials and their merge, the join table.
//! - [`gen`]: the deterministic data generator and CSV output.
//! - [`queries`]: Q6, Q1, Q14, Q12 and the word count, finalization, [`run_local`].
//! - [`rule`]: the cost rule (pull or push per shard, from measured figures), pure.
//! - [`explain`]: the record of what was chosen and why, and its printed form.
//! - [`dist`]: the I/O half: [`dist::DistTable`] (a table in a sealed, hybrid
//!   `ShardedVec` of row groups) and [`dist::Executor`], which runs queries over them
//!   with pulled fetches and pushed calls (`granule-runtime`'s pushdown pool) and
//!   measures what the rule needs.
//!
//! This crate does not own the pushed-call executor (the runtime's `pushdown` module:
//! its pool, queue, budgets and CPU cap), the sharded vector, or any setting; it reads no
//! environment. Memory for join tables built where a stage is pushed is charged to the
//! pushed call's budget through [`JoinTable::build`]'s callback, so the node's budget
//! can refuse it.

pub mod dist;
pub mod error;
pub mod explain;
pub mod expr;
pub mod gen;
pub mod ops;
pub mod queries;
pub mod rule;
pub mod table;

pub use error::OpError;
pub use expr::{CmpOp, Expr, Pred, MAX_DEPTH};
pub use gen::{generate, row_groups, schema, write_csv, GenError, TableName};
/// What pushed code uses inside its call, from the runtime's pushdown pool (so
/// `granule::pushdown::reserve` is the name the README gives): take memory from the
/// call's budget ([`reserve`]), see where it runs ([`here`]), and a pool's load as a
/// caller asks it ([`load`]).
pub use granule_runtime::pushdown::{
    here, load, reserve, OverBudget, PoolFigures, PoolLoad, Reservation,
};
pub use ops::{Acc, Agg, JoinError, JoinTable, Output, Partial, Stage};
pub use queries::{
    build_join, finalize, run_local, scan_local, BuildSide, Finalize, Query, QueryResult, Value,
};
pub use table::{ColDef, ColType, Columns, RowGroup, Schema, Table, DEFAULT_ROWS_PER_GROUP};
