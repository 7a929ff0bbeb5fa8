"""Minimal stand-alone generation scripts that ``seqgen bench --mode e2e`` times against
``seqgen generate``: the few lines a user would write with plain transformers or plain CTranslate2.

    python -m seqgen_cli.bench.baselines hf  --model DIR --input IN --output OUT --batch-size 8 --settings JSON
    python -m seqgen_cli.bench.baselines ct2 --model DIR --ct2-model CT2DIR --input IN --output OUT ...

(ct2 --stats FILE: the seconds ``translate_batch`` / ``generate_batch`` took, as JSON ``generate_seconds``.)

Both read one input per line (optional --prefix, truncated to --max-source-length), generate in batches
sorted by length and write one decoded line per input, in input order. The driver (seqgen_cli.bench.e2e)
resolves the settings with seqgen's Generator, as `seqgen generate` does, and passes them as JSON
(--settings: a GenerationConfig dict for hf, a CTranslate2 plan for ct2). Otherwise deliberately no
seqgen imports: this is the baseline.
"""

from __future__ import annotations

import argparse
import json
import sys
from typing import Any


def _inputs(args: argparse.Namespace) -> tuple[Any, bool, list[list[int]]]:
    """The tokenizer, whether the model is encoder-decoder, and every input line's token ids."""
    from transformers import AutoConfig, AutoTokenizer
    from transformers.utils import logging

    logging.set_verbosity_error()
    logging.disable_progress_bar()
    seq2seq = AutoConfig.from_pretrained(args.model, trust_remote_code=False).is_encoder_decoder
    tokenizer = AutoTokenizer.from_pretrained(args.model, trust_remote_code=False)
    with open(args.input, encoding="utf-8") as f:
        texts = [(args.prefix or "") + line.rstrip("\n") for line in f]
    limit = {"truncation": True, "max_length": args.max_source_length} if args.max_source_length else {}
    return tokenizer, seq2seq, tokenizer(texts, **limit)["input_ids"]


def _write(path: str, outputs: list[str]) -> None:
    with open(path, "w", encoding="utf-8") as f:
        for text in outputs:
            f.write(" ".join(text.splitlines()) + "\n")


def run_hf(args: argparse.Namespace) -> None:
    """Plain transformers: ``AutoModel*.from_pretrained`` + ``generate()``."""
    import torch
    from transformers import AutoModelForCausalLM, AutoModelForSeq2SeqLM, GenerationConfig

    tokenizer, seq2seq, ids = _inputs(args)
    dtype = {"float32": torch.float32, "float16": torch.float16, "bfloat16": torch.bfloat16}[args.dtype]
    auto = AutoModelForSeq2SeqLM if seq2seq else AutoModelForCausalLM
    model = auto.from_pretrained(args.model, dtype=dtype, trust_remote_code=False).to(args.device).eval()
    if not seq2seq:
        tokenizer.padding_side = "left"
    if tokenizer.pad_token_id is None:
        eos = model.generation_config.eos_token_id
        tokenizer.pad_token_id = eos[0] if isinstance(eos, list) else eos
    config = GenerationConfig(**json.loads(args.settings))
    order = sorted(range(len(ids)), key=lambda i: len(ids[i]))
    outputs = [""] * len(ids)
    with torch.inference_mode():
        for start in range(0, len(order), args.batch_size):
            idx = order[start : start + args.batch_size]
            batch = tokenizer.pad({"input_ids": [ids[i] for i in idx]}, return_tensors="pt").to(args.device)
            out = model.generate(**batch, generation_config=config)
            out = out[:, 1:] if seq2seq else out[:, batch["input_ids"].shape[1] :]
            for i, text in zip(idx, tokenizer.batch_decode(out, skip_special_tokens=True), strict=True):
                outputs[i] = text
    _write(args.output, outputs)


def run_ct2(args: argparse.Namespace) -> None:
    """Plain CTranslate2: ``Translator.translate_batch`` / ``Generator.generate_batch``."""
    import time

    import ctranslate2

    tokenizer, seq2seq, ids = _inputs(args)
    plan = json.loads(args.settings)
    cls = ctranslate2.Translator if seq2seq else ctranslate2.Generator
    device = "cuda" if args.device.startswith("cuda") else "cpu"
    translator = cls(
        args.ct2_model, device=device, compute_type=args.compute_type, intra_threads=args.threads
    )
    tokens = [tokenizer.convert_ids_to_tokens(x) for x in ids]
    options = dict(plan["options"], max_batch_size=args.batch_size)
    start = time.perf_counter()
    if seq2seq:
        prefix = [plan["prefix"]] * len(tokens) if plan["prefix"] else None
        results = translator.translate_batch(tokens, target_prefix=prefix, **options)
    else:
        results = translator.generate_batch(tokens, **options)
    if args.stats:  # the decode alone, as seqgen's --stats generate_seconds
        with open(args.stats, "w", encoding="utf-8") as f:
            json.dump({"generate_seconds": time.perf_counter() - start}, f)
    outputs = []
    for res in results:
        hyp = list(res.hypotheses[0] if seq2seq else res.sequences[0])
        if plan["append_eos"] and not (hyp and hyp[-1] in plan["eos"]):
            hyp.append(plan["append_eos"])
        outputs.append(tokenizer.decode(tokenizer.convert_tokens_to_ids(hyp), skip_special_tokens=True))
    _write(args.output, outputs)


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("system", choices=["hf", "ct2"])
    parser.add_argument("--model", required=True, help="checkpoint folder (tokenizer; weights for hf)")
    parser.add_argument("--ct2-model", help="converted CTranslate2 folder (ct2)")
    parser.add_argument("--input", required=True)
    parser.add_argument("--output", required=True)
    parser.add_argument("--batch-size", type=int, default=32)
    parser.add_argument("--settings", required=True, help="JSON: GenerationConfig (hf) or CTranslate2 plan")
    parser.add_argument("--max-source-length", type=int)
    parser.add_argument("--prefix")
    parser.add_argument("--device", default="cpu")
    parser.add_argument("--dtype", default="float32")
    parser.add_argument("--compute-type", default="float32")
    parser.add_argument("--threads", type=int, default=0)
    parser.add_argument("--stats", help="ct2: write the decode's seconds here (JSON, generate_seconds)")
    args = parser.parse_args(argv)
    if args.threads:
        import torch

        torch.set_num_threads(args.threads)
    (run_hf if args.system == "hf" else run_ct2)(args)


if __name__ == "__main__":
    sys.exit(main())
