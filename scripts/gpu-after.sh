#!/usr/bin/env bash
# Runs on the lent GPU machine after the test binaries (see ../shared/tools/gpu-pack):
# prints what the CUDA backend found, shows RLX_TRACE / RLX_PROFILE output once,
# and runs the replay benchmark when its binary was packed.
set -u
exec_bin=$(ls .gpu/tests/exec-* 2>/dev/null | head -1)
if [ -n "$exec_bin" ]; then
  echo "== rlx-cuda doctor"
  "$exec_bin" --exact missing_device_is_an_error --nocapture 2>&1 | grep -v '^test \|^running\|^$'
  echo "== RLX_TRACE=1 RLX_PROFILE=1 on the encoder-layer test (f32 part)"
  RLX_TRACE=1 RLX_PROFILE=1 "$exec_bin" --exact encoder_layer_matches_cpu_and_replay_equals_eager --nocapture 2>&1 | head -40
fi
for b in .gpu/bin/replay_bench .gpu/tests/replay_bench; do
  if [ -x "$b" ]; then echo "== replay benchmark"; "$b"; break; fi
done
# End to end through the CLI: embeddings on the GPU, then RLX vs PyTorch.
if command -v rlx >/dev/null; then
  f16=models/all-MiniLM-L6-v2-f16
  if [ -f "$f16/model.safetensors" ]; then
    echo "== rlx embed --device cuda (f16 copy of MiniLM)"
    printf 'RLX turns text into vectors.\nA second line.\n\n' | rlx embed --model "$f16" --device cuda --dtype f16 | cut -c1-120
    rlx similarity --model "$f16" --device cuda "A cat sat on the mat." "A kitten rests on a rug."
  fi
  echo "== rlx doctor"; rlx doctor
  if [ "${RLX_SKIP_BENCH:-0}" != 1 ]; then
    echo "== rlx bench"
    out=${OUT:-.gpu/out}; mkdir -p "$out"
    rlx bench ${RLX_BENCH_ARGS:-} --output "$out/gpu-bench-table.md" --plot "$out/gpu-bench.svg" 2>&1
  fi
fi
