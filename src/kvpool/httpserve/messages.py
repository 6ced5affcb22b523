"""OpenAI chat ``messages`` as a chat template takes them: the one reading that ``kvpool serve``
(which tokenizes them) and ``kvpool router`` (which tokenizes them to route) share, so that
both compute the same token ids for the same request."""

from __future__ import annotations

from collections.abc import Collection, Mapping

from kvpool.errors import InvalidArgumentError

__all__ = ["chat_messages"]


def chat_messages(messages: object,
                  roles: Collection[str] | None = None) -> list[dict[str, str]]:
    """``messages`` as ``[{"role", "content"}]`` with text ``content`` (content parts of type
    ``text`` joined); ``roles``, when given, the roles accepted. InvalidArgumentError naming
    the message otherwise."""
    if not isinstance(messages, list) or not messages:
        raise InvalidArgumentError("'messages' must be a non-empty list of {role, content}")
    clean: list[dict[str, str]] = []
    for i, m in enumerate(messages):
        if not isinstance(m, Mapping) or not isinstance(m.get("role"), str):
            raise InvalidArgumentError(f"messages[{i}] must be an object with a string 'role'")
        if roles is not None and m["role"] not in roles:
            raise InvalidArgumentError(
                f"messages[{i}].role {m['role']!r} is not a chat role; expected one of "
                f"{', '.join(roles)}"
            )
        content = m.get("content")
        if isinstance(content, list):  # content parts: only text is understood
            parts = []
            for part in content:
                if not isinstance(part, Mapping) or part.get("type") != "text" or not isinstance(
                    part.get("text"), str
                ):
                    raise InvalidArgumentError(f"messages[{i}].content: only text parts")
                parts.append(part["text"])
            content = "".join(parts)
        if not isinstance(content, str):
            raise InvalidArgumentError(f"messages[{i}].content must be a string")
        clean.append({"role": m["role"], "content": content})
    return clean
