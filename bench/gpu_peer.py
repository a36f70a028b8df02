#!/usr/bin/env python3
"""PyTorch peer for `rlx bench`: times transformers' BertModel on the same
weights and inputs that RLX runs, and writes its last hidden state so the two
outputs can be compared.

usage: gpu_peer.py JOBS.json [--runs N] [--warmup N] [--device cuda[:N]|cpu]

JOBS.json (written by `rlx bench`) is a list of jobs:
  {"id": str, "model_dir": dir with config.json + model.safetensors,
   "dtype": "f16"|"bf16"|"f32", "batch": int, "seq": int,
   "ids": file of batch*seq little-endian int64, "mask": same shape, 0/1,
   "hidden_out": file to write the eager last hidden state to (f32)}

Prints one JSON line per job on stdout:
  {"id", "eager_us", "graph_us" (null when not captured), "graph_mask",
   "graph_vs_eager_max_abs", "plain_graph_us", "hidden_out", "torch",
   "transformers", "device"}
On a GPU, two captures are timed: the loaded model (its output is checked
against the eager pass), and a plain `BertModel(config)` built in memory
with the same shapes, dtype and inputs (`plain_graph_us`: random weights;
speed does not depend on values). The caller reports the faster.
or {"id", "error"}. If torch or transformers cannot be imported it prints one
line {"error": ...} and exits with status 3, so the caller can tell "no peer"
from "peer failed".
"""
import argparse
import json
import statistics
import sys
import traceback


def emit(obj):
    print(json.dumps(obj), flush=True)


def load_model(job, torch, transformers, device):
    dtype = {"f16": torch.float16, "bf16": torch.bfloat16, "f32": torch.float32}[job["dtype"]]
    # add_pooling_layer=False: RLX computes no pooler, so neither should the peer.
    model, info = transformers.BertModel.from_pretrained(
        job["model_dir"],
        attn_implementation="sdpa",
        add_pooling_layer=False,
        output_loading_info=True,
    )
    # A missing or unexpected weight would silently leave a random one in
    # place and make the output comparison meaningless.
    info = info if isinstance(info, dict) else {}
    missing = [k for k in info.get("missing_keys", []) if not k.endswith("position_ids")]
    unexpected = [k for k in info.get("unexpected_keys", []) if not k.endswith("position_ids")]
    if missing or unexpected:
        raise RuntimeError(f"weights in {job['model_dir']} do not match BertModel: missing {missing[:5]}, unexpected {unexpected[:5]}")
    return model.to(device=device, dtype=dtype).eval(), dtype


def read_inputs(job, torch, numpy, device):
    shape = (job["batch"], job["seq"])
    ids = numpy.fromfile(job["ids"], dtype="<i8")
    mask = numpy.fromfile(job["mask"], dtype="<i8")
    n = shape[0] * shape[1]
    if ids.size != n or mask.size != n:
        raise RuntimeError(f"inputs: expected {n} int64 values each, found ids {ids.size}, mask {mask.size}")
    ids = torch.from_numpy(ids.reshape(shape).copy()).to(device)
    mask = torch.from_numpy(mask.reshape(shape).copy()).to(device)
    return ids, mask


def time_cuda(torch, fn, runs, warmup):
    """Median of `runs` calls in microseconds, each bracketed by CUDA events
    and synchronised, after `warmup` untimed calls."""
    for _ in range(warmup):
        fn()
    torch.cuda.synchronize()
    start = torch.cuda.Event(enable_timing=True)
    end = torch.cuda.Event(enable_timing=True)
    times = []
    for _ in range(runs):
        start.record()
        fn()
        end.record()
        end.synchronize()
        times.append(start.elapsed_time(end) * 1000.0)
    return statistics.median(times)


def time_cpu(fn, runs, warmup):
    import time
    for _ in range(warmup):
        fn()
    times = []
    for _ in range(runs):
        t0 = time.perf_counter()
        fn()
        times.append((time.perf_counter() - t0) * 1e6)
    return statistics.median(times)


def graph_masks(torch, mask, dtype):
    """Mask forms to try for CUDA-graph capture, in order. Some transformers
    versions inspect a 2-D mask on the host (`mask.all()`), which is not
    allowed while capturing; a 4-D additive mask (transformers 5) or a 3-D 0/1
    mask (transformers 4) is used as given. Every form gives the same output
    as the 2-D mask; the capture checks that against the eager output."""
    b, s = mask.shape
    additive = (1.0 - mask.to(dtype))[:, None, None, :] * torch.finfo(dtype).min
    # With no padding, eager transformers drops the mask; let the graph drop
    # it too, so PyTorch gets its fastest attention path.
    none = [("none (no padding)", None)] if bool(mask.all()) else []
    return none + [
        ("2d", mask),
        ("4d-additive", additive.expand(b, 1, s, s).contiguous()),
        ("3d", mask[:, None, :].expand(b, s, s).contiguous()),
    ]


def capture_graph(torch, model, ids, mask, dtype, eager_out, runs, warmup):
    """Captures one forward pass with every mask form that captures, times
    each, and keeps the fastest (on transformers 5 the 2-D mask replays in
    ~295 us at MiniLM 1x128 and no mask in ~465 us). Returns ((graph, static
    buffers), mask form, max abs difference to the eager output, median us,
    {form: us}) or raises with every reason."""
    reasons = []
    best = None
    timed = {}
    for name, m in graph_masks(torch, mask, dtype):
        try:
            static_ids = ids.clone()
            static_mask = None if m is None else m.clone()
            side = torch.cuda.Stream()
            side.wait_stream(torch.cuda.current_stream())
            with torch.cuda.stream(side):
                for _ in range(3):
                    model(input_ids=static_ids, attention_mask=static_mask)
            torch.cuda.current_stream().wait_stream(side)
            torch.cuda.synchronize()
            graph = torch.cuda.CUDAGraph()
            with torch.cuda.graph(graph):
                out = model(input_ids=static_ids, attention_mask=static_mask).last_hidden_state
            graph.replay()
            torch.cuda.synchronize()
            valid = mask.bool()
            diff = (out.float() - eager_out.float())[valid].abs().max().item()
            us = time_cuda(torch, graph.replay, runs, warmup)
            timed[name] = us
            if best is None or us < best[3]:
                # Keep the static buffers alive with the graph.
                best = ((graph, (static_ids, static_mask, out)), name, diff, us)
            else:
                del graph, out
        except Exception as e:  # capture failures come as several types
            reasons.append(f"{name}: {type(e).__name__}: {str(e).splitlines()[0] if str(e) else ''}")
            try:
                torch.cuda.synchronize()
            except Exception as e2:
                reasons.append(f"the device did not recover: {e2}")
                break
    if best is None:
        raise RuntimeError("CUDA-graph capture failed for every mask form: " + "; ".join(reasons))
    return best + (timed,)


def run_job(job, args, torch, transformers, numpy):
    device = args.device
    model, dtype = load_model(job, torch, transformers, device)
    ids, mask = read_inputs(job, torch, numpy, device)
    result = {"id": job["id"]}
    with torch.inference_mode():
        out = model(input_ids=ids, attention_mask=mask).last_hidden_state
        out.float().cpu().numpy().astype("<f4").tofile(job["hidden_out"])
        result["hidden_out"] = job["hidden_out"]

        def eager():
            model(input_ids=ids, attention_mask=mask)

        if device.startswith("cuda"):
            result["eager_us"] = time_cuda(torch, eager, args.runs, args.warmup)
            try:
                (graph, keep), form, diff, us, timed = capture_graph(torch, model, ids, mask, dtype, out, args.runs, args.warmup)
                result["graph_us"] = us
                result["graph_mask"] = form
                result["graph_mask_us"] = timed
                result["graph_vs_eager_max_abs"] = diff
                del graph, keep
            except RuntimeError as e:
                result["graph_us"] = None
                result["graph_error"] = str(e)
            try:
                plain = transformers.BertModel(model.config, add_pooling_layer=False).to(device=device, dtype=dtype).eval()
                plain_out = plain(input_ids=ids, attention_mask=mask).last_hidden_state
                (graph, keep), _, _, us, _ = capture_graph(torch, plain, ids, mask, dtype, plain_out, args.runs, args.warmup)
                result["plain_graph_us"] = us
                del graph, keep, plain
            except RuntimeError as e:
                result["plain_graph_us"] = None
                result["plain_graph_error"] = str(e)
        else:
            result["eager_us"] = time_cpu(eager, args.runs, args.warmup)
            result["graph_us"] = None  # CUDA graphs need --device cuda
    del model
    if device.startswith("cuda"):
        torch.cuda.empty_cache()
    return result


def main():
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("jobs")
    p.add_argument("--runs", type=int, default=200)
    p.add_argument("--warmup", type=int, default=20)
    p.add_argument("--device", default="cuda", help="cuda, cuda:N or cpu")
    args = p.parse_args()
    try:
        import numpy
        import torch
        import transformers
    except Exception as e:
        emit({"error": f"python peer unavailable: cannot import numpy/torch/transformers ({type(e).__name__}: {e})"})
        return 3
    if args.device.startswith("cuda"):
        if not torch.cuda.is_available():
            emit({"error": f"python peer unavailable: torch {torch.__version__} sees no CUDA device"})
            return 3
        torch.cuda.set_device(torch.device(args.device))
    elif args.device != "cpu":
        emit({"error": f"--device: expected cuda, cuda:N or cpu, found {args.device!r}"})
        return 2
    # Exact f32 matmuls, as RLX does unless told otherwise.
    torch.backends.cuda.matmul.allow_tf32 = False
    torch.backends.cudnn.allow_tf32 = False
    with open(args.jobs) as f:
        jobs = json.load(f)
    dev_name = torch.cuda.get_device_name(torch.device(args.device)) if args.device.startswith("cuda") else "cpu"
    for job in jobs:
        try:
            r = run_job(job, args, torch, transformers, numpy)
        except Exception as e:
            r = {"id": job.get("id"), "error": f"{type(e).__name__}: {e}", "trace": traceback.format_exc(limit=3)}
        r.update({"torch": torch.__version__, "transformers": transformers.__version__, "device": dev_name})
        emit(r)
    return 0


if __name__ == "__main__":
    sys.exit(main())
