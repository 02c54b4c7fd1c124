from tiny import make_byte_tokenizer

from ingot.engine.detokenizer import IncrementalDetokenizer

TEXT = "héllo wörld — 日本語 🙂 ok"


def _tok(tmp_path):
    return make_byte_tokenizer(tmp_path)


def test_multibyte_characters_are_never_split(tmp_path):
    tok = _tok(tmp_path)
    ids = tok.encode(TEXT)
    assert len(ids) > len(TEXT)  # multi-byte characters span several tokens
    detok = IncrementalDetokenizer(tok, tok.encode("prompt"))
    seen = []
    for t in ids:
        detok.update([t])
        seen.append(detok.get_next_output_text(finished=False, delta=True))
    assert all("\ufffd" not in s for s in seen)
    assert "".join(seen) == TEXT
    assert detok.output_text == TEXT


def test_stop_string_truncates_and_is_not_emitted(tmp_path):
    tok = _tok(tmp_path)
    detok = IncrementalDetokenizer(tok, [5], stop=["wör"])
    matched = None
    for t in tok.encode(TEXT):
        matched = detok.update([t])
        if matched:
            break
    assert matched == "wör"
    assert detok.output_text == "héllo "


def test_stop_string_included_when_asked(tmp_path):
    tok = _tok(tmp_path)
    detok = IncrementalDetokenizer(tok, [5], stop=["wör"], include_stop_str_in_output=True)
    for t in tok.encode(TEXT):
        if detok.update([t]):
            break
    assert detok.output_text == "héllo wör"


def test_streaming_holds_back_a_possible_stop_prefix(tmp_path):
    tok = _tok(tmp_path)
    detok = IncrementalDetokenizer(tok, [5], stop=["STOP"])
    for t in tok.encode("abcST"):
        detok.update([t])
    # "ST" could start "STOP": only text that cannot be part of it is shown.
    assert detok.get_next_output_text(finished=False, delta=False) == "ab"
    assert detok.get_next_output_text(finished=True, delta=False) == "abcST"


def test_flush_emits_incomplete_bytes_at_the_end(tmp_path):
    tok = _tok(tmp_path)
    ids = tok.encode("a日")[:-1]  # cut inside the 3-byte character
    detok = IncrementalDetokenizer(tok, [5])
    detok.update(ids[:-1])
    detok.update(ids[-1:], finishing=True)
    assert detok.output_text.startswith("a") and len(detok.output_text) == 2
