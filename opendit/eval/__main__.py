from opendit.eval.cli import main

main()
