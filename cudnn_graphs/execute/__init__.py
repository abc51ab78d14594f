"""Execution: buffers of any framework checked against a spec and launched on their stream."""
