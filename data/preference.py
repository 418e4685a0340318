"""Preference data: rows of (prompt, chosen, rejected), each pair encoded as two documents, and batched with
both sides of a pair in one micro-batch (`PairBatches`).

Row formats, as TRL's preference trainers read them (`--columns prompt=question,chosen=good,...` maps others):
    {"prompt": str, "chosen": str, "rejected": str}              text: the completions follow the prompt verbatim
    {"prompt": [messages], "chosen": [messages], "rejected": [messages]}   a chat: the prompt's turns, then each
                                                                  side's assistant turn(s), rendered by the chat
                                                                  template
    {"chosen": ..., "rejected": ...}                             the implicit prompt: two texts, or two chats, that
                                                                  share their beginning, which is the prompt
Each side becomes an SFT row, {"prompt", "completion"} (data/formats.py): the same chat template, BOS and EOS as
supervised fine-tuning, and the loss on the completion's tokens only.

A pair is kept whole, in one packed row (or in one micro-batch without packing), so it must fit in --max-len
tokens, both sides together. A pair whose two prompts leave no room for a completion token on each side is
dropped, and so is a pair with an empty side; longer completions are cut to fit, the longer one first. The
header line counts all three.
"""
import torch

from data.batches import IGNORE_INDEX, PAD_PIECE, Batches, _row, _stack, pad_batch
from data.formats import encode_example

FIELDS = ("prompt", "chosen", "rejected")
KNOWN_FORMATS = ("'prompt', 'chosen' and 'rejected' (strings, or lists of messages), or 'chosen' and 'rejected' "
                 "alone (the shared beginning is the prompt)")


def sides(row, where="example"):
    """(the chosen side, the rejected side) of a preference row, as SFT rows {"prompt", "completion"}; a
    ValueError naming the row when it is in no known format."""
    if not isinstance(row, dict) or "chosen" not in row or "rejected" not in row:
        found = sorted(row) if isinstance(row, dict) else type(row).__name__
        raise ValueError(f"{where}: expected a preference pair (found {found}). Known formats: {KNOWN_FORMATS}; "
                         "map other names with --columns prompt=...,chosen=...,rejected=...")
    chosen, rejected = row["chosen"], row["rejected"]
    kinds = {type(v) for v in (chosen, rejected, row.get("prompt", chosen))}
    if not (kinds <= {str} or kinds <= {list}):
        raise ValueError(f"{where}: 'prompt', 'chosen' and 'rejected' must all be strings, or all lists of messages")
    prompt = row.get("prompt")
    if prompt is None:
        prompt, chosen, rejected = implicit_prompt(chosen, rejected)
        if isinstance(prompt, list) and not prompt:
            raise ValueError(f"{where}: 'chosen' and 'rejected' share no first message, so they have no prompt; "
                             "give it as 'prompt'")
    return {"prompt": prompt, "completion": chosen}, {"prompt": prompt, "completion": rejected}


def implicit_prompt(chosen, rejected):
    """(prompt, chosen, rejected) from two texts or two message lists that share their beginning, as TRL's
    `extract_prompt` splits them: the prompt is the longest shared beginning, less a space it ends in."""
    n = 0
    while n < min(len(chosen), len(rejected)) and chosen[n] == rejected[n]:
        n += 1
    if n < min(len(chosen), len(rejected)) and n > 0 and chosen[n - 1] == " ":
        n -= 1  # the space starts the completion
    return chosen[:n], chosen[n:], rejected[n:]


def empty(completion):
    """Whether a completion says nothing: blank text, or messages whose contents are all blank."""
    if isinstance(completion, str):
        return not completion.strip()
    return not any(isinstance(m, dict) and str(m.get("content") or m.get("value") or "").strip() for m in completion)


def encode_pairs(records, tokenizer, system_prompt, max_len, what, log):
    """The pairs of `records` encoded, flat (see data.load_pairs), those that cannot train dropped, and a line that
    counts what was dropped or cut."""
    encoded, no_side, too_long, cut = [], 0, 0, 0
    for where, row in records:
        chosen, rejected = sides(row, where)
        if empty(chosen["completion"]) or empty(rejected["completion"]):
            no_side += 1
            continue
        pair = [encode_example(side, tokenizer, system_prompt=system_prompt, where=where)
                for side in (chosen, rejected)]
        if not all(any(mask[1:]) for _, mask in pair):  # a side with no target token
            no_side += 1
            continue
        fitted = fit_pair(pair, max_len)
        if fitted is None:
            too_long += 1
            continue
        cut += fitted != pair
        encoded += fitted
    n = len(records)
    dropped = [f"{k} with an empty side" for k in [no_side] if k] + [
        f"{k} whose prompts leave no room for an answer in --max-len {max_len}" for k in [too_long] if k]
    log(f"data: {len(encoded) // 2} {what}pairs of {n}" + (f"; dropped {', '.join(dropped)}" if dropped else "")
        + (f"; cut the completions of {cut} to fit --max-len {max_len} (both sides of a pair share a row)"
           if cut else ""))
    return encoded


def fit_pair(pair, max_len):
    """[chosen, rejected] cut so that both fit in max_len tokens together, or None when their prompts leave
    no room for one completion token on each side. The longer completion is cut first; a cut side keeps its
    first tokens, so it ends without EOS (the model does not learn to stop there)."""
    (ids_c, mask_c), (ids_r, mask_r) = pair
    if len(ids_c) + len(ids_r) <= max_len:
        return pair
    prompt_c, prompt_r = mask_c.index(True), mask_r.index(True)
    room = max_len - prompt_c - prompt_r
    if room < 2:
        return None
    n_c, n_r = len(ids_c) - prompt_c, len(ids_r) - prompt_r
    keep_c = n_c if n_c <= room // 2 else room - min(n_r, room // 2)
    keep_r = room - keep_c
    return [(ids_c[:prompt_c + keep_c], mask_c[:prompt_c + keep_c]), (ids_r[:prompt_r + keep_r],
                                                                      mask_r[:prompt_r + keep_r])]


def pack_pairs(encoded, max_len, *, pad_id):
    """Pack pairs greedily, in order, into rows of exactly max_len tokens, as data.batches.pack packs examples:
    each pair is two documents (chosen, then rejected), and a pair never spans two rows (`fit_pair` made each
    fit one). Returns (rows: a batch dict of (N, max_len) LongTensors, pairs: (N,) the pair count of each row)."""
    piece = max([PAD_PIECE] + [len(ids) for ids, _ in encoded])
    rows, counts, docs, used = [], [], [], 0
    for i in range(0, len(encoded), 2):
        pair = encoded[i:i + 2]
        n = len(pair[0][0]) + len(pair[1][0])
        if used + n > max_len:
            rows.append(_row(docs, max_len, pad_id, piece))
            counts.append(len(docs) // 2)
            docs, used = [], 0
        docs += pair
        used += n
    if docs:
        rows.append(_row(docs, max_len, pad_id, piece))
        counts.append(len(docs) // 2)
    return _stack(rows, max_len), torch.tensor(counts)


def with_sequences(batch, n_sides, ref_logps=None):
    """`batch` with "seq_ids" (B, T): each token's side in the micro-batch, 2p (chosen) or 2p + 1 (rejected) of
    its p-th pair (0 for padding, which has no target), and "seq_lengths" (2S,): each side's target count.
    n_sides (B,): how many of a row's first documents are sides (2 per pair packed, 1 per row padded).
    The P pairs fill the first of S = `pair_slots(P)` slots; the slots after them hold no pair (length 0, which
    the loss masks), so that micro-batches of one bucket have one shape (a CUDA graph's, step.py).
    ref_logps (2P,): the pairs' reference log-probabilities (--precompute-ref), kept as "ref_logps" (2S,)."""
    doc_ids, targets = batch["doc_ids"], batch["targets"]
    offset = torch.cumsum(n_sides, 0) - n_sides  # (B,) the row's first side in the micro-batch
    is_side = doc_ids < n_sides[:, None]
    seq_ids = torch.where(is_side, doc_ids + offset[:, None], 0)
    n = int(n_sides.sum())
    slots = 2 * pair_slots(n // 2)
    lengths = torch.bincount(seq_ids[is_side & (targets != IGNORE_INDEX)], minlength=slots)
    out = {**batch, "seq_ids": seq_ids, "seq_lengths": lengths}
    if ref_logps is not None:
        out["ref_logps"] = torch.cat([ref_logps.float(), ref_logps.new_zeros(slots - n, dtype=torch.float32)])
    return out


def pair_slots(n_pairs):
    """The pair slots of a micro-batch of n_pairs pairs: the next power of two, so that few shapes occur."""
    return 1 << max(n_pairs - 1, 0).bit_length()


def pad_pairs(encoded, *, pad_id, ref_logps=None):
    """The pairs of flat `encoded` one side per row (chosen, rejected, chosen, ...), padded to the longest."""
    batch = pad_batch(encoded, pad_id=pad_id)
    return with_sequences(batch, torch.ones(len(encoded), dtype=torch.long), ref_logps)


class PairBatches(Batches):
    """Training micro-batches of pairs, as `Batches` serves examples (shuffled, resumable, sharded): packed, a
    micro-batch is batch_size rows of whole pairs; padded, it is batch_size pairs, one side per row.
    ref_logps: None, or (2N,) the reference log-probabilities of the N pairs in order (--precompute-ref,
    preference.reference_logps), which each micro-batch then carries for its pairs."""

    ref_logps = None

    def _lay_out(self, encoded, max_len):
        self.truncated = 0  # load_pairs fitted every pair to max_len
        if self.packing:
            self.rows, self.pairs = pack_pairs(encoded, max_len, pad_id=self.pad_id)
            self.first_pair = torch.cumsum(self.pairs, 0) - self.pairs  # (N,) each row's first pair
            return len(self.pairs)
        self.examples = [encoded[i:i + 2] for i in range(0, len(encoded), 2)]
        return len(self.examples)

    def _batch(self, rows):
        rows = torch.as_tensor(rows)
        if self.packing:
            pairs = torch.cat([torch.arange(int(f), int(f + n)) for f, n in zip(self.first_pair[rows],
                                                                               self.pairs[rows])])
            return with_sequences({k: v[rows] for k, v in self.rows.items()}, 2 * self.pairs[rows],
                                  self._ref(pairs))
        return pad_pairs([side for i in rows.tolist() for side in self.examples[i]], pad_id=self.pad_id,
                         ref_logps=self._ref(rows))

    def _ref(self, pairs):
        """The reference log-probabilities of pairs `pairs` (indices), chosen and rejected in turn, or None."""
        return None if self.ref_logps is None else self.ref_logps.view(-1, 2)[pairs].reshape(-1)


def pair_eval_batches(encoded, *, batch_size, max_len, pad_id, packing=True):
    """All pairs of `encoded` once, in order, as a list of micro-batches (for evaluation)."""
    if packing:
        rows, pairs = pack_pairs(encoded, max_len, pad_id=pad_id)
        return [with_sequences({k: v[i:i + batch_size] for k, v in rows.items()}, 2 * pairs[i:i + batch_size])
                for i in range(0, len(pairs), batch_size)]
    return [pad_pairs(encoded[i:i + 2 * batch_size], pad_id=pad_id) for i in range(0, len(encoded), 2 * batch_size)]
