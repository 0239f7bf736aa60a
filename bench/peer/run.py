"""llama.cpp's hybrid CPU/GPU experts beside bench/hybrid.py, in one command on the GPU machine.

It builds llama-bench from .peer/llama.cpp (CUDA, sm_90, llama-bench target only), writes random GGUFs of
bench/hybrid.py's shapes (full depth, or PEER_LAYERS' first N layers) with Q4_0 experts (gpt-oss-120b: MXFP4 as
shipped; no GGUF of its deepseek shapes), and on request (PEER_SHAPES=gpt-oss-20b) GPT-OSS-20B as shipped (arch
gpt-oss, MXFP4 experts) (bench/peer/make_gguf.py; in the background while the build runs) and runs tg and pp at
batch 1 per shape, llama-bench -ngl 99 -t <physical cores> -r <reps>, in the columns of bench/hybrid.py:
  hybrid           --n-cpu-moe N: the first N layers' experts on the CPU, N the fewest such that the dense part, the KV
                   cache for pp+tg tokens and the resident layers' experts fit budget * (1 - WORKSPACE_SHARE), counted
                   in llama.cpp's bytes (the GGUF's Q8_0/F32 dense tensors and Q4_0/MXFP4 experts, f16 KV); the
                   budget is bench/hybrid.py's, or PEER_BUDGETS' for a shape it lacks (gpt-oss-20b: 8 GiB)
  hybrid-moeserve  --n-cpu-moe N with N of bench/hybrid.py's hybrid column (moeserve's bf16 dense part and KV, 4-bit
                   or MXFP4 experts: the same layers on the CPU as moeserve); run when it differs from the one above, and only
                   for shapes bench/hybrid.py has (for gpt-oss-20b, until it has one, PEER_N_CPU_MOE=gpt-oss-20b=N
                   runs the hybrid column at moeserve's N)
  cpu              -ot exps=CPU: every layer's experts on the CPU
PEER_LAYERS=shape=N (as bench/hybrid.py --layers N): the GGUF holds the shape's first N layers, the budget is
bench/hybrid.py's at that depth (budget_at: the same share of MoE layers resident), and each row also reports its
tok/s scaled to full depth, "scaled from N of L layers" (a token's time per layer as measured, times L).
summary.md/summary.json (with the GPU's peak memory per run, the GPU, the CPU, both commits and the newest moeserve
hybrid result beside) and env.txt go to $OUT; each run's llama-bench JSON, log and memory samples and the build logs
are packed into $OUT/details.tar.gz.

State lives in the work dir (source copy, build, GGUFs, finished runs): a call cut off by its time budget resumes
the build and skips finished runs when the same command runs again on the same machine (exit status 3 says so).

    MOESERVE_GIT_COMMIT=<commit> python bench/peer/run.py                       # GPU machine, results in $OUT
    MOESERVE_GIT_COMMIT=<commit> PEER_SHAPES=gpt-oss-20b python bench/peer/run.py  # GPT-OSS-20B, MXFP4 experts
    MOESERVE_GIT_COMMIT=<commit> PEER_SHAPES=qwen3-235b PEER_LAYERS=qwen3-235b=8 python bench/peer/run.py
    PEER_CPU_ONLY=1 PEER_SHAPES=tiny-qwen3,tiny-mixtral,tiny-gpt-oss python bench/peer/run.py  # CPU build, tiny

Knobs (environment): PEER_SHAPES (mixtral,qwen3; also qwen3-235b, gpt-oss-120b, gpt-oss-20b and the tiny-* ones),
PEER_LAYERS (shape=N,...: the first N layers), PEER_REPS (3), PEER_TG
(128), PEER_PP (512), PEER_THREADS (physical cores), PEER_WORK (/tmp/peer), PEER_JOBS (CPUs), PEER_BUDGET_S (570: the
whole call), PEER_BUILD_MAX_S (420: this call's build slice), PEER_N_CPU_MOE (override, e.g. mixtral=21,qwen3=35 or
gpt-oss-20b=<moeserve's N>), PEER_CUDA_FA (ON), PEER_CPU_ONLY (0), PEER_LLAMA_SRC (.peer/llama.cpp), OUT (<work
dir>/out).
"""

from __future__ import annotations

import glob
import json
import os
import shutil
import signal
import subprocess
import sys
import tarfile
import time
from dataclasses import dataclass
from pathlib import Path

HERE = Path(__file__).resolve().parent
REPO = HERE.parent.parent
sys.path[:0] = [str(HERE), str(HERE.parent), str(REPO)]
import make_gguf  # noqa: E402
from common import cpu_name, git_state  # noqa: E402
from offload import model_spec  # noqa: E402

from moeserve.plan.footprint import WORKSPACE_SHARE, dense_bytes, expert_bytes, kv_cache_bytes  # noqa: E402

GiB = 1 << 30
T0 = time.time()
TINY_BUDGET = "tiny shape: half its layers' experts on the CPU"
# GPU budgets of shapes bench/hybrid.py does not have (yet); its own budget wins once it has the shape (same name).
# gpt-oss-20b: 8 GiB, a consumer card, as qwen3's: 11.3 GiB of GGUF of which 9.5 GiB MXFP4 experts (0.39 GiB a
# layer) and 1.8 GiB Q8_0/F32 dense, so llama.cpp's rule keeps 14 of 24 layers' experts resident (N = 10)
PEER_BUDGETS = {"gpt-oss-20b": 8 * GiB}


class Stop(Exception):
    """Ends the call early with an exit status (2: setup failed, 3: out of time, run the same command again)."""

    def __init__(self, message: str, status: int):
        super().__init__(message)
        self.status = status


def log(message: str) -> None:
    print(f"[peer {time.time() - T0:4.0f}s] {message}", flush=True)


@dataclass
class Config:
    """The knobs, from the environment."""

    shapes: list[str]
    reps: int
    tg: int
    pp: int
    threads: int
    work: Path
    out: Path
    jobs: int
    budget_s: float
    build_max_s: float
    n_cpu_moe: dict[str, int]
    layers: dict[str, int]  # shape -> its first N layers (PEER_LAYERS; default every layer)
    cuda_fa: str
    cpu_only: bool
    llama_src: Path

    @classmethod
    def from_env(cls, physical_cores: int) -> "Config":
        e = os.environ.get
        work = Path(e("PEER_WORK", "/tmp/peer"))
        overrides = dict(kv.split("=") for kv in e("PEER_N_CPU_MOE", "").split(",") if kv)
        layers = dict(kv.split("=") for kv in e("PEER_LAYERS", "").split(",") if kv)
        return cls(shapes=e("PEER_SHAPES", "mixtral,qwen3").split(","), reps=int(e("PEER_REPS", "3")),
                   tg=int(e("PEER_TG", "128")), pp=int(e("PEER_PP", "512")),
                   threads=int(e("PEER_THREADS", str(physical_cores))), work=work,
                   out=Path(e("OUT") or work / "out"), jobs=int(e("PEER_JOBS", str(os.cpu_count() or 1))),
                   budget_s=float(e("PEER_BUDGET_S", "570")), build_max_s=float(e("PEER_BUILD_MAX_S", "420")),
                   n_cpu_moe={k: int(v) for k, v in overrides.items()},
                   layers={k: int(v) for k, v in layers.items()}, cuda_fa=e("PEER_CUDA_FA", "ON"),
                   cpu_only=e("PEER_CPU_ONLY", "0") == "1",
                   llama_src=Path(e("PEER_LLAMA_SRC", str(REPO / ".peer" / "llama.cpp"))))

    def depth(self, shape: str) -> int:
        """The layers of the shape's GGUF: PEER_LAYERS' N, else its full depth."""
        return self.layers.get(shape, make_gguf.SHAPES[shape].layers)

    def left(self) -> float:
        return self.budget_s - (time.time() - T0)

    @property
    def build_dir(self) -> Path:
        return self.work / ("build-cpu" if self.cpu_only else "build-cuda")

    @property
    def results_dir(self) -> Path:
        """Finished runs of this build kind, kept for the next call."""
        return self.work / ("results-cpu" if self.cpu_only else "results-cuda")


def import_hybrid():
    """bench/hybrid.py (shapes, budgets, the hybrid column's rule), leaving OMP_WAIT_POLICY as the caller set it: the
    module sets a default for torch's OpenMP, and llama-bench's OpenMP threads must run as the caller's environment
    says."""
    before = os.environ.get("OMP_WAIT_POLICY")
    import hybrid

    if before is None:
        os.environ.pop("OMP_WAIT_POLICY", None)
    return hybrid


# ---- machine, source, build ---------------------------------------------------------------------------------------


def shell(cmd: str) -> str:
    """A shell command's stdout ('' where it is missing or fails)."""
    try:
        return subprocess.run(cmd, shell=True, capture_output=True, text=True, timeout=60).stdout.strip()
    except (OSError, subprocess.SubprocessError):
        return ""


def machine_info(cfg: Config) -> dict:
    """GPU, CPU, commits and tool versions; the raw command outputs go to $OUT/env.txt."""
    commands = ["date -u", "uname -a", "nproc", "free -g | head -2", f"df -h {cfg.work} | tail -1",
                "lscpu | grep -E 'Model name|Socket|Thread|Core|NUMA node\\(s\\)|L3'",
                "grep -o -w 'avx2\\|avx512f\\|avx512_vnni\\|amx_int8' /proc/cpuinfo | sort | uniq -c",
                "nvidia-smi --query-gpu=name,memory.total,driver_version --format=csv", "nvcc --version | tail -2",
                "cmake --version | head -1", "ninja --version"]
    (cfg.out / "env.txt").write_text("".join(f"$ {c}\n{shell(c + ' 2>&1')}\n" for c in commands))
    return {"gpu": shell("nvidia-smi --query-gpu=name --format=csv,noheader | head -1") or None, "cpu": cpu_name(),
            "threads": cfg.threads, "llama_cpp_commit": llama_commit(cfg), "moeserve_git": git_state()}


def llama_commit(cfg: Config) -> str:
    """The llama.cpp source's commit (8 digits), as the kit records it in PEER_COMMIT."""
    path = cfg.llama_src / "PEER_COMMIT"
    return path.read_text().strip()[:8] if path.exists() else "unknown"


def find_nvcc() -> None:
    """Put a CUDA toolkit's nvcc on PATH when it is not there yet."""
    if shutil.which("nvcc"):
        return
    for d in sorted(glob.glob("/usr/local/cuda/bin") + glob.glob("/usr/local/cuda-*/bin")):
        if os.access(f"{d}/nvcc", os.X_OK):
            os.environ["PATH"] = f"{d}:{os.environ['PATH']}"
            return
    raise Stop("nvcc not found (PEER_CPU_ONLY=1 builds for the CPU only)", 2)


def copy_source(cfg: Config) -> Path:
    """The llama.cpp source copied into the work dir once (the carried .peer may be read-only)."""
    src = cfg.work / "src"
    if not (src / ".peer_copied").exists():
        shutil.rmtree(src, ignore_errors=True)
        shutil.copytree(cfg.llama_src, src, ignore=shutil.ignore_patterns("build"))
        (src / ".peer_copied").touch()
    return src


def configure(cfg: Config, src: Path) -> None:
    """cmake once per work dir: Release, native CPU, llama-bench's dependencies only; CUDA for sm_90."""
    if (cfg.build_dir / "build.ninja").exists():
        return
    opts = ["-G", "Ninja", "-DCMAKE_BUILD_TYPE=Release", "-DGGML_NATIVE=ON", "-DLLAMA_OPENSSL=OFF",
            "-DLLAMA_BUILD_TESTS=OFF", "-DLLAMA_BUILD_EXAMPLES=OFF", "-DLLAMA_BUILD_SERVER=OFF",
            "-DLLAMA_BUILD_APP=OFF", f"-DLLAMA_BUILD_COMMIT={llama_commit(cfg)}", "-DLLAMA_BUILD_NUMBER=0"]
    opts += ["-DGGML_CUDA=OFF"] if cfg.cpu_only else [
        "-DGGML_CUDA=ON", "-DCMAKE_CUDA_ARCHITECTURES=90-real", f"-DGGML_CUDA_FA={cfg.cuda_fa}",
        "-DGGML_CUDA_FA_QUANTS=f16-f16", "-DGGML_CUDA_NCCL=OFF"]
    log(f"cmake configure -> {cfg.build_dir}")
    t = time.time()
    for extra in ([], ["-DCMAKE_CUDA_FLAGS=-allow-unsupported-compiler"]):
        shutil.rmtree(cfg.build_dir, ignore_errors=True)
        res = subprocess.run(["cmake", "-S", str(src), "-B", str(cfg.build_dir), *opts, *extra],
                             capture_output=True, text=True)
        (cfg.out / "cmake.log").write_text(res.stdout + res.stderr)
        if res.returncode == 0 or cfg.cpu_only or "unsupported" not in res.stdout + res.stderr:
            break
        log("nvcc rejects the host compiler; configuring again with -allow-unsupported-compiler")
    if res.returncode != 0:
        raise Stop(f"cmake configure failed:\n{(res.stdout + res.stderr)[-3000:]}", 2)
    (cfg.work / "configure_seconds").write_text(f"{time.time() - t:.0f}\n")


def run_group(cmd: list[str], timeout: float, tick=None, **kwargs) -> tuple[int, float]:
    """Run a command in its own process group, killing the group at the timeout, calling tick() every 30 s while it
    runs (progress lines); (exit status or 124, seconds)."""
    t = time.time()
    proc = subprocess.Popen(cmd, start_new_session=True, **kwargs)
    while time.time() - t < timeout:
        try:
            return proc.wait(timeout=min(30, max(timeout - (time.time() - t), 0.1))), time.time() - t
        except subprocess.TimeoutExpired:
            if tick:
                tick()
    os.killpg(proc.pid, signal.SIGKILL)
    proc.wait()
    return 124, time.time() - t


def last_line(path: Path) -> str:
    """The last line of a log (the progress of a build or a GGUF writer)."""
    lines = path.read_text(errors="replace").strip().splitlines() if path.exists() else []
    return lines[-1] if lines else ""


def build(cfg: Config) -> Path:
    """llama-bench, built (or resumed) within this call's build slice; Stop(3) when the slice ran out."""
    configure(cfg, copy_source(cfg))
    lb = cfg.build_dir / "bin" / "llama-bench"
    slice_s = max(min(cfg.build_max_s, cfg.left() - 60), 10)
    log(f"ninja -j{cfg.jobs} llama-bench (slice {slice_s:.0f}s)")

    def tick():
        writers = "; ".join(last_line(p) for p in sorted(cfg.out.glob("make_gguf-*.log")))
        log(f"build {last_line(cfg.out / 'build.log')[:70]}" + (f" | {writers}" if writers else ""))

    with open(cfg.out / "build.log", "a") as f:
        rc, dt = run_group(["ninja", "-C", str(cfg.build_dir), f"-j{cfg.jobs}", "llama-bench"], slice_s, tick,
                           stdout=f, stderr=subprocess.STDOUT)
    total = float((cfg.work / "build_seconds").read_text() if (cfg.work / "build_seconds").exists() else 0) + dt
    (cfg.work / "build_seconds").write_text(f"{total:.0f}\n")
    log(f"build {dt:.0f}s this call, {total:.0f}s over all calls, exit {rc}")
    if rc == 124:
        raise Stop("BUILD INCOMPLETE (time slice used up): run the same command again to resume it", 3)
    if rc != 0 or not lb.exists():
        raise Stop(f"BUILD FAILED, see {cfg.out / 'build.log'}", 2)
    return lb


# ---- models and placements ----------------------------------------------------------------------------------------


def gguf_path(cfg: Config, shape: str) -> Path:
    d = make_gguf.SHAPES[shape]
    depth = "" if cfg.depth(shape) == d.layers else f"-{cfg.depth(shape)}L"
    return cfg.work / f"{shape}{depth}-{d.experts_type}.gguf"


def start_ggufs(cfg: Config) -> dict[str, subprocess.Popen]:
    """Writers (background, niced) of the GGUFs that are missing or of another size; checks the disk first."""
    todo = {}
    for shape in cfg.shapes:
        path, size = gguf_path(cfg, shape), make_gguf.file_size(*make_gguf.plan(shape, cfg.depth(shape)))
        if path.exists() and path.stat().st_size == size:
            log(f"{path.name}: reused ({size / GiB:.2f} GiB)")
        else:
            todo[shape] = size
    need, free = sum(todo.values()), shutil.disk_usage(cfg.work).free
    if need + GiB > free:
        raise Stop(f"{need / GiB:.1f} GiB of GGUFs need more than the {free / GiB:.1f} GiB free in {cfg.work} "
                   f"(PEER_SHAPES=one shape at a time, or another PEER_WORK)", 2)
    procs = {}
    for shape, size in todo.items():
        log(f"writing {gguf_path(cfg, shape).name} ({size / GiB:.2f} GiB) in the background")
        cmd = ["nice", sys.executable, str(HERE / "make_gguf.py"), "--dims", shape, "--layers", str(cfg.depth(shape)),
               "-o", str(gguf_path(cfg, shape))]
        procs[shape] = subprocess.Popen(cmd, stdout=open(cfg.out / f"make_gguf-{shape}.log", "w"),
                                        stderr=subprocess.STDOUT, start_new_session=True)
    return procs


def wait_ggufs(cfg: Config, procs: dict[str, subprocess.Popen]) -> list[str]:
    """Wait for the writers within the budget (stopping those still running); the shapes whose GGUF is ready."""
    for shape, proc in procs.items():
        log_path = cfg.out / f"make_gguf-{shape}.log"
        while proc.poll() is None and cfg.left() > 30:
            log(f"waiting for {gguf_path(cfg, shape).name}: {last_line(log_path)}")
            try:
                proc.wait(timeout=min(30, cfg.left() - 30))
            except subprocess.TimeoutExpired:
                pass
        if proc.poll() is None:
            os.killpg(proc.pid, signal.SIGKILL)
            proc.wait()
        log(f"{gguf_path(cfg, shape).name}: writer exit {proc.returncode} ({last_line(log_path)})")
    return [s for s in cfg.shapes if gguf_path(cfg, s).exists()]


def fewest_cpu_layers(budget: int, fixed: int, layer_experts: int, layers: int, share: float) -> int:
    """bench/hybrid.py's hybrid rule: the layers left on the CPU when as many layers' experts as fit the budget's room
    (budget * (1 - share) - fixed bytes) are resident."""
    room = int(budget * (1 - share)) - fixed
    return layers - min(max(room // layer_experts, 0), layers)


def llama_cpu_layers(cfg: Config, shape: str, budget: int, share: float) -> tuple[int, str]:
    """N and its derivation in llama.cpp's bytes: the GGUF's non-expert tensors, f16 KV for pp+tg tokens, a layer's
    expert tensors."""
    d, layers = make_gguf.SHAPES[shape], cfg.depth(shape)
    specs = make_gguf.plan(shape, layers)[1]
    dense = sum(t.nbytes for t in specs if not make_gguf.is_expert(t.name))
    layer = sum(t.nbytes for t in specs if t.name.startswith("blk.0.") and make_gguf.is_expert(t.name))
    kv = 2 * layers * d.kv_heads * d.head_dim * 2 * (cfg.pp + cfg.tg)  # every layer full (an upper bound for SWA)
    n = fewest_cpu_layers(budget, dense + kv, layer, layers, share)
    return n, (f"{budget / GiB:.2f} GiB x {1 - share:.2f} - dense {dense / GiB:.2f} GiB (Q8_0/F32) - KV "
               f"{kv / GiB:.3f} GiB (f16, {cfg.pp + cfg.tg} tokens) = {(budget * (1 - share) - dense - kv) / GiB:.2f} "
               f"GiB for experts at {layer / GiB:.3f} GiB a layer ({d.experts_type.upper()}): {layers - n} "
               f"resident, N = {n}")


def hybrid_budget(cfg: Config, hybrid, shape: str) -> int:
    """bench/hybrid.py's GPU budget of the shape at the GGUF's depth (budget_at: the same share of MoE layers
    resident as at full depth)."""
    full, budget = hybrid.SHAPES[shape][0], hybrid.SHAPES[shape][1]
    if cfg.depth(shape) == full["num_layers"]:
        return budget
    spec = model_spec(hybrid.shape_at(full, cfg.depth(shape)))
    return hybrid.budget_at(model_spec(full), spec, budget, cfg.pp + cfg.tg, 2)


def moeserve_cpu_layers(cfg: Config, hybrid, shape: str) -> tuple[int, str]:
    """N of bench/hybrid.py's hybrid column (its own functions, moeserve's bytes) and its derivation."""
    spec = model_spec(hybrid.shape_at(hybrid.SHAPES[shape][0], cfg.depth(shape)))
    budget = hybrid_budget(cfg, hybrid, shape)
    dense, kv = dense_bytes(spec, 2), kv_cache_bytes(spec, 1, cfg.pp + cfg.tg, 2)
    precision = hybrid.expert_precision_of(spec)
    experts = expert_bytes(spec, precision)
    room = int(budget * (1 - WORKSPACE_SHARE)) - dense - kv
    bits = 16 if precision.kind == "mxfp4" else hybrid.BITS
    n = len(hybrid.placement_of("hybrid", spec, room, experts, cfg.threads, bits=bits).cpu_layers)
    what = "MXFP4" if bits == 16 else f"{hybrid.BITS}-bit, group {hybrid.GROUP}"
    return n, (f"{budget / GiB:.2f} GiB x {1 - WORKSPACE_SHARE:.2f} - dense {dense / GiB:.2f} GiB (bf16) - KV "
               f"{kv / GiB:.3f} GiB (bf16) = {room / GiB:.2f} GiB for experts at "
               f"{spec.moe.num_experts * experts / GiB:.3f} GiB a layer ({what}): "
               f"{len(spec.moe.layer_indices()) - n} resident, N = {n}")


def placements(cfg: Config, hybrid, shape: str) -> dict[str, tuple[int, str]]:
    """column -> (--n-cpu-moe N, how N was derived) for the shape's hybrid columns."""
    if shape in cfg.n_cpu_moe:
        return {"hybrid": (cfg.n_cpu_moe[shape], "PEER_N_CPU_MOE")}
    if shape not in hybrid.SHAPES and shape in PEER_BUDGETS:  # llama.cpp's rule only: no moeserve N to compare
        n, why = llama_cpu_layers(cfg, shape, PEER_BUDGETS[shape], WORKSPACE_SHARE)
        why += f" (run.py's PEER_BUDGETS: bench/hybrid.py has no {shape} shape; PEER_N_CPU_MOE={shape}=N sets N)"
        return {"hybrid": (n, why)}
    if shape not in hybrid.SHAPES:
        return {"hybrid": (make_gguf.SHAPES[shape].layers // 2, TINY_BUDGET)}
    out = {"hybrid": llama_cpu_layers(cfg, shape, hybrid_budget(cfg, hybrid, shape), WORKSPACE_SHARE)}
    ours = moeserve_cpu_layers(cfg, hybrid, shape)
    if ours[0] != out["hybrid"][0]:
        out["hybrid-moeserve"] = ours
    else:
        out["hybrid"] = (out["hybrid"][0], out["hybrid"][1] + "; bench/hybrid.py's rule gives the same N")
    return out


# ---- runs ---------------------------------------------------------------------------------------------------------


class GPUMemory:
    """Peak GPU memory used (MiB) while a run goes, sampled by nvidia-smi every 100 ms (None without it)."""

    def __init__(self, path: Path):
        self.path, self.proc = path, None

    def __enter__(self):
        if shutil.which("nvidia-smi"):
            self.proc = subprocess.Popen(["nvidia-smi", "--query-gpu=memory.used", "--format=csv,noheader,nounits",
                                          "-lms", "100"], stdout=open(self.path, "w"), stderr=subprocess.DEVNULL)
        return self

    def __exit__(self, *exc):
        if self.proc:
            self.proc.terminate()
            self.proc.wait()

    def peak(self) -> int | None:
        values = [int(x) for x in self.path.read_text().split() if x.isdigit()] if self.proc else []
        return max(values) if values else None


def label_of(row: dict) -> str:
    """A llama-bench row's test as llama-bench names it: pp512, tg128."""
    return f"pp{row['n_prompt']}" if row["n_prompt"] else f"tg{row['n_gen']}"


def run_bench(cfg: Config, lb: Path, shape: str, column: str, args: list[str]) -> tuple[list[dict], str]:
    """One llama-bench call, pp and tg on one model load (reused when a previous call finished it): its JSON rows,
    tagged and also written to $OUT/<run>.json, and "ran", "reused", "failed" or "skipped" (out of time)."""
    tag = "".join(args).strip("-").replace("=", "-")
    layers, full = cfg.depth(shape), make_gguf.SHAPES[shape].layers
    name = f"{shape}{'' if layers == full else f'-{layers}L'}_{column}_{tag}_pp{cfg.pp}_tg{cfg.tg}_t{cfg.threads}_r{cfg.reps}"
    done = cfg.results_dir / f"{name}.json"
    if done.exists():
        log(f"{name}: done before, reused")
        shutil.copyfile(done, cfg.out / done.name)
        return json.loads(done.read_text()), "reused"
    if cfg.left() < 60:
        log(f"{name}: SKIPPED, {cfg.left():.0f}s of budget left")
        return [], "skipped"
    cmd = [str(lb), "-m", str(gguf_path(cfg, shape)), "-t", str(cfg.threads), "-r", str(cfg.reps), "-ngl", "99",
           *args, "-p", str(cfg.pp), "-n", str(cfg.tg), "-o", "json"]
    log(f"{name}: {' '.join(cmd[1:])}")
    part = cfg.out / f"{name}.json.part"
    with open(part, "w") as out, open(cfg.out / f"{name}.log", "w") as err, GPUMemory(cfg.out / f"{name}.mem") as mem:
        rc, dt = run_group(cmd, cfg.left() - 15, stdout=out, stderr=err)
    if rc == 124:
        log(f"{name}: CUT OFF at the end of the time budget")
        part.unlink()
        return [], "skipped"
    try:
        rows = json.loads(part.read_text()) if rc == 0 else None
    except json.JSONDecodeError:
        rows = None
    if not rows:
        log(f"{name}: FAILED (exit {rc}), see {cfg.out / (name + '.log')}")
        return [], "failed"
    for r in rows:
        r.update(peer_shape=shape, peer_column=column, peer_gpu_mem_peak_mib=mem.peak(), peer_seconds=round(dt, 1),
                 peer_layers=layers, peer_full_layers=full)
        if layers != full:  # bench/hybrid.py's scaling: a token's time per layer as measured, times the full depth
            r.update(peer_depth=f"scaled from {layers} of {full} layers",
                     peer_avg_ts_full_depth=r["avg_ts"] * layers / full)
    done.parent.mkdir(parents=True, exist_ok=True)
    done.write_text(json.dumps(rows, indent=1))
    shutil.copyfile(done, cfg.out / done.name)
    part.unlink()
    speeds = ", ".join(f"{label_of(r)} {r['avg_ts']:.2f} +/- {r['stddev_ts']:.2f}" for r in rows)
    log(f"{name}: {speeds} tok/s ({dt:.0f}s, GPU peak {mem.peak()} MiB)")
    return rows, "ran"


def run_all(cfg: Config, lb: Path, shapes: list[str], columns: dict[str, dict[str, tuple[int, str]]]):
    """Per shape the hybrid columns, then cpu: (llama-bench rows, {status: calls})."""
    results, statuses = [], {}
    for shape in shapes:
        runs = [(c, ["--n-cpu-moe", str(n)]) for c, (n, _) in columns[shape].items()] + [("cpu", ["-ot", "exps=CPU"])]
        for column, args in runs:
            rows, status = run_bench(cfg, lb, shape, column, args)
            results += rows
            statuses[status] = statuses.get(status, 0) + 1
    return results, statuses


# ---- summary ------------------------------------------------------------------------------------------------------


def moeserve_result(hybrid_results: Path) -> tuple[str, dict] | None:
    """The newest non-quick bench/hybrid.py result: (its file name and tests, {shape: {column: row}})."""
    files = sorted(p for p in hybrid_results.glob("hybrid-*.json") if "quick" not in p.name)
    if not files:
        return None
    record = json.loads(files[-1].read_text())
    c = record["config"]
    return (f"{files[-1].name} (tg{c['new_tokens']}, pp{c['prefill']}, {c['cpu_threads']} threads)",
            {s: {r["column"]: r for r in v["rows"]} for s, v in record["shapes"].items()})


def summarize(cfg: Config, info: dict, columns: dict, results: list[dict]) -> str:
    """summary.md (table, placements, machine) and summary.json in $OUT; returns the markdown."""
    ours = moeserve_result(REPO / "bench" / "results")
    lines = ["| shape | column | --n-cpu-moe | test | tok/s | +/- | reps | GPU peak MiB | moeserve tok/s (its N) | "
             "full-depth tok/s |", "|---|---|---:|---|---:|---:|---:|---:|---:|---:|"]
    for r in sorted(results, key=lambda r: (cfg.shapes.index(r["peer_shape"]), r["n_prompt"] > 0)):  # tg, then pp
        test = label_of(r)
        n = "all" if r["peer_column"] == "cpu" else r["n_cpu_moe"]
        theirs = ours[1].get(r["peer_shape"], {}).get(r["peer_column"].replace("-moeserve", "")) if ours else None
        key = "tg_tokens_per_s" if test.startswith("tg") else "pp_tokens_per_s"
        ref = f"{theirs[key]:.2f} ({theirs['cpu_layers']})" if theirs and key in theirs else "-"
        full = (f"{r['peer_avg_ts_full_depth']:.2f} ({r['peer_depth']})" if r.get("peer_depth") else "-")
        lines.append(f"| {r['peer_shape']} | {r['peer_column']} | {n} | {test} | {r['avg_ts']:.2f} | "
                     f"{r['stddev_ts']:.2f} | {len(r['samples_ts'])} | {r['peer_gpu_mem_peak_mib'] or '-'} | {ref} | "
                     f"{full} |")
    lines += ["", "--n-cpu-moe N per shape (budget x (1 - workspace share) - dense - KV, then whole layers' experts):"]
    lines += [f"- {s} {c}: {why}" for s, cols in columns.items() for c, (_, why) in cols.items()]
    first = results[0] if results else {}
    lines += ["", f"GPU: {info['gpu']} ({first.get('gpu_info', '-')}); CPU: {info['cpu']}; threads {cfg.threads}; "
              f"reps {cfg.reps}; flash_attn {first.get('flash_attn', '-')}; llama.cpp {info['llama_cpp_commit']} "
              f"(build {first.get('build_commit', '-')}); moeserve {info['moeserve_git']['commit']}",
              f"moeserve figures: bench/results/{ours[0]}" if ours else "moeserve figures: no bench/hybrid.py result"]
    text = "\n".join(lines) + "\n"
    (cfg.out / "summary.md").write_text(text)
    summary = {"name": "peer-llamacpp-hybrid", "date": time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime()),
               "device": info["gpu"] or info["cpu"], "device_type": "cpu" if cfg.cpu_only else "cuda",
               "cpu": info["cpu"], "git": info["moeserve_git"], "llama_cpp_commit": info["llama_cpp_commit"],
               "config": {k: str(v) if isinstance(v, Path) else v for k, v in vars(cfg).items()},
               "placements": {s: {c: {"n_cpu_moe": n, "derivation": why} for c, (n, why) in cols.items()}
                              for s, cols in columns.items()},
               "moeserve_reference": ours[0] if ours else None, "runs": results}
    (cfg.out / "summary.json").write_text(json.dumps(summary, indent=1) + "\n")
    return text


KEPT = ("summary.md", "summary.json", "env.txt", "details.tar.gz")  # what stays loose in $OUT


def pack_details(cfg: Config) -> None:
    """Every other file in $OUT (each run's llama-bench JSON, log and memory samples, the build and writer logs) into
    details.tar.gz: the GPU machine hands back only a few files per call, so the summary must not be crowded out."""
    loose = sorted(f for f in cfg.out.iterdir() if f.is_file() and f.name not in KEPT)
    if not loose:
        return
    with tarfile.open(cfg.out / "details.tar.gz", "w:gz") as tar:
        for f in loose:
            tar.add(f, arcname=f.name)
    for f in loose:
        f.unlink()


def main() -> int:
    hybrid = import_hybrid()
    cfg = Config.from_env(len(hybrid.physical_cores()))
    cfg.work.mkdir(parents=True, exist_ok=True)
    cfg.out.mkdir(parents=True, exist_ok=True)
    procs = {}
    try:
        if not cfg.cpu_only:
            find_nvcc()  # on PATH before env.txt records its version
        info = machine_info(cfg)
        log(f"GPU {info['gpu']}, CPU {info['cpu']}, {cfg.threads} threads, llama.cpp {info['llama_cpp_commit']}, "
            f"moeserve {info['moeserve_git']['commit']}; shapes {','.join(cfg.shapes)}, reps {cfg.reps}, "
            f"tg{cfg.tg} pp{cfg.pp}, work {cfg.work}, out {cfg.out}")
        columns = {s: placements(cfg, hybrid, s) for s in cfg.shapes}
        for shape, cols in columns.items():
            for column, (n, why) in cols.items():
                log(f"{shape} {column}: --n-cpu-moe {n} ({why})")
        procs = start_ggufs(cfg)
        lb = build(cfg)
    except Stop as stop:
        wait_ggufs(cfg, procs)
        log(str(stop))
        return stop.status
    shapes = wait_ggufs(cfg, procs)
    results, statuses = run_all(cfg, lb, shapes, columns)
    print("\n" + summarize(cfg, info, columns, results), flush=True)
    pack_details(cfg)
    unwritten = len(cfg.shapes) - len(shapes)
    log(f"runs {statuses}, GGUFs not written {unwritten}; results in {cfg.out}")
    if statuses.get("failed"):
        log("FAILED: see the runs' logs in $OUT")
        return 1
    if statuses.get("skipped") or unwritten:
        log("INCOMPLETE: run the same command again to finish")
        return 3
    log("COMPLETE")
    return 0


if __name__ == "__main__":
    sys.exit(main())
