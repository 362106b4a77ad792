//! Granule's wire format.
//!
//! This crate owns the bytes that travel between Granule processes (driver, nodes,
//! controller, tools): the frame layout, the protocol version, the message vocabulary and
//! the identifiers those messages carry. It does no I/O and knows nothing about sockets,
//! proclets or placement; `granule-transport` moves frames, the runtime and the controller
//! give them meaning.
//!
//! A frame is
//!
//! ```text
//!  u32 LE   body length (bytes after this field, at most the decoder's limit)
//!  u8       protocol version (PROTOCOL_VERSION)
//!  u8       frame kind (request / response / notify)
//!  u64 LE   request id (responses echo the id of their request; notifies carry 0)
//!  ...      message: a postcard-encoded [`Msg`], followed by an optional raw tail
//! ```
//!
//! The raw tail carries bulk payloads (a call's encoded argument, a proclet's encoded
//! state) so they are appended once, not copied into and out of a nested byte vector.
//!
//! Decoding never panics: every malformed, truncated, oversized or unknown input comes
//! back as a [`WireError`]. This is checked by property tests in this crate and by the
//! `frame_decode` fuzz target under `fuzz/`.
#![forbid(unsafe_code)]

pub mod blob;
mod frame;
pub mod market;
mod msg;
mod types;

pub use blob::Blob;
pub use frame::{
    begin_frame, decode_frame, encode_frame, finish_frame, finish_frame_leaving_out,
    peek_frame_len, Frame, FrameKind, WireError, DEFAULT_MAX_FRAME, HEADER_LEN, PROTOCOL_VERSION,
};
pub use msg::{Msg, RemoteError, ReplicaSet};
pub use types::{
    BinaryHash, CallMode, CgroupPaths, ChainId, ClusterEvent, CodeRef, Epoch, EventKind,
    GroupUsage, Kind, Location, MoveStats, NodeId, NodeInfo, NodeSpec, NodeState, Panel,
    PanelTable, ProcletId, ProcletUsage, Resource, Role, Usage,
};
