"""The trainer's non-finite-gradient skip on a CUDA GPU (run on the H200 through the device tool):

1. ``_clip_and_step`` with an inf or NaN gradient, fused AdamW and plain: weights and step counts unchanged,
   and the next finite update equal in both paths;
2. A/B: one fused update with ``found_inf`` (the current code) against the same update without it (the code
   before), interleaved, CUDA events, medians.

    python3 bench/found_inf_gpu.py
"""
import statistics
import sys

import torch

sys.path.insert(0, ".")
from trainer import shadow  # noqa: E402
from trainer.step import _clip_and_step  # noqa: E402


def model():
    torch.manual_seed(0)
    return torch.nn.Sequential(torch.nn.Linear(1024, 4096), torch.nn.GELU(), torch.nn.Linear(4096, 1024)).cuda()


def check() -> None:
    for bad in (float("inf"), float("nan")):
        out = []
        for fused in (False, True):
            m = model()
            before = [p.detach().clone() for p in m.parameters()]
            opt = torch.optim.AdamW(m.parameters(), lr=1e-2, fused=fused)
            g = torch.Generator(device="cuda").manual_seed(1)
            for p in m.parameters():
                p.grad = torch.randn(p.shape, generator=g, device="cuda") * 0.01
            next(iter(m.parameters())).grad.view(-1)[0] = bad
            norm = float(_clip_and_step(m, opt, 1.0))
            same = all(torch.equal(a, b) for a, b in zip(before, m.parameters()))
            steps = [float(st.get("step", 0)) for st in opt.state.values()]
            for p in m.parameters():
                p.grad = torch.randn(p.shape, generator=g, device="cuda") * 0.01
            norm2 = float(_clip_and_step(m, opt, 1.0))
            steps2 = [float(st["step"]) for st in opt.state.values()]
            out.append([p.detach().clone() for p in m.parameters()])
            print(f"bad={bad} fused={fused}: norm {norm}, weights unchanged {same}, steps after skip {set(steps) or {0}}, "
                  f"next norm {norm2:.4f}, steps {set(steps2)}", flush=True)
            assert same and set(steps or [0]) == {0} and set(steps2) == {1}
        diff = max(float((a - b).abs().max()) for a, b in zip(*out))
        print(f"bad={bad}: fused vs plain after the finite update, max |diff| {diff:.2e}", flush=True)
        assert diff < 1e-5


def without_found_inf(model, optimizer, max_norm):
    """``_clip_and_step`` as it was before the skip: the same calls, without ``found_inf``."""
    shadow.collect_grads(model)
    params = [p for p in model.parameters() if p.grad is not None]
    limit = max_norm if max_norm > 0 else float("inf")
    fused = bool(optimizer.defaults.get("fused")) and not any(hasattr(p, "full_tensor") for p in params)
    assert fused
    norm = torch.nn.utils.get_total_norm([p.grad for p in params]).to(torch.float32)
    optimizer.grad_scale = torch.clamp((norm + 1e-6) / limit, min=1.0).reshape(1)
    try:
        optimizer.step()
    finally:
        optimizer.grad_scale = None
    shadow.refresh(model)
    return norm.detach().to(torch.float64).reshape(())


def ab() -> None:
    for size in (1024, 4096):
        torch.manual_seed(0)
        m = torch.nn.Sequential(*[torch.nn.Linear(size, size) for _ in range(8)]).cuda()
        n = sum(p.numel() for p in m.parameters())
        opt = torch.optim.AdamW(m.parameters(), lr=1e-4, fused=True)
        for p in m.parameters():
            p.grad = torch.randn_like(p) * 0.01
        fns = {"with found_inf": _clip_and_step, "without": without_found_inf}
        for f in fns.values():
            for _ in range(20):
                f(m, opt, 1.0)
        torch.cuda.synchronize()
        times = {k: [] for k in fns}
        for _ in range(10):
            for k, f in fns.items():
                for _ in range(30):
                    s = torch.cuda.Event(enable_timing=True); e = torch.cuda.Event(enable_timing=True)
                    s.record(); f(m, opt, 1.0); e.record(); torch.cuda.synchronize(); times[k].append(s.elapsed_time(e))
        med = {k: statistics.median(v) * 1000 for k, v in times.items()}
        print(f"{n/1e6:.1f}M params: " + ", ".join(f"{k} {v:.1f} us" for k, v in med.items())
              + f"; ratio {med['with found_inf'] / med['without']:.3f}", flush=True)


if __name__ == "__main__":
    check()
    ab()
    print(torch.__version__, torch.cuda.get_device_name(), flush=True)
