"""ReasonEmbed's R2MED evaluation (VectorSpaceLab/agentic-search, ``ReasonEmbed/evaluation_r2med/``)
as the conformance suite runs it: the shell scripts' arguments parsed by the authors' own argument
classes (FlagEmbedding's ``AbsEvalModelArgs``, which turns a literal ``\\n`` into a newline), the
embedder built by their ``R2MEDEvalRunner.get_models``, and FlagEmbedding's decoder-only embedder
(``BaseLLMEmbedder``) from the pinned FlagOpen/FlagEmbedding copy.

Stubbed, because the pinned copies hold only the files the evaluation reads and these modules
cannot be imported here: the ``FlagEmbedding`` package's other modules (its ``__init__`` imports
every model family), ``datasets`` (the data loader, not run), and ``FlagAutoModel.from_finetuned``,
whose whole job here is to pick ``BaseLLMEmbedder`` for ``decoder-only-base`` (it builds that class
with the arguments it is given). ReasonIR's multi-GPU pool (one process per GPU) is replaced by
direct calls to the same ``SentenceTransformer``.
"""

from __future__ import annotations

import importlib.util
import re
import shlex
from pathlib import Path
from typing import Any

from tests.conformance.conftest import load_reference_module, reference_repo, stub

AGENTIC = "VectorSpaceLab/agentic-search"
FLAG = "FlagOpen/FlagEmbedding"
CODE = "ReasonEmbed/evaluation_r2med/code"
SCRIPTS = "ReasonEmbed/evaluation_r2med/scripts"


def script_args(script: Path) -> list[str]:
    """The arguments a ReasonEmbed script passes to ``main.py``: its ``cmd="python main.py ..."``
    with ``$model_path`` filled in, split as ``eval $cmd`` splits it (the single quotes keep
    ``'Instruct: {}\\nQuery: {}'`` whole, its backslash-n literal)."""
    text = script.read_text(encoding="utf-8")
    model = re.search(r'^model_path="([^"]*)"', text, re.M)
    cmd = re.search(r'^cmd="(.*?)"\s*$', text, re.M | re.S)
    assert model and cmd, script
    line = cmd.group(1).replace("\\\n", " ").replace("$model_path", model.group(1))
    argv = shlex.split(line)
    assert argv[:2] == ["python", "main.py"], argv[:2]
    return argv[2:]


def scripts(root: Path) -> dict[str, Path]:
    """Every evaluation script of the copy, by its path under ``ReasonEmbed/evaluation_r2med/``."""
    return {str(p.relative_to(root / "ReasonEmbed/evaluation_r2med")): p
            for p in sorted((root / SCRIPTS).rglob("eval_*.sh"))}


class Code:
    """The authors' modules, loaded once: ``args(script)`` parses a script, ``embedder(model_args,
    folder)`` builds what ``R2MEDEvalRunner.get_models`` builds for it, with the model read from
    ``folder`` instead of the hub; ``instructions`` is ``prompts.R2MEDInstructions``."""

    def __init__(self) -> None:
        self.agentic = reference_repo(AGENTIC)
        flag = reference_repo(FLAG)
        self.flag_args = load_reference_module(flag, "FlagEmbedding/abc/evaluation/arguments.py")
        abs_embedder = load_reference_module(flag, "FlagEmbedding/abc/inference/AbsEmbedder.py")
        package = {
            "FlagEmbedding": stub("FlagEmbedding"),
            "FlagEmbedding.abc": stub("FlagEmbedding.abc"),
            "FlagEmbedding.abc.inference": stub("FlagEmbedding.abc.inference", AbsEmbedder=abs_embedder.AbsEmbedder),
        }
        self.decoder_only = load_reference_module(flag, "FlagEmbedding/inference/embedder/decoder_only/base.py",
                                                  stubs=package, search=[])
        base = self.decoder_only.BaseLLMEmbedder

        class FlagAutoModel:
            @staticmethod
            def from_finetuned(model_name_or_path: str, model_class: str, **kwargs: Any) -> Any:
                assert model_class == "decoder-only-base", model_class
                return base(model_name_or_path, **kwargs)

        evaluation = stub("FlagEmbedding.abc.evaluation", AbsEvalArgs=self.flag_args.AbsEvalArgs,
                          AbsEvalModelArgs=self.flag_args.AbsEvalModelArgs)
        stubs = {
            **package,
            "FlagEmbedding": stub("FlagEmbedding", FlagAutoModel=FlagAutoModel),
            "FlagEmbedding.abc.evaluation": evaluation,
            "FlagEmbedding.abc.evaluation.arguments": self.flag_args,
        }
        if importlib.util.find_spec("datasets") is None:
            # Imported first: sentence-transformers asks importlib whether datasets exists, which a
            # stub without a module spec cannot answer.
            import sentence_transformers  # noqa: F401

            stubs["datasets"] = stub("datasets")
        self.runner = load_reference_module(self.agentic, f"{CODE}/runner.py", stubs=stubs)
        self.arguments = load_reference_module(self.agentic, f"{CODE}/arguments.py", stubs=stubs)
        self.instructions: dict[str, str] = load_reference_module(self.agentic, f"{CODE}/prompts.py").R2MEDInstructions

    def args(self, script: Path) -> tuple[Any, Any]:
        """``(eval_args, model_args)`` as ``main.py`` parses the script's arguments."""
        from transformers import HfArgumentParser

        parser = HfArgumentParser((self.arguments.R2MEDEvalArgs, self.flag_args.AbsEvalModelArgs))
        return parser.parse_args_into_dataclasses(args=script_args(script))

    def embedder(self, model_args: Any, folder: Path, **changes: Any) -> Any:
        """``R2MEDEvalRunner.get_models(model_args)``'s embedder over the model in ``folder``."""
        import dataclasses

        model_args = dataclasses.replace(model_args, embedder_name_or_path=str(folder), **changes)
        # ReasonIR's encoder, as the runner imported it: one process, no GPU pool.
        self.runner.ReasonIREncoder.__init__.__globals__["MultiGPUModel"] = _DirectModel
        embedder, _ = self.runner.R2MEDEvalRunner.get_models(model_args)
        return embedder


class _DirectModel:
    """ReasonIR's ``MultiGPUModel`` without its process pool: the same ``SentenceTransformer``."""

    def __init__(self, model: Any) -> None:
        self.model = model

    def encode(self, sentences: Any, **kwargs: Any) -> Any:
        return self.model.encode(sentences, **kwargs)


class RecordingTokenizer:
    """Wraps a tokenizer: every list of texts it is called on, and the ids it returned (without
    padding), are kept; calls on a single string (a prompt measured alone) are kept apart."""

    def __init__(self, inner: Any) -> None:
        self.inner, self.texts, self.ids, self.singles, self.max_lengths = inner, [], [], [], set()

    def __call__(self, texts: Any, *args: Any, **kwargs: Any) -> Any:
        out = self.inner(texts, *args, **kwargs)
        if isinstance(texts, str):
            self.singles.append(texts)
            return out
        self.texts.extend(texts)
        masks = out.get("attention_mask")
        for i, ids in enumerate(out["input_ids"]):
            row = [int(t) for t in ids]
            self.ids.append(row if masks is None else [t for t, m in zip(row, masks[i]) if int(m)])
        self.max_lengths.add(kwargs.get("max_length"))
        return out

    def __getattr__(self, name: str) -> Any:
        return getattr(self.inner, name)
