"""Tests for the builtin dataset (data.builtin_dataset): deterministic, disjoint splits, every task in
both, and every answer right, recomputed from its question."""
import collections
import hashlib
import json
import re

import pytest

import data
from data import builtin_dataset, load_examples

BUILTIN_SHA256 = "2066cc53b50f8971e4b893f8f9b93155f7f3210706cf692852a28000b53ce364"

# Each unit's size in its quantity's base unit, from the SI prefixes (and 100 cents to the dollar).
UNIT_SIZE = {"kilometers": ("length", 1000), "meters": ("length", 1), "centimeters": ("length", 1e-2),
             "millimeters": ("length", 1e-3), "kilograms": ("mass", 1000), "grams": ("mass", 1),
             "liters": ("volume", 1), "milliliters": ("volume", 1e-3), "dollars": ("money", 1),
             "cents": ("money", 1e-2)}


def solve(ex):
    """(task, answer): which task asks the example's question, and its answer worked out here."""
    q, x = ex["instruction"], ex["input"]
    if m := re.fullmatch(r"What number comes after (\d+)\?", q):
        return "next", str(int(m[1]) + 1)
    if m := re.fullmatch(r"What number comes before (\d+)\?", q):
        return "previous", str(int(m[1]) - 1)
    if m := re.fullmatch(r"What is the last digit of (\d+)\?", q):
        return "last digit", m[1][-1]
    if m := re.fullmatch(r"Which is larger, (\d+) or (\d+)\?", q):
        a, b = int(m[1]), int(m[2])
        assert a != b, q
        return "larger", str(max(a, b))
    if q in ("What is the first word in the list?", "What is the last word in the list?"):
        words = x.split(", ")
        assert 3 <= len(words) <= 5 and all(w.isalpha() and w.islower() for w in words), x
        return ("first word", words[0]) if "first" in q else ("last word", words[-1])
    if m := re.fullmatch(r"How many (\w+) are in (\d+) (\w+)\?", q):
        (small_kind, small), (big_kind, big) = UNIT_SIZE[m[1]], UNIT_SIZE[m[3]]
        assert small_kind == big_kind and big > small, q
        return "convert", str(round(int(m[2]) * big / small))
    if m := re.fullmatch(r"What is (\d+) times 10\?", q):
        return "times ten", m[1] + "0"
    raise AssertionError(f"no task asks {q!r}")


@pytest.mark.parametrize("split", ["train", "eval"])
def test_every_answer_is_right(split):
    for ex in builtin_dataset(split):
        task, answer = solve(ex)
        assert ex["output"] == answer, (task, ex)
        assert ex["input"] == "" or task in ("first word", "last word"), ex
        assert " " not in answer and len(answer) <= 8, ex  # short, one exact token sequence


def test_a_wrong_answer_is_caught():
    """solve works each answer out from the question alone, so a changed answer never matches it."""
    for ex in builtin_dataset("eval")[:len(data._TASKS)]:
        for wrong in (ex["output"] + "0", ex["output"][:-1] or "x"):
            assert solve(dict(ex, output=wrong))[1] != wrong, ex


def test_tasks_take_turns_in_both_splits():
    tasks = {"next", "previous", "last digit", "larger", "first word", "last word", "convert", "times ten"}
    for split, n in (("eval", 200), ("train", 2000)):
        names = [solve(ex)[0] for ex in builtin_dataset(split)]
        assert collections.Counter(names) == {t: n // len(tasks) for t in tasks}, split
        # Any window of one round holds every task, so a few eval batches already cover them all.
        assert set(names[:len(tasks)]) == tasks


def test_splits_have_the_sizes_and_are_disjoint():
    train, held_out = load_examples("builtin"), load_examples("builtin:eval")
    assert (len(train), len(held_out)) == (2000, 200)
    assert train == builtin_dataset("train") and held_out == builtin_dataset("eval")

    def questions(split):
        return {(e["instruction"], e["input"]) for e in builtin_dataset(split)}

    assert len(questions("train")) == 2000 and len(questions("eval")) == 200  # no repeats within a split
    assert not questions("train") & questions("eval")
    with pytest.raises(ValueError, match="'train' and 'eval'"):
        builtin_dataset("test")


def test_is_deterministic():
    first = builtin_dataset("eval") + builtin_dataset("train")
    data._builtin_examples.cache_clear()  # generated again, not served from the cache
    assert builtin_dataset("eval") + builtin_dataset("train") == first
    first[0]["output"] = "changed"  # callers get their own copies
    assert builtin_dataset("eval")[0]["output"] != "changed"
    # A change of the generator, the tasks or Python's random stream changes this digest.
    digest = hashlib.sha256(json.dumps([builtin_dataset("eval"), builtin_dataset("train")]).encode()).hexdigest()
    assert digest == BUILTIN_SHA256, ("the builtin dataset changed; if on purpose, update BUILTIN_SHA256, "
                                      "and know that eval numbers from before are no longer comparable")


def test_a_task_that_runs_out_of_questions_is_named(monkeypatch):
    def coin(rng):
        return "Heads or tails?", "", "heads" if rng.random() < 0.5 else "tails"
    monkeypatch.setattr(data.builtin, "_TASKS", data._TASKS + (coin,))
    with pytest.raises(RuntimeError, match="coin has too few distinct questions"):
        data._builtin_examples.__wrapped__()  # past the cache, which holds the real dataset


def solve_arithmetic(ex):
    """(task, answer) of a builtin:arithmetic row, worked out from its question alone."""
    q = ex["instruction"].removesuffix(" Reply with just the number.")
    if m := re.fullmatch(r"What is (\d\d) ([+-]) (\d\d)\?", q):
        a, b = int(m[1]), int(m[3])
        return ("add", str(a + b)) if m[2] == "+" else ("subtract", str(a - b))
    if m := re.fullmatch(r"What is (\d\d) times (\d)\?", q):
        return "multiply", str(int(m[1]) * int(m[2]))
    if m := re.fullmatch(r"Which is the (largest|smallest) of ((?:\d+, )+)(\d+) and (\d+)\?", q):
        numbers = [int(n) for n in m[2].split(", ") if n] + [int(m[3]), int(m[4])]
        assert 3 <= len(numbers) <= 4 and len(set(numbers)) == len(numbers) and max(numbers) < 1000, q
        return m[1], str(max(numbers) if m[1] == "largest" else min(numbers))
    raise AssertionError(f"no arithmetic task asks {q!r}")


def test_arithmetic_answers_are_right_and_its_splits_disjoint():
    """builtin:arithmetic (and :train, :eval) holds 2000 + 200 rows of the five tasks in equal shares, every answer
    right, no question in both splits, the same rows on every call; the builtin dataset is not changed by it."""
    from data.arithmetic import _arithmetic_examples, arithmetic_dataset
    train, held_out = load_examples("builtin:arithmetic"), load_examples("builtin:arithmetic:eval")
    assert train == load_examples("builtin:arithmetic:train") == arithmetic_dataset("train")
    assert (len(train), len(held_out)) == (2000, 200)
    for split, rows in (("train", train), ("eval", held_out)):
        tasks = collections.Counter()
        for ex in rows:
            task, answer = solve_arithmetic(ex)
            assert ex["output"] == answer and ex["input"] == "", ex
            tasks[task] += 1
        assert tasks == {t: len(rows) // 5 for t in ("add", "subtract", "multiply", "largest", "smallest")}, split
    assert not {e["instruction"] for e in train} & {e["instruction"] for e in held_out}
    assert len({e["instruction"] for e in train}) == 2000
    _arithmetic_examples.cache_clear()
    assert arithmetic_dataset("train") == train
    assert load_examples("builtin") == builtin_dataset("train")


@pytest.mark.parametrize("spec, eval_spec", [("builtin", "builtin:eval"), ("builtin:train", "builtin:eval"),
                                             ("builtin:arithmetic", "builtin:arithmetic:eval"),
                                             ("builtin:arithmetic:train", "builtin:arithmetic:eval")])
def test_a_builtin_dataset_holds_out_its_own_eval_split(spec, eval_spec):
    from data.sources import builtin_eval_spec
    assert builtin_eval_spec(spec) == eval_spec


@pytest.mark.parametrize("spec", ["builtin:test", "builtin:arithmetic:test", "builtin:algebra"])
def test_an_unknown_builtin_dataset_names_the_known_ones(spec):
    with pytest.raises(ValueError, match="the embedded ones are builtin, builtin:eval, builtin:arithmetic, "
                                         "builtin:arithmetic:eval"):
        load_examples(spec)


def test_rl_and_sft_hold_out_builtin_arithmetic_eval(tmp_path):
    """--data builtin:arithmetic trains on its train split and holds out its own eval split, in RL's prompts as in
    SFT's examples, never the builtin dataset's."""
    from data.rollouts import load_prompts
    from model import load_tokenizer
    from tests.tiny_tokenizer import make_test_tokenizer
    tokenizer = load_tokenizer(make_test_tokenizer(tmp_path / "tok"))
    train, held_out = load_prompts(tokenizer, data="builtin:arithmetic", max_examples=10, log=lambda _: None)
    expected = load_examples("builtin:arithmetic:eval")
    assert [p.answer for p in held_out] == [e["output"] for e in expected]
    assert [p.answer for p in train] == [e["output"] for e in load_examples("builtin:arithmetic")[:10]]
    _, _, rows = data.load_datasets(tokenizer, data="builtin:arithmetic", max_examples=10, num_proc=1,
                                    cache_dir=str(tmp_path / "cache"), with_rows=True, log=lambda _: None)
    assert rows == expected
