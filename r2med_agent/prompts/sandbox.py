"""Limits on what a prompt template may do while it renders: Jinja's immutable sandbox, bounded.

Templates come from users' folders (``R2MED_PROMPTS_DIR``, ``--prompts``) and clones of other
repositories. Jinja's sandbox keeps them from Python's internals, but not from work without end:
two nested ``range(99999)`` loops, ``'x' * 10**10``, ``indent(10**10)``, a macro that calls
itself. :class:`BoundedSandbox` stops each of them, and :func:`render_bounded` renders one
template under a fresh budget:

* time: :data:`RENDER_BUDGET_S` seconds, and :data:`MAX_STEPS` loop iterations, calls and
  outputs, per render;
* size: no string or list it builds (``*``, ``+``, ``~``, ``%``, ``str.format``, string methods,
  filters such as ``indent``, ``center``, ``replace``, ``join``, ``wordwrap``) and not all its
  output together may exceed :data:`MAX_TEXT` characters beyond :data:`VARIABLES_FACTOR` times
  the text of its variables, which a prompt quotes; checked before the text is made where its
  size can be known;
* depth: :data:`MAX_DEPTH` nested calls (a recursive macro); ``range`` holds at most
  :data:`MAX_RANGE` items, an integer at most :data:`MAX_INT_BITS` bits.

Each limit raises :class:`TemplateLimit`; the caller reports it with the template's file and
line. The checks sit in the sandbox's hooks (calls, the operators it intercepts) and in calls
that the parsed template is rewritten to make around each loop's items, each ``~`` and each
piece of output (:class:`_Guard`), so a template cannot rename or shadow them.
"""

from __future__ import annotations

import inspect
import re
import string
import threading
import time
from collections.abc import Callable, Iterable, Iterator, Mapping
from dataclasses import dataclass
from typing import Any

import jinja2
import jinja2.nodes as nodes
import jinja2.sandbox
from jinja2.visitor import NodeTransformer

from r2med_agent.errors import ConfigError

__all__ = ["JINJA2_MIN", "MAX_DEPTH", "MAX_INT_BITS", "MAX_RANGE", "MAX_STEPS", "MAX_TEXT", "RENDER_BUDGET_S",
           "VARIABLES_FACTOR", "BoundedSandbox", "TemplateLimit", "check_jinja2", "render_bounded"]

JINJA2_MIN = (3, 1, 6)
"""The oldest jinja2 whose sandbox holds: before 3.1.6 a template reached ``os.environ`` (and any
API key in it) through ``|attr("format")`` (CVE-2025-27516)."""

MAX_TEXT = 10_000_000
"""Most characters a template may make beyond :data:`VARIABLES_FACTOR` times the text of its
variables: in one string or list, and in all its output together (far above any model's context:
10 MB is about 2.5M tokens)."""

VARIABLES_FACTOR = 8
"""How many times the text of its variables a template may make on top of :data:`MAX_TEXT` (it
quotes them, and a macro's output counts again where the macro is used)."""

MAX_STEPS = 1_000_000
"""Most loop iterations, calls and pieces of output in one render."""

RENDER_BUDGET_S = 5.0
"""Most seconds one render may take (a prompt renders in milliseconds)."""

MAX_DEPTH = 50
"""Most nested calls (macros calling macros) in one render."""

MAX_RANGE = 100_000
"""Most items of one ``range()`` (Jinja's own sandbox limit)."""

MAX_INT_BITS = 100_000
"""Most bits of an integer a template computes with ``*`` or ``**`` (about 30,000 digits)."""


class TemplateLimit(Exception):
    """A template went past one of this module's limits (the message says which)."""


def check_jinja2(version: str | None = None) -> None:
    """Refuse a jinja2 older than :data:`JINJA2_MIN` (the one imported, unless ``version``).

    Raises:
        ConfigError: the version, why it is refused and the command that upgrades it.
    """
    version = jinja2.__version__ if version is None else version
    m = re.match(r"(\d+)\.(\d+)(?:\.(\d+))?", version)
    found = tuple(int(g or 0) for g in m.groups()) if m else (0, 0, 0)
    if found < JINJA2_MIN:
        need = ".".join(map(str, JINJA2_MIN))
        raise ConfigError(
            f"jinja2 {version} is imported; r2med-agent needs jinja2>={need}: in older versions a prompt "
            f"template escapes the sandbox through attr('format') and reads the environment (API keys "
            f"included); upgrade it: pip install 'jinja2>={need}'")


# -- the budget of one render -------------------------------------------------------------------


@dataclass
class _Budget:
    deadline: float
    text_limit: int
    steps: int = 0
    depth: int = 0
    produced: int = 0


_state = threading.local()


def _budget() -> _Budget | None:
    return getattr(_state, "budget", None)


def _text_limit() -> int:
    budget = _budget()
    return budget.text_limit if budget is not None else MAX_TEXT


def _step() -> None:
    budget = _budget()
    if budget is None:
        return
    budget.steps += 1
    if budget.steps > MAX_STEPS:
        raise TemplateLimit(f"more than {MAX_STEPS:,} loop iterations, calls and outputs in one render")
    if time.monotonic() > budget.deadline:
        raise TemplateLimit(f"rendering took more than {RENDER_BUDGET_S:g} s")


def _weight(value: Any, depth: int = 2) -> int:
    """Characters (or items) ``value`` holds: a string's length; a list's items and what they hold,
    ``depth`` levels down; 0 for other values."""
    if isinstance(value, str):
        return len(value)
    if isinstance(value, (list, tuple)):
        return len(value) + (sum(_weight(v, depth - 1) for v in value) if depth > 0 else 0)
    if isinstance(value, Mapping) and depth > 0:
        return sum(_weight(v, depth - 1) for v in value.values())
    return 0


def _check_size(size: int, what: str) -> None:
    limit = _text_limit()
    if size > limit:
        raise TemplateLimit(f"{what} would make {size:,} characters or items, more than {limit:,}")


def _check_int(value: Any, what: str) -> None:
    if isinstance(value, int) and not isinstance(value, bool):
        _check_size(abs(value), what)


# -- the calls the parsed template is rewritten to make -----------------------------------------


def _loop(items: Any) -> Iterator[Any]:
    """A ``for`` loop's items, one step each."""
    for item in items:
        _step()
        yield item


def _concat(*parts: Any) -> str:
    """``a ~ b ~ ...``, its size checked before it is made."""
    texts = [p if isinstance(p, str) else str(p) for p in parts]
    _check_size(sum(map(len, texts)), "'~'")
    return "".join(texts)


def _out(value: Any) -> str:
    """One piece of output (text or ``{{ ... }}``), counted against the render's output."""
    text = value if isinstance(value, str) else str(value)
    budget = _budget()
    if budget is not None:
        budget.produced += len(text)
        if budget.produced > budget.text_limit:
            raise TemplateLimit(f"the output would pass {budget.text_limit:,} characters")
    return text


def _range(*args: int) -> range:
    items = range(*args)
    if len(items) > MAX_RANGE:
        raise TemplateLimit(f"range() of {len(items):,} items, more than {MAX_RANGE:,}")
    return items


_GUARDS = {"r2med_loop": _loop, "r2med_concat": _concat, "r2med_out": _out}


class _Guard(NodeTransformer):
    """Rewrites a parsed template so that each loop's items, each ``~`` and each piece of output
    pass through :data:`_GUARDS` (reached as attributes of the environment, which a template
    cannot assign)."""

    @staticmethod
    def _call(name: str, args: list[nodes.Expr], lineno: int) -> nodes.Call:
        return nodes.Call(nodes.EnvironmentAttribute(name, lineno=lineno), args, [], None, None, lineno=lineno)

    def visit_For(self, node: nodes.For) -> nodes.Node:
        self.generic_visit(node)
        node.iter = self._call("r2med_loop", [node.iter], node.lineno)
        return node

    def visit_Concat(self, node: nodes.Concat) -> nodes.Node:
        self.generic_visit(node)
        return self._call("r2med_concat", list(node.nodes), node.lineno)

    def visit_Output(self, node: nodes.Output) -> nodes.Node:
        self.generic_visit(node)
        node.nodes = [self._call("r2med_out", [n if not isinstance(n, nodes.TemplateData)
                                               else nodes.Const(n.data, lineno=n.lineno)], n.lineno)
                      for n in node.nodes]
        return node


# -- sizes known before the text is made --------------------------------------------------------

_PRINTF = re.compile(r"%(?:\([^)]*\))?[#0\- +]*(\*|\d+)?(?:\.(\*|\d+))?")


def _check_printf(fmt: str, args: Any) -> None:
    """``fmt % args``: each width and precision within the limit (``*`` ones taken from args)."""
    for width, precision in _PRINTF.findall(fmt):
        for n in (width, precision):
            if n.isdigit():
                _check_size(int(n), "a '%' format width")
            elif n == "*":
                for a in args if isinstance(args, tuple) else (args,):
                    _check_int(a, "a '%' format width")


def _check_format_spec(fmt: str, args: Iterable[Any]) -> None:
    """``fmt.format(...)``: each width and precision within the limit (values of nested fields
    among ``args``)."""
    for _, _, spec, _ in string.Formatter().parse(fmt):
        for n in re.findall(r"\d+", spec or ""):
            _check_size(int(n), "a format width")
        if spec and "{" in spec:
            for a in args:
                _check_int(a, "a format width")


def _lines(text: Any) -> int:
    return str(text).count("\n") + 1


_PER_ITEM = MAX_TEXT // MAX_RANGE
"""What one list a filter makes counts for (``batch`` and ``slice`` make at most :data:`MAX_RANGE`)."""

_FILTER_SIZES: dict[str, Callable[[dict[str, Any]], int]] = {
    "indent": lambda a: len(str(a["s"])) + _lines(a["s"]) * (
        len(a["width"]) if isinstance(a["width"], str) else max(int(a["width"]), 0)),
    "center": lambda a: max(len(str(a["value"])), int(a["width"])),
    "wordwrap": lambda a: len(str(a["s"])) + (len(str(a["s"])) // max(int(a["width"]), 1) + _lines(a["s"])) * len(
        a["wrapstring"] or "\n"),
    "replace": lambda a: len(str(a["s"])) + (str(a["s"]).count(str(a["old"])) + 1) * len(str(a["new"])),
    "batch": lambda a: int(a["linecount"]) * _PER_ITEM,
    "slice": lambda a: int(a["slices"]) * _PER_ITEM,
    "tojson": lambda a: int(a["indent"] or 0) * 1000,
    "truncate": lambda a: len(str(a["end"])),
}
"""For filters that can make more than they are given: a bound on their result's size (in
characters or items) from their arguments, checked before they run."""


def _bounded_filter(name: str, func: Callable[..., Any]) -> Callable[..., Any]:
    size = _FILTER_SIZES.get(name)
    signature = inspect.signature(func) if size is not None else None
    value_at = 0 if getattr(func, "jinja_pass_arg", None) is None else 1
    # An async-capable filter is marked to take the evaluation context, which the function its
    # signature comes from may not take.
    bind_from = 0 if getattr(inspect.unwrap(func), "jinja_pass_arg", None) is not None else value_at

    def bounded(*args: Any, **kwargs: Any) -> Any:
        _step()
        if name in ("join", "sum") and len(args) > value_at and not isinstance(args[value_at], (str, list, tuple)):
            args = (*args[:value_at], list(args[value_at]), *args[value_at + 1:])
        if size is not None and signature is not None:
            bound = signature.bind(*args[bind_from:], **kwargs)
            bound.apply_defaults()
            _check_size(size(bound.arguments), f"the filter {name}")
        elif name in ("join", "sum") and len(args) > value_at:
            joiner = (args[value_at + 1] if len(args) > value_at + 1 else kwargs.get("d", "")) if name == "join" else ""
            items = args[value_at]
            _check_size(_weight(items) + len(items) * (len(joiner) if isinstance(joiner, str) else 0),
                        f"the filter {name}")
        elif name == "format" and args:
            _check_printf(str(args[0]), tuple(args[1:]) or tuple(kwargs.values()))
        result = func(*args, **kwargs)
        if isinstance(result, (str, list, tuple)):
            _check_size(_weight(result, 1), f"the filter {name}")
        return result

    bounded.__dict__.update(getattr(func, "__dict__", {}))  # Jinja's pass_context / pass_environment marks
    bounded.__name__ = bounded.__qualname__ = getattr(func, "__name__", name)
    bounded.__doc__ = func.__doc__
    return bounded


def _check_str_method(obj: Any, args: tuple[Any, ...], kwargs: Mapping[str, Any]) -> None:
    """A string method that can grow its string (``ljust``, ``center``, ``zfill``,
    ``expandtabs``, ``replace``, ``join``): the size of its result."""
    owner = getattr(obj, "__self__", None)
    if not isinstance(owner, str):
        return
    name = getattr(obj, "__name__", "")
    given = [*args, *kwargs.values()]
    if name in ("ljust", "rjust", "center", "zfill") and given:
        _check_int(given[0], f"str.{name}")
    elif name == "expandtabs" and given and isinstance(given[0], int):
        _check_size(len(owner) + owner.count("\t") * given[0], "str.expandtabs")
    elif name == "replace" and len(given) >= 2:
        _check_size(len(owner) + (owner.count(str(given[0])) + 1) * len(str(given[1])), "str.replace")
    elif name == "join" and given:
        items = given[0]
        if isinstance(items, (list, tuple)):
            _check_size(_weight(items) + len(items) * len(owner), "str.join")


class BoundedSandbox(jinja2.sandbox.ImmutableSandboxedEnvironment):
    """Jinja's immutable sandbox with this module's limits (see the module's text)."""

    intercepted_binops = frozenset({"*", "**", "+", "%"})

    def __init__(self, *args: Any, **kwargs: Any) -> None:
        check_jinja2()
        super().__init__(*args, **kwargs)
        self.globals["range"] = _range
        self.globals.pop("lipsum", None)  # placeholder text: no use in a prompt, and n=10**9 runs long
        self.filters = {name: _bounded_filter(name, f) for name, f in self.filters.items()}
        for name, guard in _GUARDS.items():
            setattr(self, name, guard)

    def _parse(self, source: str, name: str | None, filename: str | None) -> nodes.Template:
        tree = super()._parse(source, name, filename)
        return _Guard().visit(tree)  # type: ignore[no-any-return]

    def call_binop(self, context: jinja2.runtime.Context, operator: str, left: Any, right: Any) -> Any:
        ints = all(isinstance(v, int) and not isinstance(v, bool) for v in (left, right))
        if operator == "**" and ints and right > 0 and abs(left) > 1:
            if abs(left).bit_length() * right > MAX_INT_BITS:
                raise TemplateLimit(f"'**' would make an integer of more than {MAX_INT_BITS:,} bits")
        elif operator == "*" and ints:
            if abs(left).bit_length() + abs(right).bit_length() > MAX_INT_BITS:
                raise TemplateLimit(f"'*' would make an integer of more than {MAX_INT_BITS:,} bits")
        elif operator == "*":
            seq, times = (left, right) if isinstance(right, int) else (right, left)
            if isinstance(seq, (str, list, tuple)) and isinstance(times, int):
                _check_size(_weight(seq) * times, "'*'")
        elif operator == "+" and isinstance(left, (str, list, tuple)) and isinstance(right, (str, list, tuple)):
            _check_size(_weight(left) + _weight(right), "'+'")
        elif operator == "%" and isinstance(left, str):
            _check_printf(left, right)
        return super().call_binop(context, operator, left, right)

    def call(self, context: jinja2.runtime.Context, obj: Any, /, *args: Any, **kwargs: Any) -> Any:
        if any(obj is guard for guard in _GUARDS.values()):
            return obj(*args)  # (Jinja adds its _loop_vars and _block_vars to every call)
        _step()
        _check_str_method(obj, args, kwargs)
        budget = _budget()
        if budget is not None:
            budget.depth += 1
            if budget.depth > MAX_DEPTH:
                budget.depth -= 1
                raise TemplateLimit(f"calls nested more than {MAX_DEPTH} deep (a macro that calls itself?)")
        try:
            result = super().call(context, obj, *args, **kwargs)
        finally:
            if budget is not None:
                budget.depth -= 1
        if isinstance(result, (str, list, tuple)):
            _check_size(_weight(result, 1), "a call")
        return result

    def wrap_str_format(self, value: Any) -> Callable[..., str] | None:
        wrapped = super().wrap_str_format(value)
        if wrapped is None:
            return None
        fmt = value.__self__

        def bounded(*args: Any, **kwargs: Any) -> str:
            given = [*args, *kwargs.values()]
            if value.__name__ == "format_map" and args and isinstance(args[0], Mapping):
                given = list(args[0].values())
            _check_format_spec(fmt, given)
            return wrapped(*args, **kwargs)

        return bounded

    def get_template(self, *args: Any, **kwargs: Any) -> jinja2.Template:
        _step()  # an include or import while rendering
        return super().get_template(*args, **kwargs)


def render_bounded(template: jinja2.Template, variables: Mapping[str, Any]) -> str:
    """``template`` rendered with ``variables`` under a fresh budget of this module's limits.

    Raises:
        TemplateLimit: a limit was reached (the traceback holds the template's line).
    """
    outer = _budget()
    _state.budget = _Budget(deadline=time.monotonic() + RENDER_BUDGET_S,
                            text_limit=MAX_TEXT + VARIABLES_FACTOR * _weight(dict(variables), 3))
    try:
        return "".join(template.generate(**variables))
    finally:
        _state.budget = outer
