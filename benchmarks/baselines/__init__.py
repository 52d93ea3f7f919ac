"""Baseline systems the MoK dispatcher is measured against (see ../README.md).

- :mod:`.alltoall`: Megatron-Core's ``alltoall`` dispatcher in plain torch (NCCL / gloo).
- :mod:`.deepep`: DeepEP v1 intranode ``Buffer``, only when ``deep_ep`` imports.
- :mod:`.symm_a2a`: torch symmetric-memory (NVSHMEM) ``all_to_all_vdev_2d``, when present.

Each optional module raises :class:`Unavailable` with a reason instead of failing at import.
"""


class Unavailable(RuntimeError):
    """A system that cannot run here; the message is the reason recorded in the results."""
