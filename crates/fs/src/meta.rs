//! The file system's metadata, free of I/O: inodes (attributes, directory entries,
//! symlink targets), each file's stripe table (version, valid length and the stores
//! holding each stripe), hard links, and the POSIX rules of the namespace operations
//! (what may be renamed over what, what `rmdir` refuses, when a file's data is freed).
//!
//! Errors are errnos, as FUSE answers them. Data I/O is not here: operations that free
//! stripes return them, and the caller deletes them from the stores.

use crate::placement::StoreId;
use serde::{Deserialize, Serialize};
use std::collections::{BTreeMap, BTreeSet, HashMap, HashSet};
use std::ffi::{OsStr, OsString};
use std::time::SystemTime;

pub type Ino = u64;
/// The root directory's inode number (FUSE's).
pub const ROOT: Ino = 1;
/// Longest name in a directory.
pub const NAME_MAX: usize = 255;

/// What an inode is.
#[derive(Clone, Debug, PartialEq, Serialize, Deserialize)]
pub enum Node {
    File {
        /// Stripe index → where it is. Absent: a hole (reads as zeros).
        stripes: BTreeMap<u64, Stripe>,
        /// The layout (index into the mount's layouts) its stripes were placed with.
        layout: u32,
    },
    Dir {
        entries: BTreeMap<OsString, Ino>,
        parent: Ino,
    },
    Symlink {
        target: OsString,
    },
}

/// One stripe's current version.
#[derive(Clone, Debug, PartialEq, Eq, Serialize, Deserialize)]
pub struct Stripe {
    /// A fresh number per write of the stripe (the store key; the sealing counter).
    pub version: u64,
    /// Bytes of the stored stripe that are file data; the rest of the stripe reads as
    /// zeros (a truncate shortens this without rewriting the stripe).
    pub len: u32,
    /// Bytes stored (the stripe as written, before any truncate).
    pub stored: u32,
    /// Stores holding a copy.
    pub copies: Vec<StoreId>,
}

/// An inode: attributes plus what it is.
#[derive(Clone, Debug, PartialEq, Serialize, Deserialize)]
pub struct Inode {
    pub ino: Ino,
    /// Permission bits (and set-id/sticky), without the file type.
    pub perm: u16,
    pub uid: u32,
    pub gid: u32,
    pub nlink: u32,
    pub size: u64,
    pub atime: SystemTime,
    pub mtime: SystemTime,
    pub ctime: SystemTime,
    pub node: Node,
    /// A name it was last reached by (for log lines about lost data).
    pub name: OsString,
    /// Open handles: the data stays while one is open, even after the last unlink.
    #[serde(skip)]
    pub open: u32,
    /// The kernel's references (FUSE's lookup count): until it forgets the inode the
    /// kernel may still send requests for it, even after the last unlink (it writes
    /// back the times it cached), so the inode stays until then.
    #[serde(skip)]
    pub lookups: u64,
}

impl Inode {
    pub fn is_dir(&self) -> bool {
        matches!(self.node, Node::Dir { .. })
    }

    /// No name, handle or kernel reference is left: the inode and its data can go.
    fn unreferenced(&self) -> bool {
        self.nlink == 0 && self.open == 0 && self.lookups == 0
    }

    /// Bytes the stores hold for one copy of the file's stripes (`st_blocks`): a
    /// stripe never written (a hole) holds none.
    pub fn stored_bytes(&self) -> u64 {
        match &self.node {
            Node::File { stripes, .. } => stripes.values().map(|s| u64::from(s.stored)).sum(),
            _ => 0,
        }
    }
}

/// A stripe a namespace operation freed: delete these copies from their stores.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct Freed {
    pub version: u64,
    /// Bytes each copy holds (before sealing).
    pub stored: u32,
    pub copies: Vec<StoreId>,
}

/// The namespace.
#[derive(Debug)]
pub struct Namespace {
    inodes: HashMap<Ino, Inode>,
    next: Ino,
    /// Inodes changed (or removed) since the last [`Namespace::take_changes`]: what the
    /// metadata's second copy has not seen yet. Every mutable access goes through
    /// [`Namespace::get_mut`], [`Namespace::put`] or [`Namespace::take`], which mark it.
    changed: HashSet<Ino>,
    /// Count of changes ever made (a change's sequence number; fsync waits until the
    /// copy has applied the one it saw).
    seq: u64,
}

/// What changed in a namespace since the last time it was asked: inodes as they are
/// now, and those gone.
#[derive(Clone, Debug, Default, PartialEq, Serialize, Deserialize)]
pub struct Changes {
    /// The namespace's change count these bring a copy up to.
    pub seq: u64,
    /// The next inode number to hand out.
    pub next: Ino,
    pub upserts: Vec<Inode>,
    pub removes: Vec<Ino>,
}

/// lseek SEEK_DATA/SEEK_HOLE over a file of `size` bytes cut into `stripe`-byte stripes,
/// where `next_data(i)` is the first stripe at or after `i` holding data. As Linux file
/// systems answer: ENXIO at or past the end; the end of the file is a hole.
fn seek_in(
    size: u64,
    stripe: u64,
    offset: u64,
    hole: bool,
    next_data: impl Fn(u64) -> Option<u64>,
) -> Result<u64, i32> {
    if offset >= size {
        return Err(libc::ENXIO);
    }
    let mut idx = offset / stripe;
    if hole {
        // Past the run of data stripes that starts here.
        while idx * stripe < size && next_data(idx) == Some(idx) {
            idx += 1;
        }
        Ok((idx * stripe).clamp(offset, size))
    } else {
        idx = next_data(idx).ok_or(libc::ENXIO)?;
        let at = (idx * stripe).max(offset);
        if at >= size {
            return Err(libc::ENXIO);
        }
        Ok(at)
    }
}

fn check_name(name: &OsStr) -> Result<(), i32> {
    if name.len() > NAME_MAX {
        return Err(libc::ENAMETOOLONG);
    }
    if name.is_empty() || name == "." || name == ".." {
        return Err(libc::EINVAL);
    }
    Ok(())
}

impl Default for Namespace {
    fn default() -> Self {
        Namespace::new(0o755, 0, 0)
    }
}

impl Namespace {
    /// An empty file system whose root has these attributes.
    pub fn new(perm: u16, uid: u32, gid: u32) -> Namespace {
        let now = SystemTime::now();
        let root = Inode {
            ino: ROOT,
            perm,
            uid,
            gid,
            nlink: 2,
            size: 0,
            atime: now,
            mtime: now,
            ctime: now,
            node: Node::Dir {
                entries: BTreeMap::new(),
                parent: ROOT,
            },
            name: "/".into(),
            open: 0,
            lookups: 0,
        };
        Namespace {
            inodes: HashMap::from([(ROOT, root)]),
            next: ROOT + 1,
            changed: HashSet::from([ROOT]),
            seq: 1,
        }
    }

    /// A namespace rebuilt from a copy's inodes. Inodes no name reaches any more (an
    /// unlinked file that was open when its mount died) are dropped: their stripes are
    /// returned for deleting.
    pub fn restore(inodes: HashMap<Ino, Inode>, next: Ino) -> (Namespace, Vec<Freed>) {
        let mut ns = Namespace {
            next: next.max(inodes.keys().max().copied().unwrap_or(ROOT) + 1),
            inodes,
            changed: HashSet::new(),
            seq: 0,
        };
        let orphans: Vec<Ino> = ns
            .inodes
            .values()
            .filter(|i| i.nlink == 0 && i.ino != ROOT)
            .map(|i| i.ino)
            .collect();
        let freed = orphans.into_iter().flat_map(|o| ns.remove(o)).collect();
        (ns, freed)
    }

    pub fn get(&self, ino: Ino) -> Result<&Inode, i32> {
        self.inodes.get(&ino).ok_or(libc::ENOENT)
    }

    /// An inode to change (marked changed for the metadata copy).
    pub fn get_mut(&mut self, ino: Ino) -> Result<&mut Inode, i32> {
        match self.inodes.get_mut(&ino) {
            Some(i) => {
                self.changed.insert(ino);
                self.seq += 1;
                Ok(i)
            }
            None => Err(libc::ENOENT),
        }
    }

    fn put(&mut self, i: Inode) {
        self.changed.insert(i.ino);
        self.seq += 1;
        self.inodes.insert(i.ino, i);
    }

    fn take(&mut self, ino: Ino) -> Option<Inode> {
        self.changed.insert(ino);
        self.seq += 1;
        self.inodes.remove(&ino)
    }

    /// The change count (see [`Changes::seq`]).
    pub fn seq(&self) -> u64 {
        self.seq
    }

    /// What changed since the last call (None: nothing).
    pub fn take_changes(&mut self) -> Option<Changes> {
        if self.changed.is_empty() {
            return None;
        }
        let mut c = Changes {
            seq: self.seq,
            next: self.next,
            ..Changes::default()
        };
        for ino in std::mem::take(&mut self.changed) {
            match self.inodes.get(&ino) {
                Some(i) => c.upserts.push(i.clone()),
                None => c.removes.push(ino),
            }
        }
        Some(c)
    }

    /// Everything, as changes to an empty copy (and nothing left marked changed).
    pub fn snapshot(&mut self) -> Changes {
        self.changed.clear();
        Changes {
            seq: self.seq,
            next: self.next,
            upserts: self.inodes.values().cloned().collect(),
            removes: Vec::new(),
        }
    }

    /// Every inode (status, recovery checks).
    pub fn inodes(&self) -> impl Iterator<Item = &Inode> {
        self.inodes.values()
    }

    fn entries(&self, dir: Ino) -> Result<&BTreeMap<OsString, Ino>, i32> {
        match &self.get(dir)?.node {
            Node::Dir { entries, .. } => Ok(entries),
            _ => Err(libc::ENOTDIR),
        }
    }

    fn entries_mut(&mut self, dir: Ino) -> Result<&mut BTreeMap<OsString, Ino>, i32> {
        match &mut self.get_mut(dir)?.node {
            Node::Dir { entries, .. } => Ok(entries),
            _ => Err(libc::ENOTDIR),
        }
    }

    pub fn lookup(&self, parent: Ino, name: &OsStr) -> Result<Ino, i32> {
        if name.len() > NAME_MAX {
            return Err(libc::ENAMETOOLONG);
        }
        let entries = self.entries(parent)?;
        if name == "." {
            return Ok(parent);
        }
        if name == ".." {
            return match &self.get(parent)?.node {
                Node::Dir { parent, .. } => Ok(*parent),
                _ => Err(libc::ENOTDIR),
            };
        }
        entries.get(name).copied().ok_or(libc::ENOENT)
    }

    fn touch_dir(&mut self, dir: Ino) {
        if let Ok(d) = self.get_mut(dir) {
            let now = SystemTime::now();
            d.mtime = now;
            d.ctime = now;
        }
    }

    /// Make a new inode named `name` in `parent`.
    fn make(
        &mut self,
        parent: Ino,
        name: &OsStr,
        perm: u16,
        uid: u32,
        gid: u32,
        node: Node,
    ) -> Result<Ino, i32> {
        check_name(name)?;
        if self.entries(parent)?.contains_key(name) {
            return Err(libc::EEXIST);
        }
        let ino = self.next;
        self.next += 1;
        let now = SystemTime::now();
        let is_dir = matches!(node, Node::Dir { .. });
        let size = match &node {
            Node::Symlink { target } => target.len() as u64,
            _ => 0,
        };
        self.put(Inode {
            ino,
            perm: perm & 0o7777,
            uid,
            gid,
            nlink: if is_dir { 2 } else { 1 },
            size,
            atime: now,
            mtime: now,
            ctime: now,
            node,
            name: name.to_owned(),
            open: 0,
            lookups: 0,
        });
        self.entries_mut(parent)?.insert(name.to_owned(), ino);
        if is_dir {
            if let Ok(p) = self.get_mut(parent) {
                p.nlink += 1;
            }
        }
        self.touch_dir(parent);
        Ok(ino)
    }

    pub fn create(
        &mut self,
        parent: Ino,
        name: &OsStr,
        perm: u16,
        uid: u32,
        gid: u32,
        layout: u32,
    ) -> Result<Ino, i32> {
        let node = Node::File {
            stripes: BTreeMap::new(),
            layout,
        };
        self.make(parent, name, perm, uid, gid, node)
    }

    pub fn mkdir(
        &mut self,
        parent: Ino,
        name: &OsStr,
        perm: u16,
        uid: u32,
        gid: u32,
    ) -> Result<Ino, i32> {
        let node = Node::Dir {
            entries: BTreeMap::new(),
            parent,
        };
        self.make(parent, name, perm, uid, gid, node)
    }

    pub fn symlink(
        &mut self,
        parent: Ino,
        name: &OsStr,
        target: &OsStr,
        uid: u32,
        gid: u32,
    ) -> Result<Ino, i32> {
        if target.len() > 4096 {
            return Err(libc::ENAMETOOLONG);
        }
        let node = Node::Symlink {
            target: target.to_owned(),
        };
        self.make(parent, name, 0o777, uid, gid, node)
    }

    /// A hard link to `ino` named `name` in `parent`.
    pub fn link(&mut self, ino: Ino, parent: Ino, name: &OsStr) -> Result<(), i32> {
        check_name(name)?;
        if self.get(ino)?.is_dir() {
            return Err(libc::EPERM);
        }
        if self.entries(parent)?.contains_key(name) {
            return Err(libc::EEXIST);
        }
        self.entries_mut(parent)?.insert(name.to_owned(), ino);
        let i = self.get_mut(ino)?;
        i.nlink += 1;
        i.ctime = SystemTime::now();
        self.touch_dir(parent);
        Ok(())
    }

    /// Drop one link of `ino`; its stripes when that was the last link and neither a
    /// handle nor the kernel refers to it.
    fn drop_link(&mut self, ino: Ino) -> Vec<Freed> {
        let Ok(i) = self.get_mut(ino) else {
            return Vec::new();
        };
        i.nlink = i.nlink.saturating_sub(1);
        i.ctime = SystemTime::now();
        if i.unreferenced() {
            return self.remove(ino);
        }
        Vec::new()
    }

    fn remove(&mut self, ino: Ino) -> Vec<Freed> {
        match self.take(ino).map(|i| i.node) {
            Some(Node::File { stripes, .. }) => stripes
                .into_values()
                .map(|s| Freed {
                    version: s.version,
                    stored: s.stored,
                    copies: s.copies,
                })
                .collect(),
            _ => Vec::new(),
        }
    }

    pub fn unlink(&mut self, parent: Ino, name: &OsStr) -> Result<Vec<Freed>, i32> {
        let ino = self.lookup(parent, name)?;
        if self.get(ino)?.is_dir() {
            return Err(libc::EISDIR);
        }
        self.entries_mut(parent)?.remove(name);
        self.touch_dir(parent);
        Ok(self.drop_link(ino))
    }

    pub fn rmdir(&mut self, parent: Ino, name: &OsStr) -> Result<(), i32> {
        if name == "." {
            return Err(libc::EINVAL);
        }
        if name == ".." {
            return Err(libc::ENOTEMPTY);
        }
        let ino = self.lookup(parent, name)?;
        if !self.entries(ino)?.is_empty() {
            return Err(libc::ENOTEMPTY);
        }
        self.entries_mut(parent)?.remove(name);
        self.take(ino);
        if let Ok(p) = self.get_mut(parent) {
            p.nlink = p.nlink.saturating_sub(1);
        }
        self.touch_dir(parent);
        Ok(())
    }

    /// Whether `dir` is `ancestor` or inside it.
    fn is_within(&self, mut dir: Ino, ancestor: Ino) -> bool {
        loop {
            if dir == ancestor {
                return true;
            }
            match self.inodes.get(&dir).map(|i| &i.node) {
                Some(Node::Dir { parent, .. }) if *parent != dir => dir = *parent,
                _ => return false,
            }
        }
    }

    /// rename(2): `noreplace` is RENAME_NOREPLACE. Returns what a replaced file freed.
    pub fn rename(
        &mut self,
        parent: Ino,
        name: &OsStr,
        newparent: Ino,
        newname: &OsStr,
        noreplace: bool,
    ) -> Result<Vec<Freed>, i32> {
        check_name(newname)?;
        let ino = self.lookup(parent, name)?;
        self.entries(newparent)?;
        let moving_dir = self.get(ino)?.is_dir();
        if moving_dir && self.is_within(newparent, ino) {
            return Err(libc::EINVAL);
        }
        let mut freed = Vec::new();
        if let Some(&old) = self.entries(newparent)?.get(newname) {
            if old == ino {
                return Ok(freed); // the same file: nothing to do
            }
            if noreplace {
                return Err(libc::EEXIST);
            }
            let old_is_dir = self.get(old)?.is_dir();
            match (moving_dir, old_is_dir) {
                (true, false) => return Err(libc::ENOTDIR),
                (false, true) => return Err(libc::EISDIR),
                (true, true) => {
                    if !self.entries(old)?.is_empty() {
                        return Err(libc::ENOTEMPTY);
                    }
                    self.entries_mut(newparent)?.remove(newname);
                    self.take(old);
                    if let Ok(p) = self.get_mut(newparent) {
                        p.nlink = p.nlink.saturating_sub(1);
                    }
                }
                (false, false) => {
                    self.entries_mut(newparent)?.remove(newname);
                    freed = self.drop_link(old);
                }
            }
        }
        self.entries_mut(parent)?.remove(name);
        self.entries_mut(newparent)?.insert(newname.to_owned(), ino);
        let i = self.get_mut(ino)?;
        i.name = newname.to_owned();
        i.ctime = SystemTime::now();
        if let Node::Dir { parent: p, .. } = &mut i.node {
            *p = newparent;
        }
        if moving_dir && parent != newparent {
            if let Ok(p) = self.get_mut(parent) {
                p.nlink = p.nlink.saturating_sub(1);
            }
            if let Ok(p) = self.get_mut(newparent) {
                p.nlink += 1;
            }
        }
        self.touch_dir(parent);
        self.touch_dir(newparent);
        Ok(freed)
    }

    /// Set a file's size: stripes wholly past the end are freed; the stripe holding the
    /// new end keeps only the bytes before it.
    pub fn truncate(&mut self, ino: Ino, size: u64, stripe: u64) -> Result<Vec<Freed>, i32> {
        let i = self.get_mut(ino)?;
        let Node::File { stripes, .. } = &mut i.node else {
            return Err(if i.is_dir() {
                libc::EISDIR
            } else {
                libc::EINVAL
            });
        };
        let mut freed = Vec::new();
        let first_gone = size.div_ceil(stripe);
        let gone: Vec<u64> = stripes.range(first_gone..).map(|(k, _)| *k).collect();
        for k in gone {
            if let Some(s) = stripes.remove(&k) {
                freed.push(Freed {
                    version: s.version,
                    stored: s.stored,
                    copies: s.copies,
                });
            }
        }
        if !size.is_multiple_of(stripe) {
            if let Some(s) = stripes.get_mut(&(size / stripe)) {
                let keep = (size % stripe) as u32;
                s.len = s.len.min(keep);
            }
        }
        i.size = size;
        let now = SystemTime::now();
        i.mtime = now;
        i.ctime = now;
        Ok(freed)
    }

    /// A handle was opened.
    pub fn opened(&mut self, ino: Ino) -> Result<(), i32> {
        // Not get_mut: the open count is not metadata the copy keeps.
        self.inodes.get_mut(&ino).ok_or(libc::ENOENT)?.open += 1;
        Ok(())
    }

    /// A handle was released; the data goes when it was the last one of an unlinked file.
    pub fn released(&mut self, ino: Ino) -> Vec<Freed> {
        // Not get_mut: the open count is not metadata the copy keeps.
        let Some(i) = self.inodes.get_mut(&ino) else {
            return Vec::new();
        };
        i.open = i.open.saturating_sub(1);
        if i.unreferenced() {
            return self.remove(ino);
        }
        Vec::new()
    }

    /// The kernel was given `ino` in an entry reply (lookup, create, mknod, mkdir,
    /// symlink, link): one more reference until it forgets.
    pub fn looked_up(&mut self, ino: Ino) {
        // Not get_mut: the kernel's references are not metadata the copy keeps.
        if let Some(i) = self.inodes.get_mut(&ino) {
            i.lookups += 1;
        }
    }

    /// The kernel forgot `n` references to `ino`; the data goes when that leaves an
    /// unlinked file with no handle open.
    pub fn forgotten(&mut self, ino: Ino, n: u64) -> Vec<Freed> {
        // Not get_mut: as in `looked_up`.
        let Some(i) = self.inodes.get_mut(&ino) else {
            return Vec::new();
        };
        i.lookups = i.lookups.saturating_sub(n);
        if i.unreferenced() && ino != ROOT {
            return self.remove(ino);
        }
        Vec::new()
    }

    /// Where lseek's SEEK_DATA (`hole` false) or SEEK_HOLE from `offset` lands in file
    /// `ino`, to the stripe: a stripe in the table or in `buffered` (written, not stored
    /// yet) is data, any other a hole. `buffered` None: data may be anywhere (pages the
    /// kernel has not sent yet), so the whole file is data.
    pub fn seek(
        &self,
        ino: Ino,
        offset: u64,
        hole: bool,
        stripe: u64,
        buffered: Option<&BTreeSet<u64>>,
    ) -> Result<u64, i32> {
        let i = self.get(ino)?;
        let Node::File { stripes, .. } = &i.node else {
            return Err(libc::EINVAL);
        };
        let Some(buffered) = buffered else {
            return match (offset < i.size, hole) {
                (false, _) => Err(libc::ENXIO),
                (true, true) => Ok(i.size),
                (true, false) => Ok(offset),
            };
        };
        // The first stripe at or after `from` holding data.
        let next_data = |from: u64| -> Option<u64> {
            let a = stripes.range(from..).next().map(|(k, _)| *k);
            let b = buffered.range(from..).next().copied();
            a.into_iter().chain(b).min()
        };
        seek_in(i.size, stripe, offset, hole, next_data)
    }

    /// Every stripe copy on `store`: (inode, stripe index, version), those with no other
    /// copy first.
    pub fn stripes_on(&self, store: StoreId) -> Vec<(Ino, u64, u64)> {
        let mut out = Vec::new();
        for i in self.inodes.values() {
            if let Node::File { stripes, .. } = &i.node {
                for (idx, s) in stripes {
                    if s.copies.contains(&store) {
                        out.push((s.copies.len(), (i.ino, *idx, s.version)));
                    }
                }
            }
        }
        // Stripes whose only copy is there come first: a drain racing a deadline moves
        // the ones that would be lost before those that would only lose a replica.
        out.sort_by_key(|(copies, _)| *copies);
        out.into_iter().map(|(_, s)| s).collect()
    }

    /// Stripes whose only copy is on `store`.
    pub fn sole_copies_on(&self, store: StoreId) -> usize {
        self.inodes
            .values()
            .filter_map(|i| match &i.node {
                Node::File { stripes, .. } => Some(stripes),
                _ => None,
            })
            .flat_map(|stripes| stripes.values())
            .filter(|s| s.copies == [store])
            .count()
    }

    /// Stripes with fewer copies than `want` (and those with none: lost).
    pub fn under_replicated(&self, want: usize) -> (u64, u64) {
        let (mut short, mut lost) = (0, 0);
        for i in self.inodes.values() {
            if let Node::File { stripes, .. } = &i.node {
                for s in stripes.values() {
                    if s.copies.is_empty() {
                        lost += 1;
                    } else if s.copies.len() < want {
                        short += 1;
                    }
                }
            }
        }
        (short, lost)
    }

    /// Files and directories in use (for statfs).
    pub fn count(&self) -> u64 {
        self.inodes.len() as u64
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn os(s: &str) -> &OsStr {
        OsStr::new(s)
    }

    fn stripe(version: u64, len: u32, store: StoreId) -> Stripe {
        Stripe {
            version,
            len,
            stored: len,
            copies: vec![store],
        }
    }

    fn add_stripes(ns: &mut Namespace, ino: Ino, n: u64) {
        if let Node::File { stripes, .. } = &mut ns.get_mut(ino).unwrap().node {
            for k in 0..n {
                stripes.insert(k, stripe(100 + k, 10, 1));
            }
        }
        ns.get_mut(ino).unwrap().size = n * 10;
    }

    #[test]
    fn stripes_on_a_store_list_sole_copies_first() {
        let mut ns = Namespace::default();
        let f = ns.create(ROOT, os("a"), 0o644, 0, 0, 0).unwrap();
        if let Node::File { stripes, .. } = &mut ns.get_mut(f).unwrap().node {
            for k in 0..6u64 {
                let mut s = stripe(100 + k, 10, 1);
                // Even stripes have a replica on store 2; odd ones live only on store 1.
                if k % 2 == 0 {
                    s.copies.push(2);
                }
                stripes.insert(k, s);
            }
        }
        let on1: Vec<u64> = ns.stripes_on(1).iter().map(|&(_, idx, _)| idx).collect();
        assert_eq!(on1.len(), 6);
        assert!(
            on1[..3].iter().all(|i| i % 2 == 1) && on1[3..].iter().all(|i| i % 2 == 0),
            "stripes with no other copy come first: {on1:?}"
        );
        assert_eq!(ns.stripes_on(2).len(), 3);
        assert_eq!(ns.sole_copies_on(1), 3);
        assert_eq!(ns.sole_copies_on(2), 0);
    }

    #[test]
    fn create_lookup_unlink() {
        let mut ns = Namespace::default();
        let f = ns.create(ROOT, os("a"), 0o644, 0, 0, 0).unwrap();
        assert_eq!(ns.lookup(ROOT, os("a")), Ok(f));
        assert_eq!(ns.create(ROOT, os("a"), 0o644, 0, 0, 0), Err(libc::EEXIST));
        add_stripes(&mut ns, f, 3);
        let freed = ns.unlink(ROOT, os("a")).unwrap();
        assert_eq!(freed.len(), 3);
        assert_eq!(ns.lookup(ROOT, os("a")), Err(libc::ENOENT));
        assert!(ns.get(f).is_err());
    }

    #[test]
    fn unlinked_open_file_keeps_its_data_until_release() {
        let mut ns = Namespace::default();
        let f = ns.create(ROOT, os("a"), 0o644, 0, 0, 0).unwrap();
        add_stripes(&mut ns, f, 2);
        ns.opened(f).unwrap();
        assert!(ns.unlink(ROOT, os("a")).unwrap().is_empty());
        assert!(ns.get(f).is_ok());
        assert_eq!(ns.released(f).len(), 2);
        assert!(ns.get(f).is_err());
    }

    #[test]
    fn an_unlinked_file_stays_until_the_kernel_forgets_it() {
        let mut ns = Namespace::default();
        let f = ns.create(ROOT, os("a"), 0o644, 0, 0, 0).unwrap();
        add_stripes(&mut ns, f, 2);
        ns.looked_up(f);
        ns.looked_up(f);
        assert!(ns.unlink(ROOT, os("a")).unwrap().is_empty());
        // The kernel writes back the times it cached after the unlink.
        ns.get_mut(f).expect("the inode is still there").mtime = SystemTime::now();
        assert!(ns.forgotten(f, 1).is_empty());
        assert_eq!(ns.forgotten(f, 1).len(), 2);
        assert!(ns.get(f).is_err());
        // A file that still has a name is only forgotten, never removed.
        let g = ns.create(ROOT, os("g"), 0o644, 0, 0, 0).unwrap();
        ns.looked_up(g);
        assert!(ns.forgotten(g, 1).is_empty());
        assert_eq!(ns.lookup(ROOT, os("g")), Ok(g));
        assert!(ns.forgotten(ROOT, 5).is_empty());
        assert!(ns.get(ROOT).is_ok());
    }

    #[test]
    fn seek_finds_holes_and_data_by_stripe() {
        let mut ns = Namespace::default();
        let f = ns.create(ROOT, os("a"), 0o644, 0, 0, 0).unwrap();
        // Stripes of 10 bytes: 2 and 3 stored, 6 buffered, the rest holes; 75 bytes.
        if let Node::File { stripes, .. } = &mut ns.get_mut(f).unwrap().node {
            stripes.insert(2, stripe(1, 10, 1));
            stripes.insert(3, stripe(2, 10, 1));
        }
        ns.get_mut(f).unwrap().size = 75;
        let buffered = BTreeSet::from([6]);
        let seek = |off, hole| ns.seek(f, off, hole, 10, Some(&buffered));
        assert_eq!(seek(0, false), Ok(20));
        assert_eq!(seek(25, false), Ok(25));
        assert_eq!(seek(40, false), Ok(60));
        assert_eq!(seek(71, false), Err(libc::ENXIO));
        assert_eq!(seek(0, true), Ok(0));
        assert_eq!(seek(21, true), Ok(40));
        assert_eq!(seek(45, true), Ok(45));
        assert_eq!(seek(60, true), Ok(70));
        assert_eq!(seek(75, true), Err(libc::ENXIO));
        ns.get_mut(f).unwrap().size = 65;
        assert_eq!(ns.seek(f, 61, true, 10, Some(&buffered)), Ok(65));
        assert_eq!(
            ns.seek(f, 64, false, 10, Some(&BTreeSet::new())),
            Err(libc::ENXIO)
        );
        // Data anywhere: the whole file is data.
        assert_eq!(ns.seek(f, 5, false, 10, None), Ok(5));
        assert_eq!(ns.seek(f, 5, true, 10, None), Ok(65));
        assert_eq!(ns.seek(f, 65, false, 10, None), Err(libc::ENXIO));
        assert_eq!(ns.seek(ROOT, 0, false, 10, None), Err(libc::EINVAL));
        assert_eq!(ns.get(f).unwrap().stored_bytes(), 20);
    }

    #[test]
    fn hard_links_share_data() {
        let mut ns = Namespace::default();
        let f = ns.create(ROOT, os("a"), 0o644, 0, 0, 0).unwrap();
        add_stripes(&mut ns, f, 1);
        ns.link(f, ROOT, os("b")).unwrap();
        assert_eq!(ns.get(f).unwrap().nlink, 2);
        assert!(ns.unlink(ROOT, os("a")).unwrap().is_empty());
        assert_eq!(ns.lookup(ROOT, os("b")), Ok(f));
        assert_eq!(ns.unlink(ROOT, os("b")).unwrap().len(), 1);
    }

    #[test]
    fn rename_over_a_file_frees_it() {
        let mut ns = Namespace::default();
        let a = ns.create(ROOT, os("a"), 0o644, 0, 0, 0).unwrap();
        let b = ns.create(ROOT, os("b"), 0o644, 0, 0, 0).unwrap();
        add_stripes(&mut ns, b, 2);
        assert_eq!(
            ns.rename(ROOT, os("a"), ROOT, os("b"), true),
            Err(libc::EEXIST)
        );
        assert_eq!(
            ns.rename(ROOT, os("a"), ROOT, os("b"), false)
                .unwrap()
                .len(),
            2
        );
        assert_eq!(ns.lookup(ROOT, os("b")), Ok(a));
        assert!(ns.get(b).is_err());
        assert_eq!(ns.lookup(ROOT, os("a")), Err(libc::ENOENT));
    }

    #[test]
    fn directory_rules() {
        let mut ns = Namespace::default();
        let d = ns.mkdir(ROOT, os("d"), 0o755, 0, 0).unwrap();
        let e = ns.mkdir(d, os("e"), 0o755, 0, 0).unwrap();
        assert_eq!(ns.get(ROOT).unwrap().nlink, 3);
        assert_eq!(ns.rmdir(ROOT, os("d")), Err(libc::ENOTEMPTY));
        assert_eq!(
            ns.rename(ROOT, os("d"), e, os("x"), false),
            Err(libc::EINVAL)
        );
        let f = ns.create(ROOT, os("f"), 0o644, 0, 0, 0).unwrap();
        assert_eq!(
            ns.rename(ROOT, os("f"), ROOT, os("d"), false),
            Err(libc::EISDIR)
        );
        assert_eq!(
            ns.rename(d, os("e"), ROOT, os("f"), false),
            Err(libc::ENOTDIR)
        );
        assert_eq!(ns.unlink(ROOT, os("d")), Err(libc::EISDIR));
        ns.rename(d, os("e"), ROOT, os("e2"), false).unwrap();
        assert_eq!(ns.lookup(e, os("..")), Ok(ROOT));
        assert_eq!(ns.get(d).unwrap().nlink, 2);
        ns.rmdir(ROOT, os("d")).unwrap();
        assert_eq!(ns.get(ROOT).unwrap().nlink, 3);
        let _ = f;
        assert_eq!(ns.lookup(f, os("x")), Err(libc::ENOTDIR));
        assert_eq!(
            ns.create(ROOT, OsStr::new(&"n".repeat(300)), 0o644, 0, 0, 0),
            Err(libc::ENAMETOOLONG)
        );
    }

    #[test]
    fn truncate_frees_stripes_past_the_end_and_shortens_the_last() {
        let mut ns = Namespace::default();
        let f = ns.create(ROOT, os("a"), 0o644, 0, 0, 0).unwrap();
        add_stripes(&mut ns, f, 4); // stripes of 10 bytes
        let freed = ns.truncate(f, 15, 10).unwrap();
        assert_eq!(freed.len(), 2);
        let Node::File { stripes, .. } = &ns.get(f).unwrap().node else {
            panic!()
        };
        assert_eq!(stripes.get(&1).unwrap().len, 5);
        assert_eq!(stripes.get(&0).unwrap().len, 10);
        assert_eq!(ns.get(f).unwrap().size, 15);
        assert!(ns.truncate(f, 0, 10).unwrap().len() == 2);
    }

    #[test]
    fn stripes_on_and_replication_counts() {
        let mut ns = Namespace::default();
        let f = ns.create(ROOT, os("a"), 0o644, 0, 0, 0).unwrap();
        add_stripes(&mut ns, f, 3);
        assert_eq!(ns.stripes_on(1).len(), 3);
        assert_eq!(ns.under_replicated(2), (3, 0));
        if let Node::File { stripes, .. } = &mut ns.get_mut(f).unwrap().node {
            stripes.get_mut(&0).unwrap().copies.clear();
        }
        assert_eq!(ns.under_replicated(2), (2, 1));
    }
}
