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
