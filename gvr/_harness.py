"""The one timing harness of gvr: benchmarks/bench_*.py, scripts/ and the demo (python -m gvr) time
through it.

    summarize(samples_s)                 median, p10, p90, min (µs) of per-call times in seconds
    time_cpu(fn, budget_s=..)            warm-up, then time.perf_counter around each call
    time_cpu_rotating(calls, touches)    distinct inputs rotated call by call: fresh / repeat / cold
    cpu_copy_bandwidth()                 host memory copy bandwidth (read + write bytes)
    CudaTimer(torch)                     on the current CUDA device:
      .graph(fn, calls=10, replays=..)   warm L2: a CUDA graph of `calls` back-to-back calls captured
                                         on a side stream, replayed; per call = replay time / calls
      .events(fn, reps, cold=True)       eager calls between CUDA events, a GPU sleep queued ahead
                                         (no launch gap inside the span); cold: a buffer larger than
                                         L2 written before each call
      .copy_bandwidth()                  device-to-device copy bandwidth (read + write bytes), once
    cuda_graph_us(torch, fn)             median µs per call of a graph of 20 calls (quick tables)
    gbps(nbytes, us), floor_us(nbytes, bandwidth)
    header(torch=None, root=None)        device (name, SMs, L2), driver, torch, numpy, commit,
                                         source digest, date
    evaluate_bars(bars, cells, value)    acceptance bars from a data file (benchmarks/bars.json)
    write_json(path, obj), format_table(headers, rows), markdown_table(headers, rows)

Self-contained (NumPy and the standard library; torch only when passed in): scripts load it by file
path from a checkout (benchmarks/_harness.py does) so that they can time an older installed gvr too.
"""
from __future__ import annotations

import contextlib
import datetime
import gc
import hashlib
import json
import math
import os
import platform
import statistics
import time

import numpy as np

US = 1e6

# --------------------------------------------------------------------------------------------------
# statistics
# --------------------------------------------------------------------------------------------------


def summarize(samples_s) -> dict:
    """Per-call times in seconds -> {median_us, p10_us, p90_us, min_us, runs}."""
    a = np.asarray(samples_s, dtype=np.float64) * US
    if a.size == 0:
        return {"median_us": None, "p10_us": None, "p90_us": None, "min_us": None, "runs": 0}
    return {"median_us": float(np.median(a)), "p10_us": float(np.percentile(a, 10)),
            "p90_us": float(np.percentile(a, 90)), "min_us": float(a.min()), "runs": int(a.size)}


def ratio(a, b):
    """a / b, None when either is missing."""
    return None if a is None or b is None or b <= 0 else a / b


def gbps(nbytes, us):
    """GB/s (1e9 bytes per second) of moving ``nbytes`` in ``us`` microseconds."""
    if nbytes is None or not us:
        return None
    return nbytes / (us * 1e-6) / 1e9


def floor_us(nbytes, bandwidth):
    """The memory floor: µs to move ``nbytes`` at ``bandwidth`` bytes/s (CudaTimer.copy_bandwidth)."""
    if nbytes is None or not bandwidth:
        return None
    return nbytes / bandwidth * US


# --------------------------------------------------------------------------------------------------
# CPU timing
# --------------------------------------------------------------------------------------------------


@contextlib.contextmanager
def _no_gc():
    """The garbage collector off for a timed loop (a collection inside it is not the call's time)."""
    was = gc.isenabled()
    gc.disable()
    try:
        yield
    finally:
        if was:
            gc.enable()


def time_cpu(fn, *, budget_s=0.1, min_runs=10, max_runs=10000, warmup=2) -> dict:
    """time.perf_counter around each call of ``fn`` (after ``warmup`` calls), as many calls as fit
    in ``budget_s`` within [min_runs, max_runs]; the garbage collector is off while timing."""
    for _ in range(warmup):
        fn()
    t0 = time.perf_counter()
    fn()
    est = max(time.perf_counter() - t0, 1e-7)
    runs = int(min(max_runs, max(min_runs, budget_s / est)))
    pc = time.perf_counter
    samples = np.empty(runs)
    with _no_gc():
        for i in range(runs):
            t = pc()
            fn()
            samples[i] = pc() - t
    return summarize(samples)


def time_cpu_rotating(calls, touches, *, budget_s=0.1, min_runs=30, max_runs=2000) -> dict:
    """Per-call timings of zero-argument callables, one per distinct input, in three settings.
    Returns the "fresh" statistics with the other two under "repeat" and "cold":
      fresh:  inputs rotated call by call, each input's data touched (untimed, ``touches[i]()``)
              just before its call: in cache, as right after its producer wrote it, but new to the
              call (a decode loop's situation; the primary number);
      repeat: each input called back to back: caches and branch predictors trained on it;
      cold:   inputs rotated without the touch."""
    for c in calls:
        c()
    t0 = time.perf_counter()
    for c in calls:
        c()
    est = max((time.perf_counter() - t0) / len(calls), 1e-7)
    runs = int(min(max_runs, max(min_runs, budget_s / est)))
    per_input = max(1, math.ceil(runs / len(calls)))
    L = len(calls)
    pc = time.perf_counter
    with _no_gc():
        fresh = np.empty(runs)
        for i in range(runs):
            c = calls[i % L]
            touches[i % L]()
            t = pc()
            c()
            fresh[i] = pc() - t
        rep = []
        for c in calls:
            c()
            c()
            for _ in range(per_input):
                t = pc()
                c()
                rep.append(pc() - t)
        cold = np.empty(runs)
        for i in range(runs):
            c = calls[i % L]
            t = pc()
            c()
            cold[i] = pc() - t
    out = summarize(fresh)
    out["repeat"] = summarize(rep)
    out["cold"] = summarize(cold)
    return out


def cpu_copy_bandwidth(nbytes=256 << 20, reps=5) -> float:
    """Host memory copy bandwidth in bytes/s (np.copyto of ``nbytes``, read + write counted)."""
    src = np.ones(nbytes // 4, np.float32)
    dst = np.empty_like(src)
    np.copyto(dst, src)
    t = time_cpu(lambda: np.copyto(dst, src), budget_s=0, min_runs=reps, max_runs=reps, warmup=1)
    return 2 * nbytes / (t["median_us"] * 1e-6)


# --------------------------------------------------------------------------------------------------
# CUDA timing
# --------------------------------------------------------------------------------------------------


class GraphCaptureError(RuntimeError):
    pass


class CudaTimer:
    """CUDA timing on torch's current device and stream."""

    SLEEP_CYCLES = 100_000  # ~50 µs of GPU work queued ahead of a timed span: no launch gap in it

    def __init__(self, torch, flush_bytes=None):
        self.torch = torch
        self.device = torch.device("cuda", torch.cuda.current_device())
        props = torch.cuda.get_device_properties(self.device)
        self.l2_bytes = int(getattr(props, "L2_cache_size", 0) or 0)
        if flush_bytes is None:  # larger than L2 whatever the chip (128 MB at least)
            flush_bytes = max(128 << 20, 2 * self.l2_bytes)
        self.flush_bytes = int(flush_bytes)
        self._flush = None
        self._bandwidth = None
        self.has_sleep = hasattr(torch.cuda, "_sleep")

    def _sleep(self):
        if self.has_sleep:
            self.torch.cuda._sleep(self.SLEEP_CYCLES)

    def flush_l2(self):
        """Write a buffer larger than L2 (queued on the current stream)."""
        if self._flush is None:
            self._flush = self.torch.empty(self.flush_bytes // 4, dtype=self.torch.float32, device=self.device)
        self._flush.zero_()

    def _event_pairs(self, n):
        E = self.torch.cuda.Event
        return [E(enable_timing=True) for _ in range(n)], [E(enable_timing=True) for _ in range(n)]

    def events(self, fn, reps=50, *, cold=False, warmup=2) -> dict:
        """Eager calls between CUDA events; cold: L2 flushed before each call."""
        return self.events_interleaved([fn], reps, cold=cold, warmup=warmup)[0]

    def events_interleaved(self, fns, reps=50, *, cold=False, warmup=2, seed=0) -> list:
        """``events`` for several callables, taken in turns (rep 1 of each, then rep 2, ...; each turn in
        a new random order, seeded, and no synchronization until the end), so that a drift of the GPU's
        clocks or of the host's load over the run, and whatever a call leaves to the one after it, reach
        every callable alike. (Timed one method after another, or in turns that each began with it,
        cold gvr+prev -- under method "auto" the same kernel as gvr -- measured 1.0-3.4x gvr on the H100,
        2026-11-25; in turns of a fixed order with a rotating start 0.99-1.42x on an H200.) One summary
        per callable, in order."""
        torch = self.torch
        n = len(fns)
        for fn in fns:
            for _ in range(warmup):
                fn()
        torch.cuda.synchronize()
        st, en = self._event_pairs(reps * n)
        rng = np.random.default_rng(seed)
        for r in range(reps):
            for j in rng.permutation(n):
                i = r * n + int(j)
                self._sleep()
                if cold:
                    self.flush_l2()
                st[i].record()
                fns[j]()
                en[i].record()
        torch.cuda.synchronize()
        return [summarize([st[r * n + j].elapsed_time(en[r * n + j]) * 1e-3 for r in range(reps)]) for j in range(n)]

    def capture(self, fn, calls=10, warmup=3):
        """A CUDA graph of ``calls`` back-to-back calls of ``fn``, captured on a side stream (after
        ``warmup`` eager calls there). Raises GraphCaptureError."""
        torch = self.torch
        try:
            side = torch.cuda.Stream(self.device)
            side.wait_stream(torch.cuda.current_stream(self.device))
            g = torch.cuda.CUDAGraph()
            with torch.cuda.stream(side):
                for _ in range(warmup):
                    fn()
                with torch.cuda.graph(g, stream=side):
                    for _ in range(calls):
                        fn()
            torch.cuda.current_stream(self.device).wait_stream(side)
            torch.cuda.synchronize()
            return g
        except Exception as e:
            try:
                torch.cuda.synchronize()
            except Exception:
                pass
            raise GraphCaptureError(f"{type(e).__name__}: {e}") from e

    def replay(self, g, calls, replays=20) -> dict:
        """Per-call times of ``replays`` replays of a graph of ``calls`` calls."""
        torch = self.torch
        g.replay()  # warm
        torch.cuda.synchronize()
        st, en = self._event_pairs(replays)
        for i in range(replays):
            self._sleep()
            st[i].record()
            g.replay()
            en[i].record()
        torch.cuda.synchronize()
        return summarize([s.elapsed_time(e) * 1e-3 / calls for s, e in zip(st, en)])

    def graph(self, fn, calls=10, replays=20) -> dict:
        """Warm-L2 time per call: a graph of ``calls`` back-to-back calls, replayed."""
        g = self.capture(fn, calls)
        try:
            return self.replay(g, calls, replays)
        finally:
            del g

    def copy_bandwidth(self, nbytes=None, reps=10) -> float:
        """Device-to-device copy bandwidth in bytes/s, read + write bytes counted, measured once per
        timer on buffers of 4x L2 (256 MB at least): the memory floor's denominator."""
        if self._bandwidth is None:
            torch = self.torch
            nbytes = int(nbytes or max(256 << 20, 4 * self.l2_bytes))
            src = torch.empty(nbytes // 4, dtype=torch.float32, device=self.device).fill_(1.0)
            dst = torch.empty_like(src)
            t = self.events(lambda: dst.copy_(src), reps)
            self._bandwidth = 2 * nbytes / (t["median_us"] * 1e-6)
            del src, dst
        return self._bandwidth


def cuda_graph_us(torch, fn, calls=20, replays=5) -> float:
    """Median µs per call of ``fn`` in a CUDA graph of ``calls`` back-to-back calls (warm L2): the
    quick tables' and the demo's number."""
    return CudaTimer(torch, flush_bytes=0).graph(fn, calls, replays)["median_us"]


# --------------------------------------------------------------------------------------------------
# the header: what was measured, where, when
# --------------------------------------------------------------------------------------------------


def utc_now() -> str:
    return datetime.datetime.now(datetime.timezone.utc).strftime("%Y-%m-%d %H:%M:%S UTC")


def cpu_name() -> str:
    try:
        with open("/proc/cpuinfo") as f:
            for line in f:
                if line.lower().startswith(("model name", "hardware", "cpu model")):
                    return line.split(":", 1)[1].strip()
    except OSError:
        pass
    return platform.processor() or platform.machine() or "unknown CPU"


def source_digest(root) -> str | None:
    """sha256 (12 hex digits) of the sources that decide the measured code: kernels/ and csrc/ (all
    levels) and gvr/*.py. Unlike the commit (.git may be stale in a copied tree), it describes the
    files that were built."""
    if root is None:
        return None
    h = hashlib.sha256()
    found = False
    for sub, exts, deep in (("kernels", (".cu", ".cuh", ".h"), True), ("csrc", (".c", ".h"), True),
                            ("gvr", (".py",), False)):
        top = os.path.join(root, sub)
        for d, dirs, files in sorted(os.walk(top)):
            dirs.sort()
            if not deep:
                dirs.clear()
            for name in sorted(files):
                if name.endswith(exts):
                    found = True
                    p = os.path.join(d, name)
                    h.update(os.path.relpath(p, root).encode() + b"\0")
                    with open(p, "rb") as f:
                        h.update(f.read())
    return h.hexdigest()[:12] if found else None


def git_commit(root) -> str | None:
    """The checked-out commit, read from .git directly (no git process); None if unknown."""
    if root is None:
        return None
    try:
        gitdir = os.path.join(root, ".git")
        if os.path.isfile(gitdir):  # worktree: "gitdir: <path>"
            with open(gitdir) as f:
                line = f.read().strip()
            if not line.startswith("gitdir:"):
                return None
            gitdir = os.path.normpath(os.path.join(root, line.split(":", 1)[1].strip()))
        with open(os.path.join(gitdir, "HEAD")) as f:
            head = f.read().strip()
        if not head.startswith("ref:"):
            return head
        ref = head.split(":", 1)[1].strip()
        dirs = [gitdir]
        common = os.path.join(gitdir, "commondir")
        if os.path.exists(common):
            with open(common) as f:
                dirs.append(os.path.normpath(os.path.join(gitdir, f.read().strip())))
        for d in dirs:
            p = os.path.join(d, ref)
            if os.path.exists(p):
                with open(p) as f:
                    return f.read().strip()
            p = os.path.join(d, "packed-refs")
            if os.path.exists(p):
                with open(p) as f:
                    for line in f:
                        parts = line.split()
                        if len(parts) == 2 and parts[1] == ref:
                            return parts[0]
    except OSError:
        pass
    return None


def header(torch=None, root=None, *, cuda=False) -> dict:
    """Device, software and source identity of a run. ``cuda``: describe torch's current CUDA
    device (name, SMs, L2, memory, driver); ``root``: a checkout, for the commit and source digest."""
    h = {"date": utc_now(), "python": platform.python_version(), "platform": platform.platform(),
         "numpy": np.__version__, "host_cpu": cpu_name(), "cpu_count": os.cpu_count(),
         "torch": getattr(torch, "__version__", None),
         "commit": git_commit(root), "source_digest": source_digest(root)}
    try:
        import gvr

        h["gvr_version"] = getattr(gvr, "__version__", None)
        h["gvr_file"] = gvr.__file__
    except Exception:  # the harness also runs where gvr does not import
        pass
    if cuda and torch is not None:
        dev = torch.cuda.current_device()
        p = torch.cuda.get_device_properties(dev)
        h["device_name"] = torch.cuda.get_device_name(dev)
        h["device_props"] = {"sms": p.multi_processor_count, "l2_bytes": getattr(p, "L2_cache_size", None),
                             "memory_bytes": p.total_memory, "capability": f"{p.major}.{p.minor}"}
        h["cuda_runtime"] = getattr(torch.version, "cuda", None)
        h["driver"] = _driver_version()
    else:
        h["device_name"] = h["host_cpu"]
    return h


def _driver_version():
    try:
        import subprocess

        r = subprocess.run(["nvidia-smi", "--query-gpu=driver_version", "--format=csv,noheader"],
                           capture_output=True, text=True, timeout=10)
        return r.stdout.strip().splitlines()[0] if r.returncode == 0 and r.stdout.strip() else None
    except Exception:
        return None


def header_line(h) -> str:
    dev = h.get("device_name")
    if "device_props" in h:
        p = h["device_props"]
        dev = f"{dev} ({p['sms']} SMs, L2 {p['l2_bytes'] / 2**20:.0f} MB, driver {h.get('driver')})"
    else:
        dev = f"{dev} ({h.get('cpu_count')} logical CPUs)"
    return (f"# {dev}\n# {h['date']}  commit {h.get('commit')}  sources {h.get('source_digest')}  "
            f"gvr {h.get('gvr_version')}  numpy {h['numpy']}  torch {h.get('torch')}")


# --------------------------------------------------------------------------------------------------
# acceptance bars (data, not code)
# --------------------------------------------------------------------------------------------------
_OPS = {">=": lambda a, b: a >= b, "<=": lambda a, b: a <= b, ">": lambda a, b: a > b, "<": lambda a, b: a < b}


def _matches(cell, where):
    for key, want in where.items():
        if key == "n_min":
            if cell.get("n", -1) < want:
                return False
        elif cell.get(key) != want:
            return False
    return True


def evaluate_bars(bars, cells, value):
    """Evaluate acceptance bars (a list of dicts, e.g. from benchmarks/bars.json) on result cells.

    value(cell, method, mode) -> median µs or None. Each bar has a ``name``, a ``text`` and ``where``
    (fields every cell it applies to matches; ``n_min``: cells with n >= it) and one ``kind``:
      time:      value(cell, method, mode) ``op`` limit, in the first matching cell;
      ratio:     value(num) / value(den) ``op`` limit, in the first matching cell;
      ratio_all: the same in every matching cell; the reported value is the count of failures
                 (the worst ratio under "worst");
      correct:   every matching cell has ``correct`` all true and no ``error``/``errors``.
    A bar whose cells are missing is n/a (ok None). Returns a list of {name, ok, value, line}."""
    out = []
    for bar in bars:
        kind, where = bar["kind"], bar.get("where", {})
        op, limit, mode = bar.get("op"), bar.get("limit"), bar.get("mode")
        matching = [c for c in cells if _matches(c, where) and not (c.get("error") and not c.get("methods"))]
        ok, shown, detail = None, None, ""
        if kind == "time":
            v = value(matching[0], bar["method"], mode) if matching else None
            if v is not None:
                ok, shown, detail = _OPS[op](v, limit), v, f"{v:.2f} us"
        elif kind in ("ratio", "ratio_all"):
            ratios, bad = [], []
            for c in matching if kind == "ratio_all" else matching[:1]:
                a, b = value(c, bar["num"], mode), value(c, bar["den"], mode)
                if a is None or b is None or b <= 0:
                    continue
                r = a / b
                ratios.append((c, r))
                if not _OPS[op](r, limit):
                    bad.append(f"{c.get('workload')}/{c.get('n')}/B{c.get('b')} {r:.3f}")
            if ratios:
                ok = not bad
                if kind == "ratio":
                    shown, detail = ratios[0][1], f"{ratios[0][1]:.2f}x"
                else:
                    worst = (max if op in ("<=", "<") else min)(r for _, r in ratios)
                    shown = len(bad)
                    each = ", ".join(f"{c.get('n')}/B{c.get('b')}: {r:.2f}x" for c, r in ratios) if len(ratios) <= 8 else ""
                    detail = (f"{each}; " if each else "") + f"{len(bad)} of {len(ratios)} cells fail (worst {worst:.3f})" + (
                        ": " + "; ".join(bad[:8]) + (" ..." if len(bad) > 8 else "") if bad else "")
        elif kind == "correct":
            if matching:
                bad = [f"{c.get('workload')}/{c.get('n')}/B{c.get('b')}" for c in matching
                       if c.get("error") or c.get("errors") or not all((c.get("correct") or {"": False}).values())]
                ok, shown = not bad, len(bad)
                detail = f"{len(matching) - len(bad)} of {len(matching)} cells" + (f"; failing: {', '.join(bad[:8])}" if bad else "")
        else:
            raise ValueError(f"bar {bar['name']!r}: unknown kind {kind!r}")
        tag = "n/a " if ok is None else ("PASS" if ok else "FAIL")
        bound = f" (bar: {op} {limit:g})" if op is not None else ""
        line = f"{tag}  {bar['text']}: {detail or 'no data'}{bound}"
        out.append({"name": bar["name"], "ok": ok, "value": shown, "line": line})
    return out


# --------------------------------------------------------------------------------------------------
# output
# --------------------------------------------------------------------------------------------------


def write_json(path, obj):
    d = os.path.dirname(os.path.abspath(path))
    os.makedirs(d, exist_ok=True)
    with open(path, "w") as f:
        json.dump(obj, f, indent=1, default=lambda o: o.item() if hasattr(o, "item") else str(o))


def format_table(headers, rows, aligns=None, min_width=7):
    """Fixed-width table; every column at least ``min_width`` wide (rows printed one at a time as a
    run goes line up with the header)."""
    cols = len(headers)
    aligns = aligns or ["<"] + [">"] * (cols - 1)
    w = [max(min_width, len(str(headers[i])), *(len(str(r[i])) for r in rows if len(r) == cols)) for i in range(cols)]

    def fmt(r):
        return "  ".join(f"{str(r[i]) if i < len(r) else '':{aligns[i]}{w[i]}}" for i in range(cols))

    return "\n".join([fmt(headers), "  ".join("-" * x for x in w)] + [fmt(r) for r in rows])


def markdown_table(headers, rows, aligns=None):
    cols = len(headers)
    aligns = aligns or ["<"] + [">"] * (cols - 1)
    sep = ["---:" if a == ">" else ":---" for a in aligns]
    out = ["| " + " | ".join(str(h) for h in headers) + " |", "| " + " | ".join(sep) + " |"]
    out += ["| " + " | ".join(str(c) for c in r) + " |" for r in rows]
    return "\n".join(out)


def fmt_us(v):
    if v is None or (isinstance(v, float) and math.isnan(v)):
        return "-"
    return f"{v:.1f}" if v < 1000 else f"{v:.0f}"


def fmt_x(v):
    return "-" if v is None or (isinstance(v, float) and math.isnan(v)) else f"{v:.2f}x"


def fmt_n(n):
    return f"{n // 1024}K" if n % 1024 == 0 and n else str(n)


def median(xs):
    return statistics.median(xs)
