"""One command for whoever has a GPU: what CI, on CPUs, has never run, run on one CUDA device, in one table.

    python benchmarks/gpu_check.py --json gpu_check.json    # on a CUDA machine (planned for under 10 min on one H100)
    python benchmarks/gpu_check.py --dry-run                 # prints the parts, their commands and time limits
    python benchmarks/gpu_check.py --smoke                   # every part at tiny sizes on CPU tensors, under Triton's
                                                             # interpreter: proves the script, measures nothing

The parts, each in a process of its own with its own time limit (a hang or crash in one leaves the others' results):
  kernel-tests   tests/test_triton_attention.py and tests/test_kernel_guard.py, natively: the compiled Triton kernels on
                 CUDA tensors against the blocked PyTorch path (forward and every gradient, masks, GQA, ranks, dtypes),
                 the custom operators and a compiled step, the self-check's tests;
  guard          the self-check of fiber_attention_kernel="auto" (``fused_attention.check_kernel``, training:
                 forward and backward) on every kernel dtype at r in {1, 2, 4} and head_dim in {64, 128} (GQA group 3,
                 factors shared, a padded boolean mask), and on every mask kind at one of them: the largest error over
                 its tolerance, and what one check costs, the first time (Triton compiles the kernels) and again;
  bench-kernel   benchmarks/bench_kernel.py: the kernel against F.scaled_dot_product_attention's flash path (TFLOP/s
                 counting the r + 1 query-key products), its JSON beside this script's;
  compiled-step  a converted model (SmolLM2-135M's layer shape, 4 of its 30 layers, LLaMA weights loaded by the
                 conversion's identity map, geometry awake) in bfloat16, one training step under
                 torch.compile(fullgraph=True) (inductor): one graph, the loss of the eager step, the kernel chosen by
                 "auto" after its self-check; compile time and step times against the eager step on either kernel;
  bf16-spd       the metric G = I + alpha U U^T and the MLP's Woodbury system from bfloat16 / float16 values on the GPU:
                 G's smallest eigenvalue > 0 down to the gate floor, the MLP step finite.

Where the GPU machine's transformers is older than this project needs (>= 5.24), install a wheel of one first, for
example `pip install --no-deps --target DIR transformers-5.25.0-py3-none-any.whl && export PYTHONPATH=DIR`. The project
itself need not be installed: its folders are put on the path (``project_path``).
"""

import argparse
import json
import os
import platform
import shutil
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
SMOKE = "--smoke" in sys.argv
if SMOKE:  # Triton reads this when the kernels are defined, i.e. when the model package is first imported
    os.environ.setdefault("TRITON_INTERPRET", "1")

# name: (time limit in seconds, what the part checks). The limits add up to 9 min 30 s.
PARTS = {
    "kernel-tests": (150, "the kernel's and the guard's tests, compiled on CUDA"),
    "guard": (120, "self-check: dtypes x r x head_dim, every mask kind"),
    "bench-kernel": (150, "bench_kernel.py against SDPA's flash path"),
    "compiled-step": (120, "compiled training step of a converted model (bf16)"),
    "bf16-spd": (30, "the metric SPD from bf16 / fp16 values"),
}
KERNEL_TESTS = ["tests/test_triton_attention.py", "tests/test_kernel_guard.py"]
BENCH_LENGTHS = [2048, 8192]
GUARD_RANKS, GUARD_HEAD_DIMS = [1, 2, 4], [64, 128]
# SmolLM2-135M's layer shape, 4 layers: the compiled step's model
STEP_LAYERS, STEP_BATCH, STEP_TOKENS = 4, 4, 1024


def project_path() -> str:
    """PYTHONPATH entries that import this project without installing it: the repository root (modeling_fiber_bundle)
    and, where ``fiber_bundle`` is not installed, a folder holding a ``fiber_bundle`` package of links to the
    project's folders (as pyproject's package-dir maps them)."""
    entries = [str(ROOT)]
    try:
        import fiber_bundle.conversion  # noqa: F401
    except ImportError:
        shim = Path(tempfile.mkdtemp(prefix="fiber_bundle_path_"))
        (shim / "fiber_bundle").mkdir()
        (shim / "fiber_bundle" / "__init__.py").write_text("")
        for name in ("cli", "conversion", "model_cards", "training", "analysis"):
            (shim / "fiber_bundle" / name).symlink_to(ROOT / name, target_is_directory=True)
        entries.append(str(shim))
    return os.pathsep.join([*entries, *filter(None, [os.environ.get("PYTHONPATH")])])


# ---------------------------------------------------------------------------------------------------------------------
# the parts (each run as `gpu_check.py --part NAME --result PATH`, in a process of its own)
# ---------------------------------------------------------------------------------------------------------------------
def device():
    import torch

    if SMOKE:
        return torch.device("cpu")
    if not torch.cuda.is_available():
        raise SystemExit("No CUDA device here: run with --smoke (CPU, Triton's interpreter) or --dry-run.")
    return torch.device("cuda")


def part_kernel_tests(result: Path) -> dict:
    selection = ["-k", "signatures_are_read or random_state or triton_skips"] if SMOKE else []
    command = [sys.executable, "-m", "pytest", *KERNEL_TESTS, "-q", "-p", "no:cacheprovider", "-m", "not heavy",
               *selection]
    run = subprocess.run(command, cwd=ROOT, capture_output=True, text=True)
    last = (run.stdout.strip().splitlines() or ["(no output)"])[-1]
    (result.parent / "kernel_tests.log").write_text(run.stdout + run.stderr)
    return {"ok": run.returncode == 0, "summary": last.strip("= "), "command": " ".join(command[1:])}


def part_guard(result: Path) -> dict:
    import torch

    from modeling_fiber_bundle import fused_attention
    from modeling_fiber_bundle.fused_attention import KERNEL_DTYPES, KernelSignature, check_kernel, kernel_tolerances

    dev = device()
    capability = torch.cuda.get_device_capability(dev) if dev.type == "cuda" else None
    ranks, head_dims, tokens = (GUARD_RANKS, GUARD_HEAD_DIMS, fused_attention.SELF_CHECK_TOKENS)
    if SMOKE:
        ranks, head_dims, tokens = [1, 2], [16], 40
    cases = [(dtype, r, d, "boolean") for dtype in KERNEL_DTYPES for r in ranks for d in head_dims]
    cases += [(torch.bfloat16, 2, head_dims[-1], mask) for mask in fused_attention.MASK_KINDS if mask != "boolean"]
    rows = []
    for dtype, r, d, mask in cases:
        signature = KernelSignature(dev.type, capability, dtype, r, d, 3, True, mask, True)
        row = {"dtype": str(dtype).removeprefix("torch."), "r": r, "head_dim": d, "mask": mask}
        try:
            times = []
            for _ in range(2):  # the first includes Triton's compilation of the kernels for this signature
                if dev.type == "cuda":
                    torch.cuda.synchronize()
                started = time.perf_counter()
                errors = check_kernel(signature, dev, tokens)
                if dev.type == "cuda":
                    torch.cuda.synchronize()
                times.append(time.perf_counter() - started)
            tolerances = kernel_tolerances(dtype, d)
            worst = max(errors, key=lambda name: errors[name] / tolerances[name])
            row.update(ok=all(errors[n] <= tolerances[n] for n in errors), worst=worst, error=errors[worst],
                       error_over_tolerance=errors[worst] / tolerances[worst], first_s=times[0], again_s=times[1])
        except Exception as exc:  # noqa: BLE001  reported, not raised: the other signatures still run
            row.update(ok=False, error=f"{type(exc).__name__}: {' '.join(str(exc).split())[:300]}")
        rows.append(row)
        print(json.dumps(row), flush=True)
    passed = sum(row["ok"] for row in rows)
    timed = [row for row in rows if "again_s" in row]
    summary = f"{passed}/{len(rows)} signatures pass"
    if timed:
        worst = max(timed, key=lambda row: row["error_over_tolerance"])
        summary += (f"; worst error {worst['error_over_tolerance']:.2f} x tolerance ({worst['dtype']}, r={worst['r']}, "
                    f"d={worst['head_dim']}, {worst['worst']}); one check: median "
                    f"{statistics.median(row['first_s'] for row in timed):.2f} s the first time, "
                    f"{statistics.median(row['again_s'] for row in timed) * 1e3:.0f} ms again")
    return {"ok": passed == len(rows), "summary": summary, "tokens": tokens, "signatures": rows}


def part_bench_kernel(result: Path) -> dict:
    out = result.parent / "bench_kernel.json"
    args = ["--smoke"] if SMOKE else ["--lengths", *map(str, BENCH_LENGTHS)]
    command = [sys.executable, str(ROOT / "benchmarks" / "bench_kernel.py"), *args, "--json", str(out)]
    run = subprocess.run(command, cwd=ROOT, capture_output=True, text=True)
    (result.parent / "bench_kernel.log").write_text(run.stdout + run.stderr)
    if run.returncode != 0 or not out.exists():
        return {"ok": False, "summary": f"exit {run.returncode}: {run.stderr.strip()[-300:]}"}
    data = json.loads(out.read_text())
    ratios = {}
    for row in data["results"]:
        if row["kind"] == "geodesic":
            ratios.setdefault(row["mode"], []).append(row["vs_flash"])
    lengths = ", ".join(str(n) for n in sorted({row["n"] for row in data["results"]}))
    summary = "; ".join(f"{mode}: {min(v):.2f}-{max(v):.2f} x flash's TFLOP/s" for mode, v in ratios.items())
    return {"ok": True, "summary": f"{summary} (n = {lengths})", "json": out.name, "results": data["results"]}


def step_model(dev, dtype):
    """The compiled step's model: SmolLM2's layer shape (QUICK_SHAPE in a smoke run), LLaMA weights mapped as the
    conversion maps them, geometry awake (benchmarks/common.py)."""
    sys.path.insert(0, str(ROOT / "benchmarks"))
    import common

    shape = common.QUICK_SHAPE if SMOKE else dict(common.FULL_SHAPE, num_hidden_layers=STEP_LAYERS)
    model = common.build_fiber(shape, rank=2, backbone=common.build_backbone(shape))
    return model.to(dev, dtype).train(), shape


def part_compiled_step(result: Path) -> dict:
    import torch
    from torch._dynamo.testing import CompileCounterWithBackend

    from modeling_fiber_bundle import fused_attention

    dev = device()
    dtype = torch.float32 if SMOKE else torch.bfloat16
    if SMOKE:  # the interpreter stands in for the GPU: "auto" may pick the kernel on CPU tensors
        fused_attention.auto_device = lambda query: True
    model, shape = step_model(dev, dtype)
    batch, tokens = (2, 32) if SMOKE else (STEP_BATCH, STEP_TOKENS)
    ids = torch.randint(3, shape["vocab_size"], (batch, tokens), generator=torch.Generator().manual_seed(0)).to(dev)

    def sync():
        if dev.type == "cuda":
            torch.cuda.synchronize()

    def step(fn):
        """Loss of one forward+backward (no optimiser step: every call sees the same weights), and its time."""
        model.zero_grad(set_to_none=True)
        sync()
        started = time.perf_counter()
        loss = fn(input_ids=ids, labels=ids).loss
        loss.backward()
        sync()
        return loss.detach().float().item(), time.perf_counter() - started

    eager = {}
    for kernel in ("pytorch", "auto"):
        model.config.fiber_attention_kernel = kernel
        step(model)  # warm-up (and, under "auto", the self-check)
        eager[kernel] = [step(model) for _ in range(3)]
    counter = CompileCounterWithBackend("aot_eager" if SMOKE else "inductor")
    compiled = torch.compile(model, fullgraph=True, backend=counter)
    first_loss, compile_s = step(compiled)
    steady = [step(compiled) for _ in range(3)]
    loss_eager = eager["auto"][0][0]
    relative = abs(first_loss - loss_eager) / abs(loss_eager)
    chosen = {str(s.training): v for s, v in fused_attention._verdicts.items()}
    kernel_used = any(fused_attention._verdicts.values())
    ms = {k: statistics.median(t for _, t in v) * 1e3 for k, v in eager.items()}
    ms["compiled"] = statistics.median(t for _, t in steady) * 1e3
    ok = counter.frame_count == 1 and relative <= (1e-2 if dtype == torch.bfloat16 else 1e-5) and kernel_used
    summary = (f"{counter.frame_count} graph, loss {first_loss:.4f} vs eager {loss_eager:.4f} (rel {relative:.1e}), "
               f"kernel {'used' if kernel_used else 'NOT used'}; step {ms['compiled']:.0f} ms compiled, eager "
               f"{ms['auto']:.0f} ms on the kernel / {ms['pytorch']:.0f} ms blocked; compile {compile_s:.0f} s")
    return {"ok": ok, "summary": summary, "graphs": counter.frame_count, "loss_compiled": first_loss,
            "loss_eager": loss_eager, "step_ms": ms, "compile_s": compile_s, "verdicts": chosen,
            "shape": {"layers": shape["num_hidden_layers"], "batch": batch, "tokens": tokens,
                      "dtype": str(dtype).removeprefix("torch.")}}


def part_bf16_spd(result: Path) -> dict:
    import torch

    from modeling_fiber_bundle.fiber_attention import (
        GATE_FLOOR,
        bounded_factors,
        metric_gate,
        metric_gram,
        rotate_factors,
        woodbury_precondition,
    )

    dev = device()
    gen = torch.Generator().manual_seed(3)
    rows, smallest_seen = [], float("inf")
    for dtype in (torch.bfloat16, torch.float16):
        for raw_scale in (1e-3, 1.0, 1e2, 1e4):
            raw = (raw_scale * torch.randn(4, 8, 64, 3, 64, generator=gen, dtype=torch.float64)).to(dev, dtype)
            factors = bounded_factors(raw)
            angle = (100.0 * torch.rand(4, 64, 32, generator=gen)).to(dev)
            cos = torch.cat([angle.cos()] * 2, -1).to(factors.dtype)
            sin = torch.cat([angle.sin()] * 2, -1).to(factors.dtype)
            factors = rotate_factors(factors, cos, sin)
            sigma_sq = torch.linalg.eigvalsh(metric_gram(factors.double())).amax(-1)
            theta = torch.tensor([-30.0, -20.0, -7.0, -5.0, -0.5, 0.0, 0.5, 3.0], dtype=dtype, device=dev)
            alpha = metric_gate(theta)
            smallest = (1.0 + alpha.double().view(1, -1, 1) * sigma_sq).min().item()  # G's smallest eigenvalue
            update = torch.randn(4, 8, 64, 64, generator=gen, dtype=torch.float64).to(dev, dtype)
            step = woodbury_precondition(update, factors, metric_gate(torch.tensor(-20.0, dtype=dtype, device=dev)))
            ok = (smallest > 1e-5 and sigma_sq.max().item() < 1 + 1e-6 and bool((alpha >= GATE_FLOOR).all())
                  and bool(torch.isfinite(step).all()))
            smallest_seen = min(smallest_seen, smallest)
            rows.append({"dtype": str(dtype).removeprefix("torch."), "raw_scale": raw_scale, "ok": ok,
                         "smallest_eigenvalue": smallest, "largest_sigma_sq": sigma_sq.max().item()})
    passed = sum(row["ok"] for row in rows)
    return {"ok": passed == len(rows), "rows": rows,
            "summary": f"{passed}/{len(rows)} cases SPD and finite; smallest eigenvalue of G {smallest_seen:.2e}"}


PART_FUNCTIONS = {"kernel-tests": part_kernel_tests, "guard": part_guard, "bench-kernel": part_bench_kernel,
                  "compiled-step": part_compiled_step, "bf16-spd": part_bf16_spd}


# ---------------------------------------------------------------------------------------------------------------------
# the driver
# ---------------------------------------------------------------------------------------------------------------------
def environment() -> dict:
    import torch

    env = {"date": time.strftime("%Y-%m-%d"), "python": platform.python_version(), "torch": torch.__version__,
           "smoke": SMOKE, "cuda": torch.version.cuda, "command": " ".join(["benchmarks/gpu_check.py", *sys.argv[1:]])}
    for name in ("triton", "transformers"):
        try:
            env[name] = __import__(name).__version__
        except ImportError:
            env[name] = None
    if torch.cuda.is_available():
        env["device"] = torch.cuda.get_device_name()
        env["capability"] = ".".join(map(str, torch.cuda.get_device_capability()))
    if shutil.which("nvidia-smi"):
        query = "--query-gpu=name,driver_version,memory.total"
        smi = subprocess.run(["nvidia-smi", query, "--format=csv,noheader"], capture_output=True, text=True)
        env["nvidia_smi"] = smi.stdout.strip()
    return env


def plan(name: str) -> str:
    """What a part runs, in a line (``--dry-run``)."""
    if name == "kernel-tests":
        return f"python -m pytest {' '.join(KERNEL_TESTS)} -q -m 'not heavy' (on CUDA tensors)"
    if name == "guard":
        cases = 3 * len(GUARD_RANKS) * len(GUARD_HEAD_DIMS)
        return (f"check_kernel, training, twice each, on {cases} signatures (float16 / bfloat16 / float32 x r "
                f"{GUARD_RANKS} x head_dim {GUARD_HEAD_DIMS}, GQA group 3, shared factors, padded boolean mask) and 3 "
                "more (bfloat16, r=2, head_dim 128, masks causal / none / float)")
    if name == "bench-kernel":
        lengths = " ".join(map(str, BENCH_LENGTHS))
        return f"python benchmarks/bench_kernel.py --lengths {lengths} --json bench_kernel.json"
    if name == "compiled-step":
        return (f"SmolLM2 shape, {STEP_LAYERS} layers, bfloat16, batch {STEP_BATCH} x {STEP_TOKENS} tokens: 3 eager "
                "forward+backward steps on each kernel ('pytorch', 'auto'), then torch.compile(fullgraph=True, "
                "inductor) and 4 steps")
    return "bounded_factors / metric_gate / woodbury_precondition from bf16 and fp16 values, 4 scales each"


def part_command(name: str, result: Path) -> list[str]:
    return [sys.executable, str(Path(__file__).resolve()), "--part", name, "--result", str(result),
            *(["--smoke"] if SMOKE else [])]


def run_part(name: str, workdir: Path, pythonpath: str) -> dict:
    limit = PARTS[name][0] * (4 if SMOKE else 1)  # the interpreter is slow; the smoke run measures nothing
    result = workdir / f"{name}.json"
    started = time.perf_counter()
    try:
        run = subprocess.run(part_command(name, result), cwd=ROOT, capture_output=True, text=True, timeout=limit,
                             env={**os.environ, "PYTHONPATH": pythonpath})
    except subprocess.TimeoutExpired as timeout:
        tail = (timeout.stderr or b"")[-300:]
        return {"ok": False, "summary": f"timed out after {limit} s {tail!r}", "seconds": limit}
    seconds = time.perf_counter() - started
    (workdir / f"{name}.log").write_text(run.stdout + run.stderr)
    if run.returncode != 0 or not result.exists():
        error = (run.stderr.strip().splitlines() or ["(no error output)"])[-1]
        return {"ok": False, "summary": f"exit {run.returncode}: {error[:300]}", "seconds": seconds}
    return {**json.loads(result.read_text()), "seconds": seconds}


def table(results: dict) -> str:
    lines = ["| part | checks | result | s |", "|---|---|---|---|"]
    for name, res in results.items():
        verdict = ("pass" if res["ok"] else "FAIL") + f": {res['summary']}"
        lines.append(f"| {name} | {PARTS[name][1]} | {verdict} | {res['seconds']:.0f} |")
    if SMOKE:
        lines.append("\n(smoke run: CPU tensors under Triton's interpreter, tiny sizes; no figure means anything)")
    return "\n".join(lines)


def parse_args(argv=None):
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0],
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--json", metavar="PATH", help="write the environment, every part's result and the table here")
    parser.add_argument("--only", nargs="+", choices=list(PARTS), metavar="PART",
                        help=f"run only these parts (default: all, in order: {', '.join(PARTS)})")
    parser.add_argument("--dry-run", action="store_true",
                        help="print each part's command and time limit, run nothing")
    parser.add_argument("--smoke", action="store_true",
                        help="every part at tiny sizes on CPU tensors under Triton's interpreter (TRITON_INTERPRET=1): "
                             "proves the script end to end without a GPU; its figures mean nothing")
    parser.add_argument("--part", choices=list(PARTS), help=argparse.SUPPRESS)  # internal: run one part here
    parser.add_argument("--result", type=Path, help=argparse.SUPPRESS)
    return parser.parse_args(argv)


def main(argv=None):
    args = parse_args(argv)
    if args.part:  # one part, in this process
        result = PART_FUNCTIONS[args.part](args.result)
        args.result.write_text(json.dumps(result, indent=2, default=str))
        return
    names = args.only or list(PARTS)
    if args.dry_run:
        print(f"benchmarks/gpu_check.py would run {len(names)} parts, each in its own process "
              f"(limits add up to {sum(PARTS[n][0] for n in names)} s):")
        for name in names:
            limit, what = PARTS[name]
            command = " ".join(part_command(name, Path("<workdir>") / f"{name}.json"))
            print(f"  {name} ({what}; limit {limit} s)\n      runs: {plan(name)}\n      as:   {command}")
        return
    env = environment()
    print(json.dumps(env), flush=True)
    pythonpath = project_path()
    workdir = Path(tempfile.mkdtemp(prefix="gpu_check_")) if not args.json else Path(args.json).resolve().parent
    workdir.mkdir(parents=True, exist_ok=True)
    results = {}
    for name in names:
        print(f"--- {name} (limit {PARTS[name][0]} s)", flush=True)
        results[name] = run_part(name, workdir, pythonpath)
        print(f"    {'pass' if results[name]['ok'] else 'FAIL'}: {results[name]['summary']}", flush=True)
    report = table(results)
    print(report)
    if args.json:
        Path(args.json).write_text(json.dumps({"environment": env, "results": results, "table": report}, indent=2,
                                              default=str))
        print(f"\nwrote {args.json} (logs beside it: {workdir})")
    sys.exit(0 if all(res["ok"] for res in results.values()) else 1)


if __name__ == "__main__":
    main()
