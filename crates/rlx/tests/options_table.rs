//! Every `RLX_*` environment variable the code reads is in README's options
//! table ("Options", with its "For development" part): a new switch without
//! a line in the table fails here.

use std::path::{Path, PathBuf};

fn root() -> PathBuf {
    PathBuf::from(env!("CARGO_MANIFEST_DIR")).join("../..")
}

fn walk(dir: &Path, out: &mut Vec<PathBuf>) {
    let Ok(entries) = std::fs::read_dir(dir) else { return };
    for e in entries.flatten() {
        let p = e.path();
        if p.is_dir() {
            walk(&p, out);
        } else if matches!(p.extension().and_then(|x| x.to_str()), Some("rs" | "sh")) || p.parent().is_some_and(|d| d.ends_with("scripts"))
        {
            out.push(p);
        }
    }
}

/// `RLX_` names in `text`, as whole words.
fn names(text: &str) -> Vec<String> {
    let b = text.as_bytes();
    let mut v = vec![];
    let mut i = 0;
    while let Some(at) = text[i..].find("RLX_") {
        let s = i + at;
        let mut e = s + 4;
        while e < b.len() && (b[e].is_ascii_uppercase() || b[e].is_ascii_digit() || b[e] == b'_') {
            e += 1;
        }
        let before_ok = s == 0 || !(b[s - 1].is_ascii_alphanumeric() || b[s - 1] == b'_');
        if before_ok && e > s + 4 {
            v.push(text[s..e].trim_end_matches('_').to_string());
        }
        i = e;
    }
    v
}

#[test]
fn every_rlx_variable_is_documented() {
    let readme = std::fs::read_to_string(root().join("README.md")).expect("README.md");
    let start = readme.find("## Options").expect("README has an Options section");
    let end = readme[start + 3..].find("\n## ").map_or(readme.len(), |e| start + 3 + e);
    let table = &readme[start..end];
    let mut files = vec![];
    for d in ["crates", "scripts"] {
        walk(&root().join(d), &mut files);
    }
    let mut missing = vec![];
    for f in files {
        let Ok(text) = std::fs::read_to_string(&f) else { continue };
        for n in names(&text) {
            // Macro names inside generated kernel checks are not variables.
            if n.starts_with("RLX_TWIN") || n.starts_with("RLX_FLOAT_KERNELS") {
                continue;
            }
            if !table.contains(&n) && !missing.iter().any(|(m, _): &(String, PathBuf)| *m == n) {
                missing.push((n, f.clone()));
            }
        }
    }
    assert!(missing.is_empty(), "RLX_ variables read but not in README's Options table: {missing:?}");
}

#[test]
fn names_are_whole_words() {
    assert_eq!(names("a RLX_TRACE=1 b MY_RLX_X RLX_ c(\"RLX_GEMM_CACHE\")"), vec!["RLX_TRACE".to_string(), "RLX_GEMM_CACHE".to_string()]);
}
