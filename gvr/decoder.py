"""TopKDecoder: per-layer decode-loop state for gvr.topk_decode."""
from __future__ import annotations

import numbers

from .topk import topk_decode

__all__ = ["TopKDecoder"]


class TopKDecoder:
    """Owns, per layer, the previous step's Top-K (the prediction for the next step) at fixed addresses.

    ``decoder(layer, scores, lengths=None)`` returns this step's indices (int32 ``[B, k]``, a view of
    a buffer the decoder owns) and keeps them as the next step's prediction for that layer. Two
    buffers per layer alternate (the kernels never read and write one buffer in the same call), so
    the addresses a decode loop touches repeat every two steps and the loop can be captured in a CUDA
    graph and replayed. ``reset()`` forgets every prediction (a new sequence). The returned view is
    overwritten two steps later: copy it if you keep it longer.

    device: "cpu" (NumPy buffers) or a CUDA device ("cuda", "cuda:1", a torch.device; needs torch).
    """

    def __init__(self, num_layers: int, max_batch: int, k: int, device="cuda"):
        for name, v in (("num_layers", num_layers), ("max_batch", max_batch), ("k", k)):
            if isinstance(v, bool) or not isinstance(v, numbers.Integral):  # NumPy integers too
                raise TypeError(f"'{name}' must be an int, got {type(v).__name__}")
            if v < 0 or (name != "k" and v == 0):
                raise ValueError(f"'{name}' must be {'>= 0' if name == 'k' else 'positive'}, got {v}")
        num_layers, max_batch, k = int(num_layers), int(max_batch), int(k)
        self.num_layers, self.max_batch, self.k = num_layers, max_batch, k
        dev = str(device)
        if dev == "cpu":
            import numpy as np

            self._bufs = [[np.full((max_batch, k), -1, np.int32) for _ in range(2)] for _ in range(num_layers)]
            self.device = "cpu"
        elif not dev.startswith("cuda"):
            raise ValueError(f"'device' must be 'cpu' or a CUDA device, got {device!r}")
        else:
            try:
                import torch
            except ImportError as e:  # pragma: no cover - depends on the environment
                raise RuntimeError("TopKDecoder on a CUDA device needs torch") from e
            tdev = torch.device(device)
            if tdev.type != "cuda":
                raise ValueError(f"'device' must be 'cpu' or a CUDA device, got {device!r}")
            self._bufs = [
                [torch.full((max_batch, k), -1, dtype=torch.int32, device=tdev) for _ in range(2)]
                for _ in range(num_layers)
            ]
            self.device = tdev
        self._cur = [0] * num_layers  # which buffer holds the last result
        self._valid = [False] * num_layers  # whether that result is a usable prediction
        self._batch = [0] * num_layers

    def reset(self) -> None:
        """Forget every layer's prediction (start of a new sequence)."""
        self._valid = [False] * self.num_layers

    def prediction(self, layer: int):
        """The prediction the next call for ``layer`` will use, or None."""
        layer = self._check_layer(layer)
        if not self._valid[layer]:
            return None
        return self._bufs[layer][self._cur[layer]][: self._batch[layer]]

    def _check_layer(self, layer) -> int:
        if isinstance(layer, bool) or not isinstance(layer, numbers.Integral):  # NumPy integers too
            raise TypeError(f"'layer' must be an int, got {type(layer).__name__}")
        if not 0 <= layer < self.num_layers:
            raise ValueError(f"'layer' must lie in [0, {self.num_layers}), got {layer}")
        return int(layer)

    def __call__(self, layer: int, scores, lengths=None, *, sorted: bool = False):
        layer = self._check_layer(layer)
        shape = getattr(scores, "shape", None)
        if shape is None:  # a list, say: topk_decode takes arrays only
            raise TypeError(f"'scores' must be a float32, float16 or bfloat16 array [B, N] (NumPy, torch, CuPy), got "
                            f"{type(scores).__name__}")
        if len(shape) != 2:
            raise ValueError(f"'scores' must have shape [B, N], got {shape}")
        B = int(shape[0])
        if not 1 <= B <= self.max_batch:
            raise ValueError(f"'scores' has batch {B}; this decoder holds 1..{self.max_batch} rows")
        nxt = 1 - self._cur[layer]
        prev = None
        if self._valid[layer]:
            prev = self._bufs[layer][self._cur[layer]][:B]
        out = self._bufs[layer][nxt][:B]
        topk_decode(scores, self.k, prev_topk=prev, lengths=lengths, out=out, sorted=sorted)
        self._cur[layer] = nxt
        self._valid[layer] = True
        self._batch[layer] = B
        return out
