"""detgemm_cute: deterministic, batch-invariant GEMMs for PyTorch.

Every output element is one fixed chain: fp32 accumulation over K in ascending 16-wide
blocks, no split-K, bias added in fp32, one rounding at the store. Tiles are chosen per
problem size from the YAML tables in `configs/`, and do not change a single bit, so a row's
result depends only on that row of the input and on the weight.
"""

from __future__ import annotations

from . import nn
from .attention import attention
from .batched_ops import baddbmm, bmm, grouped_mm
from .functional import addmm, bias_grad, input_grad, linear, mm, weight_grad
from .gemm import force_bucket, use_family
from .mode import batch_invariant_mode, disable, enable, report, reset_report
from .split import fp32_precision

__version__ = "0.1.0"

__all__ = ["attention", "mm", "addmm", "linear", "bmm", "baddbmm", "grouped_mm", "input_grad", "weight_grad", "bias_grad", "nn",
           "batch_invariant_mode", "enable", "disable", "report", "reset_report",
           "force_bucket", "use_family", "fp32_precision", "__version__"]
