"""Chat templates rendered without Jinja per request, where that is provably the same text.

Most chat templates use a message's ``content`` in one way only: they print it, as it is
(``{{ message['content'] }}``, or concatenated: ``{{ '<|im_start|>' + message['role'] + '\\n' +
message['content'] + '<|im_end|>' }}``). Everything else they print (roles, special tokens,
a default system prompt, the generation prompt) depends on the messages' roles and number, not
on their contents. For such a template, the text of a chat is its *skeleton* — the template
rendered once for the chat's roles, with a marker in place of each content — with the markers
replaced by the contents: one ``str.join`` instead of a Jinja render (about 40 µs of Python
per request for SmolLM2's template).

:class:`SkeletonRenderer` is used only when the template's syntax tree shows that contents
reach nothing but output, unchanged (:func:`contents_only_printed`):

* every ``content`` read (``x['content']``, ``x.content``, of anything) is printed, alone or
  concatenated with ``+`` / ``~``, by an output statement, with no filter, test, condition,
  assignment or call in between;
* ``messages`` is only looped over (``{% for m in messages %}``), indexed
  (``messages[0]``) or counted (``messages|length``), never reassigned; a message (a loop
  variable over ``messages``, ``messages[i]``, ``loop.previtem``/``loop.nextitem``) is only
  read by a constant key that is not a dict method (``role``, ``content``, or a key the
  router's messages never have, such as ``tool_calls``: undefined whatever the contents);
  loop variables over messages are not reassigned;
* no blocks that capture or transform output (``{% filter %}``, ``{% set %}...{% endset %}``,
  macros, call blocks such as transformers' ``{% generation %}``), no includes or
  inheritance, and nothing that varies from one render to the next (``strftime_now``,
  ``lipsum``, the ``random`` filter);
* the environment neither escapes nor post-processes output (no autoescape, no
  ``finalize``).

Then a chat's text depends on its contents only where they are printed, and the skeleton of
its roles (cached, a bounded LRU) gives the same text. A template that fails any check keeps
its Jinja render (:mod:`kvpool.router.tokenize` decides, and also compares the two on probes).
"""

from __future__ import annotations

import re
from collections import OrderedDict
from collections.abc import Callable, Mapping, Sequence
from typing import Any, Final

__all__ = ["SKELETONS", "SkeletonRenderer", "contents_only_printed"]

SKELETONS: Final = 4096
"""Skeletons kept (one per sequence of roles seen recently)."""

_MARK: Final = "\x00kvpool-content-{}\x00"
_MARKS: Final = re.compile("\x00kvpool-content-([0-9]+)\x00")
_VARYING: Final = frozenset({"strftime_now", "lipsum"})
_DICT_NAMES: Final = frozenset(dir(dict))


def contents_only_printed(environment: Any, source: str) -> bool:
    """Whether the template ``source`` (parsed by the Jinja ``environment``) uses message
    contents only by printing them unchanged, and renders the same for the same roles; see
    the module docstring for the rules (any doubt answers False)."""
    from jinja2 import nodes

    if "\x00" in source or environment.autoescape or environment.finalize is not None:
        return False
    try:
        tree = environment.parse(source)
    except Exception:  # a template Jinja cannot parse: its render raises, not ours to judge
        return False
    parents: dict[int, Any] = {}
    every: list[Any] = []
    stack = [tree]
    while stack:
        node = stack.pop()
        every.append(node)
        for child in node.iter_child_nodes():
            parents[id(child)] = node
            stack.append(child)
    forbidden = (nodes.FilterBlock, nodes.AssignBlock, nodes.Macro, nodes.CallBlock,
                 nodes.Include, nodes.Import, nodes.FromImport, nodes.Extends, nodes.Block)
    loop_names: set[str] = set()
    for node in every:
        if isinstance(node, forbidden):
            return False
        if isinstance(node, nodes.Name) and node.name in _VARYING:
            return False
        if isinstance(node, nodes.Filter) and node.name == "random":
            return False
        if isinstance(node, nodes.For) and _is_messages(node.iter):
            if not isinstance(node.target, nodes.Name):
                return False
            loop_names.add(node.target.name)
    stores = [n.name for n in every if isinstance(n, nodes.Name) and n.ctx != "load"]
    if "messages" in stores or any(stores.count(name) != 1 for name in loop_names):
        return False  # messages, or a message's loop variable, assigned again
    for node in every:
        parent = parents.get(id(node))
        if _is_messages(node) and not _messages_use_ok(node, parent):
            return False
        if _is_message(node, loop_names) and not _plain_key(_key_of(parent, node)):
            return False
        if _key(node) == "content" and not _printed(node, parents):
            return False
    return True


class SkeletonRenderer:
    """Renders chats through cached skeletons; ``render_jinja(messages)`` renders a chat (the
    skeletons are made with it). Thread-safe enough for the router: a skeleton computed twice
    at once is the same skeleton."""

    def __init__(self, render_jinja: Callable[[Sequence[Mapping[str, str]]], str], *,
                 max_skeletons: int = SKELETONS) -> None:
        self._jinja = render_jinja
        self._skeletons: OrderedDict[tuple[str, ...], tuple[list[str], list[tuple[int, int]]]]
        self._skeletons = OrderedDict()
        self._max = max_skeletons
        self.misses = 0

    def render(self, messages: Sequence[Mapping[str, str]]) -> str:
        """The template's text for ``messages`` (as ``render_jinja`` gives it)."""
        roles = tuple(m["role"] for m in messages)
        skeleton = self._skeletons.get(roles)
        if skeleton is None:
            if any("\x00" in r for r in roles):
                return self._jinja(messages)
            skeleton = self._skeleton(roles)  # raises as the template raises for these roles
        else:
            self._skeletons.move_to_end(roles)
        parts, slots = skeleton
        out = parts.copy()
        for at, index in slots:
            out[at] = messages[index]["content"]
        return "".join(out)

    def __len__(self) -> int:
        return len(self._skeletons)

    def _skeleton(self, roles: tuple[str, ...]) -> tuple[list[str], list[tuple[int, int]]]:
        marked = [{"role": r, "content": _MARK.format(i)} for i, r in enumerate(roles)]
        pieces = _MARKS.split(self._jinja(marked))
        parts = pieces.copy()
        slots = [(at, int(pieces[at])) for at in range(1, len(pieces), 2)]
        self.misses += 1
        self._skeletons[roles] = (parts, slots)
        while len(self._skeletons) > self._max:
            self._skeletons.popitem(last=False)
        return parts, slots


def _is_messages(node: Any) -> bool:
    from jinja2 import nodes

    return isinstance(node, nodes.Name) and node.name == "messages" and node.ctx == "load"


def _messages_use_ok(node: Any, parent: Any) -> bool:
    """``messages`` looped over, indexed (not sliced) or counted, nothing else."""
    from jinja2 import nodes

    if isinstance(parent, nodes.For):
        return parent.iter is node
    if isinstance(parent, nodes.Getitem):
        return parent.node is node and not isinstance(parent.arg, nodes.Slice)
    if isinstance(parent, nodes.Filter):
        return parent.node is node and parent.name in ("length", "count") and not (
            parent.args or parent.kwargs or parent.dyn_args or parent.dyn_kwargs)
    return False


def _is_message(node: Any, loop_names: set[str]) -> bool:
    """A message: a loop variable over ``messages``, ``messages[i]``, or a loop's
    ``previtem``/``nextitem``."""
    from jinja2 import nodes

    if isinstance(node, nodes.Name):
        return node.name in loop_names and node.ctx == "load"
    if isinstance(node, nodes.Getitem):
        return _is_messages(node.node)
    if isinstance(node, nodes.Getattr):
        return (isinstance(node.node, nodes.Name) and node.node.name == "loop"
                and node.attr in ("previtem", "nextitem"))
    return False


def _key(node: Any) -> object:
    """The constant key ``node`` reads (``x['k']``, ``x.k``), else None."""
    from jinja2 import nodes

    if isinstance(node, nodes.Getattr):
        return node.attr
    if isinstance(node, nodes.Getitem) and isinstance(node.arg, nodes.Const):
        return node.arg.value
    return None


def _plain_key(key: object) -> bool:
    """A key that reads a message's item, never a dict method (``get``, ``items``: Jinja
    falls back to attributes): ``role``, ``content``, or one a message never has."""
    return isinstance(key, str) and not key.startswith("_") and key not in _DICT_NAMES


def _key_of(parent: Any, node: Any) -> object:
    """The constant key ``parent`` reads from ``node``, else None."""
    from jinja2 import nodes

    if isinstance(parent, nodes.Getattr | nodes.Getitem) and parent.node is node:
        return _key(parent)
    return None


def _printed(node: Any, parents: dict[int, Any]) -> bool:
    """Whether ``node``'s value goes only into output, through ``+``/``~`` at most."""
    from jinja2 import nodes

    child = node
    parent = parents.get(id(child))
    while isinstance(parent, nodes.Add | nodes.Concat):
        child, parent = parent, parents.get(id(parent))
    return isinstance(parent, nodes.Output) and any(n is child for n in parent.nodes)
