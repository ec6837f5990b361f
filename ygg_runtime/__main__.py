from ygg_runtime.cli import main

main()
