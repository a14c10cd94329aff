"""torch.distributed (backend nccl) on tutti's libnccl.so.2, several processes on GPU 0: the
collectives a training loop uses, checked, and DDP whose parameters after 20 steps match a
1-process run. Run with LD_PRELOAD=<tutti>/libnccl.so.2; exits non-zero on any mismatch."""
import argparse
import os
import socket
import sys

import torch
import torch.distributed as dist
import torch.multiprocessing as mp


def free_port():
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def model():
    torch.manual_seed(0)
    return torch.nn.Sequential(torch.nn.Linear(16, 32), torch.nn.Tanh(), torch.nn.Linear(32, 4)).cuda()


def batches(steps, n, per_rank):
    g = torch.Generator().manual_seed(1)
    return [(torch.randn(n * per_rank, 16, generator=g), torch.randn(n * per_rank, 4, generator=g)) for _ in range(steps)]


def train(net, data, rank, n, per_rank):
    opt = torch.optim.SGD(net.parameters(), lr=0.1)
    for x, y in data:
        x = x[rank * per_rank:(rank + 1) * per_rank].cuda()
        y = y[rank * per_rank:(rank + 1) * per_rank].cuda()
        opt.zero_grad()
        torch.nn.functional.mse_loss(net(x), y).backward()
        opt.step()
    return [p.detach().cpu() for p in net.parameters()]


def worker(rank, n, port, q):
    torch.cuda.set_device(0)
    dist.init_process_group("nccl", init_method=f"tcp://127.0.0.1:{port}", rank=rank, world_size=n,
                            device_id=torch.device("cuda", 0))
    bad = []

    def expect(name, got, want):
        if not torch.equal(got.cpu(), want.cpu()):
            bad.append(name)

    dev = "cuda"
    x = torch.arange(1000, dtype=torch.float32, device=dev) + rank
    dist.all_reduce(x)
    expect("all_reduce", x, n * torch.arange(1000, dtype=torch.float32) + sum(range(n)))
    part = torch.full((257,), float(rank), device=dev)
    out = torch.empty(257 * n, device=dev)
    dist.all_gather_into_tensor(out, part)
    expect("all_gather_into_tensor", out, torch.arange(n).repeat_interleave(257).float())
    full = torch.arange(64 * n, dtype=torch.float32, device=dev)
    shard = torch.empty(64, device=dev)
    dist.reduce_scatter_tensor(shard, full)
    expect("reduce_scatter_tensor", shard, n * torch.arange(64 * rank, 64 * (rank + 1), dtype=torch.float32))
    b = torch.full((100,), float(rank), device=dev)
    dist.broadcast(b, src=n - 1)
    expect("broadcast", b, torch.full((100,), float(n - 1)))
    src = torch.arange(8 * n, dtype=torch.float32, device=dev) + 100 * rank
    dst = torch.empty_like(src)
    dist.all_to_all_single(dst, src)
    want = torch.cat([torch.arange(8 * rank, 8 * rank + 8, dtype=torch.float32) + 100 * q_ for q_ in range(n)])
    expect("all_to_all_single", dst, want)
    send = torch.full((4096,), float(rank), device=dev)
    recv = torch.empty(4096, device=dev)
    ops = [dist.P2POp(dist.isend, send, (rank + 1) % n), dist.P2POp(dist.irecv, recv, (rank - 1) % n)]
    for req in dist.batch_isend_irecv(ops):
        req.wait()
    expect("batch_isend_irecv", recv, torch.full((4096,), float((rank - 1) % n)))
    # DDP: 20 steps, each rank on its slice of the batch.
    net = torch.nn.parallel.DistributedDataParallel(model(), device_ids=[0])
    params = train(net, batches(20, n, 8), rank, n, 8)
    torch.cuda.synchronize()
    dist.destroy_process_group()
    q.put((rank, bad, params if rank == 0 else None))


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--nprocs", type=int, default=2)
    n = ap.parse_args().nprocs
    ctx = mp.get_context("spawn")
    q = ctx.Queue()
    port = free_port()
    procs = [ctx.Process(target=worker, args=(r, n, port, q)) for r in range(n)]
    for p in procs:
        p.start()
    results = [q.get(timeout=150) for _ in procs]
    for p in procs:
        p.join(timeout=30)
    failures = [f"rank {r}: {name}" for r, bad, _ in results for name in bad]
    ddp = next(p for r, _, p in results if r == 0)
    # The 1-process run: the whole batch on one GPU (DDP averages the ranks' gradients, which is
    # the gradient of the mean loss over the whole batch).
    ref = train(model(), batches(20, n, 8), 0, 1, 8 * n)
    worst = max((a - b).abs().max().item() for a, b in zip(ddp, ref))
    if worst > 1e-5:
        failures.append(f"DDP parameters differ from the 1-process run by {worst:g}")
    print(f"torch {torch.__version__}, {n} processes on GPU 0, nccl version {torch.cuda.nccl.version()}")
    print(f"DDP after 20 steps: largest difference from 1 process {worst:.3g}")
    for f in failures:
        print("FAILED", f)
    print("collectives and DDP:", "ok" if not failures else f"{len(failures)} failure(s)")
    sys.exit(1 if failures else 0)


if __name__ == "__main__":
    main()
