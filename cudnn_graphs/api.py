"""Module-level entry points: `run(request)` and the functional helpers, on a default session per device."""

from __future__ import annotations

import threading
from typing import Any

from .plan import Session
from .requests import ConvBwdDataRequest, ConvBwdFilterRequest, ConvFwdRequest

_sessions: dict[int, Session] = {}
_lock = threading.Lock()


def default_session(device: int = 0) -> Session:
    """The shared session for `device` (default settings), created on first use."""
    session = _sessions.get(device)
    if session is None:
        with _lock:
            session = _sessions.setdefault(device, Session(device=device))
    return session


def run(request, *, stream: Any = None, session: Session | None = None) -> Any:
    """`session.run(request)` on the given session, else the default one of the buffers' device."""
    return (session or default_session(request.device)).run(request, stream=stream)


def conv_fwd(x: Any, w: Any, bias: Any = None, *, z: Any = None, y: Any = None, stream: Any = None,
             session: Session | None = None, **conv_params: Any) -> Any:
    """y = act(alpha * conv(x, w) + bias + beta * z); conv_params as ConvFwdSpec (padding, stride, ...)."""
    return run(ConvFwdRequest(x, w, y=y, bias=bias, z=z, **conv_params), stream=stream, session=session)


def conv_bwd_data(dy: Any, w: Any, *, dx: Any = None, pre_act: Any = None, x_shape: Any = None,
                  stream: Any = None, session: Session | None = None, **conv_params: Any) -> Any:
    """dx = dgrad(dy, w), times act'(pre_act) when `activation_backward` is given."""
    request = ConvBwdDataRequest(dy, w, dx=dx, pre_act=pre_act, x_shape=x_shape, **conv_params)
    return run(request, stream=stream, session=session)


def conv_bwd_filter(x: Any, dy: Any, *, dw: Any = None, db: Any = None, w_shape: Any = None,
                    bias_grad: bool | None = None, stream: Any = None, session: Session | None = None,
                    **conv_params: Any) -> Any:
    """dw = wgrad(x, dy); returns (dw, db) when `db` or `bias_grad=True` is given."""
    request = ConvBwdFilterRequest(x, dy, dw=dw, db=db, w_shape=w_shape, bias_grad=bias_grad, **conv_params)
    return run(request, stream=stream, session=session)
