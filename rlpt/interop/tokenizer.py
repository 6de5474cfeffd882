"""Hugging Face tokenizers (``tokenizer.json``) behind rlpt's ``Tokenizer`` interface.

Special roles map configured strings to single ids: pad, bos and eos come
from ``tokenizer_config.json`` / ``special_tokens_map.json`` (pad falls back to
eos, and bos to eos for models without one, such as Qwen2, whose prompts then
get no bos); ``step`` and ``answer`` default to ``<step>`` and ``<answer>``. Only
training domains need those two, so ``role_tokens="none"`` (sampling) leaves them
out; otherwise a vocabulary that lacks them gets them added when the model's embedding
has spare rows, or, when it has none (a Llama-3-style vocabulary whose table is exactly
full), they take the first unused reserved special tokens (``<|reserved_special_token_0|>``
...), with a logged note. The chat template
in ``tokenizer_config.json`` (or ``chat_template.jinja``) is rendered with
jinja2 the way ``transformers`` does, so prompts look like training data.
"""

from __future__ import annotations

import json
import logging
import os
import re
from collections.abc import Mapping, Sequence
from typing import Any

from rlpt.interop.convert import ConversionError
from rlpt.tokenizers.base import SPECIAL_ROLES, Tokenizer

DEFAULT_ROLE_STRINGS = {"step": "<step>", "answer": "<answer>"}
TRAINING_ROLES = ("step", "answer")
ROLE_TOKEN_MODES = ("auto", "none")
_RESERVED = re.compile(r"<\|?reserved[_a-z]*_\d+\|?>", re.IGNORECASE)

log = logging.getLogger(__name__)


def _token_string(value) -> str | None:
    # tokenizer_config.json stores either a string or an AddedToken dict.
    if isinstance(value, Mapping):
        return value.get("content")
    return value


def _read_json(path: str) -> dict[str, Any]:
    if not os.path.exists(path):
        return {}
    with open(path) as f:
        return json.load(f)


class HFTokenizer(Tokenizer):
    """A ``tokenizers.Tokenizer`` with rlpt's special roles and the model's chat template.

    ``stop_ids``: eos plus any end-of-turn ids ``generation_config.json`` lists,
    for the sampler's ``stop_ids``.
    """

    def __init__(
        self,
        path: str,
        *,
        roles: Mapping[str, str] | None = None,
        model_vocab_size: int | None = None,
        role_tokens: str = "auto",
    ):
        """``roles`` overrides the string of any role; ``model_vocab_size`` checks every id fits;
        ``role_tokens="none"`` sets up no step/answer tokens (sampling needs none)."""
        if role_tokens not in ROLE_TOKEN_MODES:
            raise ValueError(f"role_tokens must be one of {ROLE_TOKEN_MODES}, got {role_tokens!r}")
        try:
            from tokenizers import AddedToken
            from tokenizers import Tokenizer as _Tokenizer
        except ImportError as e:  # pragma: no cover - depends on the environment
            raise ImportError("Hugging Face tokenizers need `pip install tokenizers`") from e
        self.path = path
        tokenizer_file = os.path.join(path, "tokenizer.json")
        if not os.path.exists(tokenizer_file):
            raise ConversionError(f"{tokenizer_file}: not found")
        self._tok = _Tokenizer.from_file(tokenizer_file)
        config = _read_json(os.path.join(path, "tokenizer_config.json"))
        special_map = _read_json(os.path.join(path, "special_tokens_map.json"))
        self.config = config
        strings: dict[str, str | None] = {}
        for role in ("pad", "bos", "eos"):
            strings[role] = _token_string(
                config.get(f"{role}_token", special_map.get(f"{role}_token"))
            )
        if role_tokens == "auto":
            strings.update(DEFAULT_ROLE_STRINGS)
        strings.update(roles or {})
        unknown = sorted(set(strings) - set(SPECIAL_ROLES))
        if unknown:
            raise ValueError(f"unknown special roles {unknown}; allowed: {list(SPECIAL_ROLES)}")
        if not strings["eos"]:
            raise ConversionError(f"{path}: no eos_token configured (tokenizer_config.json)")
        self.has_bos = bool(strings["bos"])
        strings["pad"] = strings["pad"] or strings["eos"]
        strings["bos"] = strings["bos"] or strings["eos"]
        # Added in role order (step, then answer), so their ids do not depend on the strings.
        wanted = dict.fromkeys(strings[r] for r in TRAINING_ROLES if strings.get(r))
        missing = [s for s in wanted if self._tok.token_to_id(s) is None]
        room = None if model_vocab_size is None else model_vocab_size - self.vocab_size
        if missing and room is not None and room < len(missing):
            # No spare embedding rows: take reserved special tokens the vocabulary already has.
            reserved = self._unused_reserved(set(strings.values()))
            if len(reserved) >= len(missing):
                for role in TRAINING_ROLES:
                    if strings.get(role) in missing:
                        strings[role] = reserved.pop(0)
                        log.warning(
                            "%s: no spare embedding rows for a %s token; it is %r (reserved)",
                            tokenizer_file, role, strings[role],
                        )  # fmt: skip
                missing = []
        if missing:
            self._tok.add_special_tokens([AddedToken(s, special=True) for s in missing])
        self.role_strings = strings
        self._role_ids = {}
        for role, text in strings.items():
            if text is None:
                continue  # a training role left out (role_tokens="none")
            token_id = self._tok.token_to_id(text)
            if token_id is None:
                raise ConversionError(
                    f"{tokenizer_file}: the {role} token {text!r} is not a single token"
                )
            self._role_ids[role] = token_id
        self.chat_template = self._read_chat_template(config)
        # Chat models often end a turn with a token other than eos (generation_config.json).
        generation = _read_json(os.path.join(path, "generation_config.json"))
        eos_ids = generation.get("eos_token_id")
        eos_ids = [eos_ids] if isinstance(eos_ids, int) else list(eos_ids or [])
        self.stop_ids = tuple(sorted({self.eos_id, *eos_ids}))
        if model_vocab_size is not None and self.vocab_size > model_vocab_size:
            raise ConversionError(
                f"{tokenizer_file}: the tokenizer has {self.vocab_size} ids (with added tokens) "
                f"but the model's embedding (model.embed_tokens.weight) has {model_vocab_size} "
                "rows; ids past it have no embedding (map the step/answer roles to existing "
                "tokens with `roles=` if adding them overflowed)"
            )

    def _read_chat_template(self, config: Mapping[str, Any]) -> str | None:
        jinja_file = os.path.join(self.path, "chat_template.jinja")
        if os.path.exists(jinja_file):
            with open(jinja_file) as f:
                return f.read()
        template = config.get("chat_template") or _read_json(
            os.path.join(self.path, "chat_template.json")
        ).get("chat_template")
        if isinstance(template, list):  # named templates: take the default one
            named = {t["name"]: t["template"] for t in template}
            template = named.get("default", next(iter(named.values()), None))
        return template

    @property
    def vocab_size(self) -> int:
        return self._tok.get_vocab_size(with_added_tokens=True)

    def special_id(self, role: str) -> int:
        if role not in self._role_ids:
            if role in TRAINING_ROLES:
                raise ValueError(
                    f"{self.path}: this tokenizer was loaded without a {role} token "
                    "(role_tokens='none', for sampling); load it with role_tokens='auto'"
                )
            raise ValueError(f"unknown special role {role!r}; allowed: {list(SPECIAL_ROLES)}")
        return self._role_ids[role]

    def _unused_reserved(self, taken: set) -> list[str]:
        """Reserved special tokens of the vocabulary (``<|reserved_special_token_N|>``), by id."""
        added = self._tok.get_added_tokens_decoder()
        return [
            t.content
            for _, t in sorted(added.items())
            if _RESERVED.fullmatch(t.content) and t.content not in taken
        ]

    def encode(self, text: str, *, add_bos: bool = False, add_eos: bool = False) -> list[int]:
        # The tokenizer's own post-processor is bypassed so bos/eos are added exactly once.
        ids = self._tok.encode(text, add_special_tokens=False).ids
        if add_bos and self.has_bos:
            ids = [self.bos_id, *ids]
        if add_eos:
            ids = [*ids, self.eos_id]
        return ids

    def decode(self, ids: Sequence[int], *, skip_special: bool = True) -> str:
        hidden = {self.pad_id, self.bos_id, self.eos_id} if skip_special else set()
        kept = [int(t) for t in ids if int(t) not in hidden]
        return self._tok.decode(kept, skip_special_tokens=False)

    def token_to_id(self, token: str) -> int | None:
        return self._tok.token_to_id(token)

    def apply_chat_template(
        self,
        messages: Sequence[Mapping[str, Any]],
        *,
        add_generation_prompt: bool = True,
        **kwargs: Any,
    ) -> str:
        """The prompt text for ``messages`` ([{"role": ..., "content": ...}]) as the model
        was trained on it; encode it without ``add_bos`` (templates write their own)."""
        if self.chat_template is None:
            raise ValueError(f"{self.path}: the tokenizer has no chat template")
        return render_chat_template(
            self.chat_template,
            messages,
            add_generation_prompt=add_generation_prompt,
            bos_token=self.role_strings["bos"] if self.has_bos else "",
            eos_token=self.role_strings["eos"],
            pad_token=self.role_strings["pad"],
            **kwargs,
        )


def render_chat_template(template: str, messages: Sequence[Mapping[str, Any]], **kwargs) -> str:
    """Render a HF chat template in jinja2's sandbox, with the helpers transformers provides."""
    import datetime

    from jinja2.exceptions import TemplateError
    from jinja2.ext import loopcontrols
    from jinja2.sandbox import ImmutableSandboxedEnvironment

    def raise_exception(message):
        raise TemplateError(message)

    def tojson(x, ensure_ascii=False, indent=None, separators=None, sort_keys=False):
        return json.dumps(x, ensure_ascii=ensure_ascii, indent=indent, separators=separators,
                          sort_keys=sort_keys)  # fmt: skip

    env = ImmutableSandboxedEnvironment(trim_blocks=True, lstrip_blocks=True,
                                        extensions=[loopcontrols])  # fmt: skip
    env.filters["tojson"] = tojson
    env.globals["raise_exception"] = raise_exception
    env.globals["strftime_now"] = lambda fmt: datetime.datetime.now().strftime(fmt)
    return env.from_string(template).render(messages=list(messages), **kwargs)


def load_hf_tokenizer(
    path: str,
    *,
    roles: Mapping[str, str] | None = None,
    model_vocab_size: int | None = None,
    role_tokens: str = "auto",
) -> HFTokenizer:
    return HFTokenizer(
        path, roles=roles, model_vocab_size=model_vocab_size, role_tokens=role_tokens
    )


__all__ = ["DEFAULT_ROLE_STRINGS", "HFTokenizer", "load_hf_tokenizer", "render_chat_template"]
