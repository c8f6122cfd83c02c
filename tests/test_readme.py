"""The README's Python examples run as written (those needing a CUDA device are GPU tests)."""
import pathlib
import re
import sys
import types

import pytest

from harness import gpu_skip_reason

README = pathlib.Path(__file__).resolve().parents[1] / "README.md"
BLOCKS = re.findall(r"```python\n(.*?)```", README.read_text(), re.S)


def _needs_cuda(code):
    return '"cuda"' in code or ".cuda()" in code or "torch.compile" in code


def _first_line(code):
    return next((line for line in code.splitlines() if line.strip() and not line.startswith("import")), "")[:40]


PARAMS = [pytest.param(c, id=f"block{i}-{_first_line(c)}", marks=[pytest.mark.gpu] if _needs_cuda(c) else [])
          for i, c in enumerate(BLOCKS)]


@pytest.mark.parametrize("code", PARAMS)
def test_readme_example_runs(code, tmp_path, monkeypatch):
    if _needs_cuda(code):
        reason = gpu_skip_reason()
        if reason:
            pytest.skip(reason)
    elif "import torch" in code:
        pytest.importorskip("torch", reason="this README example needs PyTorch")
    monkeypatch.chdir(tmp_path)
    # a real module (torch.compile's tracer imports the module of the function it compiles)
    mod = types.ModuleType("gvr_readme_block")
    monkeypatch.setitem(sys.modules, mod.__name__, mod)
    exec(compile(code, f"README.md block {BLOCKS.index(code)}", "exec"), mod.__dict__)
