"""IncrementalDetokenizer: streamed deltas that add up to the decoded text, spaces and
multi-byte characters intact, never showing text a stop string later cuts off."""

from __future__ import annotations

import random

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st
from tokenizer_testing import PieceTokenizer

from jaxserve.tokenizer import IncrementalDetokenizer, get_tokenizer


def stream(tok, prompt_ids, output_ids, chunks=None, **kw):
    """Feeds output_ids in chunks (default one token each); returns (deltas, detokenizer)."""
    detok = IncrementalDetokenizer(tok, prompt_ids, **kw)
    chunks = chunks or [1] * len(output_ids)
    deltas, pos = [], 0
    for k, size in enumerate(chunks):
        last = k == len(chunks) - 1
        delta, stop = detok.update(output_ids[pos : pos + size], finished=last)
        deltas.append(delta)
        pos += size
        if stop is not None:
            break
    return deltas, detok


def continuation(tok, prompt_ids, output_ids):
    return tok.decode(prompt_ids + output_ids)[len(tok.decode(prompt_ids)) :]


# ---------------------------------------------------------------- sentencepiece-spaces


def split_encoding(tok, prompt_text, full_text):
    """Encodes ``full_text`` and splits the ids after those of ``prompt_text``: the output
    ids are what a model trained on this tokenization generates after the prompt."""
    full = tok.encode(full_text)
    n = len(tok.encode(prompt_text))
    assert full[:n] == tok.encode(prompt_text)
    return full[:n], full[n:]


def test_sentencepiece_spaces(sp_tokenizer):
    tok = sp_tokenizer
    prompt, output = split_encoding(
        tok, "Once upon a", "Once upon a time there  was a king.\nThe end"
    )
    assert tok.convert_ids_to_tokens(output)[0] == "▁time"
    assert tok.decode(output) == "time there  was a king.\nThe end"  # alone: no leading space
    deltas, detok = stream(tok, prompt, output)
    joined = "".join(deltas)
    assert joined == " time there  was a king.\nThe end"
    assert tok.decode(prompt) + joined == tok.decode(prompt + output)
    assert detok.output_text == joined
    assert deltas[0] == " time"  # the first generated token's "▁" is a space


def test_sentencepiece_spaces_after_bos_only_prompt(sp_tokenizer):
    """With nothing but BOS before it, the first word has no leading space, as in decode."""
    tok = sp_tokenizer
    output = tok.encode("Hello world", add_special_tokens=False)
    deltas, _ = stream(tok, [tok.bos_token_id], output)
    assert "".join(deltas) == "Hello world" == tok.decode([1] + output)


def test_sentencepiece_spaces_after_special_tokens_in_prompt(sp_tokenizer):
    """The window reaches back past trailing special tokens to a real one."""
    tok = sp_tokenizer
    prompt = tok.encode("Question") + [2] * 7
    output = tok.encode("answer", add_special_tokens=False)  # "▁answer"
    deltas, _ = stream(tok, prompt, output)
    assert "".join(deltas) == " answer" == continuation(tok, prompt, output)
    # Only special tokens before it: no space, as decode(all ids) has none either.
    deltas, _ = stream(tok, [1] * 7, output)
    assert "".join(deltas) == "answer" == tok.decode([1] * 7 + output)


def test_skip_special_tokens_false(sp_tokenizer):
    tok = sp_tokenizer
    prompt, output = split_encoding(tok, "Hi", "Hi there")
    output = output + [tok.eos_token_id]
    deltas, _ = stream(tok, prompt, output, skip_special_tokens=False)
    assert "".join(deltas) == " there</s>"
    deltas, _ = stream(tok, prompt, output, skip_special_tokens=True)
    assert "".join(deltas) == " there"


# ---------------------------------------------------------------- multi-byte characters


def test_multibyte_split_over_byte_fallback_tokens(sp_tokenizer):
    tok = sp_tokenizer
    text = "héllo 世界 🙂"
    prompt, output = split_encoding(tok, "Say:", "Say: " + text)
    pieces = tok.convert_ids_to_tokens(output)
    assert sum(p.startswith("<0x") for p in pieces) >= 9  # é, 世, 界 and 🙂 are byte pieces
    deltas, _ = stream(tok, prompt, output)
    assert all("\ufffd" not in d for d in deltas)
    assert "".join(deltas) == " " + text
    # While a character's bytes are incomplete nothing is emitted.
    emoji_at = pieces.index("<0xF0>")
    assert deltas[emoji_at : emoji_at + 3] == ["", "", ""] and deltas[emoji_at + 3] == "🙂"


def test_incomplete_character_is_flushed_at_finish(sp_tokenizer):
    tok = sp_tokenizer
    prompt, output = split_encoding(tok, "x", "x 世")
    output = output[:-1]  # lose the last byte
    detok = IncrementalDetokenizer(tok, prompt)
    held = [detok.update([t])[0] for t in output]
    assert "".join(held) == " "
    delta, _ = detok.update([], finished=True)
    assert delta.endswith("\ufffd") and " " + delta.lstrip(" ") == continuation(tok, prompt, output)


def test_byte_level_bpe_multibyte(bpe_dir):
    tok = get_tokenizer(bpe_dir)
    prompt = tok.encode("Hello")
    output = tok.encode(" wörld 世界 🙂!", add_special_tokens=False)
    deltas, _ = stream(tok, prompt, output)
    assert all("\ufffd" not in d for d in deltas)
    assert "".join(deltas) == " wörld 世界 🙂!"


def test_metaspace_unigram_spaces(unigram_dir):
    tok = get_tokenizer(unigram_dir)
    prompt, output = split_encoding(tok, "Once upon a", "Once upon a time there was a king")
    deltas, _ = stream(tok, prompt, output)
    assert "".join(deltas) == continuation(tok, prompt, output) == " time there was a king"


@settings(max_examples=60, deadline=None)
@given(prompt=st.text(max_size=20), text=st.text(max_size=40), seed=st.integers(0, 2**16))
def test_joined_deltas_equal_decode_under_any_chunking(sp_tokenizer, prompt, text, seed):
    """The invariant, for arbitrary Unicode (byte fallback everywhere) and arbitrary
    chunkings of the output ids."""
    tok = sp_tokenizer
    prompt_ids = tok.encode(prompt)
    output = tok.encode(text, add_special_tokens=False)
    rng = random.Random(seed)
    chunks, left = [], len(output)
    while left > 0:
        chunks.append(min(left, rng.randint(1, 4)))
        left -= chunks[-1]
    deltas, detok = stream(tok, prompt_ids, output, chunks or [0])
    assert "".join(deltas) == continuation(tok, prompt_ids, output)
    if "\ufffd" not in prompt + text:
        assert all("\ufffd" not in d for d in deltas)


# ---------------------------------------------------------------- stop-string-leak


PIECES = ["Hel", "lo", " wor", "ld", "!", " Good", "bye", " E", "ND", " e", "xtra", " END"]


def run_stop(output_pieces, stop, include, chunks=None):
    tok = PieceTokenizer(PIECES)
    prompt = tok.ids("Hel")
    deltas, detok = stream(
        tok, prompt, tok.ids(*output_pieces), chunks, stop=stop, include_stop_str_in_output=include
    )
    return deltas, detok


@pytest.mark.parametrize(
    "include, expected", [(False, "lo world! Goodbye"), (True, "lo world! Goodbye END")]
)
def test_stop_string_spanning_a_token_boundary(include, expected):
    # " END" arrives as " E" + "ND".
    out = ["lo", " wor", "ld", "!", " Good", "bye", " E", "ND", " e", "xtra"]
    deltas, detok = run_stop(out, [" END"], include)
    assert detok.stop_str == " END"
    assert detok.output_text == expected
    assert "".join(deltas) == expected
    assert " E" not in "".join(deltas[:7])  # " E" was withheld until " END" was decided


@pytest.mark.parametrize("include, expected", [(False, "lo world! Go"), (True, "lo world! Goodb")])
def test_stop_string_inside_a_single_token(include, expected):
    out = ["lo", " wor", "ld", "!", " Good", "bye", " E"]
    deltas, detok = run_stop(out, ["odb"], include)
    assert detok.stop_str == "odb"
    assert "".join(deltas) == detok.output_text == expected


@pytest.mark.parametrize("include", [False, True])
@pytest.mark.parametrize("chunks", [None, [3, 4, 3], [10]])
def test_no_delta_shows_text_past_the_cut(include, chunks):
    out = ["lo", " wor", "ld", "!", " Good", "bye", " E", "ND", " e", "xtra"]
    deltas, detok = run_stop(out, ["! Goodbye E", "ld!"], include, chunks)
    expected = "lo world!" if include else "lo wor"
    assert detok.stop_str == "ld!"
    assert "".join(deltas) == detok.output_text == expected
    shown = ""
    for d in deltas:
        shown += d
        assert expected.startswith(shown)


def test_possible_stop_prefix_is_released_when_it_diverges_or_finishes():
    tok = PieceTokenizer(PIECES)
    detok = IncrementalDetokenizer(tok, tok.ids("Hel"), stop=[" END", "!!!"])
    assert detok.update(tok.ids("lo", " E")) == ("lo", None)  # " E" could start " END"
    assert detok.update(tok.ids("xtra")) == (" Extra", None)  # diverged: released
    assert detok.output_text == "lo Extra"
    detok2 = IncrementalDetokenizer(tok, tok.ids("Hel"), stop=[" END"])
    assert detok2.update(tok.ids("lo", " E")) == ("lo", None)
    assert detok2.update([], finished=True) == (" E", None)  # finish releases the holdback
    assert detok2.update(tok.ids("ND")) == ("", None)  # finished: later tokens are ignored


def test_stop_string_in_real_sentencepiece_text(sp_tokenizer):
    tok = sp_tokenizer
    prompt, output = split_encoding(
        tok, "Once upon a", "Once upon a time there was a king who lived"
    )
    deltas, detok = stream(tok, prompt, output, stop=["e was"])
    assert detok.stop_str == "e was"
    assert "".join(deltas) == detok.output_text == " time ther"


def reference_stop(text, stops, include):
    """Char-by-char reference: the first position where some stop string ends."""
    for end in range(1, len(text) + 1):
        hits = [s for s in stops if text[:end].endswith(s)]
        if hits:
            s = max(hits, key=len)
            return text[:end] if include else text[: end - len(s)]
    return text


@settings(max_examples=150, deadline=None)
@given(
    out=st.lists(st.sampled_from(PIECES), max_size=12),
    stops=st.lists(st.text(alphabet="HeloEND wr!dGbyxta", min_size=1, max_size=5), max_size=3),
    include=st.booleans(),
    seed=st.integers(0, 2**16),
)
def test_stop_strings_match_char_by_char_reference(out, stops, include, seed):
    tok = PieceTokenizer(PIECES)
    ids = tok.ids(*out)
    rng = random.Random(seed)
    chunks, left = [], len(ids)
    while left > 0:
        chunks.append(min(left, rng.randint(1, 3)))
        left -= chunks[-1]
    deltas, detok = stream(
        tok, tok.ids("Hel"), ids, chunks or [0], stop=stops, include_stop_str_in_output=include
    )
    expected = reference_stop("".join(out), stops, include)
    assert "".join(deltas) == detok.output_text == expected
    shown = ""
    for d in deltas:  # no delta ever shows text beyond the final cut
        shown += d
        assert expected.startswith(shown)


# ---------------------------------------------------------------- fast path


@pytest.mark.parametrize("skip", [True, False])
@pytest.mark.parametrize("which", ["sp", "bpe", "unigram"])
def test_fast_path_deltas_equal_window_decoding(which, skip, sp_tokenizer, bpe_dir, unigram_dir):
    """Tokens whose text cannot depend on their neighbours skip the window decodes; every delta
    must equal what the window algorithm alone gives, for random ids (specials, byte pieces
    and all) streamed one at a time."""
    tok = {"sp": sp_tokenizer}.get(which) or get_tokenizer(
        bpe_dir if which == "bpe" else unigram_dir
    )
    rng = random.Random(f"{which}{skip}")
    words = tok.encode(
        "Once upon a time, naïve café 世界 🙂 there was a king!", add_special_tokens=False
    )
    fast_steps = []
    for _ in range(40):
        prompt = [rng.randrange(tok.vocab_size) for _ in range(rng.randint(0, 6))]
        pool = [rng.randrange(tok.vocab_size) for _ in range(8)] + words
        output = [rng.choice(pool) for _ in range(rng.randint(1, 30))]
        fast = IncrementalDetokenizer(tok, prompt, skip_special_tokens=skip)
        slow = IncrementalDetokenizer(tok, prompt, skip_special_tokens=skip)
        slow._stream_one = lambda token_id: None
        one = fast._stream_one
        fast._stream_one = lambda token_id, one=one: (
            fast_steps.append(one(token_id)) or fast_steps[-1]
        )
        for k, t in enumerate(output):
            last = k == len(output) - 1
            fast_delta = fast.update([t], finished=last)
            assert fast_delta == slow.update([t], finished=last), (prompt, output[: k + 1])
            assert (fast.prefix_offset, fast.read_offset) == (slow.prefix_offset, slow.read_offset)
    assert sum(x is not None for x in fast_steps) > 100  # the fast path did run
