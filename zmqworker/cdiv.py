"""Ceiling division, the one helper every layer of the package needs."""


def cdiv(a: int, b: int) -> int:
    """ceil(a / b) for positive b, in integers (numpy arrays too)."""
    return -(-a // b)
