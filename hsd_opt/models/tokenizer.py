"""The tokenizer of a model directory of ours (a converted GGUF file: the embedded model, ``--model PATH.gguf``),
read with the ``tokenizers`` library alone.

Importing transformers takes 0.7-1 s, and its tokenizer class about 0.3 s more to build: most of a short ``hsd
run``'s start-up after torch. :class:`DirectTokenizer` reads the directory's ``tokenizer.json`` (the Rust tokenizer
transformers itself runs), ``tokenizer_config.json`` (its special tokens) and chat template, and answers what the
runtime, the server and the grammar compiler ask of a tokenizer: encoding, decoding, vocabulary, special ids, chat
prompts. It renders a chat of plain ``{"role", "content"}`` messages with the template as transformers does (the
same sandboxed jinja2 environment, filters and variables) and encodes the text without adding special tokens.

Anything else (another attribute, a call with other arguments, messages with other fields) is answered by the
transformers tokenizer of the same directory, loaded on first need: so every caller gets transformers' answer,
from this class where it is the same (``tests/test_tokenizer.py`` compares the two on the shipped models). Only
directories whose ``tokenizer_config.json`` names a class in :data:`DIRECT_CLASSES` are read this way, and only
under transformers 5 (whose loading of those classes the tests compare).
"""

from __future__ import annotations

import json
from datetime import datetime
from pathlib import Path
from typing import Any, Callable

#: transformers' tokenizer classes whose Rust tokenizer, for a saved directory, is its ``tokenizer.json`` with
#: these changes (the normalizer a class sets whatever the file says): the classes of the models we convert
#: (SmolLM2: ``TokenizersBackend``; Qwen2.5: ``Qwen2Tokenizer``, which normalizes text to NFC). The tests compare
#: the two tokenizers' serialized forms.
DIRECT_CLASSES = {"TokenizersBackend": None, "Qwen2Tokenizer": "NFC"}
#: The special tokens transformers passes to a chat template as variables (those the config names).
SPECIAL_NAMES = ("bos_token", "eos_token", "unk_token", "sep_token", "pad_token", "cls_token", "mask_token")


class DirectTokenizer:
    """A saved tokenizer directory read with ``tokenizers``; see the module doc.

    Attributes:
        backend_tokenizer: the ``tokenizers.Tokenizer`` (what transformers' fast tokenizers call the same).
        chat_template: the chat template's jinja2 text, or None.
        special_tokens_map: ``{"eos_token": "<|im_end|>", ...}``, the config's special tokens by name.
        clean_up_tokenization_spaces: False (a directory asking for it is not read this way).
    """

    #: read by callers that would otherwise ask transformers' own objects (the grammar compiler)
    direct = True

    def __init__(self, path: Path, backend, config: dict[str, Any], chat_template: str | None,
                 fallback: Callable[[], Any]):
        self.path = path
        self.backend_tokenizer = backend
        self.chat_template = chat_template
        self.clean_up_tokenization_spaces = False
        self.special_tokens_map = {n: text for n in SPECIAL_NAMES
                                   if (text := _token_text(config.get(n))) is not None}
        self._fallback = fallback
        self._hf: Any = None
        self._template: Any = None

    @classmethod
    def open(cls, path: str | Path, fallback: Callable[[], Any]) -> DirectTokenizer | None:
        """The directory ``path``'s tokenizer read directly, or None where transformers might read it otherwise
        (another class, no ``tokenizer.json``, a config this class does not read). ``fallback()`` loads the
        transformers tokenizer of the same directory, for what this class does not answer itself."""
        path = Path(path)
        if transformers_major() < 5:   # what transformers 4 made of these classes: not compared
            return None
        try:
            config = json.loads((path / "tokenizer_config.json").read_text())
        except (OSError, ValueError):
            return None
        if not isinstance(config, dict) or config.get("tokenizer_class") not in DIRECT_CLASSES:
            return None
        if config.get("clean_up_tokenization_spaces") or config.get("split_special_tokens") \
                or config.get("add_bos_token") or config.get("add_eos_token") \
                or any(not isinstance(config.get(n), (str, dict, type(None))) for n in SPECIAL_NAMES):
            return None
        template = config.get("chat_template")
        if template is not None and not isinstance(template, str):       # several named templates
            return None
        jinja = path / "chat_template.jinja"
        if jinja.is_file():
            template = jinja.read_text(encoding="utf-8")
        if (path / "chat_template.json").is_file():
            return None
        import tokenizers

        try:
            backend = tokenizers.Tokenizer.from_file(str(path / "tokenizer.json"))
        except Exception:  # noqa: BLE001 - missing or unreadable: transformers says what is wrong
            return None
        normalizer = DIRECT_CLASSES[config["tokenizer_class"]]
        if normalizer is not None:
            backend.normalizer = getattr(tokenizers.normalizers, normalizer)()
        return cls(path, backend, config, template, fallback)

    # --- what transformers' tokenizers answer, here from tokenizer.json -------------------------------------------
    def __len__(self) -> int:
        return self.backend_tokenizer.get_vocab_size(with_added_tokens=True)

    @property
    def vocab_size(self) -> int:
        """Tokens of the base vocabulary (without added tokens), as transformers counts them."""
        return self.backend_tokenizer.get_vocab_size(with_added_tokens=False)

    def get_vocab(self) -> dict[str, int]:
        return self.backend_tokenizer.get_vocab(with_added_tokens=True)

    def _special_id(self, name: str) -> int | None:
        text = self.special_tokens_map.get(name)
        return None if text is None else self.backend_tokenizer.token_to_id(text)

    @property
    def eos_token_id(self) -> int | None:
        return self._special_id("eos_token")

    @property
    def bos_token_id(self) -> int | None:
        return self._special_id("bos_token")

    @property
    def pad_token_id(self) -> int | None:
        return self._special_id("pad_token")

    @property
    def eos_token(self) -> str | None:
        return self.special_tokens_map.get("eos_token")

    def convert_ids_to_tokens(self, ids):
        """The token string of one id, or a list of them for a list of ids."""
        if isinstance(ids, int):
            return self.backend_tokenizer.id_to_token(ids)
        return [self.backend_tokenizer.id_to_token(int(i)) for i in ids]

    def encode(self, text: str, add_special_tokens: bool = True, **kwargs) -> list[int]:
        if kwargs or not isinstance(text, str):
            return self._transformers().encode(text, add_special_tokens=add_special_tokens, **kwargs)
        return self.backend_tokenizer.encode(text, add_special_tokens=add_special_tokens).ids

    def __call__(self, text, add_special_tokens: bool = True, **kwargs):
        """``{"input_ids": [...], "attention_mask": [...]}`` of one text (other arguments: transformers')."""
        if kwargs or not isinstance(text, str):
            return self._transformers()(text, add_special_tokens=add_special_tokens, **kwargs)
        ids = self.backend_tokenizer.encode(text, add_special_tokens=add_special_tokens).ids
        return {"input_ids": ids, "attention_mask": [1] * len(ids)}

    def decode(self, ids, skip_special_tokens: bool = False, **kwargs) -> str:
        if kwargs:
            return self._transformers().decode(ids, skip_special_tokens=skip_special_tokens, **kwargs)
        if isinstance(ids, int):
            ids = [ids]
        return self.backend_tokenizer.decode([int(i) for i in ids], skip_special_tokens=skip_special_tokens)

    def apply_chat_template(self, conversation, add_generation_prompt: bool = False, tokenize: bool = True,
                            **kwargs):
        """A chat of plain ``{"role": str, "content": str}`` messages through the template (the ids, or the text
        with ``tokenize=False``); anything else as transformers renders it."""
        template = None if kwargs or not _plain_chat(conversation) else self._compiled_template()
        if template is None:
            return self._transformers().apply_chat_template(conversation, add_generation_prompt=add_generation_prompt,
                                                            tokenize=tokenize, **kwargs)
        text = template.render(messages=[dict(m) for m in conversation], tools=None, documents=None,
                               add_generation_prompt=add_generation_prompt, **self.special_tokens_map)
        if not tokenize:
            return text
        return self.backend_tokenizer.encode(text, add_special_tokens=False).ids

    def _compiled_template(self):
        """The chat template compiled (once), or None: no template, or one with transformers' own tags (``{%
        generation %}``), which only its renderer reads."""
        if self._template is None:
            import jinja2

            try:
                self._template = False if self.chat_template is None else compile_template(self.chat_template)
            except jinja2.TemplateSyntaxError:
                self._template = False
        return None if self._template is False else self._template

    # --- the rest: transformers' tokenizer of the same directory ----------------------------------------------------
    def _transformers(self):
        if self._hf is None:
            self._hf = self._fallback()
        return self._hf

    def __getattr__(self, name: str):
        if name.startswith("_"):      # not found among this object's own: no transformers load for a private name
            raise AttributeError(name)
        return getattr(self._transformers(), name)

    def __repr__(self) -> str:
        return f"DirectTokenizer({str(self.path)!r}, {len(self)} tokens)"


def transformers_major() -> int:
    """The installed transformers' major version (0: none), read from its metadata without importing it."""
    from importlib.metadata import PackageNotFoundError, version

    try:
        return int(version("transformers").split(".")[0])
    except (PackageNotFoundError, ValueError):
        return 0


def _token_text(value) -> str | None:
    """A special token as the config writes it: its text, or a serialized added token ``{"content": ...}``."""
    if isinstance(value, dict):
        value = value.get("content")
    return value if isinstance(value, str) else None


def _plain_chat(conversation) -> bool:
    return (isinstance(conversation, (list, tuple)) and len(conversation) > 0
            and all(type(m) is dict and set(m) == {"role", "content"}
                    and all(type(v) is str for v in m.values()) for m in conversation))


def compile_template(text: str):
    """``text`` as transformers compiles a chat template: a sandboxed jinja2 environment (``trim_blocks``,
    ``lstrip_blocks``, loop controls), ``tojson`` without HTML escapes, ``raise_exception`` and ``strftime_now``.
    (transformers' ``{% generation %}`` tag marks assistant text for training masks: a template with it does not
    compile here, and :meth:`DirectTokenizer.apply_chat_template` leaves it to transformers.)"""
    import jinja2
    import jinja2.ext
    from jinja2.sandbox import ImmutableSandboxedEnvironment

    def raise_exception(message):
        raise jinja2.exceptions.TemplateError(message)

    def tojson(x, ensure_ascii=False, indent=None, separators=None, sort_keys=False):
        return json.dumps(x, ensure_ascii=ensure_ascii, indent=indent, separators=separators, sort_keys=sort_keys)

    env = ImmutableSandboxedEnvironment(trim_blocks=True, lstrip_blocks=True, extensions=[jinja2.ext.loopcontrols])
    env.filters["tojson"] = tojson
    env.globals["raise_exception"] = raise_exception
    env.globals["strftime_now"] = lambda fmt: datetime.now().strftime(fmt)
    return env.from_string(text)

