//! `rlx inspect`: what the compiler does to a graph.

use clap::Args;
use rlx::{AttentionSpec, CompileOptions, DType, Graph, Result as RlxResult};

use crate::stdout::print;

#[derive(Args)]
pub struct InspectArgs {
    /// Storage precision: f32, f16 or bf16.
    #[arg(long, default_value = "f32")]
    precision: String,
    /// Turn off the fusion passes.
    #[arg(long)]
    no_fuse: bool,
    /// Turn off merging of sibling matmuls.
    #[arg(long)]
    no_merge: bool,
    /// Run the exact (erf) GELU as its tanh approximation.
    #[arg(long)]
    approximate_gelu: bool,
    /// Print the schedule as JSON instead of text.
    #[arg(long)]
    json: bool,
    /// Inspect a BERT model directory (config.json) instead of the built-in
    /// example graph.
    #[arg(long)]
    model: Option<std::path::PathBuf>,
    /// Batch size of the model graph's shape bucket.
    #[arg(long, default_value_t = 1)]
    batch: usize,
    /// Sequence length of the model graph's shape bucket.
    #[arg(long, default_value_t = 128)]
    seq: usize,
}

/// The built-in example: one BERT-style encoder layer (batch 2, 16 tokens,
/// hidden 64, 4 heads, FFN 256) with embedding lookup in front.
pub fn example_encoder_layer() -> RlxResult<Graph> {
    let (b, s, h, heads, ffn, vocab) = (2, 16, 64, 4, 256, 100);
    let mut g = Graph::new();
    let ids = g.input("input_ids", [b, s], DType::I32)?;
    let mask = g.input("attention_mask", [b, s], DType::F32)?;
    let emb = g.param("embeddings.word", [vocab, h], DType::F32)?;
    let x = g.gather(emb, ids)?;
    let linear = |g: &mut Graph, x, name: &str, n_in: usize, n_out: usize| -> RlxResult<_> {
        let w = g.param(&format!("{name}.weight"), [n_out, n_in], DType::F32)?;
        let bias = g.param(&format!("{name}.bias"), [n_out], DType::F32)?;
        Ok(g.linear(x, w, Some(bias), true)?)
    };
    let q = linear(&mut g, x, "attn.q", h, h)?;
    let k = linear(&mut g, x, "attn.k", h, h)?;
    let v = linear(&mut g, x, "attn.v", h, h)?;
    let spec = AttentionSpec {
        heads,
        kv_heads: heads,
        head_dim: h / heads,
        scale: 1.0 / ((h / heads) as f32).sqrt(),
        causal: false,
        mask: true,
        valid_len: false,
    };
    let a = g.attention(spec, q, k, v, Some(mask), None)?;
    let o = linear(&mut g, a, "attn.out", h, h)?;
    let r = g.add(o, x)?;
    let g1 = g.param("ln1.gamma", [h], DType::F32)?;
    let b1 = g.param("ln1.beta", [h], DType::F32)?;
    let x1 = g.layer_norm(r, g1, b1, 1e-12)?;
    let f = linear(&mut g, x1, "ffn.up", h, ffn)?;
    let f = g.gelu(f)?;
    let f = linear(&mut g, f, "ffn.down", ffn, h)?;
    let r2 = g.add(f, x1)?;
    let g2 = g.param("ln2.gamma", [h], DType::F32)?;
    let b2 = g.param("ln2.beta", [h], DType::F32)?;
    let y = g.layer_norm(r2, g2, b2, 1e-12)?;
    g.set_name(y, "hidden");
    g.output(y)?;
    Ok(g)
}

pub fn run(args: InspectArgs) -> Result<(), String> {
    let precision = match DType::parse(&args.precision) {
        Some(DType::F32) => None,
        Some(d) if d.is_float() => Some(d),
        _ => return Err(format!("--precision: expected f32, f16 or bf16, found '{}'", args.precision)),
    };
    let graph = match &args.model {
        None => example_encoder_layer().map_err(|e| e.to_string())?,
        Some(dir) => {
            let cfg = rlx_models::BertConfig::from_file(&dir.join("config.json")).map_err(|e| e.to_string())?;
            if args.seq == 0 || args.seq > cfg.max_position_embeddings || args.batch == 0 {
                return Err(format!(
                    "--batch {} --seq {}: need batch >= 1 and 1 <= seq <= {} (max_position_embeddings)",
                    args.batch, args.seq, cfg.max_position_embeddings
                ));
            }
            rlx_models::build_bert_graph(&cfg, args.batch, args.seq, &rlx_models::BertGraphOptions::default()).map_err(|e| e.to_string())?
        }
    };
    let opts = CompileOptions {
        precision,
        fuse: !args.no_fuse,
        fuse_feed_forward: !args.no_fuse,
        merge_matmuls: !args.no_merge,
        approximate_gelu: args.approximate_gelu,
        qmatmul_scratch_rows: None,
    };
    let compiled = rlx::compile(&graph, &opts).map_err(|e| e.to_string())?;
    if args.json {
        let s = serde_json::to_string_pretty(&compiled.schedule).map_err(|e| e.to_string())?;
        return print(&s);
    }
    let a = &compiled.schedule.arena;
    let saved = if a.naive_bytes > 0 { 100.0 * (1.0 - a.planned_bytes as f64 / a.naive_bytes as f64) } else { 0.0 };
    print(&format!(
        "== graph before passes ({} nodes)\n{}\n== graph after passes ({} nodes)\n{}\n== schedule\n{}\n\
         == arena: {} bytes planned vs {} bytes naive ({saved:.1}% saved), {} buffers",
        compiled.before.len(),
        compiled.before,
        compiled.after.len(),
        compiled.after,
        compiled.schedule,
        a.planned_bytes,
        a.naive_bytes,
        a.buffers.len()
    ))
}
