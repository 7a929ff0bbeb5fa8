"""`seqgen generate --stop-token-id ID`: an output ends at that token too, beside the model's EOS ids, on both
engines as `generate(eos_token_id=[...])` ends it; an id the model does not have is one line."""

from __future__ import annotations

from seqgen_cli.generator import Generator
from tests.helpers import one_line_error, seqgen

STDIN = "The weather today\nA list of\n"


def test_an_output_ends_at_a_stop_token(tiny_models) -> None:
    gpt2 = str(tiny_models("gpt2"))
    gen = Generator(gpt2, max_new_tokens=8)
    batch = [e.ids for e in gen.encode(STDIN.splitlines())]
    first = gen.generate_ids(batch)[0][0]
    stop = first[len(first) // 2]  # a token in the middle of the first output
    fast, hf = (Generator(gpt2, backend=b, max_new_tokens=8, stop_token_id=[stop]).generate_ids(batch) for b in ("fast", "hf"))
    assert fast == hf and fast[0][0] == first[: first.index(stop) + 1], "ends at the stop token, which stays"
    run = seqgen("generate", "-m", gpt2, "--max-new-tokens", "8", "-q", "--stop-token-id", str(stop), input=STDIN)
    assert run.exit_code == 0 and run.stdout.splitlines()[0] == " ".join(gen.detokenise([fast[0][0]])[0].splitlines())


def test_a_stop_token_past_the_vocabulary_is_one_line(tiny_models) -> None:
    result = seqgen("generate", "-m", str(tiny_models("gpt2")), "--stop-token-id", "99999", input=STDIN)
    assert "not a token of the model" in one_line_error(result, "--stop-token-id")
