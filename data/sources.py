"""Sources: the rows of a file, a folder, a hub dataset or "builtin" (`load_examples`), each checked to be
in a known format (data/formats.py).

Sources (`load_examples`; docs/data.md shows each):
    "builtin" ("builtin:train", "builtin:eval")      the embedded dataset, see `builtin_dataset`
    "builtin:arithmetic" (":train", ":eval")        the embedded arithmetic tasks, see `arithmetic_dataset`
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
"""
import csv
import importlib
import itertools
import json
import os
import re

import huggingface_hub

from data.arithmetic import arithmetic_dataset
from data.builtin import builtin_dataset
from data.formats import FIELDS, _format

DATA_EXTENSIONS = (".jsonl", ".json", ".csv", ".txt", ".parquet")
DATA_EXTRA = "pip install -e \".[data]\" (or pip install datasets)"
SPLIT_NAMES = ("train", "test", "validation", "valid", "val", "dev", "eval")  # how hub snapshots name split files

# user/repo, then optionally @revision, then optionally :split, :config:split or :path/in/repo.jsonl
_HUB_SPEC = re.compile(r"(?P<repo>[\w.-]+/[\w.-]+)(?:@(?P<revision>[^:]+))?(?::(?P<rest>.+))?")


def load_examples(spec, *, columns=None, max_examples=None):
    """The rows (dicts) of `spec`, one of the sources the module docstring lists. columns: a
    "field=column,..." string (see `parse_columns`); max_examples: keep only the first N rows.
    Every row is checked here, so a bad one fails now, naming its file and line, not mid-training."""
    return [row for _, row in _records(spec, parse_columns(columns), max_examples)]


def _records(spec, mapping, limit, check=_format):
    """[(where, row)]: `where` names the row in messages ('data.jsonl: line 3', 'user/repo:train: row 7').
    check(row, where) raises a ValueError for a row in no known format (SFT's by default)."""
    records = _read_spec(spec, limit)[:limit]
    if not records:
        raise ValueError(f"{spec} holds no examples")
    if mapping:
        records = [(where, _map_columns(row, mapping, where)) for where, row in records]
    for where, row in records:
        check(row, where)
    return records


BUILTIN = {"builtin": builtin_dataset, "builtin:arithmetic": arithmetic_dataset}  # the embedded datasets


def _is_builtin(spec):
    return spec == "builtin" or spec.startswith("builtin:")


def _builtin_parts(spec):
    """(dataset, split) of a builtin spec, "builtin[:split]" or "builtin:arithmetic[:split]"; the split is
    "train" when left out. ValueError for any other."""
    parts = spec.split(":")
    name = ":".join(parts[:2]) if parts[1:2] == ["arithmetic"] else "builtin"
    split = spec[len(name) + 1:] or "train"
    if split not in ("train", "eval"):
        raise ValueError(f"unknown builtin dataset {spec!r}; the embedded ones are "
                         f"{', '.join(f'{n}, {n}:eval' for n in BUILTIN)} (the eval splits held out)")
    return name, split


def builtin_eval_spec(spec):
    """The eval split of the builtin dataset that spec names: "builtin:eval" or "builtin:arithmetic:eval"."""
    return f"{_builtin_parts(spec)[0]}:eval"


def _read_spec(spec, limit):
    if _is_builtin(spec):
        name, split = _builtin_parts(spec)
        return [(f"{name}:{split}: item {i}", ex) for i, ex in enumerate(BUILTIN[name](split))]
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


def parse_columns(spec, fields=FIELDS):
    """{field: column} from "field=column,..." (e.g. "instruction=question,output=answer", "messages=dialog"):
    the dataset's column `column` is read as nanotune's field `field`, one of `fields`. None or "" maps nothing."""
    mapping = {}
    for pair in (spec or "").split(",") if spec else []:
        field, eq, column = (s.strip() for s in pair.partition("="))
        if not (eq and field and column):
            raise ValueError(f"--columns: {pair!r} is not field=column; write e.g. "
                             "--columns instruction=question,output=answer")
        if field not in fields:
            raise ValueError(f"--columns: unknown field {field!r}; the fields are {', '.join(fields)}")
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
