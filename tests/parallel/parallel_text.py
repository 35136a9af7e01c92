"""Random prompt text for the parallel tests."""
import torch


def random_text(rng, n: int) -> str:
    """``n`` random lowercase letters drawn from ``rng``."""
    return "".join(chr(int(c)) for c in torch.randint(97, 123, (n,), generator=rng))
