"""The GPU architectures the CUDA library is built for (``MOK_CUDA_ARCH``).

Torch-free on purpose: ``setup.py`` loads this file on its own (the package imports torch), and
so does ``scripts/nvcc12_build_check.py``.

``MOK_CUDA_ARCH`` is one architecture or a list (``"90a 100a"`` or ``"90a,100a"``): the
library then holds one cubin per entry and the driver runs the GPU's own. ``90a`` (H100, H200,
GH200) is the default and the only one that has run; ``100a`` (B200, GB200) compiles with
nvcc >= 12.8 (CI builds it) but has never run on a Blackwell GPU.
"""

from __future__ import annotations

import re
from typing import List, Optional

DEFAULT = "90a"
# The kernels use sm_90 features (bulk copies, programmatic dependent launch, cluster-scope
# PTX): nothing older.
MIN_MAJOR = 9
_ENTRY = re.compile(r"(\d{2,3})([af]?)")


def build_archs(value: Optional[str]) -> List[str]:
    """``MOK_CUDA_ARCH``'s value as the Makefile's list: ``"90a, 100a"`` -> ``["90a", "100a"]``
    (``None`` or blank: ``[DEFAULT]``). Raises ``ValueError`` naming the entry that is not an
    architecture nvcc takes (``sm_90a``, ``compute_90``: give ``90a``, ``90``) or is older than
    sm_90; duplicates are dropped, the order kept."""
    entries = [e for e in re.split(r"[\s,]+", value or "") if e]
    if not entries:
        return [DEFAULT]
    out: List[str] = []
    for e in entries:
        m = _ENTRY.fullmatch(e)
        if m is None:
            raise ValueError(f"MOK_CUDA_ARCH: {e!r} is not an architecture: give its number with an "
                             f"optional a/f suffix, e.g. '90a' or '90a 100a'")
        if int(m.group(1)) // 10 < MIN_MAJOR:
            raise ValueError(f"MOK_CUDA_ARCH: sm_{e} is older than sm_90, which the kernels need "
                             "(bulk copies, programmatic dependent launch)")
        if e not in out:
            out.append(e)
    return out
