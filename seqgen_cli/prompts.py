"""What goes into the model for an input: the prompt, rendered as the checkpoint was trained to read it, and its
tokens.

Three ways, one :class:`Prompter` (``Generator.encode`` asks it for every input):

* plain: ``--prefix`` + the input text, tokenised with the tokenizer's special tokens (as ``tokenizer(text)``);
* ``--prompt-template``: a text with ``{input}`` where the input goes and, for JSONL input, ``{field}`` for any
  field of the object (only ``{name}`` with a name of letters, digits and ``_`` is replaced: other braces, a JSON
  example in a few-shot prompt, stay as written);
* ``--chat``: the input (or the template's text) as the user message of the tokenizer's chat template, an assistant
  turn opened (``add_generation_prompt``), ``--system-prompt`` as the system message, as ``apply_chat_template``
  renders it; a JSONL object's ``messages`` list is the conversation as given (content parts, tool calls), its
  ``tools`` the template's tools, and a conversation that ends in an assistant message is continued from it
  (``continue_final_message``: a prefill). The rendered text is tokenised
  without adding special tokens, as ``apply_chat_template(tokenize=True)`` does (the template writes them).

Truncation (``--max-source-length``) shortens the input text inside the template, from its end, and never the
template's own tokens: the instruction and the end-of-turn marker stay. A plain prompt keeps its beginning.
"""

from __future__ import annotations

import json
import os
import re
import sys
import time
from collections.abc import Callable, Iterator, Mapping, Sequence
from contextlib import contextmanager
from dataclasses import dataclass, field
from typing import Any

from seqgen_cli.errors import SeqgenError

Offsets = list[tuple[int, int]]  # each token's span of the prompt's text (a fast tokenizer's offset mapping)
FIELD = re.compile(r"\{([A-Za-z_][A-Za-z0-9_]*)\}")  # a {name} of a --prompt-template
# apply_chat_template's own parameters: a --chat-template-kwargs key among them would replace seqgen's argument
CALL_KEYS = frozenset(
    "conversation messages tools documents chat_template add_generation_prompt continue_final_message tokenize "
    "padding truncation max_length return_tensors return_dict return_assistant_tokens_mask tokenizer_kwargs".split()
)


@dataclass(frozen=True)
class PromptSettings:
    """How inputs become prompts (the command line's ``--chat``, ``--system-prompt``, ``--chat-template``,
    ``--chat-template-kwargs``, ``--prompt-template`` and ``--prefix``); texts, not file names (``@FILE`` read)."""

    prefix: str | None = None
    template: str | None = None  # --prompt-template: {input}, {field}
    chat: bool = False
    system_prompt: str | None = None
    chat_template: str | None = None  # a Jinja template replacing the tokenizer's own
    chat_template_kwargs: Mapping[str, Any] = field(default_factory=dict)

    def __post_init__(self) -> None:
        if self.template is not None and not FIELD.search(self.template):
            raise SeqgenError("--prompt-template has no {input} (nor any {field}): where does the input go?")
        if not self.chat and (self.system_prompt is not None or self.chat_template is not None):
            object.__setattr__(self, "chat", True)  # --system-prompt and --chat-template imply --chat
        if clash := [k for k in self.chat_template_kwargs if k in CALL_KEYS]:
            raise SeqgenError(
                f"--chat-template-kwargs {', '.join(clash)}: seqgen sets {'it' if len(clash) == 1 else 'them'} itself "
                "(apply_chat_template's own arguments): give the template's own switches only"
            )

    def describe(self) -> dict[str, Any]:
        """What the outputs depend on (``--resume``'s fingerprint, ``--stats``)."""
        return {k: v for k, v in vars(self).items() if v not in (None, False, {})}


@dataclass
class Prompted:
    """One input's tokens: ``ids``; ``truncated``: its text was shortened to fit; ``error``: why it has none;
    ``breaks``: where its prompt may break into segments (:meth:`Prompter.breaks`)."""

    ids: list[int]
    truncated: bool = False
    error: str | None = None
    breaks: tuple[int, ...] = ()


class Prompter:
    """Renders inputs with :class:`PromptSettings` and tokenises them (module docstring)."""

    def __init__(self, settings: PromptSettings, tokenizer: Any, breaks: bool = False) -> None:
        """``breaks``: find each prompt's breaks (a decoder-only model's prompt tree; a fast tokenizer's offsets)."""
        self.settings, self.tokenizer = settings, tokenizer
        self.find_breaks = breaks and bool(getattr(tokenizer, "is_fast", False))
        if settings.chat and settings.chat_template is None and not getattr(tokenizer, "chat_template", None):
            raise SeqgenError(
                "--chat: the tokenizer has no chat template (no chat_template in tokenizer_config.json nor a "
                "chat_template.jinja): give one with --chat-template FILE, or use --prompt-template"
            )
        if settings.chat:  # a template that does not render fails here, before any input
            self._chat([{"role": "user", "content": "x"}])

    def render(self, text: str, fields: Mapping[str, Any] | None = None) -> str:
        """The prompt text of an input (``fields``: its JSONL object); :class:`SeqgenError` for a ``{name}`` the
        input lacks."""
        s = self.settings
        text = (s.prefix or "") + text
        if s.template is not None:
            text = _fill(s.template, text, fields)
        if not s.chat:
            return text
        messages = _messages(fields)
        if messages is not None and s.template is not None:
            raise SeqgenError(
                '--prompt-template applies to a text input, not a "messages" conversation (the prompt as given): '
                "drop one"
            )
        if messages is None:
            messages = [{"role": "user", "content": text}]
        if s.system_prompt is not None and not any(m.get("role") == "system" for m in messages):
            messages = [{"role": "system", "content": s.system_prompt}, *messages]
        return self._chat(messages, _tools(fields))

    def encode(
        self,
        texts: Sequence[str],
        fields: Sequence[Mapping[str, Any] | None],
        limit: int | None,
        said: str | None = None,
    ) -> list[Prompted]:
        """Each input's tokens, at most ``limit`` (:meth:`_fit`; ``said``: where the limit comes from, in words, for
        the errors that name it; default ``--max-source-length``)."""
        said = said or f"--max-source-length {limit}"
        out = []
        for text, obj in zip(texts, fields, strict=True):
            try:
                out.append(self._fit(text, obj, limit, said))
            except SeqgenError as err:
                out.append(Prompted([], error=str(err)))
        return out

    def _tokens(self, prompt: str, limit: int | None = None) -> tuple[list[int], Offsets | None]:
        """The prompt's tokens (at most ``limit``: the tokenizer's own truncation) and, where breaks are wanted,
        each token's span of the text."""
        # a chat template writes the special tokens itself (apply_chat_template(tokenize=True) adds none)
        cut: dict[str, Any] = {} if limit is None else {"truncation": True, "max_length": limit}
        out = self.tokenizer(
            prompt, add_special_tokens=not self.settings.chat, return_offsets_mapping=self.find_breaks, **cut
        )
        return out["input_ids"], out.get("offset_mapping")

    def _fit(self, text: str, fields: Mapping[str, Any] | None, limit: int | None, said: str) -> Prompted:
        """The tokens of the rendered prompt; over ``limit``, a plain prompt cut at its end (as the tokenizer's own
        truncation), a templated one rendered again around its input text cut short by as many tokens as it is
        over (again, should the shorter text tokenise otherwise), never the template's tokens."""
        prompt = self.render(text, fields)
        ids, offsets = self._tokens(prompt)
        if limit is None or len(ids) <= limit:
            return Prompted(ids, breaks=self.breaks(prompt, offsets, text, fields))
        s = self.settings
        if s.template is None and not s.chat:
            prompt = (s.prefix or "") + text
            ids, offsets = self._tokens(prompt, limit)
            if ids == self.tokenizer(s.prefix or "", truncation=True, max_length=limit)["input_ids"]:
                what = "--prefix and the special tokens" if s.prefix else "special tokens"
                raise SeqgenError(_nothing_left(limit, said, what))
            return Prompted(ids, True, breaks=self.breaks(prompt, offsets, text, fields))
        messages = _messages(fields)
        cut = _last_user(messages) if messages else None  # the text cut: the input, or the last user message's
        if messages and cut is None:
            raise SeqgenError(f"the conversation is over {limit} tokens ({said}) and has no user text to shorten")
        inner = messages[cut]["content"] if messages else text
        pieces = self.tokenizer(inner, add_special_tokens=False)["input_ids"]
        keep = len(pieces)
        while len(ids) > limit and keep > 0:
            keep = max(0, keep - (len(ids) - limit))
            short = self.tokenizer.decode(pieces[:keep])
            if messages:
                shortened = [*messages[:cut], {**messages[cut], "content": short}, *messages[cut + 1 :]]
                fields = {**fields, "messages": shortened}  # type: ignore[dict-item]
            else:
                text = short
            prompt = self.render(text, fields)
            ids, offsets = self._tokens(prompt)
        if len(ids) > limit:
            raise SeqgenError(
                f"the prompt's template alone takes {len(ids)} tokens, more than {limit} ({said})"
            )
        if keep == 0:  # the template fits, the input does not: an output of the template alone is no output
            raise SeqgenError(_nothing_left(limit, said, "the prompt's template"))
        return Prompted(ids, True, breaks=self.breaks(prompt, offsets, text, fields))

    def breaks(
        self, prompt: str, offsets: Offsets | None, text: str, fields: Mapping[str, Any] | None
    ) -> tuple[int, ...]:
        """Where ``prompt`` may break into segments whose keys and values other prompts may share
        (``models/prompt_tree.py``): after each message of a conversation but the last (a system turn, few-shot
        examples), and before the input's text where something comes before it (a prefix, a template's text, a
        system prompt). Each as the count of tokens wholly before that point of the text: found in the prompt's
        own text, so they do not depend on other inputs. ``()`` without offsets (a slow tokenizer)."""
        if offsets is None:
            return ()
        marks, at = [], 0
        for piece, after in self._marks(text, fields):
            piece = piece.strip()
            found = prompt.find(piece, at) if piece else -1
            if found > 0:
                at = found + len(piece)
                # before the input: also before the spaces before it (a tokenizer may join them to its first word)
                marks.append(at if after else len(prompt[:found].rstrip()))
        counts, n = [], 0
        for mark in marks:
            while n < len(offsets) and offsets[n][1] <= mark:
                n += 1
            counts.append(n)
        return tuple(b for b in dict.fromkeys(counts) if 0 < b < len(offsets))

    def _marks(self, text: str, fields: Mapping[str, Any] | None) -> list[tuple[str, bool]]:
        """The texts that mark a prompt's breaks, in the order the prompt has them: ``(text, True)`` breaks after
        it (a message), ``(text, False)`` before it (the input)."""
        s = self.settings
        given = _messages(fields) if s.chat else None
        if given is None:  # the input's text, after a prefix, a template's text, a system prompt
            lead = [(s.system_prompt, True)] if s.chat and s.system_prompt is not None else []
            return [*lead, (text, False)]
        messages = given
        if s.system_prompt is not None and not any(m.get("role") == "system" for m in given):
            messages = [{"role": "system", "content": s.system_prompt}, *given]
        return [(_content_text(m.get("content")), True) for m in messages[:-1]]

    def _chat(self, messages: list[dict[str, Any]], tools: list[Any] | None = None) -> str:
        """The chat template over ``messages`` (and ``tools``): the assistant's turn opened, or, where the conversation
        ends in an assistant message, that message continued (``continue_final_message``: a prefill)."""
        s = self.settings
        where = "--chat-template" if s.chat_template is not None else "the tokenizer's chat template"
        prefill = messages[-1].get("role") == "assistant"
        try:
            with bounded(where):
                return self.tokenizer.apply_chat_template(
                    messages,
                    tools=tools,
                    tokenize=False,
                    add_generation_prompt=not prefill,
                    continue_final_message=prefill,
                    chat_template=s.chat_template,
                    **s.chat_template_kwargs,
                )
        except SeqgenError:
            raise
        except Exception as err:  # noqa: BLE001 - jinja2's errors (syntax, undefined names, raise_exception)
            message = " ".join(str(err).split()) or type(err).__name__
            raise SeqgenError(f"{where} does not render: {message}") from None


# A chat template is a program: transformers' sandbox stops attribute tricks and ranges past 100,000, not loops
# inside loops. Rendering one prompt may run RENDER_STEPS lines of the compiled template (the seven families'
# templates run under 3,000 for a 101-message conversation) and RENDER_SECONDS (a filter's C loop runs no lines).
RENDER_STEPS = 1_000_000
RENDER_SECONDS = 10.0
TEMPLATE_FILE = "<template>"  # the file name of jinja2's compiled templates


@contextmanager
def bounded(where: str, clock: Callable[[], float] = time.monotonic) -> Iterator[None]:
    """Run the body with a line tracer on jinja2's template code (this thread only; the previous tracer put back)
    that stops it past :data:`RENDER_STEPS` lines or :data:`RENDER_SECONDS`: one line naming ``where``."""
    start, steps = clock(), 0

    def line(frame: Any, event: str, arg: Any) -> Any:
        nonlocal steps
        steps += 1
        if steps > RENDER_STEPS or clock() - start > RENDER_SECONDS:
            raise SeqgenError(
                f"{where} did not finish rendering a prompt within {RENDER_STEPS:,} steps or {RENDER_SECONDS:g} s "
                "(a loop without a bound?): fix the template"
            )
        return line

    def call(frame: Any, event: str, arg: Any) -> Any:
        return line if frame.f_code.co_filename == TEMPLATE_FILE else None

    previous = sys.gettrace()
    sys.settrace(call)
    try:
        yield
    finally:
        sys.settrace(previous)


def _nothing_left(limit: int, said: str, what: str) -> str:
    return f"a prompt of at most {limit} tokens ({said}) leaves none of the input's text beside {what}"


def _fill(template: str, text: str, fields: Mapping[str, Any] | None) -> str:
    """``template`` with ``{input}`` the input text and ``{name}`` the JSONL field ``name`` (a string as it is,
    anything else as JSON)."""
    values = dict(fields or {})

    def value(match: re.Match[str]) -> str:
        name = match.group(1)
        if name == "input":
            return text
        if name not in values:
            have = ", ".join(map(repr, values)) or "none: the input is text"
            raise SeqgenError(f"--prompt-template has {{{name}}}, a field this input lacks (fields: {have})")
        v = values[name]
        return v if isinstance(v, str) else json.dumps(v, ensure_ascii=False)

    return FIELD.sub(value, template)


def _messages(fields: Mapping[str, Any] | None) -> list[dict[str, Any]] | None:
    """A JSONL object's ``messages`` as ``apply_chat_template`` takes them, or ``None``: ``{"role", "content"}``
    objects, the content a string, a list of parts (``{"type": "text", "text": ...}``), or ``null`` beside an
    assistant's ``tool_calls``."""
    messages = (fields or {}).get("messages")
    if messages is None:
        return None
    if not (isinstance(messages, list) and messages and all(_message(m) for m in messages)):
        raise SeqgenError(
            '"messages" must be a non-empty list of {"role": ..., "content": ...} objects, each content a string, a '
            'list of parts ({"type": "text", ...}), or null beside "tool_calls"'
        )
    return messages


def _message(m: Any) -> bool:
    if not isinstance(m, dict) or not isinstance(m.get("role"), str):
        return False
    content = m.get("content")
    if isinstance(content, list):
        return all(isinstance(part, dict) and isinstance(part.get("type"), str) for part in content)
    return isinstance(content, str) or (content is None and isinstance(m.get("tool_calls"), list))


def _content_text(content: Any) -> str:
    """A message's text as a template writes it: the content, or its last text part's; ``""`` for none."""
    if isinstance(content, list):
        texts = [part.get("text") for part in content if isinstance(part.get("text"), str)]
        return texts[-1] if texts else ""
    return content if isinstance(content, str) else ""


def _last_user(messages: list[dict[str, Any]]) -> int | None:
    """The index of the last user message with text content: what ``--max-source-length`` shortens."""
    users = [i for i, m in enumerate(messages) if m.get("role") == "user" and isinstance(m.get("content"), str)]
    return users[-1] if users else None


def _tools(fields: Mapping[str, Any] | None) -> list[Any] | None:
    """A JSONL object's ``tools`` (a list of tool objects: JSON schemas, as ``apply_chat_template`` takes them)."""
    tools = (fields or {}).get("tools")
    if tools is not None and not (isinstance(tools, list) and all(isinstance(t, dict) for t in tools)):
        raise SeqgenError('"tools" must be a list of tool objects (JSON schemas, as apply_chat_template takes them)')
    return tools


def read_template_option(value: str | None) -> str | None:
    """``--chat-template``: ``@FILE`` or a file's path (its contents), or the Jinja text itself (a value with
    ``{{`` or ``{%`` that is no file)."""
    if value is None or value.startswith("@") or ("{{" not in value and "{%" not in value) or os.path.isfile(value):
        return read_text_option(value if value is None or value.startswith("@") else f"@{value}", "--chat-template")
    return value


def read_text_option(value: str | None, flag: str) -> str | None:
    """A ``--system-prompt`` / ``--prompt-template`` value: the text, or ``@FILE``'s contents (UTF-8) less one final
    newline (which any editor saves; as llama.cpp's ``--file`` reads a prompt)."""
    if value is None or not value.startswith("@"):
        return value
    try:
        with open(value[1:], encoding="utf-8") as fh:  # universal newlines: \r\n read as \n
            return fh.read().removesuffix("\n")
    except OSError as err:
        raise SeqgenError(f"{flag} {value}: cannot read {value[1:]}: {err.strerror}") from None
    except UnicodeDecodeError as err:
        raise SeqgenError(f"{flag} {value}: not UTF-8 text (byte {err.start + 1})") from None


def stop_check(tokenizer: Any, stop_strings: str | Sequence[str] | None) -> Any:
    """The check that ends a row at a stop string (``search.generate(stop=...)``): transformers'
    ``StopStringCriteria`` over ``tokenizer``, the same test ``generate(stop_strings=..., tokenizer=...)`` runs
    (its tables built once, here); ``None`` without stop strings."""
    if not stop_strings:
        return None
    from transformers import StopStringCriteria

    try:
        return StopStringCriteria(tokenizer, stop_strings)
    except ValueError:  # transformers: "unable to identify tokens matching one or more of the stop strings"
        strings = [stop_strings] if isinstance(stop_strings, str) else list(stop_strings)
        shown = ", ".join(json.dumps(s, ensure_ascii=False) for s in strings)
        raise SeqgenError(
            f"stop strings {shown}: transformers' StopStringCriteria finds no token of the model's vocabulary that "
            "spells one of them, so no output could end there"
        ) from None
