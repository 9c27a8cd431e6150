"""What the reasoning embedders' authors ran on BRIGHT, written out byte for byte with the
repository, commit and file of each string, so that the unit tests of the entries' ``bright:``
blocks run without the pinned copies of the authors' code. FlagEmbedding's and ReasonIR's values
are checked against the authors' files in those copies (tests/conformance/test_embed_bright.py);
RaDeR's have no pinned copy (read through the project's search tools). Nothing here imports the
project."""

from __future__ import annotations

# BRIGHT's task keys and the project's task names.
KEYS = ("biology", "earth_science", "economics", "psychology", "robotics", "stackoverflow", "sustainable_living",
        "leetcode", "pony", "aops", "theoremqa_questions", "theoremqa_theorems")
LONG_KEYS = KEYS[:7] + ("pony",)


def task_name(key: str, long: bool = False) -> str:
    return "bright-" + key.replace("_", "-") + ("-long" if long else "")


# FlagOpen/FlagEmbedding@7ed43d67ec03, FlagEmbedding/evaluation/bright/prompts.py:
# BrightShortInstructions and BrightLongInstructions (the long Pony one has no full stop).
FLAG_BRIGHT_SHORT = {
    "biology": "Given a Biology post, retrieve relevant passages that help answer the post.",
    "earth_science": "Given an Earth Science post, retrieve relevant passages that help answer the post.",
    "economics": "Given an Economics post, retrieve relevant passages that help answer the post.",
    "psychology": "Given a Psychology post, retrieve relevant passages that help answer the post.",
    "robotics": "Given a Robotics post, retrieve relevant passages that help answer the post.",
    "stackoverflow": "Given a Stack Overflow post, retrieve relevant passages that help answer the post.",
    "sustainable_living": "Given a Sustainable Living post, retrieve relevant passages that help answer the post.",
    "leetcode": "Given a Coding problem, retrieve relevant examples that help answer the problem.",
    "pony": "Given a Pony question, retrieve relevant passages that help answer the question.",
    "aops": "Given a Math problem, retrieve relevant examples that help answer the problem.",
    "theoremqa_questions": "Given a Math problem, retrieve relevant examples that help answer the problem.",
    "theoremqa_theorems": "Given a Math problem, retrieve relevant theorems that help answer the problem.",
}
FLAG_BRIGHT_LONG = {
    "biology": "Given a Biology post, retrieve relevant documents that help answer the post.",
    "earth_science": "Given an Earth Science post, retrieve relevant documents that help answer the post.",
    "economics": "Given an Economics post, retrieve relevant documents that help answer the post.",
    "psychology": "Given a Psychology post, retrieve relevant documents that help answer the post.",
    "robotics": "Given a Robotics post, retrieve relevant documents that help answer the post.",
    "stackoverflow": "Given a Stack Overflow post, retrieve relevant documents that help answer the post.",
    "sustainable_living": "Given a Sustainable Living post, retrieve relevant documents that help answer the post.",
    "pony": "Given a Pony question, retrieve relevant documents that help answer the question",
}
# The scripts' --query_instruction_format_for_retrieval (VectorSpaceLab/agentic-search@b2f2e40050f4,
# ReasonEmbed/evaluation_bright/scripts/*/eval_*.sh), its literal \n made a newline by FlagEmbedding.
FLAG_FORMAT = "Instruct: {}\nQuery: {}"
FLAG_ENTRIES = ("reasonembed-qwen3-8b", "reasonembed-qwen3-4b", "reasonembed-llama-8b",
                "qwen3-embedding-8b", "qwen3-embedding-4b")

_POST = "Given a {task} post, retrieve relevant {what} that help answer the post"
_PONY = "Given a {task} question, retrieve relevant {what} that help answer the question"
_CODE = "Given a coding problem, retrieve relevant examples that help answer the problem"
_MATH = "Given a Math problem, retrieve relevant examples that help answer the problem"
_THEOREMS = "Given a Math problem, retrieve relevant theorems that help answer the problem"


def _configs(head: str, tail: str) -> dict[str, tuple[str, str | None]]:
    """BRIGHT key -> (the "instructions" query string, the "instructions_long" one or None), as the
    config files write them ({task} unreplaced)."""
    def short(t: str) -> str:
        return head + t.replace("{what}", "passages") + tail

    def long(t: str) -> str:
        return head + t.replace("{what}", "documents") + tail

    out = {k: (short(_POST), long(_POST)) for k in KEYS[:7]}
    out.update(leetcode=(short(_CODE), None), pony=(short(_PONY), long(_PONY)), aops=(short(_MATH), None),
               theoremqa_questions=(short(_MATH), None), theoremqa_theorems=(short(_THEOREMS), None))
    return out


# facebookresearch/ReasonIR@0aac96269e45, evaluation/bright/configs/reasonir/<task>.json: query
# strings; every "document" is "<|embed|>\n".
REASONIR_QUERY = _configs("<|user|>\n", "\n<|embed|>\n")
REASONIR_DOC = "<|embed|>\n"
# Debrup-61/RaDeR@3a127e47a419, BRIGHT_configs/configs/trained_model/<task>.json ("query" only);
# retrievers.py retrieval_trainedmodel then builds f"query: {instruction.format(task=task)}{query}{eos}"
# and f"document: {document}{eos}" with Qwen/Qwen2.5-14B-Instruct's tokenizer.
RADER_QUERY = _configs("Instruct: ", "\nQuery: ")
