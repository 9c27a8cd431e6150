"""Moving generations between the cache and R2MED's ``query_with_hydoc.jsonl`` files.

R2MED publishes its generation outputs per task, method and LLM as ``query_with_hydoc.jsonl``
(``id``, ``text``, ``hy_doc``, ``doc_id``; ``hy_doc`` is the raw model output, reasoning
included). ``import_r2med`` stores each ``hy_doc`` under the key of the request this framework
would send for that query, so a later run with the same method and LLM scores the published
outputs without any model. ``export_r2med`` writes the cache back out in the same layout, one
configuration per file: rows are grouped by their request settings (everything of the request
but the prompt: sampling, template hash, system prompt, ...), and a selection spanning several
groups is refused with the list of groups and how to pick one.
"""

from __future__ import annotations

import hashlib
import logging
import re
import time
from datetime import datetime, timezone
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any

from r2med_agent.errors import DataError
from r2med_agent.llm.cache.store import GenerationCache
from r2med_agent.llm.cache.keys import RequestBuilder
from r2med_agent.llm.cache.records import CacheRecord, Use, canonical_json, request_key
from r2med_agent.types import Generation, Message, SamplingParams

logger = logging.getLogger(__name__)

ImportRequest = tuple[Sequence[Message], SamplingParams, Mapping[str, Any]]
"""One request the framework would send: (messages, sampling params, meta with ``query_id``)."""


@dataclass
class ImportReport:
    """What ``import_r2med`` did.

    Attributes:
        imported: rows stored (new or replacing an older row of the same key).
        missing: query ids with a request but no row in the file (left for the model to generate).
        unknown: ids in the file that match no request (ignored).
    """

    imported: int = 0
    missing: list[str] = field(default_factory=list)
    unknown: list[str] = field(default_factory=list)


def import_r2med(
    cache: GenerationCache,
    builder: RequestBuilder,
    rows: Sequence[Mapping[str, Any]],
    requests: Sequence[ImportRequest],
    *,
    template_hash: str = "",
    sample_index: int = 0,
    source: str = "",
) -> ImportReport:
    """Store R2MED ``hy_doc`` rows as the generations of the matching requests, in ONE transaction.

    Args:
        cache: the generation cache to write.
        builder: keys requests as the target LLM's CachedLLM does (``RequestBuilder.from_spec``).
        rows: parsed ``query_with_hydoc.jsonl`` objects: ``hy_doc`` is stored under the
            request of query ``id``; ``text`` and ``doc_id`` are kept with the row's use, so an
            export without the query file writes them back.
        requests: (messages, params, meta) per query, as the method would send them; ``meta``
            must hold ``query_id`` (matched against the rows' ``id``) and usually ``task`` and
            ``method``, which are stored as the row's use.
        template_hash: the method's prompt-template hash (part of the key, as in its runs).
        sample_index: the sample index the rows stand for.
        source: provenance stored in the use's extra fields (e.g. the file name).

    Raises:
        DataError: a row lacks ``id`` or ``hy_doc``, or an id appears twice.
    """
    by_id: dict[str, Mapping[str, Any]] = {}
    for i, row in enumerate(rows, start=1):
        if "id" not in row or not isinstance(row.get("hy_doc"), str):
            raise DataError("row needs 'id' and a string 'hy_doc'", source or "rows", i)
        qid = str(row["id"])
        if qid in by_id:
            raise DataError(f"duplicate id {qid!r}", source or "rows", i)
        by_id[qid] = row

    report = ImportReport()
    records: list[CacheRecord] = []
    uses: list[Use] = []
    wanted: set[str] = set()
    now = time.time()
    for messages, params, meta in requests:
        qid = str(meta["query_id"])
        wanted.add(qid)
        if qid not in by_id:
            report.missing.append(qid)
            continue
        row = by_id[qid]
        text = row["hy_doc"]
        req = builder.request(messages, params, sample_index=sample_index, template_hash=template_hash)
        key = request_key(req)
        reasoning, final = builder.parse(text)
        gen = Generation(text=text, final=final, reasoning=reasoning, finish_reason="stop")
        records.append(CacheRecord.from_generation(key, req, gen, created=now))
        extra: dict[str, Any] = {k: row[k] for k in ("text", "doc_id") if k in row}
        if source:
            extra["source"] = source
        uses.append(Use.from_meta(key, {**meta, **extra}))
    report.unknown = sorted((set(by_id) - wanted), key=natural_key)
    cache.put_many(records, uses)
    report.imported = len(records)
    if report.missing:
        logger.warning("%d queries have no row in the imported file", len(report.missing))
    if report.unknown:
        logger.warning("%d ids in the imported file match no query of the task", len(report.unknown))
    return report


SETTINGS_FILTERS = ("temperature", "top_p", "top_k", "max_tokens", "seed")
"""Sampling fields ``export_r2med`` (and ``cache export``) can select a settings group by."""


def request_settings(request: Mapping[str, Any]) -> dict[str, Any]:
    """Everything of a request record but the prompt itself: model, sampling as keyed, chat
    template options, sample index, prompt-template hash, options, and the system prompt.

    Generations with equal settings belong to one configuration (one run of one method).
    """
    out = {k: v for k, v in request.items() if k != "messages"}
    messages = request.get("messages") or []
    out["system_prompt"] = next(
        (m.get("content", "") for m in messages if m.get("role") == "system"), ""
    )
    return out


def settings_hash(request: Mapping[str, Any]) -> str:
    """A short hash (12 hex digits) of :func:`request_settings`, as ``cache export`` shows it."""
    blob = canonical_json(request_settings(request)).encode("utf-8")
    return hashlib.sha256(blob).hexdigest()[:12]


def _flat_settings(request: Mapping[str, Any]) -> dict[str, str]:
    """:func:`request_settings` one level deep (sampling fields by name), values as JSON."""
    out: dict[str, str] = {}
    for key, value in request_settings(request).items():
        items = value.items() if key in ("params", "options") and isinstance(value, Mapping) else [(key, value)]
        out.update((k, canonical_json(v)) for k, v in items)
    return out


_SHOWN = {*SETTINGS_FILTERS, "stop", "template_hash", "model_id"}


def _differing(groups: Mapping[str, Sequence[tuple[Use, CacheRecord]]]) -> list[str]:
    """The settings, beyond those every group line shows, whose values differ between groups."""
    flat = [_flat_settings(ps[0][1].request) for ps in groups.values()]
    keys = sorted({k for f in flat for k in f} - _SHOWN)
    return [k for k in keys if len({f.get(k) for f in flat}) > 1]


def _describe_group(h: str, pairs: Sequence[tuple[Use, CacheRecord]], differing: Sequence[str] = ()) -> str:
    settings = request_settings(pairs[0][1].request)
    params = settings.get("params", {})
    shown = " ".join(f"{k}={params[k]}" for k in SETTINGS_FILTERS if k in params)
    if params.get("stop"):
        shown += f" stop={params['stop']}"
    template = str(settings.get("template_hash", ""))[:8] or "-"
    newest = max(r.created for _, r in pairs)
    when = datetime.fromtimestamp(newest, timezone.utc).strftime("%Y-%m-%d %H:%M")
    queries = len({u.query_id for u, _ in pairs})
    flat = _flat_settings(pairs[0][1].request)
    shown += "".join(f" {k}={flat.get(k, '-')}" for k in differing)  # what sets the groups apart
    return f"  {h}  {queries} queries  {settings.get('model_id')}  {shown}  template {template}  newest {when} UTC"


@dataclass(frozen=True)
class ExportSelection:
    """Which cached generations :func:`export_r2med` writes: one model's, for one task, method,
    sample and configuration (``cache export``'s options).

    Attributes:
        model_ids: the model's ids (rows of any of them match).
        task: the task name stored with the rows; required when the cache holds several.
        method: the method name stored with the rows; required when the cache holds several.
        sample_index: which sample to export.
        settings: keep only the settings group whose :func:`settings_hash` starts with this.
        params: keep only generations whose keyed sampling fields equal these values
            (names from :data:`SETTINGS_FILTERS`, e.g. ``{"seed": 42}``).
    """

    model_ids: Sequence[str]
    task: str | None = None
    method: str | None = None
    sample_index: int = 0
    settings: str | None = None
    params: Mapping[str, Any] | None = None


def export_r2med(
    cache: GenerationCache,
    selection: ExportSelection,
    *,
    queries: Sequence[Mapping[str, Any]] | None = None,
    partial: bool = False,
) -> list[dict[str, Any]]:
    """Rows of R2MED's ``query_with_hydoc.jsonl`` for one task, method and configuration of one model.

    Args:
        cache: the generation cache.
        selection: the model, task, method, sample and settings to export.
        queries: the task's ``query.jsonl`` objects (``id``, ``text``, ``doc_id``): they give
            the row order, ``text`` and ``doc_id``. Without them rows follow query-id order and
            take ``text``/``doc_id`` from the use's stored extra fields (runs and imports store
            both; empty when absent).
        partial: with ``queries``, skip queries without a generation instead of failing.

    Returns:
        ``{"id", "text", "hy_doc", "doc_id"}`` dicts; ``hy_doc`` is the raw text. Within the one
        settings group, a query with several generations (e.g. its text changed between runs)
        gets the newest.

    Raises:
        DataError: nothing matches, the selection spans several tasks/methods or several
            settings groups (the message lists them), or (without ``partial``) queries lack a
            generation.
    """
    pairs = _selected_uses(cache, selection)
    _check_one_configuration(pairs, cache)
    newest = _newest_per_query(pairs)
    if queries is not None:
        return _rows_in_query_order(newest, queries, partial, cache)
    out: list[dict[str, Any]] = []
    for qid in sorted(newest, key=natural_key):
        use, rec = newest[qid]
        out.append(
            {
                "id": qid,
                "text": use.extra.get("text", ""),
                "hy_doc": rec.text,
                "doc_id": use.extra.get("doc_id", []),
            }
        )
    return out


def _selected_uses(cache: GenerationCache, sel: ExportSelection) -> list[tuple[Use, CacheRecord]]:
    """The uses (with query ids) and records that ``selection`` picks.

    Raises:
        DataError: none.
    """
    pairs: list[tuple[Use, CacheRecord]] = []
    for model_id in dict.fromkeys(sel.model_ids):
        pairs += cache.uses(model_id=model_id, task=sel.task, method=sel.method, sample_index=sel.sample_index)
    pairs = [(u, r) for u, r in pairs if u.query_id]
    chosen = []
    if sel.params:
        params = sel.params
        chosen.append(", ".join(f"{k}={v}" for k, v in params.items()))
        pairs = [
            (u, r) for u, r in pairs
            if all(_same(r.request.get("params", {}).get(k), v) for k, v in params.items())
        ]
    if sel.settings:
        settings = sel.settings
        chosen.append(f"settings {settings}")
        pairs = [(u, r) for u, r in pairs if settings_hash(r.request).startswith(settings)]
    if not pairs:
        raise DataError(
            f"no cached generations with query ids for model {', '.join(sel.model_ids)}"
            + (f", task {sel.task}" if sel.task else "")
            + (f", method {sel.method}" if sel.method else "")
            + (f", sample {sel.sample_index}" if sel.sample_index else "")
            + (f" with {'; '.join(chosen)}" if chosen else ""),
            cache.path,
        )
    return pairs


def _check_one_configuration(pairs: Sequence[tuple[Use, CacheRecord]], cache: GenerationCache) -> None:
    """Refuse a selection of several task/method pairs or several request-settings groups.

    Raises:
        DataError: listing the pairs, or the groups and how to pick one.
    """
    groups = sorted({(u.task, u.method) for u, _ in pairs})
    if len(groups) > 1:
        listed = ", ".join(f"{t or '?'}/{m or '?'}" for t, m in groups)
        raise DataError(
            f"the selection spans several task/method pairs ({listed}); choose one with --task and --method",
            cache.path,
        )
    by_settings: dict[str, list[tuple[Use, CacheRecord]]] = {}
    for use, rec in pairs:
        by_settings.setdefault(settings_hash(rec.request), []).append((use, rec))
    if len(by_settings) > 1:
        differing = _differing(by_settings)
        listed = "\n".join(_describe_group(h, ps, differing) for h, ps in sorted(by_settings.items()))
        raise DataError(
            f"the selection holds generations of {len(by_settings)} different request settings "
            f"(a file must hold one configuration):\n{listed}\n"
            "pick one with --settings HASH, or narrow with "
            + "/".join(f"--{k.replace('_', '-')}" for k in SETTINGS_FILTERS),
            cache.path,
        )


def _newest_per_query(pairs: Sequence[tuple[Use, CacheRecord]]) -> dict[str, tuple[Use, CacheRecord]]:
    """Each query id's newest use and record (a warning when some have several)."""
    newest: dict[str, tuple[Use, CacheRecord]] = {}
    dupes = 0
    for use, rec in pairs:
        old = newest.get(use.query_id)
        if old is not None:
            dupes += 1
            if old[1].created >= rec.created:
                continue
        newest[use.query_id] = (use, rec)
    if dupes:
        logger.warning("%d queries have several generations; the newest of each is exported", dupes)
    return newest


def _rows_in_query_order(
    newest: Mapping[str, tuple[Use, CacheRecord]], queries: Sequence[Mapping[str, Any]], partial: bool,
    cache: GenerationCache,
) -> list[dict[str, Any]]:
    """One row per query of ``queries`` (its ``text`` and ``doc_id``), in their order.

    Raises:
        DataError: (without ``partial``) some queries have no generation.
    """
    out: list[dict[str, Any]] = []
    missing = []
    for q in queries:
        qid = str(q["id"])
        if qid not in newest:
            missing.append(qid)
            continue
        out.append(
            {"id": qid, "text": q.get("text", ""), "hy_doc": newest[qid][1].text, "doc_id": q.get("doc_id", [])}
        )
    if missing and not partial:
        shown = ", ".join(missing[:10]) + (" ..." if len(missing) > 10 else "")
        raise DataError(
            f"{len(missing)} of {len(queries)} queries have no cached generation ({shown}); "
            "pass --partial to export the rest",
            cache.path,
        )
    return out


def _same(stored: Any, wanted: Any) -> bool:
    """Equal, with ints and floats compared by value (``--temperature 1`` matches 1.0)."""
    if isinstance(stored, bool) or isinstance(wanted, bool):
        return stored is wanted
    if isinstance(stored, (int, float)) and isinstance(wanted, (int, float)):
        return float(stored) == float(wanted)
    return bool(stored == wanted)


def natural_key(s: str) -> tuple[Any, ...]:
    """Sort key that orders ``"2"`` before ``"10"`` and keeps other ids alphabetical."""
    return tuple((0, int(p), "") if p.isdigit() else (1, 0, p) for p in re.split(r"(\d+)", s) if p)
