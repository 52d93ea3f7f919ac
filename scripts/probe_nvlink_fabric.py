"""What NVML says of each visible GPU's NVLink network (GPU fabric), and what MoK makes of it.

    python scripts/probe_nvlink_fabric.py [--json FILE]

A CUDA-backend group whose ranks span hosts must be one NVLink domain
(megatron_mok/cuda/nvlink_domain.py): every GPU must report a completed fabric with the same
cluster UUID and clique id. Run this on each host of a multi-node NVLink system to see why a
group is refused; on a single-host board (HGX H200) the fabric is expected to be reported as
not supported (state 0), which only matters when a group spans hosts.
"""

from __future__ import annotations

import argparse
import json
import os
import socket
import sys

sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), ".."))

from megatron_mok.cuda.nvlink_domain import fabric_fields, fabric_of  # noqa: E402

STATES = {0: "not supported", 1: "not started", 2: "in progress", 3: "completed"}


def probe(uuids, nvml=None):
    """One row per GPU UUID: NVML's fields (``fabric_fields``) and MoK's verdict."""
    rows = []
    for i, uuid in enumerate(uuids):
        f = fabric_fields(uuid, nvml)
        rows.append({"index": i, "uuid": uuid, "nvml": f,
                     "state_name": STATES.get(f.get("state"), "-"),
                     "nvlink_network": fabric_of(uuid, nvml)})
    return rows


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--json", help="also write the rows here")
    args = ap.parse_args(argv)
    import torch

    uuids = [str(torch.cuda.get_device_properties(i).uuid) for i in range(torch.cuda.device_count())]
    rows = probe(uuids)
    print(f"host {socket.gethostname()}: {len(rows)} GPU(s)")
    for r in rows:
        print(f"  cuda:{r['index']} {r['uuid']}: fabric state {r['state_name']}, NVML {r['nvml']}, "
              f"MoK's NVLink network: {r['nvlink_network']}")
    if args.json:
        with open(args.json, "w") as f:
            json.dump({"host": socket.gethostname(), "gpus": rows}, f, indent=1)
    return 0


if __name__ == "__main__":
    sys.exit(main())
