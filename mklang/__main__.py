from mklang.cli import main

main()
