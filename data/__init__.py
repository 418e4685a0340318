"""Data: read datasets, tokenize them with a loss mask, and batch them (packed or padded).

    load_datasets(tokenizer, data=..., ...) -> (train, eval)   read, split, tokenize (cached, parallel), check
    load_pairs(tokenizer, data=..., ...) -> (train, eval)      the same for preference pairs (--method dpo, ...)
    load_examples(spec) -> [dict]                    the rows of a file, a folder, a hub dataset or "builtin"
    encode_example(ex, tokenizer) -> (ids, mask)     mask[i]: token i is a training target
    Batches(encoded, ...)                            endless, shuffled, resumable, sharded micro-batches
    answer_accuracy(hit, batch) -> (correct, total)

This module holds `load_datasets`, which reads, splits, tokenizes and checks; each job it calls has a
module of its own:
    data/sources.py    the rows of files (.jsonl, .json, .csv, .txt, .parquet), folders, save_to_disk
                       folders and hub datasets; --columns, --max-examples
    data/formats.py    row formats, the Alpaca prompt, chat templates and their rendering, `encode_example`,
                       `held_out_prompt`, --chat-template
    data/cache.py      the tokenized-data cache and the tokenizing pool
    data/batches.py    the batch layout, packing and padding, `Batches`, `eval_batches`, `answer_accuracy`
    data/builtin.py    the embedded dataset ("builtin")
    data/arithmetic.py the embedded arithmetic tasks ("builtin:arithmetic")
    data/preference.py preference pairs: their formats, fitting them to max_len, `PairBatches`
The names that the rest of nanotune uses are importable from `data` itself (`data.Batches`).
"""
import math
import random

from data.batches import (
    IGNORE_INDEX,
    PAD_PIECE,
    Batches,
    _row,
    _stack,
    answer_accuracy,
    eval_batches,
    num_targets,
    pack,
    pad_batch,
)
from data.builtin import _TASKS, _builtin_examples, builtin_dataset
from data.cache import CHUNK, _cpu_count, _encode_cached, default_cache_dir
from data.formats import (
    SlowTemplate,
    _layout,
    alpaca_messages,
    encode_example,
    held_out_prompt,
    prompt_and_answer,
    template_roles,
    use_chat_template,
)
from data.preference import FIELDS as PAIR_FIELDS
from data.preference import KNOWN_FORMATS as PAIR_FORMATS
from data.preference import PairBatches, encode_pairs, pair_eval_batches
from data.preference import sides as pair_sides
from data.sources import _is_builtin, _records, builtin_eval_spec, load_examples, parse_columns

# What other code reads as data.<name>: the API, and the helpers that tests and benchmarks reach into.
__all__ = ["CHUNK", "EVAL_FEW", "IGNORE_INDEX", "PAD_PIECE", "Batches", "_TASKS", "_builtin_examples", "_records",
           "_row", "_split", "_stack", "alpaca_messages", "answer_accuracy", "builtin_dataset", "default_cache_dir",
           "encode_example", "eval_batches", "held_out_prompt", "load_datasets", "load_examples", "load_pairs",
           "num_targets", "pack", "pad_batch", "prompt_and_answer",
           "PairBatches", "pair_eval_batches", "template_roles",
           "use_chat_template"]


EVAL_FEW = 20  # an eval set smaller than this is warned about: one example moves its accuracy by over 5%


def load_datasets(tokenizer, *, data="builtin", eval_data=None, eval_fraction=0.02, max_examples=None,
                  columns=None, chat_template=None, system_prompt=None, train_on_inputs=False,
                  max_len=2048, seed=1337, num_proc=None, cache_dir=None, log=print, with_rows=False):
    """(train, eval): the training and evaluation examples as lists of (ids, mask), for `Batches`;
    with_rows=True: (train, eval, the eval rows as dicts, in the same order) for `held_out_prompt`.

    Reads `data` (any source `load_examples` takes) and keeps its first `max_examples` rows. The eval
    set is `eval_data` when given; else "builtin"'s own eval split; else `eval_fraction` of the rows,
    held out by a shuffle seeded with `seed` (at most 200 rows, none when there are under 20).
    `columns` maps column names (`parse_columns`), `chat_template` is a file whose Jinja template
    replaces the model's, `system_prompt` adds a system turn to chats without one, and
    train_on_inputs trains the training examples' prompt tokens too.

    Every row is checked before any is tokenized. Tokenizing runs in `num_proc` processes (default:
    every CPU) and is cached in `cache_dir` (default `default_cache_dir()`), keyed by the rows, the
    tokenizer, the chat template, the system prompt and the code that encodes them: the same data
    again is read back without tokenizing. Training and eval examples longer than max_len are dropped,
    saying so (`log`), as truncating them would cut off their answers; an eval set of fewer than EVAL_FEW
    examples is warned about. Bad input (also an eval set left with no target token) raises ValueError
    or FileNotFoundError with a one-line message.
    """
    if not 0 <= eval_fraction < 1:
        raise ValueError(f"--eval-fraction must be at least 0 and below 1 (got {eval_fraction}): it is the share "
                         "of --data held out for evaluation")
    for name, value in (("--max-examples", max_examples), ("--num-proc", num_proc)):
        if value is not None and value < 1:
            raise ValueError(f"{name} must be at least 1 (got {value})")
    mapping = parse_columns(columns)
    if mapping and _is_builtin(data):
        raise ValueError("--columns maps the column names of your --data; the builtin dataset needs none")
    tokenizer = use_chat_template(tokenizer, chat_template)
    records = _records(data, mapping, max_examples)
    eval_records = (_records(eval_data, mapping, None) if eval_data is not None
                    else _records(builtin_eval_spec(data), {}, None) if _is_builtin(data) else None)
    for where, row in records + (eval_records or []):
        _layout(row, tokenizer, system_prompt, where)
    options = dict(tokenizer=tokenizer, system_prompt=system_prompt, num_proc=num_proc or _cpu_count(),
                   cache_dir=cache_dir or default_cache_dir(), log=log)
    try:
        encoded = _encode_cached(records, **options)
        held_out = _encode_cached(eval_records, **options) if eval_records is not None else None
    except SlowTemplate as e:
        raise ValueError(e.message(f"--chat-template {chat_template}" if chat_template else
                                   "the model's chat template")) from None
    if held_out is not None:
        train = encoded
    else:
        train_rows, eval_rows = _split(len(records), eval_fraction, seed)
        train, held_out = [encoded[i] for i in train_rows], [encoded[i] for i in eval_rows]
        eval_records = [records[i] for i in eval_rows]
        if not eval_rows:
            log(_no_eval_split(len(records), eval_fraction))
    if train_on_inputs:  # every token a target, as encode_example(train_on_inputs=True) makes it
        train = [(ids, [True] * len(ids)) for ids, _ in train]
    fits = [e for e in train if len(e[0]) <= max_len]
    if not fits:
        raise ValueError(f"every training example is longer than --max-len {max_len} (the shortest has "
                         f"{min(len(ids) for ids, _ in train)} tokens); raise --max-len or shorten the examples")
    if not any(any(mask[1:]) for _, mask in fits):  # a target needs a token before it
        raise ValueError("no example has any target token (every label is masked): check the dataset's "
                         "answers/assistant turns, or pass --train-on-inputs")
    if len(fits) < len(train):
        log(f"data: dropped {len(train) - len(fits)} of {len(train)} examples longer than --max-len {max_len}")
    if held_out:
        split = eval_data is None and not _is_builtin(data)
        held_out, eval_records = _eval_fits(held_out, eval_records, max_len, split, log)
    return (fits, held_out, [row for _, row in eval_records]) if with_rows else (fits, held_out)


def load_pairs(tokenizer, *, data, eval_data=None, eval_fraction=0.02, max_examples=None, columns=None,
               chat_template=None, system_prompt=None, max_len=2048, seed=1337, log=print, **_):
    """(train, eval): the encoded pairs, each a flat list [chosen 0, rejected 0, chosen 1, ...] of (ids, mask),
    for `PairBatches`. The eval set is `eval_data`, else `eval_fraction` of the rows (as data.load_datasets
    holds them out). Options as data.load_datasets takes them (train_on_inputs and num_proc do not apply)."""
    if _is_builtin(data):
        raise ValueError("preference tuning (--method) trains on pairs of answers, and the builtin dataset has "
                         f"none; pass --data FILE with {PAIR_FORMATS}")
    mapping = parse_columns(columns, PAIR_FIELDS)
    tokenizer = use_chat_template(tokenizer, chat_template)
    records = _records(data, mapping, max_examples, check=pair_sides)
    eval_records = _records(eval_data, mapping, None, check=pair_sides) if eval_data is not None else None
    if eval_records is None:
        train_rows, eval_rows = _split(len(records), eval_fraction, seed)
        records, eval_records = [records[i] for i in train_rows], [records[i] for i in eval_rows]
        if not eval_rows:
            log(_no_eval_split(len(records), eval_fraction))
    train = encode_pairs(records, tokenizer, system_prompt, max_len, "", log)
    held_out = encode_pairs(eval_records, tokenizer, system_prompt, max_len, "eval ", log) if eval_records else []
    if not train:
        raise ValueError(f"no training pair is left (see the lines above): every pair has an empty side or prompts "
                         f"longer than --max-len {max_len} allows; raise --max-len or check the data")
    return train, held_out


def _eval_fits(held_out, records, max_len, split, log):
    """(eval examples, their records) without those longer than max_len, whose answers truncation would cut
    off (an example with no target left scores nothing, and one cut short scores the wrong answer), saying
    how many were dropped. An eval set left with no target token is a ValueError (its loss would read 0.0);
    one of fewer than EVAL_FEW examples is warned about. split: the eval set is held out of --data."""
    keep = [i for i, (ids, _) in enumerate(held_out) if len(ids) <= max_len]
    if len(keep) < len(held_out):
        log(f"data: dropped {len(held_out) - len(keep)} of {len(held_out)} eval examples longer than --max-len "
            f"{max_len} (truncating them would cut off their answers)")
    if not keep:
        raise ValueError(f"every eval example is longer than --max-len {max_len} (the shortest has "
                         f"{min(len(ids) for ids, _ in held_out)} tokens), so the eval would score no answer; raise "
                         "--max-len, or evaluate on shorter examples with --eval-data FILE"
                         + (", or hold out none with --eval-fraction 0" if split else ""))
    held_out, records = [held_out[i] for i in keep], [records[i] for i in keep]
    if not any(any(mask[1:]) for _, mask in held_out):  # a target needs a token before it
        raise ValueError("no eval example has any target token (every label is masked), so the eval would score "
                         "nothing: check the eval data's answers/assistant turns"
                         + (", or hold out none with --eval-fraction 0" if split else ""))
    if len(held_out) < EVAL_FEW:
        log(f"data: warning: the eval set has only {len(held_out)} example{'s' if len(held_out) > 1 else ''}, so "
            f"its loss and accuracy are noisy (one example is {1 / len(held_out):.0%} of the accuracy); "
            + ("hold out more with --eval-fraction, or pass " if split else "pass ")
            + f"--eval-data FILE with {EVAL_FEW} or more")
    return held_out, records


def _split(n, eval_fraction, seed):
    """(training row indices, eval row indices) of n rows: eval_fraction of them (at most 200, none when
    there are under 20) held out by a shuffle seeded with `seed`."""
    n_eval = min(200, int(n * eval_fraction)) if n >= 20 else 0
    order = list(range(n))
    random.Random(seed).shuffle(order)
    return order[n_eval:], order[:n_eval]


def _no_eval_split(n, eval_fraction):
    if n < 20:
        return (f"data: no eval split: {n} examples are too few to hold any out (it takes 20); "
                "pass --eval-data FILE to evaluate on a set of your own")
    return (f"data: no eval split: --eval-fraction {eval_fraction} of {n} examples holds out none; pass "
            f"--eval-fraction {math.ceil(100 / n) / 100:g} or more, or --eval-data FILE, to evaluate")
