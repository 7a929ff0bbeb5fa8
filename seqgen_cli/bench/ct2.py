"""CTranslate2 for ``seqgen bench``: a clear message when it is missing, a cached conversion, and the
translation of seqgen's resolved generation settings into CTranslate2 options (the "plan"; the mapping and
its limits are in docs/BENCHMARKS.md). CTranslate2 has no forced EOS: it is emulated by decoding one token
fewer and appending EOS to unfinished hypotheses (exact with ``--fixed-new-tokens``).
"""

from __future__ import annotations

import contextlib
import hashlib
import json
import os
from collections.abc import Iterator
from dataclasses import dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING, Any

from seqgen_cli.errors import SeqgenError

if TYPE_CHECKING:
    from types import ModuleType

    from seqgen_cli.generator import Generator

INSTALL_HINT = "pip install ctranslate2 (or pip install 'seqgen-cli[bench]')"
DEFAULT_CACHE = Path(os.environ.get("SEQGEN_BENCH_CACHE", "~/.cache/seqgen-bench")).expanduser() / "ct2"


def ct2_available() -> str | None:
    """``None`` when ``ctranslate2`` imports, else a one-line reason (for skipping it cleanly)."""
    try:
        import ctranslate2  # noqa: F401
    except ImportError as err:
        return f"ctranslate2 is not installed ({err.msg}); {INSTALL_HINT}"
    return None


def require_ct2() -> ModuleType:
    """The ``ctranslate2`` module, or a ``SeqgenError`` that says how to install it."""
    reason = ct2_available()
    if reason:
        raise SeqgenError(reason)
    import ctranslate2

    return ctranslate2


def convert(model: str, cache: Path | None = None) -> Path:
    """Convert a checkpoint folder once with ``TransformersConverter``; reuse the cached conversion."""
    ct2 = require_ct2()
    from ctranslate2.converters import TransformersConverter

    model_dir = Path(model).expanduser().resolve()
    if not (model_dir / "config.json").is_file():
        raise SeqgenError(f"ct2: {model} is not a local checkpoint folder; only folders are converted")
    h = hashlib.sha1(ct2.__version__.encode())  # the key: the checkpoint's files and CTranslate2's version
    for p in sorted(model_dir.iterdir()):
        if p.is_file():
            h.update(f"{p.name}:{p.stat().st_size}:{p.stat().st_mtime_ns}".encode())
    key = f"{model_dir.name}-{h.hexdigest()[:12]}-none"  # not quantised
    out = (cache or DEFAULT_CACHE).expanduser() / key
    if (out / "model.bin").is_file():
        return _start_as_transformers(out, model_dir)
    out.parent.mkdir(parents=True, exist_ok=True)
    tmp = out.with_name(out.name + f".tmp{os.getpid()}")
    try:
        with _transformers5_compat():
            TransformersConverter(str(model_dir)).convert(str(tmp), force=True)
    except Exception as err:  # the converter raises many types (ValueError, NotImplementedError, ...)
        raise SeqgenError(
            f"ct2: cannot convert {model} with CTranslate2 {ct2.__version__}: {type(err).__name__}: {err}"
        ) from None
    tmp.rename(out)
    return _start_as_transformers(out, model_dir)


def _start_as_transformers(ct2_dir: Path, model_dir: Path) -> Path:
    """The conversion decoding from the checkpoint's own ``decoder_start_token_id``: CTranslate2's converters set a
    family's usual start token (Pegasus: its pad token ``<blank>``), which a checkpoint may not use (the
    transliteration model starts from ``<s>``); ``config.json``'s ``decoder_start_token`` is rewritten where they
    differ, so both systems decode the same thing. Decoder-only and start-less conversions are left as they are."""
    path = ct2_dir / "config.json"
    converted = json.loads(path.read_text(encoding="utf-8")) if path.is_file() else {}
    start_id = json.loads((model_dir / "config.json").read_text(encoding="utf-8")).get("decoder_start_token_id")
    if converted.get("decoder_start_token") is None or not isinstance(start_id, int):
        return ct2_dir
    from transformers import AutoTokenizer

    start = AutoTokenizer.from_pretrained(str(model_dir)).convert_ids_to_tokens(start_id)
    if start is not None and start != converted["decoder_start_token"] and start in vocabulary(ct2_dir):
        converted["decoder_start_token"] = start
        path.write_text(json.dumps(converted, indent=2), encoding="utf-8")
    return ct2_dir


@contextlib.contextmanager
def _transformers5_compat() -> Iterator[None]:
    """CTranslate2's mBART/Pegasus loaders read ``config.normalize_before``, which transformers 5 configs no
    longer define; both architectures are pre-norm, so provide ``True`` while converting."""
    import transformers

    patched = []
    for name, attrs in (
        ("MBartConfig", {"normalize_before": True}),
        ("PegasusConfig", {"normalize_before": True, "normalize_embedding": False}),
    ):
        cls = getattr(transformers, name, None)
        for attr, value in attrs.items():
            if cls is not None and not hasattr(cls, attr):
                setattr(cls, attr, value)
                patched.append((cls, attr))
    try:
        yield
    finally:
        for cls, attr in patched:
            delattr(cls, attr)


def vocabulary(ct2_dir: Path) -> list[str]:
    """The converted model's target vocabulary (CTranslate2 may drop tokens, e.g. Marian's ``<pad>``)."""
    for ext in ("json", "txt"):
        for stem in ("target_vocabulary", "shared_vocabulary", "vocabulary"):
            path = ct2_dir / f"{stem}.{ext}"
            if path.is_file():
                text = path.read_text(encoding="utf-8")
                return json.loads(text) if ext == "json" else text.split("\n")
    raise SeqgenError(f"ct2: no vocabulary file in {ct2_dir}")


@dataclass
class Ct2Plan:
    """How one generation config runs in CTranslate2."""

    options: dict[str, Any]
    prefix: list[str] | None = None  # forced BOS as a target prefix (encoder-decoder)
    append_eos: str | None = None  # forced EOS emulation: append this token to unfinished outputs
    eos: list[str] = field(default_factory=list)
    notes: list[str] = field(default_factory=list)


def _ids(value: Any) -> list[int]:
    """A token id or a list of them (or None) as a list."""
    return [] if value is None else list(value) if isinstance(value, list | tuple) else [value]


def plan_for(gen: Generator, ct2_dir: Path, vocab: list[str] | None = None) -> Ct2Plan:
    """CTranslate2 options equivalent to a ``Generator``'s resolved settings (as far as they exist; unset ones
    are ``generate()``'s defaults, ``search.settings.setting``), for the model converted into ``ct2_dir``
    (``vocab``: its vocabulary, when already read)."""
    from seqgen_cli.search.settings import setting

    config, causal = gen.config, not gen.is_encoder_decoder
    max_new, min_new = gen.new_token_limits()
    known = set(vocab if vocab is not None else vocabulary(ct2_dir))
    tok = gen.tokenizer.convert_ids_to_tokens
    eos = [tok(i) for i in _ids(config.eos_token_id)]
    notes: list[str] = []
    prefix = None
    if not causal and config.forced_bos_token_id is not None:
        prefix = [tok(config.forced_bos_token_id)]
    append_eos = None
    if config.forced_eos_token_id is not None:
        append_eos = tok(_ids(config.forced_eos_token_id)[0])
        max_new -= 1  # the forced last token is appended afterwards
        min_new = min(min_new, max_new)
    config_path = ct2_dir / "config.json"
    converted = json.loads(config_path.read_text(encoding="utf-8")) if config_path.is_file() else {}
    if not causal and converted.get("decoder_start_token", 0) is None:
        # The converted model has no decoder start token (mBART): the prefix begins with transformers';
        # CTranslate2 takes the prefix's first token as the start token, neither returned nor counted.
        prefix = [tok(config.decoder_start_token_id)] + (prefix or [])
    suppress = []
    for seq in config.bad_words_ids or []:
        tokens = [tok(i) for i in seq]
        if all(t in known for t in tokens):
            suppress.append(tokens)
        else:
            notes.append(f"banned {tokens} not in the CTranslate2 vocabulary (cannot be generated anyway)")
    beams = setting(config, "num_beams")
    options: dict[str, Any] = {
        "beam_size": beams,
        "num_hypotheses": 1,
        "no_repeat_ngram_size": setting(config, "no_repeat_ngram_size"),
        "repetition_penalty": setting(config, "repetition_penalty"),
        "return_end_token": True,
        "end_token": [t for t in eos if t in known] or None,
    }
    if beams > 1:
        options["length_penalty"] = setting(config, "length_penalty")
    if suppress:
        options["suppress_sequences"] = suppress
    if setting(config, "do_sample"):
        options.update(
            sampling_topk=setting(config, "top_k"),
            sampling_topp=setting(config, "top_p"),
            sampling_temperature=setting(config, "temperature"),
        )
        notes.append("sampling: outputs differ from generate() by design")
    if causal:
        options.update(max_length=max_new, min_length=min_new, include_prompt_in_result=False)
    else:
        options.update(max_decoding_length=max_new, min_decoding_length=min_new, max_input_length=0)
    return Ct2Plan(options, prefix, append_eos, eos, notes)
