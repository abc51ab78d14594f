"""The `cudnn-graphs` command line (`python -m cudnn_graphs` runs it too).

`commands.py`: the parser, `main` and the env / check commands; `cache.py`: `cudnn-graphs cache ...`;
`doctor.py`: `cudnn-graphs doctor`; `warmup.py`: `cudnn-graphs warmup` on one GPU, `warmup_devices.py`:
a worker process per GPU (`--devices`). Both warm-up modules plan through `warmup_plan.py`, and
`warmup_devices.py` never imports `warmup.py` (`tests/test_warmup.py` checks it).
"""

from .commands import main

__all__ = ["main"]
