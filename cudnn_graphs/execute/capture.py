"""A bound plan recorded into a CUDA graph: `replay()` re-runs it as one graph launch.

Stream capture records whatever the plan launches (cuDNN engines and our fallback kernels alike);
`plan.launcher.Launcher.capture` does the recording.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

from gpu_launch.driver import GraphExec


@dataclass
class CapturedPlan:
    """A recorded launch: `replay()` re-runs it on the bound stream, on the same buffers."""

    bound: Any
    graph: GraphExec = field(repr=False)
    stream: int = field(repr=False)

    def replay(self) -> None:
        self.graph.launch(self.stream)
