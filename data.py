"""Data: load examples, tokenize them with a loss mask, and batch them (packed or padded).

    load_examples(spec) -> [dict]                    a .jsonl/.json file, a hub dataset file, or "builtin"
    encode_example(ex, tokenizer) -> (ids, mask)     mask[i]: token i is a training target
    Batches(encoded, ...)                            endless, shuffled, resumable, sharded micro-batches
    answer_accuracy(logits, batch) -> (correct, total)

A batch is a dict of four LongTensors of shape (B, T):
    input_ids     the tokens.
    targets       pre-shifted: targets[b, t] is the token to predict at position t, or IGNORE_INDEX.
                  A document's last token predicts nothing, so in a packed row no document is ever
                  predicted from the one before it.
    position_ids  restart at 0 at every document, so RoPE sees each document as if it were alone.
    doc_ids       the document index within the row (0, 1, 2, ...). Token q may attend to token k
                  iff k <= q and doc_ids[q] == doc_ids[k]. Padding is one more document of its own,
                  so no query ever has every key masked (which would give NaN in softmax).

Example formats (one per example; `load_examples` checks every one up front):
    {"text": ...}                                    BOS + text + EOS, every token trained
    {"instruction", "input" (optional), "output"}    Alpaca; the loss is on the output only
    {"messages": [{"role", "content"}, ...]}         chat; the loss is on assistant turns only

References: the Alpaca prompt format (tatsu-lab/stanford_alpaca); packing with per-document
positions and attention (Krell et al. 2021, "Efficient Sequence Packing without Cross-contamination").
"""
import json
import math
import os
import random
import re
from functools import lru_cache

import huggingface_hub
import torch

IGNORE_INDEX = -100  # what torch.nn.functional.cross_entropy skips by default
BATCH_KEYS = ("input_ids", "targets", "position_ids", "doc_ids")
KNOWN_FORMATS = ("'text'; 'instruction' + 'output' (and optional 'input'); "
                 "'messages' (a list of {\"role\": ..., \"content\": ...})")

# The plain prompt for Alpaca examples when the model has no chat template (a base model).
ALPACA_PROMPT = "### Instruction:\n{instruction}\n\n### Input:\n{input}\n\n### Response:\n"
ALPACA_PROMPT_NO_INPUT = "### Instruction:\n{instruction}\n\n### Response:\n"

# ----------------------------------------------------------------------------- loading

_HUB_SPEC = re.compile(r"([\w.-]+/[\w.-]+):(.+)")  # user/repo:path/in/repo.jsonl


def load_examples(spec):
    """Examples (dicts) from `spec`, which is one of:
        "builtin" (or "builtin:train", "builtin:eval")  the embedded dataset, see `builtin_dataset`;
        a local path to a .jsonl file (one JSON object per line) or a .json file (a list of
            objects, or {"data": [...]});
        "user/repo:path/to/file.jsonl"  a file of a Hugging Face hub dataset repository.
    Every example is checked here, so a bad one fails now, naming its line, not mid-training."""
    if spec == "builtin" or spec.startswith("builtin:"):
        return builtin_dataset(spec.partition(":")[2] or "train")
    path = spec
    if not os.path.exists(spec):
        hub = _HUB_SPEC.fullmatch(spec)
        if hub is None:
            raise FileNotFoundError(
                f"no such file: {spec!r}. The dataset can be a local .jsonl or .json file, a hub dataset "
                "file written as user/repo:path/to/file.jsonl, or 'builtin'")
        path = _hub_download(*hub.groups())
    records = _read_records(path)
    for where, ex in records:
        _format(ex, f"{path}: {where}")
    return [ex for _, ex in records]


def _hub_download(repo_id, filename):
    try:
        return huggingface_hub.hf_hub_download(repo_id, filename, repo_type="dataset")
    except Exception as e:  # the hub raises many kinds (offline, 404, gated); all mean "not fetched"
        raise FileNotFoundError(
            f"could not fetch {filename!r} from the hub dataset {repo_id!r} ({type(e).__name__}: {e}). "
            f"Check that https://huggingface.co/datasets/{repo_id} has that file; for a private or gated "
            "repo, log in with `huggingface-cli login`") from e


def _read_records(path):
    """[(where, object)] from a .jsonl or .json file; `where` is 'line N' or 'item N' for messages."""
    ext = os.path.splitext(path)[1].lower()
    if ext not in (".jsonl", ".json"):
        raise ValueError(f"{path}: unsupported file type {ext or '(no extension)'!r}. Expected .jsonl (one "
                         "JSON object per line) or .json (a list of objects, or {\"data\": [...]}); convert it")
    with open(path, encoding="utf-8-sig") as f:  # -sig: tolerate the byte-order mark some editors write
        text = f.read()
    if not text.strip():
        raise ValueError(f"{path} is empty: it needs at least one example, e.g. {{\"text\": \"...\"}}")
    if ext == ".jsonl":
        records = []
        # split("\n"), not splitlines(): JSON strings may hold a raw U+2028, which splitlines splits on.
        for n, line in enumerate(text.split("\n"), 1):
            if not line.strip():
                continue
            try:
                records.append((f"line {n}", json.loads(line)))
            except json.JSONDecodeError as e:
                raise ValueError(f"{path}: line {n} is not valid JSON ({e.msg}, column {e.colno}). "
                                 "A .jsonl file needs exactly one JSON object per line") from None
        return records
    try:
        data = json.loads(text)
    except json.JSONDecodeError as e:
        hint = "; if it holds one object per line, name it .jsonl" if e.msg == "Extra data" else ""
        raise ValueError(f"{path}: not valid JSON at line {e.lineno}, column {e.colno} ({e.msg}){hint}") from None
    if isinstance(data, dict) and "data" in data:
        data = data["data"]
    if not isinstance(data, list):
        raise ValueError(f"{path}: expected a JSON list of examples or {{\"data\": [...]}}, "
                         f"got a {type(data).__name__}")
    if not data:
        raise ValueError(f"{path} is empty: its list of examples has no items")
    return [(f"item {i}", ex) for i, ex in enumerate(data)]


def _format(ex, where="example"):
    """'text', 'alpaca' or 'messages': the format of `ex`; a ValueError that says why if it has none."""
    if not isinstance(ex, dict):
        raise ValueError(f"{where}: expected a JSON object, got a {type(ex).__name__}. Known formats: {KNOWN_FORMATS}")
    if "messages" in ex:
        msgs = ex["messages"]
        if not (isinstance(msgs, list) and msgs and all(
                isinstance(m, dict) and isinstance(m.get("role"), str) and isinstance(m.get("content"), str)
                for m in msgs)):
            raise ValueError(f"{where}: 'messages' must be a non-empty list of objects with string "
                             "'role' and 'content' fields")
        if not any(m["role"] == "assistant" for m in msgs):
            raise ValueError(f"{where}: 'messages' has no message with role 'assistant', so there is nothing "
                             f"to train on (roles found: {sorted({m['role'] for m in msgs})})")
        return "messages"
    if "instruction" in ex and "output" in ex:
        if not (isinstance(ex["instruction"], str) and isinstance(ex["output"], str)
                and isinstance(ex.get("input", ""), (str, type(None)))):
            raise ValueError(f"{where}: 'instruction' and 'output' must be strings, and 'input' a string or absent")
        return "alpaca"
    if "text" in ex:
        if not isinstance(ex["text"], str):
            raise ValueError(f"{where}: 'text' must be a string, got a {type(ex['text']).__name__}")
        return "text"
    raise ValueError(f"{where}: no known fields (found {sorted(ex)}). Known formats: {KNOWN_FORMATS}; "
                     "rename the fields to one of these")

# ----------------------------------------------------------------------------- tokenizing


def encode_example(example, tokenizer, *, train_on_inputs=False):
    """(ids, mask): the example's token ids and, per token, whether it is a training target.

    The example becomes a list of text pieces, each a target or not: text is one target piece;
    Alpaca is the prompt then the output (through the chat template when the model has one);
    messages come from the chat template, see `_chat_pieces`. `_tokenize_pieces` tokenizes them.
    Then:
      - BOS is prepended when the model uses one, unless the text already starts with it
        (chat templates often write it themselves);
      - inside a target piece, tokens after its last EOS are not targets: ChatML ends a turn with
        '<|im_end|>' + '\\n', and the model stops at EOS, so it never generates that newline;
      - EOS is appended when the text does not already end with it (ignoring trailing whitespace),
        as a target when the last piece is one, so the model learns to stop.
    The mask is the only record of what is trained; pad_id == eos_id does not hide EOS.
    """
    fmt = _format(example)
    if fmt == "text":
        pieces = [(example["text"], True)]
    elif fmt == "alpaca" and tokenizer.chat_template is None:
        template = ALPACA_PROMPT if example.get("input") else ALPACA_PROMPT_NO_INPUT
        pieces = [(template.format(instruction=example["instruction"], input=example.get("input")), False),
                  (example["output"], True)]
    else:
        messages = example["messages"] if fmt == "messages" else alpaca_messages(example)
        pieces = _chat_pieces(messages, tokenizer)

    ids, spans = _tokenize_pieces(pieces, tokenizer)
    bos, eos = tokenizer.bos_id, tokenizer.eos_id
    mask = [False] * len(ids)
    for start, end, is_target in spans:
        if is_target:
            turn = ids[start:end]
            if eos in turn:
                end = start + len(turn) - turn[::-1].index(eos)
            mask[start:end] = [True] * (end - start)
    if tokenizer.add_bos and bos is not None and ids[:1] != [bos]:
        ids, mask = [bos] + ids, [False] + mask
    text = "".join(p for p, _ in pieces)
    if eos is not None and not text.rstrip().endswith(tokenizer.id_to_token(eos)):
        ids, mask = ids + [eos], mask + [pieces[-1][1]]
    if train_on_inputs:
        mask = [True] * len(ids)
    return ids, mask


def alpaca_messages(example):
    """An Alpaca example as a chat: the instruction (and input) from the user, the output from the assistant."""
    user = example["instruction"] + ("\n\n" + example["input"] if example.get("input") else "")
    return [{"role": "user", "content": user}, {"role": "assistant", "content": example["output"]}]


def _chat_pieces(messages, tokenizer):
    """The rendered conversation as (text, is_target) pieces, found by rendering it prefix by prefix.

    For assistant message i:
        before = render(messages[:i], add_generation_prompt=True)   # ... '<|im_start|>assistant\\n'
        after  = render(messages[:i+1])                              # ... + content + '<|im_end|>\\n'
    and the assistant's piece is after[len(before):]: exactly the text the model must generate at
    inference, end-of-turn marker included. This needs no knowledge of any template's markers, only
    that the template is prefix-stable (rendering more messages only appends text); one that rewrites
    earlier turns (e.g. drops the reasoning of past turns) is refused, since no mask would be right.
    """
    pieces, done = [], ""

    def add(text, is_target, n):
        nonlocal done
        if not text.startswith(done):
            raise ValueError(
                f"the chat template is not prefix-stable: rendering the first {n} messages does not start "
                f"with the rendering of the ones before, so the assistant turns cannot be located. "
                "nanotune needs a template that only appends text as messages are added; use another "
                "template, or give the examples as 'text'")
        pieces.append((text[len(done):], is_target))
        done = text

    for i, m in enumerate(messages):
        if m["role"] == "assistant":
            add(tokenizer.apply_chat_template(messages[:i], add_generation_prompt=True), False, i)
        add(tokenizer.apply_chat_template(messages[:i + 1]), m["role"] == "assistant", i + 1)
    return pieces


def _tokenize_pieces(pieces, tokenizer):
    """(ids, [(start, end, is_target)]): the tokens of the joined pieces and each piece's token span.

    The whole text is tokenized at once, as it is at inference, and each piece's end is found by
    tokenizing the text up to it: the boundary is where those tokens stop agreeing with the whole
    text's tokens. So a token that merges across a boundary belongs to the later piece; usually the
    boundaries sit at special tokens or newlines and no token crosses them.
    """
    text = "".join(p for p, _ in pieces)
    ids = tokenizer.encode(text)
    spans, start, prefix = [], 0, ""
    for piece, is_target in pieces:
        prefix += piece
        end = max(start, _common_prefix_len(tokenizer.encode(prefix), ids))
        spans.append((start, end, is_target))
        start = end
    return ids, spans


def _common_prefix_len(a, b):
    n = 0
    while n < len(a) and n < len(b) and a[n] == b[n]:
        n += 1
    return n

# ----------------------------------------------------------------------------- batching


def pack(encoded, max_len, *, pad_id):
    """Pack encoded examples greedily, in order, into rows of exactly max_len tokens.

    An example never spans two rows: when the next one does not fit, the row is padded and a new
    one begins. An example longer than max_len is truncated to its first max_len tokens (kept
    rather than dropped, so long 'text' documents still train); its answer may be cut short, so
    the count is returned for the caller to report.
    Returns (rows, n_truncated); rows is a batch dict of (N, max_len) LongTensors.
    """
    encoded, n_truncated = truncate(encoded, max_len)
    rows, docs, used = [], [], 0
    for ids, mask in encoded:
        if used + len(ids) > max_len:
            rows.append(_row(docs, max_len, pad_id))
            docs, used = [], 0
        docs.append((ids, mask))
        used += len(ids)
    if docs:
        rows.append(_row(docs, max_len, pad_id))
    return _stack(rows, max_len), n_truncated


def pad_batch(encoded, *, pad_id, max_len=None):
    """One example per row, right-padded to the longest example, or to exactly max_len when given
    (examples longer than that are truncated). Padding is document 1 of its row, the example document 0."""
    length = max_len or max(len(ids) for ids, _ in encoded)
    encoded, _ = truncate(encoded, length)
    return _stack([_row([doc], length, pad_id) for doc in encoded], length)


def truncate(encoded, max_len):
    """(examples cut to their first max_len tokens, how many were cut)."""
    cut = [(ids[:max_len], mask[:max_len]) for ids, mask in encoded]
    return cut, sum(len(ids) > max_len for ids, _ in encoded)


def num_targets(batch):
    """How many tokens of `batch` have a target (the loss's denominator)."""
    return int((batch["targets"] != IGNORE_INDEX).sum())


def _targets(ids, mask):
    # targets[t] = ids[t+1] when token t+1 is trained; a document's last token predicts nothing.
    return [ids[t + 1] if mask[t + 1] else IGNORE_INDEX for t in range(len(ids) - 1)] + [IGNORE_INDEX]


def _row(docs, length, pad_id):
    """The four lists of one row: `docs` back to back, then padding as one more document.
    The pad token's value never matters (no target, a document of its own); None pads with 0."""
    input_ids, targets, position_ids, doc_ids = [], [], [], []
    for d, (ids, mask) in enumerate(docs):
        input_ids += ids
        targets += _targets(ids, mask)
        position_ids += range(len(ids))
        doc_ids += [d] * len(ids)
    n_pad = length - len(input_ids)
    input_ids += [0 if pad_id is None else pad_id] * n_pad
    targets += [IGNORE_INDEX] * n_pad
    position_ids += range(n_pad)
    doc_ids += [len(docs)] * n_pad
    return input_ids, targets, position_ids, doc_ids


def _stack(rows, length):
    t = torch.tensor(rows, dtype=torch.long).view(len(rows), len(BATCH_KEYS), length)  # (N, 4, T)
    return {k: t[:, i].contiguous() for i, k in enumerate(BATCH_KEYS)}


class Batches:
    """Training micro-batches, endlessly: shuffled every epoch, resumable, sharded across ranks.

    The rows (packed rows, or single examples when packing is off) are shuffled by a permutation
    that depends only on (seed, epoch), so the position (epoch, index) alone decides the next
    batch: after k batches, state_dict() loaded into a fresh Batches over the same data continues
    with batch k+1, bit for bit.

    With world_size > 1, rank r takes rows r, r + world_size, r + 2 * world_size, ... of each
    epoch's shuffled order. The last (rows % world_size) rows of that order are dropped, so every
    rank has the same number of batches (ranks must step together); a different few are dropped
    each epoch. The last batch of an epoch may be smaller than batch_size.
    Without packing, examples are truncated to max_len and each batch is padded to its longest one.
    """

    def __init__(self, encoded, *, batch_size, max_len, pad_id, packing=True, seed=0, rank=0, world_size=1):
        self.batch_size, self.pad_id, self.packing, self.seed = batch_size, pad_id, packing, seed
        self.rank, self.world_size = rank, world_size
        if packing:
            self.rows, self.truncated = pack(encoded, max_len, pad_id=pad_id)
            n_rows = len(self.rows["input_ids"])
        else:
            self.examples, self.truncated = truncate(encoded, max_len)
            n_rows = len(self.examples)
        if n_rows < world_size:
            raise ValueError(f"the dataset makes {n_rows} rows, fewer than world_size={world_size}, so some "
                             "ranks would get nothing; use more examples or fewer processes")
        self.n_rows, self.rows_per_rank = n_rows, n_rows // world_size
        self.epoch, self.index = 0, 0  # the next batch is batch `index` of epoch `epoch`
        self._cached_order = (None, None)  # (epoch, this rank's rows in that epoch's order)

    def __len__(self):
        """Batches per epoch (the same on every rank)."""
        return math.ceil(self.rows_per_rank / self.batch_size)

    def state_dict(self):
        return {"epoch": self.epoch, "index": self.index, "rows": self.n_rows}

    def load_state_dict(self, state):
        if state["rows"] != self.n_rows:  # other data would make (epoch, index) point at other batches
            raise ValueError(f"the checkpoint's data made {state['rows']} rows, this data makes {self.n_rows}; "
                             "resume with the same dataset, max_len, packing and world_size")
        self.epoch, self.index = state["epoch"], state["index"]

    def __iter__(self):
        return self

    def __next__(self):
        if self.index >= len(self):
            self.epoch, self.index = self.epoch + 1, 0
        rows = self._order(self.epoch)[self.index * self.batch_size:(self.index + 1) * self.batch_size]
        self.index += 1
        if self.packing:
            return {k: v[rows] for k, v in self.rows.items()}  # (B, max_len) each
        return pad_batch([self.examples[i] for i in rows], pad_id=self.pad_id)

    def _order(self, epoch):
        if self._cached_order[0] != epoch:
            # A distinct seed per (seed, epoch) of a run; any fixed mixing would do.
            g = torch.Generator().manual_seed(1_000_003 * self.seed + epoch)
            perm = torch.randperm(self.n_rows, generator=g)
            self._cached_order = (epoch, perm[:self.rows_per_rank * self.world_size][self.rank::self.world_size])
        return self._cached_order[1]


def eval_batches(encoded, *, batch_size, max_len, pad_id, packing=True):
    """All of `encoded` once, in order, as a list of batches (for evaluation; every rank sees all)."""
    if packing:
        rows, _ = pack(encoded, max_len, pad_id=pad_id)
        return [{k: v[i:i + batch_size] for k, v in rows.items()} for i in range(0, len(rows["input_ids"]), batch_size)]
    encoded, _ = truncate(encoded, max_len)
    return [pad_batch(encoded[i:i + batch_size], pad_id=pad_id) for i in range(0, len(encoded), batch_size)]


@torch.no_grad()
def answer_accuracy(logits, batch):
    """(correct, total): how many documents of `batch` that have targets get every target token right
    as the argmax of `logits` (B, T, V), and how many documents have targets.

    This is teacher-forced exact match: each position is scored given the true tokens before it.
    For an answer that ends in a trained EOS, it equals greedy-decoding exact match: if every argmax
    is right given the true prefix, greedy decoding produces exactly that prefix, step by step, and
    conversely. (They differ only when greedy decoding spells the right answer with other tokens.)
    It scores whatever has targets, so encode eval examples with train_on_inputs=False.
    """
    targets, doc_ids = batch["targets"], batch["doc_ids"]  # (B, T) each
    is_target = targets != IGNORE_INDEX
    wrong = is_target & (logits.argmax(-1) != targets)
    docs_per_row = int(doc_ids.max()) + 1
    doc = doc_ids + docs_per_row * torch.arange(len(doc_ids), device=doc_ids.device)[:, None]  # unique per (row, doc)
    n_docs = docs_per_row * len(doc_ids)
    has_target = torch.bincount(doc[is_target], minlength=n_docs) > 0
    has_wrong = torch.bincount(doc[wrong], minlength=n_docs) > 0
    return int((has_target & ~has_wrong).sum()), int(has_target.sum())

# ----------------------------------------------------------------------------- the builtin dataset

N_TRAIN, N_EVAL = 2000, 200


def builtin_dataset(split="train"):
    """The embedded default dataset, in Alpaca format: small tasks with one exact answer each
    (addition, subtraction, km/m, kg/g and hours/minutes conversion, string reversal, sorting,
    counting letters), so a fine-tune's effect shows in `answer_accuracy` within minutes.
    "train" has 2000 examples, "eval" 200, and no question (instruction + input) is in both.
    It is generated by code, deterministically, so the repository ships no data file."""
    if split not in ("train", "eval"):
        raise ValueError(f"unknown builtin split {split!r}; the builtin dataset has 'train' and 'eval'")
    examples = _builtin_examples()
    part = examples[:N_EVAL] if split == "eval" else examples[N_EVAL:]
    return [{"instruction": i, "input": x, "output": o} for i, x, o in part]


@lru_cache(maxsize=1)
def _builtin_examples():
    # Tasks take turns, so both splits hold them in equal shares; a repeated question is redrawn,
    # which makes the first N_EVAL (the eval split) and the rest (train) disjoint.
    rng = random.Random(0)
    seen, examples = set(), []
    while len(examples) < N_EVAL + N_TRAIN:
        ex = _TASKS[len(examples) % len(_TASKS)](rng)
        if ex[:2] not in seen:
            seen.add(ex[:2])
            examples.append(ex)
    return tuple(examples)


def _int(rng, lo, hi):
    """A uniform integer in [lo, hi]. Every draw goes through random(), the one method whose stream
    Python promises to keep across versions, so the dataset (and eval numbers) are the same everywhere."""
    return lo + int(rng.random() * (hi - lo + 1))


def _pick(rng, seq):
    return seq[_int(rng, 0, len(seq) - 1)]


def _number(rng):
    return _int(rng, 0, 10 ** _int(rng, 1, 4) - 1)  # 1 to 4 digits


def _add(rng):
    a, b = _number(rng), _number(rng)
    return "Add the two numbers.", f"{a} + {b}", str(a + b)


def _subtract(rng):
    a, b = _number(rng), _number(rng)
    return "Subtract the second number from the first.", f"{a} - {b}", str(a - b)


def _decimal(tenths):
    return f"{tenths // 10}.{tenths % 10}" if tenths % 10 else str(tenths // 10)


def _metric(big, small, quantity, big_name, small_name):
    def task(rng):
        tenths = _int(rng, 1, 9999)
        large, units = f"{_decimal(tenths)} {big}", f"{tenths * 100} {small}"
        if rng.random() < 0.5:
            return f"Convert the {quantity} to {small_name}.", large, units
        return f"Convert the {quantity} to {big_name}.", units, large
    return task


def _time(rng):
    h, m = _int(rng, 1, 99), _int(rng, 0, 59)
    if rng.random() < 0.5:
        return f"How many minutes are in {h} hours?", "", str(60 * h)
    return f"Convert {60 * h + m} minutes to hours and minutes.", "", f"{h} h {m} min"


def _reverse(rng):
    word = "".join(_pick(rng, _LETTERS) for _ in range(_int(rng, 3, 8)))
    return "Reverse the string.", word, word[::-1]


def _sort(rng):
    nums = [_int(rng, 0, 99) for _ in range(_int(rng, 3, 7))]
    return "Sort the numbers from smallest to largest.", ", ".join(map(str, nums)), ", ".join(map(str, sorted(nums)))


def _count(rng):
    text = " ".join(_pick(rng, _WORDS) for _ in range(_int(rng, 2, 4)))
    # Mostly a letter of the text, sometimes any letter (the answer may be 0). sorted(): set order
    # depends on the process's hash seed.
    letter = _pick(rng, sorted(set(text) - {" "}) if rng.random() < 0.85 else _LETTERS)
    return f"How many times does the letter \"{letter}\" appear in the text?", text, str(text.count(letter))


_LETTERS = "abcdefghijklmnopqrstuvwxyz"
_WORDS = ("apple banana cherry river mountain letter strawberry window garden yellow purple rabbit "
          "pepper coffee bottle summer winter forest butter silver mirror puzzle ladder kitten "
          "balloon mississippi committee bookkeeper engineer parallel tomorrow umbrella zebra").split()
_TASKS = (_add, _subtract, _metric("km", "m", "distance", "kilometers", "meters"),
          _metric("kg", "g", "mass", "kilograms", "grams"), _time, _reverse, _sort, _count)
