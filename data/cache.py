"""The tokenized-data cache: `encode_example` of every row, read back from a .npz file keyed by the rows,
the tokenizer, the chat template, the system prompt and the code that encodes them, or else tokenized
(in a pool of processes) and written there."""
import contextlib
import hashlib
import json
import multiprocessing
import os
import signal
import time
from functools import lru_cache

import numpy as np
from tqdm import tqdm

from data.formats import encode_example
from model.files import atomic_file, open_read

CHUNK = 256  # examples per task of the tokenizing pool
PROGRESS_EVERY = 10.0  # seconds between progress lines while tokenizing


def default_cache_dir():
    """Where tokenized datasets are cached: $NANOTUNE_CACHE/datasets, else ~/.cache/nanotune/datasets.
    Each is one .npz file named by its key; deleting the folder is always safe."""
    root = os.environ.get("NANOTUNE_CACHE") or os.path.join(os.path.expanduser("~"), ".cache", "nanotune")
    return os.path.join(root, "datasets")


def _cpu_count():
    return len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else os.cpu_count() or 1


def _encode_cached(records, *, tokenizer, system_prompt, num_proc, cache_dir, log):
    """encode_example of every record, from the cache when it holds them. A cache file that cannot be read,
    is not a regular file, or whose arrays disagree with each other, the records or the vocabulary
    (`_check_cache`) is never used: the records are tokenized again and the file replaced."""
    path = os.path.join(cache_dir, _cache_key(records, tokenizer, system_prompt) + ".npz")
    arrays = None
    if os.path.lexists(path):
        try:
            with open_read(path) as fh, np.load(fh) as f:  # np.load refuses pickled arrays
                arrays, digest = (f["ids"], f["mask"], f["lengths"]), f["digest"]
            _check_cache(arrays, digest, len(records), tokenizer.vocab_size)
            log(f"data: {len(records)} examples tokenized before, read from {path}")
        except Exception as e:  # a damaged, foreign or planted file: tokenize again and replace it
            log(f"data: ignoring the damaged cache file {path} ({e}); tokenizing again")
            arrays = None
    if arrays is None:
        arrays = _tokenize(records, tokenizer, system_prompt, num_proc, log)
        _write_cache(path, arrays, log)
    ids, mask, lengths = arrays
    ids, mask, bounds = ids.tolist(), mask.tolist(), [0] + np.cumsum(lengths).tolist()
    return [(ids[a:b], mask[a:b]) for a, b in zip(bounds, bounds[1:])]


def _check_cache(arrays, digest, n_records, vocab_size):
    """Raise ValueError, saying what disagrees, unless the cached (ids, mask, lengths) are what `_tokenize`
    writes for n_records records: 1-D integer ids, a bool mask and integer lengths, one length per record,
    the lengths adding up to the ids' and the mask's length, every id a token of the vocabulary, and the
    arrays' `_digest` the `digest` written with them."""
    ids, mask, lengths = arrays
    if any(a.ndim != 1 for a in arrays):
        raise ValueError(f"its arrays have the shapes {ids.shape}, {mask.shape}, {lengths.shape}, not one axis each")
    if not (np.issubdtype(ids.dtype, np.integer) and mask.dtype == bool and np.issubdtype(lengths.dtype, np.integer)):
        raise ValueError(f"its arrays are of {ids.dtype}, {mask.dtype} and {lengths.dtype}, not integers, booleans "
                         "and integers")
    if len(lengths) != n_records:
        raise ValueError(f"it holds {len(lengths)} examples, not {n_records}")
    if n_records and lengths.min() < 0:
        raise ValueError(f"it holds the negative length {lengths.min()}")
    total = sum(lengths.tolist())  # Python ints: no overflow
    if not len(ids) == len(mask) == total:
        raise ValueError(f"its lengths add up to {total} tokens, but it holds {len(ids)} ids and {len(mask)} mask "
                         "entries")
    if len(ids) and not (ids.min() >= 0 and ids.max() < vocab_size):
        raise ValueError(f"it holds token ids from {ids.min()} to {ids.max()}, outside the tokenizer's vocabulary "
                         f"of {vocab_size}")
    if digest.tobytes() != _digest(arrays):
        raise ValueError("its arrays do not match the checksum written with them")


def _digest(arrays):
    """The sha256 of the cached arrays (dtypes, shapes and contents): it finds arrays that agree in their
    sizes but not in their contents, e.g. lengths that move the examples' boundaries."""
    h = hashlib.sha256()
    for a in arrays:
        h.update(f"{a.dtype} {a.shape};".encode())
        h.update(memoryview(np.ascontiguousarray(a)).cast("B"))
    return h.digest()


def _cache_key(records, tokenizer, system_prompt):
    h = hashlib.sha256(json.dumps([_code_hash(), tokenizer.fingerprint(), tokenizer.chat_template,
                                   system_prompt]).encode())
    for _, row in records:
        h.update(json.dumps(row, sort_keys=True, ensure_ascii=False, default=str).encode() + b"\n")
    return h.hexdigest()[:32]


@lru_cache(maxsize=1)
def _code_hash():
    """A hash of the code that turns rows into tokens: data/formats.py (layouts, chat templates, encode_example),
    data/cache.py (this file: the cached arrays) and model/tokenizer.py. Editing one invalidates the cache."""
    package = os.path.dirname(os.path.abspath(__file__))
    h = hashlib.sha256()
    for path in (os.path.join(package, "formats.py"), os.path.join(package, "cache.py"),
                 os.path.join(os.path.dirname(package), "model", "tokenizer.py")):
        with open(path, "rb") as f:
            h.update(f.read())
    return h.hexdigest()


def _write_cache(path, arrays, log):
    try:
        os.makedirs(os.path.dirname(path), exist_ok=True)
        digest = np.frombuffer(_digest(arrays), dtype=np.uint8)
        with atomic_file(path, "wb") as f:
            np.savez(f, ids=arrays[0], mask=arrays[1], lengths=arrays[2], digest=digest)
    except OSError as e:  # a read-only or full disk costs only the cache
        log(f"data: could not cache the tokenized examples in {path} ({e}); continuing without")


def _tokenize(records, tokenizer, system_prompt, num_proc, log):
    """(ids, mask, lengths) arrays of every record's encode_example, concatenated; in a pool of
    processes when there is more than one chunk of work. Progress: a bar on a terminal, else a line
    every PROGRESS_EVERY s."""
    chunks = [records[i:i + CHUNK] for i in range(0, len(records), CHUNK)]
    procs = min(num_proc, len(chunks))
    t0 = last = time.time()
    parts, done = [], 0
    pool = multiprocessing.Pool(procs, _init_worker, (tokenizer, system_prompt)) if procs > 1 else None
    bar = tqdm(total=len(records), desc="data: tokenizing", unit=" examples", disable=None, leave=False)
    with pool or contextlib.nullcontext(), bar:
        results = (pool.imap(_encode_chunk, chunks) if pool is not None
                   else (_encode_records(chunk, tokenizer, system_prompt) for chunk in chunks))
        for part in results:
            parts.append(part)
            done += len(part[2])
            bar.update(len(part[2]))
            now = time.time()
            if bar.disable and now - last >= PROGRESS_EVERY and done < len(records):
                rate = done / (now - t0)
                log(f"data: tokenized {done}/{len(records)} examples ({rate:.0f}/s, "
                    f"about {(len(records) - done) / rate:.0f} s left)")
                last = now
    seconds = time.time() - t0
    log(f"data: tokenized {len(records)} examples in {seconds:.1f} s ({len(records) / max(seconds, 1e-9):.0f}/s, "
        f"{procs} process{'es' if procs > 1 else ''})")
    return tuple(np.concatenate(arrays) for arrays in zip(*parts))


def _encode_records(records, tokenizer, system_prompt):
    ids, mask, lengths = [], [], []
    for where, row in records:
        i, m = encode_example(row, tokenizer, system_prompt=system_prompt, where=where)
        ids += i
        mask += m
        lengths.append(len(i))
    return np.array(ids, dtype=np.int32), np.array(mask, dtype=bool), np.array(lengths, dtype=np.int64)


_worker = {}  # a pool process's tokenizer and system prompt, set once by _init_worker


def _init_worker(tokenizer, system_prompt):
    # A forked worker inherits train.py's handlers, which turn SIGTERM into KeyboardInterrupt: the pool's
    # terminate() at its end would then print a traceback from each worker. The worker ends quietly on
    # SIGTERM and leaves Ctrl-C to the main process, which ends the pool.
    signal.signal(signal.SIGTERM, signal.SIG_DFL)
    signal.signal(signal.SIGINT, signal.SIG_IGN)
    _worker.update(tokenizer=tokenizer, system_prompt=system_prompt)


def _encode_chunk(records):
    return _encode_records(records, _worker["tokenizer"], _worker["system_prompt"])
