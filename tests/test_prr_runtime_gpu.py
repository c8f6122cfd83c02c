"""GPU tests for gvr.prr.SpeculativeAttention (gvr/_prr_runtime.py): the CUDA runtime (speculative
attention on its side stream, selection on the caller's stream, events join) against the CPU runtime
on the same bfloat16 inputs (torch CPU tensors), against the float64 reference, and a CUDA graph of
one step (both streams) replaying to the eager result.

What must hold: selections, predictions and hit counts equal the CPU's (as sets: both paths are
exact and deterministic); states within the harness tolerance of the reference (exact mode: attention
over exactly the selected set; superset: predicted + missed); results bit for bit deterministic;
graph replay bit for bit equal to eager steps, with the buffers' addresses unchanged.

Every test is collected; each is skipped, with the reason, where torch with a CUDA device or gvr's
CUDA library is missing (conftest.py, harness.gpu_skip_reason).
"""

import numpy as np
import pytest

# this CUDA path raises NotImplementedError until its GPU tests have passed once (csrc/dispatch.h)

import gvr  # noqa: E402
from gvr import _prr_runtime as R  # noqa: E402
from attention_reference import missed_ref, sparse_attention_naive, sparse_attention_ref  # noqa: E402
from harness import assert_close, torch_or_none  # noqa: E402

torch = torch_or_none()

pytestmark = pytest.mark.gpu
Hq, Hkv, D, P, G = 8, 2, 64, 16, 32


class Case:
    """bfloat16 paged caches (torch CPU) of B rows, lengths growing by one per step, a drifting query."""

    def __init__(self, seed, B=2, max_pages=64, k=8):
        g = torch.Generator().manual_seed(seed)
        self.g, self.B, self.k = g, B, k
        num_pages = B * max_pages + 3
        self.K = torch.randn((num_pages, P, Hkv, D), generator=g).bfloat16()
        self.V = torch.randn((num_pages, P, Hkv, D), generator=g).bfloat16()
        self.bt = torch.randperm(num_pages, generator=g)[: B * max_pages].int().reshape(B, max_pages)
        cap = max_pages * P
        self.max_blocks = cap // G
        self.lengths = torch.tensor([cap - 2 * P - 3, cap // 2 + 5][:B], dtype=torch.int32)
        self.qf = torch.randn((B, Hq, D), generator=g)

    def next(self):
        self.qf = 0.9 * self.qf + 0.45 * torch.randn(self.qf.shape, generator=self.g)
        return self.qf.bfloat16()

    def runtime(self, device, **kw):
        kw.setdefault("block_size", G)
        kw.setdefault("k", self.k)
        return R.SpeculativeAttention(self.B, Hq, Hkv, D, self.max_blocks, device=device, dtype="bfloat16", **kw)


class Side:
    """One device's view of a Case: caches, table, lengths (updated in place), metadata, selection."""

    def __init__(self, c, device):
        self.dev = device
        self.K, self.V, self.bt = c.K.to(device), c.V.to(device), c.bt.to(device)
        self.lengths = c.lengths.clone().to(device)
        self.meta = gvr.prr.block_metadata(self.K, self.bt, self.lengths, block_size=G)
        self.select = R.quest_select(self.meta, c.k, self.lengths, block_size=G, sorted=True)  # "last" keeps the best

    def grow(self):
        old = self.lengths.clone()
        self.lengths += 1
        gvr.prr.update_block_metadata(self.meta, self.K, self.bt, old, self.lengths, block_size=G)

    def step(self, sa, q):
        return sa.step(q.to(self.dev), self.K, self.V, self.bt, self.lengths, self.select)


def sets(x):
    x = x.cpu().numpy() if isinstance(x, torch.Tensor) else np.asarray(x)
    return np.sort(x, axis=-1)


def bits(x):
    return x.detach().cpu().contiguous().view(torch.int32 if x.element_size() == 4 else torch.int16)


@pytest.mark.parametrize("budget", [0.0, 0.5, 1.0])
@pytest.mark.parametrize("predictor", ["ema", "last"])
@pytest.mark.parametrize("mode", ["exact", "superset"])
def test_cuda_equals_cpu_and_reference(cuda, mode, predictor, budget):
    c = Case(seed=1 + int(10 * budget) + 2 * (mode == "exact"))
    cpu, gpu = Side(c, "cpu"), Side(c, "cuda")
    sa_c = c.runtime("cpu", mode=mode, predictor=predictor, budget=budget)
    sa_g = c.runtime("cuda", mode=mode, predictor=predictor, budget=budget)
    for t in range(5):
        if t:
            cpu.grow()
            gpu.grow()
        q = c.next()
        pred = sa_c.prediction(c.B).copy()
        assert np.array_equal(sets(pred), sets(sa_g.prediction(c.B))), t
        oc, lc = cpu.step(sa_c, q)
        og, lg = gpu.step(sa_g, q)
        torch.cuda.synchronize()
        assert og.device.type == "cuda" and og.dtype == torch.bfloat16 and lg.dtype == torch.float32
        sel = cpu.select.selected[: c.B].numpy().copy()
        assert np.array_equal(sets(sel), sets(gpu.select.selected[: c.B])), t
        assert sa_g.hit_counts.tolist() == list(sa_c.hit_counts), t
        assert sa_g.last_hit_rate == sa_c.last_hit_rate and sa_g.mean_hit_rate == sa_c.mean_hit_rate
        idx = sel if mode == "exact" or budget == 0 else np.concatenate([pred, missed_ref(sel, pred)], axis=2)
        args = (q, c.K, c.V, idx, cpu.lengths, c.bt, G)
        ro, rl = sparse_attention_ref(*args)
        no, nl = sparse_attention_naive(*args, dtype="bfloat16")
        # the float32 states (budget 0: the bfloat16 outs, written straight by one sparse_attention launch)
        sg = sa_g.state[0][: c.B] if budget > 0 else og.float()
        sc = sa_c.state[0][: c.B] if budget > 0 else oc.float().numpy()
        assert_close(sg.cpu().numpy(), ro, no, "bfloat16", what=f"step {t} cuda state out")
        assert_close(lg.cpu().numpy(), rl, nl, "bfloat16", what=f"step {t} cuda lse")
        assert_close(sc, ro, no, "bfloat16", what=f"step {t} cpu state out")


def test_predictions_with_bad_entries(cuda):
    c = Case(seed=7)
    gpu = Side(c, "cuda")
    for mode in ("exact", "superset"):
        sa = c.runtime("cuda", mode=mode, predictor="last", budget=1.5)
        nb = int(c.lengths.min()) // G
        pred = torch.randint(0, nb, (c.B, Hkv, sa.n_pred), generator=c.g, dtype=torch.int32)
        pred[:, :, 0] = pred[:, :, 1]
        pred[0, 0, 2] = -1
        pred[0, 1, 3] = c.max_blocks + 5
        pred[1, 1, 4] = -9
        sa.set_prediction(pred.cuda())
        q = c.next()
        o, lse = gpu.step(sa, q)
        torch.cuda.synchronize()
        sel = gpu.select.selected[: c.B].cpu().numpy()
        p = pred.numpy()
        idx = sel if mode == "exact" else np.concatenate([p, missed_ref(sel, p)], axis=2)
        args = (q, c.K, c.V, idx, c.lengths, c.bt, G)
        ro, rl = sparse_attention_ref(*args)
        no, nl = sparse_attention_naive(*args, dtype="bfloat16")
        assert_close(sa.state[0][: c.B].cpu().numpy(), ro, no, "bfloat16", what=f"{mode} out")
        assert_close(lse.cpu().numpy(), rl, nl, "bfloat16", what=f"{mode} lse")


def test_deterministic_bit_for_bit(cuda):
    res = []
    for _ in range(2):
        c = Case(seed=9)
        gpu = Side(c, "cuda")
        sa = c.runtime("cuda", mode="exact", predictor="ema", budget=1.0)
        outs = []
        for t in range(4):
            if t:
                gpu.grow()
            o, l = gpu.step(sa, c.next())
            outs.append((bits(o), bits(l)))
        torch.cuda.synchronize()
        res.append(outs)
    for (a, b), (x, y) in zip(*res):
        assert torch.equal(a, x) and torch.equal(b, y)


def test_side_stream_and_callers_stream(cuda):
    c = Case(seed=10)
    gpu = Side(c, "cuda")
    sa = c.runtime("cuda", predictor="ema")
    assert sa.side_stream is not None and sa.side_stream.cuda_stream != torch.cuda.current_stream().cuda_stream
    ref = c.runtime("cuda", predictor="ema")
    s = torch.cuda.Stream()
    q = c.next()
    s.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(s):
        o, l = gpu.step(sa, q)
        o2 = o.clone()
    torch.cuda.current_stream().wait_stream(s)
    r, rl = gpu.step(ref, q)
    torch.cuda.synchronize()
    assert torch.equal(bits(o2), bits(r))


def test_budget_zero_is_one_sparse_attention_into_out_and_captures(cuda):
    """budget 0: the step writes sparse_attention over the selection straight into out (bfloat16, bit for bit
    the plain call, the float32 state's out untouched), eagerly and from a CUDA graph."""
    c = Case(seed=12)
    gpu = Side(c, "cuda")
    sa = c.runtime("cuda", budget=0.0, predictor="last")
    sentinel = sa.state[0].clone()
    akw = dict(lengths=gpu.lengths, block_table=gpu.bt, block_size=G)
    q_static = c.next().cuda()
    o, l = gpu.step(sa, q_static)  # eager (warm-up too)
    ro, rl = gvr.sparse_attention(q_static, gpu.K, gpu.V, gpu.select(q_static)[0], **akw)
    torch.cuda.synchronize()
    assert o.dtype == torch.bfloat16 and torch.equal(bits(o), bits(ro)) and torch.equal(bits(l), bits(rl))
    g = torch.cuda.CUDAGraph()
    with torch.cuda.graph(g):
        out_static, lse_static = gpu.step(sa, q_static)
    for t in range(1, 4):
        gpu.grow()
        q_static.copy_(c.next().cuda())
        g.replay()
        ro, rl = gvr.sparse_attention(q_static, gpu.K, gpu.V, gpu.select(q_static)[0], **akw)
        torch.cuda.synchronize()
        assert torch.equal(bits(out_static), bits(ro)), t
        assert torch.equal(bits(lse_static), bits(rl)), t
    assert torch.equal(bits(sa.state[0]), bits(sentinel))


@pytest.mark.parametrize("mode", ["exact", "superset"])
@pytest.mark.parametrize("predictor", ["ema", "last"])
def test_graph_capture_of_one_step_replays_to_eager(cuda, mode, predictor):
    c = Case(seed=11)
    eager_side, graph_side = Side(c, "cuda"), Side(c, "cuda")
    eager = c.runtime("cuda", mode=mode, predictor=predictor, budget=1.0)
    graphed = c.runtime("cuda", mode=mode, predictor=predictor, budget=1.0)
    q0 = c.next()
    q_static = q0.cuda()
    # step 0 eager on both (warm-up: gvr's per-stream workspaces, the library's kernels)
    eager_side.step(eager, q0)
    graph_side.step(graphed, q_static)
    torch.cuda.synchronize()
    addrs = (graphed.state[0].data_ptr(), graphed.state[1].data_ptr(), graphed.prediction().data_ptr())
    g = torch.cuda.CUDAGraph()
    with torch.cuda.graph(g):
        out_static, lse_static = graph_side.step(graphed, q_static)
    # the capture ran nothing: both runtimes still hold step 0's prediction
    assert torch.equal(graphed.prediction(), eager.prediction())
    for t in range(1, 5):
        eager_side.grow()
        graph_side.grow()
        q = c.next()
        q_static.copy_(q.cuda())
        g.replay()
        o, l = eager_side.step(eager, q)
        torch.cuda.synchronize()
        assert torch.equal(bits(out_static), bits(o)), t
        assert torch.equal(bits(lse_static), bits(l)), t
        assert np.array_equal(sets(graphed.prediction()), sets(eager.prediction())), t
        assert graphed.hit_counts.tolist() == eager.hit_counts.tolist(), t
    assert addrs == (graphed.state[0].data_ptr(), graphed.state[1].data_ptr(), graphed.prediction().data_ptr())


@pytest.mark.parametrize("predictor", ["ema", "last"])
def test_join_false_equals_join_true_and_captures_with_join(cuda, predictor):
    """step(join=False) leaves the predictor on the side stream: the next step (or join()) takes it up; the
    results, predictions and counts equal join=True steps bit for bit, eagerly and from a graph whose
    capture ends with join()."""
    c = Case(seed=17)
    a_side, b_side = Side(c, "cuda"), Side(c, "cuda")
    sa_a = c.runtime("cuda", mode="superset", predictor=predictor, budget=1.0)
    sa_b = c.runtime("cuda", mode="superset", predictor=predictor, budget=1.0)
    for t in range(4):
        if t:
            a_side.grow()
            b_side.grow()
        q = c.next()
        oa, la = a_side.step(sa_a, q)
        ob, lb = sa_b.step(q.cuda(), b_side.K, b_side.V, b_side.bt, b_side.lengths, b_side.select, join=False)
        oa, la, ob, lb = oa.clone(), la.clone(), ob.clone(), lb.clone()
        sa_b.join()  # before grow() changes lengths in place (the predictor reads them)
        torch.cuda.synchronize()
        assert torch.equal(bits(oa), bits(ob)) and torch.equal(bits(la), bits(lb)), t
        assert torch.equal(sa_a.prediction(), sa_b.prediction()), t
        assert sa_a.hit_counts.tolist() == sa_b.hit_counts.tolist(), t
    q_static = c.next().cuda()
    g = torch.cuda.CUDAGraph()
    with torch.cuda.graph(g):
        out_static, lse_static = sa_b.step(q_static, b_side.K, b_side.V, b_side.bt, b_side.lengths, b_side.select,
                                           join=False)
        sa_b.join()
    g.replay()
    o, l = a_side.step(sa_a, q_static)
    torch.cuda.synchronize()
    assert torch.equal(bits(out_static), bits(o)) and torch.equal(bits(lse_static), bits(l))
    assert torch.equal(sa_a.prediction(), sa_b.prediction())


def test_device_mismatch_is_named(cuda):
    c = Case(seed=13)
    gpu = Side(c, "cuda")
    sa_c = c.runtime("cpu")
    with pytest.raises(ValueError, match="'q'"):
        gpu.step(sa_c, c.next())
    sa_g = c.runtime("cuda")
    cpu = Side(c, "cpu")
    with pytest.raises(ValueError, match="'q'"):
        cpu.step(sa_g, c.next())


@pytest.mark.parametrize("mode", ["exact", "superset"])
def test_fp8_caches_end_to_end_and_graph(cuda, mode):
    """The runtime over fp8 (e4m3fn) caches: Quest metadata and selection over the fp8 K (fp8 metadata),
    attention and repair with k_scale / v_scale. CUDA equals the CPU runtime (selections, predictions,
    counts; states within tolerance of the float64 reference over the dequantized caches), and a CUDA
    graph of a step replays to the eager steps bit for bit."""
    c = Case(seed=31)
    ks, vs = 3.0 / 448, 2.0 / 448
    k8 = (c.K.float() / ks).clamp_(-448, 448).to(torch.float8_e4m3fn)
    v8 = (c.V.float() / vs).clamp_(-448, 448).to(torch.float8_e4m3fn)
    kd, vd = k8.float() * ks, v8.float() * vs  # what the attention sees

    class Side8(Side):
        def __init__(self, device):
            self.dev = device
            self.K, self.V, self.bt = k8.to(device), v8.to(device), c.bt.to(device)
            self.lengths = c.lengths.clone().to(device)
            self.meta = gvr.prr.block_metadata(self.K, self.bt, self.lengths, block_size=G)
            assert self.meta.dtype == torch.float8_e4m3fn
            self.select = R.quest_select(self.meta, c.k, self.lengths, block_size=G, sorted=True)

        def step(self, sa, q):
            return sa.step(q.to(self.dev), self.K, self.V, self.bt, self.lengths, self.select, k_scale=ks, v_scale=vs)

    cpu, gpu, gside = Side8("cpu"), Side8("cuda"), Side8("cuda")
    sa_c, sa_g = c.runtime("cpu", mode=mode), c.runtime("cuda", mode=mode)
    graphed = c.runtime("cuda", mode=mode)
    q0 = c.next()
    q_static = q0.cuda()
    cpu.step(sa_c, q0)
    gpu.step(sa_g, q0)
    gside.step(graphed, q_static)
    torch.cuda.synchronize()
    g = torch.cuda.CUDAGraph()
    with torch.cuda.graph(g):
        out_static, lse_static = gside.step(graphed, q_static)
    for t in range(1, 5):
        for s in (cpu, gpu, gside):
            s.grow()
        q = c.next()
        pred = sa_c.prediction(c.B).copy()
        assert np.array_equal(sets(pred), sets(sa_g.prediction(c.B))), t
        oc, lc = cpu.step(sa_c, q)
        og, lg = gpu.step(sa_g, q)
        q_static.copy_(q.cuda())
        g.replay()
        torch.cuda.synchronize()
        assert torch.equal(bits(out_static), bits(og)) and torch.equal(bits(lse_static), bits(lg)), t
        sel = cpu.select.selected[: c.B].numpy().copy()
        assert np.array_equal(sets(sel), sets(gpu.select.selected[: c.B])), t
        assert sa_g.hit_counts.tolist() == list(sa_c.hit_counts), t
        idx = sel if mode == "exact" else np.concatenate([pred, missed_ref(sel, pred)], axis=2)
        args = (q, kd, vd, idx, cpu.lengths, c.bt, G)
        ro, rl = sparse_attention_ref(*args)
        no, nl = sparse_attention_naive(*args, dtype="bfloat16")
        assert_close(sa_g.state[0][: c.B].cpu().numpy(), ro, no, "bfloat16", what=f"step {t} cuda state out")
        assert_close(lg.cpu().numpy(), rl, nl, "bfloat16", what=f"step {t} cuda lse")
        assert_close(sa_c.state[0][: c.B], ro, no, "bfloat16", what=f"step {t} cpu state out")
