from trnrt.cli import main

main()
