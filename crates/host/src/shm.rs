//! Memory shared between processes of one machine without a socket in between: an
//! *arena* is a memory file (`memfd`) cut into fixed-size slots. One process owns it and
//! writes each slot once (the file system's stripe store on an own node); other processes
//! on the same machine (the mount) map the same file read-only, found through
//! `/proc/<pid>/fd/<fd>`, and read stripes in place, so a stripe goes from the store's
//! memory to the kernel's FUSE reply in one copy instead of crossing loopback TCP.
//!
//! The file's first page holds a random tag: a peer that opens `/proc/<pid>/fd/<fd>`
//! checks it, so a process on another machine whose pid and descriptor number happen to
//! exist here is never mistaken for the arena (the peer then reads over the network as
//! before). Freed slots keep their pages up to a bound the owner sets (the file system's
//! own store: half its capacity, memory that is the file system's anyway), so a rewrite
//! reuses pages that are allocated and already mapped by the peers; the pages of slots
//! freed beyond the bound go back to the kernel at once (a hole is punched). The file
//! never shrinks, and a mapping reserves address space, not memory.
//!
//! Both sides map the file read-only; the owner writes slots with file writes.
//!
//! The protocol that keeps reads in place sound: a slot is written before its offset is
//! handed to anyone, is never written again while allocated, and is freed only when its
//! owner drops the [`ArenaSlice`]. The reader (the mount) is the only party that deletes
//! stripes, and it does not delete one while it is reading it.

use crate::os::SharedMap;
use nix::fcntl::FallocateFlags;
use nix::sys::memfd::{memfd_create, MFdFlags};
use std::fs::File;
use std::hash::{BuildHasher, Hasher};
use std::io;
use std::os::fd::AsRawFd;
use std::os::unix::fs::FileExt;
use std::sync::{Arc, Mutex};

/// Bytes before the first slot: the tag, on a page of its own so that slots are page
/// aligned (holes are punched in whole pages).
pub const HEADER: usize = 4096;
const PAGE: usize = 4096;

/// What a peer needs to map an arena: the owner's pid and descriptor, the tag, and the
/// length of the owner's mapping.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct ArenaId {
    pub pid: u32,
    pub fd: i32,
    pub tag: u128,
    pub len: u64,
}

/// The owner's side: a memory file of slots, written here.
pub struct Arena {
    file: File,
    map: SharedMap,
    slot: usize,
    /// Freed slots kept with their pages, at most.
    keep_warm: usize,
    tag: u128,
    slots: Mutex<Slots>,
}

#[derive(Default)]
struct Slots {
    /// Freed slots that kept their pages (reused first: a rewrite neither allocates
    /// pages nor makes peers map them again).
    warm: Vec<u32>,
    /// Freed slots whose pages went back to the kernel.
    free: Vec<u32>,
    /// Slots the file holds (freed ones included).
    count: u32,
    /// Slots holding data.
    used: u32,
}

/// One slot's data; the slot is freed when this is dropped.
pub struct ArenaSlice {
    arena: Arc<Arena>,
    index: u32,
    len: usize,
}

impl Arena {
    /// A new arena of `slot`-byte slots (rounded up to whole pages) in `reserve` bytes of
    /// address space. Up to `keep_warm` bytes of freed slots keep their pages for reuse;
    /// the pages of slots freed beyond that go back to the kernel at once.
    pub fn create(slot: usize, reserve: usize, keep_warm: usize) -> io::Result<Arc<Arena>> {
        let slot = slot.max(1).next_multiple_of(PAGE);
        if reserve < HEADER + slot {
            return Err(io::Error::new(
                io::ErrorKind::InvalidInput,
                format!("an arena of {reserve} bytes has no room for a {slot}-byte slot"),
            ));
        }
        let fd = memfd_create("granule-stripes", MFdFlags::MFD_CLOEXEC)?;
        let file = File::from(fd);
        file.set_len(HEADER as u64)?;
        let map = SharedMap::map(&file, reserve)?;
        let tag = random_tag();
        file.write_all_at(&tag.to_le_bytes(), 0)?;
        Ok(Arc::new(Arena {
            file,
            map,
            slot,
            keep_warm: keep_warm / slot,
            tag,
            slots: Mutex::new(Slots::default()),
        }))
    }

    /// How a peer on this machine finds and checks the arena.
    pub fn id(&self) -> ArenaId {
        ArenaId {
            pid: std::process::id(),
            fd: self.file.as_raw_fd(),
            tag: self.tag,
            len: self.map.len() as u64,
        }
    }

    /// The largest piece of data a slot holds.
    pub fn slot_size(&self) -> usize {
        self.slot
    }

    /// Slots holding data now.
    pub fn used_slots(&self) -> u32 {
        self.slots.lock().unwrap_or_else(|e| e.into_inner()).used
    }

    /// Copy `data` into a free slot. `None` when it is larger than a slot, the address
    /// space is used up, or the file cannot grow (the caller keeps the data elsewhere).
    pub fn store(self: &Arc<Self>, data: &[u8]) -> Option<ArenaSlice> {
        if data.len() > self.slot {
            return None;
        }
        let index = {
            let mut s = self.slots.lock().unwrap_or_else(|e| e.into_inner());
            let index = match s.warm.pop().or_else(|| s.free.pop()) {
                Some(i) => i,
                None => {
                    let end = HEADER + (s.count as usize + 1) * self.slot;
                    if end > self.map.len() || self.file.set_len(end as u64).is_err() {
                        return None;
                    }
                    s.count += 1;
                    s.count - 1
                }
            };
            s.used += 1;
            index
        };
        let slice = ArenaSlice {
            arena: self.clone(),
            index,
            len: data.len(),
        };
        // A file write, not a copy through the mapping: the kernel allocates the pages as
        // it copies, where writing through the mapping would take a page fault per page.
        // A failure (no memory) frees the slot.
        self.file.write_all_at(data, slice.offset()).ok()?;
        Some(slice)
    }

    fn offset_of(&self, index: u32) -> usize {
        HEADER + index as usize * self.slot
    }

    fn free(&self, index: u32) {
        {
            let mut s = self.slots.lock().unwrap_or_else(|e| e.into_inner());
            s.used -= 1;
            if s.warm.len() < self.keep_warm {
                s.warm.push(index);
                return;
            }
        }
        // The pages go back to the kernel now (and leave every peer's mapping); the
        // slot's address stays in the file for reuse.
        let _ = nix::fcntl::fallocate(
            &self.file,
            FallocateFlags::FALLOC_FL_PUNCH_HOLE | FallocateFlags::FALLOC_FL_KEEP_SIZE,
            self.offset_of(index) as i64,
            self.slot as i64,
        );
        self.slots
            .lock()
            .unwrap_or_else(|e| e.into_inner())
            .free
            .push(index);
    }

    /// Bytes of freed slots that kept their pages.
    pub fn warm_bytes(&self) -> u64 {
        let s = self.slots.lock().unwrap_or_else(|e| e.into_inner());
        (s.warm.len() * self.slot) as u64
    }
}

impl ArenaSlice {
    /// Where the data starts in the arena's file (what a peer reads at).
    pub fn offset(&self) -> u64 {
        self.arena.offset_of(self.index) as u64
    }

    pub fn len(&self) -> usize {
        self.len
    }

    pub fn is_empty(&self) -> bool {
        self.len == 0
    }
}

impl AsRef<[u8]> for ArenaSlice {
    fn as_ref(&self) -> &[u8] {
        self.arena
            .map
            .slice(self.offset() as usize, self.len)
            .expect("an allocated slot lies inside the arena's mapping")
    }
}

impl Drop for ArenaSlice {
    fn drop(&mut self) {
        self.arena.free(self.index);
    }
}

/// A peer's read-only view of an arena owned by a process on this machine.
pub struct PeerArena {
    _file: File,
    map: SharedMap,
}

impl PeerArena {
    /// Map the arena `id` names, checking its tag. Fails when the owner is not a process
    /// of this machine (or this process may not open its descriptors), or when the file
    /// found there is not the arena.
    pub fn open(id: &ArenaId) -> io::Result<PeerArena> {
        let file = File::open(format!("/proc/{}/fd/{}", id.pid, id.fd))?;
        // Reading a mapping past the file's end would fault: check the header is there.
        if file.metadata()?.len() < HEADER as u64 {
            return Err(not_the_arena());
        }
        let len = usize::try_from(id.len).map_err(|_| not_the_arena())?;
        let map = SharedMap::map(&file, len.max(HEADER))?;
        let tag = map.slice(0, 16).ok_or_else(not_the_arena)?;
        if u128::from_le_bytes(tag.try_into().expect("16 bytes")) != id.tag {
            return Err(not_the_arena());
        }
        Ok(PeerArena { _file: file, map })
    }

    /// Bytes `off..off + len` of the arena (a range its owner handed out), `None` when
    /// the range is outside the arena's address space.
    pub fn slice(&self, off: u64, len: usize) -> Option<&[u8]> {
        let off = usize::try_from(off).ok()?;
        if off < HEADER {
            return None;
        }
        self.map.slice(off, len)
    }
}

fn not_the_arena() -> io::Error {
    io::Error::new(
        io::ErrorKind::InvalidData,
        "the descriptor does not name the expected stripe arena",
    )
}

/// 128 random bits from the standard library's per-process hash keys (an identity
/// check, not a secret).
fn random_tag() -> u128 {
    let a = std::collections::hash_map::RandomState::new()
        .build_hasher()
        .finish();
    let mut h = std::collections::hash_map::RandomState::new().build_hasher();
    h.write_u64(a);
    h.write_u32(std::process::id());
    (u128::from(a) << 64) | u128::from(h.finish())
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn a_peer_reads_what_the_owner_stored_and_freed_slots_are_reused() {
        let arena = Arena::create(10_000, 64 << 20, 0).unwrap();
        assert_eq!(arena.slot_size(), 12_288);
        let a = arena.store(&[7u8; 10_000]).unwrap();
        let b = arena.store(b"hello").unwrap();
        assert_eq!(a.as_ref(), &[7u8; 10_000][..]);
        assert_eq!(b.as_ref(), b"hello");
        assert_eq!(arena.used_slots(), 2);

        let peer = PeerArena::open(&arena.id()).unwrap();
        assert_eq!(peer.slice(a.offset(), a.len()).unwrap(), a.as_ref());
        assert_eq!(peer.slice(b.offset(), 5).unwrap(), b"hello");
        // The header is not data.
        assert!(peer.slice(0, 16).is_none());

        let freed = a.offset();
        drop(a);
        assert_eq!(arena.used_slots(), 1);
        // The punched hole reads as zeros until the slot is written again.
        assert_eq!(peer.slice(freed, 4).unwrap(), &[0, 0, 0, 0]);
        let c = arena.store(b"again").unwrap();
        assert_eq!(c.offset(), freed, "a freed slot is reused");
        assert_eq!(peer.slice(freed, 5).unwrap(), b"again");
    }

    #[test]
    fn freed_slots_keep_their_pages_up_to_the_bound() {
        let arena = Arena::create(4096, 1 << 20, 2 * 4096).unwrap();
        let peer = PeerArena::open(&arena.id()).unwrap();
        let slots: Vec<ArenaSlice> = (0..3u8)
            .map(|i| arena.store(&[i + 1; 4096]).unwrap())
            .collect();
        let offsets: Vec<u64> = slots.iter().map(|s| s.offset()).collect();
        drop(slots);
        assert_eq!(
            arena.warm_bytes(),
            2 * 4096,
            "two slots stay warm, the third is punched"
        );
        // The first two keep their bytes (pages kept); the third reads as zeros.
        assert_eq!(peer.slice(offsets[0], 1).unwrap(), &[1]);
        assert_eq!(peer.slice(offsets[1], 1).unwrap(), &[2]);
        assert_eq!(peer.slice(offsets[2], 1).unwrap(), &[0]);
        // Warm slots are reused first, and a rewrite shows through the peer's mapping.
        let again = arena.store(&[9; 10]).unwrap();
        assert!(offsets[..2].contains(&again.offset()));
        assert_eq!(peer.slice(again.offset(), 10).unwrap(), &[9; 10]);
        assert_eq!(arena.warm_bytes(), 4096);
    }

    #[test]
    fn too_large_data_and_a_full_arena_are_refused() {
        let arena = Arena::create(4096, HEADER + 2 * 4096, 0).unwrap();
        assert!(arena.store(&[0u8; 4097]).is_none());
        let _a = arena.store(b"1").unwrap();
        let _b = arena.store(b"2").unwrap();
        assert!(arena.store(b"3").is_none(), "two slots fit, not three");
        assert!(Arena::create(4096, HEADER, 0).is_err());
    }

    #[test]
    fn a_wrong_tag_or_descriptor_is_not_taken_for_the_arena() {
        let arena = Arena::create(4096, 1 << 20, 0).unwrap();
        let mut id = arena.id();
        id.tag ^= 1;
        let e = PeerArena::open(&id).err().expect("wrong tag refused");
        assert_eq!(e.kind(), io::ErrorKind::InvalidData);
        // A descriptor of this process that is some other (empty) file.
        let other = tempfile_like();
        let id = ArenaId {
            fd: other.as_raw_fd(),
            ..arena.id()
        };
        assert!(PeerArena::open(&id).is_err());
        // No such descriptor.
        let id = ArenaId {
            fd: 1 << 20,
            ..arena.id()
        };
        assert!(PeerArena::open(&id).is_err());
    }

    fn tempfile_like() -> File {
        File::from(memfd_create("not-an-arena", MFdFlags::MFD_CLOEXEC).unwrap())
    }
}
