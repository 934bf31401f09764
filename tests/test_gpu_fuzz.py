"""The differential fuzzer on the GPU: random problems over every public op (`fuzz`),
each GPU result against the CPU reference bit for bit (NaN bits too where the reference
models them), for a short budget per kernel family. Any wrong bit or crash fails the test
with the shrunk one-line reproducer.

``DETGEMM_FUZZ_SECONDS`` (default 60, split over the families) and ``DETGEMM_FUZZ_SEED``
(default 20261126) change the budget and the case sequence; `detgemm-cute fuzz` runs longer
campaigns."""

import os

import pytest
import torch

pytestmark = pytest.mark.gpu

if not torch.cuda.is_available() or torch.cuda.get_device_capability() < (8, 0):
    pytest.skip("needs an SM80+ GPU", allow_module_level=True)

import detgemm_cute as dg  # noqa: E402
from detgemm_cute import fuzz  # noqa: E402
from gpu_helpers import FAMILIES  # noqa: E402

SECONDS = float(os.environ.get("DETGEMM_FUZZ_SECONDS", "60"))
SEED = int(os.environ.get("DETGEMM_FUZZ_SEED", "20261126"))


@pytest.mark.parametrize("family", FAMILIES)
def test_fuzz_finds_no_wrong_bits_and_no_crash(family):
    share = 2 / 3 if family == FAMILIES[0] and len(FAMILIES) > 1 else 1 / len(FAMILIES)
    with dg.use_family(family):
        # at least 10 problems, however long a cold kernel cache makes the first ones
        s = fuzz.run(SECONDS * share, SEED + FAMILIES.index(family), "cuda",
                     shrink_seconds=60, min_cases=10)
    assert s.fatal is None, s.fatal
    assert s.failed == 0, "\n".join(f["shrunk"] or f["reproducer"] for f in s.failures)
    assert s.problems >= 10
