"""Batches: encoded examples (ids, mask) packed or padded into rows, served to the loop, and scored.

A batch is a dict of four LongTensors of shape (B, T):
    input_ids     the tokens.
    targets       pre-shifted: targets[b, t] is the token to predict at position t, or IGNORE_INDEX.
                  A document's last token predicts nothing, so in a packed row no document is ever
                  predicted from the one before it.
    position_ids  restart at 0 at every document, so RoPE sees each document as if it were alone.
    doc_ids       the document index within the row (0, 1, 2, ...). Token q may attend to token k
                  iff k <= q and doc_ids[q] == doc_ids[k]. Padding is one more document of its own
                  (in a packed row, one or more: see `pack`), so no query ever has every key masked
                  (which would give NaN in softmax).

Reference: packing with per-document positions and attention (Krell et al. 2021, "Efficient Sequence
Packing without Cross-contamination").
"""
import math

import torch

IGNORE_INDEX = -100  # what torch.nn.functional.cross_entropy skips by default
BATCH_KEYS = ("input_ids", "targets", "position_ids", "doc_ids")
PAD_PIECE = 64  # the shortest document that a packed row's padding is split into (see `pack`)


def pack(encoded, max_len, *, pad_id):
    """Pack encoded examples greedily, in order, into rows of exactly max_len tokens.

    An example never spans two rows: when the next one does not fit, the row is padded and a new
    one begins. An example longer than max_len is truncated to its first max_len tokens (kept
    rather than dropped, so long 'text' documents still train); its answer may be cut short, so
    the count is returned for the caller to report.
    A row's padding is split into documents no longer than the longest example (at least PAD_PIECE
    tokens). A row's padding is shorter than the example that did not fit, except in the last row,
    whose padding may be most of the row: split, it is no longer than the data's documents, so it
    does not raise a batch's longest-document bound (which sizes flash attention's grid and is part
    of a CUDA graph's key, step.py) above what the data needs, and its attention costs no more than
    an example's. No target and no other document sees it, so the loss is the same either way.
    Returns (rows, n_truncated); rows is a batch dict of (N, max_len) LongTensors.
    """
    encoded, n_truncated = truncate(encoded, max_len)
    piece = max([PAD_PIECE] + [len(ids) for ids, _ in encoded])
    rows = [_row([encoded[i] for i in row], max_len, pad_id, piece)
            for row in layout([len(ids) for ids, _ in encoded], max_len)]
    return _stack(rows, max_len), n_truncated


def layout(lengths, max_len):
    """Which examples `pack` puts in each row: lists of indices, greedily in order, each row's lengths (each at
    most max_len) summing to at most max_len."""
    rows, row, used = [], [], 0
    for i, n in enumerate(lengths):
        if used + n > max_len:
            rows.append(row)
            row, used = [], 0
        row.append(i)
        used += n
    return rows + [row] if row else rows


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


def _row(docs, length, pad_id, piece=None):
    """The four lists of one row: `docs` back to back, then padding as one more document, or as documents
    of at most `piece` tokens. The pad token's value never matters (no target, a document of its own);
    None pads with 0."""
    input_ids, targets, position_ids, doc_ids = [], [], [], []
    for d, (ids, mask) in enumerate(docs):
        input_ids += ids
        targets += _targets(ids, mask)
        position_ids += range(len(ids))
        doc_ids += [d] * len(ids)
    n_pad = length - len(input_ids)
    input_ids += [0 if pad_id is None else pad_id] * n_pad
    targets += [IGNORE_INDEX] * n_pad
    piece = piece or max(n_pad, 1)
    for i, start in enumerate(range(0, n_pad, piece)):
        n = min(piece, n_pad - start)
        position_ids += range(n)
        doc_ids += [len(docs) + i] * n
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
        n_rows = self._lay_out(encoded, max_len)
        if n_rows < world_size:
            raise ValueError(f"the dataset makes {n_rows} rows, fewer than world_size={world_size}, so some "
                             "ranks would get nothing; use more examples or fewer processes")
        self.n_rows, self.rows_per_rank = n_rows, n_rows // world_size
        self.epoch, self.index = 0, 0  # the next batch is batch `index` of epoch `epoch`
        self._cached_order = (None, None)  # (epoch, this rank's rows in that epoch's order)

    def _lay_out(self, encoded, max_len):
        """Make the rows that the batches are drawn from (packed rows, or the examples); returns their count."""
        if self.packing:
            self.rows, self.truncated = pack(encoded, max_len, pad_id=self.pad_id)
            return len(self.rows["input_ids"])
        self.examples, self.truncated = truncate(encoded, max_len)
        return len(self.examples)

    def _batch(self, rows):
        """The micro-batch of rows `rows` (indices into the rows that `_lay_out` made)."""
        if self.packing:
            return {k: v[rows] for k, v in self.rows.items()}  # (B, max_len) each
        return pad_batch([self.examples[i] for i in rows], pad_id=self.pad_id)

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
        return self._batch(rows)

    def peek(self):
        """The next batch, without moving past it."""
        state = self.state_dict()
        batch = next(self)
        self.load_state_dict(state)
        return batch

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
def answer_accuracy(hit, batch):
    """(correct, total): how many documents of `batch` that have targets get every target token right,
    and how many documents have targets. hit (B, T) bool: the argmax of the logits is the target
    (`Transformer.score` gives it without B x T x V logits).

    This is teacher-forced exact match: each position is scored given the true tokens before it.
    For an answer that ends in a trained EOS, it equals greedy-decoding exact match: if every argmax
    is right given the true prefix, greedy decoding produces exactly that prefix, step by step, and
    conversely. (They differ only when greedy decoding spells the right answer with other tokens.)
    It scores whatever has targets, so encode eval examples with train_on_inputs=False.
    """
    targets, doc_ids = batch["targets"], batch["doc_ids"]  # (B, T) each
    is_target = targets != IGNORE_INDEX
    wrong = is_target & ~hit
    docs_per_row = int(doc_ids.max()) + 1
    doc = doc_ids + docs_per_row * torch.arange(len(doc_ids), device=doc_ids.device)[:, None]  # unique per (row, doc)
    n_docs = docs_per_row * len(doc_ids)
    has_target = torch.bincount(doc[is_target], minlength=n_docs) > 0
    has_wrong = torch.bincount(doc[wrong], minlength=n_docs) > 0
    return int((has_target & ~has_wrong).sum()), int(has_target.sum())
