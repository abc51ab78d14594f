"""Probe (GPU host): can a finalized cuDNN variant pack be re-pointed, and does cuDNN copy its pointers?

  python3 tools/probe_variant_pack.py     # prints JSON: statuses and relative errors per variant

A plan loaded through the backend (execute/cudnn_backend.py) builds one variant pack per execute,
as the frontend does; this checks whether a pack could be kept and re-pointed instead.
"""
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
import ctypes, tempfile, json  # noqa: E402
import torch
import cudnn_graphs as cg
from cudnn_graphs.execute import cudnn_backend as cb
from cudnn_graphs.plan import resident

out = {}
tmp = tempfile.mkdtemp()
spec = cg.ConvFwdSpec((32, 128, 28, 28), (128, 128, 3, 3), padding=1, dtype="float16", layout="channels_last",
                      bias=True, activation="relu")
w = cg.Session(cache=tmp); w.plan(spec)
resident.forget()  # the reader loads from disk, as a fresh process would
r = cg.Session(cache=tmp); plan = r.plan(spec)
part = plan.parts[0]
out["loaded_by_backend"] = part.backend is not None
out["frontend_imported_before_build"] = "cudnn" in sys.modules
from tests import gpu_reference as ref
bufs = {k: ref.random(d) for k, d in spec.tensors().items() if k != "y"}
y1, y2 = ref.poisoned(spec.tensors()["y"]), ref.poisoned(spec.tensors()["y"])
stream = torch.cuda.current_stream().cuda_stream
h = r.handles.on_stream(stream)
_, scratch = plan._scratch_for(stream, "torch")
lib = cb.lib()
uids = part.backend_uids
from cudnn_graphs.graph import ROLE_UIDS
role_of = {v: k for k, v in ROLE_UIDS.items()}
def ptrs_for(y):
    d = dict(bufs, y=y)
    return [d[role_of[u]].data_ptr() for u in uids]
n = len(uids)
U = (ctypes.c_int64 * n)(*uids)
P = (ctypes.c_void_p * n)(*ptrs_for(y1))
ws = ctypes.c_void_p(scratch["workspace"] or None)
pack = ctypes.c_void_p()
st = [lib.cudnnBackendCreateDescriptor(16, ctypes.byref(pack)),
      lib.cudnnBackendSetAttribute(pack, 1000, 3, n, U),
      lib.cudnnBackendSetAttribute(pack, 1001, 6, n, P),
      lib.cudnnBackendSetAttribute(pack, 1003, 6, 1, ctypes.byref(ws)),
      lib.cudnnBackendFinalize(pack),
      lib.cudnnBackendExecute(h, part.backend.desc, pack)]
P2 = (ctypes.c_void_p * n)(*ptrs_for(y2))
st.append(lib.cudnnBackendSetAttribute(pack, 1001, 6, n, P2))
st.append(lib.cudnnBackendExecute(h, part.backend.desc, pack))
torch.cuda.synchronize()
want = ref.fwd(spec, dict(bufs, y=y1))
out["statuses"] = st
out["err_y1"] = ref.rel_err(y1, want); out["err_y2_after_repoint"] = ref.rel_err(y2, want)
# repoint by mutating the array in place after finalize (does the pack copy or reference the array?)
y3 = ref.poisoned(spec.tensors()["y"])
for i, p in enumerate(ptrs_for(y3)): P2[i] = p
st2 = lib.cudnnBackendExecute(h, part.backend.desc, pack)
torch.cuda.synchronize()
out["inplace_mutation_status"] = st2; out["err_y3_inplace"] = ref.rel_err(y3, want)
print(json.dumps(out))
