"""The reference's NaN model (`ChainModel.nan_bits`) on the CPU.

"canonical" claims every NaN detgemm computes is its dtype's canonical NaN, whatever the
inputs' payloads and signs (bench/probe_nan.py measures that on a GPU). Under it, every CPU
path -- the 16-bit chain, fp32 at both precisions, dW continuing a buffer, the bias
gradient, bmm with its K = 0 path, baddbmm, grouped_mm -- must write the canonical pattern,
so the fuzzer can compare NaN bits exactly; the probe script's own CPU run checks that."""

import importlib.util
from pathlib import Path

import torch

from detgemm_cute import fuzz
from detgemm_cute import reference as R

_PROBE = Path(__file__).resolve().parents[1] / "bench" / "probe_nan.py"


def _probe_module():
    spec = importlib.util.spec_from_file_location("probe_nan", _PROBE)
    mod = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mod)
    return mod


def test_canonical_nans_follows_the_model():
    t = torch.tensor([1.0, float("nan"), -float("nan")])
    free = R.ChainModel(nan_bits="unmodelled")
    assert torch.equal(R.canonical_nans(t, free).view(torch.int32),
                       t.view(torch.int32))  # "unmodelled": untouched
    assert R.MODEL.nan_bits == "canonical"  # measured: bench/probe_nan.py on an H100
    canon = R.ChainModel(nan_bits="canonical")
    assert R.canonical_nans(t, canon).view(torch.int32).tolist() == [
        0x3F800000, 0x7FFFFFFF, 0x7FFFFFFF]
    for dtype in (torch.bfloat16, torch.float16):
        h = t.to(dtype)
        assert R.canonical_nans(h, canon).view(torch.int16).tolist()[1:] == [0x7FFF, 0x7FFF]
    ints = torch.arange(3)
    assert R.canonical_nans(ints, canon) is ints


def test_every_cpu_path_writes_canonical_nans_under_the_model(monkeypatch):
    monkeypatch.setattr(R, "MODEL", R.ChainModel(nan_bits="canonical"))
    assert fuzz.nan_bits_modelled()
    probe = _probe_module()
    monkeypatch.setattr(probe, "K", 16)
    result = probe.run("cpu", [None], out=lambda *a: None)
    bad = [(r["path"], r["dtype"], r["precision"], r["all_patterns"])
           for r in result["rows"] if not r["canonical"]]
    assert not bad and result["positions_and_bits_equal"]
    assert len(result["rows"]) >= 40 and all(r["nan_outputs"] for r in result["rows"])
