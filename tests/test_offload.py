"""Activation offload (model/offload.py): checkpointed layer inputs kept in CPU memory.

On CPU: the same loss and gradients as checkpointing alone, buffers kept from step to step and
grown for a longer batch, and a clear error when a second forward would overwrite the inputs a
pending backward needs; the attention outputs that travel with the inputs, so that the recompute runs
attention's backward alone. On GPU (`pytest -m gpu`): the same results through the side-stream copies,
and a peak memory that holds about two layer inputs instead of all of them.
"""
import weakref
from typing import NamedTuple

import pytest
import torch
from torch.utils._python_dispatch import TorchDispatchMode

import model.offload
from model import LoRAConfig, ModelConfig, Transformer, load_model
from model.lora import lora_parameters
from model.transformer import copies_hidden
from tests.helpers import BaseGemms, randomize_lora_b, rel_err

gpu = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")


def _batch(vocab, B, T, device, seed=0):
    g = torch.Generator().manual_seed(seed)
    ids = torch.randint(0, vocab, (B, T + 1), generator=g).to(device)
    return ids[:, :-1], ids[:, 1:]


def _loss_and_grads(model, ids, targets, **batch):
    model.zero_grad(set_to_none=True)
    loss = model(ids, targets=targets, **batch)
    loss.backward()
    return loss.detach(), {n: p.grad.clone() for n, p in lora_parameters(model)}


def _modes(model, ids, targets):
    """loss and LoRA gradients without checkpointing, with it, and with it and offload."""
    out = {}
    for mode in ("off", "on", "offload"):
        model.gradient_checkpointing = mode != "off"
        model.offload_activations = mode == "offload"
        out[mode] = _loss_and_grads(model, ids, targets)
    return out


def _assert_same(out, tol):
    for mode in ("on", "offload"):
        assert rel_err(out[mode][0], out["off"][0]) < tol, mode
        for n, g in out["off"][1].items():
            assert rel_err(out[mode][1][n], g) < tol, (mode, n)


def test_offload_gives_the_checkpointed_results(llama_folder):
    model, cfg = load_model(llama_folder, lora=LoRAConfig(r=4, alpha=8))
    randomize_lora_b(model)
    ids, targets = _batch(cfg.vocab_size, 2, 24, "cpu")
    out = _modes(model, ids, targets)
    _assert_same(out, 1e-6)
    assert torch.equal(out["offload"][0], out["on"][0])


@pytest.mark.parametrize("offload", [False, True])
def test_offloaded_inputs_are_freed_after_forward(llama_folder, offload):
    """Checkpointing alone keeps the second layer's input alive until backward; offload lets it go."""
    model, cfg = load_model(llama_folder, lora=LoRAConfig(r=4), gradient_checkpointing=True,
                            offload_activations=offload)
    inputs = []
    model.model.layers[1].register_forward_pre_hook(lambda _, args: inputs.append(weakref.ref(args[0])))
    ids, targets = _batch(cfg.vocab_size, 2, 16, "cpu")
    loss = model(ids, targets=targets)
    assert (inputs[0]() is None) == offload
    loss.backward()


def test_offload_buffers_are_kept_and_grown(llama_folder):
    """Every step reuses the layer buffers; a longer batch grows them (at least doubled), a shorter one fits."""
    model, cfg = load_model(llama_folder, lora=LoRAConfig(r=4), gradient_checkpointing=True,
                            offload_activations=True)
    off = model.offload
    _loss_and_grads(model, *_batch(cfg.vocab_size, 2, 16, "cpu"))
    first = dict(off.buffers)
    assert sorted(first) == list(range(cfg.n_layers))
    assert all(b.numel() == 2 * 16 * cfg.hidden_size for b in first.values())
    _loss_and_grads(model, *_batch(cfg.vocab_size, 2, 16, "cpu", seed=1))
    assert all(off.buffers[i] is b for i, b in first.items())
    _loss_and_grads(model, *_batch(cfg.vocab_size, 2, 20, "cpu"))
    assert all(off.buffers[i].numel() == 2 * first[i].numel() for i in first)
    grown = dict(off.buffers)
    _loss_and_grads(model, *_batch(cfg.vocab_size, 1, 8, "cpu"))
    assert all(off.buffers[i] is b for i, b in grown.items())


def test_reserve_makes_the_buffers_a_forward_would(llama_folder):
    """reserve_offload (before a CUDA graph's capture) makes each layer's buffer for a batch shape, as that forward
    would, so the forward then reuses them; nothing without offload."""
    model, cfg = load_model(llama_folder, lora=LoRAConfig(r=4), gradient_checkpointing=True, offload_activations=True)
    model.reserve_offload(2, 16)
    reserved = dict(model.offload.buffers)
    assert sorted(reserved) == list(range(cfg.n_layers))
    assert all(b.numel() == 2 * 16 * cfg.hidden_size and b.dtype == torch.float32 for b in reserved.values())
    _loss_and_grads(model, *_batch(cfg.vocab_size, 2, 16, "cpu"))
    assert all(model.offload.buffers[i] is b for i, b in reserved.items())
    model.offload_activations = False
    model.reserve_offload(4, 16)
    assert all(model.offload.buffers[i] is b for i, b in reserved.items())


def test_a_second_forward_before_backward_is_refused(llama_folder):
    """The buffers hold one forward's inputs: backward through an older forward would read the newer ones."""
    model, cfg = load_model(llama_folder, lora=LoRAConfig(r=4), gradient_checkpointing=True,
                            offload_activations=True)
    ids, targets = _batch(cfg.vocab_size, 2, 16, "cpu")
    first = model(ids, targets=targets)
    model(ids.flip(1), targets=targets)
    with pytest.raises(RuntimeError, match="run backward before the next forward"):
        first.backward()


class AttentionCalls(TorchDispatchMode):
    """Counts the attention kernels' forward and backward ops that run inside the block."""

    FORWARDS = ("_scaled_dot_product_flash_attention_for_cpu", "_scaled_dot_product_cudnn_attention",
                "_flash_attention_forward")

    def __init__(self):
        super().__init__()
        self.forward = self.backward = 0

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        name = func.overloadpacket.__name__
        self.forward += name in self.FORWARDS
        self.backward += name.endswith("_backward") and name.removesuffix("_backward") in self.FORWARDS + (
            "_flash_attention",)
        return func(*args, **(kwargs or {}))


class Counts(NamedTuple):
    forward: int  # attention's forward kernels
    backward: int  # and its backward kernels
    reads: int  # the GEMMs that read o's base weight
    qkv_reads: int  # and those that read q | k | v's


def _counted(model, *batch, **kw):
    attns = [layer.self_attn for layer in model.model.layers]
    with AttentionCalls() as calls, BaseGemms(*(a.o_proj.weight for a in attns)) as o, \
            BaseGemms(*(a.q_proj.weight for a in attns)) as qkv:
        out = _loss_and_grads(model, *batch, **kw)
    return out, Counts(calls.forward, calls.backward, o.count, qkv.count)


def test_offload_keeps_the_attention_and_projection_outputs_for_the_recompute(llama_folder):
    """With offload, each layer's first run hands its attention output and log-sum-exp, q | k | v's output and o's
    output to the offload; the recompute runs attention's backward on the first two, and the projections' Functions
    take the others as their outputs: one attention forward a layer, not two (checkpointing alone), q | k | v's and
    o's weights read twice a layer (their forward, their input's gradient), not three times, and the same loss and
    gradients, bit for bit (the same kernels, on the same q, k, v)."""
    model, cfg = load_model(llama_folder, lora=LoRAConfig(r=4, alpha=8), gradient_checkpointing=True)
    randomize_lora_b(model)
    batch = _batch(cfg.vocab_size, 2, 24, "cpu")
    (loss, grads), recomputing = _counted(model, *batch)
    n = cfg.n_layers
    assert recomputing == (2 * n, n, 3 * n, 3 * n)
    model.offload_activations = True
    (kept_loss, kept_grads), kept = _counted(model, *batch)
    assert kept == (n, n, 2 * n, 2 * n)
    assert torch.equal(kept_loss, loss)
    for name, g in grads.items():
        assert torch.equal(kept_grads[name], g), name
    tokens = 2 * 24
    sizes = (tokens * cfg.n_heads * cfg.head_dim, tokens * cfg.n_heads, tokens * cfg.hidden_size,
             tokens * (cfg.n_heads + 2 * cfg.n_kv_heads) * cfg.head_dim)
    assert sorted(model.offload.kept_buffers) == [(i, s) for i in range(n) for s in range(4)]
    assert all(b.numel() == sizes[s] for (_, s), b in model.offload.kept_buffers.items())
    model.zero_grad(set_to_none=True)
    model(*batch[:1], targets=batch[1])  # a forward without backward leaves nothing kept behind for the next one
    (again, _), calls = _counted(model, *batch)
    assert torch.equal(again, loss) and calls == kept


def test_dora_on_o_keeps_the_attention_output_alone(llama_folder):
    """DoRA's backward reads o's output before its scaling, which is not kept: with DoRA the recompute runs o again
    (and not attention), with the same results."""
    model, cfg = load_model(llama_folder, lora=LoRAConfig(r=4, alpha=8, dora=True), gradient_checkpointing=True)
    randomize_lora_b(model)
    batch = _batch(cfg.vocab_size, 2, 24, "cpu")
    (loss, grads), _ = _counted(model, *batch)
    model.offload_activations = True
    (kept_loss, kept_grads), kept = _counted(model, *batch)
    assert kept.forward == cfg.n_layers and len(model.offload.kept_buffers) == 2 * cfg.n_layers
    assert torch.equal(kept_loss, loss) and all(torch.equal(kept_grads[n], g) for n, g in grads.items())


@pytest.mark.parametrize("spare", ["all", "o", "attention", "none"])
def test_outputs_are_kept_where_the_host_has_room(llama_folder, monkeypatch, spare):
    """The kept outputs more than double the host memory a forward holds: they may take half of what the host has
    available once the layer inputs' buffers are made. At the limit of all four, all are kept; a byte less, the
    attention's two and o's output (then the recompute runs q | k | v again); a byte under their limit, the
    attention's two (o again too); a byte under theirs, none (the recompute attends again), with the same results,
    and no buffer is made for what is not kept."""
    net, cfg = load_model(llama_folder, lora=LoRAConfig(r=4, alpha=8), gradient_checkpointing=True,
                          offload_activations=True)
    tokens, size = 2 * 24, 4  # fp32
    inputs = cfg.n_layers * tokens * cfg.hidden_size * size
    attention = cfg.n_layers * tokens * cfg.n_heads * (cfg.head_dim + 1) * size  # the outputs and log-sum-exps
    qkv = cfg.n_layers * tokens * (cfg.n_heads + 2 * cfg.n_kv_heads) * cfg.head_dim * size
    outputs = cfg.n_layers * tokens * cfg.hidden_size * size
    available = {"all": inputs + 2 * (attention + outputs + qkv), "o": inputs + 2 * (attention + outputs + qkv) - 1,
                 "attention": inputs + 2 * (attention + outputs) - 1, "none": inputs + 2 * attention - 1}[spare]
    monkeypatch.setattr(model.offload, "host_available", lambda: available)
    net.reserve_offload(2, 24)
    (_, _), calls = _counted(net, *_batch(cfg.vocab_size, 2, 24, "cpu"))
    n = cfg.n_layers
    assert (calls.forward, calls.qkv_reads, calls.reads, len(net.offload.kept_buffers)) == {
        "all": (n, 2 * n, 2 * n, 4 * n), "o": (n, 3 * n, 2 * n, 3 * n), "attention": (n, 3 * n, 3 * n, 2 * n),
        "none": (2 * n, 3 * n, 3 * n, 0)}[spare]
    assert len(net.offload.buffers) == cfg.n_layers


def test_packed_rows_on_cpu_recompute_their_attention(llama_folder):
    """On a CPU, documents attend through a dense mask, whose kernel returns no log-sum-exp: their attention is
    recomputed, with or without offload, with the same results."""
    net, cfg = load_model(llama_folder, lora=LoRAConfig(r=4, alpha=8), gradient_checkpointing=True,
                          offload_activations=True)
    randomize_lora_b(net)
    ids, targets = _batch(cfg.vocab_size, 2, 24, "cpu")
    doc_ids = torch.cat([torch.zeros(2, 10, dtype=torch.long), torch.ones(2, 14, dtype=torch.long)], dim=1)
    positions = torch.cat([torch.arange(10), torch.arange(14)]).expand(2, 24)
    out = {}
    for offload in (False, True):
        net.offload_activations = offload
        out[offload] = _counted(net, ids, targets, position_ids=positions, doc_ids=doc_ids)
    (loss, grads), calls = out[False]
    (kept_loss, kept_grads), kept_calls = out[True]
    assert (kept_calls.forward, kept_calls.backward) == (calls.forward, calls.backward)
    assert torch.equal(kept_loss, loss) and all(torch.equal(kept_grads[n], g) for n, g in grads.items())
    assert net.offload.kept_buffers == {}


def test_reserve_makes_the_kept_buffers(llama_folder):
    """reserve_offload also makes the buffers of what each layer hands over, as the forward would."""
    net, cfg = load_model(llama_folder, lora=LoRAConfig(r=4), gradient_checkpointing=True, offload_activations=True)
    net.reserve_offload(2, 16)
    reserved = dict(net.offload.kept_buffers)
    assert len(reserved) == 4 * cfg.n_layers
    _loss_and_grads(net, *_batch(cfg.vocab_size, 2, 16, "cpu"))
    assert all(net.offload.kept_buffers[k] is b for k, b in reserved.items())


def test_offload_without_checkpointing_keeps_nothing(llama_folder):
    """offload_activations acts on the checkpointed inputs only: without checkpointing it is a no-op."""
    model, cfg = load_model(llama_folder, lora=LoRAConfig(r=4), offload_activations=True)
    _loss_and_grads(model, *_batch(cfg.vocab_size, 2, 16, "cpu"))
    assert model.offload.buffers == {}


@pytest.mark.gpu
@gpu
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=str)
def test_cuda_offload_gives_the_checkpointed_results(llama_folder, dtype):
    model, cfg = load_model(llama_folder, dtype=dtype, device="cuda", lora=LoRAConfig(r=4, alpha=8),
                            use_kernels=True)
    randomize_lora_b(model)
    ids, targets = _batch(cfg.vocab_size, 2, 256, "cuda")
    out = _modes(model, ids, targets)
    _assert_same(out, 1e-5 if dtype == torch.float32 else 2e-2)
    assert torch.equal(out["offload"][0], out["on"][0])  # the same kernels on the same inputs
    for n, g in out["on"][1].items():
        assert torch.equal(out["offload"][1][n], g), n
    assert all(b.is_pinned() for b in model.offload.buffers.values())


@pytest.mark.gpu
@gpu
def test_cuda_offload_buffers_are_page_locked_at_their_own_size(llama_folder):
    """torch's pinned allocator would round a 2 x 24-token layer input up to a power of two: the offload's buffers
    are registered with the driver at exactly the size they hold, and they still read as pinned."""
    model, cfg = load_model(llama_folder, device="cuda", lora=LoRAConfig(r=4), gradient_checkpointing=True,
                            offload_activations=True)
    _loss_and_grads(model, *_batch(cfg.vocab_size, 2, 24, "cuda"))
    buffers = list(model.offload.buffers.values())
    assert len(buffers) == cfg.n_layers and [id(b) for b in model.offload.pinned] == [id(b) for b in buffers]
    assert all(b.is_pinned() and b.numel() == 2 * 24 * cfg.hidden_size for b in buffers)
    model.reserve_offload(2, 40)  # a longer batch's, before a capture: at least doubled, as a forward grows them
    assert all(b.is_pinned() and b.numel() == 2 * 48 * cfg.hidden_size for b in model.offload.buffers.values())
    assert len(model.offload.pinned) == 2 * cfg.n_layers


@pytest.mark.gpu
@gpu
def test_cuda_offload_lowers_peak_memory():
    """With 16 layers whose inputs dominate, offload keeps about two of them on the GPU, not sixteen."""
    cfg = ModelConfig(vocab_size=512, hidden_size=256, intermediate_size=512, n_layers=16, n_heads=4,
                      n_kv_heads=2, head_dim=64)
    torch.manual_seed(0)
    model = Transformer(cfg, lora=LoRAConfig(r=4), use_kernels=True, gradient_checkpointing=True).cuda()
    with torch.no_grad():
        for p in model.parameters():
            p.normal_(0, 0.02)
    for n, p in model.named_parameters():
        p.requires_grad_("lora_" in n)
    ids, targets = _batch(cfg.vocab_size, 8, 2048, "cuda")
    layer_input = 8 * 2048 * cfg.hidden_size * 4  # fp32: 16 MiB
    peaks = {}
    for offload in (True, False, True):  # the first step warms up (cuBLAS workspace, buffers); the last counts
        model.offload_activations = offload
        torch.cuda.synchronize()
        torch.cuda.reset_peak_memory_stats()
        model(ids, targets=targets).backward()
        torch.cuda.synchronize()
        peaks[offload] = torch.cuda.max_memory_allocated()
    assert peaks[False] - peaks[True] > 10 * layer_input, (peaks, layer_input)


@pytest.mark.gpu
@gpu
@pytest.mark.parametrize("packed", [False, True], ids=["rows", "documents"])
def test_cuda_offload_keeps_the_attention_output(llama_folder, packed, monkeypatch):
    """bf16 on a GPU: plain causal rows keep cuDNN's attention output (its backward called without a bias), and
    documents the variable-length kernels' output; either way one attention forward a layer, not two, q | k | v's
    and o's weights read twice a layer, not three times, and the gradients of the path that recomputes them (cuDNN's
    bit for bit; the variable-length backward sums dq in another order from run to run). The tiny model's layers are
    far too small to hide the copies (`copies_hidden`): it keeps nothing unless the threshold is lifted."""
    monkeypatch.setattr(model.transformer, "KEPT_FLOPS_PER_BYTE", 0)
    net, cfg = load_model(llama_folder, dtype=torch.bfloat16, device="cuda", lora=LoRAConfig(r=4, alpha=8),
                          use_kernels=True, gradient_checkpointing=True)
    randomize_lora_b(net)
    ids, targets = _batch(cfg.vocab_size, 2, 256, "cuda")
    batch = {}
    if packed:
        cut = torch.tensor([100, 156])
        batch["doc_ids"] = torch.cat([torch.zeros(2, 100), torch.ones(2, 156)], dim=1).long().cuda()
        batch["position_ids"] = torch.cat([torch.arange(c) for c in cut]).expand(2, 256).cuda()
    out = {}
    for offload in (False, True):
        net.offload_activations = offload
        out[offload] = _counted(net, ids, targets, **batch)
    (loss, grads), calls = out[False]
    (kept_loss, kept_grads), kept = out[True]
    n = cfg.n_layers
    assert calls == (2 * n, n, 3 * n, 3 * n) and kept == (n, n, 2 * n, 2 * n)
    assert torch.equal(kept_loss, loss)
    for n, g in grads.items():
        assert torch.equal(kept_grads[n], g) if not packed else rel_err(kept_grads[n], g) < 1e-2, n
    kept_buffers = net.offload.kept_buffers
    assert len(kept_buffers) == 4 * cfg.n_layers and all(b.is_pinned() for b in kept_buffers.values())
    monkeypatch.setattr(model.transformer, "KEPT_FLOPS_PER_BYTE", 4000)
    assert net.kept_tensors(2, 256, torch.bfloat16) == ()


@pytest.mark.gpu
@gpu
def test_an_offload_freed_during_a_capture_unlocks_its_buffers_after_it():
    """The garbage collector may free an offload inside another model's CUDA graph capture, which refuses the
    driver's calls: its page-locked buffers are unlocked (and freed) after the capture, when the next buffer is made,
    and the capture is not broken."""
    offload = model.offload.ActivationOffload()
    offload.reserve(2, 1 << 16, torch.bfloat16, cuda=True)
    assert len(offload.pinned) == 2
    x = torch.zeros(4, device="cuda")
    graph = torch.cuda.CUDAGraph()
    torch.cuda.synchronize()
    with torch.cuda.graph(graph):
        del offload  # its finalizer runs here
        x += 1
    assert len(model.offload._deferred) == 2
    graph.replay()
    torch.cuda.synchronize()
    assert x.tolist() == [1.0] * 4
    model.offload.ActivationOffload().reserve(1, 16, torch.bfloat16, cuda=True)
    assert model.offload._deferred == []


def _shape(hidden, intermediate, heads, kv_heads, head_dim=None):
    return ModelConfig(vocab_size=32000, hidden_size=hidden, intermediate_size=intermediate, n_layers=2,
                       n_heads=heads, n_kv_heads=kv_heads, head_dim=head_dim or hidden // heads)


@pytest.mark.parametrize("shape, seqlen, kept, hidden", [
    (_shape(576, 1536, 9, 3), 512, 2, False),  # SmolLM2-135M at 8 x 512: slower with o's output kept too (H100)
    (_shape(576, 1536, 9, 3), 512, 1, False),  # and level with the attention's alone
    (_shape(576, 1536, 9, 3), 8192, 1, True),  # its attention's work grows with the length, the copies do not
    (_shape(896, 4864, 14, 2), 2048, 2, True),  # Qwen2.5-0.5B at 4 x 2048: faster with o's kept (H100)
    (_shape(896, 4864, 14, 2), 2048, 3, False),  # slower with q | k | v's too (H200)
    (_shape(2048, 5632, 32, 4), 2048, 2, True),  # TinyLlama at 4 x 2048: faster with o's kept (H100)
    (_shape(2048, 5632, 32, 4), 2048, 3, False),  # slower with q | k | v's too (H200)
    (_shape(4096, 14336, 32, 8), 2048, 3, True),  # Llama-3.1-8B: faster with all of them (H200)
], ids=["smollm2 o", "smollm2 attention", "smollm2 8k", "qwen2.5-0.5b o", "qwen2.5-0.5b qkv", "tinyllama o",
        "tinyllama qkv", "llama-3.1-8b"])
def test_kept_tensors_go_where_the_layers_work_hides_their_copies(shape, seqlen, kept, hidden):
    """On a GPU a layer hands tensors over only where its forward hides their copies to the host: the shapes measured
    on an H100 or H200 (bf16: the layer input, the attention output and log-sum-exp, o's output, q | k | v's output;
    `kept` of the last three kinds), against the layer's GEMM and attention FLOPs a token."""
    h, heads, d = shape.hidden_size, shape.n_heads, shape.head_dim
    copied = 2 * h + (2 * heads * d + 4 * heads) + (2 * h if kept >= 2 else 0) + (
        2 * (heads + 2 * shape.n_kv_heads) * d if kept == 3 else 0)
    assert copies_hidden(shape, seqlen, copied) == hidden
