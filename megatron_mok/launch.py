"""Run an unchanged Megatron-LM training script with the MoK dispatcher registered.

Usage::

    python -m megatron_mok.launch <script.py> <its args>
    python -m megatron_mok.launch -m <module> <its args>
    torchrun --nproc-per-node 8 -m megatron_mok.launch pretrain_gpt.py \\
        ... --moe-token-dispatcher-type mok

It sets ``sys.argv`` and ``sys.path`` exactly as ``python <script.py> <its args>`` would
(the script's folder first, so a Megatron-LM checkout next to the script is the
``megatron`` that gets imported), calls :func:`megatron_mok.megatron.install`, and runs the
script as ``__main__``. Nothing in the script changes.
"""

from __future__ import annotations

import os
import runpy
import sys

USAGE = ("usage: python -m megatron_mok.launch <script.py> [args...]\n"
         "       python -m megatron_mok.launch -m <module> [args...]\n"
         "Registers --moe-token-dispatcher-type mok (megatron_mok.megatron.install()) and runs\n"
         "the script unchanged.")


def _is_rank0() -> bool:
    return os.environ.get("RANK", os.environ.get("LOCAL_RANK", "0")) == "0"


def main(argv=None) -> None:
    argv = list(sys.argv[1:] if argv is None else argv)
    if not argv or argv[0] in ("-h", "--help"):
        print(USAGE, file=sys.stderr if not argv else sys.stdout)
        raise SystemExit(0 if argv else 2)

    if argv[0] == "-m":
        if len(argv) < 2:
            print(USAGE, file=sys.stderr)
            raise SystemExit(2)
        module, rest = argv[1], argv[2:]
        sys.argv = [module] + rest
        # python -m puts the current directory first
        sys.path[0:1] = [os.getcwd()] if sys.path else [os.getcwd()]
        target = ("module", module)
    else:
        script = argv[0]
        if not os.path.isfile(script):
            print(f"megatron_mok.launch: no such script: {script}", file=sys.stderr)
            raise SystemExit(2)
        sys.argv = argv
        # python script.py puts the script's folder first (not the current directory)
        sys.path[0:1] = [os.path.dirname(os.path.abspath(script))]
        target = ("path", script)

    # NOTE: install() imports megatron.core, so sys.path must already be the script's:
    # with a Megatron-LM checkout beside the script, that checkout's megatron is the one
    # patched and used.
    from megatron_mok.megatron import install

    version = install()
    if _is_rank0() and os.environ.get("MOK_LAUNCH_QUIET", "") in ("", "0"):
        print(f"[megatron_mok] installed the 'mok' token dispatcher into megatron-core {version}",
              file=sys.stderr, flush=True)

    if target[0] == "module":
        runpy.run_module(target[1], run_name="__main__", alter_sys=True)
    else:
        runpy.run_path(target[1], run_name="__main__")


if __name__ == "__main__":
    main()
