//! [`Blob`]: a byte buffer inside an argument or return value that a receiver decodes
//! without copying it.
//!
//! A call's encoded return value arrives as a slice of the frame the transport read
//! ([`bytes::Bytes`]). Decoding a `Vec<u8>` field out of it copies the bytes once more;
//! for bulk values (a file system stripe, megabytes) that copy is a large share of the
//! receiver's work. A `Blob` decoded while [`with_source`] names the buffer being decoded
//! is a view into that buffer instead (it keeps the frame's memory alive while it lives).
//! Decoded from anything else (another format, a buffer not named), it copies, so a
//! `Blob` is always correct and only sometimes free.
//!
//! The sending side has the mirror image: [`encode_leaving_blobs`] encodes a value but
//! leaves the bytes of its large blobs out of the buffer, returning where each belongs,
//! so a sender can write them from the blob's own memory (a vectored write) instead of
//! copying them into the frame first. What goes on the wire is byte for byte what plain
//! postcard encoding gives.

use bytes::Bytes;
use serde::de::{Error as _, SeqAccess, Visitor};
use serde::{Deserialize, Deserializer, Serialize, Serializer};
use std::cell::{Cell, RefCell};
use std::fmt;

/// Bytes that decode without a copy when they can; see the module doc.
#[derive(Clone, Default, PartialEq, Eq)]
pub struct Blob(pub Bytes);

impl fmt::Debug for Blob {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        write!(f, "Blob({} bytes)", self.0.len())
    }
}

impl std::ops::Deref for Blob {
    type Target = [u8];
    fn deref(&self) -> &[u8] {
        &self.0
    }
}

impl From<Vec<u8>> for Blob {
    fn from(v: Vec<u8>) -> Blob {
        Blob(Bytes::from(v))
    }
}

impl From<Bytes> for Blob {
    fn from(b: Bytes) -> Blob {
        Blob(b)
    }
}

thread_local! {
    /// The buffer being decoded on this thread, if the decoder named one.
    static SOURCE: RefCell<Option<Bytes>> = const { RefCell::new(None) };
    /// Blobs left out of the encoding under way on this thread (see
    /// [`encode_leaving_blobs`]), when one is under way.
    static HOLES: RefCell<Option<Vec<(usize, Bytes)>>> = const { RefCell::new(None) };
    /// Bytes in the buffer [`encode_leaving_blobs`] is writing, so far.
    static WRITTEN: Cell<usize> = const { Cell::new(0) };
}

/// Blobs at least this long are left out by [`encode_leaving_blobs`]; shorter ones are
/// cheaper to copy than to write separately.
pub const MIN_HOLE: usize = 64 << 10;

/// Postcard output onto a `Vec` that keeps [`WRITTEN`] up to date.
struct Tracked<'a> {
    out: &'a mut Vec<u8>,
}

impl postcard::ser_flavors::Flavor for Tracked<'_> {
    type Output = ();

    fn try_push(&mut self, b: u8) -> postcard::Result<()> {
        self.out.push(b);
        WRITTEN.set(self.out.len());
        Ok(())
    }

    fn try_extend(&mut self, d: &[u8]) -> postcard::Result<()> {
        self.out.extend_from_slice(d);
        WRITTEN.set(self.out.len());
        Ok(())
    }

    fn finalize(self) -> postcard::Result<()> {
        Ok(())
    }
}

/// Encode `v` with postcard onto the end of `out`, leaving out the bytes of every
/// [`Blob`] of at least [`MIN_HOLE`] bytes. Returns those blobs, each with the offset in
/// `out` its bytes belong at (ascending): `out[..o1]`, blob 1, `out[o1..o2]`, blob 2, …,
/// `out[on..]` is exactly what `postcard::to_extend` would have written.
pub fn encode_leaving_blobs<T: Serialize + ?Sized>(
    v: &T,
    out: &mut Vec<u8>,
) -> postcard::Result<Vec<(usize, Bytes)>> {
    struct Disarm(Option<Vec<(usize, Bytes)>>);
    impl Drop for Disarm {
        fn drop(&mut self) {
            // Also on a panic in a Serialize impl: no later encoding on this thread
            // may leave blobs out.
            let prev = self.0.take();
            HOLES.with(|h| *h.borrow_mut() = prev);
        }
    }
    let prev = HOLES.with(|h| h.borrow_mut().replace(Vec::new()));
    let disarm = Disarm(prev);
    WRITTEN.set(out.len());
    let r = postcard::serialize_with_flavor(v, Tracked { out });
    let holes = HOLES.with(|h| h.borrow_mut().take()).unwrap_or_default();
    drop(disarm);
    r.map(|()| holes)
}

/// Run `decode` (which decodes from `source`'s bytes) so that [`Blob`]s in it become
/// views into `source` rather than copies.
pub fn with_source<T>(source: &Bytes, decode: impl FnOnce(&[u8]) -> T) -> T {
    struct Reset(Option<Bytes>);
    impl Drop for Reset {
        fn drop(&mut self) {
            let prev = self.0.take();
            SOURCE.with(|s| *s.borrow_mut() = prev);
        }
    }
    let prev = SOURCE.with(|s| s.borrow_mut().replace(source.clone()));
    let _reset = Reset(prev);
    decode(source)
}

/// `part` as a view into the named source buffer, when it lies inside it.
fn view(part: &[u8]) -> Option<Bytes> {
    SOURCE.with(|s| {
        let s = s.borrow();
        let src = s.as_ref()?;
        let (start, end) = (src.as_ptr() as usize, src.as_ptr() as usize + src.len());
        let (p, q) = (part.as_ptr() as usize, part.as_ptr() as usize + part.len());
        (p >= start && q <= end && !part.is_empty()).then(|| src.slice(p - start..q - start))
    })
}

impl Serialize for Blob {
    fn serialize<S: Serializer>(&self, s: S) -> Result<S::Ok, S::Error> {
        let leave_out = self.0.len() >= MIN_HOLE && HOLES.with(|h| h.borrow().is_some());
        if leave_out {
            // Postcard writes a byte string as its length (a varint, the same bytes as
            // this u64's) and then the bytes: write the length only, and say where the
            // bytes go.
            let r = s.serialize_u64(self.0.len() as u64)?;
            let at = WRITTEN.get();
            HOLES.with(|h| {
                if let Some(v) = h.borrow_mut().as_mut() {
                    v.push((at, self.0.clone()));
                }
            });
            return Ok(r);
        }
        s.serialize_bytes(&self.0)
    }
}

struct BlobVisitor;

impl<'de> Visitor<'de> for BlobVisitor {
    type Value = Blob;

    fn expecting(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str("bytes")
    }

    fn visit_borrowed_bytes<E: serde::de::Error>(self, v: &'de [u8]) -> Result<Blob, E> {
        Ok(Blob(view(v).unwrap_or_else(|| Bytes::copy_from_slice(v))))
    }

    fn visit_bytes<E: serde::de::Error>(self, v: &[u8]) -> Result<Blob, E> {
        Ok(Blob(Bytes::copy_from_slice(v)))
    }

    fn visit_byte_buf<E: serde::de::Error>(self, v: Vec<u8>) -> Result<Blob, E> {
        Ok(Blob(Bytes::from(v)))
    }

    fn visit_seq<A: SeqAccess<'de>>(self, mut seq: A) -> Result<Blob, A::Error> {
        let mut v = Vec::with_capacity(seq.size_hint().unwrap_or(0).min(1 << 20));
        while let Some(b) = seq.next_element::<u8>()? {
            v.push(b);
        }
        Ok(Blob(Bytes::from(v)))
    }
}

impl<'de> Deserialize<'de> for Blob {
    fn deserialize<D: Deserializer<'de>>(d: D) -> Result<Blob, D::Error> {
        d.deserialize_bytes(BlobVisitor)
            .map_err(|e| D::Error::custom(format!("a byte buffer: {e}")))
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[derive(Serialize, Deserialize, PartialEq, Debug)]
    struct Reply {
        n: u32,
        data: Option<Blob>,
    }

    #[test]
    fn a_blob_decoded_from_its_named_source_is_a_view_into_it() {
        let r = Reply {
            n: 7,
            data: Some(Blob::from(vec![5u8; 100_000])),
        };
        let frame = Bytes::from(postcard::to_allocvec(&r).unwrap());
        let got: Reply = with_source(&frame, |b| postcard::from_bytes(b).unwrap());
        assert_eq!(got, r);
        let data = got.data.unwrap();
        let (f, d) = (frame.as_ptr() as usize, data.0.as_ptr() as usize);
        assert!(
            d > f && d + data.len() <= f + frame.len(),
            "a view, not a copy"
        );
        // The source is forgotten afterwards: decoding again copies.
        let copy: Reply = postcard::from_bytes(&frame).unwrap();
        let c = copy.data.unwrap().0.as_ptr() as usize;
        assert!(c < f || c >= f + frame.len());
    }

    #[test]
    fn other_buffers_and_formats_copy() {
        let r = Reply {
            n: 1,
            data: Some(Blob::from(b"abc".to_vec())),
        };
        let frame = Bytes::from(postcard::to_allocvec(&r).unwrap());
        let other = Bytes::from_static(b"unrelated");
        let got: Reply = with_source(&other, |_| postcard::from_bytes(&frame).unwrap());
        assert_eq!(got, r);
        let json = serde_json::to_string(&r).unwrap();
        assert_eq!(serde_json::from_str::<Reply>(&json).unwrap(), r);
    }

    #[test]
    fn leaving_blobs_out_then_writing_them_in_gives_the_plain_encoding() {
        #[derive(Serialize)]
        struct Many {
            a: Blob,
            small: Blob,
            n: u64,
            b: Option<Blob>,
            tail: String,
        }
        let v = Many {
            a: Blob::from(vec![1u8; MIN_HOLE + 5]),
            small: Blob::from(vec![2u8; 100]),
            n: 300,
            b: Some(Blob::from(vec![3u8; 1 << 20])),
            tail: "end".into(),
        };
        let plain = postcard::to_allocvec(&v).unwrap();
        let mut out = b"header".to_vec();
        let holes = encode_leaving_blobs(&v, &mut out).unwrap();
        assert_eq!(holes.len(), 2, "the two large blobs are left out");
        assert!(out.len() < 1000);
        let mut joined = Vec::new();
        let mut at = 0;
        for (o, b) in &holes {
            joined.extend_from_slice(&out[at..*o]);
            joined.extend_from_slice(b);
            at = *o;
        }
        joined.extend_from_slice(&out[at..]);
        assert_eq!(&joined[..6], b"header");
        assert_eq!(&joined[6..], &plain[..]);
        // Disarmed afterwards: a plain encoding is whole again.
        assert_eq!(postcard::to_allocvec(&v).unwrap(), plain);
    }

    #[test]
    fn malformed_input_is_an_error() {
        let r = Reply {
            n: 1,
            data: Some(Blob::from(vec![1u8; 50])),
        };
        let bytes = postcard::to_allocvec(&r).unwrap();
        let cut = Bytes::copy_from_slice(&bytes[..20]);
        assert!(with_source(&cut, |b| postcard::from_bytes::<Reply>(b)).is_err());
    }
}
