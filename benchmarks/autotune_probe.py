"""How long torch.compile(mode="max-autotune-no-cudagraphs") takes to compile GoogLeNet on a GPU, in a plain process
outside the GPU check (its float32 settings and inductor's freezing, as the check compiles), so that a slow compile in
the check can be told from one the check causes. On the GPU machine, with inductor's autotune lines timestamped:

    timeout 225 python3 benchmarks/autotune_probe.py 2>&1 | grep -E "compiled|benchmarking takes|eager|max-autotune"

docs/gpu_runs/2026-11-27-h200-autotune-probe.txt is its output on an H200 (docs/gpu.md)."""
import time

import torch
import torchvision
from torch._inductor import config

torch.backends.cudnn.allow_tf32 = False
torch.backends.cuda.matmul.allow_tf32 = False
config.freezing = True
t0 = time.perf_counter()
m = torchvision.models.googlenet(weights=None, aux_logits=False, init_weights=False).eval().cuda()
x = torch.randn(1, 3, 224, 224, device="cuda")
c = torch.compile(m, mode="max-autotune-no-cudagraphs")
with torch.inference_mode():
    y = c(x); torch.cuda.synchronize()
print(f"compiled in {time.perf_counter() - t0:.1f} s", flush=True)
with torch.inference_mode():
    ref = m(x)
    for f, name in ((m, "eager"), (c, "max-autotune")):
        for _ in range(10): f(x)
        torch.cuda.synchronize(); s = time.perf_counter()
        for _ in range(100): f(x)
        torch.cuda.synchronize(); print(name, f"{(time.perf_counter() - s) * 10:.3f} ms", flush=True)
    print("max abs diff", (y - ref).abs().max().item())
