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
