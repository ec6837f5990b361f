from ygg_bench.cli import main

main()
