//! Models for RLX: loaders (safetensors, Hugging Face config and tokenizer,
//! sentence-transformers pooling), the BERT graph builder, and
//! [`SentenceEmbedder`], which turns texts into vectors.
//!
//! ```no_run
//! # fn main() -> Result<(), rlx_models::ModelError> {
//! let embedder = rlx_models::SentenceEmbedder::load("models/all-MiniLM-L6-v2", rlx::Device::Cpu)?;
//! let vectors = embedder.embed(&["first text", "second text"])?;
//! assert_eq!(vectors[0].len(), embedder.dim());
//! # Ok(()) }
//! ```

mod ascii_wordpiece;
mod bert;
pub mod bpe_vocab;
pub mod chat_template;
mod config;
mod embedder;
mod embedding_writer;
mod error;
mod generator;
pub mod gguf;
pub mod llama;
pub mod model_dir;
mod npy;
pub mod safetensors;
mod search;
mod text_lines;
pub mod text_stream;
mod tokenizer;
mod weights;

pub use bert::{build_bert_graph, BertGraphOptions, ATTENTION_MASK, INPUT_IDS, TOKEN_TYPE_IDS};
pub use chat_template::Message;
pub use config::{BertConfig, Pooling, SentenceConfig};
pub use embedder::{cosine, l2_normalize, EmbedderOptions, EmbedderParts, SentenceEmbedder, SEQ_BUCKETS};
pub use embedding_writer::{EmbeddingWriter, OutputFormat};
pub use error::{ModelError, Result};
pub use generator::{
    default_kv_dtype, gguf_text, BatchEvent, BatchOutput, Generation, GenerationStats, Generator, GeneratorOptions, Piece, PromptEncoder,
    SamplingParams, StopReason,
};
pub use npy::{read_npy_f32, NpyMatrix};
pub use search::{CorpusIndex, Hit, DEFAULT_CHUNK_ROWS, MAX_QUERY_BATCH};
pub use text_lines::TextLines;
pub use tokenizer::TextTokenizer;
pub use weights::{bert_weight_specs, load_bert_weights, random_weights};
