"""The stages' upstream references as a graph: the order they can run in, and a cycle to name."""

from __future__ import annotations


def upstream_cycle(stages) -> list[str]:
    """The names around one cycle of upstream references, its first name again at the end
    (e.g. [a, b, a]: a starts from b, b from a); [] when there is none."""
    by_name = {s.name: s for s in stages}
    finished: set[str] = set()
    for start in stages:
        path: list[str] = []
        name: str | None = start.name
        while name is not None and name not in finished:
            if name in path:
                return path[path.index(name):] + [name]
            path.append(name)
            name = next((u for u in by_name[name].upstream if u in by_name and u not in finished), None)
        finished.update(path)
    return []


def topological_order(stages) -> list | None:
    """Stages ordered so each comes after its upstream; None when there is a cycle.

    Ties keep the file's order, so a file already in order runs as written.
    """
    by_name = {s.name: s for s in stages}
    done: list = []
    placed: set[str] = set()
    remaining = list(stages)
    while remaining:
        ready = [s for s in remaining if all(u in placed or u not in by_name for u in s.upstream)]
        if not ready:
            return None
        first = ready[0]
        done.append(first)
        placed.add(first.name)
        remaining.remove(first)
    return done
