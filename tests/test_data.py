"""Tests for the data package: formats and loss masks, packing, loading errors, batching; damaged tokenizer files
(the builtin dataset: tests/test_builtin_dataset.py)."""
import json
import re

import huggingface_hub
import pytest
import torch

from data import (
    IGNORE_INDEX,
    PAD_PIECE,
    Batches,
    answer_accuracy,
    builtin_dataset,
    encode_example,
    eval_batches,
    load_examples,
    num_targets,
    pack,
    pad_batch,
)
from model.tokenizer import load_tokenizer
from tests.tiny_tokenizer import CHATML_NO_BOS, make_test_tokenizer

CHAT = {"messages": [{"role": "system", "content": "Be brief."}, {"role": "user", "content": "hi"},
                     {"role": "assistant", "content": "hello"}, {"role": "user", "content": "2+2?"},
                     {"role": "assistant", "content": "4"}]}
ALPACA = {"instruction": "Add the two numbers.", "input": "2 + 3", "output": "5"}


@pytest.fixture(scope="module")
def make_tok(tmp_path_factory):
    def make(**options):
        return load_tokenizer(make_test_tokenizer(tmp_path_factory.mktemp("tok"), **options))
    return make


@pytest.fixture(scope="module")
def chatml(make_tok):  # ChatML template that writes BOS itself; EOS '</s>' is not the end-of-turn marker
    return make_tok()


@pytest.fixture(scope="module")
def base(make_tok):  # no chat template: a base model
    return make_tok(chat_template=None)


@pytest.fixture(scope="module")
def qwen_like(make_tok):  # no BOS; EOS is ChatML's '<|im_end|>', which the template writes
    return make_tok(chat_template=CHATML_NO_BOS, bos_token=None, eos_token="<|im_end|>", add_bos_token=False)


def target_runs(tok, ids, mask):
    """The text of each maximal run of target tokens."""
    runs, run = [], []
    for i, m in zip(ids, mask):
        if m:
            run.append(i)
        elif run:
            runs.append(run)
            run = []
    runs += [run] if run else []
    return [tok.decode(r, skip_special_tokens=False) for r in runs]


def text_of(tok, ids):
    return tok.decode(ids, skip_special_tokens=False)

# ----------------------------------------------------------------------------- formats and masks


def test_text_is_bos_text_eos_all_trained(chatml):
    ids, mask = encode_example({"text": "hello world"}, chatml)
    assert ids == [chatml.bos_id] + chatml.encode("hello world") + [chatml.eos_id]
    assert mask == [False] + [True] * (len(ids) - 1)  # BOS is context; nothing comes before it to predict it


def test_text_without_bos_when_the_model_has_none(qwen_like):
    ids, _ = encode_example({"text": "hello"}, qwen_like)
    assert ids == qwen_like.encode("hello") + [qwen_like.eos_id]


def test_text_already_ending_in_eos_gets_no_second_one(chatml):
    ids, _ = encode_example({"text": "hello</s>\n"}, chatml)
    assert ids.count(chatml.eos_id) == 1


@pytest.mark.parametrize("example, prompt", [
    (ALPACA, "### Instruction:\nAdd the two numbers.\n\n### Input:\n2 + 3\n\n### Response:\n"),
    ({"instruction": "Say five.", "output": "5"}, "### Instruction:\nSay five.\n\n### Response:\n"),
    ({"instruction": "Say five.", "input": "", "output": "5"}, "### Instruction:\nSay five.\n\n### Response:\n"),
])
def test_alpaca_without_chat_template_uses_the_plain_prompt(base, example, prompt):
    ids, mask = encode_example(example, base)
    assert text_of(base, ids) == "<s>" + prompt + "5</s>"
    assert target_runs(base, ids, mask) == ["5</s>"]


def test_alpaca_with_chat_template_is_a_user_and_an_assistant_message(chatml):
    ids, mask = encode_example(ALPACA, chatml)
    assert text_of(chatml, ids) == ("<s><|im_start|>user\nAdd the two numbers.\n\n2 + 3<|im_end|>\n"
                                    "<|im_start|>assistant\n5<|im_end|>\n</s>")
    assert target_runs(chatml, ids, mask) == ["5<|im_end|>\n</s>"]


def test_messages_train_only_assistant_turns(chatml):
    ids, mask = encode_example(CHAT, chatml)
    assert text_of(chatml, ids) == chatml.apply_chat_template(CHAT["messages"]) + "</s>"
    assert target_runs(chatml, ids, mask) == ["hello<|im_end|>\n", "4<|im_end|>\n</s>"]


def test_no_double_bos_when_the_template_writes_it(chatml):
    for example in (CHAT, ALPACA, {"text": "<s>hi"}):
        ids, _ = encode_example(example, chatml)
        assert ids[0] == chatml.bos_id and ids.count(chatml.bos_id) == 1


def test_eos_written_by_the_template_is_trained_and_not_repeated(qwen_like):
    ids, mask = encode_example(CHAT, qwen_like)
    assert text_of(qwen_like, ids) == qwen_like.apply_chat_template(CHAT["messages"])  # nothing appended
    # The newline ChatML writes after EOS is context for the next turn, never generated.
    assert target_runs(qwen_like, ids, mask) == ["hello<|im_end|>", "4<|im_end|>"]


def test_train_on_inputs_trains_every_token(chatml):
    _, mask = encode_example(CHAT, chatml, train_on_inputs=True)
    assert all(mask)


@pytest.mark.parametrize("example", [{"text": "hello"}, ALPACA, CHAT])
def test_eos_is_a_target_even_when_pad_is_eos(make_tok, example):
    tok = make_tok(pad_token="</s>")
    assert tok.pad_id == tok.eos_id
    encoded = [encode_example(example, tok), encode_example({"text": "a much longer text than the other"}, tok)]
    for batch in (pad_batch(encoded, pad_id=tok.pad_id), pack(encoded, 64, pad_id=tok.pad_id)[0]):
        n = len(encoded[0][0])  # the first example's EOS is its last token, predicted at n - 2
        assert batch["input_ids"][0, n - 1] == tok.eos_id and batch["targets"][0, n - 2] == tok.eos_id
        assert num_targets(batch) == sum(sum(mask[1:]) for _, mask in encoded)


def test_template_that_rewrites_earlier_turns_trains_its_final_render(make_tok):
    """A template whose rendering of a chat is not an extension of its rendering of the chat's start
    (it marks the last message) is read from its one full rendering."""
    tok = make_tok(chat_template="{% for m in messages %}{% if loop.last %}[last]{% endif %}{{ m['content'] }}"
                                 "{% endfor %}")
    ids, mask = encode_example(CHAT, tok)
    assert text_of(tok, ids) == "<s>Be brief.hihello2+2?[last]4</s>"
    assert target_runs(tok, ids, mask) == ["hello", "4</s>"]


def test_messages_need_a_chat_template(base):
    with pytest.raises(ValueError, match="no chat template"):
        encode_example(CHAT, base)

# ----------------------------------------------------------------------------- packing and padding


def encoded_mix(tok, n=12):
    """Examples of every format and of varied lengths."""
    examples = builtin_dataset("eval")[:n] + [{"text": "hello " * 7}, CHAT, ALPACA]
    return [encode_example(ex, tok) for ex in examples]


def documents(batch):
    """[(input_ids, targets)] of every document that has targets, row by row."""
    docs = []
    for ids, tgt, doc in zip(batch["input_ids"].tolist(), batch["targets"].tolist(), batch["doc_ids"].tolist()):
        for d in sorted(set(doc)):
            span = [t for t in range(len(doc)) if doc[t] == d]
            if any(tgt[t] != IGNORE_INDEX for t in span):
                docs.append((tuple(ids[t] for t in span), tuple(tgt[t] for t in span)))
    return docs


def expected_targets(ids, mask):
    return tuple(ids[t + 1] if t + 1 < len(ids) and mask[t + 1] else IGNORE_INDEX for t in range(len(ids)))


@pytest.mark.parametrize("max_len", [40, 64, 97])
def test_pack_layout(chatml, max_len):
    encoded = encoded_mix(chatml)
    rows, n_truncated = pack(encoded, max_len, pad_id=chatml.pad_id)
    assert n_truncated == sum(len(ids) > max_len for ids, _ in encoded)
    assert all(v.shape == rows["input_ids"].shape and v.dtype == torch.long for v in rows.values())
    assert rows["input_ids"].shape[1] == max_len
    truncated = [(ids[:max_len], mask[:max_len]) for ids, mask in encoded]
    piece = max(PAD_PIECE, max(len(ids) for ids, _ in truncated))
    next_doc = 0  # examples are packed in order
    for ids, tgt, pos, doc in zip(*(rows[k].tolist() for k in ("input_ids", "targets", "position_ids", "doc_ids"))):
        assert doc[0] == 0 and all(b - a in (0, 1) for a, b in zip(doc, doc[1:]))  # 0, 1, 2, ... in order
        padding = False
        for d in range(doc[-1] + 1):
            span = [t for t in range(max_len) if doc[t] == d]
            assert [pos[t] for t in span] == list(range(len(span)))  # positions restart per document
            if next_doc < len(encoded) and [ids[t] for t in span] == truncated[next_doc][0]:
                # the last token's target is IGNORE_INDEX: nothing crosses into the next document
                assert not padding and tuple(tgt[t] for t in span) == expected_targets(*truncated[next_doc])
                next_doc += 1
            else:  # padding: the row's last documents, none longer than the longest example
                padding = True
                assert all(ids[t] == chatml.pad_id and tgt[t] == IGNORE_INDEX for t in span) and len(span) <= piece
    assert next_doc == len(encoded)


def test_pack_splits_long_padding_into_pieces():
    """The last row's padding, longer than any example, becomes documents no longer than the longest example
    (at least PAD_PIECE tokens), each with positions from 0 and no target; other rows' padding stays whole."""
    from data import PAD_PIECE
    n = PAD_PIECE + 6
    encoded = [([1] * n, [True] * n), ([2] * 24, [True] * 24), ([3] * 5, [True] * 5)]
    rows, _ = pack(encoded, n + 25, pad_id=0)  # row 0: n + 24 and 1 of padding (the 5 does not fit); row 1: 5
    assert rows["doc_ids"][0].tolist() == [0] * n + [1] * 24 + [2]
    assert rows["doc_ids"][1].tolist() == [0] * 5 + [1] * n + [2] * 20  # n + 20 of padding: two pieces
    assert rows["position_ids"][1].tolist() == list(range(5)) + list(range(n)) + list(range(20))
    assert (rows["targets"][1, 5:] == IGNORE_INDEX).all()
    small = [([1] * 3, [True] * 3)]
    rows, _ = pack(small, PAD_PIECE + 10, pad_id=0)  # pieces are never shorter than PAD_PIECE
    assert rows["doc_ids"][0].tolist() == [0] * 3 + [1] * PAD_PIECE + [2] * 7


def test_pack_fills_rows_greedily_in_order():
    encoded = [([1] * n, [True] * n) for n in (3, 4, 2, 5, 1, 2)]
    rows, _ = pack(encoded, 8, pad_id=0)
    assert rows["doc_ids"].tolist() == [[0, 0, 0, 1, 1, 1, 1, 2],   # 3 + 4 + padding: the 2 does not fit
                                        [0, 0, 1, 1, 1, 1, 1, 2],   # 2 + 5 + 1: full
                                        [0, 0, 1, 1, 1, 1, 1, 1]]   # 2 + padding
    assert rows["position_ids"][2].tolist() == [0, 1, 0, 1, 2, 3, 4, 5]


def test_pack_truncates_long_examples_and_counts_them():
    encoded = [(list(range(1, 11)), [True] * 10), ([7] * 4, [True] * 4)]
    rows, n_truncated = pack(encoded, 6, pad_id=0)
    assert n_truncated == 1
    assert rows["input_ids"].tolist() == [[1, 2, 3, 4, 5, 6], [7, 7, 7, 7, 0, 0]]
    assert rows["targets"][0].tolist() == [2, 3, 4, 5, 6, IGNORE_INDEX]


@pytest.mark.parametrize("max_len", [48, 128])
def test_packed_and_padded_give_the_same_documents(chatml, max_len):
    encoded = encoded_mix(chatml)
    packed, _ = pack(encoded, max_len, pad_id=chatml.pad_id)
    padded = pad_batch(encoded, pad_id=chatml.pad_id, max_len=max_len)
    assert sorted(documents(packed)) == sorted(documents(padded))
    assert num_targets(packed) == num_targets(padded)


def test_pad_batch():
    encoded = [([5, 6, 7], [False, True, True]), ([8, 9], [True, True])]
    batch = pad_batch(encoded, pad_id=None)  # None pads with 0
    assert batch["input_ids"].tolist() == [[5, 6, 7], [8, 9, 0]]
    assert batch["targets"].tolist() == [[6, 7, IGNORE_INDEX], [9, IGNORE_INDEX, IGNORE_INDEX]]
    assert batch["doc_ids"].tolist() == [[0, 0, 0], [0, 0, 1]]
    fixed = pad_batch(encoded, pad_id=3, max_len=5)
    assert fixed["input_ids"].tolist() == [[5, 6, 7, 3, 3], [8, 9, 3, 3, 3]]
    assert fixed["doc_ids"].tolist() == [[0, 0, 0, 1, 1], [0, 0, 1, 1, 1]]

# ----------------------------------------------------------------------------- Batches


def synthetic(n=23):
    """Example i starts with token i + 1 (so rows can be told apart) and has 2 to 6 tokens."""
    return [([i + 1] + [50] * (1 + i % 5), [True] * (2 + i % 5)) for i in range(n)]


def first_tokens(batch):
    return [int(x) for x in batch["input_ids"][:, 0]]


def assert_same_batches(a, b):
    assert len(a) == len(b)
    for x, y in zip(a, b):
        assert x.keys() == y.keys() and all(torch.equal(x[k], y[k]) for k in x)


@pytest.mark.parametrize("packing", [True, False])
@pytest.mark.parametrize("k", [0, 3, 7, 12])
def test_resume_gives_identical_remaining_batches(packing, k):
    options = dict(batch_size=2, max_len=8, pad_id=0, packing=packing, seed=5)
    batches = Batches(synthetic(), **options)
    first = [next(batches) for _ in range(k)]
    state = json.loads(json.dumps(batches.state_dict()))  # survives a checkpoint round trip
    rest = [next(batches) for _ in range(20)]  # runs over several epochs
    resumed = Batches(synthetic(), **options)
    resumed.load_state_dict(state)
    assert_same_batches([next(resumed) for _ in range(20)], rest)
    fresh = Batches(synthetic(), **options)
    assert_same_batches([next(fresh) for _ in range(k + 20)], first + rest)


@pytest.mark.parametrize("packing", [True, False])
def test_peek_gives_the_next_batch_and_stays(packing):
    """peek() returns the batch that next() returns, also across an epoch's end, and leaves the position."""
    batches = Batches(synthetic(), batch_size=2, max_len=8, pad_id=0, packing=packing, seed=5)
    fresh = Batches(synthetic(), batch_size=2, max_len=8, pad_id=0, packing=packing, seed=5)
    for _ in range(len(batches) + 2):
        state = batches.state_dict()
        peeked = batches.peek()
        assert batches.state_dict() == state
        assert_same_batches([peeked, next(batches)], [next(fresh)] * 2)


def test_shuffle_is_deterministic_and_differs_by_seed_and_epoch():
    def epochs(seed, n=2):
        batches = Batches(synthetic(), batch_size=1, max_len=8, pad_id=0, packing=False, seed=seed)
        return [[first_tokens(next(batches))[0] for _ in range(len(batches))] for _ in range(n)]
    e0, e1 = epochs(seed=1)
    assert sorted(e0) == sorted(e1) == list(range(1, 24))  # every example once per epoch
    assert e0 != e1 and epochs(seed=1) == [e0, e1] and epochs(seed=2)[0] != e0


@pytest.mark.parametrize("packing", [True, False])
@pytest.mark.parametrize("world_size", [2, 3, 4])
def test_ranks_get_disjoint_shards_of_equal_length(packing, world_size):
    n_rows = len(pack(synthetic(), 8, pad_id=0)[0]["input_ids"]) if packing else 23
    seen = []
    for rank in range(world_size):
        batches = Batches(synthetic(), batch_size=2, max_len=8, pad_id=0, packing=packing, seed=0,
                          rank=rank, world_size=world_size)
        assert len(batches) == -(-(n_rows // world_size) // 2)  # the same on every rank
        seen += [t for _ in range(len(batches)) for t in first_tokens(next(batches))]
    assert len(seen) == len(set(seen)) == n_rows - n_rows % world_size


def test_resume_with_other_data_is_refused():
    state = Batches(synthetic(), batch_size=2, max_len=8, pad_id=0).state_dict()
    with pytest.raises(ValueError, match="same dataset, max_len"):
        Batches(synthetic(), batch_size=2, max_len=16, pad_id=0).load_state_dict(state)


def test_too_few_rows_for_the_ranks():
    with pytest.raises(ValueError, match="fewer than world_size=4"):
        Batches(synthetic(3), batch_size=1, max_len=8, pad_id=0, packing=False, world_size=4)


@pytest.mark.parametrize("packing", [True, False])
def test_eval_batches_cover_everything_in_order(packing):
    batches = eval_batches(synthetic(), batch_size=4, max_len=8, pad_id=0, packing=packing)
    assert [d for b in batches for d in documents(b)] == documents(pad_batch(synthetic(), pad_id=0))
    assert sum(num_targets(b) for b in batches) == sum(len(ids) - 1 for ids, _ in synthetic())

# ----------------------------------------------------------------------------- loading and its errors


def write(tmp_path, name, content):
    path = tmp_path / name
    path.write_text(content, encoding="utf-8")
    return str(path)


@pytest.mark.parametrize("name, content, error, message", [
    ("missing.jsonl", None, FileNotFoundError, "no such file.*user/repo:path.*builtin"),
    ("empty.jsonl", "", ValueError, "is empty"),
    ("blank.json", "  \n", ValueError, "is empty"),
    ("nothing.json", "[]", ValueError, "is empty"),
    ("broken.jsonl", '{"text": "a"}\n{"text": \n', ValueError, "line 2 is not valid JSON"),
    ("broken.json", '[{"text": "a"},\n oops]', ValueError, "not valid JSON at line 2"),
    ("lines.json", '{"text": "a"}\n{"text": "b"}\n', ValueError, "name it .jsonl"),
    ("table.xlsx", "text\nhello\n", ValueError, "unsupported file type '.xlsx'.*.jsonl"),
    ("scalar.jsonl", '{"text": "a"}\n["a"]\n', ValueError, "line 2: expected a JSON object"),
    ("dict.json", '{"rows": []}', ValueError, "expected a JSON list"),
    ("fields.jsonl", '{"question": "a", "answer": "b"}', ValueError,
     r"line 1: no known fields \(found \['answer', 'question'\]\).*'text'.*'instruction'.*'output'.*'messages'"),
    ("noanswer.jsonl", '{"instruction": "a"}', ValueError, "no known fields"),
    ("roleless.jsonl", '{"messages": [{"content": "hi"}]}', ValueError,
     r"messages\[0\] needs string 'role' and 'content'"),
    ("sharegpt.jsonl", '{"conversations": [{"from": "human", "value": "hi"}]}', ValueError,
     r"'conversations' has no message with role 'assistant'"),
    ("badfrom.jsonl", '{"conversations": [{"from": "bot", "value": "hi"}]}', ValueError,
     r"conversations\[0\] is from 'bot'; ShareGPT's roles are human, gpt and system"),
    ("mixed.jsonl", '{"prompt": "a", "completion": [{"role": "assistant", "content": "b"}]}', ValueError,
     "'prompt' and 'completion' must both be strings, or both lists of messages"),
    ("noassistant.json", '[{"messages": [{"role": "user", "content": "hi"}]}]', ValueError,
     re.escape("item 0: 'messages' has no message with role 'assistant'")),
    ("badtype.jsonl", '{"text": 5}', ValueError, "'text' must be a string"),
    ("badoutput.jsonl", '{"instruction": "a", "output": 0}', ValueError, "'output' must be strings"),
])
def test_bad_input_is_reported(tmp_path, name, content, error, message):
    path = str(tmp_path / name) if content is None else write(tmp_path, name, content)
    with pytest.raises(error, match=message):
        load_examples(path)


def test_loads_jsonl_json_and_data_wrapper(tmp_path):
    rows = [{"text": "a\u2028b"}, ALPACA, CHAT]
    jsonl = "\ufeff" + "\n".join(json.dumps(r, ensure_ascii=False) for r in rows) + "\n\n"  # BOM, blank lines
    assert load_examples(write(tmp_path, "a.jsonl", jsonl)) == rows
    assert load_examples(write(tmp_path, "b.json", json.dumps(rows))) == rows
    assert load_examples(write(tmp_path, "c.json", json.dumps({"data": rows}))) == rows


def test_hub_spec_fetches_the_dataset_file(tmp_path, monkeypatch):
    local = write(tmp_path, "train.jsonl", '{"text": "hi"}\n')
    calls = []

    def fake_download(repo_id, filename, *, repo_type=None, revision=None):
        calls.append((repo_id, filename, repo_type, revision))
        return local
    monkeypatch.setattr(huggingface_hub, "hf_hub_download", fake_download)
    assert load_examples("someone/some-data:sub/train.jsonl") == [{"text": "hi"}]
    assert load_examples("someone/some-data@v2:train.jsonl") == [{"text": "hi"}]
    assert calls == [("someone/some-data", "sub/train.jsonl", "dataset", None),
                     ("someone/some-data", "train.jsonl", "dataset", "v2")]


def test_hub_failure_names_repo_and_file(monkeypatch):
    def offline(*args, **kwargs):
        raise OSError("network unreachable")
    monkeypatch.setattr(huggingface_hub, "hf_hub_download", offline)
    with pytest.raises(FileNotFoundError, match="could not fetch 'x.jsonl' from the hub dataset 'a/b'") as e:
        load_examples("a/b:x.jsonl")
    assert "`hf auth login`" in str(e.value)  # the hub's CLI is `hf`

# ----------------------------------------------------------------------------- answer_accuracy


def perfect_logits(batch, vocab=64, seed=0):
    """Random logits whose argmax is the target wherever there is one."""
    logits = torch.randn(*batch["targets"].shape, vocab, generator=torch.Generator().manual_seed(seed))
    is_target = batch["targets"] != IGNORE_INDEX
    logits[is_target, batch["targets"][is_target]] = 100.0
    return logits


@pytest.mark.parametrize("packing", [True, False])
def test_answer_accuracy(packing):
    encoded = [([1, 2, 3, 4, 5][:n], [False] * (n - 2) + [True, True]) for n in (2, 3, 4, 5, 5, 3)]
    batch = pack(encoded, 8, pad_id=0)[0] if packing else pad_batch(encoded, pad_id=0)
    logits = perfect_logits(batch)
    assert answer_accuracy(logits.argmax(-1) == batch["targets"], batch) == (6, 6)  # padding: no targets, not counted
    b, t = (batch["targets"] != IGNORE_INDEX).nonzero()[3].tolist()  # break one answer token
    logits[b, t, batch["targets"][b, t]] = -100.0
    assert answer_accuracy(logits.argmax(-1) == batch["targets"], batch) == (5, 6)
    not_target = (batch["targets"] == IGNORE_INDEX).nonzero()[0].tolist()  # non-targets do not count
    logits[not_target[0], not_target[1]] = 0.0
    assert answer_accuracy(logits.argmax(-1) == batch["targets"], batch) == (5, 6)

# ----------------------------------------------------------------------------- damaged tokenizer files


@pytest.mark.parametrize("damage, message", [
    (lambda d: (d / "tokenizer.json").write_text(""), r"tokenizer\.json is empty \(0 bytes\).*download it again"),
    (lambda d: (d / "tokenizer.json").write_text((d / "tokenizer.json").read_text()[:5000]),
     r"tokenizer\.json cannot be read \(.*\); it is cut short or damaged.*download it again"),
    (lambda d: (d / "tokenizer_config.json").write_text('{"bos_token": "<s>",'),
     r"tokenizer_config\.json is not valid JSON .*download the model's tokenizer files again"),
    (lambda d: (d / "tokenizer_config.json").write_text('["<s>"]'),
     r"tokenizer_config\.json should hold a JSON object"),
    (lambda d: (d / "special_tokens_map.json").write_bytes(b'{"bos_token": "\xff"}'),
     r"special_tokens_map\.json is not valid JSON"),
])
def test_damaged_tokenizer_files_are_named(tmp_path, damage, message):
    folder = tmp_path / "tok"
    make_test_tokenizer(folder)
    damage(folder)
    with pytest.raises(ValueError, match=message):
        load_tokenizer(str(folder))
