"""The prompt code (the templates themselves are data, in the repository's top-level
``prompts/``): finding, rendering and hashing templates (templates) in a bounded sandbox
(sandbox); the authors' prompts at pinned commits (sources), fetched into the prompt cache
(cache); and ``prompts import``, reading a reference clone's code statically (static_python)
with one reader per repository (readers, importer) and Query2Doc's few-shot examples (examples)."""
