"""Short questions for a lent GPU, one part per call (launch/gpu_probe.sh runs them under time limits).

    python -m launch.gpu_probe env          # versions, the inductor fma op, SDPA switches
    python -m launch.gpu_probe nccl         # can NCCL run 2 ranks on one CUDA device? (the error line)
    python -m launch.gpu_probe gloo         # every collective the comm layer uses, gloo, CUDA tensors, 2 ranks
    python -m launch.gpu_probe fsdp         # FSDP2 fully_shard + DCP save/load over gloo, 2 ranks on one device
    python -m launch.gpu_probe lion         # fused Lion step candidates vs the foreach kernels vs fused AdamW
    python -m launch.gpu_probe lionopt      # the optimizers' step as the trainer takes it (Lion eager / auto, AdamW)
    python -m launch.gpu_probe mfu --mb 12 [--mode M] [--sdpa B] [--profile] [--rope before]   # gpt2-124m fwd + bwd

Every result line starts with "PROBE" and the part's name, so the output of a whole run greps well.
A failing sub-check prints its first error line and the part goes on.
"""
from __future__ import annotations

import argparse
import datetime
import os
import socket
import sys
import tempfile
import time
import traceback

import torch

# LIONCUB_PROBE_DEVICE=cpu: a dry run of the parts' code on CPU (gloo, CPU tensors, wall-clock timing)
DEV = torch.device(os.environ.get("LIONCUB_PROBE_DEVICE", "cuda"))


def say(part: str, *msg) -> None:
    print(f"PROBE {part}:", *msg, flush=True)


def first_line(e: BaseException) -> str:
    lines = [ln.strip() for ln in str(e).splitlines() if ln.strip()]
    return f"{type(e).__name__}: {lines[0] if lines else ''}"[:400]


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


# ---- env -------------------------------------------------------------------------------------------
def part_env() -> None:
    say("env", "torch", torch.__version__, "cuda", torch.version.cuda, "available", torch.cuda.is_available())
    try:
        from importlib.metadata import version
        say("env", "triton", version("triton"))
    except Exception as e:  # noqa: BLE001
        say("env", "triton: not installed:", first_line(e))
    if torch.cuda.is_available():
        say("env", "device", torch.cuda.get_device_name(), "capability", torch.cuda.get_device_capability())
        say("env", "nccl", torch.cuda.nccl.version() if hasattr(torch.cuda, "nccl") else "?")
    try:
        from torch._inductor import inductor_prims  # noqa: F401  (registers prims.fma)
        say("env", "prims.fma:", torch.ops.prims.fma)
    except Exception as e:  # noqa: BLE001
        say("env", "prims.fma: missing:", first_line(e))
    import torch._inductor.config as ic
    say("env", "inductor has emulate_precision_casts:", hasattr(ic, "emulate_precision_casts"),
        "combo_kernels:", getattr(ic, "combo_kernels", "missing"))
    from torch._inductor import lowering
    say("env", "inductor lowers add-with-alpha to fma:", hasattr(lowering, "_add_with_alpha_fma"))
    b = torch.backends.cuda
    say("env", "sdpa enabled: flash", b.flash_sdp_enabled(), "mem_efficient", b.mem_efficient_sdp_enabled(),
        "cudnn", getattr(b, "cudnn_sdp_enabled", lambda: "n/a")(), "math", b.math_sdp_enabled())
    say("env", "dist backends: gloo", torch.distributed.is_gloo_available(), "nccl", torch.distributed.is_nccl_available())
    try:
        sys.path.insert(0, os.getcwd())
        from data.tokenizer import get_encoding
        say("env", "GPT-2 tokenizer (the built-in corpus needs it): ok,", get_encoding("gpt2").n_vocab, "ids")
    except Exception as e:  # noqa: BLE001
        say("env", "GPT-2 tokenizer: MISSING:", first_line(e))
    say("env", "python", sys.version.split()[0], "cpu cores", os.cpu_count())
    say("env", "has all_gather_single", hasattr(torch.distributed, "all_gather_single"),
        "all_gather_into_tensor", hasattr(torch.distributed, "all_gather_into_tensor"))


# ---- 2 ranks on one device ----------------------------------------------------------------------------
def _init(rank: int, world: int, port: int, backend: str) -> None:
    import torch.distributed as dist
    if DEV.type == "cuda":
        torch.cuda.set_device(0)
    kw = dict(backend=backend, init_method=f"tcp://127.0.0.1:{port}", rank=rank, world_size=world,
              timeout=datetime.timedelta(seconds=20))
    if backend == "nccl":
        kw["device_id"] = torch.device("cuda", 0)
    dist.init_process_group(**kw)


def _nccl_rank(rank: int, world: int, port: int) -> None:
    import torch.distributed as dist
    try:
        _init(rank, world, port, "nccl")
        t = torch.ones(4, device="cuda")
        dist.all_reduce(t)
        torch.cuda.synchronize()
        say("nccl", f"rank {rank}: all_reduce on one device WORKED: {t.tolist()}")
    except Exception as e:  # noqa: BLE001
        say("nccl", f"rank {rank}: refused: {first_line(e)}")
    finally:
        try:
            dist.destroy_process_group()
        except Exception:  # noqa: BLE001
            pass


def _gloo_rank(rank: int, world: int, port: int) -> None:
    import torch.distributed as dist
    _init(rank, world, port, "gloo")
    dev = torch.device("cuda", 0) if DEV.type == "cuda" else DEV
    ag = getattr(dist, "all_gather_single", None) or dist.all_gather_into_tensor
    rs = getattr(dist, "reduce_scatter_single", None) or dist.reduce_scatter_tensor
    results = []

    def check(name: str, fn) -> None:
        try:
            ok = fn()
            sync()
            results.append((name, "OK" if ok else "WRONG RESULT"))
        except Exception as e:  # noqa: BLE001
            results.append((name, "FAILED " + first_line(e)))

    def ar(dtype, op=dist.ReduceOp.SUM, async_op=False):
        def f():
            t = torch.full((1000,), rank + 1, dtype=dtype, device=dev)
            w = dist.all_reduce(t, op=op, async_op=async_op)
            if async_op:
                w.wait()
            want = 3 if op == dist.ReduceOp.SUM else 2
            return t.device.type == DEV.type and bool((t == want).all())
        return f

    for dt in (torch.float32, torch.bfloat16, torch.float64, torch.int32, torch.int64, torch.uint8, torch.int8):
        check(f"all_reduce SUM {dt}", ar(dt))
    check("all_reduce MAX int32", ar(torch.int32, dist.ReduceOp.MAX))
    check("all_reduce MAX float32", ar(torch.float32, dist.ReduceOp.MAX))
    check("all_reduce SUM float32 async_op + wait", ar(torch.float32, async_op=True))

    def f_ar_side_stream():
        s = torch.cuda.Stream()
        t = torch.full((1 << 20,), rank + 1.0, device=dev)
        s.wait_stream(torch.cuda.current_stream())
        with torch.cuda.stream(s):
            w = dist.all_reduce(t, async_op=True)
        w.wait()
        torch.cuda.current_stream().wait_stream(s)
        return bool((t == 3).all())
    if DEV.type == "cuda":
        check("all_reduce async on a side stream", f_ar_side_stream)

    for dt in (torch.uint8, torch.float32, torch.int32):
        def f_ag(dt=dt):
            x = torch.full((37,), rank + 1, dtype=dt, device=dev)
            out = torch.empty(74, dtype=dt, device=dev)
            ag(out, x)
            return bool((out[:37] == 1).all() and (out[37:] == 2).all())
        check(f"all_gather_into_tensor {dt}", f_ag)

    for dt in (torch.float32, torch.int32, torch.uint8):
        def f_rs(dt=dt):
            x = torch.arange(8, device=dev).to(dt)
            out = torch.empty(4, dtype=dt, device=dev)
            rs(out, x)
            want = (torch.arange(8, device=dev).to(dt) * 2)[rank * 4:rank * 4 + 4]
            return torch.equal(out, want)
        check(f"reduce_scatter_tensor SUM {dt}", f_rs)

    def f_a2a():
        x = torch.full((8,), rank + 1, dtype=torch.uint8, device=dev)
        out = torch.empty(8, dtype=torch.uint8, device=dev)
        dist.all_to_all_single(out, x)
        return bool((out[:4] == 1).all() and (out[4:] == 2).all())
    check("all_to_all_single uint8 even", f_a2a)

    def f_a2a_split():
        ins = [3, 5] if rank == 0 else [2, 6]
        x = torch.full((sum(ins),), rank + 1, dtype=torch.float32, device=dev)
        outs = [3, 2] if rank == 0 else [5, 6]
        out = torch.empty(sum(outs), device=dev)
        dist.all_to_all_single(out, x, output_split_sizes=outs, input_split_sizes=ins)
        return bool((out[:outs[0]] == 1).all() and (out[outs[0]:] == 2).all())
    check("all_to_all_single float32 split sizes", f_a2a_split)

    def f_ag_list():
        x = torch.full((5, 3), rank + 1.0, device=dev)
        outs = [torch.empty_like(x) for _ in range(world)]
        dist.all_gather(outs, x)
        return bool((outs[0] == 1).all() and (outs[1] == 2).all())
    check("all_gather (list) float32", f_ag_list)

    def f_bc():
        t = torch.full((9,), rank + 7.0, device=dev)
        dist.broadcast(t, src=0)
        return bool((t == 7).all())
    check("broadcast float32", f_bc)

    def f_sr():
        t = torch.full((11,), rank + 1.0, device=dev)
        if rank == 0:
            dist.send(t, dst=1)
            dist.recv(t, src=1)
        else:
            r = torch.empty_like(t)
            dist.recv(r, src=0)
            dist.send(r * 5, dst=0)
            t = r
        return bool((t == 5).all()) if rank == 0 else bool((t == 1).all())

    def f_isr():
        t = torch.full((13,), rank + 1.0, device=dev)
        r = torch.empty_like(t)
        ops = [dist.isend(t, dst=1 - rank), dist.irecv(r, src=1 - rank)]
        for w in ops:
            w.wait()
        return bool((r == 2 - rank).all())

    def f_obj():
        out = [None] * world
        dist.all_gather_object(out, {"r": rank})
        lst = [rank if rank == 0 else None]
        dist.broadcast_object_list(lst, src=0)
        return out == [{"r": 0}, {"r": 1}] and lst == [0]
    check("all_gather_object / broadcast_object_list", f_obj)
    check("barrier", lambda: dist.barrier() is None)
    # last: gloo's point-to-point calls refuse CUDA tensors and leave the pair broken
    check("send / recv float32", f_sr)
    check("isend / irecv float32", f_isr)
    if rank == 0:
        for name, res in results:
            say("gloo", f"{name}: {res}")
    try:
        dist.destroy_process_group()
    except Exception:  # noqa: BLE001  (a broken pair)
        pass


def _fsdp_rank(rank: int, world: int, port: int, out: str) -> None:
    import torch.distributed as dist
    import torch.distributed.checkpoint as dcp
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.fsdp import fully_shard
    _init(rank, world, port, "gloo")

    class Steps(list):  # printed as they happen (with the rank): a crash shows the last step reached
        def append(self, s):
            say("fsdp", f"rank {rank}: {s}")

    steps = Steps()
    try:
        mesh = init_device_mesh(DEV.type, (1, world), mesh_dim_names=("replicate", "shard"))
        steps.append(f"mesh ok ({mesh['shard'].size()} shard ranks)")
        torch.manual_seed(0)
        model = torch.nn.Sequential(torch.nn.Linear(64, 64), torch.nn.Linear(64, 8)).to(DEV)
        for m in model:
            fully_shard(m, mesh=mesh["shard"])
        fully_shard(model, mesh=mesh["shard"])
        x = torch.randn(4, 64, device=DEV) * (rank + 1)
        model(x).square().mean().backward()
        g = [p.grad.full_tensor() for p in model.parameters()]
        steps.append(f"fwd/bwd ok, grad norm {torch.stack([t.norm() for t in g]).norm().item():.4f}")
        sd = {k: v.detach().clone() for k, v in model.state_dict().items()}
        dcp.save(sd, storage_writer=dcp.FileSystemWriter(out))
        steps.append("dcp.save ok")
        for p in model.parameters():
            p.data.zero_()
        sd2 = model.state_dict()
        dcp.load(sd2, storage_reader=dcp.FileSystemReader(out))
        model.load_state_dict(sd2)
        same = all(torch.equal(a.full_tensor(), sd[k].full_tensor()) for k, a in model.state_dict().items())
        steps.append(f"dcp.load ok, restored equal: {same}")
    except Exception as e:  # noqa: BLE001
        steps.append("FAILED " + first_line(e))
        if rank == 0:
            traceback.print_exc(limit=4)
    dist.destroy_process_group()


def part_ranks(kind: str) -> None:
    import torch.multiprocessing as mp
    port = free_port()
    if kind == "nccl":
        mp.spawn(_nccl_rank, args=(2, port), nprocs=2, join=True)
    elif kind == "gloo":
        mp.spawn(_gloo_rank, args=(2, port), nprocs=2, join=True)
    else:
        with tempfile.TemporaryDirectory() as d:
            mp.spawn(_fsdp_rank, args=(2, port, d), nprocs=2, join=True)


# ---- fused Lion ---------------------------------------------------------------------------------------
def model_shapes(preset: str) -> list[tuple[int, ...]]:
    sys.path.insert(0, os.getcwd())
    from model import get_preset
    from model.gpt import GPT
    with torch.device("meta"):
        m = GPT(get_preset(preset))
    return [tuple(p.shape) for p in m.parameters()]


def sync() -> None:
    if DEV.type == "cuda":
        torch.cuda.synchronize()


def time_it(fn, reps: int = 20) -> float:
    """Median ms of `reps` calls after 3 warm-up calls: CUDA events on the GPU, wall clock on a CPU dry run."""
    if DEV.type != "cuda":
        fn()
        ts = []
        for _ in range(reps):
            t0 = time.perf_counter()
            fn()
            ts.append((time.perf_counter() - t0) * 1e3)
        return sorted(ts)[len(ts) // 2]
    for _ in range(3):
        fn()
    torch.cuda.synchronize()
    ev = [torch.cuda.Event(enable_timing=True) for _ in range(reps + 1)]
    ts = []
    for i in range(reps):
        ev[i].record()
        fn()
        ev[i + 1].record()
    torch.cuda.synchronize()
    ts = sorted(ev[i].elapsed_time(ev[i + 1]) for i in range(reps))
    return ts[len(ts) // 2]


def part_lion(only: str | None, preset: str) -> None:
    """optim.lion's fused step (FusedLionStep, each fma variant) against its reference, the foreach kernels
    (lion_group_step_), and fused AdamW on the preset's shapes: GPU time, host time per call, compile time,
    values that differ, a rerun's bytes; and a copy_ of the same size (a Lion pass moves 20 bytes/element)."""
    sys.path.insert(0, os.getcwd())
    from optim.lion import FMA_VARIANTS, FusedLionStep, lion_group_step_
    shapes = model_shapes(preset)
    n = sum(torch.Size(s).numel() for s in shapes)
    say("lion", f"{preset}: {len(shapes)} tensors, {n / 1e6:.1f}M parameters")
    gen = torch.Generator(device=DEV).manual_seed(0)
    P0 = [torch.randn(s, device=DEV, generator=gen) * 0.02 for s in shapes]
    G0 = [torch.randn(s, device=DEV, generator=gen) * 1e-3 for s in shapes]
    M0 = [torch.randn(s, device=DEV, generator=gen) * 1e-3 for s in shapes]
    for M in M0[:3]:  # some exact zeros
        M.view(-1)[:1000] = 0.0
    group = dict(lr=6e-5, weight_decay=1.0, betas=(0.9, 0.99))

    def fresh():
        ps = [torch.nn.Parameter(p.clone()) for p in P0]
        for p, g in zip(ps, G0):
            p.grad = g
        return ps, {p: {"exp_avg": m.clone()} for p, m in zip(ps, M0)}

    def flat(ps, st):
        return [p.detach() for p in ps] + [st[p]["exp_avg"] for p in ps]

    with torch.no_grad():
        ref_p, ref_s = fresh()
        lion_group_step_(ref_s, group, ref_p)
        ref = flat(ref_p, ref_s)
        pe, se = fresh()
        say("lion", f"foreach kernels (lion_group_step_): {time_it(lambda: lion_group_step_(se, group, pe)):.3f} ms/step")
        steps, last = {}, None  # graphed: optim.lion_cuda's CUDA-graph replay of the fma step (compiled already)
        for name in [*FMA_VARIANTS, "graphed"] if DEV.type == "cuda" else FMA_VARIANTS:
            if only and name not in only.split(","):
                continue
            try:
                if name == "graphed":
                    from optim.lion_cuda import GraphedLionStep
                    steps[name] = GraphedLionStep(steps.get("fma") or FusedLionStep(DEV))
                step, (ps, st) = steps.setdefault(name, FusedLionStep(DEV, name)), fresh()
                t0 = time.perf_counter()
                step(st, [(group, ps)])
                sync()
                tc = time.perf_counter() - t0
                k, got = len(ps), flat(ps, st)
                ndiff = [sum(int((a != b).sum()) for a, b in zip(got[h], ref[h])) for h in (slice(0, k), slice(k, None))]
                ps2, st2 = fresh()
                step(st2, [(group, ps2)])
                det = all(torch.equal(a, b) for a, b in zip(flat(ps, st), flat(ps2, st2)))
                t = time_it(lambda: step(st, [(group, ps)]))
                sync()
                h0 = time.perf_counter()
                for _ in range(10):
                    step(st, [(group, ps)])
                h, _ = (time.perf_counter() - h0) / 10 * 1e3, sync()
                same = last is None or all(torch.equal(a, b) for a, b in zip(flat(ps, st), last))
                last = flat(ps, st)  # every candidate took the same steps from the same state
                say("lion", f"{name}: {t:.3f} ms/step (GPU), host {h:.3f} ms/call, first call {tc:.1f} s, values "
                    f"differing from the foreach kernels (p+m halves) {ndiff}, rerun bit-identical {det}, "
                    f"after the same steps equal to the candidate before: {same}")
            except Exception as e:  # noqa: BLE001
                say("lion", f"{name}: FAILED {first_line(e)}")
    params = fresh()[0]
    say("lion", f"torch.optim.AdamW(fused=True): {time_it(torch.optim.AdamW(params, lr=6e-5, fused=True).step):.3f} ms/step")
    cp, src = torch.empty(n, device=DEV), torch.empty(n, device=DEV)
    say("lion", f"copy_ of {n / 1e6:.0f}M fp32 (8 bytes/element): {time_it(lambda: cp.copy_(src)):.3f} ms")


# ---- the optimizers' step as the trainer takes it --------------------------------------------------
def part_lionopt(preset: str, steps: int) -> None:
    """gpt2-124m's parameters in the trainer's groups (one per role), gradients in the flat buffer:
    optim.build_optimizer's Lion (comm.kernels eager = the foreach kernels, auto = the fused step) and
    AdamW, each step started on an idle GPU as in the trainer (it reads the loss first): CUDA-event time
    of opt.step(), host time of the call, CUDA kernels launched per step, and the recompiles dynamo logs."""
    import logging

    import torch._logging

    sys.path.insert(0, os.getcwd())
    import optim
    from model import get_preset
    from model.gpt import GPT
    from trainer.param_groups import param_groups

    torch._logging.set_logs(recompiles=True)
    logging.getLogger("torch._dynamo").setLevel(logging.WARNING)
    torch.manual_seed(0)
    model = GPT(get_preset(preset)).to(DEV)
    ocfg = argparse.Namespace(lr=6e-5, weight_decay=1.0, embedding_lr_mult=1.0, head_lr_mult=1.0, scalar_lr_mult=1.0)
    for name, kernels in (("lion", "eager"), ("lion", "auto"), ("adamw", "auto")):
        groups = param_groups(model, ocfg)
        opt = optim.build_optimizer(name, groups, betas=(0.9, 0.99), eps=1e-8, comm_mode="fp32", kernels=kernels,
                                    grad_clip=1.0, param_order=list(model.parameters()))
        for p in model.parameters():
            p.grad.normal_(0, 1e-3)
        t0 = time.perf_counter()
        opt.warmup()
        warm = time.perf_counter() - t0
        t0 = time.perf_counter()
        for _ in range(3):
            opt.step()
        sync()
        first = time.perf_counter() - t0
        ms, host = [], []
        for _ in range(steps):
            sync()
            cuda = DEV.type == "cuda"
            if cuda:
                a, b = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
                a.record()
            h0 = time.perf_counter()
            opt.step()
            host.append((time.perf_counter() - h0) * 1e3)
            if cuda:
                b.record()
                b.synchronize()
                ms.append(a.elapsed_time(b))
            else:
                ms.append(host[-1])
        from torch.profiler import ProfilerActivity, profile as prof
        n_kernels = 0
        if DEV.type == "cuda":
            with prof(activities=[ProfilerActivity.CUDA]) as pr:
                opt.step()
                sync()
            n_kernels = sum(e.count for e in pr.key_averages() if (getattr(e, "device_time_total", 0) or 0) > 0)
        say("lionopt", f"{name} comm.kernels={kernels}: step {sorted(ms)[len(ms) // 2]:.2f} ms (CUDA events, idle GPU "
            f"at start), host {sorted(host)[len(host) // 2]:.2f} ms, {n_kernels} CUDA kernels/step, warm-up {warm:.1f} s, "
            f"first 3 steps {first:.1f} s; {opt.kernel_choices()[-1:] if hasattr(opt, 'kernel_choices') else ''}")
        del opt


# ---- MFU ----------------------------------------------------------------------------------------------
def _attention_rope_before_transpose(self, x, rope, kv=None):
    """model.gpt.Attention.forward with the rotation applied on (B, T, nh, hd), before the transpose (the
    same values bit for bit on CPU; on an H100 forward + backward took 0.7 ms longer): `mfu --rope before`."""
    import torch.nn.functional as F
    B, T, C = x.shape
    hd, kvd = self.head_dim, self.n_kv_head * self.head_dim
    q, k, v = (t.view(B, T, -1, hd) for t in self.qkv(x).split([C, kvd, kvd], dim=2))  # (B, T, heads, hd)
    cos, sin = (t.to(q.dtype)[:, None, :] for t in rope)
    rot = lambda t: torch.cat((t.chunk(2, -1)[0] * cos - t.chunk(2, -1)[1] * sin,  # noqa: E731
                               t.chunk(2, -1)[0] * sin + t.chunk(2, -1)[1] * cos), dim=-1)
    q, k, v = rot(q).transpose(1, 2), rot(k).transpose(1, 2), v.transpose(1, 2)
    y = F.scaled_dot_product_attention(q, self._repeat_kv(k), self._repeat_kv(v), is_causal=True)
    return self.proj(y.transpose(1, 2).contiguous().view(B, T, C))


def _wait_for(path: str | None, limit_s: float = 240.0) -> None:
    """Block until `path` exists (another process's signal that the GPU is quiet), at most limit_s."""
    t0 = time.perf_counter()
    while path and not os.path.exists(path) and time.perf_counter() - t0 < limit_s: time.sleep(0.2)  # noqa: E701
    if path and not os.path.exists(path):
        say("mfu", f"waited {limit_s:.0f} s for {path}; timing anyway (the GPU may be shared)")


def part_mfu(mb: int, mode: str | None, sdpa: str | None, profile: bool, steps: int, preset: str,
             rope: str = "model", after: str | None = None) -> None:
    """Compile and warm up at once; time after the file `after` exists (so the compilation can overlap
    other work while the timing has the GPU to itself)."""
    sys.path.insert(0, os.getcwd())
    from model import get_preset
    from model.gpt import GPT, Attention
    dev = DEV
    if rope == "before":
        Attention.forward = _attention_rope_before_transpose
    torch.manual_seed(0)
    model = GPT(get_preset(preset)).to(dev)
    T = model.config.block_size
    fpt = model.flops_per_token(T)
    fwd = torch.compile(model, mode=mode) if mode != "eager" else model
    x = torch.randint(0, 50257, (mb, T), device=dev)
    y = torch.randint(0, 50257, (mb, T), device=dev)

    def step():
        if mode == "reduce-overhead":  # a new step for the CUDA graphs; no gradient accumulates across their runs
            torch.compiler.cudagraph_mark_step_begin()
            model.zero_grad(set_to_none=True)
        with torch.autocast(DEV.type, dtype=torch.bfloat16):
            _, loss = fwd(x, y)
        loss.backward()

    def run():
        if not sdpa:
            return step()
        from torch.nn.attention import SDPBackend, sdpa_kernel
        with sdpa_kernel(getattr(SDPBackend, sdpa)):
            step()
    t0 = time.perf_counter()
    run()
    run()
    sync()
    tc = time.perf_counter() - t0
    _wait_for(after)
    t = time_it(run, reps=steps)
    tok = mb * T / (t / 1e3)
    mfu = fpt * tok / 989e12
    peak = torch.cuda.max_memory_allocated() / 2**30 if DEV.type == "cuda" else 0.0
    label = f"mb={mb} mode={mode or 'default'} sdpa={sdpa or 'auto'} rope={rope}"
    say("mfu", f"{label}: fwd+bwd {t:.2f} ms, {tok:,.0f} tokens/s, MFU {100 * mfu:.1f} % (of 989 TFLOP/s), "
        f"compile+2 steps {tc:.1f} s, peak mem {peak:.1f} GiB")
    if profile:
        from torch.profiler import ProfilerActivity, profile as prof
        with prof(activities=[ProfilerActivity.CUDA if DEV.type == "cuda" else ProfilerActivity.CPU]) as pr:
            for _ in range(3):
                run()
            sync()
        rows = []
        for ev in pr.key_averages():
            ct = (getattr(ev, "device_time_total", None) or getattr(ev, "cuda_time_total", 0)) if DEV.type == "cuda" \
                else ev.self_cpu_time_total
            if ct:
                rows.append((ct / 3 / 1e3, ev.count // 3, ev.key))
        rows.sort(reverse=True)
        total = sum(r[0] for r in rows)
        say("mfu", f"{label}: CUDA kernel time per step {total:.2f} ms; top kernels (ms/step, calls/step):")
        attn = [r for r in rows if any(k in r[2].lower() for k in ("flash", "fmha", "cudnn", "attention", "sdpa"))]
        for ms, cnt, key in rows[:18]:
            say("mfu", f"   {ms:7.2f} ms  x{cnt:<4d} {key[:110]}")
        say("mfu", "attention kernels: " + "; ".join(f"{r[2][:80]} {r[0]:.2f} ms" for r in attn[:4]))
        groups = {"gemm": ("gemm", "sm90", "cutlass", "nvjet", "matmul", "xmma", "cublas"),
                  "attention": ("flash", "fmha", "cudnn", "attention"),
                  "triton (fused pointwise / reductions)": ("triton",)}
        for g, keys in groups.items():
            say("mfu", f"   group {g}: {sum(r[0] for r in rows if any(k in r[2].lower() for k in keys)):.2f} ms")


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("part", choices=["env", "nccl", "gloo", "fsdp", "lion", "lionopt", "mfu"])
    ap.add_argument("--mb", type=int, default=12)
    ap.add_argument("--mode", default=None)
    ap.add_argument("--sdpa", default=None, help="SDPBackend name: FLASH_ATTENTION, CUDNN_ATTENTION, EFFICIENT_ATTENTION")
    ap.add_argument("--profile", action="store_true")
    ap.add_argument("--steps", type=int, default=10)
    ap.add_argument("--only", default=None)
    ap.add_argument("--preset", default="gpt2-124m", help="model preset (a small one for a CPU dry run)")
    ap.add_argument("--rope", choices=["model", "before"], default="model",
                    help="mfu: before = the rotation on (B, T, nh, hd) ahead of the transpose instead of the model's")
    ap.add_argument("--after", default=None, help="mfu: compile first, time once this file exists")
    ap.add_argument("--done", default=None, help="write this file when the part ends (ok or not)")
    a = ap.parse_args()
    if a.part != "env" and DEV.type == "cuda" and not torch.cuda.is_available():
        print(f"gpu_probe {a.part}: needs a CUDA GPU (torch.cuda.is_available() is False)", file=sys.stderr)
        sys.exit(2)
    try:
        run_part(a)
    finally:
        if a.done:
            open(a.done, "w").close()


def run_part(a: argparse.Namespace) -> None:
    if a.part == "env":
        part_env()
    elif a.part in ("nccl", "gloo", "fsdp"):
        part_ranks(a.part)
    elif a.part == "lion":
        part_lion(a.only, a.preset)
    elif a.part == "lionopt":
        part_lionopt(a.preset, a.steps)
    else:
        part_mfu(a.mb, a.mode, a.sdpa, a.profile, a.steps, a.preset, a.rope, a.after)


if __name__ == "__main__":
    main()
