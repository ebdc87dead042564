#!/bin/bash
# One device call: install kvpipe with the carried wheels, run the GPU tests, then two 32K runs at
# Llama-3-8B shapes under a 24 GB cap (streamed and resident max); logs and JSON under $OUT.
set -u
R=$(pwd)
python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/site .whl/*.whl
export PYTHONPATH=/tmp/site PYTHONUNBUFFERED=1
python3 -m pip install -q --no-deps --no-build-isolation . 2>&1 | grep -v "root' user" | tail -2
cd /tmp
nvidia-smi --query-gpu=name,driver_version,memory.used,memory.total --format=csv
timeout ${GPU_TESTS_S:-330} python3 -m pytest -q -m gpu -p no:cacheprovider --rootdir "$R" "$R/tests" > "$OUT/gpu-tests.log" 2>&1
tail -15 "$OUT/gpu-tests.log"
[ "${RUNS:-1}" = 0 ] && exit 0
for args in "--resident none --group 8" "--resident max --group 8"; do
  timeout 150 python3 -m kvpipe run --model llama-3-8b --random-weights --context 32K --decode-tokens 32 \
    --gpu-mem 24GB --no-progress --json $args > "$OUT/run-${args// /_}.json" 2> "$OUT/run-err.txt"
  python3 -c "import json,sys; d=json.load(open(sys.argv[1])); m=d['measured']; p=d['predicted']; print(sys.argv[2], 'prefill', round(m['prefill_s'],2), 'decode ms', round(m['decode_s_per_token']*1e3,2), 'pred', round(p['decode_s_per_token']*1e3,2), 'peak gpu GiB', round(m['peak_bytes']['gpu']/2**30,2))" "$OUT/run-${args// /_}.json" "$args" || tail -3 "$OUT/run-err.txt"
done
