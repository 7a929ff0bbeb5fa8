"""One width rule for every backend, and the variants whose outputs depend on their batch.

* Length-dependent RoPE (Phi-3 ``longrope``, on the generic backend): transformers picks the long or the short
  factors from the batch's furthest position, and Phi-3's ``prepare_inputs_for_generation`` runs the whole
  sequence again once its *padded* length passes ``original_max_position_embeddings``: ``generate()``'s outputs
  depend on the padding and on the neighbours' lengths. seqgen runs such a model unpadded, in batches of one
  length, feeding the model the whole sequences as ``generate()`` does: every output is ``generate()``'s on its
  input alone, whatever the batch, with ``--backend hf`` too, and ``--verify`` compares the batches the run cuts.
* The generic backend pads a batch to its widest input: an encoder-decoder model on it is batched by width
  bucket, as every backend that does not run each input at its own width.
"""

from __future__ import annotations

import json
from collections import Counter
from pathlib import Path

import pytest
import torch
import transformers as tf

from seqgen_cli.generator import Generator
from seqgen_cli.models import backend_name
from seqgen_cli.models.families import length_dependent_rope
from seqgen_cli.models.reference import strip_generated
from seqgen_cli.shapes import input_width
from seqgen_cli.verify import verify
from tests.helpers import seqgen, with_fixture_tokenizer
from tests.tiny_models import sample_texts, sharpen

NEW_TOKENS = 16
ORIGINAL = 32  # original_max_position_embeddings: the prompts (10-41 tokens) and outputs cross it
LONGROPE = dict(
    rope_type="longrope", rope_theta=10000.0, short_factor=[1.0] * 4, long_factor=[3.0, 5.0, 9.0, 17.0]
)  # fmt: skip
PHI3_SHAPE = dict(
    vocab_size=601, hidden_size=32, num_attention_heads=4, num_key_value_heads=2, head_dim=8, intermediate_size=64,
    num_hidden_layers=2, max_position_embeddings=128, pad_token_id=0, bos_token_id=1, eos_token_id=2,
)  # fmt: skip
LENGTHS = [24, 20, 31, 26, 29, 25, 30, 27, 24, 26, 40, 10]  # tokens after BOS: some share a length


def alone(model: tf.PreTrainedModel, ids: list[int], eos: int) -> list[int]:
    """``generate()`` on one input, unpadded, as a user runs it."""
    prompt = torch.tensor([ids])
    out = model.generate(prompt, attention_mask=torch.ones_like(prompt), max_new_tokens=NEW_TOKENS)
    return strip_generated(out[0, len(ids) :].tolist(), eos)


@pytest.fixture(scope="module")
def longrope(tiny_models, tmp_path_factory: pytest.TempPathFactory) -> tuple[Path, list[str]]:
    """A tiny Phi-3 with ``longrope`` (its EOS a token its greedy outputs often reach, so outputs end at varied
    lengths and inputs leave their batches) and texts of 10-41 tokens."""
    path = tmp_path_factory.mktemp("phi3-longrope")
    config = tf.Phi3Config(
        sliding_window=None, rope_parameters=LONGROPE, original_max_position_embeddings=ORIGINAL, **PHI3_SHAPE
    )
    torch.manual_seed(0)
    model = sharpen(tf.AutoModelForCausalLM.from_config(config), seed=1).eval()
    tokenizer = tf.AutoTokenizer.from_pretrained(with_fixture_tokenizer(path, tiny_models("llama")))
    stream = [t for s in tokenizer(sample_texts(40, seed=5))["input_ids"] for t in s[1:]]
    texts = [tokenizer.decode(stream[50 * i : 50 * i + n]) for i, n in enumerate(LENGTHS)]
    with torch.inference_mode():
        firsts = [alone(model, ids, eos=-1) for ids in tokenizer(texts)["input_ids"]]
    model.generation_config.eos_token_id = Counter(t for s in firsts for t in s[2:12]).most_common(1)[0][0]
    model.save_pretrained(path)
    return path, texts


def test_a_longrope_phi3_gives_generate_s_tokens_for_each_input_alone(longrope) -> None:
    """The generic backend and ``--backend hf`` at a batch of 8: each input's tokens are ``generate()``'s on it
    alone (before: 4 and 5 of 12, the padding and the neighbours choosing the factors and the recompute)."""
    path, texts = longrope
    fast = Generator(str(path), backend="fast", max_new_tokens=NEW_TOKENS)
    hf = Generator(str(path), backend="hf", max_new_tokens=NEW_TOKENS)
    assert backend_name(fast.model_backend()).startswith("generic") and fast.exact_widths == "longrope"
    ids = [e.ids for e in fast.encode(texts)]
    assert len({len(x) for x in ids}) < len(ids) and min(map(len, ids)) < ORIGINAL < max(map(len, ids))
    eos = hf.model.generation_config.eos_token_id
    with torch.inference_mode():
        expected = [hf.detokenise([alone(hf.model, x, eos)]) for x in ids]
    assert len({len(e[0]) for e in expected}) > 2, "outputs of varied lengths: inputs leave their batches"
    assert fast.generate(texts, batch_size=8) == expected
    assert hf.generate(texts, batch_size=8) == expected


def test_a_length_dependent_rope_batches_by_length_unpadded(longrope) -> None:
    """The batcher's and the padding's width for such a model: an input's own length (before: its bucket's, a
    batch mixing lengths)."""
    from seqgen_cli.batching import text_chunks

    path, texts = longrope
    gen = Generator(str(path), max_new_tokens=NEW_TOKENS)
    assert gen.width(25) == 25 and gen.buckets
    assert gen.pad([[5] * 25, [6] * 27]).input_ids.shape == (2, 27), "padded to the longer input only"
    batches = list(gen.batcher(text_chunks(texts, gen.encode), lambda items: None, batch_size=8))
    lengths = [{len(it.ids) for it in b.items} for b in batches]
    assert all(len(n) == 1 for n in lengths) and max(len(b.items) for b in batches) > 1, lengths


def test_verify_compares_the_batches_the_run_cuts(longrope, monkeypatch) -> None:
    """``--verify`` on such a model: the inputs of each length as one batch, as the run batches them (before: one
    batch of mixed lengths, whose tokens the run does not give: 8/8 reported while the run's lines differed), and
    each of them ``generate()``'s tokens."""
    path, texts = longrope
    gen = Generator(str(path), max_new_tokens=NEW_TOKENS)
    ids = [e.ids for e in gen.encode(texts)]
    seen: list[list[int]] = []
    run = gen.generate_output
    monkeypatch.setattr(
        gen, "generate_output", lambda batch, *a, **k: seen.append([len(x) for x in batch]) or run(batch, *a, **k)
    )
    agreement = verify(gen, ids, names=[f"line {i + 1}" for i in range(len(ids))])
    assert all(len(set(batch)) == 1 for batch in seen) and sorted(sum(seen, [])) == sorted(map(len, ids)), seen
    assert agreement.total == len(ids) and agreement.identical == len(ids), agreement.summary()


def test_the_cli_gives_generate_s_lines_with_either_backend(longrope, tmp_path: Path) -> None:
    """Where the user meets it: ``seqgen generate`` on the generic backend and with ``--backend hf`` (its
    default batch), each line ``generate()``'s on its input alone, and ``--verify`` saying so."""
    path, texts = longrope
    src = tmp_path / "in.txt"
    src.write_text("".join(" ".join(t.split()) + "\n" for t in texts), encoding="utf-8")
    gen = Generator(str(path), backend="hf", max_new_tokens=NEW_TOKENS)
    eos = gen.model.generation_config.eos_token_id
    with torch.inference_mode():
        outputs = [gen.detokenise([alone(gen.model, e.ids, eos)])[0] for e in gen.encode(src.read_text().splitlines())]
    expected = "".join(" ".join(o.splitlines()) + "\n" for o in outputs)  # the text format's line
    for backend in ("fast", "hf"):
        out, stats = tmp_path / f"{backend}.txt", tmp_path / f"{backend}.json"
        res = seqgen(
            "generate", "-m", str(path), str(src), "-o", str(out), "--backend", backend, "--device", "cpu",
            "--max-new-tokens", str(NEW_TOKENS), "--verify", "8", "--stats", str(stats),
        )  # fmt: skip
        assert res.exit_code == 0, res.stderr
        assert out.read_text(encoding="utf-8") == expected, backend
        if backend == "fast":
            report = json.loads(stats.read_text(encoding="utf-8"))["verify"]
            assert report["identical"] == report["total"] == 8, report


def test_only_length_dependent_kinds_count() -> None:
    """``longrope`` and the ``dynamic`` kinds choose their frequencies by the length; the static ones do not."""
    phi3 = tf.Phi3Config(
        sliding_window=None, rope_parameters=LONGROPE, original_max_position_embeddings=ORIGINAL, **PHI3_SHAPE
    )
    assert length_dependent_rope(phi3) == "longrope"
    dynamic = tf.LlamaConfig(rope_parameters={"rope_type": "dynamic", "factor": 2.0, "rope_theta": 10000.0})
    assert length_dependent_rope(dynamic) == "dynamic"
    assert length_dependent_rope(tf.LlamaConfig()) is None and length_dependent_rope(tf.BartConfig()) is None


# -- the generic backend's width rule (an encoder-decoder family without a fast decoder) ------------------------


@pytest.fixture(scope="module")
def blenderbot_small(tiny_models, tmp_path_factory: pytest.TempPathFactory) -> Path:
    """A tiny BlenderbotSmall checkpoint (no fast decoder: the generic backend) with the BART fixture's
    tokenizer."""
    path = tmp_path_factory.mktemp("blenderbot-small")
    config = tf.BlenderbotSmallConfig(
        vocab_size=601, d_model=32, encoder_layers=2, decoder_layers=2, encoder_attention_heads=4,
        decoder_attention_heads=4, encoder_ffn_dim=64, decoder_ffn_dim=64, max_position_embeddings=512,
        pad_token_id=1, bos_token_id=0, eos_token_id=2, decoder_start_token_id=2,
    )  # fmt: skip
    torch.manual_seed(0)
    sharpen(tf.AutoModelForSeq2SeqLM.from_config(config), seed=2).save_pretrained(path)
    return with_fixture_tokenizer(path, tiny_models("bart"))


def test_the_generic_backend_batches_an_encoder_decoder_model_by_width(blenderbot_small) -> None:
    """The generic backend pads a batch's sources to its widest (before: batches mixed widths, a short source
    padded to up to ~96x its own width, its outputs depending on its neighbours): one bucket per batch, as for
    every backend that does not run each source at its own width, and each output the one it has alone."""
    from seqgen_cli.batching import text_chunks

    gen = Generator(str(blenderbot_small), max_new_tokens=6)
    assert backend_name(gen.model_backend()).startswith("generic") and gen.buckets
    texts = sample_texts(40, seed=4)
    batches = list(gen.batcher(text_chunks(texts, gen.encode), lambda items: None, batch_size=8))
    widths = [{input_width(len(it.ids)) for it in b.items} for b in batches]
    assert len(batches) > 1 and all(len(w) == 1 for w in widths), widths
    together = gen.generate(texts, batch_size=8)
    assert together == [gen.generate([t], batch_size=1)[0] for t in texts]


def test_refill_where_it_cannot_run_says_so(blenderbot_small, tiny_models, tmp_path: Path) -> None:
    """``--refill`` on the generic backend, on ``generate()`` and with ``--dtype int8``: a note naming why it does
    not run (before: ignored without a word), and the run as without it."""
    src = tmp_path / "in.txt"
    src.write_text("a first line\nanother line\n", encoding="utf-8")
    cases = [
        (blenderbot_small, [], "the generic ("),
        (tiny_models("bart"), ["--backend", "hf"], "transformers generate() runs this model"),
        (tiny_models("bart"), ["--dtype", "int8"], "--dtype int8 runs without lanes"),
    ]
    for model, flags, why in cases:
        res = seqgen("generate", "-m", str(model), str(src), "--max-new-tokens", "3", "--refill", *flags)
        assert res.exit_code == 0, res.stderr
        notes = [line for line in res.stderr.splitlines() if "--refill does not run here" in line]
        assert len(notes) == 1 and why in notes[0], res.stderr
