"""Reliability of the data side, tried as a hostile or careless user would: symlinks planted in the
tokenized-data cache and the run folder, chat templates that never finish, damaged cache files,
malformed CSV and JSONL rows, and eval sets whose answers do not fit --max-len."""
import json
import os
import re
import signal
import sys
import time
import types

import numpy as np
import pytest

import data
import tracking
from data import load_datasets
from model.files import atomic_file
from model.tokenizer import load_tokenizer
from tests.tiny_tokenizer import CHATML, make_test_tokenizer


def quiet(*args):
    pass


@pytest.fixture(scope="module")
def tok(tmp_path_factory):
    return load_tokenizer(make_test_tokenizer(tmp_path_factory.mktemp("tok")))


def write_jsonl(path, rows):
    path.write_text("".join(json.dumps(r) + "\n" for r in rows))
    return str(path)


CHATS = [{"messages": [{"role": "user", "content": f"question {i}"}, {"role": "assistant", "content": f"answer {i}"}]}
         for i in range(5)]

# ----------------------------------------------------------------------------- symlinks: the cache, .wandb_id


def planted(tmp_path, name="precious.txt"):
    """A file outside the folder under attack, and its contents."""
    outside = tmp_path / "outside"
    outside.mkdir(exist_ok=True)
    victim = outside / name
    victim.write_text("the user's own file\n")
    return victim


def cache_entry(tok, folder, rows):
    """(the data file, the cache folder, the cache file of its rows, the examples), tokenized once in `folder`."""
    folder.mkdir(exist_ok=True)
    path, cache = write_jsonl(folder / "d.jsonl", rows), folder / "cache"
    first = load_datasets(tok, data=path, eval_fraction=0, cache_dir=str(cache), log=quiet)
    (entry,) = cache.iterdir()
    return path, cache, entry, first


def test_a_symlink_at_the_cache_file_or_its_temp_file_is_not_written_through(tok, tmp_path):
    path, cache, entry, first = cache_entry(tok, tmp_path, CHATS)
    victim, other = planted(tmp_path), planted(tmp_path, "other.txt")
    entry.unlink()
    entry.symlink_to(victim)
    # where a temp file named by the process id would go: a link there would be truncated and overwritten
    os.symlink(other, f"{entry}.{os.getpid()}.tmp")
    logs = []
    assert load_datasets(tok, data=path, eval_fraction=0, cache_dir=str(cache), log=logs.append) == first
    assert victim.read_text() == other.read_text() == "the user's own file\n"
    assert not entry.is_symlink() and entry.is_file()  # the link is replaced by a cache file of its own
    assert any(line.startswith(f"data: ignoring the damaged cache file {entry} (") for line in logs), logs
    assert load_datasets(tok, data=path, eval_fraction=0, cache_dir=str(cache), log=logs.append) == first


def test_a_symlinked_cache_file_is_not_read(tok, tmp_path):
    """A link to another data set's valid cache file, of as many rows, would change the run's tokens."""
    path, cache, entry, first = cache_entry(tok, tmp_path, CHATS)
    *_, other_entry, other = cache_entry(tok, tmp_path / "other", [{"text": f"other {i}"} for i in range(5)])
    assert other != first
    entry.unlink()
    entry.symlink_to(other_entry)
    logs = []
    assert load_datasets(tok, data=path, eval_fraction=0, cache_dir=str(cache), log=logs.append) == first
    assert any("is a symbolic link" in line for line in logs), logs


def test_write_atomic_leaves_no_temp_file_and_keeps_the_old_file_on_error(tmp_path):
    target = tmp_path / "f.bin"
    target.write_bytes(b"old")

    def fail(f):
        f.write(b"half")
        raise OSError("disk full")
    with pytest.raises(OSError, match="disk full"), atomic_file(str(target), "wb") as f:
        fail(f)
    assert target.read_bytes() == b"old" and os.listdir(tmp_path) == ["f.bin"]
    with atomic_file(str(target), "wb") as f:
        f.write(b"new")
    assert target.read_bytes() == b"new" and os.listdir(tmp_path) == ["f.bin"]


@pytest.fixture
def fake_wandb(monkeypatch):
    """A stand-in `wandb` module that records the run id each init was given."""
    ids = []
    module = types.SimpleNamespace(init=lambda **kw: ids.append(kw["id"]), log=lambda *a, **k: None,
                                   finish=lambda: None)
    monkeypatch.setitem(sys.modules, "wandb", module)
    return ids


def test_wandb_id_is_kept_in_the_run_folder(tmp_path, fake_wandb):
    tracking.open_trackers(["wandb"], str(tmp_path), config={}).close()
    tracking.open_trackers(["wandb"], str(tmp_path), config={}).close()  # a resumed run: the same W&B run
    assert fake_wandb[0] == fake_wandb[1] == (tmp_path / ".wandb_id").read_text()
    assert os.listdir(tmp_path) == [".wandb_id"]


@pytest.mark.parametrize("dangling", [False, True])
def test_a_symlinked_wandb_id_is_neither_read_nor_written_through(tmp_path, fake_wandb, dangling):
    """A link to an existing file would send its contents to W&B as the run id; a dangling one would make
    the run create a file outside its folder."""
    victim = planted(tmp_path)
    if dangling:
        victim.unlink()
    out = tmp_path / "out"
    out.mkdir()
    (out / ".wandb_id").symlink_to(victim)
    with pytest.raises(ValueError, match=rf"cannot read the W&B run id in {out / '.wandb_id'} \(.*symbolic link"):
        tracking.open_trackers(["wandb"], str(out), config={})
    assert fake_wandb == []
    assert (victim.read_text() == "the user's own file\n") if not dangling else not victim.exists()


def test_a_wandb_id_file_of_other_contents_is_refused(tmp_path, fake_wandb):
    (tmp_path / ".wandb_id").write_text("x" * 10_000)
    with pytest.raises(ValueError, match="does not hold a W&B run id"):
        tracking.open_trackers(["wandb"], str(tmp_path), config={})
    assert fake_wandb == []

# ----------------------------------------------------------------------------- a chat template that never finishes

LOOPS = "{% for i in range(OUTER) %}{% for j in range(INNER) %}{% endfor %}{% endfor %}"


@pytest.mark.parametrize("num_proc, outer, inner", [(1, 10_000, 1_000), (2, 100_000, 100_000)])
def test_a_chat_template_that_loops_too_long_is_stopped_naming_it(tok, tmp_path, monkeypatch, num_proc, outer, inner):
    """Ten million empty iterations take seconds unbounded; 10^10 (the pool's case) take hours."""
    monkeypatch.setattr(data.formats, "RENDER_SECONDS", 0.2)
    template = tmp_path / "bomb.jinja"
    template.write_text(LOOPS.replace("OUTER", str(outer)).replace("INNER", str(inner)) + CHATML)
    rows = CHATS * (1 if num_proc == 1 else data.CHUNK)
    start = time.monotonic()
    with pytest.raises(ValueError, match=rf"^--chat-template {re.escape(str(template))} took over 0\.2 s to render "
                                         r".*d\.jsonl: line \d+, so it was stopped .*: fix it, or pass another"):
        load_datasets(tok, data=write_jsonl(tmp_path / "d.jsonl", rows), chat_template=str(template),
                      num_proc=num_proc, cache_dir=str(tmp_path / "c"), log=quiet)
    assert time.monotonic() - start < 5
    assert signal.getitimer(signal.ITIMER_REAL) == (0.0, 0.0)
    assert signal.getsignal(signal.SIGALRM) is signal.SIG_DFL


def test_the_models_own_slow_template_is_named_and_a_quick_one_renders_as_before(tmp_path, monkeypatch):
    monkeypatch.setattr(data.formats, "RENDER_SECONDS", 0.2)
    slow = load_tokenizer(make_test_tokenizer(tmp_path / "slow", chat_template=LOOPS.replace("OUTER", "100000")
                                              .replace("INNER", "100000") + CHATML))
    with pytest.raises(ValueError, match=r"^the model's chat template took over 0\.2 s to render .*d\.jsonl: line 1"):
        load_datasets(slow, data=write_jsonl(tmp_path / "d.jsonl", CHATS), num_proc=1,
                      cache_dir=str(tmp_path / "c"), log=quiet)
    quick = load_tokenizer(make_test_tokenizer(tmp_path / "quick", chat_template=LOOPS.replace("OUTER", "10")
                                               .replace("INNER", "10") + CHATML))
    assert data.encode_example(CHATS[0], quick) == data.encode_example(CHATS[0], load_tokenizer(
        make_test_tokenizer(tmp_path / "plain")))

# ----------------------------------------------------------------------------- a cache file that disagrees with itself


def plant(entry, **changes):
    """Rewrite the cache file `entry` with some of its arrays changed: changes[name](array) -> new array."""
    with np.load(entry) as f:
        arrays = {k: f[k] for k in f.files}
    arrays.update({k: change(arrays[k]) for k, change in changes.items()})
    with open(entry, "wb") as f:
        np.savez(f, **arrays)


@pytest.mark.parametrize("changes, reason", [
    ({"lengths": lambda a: np.concatenate([a[:1] + 1, a[1:-1], a[-1:] - 1])},  # the same total, other boundaries
     "its arrays do not match the checksum written with them"),
    ({"digest": lambda a: a[:0]}, "its arrays do not match the checksum written with them"),
    ({"lengths": lambda a: a - 1}, r"its lengths add up to \d+ tokens, but it holds \d+ ids and \d+ mask entries"),
    ({"mask": lambda a: a[:-1]}, r"its lengths add up to \d+ tokens, but it holds \d+ ids and \d+ mask entries"),
    ({"lengths": lambda a: a[:-1]}, r"it holds 4 examples, not 5"),
    ({"ids": lambda a: np.where(a == a.max(), 10_000, a)},
     r"it holds token ids from \d+ to 10000, outside the tokenizer's vocabulary of 400"),
    ({"ids": lambda a: np.where(a == a.min(), -1, a)}, r"it holds token ids from -1 to"),
    ({"mask": lambda a: a.astype(np.int64)}, r"its arrays are of int32, int64 and int64, not integers, booleans"),
    ({"ids": lambda a: a[None]}, r"its arrays have the shapes \(1, \d+\), \(\d+,\), \(5,\), not one axis each"),
])
def test_an_inconsistent_or_out_of_vocabulary_cache_is_rebuilt(tok, tmp_path, changes, reason):
    path, cache, entry, first = cache_entry(tok, tmp_path, CHATS)
    plant(entry, **changes)
    logs = []
    again = load_datasets(tok, data=path, eval_fraction=0, cache_dir=str(cache), log=logs.append)
    assert again == first
    assert any(re.fullmatch(rf"data: ignoring the damaged cache file {re.escape(str(entry))} \({reason}.*\); "
                            "tokenizing again", line) for line in logs), logs
    logs.clear()
    assert load_datasets(tok, data=path, eval_fraction=0, cache_dir=str(cache), log=logs.append) == first
    assert any(line.startswith("data: 5 examples tokenized before") for line in logs)  # rewritten, now used


def test_a_pickled_cache_file_is_refused(tok, tmp_path):
    path, cache, entry, first = cache_entry(tok, tmp_path, CHATS)
    plant(entry, ids=lambda a: np.array([{"payload": 1}], dtype=object))
    logs = []
    assert load_datasets(tok, data=path, eval_fraction=0, cache_dir=str(cache), log=logs.append) == first
    assert any("allow_pickle=False" in line for line in logs), logs

# ----------------------------------------------------------------------------- rows that fail far from their file


def refused(tmp_path, name, content, message, **options):
    path = tmp_path / name
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_bytes(content.encode() if isinstance(content, str) else content)
    with pytest.raises(ValueError, match=message):
        data.load_examples(str(tmp_path / name.split("/")[0]), **options)


DEEP = "[" * 100_000 + "]" * 100_000


@pytest.mark.parametrize("name, content, message", [
    ("d.csv", "text,text\na,b\n", r"^.*d\.csv: the header names the column 'text' 2 times; give each column its own"),
    ("d.csv", "instruction,input,output\nAdd,1 + 2,3\nAdd,2 + 2\n",
     r"d\.csv: line 3 has 2 fields, fewer than the header's 3 \(instruction, input, output\); a field that holds a "
     r"comma"),
    ("d.jsonl", '{"text": "ok"}\n{"text": "x", "more": ' + DEEP + "}\n",
     r"d\.jsonl: line 2 nests lists or objects too deeply to read; flatten it"),
    ("d.json", '[{"text": "ok"}, {"text": "x", "more": ' + DEEP + "}]",
     r"d\.json: the file nests lists or objects too deeply to read"),
    ("d.jsonl", '{"text": "ok \\ud83d\\ude00"}\n{"text": "half \\ud800 of a pair"}\n',
     r"d\.jsonl: line 2 holds a lone surrogate escape \('\\ud800'\), half of a UTF-16 pair, which is not text"),
    ("d.json", '[{"text": "ok"}, {"text": "a", "b": ["\\uDC00"]}]', r"d\.json: item 1 holds a lone surrogate escape"),
], ids=["csv same column twice", "csv short row", "jsonl deep", "json deep", "jsonl surrogate", "json surrogate"])
def test_a_bad_row_is_named_by_its_file_and_line(tmp_path, name, content, message):
    refused(tmp_path, name, content, message)


def test_an_escaped_surrogate_pair_is_text(tmp_path):
    (tmp_path / "d.jsonl").write_text('{"text": "smile \\ud83d\\ude00"}\n')
    assert data.load_examples(str(tmp_path / "d.jsonl")) == [{"text": "smile \U0001F600"}]


BROKEN_AFTER_3 = {  # three good rows, then a line that fails to read
    "d.jsonl": '{"text": "a"}\n\n{"text": "b"}\n{"text": "c"}\n{"text": \n',
    "d.csv": "text\na\nb\nc\nd,e\n",
    "d.txt": b"a\n\nb\nb\n\nc\n\n\xff\n",
    "folder/a.jsonl": '{"text": "a"}\n{"text": "b"}\n{"text": "c"}\n{"text": \n',
}


@pytest.mark.parametrize("name", BROKEN_AFTER_3)
def test_max_examples_stops_reading_once_enough_rows_are_in(tmp_path, name):
    content = BROKEN_AFTER_3[name]
    refused(tmp_path, name, content, r": line \d+ ", max_examples=4)  # the broken line, once reached
    rows = data.load_examples(str(tmp_path / name.split("/")[0]), max_examples=3)
    assert [r["text"] for r in rows] == ["a", "b\nb" if name == "d.txt" else "b", "c"]


def test_max_examples_reads_a_parquet_file_a_batch_at_a_time(tmp_path, monkeypatch):
    parquet = pytest.importorskip("pyarrow.parquet", reason="the 'data' extra is not installed")
    import pyarrow as pa
    parquet.write_table(pa.Table.from_pylist([{"text": f"row {i}"} for i in range(5000)]), str(tmp_path / "d.parquet"),
                        row_group_size=1000)
    read, iter_batches = [], parquet.ParquetFile.iter_batches

    def counted(self, *args, **kwargs):
        for batch in iter_batches(self, *args, **kwargs):
            read.append(len(batch))
            yield batch
    monkeypatch.setattr(parquet.ParquetFile, "iter_batches", counted)
    rows = data.load_examples(str(tmp_path / "d.parquet"), max_examples=3)
    assert [r["text"] for r in rows] == ["row 0", "row 1", "row 2"] and sum(read) < 5000
    assert len(data.load_examples(str(tmp_path / "d.parquet"))) == 5000 and sum(read) >= 5000

# ----------------------------------------------------------------------------- eval rows that do not fit --max-len


def qa(i, words=1):
    return {"instruction": f"Say {i}", "output": " ".join([str(i)] * words)}


def test_eval_rows_longer_than_max_len_are_dropped_and_counted(tok, tmp_path):
    short, long = [qa(i) for i in range(25)], [qa(i, words=40) for i in range(3)]
    eval_path = write_jsonl(tmp_path / "eval.jsonl", short[:2] + long + short[2:])
    logs = []
    train, held_out, rows = load_datasets(tok, data=write_jsonl(tmp_path / "d.jsonl", short), eval_data=eval_path,
                                          max_len=48, cache_dir=str(tmp_path / "c"), log=logs.append, with_rows=True)
    assert rows == short and held_out == [data.encode_example(r, tok) for r in short]  # whole, answers and all
    assert "data: dropped 3 of 28 eval examples longer than --max-len 48 (truncating them would cut off their " \
           "answers)" in logs
    assert not any("warning" in line for line in logs)


@pytest.mark.parametrize("eval_data, fix", [(True, r"--eval-data FILE$"), (False, r"--eval-fraction 0$")])
def test_an_eval_set_whose_answers_never_fit_is_refused(tok, tmp_path, eval_data, fix):
    """Truncated to --max-len, no eval row keeps a target: the eval would report loss 0.0 and accuracy 0%."""
    if eval_data:
        options = dict(data=write_jsonl(tmp_path / "d.jsonl", [qa(i) for i in range(30)]),
                       eval_data=write_jsonl(tmp_path / "e.jsonl", [qa(i, words=40) for i in range(30)]))
    else:  # the rows that the seeded split holds out are the long ones
        held = set(data._split(40, 0.1, 0)[1])
        options = dict(data=write_jsonl(tmp_path / "d.jsonl", [qa(i, words=40 if i in held else 1) for i in range(40)]),
                       eval_fraction=0.1, seed=0)
    with pytest.raises(ValueError, match=r"^every eval example is longer than --max-len 48 \(the shortest has \d+ "
                                         r"tokens\), so the eval would score no answer; raise --max-len, .*" + fix):
        load_datasets(tok, max_len=48, cache_dir=str(tmp_path / "c"), log=quiet, **options)


def test_train_py_refuses_such_an_eval_set_before_training(run_model, tmp_path, capsys):
    import train
    write_jsonl(tmp_path / "e.jsonl", [qa(i, words=60) for i in range(20)])
    argv = ["--model", run_model, "--out-dir", str(tmp_path / "out"), "--max-steps", "1", "--max-len", "64",
            "--eval-data", str(tmp_path / "e.jsonl"), "--device", "cpu"]
    assert train.cli(argv) == 2
    assert "error: every eval example is longer than --max-len 64" in capsys.readouterr().err


@pytest.mark.parametrize("n_eval, split, warned", [
    (5, False, "data: warning: the eval set has only 5 examples, so its loss and accuracy are noisy (one example is "
               "20% of the accuracy); pass --eval-data FILE with 20 or more"),
    (1, False, "data: warning: the eval set has only 1 example, so"),
    (10, True, "data: warning: the eval set has only 10 examples, so its loss and accuracy are noisy (one example is "
               "10% of the accuracy); hold out more with --eval-fraction, or pass --eval-data FILE with 20 or more"),
    (20, False, None),
])
def test_a_tiny_eval_set_is_warned_about(tok, tmp_path, n_eval, split, warned):
    rows = [qa(i) for i in range(100)]
    options = (dict(data=write_jsonl(tmp_path / "d.jsonl", rows), eval_fraction=0.1) if split else
               dict(data=write_jsonl(tmp_path / "d.jsonl", rows[:30]),
                    eval_data=write_jsonl(tmp_path / "e.jsonl", rows[:n_eval])))
    logs = []
    _, held_out = load_datasets(tok, cache_dir=str(tmp_path / "c"), log=logs.append, **options)
    assert len(held_out) == n_eval
    if warned is None:
        assert not any("warning" in line for line in logs), logs
    else:
        assert any(line.startswith(warned) for line in logs), logs


@pytest.mark.parametrize("name, content, message", [
    ("d.jsonl", '{"text": "ok"}\n{"text": "a", "text": "b"}\n', r"d\.jsonl: line 2 has an object with the key 'text' "
                                                               r"twice; give each key once"),
    ("d.json", '[{"messages": [{"role": "user", "content": "a", "role": "assistant"}]}]',
     r"d\.json: the file has an object with the key 'role' twice"),
])
def test_a_json_object_with_a_key_twice_is_refused(tmp_path, name, content, message):
    """Like a CSV column named twice: a JSON reader keeps the last value, and the row would train on it silently."""
    refused(tmp_path, name, content, message)
