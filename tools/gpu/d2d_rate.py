"""Device-to-device copy rate of this GPU (bytes read + written per second), the memory bound the
device benchmarks are measured against (docs/PERFORMANCE.md)."""
import torch

n = 1 << 30  # 1 GiB each way: far beyond the L2
a = torch.empty(n, dtype=torch.uint8, device="cuda")
b = torch.empty_like(a)
for _ in range(3):
    b.copy_(a)
start, stop = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
reps = 20
start.record()
for _ in range(reps):
    b.copy_(a)
stop.record()
torch.cuda.synchronize()
ms = start.elapsed_time(stop) / reps
print(f"d2d copy: {n / 2**20:.0f} MiB in {ms * 1000:.1f} us: {2 * n / (ms * 1e-3) / 1e9:.0f} GB/s (read + write)")
