"""Formats: how a row becomes text, and the text tokens with a loss mask (`encode_example`).

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
SFTTrainer reads them.
"""
import contextlib
import itertools
import json
import re
import signal
import string
import threading
from functools import lru_cache

import numpy as np

KNOWN_FORMATS = ("'text'; 'prompt' + 'completion'; 'instruction' + 'output' (and optional 'input'); "
                 "'messages' or 'conversations' (a list of {\"role\": ..., \"content\": ...}, or ShareGPT's "
                 "{\"from\": ..., \"value\": ...})")
FIELDS = ("text", "prompt", "completion", "instruction", "input", "output", "messages", "conversations")

# The plain prompt for Alpaca examples when the model has no chat template (a base model).
ALPACA_PROMPT = "### Instruction:\n{instruction}\n\n### Input:\n{input}\n\n### Response:\n"
ALPACA_PROMPT_NO_INPUT = "### Instruction:\n{instruction}\n\n### Response:\n"

CHAT_ROLES = ("system", "user", "assistant")  # every template takes these (or refuses one, as Gemma's does system)
SHAREGPT_ROLES = {"human": "user", "gpt": "assistant", "system": "system",
                  "user": "user", "assistant": "assistant", "tool": "tool"}
RENDER_SECONDS = 5.0  # the longest one chat may take to render (real templates take milliseconds)


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

# ----------------------------------------------------------------------------- held-out prompts, --chat-template


def _last_trained(trained):
    """The index of a chat's last trained (assistant) message: the answer that held-out prompts stop before."""
    return max(i for i, t in enumerate(trained) if t)


def prompt_and_answer(example, tokenizer, system_prompt=None):
    """(the prompt, the row's answer) as a preference pair holds them (data/preference.py): with a chat template,
    the messages before the last trained one and that message's content; without, the text before the answer
    and the answer. None for a row with no prompt before its answer, or with targets inside its prompt."""
    layout = _layout(example, tokenizer, system_prompt)
    if layout[0] == "chat":
        messages, last = layout[1], _last_trained(layout[2])
        return messages[:last], messages[last]["content"]
    pieces = layout[1]  # [(text, is_data, is_target)]: only the last piece is the answer, or there is no prompt
    if len(pieces) < 2 or any(target for _, _, target in pieces[:-1]):
        return None
    return "".join(text for text, _, _ in pieces[:-1]), pieces[-1][0]


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
        messages, last = layout[1], _last_trained(layout[2])
        question = next((m["content"] for m in reversed(messages[:last]) if m["role"] == "user"), "")
    else:
        prompt = [(text, is_data) for text, is_data, is_target in layout[1] if not is_target]
        question = "\n\n".join(text for text, is_data in prompt if is_data) or "".join(text for text, _ in prompt)
    answer = tokenizer.decode([t for t in ids[start:end] if t != tokenizer.eos_id]).strip()
    return question, ids[:start], answer


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
