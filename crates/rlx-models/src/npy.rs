//! Reads a 2-D float32 `.npy` matrix, as `rlx embed -o FILE.npy` (and
//! numpy's `np.save` of a C-ordered float32 array) writes it.

use std::io::Read;
use std::path::Path;

use crate::{ModelError, Result};

/// A row-major `[rows, cols]` float32 matrix.
#[derive(Debug, Clone, PartialEq)]
pub struct NpyMatrix {
    pub rows: usize,
    pub cols: usize,
    pub data: Vec<f32>,
}

/// Reads `path`: NPY version 1, 2 or 3; dtype `<f4`; C order; two
/// dimensions; exactly rows × cols values after the header. Anything else is
/// an error saying what was expected and what was found.
pub fn read_npy_f32(path: &Path) -> Result<NpyMatrix> {
    let mut f = crate::error::open_regular_file(path)?;
    let bad = |detail: String| ModelError::format(path, detail);
    let mut pre = [0u8; 8];
    f.read_exact(&mut pre).map_err(|_| bad("not a .npy file: shorter than the 8-byte preamble".into()))?;
    if &pre[..6] != b"\x93NUMPY" {
        return Err(bad("not a .npy file: it does not start with \\x93NUMPY".into()));
    }
    let header_len = match pre[6] {
        1 => {
            let mut b = [0u8; 2];
            f.read_exact(&mut b).map_err(|e| ModelError::io(path, e))?;
            u16::from_le_bytes(b) as usize
        }
        2 | 3 => {
            let mut b = [0u8; 4];
            f.read_exact(&mut b).map_err(|e| ModelError::io(path, e))?;
            u32::from_le_bytes(b) as usize
        }
        v => return Err(bad(format!("unsupported .npy version {v} (expected 1, 2 or 3)"))),
    };
    if header_len > 1 << 20 {
        return Err(bad(format!(".npy header of {header_len} bytes (expected a few hundred)")));
    }
    let mut header = vec![0u8; header_len];
    f.read_exact(&mut header).map_err(|_| bad("the .npy header is cut short".into()))?;
    let header = String::from_utf8_lossy(&header);
    let descr = dict_value(&header, "descr").ok_or_else(|| bad(format!("no 'descr' in the .npy header {header:?}")))?;
    let descr = descr.trim_matches(|c| c == '\'' || c == '"');
    if descr != "<f4" && descr != "f4" {
        return Err(bad(format!("dtype {descr}: expected float32 ('<f4'), as `rlx embed -o FILE.npy` writes")));
    }
    let fortran = dict_value(&header, "fortran_order").ok_or_else(|| bad("no 'fortran_order' in the .npy header".into()))?;
    if fortran != "False" {
        return Err(bad("a Fortran-ordered array: expected C (row-major) order".into()));
    }
    let shape = dict_value(&header, "shape").ok_or_else(|| bad("no 'shape' in the .npy header".into()))?;
    let dims: Vec<usize> = shape
        .trim_matches(|c| c == '(' || c == ')')
        .split(',')
        .map(str::trim)
        .filter(|s| !s.is_empty())
        .map(|s| s.parse::<usize>().map_err(|_| bad(format!("shape {shape}: not a tuple of sizes"))))
        .collect::<Result<_>>()?;
    let [rows, cols] = dims[..] else {
        return Err(bad(format!("shape {shape}: expected two dimensions (rows, dimension)")));
    };
    let want = rows.checked_mul(cols).and_then(|n| n.checked_mul(4)).ok_or_else(|| bad(format!("shape {shape} is too large")))?;
    let mut bytes = Vec::new();
    f.read_to_end(&mut bytes).map_err(|e| ModelError::io(path, e))?;
    if bytes.len() != want {
        return Err(bad(format!("shape {shape} needs {want} bytes of data, the file has {}", bytes.len())));
    }
    let data: Vec<f32> = bytes.chunks_exact(4).map(|c| f32::from_le_bytes([c[0], c[1], c[2], c[3]])).collect();
    if let Some(i) = data.iter().position(|x| !x.is_finite()) {
        return Err(bad(format!("row {} holds a value that is not finite ({})", i / cols.max(1), data[i])));
    }
    Ok(NpyMatrix { rows, cols, data })
}

/// The text of `key`'s value in the header's Python dict literal.
fn dict_value<'a>(header: &'a str, key: &str) -> Option<&'a str> {
    let at = header.find(&format!("'{key}'")).or_else(|| header.find(&format!("\"{key}\"")))?;
    let rest = header[at + key.len() + 2..].trim_start().strip_prefix(':')?.trim_start();
    let end = if rest.starts_with('(') { rest.find(')')? + 1 } else { rest.find([',', '}'])? };
    Some(rest[..end].trim())
}

#[cfg(test)]
mod tests {
    use super::*;

    fn write(name: &str, header: &str, data: &[u8]) -> std::path::PathBuf {
        let p = std::env::temp_dir().join(format!("rlx-npy-{}-{name}.npy", std::process::id()));
        let mut h = header.as_bytes().to_vec();
        while !(10 + h.len() + 1).is_multiple_of(64) {
            h.push(b' ');
        }
        h.push(b'\n');
        let mut bytes = b"\x93NUMPY\x01\x00".to_vec();
        bytes.extend_from_slice(&(h.len() as u16).to_le_bytes());
        bytes.extend_from_slice(&h);
        bytes.extend_from_slice(data);
        std::fs::write(&p, bytes).unwrap_or_else(|e| panic!("{e}"));
        p
    }

    fn floats(v: &[f32]) -> Vec<u8> {
        v.iter().flat_map(|x| x.to_le_bytes()).collect()
    }

    #[test]
    fn reads_what_numpy_writes_and_refuses_the_rest() {
        let p = write("ok", "{'descr': '<f4', 'fortran_order': False, 'shape': (2, 3), }", &floats(&[1., 2., 3., 4., 5., 6.]));
        assert_eq!(read_npy_f32(&p).ok(), Some(NpyMatrix { rows: 2, cols: 3, data: vec![1., 2., 3., 4., 5., 6.] }));
        let err = |name: &str, header: &str, data: &[u8]| {
            let p = write(name, header, data);
            let e = read_npy_f32(&p).err().map(|e| e.to_string()).unwrap_or_default();
            let _ = std::fs::remove_file(&p);
            e
        };
        let e = err("f8", "{'descr': '<f8', 'fortran_order': False, 'shape': (1, 1), }", &[0; 8]);
        assert!(e.contains("dtype <f8") && e.contains("float32"), "{e}");
        let e = err("1d", "{'descr': '<f4', 'fortran_order': False, 'shape': (3,), }", &floats(&[1., 2., 3.]));
        assert!(e.contains("expected two dimensions"), "{e}");
        let e = err("short", "{'descr': '<f4', 'fortran_order': False, 'shape': (2, 2), }", &floats(&[1., 2., 3.]));
        assert!(e.contains("needs 16 bytes") && e.contains("has 12"), "{e}");
        let e = err("fortran", "{'descr': '<f4', 'fortran_order': True, 'shape': (1, 1), }", &floats(&[1.]));
        assert!(e.contains("Fortran"), "{e}");
        let e = err("nan", "{'descr': '<f4', 'fortran_order': False, 'shape': (2, 1), }", &floats(&[1., f32::NAN]));
        assert!(e.contains("row 1") && e.contains("not finite"), "{e}");
        let p = std::env::temp_dir().join(format!("rlx-npy-{}-text.npy", std::process::id()));
        std::fs::write(&p, "hello world, not npy").unwrap_or_else(|e| panic!("{e}"));
        let e = read_npy_f32(&p).err().map(|e| e.to_string()).unwrap_or_default();
        assert!(e.contains("not a .npy file"), "{e}");
        let _ = std::fs::remove_file(&p);
    }
}
