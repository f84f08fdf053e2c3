"""The text filter between detokenizer and stream parser, on its own (no library involved)."""
from __future__ import annotations

from hypothesis import given, settings, strategies as st

from services.gateway.adapter.output_scanner import (
    SENTINEL_DSML, SENTINEL_THINK_END, OutputScanner, Stage,
)

D, END = "｜DSML｜", "</think>"
OPEN, CLOSE = f"<{D}tool_calls>", f"</{D}tool_calls>"


def invoke(name="f", value="1", string="false"):
    return (f'<{D}invoke name="{name}">\n<{D}parameter name="x" string="{string}">{value}'
            f'</{D}parameter>\n</{D}invoke>')


def scanner(start=Stage.ANSWER, parse=True, tools=("f",)):
    return OutputScanner(start=start, parse_tool_calls=parse, tool_names=frozenset(tools),
                         dsml=D, think_end=END)


def run(text: str, pieces=None, **kw) -> tuple[str, OutputScanner]:
    s = scanner(**kw)
    out = "".join(s.feed(p) for p in (pieces if pieces is not None else [text]))
    return out + s.finish(), s


def test_reasoning_escapes_dsml_and_passes_think_end():
    out, s = run(f"a {OPEN} b{END}c", start=Stage.REASONING)
    assert out == f"a <{SENTINEL_DSML}tool_calls> b{END}c"
    assert s.stage is Stage.ANSWER


def test_answer_escapes_stray_markers_and_restores_them():
    out, s = run(f"x {END} y {D} z")
    assert out == f"x {SENTINEL_THINK_END} y {SENTINEL_DSML} z"
    assert s.restore(out) == f"x {END} y {D} z"


def test_valid_calls_are_released_last_as_one_block():
    out, s = run(f"pre{OPEN}\n{invoke(value='1')}\n{CLOSE} mid {OPEN}{invoke(value='2')}{CLOSE}post")
    assert out == f"pre mid post{OPEN}\n{invoke(value='1')}\n{invoke(value='2')}\n{CLOSE}"
    assert s.rejected == []


def test_invalid_invokes_and_stray_block_text_become_escaped_text():
    bad_name, bad_json = invoke(name="nope"), invoke(value="{oops")
    out, s = run(f"{OPEN}{bad_name}junk{invoke()}{bad_json}{CLOSE}")
    assert s.restore(out) == f"{bad_name}junk{bad_json}{OPEN}\n{invoke()}\n{CLOSE}"
    assert OPEN not in out.split(OPEN)[0]                 # rejected text holds no live marker
    assert [r.reason for r in s.rejected] == ["unknown tool 'nope'", "text outside an invoke",
                                              "parameter 'x' is not valid JSON"]


def test_string_parameters_need_no_json():
    out, s = run(f"{OPEN}{invoke(value='plain {{ text', string='true')}{CLOSE}")
    assert s.rejected == [] and out.startswith(OPEN)


def test_cut_block_keeps_complete_calls_and_returns_the_rest_as_text():
    partial = f'<{D}invoke name="f">\n<{D}parameter name="x" string="false">[1, 2'
    out, s = run(f"{OPEN}{invoke()}\n{partial}")
    assert s.restore(out) == f"\n{partial}{OPEN}\n{invoke()}\n{CLOSE}"
    assert s.rejected[-1].reason == "cut off"


def test_without_tool_parsing_blocks_are_plain_text():
    text = f"{OPEN}{invoke()}{CLOSE}"
    out, s = run(text, parse=False)
    assert s.restore(out) == text and SENTINEL_DSML in out and s.stage is Stage.ANSWER


def test_required_tool_choice_starts_inside_the_block():
    out, _ = run(f"{invoke()}\n{CLOSE}", start=Stage.TOOL_BLOCK)
    assert out == f"{OPEN}\n{invoke()}\n{CLOSE}"


def test_partial_markers_are_held_until_decided():
    s = scanner()
    assert s.feed("abc <") == "abc " and s.has_held_text
    assert s.feed(D) == "" and s.feed("tool_") == ""      # may still become the opener
    assert s.feed("x") == f"<{SENTINEL_DSML}tool_x"       # it did not
    assert not s.has_held_text


def test_sentinels_written_by_the_model_become_replacement_characters():
    out, s = run(f"a{SENTINEL_DSML}b{SENTINEL_THINK_END}")
    assert s.restore(out) == "a\ufffdb\ufffd"


FRAGMENTS = st.sampled_from(["a", " ", "\n", "<", "/", "｜", "DSML", D, END, "</think", OPEN, CLOSE,
                             OPEN[:7], CLOSE[:9], invoke(), invoke(name="zz"), invoke(value="{"),
                             '"', "tool_calls>", "🦜"])


@settings(max_examples=200, deadline=None)
@given(st.lists(FRAGMENTS, max_size=14), st.data(), st.sampled_from([Stage.REASONING, Stage.ANSWER]))
def test_output_does_not_depend_on_how_the_text_is_split(fragments, data, start):
    text = "".join(fragments)
    cuts = sorted(data.draw(st.sets(st.integers(0, len(text)), max_size=8)))
    pieces = [text[a:b] for a, b in zip([0, *cuts], [*cuts, len(text)])]
    whole, _ = run(text, start=start)
    split, s = run(text, pieces, start=start)
    assert split == whole
    restored = s.restore(split)
    assert SENTINEL_DSML not in restored and SENTINEL_THINK_END not in restored
    if OPEN not in text:                                     # no block: text passes through whole
        assert restored == text
