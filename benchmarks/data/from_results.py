"""Regenerates benchmarks/data/h200_results.json from the current tables of benchmarks/RESULTS.md
(run from the repository root: python benchmarks/data/from_results.py). The notebook
notebooks/performance.ipynb plots that file."""

import json, re
R = open('benchmarks/RESULTS.md').read().split('\n')

def table_after(marker, nth=0):
    """Rows (lists of cell strings) of the first markdown table after the line containing marker."""
    idx = [i for i, l in enumerate(R) if marker in l][nth]
    i = idx
    while not R[i].lstrip().startswith('|'):
        i += 1
    rows = []
    while i < len(R) and R[i].lstrip().startswith('|'):
        cells = [c.strip() for c in R[i].strip().strip('|').split('|')]
        rows.append(cells)
        i += 1
    return rows[0], rows[2:]

def num(s):
    s = s.replace('**', '').strip()
    m = re.match(r'^-?[0-9.]+', s)
    return float(m.group(0)) if m else None

def ratio_in(s):
    m = re.search(r'\(([0-9.]+)x[;)]', s.replace('**', ''))
    return float(m.group(1)) if m else None

out = {"_source": "Transcribed from benchmarks/RESULTS.md's current tables (NVIDIA H200, torch 2.11.0+cu130, "
       "triton 3.6.0, transformers 5.17.0 where used); each entry names its section, command and date. "
       "Ratios are peer time / compiled_moe time (> 1: compiled_moe faster). Parsed from those tables by benchmarks/data/from_results.py, not re-measured.",
       }

# grouped GEMM training shapes
hdr, rows = table_after('| case (M x K x N, G) | forward: ours / torch TFLOP/s')
cases = []
for r in rows:
    name = r[0]
    m = re.match(r'(.+?) (uniform|skewed) (fc1|fc2) \((.+)\)', name)
    model, routing, proj, shape = m.groups()
    entry = {"model": model, "routing": routing, "proj": proj, "shape": shape}
    for col, key in zip(r[1:], ["forward", "dgrad", "wgrad"]):
        a, b = col.split('(')[0].split('/')
        entry[key] = {"ours_tflops": num(a), "torch_tflops": num(b), "ratio": ratio_in(col)}
    cases.append(entry)
out["grouped_mm_training"] = {"section": "Grouped GEMM: bf16, training shapes", "date": "2026-11-27",
    "command": "python benchmarks/bench_grouped_mm.py --json bench_grouped_mm.json", "peer": "torch._grouped_mm",
    "tokens": 4096, "cases": cases}

# serving bf16
hdr, rows = table_after('benchmarks/bench_decode.py --tables gemm --json')
out["serving_bf16"] = {"section": "Serving shapes: bf16", "date": "2026-11-26",
    "command": "python benchmarks/bench_decode.py --tables gemm --json bench_decode.json",
    "peer": "torch._grouped_mm", "columns": hdr,
    "cases": [{"model": r[0], "T": int(r[1]), "proj": r[2], "experts_with_rows": int(r[3]), "weight_mb": num(r[4]),
               "ours_us": num(r[5]), "tb_per_s": num(r[6]), "vs_torch": num(r[7]), "vs_our_triton": num(r[8]),
               "vs_one_k_range": num(r[9])} for r in rows]}

# FP8 GEMMs
hdr, rows = table_after('| case | blockwise forward TFLOP/s')
fp8 = []
for r in rows:
    m = re.match(r'(.+?) (uniform|skewed) (fc1|fc2)', r[0])
    model, routing, proj = m.groups()
    fp8.append({"model": model, "routing": routing, "proj": proj, "forward_tflops": num(r[1]),
                "forward_vs_torch_rowwise": num(r[2]), "dgrad_tflops": num(r[3]), "dgrad_vs_torch_rowwise": num(r[4]),
                "forward_vs_our_bf16": num(r[5]), "wgrad_vs_torch_grouped_mm_bf16": num(r[6])})
out["fp8_gemm_training"] = {"section": "FP8 GEMMs against torch._scaled_grouped_mm (rowwise) and bf16", "date": "2026-11-29",
    "command": "python benchmarks/bench_fp8.py --skip-quantize --json bench_fp8.json", "recipe": "fp8_blockwise", "tokens": 4096, "cases": fp8}

# fused MLP / experts block 2026-11-26
hdr, rows = table_after('| model | T | fwd ms: fused | unfused | HF | unfused/fused | fwd+bwd ms')
out["experts_block"] = {"section": "The fused expert MLP", "date": "2026-11-26",
    "command": "python benchmarks/bench_moe_mlp.py --json bench_moe_mlp.json", "peer": "Hugging Face grouped_mm experts backend, compiled",
    "cases": [{"model": r[0], "T": int(r[1]), "fwd_ms": {"fused": num(r[2]), "unfused": num(r[3]), "hf": num(r[4])},
               "fwd_bwd_ms": {"fused": num(r[6]), "unfused": num(r[7]), "hf": num(r[8])},
               "fwd_bwd_hf_over_fused": num(r[10]), "fwd_bwd_unfused_over_fused": num(r[9]),
               "saved_mib": {"fused": num(r[11].split('/')[0]), "unfused": num(r[11].split('/')[1])}} for r in rows]}

# memory 2026-11-23
hdr, rows = table_after('| model | T | fwd ms: fused | unfused | HF | unfused/fused | HF/fused | fwd+bwd')
out["experts_block_memory"] = {"section": "The fused expert MLP (memory and kernel counts)", "date": "2026-11-23",
    "command": "python benchmarks/bench_moe_mlp.py --json bench_moe_mlp.json",
    "cases": [{"model": r[0], "T": int(r[1]), "peak_mib": {"fused": num(r[12].split('/')[0]), "hf": num(r[12].split('/')[1].split('(')[0])},
               "saved_mib": {"fused": num(r[13]), "unfused": num(r[14]), "hf": num(r[15])},
               "kernels_per_forward": [int(x) for x in r[16].split(',')]} for r in rows]}

# eager host time
hdr, rows = table_after('| eager call (us of host time) | this build')
out["eager_host_time"] = {"section": "Eager calls: host time per op", "date": "2026-11-29",
    "command": "python benchmarks/bench_eager.py --tables ops --json eager.json",
    "unit": "us of host time per call", "peer": "torch._grouped_mm (its row; ratios against it)",
    "cases": [{"call": r[0].replace('`', ''), "host_us": num(r[1]), "vs_torch": ratio_in(r[1])} for r in rows]}
hdr, rows = table_after('| T | forward: ours / HF (us)')
def pair(s):
    a, b = s.split('(')[0].split('/'); return num(a), num(b)
out["eager_experts_block"] = {"section": "Eager calls: the eager experts block (Qwen3-30B-A3B shape, skewed routing)", "date": "2026-11-29",
    "command": "python benchmarks/bench_eager.py --tables ops block generate --json eager.json",
    "peer": "Hugging Face grouped_mm experts backend, eager",
    "cases": [{"T": int(r[0]), "forward_us": dict(zip(["ours", "hf"], pair(r[1]))), "fwd_bwd_us": dict(zip(["ours", "hf"], pair(r[2]))),
               "fwd_bwd_gpu_us": dict(zip(["ours", "hf"], pair(r[3]))),
               "fwd_bwd_other_us": dict(zip(["fused_mlp", "unfused"], pair(r[4]))),
               "forward_hf_over_ours": ratio_in(r[1]), "fwd_bwd_hf_over_ours": ratio_in(r[2])} for r in rows]}
hdr, rows = table_after('| run | compiled_moe tokens/s')
out["generate"] = {"section": "Eager calls: Hugging Face generate()", "date": "2026-11-29",
    "command": "python benchmarks/bench_eager.py --tables ops block generate --json eager.json",
    "unit": "tokens/s", "peer": "Hugging Face grouped_mm backend (batched_mm while decoding)",
    "cases": [{"run": r[0], "compiled_moe": num(r[1]), "hf_grouped_mm": num(r[2]), "hf_eager": num(r[4])}
              for r in rows]}
hdr, rows = table_after('| model | bf16 wall (GPU) | fp8 wall (GPU)')
def wall_gpu(s):
    a, b = s.split('('); return {"wall_ms": num(a), "gpu_ms": num(b.rstrip(')'))}
out["eager_fp8_block"] = {"section": "Eager calls: the eager FP8 experts block, forward+backward", "date": "2026-11-29",
    "command": "python benchmarks/bench_eager.py --tables fp8", "recipe": "fp8_blockwise", "tokens": 4096,
    "peer": "our bf16 experts block, eager (ratios: bf16 / fp8)",
    "cases": [{"model": r[0], "bf16": wall_gpu(r[1]), "fp8": wall_gpu(r[2]), "bf16_over_fp8": num(r[3]),
               "fp8_cached": wall_gpu(r[4]), "bf16_over_fp8_cached": num(r[5])} for r in rows]}
hdr, rows = table_after('| model | FP8 moe_mlp, graph ms')
out["fp8_mlp_step"] = {"section": "FP8: the FP8 MLP's training step", "date": "2026-11-27",
    "command": "python benchmarks/bench_activation_quantize.py --rounds 3",
    "cases": [{"model": r[0], "fp8_graph_ms": num(r[1]), "bf16_graph_ms": num(r[2]), "fp8_eager_ms": num(r[4]), "bf16_eager_ms": num(r[5]),
               "bf16_over_fp8_graph": num(r[3]), "bf16_over_fp8_eager": num(r[6])} for r in rows]}
json.dump(out, open('benchmarks/data/h200_results.json', 'w'), indent=1)
print({k: len(v['cases']) for k, v in out.items() if isinstance(v, dict)})
