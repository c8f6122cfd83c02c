"""gvr.TopKDecoder on the CPU: per-layer predictions, exact results, bad arguments."""
import numpy as np
import pytest

import gvr
from gvr import data
from reference import topk_reference


def test_decode_loop_exact_and_predictions_kept():
    layers, B, N, k = 3, 2, 5000, 64
    dec = gvr.TopKDecoder(layers, 4, k, device="cpu")
    steps = data.decode_trace_batch(B, N, 4, k=k, overlap=0.45, seed=4)
    for t, x in enumerate(steps):
        for layer in range(layers):
            before = dec.prediction(layer)
            assert (before is None) == (t == 0)
            got = dec(layer, x)
            assert got.shape == (B, k)
            for b in range(B):
                assert np.array_equal(np.sort(got[b]), np.sort(topk_reference(x[b], k)))
            assert np.array_equal(dec.prediction(layer), got)
    dec.reset()
    assert all(dec.prediction(layer) is None for layer in range(layers))


@pytest.mark.parametrize(
    "args, exc, name",
    [
        ((0, 2, 4), ValueError, "num_layers"),
        ((2, 0, 4), ValueError, "max_batch"),
        ((2, 2, -1), ValueError, "k"),
        ((2.0, 2, 4), TypeError, "num_layers"),
        ((2, 2, True), TypeError, "k"),
    ],
)
def test_bad_constructor_arguments(args, exc, name):
    with pytest.raises(exc, match=name):
        gvr.TopKDecoder(*args, device="cpu")


def test_bad_call_arguments_leave_state_alone():
    dec = gvr.TopKDecoder(1, 2, 8, device="cpu")
    x = np.random.default_rng(0).standard_normal((2, 100)).astype(np.float32)
    first = dec(0, x).copy()
    with pytest.raises(ValueError, match="layer"):
        dec(1, x)
    with pytest.raises(TypeError, match="layer"):
        dec("0", x)
    with pytest.raises(ValueError, match="scores"):
        dec(0, np.zeros((3, 100), np.float32))  # more rows than max_batch
    with pytest.raises(TypeError, match="scores"):
        dec(0, x.astype(np.float64))
    assert np.array_equal(dec.prediction(0), first)
    with pytest.raises(ValueError, match="device"):
        gvr.TopKDecoder(1, 1, 1, device="meta")
