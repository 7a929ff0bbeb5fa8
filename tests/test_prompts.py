"""Prompting an LLM as it was trained (``prompts.py``, ``--chat``, ``--system-prompt``, ``--prompt-template``,
``messages`` JSONL, ``--stop``): through the CLI, each output is the one transformers gives on the prompt
``apply_chat_template`` (or the rendered template) makes, by ``generate()`` on that input alone; and the mistakes
are one line naming what is wrong."""

from __future__ import annotations

import json
import sys
from pathlib import Path

import pytest
import torch
from transformers import AutoConfig, AutoModelForCausalLM, AutoTokenizer

from seqgen_cli.errors import SeqgenError
from seqgen_cli.outputs import cut_at_stop
from seqgen_cli.prompts import Prompter, PromptSettings, read_text_option
from tests.helpers import one_line_error, seqgen, with_chat_template, write_lines
from tests.tiny_models import copy_checkpoint, sample_texts

NEW = 8
FAMILIES = ["llama", "gpt2"]  # two decoder-only families, on their fast decoders


@pytest.fixture(scope="module")
def chat_models(tiny_models, tmp_path_factory: pytest.TempPathFactory) -> dict[str, Path]:
    """The tiny llama and gpt2 checkpoints with a ChatML-like chat template (tests/helpers.py)."""
    root = tmp_path_factory.mktemp("chat")
    return {f: with_chat_template(copy_checkpoint(tiny_models(f), root / f)) for f in FAMILIES}


def _texts(n: int = 4) -> list[str]:
    return [" ".join(t.split()[:12]) for t in sample_texts(n, seed=7)]


def _alone(model: Path, prompts: list[list[int]], **settings) -> list[str]:
    """``generate()`` on each prompt alone, its new tokens decoded as seqgen writes a text line."""
    tok = AutoTokenizer.from_pretrained(model)
    lm = AutoModelForCausalLM.from_pretrained(model).eval()
    out = []
    with torch.inference_mode():
        for ids in prompts:
            x = torch.tensor([ids])
            y = lm.generate(x, attention_mask=torch.ones_like(x), max_new_tokens=NEW, **settings)
            text = tok.decode(y[0, len(ids) :], skip_special_tokens=True)
            out.append(" ".join(text.split("\n")))
    return out


def _chat_ids(model: Path, messages: list[list[dict[str, str]]]) -> list[list[int]]:
    tok = AutoTokenizer.from_pretrained(model)
    return [tok.apply_chat_template(m, add_generation_prompt=True, tokenize=True, return_dict=True)["input_ids"] for m in messages]


def _run(model: Path, src: Path, out: Path, *args: str):
    return seqgen("generate", "-m", str(model), str(src), "-o", str(out), "--max-new-tokens", str(NEW), "-q", *args)


@pytest.mark.parametrize("beams", [1, 4])
@pytest.mark.parametrize("system", [False, True])
@pytest.mark.parametrize("family", FAMILIES)
def test_chat_gives_apply_chat_template_and_generates_tokens(
    chat_models, tmp_path: Path, family: str, system: bool, beams: int
) -> None:
    """``--chat`` (and ``--system-prompt @FILE``): each input the user message, the assistant's turn opened, as
    ``apply_chat_template(add_generation_prompt=True)``; on the fast decoder, generate()'s tokens."""
    model, texts = chat_models[family], _texts()
    src, out = write_lines(tmp_path / "in.txt", texts), tmp_path / "out.txt"
    sys_file = tmp_path / "system.txt"
    sys_file.write_text("You translate.\nBriefly.", encoding="utf-8")
    head = [{"role": "system", "content": sys_file.read_text(encoding="utf-8")}] if system else []
    args = ["--chat", "--num-beams", str(beams), "--stats", str(tmp_path / "s.json")]
    res = _run(model, src, out, *args, *(["--system-prompt", f"@{sys_file}"] if system else []))
    assert res.exit_code == 0, res.stderr
    engine = json.loads((tmp_path / "s.json").read_text(encoding="utf-8"))["device"]["engine"]
    assert engine == f"{family} decoder"
    prompts = _chat_ids(model, [[*head, {"role": "user", "content": t}] for t in texts])
    assert out.read_text(encoding="utf-8").splitlines() == _alone(model, prompts, num_beams=beams)


@pytest.mark.parametrize("family", FAMILIES)
def test_a_messages_conversation_is_rendered_as_given(chat_models, tmp_path: Path, family: str) -> None:
    """JSONL ``messages`` under ``--chat``: the conversation as given, ``--system-prompt`` only where it has no
    system message of its own."""
    model = chat_models[family]
    conversations = [
        [{"role": "user", "content": "first question"}, {"role": "assistant", "content": "an answer"},
         {"role": "user", "content": "and a second one"}],
        [{"role": "system", "content": "its own system"}, {"role": "user", "content": "a question"}],
    ]  # fmt: skip
    src, out = tmp_path / "in.jsonl", tmp_path / "out.txt"
    src.write_text("".join(json.dumps({"messages": m}) + "\n" for m in conversations), encoding="utf-8")
    res = _run(model, src, out, "--chat", "--system-prompt", "the default system")
    assert res.exit_code == 0, res.stderr
    given = [[{"role": "system", "content": "the default system"}, *conversations[0]], conversations[1]]
    assert out.read_text(encoding="utf-8").splitlines() == _alone(model, _chat_ids(model, given))
    res = _run(model, src, tmp_path / "plain.txt")  # without --chat: a bad line that says what it needs
    one_line_error(res, "in.jsonl:1: no field", '"messages" conversation needs --chat')


def test_a_prompt_template_takes_the_input_and_jsonl_fields(chat_models, tmp_path: Path) -> None:
    """``--prompt-template @FILE`` on a base model: ``{input}`` and ``{field}`` replaced, other braces kept, the
    text tokenised as a plain input (special tokens added); the same tokens as generate() on it."""
    model = chat_models["llama"]
    template = tmp_path / "few-shot.txt"
    template.write_text('Example {"json": 1}\nTranslate to {lang}: {input}\nAnswer:', encoding="utf-8")
    rows = [{"text": t, "lang": lang} for t, lang in zip(_texts(), ["German", "French", "Dutch", "Czech"], strict=True)]
    src, out = tmp_path / "in.jsonl", tmp_path / "out.txt"
    src.write_text("".join(json.dumps(r) + "\n" for r in rows), encoding="utf-8")
    res = _run(model, src, out, "--prompt-template", f"@{template}")
    assert res.exit_code == 0, res.stderr
    tok = AutoTokenizer.from_pretrained(model)
    rendered = [f'Example {{"json": 1}}\nTranslate to {r["lang"]}: {r["text"]}\nAnswer:' for r in rows]
    assert out.read_text(encoding="utf-8").splitlines() == _alone(model, [tok(p)["input_ids"] for p in rendered])


def test_truncation_shortens_the_input_inside_the_template(chat_models, tmp_path: Path) -> None:
    """``--max-source-length`` with a template: the input text is cut, the instruction and the turn markers stay
    (before: the prompt's end was cut, the assistant's turn with it)."""
    model = chat_models["llama"]
    src = write_lines(tmp_path / "in.txt", [" ".join(sample_texts(3, seed=2))])
    prompter = Prompter(PromptSettings(chat=True), AutoTokenizer.from_pretrained(model))
    full = prompter.encode([src.read_text(encoding="utf-8").strip()], [None], None)[0].ids
    limit = len(full) - 20
    res = seqgen("generate", "-m", str(model), str(src), "--chat", "--max-source-length", str(limit), "--show-prompt")
    assert res.exit_code == 0, res.stderr
    shown, count = res.stdout.rstrip("\n").rsplit("\n", 1)
    assert shown.endswith("</s><|assistant|> ") and shown.startswith("<s><|user|> "), shown
    tokens = int(count.split(": ")[1].split()[0])
    assert tokens <= limit and "truncated to --max-source-length" in count
    res = _run(model, src, tmp_path / "out.txt", "--chat", "--max-source-length", str(limit))
    assert res.exit_code == 0, res.stderr


def test_show_prompt_prints_the_first_prompt_and_its_tokens(chat_models, tmp_path: Path) -> None:
    model = chat_models["gpt2"]
    src = write_lines(tmp_path / "in.txt", ["", "a first input", "another"])
    res = seqgen("generate", "-m", str(model), str(src), "--system-prompt", "Be brief.", "--show-prompt")
    assert res.exit_code == 0, res.stderr
    prompt = AutoTokenizer.from_pretrained(model).apply_chat_template(
        [{"role": "system", "content": "Be brief."}, {"role": "user", "content": "a first input"}],
        add_generation_prompt=True, tokenize=False,
    )  # fmt: skip
    shown, count = res.stdout.rstrip("\n").rsplit("\n", 1)
    assert shown == prompt and count.startswith("-- ") and "in.txt:2:" in count and "prompt tokens" in count


@pytest.mark.parametrize("beams", [1, 4])
@pytest.mark.parametrize("source", ["flag", "generation_config"])
def test_stop_strings_end_outputs_as_generate_does(chat_models, tmp_path: Path, source: str, beams: int) -> None:
    """``--stop`` and a checkpoint's ``stop_strings`` (before: "could not locate a tokenizer" on both backends):
    the outputs end where generate(stop_strings=..., tokenizer=...) ends them, greedy and beam search on the fast
    decoder and its refill lanes (beam search with stop strings ran generate() itself before)."""
    model, texts = copy_checkpoint(chat_models["llama"], tmp_path / "m"), _texts()
    src = write_lines(tmp_path / "in.txt", texts)
    plain = tmp_path / "plain.txt"
    assert _run(model, src, plain, "--num-beams", str(beams)).exit_code == 0
    first = plain.read_text(encoding="utf-8").splitlines()[0]
    tok = AutoTokenizer.from_pretrained(model)
    # two characters the first output reaches, that end generate()'s first output early: with beam search a
    # hypothesis a stop string finishes early can lose to longer ones, so not every pair of characters does
    for at in range(len(first) // 3, len(first) - 2):
        stop = first[at : at + 2]
        expected = _alone(model, [tok(t)["input_ids"] for t in texts], stop_strings=[stop], tokenizer=tok, num_beams=beams)
        if len(expected[0]) < len(first) and stop in expected[0]:
            break
    else:
        pytest.fail(f"no two characters of {first!r} end generate()'s first output early")
    if source == "generation_config":
        config = json.loads((model / "generation_config.json").read_text(encoding="utf-8"))
        (model / "generation_config.json").write_text(json.dumps({**config, "stop_strings": [stop]}), encoding="utf-8")
    for extra in ([], ["--refill"], ["--keep-stop"]):
        out, stats = tmp_path / "out.txt", tmp_path / "stats.json"
        args = ["--num-beams", str(beams), "--stats", str(stats), *extra, *(["--stop", stop] if source == "flag" else [])]
        res = _run(model, src, out, *args)
        assert res.exit_code == 0, res.stderr
        # the text written ends before the stop string (outputs.py) unless --keep-stop; generate()'s tokens keep it
        cut = expected if "--keep-stop" in extra else [cut_at_stop(e, [stop]) for e in expected]
        assert out.read_text(encoding="utf-8").splitlines() == cut, extra
        device = json.loads(stats.read_text(encoding="utf-8"))["device"]
        assert device.get("engine") == "llama decoder", device


def test_the_engine_refuses_stop_strings_without_their_check(tiny_models) -> None:
    """``search.generate`` on a config with ``stop_strings`` and no ``stop`` check: an error, not outputs that run
    past the stop string."""
    from transformers import GenerationConfig

    from seqgen_cli.generator import Generator
    from seqgen_cli.search import generate

    gen = Generator(str(tiny_models("llama")), max_new_tokens=4)
    config = GenerationConfig(**{**gen.config.to_dict(), "stop_strings": ["x"]})
    with pytest.raises(SeqgenError, match="stop_strings need"):
        generate(gen.model_backend(), gen.pad([[5, 6, 7]]), config)


def test_prompt_mistakes_are_one_line(chat_models, tiny_models, tmp_path: Path) -> None:
    src = write_lines(tmp_path / "in.txt", ["an input"])
    res = seqgen("generate", "-m", str(tiny_models("llama")), str(src), "--chat")
    one_line_error(res, "--chat: the tokenizer has no chat template", "--chat-template FILE")
    bad = tmp_path / "bad.jinja"
    bad.write_text("{% for m in messages %}{{ m['content'] }", encoding="utf-8")
    res = seqgen("generate", "-m", str(chat_models["llama"]), str(src), "--chat-template", str(bad))
    one_line_error(res, "--chat-template does not render")
    res = seqgen("generate", "-m", str(chat_models["llama"]), str(src), "--chat", "--chat-template-kwargs", "{x")
    one_line_error(res, "--chat-template-kwargs: not JSON")
    res = seqgen("generate", "-m", str(chat_models["llama"]), str(src), "--prompt-template", "no input here")
    one_line_error(res, "--prompt-template has no {input}")
    res = seqgen("generate", "-m", str(chat_models["llama"]), str(src), "--prompt-template", "{input} in {lang}", "-q")
    one_line_error(res, "in.txt:1: --prompt-template has {lang}, a field this input lacks")
    res = seqgen("generate", "-m", str(chat_models["llama"]), str(src), "--system-prompt", "@/no/such/file")
    one_line_error(res, "--system-prompt @/no/such/file: cannot read /no/such/file")


def test_a_template_whose_own_tokens_pass_the_limit_is_a_bad_input(chat_models) -> None:
    prompter = Prompter(PromptSettings(template="A long instruction of many words first: {input}"),
                        AutoTokenizer.from_pretrained(chat_models["gpt2"]))  # fmt: skip
    (p,) = prompter.encode(["x y z"], [None], 4)
    assert p.error is not None and "template alone takes" in p.error and p.ids == []
    with pytest.raises(SeqgenError, match="no {input}"):
        PromptSettings(template="nothing")


FEW_SHOT = (
    "You translate English into German. Examples:\nEnglish: the house is small\nGerman: das Haus ist klein\n"
    "English: I read a book\nGerman: ich lese ein Buch\nEnglish: {input}\nGerman:"
)


@pytest.mark.parametrize("beams", [1, 4])
@pytest.mark.parametrize("family", FAMILIES)
def test_a_few_shot_prompt_is_prefilled_once_with_generates_tokens(chat_models, tmp_path: Path, family: str, beams: int) -> None:
    """A few-shot ``--prompt-template``: the text before the input is one segment of the prompt tree, prefilled once
    per run (``--stats`` ``device.prompt_tree``), each input's own tokens over it, in batches and on refill lanes,
    with the tokens of generate() on each whole prompt alone."""
    model, texts = chat_models[family], _texts(6)
    src = write_lines(tmp_path / "in.txt", texts)
    tok = AutoTokenizer.from_pretrained(model)
    expected = _alone(model, [tok(FEW_SHOT.replace("{input}", t))["input_ids"] for t in texts], num_beams=beams)
    head = len(tok(FEW_SHOT.split("{input}")[0].rsplit(" ", 1)[0])["input_ids"])  # its tokens, at least
    for refill in ("--no-refill", "--refill"):
        out, stats = tmp_path / f"out{refill}.txt", tmp_path / f"s{refill}.json"
        args = ["--prompt-template", FEW_SHOT, "--num-beams", str(beams), "--batch-size", "4", refill, "--stats", str(stats)]
        res = _run(model, src, out, *args)
        assert res.exit_code == 0, res.stderr
        assert out.read_text(encoding="utf-8").splitlines() == expected, refill
        tree = json.loads(stats.read_text(encoding="utf-8"))["device"]["prompt_tree"]
        assert tree["segments"] == 1 + len(texts) and tree["shared"] == 1, tree  # the instruction once, each input's own
        assert tree["saved"] >= (len(texts) - 1) * head, tree


def _few_shot(task: str, examples: int) -> list[dict[str, str]]:
    """A system turn (``task``) and ``examples`` user/assistant pairs."""
    pairs = [(f"example question {i} about {task} and more words", f"the answer {i} to it, in a sentence") for i in range(examples)]
    turns = [m for q, a in pairs for m in ({"role": "user", "content": q}, {"role": "assistant", "content": a})]
    return [{"role": "system", "content": f"You do {task}. Answer briefly, in one sentence, as the examples do."}, *turns]


@pytest.mark.parametrize("family", FAMILIES)
def test_conversations_share_every_common_prefix_with_generates_tokens(chat_models, tmp_path: Path, family: str) -> None:
    """JSONL ``messages`` conversations of several tasks (each its own system turn and few-shot examples, some with
    fewer examples): every message they share is prefilled once per run (``--stats`` ``device.prompt_tree``), in
    batches and on refill lanes, with the tokens of generate() on each whole conversation alone (before: nothing
    shared, every prompt prefilled whole)."""
    model, texts = chat_models[family], _texts(8)
    heads = [_few_shot("translation", 2), _few_shot("summaries", 2), _few_shot("translation", 1)]
    conversations = [[*heads[i % 3], {"role": "user", "content": t}] for i, t in enumerate(texts)]
    src = tmp_path / "in.jsonl"
    src.write_text("".join(json.dumps({"messages": m}) + "\n" for m in conversations), encoding="utf-8")
    expected = _alone(model, _chat_ids(model, conversations))
    for refill in ("--no-refill", "--refill"):
        out, stats = tmp_path / f"out{refill}.txt", tmp_path / f"s{refill}.json"
        res = _run(model, src, out, "--chat", "--batch-size", "3", refill, "--stats", str(stats))
        assert res.exit_code == 0, res.stderr
        assert out.read_text(encoding="utf-8").splitlines() == expected, refill
        tree = json.loads(stats.read_text(encoding="utf-8"))["device"]["prompt_tree"]
        assert tree["shared"] >= 4 and tree["saved"] > tree["tokens"], tree  # two systems, their examples


def test_breaks_fall_after_each_message_and_before_the_input_the_same_for_every_prompt_that_shares_them(chat_models) -> None:
    """``Prompter.breaks``: after each message of a conversation but the last and before the input's text (after a
    system prompt, a template's instruction), each a token count whose tokens every prompt with the same text up
    to there has too; none without a fast tokenizer's offsets, none asked for (an encoder-decoder)."""
    tok = AutoTokenizer.from_pretrained(chat_models["llama"])
    settings = PromptSettings(chat=True, system_prompt="You translate news. Answer briefly.", template="In German: {input}")
    texted = Prompter(settings, tok, breaks=True)
    a, b = (texted.encode([t], [None], None)[0] for t in ("The cat sleeps.", "Nobody came to the old house."))
    assert len(a.breaks) == 2 and a.breaks == b.breaks, (a.breaks, b.breaks)
    assert a.ids[: a.breaks[-1]] == b.ids[: b.breaks[-1]] and a.ids[a.breaks[-1]] != b.ids[b.breaks[-1]]
    assert tok.decode(a.ids[: a.breaks[0]]).endswith("Answer briefly.") and "German" not in tok.decode(a.ids[: a.breaks[0]])
    chat = Prompter(PromptSettings(chat=True), tok, breaks=True)
    first = [{"role": "system", "content": "You answer questions."}, {"role": "user", "content": "What is two and two?"},
             {"role": "assistant", "content": "Four."}]  # fmt: skip
    convo = [chat.encode([""], [{"messages": [*first, {"role": "user", "content": q}]}], None)[0] for q in ("Why?", "And three?")]
    other = chat.encode([""], [{"messages": [*first[:2], {"role": "assistant", "content": "Five."}]}], None)[0]
    assert len(convo[0].breaks) == 3 and convo[0].breaks == convo[1].breaks
    assert convo[0].ids[: convo[0].breaks[-1]] == convo[1].ids[: convo[1].breaks[-1]]
    assert other.breaks == convo[0].breaks[:2] and other.ids[: other.breaks[-1]] == convo[0].ids[: other.breaks[-1]]
    assert Prompter(settings, tok).encode(["The cat sleeps."], [None], None)[0].breaks == ()
    slow = Prompter(PromptSettings(prefix="Translate: "), type("Slow", (), {"is_fast": False})(), breaks=True)
    assert slow.find_breaks is False  # a slow tokenizer has no offsets


def test_a_jsonl_input_is_a_text_or_a_conversation_never_both(chat_models, tmp_path: Path) -> None:
    """Under ``--chat`` an object with ``text`` and ``messages`` had its text dropped silently; and a
    ``--prompt-template`` was ignored for a conversation. Both are bad lines naming what to drop."""
    model = chat_models["gpt2"]
    both = {"text": "a text", "messages": [{"role": "user", "content": "a message"}]}
    src, out = tmp_path / "in.jsonl", tmp_path / "out.jsonl"
    src.write_text(json.dumps({"text": "fine"}) + "\n" + json.dumps(both) + "\n", encoding="utf-8")
    res = _run(model, src, out, "--chat")
    one_line_error(res, "in.jsonl:2:", "'text' and \"messages\" both given", "keep one")
    skipped = tmp_path / "skipped.jsonl"
    res = _run(model, src, skipped, "--chat", "--on-error", "skip", "--output-format", "jsonl")
    rows = [json.loads(line) for line in skipped.read_text(encoding="utf-8").splitlines()]
    assert res.exit_code == 0 and "error" not in rows[0] and "both given" in rows[1]["error"]
    convo = tmp_path / "convo.jsonl"
    convo.write_text(json.dumps({"messages": both["messages"]}) + "\n", encoding="utf-8")
    res = _run(model, convo, tmp_path / "convo.out", "--chat", "--prompt-template", "Translate: {input}")
    one_line_error(res, "convo.jsonl:1:", "--prompt-template applies to a text input", "drop one")


def test_an_input_truncated_to_nothing_is_a_bad_line(chat_models, tmp_path: Path) -> None:
    """``--max-source-length`` below the template's own tokens plus one left every user message empty: identical
    outputs of the template alone, exit 0. A template repeating ``{input}`` ran on its spaces."""
    model = chat_models["gpt2"]
    tok = AutoTokenizer.from_pretrained(model)
    src = write_lines(tmp_path / "in.txt", ["a first input of several words", "another input here"])
    chat = tmp_path / "chat.jinja"  # each message between special tokens: no input token merges with the template's
    chat.write_text("{% for m in messages %}{{ bos_token }}{{ m['content'] }}{{ eos_token }}{% endfor %}", encoding="utf-8")
    system = ("--chat-template", str(chat), "--system-prompt", "You translate English into German, carefully.")
    settings = PromptSettings(system_prompt=system[-1], chat_template=chat.read_text(encoding="utf-8"))
    template = len(Prompter(settings, tok).encode([""], [None], None)[0].ids)
    res = _run(model, src, tmp_path / "out.txt", *system, "--max-source-length", str(template))
    one_line_error(res, "in.txt:1:", f"a prompt of at most {template} tokens", "leaves none of the input's text")
    res = _run(model, src, tmp_path / "cut.txt", *system, "--max-source-length", str(template + 2))
    assert res.exit_code == 0, res.stderr  # two tokens of each input: an output of the input, cut
    (p,) = Prompter(PromptSettings(template=" {input}" * 1000), tok).encode(["hello"], [None], 1000 + 2)
    assert p.error is not None and "leaves none of the input's text" in p.error
    (p,) = Prompter(PromptSettings(prefix="a long prefix of many words "), tok).encode(["hello"], [None], 3)
    assert p.error is not None and "beside --prefix" in p.error


def test_reasoning_in_a_field_needs_jsonl_output(chat_models, tmp_path: Path) -> None:
    src = write_lines(tmp_path / "in.txt", ["an input"])
    res = _run(chat_models["gpt2"], src, tmp_path / "out.txt", "--reasoning", "field")
    one_line_error(res, "--reasoning field", "add --output-format jsonl")


def test_limits_are_named_as_the_user_set_them(chat_models, tmp_path: Path) -> None:
    """A prompt over the limit names where the limit comes from: the model's context less the new tokens (it named
    a ``--max-source-length`` nobody gave), or the flag given."""
    model = chat_models["gpt2"]
    src = write_lines(tmp_path / "in.txt", ["an input"])
    system = ("--chat", "--system-prompt", " ".join(["a long system prompt"] * 20))
    context = AutoConfig.from_pretrained(model).n_positions
    res = seqgen("generate", "-m", str(model), str(src), *system, "--max-new-tokens", str(context - 24), "-q")
    one_line_error(res, "in.txt:1:", f"more than 24 (the model's context of {context} positions less {context - 24} new")
    assert "--max-source-length" not in res.stderr
    res = _run(model, src, tmp_path / "out.txt", *system, "--max-source-length", "30")
    one_line_error(res, "in.txt:1:", "more than 30 (--max-source-length 30)")


def test_chat_without_a_length_generates_to_the_end_of_turn(chat_models) -> None:
    """``--chat`` where no limit is set: transformers' 20 new tokens cut an LLM's answer short; up to 1024 (at most
    half the context) instead, said once before the run. A limit set anywhere stays; without ``--chat``, 20."""
    from seqgen_cli.config import CHAT_NEW_TOKENS
    from seqgen_cli.generator import Generator, startup_notes

    model = chat_models["gpt2"]
    context = AutoConfig.from_pretrained(model).n_positions
    gen = Generator(str(model), prompt=PromptSettings(chat=True))
    assert gen.config.max_new_tokens == gen.chat_length == min(CHAT_NEW_TOKENS, context // 2)
    assert gen.default_length is None and gen.max_source_length == context - gen.chat_length
    assert any(f"up to {gen.chat_length} new tokens" in n for n in startup_notes(gen, {}))
    gen = Generator(str(model), prompt=PromptSettings(chat=True), max_new_tokens=8)
    assert gen.config.max_new_tokens == 8 and gen.chat_length is None
    gen = Generator(str(model))
    assert gen.chat_length is None and gen.default_length == 20


def test_a_chat_template_that_spins_is_stopped_in_one_line(chat_models, tmp_path: Path) -> None:
    """Nested loops (1e10 iterations) spun without end, as in transformers: rendering is bounded in steps."""
    spin = tmp_path / "spin.jinja"
    spin.write_text("{% for i in range(100000) %}{% for j in range(100000) %}{% endfor %}{% endfor %}x", encoding="utf-8")
    src = write_lines(tmp_path / "in.txt", ["an input"])
    res = seqgen("generate", "-m", str(chat_models["gpt2"]), str(src), "--chat-template", str(spin))
    one_line_error(res, "--chat-template did not finish rendering a prompt", "fix the template")


def test_a_chat_templates_time_is_bounded_on_the_clock_given(chat_models) -> None:
    """The time bound (a filter's C loop runs no template lines): a clock that moves a second a call passes
    ``RENDER_SECONDS`` after as many lines; the previous tracer is put back."""
    from seqgen_cli import prompts

    tok = AutoTokenizer.from_pretrained(chat_models["gpt2"])
    ticks = iter(range(10**6))
    before = sys.gettrace()
    with pytest.raises(SeqgenError, match="the template x did not finish"), prompts.bounded("the template x", lambda: float(next(ticks))):
        tok.apply_chat_template([{"role": "user", "content": "x"}], tokenize=False)
    assert sys.gettrace() is before
    assert int(prompts.RENDER_SECONDS) + 2 <= next(ticks) < 100  # stopped within a few lines past the bound


def test_chat_template_kwargs_that_are_the_calls_own_name_the_flag(chat_models, tmp_path: Path) -> None:
    src = write_lines(tmp_path / "in.txt", ["an input"])
    for key in ("add_generation_prompt", "tokenize", "messages"):
        res = seqgen("generate", "-m", str(chat_models["gpt2"]), str(src), "--chat", "--chat-template-kwargs",
                     json.dumps({key: False}))  # fmt: skip
        line = one_line_error(res, f"--chat-template-kwargs {key}: seqgen sets it itself")
        assert "chat template does not render" not in line


def test_a_text_option_file_loses_one_final_newline(chat_models, tmp_path: Path) -> None:
    """``--system-prompt @FILE`` kept the newline an editor saves: other tokens than the same text typed inline."""
    model, src = chat_models["gpt2"], write_lines(tmp_path / "in.txt", ["an input"])
    saved = tmp_path / "system.txt"
    saved.write_text("Be brief.\nVery brief.\n", encoding="utf-8")
    shown = [seqgen("generate", "-m", str(model), str(src), "--system-prompt", v, "--show-prompt").stdout
             for v in (f"@{saved}", "Be brief.\nVery brief.")]  # fmt: skip
    assert shown[0] == shown[1] and "Very brief." in shown[0]
    saved.write_text("Be brief.\n\n", encoding="utf-8")  # only one newline goes
    assert read_text_option(f"@{saved}", "--system-prompt") == "Be brief.\n"


TOOLS_TEMPLATE = (
    "{% if tools %}<|tools|> {{ tools | tojson }}{{ eos_token }}{% endif %}"
    "{% for m in messages %}<|{{ m['role'] }}|> "
    "{% if m['content'] is string %}{{ m['content'] }}"
    "{% elif m['content'] %}{% for p in m['content'] %}{{ p['text'] }}{% endfor %}"
    "{% else %}{% for c in m['tool_calls'] %}call {{ c['function']['name'] }}{% endfor %}{% endif %}"
    "{{ eos_token }}{% endfor %}{% if add_generation_prompt %}<|assistant|> {% endif %}"
)


@pytest.mark.parametrize("family", FAMILIES)
def test_a_conversation_ending_in_an_assistant_message_is_continued(chat_models, tmp_path: Path, family: str) -> None:
    """A prefill ("Translation:" as the assistant's last message): the turn was closed and a new one opened; now
    continued, as ``apply_chat_template(continue_final_message=True)`` + ``generate()``."""
    model = chat_models[family]
    conversations = [
        [{"role": "user", "content": "translate the house is small"}, {"role": "assistant", "content": "Translation:"}],
        [{"role": "user", "content": "and a second one"}],
    ]
    src, out = tmp_path / "in.jsonl", tmp_path / "out.txt"
    src.write_text("".join(json.dumps({"messages": m}) + "\n" for m in conversations), encoding="utf-8")
    assert _run(model, src, out, "--chat").exit_code == 0
    tok = AutoTokenizer.from_pretrained(model)
    prefill = tok.apply_chat_template(conversations[0], continue_final_message=True, tokenize=True, return_dict=True)
    assert not tok.decode(prefill["input_ids"]).endswith("<|assistant|> ")  # the turn stays open, mid-message
    want = _alone(model, [prefill["input_ids"], *_chat_ids(model, conversations[1:])])
    assert out.read_text(encoding="utf-8").splitlines() == want


def test_tools_content_parts_and_tool_calls_as_apply_chat_template_takes_them(chat_models, tmp_path: Path) -> None:
    """A JSONL ``tools`` field was ignored; content as a list of parts, and ``null`` beside ``tool_calls``, were
    refused. ``--chat-template`` takes the template's text as well as a file."""
    model = chat_models["llama"]
    tools = [{"type": "function", "function": {"name": "lookup", "description": "find a word",
                                               "parameters": {"type": "object", "properties": {}}}}]  # fmt: skip
    messages = [
        {"role": "user", "content": [{"type": "text", "text": "what is "}, {"type": "text", "text": "a house"}]},
        {"role": "assistant", "content": None, "tool_calls": [{"type": "function", "function": {"name": "lookup", "arguments": {}}}]},
        {"role": "tool", "content": "a building"},
        {"role": "user", "content": "and so?"},
    ]  # fmt: skip
    src, out = tmp_path / "in.jsonl", tmp_path / "out.txt"
    src.write_text(json.dumps({"messages": messages, "tools": tools}) + "\n", encoding="utf-8")
    res = _run(model, src, out, "--chat-template", TOOLS_TEMPLATE)
    assert res.exit_code == 0, res.stderr
    tok = AutoTokenizer.from_pretrained(model)
    ids = tok.apply_chat_template(messages, tools=tools, chat_template=TOOLS_TEMPLATE, add_generation_prompt=True,
                                  tokenize=True, return_dict=True)["input_ids"]  # fmt: skip
    assert "lookup" in tok.decode(ids) and "a house" in tok.decode(ids)
    assert out.read_text(encoding="utf-8").splitlines() == _alone(model, [ids])
    src.write_text(json.dumps({"messages": messages, "tools": "lookup"}) + "\n", encoding="utf-8")
    one_line_error(_run(model, src, tmp_path / "bad.txt", "--chat-template", TOOLS_TEMPLATE), '"tools" must be a list')


def test_a_stop_string_no_token_spells_is_one_line(tiny_models, tmp_path: Path) -> None:
    """The tiny Llama's vocabulary has no newline: ``--stop $'\\n'`` was an internal error (transformers'
    ValueError), exit 1."""
    src = write_lines(tmp_path / "in.txt", ["an input"])
    res = seqgen("generate", "-m", str(tiny_models("llama")), str(src), "--stop", "\n", "--max-new-tokens", "3")
    one_line_error(res, 'stop strings "\\n"', "no token of the model's vocabulary")
    assert res.exit_code == 2
