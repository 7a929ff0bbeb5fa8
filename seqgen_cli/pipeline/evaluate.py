"""``seqgen eval``: hypotheses against one or more references, the files checked before anything is read or written
(no ``--sentence-scores`` file is an input: ``paths.check_distinct``), the scores of ``metrics.py``, and what the
command prints (:func:`eval_report`)."""

from __future__ import annotations

import json
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

from seqgen_cli import metrics as m
from seqgen_cli.errors import SeqgenError
from seqgen_cli.pipeline import paths
from seqgen_cli.whole import write_whole


@dataclass
class EvalFiles:
    """The files of one ``seqgen eval``: ``hypotheses``, ``references``, the ``--paired-bs`` ``baseline`` and the
    ``--sentence-scores`` output (``-``: standard output)."""

    hypotheses: str
    references: list[str]
    baseline: str | None = None
    sentence_scores: str | None = None

    @classmethod
    def of(cls, files: Sequence[str], hypotheses: str | None, **more: str | None) -> EvalFiles:
        """``seqgen eval HYP REF [REF...]``, or ``REF... -i HYP`` (sacrebleu's order)."""
        refs = list(files)
        if hypotheses is None:
            if len(refs) < 2:
                raise SeqgenError("seqgen eval needs hypotheses and references: HYP REF [REF...], or REF... -i HYP")
            hypotheses = refs.pop(0)
        elif not refs:
            raise SeqgenError("seqgen eval -i HYP needs at least one reference file")
        return cls(hypotheses, refs, **more)

    def check(self) -> None:
        """No file written is a file read (by device and inode, through links), before anything is opened."""
        roles = [paths.read("hypotheses", self.hypotheses), *(paths.read("reference", r) for r in self.references)]
        roles += [paths.read("--paired-bs", self.baseline)] if self.baseline is not None else []
        if self.sentence_scores is not None:
            roles.append(paths.written("--sentence-scores", self.sentence_scores))
        paths.check_distinct(roles)


def evaluate(files: EvalFiles, names: list[str], options: m.Options) -> tuple[dict[str, Any], str | None]:
    """The scores (``metrics.score``'s result, the files named, ``paired_bs`` with a baseline) and, for
    ``--sentence-scores -``, the JSONL to print; a ``--sentence-scores FILE`` is written whole."""
    files.check()
    hyps, streams = m.read_lines(files.hypotheses), [m.read_lines(r) for r in files.references]
    m.check_unscored(hyps, files.hypotheses)
    m.check_options(options, len(hyps))
    result = m.score(hyps, streams, names, options=options, names=[files.hypotheses, *files.references])
    result["files"] = {"hypotheses": files.hypotheses, "references": files.references}
    if files.baseline is not None:
        result["paired_bs"] = m.paired_bootstrap(hyps, m.read_lines(files.baseline), streams, names, options)
        result["files"]["baseline"] = files.baseline
    if files.sentence_scores is None:
        return result, None
    text = "".join(json.dumps(r) + "\n" for r in m.sentence_scores(hyps, streams, names, options))
    if files.sentence_scores == "-":
        return result, text
    write_whole(files.sentence_scores, text)
    return result, None


@dataclass(frozen=True)
class EvalReport:
    """What ``seqgen eval`` prints: ``sentences`` first (``--sentence-scores -``'s JSONL), ``note`` on stderr
    (the metrics scored when none were chosen), then ``text`` (the table, or the JSON object)."""

    text: str
    sentences: str | None = None
    note: str | None = None


def eval_report(
    files: Sequence[str],
    hypotheses: str | None,
    metrics: str | None,
    *,
    baseline: str | None = None,
    sentence_scores: str | None = None,
    as_json: bool = False,
    **options: Any,
) -> EvalReport:
    """``seqgen eval``'s arguments scored: ``metrics`` checked first (a bad name before any file), ``options``
    sacrebleu's (:class:`~seqgen_cli.metrics.Options`)."""
    names = m.parse_metrics(metrics)
    eval_files = EvalFiles.of(files, hypotheses, baseline=baseline, sentence_scores=sentence_scores)
    result, sentences = evaluate(eval_files, names, m.Options(**options))
    note = None if metrics is not None else f"seqgen: scoring {', '.join(names)} (choose with --metrics)"
    return EvalReport(json.dumps(result, indent=2) if as_json else m.format_table(result), sentences, note)
