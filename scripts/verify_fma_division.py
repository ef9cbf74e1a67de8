"""Offline check of the fma division of compiled_moe/kernels/quantize.py (`_divide`), exact
emulation in numpy: for a divisor s and y = RN(1/s),
    q = x*y;  r = fma(q, s, -x);  q = fma(r, -y, q);  r = fma(q, s, -x);  q = fma(r, -y, q)
must give the same e4m3 byte as RN_fp32(x / s) (sign of zero included), and equal it bit
for bit wherever |x / s| >= 2^-12.

    python scripts/verify_fma_division.py            # exhaustive bf16 significands
    python scripts/verify_fma_division.py --quick    # 1/16 of the divisors

Checks: every bf16 significand of x against every fp32 significand of s (scale-invariant for
normal numbers), random fp16/fp32 x, and the range where the kernel uses it: s in
[2^-90, 2^120] (scales of finite blocks above 448 * 2^-90), |x| <= 449 s, including subnormal
x and quotients that round to zero. Exhaustive run: about 15 minutes on 2 cores.
"""
import sys
import numpy as np
import torch

f32, f64 = np.float32, np.float64


def _round_f32(v64, side):
    """v64 (float64, an fp32 rounding of an exact value) to float32, nearest even, where a tie
    of v64 between two fp32 values is broken by side: the sign of exact - v64 (0: a true tie)."""
    r = v64.astype(f32)
    r64 = r.astype(f64)
    toward = np.where(v64 > r64, f32(np.inf), f32(-np.inf)).astype(f32)
    other = np.nextafter(r, toward)
    o64 = other.astype(f64)
    midpoint = (v64 != r64) & (np.abs(v64 - r64) == np.abs(o64 - v64))
    take_other = midpoint & (side != 0) & (np.sign(o64 - v64) == side)
    return np.where(take_other, other, r).astype(f32)


def fma32(a, b, c):
    """fp32 fma with one rounding: exact product and sum in float64 + error term (TwoSum)."""
    a64, b64, c64 = a.astype(f64), b.astype(f64), c.astype(f64)
    p = a64 * b64  # exact: 24 x 24 bits
    t = p + c64
    bp = t - c64
    ap = t - bp
    err = (p - ap) + (c64 - bp)  # p + c == t + err exactly
    # t on a float32 midpoint: the exact sum lies on err's side of it
    out = _round_f32(t, np.sign(err))
    # zero results: sign by IEEE rules (exact zero sum of opposite signs is +0)
    exact_zero = (t == 0) & (err == 0)
    same_sign_zero = (p == 0) & (c64 == 0) & (np.signbit(p) == np.signbit(c64))
    out = np.where(exact_zero & ~same_sign_zero, f32(0.0), out)
    out = np.where(exact_zero & same_sign_zero, np.where(np.signbit(c64), f32(-0.0), f32(0.0)), out)
    return out.astype(f32)


def div32(x, s):
    """RN_fp32(x / s) exactly (float64 quotient, with the double-rounding case resolved)."""
    x64, s64 = x.astype(f64), s.astype(f64)
    q64 = x64 / s64
    # x/s is never exactly an fp32 midpoint; its side is the sign of x - mid * s (exact here)
    return _round_f32(q64, np.sign(x64 - q64 * s64) * np.sign(s64))


def fma_divide(x, s):
    """The kernel's _divide on a tile whose scales are all in [2^-90, Inf) (other tiles
    divide with div_rn), step for step."""
    with np.errstate(all="ignore"):
        y = div32(np.ones_like(s), s)  # RN(1/s)
        q = x * y
        q = fma32(fma32(q, s, -x), -y, q)
        q = fma32(fma32(q, s, -x), -y, q)
    return q


def e4m3_bytes(q):
    """The reference's saturating cast (torch rounds to nearest even), as bytes."""
    t = torch.from_numpy(np.ascontiguousarray(q)).clamp(-448, 448)
    return t.to(torch.float8_e4m3fn).view(torch.uint8).numpy()


def check(x, s, what):
    """The e4m3 bytes must match everywhere; the fp32 quotients wherever |x / s| >= 2^-12
    (below, the remainders may be subnormal and the quotient off by an ulp, but anything
    under 2^-10 is +-0 in e4m3 either way)."""
    got = fma_divide(x, s)
    with np.errstate(all="ignore"):
        want = div32(x, s)
    bad8 = e4m3_bytes(got) != e4m3_bytes(want)
    big = np.abs(want) >= 2.0 ** -12
    bad32 = big & (got.view(np.uint32) != want.view(np.uint32))
    n = int(bad8.sum()) + int(bad32.sum())
    if n:
        i = np.flatnonzero(bad8 | bad32)[:5]
        print(f"FAIL {what}: {int(bad8.sum())} e4m3 / {int(bad32.sum())} fp32 mismatches, "
              f"e.g. x={x[i]} s={s[i]} got={got[i]} want={want[i]}")
    return n


def main():
    quick = "--quick" in sys.argv
    rng = np.random.default_rng(0)
    fails = 0
    # every fp32 significand of s in [1, 2) against every bf16 significand of x in [1, 2)
    step = 16 if quick else 1
    s_all = (np.arange(0x3F800000, 0x40000000, step, dtype=np.uint32)).view(f32)
    for m in range(128):
        xb = np.uint32(0x3F800000 | (m << 16))
        x = np.full(s_all.shape, xb, dtype=np.uint32).view(f32)
        for sign in (1, -1):
            fails += check(sign * x, s_all, f"bf16 significand {m}")
    print(f"bf16 x all significands against {s_all.size} divisor significands: {fails} failures")
    # random fp16 / fp32 x against random s, realistic ratio |x| <= 449 s
    n = 4_000_000
    for trial in range(8):
        s = (2.0 ** rng.uniform(-90, 119, n)).astype(f32)
        ratio = (rng.uniform(-1, 1, n) * 2.0 ** -rng.uniform(0, 40, n) * 449).astype(f64)
        x32 = (ratio * s).astype(f32)
        x16 = x32.astype(np.float16).astype(f32)
        xbf = (x32.view(np.uint32) & 0xFFFF0000).view(f32)
        fails += check(x32, s, "fp32 x") + check(x16 * np.where(np.abs(x16) < 60000, 1, 0), s, "fp16 x")
        fails += check(xbf, s, "bf16-like x")
    # edges: smallest allowed s, subnormal x, zeros of both signs, x = +-449 s
    s = np.full(6, 2.0 ** -90, dtype=f32)
    x = np.array([0.0, -0.0, 1e-45, -1e-45, 2.0 ** -100, -(2.0 ** -100)], dtype=f32)
    fails += check(x, s, "edges")
    s = rng.uniform(1, 2, 1000).astype(f32) * f32(2.0 ** -90)
    x = (s.astype(f64) * 449 * rng.uniform(-1, 1, 1000)).astype(f32)
    fails += check(x, s, "smallest s")
    s = (f64(3.4e38) / 448 * rng.uniform(0.5, 1, 1000)).astype(f32)
    x = (s.astype(f64) * 448 * rng.uniform(-1, 1, 1000)).astype(f32)
    fails += check(x, s, "largest s")
    print("TOTAL failures:", fails)
    return 1 if fails else 0


if __name__ == "__main__":
    sys.exit(main())
