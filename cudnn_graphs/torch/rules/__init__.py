"""Fusion rules over a module's traced graph, registered the way TransformerEngine registers its fusions.

A rule says which operations it matches (`match`: candidates in a `View`), why a candidate cannot be
fused here (`why_not`: a reason for the report, or None), and what replaces its nodes (`install`: a
callable the rewritten forward calls with the candidate's inputs). `convert` runs the rules of its mode
over every module whose forward traces, smallest modules first; the report is keyed by rule name.
Adding a fusion is one node file, one rule file here and its tests.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Iterable

import torch.fx as fx

from .._graph import View


@dataclass
class Found:
    """A candidate: the nodes it replaces (graph order), its inputs, the node whose value it returns."""

    rule: "Rule"
    nodes: list[fx.Node]
    inputs: list[fx.Node]
    output: fx.Node
    where: str  # the qualified name the report uses
    data: Any = None  # the rule's own reading of the nodes (stages, activation ...)


class Rule:
    """Base of the rules; `modes`: the conversions ("training", "inference") it serves."""

    name: str = ""
    modes: tuple[str, ...] = ()

    def match(self, view: View) -> Iterable[Found]:
        """Each candidate in graph order; one it takes claims its nodes from later candidates."""
        claimed: set = set(view.claimed)
        index = {n: i for i, n in enumerate(view.graph.nodes)}
        for node in view.graph.nodes:
            found = None if node in claimed else self.found_at(view, node, claimed)
            if found is None:
                continue
            found.nodes = sorted(set(found.nodes), key=index.__getitem__)
            if self.why_not(found, view) is None:
                claimed.update(found.nodes)
            yield found

    def found_at(self, view: View, node: fx.Node, claimed: set) -> Found | None:
        """The candidate that starts at `node`, or None."""
        raise NotImplementedError

    def why_not(self, found: Found, view: View) -> str | None:
        return None

    def install(self, found: Found, view: View):
        raise NotImplementedError


RULES: list[Rule] = []


def register(rule: type) -> type:
    RULES.append(rule())
    return rule


def rules_for(mode: str) -> list[Rule]:
    from . import conv_bn_run, fold, preact  # noqa: F401, I001 - importing registers them, in this order of priority
    return [r for r in RULES if mode in r.modes]
