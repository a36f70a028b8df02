#!/usr/bin/env bash
# Installs the peers the benchmarks compare against. Never run in CI.
set -euo pipefail
# numpy (OpenBLAS) for the CPU matmul comparison; threadpoolctl reports its BLAS and core type.
python3 -m pip install --quiet numpy threadpoolctl || python3 -m pip install --quiet --break-system-packages numpy threadpoolctl
