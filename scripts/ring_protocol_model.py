"""A model of the dispatch ring protocol (developer tool): can a call stall?

The model keeps what the protocol promises and nothing about timing:
  - each source rank's producer stages its chunks in order into a ring of N slots (chunk j in
    slot j mod N), skipping chunks nobody else reads, and overwrites a slot only after every
    reader of its previous content released it;
  - each receiver's consumer warps take its tasks (source tokens with rows here) in the order
    the CUDA kernel uses (csrc/kernels/dispatch_transfer.cu, consume(): virtual task v is task
    v // W of source (v + rank) % W; warp w takes v = w, w + n_warps, ...); a warp stops at a
    task whose chunk is not staged yet; a receiver releases a chunk once all its tasks there
    are done; own tokens need no staging.
Every step only ever enables more steps (staging and releases never undo), so running each
party as far as it can until nothing moves reaches the same end state as any schedule: if
that end state has work left, some schedule stalls and every schedule does.

    python scripts/ring_protocol_model.py [--calls 300] [--warps 288,16,1] [--seed 1]
"""
from __future__ import annotations

import argparse
import random
from typing import Callable, List, Sequence, Set

Routing = List[List[Set[int]]]   # routing[s][t]: the ranks holding rows of source s's token t


def random_routing(T: Sequence[int], world: int, experts_per_rank: int, topk: int,
                   rng: random.Random, case: str = "random") -> Routing:
    """Receiver ranks of every token: ``random`` (top-k with replacement) or ``skewed``."""
    E = world * experts_per_rank
    out = []
    for s, n in enumerate(T):
        toks = []
        for _ in range(n):
            if case == "skewed":
                ids = [min(E - 1, int(rng.expovariate(0.3))) for _ in range(topk)]
            else:
                ids = [rng.randrange(E) for _ in range(topk)]
            toks.append({e // experts_per_rank for e in ids})
        out.append(toks)
    return out


def kernel_order(r: int, world: int, tasks: List[List[int]], chunk: int):
    """Receiver r's virtual task list in the kernel's order; None marks an empty v."""
    most = max((len(x) for x in tasks), default=0)
    order = []
    for v in range(most * world):
        s, i = (v + r) % world, v // world
        order.append((s, tasks[s][i]) if i < len(tasks[s]) else None)
    return order


def descending_chunks(r: int, world: int, tasks: List[List[int]], chunk: int):
    """A deliberately bad order (latest chunks first): with few warps it must stall."""
    return sorted(((s, t) for s in range(world) for t in tasks[s]), key=lambda st: -(st[1] // chunk))


def finishes(T: Sequence[int], routing: Routing, chunk: int, slots: int, warps: int,
             order: Callable = kernel_order) -> bool:
    """True if the call completes under the protocol; False if it stalls."""
    W = len(T)
    J = [(n + chunk - 1) // chunk for n in T]
    tasks = [[[t for t in range(T[s]) if r in routing[s][t]] for s in range(W)] for r in range(W)]
    need = [[[sum(1 for t in tasks[r][s] if t // chunk == j) for j in range(J[s])]
             for s in range(W)] for r in range(W)]
    readers = [[{r for r in range(W) if r != s and need[r][s][j]} for j in range(J[s])] for s in range(W)]
    staged = [set() for _ in range(W)]
    released = [[set() for _ in range(J[s])] for s in range(W)]
    done = [[[0] * J[s] for s in range(W)] for _ in range(W)]
    next_chunk = [0] * W
    last_in_slot = [dict() for _ in range(W)]
    lists = [order(r, W, tasks[r], chunk) for r in range(W)]
    pos = [list(range(warps)) for _ in range(W)]
    moved = True
    while moved:
        moved = False
        for s in range(W):                                # producers
            while next_chunk[s] < J[s]:
                j = next_chunk[s]
                if readers[s][j]:
                    prev = last_in_slot[s].get(j % slots)
                    if prev is not None and not readers[s][prev] <= released[s][prev]:
                        break                             # slot still being read
                    last_in_slot[s][j % slots] = j
                    staged[s].add(j)
                next_chunk[s] += 1
                moved = True
        for r in range(W):                                # consumer warps
            for w in range(warps):
                while pos[r][w] < len(lists[r]):
                    item = lists[r][pos[r][w]]
                    if item is not None and item[0] != r:
                        s, j = item[0], item[1] // chunk
                        if j not in staged[s]:
                            break                         # waits for the chunk
                        done[r][s][j] += 1
                        if done[r][s][j] == need[r][s][j]:
                            released[s][j].add(r)
                    pos[r][w] += warps
                    moved = True
    return all(p >= len(lists[r]) for r in range(W) for p in pos[r])


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--calls", type=int, default=300)
    ap.add_argument("--warps", default="288,64,16,4,1")
    ap.add_argument("--world", type=int, default=8)
    ap.add_argument("--slots", type=int, default=3)
    ap.add_argument("--max-tokens", type=int, default=300)
    ap.add_argument("--seed", type=int, default=1)
    a = ap.parse_args()
    for warps in (int(x) for x in a.warps.split(",")):
        rng = random.Random(a.seed)
        stalls = 0
        for i in range(a.calls):
            T = [rng.randrange(a.max_tokens + 1) for _ in range(a.world)]
            routing = random_routing(T, a.world, 4, 4, rng, rng.choice(["random", "skewed"]))
            stalls += not finishes(T, routing, 64, a.slots, warps)
        print(f"{a.world} ranks, {a.slots}-slot ring, {warps} consumer warps per rank: "
              f"{stalls} of {a.calls} random calls stall", flush=True)


if __name__ == "__main__":
    main()
