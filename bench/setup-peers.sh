#!/usr/bin/env bash
# Installs the peers the benchmarks compare against. Never run in CI.
set -euo pipefail
cd "$(dirname "$0")/.."
# numpy (OpenBLAS) for the CPU matmul comparison; threadpoolctl reports its BLAS and core type.
python3 -m pip install --quiet numpy threadpoolctl || python3 -m pip install --quiet --break-system-packages numpy threadpoolctl
# Sentence-embedding peers (bench/embed_peers.py): PyTorch eager, ONNX Runtime (plain and after its
# transformer optimizer), the ONNX exporter. PyPI has no CPU-only torch wheel, so this is the default
# (CUDA) build, run on the CPU; several GB.
python3 -m pip install --quiet torch transformers onnx onnxruntime onnxscript || python3 -m pip install --quiet --break-system-packages torch transformers onnx onnxruntime onnxscript
# infinity-emb (scripts/bench-serve --embeddings DIR --infinity-emb bench/.venv-infinity/bin/infinity_emb):
# its own venv, as it pins numpy<2, sentence-transformers<4 and transformers<5; it sees the torch
# installed above. Its CLI (typer 0.12) needs click older than 8.2.
python3 -m venv --system-site-packages bench/.venv-infinity
if ! bench/.venv-infinity/bin/python -c 'import torch' 2>/dev/null; then
  echo "setup-peers: the venv does not see torch (installed with --user?); pip will download it again (several GB)" >&2
fi
bench/.venv-infinity/bin/pip install --quiet "infinity-emb[server,torch]==0.0.77" "click==8.1.8"
