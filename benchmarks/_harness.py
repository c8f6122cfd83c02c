"""The timing harness, for benchmarks and scripts: a re-export of gvr/_harness.py (the one
implementation), loaded by file path from this checkout so that it also times an installed gvr that
predates it (scripts/quick_gpu_bench.py's before/after tables). Use: sys.path.insert(0, <repo>/benchmarks);
import _harness as H."""
import importlib.util
import os
import sys

_PATH = os.path.join(os.path.dirname(os.path.dirname(os.path.abspath(__file__))), "gvr", "_harness.py")
_NAME = "_gvr_harness_checkout"
if _NAME not in sys.modules:
    _spec = importlib.util.spec_from_file_location(_NAME, _PATH)
    _mod = importlib.util.module_from_spec(_spec)
    sys.modules[_NAME] = _mod
    _spec.loader.exec_module(_mod)
globals().update({k: v for k, v in vars(sys.modules[_NAME]).items() if not k.startswith("__")})


def import_gvr(root=os.path.dirname(os.path.dirname(os.path.abspath(__file__)))):
    """gvr from the checkout at ``root`` when it is built in place, else the installed gvr (with its
    submodules gvr.data and gvr.prr loaded)."""
    if os.path.exists(os.path.join(root, "gvr", "__init__.py")) and root not in sys.path:
        sys.path.insert(0, root)
        try:
            import gvr  # noqa: F401
        except ImportError:  # the checkout is not built in place
            sys.path.remove(root)
            for name in [m for m in sys.modules if m == "gvr" or m.startswith("gvr.")]:
                del sys.modules[name]
    import gvr
    import gvr.data  # noqa: F401

    try:
        import gvr.prr  # noqa: F401  (older installed builds have no gvr.prr)
    except ImportError:
        pass
    return gvr
