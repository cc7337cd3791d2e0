#!/usr/bin/env bash
# The GPU checks in one go, within 8 minutes on one GPU: the cuda-marked tests, then benchmarks/gpu_lm.py.
#
# Run from the repository root. The machine's Python needs torch, tensorboard and pytest (and lightning for the
# Fabric column); hydra-core, omegaconf, antlr4-python3-runtime and google-crc32c come as wheels in .whl/, installed
# into /tmp/site. The runner is not installed: it runs from the repository through PYTHONPATH. Logs go to $OUT
# (default /tmp/gpu_check): nvidia-smi.log, cuda.log, bench.log.
set -u
OUT=${OUT:-/tmp/gpu_check}
mkdir -p "$OUT"
python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/site .whl/*.whl \
    && export PYTHONPATH=/tmp/site:$PWD
export PYTHONUNBUFFERED=1
nvidia-smi 2>&1 | tee "$OUT/nvidia-smi.log"
python3 -c "import torch, hydra; print('torch', torch.__version__, 'hydra', hydra.__version__, torch.cuda.get_device_name(0))"

# -k: a run in the test process takes SIGTERM as a request to stop after its step (and carries on); SIGKILL ends it.
start=$SECONDS
timeout -k 10 240 python3 -m pytest -m cuda -q -p no:cacheprovider tests/test_gpu.py 2>&1 | tee "$OUT/cuda.log"
tests=${PIPESTATUS[0]}
echo "cuda tests: exit $tests in $((SECONDS - start)) s"

start=$SECONDS
timeout -k 10 200 python3 benchmarks/gpu_lm.py --compile 2>&1 | tee "$OUT/bench.log"
bench=${PIPESTATUS[0]}
echo "benchmark: exit $bench in $((SECONDS - start)) s (124: stopped at its 200 s limit; its tables so far are above)"
exit $(( tests != 0 || bench != 0 ))
