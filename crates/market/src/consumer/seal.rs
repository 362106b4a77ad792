//! Sealing one value for an untrusted store, free of I/O: the consumer's key material,
//! AES-256-GCM (encrypt mode) or keyed BLAKE3 (integrity mode), and the check of what a
//! store hands back.
//!
//! The associated data (AEAD) or the MAC's input prefix (integrity) is the *substituted*
//! key, the 64-bit counter a PUT was stored under. Every PUT takes a fresh counter, so a
//! value sealed for one key or for an older PUT of the same key fails to open under the
//! counter the metadata names: a store cannot swap values between keys nor replay an old
//! one. AES-256-GCM was chosen over ChaCha20-Poly1305 because this machine's CPUs have
//! AES-NI, PCLMULQDQ and VAES (the `kv-secure` benchmark measures both on small values).

use super::Protection;
use aes_gcm::aead::{AeadInPlace, KeyInit};
use aes_gcm::{Aes256Gcm, Nonce, Tag};
use rand::Rng;

/// Bytes of an AES-GCM nonce (stored in front of the ciphertext).
const NONCE: usize = 12;
/// Bytes of an AES-GCM tag (stored after the ciphertext).
const GCM_TAG: usize = 16;
/// Bytes of the keyed-BLAKE3 tag (stored after the value).
const MAC_TAG: usize = 32;

/// Domain-separation contexts: the AEAD key and the MAC key are derived from one
/// 32-byte master key so that the metadata file holds one secret.
const AEAD_CONTEXT: &str = "granule market consumer 2026 value encryption key";
const MAC_CONTEXT: &str = "granule market consumer 2026 value integrity key";

/// Why a value from a store was refused.
#[derive(Debug, PartialEq, Eq, thiserror::Error)]
pub enum SealError {
    #[error("value shorter than its seal ({0} bytes)")]
    Short(usize),
    #[error("value does not verify under its key")]
    Verify,
}

/// The store key a counter stands for: its 8 big-endian bytes (binary-safe in RESP).
pub fn store_key(counter: u64) -> [u8; 8] {
    counter.to_be_bytes()
}

/// A consumer's sealing keys.
pub struct Sealer {
    protection: Protection,
    aead: Aes256Gcm,
    mac_key: [u8; 32],
}

impl Sealer {
    /// Keys derived from `master` (the consumer's own, never sent anywhere).
    pub fn new(protection: Protection, master: &[u8; 32]) -> Sealer {
        let aead_key = blake3::derive_key(AEAD_CONTEXT, master);
        Sealer {
            protection,
            aead: Aes256Gcm::new(&aead_key.into()),
            mac_key: blake3::derive_key(MAC_CONTEXT, master),
        }
    }

    pub fn protection(&self) -> Protection {
        self.protection
    }

    /// Bytes a sealed value takes beyond the value.
    pub fn overhead(&self) -> usize {
        match self.protection {
            Protection::None => 0,
            Protection::Integrity => MAC_TAG,
            Protection::Encrypt => NONCE + GCM_TAG,
        }
    }

    /// What to store for `value` under `counter`.
    pub fn seal(&self, counter: u64, value: &[u8]) -> Vec<u8> {
        let aad = store_key(counter);
        let mut out = Vec::with_capacity(value.len() + self.overhead());
        match self.protection {
            Protection::None => out.extend_from_slice(value),
            Protection::Integrity => {
                out.extend_from_slice(value);
                out.extend_from_slice(self.mac(&aad, value).as_bytes());
            }
            Protection::Encrypt => {
                // A random 96-bit nonce per seal (not the counter): two processes sharing
                // one metadata file could take the same counter, never the same nonce.
                let nonce: [u8; NONCE] = rand::rng().random();
                out.extend_from_slice(&nonce);
                out.extend_from_slice(value);
                // Cannot fail for buffers under GCM's 64 GiB bound; values are far smaller.
                // (Were it to fail, the zero tag makes the value fail to open: a miss.)
                let tag = self
                    .aead
                    .encrypt_in_place_detached(Nonce::from_slice(&nonce), &aad, &mut out[NONCE..])
                    .unwrap_or_default();
                out.extend_from_slice(&tag);
            }
        }
        out
    }

    /// The value sealed under `counter`, or why not. Consumes the store's bytes (the
    /// value is decrypted in place).
    pub fn open(&self, counter: u64, mut sealed: Vec<u8>) -> Result<Vec<u8>, SealError> {
        let aad = store_key(counter);
        if sealed.len() < self.overhead() {
            return Err(SealError::Short(sealed.len()));
        }
        match self.protection {
            Protection::None => Ok(sealed),
            Protection::Integrity => {
                let n = sealed.len() - MAC_TAG;
                let want = self.mac(&aad, &sealed[..n]);
                // blake3::Hash's equality is constant-time.
                let got = blake3::Hash::from_slice(&sealed[n..]).map_err(|_| SealError::Verify)?;
                if want != got {
                    return Err(SealError::Verify);
                }
                sealed.truncate(n);
                Ok(sealed)
            }
            Protection::Encrypt => {
                let n = sealed.len() - GCM_TAG;
                let tag = Tag::clone_from_slice(&sealed[n..]);
                let nonce = Nonce::clone_from_slice(&sealed[..NONCE]);
                self.aead
                    .decrypt_in_place_detached(&nonce, &aad, &mut sealed[NONCE..n], &tag)
                    .map_err(|_| SealError::Verify)?;
                sealed.truncate(n);
                sealed.drain(..NONCE);
                Ok(sealed)
            }
        }
    }

    fn mac(&self, aad: &[u8; 8], value: &[u8]) -> blake3::Hash {
        let mut h = blake3::Hasher::new_keyed(&self.mac_key);
        h.update(aad);
        h.update(value);
        h.finalize()
    }
}

/// Time to seal and open one `len`-byte value with each candidate, per value (mean over
/// `iters`): AES-256-GCM, ChaCha20-Poly1305 and keyed BLAKE3, so the `kv-secure`
/// benchmark can say which is fastest on the machine it runs on.
pub fn compare_ciphers(len: usize, iters: u32) -> Vec<(&'static str, std::time::Duration)> {
    use chacha20poly1305::ChaCha20Poly1305;
    let key = [3u8; 32];
    let nonce = [9u8; NONCE];
    let aad = store_key(1);
    let mut buf = vec![1u8; len];
    let iters = iters.max(1);
    let mut out = Vec::new();
    let aes = Aes256Gcm::new(&key.into());
    let t = std::time::Instant::now();
    for _ in 0..iters {
        if let Ok(tag) = aes.encrypt_in_place_detached(Nonce::from_slice(&nonce), &aad, &mut buf) {
            let _ = aes.decrypt_in_place_detached(Nonce::from_slice(&nonce), &aad, &mut buf, &tag);
        }
    }
    out.push(("AES-256-GCM", t.elapsed() / iters));
    let chacha = ChaCha20Poly1305::new(&key.into());
    let t = std::time::Instant::now();
    for _ in 0..iters {
        let n = chacha20poly1305::Nonce::from_slice(&nonce);
        if let Ok(tag) = chacha.encrypt_in_place_detached(n, &aad, &mut buf) {
            let _ = chacha.decrypt_in_place_detached(n, &aad, &mut buf, &tag);
        }
    }
    out.push(("ChaCha20-Poly1305", t.elapsed() / iters));
    let t = std::time::Instant::now();
    for _ in 0..iters {
        let a = blake3::keyed_hash(&key, &buf);
        let b = blake3::keyed_hash(&key, &buf);
        std::hint::black_box(a == b);
    }
    out.push(("keyed BLAKE3", t.elapsed() / iters));
    out
}

#[cfg(test)]
mod tests {
    use super::*;

    fn sealers(p: Protection) -> (Sealer, Sealer) {
        (Sealer::new(p, &[7; 32]), Sealer::new(p, &[8; 32]))
    }

    #[test]
    fn round_trip_in_every_mode() {
        for p in [Protection::None, Protection::Integrity, Protection::Encrypt] {
            let (s, _) = sealers(p);
            for len in [0usize, 1, 100, 4096] {
                let v: Vec<u8> = (0..len).map(|i| (i * 31) as u8).collect();
                let sealed = s.seal(42, &v);
                assert_eq!(sealed.len(), len + s.overhead());
                assert_eq!(s.open(42, sealed).unwrap(), v, "{p:?} len {len}");
            }
        }
    }

    #[test]
    fn encrypt_hides_the_value_and_uses_fresh_nonces() {
        let (s, _) = sealers(Protection::Encrypt);
        let v = b"a secret value, long enough to look for".to_vec();
        let a = s.seal(1, &v);
        let b = s.seal(1, &v);
        assert_ne!(a, b, "two seals of one value must differ (fresh nonce)");
        assert!(!a.windows(8).any(|w| w == &v[..8]), "plaintext visible");
    }

    #[test]
    fn flipped_bits_swapped_counters_and_other_keys_fail() {
        for p in [Protection::Integrity, Protection::Encrypt] {
            let (s, other) = sealers(p);
            let v = vec![5u8; 64];
            let sealed = s.seal(9, &v);
            for i in 0..sealed.len() {
                let mut bad = sealed.clone();
                bad[i] ^= 0x10;
                assert_eq!(s.open(9, bad), Err(SealError::Verify), "{p:?} flip at {i}");
            }
            // Another key's (or an older PUT's) value: sealed under another counter.
            assert_eq!(s.open(10, sealed.clone()), Err(SealError::Verify));
            // Another consumer's key material.
            assert_eq!(other.open(9, sealed.clone()), Err(SealError::Verify));
            // Truncated.
            assert!(s.open(9, sealed[..sealed.len() - 1].to_vec()).is_err());
            assert!(s.open(9, Vec::new()).is_err());
        }
    }
}
