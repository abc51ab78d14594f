"""Storage of plan records: bytes + metadata in, out. Knows nothing of cuDNN.

The record format, the store and eviction arrive with the persistent-cache work; this package is
kept separate so it can be used (and tested) without a GPU or the cuDNN frontend.
"""
