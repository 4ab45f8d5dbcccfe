"""Each node's mark: what the cast pass decided for it, why, and in which module, kept in `node.meta["graphamp"]`."""

from __future__ import annotations

from dataclasses import dataclass

from torch.fx import Node

from graphamp.policy.lists import Decision

__all__ = ["MARK", "OpMark", "mark_of"]

MARK = "graphamp"  # the node.meta key


@dataclass(frozen=True)
class OpMark:
    """What the cast pass decided for one node, and why."""

    decision: Decision
    source: str  # the list line (`lists/white.txt:11`), "model", ...: "" where no list decided
    module: str  # the FQN of the innermost module the op ran in, "" at the top level

    def to_json(self) -> dict[str, str]:
        """As `export_program` keeps it in `node.meta["custom"]["graphamp"]`, which torch.export.save keeps."""
        return {"decision": str(self.decision), "source": self.source, "module": self.module}


def mark_of(node: Node) -> OpMark | None:
    """The node's mark; None for a node the cast pass did not decide (placeholders, getitems, outputs)."""
    return node.meta.get(MARK)
