"""What an encoder's entry does on one task: its settings there (:func:`settings_for_task`, the
entry's ``bright`` block on BRIGHT's tasks) and the text it puts before queries and documents
(:func:`instruction_prefixes`)."""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from dataclasses import dataclass

from r2med_agent.errors import ConfigError
from r2med_agent.retrieval.dense.spec import EncoderSpec

_INSTRUCTION_DEFAULT_KEY = "default"


def _lookup_instruction(
    table: Mapping[str, str], names: Sequence[str], family: str, domain: str
) -> str | None:
    for key in (*names, family, _INSTRUCTION_DEFAULT_KEY):
        if key and key in table:
            return table[key].replace("{domain}", domain)
    return None


def _task_keys(task_name: str) -> tuple[str, ...]:
    """The task's name, then the R2MED task behind it (``nano-Medical-Sciences`` ->
    ``Medical-Sciences``, the packaged Biology demo -> ``Biology``), so derived tasks get the
    paper's own instruction rather than the family template. Names outside the registry (a
    user's local folder) stand for themselves."""
    from r2med_agent.data import base_task_name

    if not task_name:
        return ()
    try:
        base = base_task_name(task_name)
    except ConfigError:
        return (task_name,)
    return (task_name,) if base == task_name else (task_name, base)


def _registered(task_name: str) -> bool:
    from r2med_agent.data import get_task_spec

    try:
        get_task_spec(task_name)
    except ConfigError:
        return False
    return True


def is_bright_task(task_name: str) -> bool:
    """Whether ``task_name`` is one of BRIGHT's registered tasks (``bright-<task>`` and its
    ``-long`` setting, an alias included). A task of your own in BRIGHT's layout is not: it runs
    with the entry's own settings."""
    from r2med_agent.data import get_task_spec

    if not task_name:
        return False
    try:
        return get_task_spec(task_name).source == "bright"
    except ConfigError:
        return False


def settings_for_task(spec: EncoderSpec, task_name: str) -> EncoderSpec:
    """The entry's settings on one task: its ``bright`` block applied on BRIGHT's tasks
    (:meth:`~r2med_agent.retrieval.dense.spec.EncoderSpec.on_bright`), else the entry itself."""
    if spec.bright and is_bright_task(task_name):
        return spec.on_bright()
    return spec


def _prefix_from(fmt: str, instruction: str) -> str:
    # fmt ends with "{text}" (validated), so everything before it is the prefix.
    head = fmt[: -len("{text}")]
    return head.replace("{instruction}", instruction)


@dataclass(frozen=True)


class Prefixes:
    """The resolved text put before each kind of input for one task.

    Attributes:
        query: before the original query (instruction or fixed query prefix).
        expansion: before generated text in the HyDE/LameR/reasoning mean (the query prefix when
            ``instruction_on`` is ``both``, else nothing).
        doc: before every document.
    """

    query: str = ""
    expansion: str = ""
    doc: str = ""


def instruction_prefixes(
    spec: EncoderSpec, task_name: str = "", family: str = "", domain: str = ""
) -> Prefixes:
    """Resolve the encoder's instructions for one task.

    The query instruction is looked up by task name, then the R2MED task it is drawn from (a
    NanoR2MED split, the packaged demo), then family, then ``default``; without one the fixed
    ``query_prefix`` applies. Documents likewise (``doc_instructions`` / ``doc_prefix``).
    """
    keys = _task_keys(task_name)
    if task_name and not _registered(task_name):
        family = ""  # a task of your own: only an instruction configured for its name applies
    q_instr = _lookup_instruction(spec.query_instructions, keys, family, domain)
    query = (
        _prefix_from(spec.instruction_format, q_instr) if q_instr is not None else spec.query_prefix
    )
    d_instr = _lookup_instruction(spec.doc_instructions, keys, family, domain)
    doc = (
        _prefix_from(spec.doc_instruction_format, d_instr) if d_instr is not None else spec.doc_prefix
    )
    expansion = query if spec.instruction_on == "both" else ""
    return Prefixes(query=query, expansion=expansion, doc=doc)


def _shown(text: str) -> str:
    """A string as ``--dry-run`` prints it: quoted, newlines as ``\\n``, every other byte as is."""
    return '"' + text.replace("\\", "\\\\").replace("\n", "\\n").replace('"', '\\"') + '"'


def describe_inputs(spec: EncoderSpec) -> str:
    """What an encoder entry feeds its model, in one line: the query and document strings (with
    ``{query}`` and ``{document}`` where the text goes), the token limit and how a longer text is
    cut, the pooling and normalisation."""
    if spec.query_instructions:
        query = _shown(spec.instruction_format.replace("{text}", "{query}")) + " with the task's instruction"
    else:
        query = _shown(spec.query_prefix + "{query}") + (" for every task" if spec.query_prefix else "")
    if spec.doc_instructions:
        doc = _shown(spec.doc_instruction_format.replace("{text}", "{document}")) + " with the task's instruction"
    else:
        doc = _shown(spec.doc_prefix + "{document}")
    if spec.kind == "api":
        limit = f"{spec.max_tokens} tokens" if spec.max_tokens else f"{spec.max_chars} characters" if spec.max_chars else "no cut"
        return f"query {query}; document {doc}; {limit}; {spec.provider} API"
    lengths = (f"{spec.max_length} tokens" if not spec.query_max_length or spec.query_max_length == spec.max_length
               else f"{spec.query_max_length} query / {spec.max_length} document tokens")
    cut = {"tokens": "cut by the tokenizer", "decoded-text": "cut by decoding the first tokens back to text"}[spec.truncation]
    if spec.append_eos:
        cut += " (one token fewer, EOS appended)"
    if spec.hf_tokenizer:
        cut += f", tokenized by {spec.hf_tokenizer}'s tokenizer"
    pooling = {"cls": "first-token pooling", "mean": "mean pooling", "last-token": "last-token pooling",
               "model": "the model's own pooling"}[spec.pooling]
    if spec.pooling == "mean":
        pooling += " without the prompt tokens" if spec.pool_exclude_prefix else " over every token, prompt included"
    norm = ", L2-normalised" if spec.normalize else ""
    pair = " as (title, text) pairs" if spec.doc_title_pair else ""
    return f"query {query}; document {doc}{pair}; {lengths}, {cut}; {pooling}{norm}"
