"""`detgemm-cute demo` on a CPU-only machine: a short story (the promise, then each promise
checked bit for bit through the reference), the full audit only with --audit."""

import pytest
import torch

import detgemm_cute as dg
from detgemm_cute import demo

pytestmark = pytest.mark.skipif(torch.cuda.is_available(), reason="CPU-only path")


def test_demo_tells_a_short_story_and_proves_each_promise(capsys):
    assert demo.main([]) == 0
    out = capsys.readouterr().out
    lines = out.splitlines()
    assert len(lines) <= 40, out
    assert lines[0].startswith("Promised:")
    assert "no SM90 or SM80+ GPU" in out and "CPU reference" in out
    assert "1. Batch invariance" in out
    for m in demo.CPU.ms:  # every row of the table says the rows were identical
        assert any(line.split()[:2] == [str(m), "yes"] for line in lines), m
    assert "2. Chunked prefill: 256 rows as 16 + 112 + 128 vs one call: bit-identical" in out
    assert "micro-batches of 16 + 112 + 128 tokens (fp32 buffer) vs one call: bit-identical" in out
    assert "4. bmm entry 2 alone vs in a batch of 6: bit-identical" in out
    assert "verdict: every promise held" in out
    assert "fwd_decode_m1_16_n1_2112" not in out  # the audit table is behind --audit


def test_demo_audit_adds_the_tables(capsys):
    assert demo.main(["--audit"]) == 0
    out = capsys.readouterr().out
    assert "fwd_decode_m1_16_n1_2112" in out and "audit: OK" in out
    assert "bucket:  fwd_decode_m1_16_" in out  # the explanation of a decode step


def test_demo_reports_a_broken_promise(monkeypatch, capsys):
    real = dg.linear

    def drifting(x, w, *args, **kw):  # rows change with the batch size: not invariant
        y = real(x, w, *args, **kw)
        return y if x.shape[0] == demo.CPU.full_m else y + 1

    monkeypatch.setattr(dg, "linear", drifting)
    assert demo.main([]) == 1
    out = capsys.readouterr().out
    assert "           NO" in out and "a promise FAILED here" in out
    assert "Chunked prefill: 256 rows as 16 + 112 + 128 vs one call: DIFFERENT" in out
