#!/bin/bash
# One device call: install kvpipe (and the wheels carried in .whl/ for what the GPU image lacks:
# simpy, crc32c, zstandard), then run the named steps, each under its own time limit, logs and
# JSON under $OUT. Runs from /tmp so the checkout's kvpipe/ folder cannot shadow the install.
#   bash benchmarks/device_session.sh STEP[:SECONDS] ...
# Steps: gputests calibrate hfcache32 hfcache hfeager tiers regrows(ROWS env) regimes diag(DIAG_ROWS env) codeclink fuse lossyrun simcheck(SIMCHECK_ARGS env, e.g. "--warm-row 4k-g1-all-c2k") t1m t1mpoll regret(REGRET_ARGS env, e.g. "--part 1/2 --budget-s 420"; REGRET_TAG names the JSON) dequant si4trace lossy128 lossy128r lossy512 gpunew (SKIP_INSTALL=1: reuse the install of a warm machine)
set -u
R=$(pwd)
OUT=${OUT:-$R/benchmarks/results}
if [ -n "${SKIP_INSTALL:-}" ]; then :
elif ls .whl/*.whl >/dev/null 2>&1; then
  python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/site .whl/*.whl && export PYTHONPATH=/tmp/site
fi
[ -n "${SKIP_INSTALL:-}" ] || python3 -m pip install -q --no-deps --no-build-isolation . 2>&1 | grep -v "root' user" | tail -3
mkdir -p /tmp/bp && ln -sfn "$R/benchmarks" /tmp/bp/benchmarks
export PYTHONPATH=/tmp/bp:/tmp/site PYTHONUNBUFFERED=1
cd /tmp
python3 -c "import torch, transformers, simpy, kvpipe.executor.replay.capture; print('torch', torch.__version__, 'transformers', transformers.__version__, 'cudnn', torch.backends.cudnn.version())"
nvidia-smi --query-gpu=name,driver_version,memory.used,memory.total --format=csv | tee "$OUT/nvidia-smi.txt"
poll1m() {   # poll the detached 1M run every 15 s until it ends or $1 seconds pass; copy its files to $OUT
  local end=$((SECONDS + $1))
  while [ $SECONDS -lt $end ]; do
    python3 -m benchmarks.tiers poll --dir /tmp/kvpipe-1m > /tmp/kvpipe-1m/poll.txt 2>&1
    grep -q "running" /tmp/kvpipe-1m/poll.txt || break
    sleep 15
  done
  cat /tmp/kvpipe-1m/poll.txt | tail -5; tail -c 400 /tmp/kvpipe-1m/tiers-1m-run.log; echo; free -g | head -2
  if [ -s /tmp/kvpipe-1m/tiers-1m-run.json ]; then cp /tmp/kvpipe-1m/* "$OUT/" 2>/dev/null; else cp /tmp/kvpipe-1m/poll.txt "$OUT/"; fi
}
for spec in "$@"; do
  step=${spec%%:*}; lim=${spec#*:}; [ "$lim" = "$spec" ] && lim=300
  echo "=== $step (limit $lim s) $(date -u +%H:%M:%S)"
  case $step in
    gputests) timeout "$lim" python3 -m pytest -v -m gpu -p no:cacheprovider --rootdir "$R" "$R/tests" > "$OUT/gpu-tests.log" 2>&1
              grep -E "PASSED|FAILED|ERROR|SKIPPED" "$OUT/gpu-tests.log" | grep -c PASSED | sed 's/^/passed so far: /'; tail -30 "$OUT/gpu-tests.log" ;;   # whole log kept: a cut-off run still says which tests passed
    calibrate) timeout "$lim" python3 -m kvpipe calibrate --quick --name h200-testbox --base h200 --kv-dir /tmp --out "$OUT/h200-testbox.toml" 2>&1 | tail -12 ;;
    hfcache32) timeout "$lim" python3 -m benchmarks.hf_cache --contexts 32768 --cases stream --out "$OUT/hf-cache.json" 2>&1 | tail -12 ;;
    hfcache) timeout "$lim" python3 -m benchmarks.hf_cache --contexts 32768,131072 --cases stream --out "$OUT/hf-cache.json" 2>&1 | tail -12 ;;
    hfeager) timeout "$lim" python3 -m benchmarks.hf_cache --contexts 32768 --cases stream-eager --out "$OUT/hf-cache-eager.json" 2>&1 | tail -12 ;;
    codeclink) timeout "$lim" python3 -m benchmarks.codec_link --out "$OUT/codec-link.json" 2>&1 | tail -14 ;;
    tiers) timeout "$lim" python3 -m benchmarks.tiers disk --kv-dir /tmp --probe-gib 4 --out "$OUT/tiers-disk.json" 2>&1 | tail -14 ;;
    regrows) timeout "$lim" python3 -m benchmarks.regimes --rows "$ROWS" --decode 4 --out "$OUT/regimes-rows.json" 2>&1 | tail -24 ;;
    regimes) timeout "$lim" python3 -m benchmarks.regimes --decode 8 --out "$OUT/regimes.json" 2>&1 | tail -32 ;;
    diag) timeout "$lim" python3 -m experiments.diag --out "$OUT/diag" ${DIAG_ROWS:+--rows $DIAG_ROWS} 2>&1 | grep -v Warning | tail -12 ;;
    fuse) timeout "$lim" python3 -m benchmarks.fuse_check --out "$OUT/fuse_check.json" 2>&1 | grep -v Warning | tail -13 ;;
    simcheck) timeout "$lim" python3 -m benchmarks.sim_check --measure "$OUT/sim_check.json" ${SIMCHECK_ARGS:-} 2>&1 | grep -v Warning | tail -8 ;;
    lossyrun) timeout "$lim" python3 -m benchmarks.lossy_run --context 128K --decode-tokens 8 --gpu-mem 24GB --group 8 --resident none --hw h200 --device cuda --out "$OUT/lossy-run-128k.json" 2>&1 | grep -v Warning | tail -8 ;;
    regret) timeout "$lim" python3 -m benchmarks.planner_regret --plans "$R/benchmarks/results/planner-regret-plans.json" ${REGRET_ARGS:-} --out "$OUT/planner-regret${REGRET_TAG:+-$REGRET_TAG}.json" 2>&1 | grep -v "Warning\|kvpipe: executing" | tail -72 ;;
    t1m) python3 -m benchmarks.tiers 1m --kv-dir /tmp --dir /tmp/kvpipe-1m 2>&1 | tail -4; poll1m "$lim" ;;
    t1mpoll) poll1m "$lim" ;;
    dequant) timeout "$lim" python3 -m experiments.dequant_window --out "$OUT/dequant-window.json" 2>&1 | tail -14 ;;
    si4trace) timeout "$lim" python3 -m kvpipe run --model llama-3-8b --random-weights --context 128K --decode-tokens 4 \
                --gpu-mem 24GB --group 8 --resident none --hw h200-testbox --sparse 0.2 --lossy int4 \
                --trace "$OUT/sparse-int4-trace.json" --json > "$OUT/sparse-int4-run.json" 2> "$OUT/sparse-int4-run.log"
              tail -3 "$OUT/sparse-int4-run.log"; gzip -f "$OUT/sparse-int4-trace.json" ;;
    lossy128) timeout "$lim" python3 -m benchmarks.lossy_run --context 128K --decode-tokens 6 --gpu-mem 24GB --group 8 --resident none \
                --hw h200-testbox --device cuda --sparse 0.2 --variants exact int8 int4 sparse-int4 --out "$OUT/lossy-run-128k.json" 2>&1 | grep -v Warning | tail -8 ;;
    lossy128r) timeout "$lim" python3 -m benchmarks.lossy_run --context 128K --decode-tokens 6 --gpu-mem 24GB --group 8 --resident none \
                --hw h200-testbox --device cuda --sparse 0.2 --rounds 2 --variants exact int8 int4 sparse-int4 \
                --out "$OUT/lossy-run-128k-rounds.json" 2>&1 | grep -v Warning | tail -8 ;;   # ~420 s: 5 variants x 2 rounds
    lossy512) timeout "$lim" python3 -m benchmarks.lossy_run --context 512K --decode-tokens 4 --gpu-mem 24GB --group auto --resident none \
                --hw h200-testbox --device cuda --sparse 0.2 --variants exact int4 sparse-int4 --out "$OUT/lossy-run-512k.json" 2>&1 | grep -v Warning | tail -8 ;;
    gpunew) timeout "$lim" python3 -m pytest -v -m gpu -p no:cacheprovider --rootdir "$R" "$R/tests/test_dequant_paths.py" \
                "$R/tests/test_pinned.py" "$R/tests/test_replay.py" "$R/tests/test_kvstore.py" "$R/tests/test_measure.py" \
                "$R/tests/test_lossy_store.py" "$R/tests/test_sparse_int4.py" > "$OUT/gpu-tests-new.log" 2>&1; tail -4 "$OUT/gpu-tests-new.log" ;;
    *) echo "unknown step $step" ;;
  esac
done
echo "=== done $(date -u +%H:%M:%S)"
