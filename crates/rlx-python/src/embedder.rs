//! `rlx.SentenceEmbedder`: sentence-transformers' `encode` over
//! [`rlx_models::SentenceEmbedder`].

use std::collections::HashMap;
use std::path::PathBuf;
use std::sync::{Arc, Mutex};

use numpy::{PyArray1, PyArrayMethods};
use pyo3::exceptions::{PyFileNotFoundError, PyRuntimeError, PyValueError};
use pyo3::prelude::*;
use pyo3::types::{PyList, PyString};
use rlx::DType;
use rlx_models::model_dir::default_model_dir;
use rlx_models::{l2_normalize, EmbedderOptions, SentenceEmbedder};

use crate::{check_exists, lookup_env, model_error, parse_device, run_detached};

/// Texts per forward pass when `encode` is not told otherwise.
const DEFAULT_BATCH_SIZE: usize = 32;

/// A sentence-transformers BERT model loaded for one device.
///
/// One Rust embedder per batch size, all sharing one copy of the weights:
/// `encode(batch_size=N)` makes the one for N on first use.
#[pyclass(name = "SentenceEmbedder", module = "rlx", frozen)]
pub struct PySentenceEmbedder {
    first: Arc<SentenceEmbedder>,
    by_batch_size: Mutex<HashMap<usize, Arc<SentenceEmbedder>>>,
    model: PathBuf,
}

impl PySentenceEmbedder {
    fn for_batch_size(&self, batch_size: usize) -> PyResult<Arc<SentenceEmbedder>> {
        if batch_size == 0 {
            return Err(PyValueError::new_err("batch_size must be at least 1, found 0"));
        }
        let mut map = self.by_batch_size.lock().map_err(|_| PyRuntimeError::new_err("embedder poisoned by a panic in another thread"))?;
        if let Some(e) = map.get(&batch_size) {
            return Ok(e.clone());
        }
        let e = Arc::new(self.first.with_batch_size(batch_size).map_err(model_error)?);
        map.insert(batch_size, e.clone());
        Ok(e)
    }
}

#[pymethods]
impl PySentenceEmbedder {
    /// Loads a model directory (config.json, model.safetensors,
    /// tokenizer.json and the sentence-transformers files). Without `model`,
    /// the default one `rlx` finds: $RLX_MODEL_DIR, else
    /// models/all-MiniLM-L6-v2 in a checkout around the current directory or
    /// the package, else the one `rlx fetch` put in the data directory.
    #[new]
    #[pyo3(signature = (model=None, device="cpu", dtype="f32"))]
    fn new(py: Python<'_>, model: Option<PathBuf>, device: &str, dtype: &str) -> PyResult<Self> {
        let device = parse_device(device)?;
        let dtype = match DType::parse(dtype) {
            Some(d) if d.is_float() => d,
            _ => return Err(PyValueError::new_err(format!("dtype '{dtype}': expected 'f32', 'f16' or 'bf16'"))),
        };
        let model = match model {
            Some(m) => {
                check_exists(&m, "model directory")?;
                m
            }
            None => default_model_dir(&lookup_env(py)).map_err(PyFileNotFoundError::new_err)?,
        };
        let opts = EmbedderOptions { dtype, batch_size: DEFAULT_BATCH_SIZE, approximate_gelu: false };
        let dir = model.clone();
        let first = run_detached(py, move || SentenceEmbedder::load_with(&dir, device, opts).map_err(model_error))?;
        let first = Arc::new(first);
        let by_batch_size = Mutex::new(HashMap::from([(DEFAULT_BATCH_SIZE, first.clone())]));
        Ok(PySentenceEmbedder { first, by_batch_size, model })
    }

    /// Embeds one text (a `(dimension,)` array) or a list of texts (an
    /// `(n, dimension)` array), float32, in input order. The model's own
    /// Normalize module applies as in sentence-transformers;
    /// `normalize_embeddings=True` L2-normalises the result again. Texts
    /// longer than `max_seq_length` tokens are truncated. With
    /// `convert_to_numpy=False`, a list of 1-D arrays instead.
    #[pyo3(signature = (sentences, batch_size=DEFAULT_BATCH_SIZE, normalize_embeddings=false, convert_to_numpy=true))]
    fn encode<'py>(
        &self,
        py: Python<'py>,
        sentences: &Bound<'py, PyAny>,
        batch_size: usize,
        normalize_embeddings: bool,
        convert_to_numpy: bool,
    ) -> PyResult<Bound<'py, PyAny>> {
        let single = sentences.is_instance_of::<PyString>();
        let texts: Vec<String> = if single {
            vec![sentences.extract()?]
        } else {
            sentences.extract().map_err(|_| {
                let found = sentences.get_type().name().map(|n| n.to_string()).unwrap_or_else(|_| "?".into());
                PyValueError::new_err(format!("sentences: expected a str or a list of str, found {found}"))
            })?
        };
        let embedder = self.for_batch_size(batch_size)?;
        let dim = embedder.dim();
        let vectors = run_detached(py, move || {
            let refs: Vec<&str> = texts.iter().map(String::as_str).collect();
            let v = embedder.embed(&refs).map_err(model_error)?;
            Ok(if normalize_embeddings { v.into_iter().map(l2_normalize).collect() } else { v })
        })?;
        if single {
            let v = vectors.into_iter().next().ok_or_else(|| PyRuntimeError::new_err("the embedder returned no vector"))?;
            return Ok(PyArray1::from_vec(py, v).into_any());
        }
        if !convert_to_numpy {
            let rows: Vec<Bound<'py, PyArray1<f32>>> = vectors.into_iter().map(|v| PyArray1::from_vec(py, v)).collect();
            return Ok(PyList::new(py, rows)?.into_any());
        }
        let n = vectors.len();
        let flat: Vec<f32> = vectors.into_iter().flatten().collect();
        Ok(PyArray1::from_vec(py, flat).reshape([n, dim])?.into_any())
    }

    /// Token ids of each text as the model sees them (`[CLS]` … `[SEP]`).
    fn tokenize(&self, py: Python<'_>, sentences: Vec<String>) -> PyResult<Vec<Vec<u32>>> {
        let embedder = self.first.clone();
        run_detached(py, move || {
            let refs: Vec<&str> = sentences.iter().map(String::as_str).collect();
            embedder.tokenize(&refs).map_err(model_error)
        })
    }

    /// Length of the vectors.
    #[getter]
    fn dimension(&self) -> usize {
        self.first.dim()
    }

    /// sentence-transformers' name for [`dimension`](Self::dimension).
    fn get_sentence_embedding_dimension(&self) -> usize {
        self.first.dim()
    }

    /// The most tokens a text keeps, special tokens included.
    #[getter]
    fn max_seq_length(&self) -> usize {
        self.first.max_tokens()
    }

    #[getter]
    fn device(&self) -> String {
        self.first.device().to_string()
    }

    /// The model directory.
    #[getter]
    fn model(&self) -> String {
        self.model.display().to_string()
    }

    fn __repr__(&self) -> String {
        format!(
            "SentenceEmbedder(model='{}', device='{}', dtype='{}', dimension={})",
            self.model.display(),
            self.first.device(),
            self.first.options().dtype,
            self.first.dim()
        )
    }
}
