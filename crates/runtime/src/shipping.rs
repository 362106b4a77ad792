//! Code shipping under the identical-binary rule — the only module with `unsafe` code.
//!
//! A closure given to `Proclet::run` must capture nothing, so its type is zero-sized and
//! a value of it carries no information: the code *is* the type. For every (closure,
//! state, argument, return) combination the compiler instantiates a trampoline (decode
//! the argument, conjure the closure, call it on the state, encode the result) and this
//! module places a [`Descriptor`] for it in the binary's read-only data: a magic number,
//! the `TypeId`s of the four types, and a pointer to the trampoline. What travels is the
//! descriptor's offset from a fixed anchor in the binary plus a fingerprint of the types.
//! Every host runs the identical executable (checked by blake3 hash at the hello), so the
//! same offset names the same descriptor everywhere, whatever address space layout the
//! loader chose.
//!
//! Before anything is called through a received offset ([`resolve`]):
//! 1. the descriptor's address must lie, aligned, inside a readable mapping of this
//!    process's own executable (read from `/proc/self/maps` once);
//! 2. it must start with the magic number and be of the expected kind;
//! 3. its trampoline pointer must lie inside an executable mapping of the executable
//!    (the code section);
//! 4. the fingerprint recomputed from the descriptor must equal the one in the frame,
//!    and the caller checks its state `TypeId` against the proclet's actual state.
//!
//! Only code-carrying frames on connections whose peer passed the hash handshake reach
//! this module; the transport and the node's request handler enforce that.
#![allow(unsafe_code)]

use granule_wire::{CodeRef, RemoteError};
use serde::{de::DeserializeOwned, Serialize};
use std::any::{Any, TypeId};
use std::hash::{Hash, Hasher};
use std::marker::PhantomData;
use std::ops::Range;
use std::panic::{catch_unwind, AssertUnwindSafe};
use std::sync::OnceLock;

/// Type-erased proclet state as stored in a proclet's slot.
pub(crate) type ErasedState = dyn Any + Send + Sync;

/// Trampoline for an exclusive (`&mut S`) call: decode the argument from `arg`, run the
/// closure, append the encoded result to `out`.
pub(crate) type CallMutFn = fn(&mut ErasedState, &[u8], &mut Vec<u8>) -> Result<(), RemoteError>;
/// Trampoline for a shared (`&S`) call.
pub(crate) type CallRefFn = fn(&ErasedState, &[u8], &mut Vec<u8>) -> Result<(), RemoteError>;
/// Trampoline that builds a state from an encoded constructor argument.
pub(crate) type CtorFn = fn(&[u8]) -> Result<Box<ErasedState>, RemoteError>;
/// Encode a state (for moves) in chunks of the given size, each handed to the sink.
pub(crate) type EncodeStateFn =
    fn(&ErasedState, usize, &mut crate::codec::ChunkSink<'_>) -> Result<(), RemoteError>;
/// Decode a state (for moves).
pub(crate) type DecodeStateFn = fn(&[u8]) -> Result<Box<ErasedState>, RemoteError>;
/// Take a plain byte-vector state (`Vec<u8>`) out as is; other states come back unchanged.
pub(crate) type IntoRawFn = fn(Box<ErasedState>) -> Result<Vec<u8>, Box<ErasedState>>;
/// Make a state from the bytes `IntoRawFn` gave (only for `Vec<u8>` states).
pub(crate) type FromRawFn = fn(Vec<u8>) -> Option<Box<ErasedState>>;
/// The state's memory footprint in bytes (exact or estimated, see `StateOps::exact`).
pub(crate) type FootprintFn = fn(&ErasedState) -> u64;

/// What the runtime does with a state type: move it and account for it.
#[derive(Clone, Copy)]
pub(crate) struct StateOps {
    pub encode: EncodeStateFn,
    pub decode: DecodeStateFn,
    pub into_raw: IntoRawFn,
    pub from_raw: FromRawFn,
    pub footprint: FootprintFn,
    /// Options that travel with the state wherever it moves ([`MUTATING_READS`],
    /// [`OWNER_PLACED`]).
    pub flags: u8,
}

/// State flag: its read-only calls change it through interior mutability (a lock, an
/// atomic), so a move must hold them like writes (`ProcletBuilder::mutating_reads`).
pub(crate) const MUTATING_READS: u8 = 1;
/// State flag: its creator decides where it runs, so the pressure policy never moves it
/// (`ProcletBuilder::owner_placed`).
pub(crate) const OWNER_PLACED: u8 = 2;

impl StateOps {
    pub(crate) fn mutating_reads(&self) -> bool {
        self.flags & MUTATING_READS != 0
    }

    pub(crate) fn owner_placed(&self) -> bool {
        self.flags & OWNER_PLACED != 0
    }
}

const MAGIC: [u64; 2] = [0x4752_414e_554c_4521, 0x7368_6970_7065_6421];

/// What a descriptor describes and its entry point(s).
#[derive(Clone, Copy)]
pub(crate) enum Entry {
    CallMut(CallMutFn),
    CallRef(CallRefFn),
    Ctor(CtorFn),
    State(StateOps),
}

impl Entry {
    fn kind_tag(&self) -> u8 {
        match self {
            Entry::CallMut(_) => 1,
            Entry::CallRef(_) => 2,
            Entry::Ctor(_) => 3,
            Entry::State(_) => 4,
        }
    }

    fn code_addrs(&self) -> [usize; 5] {
        match *self {
            Entry::CallMut(f) => [f as usize; 5],
            Entry::CallRef(f) => [f as usize; 5],
            Entry::Ctor(f) => [f as usize; 5],
            Entry::State(o) => [
                o.encode as usize,
                o.decode as usize,
                o.into_raw as usize,
                o.from_raw as usize,
                o.footprint as usize,
            ],
        }
    }
}

/// A shipped-code descriptor; lives in the binary's read-only data.
#[repr(C)]
pub(crate) struct Descriptor {
    magic: [u64; 2],
    /// TypeIds of (closure, state, argument, return); `()` where not applicable.
    types: [TypeId; 4],
    pub(crate) entry: Entry,
}

impl Descriptor {
    /// TypeId of the proclet state this descriptor works on.
    pub(crate) fn state_type(&self) -> TypeId {
        self.types[1]
    }

    /// Fingerprint of the descriptor's kind and types (FNV-1a over their hashes; the
    /// standard `TypeId` hash is a stable function of the id within one binary).
    pub(crate) fn fingerprint(&self) -> u64 {
        struct Fnv(u64);
        impl Hasher for Fnv {
            fn finish(&self) -> u64 {
                self.0
            }
            fn write(&mut self, bytes: &[u8]) {
                for b in bytes {
                    self.0 ^= *b as u64;
                    self.0 = self.0.wrapping_mul(0x100_0000_01b3);
                }
            }
        }
        let mut h = Fnv(0xcbf2_9ce4_8422_2325);
        h.write_u8(self.entry.kind_tag());
        for t in &self.types {
            t.hash(&mut h);
        }
        h.finish()
    }
}

/// The fixed point offsets are measured from.
static ANCHOR: u8 = 0;

fn anchor() -> usize {
    &ANCHOR as *const u8 as usize
}

/// The [`CodeRef`] (offset + fingerprint) that names `d` in any process of this binary.
pub(crate) fn code_ref(d: &'static Descriptor) -> CodeRef {
    CodeRef {
        offset: (d as *const Descriptor as usize).wrapping_sub(anchor()) as i64,
        fingerprint: d.fingerprint(),
    }
}

// ---- trampolines and their descriptors ----------------------------------------------

/// Produce the value of a zero-sized closure type.
pub(crate) fn conjure<F>() -> F {
    const { assert!(std::mem::size_of::<F>() == 0) };
    // SAFETY: `F` is zero-sized (asserted at compile time above), so reading it touches no
    // memory and a dangling, well-aligned pointer is a valid source. `F` is inhabited: the
    // only way to name this instantiation is through `Proclet::run` & co.,
    // `Proclet::run_with` & co. (which conjure the wrapped closure and its wrapper, both
    // received as values) and `RangeJob::start`, which receive a value of `F` on the
    // sending side. A capture-less closure has no invariants of its
    // own; a closure capturing only zero-sized values would get those values conjured too,
    // which is documented on `Proclet::run` (capture nothing).
    unsafe { std::ptr::NonNull::<F>::dangling().as_ptr().read() }
}

pub(crate) fn panic_message(p: Box<dyn Any + Send>) -> String {
    if let Some(s) = p.downcast_ref::<&str>() {
        (*s).to_string()
    } else if let Some(s) = p.downcast_ref::<String>() {
        s.clone()
    } else {
        "panic with a non-string payload".to_string()
    }
}

fn decode<T: DeserializeOwned>(bytes: &[u8], what: &str) -> Result<T, RemoteError> {
    postcard::from_bytes(bytes).map_err(|e| {
        RemoteError::Decode(format!(
            "cannot decode the {what} as {}: {e}",
            std::any::type_name::<T>()
        ))
    })
}

thread_local! {
    /// Set while [`with_blobs_left_out`] runs: return values leave their large blobs out.
    static LEAVE_BLOBS: std::cell::Cell<bool> = const { std::cell::Cell::new(false) };
    /// The blobs they left out, with where each belongs in the frame.
    static LEFT_OUT: std::cell::RefCell<Vec<(usize, bytes::Bytes)>> =
        const { std::cell::RefCell::new(Vec::new()) };
}

/// Run `f` (which encodes a call's return value into a frame buffer through
/// [`encode_into`]) so that the value's large [`granule_wire::Blob`]s stay out of the
/// buffer; returns them with the offsets their bytes belong at, for a vectored send.
pub(crate) fn with_blobs_left_out<R>(f: impl FnOnce() -> R) -> (R, Vec<(usize, bytes::Bytes)>) {
    struct Reset;
    impl Drop for Reset {
        fn drop(&mut self) {
            LEAVE_BLOBS.with(|l| l.set(false));
        }
    }
    LEFT_OUT.with(|l| l.borrow_mut().clear());
    LEAVE_BLOBS.with(|l| l.set(true));
    let reset = Reset;
    let r = f();
    drop(reset);
    (r, LEFT_OUT.with(|l| std::mem::take(&mut *l.borrow_mut())))
}

pub(crate) fn encode_into<T: Serialize>(
    v: &T,
    out: &mut Vec<u8>,
    what: &str,
) -> Result<(), RemoteError> {
    if LEAVE_BLOBS.with(|l| l.replace(false)) {
        // Only the outermost encoding (the return value itself) leaves blobs out.
        let r = granule_wire::blob::encode_leaving_blobs(v, out);
        LEAVE_BLOBS.with(|l| l.set(true));
        return match r {
            Ok(holes) => {
                LEFT_OUT.with(|l| l.borrow_mut().extend(holes));
                Ok(())
            }
            Err(e) => Err(RemoteError::Decode(format!(
                "cannot encode the {what} ({}): {e}",
                std::any::type_name::<T>()
            ))),
        };
    }
    let buf = std::mem::take(out);
    match postcard::to_extend(v, buf) {
        Ok(b) => {
            *out = b;
            Ok(())
        }
        Err(e) => Err(RemoteError::Decode(format!(
            "cannot encode the {what} ({}): {e}",
            std::any::type_name::<T>()
        ))),
    }
}

fn state_mismatch<S>() -> RemoteError {
    RemoteError::CodeMismatch(format!(
        "the proclet's state is not a {}",
        std::any::type_name::<S>()
    ))
}

fn call_mut_tramp<S, A, R, F>(
    state: &mut ErasedState,
    arg: &[u8],
    out: &mut Vec<u8>,
) -> Result<(), RemoteError>
where
    S: 'static,
    A: DeserializeOwned,
    R: Serialize,
    F: Fn(&mut S, A) -> R,
{
    let s = state.downcast_mut::<S>().ok_or_else(state_mismatch::<S>)?;
    let a: A = decode(arg, "argument")?;
    let f: F = conjure();
    let r = catch_unwind(AssertUnwindSafe(|| f(s, a)))
        .map_err(|p| RemoteError::Panic(panic_message(p)))?;
    encode_into(&r, out, "return value")
}

fn call_ref_tramp<S, A, R, F>(
    state: &ErasedState,
    arg: &[u8],
    out: &mut Vec<u8>,
) -> Result<(), RemoteError>
where
    S: 'static,
    A: DeserializeOwned,
    R: Serialize,
    F: Fn(&S, A) -> R,
{
    let s = state.downcast_ref::<S>().ok_or_else(state_mismatch::<S>)?;
    let a: A = decode(arg, "argument")?;
    let f: F = conjure();
    let r = catch_unwind(AssertUnwindSafe(|| f(s, a)))
        .map_err(|p| RemoteError::Panic(panic_message(p)))?;
    encode_into(&r, out, "return value")
}

fn ctor_tramp<S, A, F>(arg: &[u8]) -> Result<Box<ErasedState>, RemoteError>
where
    S: Send + Sync + 'static,
    A: DeserializeOwned,
    F: Fn(A) -> S,
{
    let a: A = decode(arg, "constructor argument")?;
    let f: F = conjure();
    let s = catch_unwind(AssertUnwindSafe(|| f(a)))
        .map_err(|p| RemoteError::Panic(panic_message(p)))?;
    Ok(Box::new(s))
}

fn encode_state<S: Serialize + 'static>(
    state: &ErasedState,
    chunk: usize,
    sink: &mut crate::codec::ChunkSink<'_>,
) -> Result<(), RemoteError> {
    let s = state.downcast_ref::<S>().ok_or_else(state_mismatch::<S>)?;
    crate::codec::encode_chunked(s, chunk, sink)
}

fn is_byte_vec<S: 'static>() -> bool {
    TypeId::of::<S>() == TypeId::of::<Vec<u8>>()
}

fn into_raw<S: 'static>(state: Box<ErasedState>) -> Result<Vec<u8>, Box<ErasedState>> {
    if !is_byte_vec::<S>() {
        return Err(state);
    }
    state.downcast::<Vec<u8>>().map(|b| *b)
}

fn from_raw<S: 'static>(bytes: Vec<u8>) -> Option<Box<ErasedState>> {
    is_byte_vec::<S>().then(|| Box::new(bytes) as Box<ErasedState>)
}

/// Estimated footprint: a byte vector's capacity, else the length of the encoding.
fn estimated_footprint<S: Serialize + 'static>(state: &ErasedState) -> u64 {
    if let Some(v) = state.downcast_ref::<Vec<u8>>() {
        return (std::mem::size_of::<Vec<u8>>() + v.capacity()) as u64;
    }
    state
        .downcast_ref::<S>()
        .map_or(0, |s| crate::footprint::encoded_len(s))
}

fn exact_footprint<S: crate::footprint::Footprint + 'static>(state: &ErasedState) -> u64 {
    state.downcast_ref::<S>().map_or(0, |s| s.footprint())
}

fn decode_state<S: DeserializeOwned + Send + Sync + 'static>(
    bytes: &[u8],
) -> Result<Box<ErasedState>, RemoteError> {
    let s: S = decode(bytes, "proclet state")?;
    Ok(Box::new(s))
}

/// Marks a type parameter as used without owning one (keeps the namespaces below `Send`,
/// `Sync` and free of drop obligations whatever the parameters are).
type Mark<T> = PhantomData<fn() -> T>;

/// Namespace for the per-instantiation descriptor constants.
pub(crate) struct Desc<F, S, A, R>(Mark<(F, S, A, R)>);

impl<F, S, A, R> Desc<F, S, A, R>
where
    F: Fn(&mut S, A) -> R + 'static,
    S: 'static,
    A: DeserializeOwned + 'static,
    R: Serialize + 'static,
{
    const CALL_MUT: Descriptor = Descriptor {
        magic: MAGIC,
        types: [
            TypeId::of::<F>(),
            TypeId::of::<S>(),
            TypeId::of::<A>(),
            TypeId::of::<R>(),
        ],
        entry: Entry::CallMut(call_mut_tramp::<S, A, R, F>),
    };
}

/// Descriptors of shared (read-only) calls.
pub(crate) struct DescRef<F, S, A, R>(Mark<(F, S, A, R)>);

impl<F, S, A, R> DescRef<F, S, A, R>
where
    F: Fn(&S, A) -> R + 'static,
    S: 'static,
    A: DeserializeOwned + 'static,
    R: Serialize + 'static,
{
    const CALL_REF: Descriptor = Descriptor {
        magic: MAGIC,
        types: [
            TypeId::of::<F>(),
            TypeId::of::<S>(),
            TypeId::of::<A>(),
            TypeId::of::<R>(),
        ],
        entry: Entry::CallRef(call_ref_tramp::<S, A, R, F>),
    };
}

/// Descriptors of constructors.
pub(crate) struct DescCtor<F, S, A>(Mark<(F, S, A)>);

impl<F, S, A> DescCtor<F, S, A>
where
    F: Fn(A) -> S + 'static,
    S: Send + Sync + 'static,
    A: DeserializeOwned + 'static,
{
    const CTOR: Descriptor = Descriptor {
        magic: MAGIC,
        types: [
            TypeId::of::<F>(),
            TypeId::of::<S>(),
            TypeId::of::<A>(),
            TypeId::of::<()>(),
        ],
        entry: Entry::Ctor(ctor_tramp::<S, A, F>),
    };
}

/// Descriptors of state types (encode/decode for moves, footprint for accounting), one
/// per combination of state flags.
pub(crate) struct DescState<S, const FLAGS: u8>(Mark<S>);

/// The descriptor of state type `S`, with the given footprint function and flags.
const fn state_descriptor<S>(footprint: FootprintFn, flags: u8) -> Descriptor
where
    S: Serialize + DeserializeOwned + Send + Sync + 'static,
{
    Descriptor {
        magic: MAGIC,
        types: [
            TypeId::of::<()>(),
            TypeId::of::<S>(),
            TypeId::of::<()>(),
            TypeId::of::<()>(),
        ],
        entry: Entry::State(StateOps {
            encode: encode_state::<S>,
            decode: decode_state::<S>,
            into_raw: into_raw::<S>,
            from_raw: from_raw::<S>,
            footprint,
            flags,
        }),
    }
}

impl<S, const FLAGS: u8> DescState<S, FLAGS>
where
    S: Serialize + DeserializeOwned + Send + Sync + 'static,
{
    const STATE: Descriptor = state_descriptor::<S>(estimated_footprint::<S>, FLAGS);
}

impl<S, const FLAGS: u8> DescState<S, FLAGS>
where
    S: Serialize + DeserializeOwned + crate::footprint::Footprint + Send + Sync + 'static,
{
    /// Same as `STATE`, but accounted with the state's own `Footprint`.
    const EXACT: Descriptor = state_descriptor::<S>(exact_footprint::<S>, FLAGS);
}

/// Descriptor of an exclusive call of `F` on `S`.
pub(crate) fn call_mut_desc<F, S, A, R>() -> &'static Descriptor
where
    F: Fn(&mut S, A) -> R + 'static,
    S: 'static,
    A: DeserializeOwned + 'static,
    R: Serialize + 'static,
{
    &Desc::<F, S, A, R>::CALL_MUT
}

/// Descriptor of a shared call of `F` on `S`.
pub(crate) fn call_ref_desc<F, S, A, R>() -> &'static Descriptor
where
    F: Fn(&S, A) -> R + 'static,
    S: 'static,
    A: DeserializeOwned + 'static,
    R: Serialize + 'static,
{
    &DescRef::<F, S, A, R>::CALL_REF
}

/// Descriptor of a constructor `F` building `S` from `A`.
pub(crate) fn ctor_desc<F, S, A>() -> &'static Descriptor
where
    F: Fn(A) -> S + 'static,
    S: Send + Sync + 'static,
    A: DeserializeOwned + 'static,
{
    &DescCtor::<F, S, A>::CTOR
}

/// Descriptor of the state type `S` with `flags` ([`MUTATING_READS`], [`OWNER_PLACED`]).
pub(crate) fn state_desc<S>(flags: u8) -> &'static Descriptor
where
    S: Serialize + DeserializeOwned + Send + Sync + 'static,
{
    match flags & (MUTATING_READS | OWNER_PLACED) {
        0 => &DescState::<S, 0>::STATE,
        1 => &DescState::<S, 1>::STATE,
        2 => &DescState::<S, 2>::STATE,
        _ => &DescState::<S, 3>::STATE,
    }
}

/// Descriptor of the state type `S` with `flags`, accounted with its own `Footprint`.
pub(crate) fn exact_state_desc<S>(flags: u8) -> &'static Descriptor
where
    S: Serialize + DeserializeOwned + crate::footprint::Footprint + Send + Sync + 'static,
{
    match flags & (MUTATING_READS | OWNER_PLACED) {
        0 => &DescState::<S, 0>::EXACT,
        1 => &DescState::<S, 1>::EXACT,
        2 => &DescState::<S, 2>::EXACT,
        _ => &DescState::<S, 3>::EXACT,
    }
}

impl Descriptor {
    /// The state operations of a state descriptor.
    pub(crate) fn state_ops(&self) -> Option<StateOps> {
        match self.entry {
            Entry::State(o) => Some(o),
            _ => None,
        }
    }
}

// ---- checking received offsets --------------------------------------------------------

struct ExeMaps {
    readable: Vec<Range<usize>>,
    executable: Vec<Range<usize>>,
}

fn parse_maps(maps: &str, exe_dev_ino: Option<(String, u64)>) -> ExeMaps {
    let mut readable = Vec::new();
    let mut executable = Vec::new();
    for line in maps.lines() {
        let mut it = line.split_ascii_whitespace();
        let (Some(range), Some(perms), Some(_off), Some(dev), Some(ino)) =
            (it.next(), it.next(), it.next(), it.next(), it.next())
        else {
            continue;
        };
        let Ok(ino) = ino.parse::<u64>() else {
            continue;
        };
        if ino == 0 {
            continue;
        }
        if let Some((d, i)) = &exe_dev_ino {
            if dev != d || ino != *i {
                continue;
            }
        }
        let Some((a, b)) = range.split_once('-') else {
            continue;
        };
        let (Ok(a), Ok(b)) = (usize::from_str_radix(a, 16), usize::from_str_radix(b, 16)) else {
            continue;
        };
        let p = perms.as_bytes();
        if p.first() == Some(&b'r') {
            readable.push(a..b);
        }
        if p.get(2) == Some(&b'x') {
            executable.push(a..b);
        }
    }
    ExeMaps {
        readable,
        executable,
    }
}

/// The mappings of this process's executable file. Identified by the mapping that holds
/// the anchor (robust to the file having been replaced or deleted since start).
fn exe_maps() -> &'static ExeMaps {
    static MAPS: OnceLock<ExeMaps> = OnceLock::new();
    MAPS.get_or_init(|| {
        let text = std::fs::read_to_string("/proc/self/maps").unwrap_or_default();
        let all = parse_maps(&text, None);
        // Find the (dev, inode) of the mapping containing the anchor, then keep only
        // mappings of that file.
        let a = anchor();
        let mut id = None;
        for line in text.lines() {
            let mut it = line.split_ascii_whitespace();
            let (Some(range), Some(_p), Some(_o), Some(dev), Some(ino)) =
                (it.next(), it.next(), it.next(), it.next(), it.next())
            else {
                continue;
            };
            if let Some((s, e)) = range.split_once('-') {
                if let (Ok(s), Ok(e)) = (usize::from_str_radix(s, 16), usize::from_str_radix(e, 16))
                {
                    if (s..e).contains(&a) {
                        if let Ok(i) = ino.parse::<u64>() {
                            id = Some((dev.to_string(), i));
                        }
                    }
                }
            }
        }
        match id {
            Some(id) => parse_maps(&text, Some(id)),
            None => all,
        }
    })
}

fn inside(ranges: &[Range<usize>], start: usize, len: usize) -> bool {
    let Some(end) = start.checked_add(len) else {
        return false;
    };
    ranges.iter().any(|r| r.start <= start && end <= r.end)
}

/// What kind of descriptor the receiver expects.
#[derive(Clone, Copy, PartialEq, Eq, Debug)]
pub(crate) enum Expect {
    CallMut,
    CallRef,
    Ctor,
    State,
}

/// Turn a received [`CodeRef`] into a descriptor, after every check in the module doc.
pub(crate) fn resolve(code: CodeRef, expect: Expect) -> Result<&'static Descriptor, RemoteError> {
    let refuse = |why: &str| {
        Err(RemoteError::CodeMismatch(format!(
            "offset {}: {why}",
            code.offset
        )))
    };
    let addr = (anchor() as i64).wrapping_add(code.offset) as usize;
    let size = std::mem::size_of::<Descriptor>();
    if !addr.is_multiple_of(std::mem::align_of::<Descriptor>()) {
        return refuse("misaligned");
    }
    let maps = exe_maps();
    if !inside(&maps.readable, addr, size) {
        return refuse("outside the executable's read-only data");
    }
    // SAFETY: `addr` is aligned for `Descriptor` and the whole `size_of::<Descriptor>()`
    // bytes lie inside a readable mapping of our own executable file, which stays mapped
    // for the life of the process (so `'static` is right). The bytes there might not be a
    // descriptor; every field we read before trusting it is plain data (`u64`s) checked
    // against the magic below. `TypeId` and `Entry` are only read after the magic matched,
    // i.e. when the bytes were written by the compiler as a `Descriptor` constant.
    let magic: [u64; 2] = unsafe { std::ptr::read(addr as *const [u64; 2]) };
    if magic != MAGIC {
        return refuse("no descriptor there");
    }
    // SAFETY: as above, and the magic matched: this is one of our descriptor constants.
    let d: &'static Descriptor = unsafe { &*(addr as *const Descriptor) };
    let kind_ok = matches!(
        (expect, &d.entry),
        (Expect::CallMut, Entry::CallMut(_))
            | (Expect::CallRef, Entry::CallRef(_))
            | (Expect::Ctor, Entry::Ctor(_))
            | (Expect::State, Entry::State(_))
    );
    if !kind_ok {
        return refuse("descriptor of the wrong kind");
    }
    for f in d.entry.code_addrs() {
        if !inside(&maps.executable, f, 1) {
            return refuse("trampoline outside the code section");
        }
    }
    if d.fingerprint() != code.fingerprint {
        return refuse("type fingerprint mismatch");
    }
    Ok(d)
}

// ---- the identical-binary hash ----------------------------------------------------------

fn exe_identity() -> Option<String> {
    use std::os::unix::fs::MetadataExt;
    let m = std::fs::metadata("/proc/self/exe").ok()?;
    Some(format!(
        "{}:{}:{}:{}",
        m.dev(),
        m.ino(),
        m.size(),
        m.mtime()
    ))
}

fn hex(h: &[u8]) -> String {
    h.iter().map(|b| format!("{b:02x}")).collect()
}

static HASH: OnceLock<[u8; 32]> = OnceLock::new();

/// blake3 hash of this process's executable (computed once, unless a hint from the
/// driver already proved it: see `accept_binary_hint`).
pub fn binary_hash() -> [u8; 32] {
    *HASH.get_or_init(|| {
        let mut hasher = blake3::Hasher::new();
        match std::fs::File::open("/proc/self/exe") {
            Ok(f) => {
                if hasher.update_reader(f).is_err() {
                    tracing::warn!("cannot read /proc/self/exe; binary hash covers nothing");
                }
            }
            Err(e) => {
                tracing::warn!("cannot open /proc/self/exe ({e}); binary hash covers nothing")
            }
        }
        *hasher.finalize().as_bytes()
    })
}

/// What a driver tells the node processes it spawns about its executable
/// (`<hex hash>:<dev>:<inode>:<size>:<mtime>`), so they can skip re-hashing a file they
/// can prove is the same one.
pub(crate) fn binary_hash_hint() -> Option<String> {
    Some(format!("{}:{}", hex(&binary_hash()), exe_identity()?))
}

/// Take the driver's hint (see [`binary_hash_hint`]) as this process's hash when it
/// names this very file (same device, inode, size and modification time); else the hash
/// is computed when first needed. Returns whether the hint was taken.
pub(crate) fn accept_binary_hint(hint: &str) -> bool {
    let (Some((h, ident)), Some(me)) = (hint.split_once(':'), exe_identity()) else {
        return false;
    };
    if ident != me || h.len() != 64 {
        return false;
    }
    let mut out = [0u8; 32];
    let ok = (0..32).all(|i| {
        h.get(2 * i..2 * i + 2)
            .and_then(|b| u8::from_str_radix(b, 16).ok())
            .map(|b| out[i] = b)
            .is_some()
    });
    ok && HASH.set(out).is_ok()
}

#[cfg(test)]
mod tests {
    use super::*;

    #[derive(serde::Serialize, serde::Deserialize, Debug, PartialEq)]
    struct Counter(u64);

    fn code_of_add() -> CodeRef {
        let f = |c: &mut Counter, x: u64| {
            c.0 += x;
            c.0
        };
        fn desc_of<F: Fn(&mut Counter, u64) -> u64 + 'static>(_f: &F) -> &'static Descriptor {
            call_mut_desc::<F, Counter, u64, u64>()
        }
        code_ref(desc_of(&f))
    }

    #[test]
    fn a_code_ref_resolves_and_runs() {
        let code = code_of_add();
        let d = resolve(code, Expect::CallMut).unwrap();
        assert_eq!(d.state_type(), TypeId::of::<Counter>());
        let Entry::CallMut(f) = d.entry else {
            panic!("kind")
        };
        let mut state: Box<ErasedState> = Box::new(Counter(1));
        let mut out = Vec::new();
        f(
            state.as_mut(),
            &postcard::to_allocvec(&41u64).unwrap(),
            &mut out,
        )
        .unwrap();
        assert_eq!(postcard::from_bytes::<u64>(&out).unwrap(), 42);
    }

    #[test]
    fn bad_offsets_and_fingerprints_are_refused() {
        let code = code_of_add();
        for bad in [
            CodeRef {
                offset: code.offset + 8,
                ..code
            },
            CodeRef {
                offset: code.offset + 1,
                ..code
            },
            CodeRef {
                offset: i64::MAX,
                ..code
            },
            CodeRef {
                offset: -(1 << 40),
                ..code
            },
            CodeRef {
                fingerprint: code.fingerprint ^ 1,
                ..code
            },
        ] {
            assert!(
                matches!(
                    resolve(bad, Expect::CallMut),
                    Err(RemoteError::CodeMismatch(_))
                ),
                "{bad:?}"
            );
        }
        assert!(resolve(code, Expect::CallRef).is_err(), "kind is checked");
    }

    #[test]
    fn wrong_state_type_is_refused_by_the_trampoline() {
        let d = resolve(code_of_add(), Expect::CallMut).unwrap();
        let Entry::CallMut(f) = d.entry else {
            panic!("kind")
        };
        let mut wrong: Box<ErasedState> = Box::new(String::from("not a counter"));
        let mut out = Vec::new();
        let r = f(
            wrong.as_mut(),
            &postcard::to_allocvec(&1u64).unwrap(),
            &mut out,
        );
        assert!(matches!(r, Err(RemoteError::CodeMismatch(_))));
    }

    #[test]
    fn panics_become_errors() {
        fn desc_of<F: Fn(&mut Counter, u64) -> u64 + 'static>(_f: &F) -> &'static Descriptor {
            call_mut_desc::<F, Counter, u64, u64>()
        }
        let d = desc_of(&|_c: &mut Counter, _x: u64| -> u64 { panic!("boom {}", 7) });
        let Entry::CallMut(f) = d.entry else {
            panic!("kind")
        };
        let mut state: Box<ErasedState> = Box::new(Counter(0));
        let r = f(
            state.as_mut(),
            &postcard::to_allocvec(&1u64).unwrap(),
            &mut Vec::new(),
        );
        assert_eq!(r, Err(RemoteError::Panic("boom 7".into())));
    }

    #[test]
    fn garbage_arguments_are_decode_errors() {
        let d = resolve(code_of_add(), Expect::CallMut).unwrap();
        let Entry::CallMut(f) = d.entry else {
            panic!("kind")
        };
        let mut state: Box<ErasedState> = Box::new(Counter(0));
        let r = f(state.as_mut(), &[], &mut Vec::new());
        assert!(matches!(r, Err(RemoteError::Decode(_))));
    }

    #[test]
    fn maps_parsing_keeps_only_the_executable() {
        let text = "\
5555-6666 r--p 00000000 fd:01 42 /bin/app
6666-7777 r-xp 00001000 fd:01 42 /bin/app
7777-8888 r--p 00000000 fd:01 43 /lib/other.so
9999-aaaa rw-p 00000000 00:00 0 [heap]";
        let m = parse_maps(text, Some(("fd:01".into(), 42)));
        assert_eq!(m.readable, vec![0x5555..0x6666, 0x6666..0x7777]);
        assert_eq!(m.executable, vec![0x6666..0x7777]);
    }
}
