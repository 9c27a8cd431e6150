"""A run: its spec plus where and how it runs (:class:`RunConfig`), resolved when it is made.

Making a :class:`RunConfig` is the build-time step the run spec leaves out: the spec part is
resolved against the registries (:func:`~r2med_agent.experiment.resolve.resolve`), the files that
are part of its identity are hashed (first-stage run files, a prompts folder of the user's own,
registry entries from a user config), and what this version cannot run is refused. The runner,
``reproduce`` and the Python API build runs through it; reading a result back never does.
"""

from __future__ import annotations

from dataclasses import dataclass, field, fields, replace
from pathlib import Path
from typing import Any

from r2med_agent.errors import ConfigError
from r2med_agent.evaluation import DEFAULT_METRICS, metrics_within_depth
from r2med_agent.experiment.plan import RunPlan
from r2med_agent.experiment.resolve import resolve as resolve_run
from r2med_agent.experiment.spec import VERSION_MARKERS, RunSpec
from r2med_agent.experiment.store import ResultStore
from r2med_agent.names import member_names

__all__ = ["RUN_OPTIONS", "RunConfig", "plan_config", "config_record", "entries_in_use", "folder_fingerprint", "model_precisions", "prompts_in_use"]


@dataclass(frozen=True)
class RunConfig(RunSpec):
    """A run: its spec (every result-changing setting, see :class:`RunSpec`) plus where and how
    it runs. Only the spec part names the result folder and is compared by ``reproduce``.

    Attributes (besides the spec's):
        tasks: task names (already resolved from specs such as ``all``).
        data_dir: local copy of the data (R2MED or BEIR layout); None loads from the hub.
        allow_missing_qrels_docs: keep qrels naming documents absent from the corpus (warned)
            instead of failing (see :func:`r2med_agent.data.load_task`).
        allow_count_mismatch: use a ``data_dir`` copy of a registered task whose query or
            document count differs from the registry's (recorded in each task's ``source``).
        output_dir: root of the result tree.
        use_cache: read and write the generation cache.
        refresh_cache: regenerate and overwrite cached generations.
        cache_path: the generation cache file (None: the default under the cache directory).
        chunk_size: cache misses per backend call, each committed when it returns (0: all in
            one call; None: the LLM entry's ``chunk_size``).
        metrics: metric keys to compute.
        show_progress: progress bars.
        prompts_dir: a folder of prompts overriding the shipped ones (None: ``$R2MED_PROMPTS_DIR``
            if set); its templates' hash becomes the spec's ``prompts``.
        candidates_path: first-stage TREC run files to rerank as given, in place of ``retriever``
            (:mod:`r2med_agent.retrieval.run_files`); their hash becomes the spec's ``candidates``.
        allow_missing_candidates: leave out (warned, counted) candidate documents the corpus
            lacks instead of stopping.
        split: the qrels split of a BEIR folder (``qrels/<split>.tsv``). A fact of the data, as
            ``data_dir`` is: recorded in each result's ``source``, not in the spec.
        all_queries: also run a BEIR folder's queries that the split's qrels do not name.
        no_eval: run every stage and write the run, generations and traces, but score nothing
            (as for a task without qrels).
    """

    prompts_from: str | None = None
    """As the spec's, but asked for: None (the default) is the run's default wording, as for
    ``run`` without ``--prompts``: the authors' where they are pinned and the LLM that reads the
    prompt is not the local smoke model, else the project's own (resolved when the run is made)."""
    tasks: tuple[str, ...] = ()
    data_dir: Path | None = None
    allow_missing_qrels_docs: bool = False
    allow_count_mismatch: bool = False
    output_dir: Path = Path("results")
    use_cache: bool = True
    refresh_cache: bool = False
    cache_path: Path | None = None
    chunk_size: int | None = None
    metrics: tuple[str, ...] = DEFAULT_METRICS
    show_progress: bool = True
    prompts_dir: Path | None = None
    candidates_path: Path | None = None
    allow_missing_candidates: bool = False
    split: str = "test"
    all_queries: bool = False
    no_eval: bool = False

    def __post_init__(self) -> None:
        object.__setattr__(self, "tasks", tuple(self.tasks))
        super().__post_init__()
        made = plan_config(self)
        for f in fields(RunSpec):
            object.__setattr__(self, f.name, getattr(made.spec, f.name))
        object.__setattr__(self, "plan", made)

    plan: RunPlan = field(default=None, init=False, repr=False, compare=False)  # type: ignore[assignment]
    """The run's plan (:func:`plan_config`): everything the runner reads of the registries."""

    def retriever_options(self, fused: bool = True) -> Any:
        """The typed options every retriever of the run is built with
        (:class:`~r2med_agent.retrieval.registry.RetrieverOptions`): the encoders' precision and
        backend, BM25's k1 and b, progress, and the fusion of a '+'-joined ``retriever`` (left out
        with ``fused=False``: a loop retriever or first pass is one retriever)."""
        from r2med_agent.retrieval.bm25.retriever import DEFAULT_B, DEFAULT_K1, BM25Options
        from r2med_agent.retrieval.dense.spec import EncoderOptions
        from r2med_agent.retrieval.fusion import FusionOptions
        from r2med_agent.retrieval.registry import RetrieverOptions
        from r2med_agent.retrieval.run_files import RunFiles

        fusion = None
        if fused and "+" in self.retriever:
            fusion = FusionOptions(method=self.fusion, rrf_k=self.rrf_k, weights=self.fusion_weights,  # type: ignore[arg-type]
                                   member_depths=self.fusion_depth)
        return RetrieverOptions(
            encoder=EncoderOptions(precision=self.precision, backend=self.encoder_backend,
                                   show_progress=self.show_progress),
            bm25=BM25Options(k1=DEFAULT_K1 if self.bm25_k1 is None else self.bm25_k1,
                             b=DEFAULT_B if self.bm25_b is None else self.bm25_b, show_progress=self.show_progress),
            fusion=fusion,
            run_files=RunFiles(self.candidate_files(), self.allow_missing_candidates) if self.candidates_path else None,
            kinds=self.kind_options,
        )

    def candidate_files(self) -> dict[str, Path]:
        """Each task's first-stage run file (``candidates_path``); empty without one."""
        if self.candidates_path is None:
            return {}
        from r2med_agent.retrieval.run_files import find_candidate_files

        return find_candidate_files(self.candidates_path, self.tasks)

    @property
    def retriever_label(self) -> str:
        """The result folder's last part (:attr:`RunSpec.leaf`)."""
        return self.leaf

    @property
    def scored_metrics(self) -> tuple[str, ...]:
        """``metrics`` whose cut-off the depth ``top_k`` reaches (all of them at 100)."""
        return metrics_within_depth(self.metrics, self.top_k)

    @property
    def store(self) -> ResultStore:
        return ResultStore(self.output_dir)

    def result_dir(self) -> Path:
        """``<output>/<method>/<llm>/<leaf>``: the spec's own folder (:meth:`RunSpec.folder`)."""
        return self.store.folder(self)


def plan_config(cfg: RunConfig) -> RunPlan:
    """The plan of a config, made in one step: its spec resolved (:func:`~r2med_agent.experiment.resolve.resolve`)
    with the hashes of the files that are part of its identity (first-stage run files, a prompts
    folder of the user's own, registry entries from a user config), and what this version cannot
    run refused.

    Raises:
        ConfigError: a bad setting (naming the option), or a spec of an earlier version.
    """
    spec = cfg.spec()
    if cfg.candidates_path is not None:
        from r2med_agent.retrieval.run_files import candidates_fingerprint

        spec = replace(spec, candidates=candidates_fingerprint(cfg.candidate_files()))
    made = resolve_run(spec)
    for name, (current, _, plural) in VERSION_MARKERS.items():
        if getattr(made.spec, name) != current:
            raise ConfigError(f"{name} {getattr(made.spec, name)} names results of an earlier version's {plural}; "
                              f"this version runs only {name} {current}")
    if cfg.chunk_size is not None and cfg.chunk_size < 0:
        raise ConfigError(f"--chunk-size must be >= 0 (0 = one backend call), got {cfg.chunk_size}")
    _check_prompt_sources(made.spec)
    hashes = {}
    if made.spec.prompts is None:
        hashes["prompts"] = prompts_in_use(made, cfg.prompts_dir)
    if made.spec.entries is None:
        hashes["entries"] = entries_in_use(made, cfg.tasks, cfg.data_dir)
    return made.with_spec(replace(made.spec, **hashes)) if hashes else made


def _check_prompt_sources(cfg: RunSpec) -> None:
    """A spec that names the authors' prompts at commits this version does not pin names results
    of an earlier version; it cannot run."""
    from r2med_agent.prompts.sources import AUTHORS, OWN, resolve

    if cfg.prompts_from == OWN:
        return
    current = resolve(AUTHORS, cfg.method, cfg.llm, cfg.generations, cfg.reranker)
    if cfg.prompts_from != current:
        raise ConfigError(f"prompts_from {cfg.prompts_from} names results made with the authors' prompts at other "
                          f"commits; this version fetches {current} (--prompts authors)")


def prompts_in_use(plan: RunPlan, prompts_dir: Path | None) -> str | None:
    """Hash of the overriding prompt folder's templates when the run renders prompts in the
    project's wording (an LLM method with fresh generations, or a reranker, whose folders are not
    all rendered in the authors' wording), else None (the shipped templates). Its templates are
    checked for what the template sandbox refuses first, before any work."""
    if not (plan.generates or plan.spec.reranker):
        return None
    folders = plan.prompt_folders
    if folders and all(src is not None for _, _, src in folders):
        return None  # every prompt is the authors'
    from r2med_agent.prompts import templates as prompts

    folders = prompts.search_path(prompts_dir)
    if len(folders) < 2:
        return None
    prompts.check_folder(folders[0])
    return folder_fingerprint(folders[0])


def entries_in_use(plan: RunPlan | RunConfig, tasks: tuple[str, ...] = (), data_dir: Path | None = None) -> str | None:
    """Hash of the registry entries the run uses that come from a user config file rather than
    the package's: an LLM, encoder or reranker of the same name but other settings is another run,
    and so is a task whose entry gives it another family or domain where the run renders prompts
    or instructions with them (:func:`_task_entries`).
    None when every entry it uses is shipped, registered from Python (its behaviour is code, which
    no hash of its fields can see) or unknown (the run's own checks name an unknown one)."""
    import hashlib
    import json

    from r2med_agent.config import PYTHON_SOURCE, registry_entries
    from r2med_agent.paths import configs_dir

    if isinstance(plan, RunConfig):
        plan, tasks, data_dir = plan.plan, plan.tasks, plan.data_dir
    cfg = plan.spec
    used: dict[str, set[str]] = {"llms": set(), "encoders": set(), "rerankers": set()}
    if cfg.generations == "fresh" and cfg.llm:  # an LLM that generates (the spec has one only then)
        used["llms"].add(cfg.llm)
    for spec in (cfg.retriever, cfg.loop_retriever or "", cfg.first_pass):
        used["encoders"].update(member_names(spec))
    entries = {section: registry_entries(section) for section in used}
    if cfg.reranker:
        used["rerankers"].add(cfg.reranker)
        llm = entries["rerankers"].get(cfg.reranker, ({}, None))[0].get("llm")
        if llm:
            used["llms"].add(str(llm))
    own = _task_entries(tasks, data_dir) if _renders_task_text(plan, entries) else []
    for section, names in used.items():
        shipped = configs_dir() / f"{section}.yaml"
        for name in sorted(names):
            fields, path = entries[section].get(name, (None, shipped))
            if path not in (shipped, PYTHON_SOURCE):
                own.append([section, name, fields])
    if not own:
        return None
    return hashlib.sha256(json.dumps(own, sort_keys=True, default=str).encode()).hexdigest()[:16]


def _renders_task_text(plan: RunPlan, entries: dict[str, Any]) -> bool:
    """Whether the run renders text from its tasks' family and domain: an LLM method's prompts
    (fresh generations), a reranker's, or a dense encoder's instructions."""
    cfg = plan.spec
    if cfg.reranker or plan.generates:
        return True
    return any(n in entries["encoders"] for s in (cfg.retriever, cfg.loop_retriever or "", cfg.first_pass)
               for n in member_names(s))


def _task_entries(tasks: tuple[str, ...], data_dir: Path | None) -> list[list[Any]]:
    """``["tasks", name, {family, domain}]`` for each of the run's tasks whose family or domain is
    not the one the package gives it (its shipped entry's, or, for a task of your own, the generic
    ``qa`` and ``medical``): a user config's task entry changes the prompts, so it is another run."""
    from r2med_agent.config import load_yaml
    from r2med_agent.data import LOCAL_DOMAIN, LOCAL_FAMILY
    from r2med_agent.data.load import prompt_facts
    from r2med_agent.errors import DataError
    from r2med_agent.paths import configs_dir

    shipped = load_yaml(configs_dir() / "tasks.yaml") or {}
    out = []
    for name in tasks:
        try:
            family, domain, _ = prompt_facts(name, data_dir)
        except (ConfigError, DataError):
            continue  # the run's own loading says what is wrong
        default = shipped.get(name) or {"family": LOCAL_FAMILY, "domain": LOCAL_DOMAIN}
        if (family, domain) != (default.get("family"), default.get("domain")):
            out.append(["tasks", name, {"family": family, "domain": domain}])
    return out


def folder_fingerprint(folder: Path) -> str:
    """SHA-256 (16 hex digits) of a prompt folder's templates and example files: relative names
    and contents, so the same files anywhere give the same hash."""
    import hashlib

    h = hashlib.sha256()
    for path in sorted(p for p in folder.rglob("*") if p.is_file() and p.suffix in (".j2", ".yaml", ".yml")):
        rel = path.relative_to(folder).as_posix()
        h.update(f"{rel}\0".encode())
        h.update(path.read_bytes())
        h.update(b"\0")
    return h.hexdigest()[:16]


RUN_OPTIONS = tuple(f.name for f in fields(RunConfig) if f.init and f.name not in {g.name for g in fields(RunSpec)})
"""RunConfig's fields that are not part of the run's identity (they cannot change a result)."""


def model_precisions(cfg: RunConfig) -> dict[str, str]:
    """The precision each local encoder and reranker of ``cfg`` runs at on a GPU (``--precision``
    or its registry entry's; on a CPU everything runs in float32), by registry name."""
    from r2med_agent.retrieval.dense.spec import encoder_registry

    encoders = encoder_registry()
    names = {p for spec in (cfg.retriever, cfg.loop_retriever or "") for p in member_names(spec)}
    out = {n: cfg.precision or encoders[n].precision
           for n in sorted(names) if n in encoders and encoders[n].kind == "hf"}
    if cfg.reranker:
        out[cfg.reranker] = cfg.precision or cfg.plan.reranker_entry().precision
    return out


def config_record(cfg: RunConfig) -> dict[str, Any]:
    """The configuration as written into result files (no secrets: names and settings only):
    the spec's record plus the run options that say where the data came from."""
    rec = cfg.record()
    rec["tasks"] = list(cfg.tasks)
    rec["metrics"] = list(cfg.scored_metrics)
    for key in ("data_dir", "output_dir", "cache_path", "prompts_dir", "candidates_path"):
        value = getattr(cfg, key)
        rec[key] = str(value) if value is not None else None
    for key in ("allow_missing_qrels_docs", "allow_count_mismatch", "use_cache", "refresh_cache", "chunk_size",
                "allow_missing_candidates", "split", "all_queries", "no_eval"):
        rec[key] = getattr(cfg, key)
    rec["prompts_import"] = _prompts_import(cfg)
    return rec


def _prompts_import(cfg: RunConfig) -> list[dict[str, Any]]:
    """The reference prompts the run renders: each authors' source (reference, full commit, its
    folders and pinned files, ``pinned: true``), then the imports of ``prompts import --out``
    behind its own-wording folders (reference, commit, folders); [] when every prompt is the
    project's or the user's own."""
    from r2med_agent.prompts.importer import imported_prompts
    from r2med_agent.prompts.sources import RunPrompts, split_folders

    folders = split_folders(cfg)
    sources = tuple(dict.fromkeys(s for _, _, s in folders if s is not None))
    out = RunPrompts(sources=sources).record()
    own = [f for f, _, s in folders if s is None]
    if cfg.prompts is not None and own:
        out += imported_prompts(own, cfg.prompts_dir)
    return out
