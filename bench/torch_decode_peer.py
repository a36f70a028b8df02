#!/usr/bin/env python3
"""PyTorch peer for `rlx bench --model smollm2`: times text generation with
transformers' LlamaForCausalLM on seeded random weights of SmolLM2-135M's
shapes (speed does not depend on the values), a static KV cache and, on a
GPU, manually captured CUDA graphs.

usage: torch_decode_peer.py [--device cuda[:N]|cpu] [--dtype auto|f16|bf16|f32]
    [--prompt-tokens 128] [--new-tokens 256] [--batch-tokens 128]
    [--batches 8,32] [--runs 3] [--warmup 2] [--seed 42]
    [--layers 30] [--hidden 576] ... (the model's shapes, see --help)

Measures, each the median of --runs after --warmup untimed runs:
  prefill at batch 1 and at every batch of --batches: one forward of random
    prompts of --prompt-tokens into a static cache rewound to position 0,
    the next token taken greedily on the device; tok/s = batch * prompt
    tokens / time. On a GPU both eager and a CUDA graph of that step are
    timed and the faster is the figure ("mode" says which).
  decode at batch 1 over --new-tokens and at every batch over --batch-tokens:
    after a prefill, one decode step (forward of the current tokens, greedy
    argmax written back into the static input ids, positions advanced in
    place) captured once as a CUDA graph and replayed N times, then one
    synchronize; tok/s = batch * N / time. On the CPU every step runs
    eagerly: the same step function, without a graph.

Prints one JSON line per measurement on stdout:
  {"measure": "prefill"|"decode", "batch", "tokens", "tok_s" (null on
   failure), "seconds" (median), "mode": "cuda graph"|"eager",
   "eager_tok_s", "graph_tok_s" (prefill on a GPU), "max_cache_len",
   "graph_error" (a capture that failed; the eager figure is then used),
   "error" (the measurement failed)}
then a final line
  {"info": "torch-decode-peer", "torch", "transformers", "device", "dtype",
   "graphs" (CUDA graphs used), "static_cache" (the constructor form that
   worked), "attention", "params", "layers", "logits" (which positions the
   LM head projects), "checks" (self-checks run, each with its verdict)}
If torch or transformers cannot be imported, or the device is missing, it
prints one line {"error": ...} and exits with status 3, so the caller can
tell "no peer" from "peer failed".
"""
import argparse
import inspect
import json
import statistics
import sys
import time
import traceback


def emit(obj):
    print(json.dumps(obj), flush=True)


def log(msg):
    print(f"torch peer: {msg}", file=sys.stderr, flush=True)


def parse_args(argv=None):
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--device", default="cuda", help="cuda, cuda:N or cpu")
    p.add_argument("--dtype", default="auto", help="auto (f16 on a GPU, f32 on the CPU), f16, bf16 or f32")
    p.add_argument("--prompt-tokens", type=int, default=128)
    p.add_argument("--new-tokens", type=int, default=256, help="decode steps at batch 1")
    p.add_argument("--batch-tokens", type=int, default=128, help="decode steps of each batched measurement")
    p.add_argument("--batches", default="8,32", help="batch sizes, comma-separated (empty: none)")
    p.add_argument("--runs", type=int, default=3)
    p.add_argument("--warmup", type=int, default=2)
    p.add_argument("--seed", type=int, default=42)
    shapes = p.add_argument_group("model shapes (default: SmolLM2-135M)")
    shapes.add_argument("--hidden", type=int, default=576)
    shapes.add_argument("--intermediate", type=int, default=1536)
    shapes.add_argument("--layers", type=int, default=30)
    shapes.add_argument("--heads", type=int, default=9)
    shapes.add_argument("--kv-heads", type=int, default=3)
    shapes.add_argument("--head-dim", type=int, default=64)
    shapes.add_argument("--vocab", type=int, default=49152)
    shapes.add_argument("--rope-theta", type=float, default=100000.0)
    shapes.add_argument("--rms-norm-eps", type=float, default=1e-5)
    shapes.add_argument("--max-positions", type=int, default=8192)
    args = p.parse_args(argv)
    try:
        args.batches = [int(b) for b in args.batches.split(",") if b.strip()]
    except ValueError:
        p.error(f"--batches: expected positive integers, found {args.batches!r}")
    if any(b <= 0 for b in args.batches):
        p.error("--batches: expected positive integers")
    for name in ("prompt_tokens", "new_tokens", "batch_tokens", "runs"):
        if getattr(args, name) <= 0:
            p.error(f"--{name.replace('_', '-')}: expected at least 1")
    return args


def build_model(args, torch, transformers, device, dtype):
    """LlamaForCausalLM with the requested shapes and seeded random weights."""
    config = transformers.LlamaConfig(
        vocab_size=args.vocab,
        hidden_size=args.hidden,
        intermediate_size=args.intermediate,
        num_hidden_layers=args.layers,
        num_attention_heads=args.heads,
        num_key_value_heads=args.kv_heads,
        head_dim=args.head_dim,
        max_position_embeddings=args.max_positions,
        rope_theta=args.rope_theta,
        rms_norm_eps=args.rms_norm_eps,
        tie_word_embeddings=True,
        hidden_act="silu",
        attn_implementation="sdpa",
    )
    config._attn_implementation = "sdpa"
    torch.manual_seed(args.seed)
    # Built on the device so the random init does not run on the host.
    with torch.device(device):
        model = transformers.LlamaForCausalLM(config)
    model = model.to(dtype=dtype).eval()
    return model


class ForwardApi:
    """How this transformers version's forward takes the cache: the keyword
    (`cache` in transformers 5, `past_key_values` before), whether positions
    in the cache come from a `cache_position` argument (transformers 4) or
    from a counter the cache keeps itself (transformers 5), and whether the
    LM head can be limited to the last position."""

    def __init__(self, model):
        params = inspect.signature(model.forward).parameters
        self.cache_kw = "cache" if "cache" in params else "past_key_values"
        self.cache_position = "cache_position" in params
        self.logits_kw = next((k for k in ("logits_to_keep", "num_logits_to_keep") if k in params), None)

    def describe(self):
        last = f"last position only ({self.logits_kw}=1)" if self.logits_kw else "every position (no logits_to_keep here)"
        return {
            "cache_keyword": self.cache_kw,
            "cache_position": "argument" if self.cache_position else "kept by the cache",
            "logits": last,
        }


def make_static_cache(transformers, config, batch, max_len, device, dtype):
    """A StaticCache under whichever constructor this version has. Returns
    (cache, the form that worked). transformers 4.4x allocates here; later
    versions allocate on the first update (which the eager prefill does)."""
    StaticCache = transformers.StaticCache
    forms = [
        ("StaticCache(config=, max_batch_size=, max_cache_len=, device=, dtype=)",
         lambda: StaticCache(config=config, max_batch_size=batch, max_cache_len=max_len, device=device, dtype=dtype)),
        ("StaticCache(config=, max_cache_len=)", lambda: StaticCache(config=config, max_cache_len=max_len)),
        ("StaticCache(config, batch, max_cache_len, device, dtype)",
         lambda: StaticCache(config, batch, max_len, device, dtype)),
    ]
    reasons = []
    for name, make in forms:
        try:
            return make(), name
        except TypeError as e:
            reasons.append(f"{name}: {e}")
    raise RuntimeError("no StaticCache constructor form worked: " + "; ".join(reasons))


def cache_counters(cache):
    """Position counters that transformers 5's static layers keep on the
    device and advance in place (`cumulative_length`); empty before 5."""
    layers = getattr(cache, "layers", None) or []
    return [c for c in (getattr(layer, "cumulative_length", None) for layer in layers) if hasattr(c, "zero_")]


class Generation:
    """Static state for generating at one batch size: the prompt, the
    current tokens, positions and the cache, all fixed tensors, so that the
    prefill and decode steps can be recorded once and replayed. The steps are
    the same functions whether run eagerly or captured."""

    def __init__(self, torch, transformers, model, api, batch, prompt_tokens, max_len, device, dtype, seed):
        self.model, self.api = model, api
        self.batch, self.prompt_tokens, self.max_len = batch, prompt_tokens, max_len
        vocab = model.config.vocab_size
        gen = torch.Generator().manual_seed(seed * 1000 + batch)
        # Ids from 1000 up skip the special and byte tokens, as rlx bench does.
        lo = min(1000, vocab - 1)
        self.prompt = torch.randint(lo, vocab, (batch, prompt_tokens), generator=gen).to(device)
        self.prompt_positions = torch.arange(prompt_tokens, device=device).unsqueeze(0)
        self.prompt_cache_positions = torch.arange(prompt_tokens, device=device)
        self.tokens = torch.zeros((batch, 1), dtype=torch.long, device=device)
        self.positions = torch.zeros((1, 1), dtype=torch.long, device=device)
        self.cache_position = torch.zeros((1,), dtype=torch.long, device=device)
        self.cache, self.cache_form = make_static_cache(transformers, model.config, batch, max_len, device, dtype)

    def _forward(self, ids, positions, cache_position):
        kw = {"input_ids": ids, "position_ids": positions, self.api.cache_kw: self.cache, "use_cache": True}
        if self.api.cache_position:
            kw["cache_position"] = cache_position
        if self.api.logits_kw:
            kw[self.api.logits_kw] = 1
        return self.model(**kw).logits

    def prefill(self):
        """The prompt into the cache from position 0, the first new token
        into `tokens`, positions to the prompt's end."""
        for counter in cache_counters(self.cache):
            counter.zero_()
        logits = self._forward(self.prompt, self.prompt_positions, self.prompt_cache_positions)
        self.tokens.copy_(logits[:, -1, :].argmax(dim=-1, keepdim=True))
        self.positions.fill_(self.prompt_tokens)
        self.cache_position.fill_(self.prompt_tokens)
        return logits

    def decode(self):
        """One token per sequence: its greedy successor replaces it in
        `tokens`; the positions advance on the device. Returns the logits."""
        logits = self._forward(self.tokens, self.positions, self.cache_position)
        self.tokens.copy_(logits[:, -1, :].argmax(dim=-1, keepdim=True))
        self.positions.add_(1)
        self.cache_position.add_(1)
        return logits


class Clock:
    """Wall time of device work: synchronises before reading the clock."""

    def __init__(self, torch, cuda):
        self.torch, self.cuda = torch, cuda

    def sync(self):
        if self.cuda:
            self.torch.cuda.synchronize()

    def time(self, fn):
        self.sync()
        t0 = time.perf_counter()
        fn()
        self.sync()
        return time.perf_counter() - t0


class Captured:
    """A step recorded as a CUDA graph, called like the step itself: each
    call replays the graph and returns the step's output tensor, which lives
    in the graph's memory pool and every replay rewrites."""

    def __init__(self, graph, out):
        self.graph, self.out = graph, out

    def __call__(self):
        self.graph.replay()
        return self.out


def capture(torch, step, prepare, warmup=3):
    """Records `step` as a CUDA graph: `prepare` then `step` run eagerly on
    a side stream first (cuBLAS workspaces, SDPA kernels and lazily created
    cache tensors all exist before capture), then one capture. The graph
    holds its own memory pool for the step's temporaries."""
    side = torch.cuda.Stream()
    side.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(side):
        for _ in range(warmup):
            prepare()
            step()
    torch.cuda.current_stream().wait_stream(side)
    torch.cuda.synchronize()
    prepare()
    torch.cuda.synchronize()
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        out = step()
    torch.cuda.synchronize()
    return Captured(graph, out)


def first_line(e):
    text = str(e).strip().splitlines()
    return f"{type(e).__name__}: {text[0] if text else ''}"


def measure_prefill(torch, g, clock, cuda, runs, warmup):
    """Prefill tok/s: eager, and on a GPU the replay of its captured graph;
    the faster is the figure. Returns (line, the graph or None)."""
    tokens = g.batch * g.prompt_tokens
    line = {"measure": "prefill", "batch": g.batch, "tokens": g.prompt_tokens, "max_cache_len": g.max_len}
    for _ in range(warmup):
        clock.time(g.prefill)
    eager = statistics.median(clock.time(g.prefill) for _ in range(runs))
    line["eager_tok_s"] = tokens / eager
    best, mode, graph = eager, "eager", None
    if cuda:
        try:
            graph = capture(torch, g.prefill, lambda: None)
            for _ in range(warmup):
                clock.time(graph)
            replay = statistics.median(clock.time(graph) for _ in range(runs))
            line["graph_tok_s"] = tokens / replay
            if replay < best:
                best, mode = replay, "cuda graph"
        except Exception as e:  # capture failures come as several types
            line["graph_error"] = first_line(e)
            graph = None
            clock.sync()
    line.update({"tok_s": tokens / best, "seconds": best, "mode": mode})
    return line, graph


def measure_decode(torch, g, clock, cuda, steps, runs, warmup, prefill):
    """Decode tok/s: after `prefill`, `steps` decode steps (graph replays on
    a GPU) and one synchronize. Returns (line, graph or None)."""
    line = {"measure": "decode", "batch": g.batch, "tokens": steps, "max_cache_len": g.max_len}
    step, mode = g.decode, "eager"
    graph = None
    if cuda:
        try:
            graph = capture(torch, g.decode, prefill)
            step, mode = graph, "cuda graph"
        except Exception as e:
            line["graph_error"] = first_line(e)
            clock.sync()

    def run():
        for _ in range(steps):
            step()

    times = []
    for i in range(warmup + runs):
        prefill()
        t = clock.time(run)
        if i >= warmup:
            times.append(t)
    secs = statistics.median(times)
    line.update({"tok_s": g.batch * steps / secs, "seconds": secs, "mode": mode})
    return line, graph


def step_logits(torch, g, prefill, step, count):
    """Sequence 0 over a prefill and `count` steps: the token each step was
    fed, and the last-position logits it returned (f32, on the host)."""
    prefill()
    fed, logits = [], []
    for _ in range(count):
        fed.append(g.tokens[0, 0].clone())
        logits.append(step()[0, -1].float().clone())
    return torch.stack(fed).cpu(), torch.stack(logits).cpu()


def recomputed_logits(torch, model, prompt, fed):
    """The logits a forward of the whole sequence (prompt then the fed
    tokens, no cache) gives at each fed token: what the static-cache steps
    must reproduce."""
    seq = torch.cat([prompt[:1], fed.to(prompt.device)[None, :]], dim=1)
    logits = model(input_ids=seq, use_cache=False).logits[0].float()
    return logits[prompt.shape[1]:].cpu()


def host_traffic_mode(torch):
    """A dispatch mode that records every op touching a tensor that is not
    on the meta device: a CPU tensor in a captured step is a host-to-device
    copy or a value baked into the graph at capture time."""
    from torch.utils._python_dispatch import TorchDispatchMode
    from torch.utils._pytree import tree_flatten

    class HostTraffic(TorchDispatchMode):
        def __init__(self):
            super().__init__()
            self.ops = 0
            self.found = []

        def __torch_dispatch__(self, func, types, args=(), kwargs=None):
            out = func(*args, **(kwargs or {}))
            self.ops += 1
            host = [t for t in tree_flatten((args, kwargs, out))[0] if isinstance(t, torch.Tensor) and t.device.type != "meta"]
            if host:
                self.found.append(f"{func} on a {host[0].device.type} tensor of shape {tuple(host[0].shape)}")
            return out

    return HostTraffic()


def meta_check(args, torch, transformers):
    """Runs the prefill and decode steps on meta tensors, which hold no
    data: a read of any value back to the host (`.item()`, `if tensor:`),
    which a CUDA-graph capture cannot record, raises there, and a dispatch
    mode catches any CPU tensor in a step. transformers takes other paths
    while a capture is under way (it skips such reads), so it is told one is:
    this checks, on the CPU, the steps as a GPU run captures them."""
    capturing, autocast = torch.cuda.is_current_stream_capturing, torch.autocast
    # transformers 4's RoPE turns autocast off for the input's device type,
    # which autocast does not know for "meta".
    torch.autocast = lambda device_type, *a, **kw: autocast("cpu" if device_type == "meta" else device_type, *a, **kw)
    try:
        model = build_model(args, torch, transformers, "meta", torch.float32)
        g = Generation(torch, transformers, model, ForwardApi(model), 2, 4, 8, "meta", torch.float32, args.seed)
        # Eager first, as on the GPU: it creates lazily allocated cache tensors.
        g.prefill()
        g.decode()
        torch.cuda.is_current_stream_capturing = lambda: True
        traffic = host_traffic_mode(torch)
        with traffic:
            g.prefill()
            g.decode()
        if traffic.found:
            return f"failed: {len(traffic.found)} of {traffic.ops} ops in the steps touch host tensors: " + "; ".join(traffic.found[:3])
        return f"passed: the prefill and decode steps as captured ({traffic.ops} ops on meta tensors) read no value back and use no host tensor"
    except Exception as e:
        # The innermost frame outside torch is the line that read the value.
        frames = traceback.extract_tb(e.__traceback__)
        where = next((f for f in reversed(frames) if "/torch/" not in f.filename), frames[-1])
        return f"failed: {first_line(e)} at {where.filename.split('/')[-1]}:{where.lineno}"
    finally:
        torch.cuda.is_current_stream_capturing, torch.autocast = capturing, autocast


def measure_batch(torch, transformers, model, api, args, batch, steps, clock, info):
    """Yields the prefill and the decode line of one batch size; a failure
    becomes an "error" in the line. At batch 1 the decode steps are also
    checked (into info["checks"])."""
    cuda = clock.cuda
    device, dtype = model.device, model.dtype
    # Room for the prompt, every step and the warm-up steps of a capture.
    max_len = args.prompt_tokens + steps + 8
    failed = [{"measure": m, "batch": batch, "tokens": t, "tok_s": None} for m, t in (("prefill", args.prompt_tokens), ("decode", steps))]
    try:
        g = Generation(torch, transformers, model, api, batch, args.prompt_tokens, max_len, device, dtype, args.seed)
    except Exception as e:
        for line in failed:
            yield dict(line, error=first_line(e))
        return
    info["static_cache"] = g.cache_form
    log(f"batch {batch}: prefill {args.prompt_tokens} tokens...")
    prefill_graph = None
    try:
        pre, prefill_graph = measure_prefill(torch, g, clock, cuda, args.runs, args.warmup)
    except Exception as e:
        pre = dict(failed[0], error=first_line(e))
        clock.sync()
    yield pre
    # Decode runs start from the faster prefill.
    prefill = prefill_graph if pre.get("mode") == "cuda graph" else g.prefill
    log(f"batch {batch}: decode {steps} tokens...")
    decode_graph = None
    try:
        dec, decode_graph = measure_decode(torch, g, clock, cuda, steps, args.runs, args.warmup, prefill)
    except Exception as e:
        dec = dict(failed[1], error=first_line(e))
        clock.sync()
    if batch == 1:
        info["checks"]["decode"] = check_decode(torch, model, g, decode_graph, min(8, steps))
    yield dec


def run(args, torch, transformers):
    cuda = args.device.startswith("cuda")
    dtype_name = args.dtype if args.dtype != "auto" else ("f16" if cuda else "f32")
    dtype = {"f16": torch.float16, "bf16": torch.bfloat16, "f32": torch.float32}[dtype_name]
    device = torch.device(args.device)
    clock = Clock(torch, cuda)
    log(f"LlamaForCausalLM, {args.layers} layers, random weights, {dtype_name} on {args.device}...")
    model = build_model(args, torch, transformers, device, dtype)
    api = ForwardApi(model)
    info = {
        "info": "torch-decode-peer",
        "torch": torch.__version__,
        "transformers": transformers.__version__,
        "device": torch.cuda.get_device_name(device) if cuda else "cpu",
        "dtype": dtype_name,
        "graphs": False,
        "attention": model.config._attn_implementation,
        "params": sum(p.numel() for p in model.parameters()),
        "layers": args.layers,
        "runs": args.runs,
        "warmup": args.warmup,
        "static_cache": "none (every batch failed before one was made)",
        "checks": {},
    }
    info.update(api.describe())
    lines = []
    with torch.inference_mode():
        for batch, steps in [(1, args.new_tokens)] + [(b, args.batch_tokens) for b in args.batches]:
            for line in measure_batch(torch, transformers, model, api, args, batch, steps, clock, info):
                emit(line)
                lines.append(line)
            if cuda:
                torch.cuda.empty_cache()
    capture_failed = any("graph_error" in line for line in lines)
    info["graphs"] = any(line.get("mode") == "cuda graph" for line in lines)
    # On a GPU the capture itself is the check; when one failed, this names the line.
    if not cuda or capture_failed:
        info["checks"]["host reads"] = meta_check(args, torch, transformers)
    emit(info)


def check_decode(torch, model, g, graph, count):
    """The batch-1 decode figure is only worth something if its steps
    compute what the model computes. Greedy tokens alone would not show it:
    random weights make the model repeat its input whatever the positions,
    so the logits are compared. On a GPU the graph's against the eager
    steps' (the same kernels); on the CPU the eager steps' against a forward
    of the whole sequence without a cache. The bound is 0.2% of the logits'
    spread; steps whose positions stayed put were off by 3.8% to 25% of it on
    the small test models tried."""
    try:
        fed, got = step_logits(torch, g, g.prefill, g.decode, count)
        if graph is not None:
            what = "CUDA-graph decode logits against the eager steps'"
            fed_graph, want = fed, got
            fed, got = step_logits(torch, g, g.prefill, graph, count)
            if not torch.equal(fed, fed_graph):
                return f"failed: {what}: the graph was fed tokens {fed.tolist()}, the eager steps {fed_graph.tolist()}"
        else:
            what = "static-cache decode logits against a forward of the whole sequence without a cache"
            want = recomputed_logits(torch, model, g.prompt, fed)
        spread = float(want.max() - want.min())
        diff = float((got - want).abs().max())
        verdict = "passed" if diff <= 2e-3 * spread else "failed"
        return f"{verdict}: {what}, {count} steps: max abs diff {diff:.2e} (spread {spread:.2f})"
    except Exception as e:
        return f"failed: {first_line(e)}"


def main(argv=None):
    args = parse_args(argv)
    try:
        import torch
        import transformers
    except Exception as e:
        emit({"error": f"python peer unavailable: cannot import torch/transformers ({type(e).__name__}: {e})"})
        return 3
    if not hasattr(transformers, "StaticCache"):
        emit({"error": f"python peer unavailable: transformers {transformers.__version__} has no StaticCache"})
        return 3
    if args.device.startswith("cuda"):
        if not torch.cuda.is_available():
            emit({"error": f"python peer unavailable: torch {torch.__version__} sees no CUDA device"})
            return 3
        torch.cuda.set_device(torch.device(args.device))
    elif args.device != "cpu":
        emit({"error": f"--device: expected cuda, cuda:N or cpu, found {args.device!r}"})
        return 2
    if args.dtype not in ("auto", "f16", "bf16", "f32"):
        emit({"error": f"--dtype: expected auto, f16, bf16 or f32, found {args.dtype!r}"})
        return 2
    try:
        run(args, torch, transformers)
    except Exception as e:
        emit({"error": f"{type(e).__name__}: {e}", "trace": traceback.format_exc(limit=3)})
        return 1
    return 0


if __name__ == "__main__":
    sys.exit(main())
