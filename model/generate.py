"""Text generation with a KV cache: greedy, or temperature / top-p sampling.

    ids = encode_prompt(tokenizer, "Name three rivers.")          # one user turn, chat template
    out = generate(model, ids, max_new_tokens=64, stop_ids=stop_ids(tokenizer, model.config))
    print(tokenizer.decode(out))

The KV cache. Generating token t+1 needs the keys and values of every earlier position in
every layer; they never change, so they are computed once and kept. The prompt runs in one
pass (prefill) that fills the cache; each new token then runs only its own position through
the layers (decode), attending to the cached keys. The model's own forward does this
(`Transformer.forward(..., cache=...)`): only attention reads the cache, so cached logits
equal the full forward's (tests/test_generate.py checks every family).

On a CUDA GPU each decoding step after the first replays a CUDA graph of the one-token forward
(`DecodeGraph`), as training steps do (step.py): issuing a small model's layers from Python costs
far more than the GPU's work for one token. A graph reads fixed addresses, so after the prefill the
cache turns static: the new token's position is a device tensor, each layer writes its keys and
values there and attends over its whole buffer, under a mask that hides the positions after it.

Batched sampling (`sample_groups`, the rollouts of RL): G samples of each of P prompts decode together as
P×G rows. The prompts are left-padded to the longest, so every row's next token goes to the same cache slot;
each row keeps its own RoPE positions (its prompt's starting at 0), and the mask hides its padding slots.
"""
import warnings

import torch

from model.capture import capture, warm_up


class LayerCache:
    """One layer's keys and values, (B, n_kv_heads, max_len, head_dim), `length` positions filled. Once `at` is
    set (a static cache, see `KVCache.make_static`), an update writes its tokens at the positions that device
    tensor holds and returns the whole buffers, whose positions not written yet `KVCache.mask` hides."""

    def __init__(self, shape, dtype, device):
        self.k = torch.zeros(shape, dtype=dtype, device=device)
        self.v = torch.zeros(shape, dtype=dtype, device=device)
        self.length = 0
        self.at = None  # static: the positions (T,) of the forward's tokens, a device tensor

    def update(self, k, v):
        """Append k, v (B, nkv, T, d) after the filled positions; return all of them (B, nkv, S, d)."""
        if self.at is not None:
            self.k.index_copy_(2, self.at, k)
            self.v.index_copy_(2, self.at, v)
            return self.k, self.v
        end = self.length + k.shape[2]
        if end > self.k.shape[2]:
            raise ValueError(f"the KV cache holds {self.k.shape[2]} positions; {end} are needed")
        self.k[:, :, self.length:end] = k
        self.v[:, :, self.length:end] = v
        self.length = end
        return self.k[:, :, :end], self.v[:, :, :end]


class KVCache:
    """Keys and values of every layer for up to `max_len` positions of `batch` rows."""

    def __init__(self, cfg, batch, max_len, dtype, device):
        shape = (batch, cfg.n_kv_heads, max_len, cfg.head_dim)
        self.layers = [LayerCache(shape, dtype, device) for _ in range(cfg.n_layers)]
        self.first = None  # static: each row's first slot that `mask` shows (B,), or None: slot 0 for every row

    @property
    def length(self):
        """How many positions the model has run through the cache (before it was made static)."""
        return self.layers[0].length

    @property
    def at(self):
        """The positions (T,) that the next forward writes, on the device, for a static cache; else None."""
        return self.layers[0].at

    def make_static(self, at, first=None):
        """From here on each forward's tokens go to the positions in `at` (T,), a long tensor on the cache's device
        whose values may change between forwards, and every layer attends over its whole buffer under `mask`:
        shapes and addresses stay fixed, as a CUDA graph needs (`DecodeGraph`). first (B,): each row's first
        slot that holds its own tokens (a left-padded prompt's first), or None: every row starts at slot 0."""
        for layer in self.layers:
            layer.at = at
        self.first = first

    def mask(self, window=None):
        """(1 or B, 1, T, max_len) bool for a static cache: the query at position at[t] sees the positions up to
        its own (with a window, the last `window` of them); those not written yet lie after it, so stay hidden,
        and so do a row's slots before its `first`."""
        at = self.at[:, None]  # (T, 1)
        keys = torch.arange(self.layers[0].k.shape[2], device=at.device)
        keep = keys <= at
        if window is not None:
            keep = keep & (at - keys < window)
        if self.first is not None:
            return (keep & (keys >= self.first[:, None, None]))[:, None]  # (B, 1, T, max_len)
        return keep[None, None]


class DecodeGraph:
    """The one-token forward of every row through a static KV cache, captured as a CUDA graph at the first call
    and replayed at every later one. A decoding step of a small model is bound by the Python that issues its
    kernels, as a training step is (step.py); replayed, it costs the GPU's time. The tokens, their slot and their
    positions are copied into the graph's input tensors; the logits are its output tensor, overwritten by the next
    replay. graphed=False (a CPU) runs the same forward eagerly. If the capture fails, the forward runs eagerly
    from then on, after one warning."""

    def __init__(self, model, cache, first=None, graphed=True):
        k = cache.layers[0].k
        self.model, self.cache, self.first = model, cache, first
        self.token = torch.zeros(k.shape[0], 1, dtype=torch.long, device=k.device)  # (B, 1)
        self.position = torch.zeros(k.shape[0], 1, dtype=torch.long, device=k.device)  # (B, 1) RoPE positions
        self.at = torch.zeros(1, dtype=torch.long, device=k.device)  # the cache slot of these tokens
        self.graph, self.logits, self.failed, self.graphed = None, None, False, graphed

    def __call__(self, tokens, slot, positions=None):
        """Logits (B, V) after tokens (B,) (or one int, for every row) at cache slot `slot`, whose keys and values
        go into the cache; positions (B,): the tokens' RoPE positions (default: the slot)."""
        if isinstance(tokens, int):  # a fill needs no copy from the host
            self.token.fill_(tokens)
        else:
            self.token.copy_(tokens.view(-1, 1))
        self.at.fill_(slot)
        if positions is None:
            self.position.fill_(slot)
        else:
            self.position.copy_(positions.view(-1, 1))
        if self.cache.at is None:
            self.cache.make_static(self.at, self.first)
        if self.graph is None and self.graphed and not self.failed:
            try:
                self._capture()
            except torch.OutOfMemoryError:
                raise
            except Exception as e:  # an op that cannot be captured
                self.failed = True
                warnings.warn(f"CUDA graph capture of the decoding step failed ({type(e).__name__}: {str(e)[:200]}); "
                              "decoding on without it (same tokens, more time per token)", stacklevel=2)
        if self.graph is None:
            return self._forward()
        self.graph.replay()
        return self.logits

    def _forward(self):
        return self.model(self.token, self.position, cache=self.cache)[:, -1]

    def _capture(self):
        # The warm-up writes these tokens' keys and values, as the replay writes them again.
        warm_up(self._forward)
        graph = torch.cuda.CUDAGraph()
        self.logits = capture(graph, self._forward)
        self.graph = graph


def sample(logits, temperature=0.0, top_p=1.0, generator=None) -> int:
    """One token id from logits (V,): see `sample_tokens`."""
    return int(sample_tokens(logits[None], temperature, top_p, generator=generator)[0][0])


def sample_tokens(logits, temperature=0.0, top_p=1.0, top_k=0, generator=None):
    """(tokens (B,), logps (B,) fp32) from logits (B, V): the argmax at temperature 0; else a draw from
    softmax(logits / T) cut to the top_k most likely tokens (0: all), then to the smallest set of most likely
    tokens whose renormalized probability reaches top_p (nucleus sampling, Holtzman et al. 2019).
    logps: each token's log-probability under log_softmax(logits / T) before the cuts, as a training forward
    at temperature T computes it (TRL's GRPOTrainer divides the logits by T); at temperature 0, under T = 1."""
    logits = logits.float()
    logp = torch.log_softmax(logits / (temperature or 1.0), dim=-1)  # (B, V)
    if temperature == 0:
        tokens = logits.argmax(-1)
    else:
        probs = logp.exp()
        if top_k:
            kth = probs.topk(min(top_k, probs.shape[-1]), dim=-1).values[:, -1:]  # (B, 1)
            probs = probs * (probs >= kth)
        if top_p < 1.0:
            p, idx = (probs / probs.sum(-1, keepdim=True)).sort(dim=-1, descending=True)
            keep = p.cumsum(-1) - p < top_p  # keep a token while the mass before it is below top_p
            probs = probs * torch.zeros_like(keep).scatter(-1, idx, keep)
        tokens = torch.multinomial(probs, 1, generator=generator)[:, 0]
    return tokens, logp.gather(1, tokens[:, None])[:, 0]


@torch.no_grad()
def generate(model, prompt_ids, max_new_tokens=128, temperature=0.0, top_p=1.0, stop_ids=(), use_cache=True,
             generator=None, on_token=None, cuda_graph=None) -> list[int]:
    """New token ids after `prompt_ids` (a list of ints), up to and including the first of
    `stop_ids`. use_cache=False reruns the whole sequence for every token (the slow reference).
    on_token(id) is called with each new token as it is chosen (a progress bar, streaming).
    cuda_graph (default: on a CUDA device, with the cache): the decoding steps replay a `DecodeGraph`."""
    weight = model.model.embed_tokens.weight
    ids = torch.tensor([list(prompt_ids)], device=weight.device)  # (1, T)
    cache = KVCache(model.config, 1, ids.shape[1] + max_new_tokens, weight.dtype, weight.device) if use_cache else None
    graphed = use_cache and (weight.is_cuda if cuda_graph is None else cuda_graph)
    decode = DecodeGraph(model, cache) if graphed else None
    logits = model(ids, cache=cache)[0, -1]  # with a cache: the prefill
    out = []
    for _ in range(max_new_tokens):
        token = sample(logits, temperature, top_p, generator)
        out.append(token)
        if on_token is not None:
            on_token(token)
        if token in stop_ids:
            break
        if decode is not None:
            logits = decode(token, len(prompt_ids) + len(out) - 1)[0]
            continue
        ids = torch.cat([ids, torch.tensor([[token]], device=ids.device)], dim=1)
        logits = model(ids[:, -1:], cache=cache)[0, -1] if use_cache else model(ids)[0, -1]
    return out


@torch.no_grad()
def sample_groups(model, prompts, num_samples, max_new_tokens, temperature=1.0, top_p=1.0, top_k=0, stop_ids=(),
                  generator=None, pad_id=0, cuda_graph=None):
    """`num_samples` (G) completions of each prompt in `prompts` (P lists of ids), decoded together as P×G rows:
    row p*G + g is sample g of prompt p. Returns (completions, logps): P×G lists of new token ids, each up to and
    including its first of `stop_ids` (at most max_new_tokens), and for each token its log-probability under
    log_softmax(logits / temperature) (`sample_tokens`). generator: a torch.Generator on the model's device; the
    same state gives the same samples.

    The prompts, left-padded to the longest (L), run once each through the prefill, padding and prompt as two
    documents of a row (the prompt's positions from 0), and their keys and values are copied G times into a
    cache of L + max_new_tokens slots. Then every decoding step writes all rows' new tokens at slot L + t,
    each at its own position len(prompt) + t, through `DecodeGraph` (a CUDA graph on CUDA, cuda_graph=None).
    A finished row goes on with `pad_id` tokens, which nothing reads."""
    weight = model.model.embed_tokens.weight
    device, cfg, G = weight.device, model.config, num_samples
    lengths = torch.tensor([len(p) for p in prompts], device=device)  # (P,)
    L = int(lengths.max())
    slots = torch.arange(L, device=device)
    start = (L - lengths)[:, None]  # (P, 1): each prompt's first slot
    ids = torch.full((len(prompts), L), pad_id, dtype=torch.long, device=device)
    for i, p in enumerate(prompts):
        ids[i, L - len(p):] = torch.tensor(p, dtype=torch.long)
    doc_ids = (slots >= start).long()  # (P, L): padding 0, the prompt 1
    prefill = KVCache(cfg, len(prompts), L, weight.dtype, device)
    h = model.hidden_states(ids, (slots - start).clamp(min=0), doc_ids, cache=prefill)[:, -1]  # (P, H)
    logits = model.logits(h).repeat_interleave(G, 0)  # (P*G, V)
    cache = KVCache(cfg, len(prompts) * G, L + max_new_tokens, weight.dtype, device)
    for big, small in zip(cache.layers, prefill.layers, strict=True):
        big.k[:, :, :L] = small.k.repeat_interleave(G, 0)
        big.v[:, :, :L] = small.v.repeat_interleave(G, 0)
    positions = lengths.repeat_interleave(G)  # (P*G,): the position of each row's next token
    decode = DecodeGraph(model, cache, first=start[:, 0].repeat_interleave(G),
                         graphed=device.type == "cuda" if cuda_graph is None else cuda_graph)
    stops = torch.tensor(sorted(stop_ids), dtype=torch.long, device=device)
    done = torch.zeros(len(positions), dtype=torch.bool, device=device)
    tokens, logps = [], []
    for t in range(max_new_tokens):
        if t > 0:
            if bool(done.all()):
                break
            logits = decode(tokens[-1], L + t - 1, positions + t - 1)
        token, logp = sample_tokens(logits, temperature, top_p, top_k, generator)
        tokens.append(torch.where(done, pad_id, token))
        logps.append(logp)
        done = done | torch.isin(token, stops)
    tokens, logps = torch.stack(tokens, 1).tolist(), torch.stack(logps, 1).tolist()  # (P*G, n) each
    n = [next((i + 1 for i, tok in enumerate(row) if tok in stop_ids), len(row)) for row in tokens]
    return [row[:k] for row, k in zip(tokens, n, strict=True)], [row[:k] for row, k in zip(logps, n, strict=True)]


def encode_prompt(tokenizer, prompt, system=None, raw=False) -> list[int]:
    """The prompt's token ids: one user turn (after an optional system message) through the chat
    template, ending in the assistant header; raw=True encodes `prompt` as plain text instead.
    BOS is prepended where the model uses one."""
    if not raw:
        messages = ([{"role": "system", "content": system}] if system else []) + [{"role": "user", "content": prompt}]
        prompt = tokenizer.apply_chat_template(messages, add_generation_prompt=True)
    ids = tokenizer.encode(prompt)
    if tokenizer.add_bos and tokenizer.bos_id is not None and ids[:1] != [tokenizer.bos_id]:
        ids = [tokenizer.bos_id] + ids
    return ids


def stop_ids(tokenizer, cfg) -> set[int]:
    """The ids that end a reply: the tokenizer's EOS and every EOS id of the model's config."""
    ids = {tokenizer.eos_id} if tokenizer.eos_id is not None else set()
    eos = cfg.eos_token_id if isinstance(cfg.eos_token_id, list) else [cfg.eos_token_id]
    return ids | (set(eos) - {None})
