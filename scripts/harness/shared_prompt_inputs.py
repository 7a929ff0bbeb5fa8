"""The inputs of the shared-prompt benchmark (docs/BENCHMARKS.md, "A shared few-shot prompt on a decoder-only LLM"):
a few-shot system prompt of WMT14 en-de pairs (about 400 tokens of the model's tokenizer), the next ``--n`` English
sentences as inputs, and the same prompts rendered whole (the chat template applied) as JSONL ``text`` lines, which
seqgen prefills whole (no prompt settings: nothing shared)::

    python scripts/harness/shared_prompt_inputs.py ~/.cache/seqgen-bench/qwen2.5-0.5b --n 16 --out /tmp/shared
"""

from __future__ import annotations

import argparse
import json
import os
from pathlib import Path

SHARED = Path(os.environ.get("SEQGEN_SHARED", Path(__file__).resolve().parents[2].parent / "shared"))


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("model")
    ap.add_argument("--n", type=int, default=32)
    ap.add_argument("--tokens", type=int, default=400, help="the system prompt's length in tokens (at least)")
    ap.add_argument("--out", type=Path, required=True)
    args = ap.parse_args()
    from transformers import AutoTokenizer

    tok = AutoTokenizer.from_pretrained(args.model)
    wmt = SHARED / "data" / "wmt" / "en-de"
    en = (wmt / "newstest2014.en").read_text(encoding="utf-8").splitlines()
    de = (wmt / "newstest2014.de").read_text(encoding="utf-8").splitlines()
    system, used = "You translate English news into German. Answer with the translation only.\n", 0
    while len(tok(system)["input_ids"]) < args.tokens:
        system += f"English: {en[used]}\nGerman: {de[used]}\n"
        used += 1
    inputs = en[used : used + args.n]
    args.out.mkdir(parents=True, exist_ok=True)
    (args.out / "system.txt").write_text(system, encoding="utf-8")
    (args.out / "inputs.txt").write_text("".join(f"{x}\n" for x in inputs), encoding="utf-8")
    rendered = [
        tok.apply_chat_template(
            [{"role": "system", "content": system}, {"role": "user", "content": x}], tokenize=False,
            add_generation_prompt=True,
        )  # fmt: skip
        for x in inputs
    ]
    (args.out / "rendered.jsonl").write_text("".join(json.dumps({"text": r}) + "\n" for r in rendered), encoding="utf-8")
    print(f"system prompt: {len(tok(system)['input_ids'])} tokens ({used} pairs); {len(inputs)} inputs in {args.out}")


if __name__ == "__main__":
    main()
