//! Granule's key-range router: which proclet serves which range of keys, for every
//! library that spreads keys over proclets that split and merge — sharded structures
//! (`granule-sharded`: ranges of keys → memory proclets, split by bytes held) and
//! services (`granule-service`: ranges of 64-bit routing keys → compute proclets, split
//! by CPU used).
//!
//! # What it owns
//!
//! Pure logic, no I/O, each with its own unit tests:
//! - [`RangeTable`] (`table`): key ranges → targets, a range named by its first key
//!   (`None` = −∞); every key in exactly one range.
//! - [`ChangeLog`] and [`Replica`] (`log`): the authoritative table as an append-only log
//!   of [`Change`]s whose length is the version, compacted to about one change per range
//!   plus [`LOG_SLACK`] (amortized O(1) per change); a client's copy catches up from its
//!   version by the changes it missed, or by a snapshot when further behind than the log.
//! - [`Answer`], [`Outcome`] and [`Retry`] (`outcome`): what a target answers a routed
//!   call — *served*; *stale* (catch up and call again); *busy* (mid-split: wait);
//!   *not run* (retired, turned away unrun, or destroyed before the call: provably not
//!   run, so sent again); *moved* (follow) — or *failed* (returned, never sent again),
//!   and the retry steps that follow.
//! - [`Trigger`] (`trigger`): when to split a range and when to merge neighbours, asked
//!   per event (a shard after a write) or per reading of every range (a scaler's window);
//!   [`Bounds`] decides by bytes held, [`CpuLoad`] by CPU used (split above N cores per
//!   window, merge a pair whose summed load averaged over M windows is under X, with a
//!   cooldown after a split).
//!
//! The proclet side (`client`): [`MapState`], what a mapping proclet's state gives the
//! router (a [`ChangeLog`]; a `ChangeLog` is one), and [`Router`], the client handle that
//! caches the table, catches up with the mapping proclet, and routes a call by the retry
//! rules above (synchronously or as a future).
//!
//! # What it does not own
//!
//! The targets and their ranges' data: how a shard splits its keys, how a service's
//! worker retires, in which steps a split is made safe, and who may write the map (any
//! client of a sharded structure; only a service's scaler) belong to the libraries, which
//! wrap their calls so a target answers with an [`Answer`]. It touches no transport,
//! placement, migration or host readings: its proclets are ordinary `granule-runtime`
//! proclets.
//!
//! # Choices
//!
//! - One representation for both users: ranges start at `Option<K>`. A service's first
//!   range, which starts at routing key 0, starts at `None`.
//! - Versions are `u64` on the wire whatever the platform.
//! - The log never removes the first range, so a table that covers every key keeps
//!   doing so through any sequence of changes (a proptest checks it).
//! - A stale or unrun answer is retried at once the first time: a map change is
//!   recorded before any target turns calls away because of it, so the catch-up almost
//!   always has the news; further misses wait, doubling, up to the policy's cap.
//!
//! ```
//! use granule_router::{Change, ChangeLog, Replica};
//!
//! let mut log = ChangeLog::<u64, &str>::whole("a"); // version 1: one range, all keys
//! let mut client = Replica::new();
//! client.catch_up(0, log.since(0));
//! log.apply(Change::Set { lo: Some(100), target: "b" }); // split at 100
//! log.apply(Change::Remove { lo: Some(100) }); // merged back
//! let from = client.version();
//! client.catch_up(from, log.since(from));
//! assert_eq!(client.version(), 3);
//! assert_eq!(client.table().lookup(&500), Some((&None, &"a")));
//! ```
#![forbid(unsafe_code)]

mod client;
mod log;
mod outcome;
mod table;
mod trigger;

pub use client::{outcome_of, pause, MapState, RouteError, Router};
pub use log::{CatchUp, Change, ChangeLog, Replica, LOG_SLACK};
pub use outcome::{Answer, Outcome, Retry, RetryPolicy, Step, Unrun};
pub use table::RangeTable;
pub use trigger::{Action, Bounds, BoundsError, CpuLoad, Decision, Done, Limits, Reading, Trigger};
