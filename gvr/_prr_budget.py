"""gvr.prr.Budget: how much to speculate (paper 002, section 4.4), measured on the device at hand.

PRR pays only when the speculative attention and the repair together cost less than the attention
they replace. The paper sizes the speculation by the selection window: the largest ratio rho (of the
selection's k blocks) whose speculative attention fits in the selection's latency. ``Budget.profile``
measures that window -- selection alone and speculative attention over rho * k blocks -- and, what
decides in the end, one whole decode step: serial (selection, then attention over the selection)
against ``SpeculativeAttention.step`` at each rho, on a synthetic paged cache and a query drifting
step to step. ``ratio(context_len)`` is the rho with the fastest step at the nearest profiled context
(log scale), 0 -- no speculation, the step runs serial -- where no rho beats serial: a prediction
never makes the step slower than the profile measured.

``Budget.default()`` is the table measured on the H200 (``_prr_budget_default.py``; its numbers are in
benchmarks/RESULTS.md). ``save(path)`` / ``load(path)``: JSON.
"""
from __future__ import annotations

import copy
import json
import math
import numbers
import os
import time

import numpy as np

__all__ = ["Budget"]


def paged_decode_case(torch, B, context, Hq, Hkv, D, page, steps, *, persistence, generator, device, dtype):
    """The synthetic decode workload of Budget.profile, benchmarks/bench_prr.py and
    scripts/prr_step_profile.py: K and V [B * context / page, page, Hkv, D] N(0, 1) in ``dtype``, each
    row's pages in shuffled order (``block_table`` int32 [B, context / page]), ``lengths`` = context,
    Quest metadata over blocks of ``page`` tokens, and ``steps`` queries [B, Hq, D] drifting as an AR(1)
    of correlation ``persistence``. -> SimpleNamespace(K, V, block_table, lengths, meta, queries)."""
    from types import SimpleNamespace
    from ._prr_select import block_metadata
    g, dev = generator, device
    pages = B * context // page
    K = torch.randn(pages, page, Hkv, D, generator=g, device=dev, dtype=dtype)
    V = torch.randn(pages, page, Hkv, D, generator=g, device=dev, dtype=dtype)
    bt = torch.randperm(pages, generator=g, device=dev).to(torch.int32).view(B, context // page)
    lengths = torch.full((B,), context, dtype=torch.int32, device=dev)
    qf = torch.randn(B, Hq, D, generator=g, device=dev)
    qs = []
    for _ in range(steps):
        qf = persistence * qf + math.sqrt(max(0.0, 1 - persistence ** 2)) * torch.randn(B, Hq, D, generator=g,
                                                                                         device=dev)
        qs.append(qf.to(dtype))
    return SimpleNamespace(K=K, V=V, block_table=bt, lengths=lengths, queries=qs,
                           meta=block_metadata(K, bt, lengths, block_size=page))


def _check_writable(path) -> None:
    """Raise ValueError naming 'path' when ``path`` cannot be opened for writing (a directory, a missing folder,
    no permission). An existing file is left as it is; a file this creates is removed again."""
    if not isinstance(path, (str, bytes, os.PathLike)):
        raise TypeError(f"'path' must be a str or os.PathLike, got {type(path).__name__}")
    existed = os.path.lexists(path)
    try:
        with open(path, "a"):  # append mode: an existing file is not truncated
            pass
    except OSError as e:
        raise ValueError(f"'path' {os.fsdecode(path)!r} cannot be written: {e.strerror or e}") from e
    if not existed:
        os.remove(path)


class Budget:
    """A speculation-budget table: per profiled context, the step times measured and the chosen rho.

    ``table`` (what ``profile`` builds and ``save`` writes): ``{"device": str, "setup": dict, "ratios":
    [rho...], "contexts": {str(context): {"select_us", "serial_us", "spec_us": {str(rho): us},
    "prr_us": {str(rho): us}, "hit_rate": {str(rho): rate}, "best": rho}}}``.
    """

    def __init__(self, table: dict):
        if not isinstance(table, dict) or not isinstance(table.get("contexts"), dict) or not table["contexts"]:
            raise ValueError("'table' must be a dict with a non-empty 'contexts' mapping (from Budget.profile or "
                             "Budget.load)")
        ctx = {}
        for key, row in table["contexts"].items():
            try:
                if isinstance(key, (bool, float)):  # JSON keys are strings; an int key is fine, 1024.5 is not
                    raise TypeError
                c = int(key)
                best = row["best"]
                if isinstance(best, bool) or not isinstance(best, numbers.Real):
                    raise TypeError
                best = float(best)  # OverflowError for an int beyond float's range
            except (TypeError, ValueError, KeyError, OverflowError) as e:
                raise ValueError(f"'table': context {key!r} needs an int key and a 'best' ratio (a number)") from e
            if c < 1 or not (math.isfinite(best) and best >= 0):
                raise ValueError(f"'table': context {key!r} must be >= 1 with a finite 'best' ratio >= 0")
            if c in ctx:  # "1024" and "01024" would silently collapse
                raise ValueError(f"'table': context {key!r} repeats context {c}")
            ctx[c] = best
        self.table = copy.deepcopy(table)  # the caller's dict may change later; ratio() and save() must agree
        self._best = dict(sorted(ctx.items()))

    # -- use ----------------------------------------------------------------------------------------
    def ratio(self, context_len) -> float:
        """The speculation budget rho for rows of ``context_len`` tokens: the best rho of the profiled
        context nearest on a log scale (ties to the smaller context); 0 means no speculation."""
        if isinstance(context_len, bool) or not isinstance(context_len, (int, np.integer)):
            raise TypeError(f"'context_len' must be an int, got {type(context_len).__name__}")
        if context_len < 1:
            raise ValueError(f"'context_len' must be >= 1, got {context_len}")
        lc = math.log2(int(context_len))
        best = min(self._best, key=lambda c: (abs(math.log2(c) - lc), c))
        return self._best[best]

    @property
    def contexts(self):
        return list(self._best)

    def __repr__(self):
        pts = ", ".join(f"{c}: {r:g}" for c, r in self._best.items())
        return f"Budget(device={self.table.get('device')!r}, ratio by context {{{pts}}})"

    # -- persistence --------------------------------------------------------------------------------
    def save(self, path) -> None:
        text = json.dumps(self.table, indent=1, sort_keys=True) + "\n"  # fails before the file is touched
        with open(path, "w") as f:
            f.write(text)

    @classmethod
    def load(cls, path) -> "Budget":
        with open(path) as f:
            return cls(json.load(f))

    @classmethod
    def default(cls) -> "Budget":
        """The shipped table (measured on the H200, see benchmarks/RESULTS.md and _prr_budget_default.py)."""
        from ._prr_budget_default import TABLE
        return cls(TABLE)

    # -- measurement --------------------------------------------------------------------------------
    @classmethod
    def profile(cls, *, contexts=(32768, 131072, 524288), ratios=(0.25, 0.5, 1.0), batch=1, Hq=32, Hkv=8, D=128,
                block_size=64, k=64, predictor="ema", mode="superset", persistence=0.95, steps=8, replays=5,
                device="cuda", seed=0, path=None) -> "Budget":
        """Measure on ``device`` ("cuda", a CUDA device, or "cpu") and return the table (saved to
        ``path`` when given). Per context: a bfloat16 (CUDA) / float32 (CPU) paged cache of ``batch``
        rows, N(0, 1), pages of ``block_size`` tokens in shuffled order; Quest metadata; ``steps``
        queries drifting as an AR(1) of correlation ``persistence``. Timed: the selection
        (``select_blocks``) alone, the speculative attention over round(rho * k) blocks alone, the
        serial step, and ``SpeculativeAttention.step`` (``predictor``, ``mode``) at each rho. CUDA: one
        graph of ``steps`` steps replayed ``replays`` times; CPU: ``replays`` eager runs of the steps
        (gvr._harness); per step = the median run / steps.

        ``contexts``: multiples of ``block_size``, each >= ``block_size * k``; ``persistence`` in [0, 1];
        ``seed``: any int (its low 64 bits seed torch). Every argument, and that ``path`` can be opened for
        writing, is checked before anything is measured (the check leaves no file behind)."""
        from . import attention as _att
        from ._prr_runtime import SpeculativeAttention, quest_select
        from ._prr_select import select_blocks
        # every argument is checked before anything is measured
        ratios = sorted({float(r) for r in ratios})
        if not ratios or any(not (math.isfinite(r) and r > 0) for r in ratios):
            raise ValueError(f"'ratios' must be floats > 0, got {ratios!r}")
        ints = dict(batch=batch, Hq=Hq, Hkv=Hkv, D=D, block_size=block_size, k=k, steps=steps, replays=replays)
        for name, v in ints.items():
            if isinstance(v, bool) or not isinstance(v, numbers.Integral):  # NumPy integers too
                raise TypeError(f"'{name}' must be an int, got {type(v).__name__}")
            if v < 1:
                raise ValueError(f"'{name}' must be an int >= 1, got {v!r}")
        batch, Hq, Hkv, D, block_size, k, steps, replays = (int(v) for v in ints.values())
        if Hq % Hkv:
            raise ValueError(f"'Hq' must be a multiple of 'Hkv', got Hq={Hq}, Hkv={Hkv}")
        try:
            cs = tuple(contexts)
        except TypeError:
            cs = None
        if cs is None or any(isinstance(c, bool) or not isinstance(c, numbers.Integral) for c in cs):
            raise TypeError(f"'contexts' must be a sequence of ints, got {contexts!r}")
        contexts = sorted({int(c) for c in cs})
        if not contexts or contexts[0] < block_size * k:
            raise ValueError(f"'contexts' must be ints >= block_size * k = {block_size * k}, got {contexts!r}")
        if any(c % block_size for c in contexts):  # the paged cache holds whole blocks
            raise ValueError(f"'contexts' must be multiples of 'block_size' = {block_size}, got {contexts!r}")
        for name, v, ok in (("predictor", predictor, ("ema", "last")), ("mode", mode, ("exact", "superset"))):
            if not isinstance(v, str):
                raise TypeError(f"'{name}' must be {ok[0]!r} or {ok[1]!r}, got {type(v).__name__}")
            if v not in ok:
                raise ValueError(f"'{name}' must be {ok[0]!r} or {ok[1]!r}, got {v!r}")
        if isinstance(persistence, bool) or not isinstance(persistence, numbers.Real):
            raise TypeError(f"'persistence' must be a float, got {type(persistence).__name__}")
        persistence = float(persistence)
        if not 0.0 <= persistence <= 1.0:  # also rejects NaN
            raise ValueError(f"'persistence' must lie in [0, 1], got {persistence}")
        if isinstance(seed, bool) or not isinstance(seed, numbers.Integral):
            raise TypeError(f"'seed' must be an int, got {type(seed).__name__}")
        seed = int(seed)
        if path is not None:
            _check_writable(path)
        cpu = str(device) == "cpu"
        import torch
        dev = torch.device("cpu") if cpu else torch.device(device)
        if not cpu and dev.index is None:
            dev = torch.device("cuda", torch.cuda.current_device())
        dt = torch.float32 if cpu else torch.bfloat16
        gen = torch.Generator(device=dev)
        gen.manual_seed(seed & 0xFFFFFFFFFFFFFFFF)  # any int, as gvr.data's seeds (torch takes 64 bits)
        G = block_size

        from . import _harness as H

        def timed(fn):
            """seconds per step: median over runs of the ``steps`` steps (fn(0) .. fn(steps - 1)) / steps"""
            def run():
                for i in range(steps):
                    fn(i)
            if cpu:
                return H.time_cpu(run, budget_s=0.0, min_runs=replays, max_runs=replays)["median_us"] * 1e-6 / steps
            with torch.cuda.device(dev):  # a graph of the steps (captured after eager warm-up calls), replayed
                return H.CudaTimer(torch, flush_bytes=0).graph(run, calls=1, replays=replays)["median_us"] * 1e-6 / steps

        rows = {}
        B = batch
        for ctx in contexts:
            c = paged_decode_case(torch, B, ctx, Hq, Hkv, D, G, steps, persistence=persistence, generator=gen,
                                  device=dev, dtype=dt)
            K, V, bt, lengths, meta, qs = c.K, c.V, c.block_table, c.lengths, c.meta, c.queries
            q = torch.empty(B, Hq, D, dtype=dt, device=dev)
            sel = torch.full((B, Hkv, k), -1, dtype=torch.int32, device=dev)
            out = torch.empty(B, Hq, D, dtype=dt, device=dev)
            akw = dict(block_table=bt, lengths=lengths, block_size=G)

            def select_only(qq):
                return select_blocks(qq, meta, k, lengths, block_size=G, out=sel)

            def sel_step(i):
                q.copy_(qs[i])
                select_only(q)

            def serial_step(i):
                q.copy_(qs[i])
                select_only(q)
                _att.sparse_attention(q, K, V, sel, out=out, **akw)

            row = {"select_us": timed(sel_step) * 1e6, "serial_us": timed(serial_step) * 1e6, "spec_us": {},
                   "prr_us": {}, "hit_rate": {}}
            for rho in ratios:
                n = min(int(math.floor(rho * k + 0.5)), ctx // G)
                pred = torch.randperm(ctx // G, generator=gen, device=dev)[:n].to(torch.int32)
                pred = pred.view(1, 1, n).expand(B, Hkv, n).contiguous()

                def spec_step(i, pred=pred):
                    _att.sparse_attention(q, K, V, pred, out=out, **akw)
                row["spec_us"][str(rho)] = timed(spec_step) * 1e6
                sa = SpeculativeAttention(B, Hq, Hkv, D, ctx // G, block_size=G, k=k, budget=rho, mode=mode,
                                          predictor=predictor, device=str(dev), dtype=str(dt).replace("torch.", ""))
                fn = quest_select(meta, k, lengths, block_size=G) if predictor == "ema" else select_only

                def prr_step(i, sa=sa, fn=fn):
                    q.copy_(qs[i])
                    sa.step(q, K, V, bt, lengths, fn, out=out)
                sa.reset_hit_rates()
                row["prr_us"][str(rho)] = timed(prr_step) * 1e6
                row["hit_rate"][str(rho)] = sa.mean_hit_rate
                del sa
            best, best_us = 0.0, row["serial_us"]
            for rho in ratios:
                if row["prr_us"][str(rho)] < best_us:
                    best, best_us = rho, row["prr_us"][str(rho)]
            row["best"] = best
            rows[str(ctx)] = row
            del K, V, meta, c
            if not cpu:
                torch.cuda.empty_cache()
        name = "cpu" if cpu else torch.cuda.get_device_name(dev)
        table = {"device": name, "ratios": ratios, "contexts": rows,
                 "setup": {"batch": batch, "Hq": Hq, "Hkv": Hkv, "D": D, "block_size": block_size, "k": k,
                           "predictor": predictor, "mode": mode, "persistence": persistence, "steps": steps,
                           "replays": replays, "dtype": str(dt).replace("torch.", ""), "seed": seed,
                           "measured": time.strftime("%Y-%m-%d %H:%M:%S UTC", time.gmtime())}}
        b = cls(table)
        if path is not None:
            b.save(path)
        return b
