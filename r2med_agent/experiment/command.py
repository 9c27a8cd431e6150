"""The ``r2med-agent run`` command line that gives a run spec (:func:`cli_args`): what
``reproduce`` prints beside each row and runs, and what a result's record turns back into."""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

from r2med_agent.errors import ConfigError
from r2med_agent.experiment.spec import SAMPLING_FLAGS, SPEC_FLAGS, VERSION_MARKERS, RunSpec

__all__ = ["cli_args"]


def cli_args(spec: RunSpec, candidates_path: str | None = None) -> list[str]:
    """The ``r2med-agent run`` options that give ``spec`` (its non-default settings; the prompts
    in use come from ``$R2MED_PROMPTS_DIR``, not from an option). A run over ``--candidates``
    needs ``candidates_path``, the files its hash was made from.

    Raises:
        ConfigError: a sampling override has no ``run`` option (set it in the LLM's entry); a
            run over candidates without their path; a spec of an earlier version's behaviour.
    """
    out = ["--method", spec.method]
    if spec.llm:
        out += ["--llm", spec.llm]
    if spec.generations != "fresh":
        out += ["--generations", spec.generations]
    if spec.candidates is not None and candidates_path is not None:
        out += ["--candidates", candidates_path]
    else:
        out += ["--retriever", spec.retriever]
    if spec.reranker:
        out += ["--reranker", spec.reranker]
    out += _prompts_args(spec)
    for name, value in spec.non_default().items():
        if name in ("method", "llm", "generations", "retriever", "reranker", "prompts", "entries", "prompts_from"):
            continue
        if name == "candidates" and candidates_path is not None:
            continue
        if name == "candidates":
            raise ConfigError("a run over --candidates is given by the files' path, which its spec (their hash) "
                              "does not hold")
        if name == "sampling":
            out += _sampling_args(value)
            continue
        if name == "kind_options":
            out += _kind_option_args(value)
            continue
        if name in VERSION_MARKERS:
            raise ConfigError(f"{name} {value} names results of an earlier version's {VERSION_MARKERS[name][2]}, "
                              "which this version does not run")
        flag = SPEC_FLAGS.get(name, "--" + name.replace("_", "-"))
        if isinstance(value, bool):
            out += [flag] if value else []
        elif isinstance(value, list):
            out += [flag, ",".join(_fmt(x) for x in value)]
        else:
            out += [flag, str(value)]
    return out


def _fmt(value: Any) -> str:
    return f"{value:g}" if isinstance(value, float) else "none" if value is None else str(value)


def _prompts_args(spec: RunSpec) -> list[str]:
    """``--prompts own|authors`` where the spec's wording is not the run's default.

    Raises:
        ConfigError: the spec names the authors' prompts at commits this version does not pin.
    """
    from r2med_agent.prompts.sources import AUTHORS, OWN
    from r2med_agent.prompts.sources import resolve as resolve_prompts

    if spec.prompts_from == resolve_prompts(None, spec.method, spec.llm, spec.generations, spec.reranker):
        return []
    if spec.prompts_from == OWN:
        return ["--prompts", OWN]
    if spec.prompts_from == resolve_prompts(AUTHORS, spec.method, spec.llm, spec.generations, spec.reranker):
        return ["--prompts", AUTHORS]
    raise ConfigError(f"prompts_from {spec.prompts_from} names results made with the authors' prompts at other "
                      "commits, which this version does not fetch")


def _sampling_args(sampling: Mapping[str, Any]) -> list[str]:
    out = []
    for name, value in sampling.items():
        if name not in SAMPLING_FLAGS:
            raise ConfigError(f"sampling override '{name}' has no `run` option; set it in the LLM's registry entry")
        out += [SAMPLING_FLAGS[name], _fmt(value)]
    return out


def _kind_option_args(values: Mapping[str, Mapping[str, Any]]) -> list[str]:
    """The options of retriever kinds' own settings (``kind_options``), by the flags they declare."""
    from r2med_agent.retrieval.registry import kind_option_fields

    flags = {(kind, f.name): names[0] for kind, f, names, _ in kind_option_fields()}
    out = []
    for kind, settings in values.items():
        for name, value in settings.items():
            if (kind, name) not in flags:
                raise ConfigError(f"retriever kind '{kind}' declares no option {name} here (is its plugin loaded?)")
            out += [flags[kind, name], _fmt(value)]
    return out
