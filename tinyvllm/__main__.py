import sys

from tinyvllm.entrypoints.cli import main

if __name__ == "__main__":   # the engine process (spawned by serve) imports this module again: do nothing then
    sys.exit(main())
