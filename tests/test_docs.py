"""Docs that cannot drift (issue 62): every argument of ``memfit.fit`` is in the FAQ, and every flag that takes
one of a fixed set of values names each of them in its help."""

from __future__ import annotations

import dataclasses
import inspect
import re
from pathlib import Path

import memfit
from memfit.engine.methods import METHODS
from memfit.engine.parts.treatments import KEEP, TREATMENTS

ROOT = Path(__file__).resolve().parents[1]


def _faq_fit_section() -> str:
    text = (ROOT / "docs" / "faq.md").read_text()
    start = text.index("## What does each argument of `memfit.fit` do?")
    return text[start:text.index("\n## ", start + 1)]


def test_every_fit_argument_is_in_the_faq():
    section = _faq_fit_section()
    for name, parameter in inspect.signature(memfit.fit).parameters.items():
        assert re.search(rf"\b{name}\b", section), f"memfit.fit's {name} is not in docs/faq.md's argument section"
        if parameter.default is not inspect.Parameter.empty and parameter.kind is not inspect.Parameter.VAR_KEYWORD:
            shown = repr(parameter.default).replace("'", '"')  # the FAQ writes strings in double quotes
            assert f"{name}={shown}" in section.replace("\n", " "), (
                f"docs/faq.md's signature of memfit.fit lacks {name}={parameter.default!r}")


def _helps() -> dict[str, str]:
    from memfit.integrations.hf import MemfitArguments

    return {f.name: f.metadata.get("help", "") for f in dataclasses.fields(MemfitArguments)}


def test_every_flag_with_fixed_choices_names_them_all():
    from memfit.integrations.hf import HEAD_FLAG

    helps = _helps()
    choices = {
        "memfit_method": list(METHODS),
        "memfit_treatments": [name for name in TREATMENTS if name != KEEP] + ["auto"],
        "memfit_head": list(HEAD_FLAG),
        "memfit_backstop": ["auto", "true", "false"],
    }
    for flag, values in choices.items():
        for value in values:
            assert re.search(rf"\b{re.escape(value)}\b", helps[flag]), f"--{flag}'s help does not name {value!r}"


def test_the_default_treatments_in_the_help_are_those_offered():
    """``--memfit_treatments auto``'s help names every treatment that offers itself by default somewhere
    (its class overrides ``Treatment.by_default``), and recompute, which every run has."""
    offered = {name for name, t in TREATMENTS.items() if t.__dict__.get("by_default") is not None} | {"recompute"}
    assert "elementwise" in offered and "host_checkpoint" in offered
    default_part = _helps()["memfit_treatments"].split("Default: auto", 1)[-1]
    for name in offered:
        assert re.search(rf"\b{name}\b", default_part), f"--memfit_treatments' default omits {name}"
