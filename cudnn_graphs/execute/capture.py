"""CUDA-graph capture and replay of a bound plan, through CuPy's stream capture.

Stream capture records whatever the plan launches (cuDNN engines and our fallback kernels alike), so
a replay is one `cudaGraphLaunch` however many parts the plan has.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

from ..errors import GraphCaptureError
from ..graph import frontend
from .streams import external_stream


@dataclass
class CapturedPlan:
    """A recorded launch: `replay()` re-runs it on the bound stream, on the same buffers."""

    bound: Any
    graph: Any = field(repr=False)
    stream: Any = field(repr=False)

    def replay(self) -> None:
        self.graph.launch(stream=self.stream)


def capture(bound) -> CapturedPlan:
    import cupy

    plan = bound.plan
    with cupy.cuda.Device(plan.device):
        origin = external_stream(bound.stream_ptr)
        side = cupy.cuda.Stream(non_blocking=True)  # the legacy default stream cannot be captured
        side.wait_event(origin.record())  # the capture must not overtake work queued on the bound stream
        side.begin_capture()
        graph, error = None, None
        try:
            frontend.cudnn().set_stream(handle=bound.handle, stream=side.ptr)
            for call in bound.calls_on(side.ptr):
                call()
        except Exception as err:  # the engine refused to run under capture
            error = err
        finally:
            try:
                graph = side.end_capture()
            except Exception as err:  # an invalidated capture only reports here
                error = error or err
            frontend.cudnn().set_stream(handle=bound.handle, stream=bound.stream_ptr)
    if error is not None or graph is None:
        raise GraphCaptureError(plan.spec, plan.engines, error)
    return CapturedPlan(bound, graph, origin)

