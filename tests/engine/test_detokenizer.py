"""Incremental detokenization and stop strings, on the default model's real byte-level BPE."""

from __future__ import annotations

from typing import Any

import pytest

from kvgate.engine.detokenizer import ByteLevelTable, IncrementalDetokenizer

MULTIBYTE = "Grüße aus Köln 🎉🎉 und 世界 ok"


@pytest.fixture(scope="module")
def real_tok() -> Any:
    from kvgate.api.tokenizer import load_tokenizer

    return load_tokenizer("default")


@pytest.fixture(scope="module")
def table(real_tok: Any) -> ByteLevelTable:
    t = ByteLevelTable.build(real_tok)
    assert t is not None
    return t


class _WithTable:
    """The real tokenizer, with every detokenizer built here taking the byte-level fast path."""

    def __init__(self, tok: Any, table: ByteLevelTable) -> None:
        self.tok, self.table = tok, table

    def __getattr__(self, name: str) -> Any:
        return getattr(self.tok, name)


@pytest.fixture(params=["window", "byte-table"], scope="module")
def tok(request: pytest.FixtureRequest, real_tok: Any, table: ByteLevelTable) -> Any:
    return real_tok if request.param == "window" else _WithTable(real_tok, table)


def _detok(tok: Any, prompt: list[int], **kw: Any) -> IncrementalDetokenizer:
    if isinstance(tok, _WithTable):
        return IncrementalDetokenizer(tok.tok, prompt, byte_table=tok.table, **kw)
    return IncrementalDetokenizer(tok, prompt, **kw)


def _stream(tok: Any, text: str, prompt: str = "Say:", **kw: Any) -> tuple[list[str], IncrementalDetokenizer]:
    d = _detok(tok, tok.encode(prompt), **kw)
    deltas = [d.add_token(t) for t in tok.encode(text)]
    deltas.append(d.flush())
    return deltas, d


def test_multibyte_characters_split_over_tokens_never_leak_replacement_chars(tok: Any) -> None:
    ids = tok.encode(MULTIBYTE)
    assert any("\ufffd" in tok.decode([i]) for i in ids)  # the test really splits characters
    deltas, d = _stream(tok, MULTIBYTE)
    assert "".join(deltas) == MULTIBYTE == d.text
    assert not any("\ufffd" in x for x in deltas)
    # Released as soon as complete: the emoji comes out in one piece, not at the end.
    assert "🎉" in deltas and deltas[-1] == ""


def test_leading_space_of_the_first_output_token_is_kept(tok: Any) -> None:
    deltas, _ = _stream(tok, " Paris is nice.", prompt="The capital of France is")
    assert "".join(deltas) == " Paris is nice."


def test_an_unfinished_character_at_the_end_is_flushed(tok: Any) -> None:
    ids = tok.encode("ok 🎉")
    d = _detok(tok, [], skip_special_tokens=True)
    out = "".join(d.add_token(t) for t in ids[:-1])
    assert "\ufffd" not in out
    assert out + d.flush() == tok.decode(ids[:-1])


def test_special_tokens_are_skipped_or_kept(tok: Any) -> None:
    eos = tok.eos_token_id
    ids = [*tok.encode("hi"), eos]
    d = _detok(tok, [])
    assert "".join(d.add_token(t) for t in ids) + d.flush() == "hi"
    d = _detok(tok, [], skip_special_tokens=False)
    assert "".join(d.add_token(t) for t in ids) + d.flush() == "hi" + tok.decode(
        [eos], skip_special_tokens=False
    )


def test_stop_string_across_token_boundaries_is_cut_and_never_streamed(tok: Any) -> None:
    text = "alpha beta STOP-HERE gamma"
    stop = "P-HE"  # starts inside one token and ends inside another
    deltas, d = _stream(tok, text, stop=[stop])
    assert d.stop_string == stop
    assert "".join(deltas) == "alpha beta STO" == d.text
    for i in range(len(deltas)):
        assert stop not in "".join(deltas[: i + 1])


def test_include_stop_str_in_output(tok: Any) -> None:
    deltas, d = _stream(tok, "one two three four", stop=["three"], include_stop_str_in_output=True)
    assert "".join(deltas) == "one two three"
    assert d.add_token(tok.encode(" more")[0]) == ""  # nothing after a stop


def test_earliest_of_several_stop_strings_completed_by_one_token_wins(tok: Any) -> None:
    deltas, d = _stream(tok, "a b c d e f", stop=["d e", "c d e"])
    assert "".join(deltas) == "a b " and d.stop_string == "c d e"


def test_text_that_may_become_a_stop_string_is_held_back_then_released(tok: Any) -> None:
    d = _detok(tok, [], stop=["END."])
    released = ""
    for t in tok.encode("the EN"):
        released += d.add_token(t)
    assert released == "the "  # "EN" could start "END."
    for t in tok.encode("D is near"):
        released += d.add_token(t)
    assert released == "the END is near"
    assert d.stop_string is None and released + d.flush() == "the END is near"


def test_held_back_text_is_released_at_the_end(tok: Any) -> None:
    deltas, d = _stream(tok, "wait for it E", stop=["END"])
    assert deltas[-1] == "E" and "".join(deltas) == "wait for it E"
    assert d.stop_string is None


def test_stop_strings_wait_for_min_tokens(tok: Any) -> None:
    ids = tok.encode("stop here, then stop again")
    d = _detok(tok, [], stop=["stop"], min_tokens=3)
    out = "".join(d.add_token(t) for t in ids)
    assert d.stop_string == "stop" and out == "stop here, then "


def test_byte_table_decodes_exactly_like_the_tokenizer(real_tok: Any, table: ByteLevelTable) -> None:
    import random

    rng = random.Random(0)
    n = len(table.pieces)
    for _ in range(200):
        ids = [rng.randrange(n) for _ in range(rng.randrange(1, 12))]
        for skip in (True, False):
            d = IncrementalDetokenizer(real_tok, [], skip_special_tokens=skip, byte_table=table)
            text = "".join(d.add_token(t) for t in ids) + d.flush()
            assert text == real_tok.decode(ids, skip_special_tokens=skip), ids


def test_byte_table_is_only_for_byte_level_tokenizers() -> None:
    from tokenizers import Tokenizer, decoders, models

    wordpiece = Tokenizer(models.WordPiece({"[UNK]": 0, "a": 1}, unk_token="[UNK]"))
    wordpiece.decoder = decoders.WordPiece()
    assert ByteLevelTable.build(wordpiece) is None


def test_a_single_stop_string_is_not_taken_for_a_list_of_characters(tok: Any) -> None:
    deltas, d = _stream(tok, "abc STOP def", stop="STOP")
    assert "".join(deltas) == "abc " and d.stop_string == "STOP"
