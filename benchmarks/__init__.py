"""Benchmarks of cudnn-graphs against torch, run from the repository root as `python -m benchmarks.<name>`.

Each imports the installed package and measures through `benchmarks.harness`; README.md here says what
each measures, how to run it, and where its curated result per GPU model is (`results/<gpu>/<name>.json`).
"""
