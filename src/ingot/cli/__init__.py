"""The `ingot` command: `launcher.py` is the console script (Ctrl-C handling, lazy imports),
`main.py` the parser and the commands. It sits above every other layer: it dispatches to the
accuracy toolkit and the benchmarks, which drive the `LLM` class and the server."""
