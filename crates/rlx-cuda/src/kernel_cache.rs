//! The compiled-kernel cache's file format, checked on the host before a
//! byte of it reaches the driver: `cuModuleLoadData` takes a bare pointer
//! with no length, so a truncated, edited or foreign file must be caught
//! here, where it only costs a recompile.
//!
//! A cache file is the CUBIN followed by a 48-byte trailer: the magic
//! `RLXCUBIN`, the CUBIN's length (u64, little-endian) and the SHA-256 of
//! the CUBIN. Reading checks the trailer, the digest, then the ELF header
//! the driver will parse (64-bit, little-endian, machine `EM_CUDA`, the
//! section and program header tables inside the image).

use sha2::{Digest, Sha256};

const MAGIC: &[u8; 8] = b"RLXCUBIN";
const TRAILER: usize = 8 + 8 + 32;
/// ELF's machine number for NVIDIA CUDA images.
const EM_CUDA: u16 = 190;
const ELF_HEADER: usize = 64;

/// Part of every cache key: bumped when this file format changes, so files
/// of another format are never opened.
pub const FORMAT: &str = "rlx-cubin-cache 2";

/// The cache file's name for kernel file `file` compiled for `arch` under
/// `key` (a hex digest).
pub fn file_name(file: &str, arch: &str, key: &str) -> String {
    format!("{}-{arch}-{key}.cubin", file.trim_end_matches(".cu"))
}

/// What is written to the cache for `cubin`.
pub fn encode(cubin: &[u8]) -> Vec<u8> {
    let mut out = Vec::with_capacity(cubin.len() + TRAILER);
    out.extend_from_slice(cubin);
    out.extend_from_slice(MAGIC);
    out.extend_from_slice(&(cubin.len() as u64).to_le_bytes());
    out.extend_from_slice(&Sha256::digest(cubin));
    out
}

/// Why a cache file was not used (it is then recompiled and rewritten).
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum Rejected {
    TooShort(usize),
    NoTrailer,
    LengthMismatch { stored: u64, found: usize },
    DigestMismatch,
    NotElf(String),
}

impl std::fmt::Display for Rejected {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        match self {
            Rejected::TooShort(n) => write!(f, "{n} bytes, shorter than a trailer and an ELF header"),
            Rejected::NoTrailer => write!(f, "no RLXCUBIN trailer (not written by this version, or cut short)"),
            Rejected::LengthMismatch { stored, found } => write!(f, "the trailer says {stored} bytes of CUBIN, found {found}"),
            Rejected::DigestMismatch => write!(f, "the CUBIN's SHA-256 does not match its trailer"),
            Rejected::NotElf(why) => write!(f, "not a CUDA ELF image: {why}"),
        }
    }
}

fn u16_at(b: &[u8], at: usize) -> u16 {
    u16::from_le_bytes([b[at], b[at + 1]])
}

fn u64_at(b: &[u8], at: usize) -> u64 {
    let mut w = [0u8; 8];
    w.copy_from_slice(&b[at..at + 8]);
    u64::from_le_bytes(w)
}

/// Whether a table of `count` entries of `entry` bytes at `offset` lies
/// inside an image of `len` bytes.
fn table_fits(offset: u64, count: u16, entry: u16, len: usize) -> bool {
    let size = count as u64 * entry as u64;
    offset.checked_add(size).is_some_and(|end| end <= len as u64)
}

/// The ELF header checks the driver's loader relies on.
pub fn check_elf(image: &[u8]) -> Result<(), Rejected> {
    let bad = |why: &str| Err(Rejected::NotElf(why.to_string()));
    if image.len() < ELF_HEADER {
        return bad(&format!("{} bytes, shorter than an ELF header", image.len()));
    }
    if &image[..4] != b"\x7fELF" {
        return bad("no ELF magic");
    }
    if image[4] != 2 || image[5] != 1 {
        return bad("not 64-bit little-endian");
    }
    let machine = u16_at(image, 18);
    if machine != EM_CUDA {
        return bad(&format!("machine {machine}, expected {EM_CUDA} (CUDA)"));
    }
    let (phoff, shoff) = (u64_at(image, 32), u64_at(image, 40));
    let (phentsize, phnum, shentsize, shnum) = (u16_at(image, 54), u16_at(image, 56), u16_at(image, 58), u16_at(image, 60));
    if shnum == 0 || shentsize != 64 || !table_fits(shoff, shnum, shentsize, image.len()) {
        return bad("the section header table is missing or outside the image");
    }
    if phnum > 0 && (phentsize != 56 || !table_fits(phoff, phnum, phentsize, image.len())) {
        return bad("the program header table is outside the image");
    }
    Ok(())
}

/// The CUBIN inside a cache file's bytes, or why the file cannot be used.
pub fn decode(file: &[u8]) -> Result<&[u8], Rejected> {
    if file.len() < TRAILER + ELF_HEADER {
        return Err(Rejected::TooShort(file.len()));
    }
    let (cubin, trailer) = file.split_at(file.len() - TRAILER);
    if &trailer[..8] != MAGIC {
        return Err(Rejected::NoTrailer);
    }
    let stored = u64_at(trailer, 8);
    if stored != cubin.len() as u64 {
        return Err(Rejected::LengthMismatch { stored, found: cubin.len() });
    }
    if Sha256::digest(cubin).as_slice() != &trailer[16..] {
        return Err(Rejected::DigestMismatch);
    }
    check_elf(cubin)?;
    Ok(cubin)
}

#[cfg(test)]
mod tests {
    use super::*;

    /// The smallest image `check_elf` accepts: a header and one section header.
    fn tiny_elf() -> Vec<u8> {
        let mut b = vec![0u8; 128];
        b[..4].copy_from_slice(b"\x7fELF");
        b[4] = 2;
        b[5] = 1;
        b[18..20].copy_from_slice(&EM_CUDA.to_le_bytes());
        b[40..48].copy_from_slice(&64u64.to_le_bytes());
        b[58..60].copy_from_slice(&64u16.to_le_bytes());
        b[60..62].copy_from_slice(&1u16.to_le_bytes());
        b
    }

    #[test]
    fn an_encoded_image_decodes_to_itself() {
        let elf = tiny_elf();
        assert_eq!(decode(&encode(&elf)), Ok(elf.as_slice()));
    }

    #[test]
    fn every_damage_is_rejected_with_its_reason() {
        let file = encode(&tiny_elf());
        for cut in [1, 10, 48, file.len() - 10] {
            assert!(decode(&file[..file.len() - cut]).is_err(), "cut {cut} accepted");
        }
        let mut flipped = file.clone();
        flipped[70] ^= 1;
        assert_eq!(decode(&flipped), Err(Rejected::DigestMismatch));
        let mut other = tiny_elf();
        other[18] = 62; // x86-64
        assert!(matches!(decode(&encode(&other)), Err(Rejected::NotElf(m)) if m.contains("machine 62")));
        let mut far = tiny_elf();
        far[40..48].copy_from_slice(&u64::MAX.to_le_bytes());
        assert!(matches!(decode(&encode(&far)), Err(Rejected::NotElf(m)) if m.contains("section header")));
        // A bare CUBIN (an older cache file) has no trailer.
        let mut bare = tiny_elf();
        bare.extend_from_slice(&[0; 64]);
        assert_eq!(decode(&bare), Err(Rejected::NoTrailer));
    }
}
