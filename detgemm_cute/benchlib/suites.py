"""Named suites of problems for the bench and for `detgemm-cute tune --preset`.

  core            M in {1, 16, 64, 128, 512, 2048, 8192, 16384} x six (K, N)       fwd
  quick           M in {1, 128, 2048} x two (K, N) (smoke run)                     fwd
  decode          M in {1, 8, 16, 32, 64} x five LLM weights                       fwd
  decode-models   M in {1, 2, 4, 8, 16, 32, 48, 64} x every weight of `models`     fwd
  prefill-models  two M from {128 ... 16384, incl. 777, 1000, 3000, 12000} per
                  weight of `models` (rotating, so every M appears)               fwd, dx, dw

Every suite is deduplicated; `shapes.subsample` thins it (`--every`, `--limit`).
"""

from __future__ import annotations

from . import models as _models
from .shapes import Problem, dedup

CORE_MS = (1, 16, 64, 128, 512, 2048, 8192, 16384)
CORE_KN = ((768, 3072), (3072, 768), (4096, 4096), (4096, 14336), (14336, 4096), (8192, 8192))
QUICK_MS = (1, 128, 2048)
QUICK_KN = ((4096, 4096), (14336, 4096))
DECODE_MS = (1, 8, 16, 32, 64)
DECODE_KN = ((4096, 4096), (4096, 14336), (14336, 4096), (8192, 28672), (8192, 8192))
DECODE_MODEL_MS = (1, 2, 4, 8, 16, 32, 48, 64)
PREFILL_MS = (128, 256, 512, 777, 1000, 2048, 3000, 4096, 8192, 12000, 16384)
PREFILL_M_STEP = 5  # weight i gets PREFILL_MS[i % 11] and PREFILL_MS[(i + 5) % 11]

# Held out from tuning: M values the prefill suite never has, one per weight (rotating), so
# a table tuned on prefill-models is measured on problems it was not chosen from.
HELDOUT_MS = (200, 384, 640, 1234, 1600, 2600, 3500, 5000, 6400, 9000, 14000)
HELDOUT_M_OFFSET = 3

SUITES = ("core", "quick", "decode", "decode-models", "prefill-models", "prefill-heldout")
DEFAULT_OPS = {"core": ("fwd",), "quick": ("fwd",), "decode": ("fwd",),
               "decode-models": ("fwd",), "prefill-models": ("fwd", "dx", "dw"),
               "prefill-heldout": ("fwd", "dx", "dw")}
DESCRIPTIONS = {
    "core": f"M in {CORE_MS} x (K, N) in {CORE_KN}",
    "quick": f"M in {QUICK_MS} x (K, N) in {QUICK_KN}",
    "decode": f"M in {DECODE_MS} x (K, N) in {DECODE_KN}",
    "decode-models": f"M in {DECODE_MODEL_MS} x every distinct model weight "
                     f"(detgemm_cute/benchlib/models.py, TP 1/2/4/8)",
    "prefill-models": f"two M per distinct model weight, rotating over {PREFILL_MS}",
    "prefill-heldout": f"one M per distinct model weight, rotating over {HELDOUT_MS} (M the "
                       f"prefill-models suite, which tunes the table, does not have)",
}


def _grid(ms, kns, ops, label=""):
    return [Problem(op, m, k, n, label) for (k, n) in kns for m in ms for op in ops]


def model_weight_list(models=None):
    """(K, N, label) of every distinct weight of the model table."""
    return _models.distinct_weights(_models.all_weights(models or _models.MODELS))


def prefill_ms_for(index: int) -> tuple[int, int]:
    """The two M of the prefill suite for the `index`-th distinct weight."""
    n = len(PREFILL_MS)
    return PREFILL_MS[index % n], PREFILL_MS[(index + PREFILL_M_STEP) % n]


def suite_problems(name: str, ops=None) -> list[Problem]:
    """The problems of suite `name` for `ops` (default: the suite's own), deduplicated,
    weight-major (all M of one weight together), ops innermost."""
    if name not in SUITES:
        raise ValueError(f"unknown suite {name!r}; one of {', '.join(SUITES)}")
    ops = tuple(ops or DEFAULT_OPS[name])
    if name == "core":
        probs = _grid(CORE_MS, CORE_KN, ops)
    elif name == "quick":
        probs = _grid(QUICK_MS, QUICK_KN, ops)
    elif name == "decode":
        probs = _grid(DECODE_MS, DECODE_KN, ops)
    elif name == "decode-models":
        probs = [Problem(op, m, k, n, label) for (k, n, label) in model_weight_list()
                 for m in DECODE_MODEL_MS for op in ops]
    elif name == "prefill-heldout":
        probs = [Problem(op, HELDOUT_MS[(i + HELDOUT_M_OFFSET) % len(HELDOUT_MS)], k, n, label)
                 for i, (k, n, label) in enumerate(model_weight_list()) for op in ops]
    else:
        probs = [Problem(op, m, k, n, label)
                 for i, (k, n, label) in enumerate(model_weight_list())
                 for m in sorted(prefill_ms_for(i)) for op in ops]
    return dedup(probs)
