"""The Jinja environment chat templates render in: the immutable sandbox, held to a size.

A chat template is data from a checkpoint. Jinja's sandbox keeps it from Python objects, but not
from asking for memory or time: `'a' * 2**36` wants 64 GiB (folded when the template compiles),
`'x'.center(10**9)` or `'%1000000000s' % x` a gigabyte, a string doubled by `~` thirty times the
same, and three loops nested over a message's characters run for hours on a 2,000-character
message. A render is held to:

- `*` building at most MAX_TEXT_ITEMS items, `**` exponents of MAX_EXPONENT, integer products of
  MAX_INT_BITS bits;
- strings built by `~`, `join`, `replace`, `center`/`ljust`/`rjust`/`zfill`/`indent`, and `%` or
  `format` with widths, and the rows of `batch` and `slice`, of at most MAX_TEXT_ITEMS characters
  (or rows), checked before they are built;
- MAX_RENDER_ITEMS loop iterations and range() items together (a loop is charged its length when
  it starts, so nested loops are charged their product);
- constants not folded at compile time (`optimized=False`): every limit applies at render.
"""

from __future__ import annotations

import re
from contextvars import ContextVar

MAX_TEXT_ITEMS = 4 << 20  # characters of a built string, items of a built list
MAX_EXPONENT = 64
MAX_INT_BITS = 4096
MAX_RENDER_ITEMS = 100_000
# widths and precisions in a %-format or a str.format spec: "%1000000000s", "{:>1000000000}"
_FORMAT_WIDTH = re.compile(r"%[-+ #0]*(\d+)|%[-+ #0]*\d*\.(\d+)|\{[^{}]*:[^{}]*?(\d+)")
_LEFT: ContextVar[list[int] | None] = ContextVar("render_items_left", default=None)


class RenderBudget:
    """The items one render may still use: `with RenderBudget():` around each render."""

    def __enter__(self):
        self.token = _LEFT.set([MAX_RENDER_ITEMS])
        return self

    def __exit__(self, *exc):
        _LEFT.reset(self.token)


def _refuse(what: str):
    from jinja2.exceptions import SecurityError

    return SecurityError(f"a chat template {what}")


def _charge(n: int) -> None:
    left = _LEFT.get()
    if left is not None:
        left[0] -= n
        if left[0] < 0:
            raise _refuse(f"loops and range() over more than {MAX_RENDER_ITEMS:,} items in one render")


def _text_size(n: int, how: str) -> None:
    if n > MAX_TEXT_ITEMS:
        raise _refuse(f"{how} past {MAX_TEXT_ITEMS:,} items")


def _check_format(spec: str) -> None:
    for match in _FORMAT_WIDTH.finditer(spec):
        width = max(int(g) for g in match.groups() if g)
        _text_size(width, "formatted a field wider")


def _charged_iter(iterable):
    """A loop's iterable, charged its length against the render's items before it runs."""
    if not hasattr(iterable, "__len__"):
        from itertools import islice

        left = _LEFT.get()
        iterable = list(islice(iterable, (left[0] if left is not None else MAX_RENDER_ITEMS) + 1))
    _charge(len(iterable))
    return iterable


def _bounded_range(*args):
    items = range(*args)
    _charge(len(items))
    return items


def _joined(parts) -> str:
    """`a ~ b ~ c`, its length checked before it is built."""
    texts = [str(p) for p in parts]
    _text_size(sum(len(t) for t in texts), "concatenated a string")
    return "".join(texts)


def _width(value, width) -> None:
    if isinstance(width, int):
        _text_size(width, "padded a string")


def _rows(n) -> None:
    if isinstance(n, int):
        _text_size(n, "asked for rows")


def _join_size(items, sep: str = "") -> None:
    items = list(items)
    _text_size(sum(len(str(i)) for i in items) + len(sep) * max(len(items) - 1, 0), "joined a string")


def _replaced_size(text: str, old: str, new: str, count: int = -1) -> None:
    if isinstance(text, str) and isinstance(old, str) and isinstance(new, str) and len(new) > len(old):
        hits = text.count(old) if old else len(text) + 1
        if count is not None and count >= 0:
            hits = min(hits, count)
        _text_size(len(text) + hits * (len(new) - len(old)), "replaced into a string")


# str methods whose result a template sizes: a check before the call
_METHOD_CHECKS = {
    "center": lambda s, width, *a: _width(s, width),
    "ljust": lambda s, width, *a: _width(s, width),
    "rjust": lambda s, width, *a: _width(s, width),
    "zfill": lambda s, width, *a: _width(s, width),
    "expandtabs": lambda s, size=8, *a: _text_size(s.count("\t") * size + len(s), "expanded tabs"),
    "join": lambda sep, items, *a: _join_size(items, sep),
    "replace": lambda s, old, new, count=-1, *a: _replaced_size(s, old, new, count),
    "format": lambda s, *a, **k: _check_format(s),
    "format_map": lambda s, *a: _check_format(s),
}


def bounded_environment(**options):
    """Jinja's immutable sandbox held to the limits above; `options` as Jinja's Environment's."""
    from jinja2 import nodes
    from jinja2.filters import FILTERS
    from jinja2.sandbox import ImmutableSandboxedEnvironment
    from jinja2.visitor import NodeTransformer

    class Bounded(NodeTransformer):
        """Every loop's iterable through _charged_iter, every `~` through _joined."""

        def __init__(self, environment):
            self.environment = environment

        def _call(self, name: str, arg, lineno: int):
            call = nodes.Call(nodes.Name(name, "load"), [arg], [], None, None, lineno=lineno)
            return call.set_environment(self.environment)

        def visit_For(self, node):
            self.generic_visit(node)
            node.iter = self._call("_charged_iter", node.iter, node.lineno)
            return node

        def visit_Concat(self, node):
            self.generic_visit(node)
            return self._call("_joined", nodes.List(node.nodes, lineno=node.lineno), node.lineno)

    class BoundedSandbox(ImmutableSandboxedEnvironment):
        intercepted_binops = frozenset({"*", "**", "%"})

        def _parse(self, source, name, filename):
            return Bounded(self).visit(super()._parse(source, name, filename))

        def call_binop(self, context, operator, left, right):
            if operator == "*":
                for seq, n in ((left, right), (right, left)):
                    if isinstance(seq, (str, list, tuple)) and isinstance(n, int):
                        _text_size(len(seq) * n, "repeated a sequence")
                if isinstance(left, int) and isinstance(right, int):
                    if left.bit_length() + right.bit_length() > MAX_INT_BITS:
                        raise _refuse(f"multiplied integers past {MAX_INT_BITS} bits")
            elif operator == "**":
                if isinstance(right, (int, float)) and abs(right) > MAX_EXPONENT:
                    raise _refuse(f"raised to a power above {MAX_EXPONENT}")
            elif isinstance(left, str):  # %-formatting
                _check_format(left)
            return super().call_binop(context, operator, left, right)

        def call(__self, __context, __obj, *args, **kwargs):  # noqa: N805 (Jinja's signature)
            method = getattr(__obj, "__wrapped__", __obj)  # the sandbox wraps str.format
            check = _METHOD_CHECKS.get(getattr(method, "__name__", ""))
            if check is not None and isinstance(getattr(method, "__self__", None), str):
                check(method.__self__, *args, **kwargs)
            return super().call(__context, __obj, *args, **kwargs)

    env = BoundedSandbox(optimized=False, **options)
    env.globals.update(range=_bounded_range, _charged_iter=_charged_iter, _joined=_joined)

    def checked(name, check):
        """Jinja's filter `name` with `check` run on its arguments first (and the context it
        is passed, if any, passed on)."""
        original = FILTERS[name]
        passes = getattr(original, "jinja_pass_arg", None)
        if passes is None:

            def bounded(value, *args, **kwargs):
                check(value, *args, **kwargs)
                return original(value, *args, **kwargs)

        else:

            def bounded(ctx, value, *args, **kwargs):
                check(value, *args, **kwargs)
                return original(ctx, value, *args, **kwargs)

            bounded.jinja_pass_arg = passes
        return bounded

    env.filters.update(
        center=checked("center", lambda s, width=80: _width(s, width)),
        indent=checked(
            "indent",
            lambda s, width=4, *a, **k: _text_size(
                len(str(s)) * (1 + (width if isinstance(width, int) else len(str(width)))), "indented a string"
            ),
        ),
        format=checked("format", lambda s, *a, **k: _check_format(str(s))),
        join=checked("join", lambda items, d="", attribute=None: _join_size(items, str(d))),
        replace=checked("replace", lambda s, old, new, count=None: _replaced_size(str(s), old, new, count)),
        batch=checked("batch", lambda items, linecount, fill_with=None: _rows(linecount)),
        slice=checked("slice", lambda items, slices, fill_with=None: _rows(slices)),
    )
    return env
