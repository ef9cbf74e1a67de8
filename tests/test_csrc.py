"""CPU tier of the Hopper CUDA kernels (csrc/*.cu): ptxas keeps their wgmma asynchronous and
their registers unspilled, and their launch limits fit a Hopper block. Compiled by NVRTC for
sm_90a without a GPU; the SASS is read with Triton's cuobjdump."""

from __future__ import annotations

import os
import re
import subprocess

import pytest
import torch

native = pytest.importorskip("compiled_moe.native")
pytest.importorskip("cuda.core")

# Kernel -> the wgmma its SASS must hold (at least once per pipelined step of each loop).
KERNELS = {
    "fp8_grouped_mm": {"fp8_blockwise_grouped_mm": "QGMMA.64x128x32.F32.E4M3.E4M3",
                       "fp8_blockwise_grouped_mm_bias": "QGMMA.64x128x32.F32.E4M3.E4M3",
                       "fp8_blockwise_grouped_mm_x2": "QGMMA.64x128x32.F32.E4M3.E4M3",
                       "fp8_blockwise_grouped_mm_x2_bias": "QGMMA.64x128x32.F32.E4M3.E4M3",
                       "fp8_blockwise_grouped_mm_n256": "QGMMA.64x128x32.F32.E4M3.E4M3",
                       "fp8_blockwise_grouped_mm_n256_bias": "QGMMA.64x128x32.F32.E4M3.E4M3",
                       "fp8_grouped_mm_wgrad": "QGMMA.64x128x32.F32.E4M3.E4M3",
                       "fp8_grouped_mm_wgrad_claimed": "QGMMA.64x128x32.F32.E4M3.E4M3"},
    "grouped_mm": {
        "grouped_mm_bf16": "HGMMA.64x256x16.F32.BF16",
        "grouped_mm_bf16_nmajor": "HGMMA.64x256x16.F32.BF16",
        "grouped_mm_f16": "HGMMA.64x256x16.F32",
        "grouped_mm_f16_nmajor": "HGMMA.64x256x16.F32",
        "grouped_mm_bf16_skip": "HGMMA.64x256x16.F32.BF16",
        "grouped_mm_bf16_nmajor_skip": "HGMMA.64x256x16.F32.BF16",
        "grouped_mm_f16_skip": "HGMMA.64x256x16.F32",
        "grouped_mm_f16_nmajor_skip": "HGMMA.64x256x16.F32",
        "grouped_mm_bf16_skip_split": "HGMMA.64x256x16.F32.BF16",
        "grouped_mm_bf16_nmajor_skip_split": "HGMMA.64x256x16.F32.BF16",
        "grouped_mm_f16_skip_split": "HGMMA.64x256x16.F32",
        "grouped_mm_f16_nmajor_skip_split": "HGMMA.64x256x16.F32",
        "grouped_mm_wgrad_bf16": "HGMMA.64x256x16.F32.BF16",
        "grouped_mm_wgrad_f16": "HGMMA.64x256x16.F32",
        "grouped_mm_wgrad_bf16_claimed": "HGMMA.64x256x16.F32.BF16",
        "grouped_mm_wgrad_f16_claimed": "HGMMA.64x256x16.F32",
    },
}

# Kernels that wait for each step's wgmma by design: the FP8 weight gradient and the FP8
# forward's 128 x 256 tiles have one buffer of partial products (the other warpgroup's wgmma
# run meanwhile; csrc/fp8_grouped_mm.cu).
WAITS_FOR_EACH_STEP = {"fp8_grouped_mm_wgrad", "fp8_grouped_mm_wgrad_claimed",
                       "fp8_blockwise_grouped_mm_n256", "fp8_blockwise_grouped_mm_n256_bias"}

# Kernels whose consumers hold all but a few of their 232 registers in the k loop, where ptxas
# keeps a tile-loop variable on the stack (at most this many bytes, read once a tile); their
# SASS holds no spill between the first and the last wgmma.
SPILLS_OUTSIDE_LOOP = {"fp8_blockwise_grouped_mm_n256": 16, "fp8_blockwise_grouped_mm_n256_bias": 16}


def _sass_by_function(cubin_path: str) -> dict[str, str]:
    import triton
    cuobjdump = os.path.join(os.path.dirname(triton.__file__), "backends", "nvidia", "bin", "cuobjdump")
    if not os.path.exists(cuobjdump):
        pytest.skip("Triton's cuobjdump is not installed")
    sass = subprocess.run([cuobjdump, "--dump-sass", cubin_path], capture_output=True, text=True,
                          check=True).stdout
    parts = re.split(r"\n\s*Function : (\w+)", sass)
    return dict(zip(parts[1::2], parts[2::2]))


@pytest.mark.parametrize("source", sorted(KERNELS))
def test_kernels_compile_without_spills_or_wgmma_serialization(source, tmp_path):
    """Both break silently: when a non-wgmma instruction or (for some ptxas versions) a
    divergent branch sits inside a wgmma's flight, ptxas waits for every wgmma to finish (each
    wait in the SASS becomes `WARPGROUP.DEPBAR.LE gsb0, 0x0`; the FP8 kernel measured 1.1-1.2x
    slower on the H200), and spills land in the main loop. A wgmma accumulator indexed with a
    value ptxas cannot fold puts it on the stack, which serializes too."""
    path = native.csrc_dir() / f"{source}.cu"
    arch = native.source_arch(path, "sm_90")
    log = native.ptxas_report(path, arch)
    assert "serialized" not in log, log
    for kernel in KERNELS[source]:
        assert f"Compiling entry function '{kernel}'" in log, log
    spills = dict(re.findall(r"Function properties for (\w+)\n.*?(\d+) bytes spill stores", log))
    for kernel in KERNELS[source]:
        assert int(spills[kernel]) <= SPILLS_OUTSIDE_LOOP.get(kernel, 0), (kernel, log)
    # The FP8 kernels' launchers size their shared memory as all dynamic (fit_stages).
    usage = dict(re.findall(r"Function properties for (\w+)\n.*?\n.*?(Used [^\n]*)", log))
    for kernel in KERNELS[source]:
        if kernel.startswith("fp8"):
            assert "bytes smem" not in usage[kernel], (kernel, usage[kernel])
    cubin = tmp_path / f"{source}.cubin"
    cubin.write_bytes(native.compile_source(path, arch))
    functions = _sass_by_function(str(cubin))
    for kernel, wgmma in KERNELS[source].items():
        sass = functions[kernel]
        assert sass.count(wgmma) >= 4, kernel
        loop = sass[sass.index(wgmma):sass.rindex(wgmma)]
        assert "LDL" not in loop and "STL" not in loop, kernel
        # Each steady-state step waits with one step still in flight (but WAITS_FOR_EACH_STEP).
        if kernel not in WAITS_FOR_EACH_STEP:
            assert "WARPGROUP.DEPBAR.LE gsb0, 0x1" in sass, kernel


def test_grouped_mm_cuda_kernel_limits():
    """Shared memory at the most groups the forward kernel takes fits a Hopper block (227 KB),
    and CPU tensors never reach the CUDA kernels."""
    from compiled_moe.kernels import configs
    from compiled_moe.kernels import grouped_mm_sm90 as sm90
    stages = configs.grouped_mm_sm90_config().num_stages
    assert sm90._shared_bytes(stages, sm90.MAX_GROUPS) <= 227 * 1024
    assert sm90._shared_bytes(configs.grouped_mm_wgrad_sm90_config().num_stages) <= 227 * 1024
    a = torch.zeros(256, 512, dtype=torch.bfloat16)
    b = torch.zeros(4, 256, 512, dtype=torch.bfloat16).mT
    assert not sm90.supported(a, b, None, torch.bfloat16)
    assert not sm90.wgrad_supported(a, a, torch.bfloat16)


def test_launch_constants_are_read_from_one_header():
    """csrc/sm90_launch.cuh is the one definition of what the GEMMs' launches share with their
    kernels: Python reads every constant of it, with C's integer arithmetic, and the launchers
    take theirs from it (the kernels and the C++ layer include it)."""
    from compiled_moe.kernels import grouped_mm_sm90, scaled_grouped_mm_sm90

    text = (native.csrc_dir() / "sm90_launch.cuh").read_text()
    constants = native.launch_constants()
    assert list(constants) == re.findall(r"^constexpr int (\w+) =", text, re.M)
    assert constants["ORDER_SCRATCH_BYTES"] == 8 * ((constants["ORDER_MAX_GRID"] + 2) // 2 + 65)
    assert scaled_grouped_mm_sm90._THREADS == constants["SM90_THREADS"]  # (its cluster fit)
    assert grouped_mm_sm90.TILE_QUEUE_BYTES == constants["TILE_QUEUE_BYTES"]
    assert native._integer_expression("(7 - 10) / 2 + A * 3", {"A": 4}) == 11  # -3/2 = -1 in C
    with pytest.raises(ValueError, match="not an integer expression"):
        native._integer_expression("B + 1", {})
    for source in ("grouped_mm.cu", "fp8_grouped_mm.cu", "sm90.cuh"):
        body = (native.csrc_dir() / source).read_text()
        assert "= 384" not in body and "ORDER_SCRATCH =" not in body, source


def test_grouped_mm_cuda_dispatch_conditions(monkeypatch):
    """Which calls the Hopper kernels take (fake CUDA tensors, the device check forced on):
    everything else must go to the Triton kernels, so that no stride or dtype the kernels do
    not handle reaches them."""
    from torch._subclasses.fake_tensor import FakeTensorMode

    from compiled_moe.kernels import grouped_mm_sm90 as sm90
    monkeypatch.setattr(sm90, "hopper", lambda index: True)
    bf16, f32 = torch.bfloat16, torch.float32
    with FakeTensorMode(allow_non_fake_inputs=True):
        def t(shape, stride=None, dtype=bf16):
            if stride is None:  # contiguous
                stride = [1]
                for size in reversed(shape[1:]):
                    stride.insert(0, stride[0] * size)
            return torch.empty_strided(shape, stride, dtype=dtype, device="cuda")

        G, M, K, N = 8, 512, 256, 384
        a = t((M, K))
        b_k = t((G, K, N), (N * K, 1, K))  # the (G, K, N) view of a (G, N, K) weight: forward
        b_n = t((G, K, N))                 # (G, K, N) contiguous, as a weight is for dgrad
        assert sm90.supported(a, b_k, None, bf16) and sm90.supported(a, b_n, t((G, N)), bf16)
        assert sm90.supported(t((M, K), dtype=torch.float16), t((G, K, N), dtype=torch.float16),
                              None, torch.float16)
        assert not sm90.supported(a, b_k, None, f32)                             # fp32 output
        assert not sm90.supported(t((M, K), dtype=f32), t((G, K, N), dtype=f32), None, f32)
        assert not sm90.supported(a, t((G, K, 197), (197 * K, 1, K)), None, bf16)  # N = 197
        assert not sm90.supported(t((M, 100)), t((G, 100, N)), None, bf16)       # 200-byte rows
        assert not sm90.supported(t((M, K), (1, M)), b_k, None, bf16)            # a not K-major
        assert not sm90.supported(a, t((G, K, N), (N * K * 2, 2 * N, 2)), None, bf16)  # no unit stride
        assert not sm90.supported(a, t((sm90.MAX_GROUPS + 1, K, N)), None, bf16)
        assert not sm90.supported(a, b_k, t((G, N), (1, G)), bf16)               # bias strided

        x, dy = t((M, K)), t((M, N))
        assert sm90.wgrad_supported(dy, x, bf16)
        assert sm90.wgrad_supported(dy, x, f32, t((G, N, K), dtype=f32))
        assert sm90.wgrad_supported(dy, x, f32, t((G, N, K), (N * K, 1, N), dtype=f32))  # transposed
        assert not sm90.wgrad_supported(t((M, N), (1, M)), x, bf16)             # not token-major
        assert not sm90.wgrad_supported(dy, t((M, 100)), bf16)                   # 200-byte rows
        assert not sm90.wgrad_supported(t((M, 197)), x, bf16)                    # 394-byte rows
        assert not sm90.wgrad_supported(dy, x, f32, t((G, N, K), (N * K * 2, 2 * K, 2), dtype=f32))
        assert not sm90.wgrad_supported(t((M, N), dtype=f32), t((M, K), dtype=f32), f32)
        monkeypatch.setenv("COMPILED_MOE_GEMM", "triton")
        assert not sm90.supported(a, b_k, None, bf16)
        assert not sm90.wgrad_supported(dy, x, bf16)


def test_fp8_wgrad_cuda_dispatch_conditions(monkeypatch):
    """Which FP8 weight gradients the Hopper kernel takes (fake CUDA tensors, the device check
    forced on): fp8_blockwise and fp8_rowwise, token-major columnwise data with 16-byte rows,
    at most MAX_GROUPS groups; the rest runs the Triton kernel."""
    from torch._subclasses.fake_tensor import FakeTensorMode

    from compiled_moe.kernels import scaled_grouped_mm_sm90 as sm90
    monkeypatch.setattr(sm90, "hopper", lambda index: True)
    fp8 = torch.float8_e4m3fn
    with FakeTensorMode(allow_non_fake_inputs=True):
        def t(shape, stride):
            return torch.empty_strided(shape, stride, dtype=fp8, device="cuda")

        P, Q, M, G = 256, 384, 512, 8
        a_t, d_t = t((P, M), (M, 1)), t((Q, M), (M, 1))
        assert sm90.wgrad_supported(a_t, d_t, "fp8_blockwise", G)
        assert sm90.wgrad_supported(a_t, d_t, "fp8_rowwise", G)
        assert not sm90.wgrad_supported(a_t, d_t, "mxfp8", G)
        assert not sm90.wgrad_supported(a_t, d_t, "fp8_blockwise", sm90.MAX_GROUPS + 1)
        assert not sm90.wgrad_supported(t((P, 520), (520, 1)), d_t, "fp8_blockwise", G)  # 520-byte rows
        assert not sm90.wgrad_supported(a_t, t((Q, M), (1, Q)), "fp8_blockwise", G)      # not token-major
        monkeypatch.setenv("COMPILED_MOE_FP8_GEMM", "triton")
        assert not sm90.wgrad_supported(a_t, d_t, "fp8_blockwise", G)
    # The ring and the group table fit a Hopper block: 4 stages up to 1024 groups; fp32 outputs
    # (twice bf16's staging) at more groups than that take 3 beside the stages' side boxes.
    for groups in (1, 128, 1024, sm90.MAX_GROUPS):
        for dtype in (torch.bfloat16, torch.float32):
            stages = sm90.wgrad_stages(5, groups, dtype)
            least = 3 if groups > 1024 and dtype == torch.float32 else 4
            assert stages >= least and sm90._wgrad_shared_bytes(groups, stages, dtype) <= 227 * 1024


def test_quantize_cuda_dispatch_conditions(monkeypatch):
    """Which grouped_quantize calls the CUDA columnwise kernels take (fake CUDA tensors, the
    device check forced on): 2-D x in bf16/fp16/fp32 with 16-byte rows of whole 8-column
    chunks, recipe fp8_blockwise; the rest runs the Triton kernels."""
    from torch._subclasses.fake_tensor import FakeTensorMode

    from compiled_moe.kernels import quantize_cuda
    monkeypatch.setattr(quantize_cuda, "_sm90_or_later", lambda index: True)
    with FakeTensorMode(allow_non_fake_inputs=True):
        def t(shape, stride, dtype=torch.bfloat16):
            return torch.empty_strided(shape, stride, dtype=dtype, device="cuda")

        x = t((512, 256), (256, 1))
        for dtype in (torch.bfloat16, torch.float16, torch.float32):
            assert quantize_cuda.supported(t((512, 256), (256, 1), dtype), "fp8_blockwise")
        assert not quantize_cuda.supported(x, "mxfp8")
        assert quantize_cuda.supported(t((512, 256), (264, 1)), "fp8_blockwise")  # padded rows
        assert not quantize_cuda.supported(x, "fp8_rowwise")
        assert not quantize_cuda.supported(t((512, 252), (252, 1)), "fp8_blockwise")   # K % 8
        assert not quantize_cuda.supported(t((512, 256), (260, 1)), "fp8_blockwise")   # 520-byte rows
        assert not quantize_cuda.supported(t((512, 256), (1, 512)), "fp8_blockwise")   # column-major
        assert not quantize_cuda.supported(t((4, 512, 256), (512 * 256, 256, 1)), "fp8_blockwise")
        assert not quantize_cuda.supported(t((512, 256), (256, 1), torch.float64), "fp8_blockwise")
        monkeypatch.setenv("COMPILED_MOE_QUANTIZE", "triton")
        assert not quantize_cuda.supported(x, "fp8_blockwise")
    assert not quantize_cuda.supported(torch.zeros(512, 256), "fp8_blockwise")  # CPU tensors
    # Four stages beside the slot table of the largest benchmark shape (Qwen3, 640 slots).
    assert quantize_cuda.shared_bytes(torch.bfloat16, 4, 640) <= 227 * 1024
    assert quantize_cuda.fits(torch.zeros(1, dtype=torch.bfloat16), "fp8_blockwise", 30000)
    assert not quantize_cuda.fits(torch.zeros(1), "fp8_blockwise", 30000)  # fp32 stages are twice as large


@pytest.mark.parametrize("arch", ["sm_80", "sm_90"])
def test_host_layer_kernels_compile(arch):
    """The kernels the C++ host layer launches outside the GEMMs (csrc/moe_rows.cu, every one it
    asks for, and csrc/moe_route.cu) compile for the GPUs it runs them on, without spills."""
    from compiled_moe import host

    for source, kernels in (("moe_rows", host.row_kernel_names()),
                            ("moe_route", [f"moe_route_{s}_{i}" for s in ("rank", "place") for i in ("i32", "i64")])):
        path = native.csrc_dir() / f"{source}.cu"
        log = native.ptxas_report(path, native.source_arch(path, arch))
        for kernel in kernels:
            assert f"Compiling entry function '{kernel}'" in log, (source, kernel, log)
        assert not re.search(r"[1-9]\d* bytes spill stores", log), log


def test_rowwise_quantize_kernels_compile():
    """The rowwise-only quantizer the C++ host layer launches (csrc/grouped_quantize.cu, sm_90
    like the file's other kernels) compiles without spills for each input dtype."""
    path = native.csrc_dir() / "grouped_quantize.cu"
    log = native.ptxas_report(path, native.source_arch(path, "sm_90"))
    spills = dict(re.findall(r"Function properties for (\w+)\n.*?(\d+) bytes spill stores", log))
    for dtype in ("bf16", "f16", "f32"):
        assert spills[f"quantize_rows_fp8_blockwise_{dtype}"] == "0", log
