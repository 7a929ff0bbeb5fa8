from seqgen_cli.cli import main

main()
