#!/usr/bin/env bash
# GPU tier and benchmarks on a CUDA machine (the H200): install, run the tests marked gpu,
# then the demo and the benchmarks. Logs and JSON go to $OUT (default ./out). Extra arguments are passed
# to pytest (e.g. -x, -k name).
set -o pipefail
OUT=${OUT:-out}
mkdir -p "$OUT"
export PYTHONUNBUFFERED=1
python3 -m pip install -q --no-build-isolation --no-deps -e . || exit 1
python3 -m pytest -q -m gpu tests "$@" 2>&1 | tee "$OUT/gpu_tests.log"
status=$?
python3 -m compiled_moe.demo 2>&1 | tee "$OUT/demo.log" || status=1
python3 benchmarks/tools/host_overhead.py 2>&1 | tee "$OUT/host_overhead.log" || status=1
python3 benchmarks/bench_eager.py --json "$OUT/bench_eager.json" 2>&1 | tee "$OUT/bench_eager.log" || status=1
python3 benchmarks/bench_grouped_mm.py --json "$OUT/bench_grouped_mm.json" 2>&1 \
    | tee "$OUT/bench_grouped_mm.log" || status=1
python3 benchmarks/bench_experts.py --json "$OUT/bench_experts.json" 2>&1 \
    | tee "$OUT/bench_experts.log" || status=1
python3 benchmarks/bench_rows.py --json "$OUT/bench_rows.json" 2>&1 \
    | tee "$OUT/bench_rows.log" || status=1
python3 benchmarks/bench_fp8.py --json "$OUT/bench_fp8.json" 2>&1 \
    | tee "$OUT/bench_fp8.log" || status=1
python3 benchmarks/bench_quantize.py --no-baseline 2>&1 | tee "$OUT/bench_quantize.log" || status=1
python3 benchmarks/bench_activation_quantize.py --json "$OUT/bench_activation_quantize.json" 2>&1 \
    | tee "$OUT/bench_activation_quantize.log" || status=1
python3 benchmarks/bench_fp8_training.py --json "$OUT/bench_fp8_training.json" 2>&1 \
    | tee "$OUT/bench_fp8_training.log" || status=1
python3 benchmarks/bench_moe_mlp.py --json "$OUT/bench_moe_mlp.json" 2>&1 \
    | tee "$OUT/bench_moe_mlp.log" || status=1
python3 benchmarks/bench_lowering.py --json "$OUT/bench_lowering.json" 2>&1 \
    | tee "$OUT/bench_lowering.log" || status=1
python3 benchmarks/bench_ep.py --out "$OUT/bench_ep.json" 2>&1 | tee "$OUT/bench_ep.log" || status=1
python3 benchmarks/bench_decode.py --json "$OUT/bench_decode.json" 2>&1 \
    | tee "$OUT/bench_decode.log" || status=1
exit $status
