"""Triton kernels and their launchers, one file per op (installed as fastllm.kernels).

Import a submodule only when its backend is chosen: importing triton is slow, and on a CPU-only
machine Triton kernels run only under TRITON_INTERPRET=1.
"""


# Grid and block arithmetic on the host. triton.cdiv and triton.next_power_of_2 are
# ConstexprFunctions (Triton 3.6 and later): usable inside kernels, but each host call unwraps
# its arguments in Python, ~5 us where these take ~0.1; a patched model step makes ~500 such calls.

def cdiv(a, b):
    """ceil(a / b) of non-negative ints a and positive b."""
    return -(-a // b)


def next_power_of_2(n):
    """The smallest power of two >= n for n >= 1 (0 for 0), as triton.next_power_of_2."""
    return 1 << (n - 1).bit_length() if n > 1 else max(n, 0)
