"""`python -m fastllm` is the `fastllm` command (so `torchrun -m fastllm train ...` works)."""

from fastllm.cli import main

main()
