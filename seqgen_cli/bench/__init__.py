"""``seqgen bench``: speed and agreement of seqgen against transformers ``generate()`` and CTranslate2.

:func:`.run.run_bench` runs it with :class:`.settings.BenchSettings`. Every (beams, batch size) cell runs the
systems on the same work, interleaved after a warm-up (:mod:`.cells`): :mod:`.decode` times generation only (systems in :mod:`.systems`, CTranslate2 in :mod:`.ct2`), :mod:`.e2e`
whole processes, files to files (against :mod:`.baselines`). Agreement: outputs token-identical (decode) or
text-identical (e2e) to transformers'. :mod:`.report` writes ``bench.json``, ``bench.md``, ``bench.png``.
"""
