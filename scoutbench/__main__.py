from scoutbench.cli import main

main()
