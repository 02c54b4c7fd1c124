"""Compilation: FX passes over Dynamo graphs and the persistent compile cache.

Submodules are imported explicitly (``ingot.compilation.passes``, ``ingot.compilation.cache``)
so that using the cache does not pull in torch and using the passes does not pull in filelock.
"""
