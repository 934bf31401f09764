"""GPU bits against detgemm_cute.reference (run on the GPU machine: `pytest -m gpu -s`).

`test_linear_matches_reference` asserts bit equality of `detgemm_cute.linear` on CUDA
with the CPU model on fresh seeded inputs: many shapes, both input dtypes, every output
dtype, bias, exponent spreads of 2^+-20 and special values mixed in. The same cases also
go through a plain Triton WGMMA GEMM, which checks the model against the hardware apart
from detgemm's own kernels. The probe prints how the GPU treats the edge cases of
`ChainModel` (subnormals, tiny and huge sums, NaN/Inf, -0, the epilogue) and which choice
it matches; it asserts nothing, so a changed behaviour shows up as a readable table.

Cost: the reference runs on the CPU (all cores), about 5e8 multiply-adds per pass.
"""

from __future__ import annotations

import json
import math
import os
import random

import pytest
import torch

from detgemm_cute import reference as R

pytestmark = [pytest.mark.gpu,
              pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")]

BF16, FP16, FP32 = torch.bfloat16, torch.float16, torch.float32
K_VALUES = (1, 7, 16, 17, 64, 100, 1000, 4096)
CASES_PER_GROUP = 24  # per (input dtype, output dtype): 3 passes over K_VALUES
MAX_MNK = 4 * 10**7  # keeps the CPU side of one case under a second or so
_checked = {"outputs": 0, "cases": 0}


@pytest.fixture(scope="module", autouse=True)
def _cpu_threads():
    prev = torch.get_num_threads()
    torch.set_num_threads(os.cpu_count() or prev)
    yield
    torch.set_num_threads(prev)


def _gpu_linear(x, w, bias, out_dtype):
    import detgemm_cute

    dev = lambda t: None if t is None else t.cuda()  # noqa: E731
    return detgemm_cute.linear(dev(x), dev(w), dev(bias), out_dtype=out_dtype).cpu()


# ---------------------------------------------------------------------------------------
# Inputs


def _operand(shape, dtype, g, spread, zeros, subnormals, specials):
    """randn * 2^randint(-spread, spread) per element, then +-0, subnormals, NaN/Inf."""
    x = torch.randn(shape, generator=g, dtype=torch.float64)
    x = x * torch.pow(2.0, torch.randint(-spread, spread + 1, shape, generator=g).double())
    big = torch.finfo(dtype).max
    x = x.clamp(-big, big).to(dtype)
    u = torch.rand(shape, generator=g)
    x = torch.where(u < zeros, torch.tensor(0.0, dtype=dtype), x)
    x = torch.where(u < zeros / 3, torch.tensor(-0.0, dtype=dtype), x)
    mant = 7 if dtype == BF16 else 10
    sub = (torch.randint(1, 2 ** mant, shape, generator=g).double()
           * (torch.randint(0, 2, shape, generator=g).double() * 2 - 1)
           * torch.finfo(dtype).tiny * 2.0 ** -mant).to(dtype)
    v = torch.rand(shape, generator=g)
    x = torch.where(v < subnormals, sub, x)
    pick = torch.randint(0, 3, shape, generator=g)
    special = torch.tensor([math.nan, math.inf, -math.inf], dtype=dtype)[pick]
    return torch.where(torch.rand(shape, generator=g) < specials, special, x)


def _case(dtype, out_dtype, i):
    """Shapes and recipe of case i of a group, from a seeded Python RNG."""
    seed = 1000 * (dtype == FP16) + 100 * [BF16, FP16, FP32].index(out_dtype) + i
    rng = random.Random(seed)
    k = K_VALUES[i % len(K_VALUES)]
    m = rng.choice([1, 2, 3, 8, 16, 17, 31, 64, 65, 127, 128, 129, rng.randint(1, 300),
                    rng.randint(1, 300), 300])
    n = rng.randint(8, 264)
    while m * n * k > MAX_MNK:
        m = max(1, m // 2)
    kind = rng.choice(["spread", "spread", "zeros", "subnormals", "specials", "cancel"])
    # bf16 spreads of 2^+-20 would overflow most fp16 outputs: narrower there.
    spread = 20 if dtype == BF16 and out_dtype != FP16 else 6
    spread = 4 if kind == "zeros" else spread
    zeros = 0.25 if kind == "zeros" else 0.02
    subn = 0.1 if kind == "subnormals" else 0.002
    specials = 1.0 / (m * k + n * k) * rng.choice([0.5, 2]) if kind == "specials" else 0.0
    g = torch.Generator().manual_seed(seed)
    x = _operand((m, k), dtype, g, spread, zeros, subn, specials)
    w = _operand((n, k), dtype, g, spread, zeros, subn, specials)
    if kind == "cancel" and k >= 2:  # the largest products cancel exactly, in pairs
        x[:, 1:k // 2 * 2:2] = -x[:, 0:k // 2 * 2:2]
        w[:, 1:k // 2 * 2:2] = w[:, 0:k // 2 * 2:2]
    bias = None
    if rng.random() < 0.5:
        bias = _operand((n,), dtype, g, 8 if dtype == BF16 else 4, 0.05, 0.01,
                        0.02 if kind == "specials" else 0.0)
    if rng.random() < 0.25:  # a strided view: row stride != K
        pad = rng.choice([1, 3, 8])
        xf = torch.zeros((m, k + pad), dtype=dtype)
        xf[:, :k] = x
        x = xf[:, :k]
    return f"{kind} M={m} N={n} K={k} bias={bias is not None}", x, w, bias


@pytest.mark.parametrize("out_dtype", [BF16, FP16, FP32], ids=["bf16out", "fp16out", "fp32out"])
@pytest.mark.parametrize("dtype", [BF16, FP16], ids=["bf16", "fp16"])
def test_linear_matches_reference(dtype, out_dtype):
    failures, outputs = [], 0
    for i in range(CASES_PER_GROUP):
        name, x, w, bias = _case(dtype, out_dtype, i)
        got = _gpu_linear(x, w, bias, out_dtype)
        r = R.verify(x, w, got, bias)
        outputs += r.checked
        if not r.ok:
            failures.append(f"case {i} ({name}): {r}")
    _checked["outputs"] += outputs
    _checked["cases"] += CASES_PER_GROUP
    print(f"\n{dtype} -> {out_dtype}: {outputs} outputs in {CASES_PER_GROUP} cases checked")
    assert not failures, "\n".join(failures)


# ---------------------------------------------------------------------------------------
# The same comparison against a plain Triton WGMMA GEMM: checks the model against the
# hardware independently of detgemm's own kernels (Triton's tl.dot without split-K runs the
# same chain on the H100: docs/reference.md).

try:
    import triton
    import triton.language as tl
except ImportError:  # pragma: no cover - the GPU machine has Triton
    triton = None

if triton is not None:
    @triton.jit
    def _triton_linear_kernel(a, b, c, bias, M, N, K, sam, sak, sbk, sbn, scm, scn,
                              HAS_BIAS: tl.constexpr, BM: tl.constexpr, BN: tl.constexpr,
                              BK: tl.constexpr):
        rm = tl.program_id(0) * BM + tl.arange(0, BM)
        rn = tl.program_id(1) * BN + tl.arange(0, BN)
        rk = tl.arange(0, BK)
        acc = tl.zeros((BM, BN), dtype=tl.float32)
        for k0 in range(0, K, BK):
            ka = k0 + rk
            av = tl.load(a + rm[:, None] * sam + ka[None, :] * sak,
                         mask=(rm[:, None] < M) & (ka[None, :] < K), other=0.0)
            bv = tl.load(b + ka[:, None] * sbk + rn[None, :] * sbn,
                         mask=(ka[:, None] < K) & (rn[None, :] < N), other=0.0)
            acc = tl.dot(av, bv, acc)
        if HAS_BIAS:
            acc = acc + tl.load(bias + rn, mask=rn < N, other=0.0).to(tl.float32)[None, :]
        tl.store(c + rm[:, None] * scm + rn[None, :] * scn, acc.to(c.dtype.element_ty),
                 mask=(rm[:, None] < M) & (rn[None, :] < N))


def _triton_linear(x, w, bias, out_dtype, bk=64):
    x, bt = x.cuda(), w.cuda().t()
    (m, k), n = x.shape, w.shape[0]
    c = torch.empty((m, n), dtype=out_dtype, device="cuda")
    _triton_linear_kernel[(triton.cdiv(m, 64), triton.cdiv(n, 64))](
        x, bt, c, c if bias is None else bias.cuda(), m, n, k, x.stride(0), x.stride(1),
        bt.stride(0), bt.stride(1), c.stride(0), c.stride(1), HAS_BIAS=bias is not None,
        BM=64, BN=64, BK=bk, num_warps=4)
    return c.cpu()


@pytest.mark.skipif(triton is None, reason="needs Triton")
@pytest.mark.skipif(not torch.cuda.is_available()
                    or torch.cuda.get_device_capability()[0] != 9, reason="needs SM90")
def test_triton_wgmma_matches_reference():
    """Every case of the groups above, through Triton's tl.dot (WGMMA on SM90).

    K=1 cases run without bias: Triton specialises K == 1, unrolls the single step and
    folds `dot + bias` into the MMA, so the bias enters as the starting accumulator (it
    then matches `chain(x, w.T, acc=bias)` instead; detgemm's epilogue never does this)."""
    failures, outputs = [], 0
    for dtype in (BF16, FP16):
        for out_dtype in (BF16, FP16, FP32):
            for i in range(CASES_PER_GROUP):
                name, x, w, bias = _case(dtype, out_dtype, i)
                if x.shape[1] == 1:
                    bias = None
                r = R.verify(x, w, _triton_linear(x, w, bias, out_dtype), bias)
                outputs += r.checked
                if not r.ok:
                    failures.append(f"{dtype}->{out_dtype} case {i} ({name}): {r}")
    print(f"\nreference vs Triton WGMMA: {outputs} outputs checked")
    assert not failures, "\n".join(failures)


def test_zz_report_outputs_checked():
    """Runs after the comparisons (file order): the total, for the log."""
    print(f"\nreference vs GPU: {_checked['outputs']} outputs in {_checked['cases']} cases "
          f"bit-identical")


# ---------------------------------------------------------------------------------------
# Probe: what the GPU does where the model guessed


def _rand(shape, dtype, seed, spread=0, scale=0):
    g = torch.Generator().manual_seed(seed)
    x = torch.randn(shape, generator=g, dtype=torch.float64)
    x = x * torch.pow(2.0, torch.randint(-spread, spread + 1, shape, generator=g).double())
    big = torch.finfo(dtype).max
    return (x * 2.0 ** scale).clamp(-big, big).to(dtype)


def _subnormal_lead(dtype, seed):
    """Blocks whose largest nominal exponent comes from a subnormal input."""
    bf = dtype == BF16
    g = torch.Generator().manual_seed(seed)
    x = _rand((32, 256), dtype, seed, 2, -124 if bf else -12)
    mant = 7 if bf else 10
    sub = (torch.randint(1, 2 ** mant, x.shape, generator=g).double()
           * (torch.randint(0, 2, x.shape, generator=g).double() * 2 - 1)
           * torch.finfo(dtype).tiny * 2.0 ** -mant).to(dtype)
    x = torch.where(torch.rand(x.shape, generator=g) < 0.7, sub, x)
    return x, _rand((64, 256), dtype, seed + 1, 12 if bf else 6, 90 if bf else 8)


def probe_cases():
    """(name, ChainModel field or None, x, w, bias, out_dtype). With a field, the table
    says which of its values matches the GPU; without, whether the default model does."""
    tiny_x, tiny_w = _rand((32, 256), BF16, 3, 6, -68), _rand((64, 256), BF16, 4, 6, -70)
    neg = _rand((32, 64), BF16, 5, 4, -80).abs()
    pad = [0.0] * 16
    nan, inf = math.nan, math.inf
    special_x = torch.tensor([[inf, 1.0, 0.0, 0.0], [inf, 2.0, 0, 0], [nan, 1, 0, 0],
                              [inf, 0, 0, 0], [-0.0, -0.0, -0.0, -0.0]], dtype=BF16)
    special_w = torch.tensor([[1.0, 1, 1, 1], [0, 1, 1, 1], [-inf, 1, 1, 1], [-1, 1, 1, 1]],
                             dtype=BF16)
    big = _rand((16, 64), BF16, 6, 2, 100)
    order_x = torch.tensor([[2.0 ** 100] + pad + [-inf], [-inf] + pad + [2.0 ** 100],
                            [2.0 ** 100] + pad + [2.0 ** 100]], dtype=BF16)
    order_w = torch.tensor([[2.0 ** 100] + pad + [1.0], [1.0] + pad + [2.0 ** 100],
                            [2.0 ** 100] + pad + [-(2.0 ** 100)]], dtype=BF16)
    sub_bias = (torch.arange(1, 65, dtype=torch.float64) * 2.0 ** -133).to(BF16)
    # Rows summing to 2^128 - 2^103 and 2^128 - 2^102: round toward zero gives the largest
    # finite fp32, round to nearest 2^128 (Inf).
    near = torch.tensor([2.0 ** (e - 60) for e in range(127, 101, -1)], dtype=BF16)
    near_x = torch.stack([torch.cat([near[:25], near[:1] * 0]), near])
    near_w = torch.full((8, 26), 2.0 ** 60, dtype=BF16)
    zeros = torch.zeros((4, 32), dtype=BF16)
    return [
        ("subnormal inputs, bf16", "subnormal_inputs", *_subnormal_lead(BF16, 10), None, FP32),
        ("subnormal inputs, fp16", "subnormal_inputs", *_subnormal_lead(FP16, 20), None, FP32),
        ("zero accumulator in E", "zero_acc", tiny_x, tiny_w, None, FP32),
        ("block sums < 2^-126", "acc_subnormals", tiny_x, tiny_w, None, FP32),
        ("block sums >= 2^128", "overflow", big, big, None, FP32),
        ("negative sums < 2^-149", "underflow_sign", -neg, neg, None, FP32),
        ("NaN / Inf products", None, special_x, special_w, None, FP32),
        ("Inf and overflow, order", "overflow", order_x, order_w, None, FP32),
        ("sums in (max, 2^128)", None, near_x, near_w, None, FP32),
        ("random NaN/Inf, bf16 out", None, *_specials(30), BF16),
        ("-0 inputs, -0 bias", None, zeros * -1, _rand((64, 32), BF16, 7),
         torch.full((64,), -0.0, dtype=BF16), BF16),
        ("subnormal bias (fp32 add)", None, zeros, _rand((64, 32), BF16, 8), sub_bias, FP32),
        ("subnormal bias, bf16 out", None, zeros, _rand((64, 32), BF16, 8), sub_bias, BF16),
        ("fp32 -> fp16 overflow", None, _rand((8, 64), BF16, 9, 0, 7),
         _rand((64, 64), BF16, 10, 0, 7), None, FP16),
        ("fp32 -> fp16 subnormal", None, _rand((8, 64), BF16, 11, 2, -12),
         _rand((64, 64), BF16, 12, 2, -12), None, FP16),
        ("fp32 -> bf16 rounding", None, _rand((64, 128), BF16, 13, 8),
         _rand((64, 128), BF16, 14, 8), _rand((64,), BF16, 15, 4), BF16),
    ]


def _specials(seed):
    g = torch.Generator().manual_seed(seed)
    x = _rand((16, 48), BF16, seed, 4)
    w = _rand((64, 48), BF16, seed + 1, 4)
    pick = torch.tensor([math.nan, math.inf, -math.inf], dtype=BF16)
    for t in (x, w):
        where = torch.rand(t.shape, generator=g) < 0.004
        t[where] = pick[torch.randint(0, 3, (int(where.sum()),), generator=g)]
    return x, w, _rand((64,), BF16, seed + 2, 2)


def _hex(t, flat_index):
    v = t.reshape(-1)[flat_index:flat_index + 1]
    digits = 8 if t.dtype == FP32 else 4
    ints = torch.int32 if t.dtype == FP32 else torch.int16
    return f"0x{int(v.view(ints)) & ((1 << 4 * digits) - 1):0{digits}x}"


def probe_table(gemm_fn, cases=None):
    """Run every probe case through gemm_fn(x, w, bias, out_dtype) -> CPU tensor; return
    rows {case, field, matches: {value: "n/total"}, example} and print them."""
    rows = []
    for name, field, x, w, bias, out_dtype in cases or probe_cases():
        got = gemm_fn(x, w, bias, out_dtype)
        models = R.MODEL.variants(field) if field else {"default": R.MODEL}
        current = getattr(R.MODEL, field) if field else "default"
        matches, example = {}, ""
        for value, model in models.items():
            exp = R.linear(x, w, bias, out_dtype, model=model)
            diff = R.bits(exp) != R.bits(got)
            matches[value] = f"{int((~diff).sum())}/{diff.numel()}"
            if value == current:
                i = int(torch.nonzero(diff.reshape(-1))[0]) if diff.any() else 0
                example = (f"[{i}] gpu {_hex(got, i)} model {_hex(exp, i)}"
                           + (" (first mismatch)" if diff.any() else ""))
        nan = got[torch.isnan(got)]
        if nan.numel():
            example += f"; NaN bits on GPU: {_hex(nan, 0)}"
        rows.append({"case": name, "field": field or "-", "matches": matches,
                     "example": example})
    print("\nGPU behaviour vs reference.ChainModel choices (default model: "
          f"{R.MODEL})")
    for r in rows:
        ms = ", ".join(f"{k}={v}" for k, v in r["matches"].items())
        print(f"  {r['case']:28s} {r['field']:17s} {ms:48s} {r['example']}")
    return rows


def test_probe_gpu_behaviour_table():
    """Prints the table (run with -s); writes $DETGEMM_PROBE_OUT/probe.json if set.

    On an H100 (Triton's tl.dot standing in for the kernel) every row matched the
    default model; see docs/reference.md."""
    rows = probe_table(_gpu_linear)
    out = os.environ.get("DETGEMM_PROBE_OUT")
    if out:
        os.makedirs(out, exist_ok=True)
        with open(os.path.join(out, "probe.json"), "w") as f:
            json.dump({"gpu": torch.cuda.get_device_name(), "torch": torch.__version__,
                       "model": R.MODEL.__dict__, "rows": rows}, f, indent=1)
    assert len(rows) == len(probe_cases())


# Volume: many outputs through every kind of bucket, wide exponent ranges, all out dtypes.
VOLUME_CASES = [  # (M, N, K, dtype, out_dtype, bias)
    (2048, 1024, 256, BF16, BF16, True), (2048, 1024, 64, FP16, FP32, False),
    (1500, 1000, 100, BF16, FP32, True), (700, 2048, 48, FP16, FP16, True),
    (300, 4096, 16, BF16, BF16, False), (4100, 1100, 1040, BF16, BF16, False),
    (129, 9000, 96, FP16, BF16, True), (16, 8192, 512, BF16, FP32, True),
    (1024, 1024, 2000, FP16, FP16, False), (64, 4096, 256, BF16, BF16, True),
]


def test_volume_ten_million_outputs():
    total, failures = 0, []
    for i, (m, n, k, dtype, out_dtype, use_bias) in enumerate(VOLUME_CASES):
        g = torch.Generator().manual_seed(7000 + i)
        spread = 20 if dtype == BF16 and out_dtype != FP16 else 5
        x = _operand((m, k), dtype, g, spread, 0.02, 0.002, 0.0)
        w = _operand((n, k), dtype, g, spread, 0.02, 0.002, 0.0)
        bias = _operand((n,), dtype, g, 4, 0.05, 0.01, 0.0) if use_bias else None
        r = R.verify(x, w, _gpu_linear(x, w, bias, out_dtype), bias)
        total += r.checked
        if not r.ok:
            failures.append(f"volume case {i} M={m} N={n} K={k}: {r}")
    _checked["outputs"] += total
    print(f"\nvolume: {total} outputs bit-identical to the reference")
    assert total >= 10_000_000
    assert not failures, "\n".join(failures)
