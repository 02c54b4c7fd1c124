"""Structured outputs: constraints compiled with xgrammar (``manager.py``, used by the engine
core) and the packed token bitmask the runner applies to the logits (``bitmask.py``)."""
