//! The BERT encoder as an RLX graph, for any BertModel config and one shape
//! bucket. The graph is the plain textbook one (separate Q/K/V projections,
//! bias adds, residual adds before LayerNorm); the compiler merges and fuses.

use rlx::{AttentionSpec, DType, Graph, NodeId};

use crate::{BertConfig, Pooling, Result};

/// Graph input names.
pub const INPUT_IDS: &str = "input_ids";
pub const ATTENTION_MASK: &str = "attention_mask";
pub const TOKEN_TYPE_IDS: &str = "token_type_ids";

/// What the graph computes besides the pooled vector.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct BertGraphOptions {
    pub pooling: Pooling,
    /// Also output the embedding-LayerNorm output and every layer's output,
    /// each `[B, S, hidden]` (outputs 1..=layers+1).
    pub hidden_states: bool,
    /// Take a `token_type_ids` i32 `[B, S]` input; otherwise every token has
    /// type 0.
    pub token_type_ids: bool,
}

impl Default for BertGraphOptions {
    fn default() -> Self {
        BertGraphOptions { pooling: Pooling::Mean, hidden_states: false, token_type_ids: false }
    }
}

/// Builds the encoder for `batch` sequences of `seq` tokens.
///
/// Inputs: `input_ids` i32 `[batch, seq]`, `attention_mask` f32 `[batch, seq]`
/// (1 = token, 0 = padding; every row needs at least one 1), and
/// `token_type_ids` if asked for. Output 0 is the pooled vector `[batch,
/// hidden]`, not normalised (the caller normalises on the host).
pub fn build_bert_graph(cfg: &BertConfig, batch: usize, seq: usize, opts: &BertGraphOptions) -> Result<Graph> {
    let (h, inter) = (cfg.hidden_size, cfg.intermediate_size);
    let f = DType::F32;
    let mut g = Graph::new();
    let ids = g.input(INPUT_IDS, [batch, seq], DType::I32)?;
    let mask = g.input(ATTENTION_MASK, [batch, seq], f)?;

    // Embeddings: word + position + token type, then LayerNorm.
    let word = g.param("embeddings.word_embeddings.weight", [cfg.vocab_size, h], f)?;
    let mut x = g.gather(word, ids)?;
    let pos_table = g.param("embeddings.position_embeddings.weight", [cfg.max_position_embeddings, h], f)?;
    let pos = g.narrow(pos_table, 0, 0, seq)?;
    x = g.add(x, pos)?;
    if cfg.type_vocab_size > 0 {
        let tt_table = g.param("embeddings.token_type_embeddings.weight", [cfg.type_vocab_size, h], f)?;
        let tt = if opts.token_type_ids {
            let tt_ids = g.input(TOKEN_TYPE_IDS, [batch, seq], DType::I32)?;
            g.gather(tt_table, tt_ids)?
        } else {
            g.narrow(tt_table, 0, 0, 1)?
        };
        x = g.add(x, tt)?;
    }
    x = layer_norm(&mut g, x, "embeddings.LayerNorm", h, cfg.layer_norm_eps)?;
    let mut hidden = vec![x];

    let spec = AttentionSpec {
        heads: cfg.num_attention_heads,
        kv_heads: cfg.num_attention_heads,
        head_dim: cfg.head_dim(),
        scale: 1.0 / (cfg.head_dim() as f32).sqrt(),
        causal: false,
        mask: true,
        valid_len: false,
    };
    for l in 0..cfg.num_hidden_layers {
        let p = format!("encoder.layer.{l}.");
        let q = linear(&mut g, x, &format!("{p}attention.self.query"), h, h)?;
        let k = linear(&mut g, x, &format!("{p}attention.self.key"), h, h)?;
        let v = linear(&mut g, x, &format!("{p}attention.self.value"), h, h)?;
        let ctx = g.attention(spec, q, k, v, Some(mask), None)?;
        let attn_out = linear(&mut g, ctx, &format!("{p}attention.output.dense"), h, h)?;
        let res = g.add(attn_out, x)?;
        let x1 = layer_norm(&mut g, res, &format!("{p}attention.output.LayerNorm"), h, cfg.layer_norm_eps)?;
        let up = linear(&mut g, x1, &format!("{p}intermediate.dense"), h, inter)?;
        let act = g.activation(cfg.hidden_act, up)?;
        let down = linear(&mut g, act, &format!("{p}output.dense"), inter, h)?;
        let res = g.add(down, x1)?;
        x = layer_norm(&mut g, res, &format!("{p}output.LayerNorm"), h, cfg.layer_norm_eps)?;
        hidden.push(x);
    }

    let pooled = match opts.pooling {
        // sum(h · mask) / max(sum(mask), 1e-9) over the sequence axis, one
        // kernel (a multiply, two reductions and a division before).
        Pooling::Mean => g.masked_mean(x, mask)?,
        Pooling::Cls => {
            let first = g.narrow(x, 1, 0, 1)?;
            g.reshape(first, [batch, h])?
        }
    };
    g.set_name(pooled, "pooled");
    g.output(pooled)?;
    if opts.hidden_states {
        for (i, hs) in hidden.into_iter().enumerate() {
            // A node may be an output once; name each by its layer.
            g.set_name(hs, format!("hidden_state.{i}"));
            g.output(hs)?;
        }
    }
    Ok(g)
}

/// `x · Wᵀ + b` with PyTorch's `[out, in]` weight layout.
fn linear(g: &mut Graph, x: NodeId, prefix: &str, d_in: usize, d_out: usize) -> Result<NodeId> {
    let w = g.param(&format!("{prefix}.weight"), [d_out, d_in], DType::F32)?;
    let b = g.param(&format!("{prefix}.bias"), [d_out], DType::F32)?;
    Ok(g.linear(x, w, Some(b), true)?)
}

fn layer_norm(g: &mut Graph, x: NodeId, prefix: &str, h: usize, eps: f32) -> Result<NodeId> {
    let gamma = g.param(&format!("{prefix}.weight"), [h], DType::F32)?;
    let beta = g.param(&format!("{prefix}.bias"), [h], DType::F32)?;
    Ok(g.layer_norm(x, gamma, beta, eps)?)
}
