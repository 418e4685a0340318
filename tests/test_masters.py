"""MasterAdamW (masters.py, kernels/adamw_master.py) against the per-weight path it replaces: torch's fused AdamW
over fp32 copies of the weights, with the gradients upcast, unscaled and clipped by torch, then rounded back.
Several steps, with and without weight decay and clipping, in bf16 and in fp16 with a loss scale and a skipped
(inf) step; its state_dict against torch.optim.AdamW's, both ways; gradients accumulated into the flat buffer."""
import pytest
import torch

from masters import Masters, param_groups
from precision import LossScaler
from tests.helpers import USE_KERNELS, assert_close

SHAPES = [(33, 17), (5,), (3, 423), (64, 8)]
LR = 1e-3


def _weights(dtype, seed=0):
    g = torch.Generator().manual_seed(seed)
    return [(f"model.layers.{i}.w.weight", torch.nn.Parameter(torch.randn(s, generator=g).to(dtype)))
            for i, s in enumerate(SHAPES)]


def _grads(dtype, steps, scale, inf_step):
    """Per step, a gradient per weight (times the loss scale, as a backward gives it); inf where step is inf_step."""
    g = torch.Generator().manual_seed(1)
    out = []
    for t in range(steps):
        gs = [(torch.randn(s, generator=g) * 10.0 ** torch.randint(-3, 1, s, generator=g) * scale).to(dtype)
              for s in SHAPES]
        if t == inf_step:
            gs[1][2] = float("inf")
        out.append(gs)
    return out


class PerWeight:
    """The reference: fp32 masters stepped by torch.optim.AdamW(fused=True), the bf16/fp16 weights their rounding."""

    def __init__(self, named, weight_decay, scaler):
        self.weights = [w for _, w in named]
        self.masters = [w.detach().float().requires_grad_() for w in self.weights]
        self.optimizer = torch.optim.AdamW(param_groups(list(zip([n for n, _ in named], self.masters)),
                                                        weight_decay), lr=LR, fused=True)
        self.scaler = scaler

    def step(self, grads, clip):
        for m, g in zip(self.masters, grads):
            m.grad = g.float()
        self.scaler.unscale_(self.masters)
        norm = torch.nn.utils.clip_grad_norm_(self.masters, clip or float("inf"))
        applied = self.scaler.step(self.optimizer, torch.tensor(1.0), norm)
        with torch.no_grad():
            for w, m in zip(self.weights, self.masters):
                w.copy_(m)
        return norm, applied


class Flat:
    """MasterAdamW over Masters' flat buffers, as train.py drives it."""

    def __init__(self, named, weight_decay, scaler, use_kernels):
        self.masters = Masters(named)
        self.optimizer = self.masters.optimizer(param_groups(self.masters.named(), weight_decay), LR, use_kernels)
        self.scaler = scaler

    def step(self, grads, clip):
        with torch.no_grad():
            for w, g in zip(self.masters.weights, grads):
                w.grad.copy_(g)
        norm = self.masters.unscale_and_clip_(self.scaler, clip)
        applied = self.scaler.step(self.optimizer, torch.tensor(1.0), norm)
        self.masters.zero_grad()
        return norm, applied


def _moments(optimizer, params):
    return [(optimizer.state[p]["exp_avg"], optimizer.state[p]["exp_avg_sq"]) for p in params]


def _compare(ref, flat, dtype):
    """Masters and moments within fp32 rounding; returns the fraction of weights that differ (by one ulp)."""
    differ, total = 0, 0
    for i, (r, f) in enumerate(zip(ref.masters, flat.masters.params)):
        assert_close(f, r, atol=1e-6, rtol=2e-6, name=f"master {i}")
    for i, ((ra, rs), (fa, fs)) in enumerate(zip(_moments(ref.optimizer, ref.masters),
                                                 _moments(flat.optimizer, flat.masters.params))):
        assert_close(fa, ra, atol=1e-7, rtol=2e-6, name=f"exp_avg {i}")
        assert_close(fs, rs, atol=1e-9, rtol=2e-6, name=f"exp_avg_sq {i}")
    for rw, fw in zip(ref.weights, flat.masters.weights):
        assert fw.dtype == dtype
        ulp = torch.finfo(dtype).eps * rw.float().abs().clamp(min=torch.finfo(dtype).tiny)
        assert ((fw.float() - rw.float()).abs() <= ulp).all(), "a weight differs by more than one ulp"
        differ += int((fw != rw).sum())
        total += rw.numel()
    return differ / total


@pytest.mark.parametrize("use_kernels", USE_KERNELS, ids=["reference", "kernel"])
@pytest.mark.parametrize("weight_decay", [0.0, 0.1])
@pytest.mark.parametrize("clip", [None, 0.05])
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
def test_steps_equal_torch_adamw_over_fp32_masters(dtype, clip, weight_decay, use_kernels):
    """Five steps; in fp16 with a loss scale of 2^10, the third step's gradient holds an inf: both skip it, and
    neither changes a weight, a moment or the step count."""
    fp16 = dtype == torch.float16
    scale, inf_step = (2.0 ** 10, 2) if fp16 else (1.0, None)
    ref = PerWeight(_weights(dtype), weight_decay, LossScaler(scale, 100, enabled=fp16))
    flat = Flat(_weights(dtype), weight_decay, LossScaler(scale, 100, enabled=fp16), use_kernels)
    for t, grads in enumerate(_grads(dtype, 5, scale, inf_step)):
        ref_norm, ref_applied = ref.step(grads, clip)
        norm, applied = flat.step(grads, clip)
        assert applied == ref_applied == (t != inf_step)
        if applied:
            assert_close(norm, ref_norm, atol=0, rtol=1e-6, name="gradient norm")
        assert flat.scaler.scale == ref.scaler.scale
        assert _compare(ref, flat, dtype) < 1e-3  # weights: equal after rounding, nearly all of them
    steps = {int(s["step"]) for s in flat.optimizer.state.values()}
    assert steps == {5 - fp16}


def test_state_dict_is_torch_adamws_both_ways():
    """A checkpoint's optimizer state from the per-weight torch AdamW continues in MasterAdamW, and MasterAdamW's
    state_dict continues in torch AdamW: the next steps equal the uninterrupted run's."""
    grads = _grads(torch.bfloat16, 6, 1.0, None)
    ref = PerWeight(_weights(torch.bfloat16), 0.1, LossScaler(1.0, 100, enabled=False))
    for g in grads[:3]:
        ref.step(g, 1.0)
    flat = Flat(_weights(torch.bfloat16), 0.1, LossScaler(1.0, 100, enabled=False), use_kernels=False)
    with torch.no_grad():  # what checkpoint.restore does: the masters, then the optimizer's state
        for m, w, r in zip(flat.masters.params, flat.masters.weights, ref.masters):
            m.copy_(r)
            w.copy_(r)
    flat.optimizer.load_state_dict(ref.optimizer.state_dict())
    for g in grads[3:5]:
        ref.step(g, 1.0)
        flat.step(g, 1.0)
        _compare(ref, flat, torch.bfloat16)

    back = PerWeight([(n, torch.nn.Parameter(w.detach().clone())) for n, w in zip(flat.masters.names,
                                                                                   flat.masters.weights)],
                     0.1, LossScaler(1.0, 100, enabled=False))
    with torch.no_grad():
        for b, m in zip(back.masters, flat.masters.params):
            b.copy_(m)
    saved = flat.optimizer.state_dict()
    assert saved["param_groups"][0].keys() == ref.optimizer.state_dict()["param_groups"][0].keys()
    back.optimizer.load_state_dict(saved)
    ref.step(grads[5], 1.0)
    back.step(grads[5], 1.0)
    for r, b in zip(ref.masters, back.masters):
        assert_close(b, r, atol=1e-6, rtol=2e-6, name="master")


def test_backward_accumulates_into_the_flat_buffers():
    """The model's weights live in the flat weight buffer, and two backwards add into the flat gradient buffer."""
    named = _weights(torch.bfloat16)
    masters = Masters(named)
    x = [torch.randn(s).to(torch.bfloat16) for s in SHAPES]
    for _ in range(2):
        sum((w * xi).sum() for (_, w), xi in zip(named, x)).backward()
    for (_, w), xi, view in zip(named, x, masters.views(masters.grad_buffer)):
        assert w.grad.data_ptr() == view.data_ptr() and torch.equal(w.grad, 2 * xi)
    assert masters.weights[0].data_ptr() == masters.weight_buffer.data_ptr()


def test_moments_are_made_at_the_first_step():
    """As torch's AdamW, MasterAdamW makes its moments (8 bytes a weight) at its first step, not before the first
    forward and backward: before it, its state is empty and its state_dict torch AdamW's, which loads back."""
    grads = _grads(torch.bfloat16, 1, 1.0, None)
    flat = Flat(_weights(torch.bfloat16), 0.1, LossScaler(1.0, 100, enabled=False), use_kernels=False)
    ref = PerWeight(_weights(torch.bfloat16), 0.1, LossScaler(1.0, 100, enabled=False))
    assert flat.optimizer.exp_avg is None and not flat.optimizer.state
    assert flat.optimizer.state_dict()["state"] == ref.optimizer.state_dict()["state"] == {}
    flat.optimizer.load_state_dict(ref.optimizer.state_dict())  # a checkpoint of no step yet
    ref.step(grads[0], 1.0)
    flat.step(grads[0], 1.0)
    _compare(ref, flat, torch.bfloat16)
    assert flat.optimizer.exp_avg.numel() == flat.masters.master_buffer.numel()


def _stacked_weights(dtype):
    """Weights of which q and k share one storage as consecutive rows (as `pack_weights_` stores a projection
    group), and their biases another, listed apart, among weights of their own. Names that end in .lora_A take
    weight decay (`param_groups`), the others none: two groups, interleaved in the flat buffers."""
    g = torch.Generator().manual_seed(0)
    rows, bias = torch.randn(7, 17, generator=g).to(dtype), torch.randn(7, generator=g).to(dtype)
    tensors = [("a.lora_A", torch.randn(33, 17, generator=g).to(dtype)), ("q.lora_A", rows[:3]), ("q.bias", bias[:3]),
               ("k.weight", rows[3:]), ("k.lora_A", bias[3:]), ("z.lora_A", torch.randn(5, generator=g).to(dtype))]
    return [(f"model.{n}", torch.nn.Parameter(t)) for n, t in tensors]


def test_stacked_weights_stay_one_view_in_the_flat_buffers():
    """Weights that share one storage lie together in the flat buffers, in their storage order, at the place of the
    first of them, so that the group is still one view of consecutive rows; the names keep their order; each
    group's runs follow where its weights lie, and five steps equal torch AdamW's per weight."""
    from model.lora import _rows_view
    named = _stacked_weights(torch.bfloat16)
    flat = Flat(named, 0.1, LossScaler(1.0, 100, enabled=False), use_kernels=False)
    ref = PerWeight(_stacked_weights(torch.bfloat16), 0.1, LossScaler(1.0, 100, enabled=False))
    m = flat.masters
    assert m.names == [n for n, _ in named]
    a, q, qb, k, kb, z = m.weights
    assert _rows_view([q, k]) is not None and _rows_view([qb, kb]) is not None  # still one GEMM's operand each
    assert [s for s, _ in m.spans] == [0, 561, 680, 612, 683, 687]  # a, q, k, then q's and k's biases, z
    decayed, plain = ([list(r) for r in runs] for _, runs in flat.optimizer.runs)
    assert (decayed, plain) == ([[0, 612], [683, 692]], [[612, 683]])
    g = torch.Generator().manual_seed(1)
    for _ in range(5):
        grads = [torch.randn(w.shape, generator=g).to(torch.bfloat16) for w in m.weights]
        ref.step(grads, 1.0)
        flat.step(grads, 1.0)
        assert _compare(ref, flat, torch.bfloat16) < 1e-3
