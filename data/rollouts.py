"""Rollouts into training batches for GRPO (grpo.py reads them; rl.py makes them).

    rollouts = [Rollout(prompt_ids, completion_ids, advantage, old_logps), ...]
    batches = collate(rollouts, max_len=1024, pad_id=0, rows=8)      # fixed_shapes=True: for a CUDA graph
    train, held_out = load_prompts(tokenizer, data="builtin", ...)   # Prompt(question, ids, answer) lists
    prompts = PromptBatches(train, batch_size=4, seed=0)            # P prompts per step, resumable

A rollout (prompt + completion) is one document, laid out as SFT lays out an example whose completion is its
answer (data/batches.py): packed rows of max_len tokens with per-document positions (the same packer, `layout`),
or one rollout per row, right-padded (packing=False). Only the completion's tokens are targets, shifted as SFT's:
targets[t] is token t + 1 where that is a completion token. Besides SFT's four tensors a batch holds, for the
N rollout slots it carries (numbered 0..N-1 within the batch):
    seq_ids      (B, T) int64  the rollout of each token's document (padding 0: it has no target)
    seq_lengths  (N,)          each rollout's completion-token count (0: an empty completion, or no rollout)
    rollout_mask (N,) bool     True where the slot holds a rollout, False in a padding slot (fixed_shapes)
    advantages   (N,) fp32     (0 in a padding slot)
    old_logps    (B, T) fp32   the sampling policy's log-prob of each target token, 0 where there is none
    ref_logps    (B, T) fp32   the reference's, likewise (only when every rollout has them: β > 0)
"""
from typing import NamedTuple

import torch

from data.batches import IGNORE_INDEX, Batches, layout, pack, pad_batch
from data.formats import held_out_prompt, use_chat_template
from data.sources import _is_builtin, _records, builtin_eval_spec, parse_columns


class Prompt(NamedTuple):
    question: str  # the text the answer replies to (the last user turn), as reward functions get it
    ids: list  # the prompt's token ids, rendered as SFT renders the row, up to where its answer starts
    answer: str | None  # the row's answer (its completion or last assistant turn): the reference


def load_prompts(tokenizer, *, data="builtin", eval_data=None, eval_fraction=0.02, max_examples=None, columns=None,
                 chat_template=None, system_prompt=None, seed=1337, max_prompt_len=None, log=print, **_):
    """(train, eval): the Prompts of the rows of `data` (any source SFT reads: prompt/completion, Alpaca or
    messages rows), held out as data.load_datasets holds them out (`eval_data`, builtin's eval split, or
    `eval_fraction` of the rows). A row with no prompt before its answer (plain text) is skipped, and so is one
    whose prompt is longer than max_prompt_len, saying how many. ValueError when no training prompt is left."""
    from data import _split  # the held-out split of data.load_datasets, which imports this module's package
    tokenizer = use_chat_template(tokenizer, chat_template)
    mapping = parse_columns(columns)
    records = _records(data, mapping, max_examples)
    eval_records = (_records(eval_data, mapping, None) if eval_data is not None
                    else _records(builtin_eval_spec(data), {}, None) if _is_builtin(data) else None)
    if eval_records is None:
        train_rows, eval_rows = _split(len(records), eval_fraction, seed)
        records, eval_records = [records[i] for i in train_rows], [records[i] for i in eval_rows]

    def prompts(rows, what):
        cases = [held_out_prompt(row, tokenizer, system_prompt) for _, row in rows]
        out = [Prompt(*c) for c in cases if c is not None and (max_prompt_len is None or len(c[1]) <= max_prompt_len)]
        if len(out) < len(rows):
            log(f"data: {len(rows) - len(out)} of {len(rows)} {what} rows have no prompt before their answer or a "
                f"prompt longer than {max_prompt_len} tokens (--max-len - --max-new-tokens); skipped")
        return out
    train = prompts(records, "training")
    if not train:
        raise ValueError("no training prompt is left: the rows need a prompt (a prompt/completion, Alpaca or "
                         "messages row) that fits --max-len with --max-new-tokens")
    return train, prompts(eval_records, "eval")


class PromptBatches(Batches):
    """The prompts of each step, batch_size at a time, in data.Batches' order: shuffled every epoch by (seed,
    epoch), resumable from (epoch, index)."""

    def __init__(self, prompts, *, batch_size, seed=0):
        super().__init__(prompts, batch_size=batch_size, max_len=None, pad_id=None, packing=False, seed=seed)

    def _lay_out(self, prompts, max_len):
        self.prompts, self.truncated = prompts, 0
        return len(prompts)

    def _batch(self, rows):
        return [self.prompts[i] for i in rows]


class Rollout(NamedTuple):
    prompt: list  # token ids
    completion: list  # token ids, up to and including a stop id
    advantage: float = 0.0
    old_logps: list | None = None  # one per completion token
    ref_logps: list | None = None


def collate(rollouts, *, max_len, pad_id, packing=True, rows=None, device="cpu", fixed_shapes=False):
    """The batches of `rollouts`, in order, each at most `rows` rows (None: one batch). Packed: rows of exactly
    max_len tokens; padded: one rollout per row, right-padded to the batch's longest. A rollout longer than
    max_len is refused (its completion would lose tokens).
    fixed_shapes: few shapes per run, as a CUDA graph replays them (rl.py under step.GraphStep, which also pads a
    padded batch's length to its bucket): a batch's row count is raised to a power of two (at most `rows`) with
    rows of padding, and its rollout slots to a power of two with padding slots (no token, advantage 0,
    rollout_mask False). Neither adds to the loss, its gradients or its metrics."""
    if not rollouts:
        return []
    longest = max(len(r.prompt) + len(r.completion) for r in rollouts)
    if longest > max_len:
        raise ValueError(f"a rollout of {longest} tokens (prompt + completion) does not fit --max-len {max_len}; "
                         "raise --max-len or lower --max-new-tokens")
    placed = layout([len(r.prompt) + len(r.completion) for r in rollouts], max_len) if packing else \
        [[i] for i in range(len(rollouts))]
    rows = rows or len(placed)
    return [_batch([[rollouts[i] for i in row] for row in placed[k:k + rows]], max_len, pad_id, packing, device,
                   rows if fixed_shapes else None)
            for k in range(0, len(placed), rows)]


def power_of_two(n, most=None):
    """The least power of two >= n, at most `most` (where that is not below n)."""
    p = 1 << max(n - 1, 0).bit_length()
    return p if most is None else max(min(p, most), n)


def _batch(row_rollouts, max_len, pad_id, packing, device, rows=None):
    """One batch of rows, each a list of rollouts laid side by side; rows: the most a batch has, whose power of
    two (at most rows) its rows and slots are padded to (collate's fixed_shapes), or None: no padding."""
    flat = [r for row in row_rollouts for r in row]
    encoded = [(r.prompt + r.completion, [0] * len(r.prompt) + [1] * len(r.completion)) for r in flat]
    # Greedy packing starts afresh at a row's first rollout, so these rollouts packed again make the rows that
    # `layout` chose for them.
    batch = pack(encoded, max_len, pad_id=pad_id)[0] if packing else pad_batch(encoded, pad_id=pad_id)
    B, T = batch["input_ids"].shape
    assert B == len(row_rollouts), (B, len(row_rollouts))
    slots = len(flat)
    if rows is not None:
        # A padding row is one document of pad tokens without targets; a padding slot has no token.
        extra = power_of_two(B, rows) - B
        fill = {"input_ids": pad_id, "targets": IGNORE_INDEX, "position_ids": 0, "doc_ids": 0}
        batch = {k: torch.cat([v, torch.full((extra, T), fill[k], dtype=v.dtype)]) for k, v in batch.items()}
        batch["position_ids"][B:] = torch.arange(T)
        row_rollouts, B, slots = row_rollouts + [[]] * extra, B + extra, power_of_two(slots)
    seq_ids = torch.zeros(B, T, dtype=torch.long)
    old, ref = torch.zeros(B, T), torch.zeros(B, T)
    n = 0
    for b, row in enumerate(row_rollouts):
        col = 0
        for r in row:
            end = col + len(r.prompt) + len(r.completion)
            seq_ids[b, col:end] = n
            # The j-th completion token is predicted at position len(prompt) - 1 + j of its document.
            first = col + len(r.prompt) - 1
            if r.old_logps is not None:
                old[b, first:first + len(r.completion)] = torch.tensor(r.old_logps, dtype=torch.float32)
            if r.ref_logps is not None:
                ref[b, first:first + len(r.completion)] = torch.tensor(r.ref_logps, dtype=torch.float32)
            col, n = end, n + 1
    empty = slots - len(flat)
    batch.update(seq_ids=seq_ids, old_logps=old,
                 seq_lengths=torch.tensor([len(r.completion) for r in flat] + [0] * empty, dtype=torch.long),
                 rollout_mask=torch.arange(slots) < len(flat),
                 advantages=torch.tensor([float(r.advantage) for r in flat] + [0.0] * empty, dtype=torch.float32))
    if all(r.ref_logps is not None for r in flat):
        batch["ref_logps"] = ref
    assert int((batch["targets"] != IGNORE_INDEX).sum()) == int(batch["seq_lengths"].sum())
    return {k: v.to(device) for k, v in batch.items()}

