"""Structured outputs: constraints compiled with xgrammar, one matcher per request
(``manager.py``, used by the engine core). The runner applies the packed token bitmask the
manager fills with ``model_executor/layers/grammar_bitmask.py``."""
