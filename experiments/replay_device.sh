#!/bin/bash
# One device call for issue 8: GPU tests of the replay, then timings. Usage (repo root, on the GPU):
#   bash benchmarks/replay_device.sh quick|both|regimes|tests   (results under $OUT, or benchmarks/results)
# kvpipe is installed as a regular package and everything runs from /tmp, so that the repository's
# own kvpipe/ folder (which lacks the layer subpackages) does not shadow the installed one.
set -u
R=$(pwd)
OUT=${OUT:-$R/benchmarks/results}
mode=${1:-quick}
python3 -m pip install -q --no-deps --no-build-isolation . 2>&1 | grep -v "root' user" | tail -3
python3 -c "import kvpipe.executor" 2>/dev/null || python3 -m pip install -q --no-deps --no-build-isolation -e . 2>&1 | tail -3
mkdir -p /tmp/bp && ln -sfn "$R/benchmarks" /tmp/bp/benchmarks
cd /tmp
export PYTHONPATH=/tmp/bp
nvidia-smi --query-gpu=name,memory.used,memory.total,clocks.sm --format=csv > "$OUT/nvidia-smi.txt" 2>&1
python3 -c "import torch, transformers, kvpipe.executor.replay.capture as r; print(torch.__version__, transformers.__version__, torch.backends.cudnn.version(), r.__file__)"
T="python3 -m pytest -q -m gpu -p no:cacheprovider --rootdir $R"
if [ "$mode" = quick ]; then
  timeout 150 $T $R/tests/test_replay.py -x 2>&1 | tail -25 | tee "$OUT/gpu-tests-replay.log"
  timeout 60 python3 -m experiments.issue_cost --out "$OUT/issue-cost.json" 2>&1 | tail -14
  timeout 120 python3 -m benchmarks.regimes --rows 8k-default,8k-g8-all,32k-g8-none,32k-g1-none --hf-max 8192 --decode 8 --out "$OUT/regimes-quick.json" 2>&1 | tail -12
elif [ "$mode" = both ]; then
  timeout 110 $T $R/tests/test_replay.py -x --tb=short 2>&1 | tail -40 | tee "$OUT/gpu-tests-replay.log"
  ok=$(grep -c " failed\| error\|rror" "$OUT/gpu-tests-replay.log")
  timeout 50 python3 -m experiments.issue_cost --out "$OUT/issue-cost.json" 2>&1 | tail -12
  if [ "$ok" = 0 ]; then rows=all; rp=auto; else rows=8k-default,8k-g8-all,32k-g8-none,32k-g1-none; rp=off; fi
  timeout 280 python3 -m benchmarks.regimes --rows $rows --replay $rp --decode 8 --out "$OUT/regimes.json" 2>&1 | tail -32
elif [ "$mode" = regimes ]; then
  timeout 540 python3 -m benchmarks.regimes --decode 8 --out "$OUT/regimes.json" 2>&1 | tail -32
else   # tests
  timeout 540 $T $R/tests/test_replay.py $R/tests/test_executor.py $R/tests/test_attention.py 2>&1 | tail -15 | tee "$OUT/gpu-tests.log"
fi
