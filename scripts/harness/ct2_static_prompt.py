"""CTranslate2 on the shared-prompt benchmark's prompts (docs/BENCHMARKS.md, "Shared prompt parts on a
decoder-only LLM"): the rendered prompts of ``shared_prompt_inputs.py`` split into the tokens they all begin with
(``generate_batch(static_prompt=...)``, which CTranslate2 prefills once and caches) and each prompt's own tokens, as
a user of CTranslate2 would run them; one decoded line per input, in input order, and the seconds ``generate_batch`` took::

    python scripts/harness/ct2_static_prompt.py MODEL CT2_MODEL rendered.jsonl out.txt --beam 1 --new 48

(CT2_MODEL: ``ct2-transformers-converter --model MODEL``.) ``--whole`` passes the whole prompts (nothing cached).
Rows with a ``task`` field run as one ``generate_batch`` call per task, each with its own static prompt (the most a
CTranslate2 user can share of several prompts: one static prompt per call).
"""

from __future__ import annotations

import argparse
import json
import os


def split_head(prompts: list[list[int]]) -> tuple[list[int], list[list[int]]]:
    """The longest token prefix every prompt shares, less one token so that each keeps one of its own."""
    n = min(len(p) for p in prompts) - 1
    for p in prompts[1:]:
        n = next((i for i in range(n) if p[i] != prompts[0][i]), n)
    return prompts[0][:n], [p[n:] for p in prompts]


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("model", help="the checkpoint folder (its tokenizer)")
    ap.add_argument("ct2_model", help="its CTranslate2 conversion")
    ap.add_argument("rendered", help="JSONL, one {'text': prompt} per line")
    ap.add_argument("output")
    ap.add_argument("--beam", type=int, default=1)
    ap.add_argument("--new", type=int, default=48, help="new tokens per input (forced: min = max)")
    ap.add_argument("--batch-size", type=int, default=32)
    ap.add_argument("--compute-type", default="float32")
    ap.add_argument("--whole", action="store_true", help="no static prompt: every prompt whole")
    args = ap.parse_args()
    import time

    import ctranslate2
    from transformers import AutoTokenizer

    tok = AutoTokenizer.from_pretrained(args.model)
    with open(args.rendered, encoding="utf-8") as f:
        rows = [json.loads(line) for line in f]
    groups: dict[object, list[int]] = {}  # a task -> its rows, in input order
    for i, row in enumerate(rows):
        groups.setdefault(row.get("task"), []).append(i)
    engine = ctranslate2.Generator(
        args.ct2_model, device="cpu", compute_type=args.compute_type, intra_threads=os.cpu_count() or 0
    )
    texts: list[str] = [""] * len(rows)
    seconds, heads = 0.0, []
    for members in groups.values():
        prompts = [tok(rows[i]["text"])["input_ids"] for i in members]
        head, own = ([], prompts) if args.whole else split_head(prompts)
        heads.append(len(head))
        start = time.perf_counter()
        results = engine.generate_batch(
            [tok.convert_ids_to_tokens(p) for p in own],
            max_batch_size=args.batch_size,
            beam_size=args.beam,
            max_length=args.new,
            min_length=args.new,
            include_prompt_in_result=False,
            static_prompt=tok.convert_ids_to_tokens(head) if head else None,
        )
        seconds += time.perf_counter() - start
        for i, r in zip(members, results, strict=True):
            texts[i] = tok.decode(tok.convert_tokens_to_ids(r.sequences[0]), skip_special_tokens=True)
    with open(args.output, "w", encoding="utf-8") as f:
        f.write("".join(" ".join(text.splitlines()) + "\n" for text in texts))
    print(f"static prompts: {heads} tokens; {len(rows)} inputs; generate_batch {seconds:.2f} s")


if __name__ == "__main__":
    main()
