"""An independent pure-NumPy reference for SparDA's host KV cache: ``gvr.sparda.prefetch`` (the staging
policy and the block copies) and ``HostKVCache.append`` (the token store), written from the contract in
kernels/gvr_kernels.h, section "SparDA host KV cache: prefetch and store", literally and with Python
loops (clarity over speed).

The policy (block = one page of P tokens, all Hkv heads; (b, j) = block j of row b):
  1. needed: the blocks (b, j) named by an entry of ``indices[b]`` in [0, max_pages) whose host page
     (``block_table[b, j]``, or j without a table) lies in [0, num_pages);
  2. owner of staging slot s: the first block (b, j) in row-major order with ``resident[b, j] == s``
     (s in [0, S)) and a valid host page; later claims of s are ignored;
  3. kept: a needed block that owns its resident slot keeps it (not moved);
  4. free slots, in this order: the slots with no owner (ascending), then the slots whose owner is not
     needed (ascending); the needed blocks that are not kept take them in row-major order and are moved
     (K and V: ``dst[s] = host[page]``, byte for byte);
  5. retained: a block that is not needed but owns a slot that was not handed out keeps it in slot_map;
     every other block gets -1.
  counts = [blocks moved, blocks needed].

Everything here works on the raw bits: arrays (NumPy, or torch CPU tensors, bfloat16 included) are read
through an unsigned-integer view of their element size (``bits``), so NaN payloads and signed zeros are
copied and compared exactly.
"""
from __future__ import annotations

import numpy as np

__all__ = ["bits", "as_int_numpy", "prefetch_plan", "prefetch_reference", "store_reference"]

_UINT = {1: np.uint8, 2: np.uint16, 4: np.uint32, 8: np.uint64}


def bits(x) -> np.ndarray:
    """A NumPy unsigned-integer VIEW (no copy for NumPy / CPU torch) of ``x``'s elements' bits, same
    logical shape and strides. Torch tensors on a device are copied to the host first."""
    if isinstance(x, np.ndarray):
        return x.view(_UINT[x.itemsize])
    mod = type(x).__module__
    if mod.startswith("torch"):
        import torch

        x = x.detach()
        if x.device.type != "cpu":
            x = x.cpu()
        size = x.element_size()
        tdt = {1: torch.uint8, 2: torch.int16, 4: torch.int32, 8: torch.int64}[size]
        return x.view(tdt).numpy().view(_UINT[size])
    x = np.asarray(x)
    return x.view(_UINT[x.itemsize])


def as_int_numpy(x):
    """An int64 NumPy copy of an integer array (NumPy or torch, any device), or None."""
    if x is None:
        return None
    mod = type(x).__module__
    if mod.startswith("torch"):
        x = x.detach().cpu().numpy()
    return np.array(x, dtype=np.int64, copy=True)


def prefetch_plan(indices, num_pages: int, S: int, block_table=None, resident=None):
    """The staging policy alone -> ``(slot_map int32 [B, max_pages], counts int64 [2], moves)``;
    ``moves``: list of ``(b, j, host_page, slot)`` in the order the blocks take their slots (row-major).

    indices: int ``[B, Hsel, n]``; block_table: int ``[B, max_pages]`` or None (identity, max_pages =
    num_pages); resident: int ``[B, max_pages]`` or None."""
    ix = as_int_numpy(indices)
    assert ix.ndim == 3, ix.shape
    B, Hsel, n = ix.shape
    bt = as_int_numpy(block_table)
    if bt is None:
        max_pages = int(num_pages)
    else:
        assert bt.ndim == 2 and bt.shape[0] == B, bt.shape
        max_pages = bt.shape[1]
    res = as_int_numpy(resident)
    if res is not None:
        assert res.shape == (B, max_pages), (res.shape, (B, max_pages))

    def page(b, j):
        return j if bt is None else int(bt[b, j])

    def valid(b, j):
        return 0 <= page(b, j) < num_pages

    # 1. needed
    needed = set()
    for b in range(B):
        for h in range(Hsel):
            for i in range(n):
                j = int(ix[b, h, i])
                if 0 <= j < max_pages and valid(b, j):
                    needed.add((b, j))

    # 2. owners
    owner = {}
    if res is not None:
        for b in range(B):
            for j in range(max_pages):
                s = int(res[b, j])
                if 0 <= s < S and valid(b, j) and s not in owner:
                    owner[s] = (b, j)

    slot_map = np.full((B, max_pages), -1, dtype=np.int32)

    # 3. kept
    kept = set()
    for s, blk in owner.items():
        if blk in needed:
            kept.add(blk)
            slot_map[blk] = s

    # 4. free slots and moves
    free = [s for s in range(S) if s not in owner]
    free += [s for s in sorted(owner) if owner[s] not in needed]
    to_move = [(b, j) for b in range(B) for j in range(max_pages) if (b, j) in needed and (b, j) not in kept]
    if len(to_move) > len(free):
        raise ValueError(f"S = {S} staging pages cannot hold the {len(needed)} needed blocks")
    moves = []
    handed = set()
    for (b, j), s in zip(to_move, free):
        slot_map[b, j] = s
        handed.add(s)
        moves.append((b, j, page(b, j), s))

    # 5. retained
    for s, (b, j) in owner.items():
        if (b, j) not in needed and s not in handed:
            slot_map[b, j] = s

    counts = np.array([len(moves), len(needed)], dtype=np.int64)
    return slot_map, counts, moves


def prefetch_reference(host_k, host_v, indices, dst_k, dst_v, block_table=None, resident=None):
    """The whole prefetch: the plan, then the block copies on bit copies of dst_k / dst_v (the inputs are
    not modified) -> dict(slot_map, counts, moves, dst_k, dst_v); ``dst_k`` / ``dst_v`` are unsigned-integer
    NumPy arrays ``[S, P, Hkv, D]`` holding the bits the staging caches must hold afterwards."""
    hk, hv = bits(host_k), bits(host_v)
    dk, dv = np.array(bits(dst_k), copy=True), np.array(bits(dst_v), copy=True)
    assert hk.ndim == 4 and hk.shape == hv.shape, (hk.shape, hv.shape)
    assert dk.ndim == 4 and dk.shape == dv.shape, (dk.shape, dv.shape)
    assert hk.shape[1:] == dk.shape[1:] and hk.dtype == dk.dtype, (hk.shape, dk.shape, hk.dtype, dk.dtype)
    num_pages, S = hk.shape[0], dk.shape[0]
    slot_map, counts, moves = prefetch_plan(indices, num_pages, S, block_table, resident)
    for _b, _j, pg, s in moves:
        dk[s] = hk[pg]
        dv[s] = hv[pg]
    return dict(slot_map=slot_map, counts=counts, moves=moves, dst_k=dk, dst_v=dv)


def store_reference(dst_k, dst_v, k, v, slots, P):
    """HostKVCache.append / gvr_sparda_kv_store on bit copies -> ``(dst_k, dst_v)`` (unsigned-integer NumPy
    arrays ``[num_pages, P, Hkv, D]``): for t in order, slot = slots[t] >= 0: ``dst[slot // P, slot % P] =
    k[t]`` (likewise v); slots < 0 skipped; later tokens win. Slots >= num_pages * P raise here (the host
    intake rejects them)."""
    dk, dv = np.array(bits(dst_k), copy=True), np.array(bits(dst_v), copy=True)
    kb, vb = bits(k), bits(v)
    sl = as_int_numpy(slots)
    assert sl.ndim == 1 and kb.shape[0] == sl.shape[0] == vb.shape[0], (kb.shape, vb.shape, sl.shape)
    assert dk.shape[1] == P and kb.shape[1:] == dk.shape[2:], (kb.shape, dk.shape, P)
    num_pages = dk.shape[0]
    for t in range(sl.shape[0]):
        s = int(sl[t])
        if s < 0:
            continue
        if s >= num_pages * P:
            raise ValueError(f"slot {s} >= num_pages * P = {num_pages * P}")
        dk[s // P, s % P] = kb[t]
        dv[s // P, s % P] = vb[t]
    return dk, dv
