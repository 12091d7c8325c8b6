from recsys_cli.cli import main

main()
