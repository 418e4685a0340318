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

    @property
    def length(self):
        """How many positions the model has run through the cache (before it was made static)."""
        return self.layers[0].length

    @property
    def at(self):
        """The positions (T,) that the next forward writes, on the device, for a static cache; else None."""
        return self.layers[0].at

    def make_static(self, at):
        """From here on each forward's tokens go to the positions in `at` (T,), a long tensor on the cache's device
        whose values may change between forwards, and every layer attends over its whole buffer under `mask`:
        shapes and addresses stay fixed, as a CUDA graph needs (`DecodeGraph`)."""
        for layer in self.layers:
            layer.at = at

    def mask(self, window=None):
        """(1, 1, T, max_len) bool for a static cache: the query at position at[t] sees the positions up to its
        own (with a window, the last `window` of them); those not written yet lie after it, so stay hidden."""
        at = self.at[:, None]  # (T, 1)
        keys = torch.arange(self.layers[0].k.shape[2], device=at.device)
        keep = keys <= at
        if window is not None:
            keep = keep & (at - keys < window)
        return keep[None, None]


class DecodeGraph:
    """The one-token forward through a static KV cache, captured as a CUDA graph at the first call and replayed
    at every later one. A decoding step of a small model is bound by the Python that issues its kernels, as a
    training step is (step.py); replayed, it costs the GPU's time. The token and its position are copied into
    the graph's input tensors; the logits are its output tensor, overwritten by the next replay. If the capture
    fails, the same forward runs eagerly from then on, after one warning."""

    def __init__(self, model, cache):
        device = cache.layers[0].k.device
        self.model, self.cache = model, cache
        self.token = torch.zeros(1, 1, dtype=torch.long, device=device)
        self.at = torch.zeros(1, dtype=torch.long, device=device)
        self.graph, self.logits, self.failed = None, None, False

    def __call__(self, token, position):
        """Logits (V,) after `token` at `position`, whose keys and values go into the cache."""
        self.token.fill_(token)
        self.at.fill_(position)
        if self.graph is None and not self.failed:
            self.cache.make_static(self.at)
            try:
                self._capture()
            except torch.OutOfMemoryError:
                raise
            except Exception as e:  # an op that cannot be captured
                self.failed = True
                warnings.warn(f"CUDA graph capture of the decoding step failed ({type(e).__name__}: {str(e)[:200]}); "
                              "decoding on without it (same tokens, more time per token)", stacklevel=2)
        if self.failed:
            return self.model(self.token, cache=self.cache)[0, -1]
        self.graph.replay()
        return self.logits

    def _capture(self):
        # The warm-up writes this token's keys and values, as the replay writes them again.
        warm_up(lambda: self.model(self.token, cache=self.cache))
        graph = torch.cuda.CUDAGraph()
        self.logits = capture(graph, lambda: self.model(self.token, cache=self.cache)[0, -1])
        self.graph = graph


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
            logits = decode(token, len(prompt_ids) + len(out) - 1)
            continue
        ids = torch.cat([ids, torch.tensor([[token]], device=ids.device)], dim=1)
        logits = model(ids[:, -1:], cache=cache)[0, -1] if use_cache else model(ids)[0, -1]
    return out


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
