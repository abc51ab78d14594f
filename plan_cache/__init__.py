"""A persistent on-disk store of plan records: bytes + plain metadata in, out. Knows nothing of cuDNN or GPUs.

`PlanStore(root)` keeps each `PlanRecord` in its own self-checking file (see `plan_cache.record` for the
format), is safe for many processes at once, caps its size by evicting least recently used records, and treats
any corrupt or untrusted file as a miss. `RemoteStore(url, secret=)` shares signed records through Redis.
Kept separate from `cudnn_graphs` so it can be used and tested without
a GPU or the cuDNN frontend.
"""

from .bundle import CorruptBundleError, ImportReport, export_bundle, import_bundle
from .errors import CacheError, CorruptRecordError, UntrustedCacheError
from .record import FORMAT_VERSION, PlanRecord
from .remote import RemoteCacheError, RemoteStore, redact_url
from .store import PlanStore

__all__ = ["FORMAT_VERSION", "CacheError", "CorruptBundleError", "CorruptRecordError", "ImportReport", "PlanRecord",
           "PlanStore", "RemoteCacheError", "RemoteStore", "UntrustedCacheError", "export_bundle", "import_bundle",
           "redact_url"]
