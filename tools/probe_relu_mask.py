"""Probe (GPU host): what cuBLASLt's RELU_AUX_BIAS writes: y against float64, the bit mask against y > 0 and
pre > 0 (little-endian bit order, rows of aux_ld bits), and whether it writes past m * aux_ld bits."""
import torch, json, numpy as np, sys
sys.path.insert(0, ".")
from cudnn_graphs.torch._mlp import _run
from fallback_kernels import cublaslt
torch.manual_seed(0)
for dt in (torch.float16, torch.bfloat16, torch.float32):
    name = {torch.float16: "float16", torch.bfloat16: "bfloat16", torch.float32: "float32"}[dt]
    for (m, k, n) in ((37, 32, 56), (64, 64, 128), (37, 29, 53)):
        a = torch.randn(m, k, device="cuda", dtype=dt)
        w = torch.randn(n, k, device="cuda", dtype=dt)
        b = torch.randn(n, device="cuda", dtype=dt)
        y = torch.full((m, n), float("nan"), device="cuda", dtype=dt)
        ld = cublaslt.relu_mask_ld(n)
        big = torch.full((m * ld // 32 + 4096,), 0x5A5A5A5A, device="cuda", dtype=torch.int32)
        _run(0, name, y, a, w, b_col=True, epilogue="RELU_AUX_BIAS", bias=b, aux=big, aux_ld=ld)
        torch.cuda.synchronize()
        pre = a.double() @ w.double().t() + b.double()
        ref = torch.relu(pre)
        err = float((y.double() - ref).norm() / ref.norm())
        used = m * ld // 32
        tail_ok = bool((big[used:] == 0x5A5A5A5A).all())
        words = big[:used].view(m, ld // 32).cpu().numpy().astype(np.uint32)
        bits = np.unpackbits(words.view(np.uint8), bitorder="little").reshape(m, ld)[:, :n]
        ypos = (y > 0).cpu().numpy()
        ppos = (pre > 0).cpu().numpy()
        print(json.dumps({"dtype": name, "shape": [m, k, n], "y_err": err, "tail_untouched": tail_ok,
                          "bits_vs_y_mismatch": int((bits != ypos).sum()), "bits_vs_pre_mismatch": int((bits != ppos).sum()),
                          "first_row_words": [hex(v) for v in words[0][:4]], "y_nan": int(torch.isnan(y).sum())}))
