"""Data: read datasets, tokenize them with a loss mask, and batch them (packed or padded).

    load_datasets(tokenizer, data=..., ...) -> (train, eval)   read, split, tokenize (cached, parallel), check
    load_examples(spec) -> [dict]                    the rows of a file, a folder, a hub dataset or "builtin"
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
                  iff k <= q and doc_ids[q] == doc_ids[k]. Padding is one more document of its own
                  (in a packed row, one or more: see `pack`), so no query ever has every key masked
                  (which would give NaN in softmax).

Sources (`load_examples`; docs/data.md shows each):
    "builtin" ("builtin:train", "builtin:eval")      the embedded dataset, see `builtin_dataset`
    a file: .jsonl (a JSON object per line), .json (a list of objects, or {"data": [...]}), .csv (a
        header row, then a row per example), .txt (each blank-line-separated block is one 'text'
        example), .parquet
    a folder: every such file under it, in sorted order; FOLDER:NAME keeps only split NAME's files
        (those in a subfolder NAME, or named NAME-*, NAME.*, as hub snapshots name them); or a folder
        written by `datasets`' save_to_disk (FOLDER:NAME picks a split of a DatasetDict)
    user/repo[@revision][:split] or user/repo[@revision]:config:split   a hub dataset (split "train" by default)
    user/repo[@revision]:path/in/repo.jsonl          one file of a hub dataset repository
Parquet files, save_to_disk folders and hub datasets are read with Hugging Face `datasets` (and its
pyarrow), the optional extra `pip install -e ".[data]"`; the other sources need nothing more.

Example formats, detected per row (`--columns field=column` maps a dataset's own column names to these):
    {"text": ...}                                    BOS + text + EOS, every token trained
    {"prompt": str, "completion": str}               BOS + prompt + completion + EOS; the loss is on the completion
    {"instruction", "input" (optional), "output"}    Alpaca; the loss is on the output only
    {"messages" or "conversations": [...]}           a chat, as OpenAI's {"role", "content"} messages or ShareGPT's
                                                     {"from", "value"}; the loss is on the assistant turns only
    {"prompt": [messages], "completion": [messages]} a chat; the loss is on the completion's assistant turns
'text', 'prompt' and 'completion' strings are the model's input verbatim: a special token written in
them ('</s>') is that token. What a chat template or the Alpaca prompt wraps (message contents,
instruction, input, output) is data: it is tokenized as plain text and never becomes a control token.

References: the Alpaca prompt format (tatsu-lab/stanford_alpaca); ShareGPT and prompt/completion as TRL's
SFTTrainer reads them; packing with per-document positions and attention (Krell et al. 2021, "Efficient
Sequence Packing without Cross-contamination").
"""
import contextlib
import csv
import hashlib
import importlib
import itertools
import json
import math
import multiprocessing
import os
import random
import re
import signal
import string
import threading
import time
from functools import lru_cache

import huggingface_hub
import numpy as np
import torch
from tqdm import tqdm

from model.files import atomic_file, open_read


IGNORE_INDEX = -100  # what torch.nn.functional.cross_entropy skips by default
BATCH_KEYS = ("input_ids", "targets", "position_ids", "doc_ids")
PAD_PIECE = 64  # the shortest document that a packed row's padding is split into (see `pack`)
KNOWN_FORMATS = ("'text'; 'prompt' + 'completion'; 'instruction' + 'output' (and optional 'input'); "
                 "'messages' or 'conversations' (a list of {\"role\": ..., \"content\": ...}, or ShareGPT's "
                 "{\"from\": ..., \"value\": ...})")
FIELDS = ("text", "prompt", "completion", "instruction", "input", "output", "messages", "conversations")
DATA_EXTENSIONS = (".jsonl", ".json", ".csv", ".txt", ".parquet")
DATA_EXTRA = "pip install -e \".[data]\" (or pip install datasets)"

# The plain prompt for Alpaca examples when the model has no chat template (a base model).
ALPACA_PROMPT = "### Instruction:\n{instruction}\n\n### Input:\n{input}\n\n### Response:\n"
ALPACA_PROMPT_NO_INPUT = "### Instruction:\n{instruction}\n\n### Response:\n"

CHAT_ROLES = ("system", "user", "assistant")  # every template takes these (or refuses one, as Gemma's does system)
SHAREGPT_ROLES = {"human": "user", "gpt": "assistant", "system": "system",
                  "user": "user", "assistant": "assistant", "tool": "tool"}
RENDER_SECONDS = 5.0  # the longest one chat may take to render (real templates take milliseconds)
SPLIT_NAMES = ("train", "test", "validation", "valid", "val", "dev", "eval")  # how hub snapshots name split files

# ----------------------------------------------------------------------------- loading

# user/repo, then optionally @revision, then optionally :split, :config:split or :path/in/repo.jsonl
_HUB_SPEC = re.compile(r"(?P<repo>[\w.-]+/[\w.-]+)(?:@(?P<revision>[^:]+))?(?::(?P<rest>.+))?")


def load_examples(spec, *, columns=None, max_examples=None):
    """The rows (dicts) of `spec`, one of the sources the module docstring lists. columns: a
    "field=column,..." string (see `parse_columns`); max_examples: keep only the first N rows.
    Every row is checked here, so a bad one fails now, naming its file and line, not mid-training."""
    return [row for _, row in _records(spec, parse_columns(columns), max_examples)]


def _records(spec, mapping, limit):
    """[(where, row)]: `where` names the row in messages ('data.jsonl: line 3', 'user/repo:train: row 7')."""
    records = _read_spec(spec, limit)[:limit]
    if not records:
        raise ValueError(f"{spec} holds no examples")
    if mapping:
        records = [(where, _map_columns(row, mapping, where)) for where, row in records]
    for where, row in records:
        _format(row, where)
    return records


def _is_builtin(spec):
    return spec == "builtin" or spec.startswith("builtin:")


def _read_spec(spec, limit):
    if _is_builtin(spec):
        split = spec.partition(":")[2] or "train"
        return [(f"builtin:{split}: item {i}", ex) for i, ex in enumerate(builtin_dataset(split))]
    if os.path.isfile(spec):
        return _read_file(spec, limit=limit)
    if os.path.isdir(spec):
        return _read_folder(spec, None, limit)
    folder, _, split = spec.rpartition(":")
    if folder and os.path.isdir(folder):
        return _read_folder(folder, split, limit)
    hub = _HUB_SPEC.fullmatch(spec)
    if hub is None or spec.startswith((".", "/", "~")) or hub["repo"].lower().endswith(DATA_EXTENSIONS):
        raise FileNotFoundError(
            f"no such file: {spec!r}. The dataset can be a local file (.jsonl, .json, .csv, .txt, .parquet) or "
            "folder, a hub dataset (user/repo, user/repo:split, user/repo@revision:config:split), one file of a "
            "hub dataset (user/repo:path/to/file.jsonl), or 'builtin'")
    repo, revision, rest = hub["repo"], hub["revision"], hub["rest"] or ""
    if "/" in rest or rest.lower().endswith(DATA_EXTENSIONS):
        return _read_file(_hub_download(repo, rest, revision), name=f"{repo}:{rest}", limit=limit)
    parts = rest.split(":") if rest else []
    if len(parts) > 2:
        raise ValueError(f"{spec!r}: a hub dataset is written user/repo[@revision][:config]:split, with at most "
                         "two ':' parts")
    config, split = parts if len(parts) == 2 else (None, parts[0] if parts else None)
    return _read_hub(repo, revision, config, split, limit)


def _hub_download(repo_id, filename, revision):
    try:
        return huggingface_hub.hf_hub_download(repo_id, filename, repo_type="dataset", revision=revision)
    except Exception as e:  # the hub raises many kinds (offline, 404, gated); all mean "not fetched"
        raise FileNotFoundError(
            f"could not fetch {filename!r} from the hub dataset {repo_id!r} ({type(e).__name__}: {e}). "
            f"Check that https://huggingface.co/datasets/{repo_id} has that file; for a private or gated "
            "repo, log in with `hf auth login`") from e


def _optional(module, what):
    """Import `module` of the optional 'data' extra, or say which extra `what` needs."""
    try:
        return importlib.import_module(module)
    except ImportError:
        raise ValueError(f"{what} needs Hugging Face datasets: {DATA_EXTRA}") from None


def _read_hub(repo, revision, config, split, limit):
    datasets = _optional("datasets", f"loading the hub dataset {repo!r}")
    split = split or "train"
    try:
        # A hub dataset's own loading script would run its author's code here: never allowed.
        ds = datasets.load_dataset(repo, config, split=split, revision=revision, trust_remote_code=False)
    except Exception as e:  # offline, not found, gated, no such config or split: all mean "not loaded"
        said = (str(e).strip().splitlines() or [""])[0].rstrip(".")
        raise FileNotFoundError(
            f"could not load the hub dataset {repo!r} (config {config!r}, split {split!r}"
            f"{f', revision {revision!r}' if revision else ''}): {type(e).__name__}: {said}. Check the name at "
            f"https://huggingface.co/datasets/{repo}; for a private or gated one, log in with `hf auth login`"
        ) from None
    return _dataset_rows(ds, f"{repo}:{config + ':' if config else ''}{split}", limit)


def _dataset_rows(ds, name, limit):
    if limit is not None:
        ds = ds.select(range(min(limit, len(ds))))
    return [(f"{name}: row {i}", row) for i, row in enumerate(ds.to_list())]


def _read_folder(folder, split, limit):
    """The rows of every data file under `folder` (hidden ones skipped), or of a save_to_disk folder."""
    if os.path.isfile(os.path.join(folder, "dataset_dict.json")) or os.path.isfile(os.path.join(folder, "state.json")):
        return _read_saved(folder, split, limit)
    files = []
    for root, dirs, names in os.walk(folder):
        dirs[:] = [d for d in dirs if not d.startswith(".")]  # a hub snapshot's .cache, a .git
        files += [os.path.relpath(os.path.join(root, n), folder) for n in names
                  if not n.startswith(".") and n.lower().endswith(DATA_EXTENSIONS)]
    files.sort()
    if not files:
        raise FileNotFoundError(f"{folder} is a folder with no data files in it (.jsonl, .json, .csv, .txt, .parquet); "
                                "point --data at a data file, or at a folder that holds some")
    splits = sorted({n for f in files for n in _split_names(f) if n.split("_")[0] in SPLIT_NAMES})
    if split is not None:
        files = [f for f in files if split in _split_names(f)]
        if not files:
            raise ValueError(f"{folder} has no files of split {split!r} (a subfolder {split}/, or files named "
                             f"{split}-* or {split}.*); the splits its file names show: {', '.join(splits) or 'none'}")
    elif len(splits) > 1:
        raise ValueError(f"{folder} holds the files of several splits ({', '.join(splits)}); choose one, "
                         f"e.g. --data {folder}:{splits[-1] if 'train' not in splits else 'train'}")
    rows = []
    for f in files:
        rows += _read_file(os.path.join(folder, f), limit=None if limit is None else limit - len(rows))
        if limit is not None and len(rows) >= limit:
            break
    return rows


def _split_names(relpath):
    """The split names a data file's path gives it: its folders, and its file name up to the first
    '-', '.' or digit ('data/train-00000-of-00002.parquet': data, train)."""
    *folders, name = relpath.split(os.sep)
    return set(folders) | {re.match(r"[^-.\d]*", name)[0]}


def _read_saved(folder, split, limit):
    datasets = _optional("datasets", f"reading the datasets folder {folder}")
    try:
        ds = datasets.load_from_disk(folder)
    except Exception as e:  # datasets raises several kinds for a damaged or foreign folder
        raise ValueError(f"{folder}: cannot read it as a datasets save_to_disk folder "
                         f"({type(e).__name__}: {e})") from None
    if isinstance(ds, datasets.DatasetDict):
        names = list(ds)
        if split is None and (len(names) == 1 or "train" in names):
            split = "train" if "train" in names else names[0]
        if split not in names:
            raise ValueError(f"{folder} holds the splits {', '.join(names)}"
                             f"{'' if split is None else f', not {split!r}'}; choose one, "
                             f"e.g. --data {folder}:{names[0]}")
        return _dataset_rows(ds[split], f"{folder}:{split}", limit)
    if split is not None:
        raise ValueError(f"{folder} holds one dataset, not named splits; drop ':{split}'")
    return _dataset_rows(ds, folder, limit)


def _read_file(path, name=None, limit=None):
    """[(where, row)] of one data file; `name` (default: the path) starts every `where`. With `limit`, reading
    stops once that many rows are in (all but .json, which is one JSON document, are read row by row)."""
    name = name or path
    ext = os.path.splitext(path)[1].lower()
    if ext not in _READERS:
        raise ValueError(f"{name}: unsupported file type {ext or '(no extension)'!r}. Expected .jsonl (one JSON "
                         "object per line), .json (a list of objects, or {\"data\": [...]}), .csv, .txt or .parquet; "
                         "convert it")
    rows = list(itertools.islice(_READERS[ext](path, name), limit))
    if not rows:
        raise ValueError(f"{name} is empty: it needs at least one example, e.g. {{\"text\": \"...\"}}")
    return rows


def _not_utf8(name, line, raw, at):
    """The error for byte `at` of line `line` (its bytes `raw`), which does not decode as UTF-8."""
    return ValueError(f"{name}: line {line} is not UTF-8 text (byte 0x{raw[at]:02x} at byte {at + 1} of the line); "
                      "save the file as UTF-8")


def _read_text(path, name):
    with open(path, "rb") as f:
        raw = f.read()
    try:
        return raw.decode("utf-8-sig")  # -sig: tolerate the byte-order mark some editors write
    except UnicodeDecodeError as e:
        start = raw.rfind(b"\n", 0, e.start) + 1
        raise _not_utf8(name, raw.count(b"\n", 0, start) + 1, raw[start:], e.start - start) from None


def _lines(path, name):
    """(number, text) of each line of a UTF-8 file, read one at a time, each with its line end. Lines end at
    '\\n' only (a JSON string may hold a raw U+2028, which str.splitlines would split at); a byte-order mark
    at the start is dropped, as some editors write one."""
    with open(path, "rb") as f:
        for n, raw in enumerate(f, 1):
            bom = 3 if n == 1 and raw.startswith(b"\xef\xbb\xbf") else 0
            try:
                yield n, raw[bom:].decode("utf-8")
            except UnicodeDecodeError as e:
                raise _not_utf8(name, n, raw, bom + e.start) from None


def _json(text, name, where):
    """json.loads(text), with errors naming `where` for what no JSON parse error covers: an object that
    has a key twice (a JSON reader keeps the last value silently, so a row would train on the other one),
    and nesting deeper than the parser's recursion limit."""
    try:
        return json.loads(text, object_pairs_hook=_unique_keys)
    except _KeyTwice as e:
        raise ValueError(f"{name}: {where} has an object with the key {e.args[0]!r} twice; give each key once"
                         ) from None
    except RecursionError:
        raise ValueError(f"{name}: {where} nests lists or objects too deeply to read; flatten it") from None


class _KeyTwice(Exception):
    """A JSON object with the key args[0] twice."""


def _unique_keys(pairs):
    obj = dict(pairs)
    if len(obj) < len(pairs):
        seen = set()
        raise _KeyTwice(next(k for k, _ in pairs if k in seen or seen.add(k)))
    return obj


def _no_lone_surrogate(value, name, where):
    """Raise ValueError naming `where` if JSON-read `value` holds a lone surrogate (from an escape like "\\ud800",
    half of a UTF-16 pair), which is no text: it would fail later, naming no file or row. Worth calling only
    where `_SURROGATE_ESCAPE` finds such an escape in the JSON text."""
    try:
        json.dumps(value, ensure_ascii=False).encode("utf-8")
    except UnicodeEncodeError as e:
        raise ValueError(f"{name}: {where} holds a lone surrogate escape ({e.object[e.start]!a}), half of a UTF-16 "
                         "pair, which is not text; fix or remove it") from None


_SURROGATE_ESCAPE = re.compile(r"\\u[dD][89a-fA-F]")  # a surrogate's escape; valid pairs (an emoji) are common


def _read_jsonl(path, name):
    for n, line in _lines(path, name):
        if not line.strip():
            continue
        try:
            row = _json(line, name, f"line {n}")
        except json.JSONDecodeError as e:
            raise ValueError(f"{name}: line {n} is not valid JSON ({e.msg}, column {e.colno}). "
                             "A .jsonl file needs exactly one JSON object per line") from None
        if _SURROGATE_ESCAPE.search(line):
            _no_lone_surrogate(row, name, f"line {n}")
        yield f"{name}: line {n}", row


def _read_json(path, name):
    text = _read_text(path, name)
    if not text.strip():
        return []
    try:
        data = _json(text, name, "the file")
    except json.JSONDecodeError as e:
        hint = "; if it holds one object per line, name it .jsonl" if e.msg == "Extra data" else ""
        raise ValueError(f"{name}: not valid JSON at line {e.lineno}, column {e.colno} ({e.msg}){hint}") from None
    if isinstance(data, dict) and "data" in data:
        data = data["data"]
    if not isinstance(data, list):
        raise ValueError(f"{name}: expected a JSON list of examples or {{\"data\": [...]}}, "
                         f"got a {type(data).__name__}")
    if _SURROGATE_ESCAPE.search(text):
        for i, ex in enumerate(data):
            _no_lone_surrogate(ex, name, f"item {i}")
    return [(f"{name}: item {i}", ex) for i, ex in enumerate(data)]


def _read_csv(path, name):
    lines = _lines(path, name)
    reader = csv.DictReader((line for _, line in lines), restval=None)
    try:
        header = reader.fieldnames or []
        twice = next((c for c in header if header.count(c) > 1), None)
        if twice is not None:
            raise ValueError(f"{name}: the header names the column {twice!r} {header.count(twice)} times; "
                             "give each column its own name")
        for row in reader:
            if None in row:
                raise ValueError(f"{name}: line {reader.line_num} has more fields than the header "
                                 f"({', '.join(header)})")
            if None in row.values():  # restval: the row ended before the header did
                raise ValueError(f"{name}: line {reader.line_num} has {sum(v is not None for v in row.values())} "
                                 f"fields, fewer than the header's {len(header)} ({', '.join(header)}); a field "
                                 "that holds a comma or a line break needs double quotes")
            yield f"{name}: line {reader.line_num}", row
    except csv.Error as e:
        raise ValueError(f"{name}: line {reader.line_num} is not valid CSV ({e})") from None


def _read_txt(path, name):
    block, first = [], 0
    for n, line in itertools.chain(_lines(path, name), [(None, "")]):
        line = line.rstrip("\r\n")
        if line.strip():
            first = first if block else n
            block.append(line)
        elif block:
            yield f"{name}: line {first}", {"text": "\n".join(block)}
            block = []


def _read_parquet(path, name):
    parquet = _optional("pyarrow.parquet", f"reading the parquet file {name}")
    damaged = f"{name}: not a readable parquet file"
    try:
        table = parquet.ParquetFile(path)
        columns = table.schema_arrow.names
    except Exception as e:  # pyarrow raises ArrowInvalid, OSError, ... for a damaged file
        raise ValueError(f"{damaged} ({e})") from None
    twice = next((c for c in columns if columns.count(c) > 1), None)
    if twice is not None:
        raise ValueError(f"{name}: it has {columns.count(twice)} columns named {twice!r}; give each column its own "
                         "name")
    batches, i = table.iter_batches(batch_size=1024), 0  # a batch at a time: --max-examples reads only a few
    while True:
        try:
            batch = next(batches, None)
        except Exception as e:  # a damaged row group
            raise ValueError(f"{damaged} ({e})") from None
        if batch is None:
            return
        for row in batch.to_pylist():
            yield f"{name}: row {i}", row
            i += 1


_READERS = {".jsonl": _read_jsonl, ".json": _read_json, ".csv": _read_csv, ".txt": _read_txt, ".parquet": _read_parquet}


def parse_columns(spec):
    """{field: column} from "field=column,..." (e.g. "instruction=question,output=answer", "messages=dialog"):
    the dataset's column `column` is read as nanotune's field `field`. None or "" maps nothing."""
    mapping = {}
    for pair in (spec or "").split(",") if spec else []:
        field, eq, column = (s.strip() for s in pair.partition("="))
        if not (eq and field and column):
            raise ValueError(f"--columns: {pair!r} is not field=column; write e.g. "
                             "--columns instruction=question,output=answer")
        if field not in FIELDS:
            raise ValueError(f"--columns: unknown field {field!r}; the fields are {', '.join(FIELDS)}")
        if field in mapping:
            raise ValueError(f"--columns: the field {field!r} is given twice")
        mapping[field] = column
    return mapping


def _map_columns(row, mapping, where):
    if not isinstance(row, dict):
        return row  # _format says what is wrong with it
    missing = [c for c in mapping.values() if c not in row]
    if missing:
        raise ValueError(f"{where}: no column {missing[0]!r} (named in --columns); its columns are {sorted(row)}")
    mapped = {k: v for k, v in row.items() if k not in mapping and k not in mapping.values()}
    return mapped | {field: row[column] for field, column in mapping.items()}

# ----------------------------------------------------------------------------- formats


def _format(ex, where="example"):
    """The format of row `ex`: 'text', 'completion', 'alpaca', 'messages' or 'chat_completion';
    a ValueError that says why if it has none."""
    if not isinstance(ex, dict):
        raise ValueError(f"{where}: expected a JSON object, got a {type(ex).__name__}. Known formats: {KNOWN_FORMATS}")
    if "messages" in ex or "conversations" in ex:
        field = "messages" if "messages" in ex else "conversations"
        messages = _messages(ex[field], field, where)
        if not any(m["role"] == "assistant" for m in messages):
            raise ValueError(f"{where}: '{field}' has no message with role 'assistant', so there is nothing to train "
                             f"on (roles found: {sorted({m['role'] for m in messages})})")
        return "messages"
    if "prompt" in ex and "completion" in ex:
        prompt, completion = ex["prompt"], ex["completion"]
        if isinstance(prompt, str) and isinstance(completion, str):
            return "completion"
        if not (isinstance(prompt, list) and isinstance(completion, list)):
            raise ValueError(f"{where}: 'prompt' and 'completion' must both be strings, or both lists of messages")
        _messages(prompt, "prompt", where)
        if not any(m["role"] == "assistant" for m in _messages(completion, "completion", where)):
            raise ValueError(f"{where}: 'completion' has no message with role 'assistant', so there is nothing "
                             "to train on")
        return "chat_completion"
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
                     "rename the fields to one of these, or map them with --columns field=column")


def _messages(value, field, where):
    """The messages of a chat field as OpenAI-style dicts: ShareGPT's {"from", "value"} become
    {"role", "content"} (human -> user, gpt -> assistant); other keys (tool_calls, name) are kept."""
    if not (isinstance(value, list) and value):
        raise ValueError(f"{where}: '{field}' must be a non-empty list of objects with string 'role' and 'content' "
                         "fields (or ShareGPT's 'from' and 'value')")
    messages = []
    for i, m in enumerate(value):
        if not isinstance(m, dict):
            raise ValueError(f"{where}: {field}[{i}] must be an object with string 'role' and 'content' fields, "
                             f"got a {type(m).__name__}")
        if "role" not in m and "from" in m:
            if m["from"] not in SHAREGPT_ROLES:
                raise ValueError(f"{where}: {field}[{i}] is from {m['from']!r}; ShareGPT's roles are human, gpt and "
                                 f"system (user, assistant and tool are read too)")
            m = {"role": SHAREGPT_ROLES[m["from"]], "content": m.get("value"),
                 **{k: v for k, v in m.items() if k not in ("from", "value")}}
        role, content = m.get("role"), m.get("content")
        if not isinstance(role, str):
            raise ValueError(f"{where}: {field}[{i}] needs string 'role' and 'content' fields (found {sorted(m)})")
        if not (isinstance(content, str) or (role == "assistant" and content is None and m.get("tool_calls"))):
            raise ValueError(f"{where}: {field}[{i}] ({role}) needs a string 'content', got "
                             f"{type(content).__name__}" + (" (an assistant message with 'tool_calls' may have "
                                                            "null content)" if role == "assistant" else ""))
        messages.append(m)
    return messages


def alpaca_messages(example):
    """An Alpaca example as a chat: the instruction (and input) from the user, the output from the assistant."""
    user = example["instruction"] + ("\n\n" + example["input"] if example.get("input") else "")
    return [{"role": "user", "content": user}, {"role": "assistant", "content": example["output"]}]


def _layout(example, tokenizer, system_prompt=None, where="example"):
    """How `example` becomes text, checked as far as it can be without rendering or tokenizing it:
        ("pieces", [(text, is_data, is_target)])   when no chat template is involved;
        ("chat", messages, trained)                when the chat template renders it; trained[i]:
                                                   message i is a training target.
    is_data marks text that comes from the row and is wrapped by a prompt (tokenized as plain text)."""
    fmt = _format(example, where)
    if fmt in ("text", "completion") or (fmt == "alpaca" and tokenizer.chat_template is None):
        if system_prompt is not None:
            raise ValueError(f"{where}: --system-prompt adds a system turn to chats, and this row is not one "
                             f"({fmt!r}{' without a chat template' if fmt == 'alpaca' else ''}); drop --system-prompt")
        if fmt == "text":
            return "pieces", [(example["text"], False, True)]
        if fmt == "completion":
            return "pieces", [(example["prompt"], False, False), (example["completion"], False, True)]
        pieces = []  # the prompt's own text, and the row's instruction and input in their places
        for literal, field, _, _ in string.Formatter().parse(ALPACA_PROMPT if example.get("input")
                                                             else ALPACA_PROMPT_NO_INPUT):
            pieces += [(literal, False, False)] + ([(example[field], True, False)] if field else [])
        return "pieces", pieces + [(example["output"], True, True)]
    if tokenizer.chat_template is None:
        raise ValueError(f"{where}: this row is a chat, and the tokenizer has no chat template (no 'chat_template' in "
                         "tokenizer_config.json); pass one with --chat-template FILE, or use a chat model")
    if fmt == "messages":
        field = "messages" if "messages" in example else "conversations"
        messages = _messages(example[field], field, where)
        trained = [m["role"] == "assistant" for m in messages]
    elif fmt == "chat_completion":
        prompt = _messages(example["prompt"], "prompt", where)
        completion = _messages(example["completion"], "completion", where)
        messages, trained = prompt + completion, [False] * len(prompt) + [m["role"] == "assistant" for m in completion]
    else:
        messages, trained = alpaca_messages(example), [False, True]
    if system_prompt is not None and messages[0]["role"] != "system":
        messages, trained = [{"role": "system", "content": system_prompt}] + messages, [False] + trained
    roles = template_roles(tokenizer.chat_template)
    for m in messages:
        if m["role"] not in roles:
            raise ValueError(f"{where}: a message has the role {m['role']!r}, which this chat template does not take; "
                             f"its roles are {', '.join(roles)}")
    return "chat", messages, trained


@lru_cache(maxsize=8)
def template_roles(template):
    """The roles a chat template takes: system, user and assistant, and those it tests for by name
    (message.role == "tool", message['role'] == 'ipython')."""
    named = re.findall(r"""role['"]?\]?\s*[!=]=\s*['"]([\w-]+)['"]""", template)
    return CHAT_ROLES + tuple(sorted(set(named) - set(CHAT_ROLES)))

# ----------------------------------------------------------------------------- tokenizing


def encode_example(example, tokenizer, *, train_on_inputs=False, system_prompt=None, where="example"):
    """(ids, mask): the example's token ids and, per token, whether it is a training target.

    The example becomes text pieces, each a target or not (`_layout`; chats through `_chat_pieces`),
    and `_encode_pieces` tokenizes them. Then:
      - inside a run of target tokens, tokens after its last EOS are not targets (the model stops
        at EOS, so it never generates what follows);
      - BOS is prepended when the model uses one, unless the tokens already start with it
        (chat templates often write it themselves);
      - EOS is appended unless the tokens already end with it (ignoring trailing whitespace), as a
        target when the last piece is one, so the model learns to stop.
    system_prompt adds a system turn to chats that have none; train_on_inputs makes every token a
    target; `where` names the example in errors. The mask is the only record of what is trained;
    pad_id == eos_id does not hide EOS.
    """
    layout = _layout(example, tokenizer, system_prompt, where)
    pieces = layout[1] if layout[0] == "pieces" else _chat_pieces(layout[1], layout[2], tokenizer, where)
    ids, mask = _encode_pieces(pieces, tokenizer)
    bos, eos = tokenizer.bos_id, tokenizer.eos_id
    for start, end in _runs(mask):
        if eos in ids[start:end]:
            last = end - 1 - ids[start:end][::-1].index(eos)
            mask[last + 1:end] = [False] * (end - last - 1)
    if tokenizer.add_bos and bos is not None and ids[:1] != [bos]:
        ids, mask = [bos] + ids, [False] + mask
    if eos is not None and not _ends_with_eos(ids, tokenizer):
        ids, mask = ids + [eos], mask + [pieces[-1][2]]
    if train_on_inputs:
        mask = [True] * len(ids)
    return ids, mask


def _runs(mask):
    """[(start, end)] of every maximal run of True in `mask`."""
    runs, i = [], 0
    for value, group in itertools.groupby(mask):
        n = len(list(group))
        if value:
            runs.append((i, i + n))
        i += n
    return runs


def _ends_with_eos(ids, tokenizer):
    for i in reversed(ids):
        if i == tokenizer.eos_id:
            return True
        if tokenizer.decode([i], skip_special_tokens=False).strip():
            return False
    return False


def _sentinel(k):
    """Stands in for message k's content while the chat is rendered again: private-use characters,
    which real text does not hold and which trim, strip and split leave alone."""
    return f"\ue000{k}\ue001"


def _chat_pieces(messages, trained, tokenizer, where):
    """The chat rendered by the template once, as (text, is_data, is_target) pieces.

    Each message's content is located in that one rendering `full` by rendering the chat with
    sentinels in place of contents. Most templates write every content verbatim: the rendering with
    all contents replaced at once, with the contents put back, is `full`, and the sentinels' places
    are the contents' places. Where that fails (the template trims contents, moves their reasoning
    into a block, or rewrites earlier turns as Qwen3 does), each content is found on its own: the
    chat rendered with only that content replaced agrees with `full` before and after it, and differs
    exactly where the template wrote it, however it wrote it. Neither needs knowledge of the
    template's markers, and every span is placed in the final rendering, which a rendering of each
    prefix of the chat could not do for a template that rewrites earlier turns.

    An assistant turn's target runs from the end of its header (what the template's generation
    prompt ends with, '<|im_start|>assistant\n') through its end-of-turn text ('<|im_end|>\n'): what
    the model generates at inference (encode_example then drops what follows an EOS). Template text
    between the header and the content that the template writes for any content (Qwen3's empty
    '<think>\n\n</think>\n\n') stays prompt; text it writes because of this content (a '<think>'
    reasoning block) is target, as the content is.
    """
    full = _render(tokenizer, messages, where)
    header, turn_end = _turn_markers(tokenizer)
    probes = [{"role": m["role"], "content": _sentinel(k)} for k, m in enumerate(messages)]
    data = _spans_in_one_render(full, _render(tokenizer, probes, where), messages)
    begins = [start for start, _ in data] if data is not None else None
    if data is None:
        data, begins = [], []
        for k in range(len(messages)):
            probe = _render(tokenizer, messages[:k] + probes[k:k + 1] + messages[k + 1:], where)
            start = _common_prefix_len(full, probe)
            data.append((start, len(full) - _common_prefix_len(full[start:][::-1], probe[start:][::-1])))
            at = probe.find(_sentinel(k))
            h = probe.rfind(header, 0, at) if header and at >= 0 else -1
            if h < 0 or h + len(header) > start:  # no header before the content: the target starts at the content
                begins.append(start)
            else:
                fixed = probe[h + len(header):at]  # what the template writes before any content of this turn
                begins.append(h + len(header) + (len(fixed) if full.startswith(fixed, h + len(header)) else 0))
        spans = sorted(data)
        if any(b[0] < a[1] for a, b in zip(spans, spans[1:])):
            raise ValueError(f"{where}: the chat template writes these messages so that their contents cannot be "
                             "told apart in its rendering; use another template (--chat-template)")
    targets = [(begin, end + _common_prefix_len(full[end:end + len(turn_end)], turn_end))
               for begin, (_, end), is_target in zip(begins, data, trained) if is_target]
    cuts = sorted({0, len(full)}.union(*data, *targets))
    return [(full[a:b], any(s <= a and b <= e for s, e in data), any(s <= a and b <= e for s, e in targets))
            for a, b in zip(cuts, cuts[1:])]


def _spans_in_one_render(full, rendered, messages):
    """[(start, end)] of each message's content in `full`, when `rendered` (the chat with content k
    replaced by _sentinel(k), in order) with the contents put back is `full`; else None."""
    pieces, spans, last, length = [], [], 0, 0
    for k, m in enumerate(messages):
        at, content = rendered.find(_sentinel(k), last), m["content"] or ""
        if at < 0:
            return None
        length += at - last
        pieces += [rendered[last:at], content]
        spans.append((length, length + len(content)))
        length, last = length + len(content), at + len(_sentinel(k))
    return spans if "".join(pieces) + rendered[last:] == full else None


def _render(tokenizer, messages, where, add_generation_prompt=False):
    """The chat template's rendering of `messages`. The Jinja sandbox stops a template from touching
    anything but its arguments; RENDER_SECONDS stops one that would never finish (nested loops)."""
    try:
        with _time_limit(RENDER_SECONDS, SlowTemplate(where)):
            return tokenizer.apply_chat_template(messages, add_generation_prompt=add_generation_prompt)
    except SlowTemplate:
        raise
    except Exception as e:  # the template's raise_exception(), a Jinja error, or a Python error inside it
        raise ValueError(f"{where}: the chat template failed on it ({type(e).__name__}: {e})") from None


class SlowTemplate(ValueError):
    """A chat template that took over RENDER_SECONDS to render the chat that `where` names."""

    def __init__(self, where):
        super().__init__(where)  # the only argument: a pool process sends it back pickled as SlowTemplate(where)
        self.where = where

    def __str__(self):
        return self.message("the chat template")

    def message(self, template):
        """The error line, naming the template (`template`: 'the model's chat template', '--chat-template FILE')."""
        return (f"{template} took over {RENDER_SECONDS:g} s to render {self.where}, so it was stopped (a chat "
                "template renders a chat in milliseconds; this one loops far too long): fix it, or pass another "
                "with --chat-template FILE")


@contextlib.contextmanager
def _time_limit(seconds, error):
    """Raise `error` inside the block once it has run for `seconds`: a SIGALRM timer, which stops pure-Python
    code (a Jinja template is compiled to Python) wherever it is. Signals reach only the main thread, where
    train.py and the tokenizing pool's processes read data; in another thread the block runs unbounded."""
    if threading.current_thread() is not threading.main_thread():
        yield
        return

    def stop(signum, frame):
        raise error
    previous = signal.signal(signal.SIGALRM, stop)
    signal.setitimer(signal.ITIMER_REAL, seconds)
    try:
        yield
    finally:
        signal.setitimer(signal.ITIMER_REAL, 0)
        signal.signal(signal.SIGALRM, previous)


_MARKERS = {}  # (template, bos, eos) -> (header, turn_end)


def _turn_markers(tokenizer):
    """(header, turn_end): what the chat template writes before an assistant turn's content (its
    generation prompt) and after it ('<|im_end|>\n'), from rendering a one-question chat."""
    key = (tokenizer.chat_template, tokenizer.bos_id, tokenizer.eos_id)
    if key not in _MARKERS:
        where = "the chat template, rendering one user and one assistant message"
        question = [{"role": "user", "content": "Hi"}]
        prompt = _render(tokenizer, question, where)
        with_header = _render(tokenizer, question, where, add_generation_prompt=True)
        turn = _render(tokenizer, question + [{"role": "assistant", "content": _sentinel(0)}], where)
        at = turn.rfind(_sentinel(0))
        _MARKERS[key] = (with_header[len(prompt):] if with_header.startswith(prompt) else "",
                         turn[at + len(_sentinel(0)):] if at >= 0 else "")
    return _MARKERS[key]


def _encode_pieces(pieces, tokenizer):
    """(ids, mask) of the joined pieces: mask[i] is the is_target of the piece holding token i's last character.

    The text is tokenized whole, as it is at inference, so a token that merges across a boundary
    belongs to the later piece (the boundaries mostly sit at special tokens or newlines, which no
    token crosses). Should a data piece spell a special token ('</s>' in an answer), whole-text
    tokenizing would turn it into that control token: then each run of data pieces is tokenized
    apart, as plain text, and each run of template pieces with its special tokens.
    """
    starts = np.cumsum([0] + [len(text) for text, _, _ in pieces[:-1]])
    is_data, is_target = np.array([p[1] for p in pieces]), np.array([p[2] for p in pieces])

    def piece_of(offsets):  # each token's piece: the one holding its last character ((s, s): a token of no text)
        spans = np.fromiter(itertools.chain.from_iterable(offsets), dtype=np.int64, count=2 * len(offsets))
        return np.searchsorted(starts, np.maximum(spans[0::2], spans[1::2] - 1), side="right") - 1

    text = "".join(t for t, _, _ in pieces)
    ids, offsets = tokenizer.encode_offsets(text)
    piece = piece_of(offsets)
    special = tokenizer.special_tokens  # id -> text; '<unk>' for unknown text is special, but not spelled
    if any(is_data[piece[k]] and text[offsets[k][0]:offsets[k][1]] == special[ids[k]]
           for k in np.flatnonzero(np.isin(ids, list(special)))):
        ids, offsets, at = [], [], 0
        for data_run, group in itertools.groupby(pieces, key=lambda p: p[1]):
            run = "".join(t for t, _, _ in group)
            part, part_offsets = tokenizer.encode_offsets(run, parse_special=not data_run)
            ids += part
            offsets += [(a + at, b + at) for a, b in part_offsets]
            at += len(run)
        piece = piece_of(offsets)
    return ids, is_target[piece].tolist()


def _common_prefix_len(a, b):
    """The length of the longest common prefix of sequences a and b (a binary search of slice compares)."""
    lo, hi = 0, min(len(a), len(b))
    while lo < hi:
        mid = (lo + hi + 1) // 2
        if a[:mid] == b[:mid]:
            lo = mid
        else:
            hi = mid - 1
    return lo

# ----------------------------------------------------------------------------- datasets: split, tokenize, cache

CHUNK = 256  # examples per task of the tokenizing pool
EVAL_FEW = 20  # an eval set smaller than this is warned about: one example moves its accuracy by over 5%
PROGRESS_EVERY = 10.0  # seconds between progress lines while tokenizing


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
                    else _records("builtin:eval", {}, None) if _is_builtin(data) else None)
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


def held_out_prompt(example, tokenizer, system_prompt=None):
    """(question, prompt ids, expected answer) of a row, to sample the model's answer: the row is encoded as
    for training and cut before its last run of target tokens, which is the expected answer (without EOS).
    The question is the text the answer replies to: the last user turn of a chat, the instruction and input
    of an Alpaca row, the prompt of a prompt/completion pair. None for a row with no prompt before its last
    target (plain text)."""
    layout = _layout(example, tokenizer, system_prompt)
    ids, mask = encode_example(example, tokenizer, system_prompt=system_prompt)
    runs = _runs(mask)
    start, end = runs[-1] if runs else (0, 0)
    if start <= (ids[:1] == [tokenizer.bos_id]):  # nothing but BOS before the answer
        return None
    if layout[0] == "chat":
        messages, trained = layout[1], layout[2]
        last = max(i for i, t in enumerate(trained) if t)
        question = next((m["content"] for m in reversed(messages[:last]) if m["role"] == "user"), "")
    else:
        prompt = [(text, is_data) for text, is_data, is_target in layout[1] if not is_target]
        question = "\n\n".join(text for text, is_data in prompt if is_data) or "".join(text for text, _ in prompt)
    answer = tokenizer.decode([t for t in ids[start:end] if t != tokenizer.eos_id]).strip()
    return question, ids[:start], answer


def _no_eval_split(n, eval_fraction):
    if n < 20:
        return (f"data: no eval split: {n} examples are too few to hold any out (it takes 20); "
                "pass --eval-data FILE to evaluate on a set of your own")
    return (f"data: no eval split: --eval-fraction {eval_fraction} of {n} examples holds out none; pass "
            f"--eval-fraction {math.ceil(100 / n) / 100:g} or more, or --eval-data FILE, to evaluate")


def use_chat_template(tokenizer, path):
    """The tokenizer that renders chats with the template of file `path` (--chat-template); None: `tokenizer`."""
    if path is None:
        return tokenizer
    return tokenizer.with_chat_template(_read_chat_template(path), f"--chat-template {path}")


def _read_chat_template(path):
    """The Jinja text of a --chat-template file: a template, or a tokenizer_config.json holding one."""
    try:
        with open(path, encoding="utf-8") as f:
            text = f.read()
    except FileNotFoundError:
        raise FileNotFoundError(f"--chat-template: no such file: {path!r}; pass a file that holds a Jinja chat "
                                "template (a .jinja file, or a tokenizer_config.json)") from None
    except UnicodeDecodeError:
        raise ValueError(f"--chat-template {path} is not UTF-8 text") from None
    if path.endswith(".json"):
        try:
            text = json.loads(text).get("chat_template")
        except (json.JSONDecodeError, AttributeError):
            raise ValueError(f"--chat-template {path} is not a JSON object; a .json file must be a "
                             "tokenizer_config.json with a 'chat_template'") from None
        if not isinstance(text, str):
            raise ValueError(f"--chat-template {path} has no 'chat_template' string")
    if not text.strip():
        raise ValueError(f"--chat-template {path} is empty")
    return text


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
    """A hash of the code that turns rows into tokens (this file, the tokenizer's): editing it invalidates the cache."""
    here = os.path.dirname(os.path.abspath(__file__))
    h = hashlib.sha256()
    for path in (os.path.join(here, "data.py"), os.path.join(here, "model", "tokenizer.py")):
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

# ----------------------------------------------------------------------------- batching


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
    rows, docs, used = [], [], 0
    for ids, mask in encoded:
        if used + len(ids) > max_len:
            rows.append(_row(docs, max_len, pad_id, piece))
            docs, used = [], 0
        docs.append((ids, mask))
        used += len(ids)
    if docs:
        rows.append(_row(docs, max_len, pad_id, piece))
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

# ----------------------------------------------------------------------------- the builtin dataset

N_TRAIN, N_EVAL = 2000, 200


def builtin_dataset(split="train"):
    """The embedded default dataset, in Alpaca format: eight small tasks with one short, exact answer
    each (the number after or before a number, the last digit of a number, the larger of two numbers,
    the first or last word of a list, a unit conversion by 10, 100 or 1000, a number times 10).
    An instruct model half-knows them but answers in sentences; a short fine-tune teaches it the
    terse exact answers, which shows in `answer_accuracy` within minutes, even on a CPU.
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
    # which makes the first N_EVAL (the eval split) and the rest (train) disjoint. A task whose
    # questions run out would redraw forever, so that is an error naming it.
    rng = random.Random(0)
    seen, examples = set(), []
    while len(examples) < N_EVAL + N_TRAIN:
        task = _TASKS[len(examples) % len(_TASKS)]
        for _ in range(1000):
            ex = task(rng)
            if ex[:2] not in seen:
                break
        else:
            raise RuntimeError(f"the builtin task {task.__name__} has too few distinct questions for "
                               f"{(N_EVAL + N_TRAIN) // len(_TASKS)} examples; widen its ranges")
        seen.add(ex[:2])
        examples.append(ex)
    return tuple(examples)


def _int(rng, lo, hi):
    """A uniform integer in [lo, hi]. Every draw goes through random(), the one method whose stream
    Python promises to keep across versions, so the dataset (and eval numbers) are the same everywhere."""
    return lo + int(rng.random() * (hi - lo + 1))


def _pick(rng, seq):
    return seq[_int(rng, 0, len(seq) - 1)]


def _next_number(rng):
    n = _int(rng, 0, 9998)
    return f"What number comes after {n}?", "", str(n + 1)


def _previous_number(rng):
    n = _int(rng, 1, 9999)
    return f"What number comes before {n}?", "", str(n - 1)


def _last_digit(rng):
    n = _int(rng, 10, 99999)
    return f"What is the last digit of {n}?", "", str(n % 10)


def _larger(rng):
    a, b = _int(rng, 0, 999), _int(rng, 0, 998)
    b += b >= a  # b != a, uniform over the other 999 numbers
    return f"Which is larger, {a} or {b}?", "", str(max(a, b))


def _word_list(rng):
    return [_pick(rng, _WORDS) for _ in range(_int(rng, 3, 5))]


def _first_word(rng):
    words = _word_list(rng)
    return "What is the first word in the list?", ", ".join(words), words[0]


def _last_word(rng):
    words = _word_list(rng)
    return "What is the last word in the list?", ", ".join(words), words[-1]


def _convert(rng):
    big, small, factor = _pick(rng, _UNITS)
    n = _int(rng, 2, 99)
    return f"How many {small} are in {n} {big}?", "", str(n * factor)


def _times_ten(rng):
    n = _int(rng, 1, 999)
    return f"What is {n} times 10?", "", str(10 * n)


_WORDS = ("apple banana cherry river mountain letter window garden yellow purple rabbit pepper coffee "
          "bottle summer winter forest butter silver mirror puzzle ladder kitten balloon tomorrow umbrella "
          "zebra orange pencil basket candle dragon flower guitar hammer island jacket lemon monkey needle "
          "ocean planet rocket saddle tiger violin wagon castle doctor engine").split()
# Round factors only: the answer is the number with zeros appended, which a small model learns in a
# short run (docs/builtin-dataset.md lists the tasks tried and dropped).
_UNITS = (("kilometers", "meters", 1000), ("meters", "centimeters", 100), ("centimeters", "millimeters", 10),
          ("kilograms", "grams", 1000), ("liters", "milliliters", 1000), ("dollars", "cents", 100))
_TASKS = (_next_number, _previous_number, _last_digit, _larger, _first_word, _last_word, _convert, _times_ten)
