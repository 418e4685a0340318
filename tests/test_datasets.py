"""Tests for reading datasets (data.load_datasets): every format from every kind of source with exact
tokens and targets, folders and splits, hub datasets (simulated), column mapping, the eval split, the
tokenized-data cache and parallel tokenizing."""
import csv
import json
import os
import random
import re
import signal
import sys

import huggingface_hub
import pytest

import data
from data import default_cache_dir, load_datasets, load_examples
from model.tokenizer import Tokenizer, load_tokenizer
from tests.tiny_tokenizer import make_test_tokenizer


def quiet(*args):
    pass


@pytest.fixture(scope="module")
def tok(tmp_path_factory):  # ChatML template that writes BOS <s> itself; EOS '</s>' is appended
    return load_tokenizer(make_test_tokenizer(tmp_path_factory.mktemp("tok")))


def expected(tok, segments):
    """(ids, mask) of hand-written (text, is_target) segments. Every boundary sits at a special token or
    between tokens, so each segment's tokens are those it has within the whole text."""
    ids, mask = [], []
    for text, is_target in segments:
        part = tok.encode(text)
        ids, mask = ids + part, mask + [is_target] * len(part)
    return ids, mask


USER, ASSISTANT = {"role": "user", "content": "hi"}, {"role": "assistant", "content": "hello"}
CHAT = [("<s><|im_start|>user\nhi<|im_end|>\n<|im_start|>assistant\n", False), ("hello<|im_end|>\n</s>", True)]
FORMATS = {  # format -> (row, its expected segments)
    "text": ({"text": "hello world"}, [("<s>", False), ("hello world</s>", True)]),
    "completion": ({"prompt": "Question: 2 + 3\nAnswer:", "completion": " 5"},
                   [("<s>Question: 2 + 3\nAnswer:", False), (" 5</s>", True)]),
    "alpaca": ({"instruction": "hi", "input": "", "output": "hello"}, CHAT),
    "messages": ({"messages": [USER, ASSISTANT]}, CHAT),
    "sharegpt": ({"conversations": [{"from": "human", "value": "hi"}, {"from": "gpt", "value": "hello"}]}, CHAT),
    "chat completion": ({"prompt": [USER], "completion": [ASSISTANT]}, CHAT),
}
FLAT = ("text", "completion", "alpaca")  # what a CSV file can hold


def write_jsonl(path, rows):
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text("".join(json.dumps(r) + "\n" for r in rows))
    return str(path)


def write_csv(path, rows):
    with open(path, "w", newline="") as f:
        writer = csv.DictWriter(f, fieldnames=list(rows[0]))
        writer.writeheader()
        writer.writerows(rows)
    return str(path)


def hf_datasets():
    return pytest.importorskip("datasets", reason="the 'data' extra (pip install -e '.[data]') is not installed")


def hub(monkeypatch, rows):
    """Make datasets.load_dataset answer with `rows`, as a hub dataset would; returns the calls it gets."""
    datasets, calls = hf_datasets(), []

    def load_dataset(path, name=None, *, split=None, revision=None, trust_remote_code=None):
        assert trust_remote_code is False, "a hub dataset's loading script must never run"
        calls.append((path, name, split, revision))
        return datasets.Dataset.from_list(rows)
    monkeypatch.setattr(datasets, "load_dataset", load_dataset)
    return calls


def as_json(d, rows, monkeypatch):
    (d / "d.json").write_text(json.dumps(rows))
    return str(d / "d.json")


def as_json_data(d, rows, monkeypatch):
    (d / "d.json").write_text(json.dumps({"data": rows}))
    return str(d / "d.json")


def as_txt(d, rows, monkeypatch):
    (d / "d.txt").write_text("\n\n".join(r["text"] for r in rows))
    return str(d / "d.txt")


def as_parquet(d, rows, monkeypatch):
    hf_datasets().Dataset.from_list(rows).to_parquet(str(d / "d.parquet"))
    return str(d / "d.parquet")


def as_saved(d, rows, monkeypatch):
    hf_datasets().Dataset.from_list(rows).save_to_disk(str(d / "saved"))
    return str(d / "saved")


def as_saved_split(d, rows, monkeypatch):
    datasets = hf_datasets()
    splits = {"train": datasets.Dataset.from_list(rows),
              "test": datasets.Dataset.from_list([{"text": "not this split"}])}
    datasets.DatasetDict(splits).save_to_disk(str(d / "saved"))
    return str(d / "saved") + ":train"


def as_hub(d, rows, monkeypatch):
    hub(monkeypatch, rows)
    return "someone/data:train"


def as_hub_file(d, rows, monkeypatch):
    local = write_jsonl(d / "d.jsonl", rows)
    monkeypatch.setattr(huggingface_hub, "hf_hub_download", lambda repo_id, filename, **kw: local)
    return "someone/data:sub/train.jsonl"


SOURCES = {  # name -> (write rows as this source and return its --data spec, the formats it can hold)
    "jsonl": (lambda d, rows, monkeypatch: write_jsonl(d / "d.jsonl", rows), FORMATS),
    "json": (as_json, FORMATS),
    "json data": (as_json_data, FORMATS),
    "csv": (lambda d, rows, monkeypatch: write_csv(d / "d.csv", rows), FLAT),
    "txt": (as_txt, ("text",)),
    "parquet": (as_parquet, FORMATS),
    "folder": (lambda d, rows, monkeypatch: os.path.dirname(write_jsonl(d / "shards" / "part-0.jsonl", rows)), FORMATS),
    "save_to_disk": (as_saved, FORMATS),
    "save_to_disk split": (as_saved_split, FORMATS),
    "hub": (as_hub, FORMATS),
    "hub file": (as_hub_file, FORMATS),
}


@pytest.mark.parametrize("source, fmt", [(s, f) for s, (_, formats) in SOURCES.items() for f in formats])
def test_each_format_from_each_source(tok, tmp_path, monkeypatch, source, fmt):
    row, segments = FORMATS[fmt]
    spec = SOURCES[source][0](tmp_path, [row], monkeypatch)
    train, held_out = load_datasets(tok, data=spec, cache_dir=str(tmp_path / "cache"), log=quiet)
    assert (train, held_out) == ([expected(tok, segments)], [])

# ----------------------------------------------------------------------------- sources


def test_folder_reads_every_data_file_in_sorted_order(tmp_path):
    write_jsonl(tmp_path / "b" / "2.jsonl", [{"text": "two"}])
    write_jsonl(tmp_path / "a.jsonl", [{"text": "one"}])
    (tmp_path / "c.json").write_text(json.dumps([{"text": "three"}]))
    write_csv(tmp_path / "d.csv", [{"text": "four"}])
    (tmp_path / "e.txt").write_text("five\n\nsix")
    write_jsonl(tmp_path / ".cache" / "x.jsonl", [{"text": "hidden"}])
    (tmp_path / "README.md").write_text("# not data")
    assert [r["text"] for r in load_examples(str(tmp_path))] == ["one", "two", "three", "four", "five", "six"]


def test_folder_split_by_file_names(tmp_path):
    for name, text in [("data/train-00000-of-00002.jsonl", "t0"), ("data/train-00001-of-00002.jsonl", "t1"),
                       ("data/test-00000-of-00001.jsonl", "e0")]:
        write_jsonl(tmp_path / name, [{"text": text}])
    assert [r["text"] for r in load_examples(f"{tmp_path}:train")] == ["t0", "t1"]
    assert [r["text"] for r in load_examples(f"{tmp_path}:test")] == ["e0"]
    with pytest.raises(ValueError, match=r"holds the files of several splits \(test, train\); choose one, e\.g\. "
                                         r"--data .*:train"):
        load_examples(str(tmp_path))
    with pytest.raises(ValueError, match=r"no files of split 'validation'.*"
                                         r"the splits its file names show: test, train"):
        load_examples(f"{tmp_path}:validation")


def test_folder_without_data_files_is_refused(tmp_path):
    (tmp_path / "README.md").write_text("# nothing here")
    with pytest.raises(FileNotFoundError, match=r"is a folder with no data files in it \(\.jsonl, \.json, \.csv"):
        load_examples(str(tmp_path))


def test_txt_blocks_are_examples(tmp_path):
    path = tmp_path / "notes.txt"
    path.write_text("first line\nsecond line\n\n\n  \nthird\r\n\r\nfourth\n")
    records = data._records(str(path), {}, None)
    assert [r for _, r in records] == [{"text": "first line\nsecond line"}, {"text": "third"}, {"text": "fourth"}]
    assert [w for w, _ in records] == [f"{path}: line 1", f"{path}: line 6", f"{path}: line 8"]


def test_csv_rows(tmp_path):
    path = tmp_path / "qa.csv"
    path.write_text('instruction,output\n"Say ""hi""","multi\nline"\nAdd,5\n')
    records = data._records(str(path), {}, None)
    assert [r for _, r in records] == [{"instruction": 'Say "hi"', "output": "multi\nline"},
                                       {"instruction": "Add", "output": "5"}]
    assert [w for w, _ in records] == [f"{path}: line 3", f"{path}: line 4"]
    path.write_text("text\nhello,extra\n")
    with pytest.raises(ValueError, match=r"qa\.csv: line 2 has more fields than the header \(text\)"):
        load_examples(str(path))


@pytest.mark.parametrize("name, content, line, byte", [("bad.jsonl", b'{"text": "ok"}\n{"text": "caf\xe9"}\n', 2, 14),
                                                       ("bad.csv", b'text\nok\ncaf\xe9\n', 3, 4),
                                                       ("bad.txt", b"ok\n\ncaf\xe9\n", 3, 4)])
def test_non_utf8_data_names_the_file_and_line(tmp_path, name, content, line, byte):
    (tmp_path / name).write_bytes(content)
    with pytest.raises(ValueError, match=rf"{re.escape(name)}: line {line} is not UTF-8 text \(byte 0xe9 at byte "
                                         rf"{byte} of the line\); save the file as UTF-8"):
        load_examples(str(tmp_path / name))


def test_a_missing_path_is_not_taken_for_a_hub_name(tmp_path):
    for spec in ("data/train.jsonl", "./x", str(tmp_path / "nope.parquet")):
        with pytest.raises(FileNotFoundError, match="no such file: .*user/repo:split"):
            load_examples(spec)


def test_local_json_csv_and_txt_need_no_datasets(tmp_path, monkeypatch):
    monkeypatch.setitem(sys.modules, "datasets", None)  # import datasets now raises ImportError
    monkeypatch.setitem(sys.modules, "pyarrow", None)
    monkeypatch.setitem(sys.modules, "pyarrow.parquet", None)
    assert load_examples(write_jsonl(tmp_path / "a.jsonl", [{"text": "a"}])) == [{"text": "a"}]
    assert load_examples(write_csv(tmp_path / "b.csv", [{"text": "b"}])) == [{"text": "b"}]
    (tmp_path / "c.parquet").write_bytes(b"PAR1")
    (tmp_path / "saved").mkdir()
    (tmp_path / "saved" / "dataset_dict.json").write_text('{"splits": ["train"]}')
    extra = re.escape('needs Hugging Face datasets: pip install -e ".[data]"')
    for spec, what in [("someone/data", "loading the hub dataset 'someone/data'"),
                       (str(tmp_path / "c.parquet"), "reading the parquet file .*c.parquet"),
                       (str(tmp_path / "saved"), "reading the datasets folder .*saved")]:
        with pytest.raises(ValueError, match=f"^{what} {extra}"):
            load_examples(spec)


@pytest.mark.parametrize("spec, call", [
    ("someone/data", ("someone/data", None, "train", None)),
    ("HuggingFaceH4/ultrachat_200k:train_sft", ("HuggingFaceH4/ultrachat_200k", None, "train_sft", None)),
    ("someone/data@v1.0:default:test", ("someone/data", "default", "test", "v1.0")),
    ("someone/data@refs/convert/parquet", ("someone/data", None, "train", "refs/convert/parquet")),
])
def test_hub_dataset_spec(monkeypatch, spec, call):
    calls = hub(monkeypatch, [{"text": "a"}])
    assert load_examples(spec) == [{"text": "a"}]
    assert calls == [call]


def test_hub_dataset_errors(monkeypatch):
    datasets = hf_datasets()

    def unknown_split(*args, **kwargs):
        raise ValueError('Unknown split "train". Should be one of [\'train_sft\', \'test_sft\'].\nmore lines')
    monkeypatch.setattr(datasets, "load_dataset", unknown_split)
    with pytest.raises(FileNotFoundError, match=r"^could not load the hub dataset 'a/b' \(config None, split "
                                                r"'train'\): ValueError: Unknown split \"train\"\. Should be one of "
                                                r"\['train_sft', 'test_sft'\]\. Check the name at "
                                                r"https://huggingface\.co/datasets/a/b"):
        load_examples("a/b")
    with pytest.raises(ValueError, match="at most two ':' parts"):
        load_examples("a/b:x:y:z")


def test_save_to_disk_splits(tmp_path):
    datasets = hf_datasets()
    datasets.DatasetDict({"train_sft": datasets.Dataset.from_list([{"text": "t"}]),
                          "test_sft": datasets.Dataset.from_list([{"text": "e"}])}).save_to_disk(str(tmp_path / "dd"))
    assert load_examples(f"{tmp_path / 'dd'}:test_sft") == [{"text": "e"}]
    with pytest.raises(ValueError, match=r"dd holds the splits train_sft, test_sft; choose one, "
                                         r"e\.g\. --data .*dd:train_sft"):
        load_examples(str(tmp_path / "dd"))
    with pytest.raises(ValueError, match=r"dd holds the splits train_sft, test_sft, not 'train'"):
        load_examples(f"{tmp_path / 'dd'}:train")
    datasets.Dataset.from_list([{"text": "t"}]).save_to_disk(str(tmp_path / "one"))
    with pytest.raises(ValueError, match=r"one holds one dataset, not named splits; drop ':train'"):
        load_examples(f"{tmp_path / 'one'}:train")


def test_parquet_rows_keep_their_nested_messages(tmp_path):
    datasets = hf_datasets()
    rows = [{"messages": [USER, ASSISTANT]}, {"messages": [{"role": "user", "content": "2+2?"},
                                                           {"role": "assistant", "content": "4"}]}]
    datasets.Dataset.from_list(rows).to_parquet(str(tmp_path / "chats.parquet"))
    assert load_examples(str(tmp_path / "chats.parquet")) == rows
    (tmp_path / "broken.parquet").write_bytes(b"PAR1 not really")
    with pytest.raises(ValueError, match=r"broken\.parquet: not a readable parquet file"):
        load_examples(str(tmp_path / "broken.parquet"))

# ----------------------------------------------------------------------------- columns and rows


def test_columns_map_dataset_names_to_fields(tok, tmp_path):
    qa = write_csv(tmp_path / "qa.csv", [{"question": "hi", "answer": "hello", "id": "7"}])
    assert load_examples(qa, columns="instruction=question, output=answer") == [
        {"id": "7", "instruction": "hi", "output": "hello"}]
    train, _ = load_datasets(tok, data=qa, columns="instruction=question,output=answer",
                             cache_dir=str(tmp_path / "c"), log=quiet)
    assert train == [expected(tok, CHAT)]
    dialog = write_jsonl(tmp_path / "d.jsonl", [{"dialog": [USER, ASSISTANT], "messages": "not these"}])
    assert load_examples(dialog, columns="messages=dialog") == [{"messages": [USER, ASSISTANT]}]


@pytest.mark.parametrize("columns, message", [
    ("instruction", r"--columns: 'instruction' is not field=column; write e\.g\. --columns instruction=question"),
    ("question=instruction", r"--columns: unknown field 'question'; the fields are text, prompt, completion"),
    ("output=a,output=b", r"--columns: the field 'output' is given twice"),
    ("instruction=q,output=missing",
     r"d\.jsonl: line 1: no column 'missing' \(named in --columns\); its columns are \['a', 'q'\]"),
])
def test_bad_columns(tmp_path, columns, message):
    path = write_jsonl(tmp_path / "d.jsonl", [{"q": "hi", "a": "yo"}])
    with pytest.raises(ValueError, match=message):
        load_examples(path, columns=columns)


def test_max_examples_takes_the_first_rows(tok, tmp_path):
    rows = [{"text": f"row {i}"} for i in range(30)]
    path = write_jsonl(tmp_path / "d.jsonl", rows)
    assert load_examples(path, max_examples=3) == rows[:3]
    train, _ = load_datasets(tok, data=path, max_examples=3, cache_dir=str(tmp_path / "c"), log=quiet)
    assert sorted(train) == sorted(data.encode_example(r, tok) for r in rows[:3])
    assert len(load_datasets(tok, max_examples=5, cache_dir=str(tmp_path / "c"), log=quiet)[0]) == 5  # builtin


def test_every_row_is_checked_before_any_is_tokenized(tok, tmp_path, monkeypatch):
    rows = [{"messages": [USER, ASSISTANT]}] * 30 + [{"messages": [USER, {"role": "bot", "content": "x"}, ASSISTANT]}]
    path = write_jsonl(tmp_path / "d.jsonl", rows)

    def no_tokenizing(*args, **kwargs):
        raise AssertionError("tokenized before every row was checked")
    monkeypatch.setattr(Tokenizer, "encode_offsets", no_tokenizing)
    with pytest.raises(ValueError, match=r"d\.jsonl: line 31: a message has the role 'bot'.*its roles are system, "
                                         "user, assistant"):
        load_datasets(tok, data=path, cache_dir=str(tmp_path / "c"), log=quiet)


def test_system_prompt_needs_chat_rows(tok, tmp_path):
    path = write_jsonl(tmp_path / "d.jsonl", [{"text": "hello"}])
    with pytest.raises(ValueError, match=r"line 1: --system-prompt adds a system turn to chats, and this row is not "
                                         r"one \('text'\); drop --system-prompt"):
        load_datasets(tok, data=path, system_prompt="Be brief.", cache_dir=str(tmp_path / "c"), log=quiet)

# ----------------------------------------------------------------------------- splits and filtering


def test_eval_split_is_a_seeded_shuffle(tok, tmp_path):
    rows = [{"text": f"row {i}"} for i in range(100)]
    path = write_jsonl(tmp_path / "d.jsonl", rows)
    order = list(range(100))
    random.Random(7).shuffle(order)
    train, held_out = load_datasets(tok, data=path, eval_fraction=0.1, seed=7, cache_dir=str(tmp_path / "c"), log=quiet)
    encoded = [data.encode_example(r, tok) for r in rows]
    assert held_out == [encoded[i] for i in order[:10]] and train == [encoded[i] for i in order[10:]]


def test_eval_data_is_a_separate_eval_set(tok, tmp_path):
    rows, evals = [{"text": f"row {i}"} for i in range(50)], [{"text": "held out"}, {"messages": [USER, ASSISTANT]}]
    logs = []
    train, held_out = load_datasets(tok, data=write_jsonl(tmp_path / "d.jsonl", rows), eval_fraction=0.5,
                                    eval_data=write_jsonl(tmp_path / "e.jsonl", evals),
                                    cache_dir=str(tmp_path / "c"), train_on_inputs=True, log=logs.append)
    assert [ids for ids, _ in train] == [data.encode_example(r, tok)[0] for r in rows]  # all of them, in order
    assert all(all(mask) for _, mask in train)  # train_on_inputs: every token a target
    assert held_out == [data.encode_example(r, tok) for r in evals]  # eval keeps its answer-only mask
    assert not any("eval split" in line for line in logs)


def test_builtin_has_its_own_eval_split(tok, tmp_path):
    train, held_out = load_datasets(tok, eval_fraction=0.5, cache_dir=str(tmp_path / "c"), log=quiet)
    assert len(train) == 2000 and held_out == [data.encode_example(r, tok) for r in data.builtin_dataset("eval")]
    with pytest.raises(ValueError, match="the builtin dataset needs none"):
        load_datasets(tok, columns="text=body", cache_dir=str(tmp_path / "c"), log=quiet)


@pytest.mark.parametrize("n, message", [
    (40, "data: no eval split: --eval-fraction 0.02 of 40 examples holds out none; pass --eval-fraction 0.03 or more, "
         "or --eval-data FILE, to evaluate"),
    (10, "data: no eval split: 10 examples are too few to hold any out (it takes 20); pass --eval-data FILE to "
         "evaluate on a set of your own"),
])
def test_an_empty_eval_split_is_said(tok, tmp_path, n, message):
    logs = []
    path = write_jsonl(tmp_path / "d.jsonl", [{"text": f"row {i}"} for i in range(n)])
    train, held_out = load_datasets(tok, data=path, cache_dir=str(tmp_path / "c"), log=logs.append)
    assert (len(train), held_out) == (n, []) and message in logs
    train, held_out = load_datasets(tok, data=path, eval_fraction=0.03, cache_dir=str(tmp_path / "c"), log=logs.append)
    assert len(held_out) == (1 if n == 40 else 0)


@pytest.mark.parametrize("options, message", [
    (dict(eval_fraction=1.0), r"--eval-fraction must be at least 0 and below 1 \(got 1\.0\)"),
    (dict(eval_fraction=-0.5), r"--eval-fraction must be at least 0 and below 1 \(got -0\.5\)"),
    (dict(max_examples=0), r"--max-examples must be at least 1 \(got 0\)"),
    (dict(num_proc=0), r"--num-proc must be at least 1 \(got 0\)"),
])
def test_bad_options(tok, options, message):
    with pytest.raises(ValueError, match=message):
        load_datasets(tok, **options)


def test_long_examples_are_dropped_and_said(tok, tmp_path):
    rows = [{"text": "hi"}, {"text": "hello world " * 10}]
    logs = []
    path = write_jsonl(tmp_path / "d.jsonl", rows)
    train, _ = load_datasets(tok, data=path, max_len=8, cache_dir=str(tmp_path / "c"), log=logs.append)
    assert train == [data.encode_example(rows[0], tok)]
    assert "data: dropped 1 of 2 examples longer than --max-len 8" in logs
    with pytest.raises(ValueError, match=r"every training example is longer than --max-len 3 \(the shortest has 4 "
                                         r"tokens\); raise --max-len"):
        load_datasets(tok, data=path, max_len=3, cache_dir=str(tmp_path / "c"), log=quiet)


def test_no_target_at_all_is_refused(tok, tmp_path, monkeypatch):
    encode = data.encode_example
    monkeypatch.setattr(data.cache, "encode_example",
                        lambda *a, **k: (encode(*a, **k)[0], [False] * len(encode(*a, **k)[0])))
    with pytest.raises(ValueError, match=r"no example has any target token \(every label is masked\)"
                                         r".*--train-on-inputs"):
        load_datasets(tok, data=write_jsonl(tmp_path / "d.jsonl", [{"text": "hi"}]), cache_dir=str(tmp_path / "c"),
                      log=quiet)

# ----------------------------------------------------------------------------- the cache and parallel tokenizing


def count_tokenizing(monkeypatch):
    calls, encode = [], Tokenizer.encode_offsets
    monkeypatch.setattr(Tokenizer, "encode_offsets", lambda self, *a, **k: calls.append(1) or encode(self, *a, **k))
    return calls


def test_a_second_load_reads_the_cache_without_tokenizing(tok, tmp_path, monkeypatch):
    rows = [{"messages": [USER, ASSISTANT]}, {"instruction": "Add", "input": "2 + 3", "output": "5"}, {"text": "x"}]
    path, cache = write_jsonl(tmp_path / "d.jsonl", rows * 10), str(tmp_path / "cache")
    calls, logs = count_tokenizing(monkeypatch), []
    first = load_datasets(tok, data=path, cache_dir=cache, log=logs.append)
    assert calls and len(os.listdir(cache)) == 1 and os.listdir(cache)[0].endswith(".npz")
    calls.clear()
    for options in ({}, dict(max_len=64), dict(seed=3, eval_fraction=0.1), dict(train_on_inputs=True)):
        again = load_datasets(tok, data=path, cache_dir=cache, log=logs.append, **options)
        if not options:
            assert again == first
    assert calls == [] and len(os.listdir(cache)) == 1  # split, filtering and masking options reuse it
    assert f"data: 30 examples tokenized before, read from {os.path.join(cache, os.listdir(cache)[0])}" in logs


def test_the_cache_is_keyed_by_data_tokenizer_template_and_system_prompt(tok, tmp_path, monkeypatch):
    rows = [{"messages": [USER, ASSISTANT]}]
    path, cache = write_jsonl(tmp_path / "d.jsonl", rows), str(tmp_path / "cache")
    template = tmp_path / "other.jinja"
    template.write_text("{% for m in messages %}{{ m['role'] }}: {{ m['content'] }}\n{% endfor %}")
    other_tok = load_tokenizer(make_test_tokenizer(tmp_path / "other", tokens=("<think>",)))
    first = load_datasets(tok, data=path, cache_dir=cache, log=quiet)
    calls = count_tokenizing(monkeypatch)
    for n, (tokenizer, options) in enumerate([(tok, dict(chat_template=str(template))), (other_tok, {}),
                                              (tok, dict(system_prompt="Be brief."))], start=2):
        calls.clear()
        result = load_datasets(tokenizer, data=path, cache_dir=cache, log=quiet, **options)
        assert calls and len(os.listdir(cache)) == n
        if options:
            assert result != first
    calls.clear()
    write_jsonl(tmp_path / "d.jsonl", rows + [{"text": "one more row"}])
    assert len(load_datasets(tok, data=path, cache_dir=cache, log=quiet)[0]) == 2 and calls


def test_a_damaged_cache_file_is_tokenized_again(tok, tmp_path):
    path, cache, logs = write_jsonl(tmp_path / "d.jsonl", [{"text": "hi"}]), tmp_path / "cache", []
    first = load_datasets(tok, data=path, cache_dir=str(cache), log=quiet)
    (entry,) = cache.iterdir()
    entry.write_bytes(b"not a zip file")
    assert load_datasets(tok, data=path, cache_dir=str(cache), log=logs.append) == first
    assert any(line.startswith(f"data: ignoring the damaged cache file {entry}") for line in logs)
    logs.clear()
    assert load_datasets(tok, data=path, cache_dir=str(cache), log=logs.append) == first  # rewritten, readable
    assert any(line.startswith("data: 1 examples tokenized before") for line in logs)


def test_an_unwritable_cache_costs_only_the_cache(tok, tmp_path):
    (tmp_path / "file").write_text("in the way")
    logs = []
    train, _ = load_datasets(tok, data=write_jsonl(tmp_path / "d.jsonl", [{"text": "hi"}]),
                             cache_dir=str(tmp_path / "file" / "cache"), log=logs.append)
    assert train == [data.encode_example({"text": "hi"}, tok)]
    assert any(line.startswith("data: could not cache the tokenized examples in") for line in logs)


def test_default_cache_dir(monkeypatch, tmp_path):
    monkeypatch.setenv("NANOTUNE_CACHE", str(tmp_path / "nt"))
    assert default_cache_dir() == str(tmp_path / "nt" / "datasets")
    monkeypatch.delenv("NANOTUNE_CACHE")
    monkeypatch.setenv("HOME", str(tmp_path / "home"))
    assert default_cache_dir() == str(tmp_path / "home" / ".cache" / "nanotune" / "datasets")


def test_parallel_tokenizing_matches_serial_and_reports_progress(tok, tmp_path, monkeypatch):
    rows = [{"messages": [{"role": "user", "content": f"question {i}"}, {"role": "assistant", "content": str(i)}]}
            if i % 2 else {"text": f"document {i}"} for i in range(3 * data.CHUNK)]
    path = write_jsonl(tmp_path / "d.jsonl", rows)
    monkeypatch.setattr(data.cache, "PROGRESS_EVERY", 0.0)
    logs = []
    parallel = load_datasets(tok, data=path, num_proc=2, cache_dir=str(tmp_path / "a"), log=logs.append)
    serial = load_datasets(tok, data=path, num_proc=1, cache_dir=str(tmp_path / "b"), log=quiet)
    assert parallel == serial
    assert any(re.fullmatch(rf"data: tokenized \d+/{len(rows)} examples \(\d+/s, about \d+ s left\)", line)
               for line in logs)
    assert any(re.fullmatch(rf"data: tokenized {len(rows)} examples in [\d.]+ s \(\d+/s, 2 processes\)", line)
               for line in logs)


def test_pool_workers_end_quietly_under_train_py_signal_handlers(tok, tmp_path, capfd):
    """train.py turns SIGTERM into KeyboardInterrupt before the data is read; the pool's workers, forked with
    that handler, must not print a traceback when the pool terminates them at its end."""
    def interrupt(signum, frame):
        raise KeyboardInterrupt(signum)
    rows = [{"text": f"document {i}"} for i in range(3 * data.CHUNK)]
    old = signal.signal(signal.SIGTERM, interrupt)
    try:
        for _ in range(3):  # a worker still busy at terminate() is what printed the traceback
            load_datasets(tok, data=write_jsonl(tmp_path / "d.jsonl", rows), num_proc=2,
                          cache_dir=str(tmp_path / f"c{_}"), log=quiet)
    finally:
        signal.signal(signal.SIGTERM, old)
    err = capfd.readouterr().err
    assert "Traceback" not in err and "KeyboardInterrupt" not in err, err


def test_a_row_error_in_a_pool_process_reaches_the_caller(tmp_path, monkeypatch):
    gemma_like = load_tokenizer(make_test_tokenizer(
        tmp_path / "tok", chat_template="{% if messages[0]['role'] == 'system' %}{{ raise_exception('System role "
                                        "not supported') }}{% endif %}{% for m in messages %}{{ m['content'] }}"
                                        "{% endfor %}"))
    rows = [{"messages": [USER, ASSISTANT]}] * data.CHUNK + [{"messages": [{"role": "system", "content": "s"},
                                                                          USER, ASSISTANT]}]
    with pytest.raises(ValueError, match=rf"d\.jsonl: line {data.CHUNK + 1}: the chat template failed on it "
                                         r"\(TemplateError: System role not supported\)"):
        load_datasets(gemma_like, data=write_jsonl(tmp_path / "d.jsonl", rows), num_proc=2,
                      cache_dir=str(tmp_path / "c"), log=quiet)


# ----------------------------------------------------------------------------- train.py end to end

QWEN3_STYLE = ("{% for m in messages %}{% if m['role'] == 'assistant' and not loop.last %}"
               "<|im_start|>assistant\n{{ m['content'].split('</think>')[-1] }}<|im_end|>\n"
               "{% else %}<|im_start|>{{ m['role'] }}\n{{ m['content'] }}<|im_end|>\n{% endif %}{% endfor %}"
               "{% if add_generation_prompt %}<|im_start|>assistant\n{% endif %}")


def _train(run_model, tmp_path, *args):
    import train
    from tests.helpers import read_metrics
    out = str(tmp_path / "out")
    argv = ["--model", run_model, "--out-dir", out, "--max-steps", "2", "--batch-size", "2", "--max-len", "128",
            "--eval-every", "0", "--save-every", "0", "--device", "cpu", *args]
    assert train.cli(argv) == 0
    return [r for r in read_metrics(out) if "loss" in r]


def test_train_on_a_sharegpt_parquet_file(run_model, tmp_path):
    pq = pytest.importorskip("pyarrow.parquet", reason="the 'data' extra (pip install -e '.[data]') is not installed")
    import pyarrow as pa
    rows = [{"conversations": [{"from": "human", "value": f"say {i}"}, {"from": "gpt", "value": f"{i} {i}"}]}
            for i in range(30)]
    pq.write_table(pa.Table.from_pylist(rows), str(tmp_path / "chats.parquet"))
    steps = _train(run_model, tmp_path, "--data", str(tmp_path / "chats.parquet"))
    assert len(steps) == 2 and all(r["target_tokens"] > 0 for r in steps)


def test_train_on_a_save_to_disk_folder_with_columns(run_model, tmp_path):
    datasets = hf_datasets()
    rows = [{"dialog": [{"role": "user", "content": f"q{i}"}, {"role": "assistant", "content": f"a{i}"}]}
            for i in range(30)]
    datasets.DatasetDict({"train": datasets.Dataset.from_list(rows)}).save_to_disk(str(tmp_path / "saved"))
    steps = _train(run_model, tmp_path, "--data", str(tmp_path / "saved") + ":train", "--columns", "messages=dialog")
    assert len(steps) == 2 and all(r["target_tokens"] > 0 for r in steps)


def test_train_on_multi_turn_chats_with_a_template_file(run_model, tmp_path):
    """A template that rewrites earlier assistant turns (as Qwen3's drops their reasoning) trains, from a file."""
    (tmp_path / "template.jinja").write_text(QWEN3_STYLE)
    chats = [{"messages": [{"role": "user", "content": f"u{i}"},
                           {"role": "assistant", "content": f"<think>r</think>a{i}"},
                           {"role": "user", "content": "again"}, {"role": "assistant", "content": f"b{i}"}]}
             for i in range(30)]
    write_jsonl(tmp_path / "chats.jsonl", chats)
    steps = _train(run_model, tmp_path, "--data", str(tmp_path / "chats.jsonl"),
                   "--chat-template", str(tmp_path / "template.jinja"))
    assert len(steps) == 2 and all(r["target_tokens"] > 0 for r in steps)
