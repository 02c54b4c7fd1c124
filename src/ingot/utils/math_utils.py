"""Small integer helpers shared by every layer."""


def cdiv(a: int, b: int) -> int:
    """Ceiling division: the blocks (or tiles) ``a`` items fill, ``b`` to each."""
    return -(-a // b)
