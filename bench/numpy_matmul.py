#!/usr/bin/env python3
"""numpy's f32 matmul GFLOP/s, the peer for crates/rlx-cpu/benches/kernels.rs.

usage: numpy_matmul.py THREADS MxKxN [MxKxN ...]
Prints one JSON line describing the BLAS (from threadpoolctl: library,
version, core type such as SkylakeX), then one JSON line per shape.
"""
import json
import sys
import time

import numpy as np
from threadpoolctl import threadpool_info, threadpool_limits


def best_seconds(f, min_time=0.3, repeats=5):
    f()  # warm up: page faults, BLAS buffers
    iters = 1
    while True:
        t0 = time.perf_counter()
        for _ in range(iters):
            f()
        if time.perf_counter() - t0 > min_time / repeats:
            break
        iters *= 2
    best = float("inf")
    for _ in range(repeats):
        t0 = time.perf_counter()
        for _ in range(iters):
            f()
        best = min(best, (time.perf_counter() - t0) / iters)
    return best


def main():
    threads = int(sys.argv[1])
    shapes = [tuple(int(x) for x in s.split("x")) for s in sys.argv[2:]]
    blas = [i for i in threadpool_info() if i.get("user_api") == "blas"]
    b = blas[0] if blas else {}
    print(json.dumps({
        "numpy": np.__version__,
        "blas": b.get("internal_api", "unknown"),
        "version": b.get("version"),
        "core_type": b.get("architecture", "unknown"),
        "threads": threads,
    }), flush=True)
    rng = np.random.default_rng(0)
    with threadpool_limits(limits=threads, user_api="blas"):
        for m, k, n in shapes:
            a = rng.standard_normal((m, k), dtype=np.float32)
            w = rng.standard_normal((k, n), dtype=np.float32)
            out = np.empty((m, n), dtype=np.float32)
            s = best_seconds(lambda: np.matmul(a, w, out=out))
            print(json.dumps({"m": m, "k": k, "n": n, "gflops": 2.0 * m * n * k / s / 1e9}), flush=True)


if __name__ == "__main__":
    main()
