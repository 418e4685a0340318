"""Sample from a model (optionally with a LoRA adapter), with a KV cache.

    python scripts/generate.py --model smollm2.gguf --prompt "Name three rivers in Europe."
    python scripts/generate.py --model tinyllama --adapter out/adapter --prompt "..." --temperature 0.7
    python scripts/generate.py --model ./base --raw --prompt "Once upon a time"   # no chat template

--prompt is sent as one user message through the model's chat template (with
--add-generation-prompt, i.e. the assistant header), unless --raw. Generation stops at the
tokenizer's EOS or after --max-new-tokens.

The KV cache. Generating token t+1 needs the keys and values of every earlier position in
every layer; they never change, so they are computed once and kept. The prompt is run in one
pass (prefill) that fills the cache; each new token then runs only its own position through
the layers (decode), attending to the cached keys. `forward_cached` does this with the
model's own modules: projections, norms, MLP and RoPE are the ones Transformer.forward uses,
only the attention reads keys and values from the cache. Its logits equal the full forward's
(tests/test_gguf.py checks this for every family).
"""
import argparse
import os
import sys

import torch

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))  # the repo root, for `model`

from model import load_model, load_tokenizer  # noqa: E402
from model.adapters import load_adapter, read_adapter_config  # noqa: E402
from model.transformer import attend, rope_cos_sin, rope_inv_freq  # noqa: E402


class KVCache:
    """Keys and values of every layer, for up to `max_len` positions; `length` are filled."""

    def __init__(self, cfg, batch, max_len, dtype, device):
        shape = (cfg.n_layers, batch, cfg.n_kv_heads, max_len, cfg.head_dim)
        self.k = torch.zeros(shape, dtype=dtype, device=device)
        self.v = torch.zeros(shape, dtype=dtype, device=device)
        self.length = 0

    def update(self, layer, k, v):
        """Store k, v (B, nkv, T, d) after the filled positions; return all of the layer's (B, nkv, S, d)."""
        end = self.length + k.shape[2]
        self.k[layer, :, :, self.length:end] = k
        self.v[layer, :, :, self.length:end] = v
        return self.k[layer, :, :, :end], self.v[layer, :, :, :end]


def _attention(attn, x, cos, sin, mask, cache, i):
    """model.transformer.Attention.forward, with keys and values from (and into) the cache."""
    B, T, _ = x.shape
    q = attn.q_proj(x).view(B, T, attn.nh, attn.d)
    k = attn.k_proj(x).view(B, T, attn.nkv, attn.d)
    v = attn.v_proj(x).view(B, T, attn.nkv, attn.d)
    if attn.qk_norm:
        q, k = attn.q_norm(q), attn.k_norm(k)
    q, k = attn.ops.rope(q, k, cos, sin)  # (B, T, nh, d), (B, T, nkv, d)
    k, v = cache.update(i, k.transpose(1, 2), v.transpose(1, 2))  # (B, nkv, S, d)
    y = attend(q.transpose(1, 2), k, v, mask, attn.scale, attn.softcap)  # (B, nh, T, d)
    return attn.o_proj(y.transpose(1, 2).reshape(B, T, attn.nh * attn.d))


@torch.no_grad()
def forward_cached(model, ids, cache: KVCache):
    """Logits (B, T, V) of `ids` (B, T), the continuation of the positions already in `cache`
    (none for the prompt). Mirrors Transformer.forward; the cache is extended in place."""
    cfg = model.config
    B, T = ids.shape
    start, end = cache.length, cache.length + T
    q_pos = torch.arange(start, end, device=ids.device)
    k_pos = torch.arange(end, device=ids.device)
    x = model.model.embed_tokens(ids)  # (B, T, H)
    if cfg.embed_scale != 1.0:
        x = x * torch.tensor(cfg.embed_scale, dtype=x.dtype)
    tables, masks = {}, {}
    for t in set(cfg.layer_types):
        tables[t] = rope_cos_sin(q_pos.expand(B, T), rope_inv_freq(cfg, t, ids.device), x.dtype)
        keep = k_pos[None, :] <= q_pos[:, None]  # (T, S): causal
        if t == "sliding" and cfg.sliding_window is not None:
            keep = keep & (q_pos[:, None] - k_pos[None, :] < cfg.sliding_window)
        masks[t] = keep.expand(B, 1, T, end)
    for i, layer in enumerate(model.model.layers):  # DecoderLayer.forward, with the cached attention
        cos, sin = tables[layer.layer_type]
        a = _attention(layer.self_attn, layer.input_layernorm(x), cos, sin, masks[layer.layer_type], cache, i)
        if layer.sandwich:
            x = x + layer.post_attention_layernorm(a)
            x = x + layer.post_feedforward_layernorm(layer.mlp(layer.pre_feedforward_layernorm(x)))
        else:
            x = x + a
            x = x + layer.mlp(layer.post_attention_layernorm(x))
    cache.length = end
    logits = model.lm_head(model.model.norm(x))
    if cfg.final_softcap is not None:
        logits = cfg.final_softcap * torch.tanh(logits / cfg.final_softcap)
    return logits


def sample(logits, temperature=0.0, top_p=1.0, generator=None) -> int:
    """One token id from logits (V,): the argmax at temperature 0; else from softmax(logits / T)
    cut to the smallest set of most likely tokens whose probability reaches top_p (nucleus
    sampling, Holtzman et al. 2019)."""
    if temperature == 0:
        return int(logits.argmax())
    probs = torch.softmax(logits.float() / temperature, dim=-1)
    p, idx = probs.sort(descending=True)
    p = p * (p.cumsum(-1) - p < top_p)  # keep a token while the mass before it is below top_p
    return int(idx[torch.multinomial(p, 1, generator=generator)])


@torch.no_grad()
def generate(model, prompt_ids, max_new_tokens=128, temperature=0.0, top_p=1.0, stop_ids=(), use_cache=True,
             generator=None) -> list[int]:
    """New token ids after `prompt_ids`, up to and including the first of `stop_ids`.
    use_cache=False reruns the whole sequence for every token (the slow reference)."""
    device = model.model.embed_tokens.weight.device
    ids = torch.tensor([list(prompt_ids)], device=device)  # (1, T)
    if use_cache:
        cache = KVCache(model.config, 1, ids.shape[1] + max_new_tokens, model.model.embed_tokens.weight.dtype, device)
        logits = forward_cached(model, ids, cache)[0, -1]  # prefill
    else:
        logits = model(ids)[0, -1]
    out = []
    for _ in range(max_new_tokens):
        token = sample(logits, temperature, top_p, generator)
        out.append(token)
        if token in stop_ids:
            break
        ids = torch.cat([ids, torch.tensor([[token]], device=device)], dim=1)
        logits = forward_cached(model, ids[:, -1:], cache)[0, -1] if use_cache else model(ids)[0, -1]
    return out


def prompt_ids(tokenizer, prompt, system=None, raw=False):
    """The prompt's token ids: one user turn through the chat template (BOS where the model uses one)."""
    if not raw:
        messages = ([{"role": "system", "content": system}] if system else []) + [{"role": "user", "content": prompt}]
        prompt = tokenizer.apply_chat_template(messages, add_generation_prompt=True)
    ids = tokenizer.encode(prompt)
    if tokenizer.add_bos and tokenizer.bos_id is not None and ids[:1] != [tokenizer.bos_id]:
        ids = [tokenizer.bos_id] + ids
    return ids


def main():
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--model", required=True, help="local folder, short name, hub repo id or .gguf file")
    p.add_argument("--adapter", default=None, help="LoRA adapter folder (PEFT format, e.g. out/adapter)")
    p.add_argument("--prompt", required=True, help="the user message (or the raw text with --raw)")
    p.add_argument("--system", default=None, help="a system message before the prompt")
    p.add_argument("--raw", action="store_true", help="no chat template: continue --prompt as plain text")
    p.add_argument("--max-new-tokens", type=int, default=256, help="stop after this many tokens")
    p.add_argument("--temperature", type=float, default=0.0, help="0: greedy (deterministic); 0.7 is a common "
                                                                   "choice for sampling")
    p.add_argument("--top-p", type=float, default=0.9, help="with temperature > 0: sample from the most likely "
                                                            "tokens holding this much probability")
    p.add_argument("--seed", type=int, default=0, help="seed for sampling")
    p.add_argument("--device", default="auto", help="auto | cpu | cuda | cuda:N")
    args = p.parse_args()
    device = torch.device(("cuda" if torch.cuda.is_available() else "cpu") if args.device == "auto" else args.device)
    dtype = torch.bfloat16 if device.type == "cuda" and torch.cuda.is_bf16_supported() else torch.float32
    lora = read_adapter_config(args.adapter) if args.adapter else None
    model, cfg = load_model(args.model, dtype=dtype, device=device, lora=lora)
    if args.adapter:
        load_adapter(model, args.adapter)
    tok = load_tokenizer(args.model)
    ids = prompt_ids(tok, args.prompt, args.system, args.raw)
    stop = {tok.eos_id} if tok.eos_id is not None else set()
    stop |= set(cfg.eos_token_id if isinstance(cfg.eos_token_id, list) else [cfg.eos_token_id]) - {None}
    gen = torch.Generator(device=device).manual_seed(args.seed)
    out = generate(model, ids, args.max_new_tokens, args.temperature, args.top_p, stop, generator=gen)
    print(tok.decode(out))


if __name__ == "__main__":
    try:
        main()
    except (ValueError, FileNotFoundError) as e:
        print(f"error: {e}", file=sys.stderr)
        sys.exit(2)
