//! Where `rlx` finds its default models: the lookup lives in
//! `rlx_models::model_dir`, shared with the Python package.

pub use rlx_models::model_dir::*;
