"""The differential fuzzer (`detgemm_cute.fuzz`) on the CPU.

Its CPU part runs here for a few seconds: the reference on each case's layouts (transposed,
sliced, odd-offset, broadcast operands) against contiguous copies of the same values, NaN
bits included. The GPU loop's bookkeeping (reference worker processes, judging, shrinking,
reproducers) runs with the device side played by a deliberately broken CPU path, which it
must catch; `tests/test_gpu_fuzz.py` runs the real thing."""

import argparse
import random

import pytest
import torch

import detgemm_cute as dg
from detgemm_cute import cli, fuzz, fuzz_campaign
from detgemm_cute import fuzz_cases as fc
from detgemm_cute.fuzz_cases import Case


def test_the_reference_agrees_with_itself_under_layouts():
    s = fuzz.run(seconds=6, seed=20261126, device="cpu", out=lambda *a: None)
    assert s.failed == 0, [f["reproducer"] for f in s.failures]
    assert s.problems >= 10 and s.per_op


def test_dims_reach_multiples_of_32():
    """About a fifth of the dims (edges and sizes aside) are multiples of 32, within the
    bound: the aligned paths of real layer widths get drawn."""
    rng = random.Random(3)
    dims = [fc._dim(rng, 4096) for _ in range(4000)]
    aligned = sum(d % 32 == 0 for d in dims) / len(dims)
    assert 0.2 <= aligned <= 0.4, aligned
    assert all(1 <= d <= 4096 for d in dims)
    assert all(fc._dim(rng, 40) <= 40 for _ in range(500))


def test_cases_are_reproducible_from_the_seed_and_their_repr():
    rng_a, rng_b = random.Random(7), random.Random(7)
    a = [fc.draw(rng_a) for _ in range(60)]
    assert a == [fc.draw(rng_b) for _ in range(60)]
    for case in a:
        assert eval(repr(case), {"Case": Case}) == case
        assert case.macs() <= 1 << 22
        first, again = fc.inputs(case), fc.inputs(case)
        assert all(torch.equal(first[k].view(-1).view(torch.uint8),
                               again[k].view(-1).view(torch.uint8)) for k in first)
    assert {c.op for c in a} >= {"mm", "linear", "bmm", "grouped_mm"}
    assert any(layout == "offset" for c in a for _, layout in c.layouts)


def test_layouts_keep_the_values_and_change_the_storage():
    x = torch.randn(3, 5, 8)
    for layout in fc.LAYOUTS:
        y = fc.place(x, layout, "cpu")
        assert torch.equal(y, x)
    assert fc.place(x, "offset", "cpu").storage_offset() == 1
    assert fc.place(x, "t", "cpu").stride()[-2:] == (1, 5)
    b = fc.place(x[:1].expand(3, 5, 8).contiguous(), "bcast", "cpu")
    assert b.stride(0) == 0 and torch.equal(b[2], x[0])


def test_special_values_reach_the_inputs():
    g = torch.Generator().manual_seed(0)
    v = fc.values((64, 64), torch.float32, g, "nan")
    nan_bits = set(v[torch.isnan(v)].view(torch.int32).tolist())
    assert len(nan_bits) >= 2  # several payloads and signs
    assert torch.isinf(fc.values((64, 64), torch.bfloat16, g, "inf")).any()
    sub = fc.values((64, 64), torch.float16, g, "subnormal")
    assert ((sub != 0) & (sub.abs() < torch.finfo(torch.float16).tiny)).any()


def _broken_linear(case, device):
    """The device side with a bug: linear's result off where K > 8."""
    y = fc.evaluate(case, "cpu")
    if case.op == "linear" and case.dim("K") > 8 and y.numel():
        y.view(-1)[0] = torch.nextafter(y.view(-1)[0:1], torch.tensor([float("inf")]).to(
            y.dtype))[0] if y.dtype == torch.float32 else y.view(-1)[0] * 3 + 1
    return y


def test_a_wrong_result_is_caught_shrunk_and_printed(monkeypatch):
    monkeypatch.setattr(fuzz, "_on_device", _broken_linear)
    case = Case(op="linear", dtype="fp32", dims=(("M", 40), ("K", 300), ("N", 24)),
                layouts=(("x", "offset"),), seed=3)
    outcome = fuzz.check(case, "cuda")
    assert outcome.kind == "wrong_bits" and "outputs differ" in outcome.detail
    small = fuzz.shrink(case, outcome, "cuda", seconds=30)
    assert small.dim("M") == 1 and small.dim("N") == 1 and 8 < small.dim("K") <= 16
    line = fuzz.reproducer(small, "cuda")
    assert "\n" not in line and repr(small) in line and "check(" in line


def test_gpu_loop_with_reference_workers_counts_and_reports(monkeypatch):
    """The GPU loop (reference in a worker process), its device side broken for linear."""
    monkeypatch.setattr(fuzz, "_on_device", _broken_linear)
    lines = []
    s = fuzz.run(seconds=120, seed=5, device="cuda", ops=("linear", "mm"), jobs=1,
                 max_macs=1 << 12, shrink_seconds=10, out=lines.append, cases=30)
    assert s.problems == 30 and set(s.per_op) == {"linear", "mm"}
    assert s.failures and s.per_op["mm"]["wrong_bits"] == 0
    assert all(f["kind"] == "wrong_bits" and "op='linear'" in f["case"] for f in s.failures)
    assert any("fuzz: seed 5, device cuda, 30 problems" in ln for ln in lines)
    assert any(ln.startswith("FAIL wrong_bits linear") for ln in lines)
    assert any(f["shrunk"] for f in s.failures)


def test_min_cases_stretches_the_budget_boundedly(monkeypatch):
    """Past its seconds the loop goes on only while short of `min_cases`, and never past
    MIN_CASES_STRETCH x the budget (a zero budget draws nothing)."""
    assert fuzz._more_time(1.0, 2.0, 0, 0) and not fuzz._more_time(2.0, 2.0, 0, 0)
    assert fuzz._more_time(5.0, 2.0, 9, 10) and not fuzz._more_time(5.0, 2.0, 10, 10)
    assert not fuzz._more_time(2.0 * fuzz.MIN_CASES_STRETCH, 2.0, 0, 10)
    s = fuzz.run(seconds=0.0, seed=3, device="cpu", ops=("mm",), max_macs=1 << 10,
                 out=lambda *a: None, min_cases=3)
    assert s.problems == 0  # a zero budget stretches to zero: nothing is drawn
    monkeypatch.setattr(fuzz, "MIN_CASES_STRETCH", float("inf"))  # only min_cases stops it
    s = fuzz.run(seconds=1e-6, seed=3, device="cpu", ops=("mm",), max_macs=1 << 10,
                 out=lambda *a: None, min_cases=3)
    assert s.problems == 3


def test_judge_classifies_refusals_and_crashes():
    ok = ("ok", torch.zeros(2))
    assert fuzz.judge(("error", "ValueError: x"), ("error", "ValueError: x"), False).kind == \
        "refused"
    assert fuzz.judge(("error", "ValueError: Misaligned"), ok, False).kind == "crash"
    assert fuzz.judge(ok, ("error", "TypeError: y"), False).kind == "crash"
    nan1 = torch.tensor([0x7FC00000], dtype=torch.int32).view(torch.float32)
    nan2 = torch.tensor([0x7FFFFFFF], dtype=torch.int32).view(torch.float32)
    assert fuzz.judge(("ok", nan1), ("ok", nan2), exact_nan=False).kind == "ok"
    assert fuzz.judge(("ok", nan1), ("ok", nan2), exact_nan=True).kind == "wrong_bits"


def test_command_line(capsys):
    assert cli.main(["fuzz", "--device", "cpu", "--seconds", "1", "--ops", "mm",
                     "--seed", "2"]) == 0
    assert "fuzz: seed 2, device cpu" in capsys.readouterr().out
    assert cli.main(["fuzz", "--device", "cpu", "--ops", "mm,nope"]) == 1
    assert "unknown op(s) ['nope']" in capsys.readouterr().err
    assert cli.main(["fuzz", "--device", "cpu", "--seconds", "0"]) == 1


@pytest.mark.parametrize("op", fc.OPS)
def test_every_op_draws_runnable_cases(op):
    rng = random.Random(op)
    for _ in range(3):
        case = fc.draw(rng, (op,), max_macs=1 << 10)
        assert fuzz.check(case, "cpu").kind == "ok", repr(case)


def test_campaign_in_two_processes_adds_up_their_summaries():
    lines = []
    p = argparse.ArgumentParser()
    fuzz.add_arguments(p)
    args = p.parse_args(["--device", "cpu", "--seconds", "2", "--seed", "11", "--procs", "2",
                         "--jobs", "1"])
    s = fuzz_campaign.run_campaign(args, [], out=lines.append)
    assert s.fatal is None and s.failed == 0
    seeds = {ln.split("]")[0] for ln in lines if ln.startswith("[seed ")}
    assert seeds == {"[seed 11", "[seed 12"}
    per_child = [int(ln.split(" problems")[0].rsplit(" ", 1)[1]) for ln in lines
                 if ln.startswith("[seed ") and "fuzz: seed" in ln]
    assert len(per_child) == 2 and s.problems == sum(per_child) > 0
    assert any(ln.strip().startswith("fuzz: seeds 11..12 (2 processes)") for ln in lines)


def test_campaign_merge_keeps_failures_and_the_first_fatal_error():
    zero = dict.fromkeys(fuzz.KINDS, 0)
    a = {"seed": 1, "device": "cuda", "nan_bits": "bit for bit", "seconds": 5.0, "fatal": None,
         "per_op": {"mm": {**zero, "ok": 3, "wrong_bits": 1}},
         "failures": [{"case": "c1", "kind": "wrong_bits"}]}
    b = {"seed": 2, "device": "cuda", "nan_bits": "bit for bit", "seconds": 7.0,
         "fatal": "CUDA error: x", "per_op": {"mm": {**zero, "ok": 2}, "bmm": {**zero, "crash": 1}},
         "failures": [{"case": "c2", "kind": "crash"}]}
    s = fuzz_campaign.merge([a, b], 1)
    assert s.problems == 7 and s.per_op["mm"]["ok"] == 5 and s.per_op["bmm"]["crash"] == 1
    assert [f["case"] for f in s.failures] == ["c1", "c2"] and s.failed == 2
    assert s.fatal == "CUDA error: x" and s.seconds == 7.0


def test_reproducer_names_a_forced_kernel_family():
    case = Case(op="mm", dtype="bf16", dims=(("M", 3), ("K", 5), ("N", 7)), seed=1)
    with dg.use_family("sm80"):
        line = fuzz.reproducer(case, "cuda")
    assert "family='sm80'" in line
    assert "family=" not in fuzz.reproducer(case, "cuda")


def test_family_all_needs_several_processes(capsys):
    assert cli.main(["fuzz", "--device", "cpu", "--family", "all"]) == 1
    assert "--family all needs --procs 2" in capsys.readouterr().err
