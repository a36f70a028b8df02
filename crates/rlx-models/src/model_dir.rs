//! Where `rlx` (and the Python package) find the default models when none
//! is named, and the per-user data directory `rlx fetch` writes to.
//!
//! Lookup order of the embedding model (the first that exists wins):
//! 1. `$RLX_MODEL_DIR`;
//! 2. `models/all-MiniLM-L6-v2` under the current directory or one of its
//!    parents, then under the executable's directory or one of its parents
//!    (a checkout of the repository, where `scripts/fetch-models` puts it);
//! 3. `models/all-MiniLM-L6-v2` in the data directory: `$RLX_HOME`, else
//!    `$XDG_DATA_HOME/rlx`, else `~/.local/share/rlx` (where `rlx fetch`
//!    puts it).
//!
//! The generation model ([`DEFAULT_GGUF`]) is looked for in `models/` under
//! the same bases and their parents, then in the data directory.

use std::ffi::OsString;
use std::path::{Path, PathBuf};

/// The default model's folder name, under a models directory.
pub const DEFAULT_MODEL_NAME: &str = "all-MiniLM-L6-v2";

/// The default generation model's file name, under a models directory.
pub const DEFAULT_GGUF: &str = "SmolLM2-135M-Instruct.Q4_1.gguf";

/// The process environment, as the lookup sees it (tests pass their own).
pub struct Env<'a> {
    pub var: &'a dyn Fn(&str) -> Option<OsString>,
    /// Directories whose ancestors may hold a repository checkout.
    pub bases: Vec<PathBuf>,
}

impl Env<'_> {
    pub fn process() -> Env<'static> {
        let mut bases = vec![];
        if let Ok(cwd) = std::env::current_dir() {
            bases.push(cwd);
        }
        if let Some(dir) = std::env::current_exe().ok().and_then(|e| e.parent().map(Path::to_path_buf)) {
            bases.push(dir);
        }
        Env { var: &process_var, bases }
    }

    /// A variable that is set and not empty.
    fn get(&self, key: &str) -> Option<OsString> {
        (self.var)(key).filter(|v| !v.is_empty())
    }
}

fn process_var(key: &str) -> Option<OsString> {
    std::env::var_os(key)
}

/// `$RLX_HOME`, else `$XDG_DATA_HOME/rlx` (an absolute path, as the XDG
/// spec requires), else `$HOME/.local/share/rlx`.
pub fn data_dir(env: &Env) -> Result<PathBuf, String> {
    if let Some(d) = env.get("RLX_HOME") {
        return Ok(PathBuf::from(d));
    }
    if let Some(d) = env.get("XDG_DATA_HOME").map(PathBuf::from).filter(|d| d.is_absolute()) {
        return Ok(d.join("rlx"));
    }
    match env.get("HOME") {
        Some(h) => Ok(PathBuf::from(h).join(".local/share/rlx")),
        None => Err("no data directory: none of RLX_HOME, XDG_DATA_HOME and HOME is set".into()),
    }
}

/// The models directory inside the data directory.
pub fn user_models_dir(env: &Env) -> Result<PathBuf, String> {
    data_dir(env).map(|d| d.join("models"))
}

/// What to run to get the default model, for error messages.
pub fn fetch_hint(env: &Env) -> String {
    let target = user_models_dir(env).map(|d| format!(" (into {})", d.display())).unwrap_or_default();
    format!("run `rlx fetch`{target}, or scripts/fetch-models in the RLX repository, or pass --model DIR")
}

/// The default model directory, by the lookup order in the module doc.
pub fn default_model_dir(env: &Env) -> Result<PathBuf, String> {
    if let Some(d) = env.get("RLX_MODEL_DIR") {
        let d = PathBuf::from(d);
        if d.is_dir() {
            return Ok(d);
        }
        return Err(format!("RLX_MODEL_DIR is {}, which is not a directory; {}", d.display(), fetch_hint(env)));
    }
    let in_repo = Path::new("models").join(DEFAULT_MODEL_NAME);
    for base in &env.bases {
        for anc in base.ancestors() {
            let c = anc.join(&in_repo);
            if c.join("config.json").is_file() {
                return Ok(c);
            }
        }
    }
    let user = user_models_dir(env).map(|d| d.join(DEFAULT_MODEL_NAME));
    if let Ok(c) = &user {
        if c.join("config.json").is_file() {
            return Ok(c.clone());
        }
    }
    let mut looked: Vec<String> = env.bases.iter().map(|b| format!("{} under {} or its parents", in_repo.display(), b.display())).collect();
    if let Ok(c) = user {
        looked.push(c.display().to_string());
    }
    Err(format!("no model found: RLX_MODEL_DIR is not set and there is no {}; {}", looked.join(", nor "), fetch_hint(env)))
}

/// The default generation model: [`DEFAULT_GGUF`] in `models/` under a
/// base or one of its parents, then in the data directory's `models/`.
pub fn default_generation_model(env: &Env) -> Result<PathBuf, String> {
    let mut tried = vec![];
    for base in &env.bases {
        for dir in base.ancestors() {
            let p = dir.join("models").join(DEFAULT_GGUF);
            if p.is_file() {
                return Ok(p);
            }
        }
        tried.push(base.join("models").join(DEFAULT_GGUF));
    }
    if let Ok(d) = data_dir(env) {
        let p = d.join("models").join(DEFAULT_GGUF);
        if p.is_file() {
            return Ok(p);
        }
        tried.push(p);
    }
    Err(format!(
        "no generation model given and the default ({DEFAULT_GGUF}) was not found (looked in models/ here and above, and {}); run `rlx fetch` or scripts/fetch-models, or pass --model FILE.gguf",
        tried.last().map(|p| p.display().to_string()).unwrap_or_default()
    ))
}

#[cfg(test)]
mod tests {
    use super::*;
    use std::collections::HashMap;

    fn temp(name: &str) -> PathBuf {
        let d = std::env::temp_dir().join(format!("rlx-cli-model-dir-{}-{name}", std::process::id()));
        let _ = std::fs::remove_dir_all(&d);
        std::fs::create_dir_all(&d).unwrap_or_else(|e| panic!("{}: {e}", d.display()));
        d
    }

    fn model_at(models: &Path) -> PathBuf {
        let d = models.join(DEFAULT_MODEL_NAME);
        std::fs::create_dir_all(&d).unwrap_or_else(|e| panic!("{e}"));
        std::fs::write(d.join("config.json"), "{}").unwrap_or_else(|e| panic!("{e}"));
        d
    }

    fn lookup(vars: &[(&str, &Path)], bases: &[&Path]) -> Result<PathBuf, String> {
        let vars: HashMap<String, OsString> = vars.iter().map(|(k, v)| (k.to_string(), v.as_os_str().to_owned())).collect();
        let var = move |k: &str| vars.get(k).cloned();
        default_model_dir(&Env { var: &var, bases: bases.iter().map(|b| b.to_path_buf()).collect() })
    }

    #[test]
    fn data_dir_prefers_rlx_home_then_xdg_then_home() {
        let vars =
            |pairs: &'static [(&'static str, &'static str)]| move |k: &str| pairs.iter().find(|p| p.0 == k).map(|p| OsString::from(p.1));
        let dir = |v: &dyn Fn(&str) -> Option<OsString>| data_dir(&Env { var: v, bases: vec![] });
        let all = vars(&[("RLX_HOME", "/r"), ("XDG_DATA_HOME", "/x"), ("HOME", "/h")]);
        assert_eq!(dir(&all), Ok(PathBuf::from("/r")));
        let xdg = vars(&[("RLX_HOME", ""), ("XDG_DATA_HOME", "/x"), ("HOME", "/h")]);
        assert_eq!(dir(&xdg), Ok(PathBuf::from("/x/rlx")));
        let relative_xdg = vars(&[("XDG_DATA_HOME", "x"), ("HOME", "/h")]);
        assert_eq!(dir(&relative_xdg), Ok(PathBuf::from("/h/.local/share/rlx")));
        assert!(dir(&vars(&[])).is_err_and(|e| e.contains("HOME")));
    }

    #[test]
    fn lookup_order_is_env_then_checkout_then_data_dir() {
        let root = temp("order");
        let home = root.join("home");
        let user = model_at(&home.join("models"));
        let checkout = root.join("checkout");
        let repo_model = model_at(&checkout.join("models"));
        let deep = checkout.join("crates/rlx-cli");
        std::fs::create_dir_all(&deep).unwrap_or_else(|e| panic!("{e}"));
        let elsewhere = root.join("elsewhere");
        std::fs::create_dir_all(&elsewhere).unwrap_or_else(|e| panic!("{e}"));

        // Inside a checkout (or a parent of the cwd has models/): that one.
        assert_eq!(lookup(&[("RLX_HOME", &home)], &[&deep]), Ok(repo_model.clone()));
        // Not in a checkout: the data directory.
        assert_eq!(lookup(&[("RLX_HOME", &home)], &[&elsewhere]), Ok(user.clone()));
        // RLX_MODEL_DIR beats both.
        assert_eq!(lookup(&[("RLX_HOME", &home), ("RLX_MODEL_DIR", &elsewhere)], &[&deep]), Ok(elsewhere.clone()));
        // Nothing anywhere: the message says what was looked for and how to fetch.
        let empty = root.join("empty-home");
        let e = lookup(&[("RLX_HOME", &empty)], &[&elsewhere]).err().unwrap_or_default();
        assert!(e.contains("rlx fetch") && e.contains(&empty.join("models").display().to_string()), "{e}");
        let e = lookup(&[("RLX_MODEL_DIR", &root.join("nope"))], &[&deep]).err().unwrap_or_default();
        assert!(e.contains("RLX_MODEL_DIR") && e.contains("not a directory"), "{e}");
        let _ = std::fs::remove_dir_all(&root);
    }
}
