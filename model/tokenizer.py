"""Tokenizer: a thin wrapper over the `tokenizers` library plus the chat template.

Hugging Face model folders keep the vocabulary and merges in `tokenizer.json`
(read by `tokenizers.Tokenizer`) and the special-token names and the Jinja chat
template in `tokenizer_config.json`. This wrapper reads both, so the rest of
nanotune needs no transformers at run time.
"""
import dataclasses
import hashlib
import json
import os
from dataclasses import dataclass
from functools import cached_property, lru_cache

import jinja2
from jinja2.sandbox import ImmutableSandboxedEnvironment
from tokenizers import Tokenizer as _HFTokenizer


def _token_text(tok):
    # tokenizer_config.json stores special tokens either as plain strings or as
    # AddedToken dicts ({"content": "<s>", "lstrip": false, ...}).
    if tok is None or isinstance(tok, str):
        return tok
    return tok.get("content")


@dataclass
class Tokenizer:
    tok: _HFTokenizer
    bos_id: int | None
    eos_id: int | None
    pad_id: int | None
    chat_template: str | None
    add_bos: bool  # whether the model's tokenizer prepends BOS when encoding
    add_eos: bool = False  # whether it appends EOS (recorded for GGUF export; training adds EOS itself)

    @property
    def vocab_size(self):
        return self.tok.get_vocab_size(with_added_tokens=True)

    def encode(self, text, add_special_tokens=False):
        """Token ids of `text`. BOS is prepended only when asked and the model uses one."""
        ids = self.tok.encode(text, add_special_tokens=False).ids
        if add_special_tokens and self.add_bos and self.bos_id is not None:
            ids = [self.bos_id] + ids
        return ids

    def encode_offsets(self, text, *, parse_special=True):
        """(ids, offsets): the tokens of `text` and each one's (start, end) character span in it.
        parse_special=False encodes text that spells a special token ('</s>', '<|im_end|>') as
        ordinary characters, for text that comes from data rather than from a template. Added
        tokens that are not special (Qwen's '<think>') are matched either way."""
        enc = (self.tok if parse_special else self._tok_plain).encode(text, add_special_tokens=False)
        return enc.ids, enc.offsets

    @cached_property
    def _tok_plain(self):
        tok = _HFTokenizer.from_str(self.tok.to_str())
        tok.encode_special_tokens = True
        return tok

    @cached_property
    def special_tokens(self):
        """{id: text} of the special (control) tokens: BOS, EOS, the chat markers."""
        return {i: t.content for i, t in self.tok.get_added_tokens_decoder().items() if t.special}

    def fingerprint(self):
        """A hash of everything that decides how text is tokenized (vocabulary, merges, normalizer,
        special tokens, BOS/EOS use), for caches of tokenized data. The chat template is not in it."""
        state = json.dumps([self.tok.to_str(), self.bos_id, self.eos_id, self.pad_id, self.add_bos])
        return hashlib.sha256(state.encode()).hexdigest()

    def with_chat_template(self, template, source="the chat template"):
        """A copy of this tokenizer that renders chats with `template` (Jinja text) instead; a
        template that does not compile is a ValueError naming `source`."""
        try:
            _compile(template)
        except jinja2.TemplateSyntaxError as e:
            raise ValueError(f"{source} is not a valid Jinja template: {e.message} (line {e.lineno})") from None
        return dataclasses.replace(self, chat_template=template)

    def decode(self, ids, skip_special_tokens=True):
        return self.tok.decode(list(ids), skip_special_tokens=skip_special_tokens)

    def token_to_id(self, text):
        return self.tok.token_to_id(text)

    def id_to_token(self, i):
        return self.tok.id_to_token(i)

    def apply_chat_template(self, messages, add_generation_prompt=False):
        """Render `messages` ([{"role", "content"}]) with the model's Jinja chat template."""
        if self.chat_template is None:
            raise ValueError(
                "this tokenizer has no chat template (no 'chat_template' in tokenizer_config.json); "
                "use a dataset with 'text' or 'instruction'/'output' fields, or a chat model")
        return _render(self.chat_template, messages, add_generation_prompt,
                       bos_token=self._text(self.bos_id), eos_token=self._text(self.eos_id))

    def _text(self, i):
        return "" if i is None else self.tok.id_to_token(i)


def _raise(msg):
    raise jinja2.exceptions.TemplateError(msg)


@lru_cache(maxsize=8)
def _compile(template):
    # Compiling a template costs ~3 ms; a dataset renders thousands of examples with one template.
    env = ImmutableSandboxedEnvironment(trim_blocks=True, lstrip_blocks=True,
                                        extensions=["jinja2.ext.loopcontrols"])
    env.globals["raise_exception"] = _raise
    env.filters["tojson"] = lambda x, indent=None, **kw: json.dumps(x, indent=indent, ensure_ascii=False)
    return env.from_string(template)


def _render(template, messages, add_generation_prompt, **special):
    return _compile(template).render(messages=messages, add_generation_prompt=add_generation_prompt, **special)


def _read_json(path):
    """The JSON object in `path`, or {} when there is no such file; a damaged file is a ValueError naming it."""
    if not os.path.isfile(path):
        return {}
    try:
        with open(path, encoding="utf-8") as f:
            value = json.load(f)
    except (json.JSONDecodeError, UnicodeDecodeError) as e:
        raise ValueError(f"{path} is not valid JSON ({e}); the file is damaged: download the model's "
                         "tokenizer files again") from None
    if not isinstance(value, dict):
        raise ValueError(f"{path} should hold a JSON object, not a {type(value).__name__}; download it again")
    return value


def post_processor_specials(tok: _HFTokenizer) -> tuple[list[int], list[int]]:
    """(ids before, ids after) the text that tokenizer.json's post-processor adds to one sequence:
    what `encode(text, add_special_tokens=True)` really wraps it in (e.g. ([1], []) for Llama's BOS)."""
    def walk(proc):
        if proc is None:
            return [], []
        if proc["type"] == "Sequence":
            parts = [walk(p) for p in proc["processors"]]
            return [i for b, _ in parts for i in b], [i for _, a in parts for i in a]
        if proc["type"] == "TemplateProcessing":
            ids = {name: t["ids"] for name, t in proc.get("special_tokens", {}).items()}
            items = [next(iter(item.items())) for item in proc["single"]]
            cut = next((k for k, (kind, _) in enumerate(items) if kind == "Sequence"), len(items))
            return ([i for kind, v in items[:cut] if kind == "SpecialToken" for i in ids[v["id"]]],
                    [i for kind, v in items[cut:] if kind == "SpecialToken" for i in ids[v["id"]]])
        if proc["type"] in ("BertProcessing", "RobertaProcessing"):
            return [proc["cls"][1]], [proc["sep"][1]]
        return [], []  # ByteLevel: offsets only
    return walk(json.loads(tok.to_str()).get("post_processor"))


def load_tokenizer(path):
    """Load `tokenizer.json` (+ `tokenizer_config.json` if present) from a local model folder."""
    tj = os.path.join(path, "tokenizer.json")
    if not os.path.isfile(tj):
        raise FileNotFoundError(
            f"no tokenizer.json in {path!r}. nanotune reads the fast-tokenizer file that Hugging Face "
            "model folders ship; save one with transformers' tokenizer.save_pretrained(path)")
    if os.path.getsize(tj) == 0:
        raise ValueError(f"{tj} is empty (0 bytes), as an interrupted download leaves it: download it again")
    try:
        tok = _HFTokenizer.from_file(tj)
    except Exception as e:  # the tokenizers library raises a bare Exception for every parse error
        raise ValueError(f"{tj} cannot be read ({e}); it is cut short or damaged, as an interrupted "
                         "download leaves it: download it again") from None
    cfg = _read_json(os.path.join(path, "tokenizer_config.json"))
    special = _read_json(os.path.join(path, "special_tokens_map.json"))

    def tid(key):
        text = _token_text(cfg.get(key)) or _token_text(special.get(key))
        return None if text is None else tok.token_to_id(text)

    template = cfg.get("chat_template")
    ct = os.path.join(path, "chat_template.jinja")
    if template is None and os.path.isfile(ct):
        with open(ct) as f:
            template = f.read()
    if isinstance(template, list):  # several named templates: take the default one
        if not template or not all(isinstance(t, dict) and isinstance(t.get("name"), str)
                                   and isinstance(t.get("template"), str) for t in template):
            raise ValueError(f"{os.path.join(path, 'tokenizer_config.json')}: chat_template is a list, but not of "
                             '{"name": ..., "template": ...} objects; fix or remove it')
        template = next((t["template"] for t in template if t["name"] == "default"), template[0]["template"])
    elif template is not None and not isinstance(template, str):
        raise ValueError(f"{os.path.join(path, 'tokenizer_config.json')}: chat_template is a "
                         f"{type(template).__name__}; it must be Jinja text or a list of named templates")
    bos, eos = tid("bos_token"), tid("eos_token")
    # tokenizer_config.json's add_bos_token / add_eos_token when it has them (transformers' Llama and
    # Gemma tokenizers rebuild their post-processor from them), else what tokenizer.json's
    # post-processor does: Llama's prepends BOS, SmolLM2's and Qwen's add nothing. A tokenizer.json
    # without a post-processor leaves it to the tokenizer class, which for SentencePiece models
    # (the ones converted without one) prepends BOS.
    if json.loads(tok.to_str()).get("post_processor") is None:
        before, after = [bos], []
    else:
        before, after = post_processor_specials(tok)
    add_bos = cfg.get("add_bos_token", bos is not None and bos in before)
    add_eos = cfg.get("add_eos_token", eos is not None and eos in after)
    return Tokenizer(tok=tok, bos_id=bos, eos_id=eos, pad_id=tid("pad_token"),
                     chat_template=template, add_bos=bool(add_bos), add_eos=bool(add_eos))
