//! Granule's scavenging file system (after MemFSS): a FUSE mount whose files live in
//! memory — on the user's own nodes and, to extend its space, in small capped stores on
//! other tenants' ("victim") machines, the memory market's producer stores.
//!
//! What it owns, by module:
//! - [`placement`]: weighted two-level rendezvous hashing (a stripe's class, then its
//!   store in the class; replicas; the order a drained stripe moves along), free of I/O;
//! - [`meta`]: the namespace and each file's stripe table, and the POSIX rules of the
//!   namespace operations, free of I/O;
//! - [`metacopy`]: the metadata's second copy on another own node, kept current, and
//!   adopted by the next mount when the mount process dies;
//! - [`metasync`]: how far that copy has caught up (what an fsync waits on; the
//!   engine's, so the engine does not depend on the replicator);
//! - [`stores`]: own stores (a memory proclet per own node) and victim stores (RESP,
//!   with the lease's secret; stripes sealed as the market's consumer seals values);
//! - [`room`]: room promised to acknowledged writes whose stripes are not stored yet;
//! - [`writebehind`]: stripes written and not stored yet (buffers, stripes in flight,
//!   their room, per-file errors for the next fsync);
//! - [`readcache`]: stripes read, bounded in bytes, one fetch shared by their readers;
//! - [`engine`]: the namespace and layouts, write-behind's I/O, readahead, placement
//!   onto stores, replicas, draining and repairing;
//! - [`watch`]: probing the stores, so a dead one is noticed (and its stripes
//!   re-replicated) without I/O to it;
//! - [`fuse`]: the kernel's requests mapped onto the engine (through `fuser`);
//! - [`liveness`]: whether a recorded mount lives (a lock only a live mount holds);
//! - [`mount`]: one mount's life (own cluster, victims, leases, status door, unmount);
//! - [`status`]: what a mount reports (`granule fs status`, `/metrics`);
//! - [`panel`]: the same figures as a panel on the controller's dashboard.
//!
//! It is a layer on the runtime (proclets for own stores) and the market (stores,
//! leases, sealing): it must not touch `/proc` or `/sys` (the host crate does), nor the
//! runtime's internals.
#![forbid(unsafe_code)]

pub mod engine;
pub mod fuse;
pub mod liveness;
pub mod meta;
pub mod metacopy;
pub mod metasync;
pub mod mount;
pub mod panel;
pub mod placement;
pub mod readcache;
pub mod room;
pub mod status;
pub mod stores;
pub mod watch;
pub mod writebehind;

pub use mount::{
    discard, is_mounted, preflight, run, unmount, Discarded, MountError, MountOptions,
};
