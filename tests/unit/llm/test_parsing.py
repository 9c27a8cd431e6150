"""Reasoning-output parsing (docs/protocol.md, "Reasoning output")."""

from __future__ import annotations

import pytest

from r2med_agent.errors import ConfigError
from r2med_agent.llm.parsing import REASONING_FORMATS, check_format, split_reasoning


def test_formats_listed():
    assert set(REASONING_FORMATS) == {"plain", "think", "huatuo", "search-r1"}


# -- plain -------------------------------------------------------------------------------------


@pytest.mark.parametrize(
    "text, final",
    [
        # kept as generated, surrounding whitespace included (R2MED's src/base.py uses hy_doc as is)
        ("  A passage.\n", "  A passage.\n"),
        ("", ""),
        ("<think>kept</think> as is", "<think>kept</think> as is"),
        ("Final Response: kept", "Final Response: kept"),
    ],
)
def test_plain_keeps_whole_text(text, final):
    assert split_reasoning(text, "plain") == ("", final)


# -- think ---------------------------------------------------------------------------------------


def test_think_splits_at_close_tag():
    text = "<think>\nThe patient has fever.\n</think>\n\nA passage about malaria."
    assert split_reasoning(text, "think") == ("The patient has fever.", "A passage about malaria.")


def test_think_without_open_tag():
    # R1 distills' chat templates put <think> in the prompt, so the output starts inside it.
    assert split_reasoning("reasoning here</think>answer", "think") == ("reasoning here", "answer")


def test_think_uses_first_close_tag():
    text = "<think>a</think>middle</think>end"
    assert split_reasoning(text, "think") == ("a", "middle</think>end")


def test_think_no_tag_returns_whole_text():
    # The reference's fallback is the text as generated, not stripped (a split one is stripped).
    assert split_reasoning("  just an answer  ", "think") == ("", "  just an answer  ")


def test_think_unclosed_returns_whole_text():
    # A generation cut by max_tokens inside its reasoning: the reference keeps the whole text.
    text = "<think>still reasoning when max_tokens hit"
    assert split_reasoning(text, "think") == ("", text)


def test_think_empty_parts():
    assert split_reasoning("", "think") == ("", "")
    assert split_reasoning("<think></think>", "think") == ("", "")
    assert split_reasoning("<think>\n\n</think>\n\nOnly answer", "think") == ("", "Only answer")
    assert split_reasoning("<think>only reasoning</think>   ", "think") == ("only reasoning", "")


def test_think_open_tag_only_stripped_at_start():
    text = "pre <think>inner</think> post"
    assert split_reasoning(text, "think") == ("pre <think>inner", "post")


# -- huatuo --------------------------------------------------------------------------------------


def test_huatuo_markdown_headings():
    text = "## Thinking\n\nFever and travel suggest malaria.\n\n## Final Response\n\nMalaria is ..."
    assert split_reasoning(text, "huatuo") == (
        "Fever and travel suggest malaria.",
        "Malaria is ...",
    )


def test_huatuo_colon_stays_in_the_response():
    # R2MED's src/base.py: re.search(r"Final Response\s*(.*)") then strip(): a colon after the
    # marker is the response's first character.
    text = "Thinking: step one.\nFinal Response: The answer."
    assert split_reasoning(text, "huatuo") == ("step one.", ": The answer.")


def test_huatuo_heading_with_colon():
    text = "## Thinking\nx\n### Final Response:\n  y  "
    assert split_reasoning(text, "huatuo") == ("x", ":\n  y")


def test_huatuo_first_marker_wins():
    text = "## Thinking\nr\n## Final Response\nfirst ## Final Response\nsecond"
    reasoning, final = split_reasoning(text, "huatuo")
    assert reasoning == "r"
    assert final == "first ## Final Response\nsecond"


def test_huatuo_no_marker_returns_whole_text():
    text = "## Thinking\nnever finished"
    assert split_reasoning(text, "huatuo") == ("", text)
    assert split_reasoning("", "huatuo") == ("", "")


def test_huatuo_marker_is_case_sensitive():
    # The reference matches "Final Response" exactly; lowercase prose is not a marker.
    text = "the final response is pending"
    assert split_reasoning(text, "huatuo") == ("", text)


# -- search-r1 -------------------------------------------------------------------------------------


def test_search_r1_first_answer_span():
    text = (
        "<think>need facts</think><search>malaria</search><information>Doc 1</information>"
        "<answer> Plasmodium </answer> and <answer>second</answer>"
    )
    reasoning, final = split_reasoning(text, "search-r1")
    assert final == "Plasmodium"
    assert reasoning.startswith("<think>need facts</think><search>malaria</search>")
    assert reasoning.endswith("</information>")


def test_search_r1_multiline_answer():
    assert split_reasoning("<answer>line 1\nline 2</answer>", "search-r1") == ("", "line 1\nline 2")


def test_search_r1_unclosed_or_missing_returns_whole_text():
    text = "<think>x</think><answer>never closed"
    assert split_reasoning(text, "search-r1") == ("", text)
    assert split_reasoning(" no tags ", "search-r1") == ("", " no tags ")
    assert split_reasoning("", "search-r1") == ("", "")


def test_search_r1_empty_answer():
    assert split_reasoning("r<answer></answer>", "search-r1") == ("r", "")


# -- errors --------------------------------------------------------------------------------------


def test_unknown_format_names_allowed_values():
    with pytest.raises(ConfigError, match="plain, think, huatuo, search-r1"):
        split_reasoning("x", "r1")
    with pytest.raises(ConfigError, match="unknown reasoning_format 'sky'"):
        check_format("sky")
    assert check_format("think") == "think"
