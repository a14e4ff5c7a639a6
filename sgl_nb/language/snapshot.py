"""A program's run as it is at one moment: `state.snapshot()`.

Views, records, diffs and token_info read this instead of the state's own fields, so they
never wait on the program (taking one does not sync) and never see a half-updated dict: the
containers are copies, read-only. The Nodes are the run's own objects (their status and
output still change while the program runs; the tuple of them does not)."""

from __future__ import annotations

from collections.abc import Iterator, Mapping
from dataclasses import dataclass

from sgl_nb.runtime.compiler.ir import Node
from sgl_nb.runtime.status import Status
from sgl_nb.runtime.token_choice import TokenChoice


@dataclass(frozen=True)
class ProgramSnapshot:
    id: int
    function: str | None
    parent: int | None  # the program that forked it, for a branch
    text: str
    vars: Mapping[str, object]  # in the order they were bound
    meta: Mapping[str, dict]  # what each gen or select reported
    messages: tuple[dict, ...]
    nodes: tuple[Node, ...]  # handed to the executor, in order (a Join brings its branches')
    tokens: Mapping[int, tuple[TokenChoice, ...]]  # gen node id -> its tokens, when recorded
    forks: Mapping[int, tuple[ProgramSnapshot, ...]]  # fork node id -> its branches
    status: Status  # RUNNING until its Return ran (a branch: DONE unless it failed)
    error: BaseException | None
    error_line: int | None
    finished: bool  # its Return ran
    held: bool  # its step controller holds it now
    call: Mapping[str, object]  # ProgramCall.attrs(): module, qualname, args, options

    def branches(self) -> Iterator[ProgramSnapshot]:
        """Every fork branch under this program, depth first."""
        for children in self.forks.values():
            for child in children:
                yield child
                yield from child.branches()

    def own_nodes(self) -> list[Node]:
        """The Nodes this program ran itself (not its branches')."""
        return [n for n in self.nodes if n.program == self.id]
