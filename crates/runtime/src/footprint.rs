//! Memory footprints: how many bytes a value holds, for resource accounting.
//!
//! The pressure policy sheds the proclets that free the most memory per second of
//! migration, so it needs each proclet's size. A state type tells it through
//! [`Footprint`]: implementations here are exact for the standard containers up to
//! allocator overhead (they count capacity, not length, because that is what is
//! allocated). Granule's own library types implement it exactly and cheaply.
//!
//! A proclet created with `ProcletBuilder::footprint()` is accounted with its state's
//! `Footprint`; any other proclet is accounted with an *estimate*: the length of its
//! encoding (what a move would send), measured at creation and, after calls that mutate
//! it, again at most every [`ESTIMATE_EVERY`] (a counting serializer walks the state, so
//! this costs about as much as encoding it once, without allocating).
//!
//! Sharded structures need it of every element, key and value (they keep each shard's
//! byte count exact as entries come and go, so shards split at the right size). For a
//! type of your own, derive it:
//!
//! ```
//! use granule_runtime::Footprint;
//!
//! #[derive(Footprint)]
//! struct Doc {
//!     id: u64,
//!     words: Vec<String>,
//! }
//!
//! #[derive(Footprint)]
//! enum Shape<T> {
//!     Point,
//!     Tagged(T, String),
//! }
//!
//! let d = Doc { id: 1, words: vec!["a".into()] };
//! // Its own bytes, the vector's buffer, and the string's buffer.
//! assert_eq!(
//!     d.footprint(),
//!     (std::mem::size_of::<Doc>() + std::mem::size_of::<String>() + d.words[0].capacity()) as u64
//! );
//! assert_eq!(Shape::<u8>::Point.heap_bytes(), 0);
//! ```
//!
//! The derive (`granule::Footprint` for applications, which get it from the facade)
//! counts `size_of::<Self>()` plus each field's [`Footprint::heap_bytes`]: inline bytes
//! once, heap bytes of every field (for an enum, of the variant held). Types with fields
//! that do not implement it (a foreign type) implement it by hand: return the inline size
//! plus what the value owns on the heap.

use std::collections::{BTreeMap, BTreeSet, HashMap, HashSet, VecDeque};
use std::mem::size_of;
use std::time::Duration;

/// Shortest interval between two estimates of the same proclet's footprint.
pub const ESTIMATE_EVERY: Duration = Duration::from_millis(50);

/// Bytes a value holds: its own size plus everything it owns on the heap.
///
/// Implemented for the primitive types, `String`, the standard containers, `Option`,
/// `Box`, arrays and tuples of up to four, and Granule's own types. Derive it for your
/// own with `#[derive(Footprint)]` (see the [module docs](self)).
#[diagnostic::on_unimplemented(
    message = "`{Self}` does not implement `Footprint`, which memory accounting needs (sharded structures need it of every element, key and value)",
    label = "`{Self}` has no `Footprint` impl",
    note = "derive it with `#[derive(granule::Footprint)]` (every field must implement `Footprint` too), or implement it by hand"
)]
pub trait Footprint {
    /// Total bytes, including `size_of::<Self>()`.
    fn footprint(&self) -> u64;

    /// Heap bytes only (what `footprint` adds to the inline size). Containers use this
    /// for their elements, whose inline size they already count as capacity.
    fn heap_bytes(&self) -> u64 {
        self.footprint().saturating_sub(size_of_val_u64(self))
    }
}

/// `#[derive(Footprint)]` (the macro shares the trait's name, as serde's derives do).
pub use granule_derive::Footprint;

fn size_of_val_u64<T: ?Sized>(v: &T) -> u64 {
    std::mem::size_of_val(v) as u64
}

macro_rules! plain_footprint {
    ($($t:ty),*) => {$(
        impl Footprint for $t {
            fn footprint(&self) -> u64 {
                size_of::<$t>() as u64
            }
            fn heap_bytes(&self) -> u64 {
                0
            }
        }
    )*};
}

plain_footprint!(
    (),
    bool,
    char,
    u8,
    u16,
    u32,
    u64,
    u128,
    usize,
    i8,
    i16,
    i32,
    i64,
    i128,
    isize,
    f32,
    f64
);

impl Footprint for String {
    fn footprint(&self) -> u64 {
        (size_of::<String>() + self.capacity()) as u64
    }
}

impl<T: Footprint> Footprint for Vec<T> {
    fn footprint(&self) -> u64 {
        (size_of::<Vec<T>>() + self.capacity() * size_of::<T>()) as u64
            + self.iter().map(|x| x.heap_bytes()).sum::<u64>()
    }
}

impl<T: Footprint> Footprint for VecDeque<T> {
    fn footprint(&self) -> u64 {
        (size_of::<VecDeque<T>>() + self.capacity() * size_of::<T>()) as u64
            + self.iter().map(|x| x.heap_bytes()).sum::<u64>()
    }
}

impl<T: Footprint> Footprint for Box<T> {
    fn footprint(&self) -> u64 {
        size_of::<Box<T>>() as u64 + (**self).footprint()
    }
}

impl<T: Footprint> Footprint for Option<T> {
    fn footprint(&self) -> u64 {
        size_of::<Option<T>>() as u64 + self.as_ref().map_or(0, |x| x.heap_bytes())
    }
}

impl<T: Footprint, const N: usize> Footprint for [T; N] {
    fn footprint(&self) -> u64 {
        size_of::<[T; N]>() as u64 + self.iter().map(|x| x.heap_bytes()).sum::<u64>()
    }
}

/// Hash tables: one slot per bucket of capacity, plus a control byte each (hashbrown's
/// layout), plus what keys and values own.
impl<K: Footprint, V: Footprint, H> Footprint for HashMap<K, V, H> {
    fn footprint(&self) -> u64 {
        (size_of::<Self>() + self.capacity() * (size_of::<(K, V)>() + 1)) as u64
            + self
                .iter()
                .map(|(k, v)| k.heap_bytes() + v.heap_bytes())
                .sum::<u64>()
    }
}

impl<K: Footprint, H> Footprint for HashSet<K, H> {
    fn footprint(&self) -> u64 {
        (size_of::<Self>() + self.capacity() * (size_of::<K>() + 1)) as u64
            + self.iter().map(|k| k.heap_bytes()).sum::<u64>()
    }
}

/// B-trees: nodes hold up to 11 entries; count entries at ~2/3 occupancy plus edges.
impl<K: Footprint, V: Footprint> Footprint for BTreeMap<K, V> {
    fn footprint(&self) -> u64 {
        let per_entry = (size_of::<(K, V)>() * 3).div_ceil(2) + size_of::<usize>();
        (size_of::<Self>() + self.len() * per_entry) as u64
            + self
                .iter()
                .map(|(k, v)| k.heap_bytes() + v.heap_bytes())
                .sum::<u64>()
    }
}

impl<K: Footprint> Footprint for BTreeSet<K> {
    fn footprint(&self) -> u64 {
        let per_entry = (size_of::<K>() * 3).div_ceil(2) + size_of::<usize>();
        (size_of::<Self>() + self.len() * per_entry) as u64
            + self.iter().map(|k| k.heap_bytes()).sum::<u64>()
    }
}

macro_rules! tuple_footprint {
    ($($n:tt $t:ident),+) => {
        impl<$($t: Footprint),+> Footprint for ($($t,)+) {
            fn footprint(&self) -> u64 {
                size_of::<Self>() as u64 $(+ self.$n.heap_bytes())+
            }
        }
    };
}

tuple_footprint!(0 A);
tuple_footprint!(0 A, 1 B);
tuple_footprint!(0 A, 1 B, 2 C);
tuple_footprint!(0 A, 1 B, 2 C, 3 D);

/// Length of a value's postcard encoding, without allocating: the footprint estimate
/// for state types that do not implement [`Footprint`].
pub(crate) fn encoded_len<T: serde::Serialize + ?Sized>(v: &T) -> u64 {
    struct Count(u64);
    impl postcard::ser_flavors::Flavor for Count {
        type Output = u64;
        fn try_extend(&mut self, data: &[u8]) -> postcard::Result<()> {
            self.0 += data.len() as u64;
            Ok(())
        }
        fn try_push(&mut self, _: u8) -> postcard::Result<()> {
            self.0 += 1;
            Ok(())
        }
        fn finalize(self) -> postcard::Result<u64> {
            Ok(self.0)
        }
    }
    postcard::serialize_with_flavor(v, Count(0)).unwrap_or(0)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn containers_count_capacity_and_owned_heap() {
        let v: Vec<u8> = Vec::with_capacity(1000);
        assert_eq!(v.footprint(), 24 + 1000);
        let s = String::from("hello");
        assert_eq!(s.footprint(), 24 + s.capacity() as u64);
        let nested: Vec<Vec<u8>> = vec![vec![0; 100], vec![0; 200]];
        assert_eq!(nested.footprint(), 24 + 2 * 24 + 300);
        let mut m: HashMap<u64, Vec<u8>> = HashMap::new();
        m.insert(1, vec![0; 4096]);
        assert!(m.footprint() >= 4096 + 8 + 24);
        assert!(m.footprint() < 4096 + 1024);
        let t = (5u64, String::from("ab"));
        assert_eq!(t.footprint(), size_of::<(u64, String)>() as u64 + 2);
        let b: Box<Vec<u8>> = Box::new(vec![0; 10]);
        assert_eq!(b.footprint(), 8 + 24 + 10);
    }

    #[derive(Footprint)]
    struct Named {
        id: u64,
        name: String,
        tags: Vec<String>,
    }

    #[derive(Footprint)]
    struct Tuple(u32, Vec<u8>);

    #[derive(Footprint)]
    struct Unit;

    #[derive(Footprint)]
    enum Either<T> {
        Nothing,
        One(T),
        Named { label: String, more: Box<T> },
    }

    #[derive(Footprint)]
    struct Wrapper<T, U> {
        inner: T,
        other: Option<U>,
    }

    #[test]
    fn derived_impls_count_inline_size_once_and_every_fields_heap() {
        let n = Named {
            id: 7,
            name: String::with_capacity(10),
            tags: vec![String::with_capacity(3), String::new()],
        };
        let want = size_of::<Named>() + 10 + n.tags.capacity() * size_of::<String>() + 3;
        assert_eq!(n.footprint(), want as u64);
        assert_eq!(n.heap_bytes(), (want - size_of::<Named>()) as u64);

        let t = Tuple(1, Vec::with_capacity(100));
        assert_eq!(t.footprint(), (size_of::<Tuple>() + 100) as u64);
        assert_eq!(Unit.footprint(), 0);
        assert_eq!(Unit.heap_bytes(), 0);

        // An enum counts the variant it holds.
        let none: Either<Vec<u8>> = Either::Nothing;
        assert_eq!(none.footprint(), size_of::<Either<Vec<u8>>>() as u64);
        let one: Either<Vec<u8>> = Either::One(Vec::with_capacity(50));
        assert_eq!(one.heap_bytes(), 50);
        let named: Either<Vec<u8>> = Either::Named {
            label: String::with_capacity(4),
            more: Box::new(Vec::with_capacity(8)),
        };
        // The string's buffer, and the box's allocation (a Vec header) with its buffer.
        assert_eq!(named.heap_bytes(), 4 + 24 + 8);

        // Generic fields go through their own impls; a derived type nests like any other.
        let w = Wrapper {
            inner: Tuple(0, vec![0; 16]),
            other: Some(String::with_capacity(5)),
        };
        assert_eq!(
            w.footprint(),
            size_of::<Wrapper<Tuple, String>>() as u64 + 16 + 5
        );
        let in_vec = vec![Tuple(0, Vec::with_capacity(9))];
        assert_eq!(
            in_vec.footprint(),
            (size_of::<Vec<Tuple>>() + size_of::<Tuple>() + 9) as u64
        );
    }

    #[test]
    fn encoded_len_matches_postcard() {
        let v: Vec<(u64, String)> = (0..100).map(|i| (i, format!("v{i}"))).collect();
        assert_eq!(
            encoded_len(&v),
            postcard::to_allocvec(&v).unwrap().len() as u64
        );
    }
}
