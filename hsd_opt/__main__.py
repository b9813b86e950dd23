from hsd_opt.cli import main

main()
