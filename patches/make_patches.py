"""Regenerate the Megatron-LM patches in this folder from a Megatron-LM git checkout.

    python patches/make_patches.py /path/to/Megatron-LM

For each release (git ref below) it takes ``moe_layer.py``, ``transformer_config.py`` and the
file that defines ``should_free_input``,
applies the same edits ``megatron_mok.megatron.install()`` makes at run time (the dispatcher
choice, the config checks, ``moe_shared_expert_overlap`` and the 1F1B EP overlap allowed for
``mok``, and the EP overlap's ``should_free_input`` keeping MoK's inputs), and
writes ``megatron-lm-<branch>.patch`` (``git apply`` / ``patch -p1`` from the checkout root).
An edit whose anchor text is missing fails loudly: read the new release and update it here.
"""

from __future__ import annotations

import os
import subprocess
import sys
import tempfile

RELEASES = {   # patch name -> (git ref it is made against, the file with should_free_input)
    "core_r0.16.0": ("core_v0.16.1", "megatron/core/models/gpt/fine_grained_callables.py"),
    "core_r0.17.0": ("core_v0.17.1", "megatron/core/models/gpt/fine_grained_callables.py"),
    "core_r0.18.0": ("core_v0.18.2", "megatron/core/models/gpt/fine_grained_callables.py"),
    "core_r0.19.0": ("core_r0.19.0", "megatron/core/models/common/utils.py"),
}
MOE_LAYER = "megatron/core/transformer/moe/moe_layer.py"
CONFIG = "megatron/core/transformer/transformer_config.py"

DISPATCH_ANCHOR = '''        elif config.moe_token_dispatcher_type == "flex":
            self.token_dispatcher = MoEFlexTokenDispatcher(
                self.num_local_experts,
                self.local_expert_indices,
                config=self.config,
                pg_collection=pg_collection,
            )
'''
DISPATCH_ADD = '''        elif config.moe_token_dispatcher_type == "mok":
            # MoK pull-based NVLink dispatcher (pip install megatron_mok).
            from megatron_mok.megatron.dispatcher import MokTokenDispatcher

            self.token_dispatcher = MokTokenDispatcher(
                self.num_local_experts,
                self.local_expert_indices,
                config=self.config,
                pg_collection=pg_collection,
            )
'''
SHARED_ANCHOR = "        # Initialize shared experts\n"
SHARED_ADD = '''        if config.moe_token_dispatcher_type == "mok":
            self.token_dispatcher.configure_for_experts(self.experts)

'''
LITERAL_OLD = "moe_token_dispatcher_type: Literal['allgather', 'alltoall', 'flex'] = \"allgather\""
LITERAL_NEW = ("moe_token_dispatcher_type: Literal['allgather', 'alltoall', 'flex', 'mok'] = "
               "\"allgather\"")
DOC_OLD = "Options are 'allgather','alltoall' and 'flex'."
DOC_NEW = "Options are 'allgather','alltoall', 'flex' and 'mok' (megatron_mok)."
POST_INIT_ANCHOR = '''        details.
        """
        super().__post_init__()
'''
POST_INIT_ADD = '''        if self.moe_token_dispatcher_type == "mok":
            # Unsupported MoK combinations fail here, saying what to change.
            from megatron_mok.megatron.config import check_config

            check_config(self)
'''


# Megatron allows moe_shared_expert_overlap for its own dispatchers only; MoK drives the same
# SharedExpertMLP hooks. One of these (0.16 lists alltoall, 0.19 alltoall and flex) matches.
OVERLAP_HEAD = "            if self.moe_shared_expert_overlap and self.moe_token_dispatcher_type not in [\n"
OVERLAP_EDITS = [
    (OVERLAP_HEAD + '                "alltoall"\n            ]:\n',
     OVERLAP_HEAD + '                "alltoall",\n                "mok",\n            ]:\n'),
    (OVERLAP_HEAD + '                "alltoall",\n                "flex",\n            ]:\n',
     OVERLAP_HEAD + '                "alltoall",\n                "flex",\n                "mok",\n            ]:\n'),
]


# Megatron's 1F1B EP overlap (overlap_moe_expert_parallel_comm): allowed for mok (as install()
# does by validating the config as alltoall's), and the schedule's free rule keeps the two node
# inputs MoK still needs (install()'s should_free_input wrapper, megatron_mok/megatron/_patch.py).
EP_OVERLAP_OLD = """            assert self.moe_token_dispatcher_type in [
                'alltoall',
                'flex',
            ], 'overlap_moe_expert_parallel_comm is supported with alltoall/flex token dispatcher'
"""
EP_OVERLAP_NEW = """            assert self.moe_token_dispatcher_type in [
                'alltoall',
                'flex',
                'mok',
            ], 'overlap_moe_expert_parallel_comm is supported with alltoall/flex/mok token dispatcher'
"""
FREE_INPUT_ANCHOR = "    if not is_moe:\n        return False\n"
FREE_INPUT_ADD = """    # MoK (megatron_mok): the dispatch input is a view of the pre-MLP layernorm output, which
    # the router's gate and a shared expert keep for their backward, and the experts keep the
    # dispatched rows as MoK wrote them; both stay.
    if config.moe_token_dispatcher_type == "mok" and name in ("moe_dispatch", "mlp"):
        return False
"""


def _edit_one_of(text: str, edits, path: str) -> str:
    found = [(old, new) for old, new in edits if text.count(old) == 1]
    if len(found) != 1:
        raise SystemExit(f"{path}: expected exactly one of these anchors once:\n"
                         + "\n".join(old for old, _ in edits))
    return text.replace(*found[0])


def _edit(text: str, old: str, new: str, path: str) -> str:
    if text.count(old) != 1:
        raise SystemExit(f"{path}: anchor found {text.count(old)} times, expected once:\n{old}")
    return text.replace(old, new)


def make(checkout: str, name: str, ref: str, free_input: str, out_dir: str) -> str:
    with tempfile.TemporaryDirectory() as tmp:
        for side in ("a", "b"):
            for rel in (MOE_LAYER, CONFIG, free_input):
                text = subprocess.check_output(["git", "-C", checkout, "show", f"{ref}:{rel}"],
                                               text=True)
                if side == "b" and rel == MOE_LAYER:
                    text = _edit(text, DISPATCH_ANCHOR, DISPATCH_ANCHOR + DISPATCH_ADD, rel)
                    text = _edit(text, SHARED_ANCHOR, SHARED_ADD + SHARED_ANCHOR, rel)
                if side == "b" and rel == CONFIG:
                    text = _edit(text, LITERAL_OLD, LITERAL_NEW, rel)
                    text = _edit(text, DOC_OLD, DOC_NEW, rel)
                    text = _edit(text, POST_INIT_ANCHOR, POST_INIT_ANCHOR + POST_INIT_ADD, rel)
                    text = _edit_one_of(text, OVERLAP_EDITS, rel)
                    text = _edit(text, EP_OVERLAP_OLD, EP_OVERLAP_NEW, rel)
                if side == "b" and rel == free_input:
                    text = _edit(text, FREE_INPUT_ANCHOR, FREE_INPUT_ANCHOR + FREE_INPUT_ADD, rel)
                dst = os.path.join(tmp, side, rel)
                os.makedirs(os.path.dirname(dst), exist_ok=True)
                with open(dst, "w") as f:
                    f.write(text)
        diff = subprocess.run(["git", "diff", "--no-index", "--no-prefix", "a", "b"], cwd=tmp,
                              capture_output=True, text=True).stdout
    # git diff --no-index --no-prefix names files a/<path> and b/<path>: exactly -p1 paths
    header = (f"MoK token dispatcher for Megatron-LM {name} (made against {ref}).\n"
              f"Apply from the Megatron-LM checkout root: git apply megatron-lm-{name}.patch"
              f" or patch -p1 < megatron-lm-{name}.patch; then pip install megatron_mok.\n\n")
    path = os.path.join(out_dir, f"megatron-lm-{name}.patch")
    with open(path, "w") as f:
        f.write(header + diff)
    return path


def main():
    if len(sys.argv) != 2:
        raise SystemExit(__doc__)
    out_dir = os.path.dirname(os.path.abspath(__file__))
    for name, (ref, free_input) in RELEASES.items():
        print(make(sys.argv[1], name, ref, free_input, out_dir))


if __name__ == "__main__":
    main()
