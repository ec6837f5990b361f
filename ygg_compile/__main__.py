from ygg_compile.cli import main

main()
