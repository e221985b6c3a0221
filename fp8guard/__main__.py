from fp8guard.cli import main

main()
