from kiln.cli import main

main()
