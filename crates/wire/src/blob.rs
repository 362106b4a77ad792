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

use bytes::Bytes;
use serde::de::{Error as _, SeqAccess, Visitor};
use serde::{Deserialize, Deserializer, Serialize, Serializer};
use std::cell::RefCell;
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
