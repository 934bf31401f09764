"""detgemm_cute: deterministic, batch-invariant GEMMs for PyTorch.

Every output element is one fixed chain: fp32 accumulation over K in ascending 16-wide
blocks, no split-K, bias added in fp32, one rounding at the store. Tiles are chosen per
problem size from the YAML tables in `configs/`, and do not change a single bit, so a row's
result depends only on that row of the input and on the weight.
"""

from __future__ import annotations

import importlib.util as _importlib_util
import warnings as _warnings

if _importlib_util.find_spec("numpy") is None:
    # Without numpy (it is optional here), importing torch warns "Failed to initialize
    # NumPy" (torch/csrc/utils/tensor_numpy.cpp), and every `detgemm-cute` command would
    # print it. Nothing here needs numpy: that one message is filtered, nothing else.
    _warnings.filterwarnings("ignore", message=r"Failed to initialize NumPy",
                             category=UserWarning)

from . import nn  # noqa: E402
from .attention import attention  # noqa: E402
from .batched_ops import baddbmm, bmm, grouped_mm  # noqa: E402
from .functional import addmm, bias_grad, input_grad, linear, mm, weight_grad  # noqa: E402
from .gemm import force_bucket, use_family  # noqa: E402
from .mode import batch_invariant_mode, disable, enable, report, reset_report  # noqa: E402
from .split import fp32_precision  # noqa: E402

__version__ = "0.1.0"

__all__ = ["attention", "mm", "addmm", "linear", "bmm", "baddbmm", "grouped_mm", "input_grad", "weight_grad", "bias_grad", "nn",
           "batch_invariant_mode", "enable", "disable", "report", "reset_report",
           "force_bucket", "use_family", "fp32_precision", "__version__"]
