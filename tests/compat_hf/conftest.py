"""Every test here sees Slipstream as `deepspeed` (the compat distribution, or the temporary shim) in this process
and in the ranks it spawns, before anything imports Transformers or Accelerate (they decide at import time
whether DeepSpeed is there)."""

from __future__ import annotations

import pytest

from tests.compat_hf import hf_common as H


@pytest.fixture(autouse=True, scope="package")
def slipstream_as_deepspeed() -> None:
    if H.missing_packages("transformers", "accelerate") is None:
        H.use_slipstream_as_deepspeed()
