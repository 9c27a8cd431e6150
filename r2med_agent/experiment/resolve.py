"""Resolving a run: the one step, at build time, between what a user asks for and the run's plan.

A :class:`~r2med_agent.experiment.spec.RunSpec` is pure data. What a user asks for (a method's
name in any case, options that play no part in the run, a sampling override equal to the LLM's
own default, ``authors`` for the prompts) becomes the run's plan here, by :func:`resolve` (a
:class:`~r2med_agent.experiment.plan.RunPlan`: the resolved spec, which is the run's identity, and
every entry and merged setting the run reads; :func:`resolve_spec` is its spec alone), which
reads the registries once, through :class:`Registries`, and only what the components declare,
never their names:

- a method's :class:`~r2med_agent.methods.base.Capabilities` (does it generate, loop, take
  samples or a first pass, fuse its searches) and the sampling its generations use
  (:meth:`~r2med_agent.methods.base.Method.sampling`);
- a retriever kind's ``combine``, ``has_model`` and ``settings``
  (:data:`~r2med_agent.retrieval.registry.RETRIEVER_KINDS`), and an encoder entry's
  ``encoder_rules`` (the version at which its settings last changed);
- a reranker kind's ``has_model`` and ``published_formats``
  (:data:`~r2med_agent.rerank.kinds.RERANKER_KINDS`);
- an LLM entry's default sampling and backend, and the authors' prompt sources the run renders.

A setting that does not apply is set back to its default and an explicit default is dropped, so
neither splits nor merges folders; a bad combination is a ConfigError naming the option.
:func:`spec_of_config` reads a recorded config: this version's records as they are (no lookup),
an earlier version's upgraded with the version markers of behaviours changed since.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass, fields, replace
from typing import Any

from r2med_agent.errors import ConfigError, did_you_mean
from r2med_agent.experiment.plan import RetrieverFacts, RunPlan
from r2med_agent.experiment.spec import (
    FINAL_MODES,
    LOOP_RULES,
    RELEASED_SOURCES,
    RERANK_RULES,
    REQUEST_RULES,
    VERSION_MARKERS,
    RunSpec,
)
from r2med_agent.methods.base import Capabilities, capabilities
from r2med_agent.names import ORIGINAL_QUERY, member_names
from r2med_agent.types import SAMPLING_KNOBS, sampling_problems

__all__ = ["Registries", "applicable", "resolve", "resolve_spec", "spec_of_config"]


class Registries:
    """What resolving a run reads: this process's registries, looked up when asked (a test or
    a tool may pass a subclass that answers otherwise)."""

    def methods(self) -> Mapping[str, type[Any]]:
        """Method name -> class (:data:`~r2med_agent.methods.METHODS`)."""
        from r2med_agent.methods import METHODS

        return METHODS

    def method(self, name: str) -> tuple[str, type[Any]]:
        """The registered spelling of ``name`` (any case) and its class.

        Raises:
            ConfigError: an unknown method (the message lists the known ones).
        """
        methods = self.methods()
        low = name.strip().lower().replace("_", "-")
        key = low if low in methods else name
        if key not in methods:
            raise ConfigError(f"unknown method '{name}'{did_you_mean(name, methods)}; allowed: {', '.join(methods)}")
        return key, methods[key]

    def retriever_kind(self, word: str) -> Any:
        """The :class:`~r2med_agent.retrieval.registry.RetrieverKind` of a retriever word (None: unknown)."""
        from r2med_agent.retrieval.registry import retriever_kind

        return retriever_kind(word)

    def retriever_kind_options(self, name: str, values: Mapping[str, Any]) -> Any:
        """Kind ``name``'s ``options`` dataclass filled with ``values`` (ConfigError: it declares no such option)."""
        from r2med_agent.retrieval.registry import kind_options
        return kind_options(name, values)

    def reranker(self, name: str | None) -> Any:
        """The reranker entry ``name`` (None: none given, or unknown: reported where it is built)."""
        if not name:
            return None
        from r2med_agent.rerank.spec import reranker_registry

        return reranker_registry().get(name)

    def origin(self, group: str, name: str) -> str | None:
        """Who registered component ``name`` of ``group`` (:func:`~r2med_agent.plugins.registry`):
        ``built in``, a plugin and its distribution, or ``Python``; None: no such name."""
        from r2med_agent.plugins import registry

        return registry(group).origin(name)

    def retriever_kind_name(self, word: str) -> str | None:
        """The registry name of a retriever word's kind (None: unknown)."""
        from r2med_agent.retrieval.registry import RETRIEVER_KINDS

        kind = self.retriever_kind(word)
        return next((name for name, k in RETRIEVER_KINDS.items() if k is kind), None)

    def encoder(self, word: str) -> Any:
        """The encoder entry ``word`` (None: an unknown word, or a retriever that is no encoder)."""
        from r2med_agent.retrieval.dense.spec import encoder_registry

        return encoder_registry().get(word)

    def encoder_rules(self, word: str) -> int:
        """The version at which the encoder entry ``word`` last changed its settings (1: an
        unknown word, a retriever that is no encoder, or an entry never changed)."""
        entry = self.encoder(word)
        return entry.encoder_rules if entry is not None else 1

    def llm(self, name: str | None) -> Any:
        """The LLM entry ``name`` (None: none given, or unknown: reported where it is built)."""
        if not name:
            return None
        from r2med_agent.llm.registry import get_llm_spec

        try:
            return get_llm_spec(name)
        except ConfigError:
            return None


def resolve(spec: RunSpec, registries: Registries | None = None) -> RunPlan:
    """The plan of the run ``spec`` asks for (:class:`~r2med_agent.experiment.plan.RunPlan`): its
    resolved spec (names canonical, settings that do not apply and explicit defaults set back to
    their defaults, ``prompts_from`` the sources the run renders) and every entry, kind and merged
    setting the run reads, each looked up, merged and checked here, once. Resolving a resolved
    spec gives the same plan.

    Raises:
        ConfigError: an unknown method or a setting out of range or that cannot go with another,
            naming the option and the fix.
    """
    reg = registries or Registries()
    resolved, method_cls, found = _resolve(spec, reg, explicit_sampling=False)
    return _plan(resolved, method_cls, found, reg)


def resolve_spec(spec: RunSpec, registries: Registries | None = None) -> RunSpec:
    """The resolved spec alone (:func:`resolve`'s ``spec``): the run's identity."""
    return resolve(spec, registries).spec


def _resolve(spec: RunSpec, reg: Registries, *, explicit_sampling: bool) -> tuple[RunSpec, type[Any], _Found]:
    v: dict[str, Any] = {f.name: getattr(spec, f.name) for f in fields(RunSpec)}
    _check_choices(v)
    v["method"], method_cls = reg.method(v["method"])
    caps = capabilities(method_cls)
    found = _Found(llm=reg.llm(v["llm"]), reranker=reg.reranker(v["reranker"] or None))
    _normalise(v, reg, caps, found)
    _validate(v, reg, caps)
    if not explicit_sampling:
        _drop_default_sampling(v, found, method_cls)
    return RunSpec(**v), method_cls, found


@dataclass(frozen=True)
class _Found:
    """The entries of a run, each looked up by name once."""

    llm: Any = None
    reranker: Any = None


def _plan(spec: RunSpec, method_cls: type[Any], found: _Found, reg: Registries) -> RunPlan:
    """The plan of a resolved spec: its entries (the one lookup of each, in :func:`_resolve`),
    the facts of its retrievers, its final sampling (the one merge) and its prompt folders."""
    from r2med_agent.data.sources import generation_source
    from r2med_agent.prompts.sources import split_folders

    caps = capabilities(method_cls)
    llm_problem = reranker_problem = None
    source = generation_source(spec.generations)
    if found.llm is None and spec.llm and caps.uses_llm and (source is None or source.needs_llm_entry):
        llm_problem = _lookup_problem("llm", spec.llm)
    if found.reranker is None and spec.reranker:
        reranker_problem = _lookup_problem("reranker", spec.reranker)
    sampling = None
    if found.llm is not None and caps.uses_llm and spec.generations not in RELEASED_SOURCES:
        sampling = method_cls().sampling(found.llm, dict(spec.sampling))
    words = list(dict.fromkeys(_searched_names(vars(spec), caps)))
    retrievers = tuple(RetrieverFacts(word, kind.combine, bool(kind.has_model), tuple(kind.settings))
                       for word in words
                       if (kind := reg.retriever_kind(word)) is not None)
    return RunPlan(spec=spec, method=method_cls, llm=found.llm, llm_problem=llm_problem, reranker=found.reranker,
                   reranker_kind=found.reranker.kind_of if found.reranker is not None else None,
                   reranker_problem=reranker_problem, reranker_llm=_reranker_llm(found.reranker, reg),
                   retrievers=retrievers, encoders=_encoders(spec, caps, reg), sampling=sampling,
                   prompt_folders=tuple((f, r, s.short if s is not None else None) for f, r, s in split_folders(spec)),
                   source=source, plugins=_plugins(spec, words, caps, found, reg))


def _plugins(spec: RunSpec, words: list[str], caps: Capabilities, found: _Found,
             reg: Registries) -> tuple[tuple[str, str], ...]:
    """``(component, who registered it)`` of every component of the run that is not built in: the
    method, each searched word's retriever kind and encoder, the reranker's kind, the LLM's backend."""
    from r2med_agent.plugins import BUILT_IN

    wanted = [("methods", spec.method)]
    for word in words:  # the searched words, each once
        wanted += [("retrievers", reg.retriever_kind_name(word) or word), ("encoders", word)]
    if found.reranker is not None:
        wanted.append(("rerankers", found.reranker.kind))
    if found.llm is not None and caps.uses_llm:
        wanted.append(("llm-backends", found.llm.backend))
    out = {}
    for group, name in wanted:
        origin = reg.origin(group, name)
        if origin is not None and origin != BUILT_IN:
            out[f"{group} {name}"] = origin
    return tuple(out.items())


def _encoders(spec: RunSpec, caps: Capabilities, reg: Registries) -> tuple[tuple[str, Any], ...]:
    """``(word, entry)`` of every searched word with an encoder entry, and of the dense encoder a
    rebuilt shipped list fuses with."""
    from r2med_agent.retrieval.candidates import DENSE_ENCODER, REBUILT

    words = _searched_names(vars(spec), caps)
    if any(word in REBUILT for word in words):
        words.append(DENSE_ENCODER)
    return tuple((word, entry) for word in dict.fromkeys(words) if (entry := reg.encoder(word)) is not None)


def _reranker_llm(entry: Any, reg: Registries) -> Any:
    """The LLM entry an LLM reranker's entry names (None: no such reranker, or an unknown LLM)."""
    if entry is None or not entry.kind_of.uses_llm or not entry.llm:
        return None
    return reg.llm(entry.llm)


def _lookup_problem(what: str, name: str) -> str:
    """The registry's own message for an unknown entry (its lookup raises it)."""
    try:
        if what == "llm":
            from r2med_agent.llm.registry import get_llm_spec

            get_llm_spec(name)
        else:
            from r2med_agent.rerank.spec import get_reranker_spec

            get_reranker_spec(name)
    except ConfigError as e:
        return str(e)
    return f"unknown {what} '{name}'"


def _default(name: str) -> Any:
    f = next(f for f in fields(RunSpec) if f.name == name)
    return f.default


def _kinds(reg: Registries, *specs: str | None) -> list[Any]:
    """The kinds of every member of the '+'-joined retriever specs (unknown words left out)."""
    out = []
    for spec in specs:
        for word in member_names(spec or ""):
            kind = reg.retriever_kind(word)
            if kind is not None:
                out.append(kind)
    return out


def _normalise_kind_options(v: dict[str, Any], reg: Registries, searched: list[Any]) -> None:
    """Kinds' own options checked by their dataclass; kept for searched kinds where not the default."""
    from r2med_agent.retrieval.registry import kind_name, non_default_options
    used, out = {kind_name(kind) for kind in searched}, {}
    for name, values in dict(v["kind_options"]).items():
        changed = non_default_options(reg.retriever_kind_options(name, values))
        if name in used and changed:
            out[name] = changed
    v["kind_options"] = out


def _check_choices(v: dict[str, Any]) -> None:
    """Settings with a fixed set of values, checked even where they play no part."""
    from r2med_agent.prompts.sources import check_value
    from r2med_agent.retrieval.dense.spec import BACKENDS, PRECISIONS

    if v["precision"] is not None and v["precision"] not in PRECISIONS:
        raise ConfigError(f"--precision must be one of {', '.join(PRECISIONS)}, got '{v['precision']}'")
    if v["encoder_backend"] is not None and v["encoder_backend"] not in BACKENDS:
        raise ConfigError(f"--encoder-backend must be one of {', '.join(BACKENDS)}, got '{v['encoder_backend']}'")
    if v["bm25_k1"] is not None and not v["bm25_k1"] >= 0:
        raise ConfigError(f"--k1 must be >= 0, got {v['bm25_k1']}")
    if v["bm25_b"] is not None and not 0 <= v["bm25_b"] <= 1:
        raise ConfigError(f"--b must be between 0 and 1, got {v['bm25_b']}")
    check_value(v["prompts_from"])


def _normalise(v: dict[str, Any], reg: Registries, caps: Capabilities, found: _Found) -> None:
    """Canonical forms, and settings that do not apply set back to their defaults."""
    from r2med_agent.retrieval.bm25.retriever import DEFAULT_B, DEFAULT_K1
    from r2med_agent.retrieval.registry import RUN_FILES

    released = v["generations"] in RELEASED_SOURCES
    _normalise_fusion_depth(v)
    if not caps.agentic or v["loop_retriever"] == v["retriever"]:
        v["loop_retriever"] = None
    if not caps.agentic or released:
        v["loop_rules"] = LOOP_RULES  # no loop ran
    if not caps.final_fuse and v["final"] in FINAL_MODES:
        v["final"] = _default("final")
    if caps.needs_first_pass and released:
        v["first_pass"] = _default("first_pass")  # the released generations already hold their first pass
    if not v["reranker"]:
        v["reranker"], v["rerank_k"] = None, _default("rerank_k")
    entry = found.reranker if v["reranker"] else None
    if entry is None or not _published(entry):
        v["rerank_rules"] = RERANK_RULES  # no published LLM reranker ran
    if not _versioned_requests(found.llm, caps, v["generations"]):
        v["request_rules"] = REQUEST_RULES  # no request to an entry that declares the marker
    if not caps.uses_llm or released:
        v["prompts"] = None
    for name, default in (("bm25_k1", DEFAULT_K1), ("bm25_b", DEFAULT_B)):
        value = v[name]
        v[name] = None if value is None or float(value) == default else float(value)
    if v["candidates"] is not None and v["retriever"] in (_default("retriever"), RUN_FILES):
        v["retriever"] = RUN_FILES  # the files are the first stage
    searched = _kinds(reg, v["retriever"], v["loop_retriever"], v["first_pass"] if caps.needs_first_pass else None)
    applies = {s for k in searched for s in k.settings}
    if "bm25_k1" not in applies:
        v["bm25_k1"] = v["bm25_b"] = None
    _normalise_kind_options(v, reg, searched)
    _normalise_encoder_rules(v, reg, caps)
    models = [k.has_model for k in _kinds(reg, v["retriever"], v["loop_retriever"])]
    if not any(models) and not (entry is not None and entry.kind_of.has_model) and not (v["reranker"] and entry is None):
        v["precision"] = v["encoder_backend"] = None
    _normalise_reference_options(v, reg, caps, entry, found.llm)
    from r2med_agent.prompts.sources import resolve as resolve_prompts

    v["prompts_from"] = resolve_prompts(v["prompts_from"], v["method"], v["llm"], v["generations"], v["reranker"])


def _versioned_requests(llm: Any, caps: Capabilities, generations: str) -> bool:
    """Whether the run sends fresh requests to an LLM entry (``llm``) that declares ``request_rules``."""
    return caps.uses_llm and generations not in RELEASED_SOURCES and bool(getattr(llm, "request_rules", False))


def _searched_names(v: Mapping[str, Any], caps: Capabilities) -> list[str]:
    """Every retriever word the run searches with: the retriever's members, the loop retriever's,
    the first pass of a method that takes one."""
    specs = (v["retriever"], v["loop_retriever"], v["first_pass"] if caps.needs_first_pass else None)
    return [word for spec in specs for word in member_names(spec or "")]


def _normalise_encoder_rules(v: dict[str, Any], reg: Registries, caps: Capabilities) -> None:
    """An earlier version of the encoder entries names another run only where the run searches with
    an entry whose settings changed since that version; elsewhere it is the current one."""
    if v["encoder_rules"] == _default("encoder_rules"):
        return
    if not any(reg.encoder_rules(word) > v["encoder_rules"] for word in _searched_names(v, caps)):
        v["encoder_rules"] = _default("encoder_rules")


def _published(entry: Any) -> bool:
    """Whether a reranker entry follows a published reranker's code (its kind's ``published_formats``)."""
    return entry.format in entry.kind_of.published_formats


def _normalise_fusion_depth(v: dict[str, Any]) -> None:
    """One depth per member (a single number stands for all); depths all equal to top_k are the
    default (None), so they neither split nor merge folders."""
    if v["fusion_depth"] is None:
        return
    depths = tuple(v["fusion_depth"])
    n = len(v["retriever"].split("+"))
    if n == 1:
        raise ConfigError(f"--fusion-depth needs a '+'-joined --retriever (e.g. bm25+minilm), got '{v['retriever']}'")
    if len(depths) == 1:
        depths = depths * n
    if len(depths) != n:
        raise ConfigError(f"--fusion-depth: {len(depths)} depth(s) for {n} fused retriever(s); give one or one per retriever")
    if any(isinstance(d, bool) or not isinstance(d, int) or d < v["top_k"] for d in depths):
        raise ConfigError(f"--fusion-depth must be whole numbers of at least --top-k ({v['top_k']}), got {list(depths)}")
    v["fusion_depth"] = None if all(d == v["top_k"] for d in depths) else depths


def _normalise_reference_options(v: dict[str, Any], reg: Registries, caps: Capabilities, entry: Any, llm: Any) -> None:
    """The options that follow R2MED's scripts, set back where they do not apply: the identical-id
    exclusion where no retriever declares it, the empty-generation policy without an LLM, the
    prompt path without fresh generations of an LLM whose backend takes it; a reranker's input
    length where it is its entry's own or its kind has no model."""
    from r2med_agent.llm.registry import PROMPT_PATH_BACKENDS

    if not any("exclude_identical_ids" in k.settings for k in _kinds(reg, v["retriever"])):
        v["exclude_identical_ids"] = False
    if not caps.uses_llm:
        v["empty_generation"] = _default("empty_generation")
    if not caps.uses_llm or v["generations"] in RELEASED_SOURCES or (llm is not None and llm.backend not in PROMPT_PATH_BACKENDS):
        v["llm_prompt"] = _default("llm_prompt")
    if v["rerank_max_length"] is not None:
        own = entry.max_length if entry is not None and entry.kind_of.has_model else None
        if own in (None, v["rerank_max_length"]):
            v["rerank_max_length"] = None


def _drop_default_sampling(v: dict[str, Any], found: _Found, method_cls: type[Any]) -> None:
    """Sampling overrides that give the sampling the method uses without them (``--temperature
    0.7`` for an LLM whose default is 0.7) are dropped: the same run, folder and cache keys."""
    if not v["sampling"] or v["generations"] in RELEASED_SOURCES:
        return
    llm = found.llm
    if llm is None:
        return
    method = method_cls()
    default = method.sampling(llm, {})
    kept = {}
    for name, value in v["sampling"].items():
        if name not in SAMPLING_KNOBS or method.sampling(llm, {name: value}) != default:
            kept[name] = value
    v["sampling"] = kept


def _validate(v: dict[str, Any], reg: Registries, caps: Capabilities) -> None:
    """Errors a user can make, each a ConfigError naming the option and the fix."""
    methods = reg.methods()
    using = [n for n, c in methods.items() if capabilities(c).uses_llm]
    if not caps.uses_llm and v["llm"]:
        raise ConfigError(f"--llm {v['llm']} is only used by a method; add --method ({', '.join(using)}), or leave "
                          "--llm out for plain retrieval")
    if caps.uses_llm and not v["llm"]:
        raise ConfigError(f"--method {v['method']} needs --llm (see `r2med-agent llms`)")
    if v["final"] == "fuse" and v["loop_retriever"] not in (None, v["retriever"]):
        raise ConfigError("--final fuse ranks with the loop's own searches: --loop-retriever must be the same "
                          f"as --retriever (got {v['loop_retriever']} and {v['retriever']})")
    _validate_generations(v, caps, using)
    if v["rerank_cut"] and not v["reranker"]:
        raise ConfigError("--rerank-cut needs --reranker")
    _validate_candidates(v, reg, caps)
    if v["first_pass"] != _default("first_pass") and not caps.needs_first_pass:
        raise ConfigError(f"--first-pass is LameR's first-pass retriever; --method {v['method']} has none")
    if "+" in v["first_pass"]:
        raise ConfigError(f"--first-pass takes one retriever (bm25, bm25-compat, an encoder), got '{v['first_pass']}'")
    if v["top_k"] < 1 or v["rerank_k"] < 1:
        raise ConfigError("--top-k and --rerank-k must be at least 1")
    if v["rerank_max_length"] is not None and v["rerank_max_length"] < 8:
        raise ConfigError(f"--rerank-max-length must be at least 8, got {v['rerank_max_length']}")
    _validate_samples(v, caps, methods)
    problems = sampling_problems(v["sampling"], options=True)
    if problems:
        raise ConfigError("; ".join(problems))
    _validate_fusion(v, reg, caps)


def _validate_generations(v: dict[str, Any], caps: Capabilities, using: list[str]) -> None:
    if v["generations"] not in RELEASED_SOURCES:
        return
    whose = "R2MED's released generations" if v["generations"] == "r2med" else "BRIGHT's released reasoning queries"
    if not caps.uses_llm:
        raise ConfigError(f"--generations {v['generations']} needs a --method that generates ({', '.join(using)})")
    if v["sampling"]:
        raise ConfigError(f"sampling options ({', '.join(sorted(v['sampling']))}) do not apply to {whose}; "
                          "drop them or use --generations fresh")
    if v["final"] == "fuse":
        raise ConfigError("--final fuse needs the loop's own searches, which released generations do "
                          "not have; use --generations fresh")


def _validate_candidates(v: dict[str, Any], reg: Registries, caps: Capabilities) -> None:
    from r2med_agent.retrieval.registry import RUN_FILES

    if v["candidates"] is None:
        if v["retriever"] == RUN_FILES:
            raise ConfigError(f"--retriever {RUN_FILES} is what --candidates PATH sets; give the run files")
        return
    if v["retriever"] != RUN_FILES:
        raise ConfigError(f"--candidates replaces --retriever (got --retriever {v['retriever']}); give one of them")
    if caps.uses_llm:
        raise ConfigError(f"--candidates hold one ranking per task query and cannot search for what --method "
                          f"{v['method']} generates; use --method none (and a --reranker)")


def _validate_samples(v: dict[str, Any], caps: Capabilities, methods: Mapping[str, type[Any]]) -> None:
    if v["samples"] < 1:
        raise ConfigError(f"--samples must be at least 1, got {v['samples']}")
    if v["samples"] > 1 and not caps.supports_samples:
        takers = [n for n, c in methods.items() if capabilities(c).supports_samples]
        raise ConfigError(f"--samples applies to {', '.join(takers[:-1])} and {takers[-1]}, not --method {v['method']}")


def _validate_fusion(v: dict[str, Any], reg: Registries, caps: Capabilities) -> None:
    """Fusion options, and retrievers that answer only the task's own queries (a kind that
    declares ``combine: fixed``) with a method whose queries are an LLM's."""
    from r2med_agent.retrieval.fusion import check_fusion_options
    from r2med_agent.names import DEFAULT_RRF_K

    n = len(v["retriever"].split("+"))
    if n == 1 and v["retriever"].endswith(ORIGINAL_QUERY):
        raise ConfigError(f"--retriever {v['retriever']}: the {ORIGINAL_QUERY} suffix marks a fused member that "
                          "searches with the original query; write e.g. bm25+minilm:query")
    if n == 1 and (v["fusion"] != _default("fusion") or v["fusion_weights"] is not None or v["rrf_k"] != DEFAULT_RRF_K):
        raise ConfigError(f"--fusion, --fusion-weights and --rrf-k need a '+'-joined --retriever (e.g. bm25+minilm), "
                          f"got '{v['retriever']}'")
    check_fusion_options(n, v["fusion"], v["rrf_k"], v["fusion_weights"])
    if not caps.uses_llm:
        return
    used = [("--retriever", v["retriever"])] + ([("--loop-retriever", v["loop_retriever"])] if v["loop_retriever"] else [])
    for option, name in used:
        fixed = [w for w in member_names(name) if getattr(reg.retriever_kind(w), "combine", None) == "fixed"]
        if fixed:
            raise ConfigError(f"{option} {name}: {', '.join(fixed)} answer the task's own queries from a fixed list "
                              f"and cannot search for what --method {v['method']} generates; use --method none")


# -- reading what was recorded ---------------------------------------------------------------


def spec_of_config(config: Mapping[str, Any], registries: Registries | None = None) -> RunSpec:
    """The spec a recorded config names.

    A config this version wrote holds every setting of the spec and reads back as it is
    (:meth:`RunSpec.from_record`): nothing is looked up, so a result made with a method,
    retriever or reranker registered from Python reads back, labels and moves the same in a
    process without it.

    A config an earlier version wrote lacks the settings added since. It is read as those
    versions' readers read it: the settings it lacks have their defaults, but the version markers
    it lacks (:data:`~r2med_agent.experiment.spec.VERSION_MARKERS`) are 1 (the behaviour of its
    time) where the setting applies (an agentic method's fresh loop; a reranker entry that follows
    a published reranker's code; fresh generations of an LLM entry that declares
    ``request_rules``; an encoder entry whose settings changed since, ``diver-4b``), and the
    whole is resolved against the registries (settings that played no part set back to their
    defaults; its sampling overrides kept as recorded), so it names the folder and row it always
    did. Such a config whose method this process does not know is not understood (ConfigError).
    """
    spec = RunSpec.from_record(config)
    if all(f.name in config for f in fields(RunSpec)):
        return spec
    markers = {name: 1 for name in VERSION_MARKERS if name not in config}
    return _resolve(replace(spec, **markers), registries or Registries(), explicit_sampling=True)[0]


def applicable(spec: RunSpec, registries: Registries | None = None) -> list[str]:
    """The settings that play a part in ``spec``'s run (a released generation has no sampling,
    prompts or first pass; a run without a reranker no rerank depth; a method without a loop no
    loop retriever or final mode)."""
    reg = registries or Registries()
    method = reg.methods().get(spec.method)
    caps = capabilities(method) if method is not None else Capabilities()
    skip = set()
    if spec.generations in RELEASED_SOURCES:
        skip |= {"sampling", "prompts", "first_pass"}
        if not spec.reranker:
            skip.add("prompts_from")
    if not caps.needs_first_pass:
        skip.add("first_pass")
    if not spec.reranker:
        skip |= {"rerank_k", "rerank_cut"}
    if not caps.agentic:
        skip |= {"loop_retriever", "final", "loop_rules"}
    entry = reg.reranker(spec.reranker)
    if entry is None or not _published(entry):
        skip.add("rerank_rules")
    if not _versioned_requests(reg.llm(spec.llm), caps, spec.generations):
        skip.add("request_rules")
    if not any(reg.encoder_rules(word) > 1 for word in _searched_names(vars(spec), caps)):
        skip.add("encoder_rules")
    return [f.name for f in fields(RunSpec) if f.name not in skip]
