#!/usr/bin/env python3
"""Writes the small hand-made seed inputs under fuzz/seeds/<target>/.
Run from anywhere; the files are committed, this only regenerates them."""
import json, os, struct

ROOT = os.path.join(os.path.dirname(os.path.abspath(__file__)), "seeds")

def put(target, name, data):
    d = os.path.join(ROOT, target)
    os.makedirs(d, exist_ok=True)
    if isinstance(data, str):
        data = data.encode()
    with open(os.path.join(d, name), "wb") as f:
        f.write(data)

# safetensors: header length, JSON header, data.
def st(header, data=b"", pad=True):
    h = json.dumps(header, separators=(",", ":")).encode()
    while pad and len(h) % 8:
        h += b" "
    return struct.pack("<Q", len(h)) + h + data

two = {"a": {"dtype": "F32", "shape": [2], "data_offsets": [0, 8]},
       "b": {"dtype": "F16", "shape": [2, 1], "data_offsets": [8, 12]}}
put("safetensors_header", "good", st(two, b"\0" * 12))
put("safetensors_header", "metadata", st({"__metadata__": {"format": "pt"}, **two}, b"\0" * 12))
put("safetensors_header", "truncated", st(two, b"\0" * 6))
put("safetensors_header", "overlap", st({"a": {"dtype": "F32", "shape": [2], "data_offsets": [0, 8]},
                                          "b": {"dtype": "F32", "shape": [1], "data_offsets": [4, 8]}}, b"\0" * 8))
put("safetensors_header", "bad_dtype", st({"a": {"dtype": "Q9", "shape": [1], "data_offsets": [0, 4]}}, b"\0" * 4))
put("safetensors_header", "huge_shape", st({"a": {"dtype": "F32", "shape": [4294967296, 4294967296], "data_offsets": [0, 4]}}, b"\0" * 4))
put("safetensors_header", "empty_header", st({}))
put("safetensors_header", "huge_length", struct.pack("<Q", 1 << 62) + b"{}")
put("safetensors_header", "all_dtypes", st({f"t{i}": {"dtype": d, "shape": [1], "data_offsets": [8 * i, 8 * i + s]}
                                             for i, (d, s) in enumerate([("F64", 8), ("I64", 8), ("I32", 4), ("I16", 2), ("I8", 1), ("U8", 1), ("BOOL", 1), ("BF16", 2)])},
                                            b"\0" * 64))

# config.json
tiny = {"architectures": ["BertModel"], "model_type": "bert", "hidden_size": 8, "num_hidden_layers": 1,
        "num_attention_heads": 2, "intermediate_size": 16, "hidden_act": "gelu", "layer_norm_eps": 1e-12,
        "max_position_embeddings": 32, "type_vocab_size": 2, "vocab_size": 50}
put("bert_config", "tiny.json", json.dumps(tiny))
minilm = dict(tiny, hidden_size=384, num_hidden_layers=6, num_attention_heads=12, intermediate_size=1536,
              max_position_embeddings=512, vocab_size=30522, position_embedding_type="absolute")
put("bert_config", "minilm.json", json.dumps(minilm, indent=2))
put("bert_config", "huge_layers.json", json.dumps(dict(tiny, num_hidden_layers=1000000000000)))
put("bert_config", "llama.json", json.dumps({"model_type": "llama", "hidden_size": 64}))
put("bert_config", "relu.json", json.dumps(dict(tiny, hidden_act="relu", type_vocab_size=0)))

# tokenizer.json: a tiny WordPiece (BERT-style) and a tiny byte-level BPE.
vocab = ["[PAD]", "[UNK]", "[CLS]", "[SEP]", "hello", "world", "##s", "word", ",", "!", "a", "b", "c"]
wordpiece = {
    "version": "1.0", "truncation": None, "padding": None,
    "added_tokens": [{"id": i, "content": t, "single_word": False, "lstrip": False, "rstrip": False,
                      "normalized": False, "special": True} for i, t in enumerate(vocab[:4])],
    "normalizer": {"type": "BertNormalizer", "clean_text": True, "handle_chinese_chars": True,
                   "strip_accents": None, "lowercase": True},
    "pre_tokenizer": {"type": "BertPreTokenizer"},
    "post_processor": {"type": "TemplateProcessing",
                       "single": [{"SpecialToken": {"id": "[CLS]", "type_id": 0}}, {"Sequence": {"id": "A", "type_id": 0}},
                                  {"SpecialToken": {"id": "[SEP]", "type_id": 0}}],
                       "pair": [{"Sequence": {"id": "A", "type_id": 0}}, {"Sequence": {"id": "B", "type_id": 1}}],
                       "special_tokens": {"[CLS]": {"id": "[CLS]", "ids": [2], "tokens": ["[CLS]"]},
                                          "[SEP]": {"id": "[SEP]", "ids": [3], "tokens": ["[SEP]"]}}},
    "decoder": {"type": "WordPiece", "prefix": "##", "cleanup": True},
    "model": {"type": "WordPiece", "unk_token": "[UNK]", "continuing_subword_prefix": "##",
              "max_input_chars_per_word": 100, "vocab": {t: i for i, t in enumerate(vocab)}},
}
put("tokenizer_json", "wordpiece.json", json.dumps(wordpiece))
put("tokenizer_json", "wordpiece_truncating.json",
    json.dumps(dict(wordpiece, truncation={"direction": "Right", "max_length": 128, "strategy": "LongestFirst", "stride": 0})))
bpe = {
    "version": "1.0", "truncation": None, "padding": None, "added_tokens": [],
    "normalizer": None, "pre_tokenizer": {"type": "ByteLevel", "add_prefix_space": False, "trim_offsets": True, "use_regex": True},
    "post_processor": None, "decoder": {"type": "ByteLevel", "add_prefix_space": True, "trim_offsets": True, "use_regex": True},
    "model": {"type": "BPE", "dropout": None, "unk_token": None, "continuing_subword_prefix": None, "end_of_word_suffix": None,
              "fuse_unk": False, "byte_fallback": False, "vocab": {"h": 0, "e": 1, "l": 2, "o": 3, "he": 4, "ll": 5, "hell": 6, "Ġ": 7},
              "merges": ["h e", "l l", "he ll"]},
}
put("tokenizer_json", "bpe.json", json.dumps(bpe))
put("tokenizer_json", "not_json", "{ this is not")

# text lines
put("text_lines", "plain", "first\nsecond\n\nfourth")
put("text_lines", "crlf", "a\r\nb\r\n\r\n")
put("text_lines", "bad_utf8", b"ok\n\xff\xfe\nafter\n")
put("text_lines", "nul", b"nul\0in\0side\n\0\n")
put("text_lines", "long", b"\x03" + b"x" * 300 + b"\n" + "é".encode() * 100)

# GGUF v3
def gstr(s):
    b = s.encode()
    return struct.pack("<Q", len(b)) + b

def gval(v):
    if isinstance(v, bool):
        return struct.pack("<I", 7) + struct.pack("<?", v)
    if isinstance(v, int):
        return struct.pack("<I", 4) + struct.pack("<I", v)
    if isinstance(v, float):
        return struct.pack("<I", 6) + struct.pack("<f", v)
    if isinstance(v, str):
        return struct.pack("<I", 8) + gstr(v)
    if isinstance(v, list):
        if all(isinstance(x, str) for x in v):
            return struct.pack("<IIQ", 9, 8, len(v)) + b"".join(gstr(x) for x in v)
        return struct.pack("<IIQ", 9, 5, len(v)) + b"".join(struct.pack("<i", x) for x in v)
    raise TypeError(v)

def gguf(kvs, tensors=(), align=32):
    out = b"GGUF" + struct.pack("<IQQ", 3, len(tensors), len(kvs))
    for k, v in kvs:
        out += gstr(k) + gval(v)
    offset = 0
    datas = []
    for name, dims, ty, data in tensors:
        out += gstr(name) + struct.pack("<I", len(dims)) + b"".join(struct.pack("<Q", d) for d in dims)
        out += struct.pack("<IQ", ty, offset)
        datas.append(data)
        offset += len(data)
        offset = (offset + align - 1) // align * align
    out += b"\0" * ((-len(out)) % align)
    for d in datas:
        out += d + b"\0" * ((-len(d)) % align)
    return out

chatml = ("{% for m in messages %}<|im_start|>{{ m['role'] }}\n{{ m['content'] }}<|im_end|>\n{% endfor %}"
          "{% if add_generation_prompt %}<|im_start|>assistant\n{% endif %}")
toks = ["<|endoftext|>", "<|im_start|>", "<|im_end|>", "H", "e", "l", "o", "He", "ll", "Hell", "Hello", "Ġ", ",", "!"]
tok_kvs = [("tokenizer.ggml.model", "gpt2"), ("tokenizer.ggml.pre", "smollm"), ("tokenizer.ggml.tokens", toks),
           ("tokenizer.ggml.merges", ["H e", "l l", "He ll", "Hell o"]),
           ("tokenizer.ggml.token_type", [3, 3, 3] + [1] * (len(toks) - 3)),
           ("tokenizer.ggml.bos_token_id", 1), ("tokenizer.ggml.eos_token_id", 2),
           ("tokenizer.chat_template", chatml)]
llama_kvs = [("general.architecture", "llama"), ("general.alignment", 32), ("llama.embedding_length", 8),
             ("llama.block_count", 1), ("llama.attention.head_count", 2), ("llama.attention.head_count_kv", 1),
             ("llama.feed_forward_length", 16), ("llama.context_length", 64),
             ("llama.attention.layer_norm_rms_epsilon", 1e-5), ("llama.rope.freq_base", 10000.0)]
put("gguf_file", "tokenizer_only.gguf", gguf(tok_kvs))
put("gguf_file", "llama_tiny.gguf", gguf(llama_kvs + tok_kvs, [("token_embd.weight", [8, 14], 0, b"\0" * (8 * 14 * 4)),
                                                              ("output_norm.weight", [8], 0, struct.pack("<8f", *[1.0] * 8))]))
put("gguf_file", "q8_tensor.gguf", gguf(llama_kvs, [("blk.0.attn_q.weight", [32, 2], 8, b"\x00\x3c" + b"\x01" * 32 + b"\x00\x3c" + b"\x02" * 32)]))
put("gguf_file", "empty.gguf", gguf([]))
put("gguf_file", "v2_header", b"GGUF" + struct.pack("<IQQ", 2, 0, 0))
put("gguf_file", "lying_counts", b"GGUF" + struct.pack("<IQQ", 3, 1 << 40, 1 << 40))

# bpe vocab: model ÿ pre ÿ tokens(NUL) ÿ merges(NUL) ÿ types/ids ÿ text
def bpe_seed(model, pre, tokens, merges, types, text):
    return b"\xff".join([model.encode(), pre.encode(), b"\0".join(t.encode() for t in tokens),
                         b"\0".join(m.encode() for m in merges), bytes(types), text.encode()])
put("bpe_vocab", "gpt2", bpe_seed("gpt2", "", toks, ["H e", "l l", "He ll", "Hell o"], [1, 2, 0, 0] + [1] * 10, "Hello, Hello!"))
put("bpe_vocab", "smollm", bpe_seed("gpt2", "smollm", toks, ["H e", "l l"], [3, 3, 3, 1], "Hell o"))
put("bpe_vocab", "llama_model", bpe_seed("llama", "", ["<unk>", "a"], [], [], "a"))
put("bpe_vocab", "bad_merge", bpe_seed("gpt2", "qwen2", ["a", "b"], ["a b c", "z q"], [1, 1], "ab"))

# chat templates: source ÿ role\0content\0role\0content ...
def chat(src, *msgs):
    return src.encode() + b"\xff" + b"\0".join(m.encode() for m in msgs)
put("chat_template", "chatml", chat(chatml, "system", "Be brief.", "user", "Hi", "assistant", "Hello", "user", "2+2?"))
put("chat_template", "llama3", chat("{{ bos_token }}{% for m in messages %}<|start_header_id|>{{ m.role }}<|end_header_id|>\n\n"
                                     "{{ m.content | trim }}<|eot_id|>{% endfor %}{% if add_generation_prompt %}"
                                     "<|start_header_id|>assistant<|end_header_id|>\n\n{% endif %}", "user", "hi"))
put("chat_template", "raise", chat("{% if messages[0].role != 'user' %}{{ raise_exception('first must be user') }}{% endif %}ok",
                                    "system", "x"))
put("chat_template", "loop", chat("{% for i in range(1000000) %}{{ i }}{% endfor %}", "user", "x"))
put("chat_template", "macro", chat("{% macro f(n) %}{% if n > 0 %}{{ f(n - 1) }}{% endif %}x{% endmacro %}{{ f(100) }}", "user", "y"))

# rlx-cuda's matmul-choice file: `<32 hex key> lt <8 hex words>` lines.
k1, k2 = "0123456789abcdef0123456789abcdef", "fedcba9876543210fedcba9876543210"
line = lambda k, ws: f"{k} lt {' '.join(format(w, 'x') for w in ws)}\n"
put("gemm_choices", "good", line(k1, range(8)) + line(k2, [0xdeadbeef, 2**64 - 1, 0, 1, 2, 3, 4, 5]))
put("gemm_choices", "last_wins", line(k1, [1] * 8) + line(k1, [2] * 8))
put("gemm_choices", "torn", line(k1, range(8)) + line(k2, range(8))[:40])
put("gemm_choices", "bad_lines", "garbage\n" + k1 + " lt 1 2 3\n" + k1 + " own 64 9 3 2\n" + line("ABC", range(8))
    + k1 + " lt 10000000000000000 0 0 0 0 0 0 0\n")
put("gemm_choices", "not_utf8", b"\xff\xfe lt\n" + line(k2, range(8)).encode())

# rlx-cuda's kernel cache file: CUBIN + "RLXCUBIN" + u64 length + sha256.
import hashlib
def elf(shnum=1, phnum=0, machine=190, size=256):
    b = bytearray(size)
    b[0:4] = b"\x7fELF"; b[4] = 2; b[5] = 1
    struct.pack_into("<H", b, 18, machine)
    struct.pack_into("<Q", b, 32, 64 if phnum else 0)
    struct.pack_into("<Q", b, 40, 64 + 56 * phnum)
    struct.pack_into("<HHHH", b, 54, 56, phnum, 64, shnum)
    return bytes(b)
def cache(cubin):
    return cubin + b"RLXCUBIN" + struct.pack("<Q", len(cubin)) + hashlib.sha256(cubin).digest()
put("kernel_cache", "good", cache(elf()))
put("kernel_cache", "with_phdrs", cache(elf(shnum=2, phnum=1, size=64 + 56 + 128)))
put("kernel_cache", "bare_elf", elf())
put("kernel_cache", "truncated", cache(elf())[:200])
put("kernel_cache", "x86_elf", cache(elf(machine=62)))
put("kernel_cache", "short_tables", cache(elf(shnum=100)))

# rlx-serve request bodies (each replayed as every route reads them).
bodies = {
    "embed_text": {"model": "all-MiniLM-L6-v2", "input": "hello"},
    "embed_list": {"input": ["a", "b"], "encoding_format": "base64", "dimensions": 384, "truncate": False},
    "embed_ids": {"input": [[101, 7, 102], [101, 102]]},
    "embed_bad": {"input": ["a", 1], "encoding_format": "hex"},
    "rerank": {"query": "q", "documents": ["a", {"text": "b"}], "top_n": 1, "return_documents": True},
    "rerank_bad": {"query": "", "documents": [], "top_n": 0},
    "chat": {"messages": [{"role": "system", "content": "Be brief."}, {"role": "user", "content": [{"type": "text", "text": "hi"}]}],
             "max_tokens": 8, "temperature": 0.7, "top_p": 0.9, "top_k": 40, "min_p": 0.05, "repeat_penalty": 1.1,
             "stop": ["\n", "User:"], "seed": -3, "stream": True, "stream_options": {"include_usage": True}},
    "chat_refused": {"messages": [{"role": "user", "content": "x"}], "n": 2, "tools": [{}], "logit_bias": {"1": 2}},
    "completion": {"prompt": "The capital of France is", "max_tokens": 4, "temperature": 0, "ignore_eos": True},
    "completion_ids": {"prompt": [[1, 2, 3]], "max_completion_tokens": 1, "response_format": {"type": "json_object"}},
}
for name, b in bodies.items():
    put("serve_request", name + ".json", json.dumps(b))
put("serve_request", "not_object", "[1, 2]")
put("serve_request", "not_json", '{"input": ')
