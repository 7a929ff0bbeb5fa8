"""Structured outputs: the grammar an output must match (``--json-schema``, ``--regex``, ``--grammar``,
``--choice``), checked before the model loads and compiled once per run for the tokenizer.

llguidance does the work (no dependencies beyond its wheel; vLLM and SGLang use it as one of their guided-decoding
engines): a JSON schema, a regex, a GBNF / Lark grammar or a list of choices becomes one llguidance grammar
(:class:`GrammarSpec`), and :class:`Grammar` makes a *matcher* per row: the parser state that says which tokens may
come next (``search/grammar.py`` turns that into a mask over the logits). An output that ends before its grammar
completes (the new-token limit, a stop string) is *incomplete*: :meth:`Grammar.complete` says so from its tokens.
A JSONL input's ``schema`` field is its own JSON schema (:class:`Grammars`), so one run serves several.
"""

from __future__ import annotations

import copy
import json
import os
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from typing import Any

from seqgen_cli.errors import SeqgenError

KINDS = ("json_schema", "regex", "grammar", "choice")
FLAGS = {"json_schema": "--json-schema", "regex": "--regex", "grammar": "--grammar", "choice": "--choice"}
INSTALL = "pip install 'seqgen-cli[grammar]'"
# JSON as json.dumps writes it: one line (an output is a line of the output file), ", " and ": " between items
# (llguidance's JSON options, a schema's "x-guidance")
JSON_LAYOUT = {"item_separator": ", ", "key_separator": ": ", "whitespace_flexible": False}


def _llguidance() -> Any:
    try:
        import llguidance
    except ImportError:
        raise SeqgenError(f"structured outputs need llguidance: {INSTALL}") from None
    return llguidance


@dataclass(frozen=True)
class GrammarSpec:
    """One grammar as the user gave it: ``kind`` (one of :data:`KINDS`), ``source`` (the schema's JSON text, the
    regex, the grammar's text, or the choices as a JSON list) and ``name`` (the option and file, for messages)."""

    kind: str
    source: str
    name: str

    @property
    def lark(self) -> str:
        """The grammar in llguidance's Lark (its ``start`` rule the whole output; checked by :func:`grammar_spec`)."""
        llg = _llguidance()
        if self.kind == "json_schema":  # on one line, as json.dumps writes it, unless the schema's x-guidance says
            schema = json.loads(self.source)
            schema["x-guidance"] = {**JSON_LAYOUT, **(schema.get("x-guidance") or {})}
            return f"start: %json {json.dumps(schema)}"
        if self.kind == "regex":
            return f"start: /{llg.regex_to_lark(self.source)}/"
        if self.kind == "choice":
            return "start: " + " | ".join(json.dumps(c) for c in json.loads(self.source))
        from llguidance.gbnf_to_lark import any_to_lark

        return any_to_lark(self.source)  # GBNF (llama.cpp's) or Lark, as llguidance reads them


def _read(value: str, flag: str, inline: bool) -> tuple[str, str]:
    """A ``FILE`` or ``@FILE`` value (or, where ``inline``, the text itself) -> (its text, how messages name it)."""
    if inline and not value.startswith("@"):
        return value, flag
    path = value.removeprefix("@")
    try:
        with open(path, encoding="utf-8") as fh:
            return fh.read(), f"{flag} {path}"
    except OSError as err:
        raise SeqgenError(f"{flag} {value}: cannot read {path}: {err.strerror}") from None
    except UnicodeDecodeError as err:
        raise SeqgenError(f"{flag} {path}: not UTF-8 text (byte {err.start + 1})") from None


def grammar_spec(
    json_schema: str | None = None,
    regex: str | None = None,
    grammar: str | None = None,
    choices: Sequence[str] = (),
) -> GrammarSpec | None:
    """The run's grammar from the options (at most one given), checked: a schema that is no JSON object, a regex or
    grammar llguidance cannot read, an empty choice list is one line naming the option (before any model loads)."""
    given = [k for k, v in zip(KINDS, (json_schema, regex, grammar, choices), strict=True) if v]
    if not given:
        return None
    if len(given) > 1:
        raise SeqgenError(
            f"{' and '.join(FLAGS[k] for k in given)} contradict: give one form of structured output"
        )
    kind = given[0]
    if kind == "json_schema":
        value = json_schema or ""
        text, name = _read(value, FLAGS[kind], inline=value.lstrip()[:1] in ("{", "["))
        spec = GrammarSpec(kind, schema_text(text, name), name)
    elif kind == "grammar":
        value = grammar or ""  # a file, or the rules themselves (GBNF's ::=) where no file has that name
        spec = GrammarSpec(kind, *_read(value, FLAGS[kind], inline="::=" in value and not os.path.isfile(value)))
    elif kind == "regex":
        spec = GrammarSpec(kind, regex or "", FLAGS[kind])
    else:
        if any(c == "" for c in choices):
            raise SeqgenError("--choice '': a choice must have at least one character")
        spec = GrammarSpec(kind, json.dumps(list(choices)), FLAGS[kind])
    check(spec)
    return spec


def schema_text(text: str, name: str) -> str:
    """A JSON schema's text, checked to be a JSON object (``json.loads`` names where it is not)."""
    try:
        schema = json.loads(text)
    except json.JSONDecodeError as err:
        raise SeqgenError(f"{name}: not JSON: {err.msg} (line {err.lineno}, column {err.colno})") from None
    if not isinstance(schema, dict):
        raise SeqgenError(f"{name}: a JSON schema is an object, not {type(schema).__name__}")
    return json.dumps(schema)


def check(spec: GrammarSpec) -> None:
    """llguidance's own check of the grammar (no tokenizer needed): its first error as one line."""
    llg = _llguidance()
    try:
        lark = spec.lark
    except Exception as err:  # noqa: BLE001 - llguidance's GBNF reader raises plain Exception
        raise SeqgenError(f"{spec.name}: {first_line(str(err))}") from None
    is_error, messages = llg.LLMatcher.validate_grammar_with_warnings(lark)
    if is_error:
        raise SeqgenError(f"{spec.name}: {first_line(messages[0])}")


def first_line(message: str) -> str:
    """A multi-line parser message as one line: its first line, without llguidance's location prefix and a trailing
    colon, and the parser's own ``error:`` line where it has one (``invalid regex "a(b": unclosed group``)."""
    lines = [ln.strip() for ln in message.splitlines() if ln.strip()] or [message]
    head = lines[0].split("): ", 1)[1] if lines[0].startswith("at ") and "): " in lines[0] else lines[0]
    detail = next((ln.removeprefix("error:").strip() for ln in lines[1:] if ln.startswith("error:")), None)
    if detail is None:
        return head
    return f"{head.split(' (in ', 1)[0].rstrip(':')}: {detail}"


class Grammar:
    """A :class:`GrammarSpec` compiled for one tokenizer: :meth:`matcher` makes a row's parser state, over a
    vocabulary of ``vocab`` ids (the model's logits; ids past the tokenizer's never allowed), ending at ``eos``.

    Byte-level BPE and byte-fallback tokenizers (GPT-2, BART, Llama 3, Qwen, Mistral, Gemma, Phi-3) are read by
    llguidance itself. A SentencePiece vocabulary without byte fallback (T5, Marian, Pegasus, mBART) is read here as
    each token's text with ``▁`` as a space (:class:`PieceVocabulary`); its decoder drops the space that begins an
    output, so the grammar takes one there (``" "? grammar``)."""

    def __init__(self, spec: GrammarSpec, tokenizer: Any, vocab: int, eos: Sequence[int]) -> None:
        llg = _llguidance()
        from llguidance.hf import from_tokenizer

        if not eos:
            raise SeqgenError(f"{spec.name}: the model has no end-of-sequence token, which ends a structured output")
        self.spec, self.vocab, self.eos = spec, vocab, tuple(eos)
        self.pieces = False  # a SentencePiece vocabulary (PieceVocabulary): its output's first space optional
        self.space: int | None = None  # its "▁" piece alone
        self.special = tuple(getattr(tokenizer, "all_special_ids", ()))
        try:
            self.tokenizer = from_tokenizer(tokenizer, n_vocab=vocab, eos_token=list(eos))
        except ValueError as err:  # no byte-level decoder: a SentencePiece vocabulary, read piece by piece
            pieces = PieceVocabulary(tokenizer, eos)
            if not pieces.spaced:
                raise SeqgenError(f"{spec.name}: this tokenizer cannot guide decoding: {err}") from None
            self.tokenizer = llg.LLTokenizer(llg.TokenizerWrapper(pieces), n_vocab=vocab, eos_token=list(eos))
            self.pieces, self.space = True, pieces.ids.get(b" ")
        self._compile()

    def _compile(self) -> None:
        """The start state each row copies (microseconds; a new matcher: ~1 ms), checked to begin an output."""
        spec, self.lark = self.spec, self.spec.lark
        if self.pieces:
            inner = {"name": "output", "lark_grammar": self.lark}
            self.lark = json.dumps({"grammars": [{"lark_grammar": 'start: " "? @output'}, inner]})
        self._start = _llguidance().LLMatcher(self.tokenizer, self.lark, log_level=0)
        probe = self.matcher()
        if probe.is_error():
            raise SeqgenError(f"{spec.name}: {first_line(probe.get_error())}")
        if not self._can_begin(probe):  # T5's vocabulary has no "{", for one
            raise SeqgenError(f"{spec.name}: no token of this model's vocabulary can begin an output of the grammar")

    def with_spec(self, spec: GrammarSpec) -> Grammar:
        """Another grammar over this one's tokenizer (read once per run: ~0.5 s for a 50k vocabulary)."""
        other = copy.copy(self)
        other.spec = spec
        other._compile()
        return other

    def _can_begin(self, probe: Any) -> bool:
        """Some text token begins an output (a special token, the unknown one where the grammar needs a character the
        vocabulary lacks, does not; nor does the space alone a SentencePiece output begins with)."""
        special = set(self.special)
        firsts = [i for i in allowed_ids(probe) if i not in special]
        if firsts != [self.space] or self.space is None:
            return bool(firsts)
        probe.consume_token(self.space)
        return any(i not in special for i in allowed_ids(probe))

    @classmethod
    def for_model(cls, spec: GrammarSpec, tokenizer: Any, model: Any, config: Any) -> Grammar:
        """``spec`` for a loaded model: its logits' width (the tokenizer's ids and the embedding's rows, the larger)
        and its generation settings' EOS ids."""
        text = model.config.get_text_config(decoder=True)
        vocab = max(len(tokenizer), int(getattr(text, "vocab_size", 0) or 0))
        eos = config.eos_token_id
        return cls(spec, tokenizer, vocab, [eos] if isinstance(eos, int) else list(eos or []))

    def matcher(self) -> Any:
        """A new row's parser state (an ``llguidance.LLMatcher`` at the grammar's start)."""
        return self._start.deep_copy()

    def complete(self, tokens: Sequence[int]) -> bool:
        """Whether an output's text makes a whole match of the grammar: its tokens less the special ones (EOS, a
        forced BOS), which the written output leaves out too."""
        m, skip = self.matcher(), {*self.eos, *self.special}
        ids = [t for t in tokens if t not in skip]
        return m.consume_tokens(ids) and (m.is_accepting() or m.is_stopped()) and not m.is_error()


def allowed_ids(matcher: Any) -> list[int]:
    """The ids a matcher allows next (its bitmask's set bits)."""
    return [8 * k + j for k, byte in enumerate(matcher.compute_bitmask()) for j in range(8) if byte >> j & 1]


class PieceVocabulary:
    """A SentencePiece tokenizer's vocabulary as llguidance's ``TokenizerWrapper`` reads one: each id's bytes (its
    piece with ``▁`` as a space, ``<0xNN>`` as that byte, special tokens none), the special ids, the EOS."""

    def __init__(self, tokenizer: Any, eos: Sequence[int]) -> None:
        self._tokenizer = tokenizer
        self.eos_token_id, self.bos_token_id = eos[0], getattr(tokenizer, "bos_token_id", None)
        special = set(tokenizer.all_special_ids)
        pieces = tokenizer.convert_ids_to_tokens(list(range(len(tokenizer))))
        # a special token's bytes: llguidance's marker byte 0xFF and its name (no text grammar matches it)
        self.tokens = [
            b"\xff" + (p or "").encode() if i in special or p is None else piece_bytes(p) for i, p in enumerate(pieces)
        ]
        self.special_token_ids = sorted(special)
        self.spaced = any(p and p.startswith("\u2581") for p in pieces)  # a SentencePiece vocabulary
        self.ids: dict[bytes, int] = {}  # each piece's bytes -> its first id
        for i, piece in enumerate(self.tokens):
            if piece and piece[:1] != b"\xff" and piece not in self.ids:
                self.ids[piece] = i
        self._longest = max(map(len, self.ids), default=1)
        self.unknown = getattr(tokenizer, "unk_token_id", None) or 0

    def __call__(self, text: str) -> list[int]:
        """``text``'s ids, longest piece first (llguidance tokenises the bytes a grammar forces; the tokenizer's own
        ``encode`` would begin them with a ``▁``)."""
        data, ids, at = text.encode("utf-8"), [], 0
        while at < len(data):
            end = next((e for e in range(min(len(data), at + self._longest), at, -1) if data[at:e] in self.ids), None)
            ids.append(self.unknown if end is None else self.ids[data[at:end]])  # no piece holds the byte
            at = at + 1 if end is None else end
        return ids


def piece_bytes(piece: str) -> bytes:
    """A SentencePiece piece's text as bytes: ``▁`` a space, a byte-fallback piece ``<0xNN>`` that byte."""
    if len(piece) == 6 and piece.startswith("<0x") and piece.endswith(">"):
        return bytes([int(piece[3:5], 16)])
    return piece.replace("\u2581", " ").encode("utf-8")


SCHEMA_FIELD = "schema"  # a JSONL input's own JSON schema


class Grammars:
    """The run's grammar (``run``: the options', or none) and each JSONL input's own (its ``schema`` field, an
    object or its JSON text), compiled once per distinct schema over one tokenizer."""

    def __init__(self, run: GrammarSpec | None, tokenizer: Any, model: Any, config: Any) -> None:
        self.run = None if run is None else Grammar.for_model(run, tokenizer, model, config)
        self._model = (tokenizer, model, config)
        self._schemas: dict[str, Grammar] = {}

    @property
    def used(self) -> bool:
        """Some output of the run has a grammar (the run's, or an input's schema read so far)."""
        return self.run is not None or bool(self._schemas)

    def of(self, fields: Any) -> Grammar | None:
        """An input's grammar: its ``schema`` field's, else the run's; a schema that does not compile is a
        :class:`SeqgenError` naming the field (a bad input)."""
        schema = fields.get(SCHEMA_FIELD) if isinstance(fields, Mapping) else None
        if schema is None:
            return self.run
        name = f"its {SCHEMA_FIELD} field"
        text = schema_text(schema if isinstance(schema, str) else json.dumps(schema), name)
        if text not in self._schemas:
            spec = GrammarSpec("json_schema", text, name)
            check(spec)
            base = self.run or next(iter(self._schemas.values()), None)
            grammar = base.with_spec(spec) if base is not None else Grammar.for_model(spec, *self._model)
            self._schemas[text] = grammar
        return self._schemas[text]
