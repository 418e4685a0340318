"""GPU: the CUDA paths (flash attention's variable-length kernels for documents and windows, the
Triton kernels) against the CPU references.

Run on a GPU machine with `python -m pytest -m gpu`.
"""
import pytest
import torch

from model import KVCache, LoRAConfig, generate, load_model
from model.lora import lora_parameters
from model.transformer import DocumentMask, attend, attention_mask, documents
from tests.helpers import randomize_lora_b, rel_err
from tests.tiny_models import FAMILIES, save_tiny

pytestmark = [pytest.mark.gpu,
              pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")]


def _packed_batch(vocab, B=2, lens=((13, 11, 8), (20, 12))):
    T = max(sum(l) for l in lens)
    ids = torch.randint(0, vocab, (B, T))
    pos = torch.zeros(B, T, dtype=torch.long)
    doc = torch.zeros(B, T, dtype=torch.long)
    for b, row in enumerate(lens):
        i = 0
        for d, n in enumerate(row):
            pos[b, i:i + n] = torch.arange(n)
            doc[b, i:i + n] = d
            i += n
        doc[b, i:] = len(row)  # padding: a document of its own
        pos[b, i:] = torch.arange(T - i)
    targets = torch.randint(0, vocab, (B, T))
    targets[doc == doc.max()] = -100
    return ids, pos, doc, targets


# Rows of 128 and of 32 tokens. In fp32 both take SDPA with a dense mask (flash takes fp16/bf16 only).
LENGTHS = {"long": ((60, 40, 28), (100, 20)), "short": ((13, 11, 8), (20, 7))}


def _cpu_and_cuda(folder, batch, cuda_dtype, use_kernels):
    """{device: (loss, LoRA grads)} of one packed batch: the fp32 CPU reference, and CUDA in cuda_dtype."""
    ids, pos, doc, targets = batch
    out = {}
    for dev, dtype, kern in (("cpu", torch.float32, False), ("cuda", cuda_dtype, use_kernels)):
        model, _ = load_model(folder, device=dev, dtype=dtype, lora=LoRAConfig(r=4, alpha=8), use_kernels=kern,
                              lora_seed=1)
        randomize_lora_b(model)
        loss = model(ids.to(dev), pos.to(dev), doc.to(dev), targets=targets.to(dev))
        loss.backward()
        out[dev] = (loss.detach().cpu(), {n: p.grad.cpu() for n, p in lora_parameters(model)})
    return out


@pytest.mark.parametrize("family", FAMILIES)
@pytest.mark.parametrize("use_kernels", [False, True])
@pytest.mark.parametrize("path", ["long", "short"])
def test_cuda_packed_matches_cpu_reference(family, use_kernels, path, tmp_path):
    """Packed and padded rows (document masks, softcap and sliding window on GPU) give the CPU
    reference's loss and LoRA gradients in fp32."""
    save_tiny(family, str(tmp_path))
    out = _cpu_and_cuda(str(tmp_path), _packed_batch(256, lens=LENGTHS[path]), torch.float32, use_kernels)
    assert rel_err(out["cuda"][0], out["cpu"][0]) < 1e-4
    for n, g in out["cpu"][1].items():
        assert rel_err(out["cuda"][1][n], g) < 2e-3, n  # tf32 reductions on GPU


@pytest.mark.parametrize("family", ["llama", "gemma2"])
def test_cuda_bf16_training_step_is_finite(family, tmp_path):
    save_tiny(family, str(tmp_path))
    model, _ = load_model(str(tmp_path), dtype=torch.bfloat16, device="cuda", lora=LoRAConfig(r=4),
                          use_kernels=True, gradient_checkpointing=True)
    ids, pos, doc, targets = _packed_batch(256)
    loss = model(ids.cuda(), pos.cuda(), doc.cuda(), targets=targets.cuda())
    loss.backward()
    assert loss.dtype == torch.float32 and torch.isfinite(loss)
    for n, p in lora_parameters(model):
        assert p.grad.dtype == torch.float32 and torch.isfinite(p.grad).all(), n


@pytest.mark.parametrize("family", ["llama", "gemma2"])
@pytest.mark.parametrize("path", ["long", "short"])
def test_cuda_checkpointing_matches_no_checkpointing(family, path, tmp_path):
    """Reentrant checkpointing (and with activation offload) recomputes each layer exactly: the same
    loss and LoRA gradients as one plain pass, in fp32 with the Triton kernels."""
    save_tiny(family, str(tmp_path))
    ids, pos, doc, targets = (t.cuda() for t in _packed_batch(256, lens=LENGTHS[path]))
    model, _ = load_model(str(tmp_path), device="cuda", lora=LoRAConfig(r=4, alpha=8), use_kernels=True,
                          lora_seed=1)
    randomize_lora_b(model)
    out = {}
    for mode in ("off", "on", "on+offload"):
        model.gradient_checkpointing = mode != "off"
        model.offload_activations = mode == "on+offload"
        loss = model(ids, pos, doc, targets=targets)
        loss.backward()
        out[mode] = (loss.detach(), {n: p.grad.clone() for n, p in lora_parameters(model)})
        model.zero_grad(set_to_none=True)
    for mode in ("on", "on+offload"):
        assert rel_err(out[mode][0], out["off"][0]) < 1e-6, mode
        for n, g in out["off"][1].items():
            assert rel_err(out[mode][1][n], g) < 1e-5, (mode, n)


@pytest.mark.parametrize("family", FAMILIES)
def test_cuda_kv_cache_matches_full_forward(family, tmp_path):
    """On CUDA with the Triton kernels, in fp32: cached logits (prefill, then single tokens, past
    Gemma 2/3's window of 8) equal the full forward's, and cached greedy generation equals uncached."""
    save_tiny(family, str(tmp_path))
    model, cfg = load_model(str(tmp_path), device="cuda", use_kernels=True)
    ids = torch.randint(0, cfg.vocab_size, (2, 20), generator=torch.Generator().manual_seed(0)).cuda()
    cache = KVCache(cfg, 2, 20, torch.float32, "cuda")
    with torch.no_grad():
        full = model(ids)
        pieces = [model(ids[:, :12], cache=cache)] + [model(ids[:, t:t + 1], cache=cache) for t in range(12, 20)]
    assert rel_err(torch.cat(pieces, dim=1), full) < 1e-4
    prompt = ids[0, :6].tolist()
    assert generate(model, prompt, max_new_tokens=10) == generate(model, prompt, max_new_tokens=10, use_cache=False)


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16], ids=str)
@pytest.mark.parametrize("window", [None, 5])
@pytest.mark.parametrize("heads", [(4, 4), (8, 2)], ids=["mha", "gqa"])
@pytest.mark.parametrize("bucket", [False, True], ids=["exact", "bucketed"])
def test_varlen_attention_matches_dense_mask(dtype, window, heads, bucket):
    """Flash attention's variable-length kernels (DocumentMask) give the float64 dense-mask attention's
    output and q, k, v gradients for packed and padded rows, with a window and grouped kv heads, and
    with the documents bucketed as a CUDA graph's step pads them (empty documents, a larger max_len)."""
    torch.manual_seed(0)
    Hq, Hk = heads
    _, _, doc, _ = _packed_batch(256, lens=LENGTHS["long"])
    doc = doc.cuda()
    B, T = doc.shape
    q, k, v = (torch.randn(B, h, T, 32, device="cuda", dtype=dtype, requires_grad=True) for h in (Hq, Hk, Hk))
    dy = torch.randn(B, Hq, T, 32, device="cuda", dtype=dtype)
    y = attend(q, k, v, DocumentMask(documents(doc, bucket=bucket), window), 32 ** -0.5, None)
    assert y.dtype == dtype and y.shape == (B, Hq, T, 32)
    grads = torch.autograd.grad(y, (q, k, v), dy)
    ref_in = [t.detach().double().requires_grad_() for t in (q, k, v)]
    mask = attention_mask(T, window, "cuda", doc)
    kr, vr = (t.repeat_interleave(Hq // Hk, dim=1) for t in ref_in[1:])
    y_ref = torch.softmax((ref_in[0] @ kr.transpose(-1, -2) * 32 ** -0.5).masked_fill(~mask, float("-inf")), -1) @ vr
    ref_grads = torch.autograd.grad(y_ref, ref_in, dy.double())
    tol = 2e-2 if dtype == torch.bfloat16 else 4e-3
    assert rel_err(y.double(), y_ref) < tol
    for g, r, name in zip(grads, ref_grads, "qkv"):
        assert g.dtype == dtype and rel_err(g.double(), r) < tol, name


@pytest.mark.parametrize("family", FAMILIES)
def test_cuda_bf16_packed_loss_matches_cpu_reference(family, tmp_path):
    """In bf16 on GPU (documents and windows through the variable-length kernels, softcapped layers
    through the softcapped flash kernel) the loss and LoRA gradients of packed rows follow the fp32 CPU reference."""
    save_tiny(family, str(tmp_path))
    out = _cpu_and_cuda(str(tmp_path), _packed_batch(256, lens=LENGTHS["long"]), torch.bfloat16, True)
    assert rel_err(out["cuda"][0], out["cpu"][0]) < 2e-2
    for n, g in out["cpu"][1].items():
        assert rel_err(out["cuda"][1][n], g) < 1e-1, n
