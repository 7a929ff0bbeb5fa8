"""Structured outputs (``grammars.py``, ``search/grammar.py``): the fast engine's grammar mask against ``generate()``
with the reference processor (``models/reference.grammar_processor``: each row's tokens replayed through its own
matcher, a different path over the same llguidance grammar), in float32, on tiny checkpoints; every output that
completed its grammar parses."""

from __future__ import annotations

import json
import re

import pytest

from seqgen_cli.errors import SeqgenError
from seqgen_cli.generator import Generator
from seqgen_cli.grammars import Grammar, grammar_spec

pytest.importorskip("llguidance")

SCHEMA = {
    "type": "object",
    "properties": {
        "name": {"type": "string", "maxLength": 6},
        "tag": {"enum": ["red", "green"]},
        "sub": {"type": "object", "properties": {"ok": {"type": "boolean"}}, "required": ["ok"]},
    },
    "required": ["name", "tag", "sub"],
    "additionalProperties": False,
}
REGEX = r"[a-z]{2,5}@[a-z]{2,4}\.(com|org)"
GBNF = 'root ::= "(" num ("," num)? ")"\nnum ::= [0-9] [0-9]?'
CHOICES = ("yes", "no way", "maybe")
SPECS = {
    "json": grammar_spec(json_schema=json.dumps(SCHEMA)),
    "regex": grammar_spec(regex=REGEX),
    "gbnf": grammar_spec(grammar=GBNF),
    "choice": grammar_spec(choices=CHOICES),
}
TEXTS = ["The weather today", "A list of", "Hello there my friend", "In 1990 the"]


def parses(kind: str, text: str) -> bool:
    """Whether ``text`` is an output of ``SPECS[kind]`` (checked without llguidance)."""
    if kind == "json":
        value = json.loads(text)
        return set(value) == {"name", "tag", "sub"} and value["tag"] in ("red", "green") and len(value["name"]) <= 6
    if kind == "regex":
        return re.fullmatch(REGEX, text) is not None
    if kind == "gbnf":
        return re.fullmatch(r"\([0-9]{1,2}(,[0-9]{1,2})?\)", text) is not None
    return text in CHOICES


def run(model, spec, backend: str, **settings) -> list[str]:
    gen = Generator(str(model), backend=backend, grammar=spec, max_new_tokens=48, **settings)
    return [outs[0] for outs in gen.generate(TEXTS)]


@pytest.mark.parametrize("kind", sorted(SPECS))
@pytest.mark.parametrize("family", ["gpt2", "bart"])
@pytest.mark.parametrize("search", ["greedy", "beam"])
def test_fast_engine_equals_generate_and_outputs_parse(tiny_models, family, kind, search):
    """Greedy with n-gram blocking, and beam search (each hypothesis its matcher, copied through reorders): the
    same tokens as generate() + the reference processor; bart's forced BOS and EOS steps go unmasked in both.
    (Beam search with blocking as well can leave every candidate of an input at -inf, the grammar's tokens all
    banned: which of those equal candidates runs on is torch.topk's order over a different shape, and such an
    output has no score.)"""
    settings = {"num_beams": 3, "length_penalty": 0.8} if search == "beam" else {"no_repeat_ngram_size": 3}
    model, spec = tiny_models(family), SPECS[kind]
    fast = run(model, spec, "fast", do_sample=False, **settings)
    assert fast == run(model, spec, "hf", do_sample=False, **settings)
    grammar = Generator(str(model), backend="fast", grammar=spec).grammar
    assert grammar is not None
    gen = Generator(str(model), backend="fast", grammar=spec, max_new_tokens=48, do_sample=False, **settings)
    ids = [seqs[0] for seqs in gen.generate_output([gen.encode([t])[0].ids for t in TEXTS]).sequences]
    whole = [grammar.complete(seq) for seq in ids]
    assert [parses(kind, text) for text, w in zip(fast, whole, strict=True) if w] == [True] * sum(whole)
    if kind in ("choice", "regex"):  # short grammars: every output completes within 48 tokens
        assert all(whole)


def test_sampling_outputs_parse_and_repeat_with_the_seed(tiny_models):
    """Sampling draws from the masked distribution: every output is a choice, the same seed the same outputs, with
    or without refill's lanes (an input's stream and matcher are its own)."""
    model = tiny_models("gpt2")
    first = run(model, SPECS["choice"], "fast", do_sample=True, seed=7, top_k=0)
    assert set(first) <= set(CHOICES)
    assert run(model, SPECS["choice"], "fast", do_sample=True, seed=7, top_k=0) == first
    assert run(model, SPECS["choice"], "fast", do_sample=True, seed=7, top_k=0, refill=True, lanes=2) == first


def test_refill_lanes_equal_batches(tiny_models):
    """The refill engine's cohorts (inputs joining lanes as others leave) carry their rows' matchers."""
    model = tiny_models("bart")
    batches = run(model, SPECS["regex"], "fast", num_beams=2)
    assert run(model, SPECS["regex"], "fast", num_beams=2, refill=True, lanes=2) == batches


def test_a_sentencepiece_vocabulary(real_tokenizer_models):
    """T5's pieces (no byte-level decoder: read as text with ▁ a space, the output's first space optional) give
    generate()'s tokens; a grammar whose first character no piece writes (T5 has no "{") is one line."""
    model = real_tokenizer_models("t5")
    fast = run(model, SPECS["choice"], "fast", num_beams=2)
    assert fast == run(model, SPECS["choice"], "hf", num_beams=2)
    assert set(fast) <= set(CHOICES)
    with pytest.raises(SeqgenError, match="no token of this model's vocabulary can begin an output"):
        Generator(str(model), grammar=SPECS["json"])


@pytest.mark.parametrize(
    ("options", "message"),
    [
        ({"regex": "a(b"}, r'--regex: invalid regex "a\(b": unclosed group'),
        ({"json_schema": "[1, 2]"}, "--json-schema: a JSON schema is an object, not list"),
        ({"json_schema": '{"type": '}, "--json-schema: not JSON: Expecting value"),
        ({"json_schema": "missing.json"}, "--json-schema missing.json: cannot read missing.json"),
        ({"json_schema": '{"type": "nothing"}'}, "--json-schema: .*nothing"),
        ({"grammar": 'root ::= "a" | b'}, "--grammar: .*'b'"),
        ({"regex": "a", "choices": ("x",)}, "--regex and --choice contradict"),
        ({"choices": ("x", "")}, "a choice must have at least one character"),
    ],
)
def test_bad_grammars_are_one_line(options, message):
    with pytest.raises(SeqgenError, match=message) as err:
        grammar_spec(**options)
    assert "\n" not in str(err.value)


def test_complete_reads_the_tokens(tiny_models):
    """An output is complete where its tokens (EOS or not) make a whole match, and not where they stop inside it."""
    gen = Generator(str(tiny_models("gpt2")), grammar=SPECS["choice"])
    grammar, tok = gen.grammar, gen.tokenizer
    assert isinstance(grammar, Grammar)
    ids = tok.encode("no way", add_special_tokens=False)
    assert grammar.complete(ids) and grammar.complete([*ids, *grammar.eos])
    assert not grammar.complete(tok.encode("no", add_special_tokens=False))
    assert not grammar.complete(tok.encode("nope", add_special_tokens=False))
