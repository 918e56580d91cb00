"""What FusedMatMul can express, shared by the FusedMatMul fusions.

FusedMatMul applies, to each input, ``transBatch`` (move dim 0 to just before the last dim)
and then ``trans`` (swap the last two dims). A Transpose feeding it can be absorbed when
the Transpose followed by what the flags already do is one of those four permutations."""
from __future__ import annotations

from functools import lru_cache

from graphopt.vocabulary import MS_DOMAIN, attribute_defaults


def flags_permutation(rank: int, trans: bool, trans_batch: bool) -> list[int]:
    perm = list(range(rank))
    if rank >= 3 and trans_batch:
        perm = list(range(1, rank - 1)) + [0, rank - 1]
    if rank >= 2 and trans:
        perm[-2], perm[-1] = perm[-1], perm[-2]
    return perm


@lru_cache(maxsize=1024)
def absorb_transpose(perm: tuple[int, ...], trans: bool, trans_batch: bool):
    """Flags (trans, trans_batch) equal to Transpose(perm) then the current flags, or None."""
    rank = len(perm)
    current = flags_permutation(rank, trans, trans_batch)
    composed = [perm[i] for i in current]
    for new_batch in ((False, True) if rank >= 3 else (False,)):
        for new_trans in (False, True):
            if flags_permutation(rank, new_trans, new_batch) == composed:
                return new_trans, new_batch
    return None


@lru_cache(maxsize=1024)
def absorb_flags(perm: tuple[int, ...], trans: int, trans_batch: int):
    """absorb_transpose for flags as the attributes hold them (ints), answered as ints."""
    flags = absorb_transpose(perm, bool(trans), bool(trans_batch))
    return None if flags is None else (int(flags[0]), int(flags[1]))


MATMUL_DEFAULTS = attribute_defaults("FusedMatMul", MS_DOMAIN)  # what a plain MatMul does


def fused_attrs(node) -> dict:
    """The FusedMatMul attributes of a MatMul or FusedMatMul node, defaults filled in."""
    if node is None or node.op_type == "MatMul":
        return dict(MATMUL_DEFAULTS)
    return {name: type(default)(node.attr(name, default))  # alpha a float, the flags ints
            for name, default in MATMUL_DEFAULTS.items()}
