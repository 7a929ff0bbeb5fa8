"""The inputs of the shared-prompt benchmarks (docs/BENCHMARKS.md, "Shared prompt parts on a decoder-only LLM"), and
the same prompts rendered whole (the chat template applied) as JSONL ``text`` lines, which seqgen prefills whole
(no prompt settings: nothing shared) and ``generate()`` and CTranslate2 read. Three kinds:

* ``system``: a few-shot system prompt of WMT14 en-de pairs (``system.txt``) and the next ``--n`` English sentences
  as inputs (``inputs.txt``: ``--chat --system-prompt @system.txt``);
* ``messages``: ``--n`` JSONL ``messages`` conversations (``conversations.jsonl``): the same instruction as a system
  turn, the example pairs as user and assistant turns, then the sentence;
* ``tasks``: ``--n`` conversations over 4 tasks (``conversations.jsonl``), input ``i`` task ``i % 4``: a system turn
  each of its own (an instruction and example pairs: English into German, French or Romanian, German into English),
  about ``--tokens`` tokens each.

::

    python scripts/harness/shared_prompt_inputs.py ~/.cache/seqgen-bench/qwen2.5-0.5b --kind messages --n 32 --out /tmp/m
"""

from __future__ import annotations

import argparse
import json
import os
from pathlib import Path

SHARED = Path(os.environ.get("SEQGEN_SHARED", Path(__file__).resolve().parents[2].parent / "shared"))
WMT = SHARED / "data" / "wmt"
# the tasks of ``--kind tasks`` (the first: the other kinds'): (source language, target language, their files)
TASKS = [
    ("English", "German", "en-de/newstest2014.en", "en-de/newstest2014.de"),
    ("English", "French", "en-fr/newstest2014.en", "en-fr/newstest2014.fr"),
    ("English", "Romanian", "en-ro/newstest2016.en", "en-ro/newstest2016.ro"),
    ("German", "English", "de-en/newstest2019.de", "de-en/newstest2019.en"),
]


def lines(name: str) -> list[str]:
    return (WMT / name).read_text(encoding="utf-8").splitlines()


def instruction(task: tuple[str, ...]) -> str:
    return f"You translate {task[0]} news into {task[1]}. Answer with the translation only."


def examples(tok, task: tuple[str, ...], tokens: int) -> tuple[list[tuple[str, str]], str]:
    """Example pairs of ``task`` from the start of its files until its instruction and they pass ``tokens`` tokens,
    and that system prompt."""
    src, tgt = lines(task[2]), lines(task[3])
    pairs: list[tuple[str, str]] = []
    text = instruction(task) + "\n"
    while len(tok(text)["input_ids"]) < tokens:
        pairs.append((src[len(pairs)], tgt[len(pairs)]))
        text += f"{task[0]}: {pairs[-1][0]}\n{task[1]}: {pairs[-1][1]}\n"
    return pairs, text


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("model")
    ap.add_argument("--kind", choices=["system", "messages", "tasks"], default="system")
    ap.add_argument("--n", type=int, default=32)
    ap.add_argument("--tokens", type=int, default=400, help="each shared prompt's length in tokens (at least)")
    ap.add_argument("--out", type=Path, required=True)
    args = ap.parse_args()
    from transformers import AutoTokenizer

    tok = AutoTokenizer.from_pretrained(args.model)
    args.out.mkdir(parents=True, exist_ok=True)
    conversations = []
    if args.kind == "tasks":
        heads = [(examples(tok, task, args.tokens)[1], lines(task[2])) for task in TASKS]
        for i in range(args.n):
            system, src = heads[i % len(heads)]
            conversations.append([{"role": "system", "content": system}, {"role": "user", "content": src[100 + i]}])
    else:
        pairs, system = examples(tok, TASKS[0], args.tokens)
        inputs = lines(TASKS[0][2])[len(pairs) : len(pairs) + args.n]
        (args.out / "system.txt").write_text(system, encoding="utf-8")
        (args.out / "inputs.txt").write_text("".join(f"{x}\n" for x in inputs), encoding="utf-8")
        turns = [
            m for s, t in pairs for m in ({"role": "user", "content": s}, {"role": "assistant", "content": t})
        ]
        for x in inputs:
            if args.kind == "system":
                conversations.append([{"role": "system", "content": system}, {"role": "user", "content": x}])
            else:
                head = {"role": "system", "content": instruction(TASKS[0])}
                conversations.append([head, *turns, {"role": "user", "content": x}])
    if args.kind != "system":
        (args.out / "conversations.jsonl").write_text(
            "".join(json.dumps({"messages": m}, ensure_ascii=False) + "\n" for m in conversations), encoding="utf-8"
        )
    rendered = [tok.apply_chat_template(m, tokenize=False, add_generation_prompt=True) for m in conversations]
    rows = [{"text": r} | ({"task": i % len(TASKS)} if args.kind == "tasks" else {}) for i, r in enumerate(rendered)]
    (args.out / "rendered.jsonl").write_text(
        "".join(json.dumps(row, ensure_ascii=False) + "\n" for row in rows), encoding="utf-8"
    )
    lengths = [len(tok(r)["input_ids"]) for r in rendered]
    print(f"{args.kind}: {len(rendered)} prompts of {min(lengths)}-{max(lengths)} tokens in {args.out}")


if __name__ == "__main__":
    main()
