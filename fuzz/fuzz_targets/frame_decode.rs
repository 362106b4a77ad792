//! Fuzz target: arbitrary bytes through Granule's frame decoder.
//!
//! The decoder faces bytes from any peer that can open a TCP connection, so it must never
//! panic, never allocate what a length field merely claims, and give back exactly what
//! was encoded. This target feeds the input
//!
//! 1. to `peek_frame_len` and `decode_frame` as one frame;
//! 2. as a byte stream split into frames the way a connection's reader does it (peek the
//!    length, decode once the frame is complete, advance), once with the default frame
//!    limit and once with the transport's 64 KiB limit for frames before the handshake;
//!
//! and re-encodes every frame that decodes, checking that decoding the re-encoding gives
//! the same frame (and that encoding is then stable byte for byte).
#![no_main]

use bytes::Bytes;
use granule_wire::{
    decode_frame, encode_frame, peek_frame_len, Frame, DEFAULT_MAX_FRAME, HEADER_LEN,
};
use libfuzzer_sys::fuzz_target;

/// The transport's `max_hello_frame` default.
const HELLO_MAX: usize = 64 << 10;

fn same(a: &Frame, b: &Frame) -> bool {
    // Frames holding a float NaN (node specs, usage reports) are not equal to themselves
    // under `PartialEq`; their debug forms are.
    a == b || format!("{a:?}") == format!("{b:?}")
}

fn check_round_trip(frame: &Frame, max: usize) {
    let bytes = encode_frame(frame.kind, frame.id, &frame.msg, &frame.tail)
        .expect("a frame that decoded must encode again");
    assert!(
        bytes.len() <= max,
        "re-encoding grew a {}-byte-limited frame to {} bytes",
        max,
        bytes.len()
    );
    assert_eq!(
        peek_frame_len(&bytes, max),
        Ok(Some(bytes.len())),
        "the length field of a re-encoded frame is wrong"
    );
    let again =
        decode_frame(Bytes::from(bytes.clone()), max).expect("a re-encoded frame must decode");
    assert!(
        same(frame, &again),
        "round trip changed the frame:\n{frame:?}\n{again:?}"
    );
    let bytes2 = encode_frame(again.kind, again.id, &again.msg, &again.tail)
        .expect("a frame that decoded must encode again");
    assert_eq!(bytes, bytes2, "encoding is not stable");
}

/// Split `data` into frames like a connection's reader; returns how many decoded.
fn stream(data: &[u8], max: usize) -> usize {
    let mut rest = Bytes::copy_from_slice(data);
    let mut frames = 0;
    loop {
        match peek_frame_len(&rest, max) {
            Ok(Some(total)) => {
                assert!(
                    (HEADER_LEN..=max).contains(&total),
                    "peek_frame_len returned {total}, outside {HEADER_LEN}..={max}"
                );
                if rest.len() < total {
                    // Incomplete: the reader waits for more bytes.
                    return frames;
                }
                let one = rest.split_to(total);
                match decode_frame(one, max) {
                    Ok(frame) => {
                        check_round_trip(&frame, max);
                        frames += 1;
                    }
                    // The reader closes the connection on a bad frame.
                    Err(_) => return frames,
                }
            }
            Ok(None) => {
                assert!(rest.len() < 4, "no length read from {} bytes", rest.len());
                return frames;
            }
            // Too large or too short: the reader closes the connection.
            Err(_) => return frames,
        }
    }
}

fuzz_target!(|data: &[u8]| {
    // The whole input as one frame.
    let peeked = peek_frame_len(data, DEFAULT_MAX_FRAME);
    if let Ok(frame) = decode_frame(Bytes::copy_from_slice(data), DEFAULT_MAX_FRAME) {
        assert_eq!(peeked, Ok(Some(data.len())), "decoded, but peek disagreed");
        check_round_trip(&frame, DEFAULT_MAX_FRAME);
    }
    // The input as a stream of frames.
    stream(data, DEFAULT_MAX_FRAME);
    stream(data, HELLO_MAX);
});
