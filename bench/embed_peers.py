#!/usr/bin/env python3
"""Peers for the CPU sentence-embedding benchmark (crates/rlx-models/benches/embed.rs).

Serves timing requests over stdin/stdout so the Rust bench can alternate RLX and
the peers run by run in one process tree, on the same thread count:

  ort      ONNX Runtime, the model exported from PyTorch, session at ORT_ENABLE_ALL
  ort_opt  the same after onnxruntime's transformer optimizer (fused Attention,
           SkipLayerNorm, BiasGelu), also at ORT_ENABLE_ALL
  torch    PyTorch eager (transformers BertModel, SDPA attention), inference_mode

Every engine computes token ids -> mean-pooled, L2-normalised embedding, the
same thing RLX's SentenceEmbedder does. Requests are JSON lines:

  {"cmd": "fwd", "engine": E, "batch": B, "seq": S}   -> {"ms": t, "row0": [...]}
  {"cmd": "e2e", "engine": E}                         -> {"seconds": t, "texts": n}
  {"cmd": "quit"}

Input ids for "fwd" follow ids_for() below (the Rust side uses the same formula);
"e2e" embeds bench/embed-corpus.txt with the HF fast tokenizer, sorted by length,
batches of 32 padded to the longest, truncation at 256 (sentence-transformers'
way). Install the peers with bench/setup-peers.sh (never in CI).
"""
import argparse
import json
import os
import sys
import time


def log(*a):
    print(*a, file=sys.stderr, flush=True)


def ids_for(batch, seq):
    """Deterministic ids: [CLS] ... [SEP], the middle spread over the vocabulary."""
    rows = []
    for b in range(batch):
        row = []
        for s in range(seq):
            if s == 0:
                row.append(101)
            elif s == seq - 1:
                row.append(102)
            else:
                row.append(1000 + (b * 7919 + s * 104729) % 28000)
        rows.append(row)
    return rows


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--model", required=True, help="models/all-MiniLM-L6-v2")
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--corpus", required=True)
    # models/ is git-ignored: the exported ONNX files live beside the model.
    ap.add_argument("--cache", default=os.path.join(os.path.dirname(os.path.abspath(__file__)), "..", "models", ".bench-cache"))
    args = ap.parse_args()

    import numpy as np
    import torch
    import onnxruntime as ort
    import transformers
    from transformers import AutoTokenizer, BertModel

    torch.set_num_threads(args.threads)
    torch.set_num_interop_threads(1)

    class Pooled(torch.nn.Module):
        def __init__(self, bert):
            super().__init__()
            self.bert = bert

        def forward(self, input_ids, attention_mask):
            h = self.bert(input_ids=input_ids, attention_mask=attention_mask,
                          token_type_ids=torch.zeros_like(input_ids)).last_hidden_state
            m = attention_mask.unsqueeze(-1).to(h.dtype)
            pooled = (h * m).sum(1) / m.sum(1).clamp(min=1e-9)
            return torch.nn.functional.normalize(pooled, p=2, dim=1)

    torch_model = Pooled(BertModel.from_pretrained(args.model, add_pooling_layer=False, attn_implementation="sdpa")).eval()

    os.makedirs(args.cache, exist_ok=True)
    onnx_path = os.path.join(args.cache, "minilm-pooled.onnx")
    opt_path = os.path.join(args.cache, "minilm-pooled-opt.onnx")
    if not os.path.exists(onnx_path):
        # Eager attention exports the plain MatMul/Softmax pattern ORT's
        # transformer optimizer knows how to fuse.
        export_model = Pooled(BertModel.from_pretrained(args.model, add_pooling_layer=False, attn_implementation="eager")).eval()
        ex = (torch.tensor(ids_for(2, 16)), torch.ones(2, 16, dtype=torch.int64))
        dyn = {"input_ids": {0: "batch", 1: "seq"}, "attention_mask": {0: "batch", 1: "seq"}, "embedding": {0: "batch"}}
        kw = dict(input_names=["input_ids", "attention_mask"], output_names=["embedding"], dynamic_axes=dyn, opset_version=17)
        try:
            torch.onnx.export(export_model, ex, onnx_path, dynamo=False, **kw)
        except Exception as e:  # newer torch may have dropped the TorchScript exporter
            log(f"TorchScript ONNX export failed ({e}); using the dynamo exporter")
            torch.onnx.export(export_model, ex, onnx_path, dynamo=True, **kw)
    if not os.path.exists(opt_path):
        try:
            from onnxruntime.transformers import optimizer
            m = optimizer.optimize_model(onnx_path, model_type="bert", num_heads=12, hidden_size=384)
            log("ORT transformer optimizer fused:", json.dumps(m.get_fused_operator_statistics()))
            m.save_model_to_file(opt_path)
        except Exception as e:  # e.g. the onnx package missing: go on without that engine
            log(f"ORT transformer optimizer unavailable ({e}); no ort_opt engine")

    def session(path):
        so = ort.SessionOptions()
        so.graph_optimization_level = ort.GraphOptimizationLevel.ORT_ENABLE_ALL
        so.intra_op_num_threads = args.threads
        so.inter_op_num_threads = 1
        so.execution_mode = ort.ExecutionMode.ORT_SEQUENTIAL
        return ort.InferenceSession(path, so, providers=["CPUExecutionProvider"])

    sessions = {"ort": session(onnx_path)}
    if os.path.exists(opt_path):
        sessions["ort_opt"] = session(opt_path)
    engines = [e for e in ("ort", "ort_opt") if e in sessions] + ["torch"]

    def run(engine, ids, mask):
        if engine == "torch":
            with torch.inference_mode():
                return torch_model(torch.from_numpy(ids), torch.from_numpy(mask)).numpy()
        return sessions[engine].run(None, {"input_ids": ids, "attention_mask": mask})[0]

    tok = AutoTokenizer.from_pretrained(args.model)
    with open(args.corpus, encoding="utf-8") as f:
        corpus = f.read().split("\n")[:-1]

    def e2e(engine):
        order = sorted(range(len(corpus)), key=lambda i: len(corpus[i]))
        out = [None] * len(corpus)
        for k in range(0, len(order), 32):
            idx = order[k:k + 32]
            enc = tok([corpus[i] for i in idx], padding=True, truncation=True, max_length=256, return_tensors="np")
            vecs = run(engine, enc["input_ids"].astype(np.int64), enc["attention_mask"].astype(np.int64))
            for j, i in enumerate(idx):
                out[i] = vecs[j]
        return out

    versions = {"torch": torch.__version__, "onnxruntime": ort.__version__, "transformers": transformers.__version__}
    print(json.dumps({"ready": True, "versions": versions, "threads": args.threads, "engines": engines}), flush=True)
    for line in sys.stdin:
        req = json.loads(line)
        cmd = req.get("cmd")
        if cmd == "quit":
            break
        if cmd == "fwd":
            ids = np.array(ids_for(req["batch"], req["seq"]), dtype=np.int64)
            mask = np.ones_like(ids)
            t0 = time.perf_counter()
            vec = run(req["engine"], ids, mask)
            ms = (time.perf_counter() - t0) * 1e3
            print(json.dumps({"ms": ms, "row0": [float(x) for x in vec[0]]}), flush=True)
        elif cmd == "e2e":
            t0 = time.perf_counter()
            vecs = e2e(req["engine"])
            print(json.dumps({"seconds": time.perf_counter() - t0, "texts": len(vecs)}), flush=True)
        else:
            print(json.dumps({"error": f"unknown command {cmd!r}"}), flush=True)


if __name__ == "__main__":
    main()
