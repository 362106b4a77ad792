//! The FUSE side: the kernel's requests (through `fuser`, several session threads) mapped
//! onto the [`Engine`]. Each request runs on its session thread; data I/O blocks that
//! thread on the engine's tokio runtime, so requests from different threads proceed in
//! parallel while one waits for a store.
//!
//! Kernel settings it asks for: write-back caching (the page cache gathers small writes
//! into large ones and keeps `mmap` writable), writes of up to 1 MiB, the largest
//! readahead the kernel allows. Locks (`flock`, `fcntl`) are left to the kernel (local to
//! this machine), extended attributes and special files are refused with the errno
//! Linux file systems use for them, and ioctls with ENOTTY.
//!
//! An inode lives until the kernel forgets it (FUSE's lookup count), not only until its
//! last unlink: the kernel still writes back the times it cached for an unlinked file.
//! Sparse files show as such: `st_blocks` counts the stripes stored, and
//! SEEK_DATA/SEEK_HOLE find the stripes never written. `statfs` reports the space one
//! copy of each stripe can use (the raw space divided by `fs.replicas`).

use crate::engine::Engine;
use crate::meta::{Ino, Inode, Namespace, Node};
use fuser::{
    Errno, FileAttr, FileHandle, FileType, Filesystem, FopenFlags, Generation, INodeNo, IoctlFlags,
    KernelConfig, LockOwner, OpenAccMode, OpenFlags, RenameFlags, ReplyAttr, ReplyCreate,
    ReplyData, ReplyDirectory, ReplyEmpty, ReplyEntry, ReplyIoctl, ReplyLseek, ReplyOpen,
    ReplyStatfs, ReplyWrite, Request, TimeOrNow, WriteFlags,
};
use parking_lot::Mutex;
use std::collections::HashMap;
use std::ffi::OsStr;
use std::path::Path;
use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::Arc;
use std::time::{Duration, SystemTime};

/// How long the kernel may keep attributes and names: this mount is the only writer.
const TTL: Duration = Duration::from_secs(1);
/// Largest write the kernel is asked to send at once.
pub const MAX_WRITE: u32 = 1 << 20;

struct Handle {
    ino: Ino,
    /// Opened for writing: the kernel may hold pages written through it that it has not
    /// sent yet (write-back caching), until the handle is flushed and released.
    writable: bool,
    /// Where the last read ended: a read starting there is sequential (readahead).
    next: AtomicU64,
}

pub struct GranuleFs {
    engine: Arc<Engine>,
    handles: Mutex<HashMap<u64, Arc<Handle>>>,
    next_fh: AtomicU64,
}

fn errno(e: i32) -> Errno {
    Errno::from_i32(e)
}

fn kind_of(i: &Inode) -> FileType {
    match i.node {
        Node::File { .. } => FileType::RegularFile,
        Node::Dir { .. } => FileType::Directory,
        Node::Symlink { .. } => FileType::Symlink,
    }
}

impl GranuleFs {
    pub fn new(engine: Arc<Engine>) -> GranuleFs {
        GranuleFs {
            engine,
            handles: Mutex::new(HashMap::new()),
            next_fh: AtomicU64::new(1),
        }
    }

    fn attr(&self, i: &Inode) -> FileAttr {
        let blksize = self.engine.settings.stripe.clamp(4096, 1 << 20) as u32;
        // A file's blocks are the stripes stored (holes take none), so `du` and the
        // sparse-file checks of `cp` and `tar` see what is there.
        let blocks = match i.node {
            Node::File { .. } => i.stored_bytes().div_ceil(512),
            _ => i.size.div_ceil(512),
        };
        FileAttr {
            ino: INodeNo(i.ino),
            size: i.size,
            blocks,
            atime: i.atime,
            mtime: i.mtime,
            ctime: i.ctime,
            crtime: i.ctime,
            kind: kind_of(i),
            perm: i.perm,
            nlink: i.nlink,
            uid: i.uid,
            gid: i.gid,
            rdev: 0,
            blksize,
            flags: 0,
        }
    }

    fn attr_of(&self, ino: Ino) -> Result<FileAttr, i32> {
        let ns = self.engine.ns.lock();
        ns.get(ino).map(|i| self.attr(i))
    }

    /// The attributes of an entry reply: from the reply on the kernel holds one more
    /// reference to the inode, counted until it forgets it.
    fn entry_attr(&self, ns: &mut Namespace, ino: Ino) -> Result<FileAttr, i32> {
        let a = self.attr(ns.get(ino)?);
        ns.looked_up(ino);
        Ok(a)
    }

    fn open_handle(&self, ino: Ino, writable: bool) -> Result<u64, i32> {
        self.engine.ns.lock().opened(ino)?;
        Ok(self.new_handle(ino, writable))
    }

    /// A handle for an inode already counted open.
    fn new_handle(&self, ino: Ino, writable: bool) -> u64 {
        let fh = self.next_fh.fetch_add(1, Ordering::Relaxed);
        self.handles.lock().insert(
            fh,
            Arc::new(Handle {
                ino,
                writable,
                next: AtomicU64::new(0),
            }),
        );
        fh
    }

    fn block<T>(&self, f: impl std::future::Future<Output = T>) -> T {
        self.engine.rt.block_on(f)
    }
}

fn time(t: TimeOrNow) -> SystemTime {
    match t {
        TimeOrNow::SpecificTime(t) => t,
        TimeOrNow::Now => SystemTime::now(),
    }
}

impl Filesystem for GranuleFs {
    fn init(&mut self, _req: &Request, config: &mut KernelConfig) -> std::io::Result<()> {
        // No write-back cache: with it the kernel acknowledges write() from its page
        // cache, owns the file's size and sends the bytes later, so a full mount could
        // only fail the writeback, after the writer was told the bytes were written (and
        // the kernel would keep a size the mount never stored). Written through, every
        // write() is a request the engine answers, ENOSPC included; the engine's own
        // write-behind still gathers small writes into stripes.
        if let Err(max) = config.set_max_write(MAX_WRITE) {
            let _ = config.set_max_write(max);
        }
        if let Err(max) = config.set_max_readahead(MAX_WRITE) {
            let _ = config.set_max_readahead(max);
        }
        let _ = config.set_max_background(64);
        let _ = config.set_congestion_threshold(48);
        Ok(())
    }

    fn lookup(&self, _req: &Request, parent: INodeNo, name: &OsStr, reply: ReplyEntry) {
        let mut ns = self.engine.ns.lock();
        match ns
            .lookup(parent.0, name)
            .and_then(|ino| self.entry_attr(&mut ns, ino))
        {
            Ok(a) => reply.entry(&TTL, &a, Generation(0)),
            Err(e) => reply.error(errno(e)),
        }
    }

    fn forget(&self, _req: &Request, ino: INodeNo, nlookup: u64) {
        let freed = self.engine.ns.lock().forgotten(ino.0, nlookup);
        self.engine.release_freed(freed);
    }

    fn getattr(&self, _req: &Request, ino: INodeNo, _fh: Option<FileHandle>, reply: ReplyAttr) {
        match self.attr_of(ino.0) {
            Ok(a) => reply.attr(&TTL, &a),
            Err(e) => reply.error(errno(e)),
        }
    }

    fn setattr(
        &self,
        _req: &Request,
        ino: INodeNo,
        mode: Option<u32>,
        uid: Option<u32>,
        gid: Option<u32>,
        size: Option<u64>,
        atime: Option<TimeOrNow>,
        mtime: Option<TimeOrNow>,
        ctime: Option<SystemTime>,
        _fh: Option<FileHandle>,
        _crtime: Option<SystemTime>,
        _chgtime: Option<SystemTime>,
        _bkuptime: Option<SystemTime>,
        _flags: Option<fuser::BsdFileFlags>,
        reply: ReplyAttr,
    ) {
        if let Some(size) = size {
            if let Err(e) = self.block(self.engine.truncate(ino.0, size)) {
                return reply.error(errno(e));
            }
        }
        let mut ns = self.engine.ns.lock();
        let i = match ns.get_mut(ino.0) {
            Ok(i) => i,
            Err(e) => return reply.error(errno(e)),
        };
        let now = SystemTime::now();
        if let Some(m) = mode {
            i.perm = (m & 0o7777) as u16;
            i.ctime = now;
        }
        if let Some(u) = uid {
            i.uid = u;
            i.ctime = now;
        }
        if let Some(g) = gid {
            i.gid = g;
            i.ctime = now;
        }
        if let Some(t) = atime {
            i.atime = time(t);
            i.ctime = now;
        }
        if let Some(t) = mtime {
            i.mtime = time(t);
            i.ctime = now;
        }
        if let Some(t) = ctime {
            i.ctime = t;
        }
        let a = self.attr(i);
        drop(ns);
        reply.attr(&TTL, &a);
    }

    fn readlink(&self, _req: &Request, ino: INodeNo, reply: ReplyData) {
        let ns = self.engine.ns.lock();
        match ns.get(ino.0).map(|i| &i.node) {
            Ok(Node::Symlink { target }) => reply.data(target.as_encoded_bytes()),
            Ok(_) => reply.error(Errno::EINVAL),
            Err(e) => reply.error(errno(e)),
        }
    }

    fn mknod(
        &self,
        req: &Request,
        parent: INodeNo,
        name: &OsStr,
        mode: u32,
        umask: u32,
        _rdev: u32,
        reply: ReplyEntry,
    ) {
        if mode & libc::S_IFMT != libc::S_IFREG {
            // FIFOs, sockets and devices are not kept here.
            return reply.error(Errno::EPERM);
        }
        let mut ns = self.engine.ns.lock();
        let perm = (mode & !umask & 0o7777) as u16;
        let layout = self.engine.current_layout();
        match ns
            .create(parent.0, name, perm, req.uid(), req.gid(), layout)
            .and_then(|ino| self.entry_attr(&mut ns, ino))
        {
            Ok(a) => reply.entry(&TTL, &a, Generation(0)),
            Err(e) => reply.error(errno(e)),
        }
    }

    fn mkdir(
        &self,
        req: &Request,
        parent: INodeNo,
        name: &OsStr,
        mode: u32,
        umask: u32,
        reply: ReplyEntry,
    ) {
        let mut ns = self.engine.ns.lock();
        let perm = (mode & !umask & 0o7777) as u16;
        match ns
            .mkdir(parent.0, name, perm, req.uid(), req.gid())
            .and_then(|ino| self.entry_attr(&mut ns, ino))
        {
            Ok(a) => reply.entry(&TTL, &a, Generation(0)),
            Err(e) => reply.error(errno(e)),
        }
    }

    fn unlink(&self, _req: &Request, parent: INodeNo, name: &OsStr, reply: ReplyEmpty) {
        let r = self.engine.ns.lock().unlink(parent.0, name);
        match r {
            Ok(freed) => {
                self.engine.release_freed(freed);
                reply.ok()
            }
            Err(e) => reply.error(errno(e)),
        }
    }

    fn rmdir(&self, _req: &Request, parent: INodeNo, name: &OsStr, reply: ReplyEmpty) {
        match self.engine.ns.lock().rmdir(parent.0, name) {
            Ok(()) => reply.ok(),
            Err(e) => reply.error(errno(e)),
        }
    }

    fn symlink(
        &self,
        req: &Request,
        parent: INodeNo,
        link_name: &OsStr,
        target: &Path,
        reply: ReplyEntry,
    ) {
        let mut ns = self.engine.ns.lock();
        match ns
            .symlink(
                parent.0,
                link_name,
                target.as_os_str(),
                req.uid(),
                req.gid(),
            )
            .and_then(|ino| self.entry_attr(&mut ns, ino))
        {
            Ok(a) => reply.entry(&TTL, &a, Generation(0)),
            Err(e) => reply.error(errno(e)),
        }
    }

    fn rename(
        &self,
        _req: &Request,
        parent: INodeNo,
        name: &OsStr,
        newparent: INodeNo,
        newname: &OsStr,
        flags: RenameFlags,
        reply: ReplyEmpty,
    ) {
        if flags.intersects(RenameFlags::RENAME_EXCHANGE | RenameFlags::RENAME_WHITEOUT) {
            return reply.error(Errno::EINVAL);
        }
        let noreplace = flags.contains(RenameFlags::RENAME_NOREPLACE);
        let r = self
            .engine
            .ns
            .lock()
            .rename(parent.0, name, newparent.0, newname, noreplace);
        match r {
            Ok(freed) => {
                self.engine.release_freed(freed);
                reply.ok()
            }
            Err(e) => reply.error(errno(e)),
        }
    }

    fn link(
        &self,
        _req: &Request,
        ino: INodeNo,
        newparent: INodeNo,
        newname: &OsStr,
        reply: ReplyEntry,
    ) {
        let mut ns = self.engine.ns.lock();
        match ns
            .link(ino.0, newparent.0, newname)
            .and_then(|()| self.entry_attr(&mut ns, ino.0))
        {
            Ok(a) => reply.entry(&TTL, &a, Generation(0)),
            Err(e) => reply.error(errno(e)),
        }
    }

    fn open(&self, _req: &Request, ino: INodeNo, flags: OpenFlags, reply: ReplyOpen) {
        {
            let ns = self.engine.ns.lock();
            match ns.get(ino.0) {
                Ok(i) if i.is_dir() => return reply.error(Errno::EISDIR),
                Ok(_) => {}
                Err(e) => return reply.error(errno(e)),
            }
        }
        let writable = flags.acc_mode() != OpenAccMode::O_RDONLY;
        match self.open_handle(ino.0, writable) {
            // This mount is the only writer: what the page cache holds stays valid.
            Ok(fh) => reply.opened(FileHandle(fh), FopenFlags::FOPEN_KEEP_CACHE),
            Err(e) => reply.error(errno(e)),
        }
    }

    fn read(
        &self,
        _req: &Request,
        ino: INodeNo,
        fh: FileHandle,
        offset: u64,
        size: u32,
        _flags: OpenFlags,
        _lock_owner: Option<LockOwner>,
        reply: ReplyData,
    ) {
        let h = self.handles.lock().get(&fh.0).cloned();
        let sequential = h
            .as_ref()
            .is_some_and(|h| h.next.load(Ordering::Relaxed) == offset);
        match self.block(self.engine.read(ino.0, offset, size, sequential)) {
            Ok(d) => {
                let d = d.as_slice();
                if let Some(h) = h {
                    h.next.store(offset + d.len() as u64, Ordering::Relaxed);
                }
                reply.data(d)
            }
            Err(e) => reply.error(errno(e)),
        }
    }

    fn write(
        &self,
        _req: &Request,
        ino: INodeNo,
        _fh: FileHandle,
        offset: u64,
        data: &[u8],
        _write_flags: WriteFlags,
        _flags: OpenFlags,
        _lock_owner: Option<LockOwner>,
        reply: ReplyWrite,
    ) {
        match self.block(self.engine.write(ino.0, offset, data)) {
            Ok(n) => reply.written(n as u32),
            Err(e) => reply.error(errno(e)),
        }
    }

    fn flush(
        &self,
        _req: &Request,
        ino: INodeNo,
        _fh: FileHandle,
        _lock_owner: LockOwner,
        reply: ReplyEmpty,
    ) {
        match self.block(self.engine.sync(ino.0)) {
            Ok(()) => reply.ok(),
            Err(e) => reply.error(errno(e)),
        }
    }

    fn release(
        &self,
        _req: &Request,
        ino: INodeNo,
        fh: FileHandle,
        _flags: OpenFlags,
        _lock_owner: Option<LockOwner>,
        _flush: bool,
        reply: ReplyEmpty,
    ) {
        self.handles.lock().remove(&fh.0);
        // Buffered stripes go out now; errors were reported at flush.
        self.block(self.engine.flush_buffers(ino.0));
        let freed = self.engine.ns.lock().released(ino.0);
        self.engine.release_freed(freed);
        reply.ok();
    }

    fn fsync(
        &self,
        _req: &Request,
        ino: INodeNo,
        _fh: FileHandle,
        _datasync: bool,
        reply: ReplyEmpty,
    ) {
        match self.block(self.engine.fsync(ino.0)) {
            Ok(()) => reply.ok(),
            Err(e) => reply.error(errno(e)),
        }
    }

    fn opendir(&self, _req: &Request, ino: INodeNo, _flags: OpenFlags, reply: ReplyOpen) {
        let ns = self.engine.ns.lock();
        match ns.get(ino.0) {
            Ok(i) if i.is_dir() => reply.opened(FileHandle(0), FopenFlags::empty()),
            Ok(_) => reply.error(Errno::ENOTDIR),
            Err(e) => reply.error(errno(e)),
        }
    }

    fn readdir(
        &self,
        _req: &Request,
        ino: INodeNo,
        _fh: FileHandle,
        offset: u64,
        mut reply: ReplyDirectory,
    ) {
        let ns = self.engine.ns.lock();
        let (entries, parent) = match ns.get(ino.0).map(|i| &i.node) {
            Ok(Node::Dir { entries, parent }) => (entries, *parent),
            Ok(_) => return reply.error(Errno::ENOTDIR),
            Err(e) => return reply.error(errno(e)),
        };
        let dots = [
            (ino.0, FileType::Directory, OsStr::new(".")),
            (parent, FileType::Directory, OsStr::new("..")),
        ];
        let rest = entries.iter().map(|(name, &child)| {
            let kind = ns.get(child).map(kind_of).unwrap_or(FileType::RegularFile);
            (child, kind, name.as_os_str())
        });
        for (n, (child, kind, name)) in dots
            .into_iter()
            .chain(rest)
            .enumerate()
            .skip(offset as usize)
        {
            if reply.add(INodeNo(child), (n + 1) as u64, kind, name) {
                break;
            }
        }
        reply.ok();
    }

    fn fsyncdir(
        &self,
        _req: &Request,
        _ino: INodeNo,
        _fh: FileHandle,
        _datasync: bool,
        reply: ReplyEmpty,
    ) {
        // Metadata changes take effect when they are made; fsync makes them survive the
        // mount process (on the metadata copy).
        self.block(self.engine.sync_meta());
        reply.ok();
    }

    fn statfs(&self, _req: &Request, _ino: INodeNo, reply: ReplyStatfs) {
        const BLOCK: u64 = 4096;
        // What files can use: each stripe takes `replicas` copies of the raw space.
        let copies = self.engine.settings.replicas.max(1) as u64;
        let (cap, used) = self.engine.space();
        let blocks = cap / copies / BLOCK;
        let free = (cap.saturating_sub(used) / copies / BLOCK).min(blocks);
        let files = self.engine.ns.lock().count();
        let max_files = 1u64 << 32;
        reply.statfs(
            blocks,
            free,
            free,
            max_files,
            max_files.saturating_sub(files),
            BLOCK as u32,
            crate::meta::NAME_MAX as u32,
            BLOCK as u32,
        );
    }

    fn access(&self, _req: &Request, ino: INodeNo, _mask: fuser::AccessFlags, reply: ReplyEmpty) {
        // Permissions are checked by the kernel (default_permissions).
        match self.engine.ns.lock().get(ino.0) {
            Ok(_) => reply.ok(),
            Err(e) => reply.error(errno(e)),
        }
    }

    fn create(
        &self,
        req: &Request,
        parent: INodeNo,
        name: &OsStr,
        mode: u32,
        umask: u32,
        flags: i32,
        reply: ReplyCreate,
    ) {
        let perm = (mode & !umask & 0o7777) as u16;
        let layout = self.engine.current_layout();
        let r = {
            let mut ns = self.engine.ns.lock();
            ns.create(parent.0, name, perm, req.uid(), req.gid(), layout)
                .and_then(|ino| {
                    ns.opened(ino)?;
                    self.entry_attr(&mut ns, ino)
                })
        };
        let attr = match r {
            Ok(a) => a,
            Err(e) => return reply.error(errno(e)),
        };
        let fh = self.new_handle(attr.ino.0, flags & libc::O_ACCMODE != libc::O_RDONLY);
        reply.created(
            &TTL,
            &attr,
            Generation(0),
            FileHandle(fh),
            FopenFlags::FOPEN_KEEP_CACHE,
        );
    }

    // Extended attributes are not kept: ENOSYS tells the kernel once, and it then answers
    // EOPNOTSUPP itself without asking again (no request per write for
    // security.capability).
    fn getxattr(
        &self,
        _req: &Request,
        _ino: INodeNo,
        _name: &OsStr,
        _size: u32,
        reply: fuser::ReplyXattr,
    ) {
        reply.error(Errno::ENOSYS);
    }

    fn listxattr(&self, _req: &Request, _ino: INodeNo, _size: u32, reply: fuser::ReplyXattr) {
        reply.error(Errno::ENOSYS);
    }

    fn setxattr(
        &self,
        _req: &Request,
        _ino: INodeNo,
        _name: &OsStr,
        _value: &[u8],
        _flags: i32,
        _position: u32,
        reply: ReplyEmpty,
    ) {
        reply.error(Errno::ENOSYS);
    }

    fn removexattr(&self, _req: &Request, _ino: INodeNo, _name: &OsStr, reply: ReplyEmpty) {
        reply.error(Errno::ENOSYS);
    }

    fn fallocate(
        &self,
        _req: &Request,
        ino: INodeNo,
        _fh: FileHandle,
        offset: u64,
        length: u64,
        mode: i32,
        reply: ReplyEmpty,
    ) {
        if mode & !libc::FALLOC_FL_KEEP_SIZE != 0 {
            // Punching holes, collapsing and zeroing ranges are not supported.
            return reply.error(Errno::EOPNOTSUPP);
        }
        let Some(end) = offset.checked_add(length) else {
            return reply.error(Errno::EFBIG);
        };
        let size = match self.engine.ns.lock().get(ino.0) {
            Ok(i) if i.is_dir() => return reply.error(Errno::EISDIR),
            Ok(i) => i.size,
            Err(e) => return reply.error(errno(e)),
        };
        // Room is claimed when stripes are written; here it must at least exist.
        let grow = end.saturating_sub(size) * self.engine.settings.replicas as u64;
        let (cap, used) = self.engine.space();
        if used + grow > cap {
            return reply.error(Errno::ENOSPC);
        }
        if mode & libc::FALLOC_FL_KEEP_SIZE == 0 && end > size {
            if let Err(e) = self.block(self.engine.truncate(ino.0, end)) {
                return reply.error(errno(e));
            }
        }
        reply.ok();
    }

    fn lseek(
        &self,
        _req: &Request,
        ino: INodeNo,
        _fh: FileHandle,
        offset: i64,
        whence: i32,
        reply: ReplyLseek,
    ) {
        // The kernel answers SEEK_SET, SEEK_CUR and SEEK_END itself.
        let hole = match whence {
            libc::SEEK_DATA => false,
            libc::SEEK_HOLE => true,
            _ => return reply.error(Errno::EINVAL),
        };
        // A negative offset is past any end, as the kernel's own lseek treats it.
        let Ok(offset) = u64::try_from(offset) else {
            return reply.error(Errno::ENXIO);
        };
        let unsent = self
            .handles
            .lock()
            .values()
            .any(|h| h.ino == ino.0 && h.writable);
        match self.engine.seek(ino.0, offset, hole, unsent) {
            Ok(at) => reply.offset(at as i64),
            Err(e) => reply.error(errno(e)),
        }
    }

    fn ioctl(
        &self,
        _req: &Request,
        ino: INodeNo,
        _fh: FileHandle,
        _flags: IoctlFlags,
        cmd: u32,
        _in_data: &[u8],
        _out_size: u32,
        reply: ReplyIoctl,
    ) {
        // No ioctl is supported. Every isatty() asks (TCGETS), so this is no news.
        tracing::debug!(ino = ino.0, cmd, "ioctl refused: ENOTTY");
        reply.error(Errno::ENOTTY);
    }
}
