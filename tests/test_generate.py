"""Generation: the KV cache gives the full forward's logits for every family, cached and
uncached generation agree, sampling, and the prompt and stop-token helpers."""
from types import SimpleNamespace

import pytest
import torch

from model import LoRAConfig, load_model
from model.generate import KVCache, encode_prompt, generate, sample, stop_ids
from tests.helpers import assert_close, interpreter, randomize_lora_b, rel_err
from tests.tiny_models import FAMILIES, save_tiny
from tests.tiny_tokenizer import make_test_tokenizer


@pytest.mark.parametrize("family", FAMILIES)
def test_kv_cache_matches_full_forward(family, tmp_path):
    """Cached logits (prefill, then a chunk, then single tokens) equal the full forward's, and cached
    greedy generation equals uncached greedy generation. Gemma 2/3's window (8) is shorter than the text."""
    save_tiny(family, str(tmp_path))
    model, cfg = load_model(str(tmp_path))
    ids = torch.randint(0, cfg.vocab_size, (2, 20), generator=torch.Generator().manual_seed(0))
    cache = KVCache(cfg, 2, 20, torch.float32, "cpu")
    with torch.no_grad():
        full = model(ids)
        pieces = [model(ids[:, :9], cache=cache), model(ids[:, 9:15], cache=cache)]
        pieces += [model(ids[:, t:t + 1], cache=cache) for t in range(15, 20)]
    assert cache.length == 20
    assert_close(torch.cat(pieces, dim=1), full, atol=1e-5, rtol=1e-5, name=f"{family} cached logits")
    prompt = ids[0, :6].tolist()
    cached = generate(model, prompt, max_new_tokens=12, use_cache=True)
    uncached = generate(model, prompt, max_new_tokens=12, use_cache=False)
    assert cached == uncached and len(cached) == 12


def test_generation_stops_at_a_stop_id(llama_folder):
    model, cfg = load_model(llama_folder)
    prompt = [3, 5, 7]
    free = generate(model, prompt, max_new_tokens=8)
    stop = free[3]
    out = generate(model, prompt, max_new_tokens=8, stop_ids={stop})
    assert out == free[:free.index(stop) + 1]


def test_full_cache_is_refused(llama_folder):
    model, cfg = load_model(llama_folder)
    cache = KVCache(cfg, 1, 4, torch.float32, "cpu")
    with torch.no_grad(), pytest.raises(ValueError, match="holds 4 positions; 5 are needed"):
        model(torch.zeros(1, 5, dtype=torch.long), cache=cache)


def test_sampling():
    logits = torch.tensor([0.0, 3.0, 2.9, -1.0])
    assert sample(logits) == 1
    draws = [sample(logits, temperature=1.0, top_p=0.5, generator=torch.Generator().manual_seed(s)) for s in range(20)]
    assert set(draws) == {1}, "top_p=0.5 keeps only the most likely token here (p = 0.51)"
    draws = [sample(logits, temperature=1.0, top_p=1.0, generator=torch.Generator().manual_seed(s)) for s in range(50)]
    assert {1, 2} <= set(draws)


def test_prompt_and_stop_ids(tmp_path):
    from model import load_tokenizer
    make_test_tokenizer(tmp_path)
    tok = load_tokenizer(str(tmp_path))
    chat = encode_prompt(tok, "Hi", system="Be brief.")
    assert tok.decode(chat, skip_special_tokens=False) == tok.apply_chat_template(
        [{"role": "system", "content": "Be brief."}, {"role": "user", "content": "Hi"}], add_generation_prompt=True)
    assert encode_prompt(tok, "Hi", raw=True) == [tok.bos_id] + tok.encode("Hi")  # this model uses a BOS
    assert stop_ids(tok, SimpleNamespace(eos_token_id=[7, None, tok.eos_id])) == {7, tok.eos_id}
    assert stop_ids(tok, SimpleNamespace(eos_token_id=None)) == {tok.eos_id}


@pytest.mark.parametrize("family", FAMILIES)
def test_static_cache_matches_full_forward(family, tmp_path):
    """A cache made static after the prefill (the CUDA-graphed decoding step's: positions from a device tensor, the
    whole buffer under a mask) gives the full forward's logits, one token at a time, past Gemma's window (8)."""
    save_tiny(family, str(tmp_path))
    model, cfg = load_model(str(tmp_path))
    ids = torch.randint(0, cfg.vocab_size, (2, 20), generator=torch.Generator().manual_seed(1))
    cache = KVCache(cfg, 2, 24, torch.float32, "cpu")  # longer than the text: unwritten positions stay hidden
    at = torch.zeros(1, dtype=torch.long)
    with torch.no_grad():
        full = model(ids)
        pieces = [model(ids[:, :9], cache=cache)]
        cache.make_static(at)
        for t in range(9, 20):
            at.fill_(t)
            pieces.append(model(ids[:, t:t + 1], cache=cache))
    assert_close(torch.cat(pieces, dim=1), full, atol=1e-5, rtol=1e-5, name=f"{family} static-cache logits")


@pytest.mark.parametrize("family, bf16_head_norms", [("llama", False), ("qwen3", False), ("gemma2", False),
                                                     ("gemma3", False), ("qwen3", True)])
@interpreter
def test_decoding_kernels_match_full_forward(family, bf16_head_norms, tmp_path, monkeypatch):
    """With the kernels, a static cache's one-token steps take the decoding kernels (rope into the cache with the
    q/k norms, attention over it in place, each residual add with the norm after it, and with sandwich norms the
    norm before it too) and give the full forward's logits, for grouped kv heads, Qwen3's q/k norms, Gemma 2's
    sandwich norms, softcap and window (8), and Gemma 3's sandwich and q/k norms. The only norm launched alone is
    the first layer's input norm; q/k norms whose weights have another dtype than q run as their own launches."""
    save_tiny(family, str(tmp_path))
    model, cfg = load_model(str(tmp_path), use_kernels=True)
    model.ops.fused_decode = None  # the nine-launch layers; test_fused_decoding_layers covers the five-launch ones
    plain, _ = load_model(str(tmp_path))  # the full forward and the prefill: Triton's interpreter is slow
    if bf16_head_norms:
        for m in (model, plain):
            for layer in m.model.layers:
                layer.self_attn.q_norm.to(torch.bfloat16)
                layer.self_attn.k_norm.to(torch.bfloat16)
    calls = []
    for name in ("decode_attention", "add_rms_norm", "rms_norm"):
        kernel = getattr(model.ops, name)
        monkeypatch.setattr(model.ops, name, lambda *a, _k=kernel, _n=name, **kw: calls.append(_n) or _k(*a, **kw))
    ids = torch.randint(0, cfg.vocab_size, (2, 14), generator=torch.Generator().manual_seed(1))
    cache = KVCache(cfg, 2, 16, torch.float32, "cpu")
    at = torch.zeros(1, dtype=torch.long)
    with torch.no_grad():
        full = plain(ids)
        pieces = [plain(ids[:, :9], cache=cache)]
        cache.make_static(at, torch.tensor([0, 0]))
        for t in range(9, 14):
            at.fill_(t)
            pieces.append(model(ids[:, t:t + 1], cache=cache))
    assert calls.count("decode_attention") == 5 * cfg.n_layers
    assert calls.count("add_rms_norm") == 5 * 2 * cfg.n_layers
    assert calls.count("rms_norm") == 5 * (1 + (2 * cfg.n_layers if bf16_head_norms else 0))
    assert_close(torch.cat(pieces, dim=1), full, atol=1e-5, rtol=1e-5, name=f"{family} decoding-kernel logits")


@pytest.mark.parametrize("family, dtype, tol", [("llama", torch.float32, 2e-5), ("qwen2", torch.float32, 2e-5),
                                                ("qwen3", torch.float32, 2e-5), ("gemma", torch.float32, 2e-5),
                                                ("gemma2", torch.float32, 2e-5), ("gemma3", torch.float32, 2e-5),
                                                ("llama", torch.float16, 2e-2)])
@interpreter
def test_fused_decoding_layers(family, dtype, tol, tmp_path, monkeypatch):
    """With the kernels, the one-token steps of Llama, Qwen2 (its q | k | v bias), Qwen3 (its q and k heads'
    norms), Gemma (GeGLU), Gemma 2 (sandwich norms, softcapped attention, a window) and Gemma 3 (sandwich norms, q/k
    norms, windowed layers) run in five launches a layer
    (norm + q | k | v + RoPE + cache write, attention, o + add, norm + gate | up + SwiGLU, down + add,
    model/decode.py) and give the torch layers' logits and cache, for rows left-padded to different slots. Every
    normalizing GEMM but the first layer's q | k | v reads the `Scaled` rows that the launch before wrote (with
    sandwich norms, a `Sandwich` of them and the residual stream); in fp16 none does (its range)."""
    import copy

    import model.decode as decode
    from kernels.decode_linear import Sandwich, Scaled
    from kernels.decode_qkv import decode_qkv
    from kernels.decode_swiglu import decode_swiglu
    save_tiny(family, str(tmp_path))
    model, cfg = load_model(str(tmp_path), dtype=dtype, use_kernels=True)
    plain, _ = load_model(str(tmp_path), dtype=dtype)  # the prefill and the reference: Triton's interpreter is slow
    calls = []
    for name, fn in (("decode_qkv", decode_qkv), ("decode_swiglu", decode_swiglu)):
        monkeypatch.setattr(decode, name, lambda *a, fn=fn, **kw: calls.append(type(a[0])) or fn(*a, **kw))
    ids = torch.randint(0, cfg.vocab_size, (3, 8), generator=torch.Generator().manual_seed(1))
    prefilled = KVCache(cfg, 3, 9, dtype, "cpu")
    with torch.no_grad():
        plain(ids[:, :6], cache=prefilled)
    logits, caches = [], []
    for run in (model, plain):
        cache, at = copy.deepcopy(prefilled), torch.zeros(1, dtype=torch.long)
        cache.make_static(at, torch.tensor([0, 2, 0]))
        with torch.no_grad():
            for t in range(6, 8):
                at.fill_(t)
                logits.append(run(ids[:, t:t + 1], cache=cache))
        caches.append(torch.stack([torch.stack((c.k, c.v)) for c in cache.layers]))
    written = Sandwich if cfg.sandwich_norm else Scaled if dtype != torch.float16 else torch.Tensor
    assert calls == ([torch.Tensor] + [written] * (2 * cfg.n_layers - 1)) * 2, calls
    assert_close(torch.cat(logits[:2]), torch.cat(logits[2:]), atol=tol, rtol=tol, name=f"{family} logits")
    assert_close(caches[0], caches[1], atol=tol, rtol=tol, name=f"{family} cache")


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")
@pytest.mark.parametrize("family", ["llama", "qwen2", "qwen3", "gemma2", "gemma3"])
def test_fused_decoding_layers_on_gpu(family, tmp_path):
    """bf16 on a GPU with merged adapters (a rollout's sampler): a step's logits through the five-launch layers are as
    close to the same weights' fp32 logits as the nine-launch layers' (the five-launch GEMMs round the norm's output
    once, as x ⊙ w, where the norm rounds it twice), and CUDA-graphed greedy generation runs through both."""
    from model.lora import MergedAdapters
    save_tiny(family, str(tmp_path))
    model, cfg = load_model(str(tmp_path), dtype=torch.bfloat16, device="cuda", use_kernels=True,
                            lora=LoRAConfig(r=4, alpha=8))
    randomize_lora_b(model)
    model.eval()
    exact, _ = load_model(str(tmp_path), device="cuda", lora=LoRAConfig(r=4, alpha=8))
    exact.load_state_dict({k: v.float() for k, v in model.state_dict().items()})
    fused = model.ops.fused_decode
    prompt = torch.randint(0, cfg.vocab_size, (7,), generator=torch.Generator().manual_seed(2)).tolist()
    ids = torch.tensor([prompt], device="cuda")
    runs, logits = [], []
    for run, path in ((model, fused), (model, None), (exact, None)):
        run.ops.fused_decode = path
        runs.append(generate(run, prompt, max_new_tokens=8, temperature=0.0))
        dtype = next(run.parameters()).dtype
        cache, at = KVCache(cfg, 1, 8, dtype, "cuda"), torch.zeros(1, dtype=torch.long, device="cuda")
        with torch.no_grad(), MergedAdapters(run):
            run(ids[:, :6], cache=cache)
            cache.make_static(at)
            at.fill_(6)
            logits.append(run(ids[:, 6:7], cache=cache).float())
    assert [len(r) for r in runs] == [8, 8, 8], runs
    err = [(x - logits[2]).abs().mean().item() for x in logits[:2]]
    assert err[0] <= 1.25 * err[1], f"{family}: mean |error| of the five-launch layers {err[0]:.2e}, nine {err[1]:.2e}"
    for x, name in zip(logits[:2], ("five", "nine")):
        assert_close(x, logits[2], atol=5e-2, rtol=5e-2, name=f"{family} bf16 logits, {name}-launch layers")


@pytest.mark.parametrize("family", ["gemma", "gemma2", "gemma3"])
def test_fused_decoding_layers_leave_sandwich_norms_in_fp16_alone(family):
    """In fp16, Gemma 2/3's sandwich norms keep the model's layers (a sublayer's output times its norm's weight can
    pass fp16's range); Gemma's norms, after the add, take the five-launch layers as Llama's do."""
    from model.config import from_hf_config
    from model.decode import FusedDecode
    from model.transformer import Transformer
    from tests.tiny_models import hf_config
    cfg = from_hf_config(hf_config(family).to_dict())
    with torch.device("meta"):
        model = Transformer(cfg).half()
    x = torch.empty(2, 1, cfg.hidden_size, dtype=torch.float16)
    assert FusedDecode().serves(model, x) is not cfg.sandwich_norm
    assert FusedDecode().serves(model.float(), x.float())


LAYERS = {  # hidden, intermediate, layers, q heads, kv heads, head_dim, architecture: real models' layer shapes
    "Qwen2.5-1.5B": (1536, 8960, 28, 12, 2, 128, "Qwen2ForCausalLM"),
    "Qwen2.5-3B": (2048, 11008, 36, 16, 2, 128, "Qwen2ForCausalLM"),
    "Gemma-3-270M": (640, 2048, 18, 4, 1, 256, "Gemma3ForCausalLM"),
    "Gemma-3-1B": (1152, 6912, 26, 4, 1, 256, "Gemma3ForCausalLM"),
}


@pytest.mark.parametrize("name, served", [("Qwen2.5-1.5B", True), ("Qwen2.5-3B", False), ("Gemma-3-270M", True),
                                          ("Gemma-3-1B", False)])
def test_fused_decoding_layers_serve_small_layers(name, served):
    """The five-launch layers take a step where a layer's weights are small enough that the step costs its launches
    (up to Qwen2.5-1.5B's; with sandwich norms up to Gemma 3 270M's); larger layers keep the nine launches, whose
    cuBLAS GEMMs stream the weights faster (docs/benchmarks.md, "The rollout today, model by model")."""
    from model.config import from_hf_config
    from model.decode import FusedDecode
    from model.transformer import Transformer
    H, inter, n, q, kv, D, arch = LAYERS[name]
    cfg = from_hf_config(dict(architectures=[arch], vocab_size=1024, hidden_size=H, intermediate_size=inter,
                              num_hidden_layers=n, num_attention_heads=q, num_key_value_heads=kv, head_dim=D,
                              hidden_activation="gelu_pytorch_tanh", query_pre_attn_scalar=D, sliding_window=512),
                         name)
    with torch.device("meta"):
        model = Transformer(cfg)
    assert FusedDecode().serves(model, torch.empty(16, 1, H)) is served


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")
@pytest.mark.parametrize("adapters", [True, False], ids=["lora", "base"])
@pytest.mark.parametrize("family", FAMILIES)
@pytest.mark.filterwarnings("error:CUDA graph capture")  # the fallback warns so: here it must not happen
def test_graphed_decoding_matches_eager(family, adapters, tmp_path):
    """On CUDA, generation that replays a CUDA graph per token gives eager generation's tokens (fp32, greedy and
    sampled with one seed), for every family, with LoRA adapters and without; the capture does not fall back."""
    save_tiny(family, str(tmp_path))
    model, cfg = load_model(str(tmp_path), device="cuda", use_kernels=True,
                            lora=LoRAConfig(r=4, alpha=8) if adapters else None)
    if adapters:
        randomize_lora_b(model)
    model.eval()
    prompt = torch.randint(0, cfg.vocab_size, (7,), generator=torch.Generator().manual_seed(2)).tolist()
    for temperature in (0.0, 0.8):
        runs = [generate(model, prompt, max_new_tokens=14, temperature=temperature, cuda_graph=graphed,
                         generator=torch.Generator(device="cuda").manual_seed(3)) for graphed in (True, False)]
        assert runs[0] == runs[1] and len(runs[0]) == 14, runs


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")
def test_decoding_goes_on_eagerly_when_the_capture_fails(llama_folder, monkeypatch):
    """A decoding step that cannot be captured (here: a host sync inside the forward) runs eagerly from then on:
    one warning, the same tokens, sampled from the CUDA generator, which draws again after the failed capture."""
    model, cfg = load_model(llama_folder, device="cuda", use_kernels=True, lora=LoRAConfig(r=4, alpha=8))
    model.eval()
    prompt = list(range(3, 10))
    torch.cuda.manual_seed(0)
    want = generate(model, prompt, max_new_tokens=8, temperature=1.0, cuda_graph=False)
    forward = model.forward

    def syncing(*args, **kwargs):
        logits = forward(*args, **kwargs)
        logits.sum().item()  # a host sync: not allowed inside a capture
        return logits
    monkeypatch.setattr(model, "forward", syncing)
    torch.cuda.manual_seed(0)
    with pytest.warns(UserWarning, match="CUDA graph capture of the decoding step failed"):
        assert generate(model, prompt, max_new_tokens=8, temperature=1.0) == want


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=str)
@pytest.mark.parametrize("kernels", [True, False], ids=["kernels", "torch"])
def test_decoding_with_adapters_on_gpu(llama_folder, dtype, kernels):
    """On CUDA with LoRA adapters (the fused path): one-token decoding steps, whose GEMMs have one row, give the
    full forward's logits, and greedy generation runs, as train.py's samples and scripts/generate.py use it."""
    model, cfg = load_model(llama_folder, dtype=dtype, device="cuda", use_kernels=kernels,
                            lora=LoRAConfig(r=4, alpha=8))
    randomize_lora_b(model)
    model.eval()
    ids = torch.randint(0, cfg.vocab_size, (1, 12), generator=torch.Generator().manual_seed(0)).cuda()
    cache = KVCache(cfg, 1, 12, dtype, "cuda")
    with torch.no_grad():
        full = model(ids).float()
        pieces = [model(ids[:, :8], cache=cache)] + [model(ids[:, t:t + 1], cache=cache) for t in range(8, 12)]
    assert rel_err(torch.cat(pieces, dim=1).float(), full) < (1e-4 if dtype == torch.float32 else 3e-2)
    for graphed in (True, False):
        assert len(generate(model, ids[0, :6].tolist(), max_new_tokens=6, cuda_graph=graphed)) == 6
