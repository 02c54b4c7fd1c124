import sys
from pathlib import Path

import pytest

sys.path.insert(0, str(Path(__file__).parent / "models"))


@pytest.fixture(scope="session")
def tiny_llama_dir(tmp_path_factory):
    """A tiny random Llama with a byte-level tokenizer, saved as an HF directory."""
    from tiny import make_byte_tokenizer, make_tiny_model

    path = tmp_path_factory.mktemp("tiny-llama")
    make_tiny_model("llama", path, vocab_size=259)
    make_byte_tokenizer(path)
    return path
