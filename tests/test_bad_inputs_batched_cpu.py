"""Bad-input matrix, continued (tests/test_bad_inputs_cpu.py covers mm, addmm, linear and
the gradient functions): bmm, baddbmm, grouped_mm (offs faults included), the fp32
precision argument of every op that takes one, and InvariantDataParallel's setup. Each case
raises before any launch a TypeError / ValueError / RuntimeError whose message names the
call and the argument; valid edge values give the reference's bits.

Tiny shapes, CPU tensors (the bit-exact reference); meta tensors stand in for another
device."""

import pytest
import torch

import detgemm_cute as dg
from detgemm_cute import reference

BF, FP, F32, F64 = torch.bfloat16, torch.float16, torch.float32, torch.float64
L, M, K, N, T = 2, 4, 8, 3, 6


def rand(*shape, dtype=BF):
    return torch.randn(shape).to(dtype)


def offs(*ends, dtype=torch.int32, device="cpu"):
    return torch.tensor(ends, dtype=dtype, device=device)


def meta(*shape, dtype=BF):
    return torch.empty(*shape, dtype=dtype, device="meta")


def E(call, exc, regex, id):
    return pytest.param(call, exc, regex, id=id)


BMM = "detgemm_cute\\.bmm"
BADD = "detgemm_cute\\.baddbmm"
GMM = "detgemm_cute\\.grouped_mm"

BAD = [
    # --- bmm ----------------------------------------------------------------------------
    E(lambda: dg.bmm([1.0], rand(L, K, N)), TypeError, BMM + r": a must be a torch\.Tensor",
      "bmm-a-list"),
    E(lambda: dg.bmm(rand(L, M, K), "b"), TypeError, BMM + r": b must be a torch\.Tensor",
      "bmm-b-str"),
    E(lambda: dg.bmm(rand(L, M, K, dtype=F64), rand(L, K, N, dtype=F64)), TypeError,
      BMM + r": a must be torch\.bfloat16, torch\.float16 or torch\.float32, got torch\.float64",
      "bmm-a-fp64"),
    E(lambda: dg.bmm(rand(L, M, K), rand(L, K, N, dtype=FP)), TypeError,
      BMM + r": b must have the same dtype as a", "bmm-b-dtype"),
    E(lambda: dg.bmm(rand(M, K), rand(L, K, N)), ValueError, BMM + r": a must be 3-D",
      "bmm-a-2d"),
    E(lambda: dg.bmm(rand(L, M, K), rand(1, L, K, N)), ValueError, BMM + r": b must be 3-D",
      "bmm-b-4d"),
    E(lambda: dg.bmm(rand(L, M, K), rand(L + 1, K, N)), ValueError,
      BMM + r": batch mismatch: a has L=2, b has L=3", "bmm-batch"),
    E(lambda: dg.bmm(rand(L, M, K), rand(L, K + 1, N)), ValueError,
      BMM + r": K mismatch: a has K=8 .* but b has K=9", "bmm-k"),
    E(lambda: dg.bmm(rand(L, M, K), rand(L, K, N), bias=rand(N + 1)), ValueError,
      BMM + r": bias must be 1-D of length N=3", "bmm-bias-length"),
    E(lambda: dg.bmm(rand(L, M, K), rand(L, K, N), bias=rand(1, N)), ValueError,
      BMM + r": bias must be 1-D of length N=3, got shape \(1, 3\)", "bmm-bias-2d"),
    E(lambda: dg.bmm(rand(L, M, K), rand(L, K, N), bias=rand(N, dtype=F32)), TypeError,
      BMM + r": bias must have dtype torch\.bfloat16 like a", "bmm-bias-dtype"),
    E(lambda: dg.bmm(rand(L, M, K), rand(L, K, N), bias=[0.0] * N), TypeError,
      BMM + r": bias must be a torch\.Tensor", "bmm-bias-list"),
    E(lambda: dg.bmm(rand(L, M, K), rand(L, K, N), out_dtype=torch.int32), TypeError,
      BMM + r": out_dtype must be one of .* got torch\.int32", "bmm-out-dtype"),
    E(lambda: dg.bmm(rand(L, M, K), meta(L, K, N)), ValueError,
      BMM + r": b is on meta but a is on cpu", "bmm-b-device"),
    E(lambda: dg.bmm(rand(L, M, K), rand(L, K, N), bias=meta(N)), ValueError,
      BMM + r": bias is on meta but a is on cpu", "bmm-bias-device"),
    # --- baddbmm ------------------------------------------------------------------------
    E(lambda: dg.baddbmm([1.0], rand(L, M, K), rand(L, K, N)), TypeError,
      BADD + r": input must be a torch\.Tensor, got list", "baddbmm-input-list"),
    E(lambda: dg.baddbmm(torch.ones(L, M, N, dtype=torch.int64), rand(L, M, K),
                         rand(L, K, N)), TypeError,
      BADD + r": input must be torch\.bfloat16, torch\.float16 or torch\.float32, got "
             r"torch\.int64", "baddbmm-input-int"),
    E(lambda: dg.baddbmm(torch.ones(L, M, N, dtype=torch.complex64), rand(L, M, K),
                         rand(L, K, N)), TypeError, BADD + r": input must be .* got "
                                                          r"torch\.complex64",
      "baddbmm-input-complex"),
    E(lambda: dg.baddbmm(rand(L, M, N + 1), rand(L, M, K), rand(L, K, N)), ValueError,
      BADD + r": input of shape \(2, 4, 4\) does not broadcast", "baddbmm-input-shape"),
    E(lambda: dg.baddbmm(meta(N), rand(L, M, K), rand(L, K, N)), ValueError,
      BADD + r": input is on meta but the product is on cpu", "baddbmm-input-device"),
    E(lambda: dg.baddbmm(rand(N), rand(L, M, K), rand(L, K, N), beta="half"), TypeError,
      BADD + r": beta must be a real number, got str", "baddbmm-beta"),
    E(lambda: dg.baddbmm(rand(N), rand(L, M, K), rand(L, K, N), alpha=None), TypeError,
      BADD + r": alpha must be a real number, got NoneType", "baddbmm-alpha"),
    E(lambda: dg.baddbmm(rand(N), rand(L, M, K), rand(L, K, N), alpha=torch.tensor(2.0)),
      TypeError, BADD + r": alpha must be a real number, got Tensor", "baddbmm-alpha-tensor"),
    E(lambda: dg.baddbmm(rand(L, M, N), rand(L, M, K), rand(L, K, N), beta=0.5,
                         out_dtype=torch.int32), TypeError,
      BADD + r": out_dtype must be one of .* got torch\.int32", "baddbmm-out-dtype"),
    E(lambda: dg.baddbmm(rand(N), rand(M, K), rand(L, K, N)), ValueError,
      BADD + r": a must be 3-D", "baddbmm-a-2d"),
    E(lambda: dg.baddbmm(rand(N), rand(L, M, K), rand(L, K, N, dtype=FP)), TypeError,
      BADD + r": b must have the same dtype as a", "baddbmm-b-dtype"),
    # --- grouped_mm: offs -----------------------------------------------------------------
    E(lambda: dg.grouped_mm(rand(T, K), rand(2, K, N), offs(3, 6, dtype=torch.int64)),
      TypeError, GMM + r": offs must be a 1-D torch\.int32 tensor", "offs-int64"),
    E(lambda: dg.grouped_mm(rand(T, K), rand(2, K, N), offs(3.0, 6.0, dtype=F32)),
      TypeError, GMM + r": offs must be a 1-D torch\.int32 tensor", "offs-float"),
    E(lambda: dg.grouped_mm(rand(T, K), rand(2, K, N), offs([3, 6])), TypeError,
      GMM + r": offs must be a 1-D torch\.int32 tensor", "offs-2d"),
    E(lambda: dg.grouped_mm(rand(T, K), rand(2, K, N), [3, 6]), TypeError,
      GMM + r": offs must be a 1-D torch\.int32 tensor", "offs-list"),
    E(lambda: dg.grouped_mm(rand(T, K), rand(2, K, N), offs(6)), ValueError,
      GMM + r": offs has 1 entries but b has 2 groups", "offs-length"),
    E(lambda: dg.grouped_mm(rand(T, K), rand(2, K, N), offs(4, 2)), ValueError,
      GMM + r": offs must be non-decreasing and <= 6; offs\[1\]=2 after 4", "offs-decreasing"),
    E(lambda: dg.grouped_mm(rand(T, K), rand(2, K, N), offs(3, 7)), ValueError,
      GMM + r": offs must be non-decreasing and <= 6; offs\[1\]=7", "offs-past-rows"),
    E(lambda: dg.grouped_mm(rand(T, K), rand(2, K, N), offs(-1, 6)), ValueError,
      GMM + r": offs must be non-decreasing and <= 6; offs\[0\]=-1", "offs-negative"),
    E(lambda: dg.grouped_mm(rand(T, K), rand(2, K, N), offs(3, 6, device="meta")), ValueError,
      GMM + r": offs is on meta but a is on cpu", "offs-device"),
    E(lambda: dg.grouped_mm(rand(T, K), rand(2, K, N)), ValueError,
      GMM + r": offs is expected for the 2-D x 3-D form", "offs-missing"),
    E(lambda: dg.grouped_mm(rand(L, M, K), rand(L, K, N), offs(1, 2)), ValueError,
      GMM + r": offs is not expected for the 3-D x 3-D form", "offs-extra"),
    E(lambda: dg.grouped_mm(rand(M, T), rand(T, N), offs(4, 2)), ValueError,
      GMM + r": offs must be non-decreasing and <= 6; offs\[1\]=2", "offs-2x2-decreasing"),
    E(lambda: dg.grouped_mm(rand(M, T), rand(T, N), offs(4, 9)), ValueError,
      GMM + r": offs must be non-decreasing and <= 6; offs\[1\]=9", "offs-2x2-past"),
    # --- grouped_mm: operands -----------------------------------------------------------
    E(lambda: dg.grouped_mm([1.0], rand(2, K, N), offs(3, 6)), TypeError,
      GMM + r": a must be a torch\.Tensor", "grouped-a-list"),
    E(lambda: dg.grouped_mm(rand(T, K), rand(2, K, N, dtype=FP), offs(3, 6)), TypeError,
      GMM + r": b must have the same dtype as a", "grouped-b-dtype"),
    E(lambda: dg.grouped_mm(rand(T, K, dtype=F64), rand(2, K, N, dtype=F64), offs(3, 6)),
      TypeError, GMM + r": a must be torch\.bfloat16, torch\.float16 or torch\.float32",
      "grouped-fp64"),
    E(lambda: dg.grouped_mm(rand(L, M, K), rand(K, N), offs(1, 2)), ValueError,
      GMM + r": takes a \[T, K\] with b \[G, K, N\] .* got shapes \(2, 4, 8\) and \(8, 3\)",
      "grouped-form"),
    E(lambda: dg.grouped_mm(rand(T, K), rand(2, K + 1, N), offs(3, 6)), ValueError,
      GMM + r": inner dims differ: a \(6, 8\), b \(2, 9, 3\)", "grouped-k"),
    E(lambda: dg.grouped_mm(rand(T, K), meta(2, K, N), offs(3, 6)), ValueError,
      GMM + r": b is on meta but a is on cpu", "grouped-b-device"),
    E(lambda: dg.grouped_mm(rand(T, K), rand(2, K, N), offs(3, 6), out_dtype=F64), TypeError,
      GMM + r": out_dtype must be one of .* got torch\.float64", "grouped-out-dtype"),
]


@pytest.mark.parametrize("call, exc, regex", BAD)
def test_bad_input_is_refused(call, exc, regex):
    with pytest.raises(exc, match=regex):
        call()


# --- the fp32 precision argument ---------------------------------------------------------
PRECISION_OPS = {
    "mm": lambda x, w, p: dg.mm(x, w.t(), precision=p),
    "addmm": lambda x, w, p: dg.addmm(w[:, 0].clone(), x, w.t(), precision=p),
    "linear": lambda x, w, p: dg.linear(x, w, precision=p),
    "input_grad": lambda x, w, p: dg.input_grad(x[:, :N], w[:N], precision=p),
    "bmm": lambda x, w, p: dg.bmm(x.expand(2, M, K), w.t().expand(2, K, N), precision=p),
    "grouped_mm": lambda x, w, p: dg.grouped_mm(x, w.t().expand(2, K, N).contiguous(),
                                                offs(1, M), precision=p),
}


@pytest.mark.parametrize("op", sorted(PRECISION_OPS))
@pytest.mark.parametrize("dtype", [F32, BF])
@pytest.mark.parametrize("bad, exc", [("fp64", ValueError), ("TF32", ValueError),
                                      ("", ValueError), (1, TypeError), (True, TypeError)])
def test_bad_precision_is_refused_by_name(op, dtype, bad, exc):
    x, w = rand(M, K, dtype=dtype), rand(N, K, dtype=dtype)
    with pytest.raises(exc, match=rf"detgemm_cute\.{op}: precision must be one of "
                                  rf"\('ieee', 'tf32'\) or None, got"):
        PRECISION_OPS[op](x, w, bad)


@pytest.mark.parametrize("op", sorted(PRECISION_OPS))
def test_precision_on_16_bit_inputs_is_refused(op):
    """The precision picks the fp32 tier's chain; bf16 inputs have one chain, so an explicit
    precision cannot apply and is refused by name rather than ignored."""
    x, w = rand(M, K), rand(N, K)
    for p in ("ieee", "tf32"):
        with pytest.raises(ValueError, match=rf"precision='{p}' chooses how fp32 inputs"):
            PRECISION_OPS[op](x, w, p)


def test_precision_on_fp32_inputs_is_the_chosen_chain():
    x, w = rand(M, 40, dtype=F32), rand(N, 40, dtype=F32)
    for p in ("ieee", "tf32"):
        with dg.fp32_precision(p):
            want = reference.linear(x, w)
        assert reference.same_bits(dg.linear(x, w, precision=p), want)
    assert not reference.same_bits(dg.linear(x, w, precision="ieee"),
                                   dg.linear(x, w, precision="tf32"))


def test_fp32_precision_context_refuses_bad_values():
    with pytest.raises(ValueError, match=r"fp32_precision: precision must be one of "
                                         r"\('ieee', 'tf32'\), got 'fast'"):
        dg.fp32_precision("fast").__enter__()
    with pytest.raises(TypeError, match=r"fp32_precision: precision must be .* got NoneType"):
        dg.fp32_precision(None).__enter__()


# --- InvariantDataParallel ----------------------------------------------------------------
@pytest.fixture(scope="module")
def world1(tmp_path_factory):
    """A one-rank gloo process group (the wrapper's construction is collective)."""
    if not torch.distributed.is_available():
        pytest.skip("torch.distributed is not available")
    from dist_helpers import one_rank_gloo

    with one_rank_gloo(tmp_path_factory.mktemp("pg")):
        yield


def _model(fp32_grad_accum=True):
    return dg.nn.convert(torch.nn.Sequential(torch.nn.Linear(K, N)),
                         fp32_grad_accum=fp32_grad_accum)


IDP = "detgemm_cute\\.distributed"
IDP_BAD = [
    ("module-class", lambda: (torch.nn.Linear,), {}, TypeError,
     r"module must be a torch\.nn\.Module, got type"),
    ("module-none", lambda: (None,), {}, TypeError, r"module must be a torch\.nn\.Module"),
    ("pipeline-zero", lambda: (_model(),), {"pipeline_bytes": 0}, ValueError,
     r"pipeline_bytes must be a positive int, got 0"),
    ("pipeline-float", lambda: (_model(),), {"pipeline_bytes": 1e6}, ValueError,
     r"pipeline_bytes must be a positive int, got 1000000\.0"),
    ("pipeline-bool", lambda: (_model(),), {"pipeline_bytes": True}, ValueError,
     r"pipeline_bytes must be a positive int, got True"),
    ("broadcast-int", lambda: (_model(),), {"broadcast_parameters": 1}, TypeError,
     r"broadcast_parameters must be a bool, got int"),
    ("group-str", lambda: (_model(), "world"), {}, TypeError,
     r"process_group must be a torch\.distributed\.ProcessGroup or None, got str"),
    ("not-converted", lambda: (torch.nn.Sequential(torch.nn.Linear(K, N)),), {}, ValueError,
     r"the module has no trainable detgemm Linear; convert it"),
    ("no-fp32-accum", lambda: (_model(fp32_grad_accum=False),), {}, ValueError,
     r"layer '0' is a detgemm Linear without fp32 gradient accumulation"),
]


@pytest.mark.parametrize("case", IDP_BAD, ids=[c[0] for c in IDP_BAD])
def test_invariant_data_parallel_bad_setups(world1, case):
    from detgemm_cute.distributed import InvariantDataParallel

    _, args, kwargs, exc, regex = case
    with pytest.raises(exc, match=IDP + r".*" + regex):
        InvariantDataParallel(*args(), **kwargs)


def test_invariant_data_parallel_refuses_a_second_wrap(world1):
    from detgemm_cute.distributed import InvariantDataParallel

    model = _model()
    wrapped = InvariantDataParallel(model)
    assert wrapped.world_size == 1 and wrapped.rank == 0
    with pytest.raises(ValueError, match=IDP + r".*layer '0' is already wrapped by an "
                                               r"InvariantDataParallel"):
        InvariantDataParallel(model)
    del wrapped, model
