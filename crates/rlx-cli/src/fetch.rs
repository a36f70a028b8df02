//! `rlx fetch`: puts the default models in the per-user data directory. The
//! download and its sha256 checks are scripts/fetch-models, compiled into the
//! binary and run with `RLX_MODELS_ROOT` pointing there, so the repository's
//! script and an installed `rlx` share one implementation.

use std::path::PathBuf;
use std::process::Command;

use clap::Args;

use crate::model_dir::{user_models_dir, Env};

const FETCH_SCRIPT: &str = include_str!("../../../scripts/fetch-models");

#[derive(Args, Debug)]
pub struct FetchArgs {
    /// Also write an f16 copy of the model (all-MiniLM-L6-v2-f16, 45 MB),
    /// for GPU checks.
    #[arg(long)]
    pub f16: bool,
    /// The models directory to fill. Default: models/ in the data directory
    /// ($RLX_HOME, else $XDG_DATA_HOME/rlx, else ~/.local/share/rlx).
    #[arg(long)]
    pub dir: Option<PathBuf>,
}

pub fn run(args: FetchArgs) -> Result<(), String> {
    let dir = match args.dir {
        Some(d) => d,
        None => user_models_dir(&Env::process())?,
    };
    let mut cmd = Command::new("bash");
    // `bash -c SCRIPT NAME ARGS`: NAME becomes $0 in the script's messages.
    cmd.arg("-c").arg(FETCH_SCRIPT).arg("rlx fetch").env("RLX_MODELS_ROOT", &dir);
    if args.f16 {
        cmd.arg("--f16");
    }
    let status = cmd.status().map_err(|e| format!("cannot start bash to fetch the models: {e} (rlx fetch needs bash, python3 and pip)"))?;
    if !status.success() {
        return Err(format!("fetching the models into {} failed ({status})", dir.display()));
    }
    Ok(())
}
