"""The test harness itself: the precision-derived tolerance passes good results and fails bad ones
with a message naming the worst element; bfloat16 rounding; GPU skip reasons."""
import numpy as np
import pytest

from harness import assert_close, gpu_skip_reason, naive_inputs, round_to, tolerance


def _softmax(x):
    e = np.exp(x - x.max(axis=-1, keepdims=True))
    return e / e.sum(axis=-1, keepdims=True)


@pytest.mark.parametrize("dtype", ["float32", "float16", "bfloat16"])
def test_tolerance_accepts_fp32_accumulation_and_rejects_an_error(dtype):
    rng = np.random.default_rng(0)
    x = rng.standard_normal((4, 97)) * 3
    xin = round_to(x, dtype)  # what the kernel reads
    ref = _softmax(xin)  # float64 reference on the same inputs
    naive = _softmax(naive_inputs(dtype, xin))  # the same math in the input precision
    good = _softmax(xin.astype(np.float32)).astype(np.float32)  # a kernel accumulating in fp32
    assert_close(good, ref, naive, dtype, what="fp32 accumulation")
    bad = good.astype(np.float64).copy()
    bad[2, 41] += 10 * tolerance(ref, naive, dtype) + 1e-3
    with pytest.raises(AssertionError) as e:
        assert_close(bad, ref, naive, dtype, what="perturbed")
    msg = str(e.value)
    assert "(2, 41)" in msg and "got" in msg and "reference" in msg and "naive" in msg, msg


def test_non_finite_reference_values_must_match():
    ref = np.array([1.0, np.inf, np.nan])
    assert_close(np.array([1.0, np.inf, np.nan]), ref, ref, "float32")
    with pytest.raises(AssertionError, match="index \\(1,\\)"):
        assert_close(np.array([1.0, 5.0, np.nan]), ref, ref, "float32")
    with pytest.raises(AssertionError, match="worst at index \\(0,\\)"):
        assert_close(np.array([np.nan, np.inf, np.nan]), ref, ref, "float32")


def test_round_to_bfloat16():
    x = np.array([1.0, 1.0 + 2**-8, 1.0 + 3 * 2**-8, -2.5, np.inf, -np.inf, 0.0, 3.0e38])
    r = round_to(x, "bfloat16")
    assert r[0] == 1.0 and r[1] == 1.0  # ties to even
    assert r[2] == 1.0 + 2**-6  # rounds up to the next bfloat16
    assert r[3] == -2.5 and np.isposinf(r[4]) and np.isneginf(r[5]) and r[6] == 0.0
    assert np.isnan(round_to(np.array([np.nan]), "bfloat16")[0])
    with pytest.raises(ValueError, match="precision"):
        round_to(x, "float8")


def test_gpu_skip_reason_names_the_cause():
    why = gpu_skip_reason()
    assert why is None or why.startswith("needs a CUDA device: ") and len(why) > 22
