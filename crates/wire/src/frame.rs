//! Frame layout: encoding and panic-free decoding.

use crate::msg::Msg;
use bytes::Bytes;
use thiserror::Error;

/// Version byte every frame carries. A peer speaking another version is refused with
/// [`WireError::BadVersion`] before anything else in the frame is looked at.
pub const PROTOCOL_VERSION: u8 = 1;

/// Bytes before the message: length (4), version (1), kind (1), request id (8).
pub const HEADER_LEN: usize = 14;

/// Default upper bound on a frame's total length. Bigger payloads (large proclet states)
/// must be split by the sender.
pub const DEFAULT_MAX_FRAME: usize = 256 << 20;

/// What a frame is for.
#[derive(Clone, Copy, PartialEq, Eq, Debug, Hash)]
pub enum FrameKind {
    /// Expects exactly one response with the same id.
    Request = 1,
    /// Answers the request with the same id.
    Response = 2,
    /// One-way message; no response.
    Notify = 3,
}

impl FrameKind {
    fn from_byte(b: u8) -> Result<Self, WireError> {
        match b {
            1 => Ok(FrameKind::Request),
            2 => Ok(FrameKind::Response),
            3 => Ok(FrameKind::Notify),
            other => Err(WireError::BadKind(other)),
        }
    }
}

/// A decoded frame.
#[derive(Clone, PartialEq, Debug)]
pub struct Frame {
    pub kind: FrameKind,
    pub id: u64,
    pub msg: Msg,
    /// Raw bytes after the message (argument, state or return value), possibly empty.
    pub tail: Bytes,
}

/// Everything that can be wrong with bytes claiming to be a frame.
#[derive(Debug, Error, Clone, PartialEq, Eq)]
pub enum WireError {
    #[error("frame too short: {got} bytes, a frame needs at least {HEADER_LEN}")]
    TooShort { got: usize },
    #[error("frame of {len} bytes exceeds the limit of {max} bytes")]
    TooLarge { len: usize, max: usize },
    #[error("frame length field says {declared} bytes but {actual} were given")]
    LengthMismatch { declared: usize, actual: usize },
    #[error("protocol version {got} is not supported (this build speaks version {PROTOCOL_VERSION}); run the same Granule build on every machine")]
    BadVersion { got: u8 },
    #[error("unknown frame kind {0}")]
    BadKind(u8),
    #[error("malformed message: {0}")]
    Message(String),
    #[error("cannot encode message: {0}")]
    Encode(String),
}

/// Total length (including the 4-byte length field) of the frame at the start of `buf`,
/// or `None` if fewer than 4 bytes are available yet.
pub fn peek_frame_len(buf: &[u8], max: usize) -> Result<Option<usize>, WireError> {
    let Some(len_bytes) = buf.get(..4) else {
        return Ok(None);
    };
    let mut le = [0u8; 4];
    le.copy_from_slice(len_bytes);
    let body = u32::from_le_bytes(le) as usize;
    let total = body + 4;
    if total > max {
        return Err(WireError::TooLarge { len: total, max });
    }
    if total < HEADER_LEN {
        return Err(WireError::TooShort { got: total });
    }
    Ok(Some(total))
}

/// Encode a frame whose tail is given as bytes.
pub fn encode_frame(
    kind: FrameKind,
    id: u64,
    msg: &Msg,
    tail: &[u8],
) -> Result<Vec<u8>, WireError> {
    let mut buf = begin_frame(kind, id, msg, tail.len())?;
    buf.extend_from_slice(tail);
    finish_frame(&mut buf)?;
    Ok(buf)
}

/// Start a frame whose tail the caller appends afterwards; finish it with
/// [`finish_frame`] (which writes the length field).
pub fn begin_frame(
    kind: FrameKind,
    id: u64,
    msg: &Msg,
    tail_hint: usize,
) -> Result<Vec<u8>, WireError> {
    let mut buf = Vec::with_capacity(HEADER_LEN + 32 + tail_hint);
    buf.extend_from_slice(&[0, 0, 0, 0]);
    buf.push(PROTOCOL_VERSION);
    buf.push(kind as u8);
    buf.extend_from_slice(&id.to_le_bytes());
    postcard::to_extend(msg, buf).map_err(|e| WireError::Encode(e.to_string()))
}

/// Write the length field of a frame started with [`begin_frame`].
pub fn finish_frame(buf: &mut [u8]) -> Result<(), WireError> {
    if buf.len() < HEADER_LEN {
        return Err(WireError::TooShort { got: buf.len() });
    }
    let body = u32::try_from(buf.len() - 4).map_err(|_| WireError::TooLarge {
        len: buf.len(),
        max: u32::MAX as usize,
    })?;
    buf[..4].copy_from_slice(&body.to_le_bytes());
    Ok(())
}

/// Write the length field of a frame started with [`begin_frame`] whose buffer leaves
/// out `extra` bytes the sender writes separately (see
/// [`crate::blob::encode_leaving_blobs`]).
pub fn finish_frame_leaving_out(buf: &mut [u8], extra: usize) -> Result<(), WireError> {
    if buf.len() < HEADER_LEN {
        return Err(WireError::TooShort { got: buf.len() });
    }
    let total = buf.len() + extra;
    let body = u32::try_from(total - 4).map_err(|_| WireError::TooLarge {
        len: total,
        max: u32::MAX as usize,
    })?;
    buf[..4].copy_from_slice(&body.to_le_bytes());
    Ok(())
}

/// Decode exactly one frame (length field included). Never panics.
pub fn decode_frame(buf: Bytes, max: usize) -> Result<Frame, WireError> {
    let total = match peek_frame_len(&buf, max)? {
        Some(t) => t,
        None => return Err(WireError::TooShort { got: buf.len() }),
    };
    if total != buf.len() {
        return Err(WireError::LengthMismatch {
            declared: total,
            actual: buf.len(),
        });
    }
    // peek_frame_len guarantees total >= HEADER_LEN, so these indexes exist.
    let version = buf[4];
    if version != PROTOCOL_VERSION {
        return Err(WireError::BadVersion { got: version });
    }
    let kind = FrameKind::from_byte(buf[5])?;
    let mut id_le = [0u8; 8];
    id_le.copy_from_slice(&buf[6..HEADER_LEN]);
    let id = u64::from_le_bytes(id_le);
    let body = &buf[HEADER_LEN..];
    let (msg, rest) =
        postcard::take_from_bytes::<Msg>(body).map_err(|e| WireError::Message(e.to_string()))?;
    let tail_start = buf.len() - rest.len();
    let tail = buf.slice(tail_start..);
    Ok(Frame {
        kind,
        id,
        msg,
        tail,
    })
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::types::*;
    use crate::RemoteError;
    use proptest::prelude::*;

    fn sample_msgs() -> Vec<Msg> {
        vec![
            Msg::Ping,
            Msg::Hello {
                role: Role::Node,
                node: Some(NodeId(3)),
                binary: Some([7; 32]),
                program: "/bin/x".into(),
            },
            Msg::Call {
                proclet: ProcletId(42),
                code: CodeRef {
                    offset: -12345,
                    fingerprint: 0xdead_beef,
                },
                mode: CallMode::Shared,
                chain: 99,
                call: 7,
            },
            Msg::Error(RemoteError::NotHere {
                hint: Some(Location {
                    node: NodeId(2),
                    addr: "127.0.0.1:4000".into(),
                    epoch: 3,
                }),
            }),
            Msg::Nodes(vec![NodeInfo {
                id: NodeId(1),
                role: Role::Driver,
                addr: "127.0.0.1:1".into(),
                pid: 5,
                spec: NodeSpec {
                    cores: 1.0,
                    mem_bytes: 1 << 30,
                },
                usage: Usage::default(),
                state: NodeState::Alive,
                last_seen_ms: 12,
                cgroups: Some(CgroupPaths {
                    memory: Some("/granule/c1/node0".into()),
                    cpu: None,
                }),
                metrics_addr: Some("127.0.0.1:9100".into()),
            }]),
            Msg::Heartbeat {
                node: NodeId(2),
                usage: Usage {
                    groups: vec![crate::GroupUsage {
                        group: "ShardedVec p12".into(),
                        proclets: 3,
                        bytes: 3 << 20,
                    }],
                    ..Usage::default()
                },
                events: vec![crate::ClusterEvent::now(
                    crate::EventKind::Migration,
                    NodeId(2),
                    "p7",
                )],
            },
            Msg::Events {
                after: 4,
                limit: 100,
            },
            Msg::Transfer {
                proclet: ProcletId(9),
                kind: Kind::Memory,
                state: CodeRef {
                    offset: -4,
                    fingerprint: 7,
                },
                epoch: 2,
                offset: 1 << 20,
                total: 16 << 20,
                last: false,
                raw: true,
                pinned: false,
                group: Some("MapShard p3".into()),
            },
            Msg::Moved(MoveStats {
                bytes: 5,
                micros: 6,
                drain_micros: 1,
            }),
            Msg::Push {
                proclet: ProcletId(12),
                code: CodeRef {
                    offset: 4096,
                    fingerprint: 0xfeed,
                },
                chain: 5,
                ticket: u64::MAX - 3,
                memory: Some(64 << 20),
                timeout_ms: None,
            },
            Msg::CancelPush {
                ticket: 77,
                timed_out: true,
            },
            Msg::Error(RemoteError::TimedOut { after_ms: 250 }),
            Msg::PublishPanel(Panel {
                name: "fs".into(),
                title: "granule fs at /mnt/g".into(),
                ttl_ms: 5000,
                facts: vec![("stripes draining".into(), "3".into())],
                tables: vec![PanelTable {
                    title: "space per class".into(),
                    columns: vec!["class".into(), "used".into()],
                    rows: vec![vec!["own".into(), "1.50 GiB".into()], vec![]],
                }],
            }),
        ]
    }

    #[test]
    fn round_trip_with_tail() {
        for (i, msg) in sample_msgs().into_iter().enumerate() {
            let tail = vec![i as u8; i * 10];
            let bytes = encode_frame(FrameKind::Request, i as u64 + 1, &msg, &tail).unwrap();
            assert_eq!(
                peek_frame_len(&bytes, DEFAULT_MAX_FRAME).unwrap(),
                Some(bytes.len())
            );
            let f = decode_frame(Bytes::from(bytes), DEFAULT_MAX_FRAME).unwrap();
            assert_eq!(f.kind, FrameKind::Request);
            assert_eq!(f.id, i as u64 + 1);
            assert_eq!(f.msg, msg);
            assert_eq!(&f.tail[..], &tail[..]);
        }
    }

    /// New variants go last: the variant numbers peers already speak stay as they are.
    #[test]
    fn pushed_call_messages_come_after_every_earlier_variant() {
        let first = |m: &Msg| postcard::to_allocvec(m).unwrap()[0];
        let panel = first(&Msg::PublishPanel(Panel {
            name: String::new(),
            title: String::new(),
            ttl_ms: 0,
            facts: vec![],
            tables: vec![],
        }));
        let push = first(&Msg::Push {
            proclet: ProcletId(1),
            code: CodeRef {
                offset: 0,
                fingerprint: 0,
            },
            chain: 1,
            ticket: 1,
            memory: None,
            timeout_ms: None,
        });
        let cancel = first(&Msg::CancelPush {
            ticket: 1,
            timed_out: false,
        });
        assert_eq!((push, cancel), (panel + 1, panel + 2));
        let err = |e: RemoteError| postcard::to_allocvec(&e).unwrap()[0];
        assert_eq!(
            err(RemoteError::TimedOut { after_ms: 5 }),
            err(RemoteError::Internal(String::new())) + 1
        );
    }

    #[test]
    fn rejects_bad_version_and_kind() {
        let mut bytes = encode_frame(FrameKind::Notify, 0, &Msg::Ping, &[]).unwrap();
        bytes[4] = 9;
        assert_eq!(
            decode_frame(Bytes::from(bytes.clone()), DEFAULT_MAX_FRAME),
            Err(WireError::BadVersion { got: 9 })
        );
        bytes[4] = PROTOCOL_VERSION;
        bytes[5] = 0;
        assert_eq!(
            decode_frame(Bytes::from(bytes), DEFAULT_MAX_FRAME),
            Err(WireError::BadKind(0))
        );
    }

    #[test]
    fn rejects_oversized_before_buffering() {
        let len = (1u32 << 31).to_le_bytes();
        assert!(matches!(
            peek_frame_len(&len, DEFAULT_MAX_FRAME),
            Err(WireError::TooLarge { .. })
        ));
    }

    proptest! {
        #![proptest_config(ProptestConfig::with_cases(2000))]

        /// Arbitrary bytes never panic the decoder.
        #[test]
        fn random_bytes_never_panic(data in proptest::collection::vec(any::<u8>(), 0..512)) {
            let _ = peek_frame_len(&data, DEFAULT_MAX_FRAME);
            let _ = decode_frame(Bytes::from(data), DEFAULT_MAX_FRAME);
        }

        /// Random bytes behind a valid header (so postcard itself is exercised) never panic.
        #[test]
        fn random_body_never_panics(kind in 1u8..=3, body in proptest::collection::vec(any::<u8>(), 0..512)) {
            let mut data = Vec::new();
            data.extend_from_slice(&((body.len() + HEADER_LEN - 4) as u32).to_le_bytes());
            data.push(PROTOCOL_VERSION);
            data.push(kind);
            data.extend_from_slice(&7u64.to_le_bytes());
            data.extend_from_slice(&body);
            let _ = decode_frame(Bytes::from(data), DEFAULT_MAX_FRAME);
        }

        /// Truncating or corrupting a valid frame gives an error or a frame, never a panic.
        #[test]
        fn truncated_and_flipped_frames_never_panic(
            which in any::<usize>(),
            cut in 0usize..200,
            flip_at in 0usize..200,
            flip in any::<u8>(),
        ) {
            let msgs = sample_msgs();
            let msg = msgs[which % msgs.len()].clone();
            let full = encode_frame(FrameKind::Response, 5, &msg, b"tail-bytes").unwrap();
            let cut = cut.min(full.len());
            let truncated = full[..cut].to_vec();
            prop_assert!(cut == full.len() || decode_frame(Bytes::from(truncated), DEFAULT_MAX_FRAME).is_err());
            let mut flipped = full.clone();
            let at = flip_at % flipped.len();
            flipped[at] ^= flip;
            let _ = decode_frame(Bytes::from(flipped), DEFAULT_MAX_FRAME);
        }
    }
}
