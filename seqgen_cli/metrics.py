"""Scoring behind ``seqgen eval HYP REF``: ROUGE (rouge-score), BLEU and chrF (sacrebleu).

Numbers are exactly what the reference libraries compute:

* ``rouge``: ``rouge_score.rouge_scorer.RougeScorer(["rouge1", "rouge2", "rougeL", "rougeLsum"],
  use_stemmer=True)`` per line, then the plain mean over lines of F-measure (and of precision and
  recall), times 100. This is the number most papers report; it is *not* rouge-score's
  ``BootstrapAggregator`` "mid" value (a resampled estimate that is slightly different and random).
  For ROUGE-Lsum, both sides are split into sentences with :func:`split_sentences` (offline regex,
  no nltk punkt) and joined with ``"\\n"``, which is the input rougeLsum expects.
* ``bleu`` / ``chrf`` / ``chrf++`` / ``ter``: ``sacrebleu.metrics.BLEU`` / ``CHRF`` (``word_order=2``: chrF++) /
  ``TER`` ``.corpus_score(hyps, refs)`` over one or more reference streams, with sacrebleu's settings
  (:class:`Options`: ``--tokenize``, ``--lowercase``, ``--chrf-word-order``, ``--force``, ``--confidence``) and
  reported with its signature string: the numbers of sacrebleu's own command line on the same files.

No Unicode normalisation (neither library offers one): NFC and NFD forms of the same text score as different
(rouge-score's tokenizer keeps only ``a-z0-9``, so NFC "café" is ``caf``, NFD ``cafe``).
"""

from __future__ import annotations

import math
import os
import re
import sys
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

from seqgen_cli.errors import SeqgenError

METRICS: tuple[str, ...] = ("rouge", "bleu", "chrf", "chrf++", "ter")  # what --metrics takes
DEFAULT_METRICS: tuple[str, ...] = ("rouge", "bleu", "chrf")  # without --metrics
ROUGE_TYPES: tuple[str, ...] = ("rouge1", "rouge2", "rougeL", "rougeLsum")

# --------------------------------------------------------------------------- sentence splitting

# Words that end in "." without ending a sentence (compared case-insensitively, without the dot).
_ABBREVIATIONS = frozenset(
    """mr mrs ms dr prof sr jr st mt ft gen col lt sgt capt cpl adm maj gov sen rep rev hon pres
    supt insp det messrs mme mlle inc ltd co corp bros no nos vol vols pp fig figs approx dept
    est vs v cf al e.g i.e jan feb mar apr jun jul aug sep sept oct nov dec""".split()
)
# Initials and dotted acronyms: "J", "U.S", "U.K", "e.g" (the final dot is the candidate boundary).
_INITIALS = re.compile(r"^(?:[^\W\d_]\.)*[^\W\d_]$")
# A terminator run, then closing quotes/brackets (attached, or PTB-style as their own token when
# followed by whitespace), then the whitespace where we may cut.
_CANDIDATE = re.compile(r"[.!?]+(?:['\"”’)\]]+|\s+['\"”’)\]]+(?=\s))*(\s+)")
_OPENERS = "'\"“‘([`"


def split_sentences(text: str) -> list[str]:
    """Split ``text`` into sentences with an offline heuristic (no nltk punkt).

    A boundary is ``.``, ``!`` or ``?`` (plus any closing quotes/brackets, also PTB-style
    space-separated ones like ``epidemic . ' Their``) followed by whitespace and an upper-case
    letter, or an opening quote/bracket. A ``.`` does not end a sentence after a known
    abbreviation (``Mr.``, ``Dr.``, ``St.``, ``Inc.`` ...) or initials/acronyms (``J.``, ``U.S.``),
    so "the U.S. The" stays one sentence. Existing newlines always separate sentences. Returns
    stripped, non-empty sentences; their concatenation keeps every non-space character.
    """
    sentences: list[str] = []
    for block in text.split("\n"):
        start = 0
        for m in _CANDIDATE.finditer(block):
            cut = m.start(1)  # start of the whitespace after the terminator (+ closers)
            nxt = m.end(1)
            if nxt >= len(block) or not _starts_sentence(block, nxt):
                continue
            single_dot = m.group(0).startswith(".") and not m.group(0).startswith("..")
            if single_dot and _is_abbreviation(block[start : m.start()]):
                continue
            piece = block[start:cut].strip()
            if piece:
                sentences.append(piece)
            start = nxt
        piece = block[start:].strip()
        if piece:
            sentences.append(piece)
    return sentences


def _starts_sentence(block: str, i: int) -> bool:
    ch = block[i]
    if ch.isupper():
        return True
    if ch in _OPENERS:
        # An opening quote/bracket: attached to what follows ("'Hello", "(The"), or PTB-style
        # "`` The" / "' The" followed by a capitalised word.
        rest = block[i + 1 :].lstrip("'\"“‘([`")
        rest = rest.lstrip() if rest[:1].isspace() else rest
        return bool(rest) and (rest[0].isupper() or rest[0].isdigit())
    return False


def _is_abbreviation(before: str) -> bool:
    """Whether the word just before a ``.`` (``before`` ends right at the dot) is an abbreviation."""
    if not before or before[-1].isspace():
        return False  # PTB-style detached " . " is always a full stop
    word = before.split()[-1].lstrip("'\"“‘([`")
    if word.lower() in _ABBREVIATIONS:
        return True
    # "U.S", "p.m" (dotted) or a single capital initial "J"; a lone lower-case letter is a word.
    return bool(_INITIALS.match(word)) and (len(word) > 1 or word.isupper())


# --------------------------------------------------------------------------- scoring


@dataclass(frozen=True)
class Options:
    """sacrebleu's settings, as its command line names them: ``tokenize`` (BLEU's tokenizer; default by
    ``target_lang``, else 13a), ``lowercase`` (BLEU's and chrF's), ``chrf_word_order`` (2: chrF++), ``force``
    (tokenised input accepted without a warning), ``confidence`` (bootstrap resamples for a 95 % interval, 0:
    none)."""

    target_lang: str | None = None
    tokenize: str | None = None
    lowercase: bool = False
    chrf_word_order: int = 0
    force: bool = False
    confidence: int = 0


# sacrebleu's bootstrap holds an index and the statistics of every resample of every line at once: resamples x
# lines x (8 + 4 x statistics) bytes, the statistics of chrF++ 24 float32s (BLEU's 10), so 104 bytes each at most.
BOOTSTRAP_BYTES_PER_LINE = 104
BOOTSTRAP_MEMORY = 2 << 30  # the most --confidence may hold (sacrebleu's 1000 resamples: 0.1 GiB per 1000 lines)


def check_options(o: Options, lines: int) -> None:
    """One line for settings sacrebleu would take badly: an unknown BLEU tokenizer (a ``KeyError`` there), a
    bootstrap of one resample (its placeholder -1 as the interval) or one too large for memory."""
    from sacrebleu.metrics import BLEU

    if o.tokenize is not None and o.tokenize not in BLEU.TOKENIZERS:
        raise SeqgenError(f"--tokenize {o.tokenize}: not a sacrebleu tokenizer: choose from {', '.join(BLEU.TOKENIZERS)}")
    if o.confidence == 1:
        raise SeqgenError("--confidence 1: a bootstrap needs 2 resamples or more (sacrebleu's default: 1000)")
    need = o.confidence * lines * BOOTSTRAP_BYTES_PER_LINE
    if need > BOOTSTRAP_MEMORY:
        most = max(2, BOOTSTRAP_MEMORY // (max(lines, 1) * BOOTSTRAP_BYTES_PER_LINE))
        raise SeqgenError(
            f"--confidence {o.confidence} over {lines} lines would hold about {need / 2**30:.1f} GiB in sacrebleu's "
            f"bootstrap (at most {BOOTSTRAP_MEMORY >> 30} GiB): give --confidence {most} or fewer"
        )


def parse_metrics(names: str | None) -> list[str]:
    """``--metrics`` (comma-separated names) as a list; :data:`DEFAULT_METRICS` when none are given."""
    if not names:
        return list(DEFAULT_METRICS)
    return _check_metrics([s for s in names.split(",") if s.strip()])


def _check_metrics(metrics: Sequence[str]) -> list[str]:
    if isinstance(metrics, str):
        metrics = [metrics]
    chosen: list[str] = []
    for name in metrics:
        key = name.strip().lower()
        if key not in METRICS:
            raise SeqgenError(f"unknown metric {name!r}: expected one of {', '.join(METRICS)}")
        if key not in chosen:
            chosen.append(key)
    if not chosen:
        raise SeqgenError(f"no metric given: expected one or more of {', '.join(METRICS)}")
    return chosen


def _mean100(values: Sequence[float]) -> float:
    return 100.0 * math.fsum(values) / len(values)


References = Sequence[Sequence[str]]  # reference streams: refs[k][i] is reference k of line i


def rouge(hyps: Sequence[str], refs: References) -> dict[str, Any]:
    """Per-line rouge-score (stemmed; against several references, the best: ``score_multi``), averaged over
    lines, ×100; see the module docstring."""
    from rouge_score import rouge_scorer

    scorer = rouge_scorer.RougeScorer(list(ROUGE_TYPES), use_stemmer=True)
    per_type: dict[str, dict[str, list[float]]] = {
        t: {"precision": [], "recall": [], "fmeasure": []} for t in ROUGE_TYPES
    }
    for i, hyp in enumerate(hyps):
        targets = ["\n".join(split_sentences(stream[i])) for stream in refs]
        prediction = "\n".join(split_sentences(hyp))
        scores = scorer.score(targets[0], prediction) if len(targets) == 1 else scorer.score_multi(targets, prediction)
        for t in ROUGE_TYPES:
            for field in ("precision", "recall", "fmeasure"):
                per_type[t][field].append(getattr(scores[t], field))
    out: dict[str, Any] = {t: {f: _mean100(v) for f, v in d.items()} for t, d in per_type.items()}
    out["aggregation"] = "mean over lines x100" + (", the best of the references per line" if len(refs) > 1 else "")
    out["settings"] = "rouge-score use_stemmer=True; rougeLsum on seqgen sentence split"
    return out


def _sacrebleu_metric(name: str, o: Options, sentence: bool = False) -> Any:
    """sacrebleu's metric object for ``name`` with ``o``'s settings (``sentence``: BLEU with effective order,
    as sacrebleu's ``--sentence-level`` scores each line)."""
    from sacrebleu.metrics import BLEU, CHRF, TER

    if name == "bleu":
        try:
            return BLEU(
                trg_lang=o.target_lang or "",
                tokenize=o.tokenize,
                lowercase=o.lowercase,
                force=o.force,
                effective_order=sentence,
            )
        except (RuntimeError, ImportError) as err:  # e.g. ja/ko tokenisers need sacrebleu[ja]/[ko]
            first = next((ln.strip() for ln in str(err).splitlines() if ln.strip()), type(err).__name__)
            what = f"tokenizer {o.tokenize!r}" if o.tokenize else f"target language {o.target_lang!r}"
            extra = o.tokenize or o.target_lang
            raise SeqgenError(f"BLEU with {what}: {first} (pip install 'sacrebleu[{extra}]')") from None
    if name in ("chrf", "chrf++"):
        return CHRF(word_order=2 if name == "chrf++" else o.chrf_word_order, lowercase=o.lowercase)
    return TER()


def sacrebleu_score(name: str, hyps: Sequence[str], refs: References, o: Options) -> dict[str, Any]:
    """sacrebleu's corpus score of ``name`` (bleu, chrf, chrf++, ter) with its signature; with ``o.confidence``,
    the bootstrap mean and 95 % interval half-width as sacrebleu's ``--confidence`` gives them."""
    metric = _sacrebleu_metric(name, o)
    streams = [list(r) for r in refs]
    res = metric.corpus_score(list(hyps), streams, n_bootstrap=o.confidence or 1)
    out: dict[str, Any] = {"score": res.score, "signature": str(metric.get_signature())}
    if o.confidence:
        out["confidence"] = {"mean": res._mean, "ci95": res._ci, "resamples": o.confidence}
    if name == "bleu":
        out.update(precisions=list(res.precisions), bp=res.bp, ratio=res.ratio, hyp_len=res.sys_len, ref_len=res.ref_len)
    return out


PAIRED_RESAMPLES = 1000  # sacrebleu --paired-bs's default (--paired-bs-n)


def paired_bootstrap(
    hyps: Sequence[str], baseline: Sequence[str], refs: References, metrics: Sequence[str], o: Options
) -> dict[str, Any]:
    """sacrebleu's paired bootstrap resampling (``--paired-bs``, :data:`PAIRED_RESAMPLES` resamples, its seed) of
    ``hyps`` against ``baseline``, for each sacrebleu metric of ``metrics``: both systems' scores, bootstrap means
    and 95 % intervals, and the p-value of the difference (under 0.05: unlikely to be chance)."""
    from sacrebleu.significance import PairedTest

    chosen = {n: _sacrebleu_metric(n, o) for n in metrics if n != "rouge"}
    if not chosen:
        raise SeqgenError("--paired-bs needs a sacrebleu metric (bleu, chrf, chrf++, ter) in --metrics")
    if len(baseline) != len(hyps):
        raise SeqgenError(f"--paired-bs: the baseline has {len(baseline)} lines, the hypotheses {len(hyps)}")
    systems = [("baseline", list(baseline)), ("system", list(hyps))]
    test = PairedTest(systems, chosen, [list(r) for r in refs], test_type="bs", n_samples=PAIRED_RESAMPLES)
    signatures, scores = test()
    out: dict[str, Any] = {}
    labels = [k for k in scores if k != "System"]  # sacrebleu's names (BLEU, chrF2, TER), in the metrics' order
    for name, label in zip(chosen, labels, strict=True):
        base, mine = scores[label]
        out[name] = {
            "baseline": {"score": float(base.score), "mean": float(base.mean), "ci95": float(base.ci)},
            "system": {"score": float(mine.score), "mean": float(mine.mean), "ci95": float(mine.ci)},
            "p_value": float(mine.p_value),
            "signature": str(signatures[label]),
        }
    return out


def sentence_scores(hyps: Sequence[str], refs: References, metrics: Sequence[str], o: Options) -> list[dict[str, Any]]:
    """Per line, each metric's sentence-level score (``--sentence-scores``): sacrebleu's ``sentence_score``
    (BLEU with effective order, as its ``--sentence-level``), ROUGE F-measures ×100."""
    objects = {n: _sacrebleu_metric(n, o, sentence=True) for n in metrics if n != "rouge"}
    rows: list[dict[str, Any]] = []
    for i, hyp in enumerate(hyps):
        row: dict[str, Any] = {"line": i + 1}
        mine = [[stream[i]] for stream in refs]
        for name, metric in objects.items():
            row[name] = metric.sentence_score(hyp, [m[0] for m in mine]).score
        if "rouge" in metrics:
            r = rouge([hyp], mine)
            row.update({t: r[t]["fmeasure"] for t in ROUGE_TYPES})
        rows.append(row)
    return rows


def score(
    hyps: list[str],
    refs: list[str] | References,
    metrics: list[str],
    *,
    target_lang: str | None = None,
    options: Options | None = None,
    names: Sequence[str] = (),
) -> dict[str, Any]:
    """Score line-aligned hypotheses against references: one reference stream (``list[str]``) or several
    (``list[list[str]]``, each line-aligned).

    Returns a JSON-serialisable dict: ``{"lines": n, "references": k, "<metric>": {...}}`` for each requested
    metric, in the order given (duplicates dropped). Raises :class:`SeqgenError` on mismatched line counts,
    empty input or an unknown metric. ``target_lang`` (or ``options.target_lang``) selects sacrebleu BLEU's
    tokeniser (``trg_lang``). ``names``: the files, hypotheses first then each reference, for the errors.
    """
    o = options or Options(target_lang=target_lang)
    chosen = _check_metrics(metrics)
    streams = streams_of(refs)
    hyp_name, *ref_names = names or ["", *("" for _ in streams)]
    for k, stream in enumerate(streams):
        if len(stream) != len(hyps):
            hyp_file = f" ({hyp_name})" if hyp_name else ""
            which = f" ({ref_names[k]})" if ref_names[k] else ("" if len(streams) == 1 else f" (reference {k + 1})")
            raise SeqgenError(
                f"line counts differ: the hypotheses{hyp_file} have {len(hyps)} lines, the references{which} "
                f"{len(stream)} (they must be line-aligned)"
            )
    if not hyps:
        raise SeqgenError("nothing to score: hypotheses and references are both empty")
    result: dict[str, Any] = {"lines": len(hyps), "references": len(streams)}
    for name in chosen:
        result[name] = rouge(hyps, streams) if name == "rouge" else sacrebleu_score(name, hyps, streams, o)
    return result


def streams_of(refs: list[str] | References) -> list[list[str]]:
    """Reference streams from one stream (``list[str]``) or several."""
    if refs and all(isinstance(r, str) for r in refs):
        return [list(refs)]  # type: ignore[arg-type]
    return [list(r) for r in refs] or [[]]


# --------------------------------------------------------------------------- presentation & I/O

_SACREBLEU_LABELS = (("bleu", "BLEU"), ("chrf", "chrF"), ("chrf++", "chrF++"), ("ter", "TER"))
_ROUGE_LABELS = {"rouge1": "ROUGE-1", "rouge2": "ROUGE-2", "rougeL": "ROUGE-L", "rougeLsum": "ROUGE-Lsum"}


def format_table(result: dict[str, Any]) -> str:
    """Render a :func:`score` result as an aligned text table (scores ×100, two decimals)."""
    rows: list[tuple[str, str, str]] = []
    notes: list[str] = []
    if "rouge" in result:
        r = result["rouge"]
        for t in ROUGE_TYPES:
            rows.append(
                (
                    _ROUGE_LABELS[t],
                    f"{r[t]['fmeasure']:.2f}",
                    f"P {r[t]['precision']:.2f}  R {r[t]['recall']:.2f}",
                )
            )
        notes.append(f"ROUGE: F-measure, {r['aggregation']}; {r['settings']}")
    if "bleu" in result:
        b = result["bleu"]
        prec = "/".join(f"{p:.1f}" for p in b["precisions"])
        rows.append(
            (
                "BLEU",
                f"{b['score']:.2f}",
                f"{prec}  BP {b['bp']:.3f}  ratio {b['ratio']:.3f}  hyp {b['hyp_len']} ref {b['ref_len']}",
            )
        )
        notes.append(f"BLEU: {b['signature']}")
    for name, label in (("chrf", "chrF"), ("chrf++", "chrF++"), ("ter", "TER")):
        if name in result:
            rows.append((label, f"{result[name]['score']:.2f}", ""))
            notes.append(f"{label}: {result[name]['signature']}")
    for name, label in _SACREBLEU_LABELS:
        ci = result.get(name, {}).get("confidence")
        if ci:
            notes.append(f"{label}: bootstrap mean {ci['mean']:.2f} ± {ci['ci95']:.2f} (95 %, {ci['resamples']} resamples)")
    for name, label in _SACREBLEU_LABELS:
        pbs = result.get("paired_bs", {}).get(name)
        if pbs:
            b, mine = pbs["baseline"], pbs["system"]
            star = " *" if pbs["p_value"] < 0.05 else ""
            notes.append(
                f"{label} against the baseline: {mine['score']:.2f} ({mine['mean']:.2f} ± {mine['ci95']:.2f}) vs "
                f"{b['score']:.2f} ({b['mean']:.2f} ± {b['ci95']:.2f}), p = {pbs['p_value']:.4f}{star} "
                f"(paired bootstrap, {PAIRED_RESAMPLES} resamples)"
            )
    header = ("metric", "score", "detail")
    w0 = max(len(header[0]), *(len(r[0]) for r in rows)) if rows else len(header[0])
    w1 = max(len(header[1]), *(len(r[1]) for r in rows)) if rows else len(header[1])
    lines = [f"{header[0]:<{w0}}  {header[1]:>{w1}}  {header[2]}"]
    lines += [f"{a:<{w0}}  {b:>{w1}}  {c}".rstrip() for a, b, c in rows]
    if "lines" in result:
        refs = result.get("references", 1)
        notes.insert(0, f"{result['lines']} lines" + (f", {refs} references each" if refs > 1 else ""))
    if "files" in result:
        notes.insert(0, f"hypotheses {result['files']['hypotheses']}; references {', '.join(result['files']['references'])}")
    return "\n".join(lines + [""] + notes) if notes else "\n".join(lines)


SCORED_LINE = re.compile(r"(-?(\d+\.?\d*(e-?\d+)?|inf)\t){2}|\t\t")  # `seqgen generate --scores` text lines


def check_unscored(lines: list[str], name: str) -> None:
    """Refuse hypotheses whose every line begins ``SCORE<TAB>LOG_PROB<TAB>`` (``seqgen generate --scores``' text
    output): the numbers would be scored as words."""
    if lines and any(lines) and all(SCORED_LINE.match(line) for line in lines):
        raise SeqgenError(
            f"{name}: every line begins with two scores and tabs, as seqgen generate --scores writes them: score the "
            f"text after them (cut -f3- {name} > hyps.txt)"
        )


def read_lines(path: str | os.PathLike[str]) -> list[str]:
    """Read a UTF-8 text file (``"-"`` = stdin) into lines.

    Splits on ``"\\n"`` only (a trailing ``"\\r"`` is dropped; a final newline adds no empty line),
    so Unicode line separators inside a line never break line alignment. A leading BOM is removed.
    Raises :class:`SeqgenError` naming the file and line on non-UTF-8 bytes or when unreadable.
    """
    name = "<stdin>" if str(path) == "-" else os.fspath(path)
    try:
        if str(path) == "-":
            data = sys.stdin.buffer.read()
        else:
            with open(path, "rb") as fh:
                data = fh.read()
    except OSError as err:
        raise SeqgenError(f"{name}: cannot read: {err.strerror or err}") from None
    try:
        text = data.decode("utf-8")
    except UnicodeDecodeError as err:
        line_no = data.count(b"\n", 0, err.start) + 1
        col = err.start - (data.rfind(b"\n", 0, err.start) + 1) + 1
        raise SeqgenError(
            f"{name}: line {line_no}: not valid UTF-8 (byte 0x{data[err.start]:02x} at byte column {col})"
        ) from None
    if text.startswith("\ufeff"):
        text = text[1:]
    if not text:
        return []
    if text.endswith("\n"):
        text = text[:-1]
    return [line[:-1] if line.endswith("\r") else line for line in text.split("\n")]
