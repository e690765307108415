from moeshard.cli import main

main()
