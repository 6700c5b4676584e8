"""The gateway's route table: path and method -> handler (an ASGI callable).

A path is exact (``/v1/models``: one dict lookup, the inference routes' cost) or a template
whose segments may be ``{name}`` (one segment) or, last, ``{name:path}`` (the rest, slashes
included: model ids have them). A template's values reach the handler in
``scope["path_params"]``, as Starlette passes them. A GET route answers HEAD too (the app
drops the body). Adding a route is one ``add`` line in :class:`zml_gateway.app.Gateway`::

    routes.add("GET", "/v1/files/{file_id}/content", files.content)
"""

from __future__ import annotations

from zml_gateway.asgi import Handler

Methods = dict[str, Handler]


class _Template:
    __slots__ = ("parts", "names", "rest")

    def __init__(self, path: str) -> None:
        self.parts: list[str | None] = []  # a literal segment, or None for a parameter
        self.names: list[str] = []
        self.rest: str | None = None  # the {name:path} parameter, last
        segments = path.split("/")
        for i, seg in enumerate(segments):
            if seg.startswith("{") and seg.endswith("}"):
                name, _, kind = seg[1:-1].partition(":")
                if kind == "path":
                    if i != len(segments) - 1:
                        raise ValueError(f"{path}: a {{name:path}} parameter must come last")
                    self.rest = name
                    continue
                if kind:
                    raise ValueError(f"{path}: unknown parameter kind {kind!r}")
                self.parts.append(None)
                self.names.append(name)
            else:
                self.parts.append(seg)

    def match(self, path: str) -> dict[str, str] | None:
        segments = path.split("/", len(self.parts)) if self.rest is not None else path.split("/")
        if self.rest is not None:
            if len(segments) != len(self.parts) + 1:
                return None
            rest = segments.pop()
        elif len(segments) != len(self.parts):
            return None
        params: dict[str, str] = {}
        names = iter(self.names)
        for want, seg in zip(self.parts, segments):
            if want is None:
                if not seg:
                    return None
                params[next(names)] = seg
            elif want != seg:
                return None
        if self.rest is not None:
            params[self.rest] = rest
        return params


class Routes:
    def __init__(self) -> None:
        self._exact: dict[str, Methods] = {}
        self._templates: list[tuple[_Template, Methods]] = []
        self._by_template: dict[str, Methods] = {}

    def add(self, method: str, path: str, handler: Handler) -> None:
        if "{" in path:
            methods = self._by_template.get(path)
            if methods is None:
                methods = self._by_template[path] = {}
                self._templates.append((_Template(path), methods))
        else:
            methods = self._exact.setdefault(path, {})
        if method in methods:
            raise ValueError(f"{method} {path} has a handler already")
        methods[method] = handler

    def match(self, path: str) -> tuple[Methods, dict[str, str] | None] | None:
        """The handlers of ``path`` by method and its template's values (None: exact), or None."""
        methods = self._exact.get(path)
        if methods is not None:
            return methods, None
        for template, methods in self._templates:
            params = template.match(path)
            if params is not None:
                return methods, params
        return None

    def allow(self, path: str) -> str:
        """The ``Allow`` header of a 405 on ``path``."""
        found = self.match(path)
        return ", ".join(found[0]) if found is not None else "GET"

    def paths(self) -> list[str]:
        """Every path and template, in the order added."""
        return [*self._exact, *self._by_template]
