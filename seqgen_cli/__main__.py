from seqgen_cli.cli import run

run()
