//! Encoding proclet states in pieces, for migration.
//!
//! A move streams a state to its destination in chunks instead of building one buffer
//! holding the whole encoding: the source never holds a second full copy of a large state,
//! and sending overlaps with encoding. [`Chunker`] is the postcard output that cuts the
//! encoding into chunks and hands each to the sender as soon as it is full.

use granule_wire::RemoteError;

/// Where finished chunks go. An error stops the encoding (the move is abandoned).
pub(crate) type ChunkSink<'a> = dyn FnMut(Vec<u8>) -> Result<(), RemoteError> + 'a;

/// A postcard output that emits `chunk`-sized pieces of the encoding to `emit`, which
/// returns false to stop.
struct Chunker<'a> {
    cur: Vec<u8>,
    chunk: usize,
    emit: &'a mut dyn FnMut(Vec<u8>) -> bool,
}

impl Chunker<'_> {
    fn flush(&mut self) -> postcard::Result<()> {
        let full = std::mem::replace(&mut self.cur, Vec::with_capacity(self.chunk));
        if (self.emit)(full) {
            Ok(())
        } else {
            Err(postcard::Error::SerializeBufferFull)
        }
    }
}

impl postcard::ser_flavors::Flavor for Chunker<'_> {
    type Output = ();

    fn try_extend(&mut self, mut data: &[u8]) -> postcard::Result<()> {
        while !data.is_empty() {
            let n = (self.chunk - self.cur.len()).min(data.len());
            self.cur.extend_from_slice(&data[..n]);
            data = &data[n..];
            if self.cur.len() == self.chunk {
                self.flush()?;
            }
        }
        Ok(())
    }

    fn try_push(&mut self, b: u8) -> postcard::Result<()> {
        self.cur.push(b);
        if self.cur.len() == self.chunk {
            self.flush()?;
        }
        Ok(())
    }

    fn finalize(mut self) -> postcard::Result<()> {
        if !self.cur.is_empty() {
            self.flush()?;
        }
        Ok(())
    }
}

/// Encode `value` in chunks of `chunk` bytes (the last one shorter), each handed to
/// `sink` as soon as it is full. A sink error stops the encoding and is returned.
pub(crate) fn encode_chunked<T: serde::Serialize + ?Sized>(
    value: &T,
    chunk: usize,
    sink: &mut ChunkSink<'_>,
) -> Result<(), RemoteError> {
    let chunk = chunk.max(1);
    let mut sink_error = None;
    let r = {
        let mut emit = |c: Vec<u8>| match sink(c) {
            Ok(()) => true,
            Err(e) => {
                sink_error = Some(e);
                false
            }
        };
        let chunker = Chunker {
            cur: Vec::with_capacity(chunk.min(64 << 10)),
            chunk,
            emit: &mut emit,
        };
        postcard::serialize_with_flavor(value, chunker)
    };
    if let Some(e) = sink_error {
        return Err(e);
    }
    r.map_err(|e| {
        RemoteError::Decode(format!(
            "cannot encode the proclet state ({}): {e}",
            std::any::type_name::<T>()
        ))
    })
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn chunks_concatenate_to_the_plain_encoding() {
        let v: Vec<(u64, String)> = (0..5000).map(|i| (i, format!("value {i}"))).collect();
        let plain = postcard::to_allocvec(&v).unwrap();
        let mut got = Vec::new();
        let mut sizes = Vec::new();
        encode_chunked(&v, 1000, &mut |c: Vec<u8>| {
            sizes.push(c.len());
            got.extend_from_slice(&c);
            Ok(())
        })
        .unwrap();
        assert_eq!(got, plain);
        assert!(sizes[..sizes.len() - 1].iter().all(|s| *s == 1000));
    }

    #[test]
    fn a_failing_sink_stops_the_encoding() {
        let v = vec![7u8; 10_000];
        let mut calls = 0;
        let r = encode_chunked(&v, 100, &mut |_c: Vec<u8>| {
            calls += 1;
            if calls == 3 {
                Err(RemoteError::Internal("destination gone".into()))
            } else {
                Ok(())
            }
        });
        assert!(r.is_err());
        assert_eq!(calls, 3);
    }
}
