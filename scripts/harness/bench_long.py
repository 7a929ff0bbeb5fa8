"""Long documents: LED at led-large-16384's shape on 4,096-token CNN/DM-style sources (articles concatenated),
beam 4: seqgen's fast decoder against ``generate()``, the decode alone (the encoder runs once, outside the timing,
and both decode from its output), quiet and beside a busy process, interleaved, medians and spread, and whether the
outputs are identical. From the repository root::

    python scripts/harness/bench_long.py --inputs 2 --new-tokens 64 --rounds 3

``--encoder`` times the encoders instead, quiet: the model's own module against the fast backend's (its products on
oneDNN, ``linear_maps.onednn_copy``) on the same sources, alternating, and their largest difference.

The checkpoint (random weights, seed 0; led-large-16384's published config: d_model 1024, 12 + 12 layers, 16 heads,
ffn 4096, 16,384 encoder positions, attention window 1024; the BART tokenizer of ``../shared/tokenizers/
bart-large-cnn``) is built once into ``~/.cache/seqgen-bench/led-large-16384``.
"""

from __future__ import annotations

import argparse
import statistics
import subprocess
import sys
import time
from pathlib import Path

import torch

REPO = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(REPO))

from seqgen_cli.config import resolve_generation_config  # noqa: E402
from seqgen_cli.models import get_backend  # noqa: E402
from seqgen_cli.search import Batch, generate  # noqa: E402

CACHE = Path("~/.cache/seqgen-bench/led-large-16384").expanduser()
SHARED = REPO.parent / "shared"
LED_LARGE = dict(
    vocab_size=50265, d_model=1024, encoder_layers=12, decoder_layers=12, encoder_attention_heads=16,
    decoder_attention_heads=16, encoder_ffn_dim=4096, decoder_ffn_dim=4096, max_encoder_position_embeddings=16384,
    max_decoder_position_embeddings=1024, attention_window=[1024] * 12, activation_function="gelu",
    pad_token_id=1, bos_token_id=0, eos_token_id=2, decoder_start_token_id=2,
)  # fmt: skip


def checkpoint() -> Path:
    """The LED checkpoint folder (built on first use)."""
    from transformers import AutoTokenizer, LEDConfig, LEDForConditionalGeneration

    if not (CACHE / "model.safetensors").is_file():
        torch.manual_seed(0)
        LEDForConditionalGeneration(LEDConfig(**LED_LARGE)).save_pretrained(CACHE)
        AutoTokenizer.from_pretrained(SHARED / "tokenizers" / "bart-large-cnn").save_pretrained(CACHE)
    return CACHE


def long_sources(tokenizer: object, n: int, tokens: int) -> Batch:
    """``n`` sources of ``tokens`` tokens: consecutive CNN/DM articles concatenated, cut at ``tokens``."""
    lines = (SHARED / "data" / "cnndm" / "fastseq128" / "cnndm_128.txt").read_text(encoding="utf-8").splitlines()
    ids, at = [], 0
    for _ in range(n):
        row: list[int] = []
        while len(row) < tokens:
            row += tokenizer(lines[at % len(lines)], add_special_tokens=False)["input_ids"]
            at += 1
        ids.append([0, *row[: tokens - 2], 2])
    t = torch.tensor(ids)
    return Batch(t, torch.ones_like(t))


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--inputs", type=int, default=2)
    ap.add_argument("--tokens", type=int, default=4096)
    ap.add_argument("--new-tokens", type=int, default=64, help="exactly this many (min = max)")
    ap.add_argument("--rounds", type=int, default=3)
    ap.add_argument("--encoder", action="store_true", help="time the two encoders instead (see above)")
    args = ap.parse_args()
    from transformers import AutoTokenizer, LEDForConditionalGeneration
    from transformers.modeling_outputs import BaseModelOutput

    torch.set_num_threads(2)
    path = checkpoint()
    model = LEDForConditionalGeneration.from_pretrained(path).eval()
    batch = long_sources(AutoTokenizer.from_pretrained(path), args.inputs, args.tokens)
    settings = dict(
        num_beams=4, no_repeat_ngram_size=3, max_new_tokens=args.new_tokens, min_new_tokens=args.new_tokens
    )
    if args.encoder:
        encoders(model, batch, args.rounds)
        return
    start = time.perf_counter()
    with torch.inference_mode():
        hidden = model.get_encoder()(input_ids=batch.input_ids, attention_mask=batch.attention_mask).last_hidden_state
    encoder_seconds = time.perf_counter() - start
    backend = get_backend(model)
    backend._encoder = lambda ids, mask: hidden  # the encoder ran above: both decode from its output
    config = resolve_generation_config(model.generation_config, None, settings)

    def seqgen() -> list[list[int]]:
        return [list(s[0]) for s in generate(backend, batch, config).sequences]

    def hf() -> list[list[int]]:
        with torch.inference_mode():
            out = model.generate(
                encoder_outputs=BaseModelOutput(last_hidden_state=hidden), attention_mask=batch.attention_mask,
                **settings,
            )  # fmt: skip
        return [row[1:].tolist() for row in out]  # without the decoder start token

    systems = {"seqgen (fast led decoder)": seqgen, "generate()": hf}
    times: dict[tuple[str, str], list[float]] = {}
    outputs: dict[str, list[list[int]]] = {}
    for r in range(args.rounds):
        for state in ("quiet", "loaded") if r % 2 == 0 else ("loaded", "quiet"):
            busy = [subprocess.Popen([sys.executable, "-c", "while True: pass"])] if state == "loaded" else []
            try:
                for name in list(systems)[r % 2 :] + list(systems)[: r % 2]:
                    start = time.perf_counter()
                    outputs[name] = systems[name]()
                    times.setdefault((name, state), []).append(time.perf_counter() - start)
                    print(f"round {r + 1} {state}: {name} {times[name, state][-1]:.2f} s", file=sys.stderr)
            finally:
                for p in busy:
                    p.kill()
                    p.wait()
    print(f"`python scripts/harness/bench_long.py {' '.join(sys.argv[1:])}`  ")
    print(
        f"{args.inputs} inputs x {args.tokens} source tokens, beam 4, no_repeat_ngram_size 3, {args.new_tokens} new "
        f"tokens, float32, 2 threads; the encoder once beforehand ({encoder_seconds:.1f} s, not timed below); "
        f"{args.rounds} rounds. Decode seconds: median (min-max).\n"
    )
    print("| system | decode, quiet | beside a busy process | outputs identical to generate()'s |")
    print("| --- | ---: | ---: | ---: |")
    same = sum(a == b for a, b in zip(outputs["generate()"], outputs["seqgen (fast led decoder)"], strict=True))
    for name in systems:
        cells = [
            f"{statistics.median(t):.2f} ({min(t):.2f}-{max(t):.2f})"
            for t in (times[name, "quiet"], times[name, "loaded"])
        ]
        print(f"| {name} | {' | '.join(cells)} | {same}/{len(outputs[name])} |")
    ratio = {s: statistics.median(times["generate()", s]) / statistics.median(times["seqgen (fast led decoder)", s])
             for s in ("quiet", "loaded")}  # fmt: skip
    print(f"\ngenerate() / seqgen: {ratio['quiet']:.2f}x quiet, {ratio['loaded']:.2f}x beside a busy process")


def encoders(model: torch.nn.Module, batch: Batch, rounds: int) -> None:
    """``--encoder``: the model's encoder against the fast backend's, alternating, medians of ``rounds``."""
    runs = {"the model's own (MKL)": model.get_encoder(), "seqgen's (oneDNN)": get_backend(model).encoder}
    times: dict[str, list[float]] = {k: [] for k in runs}
    out = {}
    with torch.inference_mode():
        for r in range(rounds):
            for name in list(runs)[r % 2 :] + list(runs)[: r % 2]:
                start = time.perf_counter()
                out[name] = runs[name](input_ids=batch.input_ids, attention_mask=batch.attention_mask).last_hidden_state
                times[name].append(time.perf_counter() - start)
                print(f"round {r + 1}: {name} {times[name][-1]:.2f} s", file=sys.stderr)
    a, b = out.values()
    print(f"`python scripts/harness/bench_long.py {' '.join(sys.argv[1:])}`  ")
    for name, t in times.items():
        print(f"- {name} encoder: {statistics.median(t):.2f} s ({min(t):.2f}-{max(t):.2f})")
    print(f"- largest difference {float((a - b).abs().max()):.2e} (outputs' largest magnitude {float(a.abs().max()):.2f})")


if __name__ == "__main__":
    main()
