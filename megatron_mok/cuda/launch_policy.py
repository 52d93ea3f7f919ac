"""How a CUDA Buffer launches its kernels: programmatic dependent launch and the SM budget of
small calls, decided once per Buffer from its arguments and the environment.

Kept apart from the backend so the rules are plain data, checked on any machine
(tests/test_launch_policy.py); the backend applies them (``mok_set_pdl``, the small-call roles).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Mapping, Optional

# num_sms=None: calls with at most DEFAULT_SMALL_CALL_TOKENS tokens on a rank run their transfer
# kernels on DEFAULT_SMALL_CALL_SMS SMs (latency-bound calls: more SMs finish them sooner; one
# H200, W=1, a dispatch + combine pair at 24 -> 64 SMs: 64 -> 52 us at 128 tokens, 158 -> 96 us
# at 512, 243 -> 143 us at 1024, runs s13-3/s13-4, benchmarks/NOTES.md #49); larger calls keep
# num_sms (default 24), the footprint the standard shape's targets are stated for.
DEFAULT_SMALL_CALL_SMS = 64
DEFAULT_SMALL_CALL_TOKENS = 1024


@dataclass(frozen=True)
class LaunchPolicy:
    pdl: bool               # programmatic dependent launch of every kernel (NOTES #48)
    small_call_sms: int     # SMs of calls with at most small_call_tokens tokens; 0: num_sms
    small_call_tokens: int  # -1 when small calls have no budget of their own


def env_int(environ: Mapping[str, str], name: str, default: int) -> int:
    """``environ[name]`` as an int; ``default`` when unset or empty (a malformed value raises)."""
    v = environ.get(name)
    return int(v) if v else default


def launch_policy(environ: Mapping[str, str], num_sms: Optional[int], shares_gpu: bool) -> LaunchPolicy:
    """The launch settings of a Buffer.

    Args:
        environ: the environment (``os.environ``) at the Buffer's creation.
        num_sms: the Buffer's ``num_sms`` argument (``None``: not given).
        shares_gpu: whether the Buffer's ranks share one GPU (a loopback group of 2+ ranks).

    PDL is on unless the ranks share a GPU (there a rank's early-resident blocks could take
    the SMs a peer rank's kernel needs to make progress); ``MOK_PDL=0`` turns it off,
    ``MOK_PDL=1`` forces it on. Small calls get ``DEFAULT_SMALL_CALL_SMS`` when ``num_sms``
    was not given (a number given holds for every call) and the ranks do not share a GPU
    (loopback groups fit all ranks' grids into one GPU); ``MOK_SMALL_CALL_SMS=N`` sets it
    (0: off) and ``MOK_SMALL_CALL_TOKENS`` the threshold.
    """
    pdl_env = environ.get("MOK_PDL", "")
    pdl = pdl_env[:1] == "1" or (pdl_env[:1] != "0" and not shares_gpu)
    default_small = DEFAULT_SMALL_CALL_SMS if num_sms is None and not shares_gpu else 0
    small = max(0, env_int(environ, "MOK_SMALL_CALL_SMS", default_small))
    tokens = env_int(environ, "MOK_SMALL_CALL_TOKENS", DEFAULT_SMALL_CALL_TOKENS) if small > 0 else -1
    return LaunchPolicy(pdl=pdl, small_call_sms=small, small_call_tokens=tokens)
