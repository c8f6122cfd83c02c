"""gvr: exact, fast decode-step operators for sparse-attention LLMs, with a C/CUDA core.

gvr.topk_decode  exact Top-K of indexer scores, warm-started by the previous step's Top-K (GVR)
gvr.sparse_attention  attention over selected blocks/tokens of a paged KV cache -> state (out, lse)
gvr.merge_states      exact merge of attention states (and merge_states_in_place)
gvr.prr          PRR: repair (fold missed blocks into a state in place), missed, finalize (exact mode),
                 Quest selection, EMA predictor, SpeculativeAttention, Budget
gvr.sparda       SparDA: prefetch of selected KV blocks from pinned host memory (HostKVCache,
                 prefetch, Prefetcher), the Forecast indexer (forecast_select, compressed keys) and its
                 training objective (forecast_kl_loss)
gvr.TopKDecoder  per-layer decode-loop state (previous Top-K buffers), CUDA-graph friendly
gvr.data         deterministic workload generators (decode traces, i.i.d., adversarial rows)
"""
try:
    from . import _C
except ImportError as e:  # pragma: no cover - depends on how gvr is run
    raise ImportError(
        "gvr's C extension is missing: this imports gvr from its unbuilt source tree. Run from another "
        "directory (to use the installed package) or build in place: python setup.py build_ext --inplace"
    ) from e

from .topk import topk_decode
from .attention import sparse_attention, merge_states, merge_states_in_place
from . import prr
from . import sparda
from .decoder import TopKDecoder
from . import data

__version__ = "0.1.0"
__all__ = ["topk_decode", "sparse_attention", "merge_states", "merge_states_in_place", "prr", "sparda", "TopKDecoder", "cuda_available", "build_info", "set_num_threads", "get_num_threads"]


def cuda_available() -> bool:
    """True when gvr's CUDA library is built and loads (a GPU is still needed to run it)."""
    return _C.cuda_available()


def build_info() -> dict:
    """What this installation has: the CPU threading ("threads"), the CUDA library path and whether it loads."""
    info = dict(_C.build_info())
    info["cuda_error"] = _C.cuda_error()
    info["cuda"] = info["cuda_error"] is None
    return info


def set_num_threads(n: int) -> None:
    """Threads for CPU rows when B > 1 (0: the default)."""
    _C.set_num_threads(n)


def get_num_threads() -> int:
    return _C.get_num_threads()


def _check_cpu_isa_env():
    """GVR_CPU_ISA is read once by the C path; a value it does not know would silently mean 'auto'."""
    import os
    import warnings
    value = os.environ.get("GVR_CPU_ISA")
    if value not in (None, "", "auto", "generic"):
        warnings.warn(f"GVR_CPU_ISA={value!r} is not a value gvr knows and is ignored: 'generic' forces the generic "
                      "C loops of the CPU attention path; unset (or 'auto') picks the best the CPU runs",
                      RuntimeWarning, stacklevel=3)


_check_cpu_isa_env()
