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

Batched sampling (`GroupSampler`, the rollouts of RL): G samples of each of P prompts decode together as
P×G rows. The prompts end at one fixed slot (left-padded), so every row's next token goes to the same cache
slot; each row keeps its own RoPE positions (its prompt's starting at 0), and the mask hides the slots before
its prompt. One sampler serves a whole run: its cache and its graphs (the prefill's and the decoding step's) are
made once, for the longest prompt.
"""
import warnings

import torch

from model.capture import capture, warm_up
from model.lora import MergedAdapters, NoDropout


class LayerCache:
    """One layer's keys and values, (B, n_kv_heads, max_len, head_dim), `length` positions filled. Once `at` is
    set (a static cache, see `KVCache.make_static`), an update writes its tokens at the positions that device
    tensor holds and returns the whole buffers, whose positions not written yet `KVCache.mask` hides. (With the
    kernels, a one-token step writes the slot and reads the buffers itself: model/transformer.py, `decode_attend`.)"""

    def __init__(self, k, v):
        self.k, self.v = k, v  # (B, n_kv_heads, max_len, head_dim) each, zeros: views of the `KVCache`'s buffers
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
    """Keys and values of every layer for up to `max_len` positions of `batch` rows: two buffers, k and v, of
    (n_layers, batch, n_kv_heads, max_len, head_dim), whose layer i each `LayerCache` holds, so that one copy
    moves every layer's (`Prefill`)."""

    def __init__(self, cfg, batch, max_len, dtype, device):
        shape = (cfg.n_layers, batch, cfg.n_kv_heads, max_len, cfg.head_dim)
        self.k = torch.zeros(shape, dtype=dtype, device=device)
        self.v = torch.zeros(shape, dtype=dtype, device=device)
        self.layers = [LayerCache(k, v) for k, v in zip(self.k, self.v, strict=True)]
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
        and so do a row's slots before its `first`. A query in those slots (a left-padded prompt's padding, in a
        prefill) sees its own slot alone: no row of the softmax is fully masked."""
        at = self.at[:, None]  # (T, 1)
        keys = torch.arange(self.layers[0].k.shape[2], device=at.device)
        keep = keys <= at
        if window is not None:
            keep = keep & (at - keys < window)
        if self.first is not None:
            return (keep & ((keys >= self.first[:, None, None]) | (keys == at)))[:, None]  # (B, 1, T, max_len)
        return keep[None, None]


class Replay:
    """fn(), a forward on fixed input buffers, captured as a CUDA graph at the first call and replayed at every
    later one: a small model's forward is bound by the Python that issues its kernels, as a training step is
    (step.py); replayed, it costs the GPU's time. graphed=False (a CPU) runs fn eagerly. If the capture fails, fn
    runs eagerly from then on, after one warning. The result is the graph's output tensor, overwritten by the next
    replay."""

    def __init__(self, fn, graphed, what):
        self.fn, self.graphed, self.what = fn, graphed, what
        self.graph, self.out, self.failed = None, None, False

    def __call__(self):
        if self.graph is None and self.graphed and not self.failed:
            try:
                warm_up(self.fn)  # it writes what the replay writes again (keys and values)
                graph = torch.cuda.CUDAGraph()
                self.out = capture(graph, self.fn)
                self.graph = graph
            except torch.OutOfMemoryError:
                raise
            except Exception as e:  # an op that cannot be captured
                self.failed = True
                warnings.warn(f"CUDA graph capture of the {self.what} failed ({type(e).__name__}: {str(e)[:200]}); "
                              "going on without it (the same tokens, more time)", stacklevel=3)
        if self.graph is None:
            return self.fn()
        self.graph.replay()
        return self.out


class DecodeGraph:
    """The one-token forward of every row through a static KV cache, replayed from a CUDA graph (`Replay`). The
    tokens, their slot and their positions are copied into the graph's input tensors."""

    def __init__(self, model, cache, first=None, graphed=True):
        k = cache.layers[0].k
        self.model, self.cache, self.first = model, cache, first
        self.token = torch.zeros(k.shape[0], 1, dtype=torch.long, device=k.device)  # (B, 1)
        self.position = torch.zeros(k.shape[0], 1, dtype=torch.long, device=k.device)  # (B, 1) RoPE positions
        self.at = torch.zeros(1, dtype=torch.long, device=k.device)  # the cache slot of these tokens
        self.replay = Replay(self._forward, graphed, "decoding step")

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
        return self.replay()

    def _forward(self):
        return self.model(self.token, self.position, cache=self.cache)[:, -1]


class Prefill:
    """The prompts' forward for a `GroupSampler`, with fixed shapes, so that it replays a CUDA graph (`Replay`) as
    the decoding steps do: P prompts, left-padded to the sampler's M slots, run through a static cache of their
    own (P rows of M slots, each row's padding hidden by its `first`); their keys and values are then copied to
    the rows of each prompt in the sampler's cache (slots [0, M)), and the logits after each prompt to its rows.
    A prompt runs once, not once per sample; a replay issues its layers without Python."""

    def __init__(self, model, cache, prompts, max_prompt_len, graphed):
        k = cache.layers[0].k
        rows, M = k.shape[0], max_prompt_len
        self.model, self.cache, self.M = model, cache, M
        self.tokens = torch.zeros(prompts, M, dtype=torch.long, device=k.device)  # (P, M), left-padded
        self.lengths = torch.zeros(prompts, dtype=torch.long, device=k.device)  # (P,)
        self.prompt_of = torch.zeros(rows, dtype=torch.long, device=k.device)  # (rows,) each row's prompt
        self.own = KVCache(model.config, prompts, M, k.dtype, k.device)
        self.own.make_static(torch.arange(M, device=k.device), torch.zeros_like(self.lengths))
        self.replay = Replay(self._forward, graphed, "prefill")

    def __call__(self, ids, lengths, prompt_of):
        """Logits (rows, V) after each row's prompt; ids (P, M) on the host, left-padded; lengths (P,), prompt_of
        (rows,) on the device."""
        self.tokens.copy_(ids)
        self.lengths.copy_(lengths)
        self.prompt_of.copy_(prompt_of)
        return self.replay()

    def _forward(self):
        M, cache = self.M, self.own
        cache.first.copy_(M - self.lengths)
        positions = (torch.arange(M, device=self.tokens.device) - cache.first[:, None]).clamp(min=0)  # (P, M)
        h = self.model.hidden_states(self.tokens, positions, cache=cache)[:, -1]
        self.cache.k[:, :, :, :M] = cache.k.index_select(1, self.prompt_of)  # every layer's at once
        self.cache.v[:, :, :, :M] = cache.v.index_select(1, self.prompt_of)
        return self.model.logits(h).index_select(0, self.prompt_of)


def sample(logits, temperature=0.0, top_p=1.0, generator=None) -> int:
    """One token id from logits (V,): see `sample_tokens`."""
    return int(sample_tokens(logits[None], temperature, top_p, generator=generator)[0][0])


def sample_tokens(logits, temperature=0.0, top_p=1.0, top_k=0, generator=None, kernel=None):
    """(tokens (B,), logps (B,) fp32) from logits (B, V): the argmax at temperature 0; else a draw from
    softmax(logits / T) cut to the top_k most likely tokens (0: all), then to the smallest set of most likely
    tokens whose renormalized probability reaches top_p (nucleus sampling, Holtzman et al. 2019).
    logps: each token's log-probability under log_softmax(logits / T) before the cuts, as a training forward
    at temperature T computes it (TRL's GRPOTrainer divides the logits by T); at temperature 0, under T = 1.
    kernel: kernels/sample.py's `sample_tokens` (a model's `ops.sample_tokens`), which draws without the cuts in
    two launches from the same exponential draw as below: the same generator state gives the same tokens."""
    if kernel is not None and top_k == 0 and top_p >= 1.0:
        noise = None  # E ~ Exp(1): the draw below, of the same shape and dtype
        if temperature > 0:
            noise = torch.empty(logits.shape, dtype=torch.float32, device=logits.device)
            noise.exponential_(generator=generator)
        return kernel(logits, temperature, noise)
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
        # The exponential race: argmax of p / E, E ~ Exp(1) drawn per token, is token i with probability p_i
        # (torch.multinomial's own draw of one sample, without its checks of the probabilities, which can wait for
        # the GPU).
        tokens = (probs / torch.empty_like(probs).exponential_(generator=generator)).argmax(-1)
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
    """`num_samples` (G) completions of each prompt in `prompts` (P lists of ids), from a `GroupSampler` made for
    this call alone (rl.py keeps one for the run). Returns (completions, logps): see `GroupSampler.__call__`."""
    sampler = GroupSampler(model, len(prompts) * num_samples, max(map(len, prompts)), max_new_tokens, pad_id,
                           cuda_graph)
    return sampler(prompts, num_samples, temperature, top_p, top_k, stop_ids, generator)


class GroupSampler:
    """Batched sampling of G completions per prompt through one static KV cache and one `DecodeGraph`, made once
    and reused by every call: a CUDA graph's warm-up and capture cost tens of milliseconds, more than a short
    rollout's decoding.

        sampler = GroupSampler(model, rows=P * G, max_prompt_len=M, max_new_tokens=N, pad_id=pad_id)
        completions, logps = sampler(prompts, G, temperature=1.0, stop_ids=stops, generator=g)

    The cache has `rows` rows of M + N slots. A call's P prompts (at most M tokens each) run once each through the
    prefill (`Prefill`, one per P, made at the first call with P prompts), left-padded to M, and their keys and
    values are copied to each of their G rows, in slots [0, M): every prompt ends at slot M - 1. Then decoding
    step t writes all rows' new tokens at slot M + t, each at its own RoPE position len(prompt) + t. The mask shows
    a row the slots from its prompt's first (`first`, a device tensor the graph reads, refilled at each call) up to
    the current one: the keys and values an earlier call left in the slots after the current token stay hidden, so
    a call samples what a fresh sampler samples. A call with fewer than `rows` rows fills the rest with copies of
    its last row, whose samples are dropped. A call samples with the adapters as they are, merged into the weights
    where `MergedAdapters` takes them, and without their dropout (`NoDropout`) in train mode too: an RL loop
    needs no model.eval() and model.train() around it."""

    SYNC_EVERY = 16  # decoding steps between the host's checks that every row has stopped

    def __init__(self, model, rows, max_prompt_len, max_new_tokens, pad_id=0, cuda_graph=None):
        weight = model.model.embed_tokens.weight
        self.model, self.rows, self.pad_id = model, rows, pad_id
        self.max_prompt_len, self.max_new_tokens = max_prompt_len, max_new_tokens
        self.device = weight.device
        self.graphed = self.device.type == "cuda" if cuda_graph is None else cuda_graph
        self.cache = KVCache(model.config, rows, max_prompt_len + max_new_tokens, weight.dtype, self.device)
        self.first = torch.zeros(rows, dtype=torch.long, device=self.device)  # (rows,) each row's first shown slot
        self.merged = MergedAdapters(model)  # its buffers, like the cache, are made once: the graphs read them
        self.no_dropout = NoDropout(model)  # the adapters sample as they are, in train mode too
        self.prefills = {}  # P: the Prefill of P prompts
        self.decode = DecodeGraph(model, self.cache, first=self.first, graphed=self.graphed)

    @torch.no_grad()
    def __call__(self, prompts, num_samples, temperature=1.0, top_p=1.0, top_k=0, stop_ids=(), generator=None):
        """(completions, logps) of `num_samples` (G) samples of each prompt (P lists of ids, P × G <= rows): row
        p*G + g is sample g of prompt p. P×G lists of new token ids, each up to and including its first of
        `stop_ids` (at most max_new_tokens), and for each token its log-probability under
        log_softmax(logits / temperature) (`sample_tokens`). generator: a torch.Generator on the model's device;
        the same state gives the same samples. A finished row goes on with `pad_id` tokens, which nothing reads."""
        M, G, P = self.max_prompt_len, num_samples, len(prompts)
        n = P * G
        if not prompts or n > self.rows:
            raise ValueError(f"the sampler holds {self.rows} rows; {P} prompts x {G} samples need {n}")
        if max(map(len, prompts)) > M:
            raise ValueError(f"a prompt of {max(map(len, prompts))} tokens does not fit the sampler's {M}")
        if P not in self.prefills:
            self.prefills[P] = Prefill(self.model, self.cache, P, M, self.graphed)
        with self.merged, self.no_dropout:  # the adapters stay fixed while sampling: plain GEMMs on merged weights
            ids = torch.full((P, M), self.pad_id, dtype=torch.long)
            for i, p in enumerate(prompts):
                ids[i, M - len(p):] = torch.tensor(p, dtype=torch.long)
            lengths = torch.tensor([len(p) for p in prompts], device=self.device)  # (P,)
            prompt_of = torch.arange(self.rows, device=self.device).clamp(max=n - 1) // G  # (rows,) each row's prompt
            logits = self.prefills[P](ids, lengths, prompt_of)  # (rows, V)
            positions = lengths[prompt_of]  # (rows,): the position of each row's next token
            self.first.copy_(M - positions)
            stops = torch.tensor(sorted(stop_ids), dtype=torch.long, device=self.device)
            done = torch.zeros(self.rows, dtype=torch.bool, device=self.device)
            tokens, logps = [], []
            for t in range(self.max_new_tokens):
                if t > 0:
                    if t % self.SYNC_EVERY == 0 and bool(done.all()):  # a host sync: not at every token
                        break
                    logits = self.decode(tokens[-1], M + t - 1, positions + t - 1)
                token, logp = sample_tokens(logits, temperature, top_p, top_k, generator, self.model.ops.sample_tokens)
                tokens.append(torch.where(done, self.pad_id, token))
                logps.append(logp)
                done = done | torch.isin(token, stops)
        tokens, logps = torch.stack(tokens, 1)[:n].tolist(), torch.stack(logps, 1)[:n].tolist()  # (P*G, steps)
        kept = [next((i + 1 for i, tok in enumerate(row) if tok in stop_ids), len(row)) for row in tokens]
        return ([row[:k] for row, k in zip(tokens, kept, strict=True)],
                [row[:k] for row, k in zip(logps, kept, strict=True)])


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
