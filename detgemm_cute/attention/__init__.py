"""Batch-invariant attention: `attention()` and the SDPA routing of `batch_invariant_mode()`.

Engines: flash-attn-4 (optional extra ``detgemm-cute[attention]``, SM90) configured for the
contract (`flash_engine`), and the math engine on detgemm's GEMMs (`math_engine`), always
available. `sdpa` maps torch's ``scaled_dot_product_attention`` semantics onto them.
"""

from .api import AttentionEngineWarning, attention, choose_engine, report, reset_report
from .spec import AttentionSpec

__all__ = ["attention", "AttentionSpec", "AttentionEngineWarning", "choose_engine", "report",
           "reset_report"]
