"""Tokenizer: a thin wrapper over the `tokenizers` library plus the chat template.

Hugging Face model folders keep the vocabulary and merges in `tokenizer.json`
(read by `tokenizers.Tokenizer`) and the special-token names and the Jinja chat
template in `tokenizer_config.json`. This wrapper reads both, so the rest of
nanotune needs no transformers at run time.
"""
import json
import os
from dataclasses import dataclass
from functools import lru_cache

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

    @property
    def vocab_size(self):
        return self.tok.get_vocab_size(with_added_tokens=True)

    def encode(self, text, add_special_tokens=False):
        """Token ids of `text`. BOS is prepended only when asked and the model uses one."""
        ids = self.tok.encode(text, add_special_tokens=False).ids
        if add_special_tokens and self.add_bos and self.bos_id is not None:
            ids = [self.bos_id] + ids
        return ids

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


def load_tokenizer(path):
    """Load `tokenizer.json` (+ `tokenizer_config.json` if present) from a local model folder."""
    tj = os.path.join(path, "tokenizer.json")
    if not os.path.isfile(tj):
        raise FileNotFoundError(
            f"no tokenizer.json in {path!r}. nanotune reads the fast-tokenizer file that Hugging Face "
            "model folders ship; save one with transformers' tokenizer.save_pretrained(path)")
    tok = _HFTokenizer.from_file(tj)
    cfg = {}
    tc = os.path.join(path, "tokenizer_config.json")
    if os.path.isfile(tc):
        with open(tc) as f:
            cfg = json.load(f)
    special = {}
    stm = os.path.join(path, "special_tokens_map.json")
    if os.path.isfile(stm):
        with open(stm) as f:
            special = json.load(f)

    def tid(key):
        text = _token_text(cfg.get(key)) or _token_text(special.get(key))
        return None if text is None else tok.token_to_id(text)

    template = cfg.get("chat_template")
    ct = os.path.join(path, "chat_template.jinja")
    if template is None and os.path.isfile(ct):
        with open(ct) as f:
            template = f.read()
    if isinstance(template, list):  # several named templates: take the default one
        template = next((t["template"] for t in template if t.get("name") == "default"), template[0]["template"])
    bos = tid("bos_token")
    # Llama/Gemma tokenizers prepend BOS; Qwen's do not (its bos_token is null).
    add_bos = cfg.get("add_bos_token", bos is not None)
    return Tokenizer(tok=tok, bos_id=bos, eos_id=tid("eos_token"), pad_id=tid("pad_token"),
                     chat_template=template, add_bos=bool(add_bos))
